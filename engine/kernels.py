"""Numba kernels for the engine's per-layer glue: RMS norm and rotary embedding.

As torch ops these cost ~15-20 us each on this machine for a decode step's tiny tensors
(a norm is 5-7 ops, a rotary 8-10), more than the GEMM they surround; one Numba call
each does the same arithmetic in fp32, 16 lanes at a time. Small inputs run on the
calling thread (a parallel region costs ~5 us to start); large ones over rows with
``prange``.
"""

import math

from numba import prange

from numkern import _check as C
from numkern._jit import jit
from numkern.simd import (
    store_f32,
    to_f32,
    vadd,
    vfma,
    vload,
    vmul,
    vsplat,
    vstore,
    vsub,
    vsum,
    vzero,
)

PARALLEL_ROWS = 64  # below this many rows the work stays on the calling thread


@jit
def _norm_rows(x, w, out, r0, r1, n, eps):
    nv = n - n % 16  # 16 lanes at a time, then a scalar tail
    for r in range(r0, r1):
        o = r * n
        acc = vzero()
        for i in range(0, nv, 16):
            v = vload(x, o + i)
            acc = vfma(v, v, acc)
        s = vsum(acc)
        for i in range(nv, n):
            v = to_f32(x, o + i)
            s += v * v
        inv = 1.0 / math.sqrt(s / n + eps)
        iv = vsplat(inv)
        for i in range(0, nv, 16):
            vstore(out, o + i, vmul(vmul(vload(x, o + i), iv), vload(w, i)))
        for i in range(nv, n):
            store_f32(out, o + i, to_f32(x, o + i) * inv * w[i])


@jit(parallel=True)
def _rms_norm(x, w, out, rows, n, eps):
    if rows < PARALLEL_ROWS:
        _norm_rows(x, w, out, 0, rows, n, eps)
    else:
        for r in prange(rows):
            _norm_rows(x, w, out, r, r + 1, n, eps)


def rms_norm(x, weight, eps):
    """``x [..., n]`` (contiguous) normalised over its last dim, times ``weight`` fp32 [n]."""
    out = x.new_empty(x.shape)
    n = x.shape[-1]
    _rms_norm(C.as_numpy(x).reshape(-1), weight, C.as_numpy(out).reshape(-1), x.numel() // n,
              n, float(eps))  # fmt: skip
    return out


@jit
def _rope_rows(x, pos, cos, sin, t0, t1, heads, d, row):
    """Rows t0..t1 of ``x`` (row stride ``row``): rotate their first ``heads`` heads."""
    half = d // 2
    hv = half - half % 16  # 16 lanes at a time, then a scalar tail
    for t in range(t0, t1):
        p = pos[t]
        cr = cos[p]
        sr = sin[p]
        for h in range(heads):
            base = t * row + h * d
            for i in range(0, hv, 16):
                a = vload(x, base + i)
                b = vload(x, base + i + half)
                c = vload(cr, i)
                s = vload(sr, i)
                vstore(x, base + i, vsub(vmul(a, c), vmul(b, s)))
                vstore(x, base + i + half, vadd(vmul(b, c), vmul(a, s)))
            for i in range(hv, half):
                a = to_f32(x, base + i)
                b = to_f32(x, base + i + half)
                c = cr[i]
                s = sr[i]
                store_f32(x, base + i, a * c - b * s)
                store_f32(x, base + i + half, b * c + a * s)


@jit(parallel=True)
def _rope(x, pos, cos, sin, t_n, heads, d, row):
    if t_n < PARALLEL_ROWS:
        _rope_rows(x, pos, cos, sin, 0, t_n, heads, d, row)
    else:
        for t in prange(t_n):
            _rope_rows(x, pos, cos, sin, t, t + 1, heads, d, row)


def rope_(x, positions, cos, sin):
    """Rotate ``x [T, H, D]`` (contiguous) in place, rotate-half form; ``cos``/``sin``
    fp32 ``[P, D/2]`` NumPy tables, ``positions`` int64 NumPy ``[T]`` below P."""
    t_n, heads, d = x.shape
    _rope(C.as_numpy(x).reshape(-1), positions, cos, sin, t_n, heads, d, heads * d)
    return x
