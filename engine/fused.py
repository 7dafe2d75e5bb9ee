"""One Numba call per decoder layer: the engine's hot loop without Python or torch in it.

A decode step of a small model is ~20 kernel calls per layer (norms, GEMMs, rotary,
cache write, attention, activation, residual adds). Issued from Python each costs
10-30 us of wrapper, checking and tensor plumbing, and every torch op between two
Numba kernels lets torch's OpenMP pool spin on the cores Numba's pool needs. Here a
layer is one call of :func:`attn_block` (norm, qkv GEMM, q/k norms, rotary, cache
write, paged attention, o GEMM and residual, next norm) and, for dense layers,
:func:`mlp_block` (gate|up GEMM, SiLU·mul, down GEMM and residual). The kernels are
numkern's own (``gemm._linear``, ``attention._attention``/``_reshape_and_cache``) and
this package's norms and rotary; their inputs were validated once per step (the
attention plan and indices) or at load (weights), and the per-step workspaces are
allocated once per step and shared by all layers.

Rounding points are those of the op-by-op path (and HF): every op's output is rounded
to the model dtype. Only SiLU's exp differs (numkern's ``vexp`` vs torch's, ~2e-7
relative), so the two paths agree to 1e-5 in fp32 and to one bf16 unit in bf16.
"""

import numpy as np
from numba import prange

from numkern import attention as A
from numkern._jit import jit
from numkern.gemm import NB, _linear
from numkern.simd import store_f32, to_f32, vadd, vdiv, vexp, vload, vmul, vsplat, vstore

from .kernels import PARALLEL_ROWS, _norm_rows, _rms_norm, _rope


@jit
def _gemm(out, x, w, bias, has_bias, m, n, k):
    """out[m, n] = x[m, k] @ W.T (+ bias) for a packed W (16-bit as K pairs, or fp32)."""
    if w.itemsize == x.itemsize:  # fp32 rows of K
        _linear(out, n, x, k, w, k, 2 * NB, NB, bias, has_bias, m, n, k)
    else:
        _linear(out, n, x, k, w, k // 2, NB, 0, bias, has_bias, m, n, k)


@jit
def _add_rows(h, y, t0, t1, n):
    """h += y (rounded to h's dtype), rows t0..t1 of width n."""
    for i in range(t0 * n, t1 * n, 16):
        vstore(h, i, vadd(vload(h, i), vload(y, i)))


@jit(parallel=True)
def add(h, y, rows, n):
    if n % 16:
        for i in range(rows * n):
            store_f32(h, i, to_f32(h, i) + to_f32(y, i))
    elif rows < PARALLEL_ROWS:
        _add_rows(h, y, 0, rows, n)
    else:
        for r in prange(rows):
            _add_rows(h, y, r, r + 1, n)


@jit
def _silu_mul_rows(gu, act, t0, t1, inter):
    """act = silu(g) * u for gu rows [g | u], each op rounded as torch does in fp32."""
    one = vsplat(1.0)
    for t in range(t0, t1):
        for i in range(0, inter, 16):
            g = vload(gu, t * 2 * inter + i)
            u = vload(gu, t * 2 * inter + inter + i)
            s = vdiv(g, vadd(one, vexp(vmul(g, vsplat(-1.0)))))
            vstore(act, t * inter + i, vmul(s, u))


@jit(parallel=True)
def _silu_mul(gu, act, rows, inter):
    if rows < PARALLEL_ROWS:
        _silu_mul_rows(gu, act, 0, rows, inter)
    else:
        for r in prange(rows):
            _silu_mul_rows(gu, act, r, r + 1, inter)


@jit
def attn_block(h, x, qkv, att, tmp, t_n, hid, ln1, ln2, eps, w_qkv, b_qkv, has_b_qkv, w_o,
               b_o, has_b_o, qn, kn, has_qk_norm, hq, hkv, d, pos, cos, sin, kw, vw, wb_s,
               wh_s, kr, vr, rb_s, rh_s, slots, qsl, seq_lens, bt, items, merges, part_m,
               part_l, part_acc, scale, causal, window, softcap, sinks, has_sinks, b, v_cs,
               amx):  # fmt: skip
    """``h += o(attention(rope(norm(h) @ Wqkv)))``; then ``x = ln2(h)``.

    ``h``/``x [T, hid]``, ``qkv [T, (hq + 2 hkv) d]``, ``att``/``tmp`` workspaces of the
    step; ``kw``/``vw`` the cache's element views (writes), ``kr``/``vr`` its read
    carriers (``amx``: bf16 pairs); the rest as ``paged_attention`` and ``_launch``.
    """
    nq = hq * d
    nqkv = (hq + 2 * hkv) * d
    _rms_norm(h, ln1, x, t_n, hid, eps)
    _gemm(qkv, x, w_qkv, b_qkv, has_b_qkv, t_n, nqkv, hid)
    if has_qk_norm:  # per-head RMS norm of q and k (Qwen3), in place
        for t in range(t_n):
            for hh in range(hq):
                o = t * nqkv + hh * d
                _norm_rows(qkv[o : o + d], qn, qkv[o : o + d], 0, 1, d, eps)
            for hh in range(hkv):
                o = t * nqkv + nq + hh * d
                _norm_rows(qkv[o : o + d], kn, qkv[o : o + d], 0, 1, d, eps)
    _rope(qkv, pos, cos, sin, t_n, hq + hkv, d, nqkv)  # q and k heads are adjacent
    # cache write of k, v straight from the qkv rows (row stride nqkv)
    A._reshape_and_cache(qkv[nq:], qkv[nq + hkv * d :], kw, vw, slots, t_n, hkv, d, b, nqkv,
                         d, nqkv, d, wb_s, wh_s, wb_s, wh_s, amx)  # fmt: skip
    alibi = np.zeros(0, np.float32)
    A._attention(qkv, kr, vr, att, qsl, seq_lens, bt, items, merges, part_m, part_l, part_acc,
                 scale, causal, window, softcap, alibi, False, sinks, has_sinks, hq, hkv, d, b,
                 nqkv, d, nq, d, rb_s, rh_s, rb_s, rh_s, v_cs, amx)  # fmt: skip
    _gemm(tmp, att, w_o, b_o, has_b_o, t_n, hid, nq)
    add(h, tmp, t_n, hid)
    _rms_norm(h, ln2, x, t_n, hid, eps)


@jit
def mlp_block(h, x, gu, act, tmp, t_n, hid, inter, w_gu, w_down):
    """``h += down(silu(gate(x)) * up(x))`` with gate|up one packed GEMM."""
    empty = np.zeros(0, np.float32)
    _gemm(gu, x, w_gu, empty, False, t_n, 2 * inter, hid)
    _silu_mul(gu, act, t_n, inter)
    _gemm(tmp, act, w_down, empty, False, t_n, hid, inter)
    add(h, tmp, t_n, hid)
