"""Rotary position embedding, in place on query and key, with vLLM's CPU op argument list.

``rotary_embedding(positions, query, key, head_size, cos_sin_cache, is_neox) -> None``

* ``positions [T]`` int64, contiguous; each in ``[0, P)``.
* ``query``: ``[T, Hq * head_size]`` or ``[T, Hq, head_size]``, bf16/fp16/fp32,
  ``stride(-1) == 1``, heads packed (3-D: ``stride(1) == head_size``); the rows may be
  strided (e.g. the q columns of a fused qkv buffer).
* ``key``: None, or like ``query`` with its own head count ``Hk`` and row stride,
  same dtype and T; no element in both (ValueError naming ``key``; the q and k column
  windows of one qkv buffer are fine).
* ``cos_sin_cache [P, rot_dim]`` contiguous, in query's dtype or fp32: ``cos`` in
  columns ``[0, rot_dim/2)``, ``sin`` in ``[rot_dim/2, rot_dim)``; ``rot_dim`` even and
  ``<= head_size`` (partial rotary: only the first ``rot_dim`` elements of each head
  rotate, the rest are left alone).
* ``is_neox``: True rotates halves — pairs ``(i, i + rot_dim/2)``; False rotates GPT-J
  interleaved pairs ``(2i, 2i+1)``. Pair ``j`` with ``c, s = cos[p, j], sin[p, j]``:
  ``(a, b) -> (a*c - b*s, b*c + a*s)``, fp32 math, one rounding to the dtype.

vLLM 0.32's schema adds ``rope_dim_offset=0`` and ``inverse=False``; its CPU op rejects
any other value, so they are not offered here. vLLM's CPU op also needs the cache in
the query's dtype and a 2-D query; this one takes either.

Kernel: the rotate-half form runs 16 pairs at a time (``numkern.simd``) and a scalar
tail; the GPT-J form is a scalar loop (its pairs are interleaved, and no model this
engine runs uses it). Few rows run on the calling thread, many over rows with
``prange``.

Row kernel for fused callers (``numkern.decoder``):
``_rows(x, pos, cos_sin, t0, t1, heads, head_size, rot_dim, row, is_neox)`` rotates the
first ``heads`` heads (head stride ``head_size``) of rows t0..t1 (row stride ``row``)
of the 1-D carrier array ``x`` in place; ``pos`` int64 ``[T]``; ``cos_sin`` a 2-D
C-contiguous ``[P, rot_dim]`` array of any carrier (uint16 bf16 bits, int16 fp16 bits,
float32).
"""

import numpy as np
import torch
from numba import prange

from . import _check as C
from ._jit import jit
from .norm import PARALLEL_ROWS  # below this many tokens: the calling thread only
from .simd import LANES, store_f32, to_f32, vadd, vload, vmul, vstore, vsub


@jit
def _pair(x, ia, ib, c, s):
    """Rotate the pair ``(x[ia], x[ib])`` by (c, s), fp32 math, one rounding each."""
    a = to_f32(x, ia)
    b = to_f32(x, ib)
    store_f32(x, ia, a * c - b * s)
    store_f32(x, ib, b * c + a * s)


@jit
def _rows(x, pos, cos_sin, t0, t1, heads, head_size, rot_dim, row, is_neox):
    """Rows t0..t1 of ``x`` (row stride ``row``): rotate their first ``heads`` heads."""
    half = rot_dim // 2
    hv = half - half % LANES  # rotate-half: 16 pairs at a time, then a scalar tail
    for t in range(t0, t1):
        cs = cos_sin[pos[t]]
        for h in range(heads):
            base = t * row + h * head_size
            if is_neox:
                for i in range(0, hv, LANES):
                    a = vload(x, base + i)
                    b = vload(x, base + i + half)
                    c = vload(cs, i)
                    s = vload(cs, half + i)
                    vstore(x, base + i, vsub(vmul(a, c), vmul(b, s)))
                    vstore(x, base + i + half, vadd(vmul(b, c), vmul(a, s)))
                for i in range(hv, half):
                    _pair(x, base + i, base + i + half, to_f32(cs, i), to_f32(cs, half + i))
            else:
                for i in range(half):
                    _pair(x, base + 2 * i, base + 2 * i + 1, to_f32(cs, i), to_f32(cs, half + i))


@jit(parallel=True)
def _rotary(q, q_row, hq, k, k_row, hk, pos, cos_sin, t_n, head_size, rot_dim, is_neox):
    """Query rows then key rows (``hk == 0``: no key; ``k`` is then empty)."""
    if t_n < PARALLEL_ROWS:
        _rows(q, pos, cos_sin, 0, t_n, hq, head_size, rot_dim, q_row, is_neox)
        _rows(k, pos, cos_sin, 0, t_n, hk, head_size, rot_dim, k_row, is_neox)
    else:
        for t in prange(t_n):
            i = np.int64(t)  # (int64 in and out of the parallel body: one signature)
            _rows(q, pos, cos_sin, i, i + 1, hq, head_size, rot_dim, q_row, is_neox)
            _rows(k, pos, cos_sin, i, i + 1, hk, head_size, rot_dim, k_row, is_neox)


# --- wrapper --------------------------------------------------------------------------


def _check_heads(name, x, dt, t_n, head_size):
    """(heads, row stride) of ``x``: ``[T, H * head_size]`` or ``[T, H, head_size]``."""
    if dt is None:
        dt = C.check_dtype(name, x, C.FLOATS)
    C.check_ndim(name, x, (2, 3))
    C.check_inner_contiguous(name, x)
    st = C.strides_of(x)
    if x.ndim == 3:
        C.check_shape(name, x, (t_n, None, head_size))
        heads = x.shape[1]
        if heads > 1 and st[1] != head_size:
            raise ValueError(
                f"{name}: expected packed heads (stride(1) == {head_size}), got strides {list(st)}"
            )
    else:
        C.check_shape(name, x, (t_n, None))
        if x.shape[1] % head_size:
            raise ValueError(
                f"{name}: expected a last dim that is a multiple of head_size {head_size}, "
                f"got shape {list(x.shape)}"
            )
        heads = x.shape[1] // head_size
    width = heads * head_size
    row = st[0] if t_n > 1 else width
    if row < width:
        raise ValueError(
            f"{name}: expected a row stride >= {width} (rows must not overlap), got "
            f"strides {list(st)}"
        )
    return dt, heads, row


def rotary_embedding(positions, query, key, head_size, cos_sin_cache, is_neox):
    """Rotate ``query`` and ``key`` (None: query only) in place by ``cos_sin_cache`` at
    ``positions``. See the module docstring for shapes and dtypes. Returns None.
    """
    if not isinstance(is_neox, (bool, np.bool_)):
        raise TypeError(f"is_neox: expected a bool, got {type(is_neox).__name__}")
    head_size = C.check_int("head_size", head_size, low=1)
    C.check_dtype("positions", positions, (torch.int64,))
    C.check_ndim("positions", positions, (1,))
    C.check_contiguous("positions", positions)
    t_n = positions.shape[0]
    dt, hq, q_row = _check_heads("query", query, None, t_n, head_size)
    if key is None:
        hk, k_row = 0, 0
    else:
        C.check_same_dtype("key", key, dt, "query")
        _, hk, k_row = _check_heads("key", key, dt, t_n, head_size)
        C.check_disjoint("key", key, "query", query)
    C.check_dtype("cos_sin_cache", cos_sin_cache, (dt, torch.float32))
    C.check_ndim("cos_sin_cache", cos_sin_cache, (2,))
    C.check_contiguous("cos_sin_cache", cos_sin_cache)
    n_pos, rot_dim = cos_sin_cache.shape
    if rot_dim % 2 or not 2 <= rot_dim <= head_size:
        raise ValueError(
            f"cos_sin_cache: expected an even rot_dim (shape[1]) in [2, head_size "
            f"{head_size}], got shape {list(cos_sin_cache.shape)}"
        )
    if t_n == 0:
        return
    pos = C.as_numpy(positions)
    lo, hi = int(pos.min()), int(pos.max())
    if lo < 0 or hi >= n_pos:
        bad = lo if lo < 0 else hi
        raise ValueError(
            f"positions: expected values in [0, {n_pos}) (the rows of cos_sin_cache), got {bad}"
        )
    q = C.span(query)
    k = C.WITNESS[dt] if key is None else C.span(key)  # an empty carrier: no key
    cs = C.as_numpy(cos_sin_cache)
    _rotary(q, q_row, hq, k, k_row, hk, pos, cs, t_n, head_size, rot_dim, bool(is_neox))
