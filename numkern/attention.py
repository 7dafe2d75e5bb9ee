"""Block-tiled paged attention over a paged KV cache (DESIGN §4).

Layouts
-------
``kv_cache [num_blocks, Hkv, B, 2*D]`` (vLLM 0.32's allocation), viewed as
``[num_blocks, Hkv, 2*B, D]`` and cut at B: in each (block b, kv head h) slab the first
``B*D`` elements are K and the next ``B*D`` are V (:func:`split_kv_cache`). Inside a
half-slab:

* ``vec`` / ``vec16`` / ``neon``: K transposed (``K[d*B + t]``), V row-major (``V[t*D + d]``);
* ``amx`` (bf16): K in groups of 16 tokens ``[D/2][16][2]``
  (``K[(t//16)*16*D + (d//2)*32 + (t%16)*2 + d%2]``), V in groups of 16 dims
  ``[B/2][16][2]`` (``V[(d//16)*B*16 + (t//2)*32 + (d%16)*2 + t%2]``).

``paged_attention(query [T, Hq, D], key_cache, value_cache, output [T, Hq, D],
query_start_loc [R+1] int32, seq_lens [R] int32, block_table [R, max_blocks] int32, *,
scale, causal, sliding_window, softcap, alibi_slopes [Hq] fp32, sinks [Hq], isa, plan)``.
Request r owns query rows ``query_start_loc[r]:query_start_loc[r+1]``; its keys are
positions ``0..seq_lens[r]-1``; query row i sits at position ``seq_lens[r] - q_len + i``.

Kernel
------
A plan (:func:`plan_attention`, once per step) cuts the batch into work items: one
request, one kv head, up to ``NRI = 256`` query rows — (position, q head) pairs of that kv
head's group, so every K/V tile is read once for the whole group — and a key range.
When a step has few items (decode of few requests), long key ranges are split across
items and the partial (max, sum, acc) are merged exactly afterwards.

An item of at most 8 rows (a decode with a GQA group of 8 or fewer) walks its keys in
tiles of 32 (two 16-key halves with their own cache offsets, so a ``vec16`` tile may
straddle two blocks) straight from the cache, prefetching the next tile: scores in
512-bit registers (rows x 2 key vectors), soft-cap / ALiBi / mask (only on tiles a row
does not fully see), online softmax in fp32 with 16-lane running sums and the rescale of
the accumulator deferred into the P·V pass, which runs token-major (each key's V row is
contiguous) with 4 rows x 64 dims of accumulators in registers. A prefill item (several
row groups) walks its keys in super-tiles of ``KS = 256`` keys, widened to fp32 once for
all its groups; per row group, the scores of the whole super-tile, one softmax pass (one
max and one rescale per row) and one P·V pass whose accumulators stay in registers
across the super-tile. P·V reads only keys that exist: an unwritten slot of a tail block
is never touched (it may hold NaN). Threads take items from a shared atomic counter
(dynamic schedule), as vLLM's kernel does.
"""

import math
from dataclasses import dataclass

import numba
import numpy as np
import torch
from numba import prange, types
from numba.extending import overload

from . import _check as C
from ._jit import jit
from .simd import (
    fetch_add,
    prefetch,
    to_f32,
    vadd,
    vbcast,
    vexp,
    vfma,
    vhmax,
    viota,
    vload,
    vload_pairs,
    vmul,
    vselect_lt,
    vsplat,
    vstore,
    vsub,
    vsum,
    vtanh,
)

KT = 32  # keys per tile: two 16-lane score vectors per row
KS = 256  # keys per super-tile of a prefill item at head_dim <= 128 (scaled by 128/head_dim
# above): widened once, one softmax pass per row group
NR = 8  # query rows per register group: 16 score accumulators
NRI = 256  # query rows per work item (GQA group x positions) at head_dim <= 128: each
# K/V super-tile is widened once for all of them (scaled down by 128/head_dim above that)
SPLIT_KEYS = 512  # a split of a long key range covers at least this many keys
ITEMS_PER_THREAD = 4  # split long ranges until a step has this many items per thread
WORKERS = 256  # item loops of the dynamic schedule (at least the thread count)
ATTN_ISAS = ("amx", "vec", "vec16", "neon")
BLOCK_MULTIPLE = {"amx": 32, "vec": 32, "vec16": 16, "neon": 32}
# item columns
I_REQ, I_HK, I_POS, I_NPOS, I_G0, I_NG, I_LO, I_HI, I_PART = range(9)
# merge columns: first partial slot, number of partials, then the item's row description
M_FIRST, M_COUNT, M_REQ, M_HK, M_POS, M_NPOS, M_G0, M_NG = range(8)


# ---------------------------------------------------------------------------------------
# cache layout


def kv_cache_shape(num_blocks, num_kv_heads, block_size, head_dim):
    """``(num_blocks, num_kv_heads, block_size, 2 * head_dim)``, as vLLM 0.32 allocates."""
    for name, v in (("num_blocks", num_blocks), ("num_kv_heads", num_kv_heads),
                    ("block_size", block_size), ("head_dim", head_dim)):  # fmt: skip
        C.check_int(name, v, low=1)
    return (num_blocks, num_kv_heads, block_size, 2 * head_dim)


def split_kv_cache(kv_cache):
    """``(key_cache, value_cache)``: two non-contiguous views ``[num_blocks, Hkv, B, D]``."""
    C.check_dtype("kv_cache", kv_cache, C.FLOATS)
    C.check_ndim("kv_cache", kv_cache, (4,))
    C.check_contiguous("kv_cache", kv_cache)
    nb, hkv, b, d2 = kv_cache.shape
    if d2 % 2:
        raise ValueError(f"kv_cache: expected a last dim of 2*head_dim, got {d2}")
    v = C.as_torch(kv_cache).view(nb, hkv, 2 * b, d2 // 2)
    return v[:, :, :b], v[:, :, b:]


# ---------------------------------------------------------------------------------------
# kernels


@jit
def _reshape_and_cache(key, value, kc, vc, slots, t_n, hkv, d, b, k_ts, k_hs, v_ts, v_hs,
                       kb_s, kh_s, vb_s, vh_s, amx):  # fmt: skip
    for t in range(t_n):
        s = slots[t]
        if s < 0:
            continue
        blk = s // b
        o = s % b
        for h in range(hkv):
            kbase = blk * kb_s + h * kh_s
            vbase = blk * vb_s + h * vh_s
            for e in range(d):
                kv = key[t * k_ts + h * k_hs + e]
                vv = value[t * v_ts + h * v_hs + e]
                if amx:
                    kc[kbase + (o // 16) * 16 * d + (e // 2) * 32 + (o % 16) * 2 + e % 2] = kv
                    vc[vbase + (e // 16) * b * 16 + (o // 2) * 32 + (e % 16) * 2 + o % 2] = vv
                else:
                    kc[kbase + e * b + o] = kv
                    vc[vbase + o * d + e] = vv


# ---------------------------------------------------------------------------------------
# register tiles
#
# A tile is 32 keys of one (request, kv head): half A (keys j0..j0+15) and half B
# (j0+16..j0+31), each with its own cache offsets, so a ``vec16`` tile may straddle two
# blocks. Scores of a row are two 16-lane vectors, (A, B). The K/V carrier decides the
# layout at compile time: ``uint32`` is ``amx`` (bf16 pairs), a 16-bit or fp32 carrier
# is ``vec``/``vec16``. Offsets are in elements of the 16-bit (or fp32) cache.


@jit(inline="always")
def _prefetch_vec(kc, vc, pka, pkb, pva, pvb, e, b):
    """The next tile's lines for dim e of K and 1/d of its V rows (d iterations: all)."""
    prefetch(kc, pka + e * b)
    prefetch(kc, pkb + e * b)
    prefetch(vc, pva + e * 16)
    prefetch(vc, pvb + e * 16)


@jit(inline="always")
def _prefetch_amx(kc, vc, pka, pkb, pva, pvb, d2, vcs):
    """The next tile's K pairs of dims 2*d2, 2*d2+1 and 1/(d/2) of its V token pairs."""
    prefetch(kc, pka + d2 * 16)
    prefetch(kc, pkb + d2 * 16)
    o = d2 * 32  # 64 bytes of the half's V: 256 elements per 16-dim group
    c = o // 256
    w = o % 256
    prefetch(vc, ((pva + c * vcs + w) >> 1))
    prefetch(vc, ((pvb + c * vcs + w) >> 1))


def _qk4(qf, q0, q1, q2, q3, d, kc, ka, kb, b, sbuf, vc, pf, vcs, do_pf):
    """Scores of 4 (possibly repeated) rows against a tile into ``sbuf[i*32:(i+1)*32]``."""


@overload(_qk4)
def _qk4_impl(qf, q0, q1, q2, q3, d, kc, ka, kb, b, sbuf, vc, pf, vcs, do_pf):
    f = _qk4_amx if kc.dtype == types.uint32 else _qk4_vec
    return lambda qf, q0, q1, q2, q3, d, kc, ka, kb, b, sbuf, vc, pf, vcs, do_pf: f(
        qf, q0, q1, q2, q3, d, kc, ka, kb, b, sbuf, vc, pf, vcs, do_pf
    )


@jit
def _qk4_vec(qf, q0, q1, q2, q3, d, kc, ka, kb, b, sbuf, vc, pf, vcs, do_pf):
    # one K row per dim: 16 contiguous keys per half (K[d*B + t]); 8 independent chains
    a0 = a1 = a2 = a3 = b0 = b1 = b2 = b3 = vsplat(0.0)
    pka, pkb, pva, pvb = pf[0], pf[1], pf[2], pf[3]
    for e in range(d):
        kx = vload(kc, ka + e * b)
        ky = vload(kc, kb + e * b)
        if do_pf:
            _prefetch_vec(kc, vc, pka, pkb, pva, pvb, e, b)
        x = vbcast(qf, q0 + e)
        a0 = vfma(x, kx, a0)
        b0 = vfma(x, ky, b0)
        x = vbcast(qf, q1 + e)
        a1 = vfma(x, kx, a1)
        b1 = vfma(x, ky, b1)
        x = vbcast(qf, q2 + e)
        a2 = vfma(x, kx, a2)
        b2 = vfma(x, ky, b2)
        x = vbcast(qf, q3 + e)
        a3 = vfma(x, kx, a3)
        b3 = vfma(x, ky, b3)
    _store8(sbuf, 0, KT, a0, b0, a1, b1, a2, b2, a3, b3)


@jit
def _qk4_amx(qf, q0, q1, q2, q3, d, kc, ka, kb, b, sbuf, vc, pf, vcs, do_pf):
    # K[(t//16)*16*D + (d//2)*32 + (t%16)*2 + d%2]: one pair load = 16 keys x 2 dims
    pa = ka >> 1
    pb = kb >> 1
    a0 = a1 = a2 = a3 = b0 = b1 = b2 = b3 = vsplat(0.0)
    pka, pkb, pva, pvb = pf[0] >> 1, pf[1] >> 1, pf[2], pf[3]
    for d2 in range(d // 2):
        xe, xo = vload_pairs(kc, pa + d2 * 16)
        ye, yo = vload_pairs(kc, pb + d2 * 16)
        if do_pf:
            _prefetch_amx(kc, vc, pka, pkb, pva, pvb, d2, vcs)
        e = 2 * d2
        u = vbcast(qf, q0 + e)
        w = vbcast(qf, q0 + e + 1)
        a0 = vfma(w, xo, vfma(u, xe, a0))
        b0 = vfma(w, yo, vfma(u, ye, b0))
        u = vbcast(qf, q1 + e)
        w = vbcast(qf, q1 + e + 1)
        a1 = vfma(w, xo, vfma(u, xe, a1))
        b1 = vfma(w, yo, vfma(u, ye, b1))
        u = vbcast(qf, q2 + e)
        w = vbcast(qf, q2 + e + 1)
        a2 = vfma(w, xo, vfma(u, xe, a2))
        b2 = vfma(w, yo, vfma(u, ye, b2))
        u = vbcast(qf, q3 + e)
        w = vbcast(qf, q3 + e + 1)
        a3 = vfma(w, xo, vfma(u, xe, a3))
        b3 = vfma(w, yo, vfma(u, ye, b3))
    _store8(sbuf, 0, KT, a0, b0, a1, b1, a2, b2, a3, b3)


@jit(inline="always")
def _store8(sbuf, o, ss, a0, b0, a1, b1, a2, b2, a3, b3):
    """Scores of 4 rows (row stride ``ss``) at ``sbuf[o:]``: half A, then half B."""
    vstore(sbuf, o, a0)
    vstore(sbuf, o + 16, b0)
    vstore(sbuf, o + ss, a1)
    vstore(sbuf, o + ss + 16, b1)
    vstore(sbuf, o + 2 * ss, a2)
    vstore(sbuf, o + 2 * ss + 16, b2)
    vstore(sbuf, o + 3 * ss, a3)
    vstore(sbuf, o + 3 * ss + 16, b3)


def _qk8(qf, qr, d, kc, ka, kb, b, sbuf, so, ss, vc, pf, vcs, do_pf):
    """Scores of 8 rows (``qf`` offsets ``qr[0:8]``) against a tile into ``sbuf``."""


@overload(_qk8)
def _qk8_impl(qf, qr, d, kc, ka, kb, b, sbuf, so, ss, vc, pf, vcs, do_pf):
    f = _qk8_amx if kc.dtype == types.uint32 else _qk8_vec
    return lambda qf, qr, d, kc, ka, kb, b, sbuf, so, ss, vc, pf, vcs, do_pf: f(
        qf, qr, d, kc, ka, kb, b, sbuf, so, ss, vc, pf, vcs, do_pf
    )


@jit
def _qk8_vec(qf, qr, d, kc, ka, kb, b, sbuf, so, ss, vc, pf, vcs, do_pf):
    q0, q1, q2, q3, q4, q5, q6, q7 = qr[0], qr[1], qr[2], qr[3], qr[4], qr[5], qr[6], qr[7]
    a0 = a1 = a2 = a3 = a4 = a5 = a6 = a7 = vsplat(0.0)
    b0 = b1 = b2 = b3 = b4 = b5 = b6 = b7 = vsplat(0.0)
    pka, pkb, pva, pvb = pf[0], pf[1], pf[2], pf[3]
    for e in range(d):
        kx = vload(kc, ka + e * b)
        ky = vload(kc, kb + e * b)
        if do_pf:
            _prefetch_vec(kc, vc, pka, pkb, pva, pvb, e, b)
        x = vbcast(qf, q0 + e)
        a0 = vfma(x, kx, a0)
        b0 = vfma(x, ky, b0)
        x = vbcast(qf, q1 + e)
        a1 = vfma(x, kx, a1)
        b1 = vfma(x, ky, b1)
        x = vbcast(qf, q2 + e)
        a2 = vfma(x, kx, a2)
        b2 = vfma(x, ky, b2)
        x = vbcast(qf, q3 + e)
        a3 = vfma(x, kx, a3)
        b3 = vfma(x, ky, b3)
        x = vbcast(qf, q4 + e)
        a4 = vfma(x, kx, a4)
        b4 = vfma(x, ky, b4)
        x = vbcast(qf, q5 + e)
        a5 = vfma(x, kx, a5)
        b5 = vfma(x, ky, b5)
        x = vbcast(qf, q6 + e)
        a6 = vfma(x, kx, a6)
        b6 = vfma(x, ky, b6)
        x = vbcast(qf, q7 + e)
        a7 = vfma(x, kx, a7)
        b7 = vfma(x, ky, b7)
    _store8(sbuf, so, ss, a0, b0, a1, b1, a2, b2, a3, b3)
    _store8(sbuf, so + 4 * ss, ss, a4, b4, a5, b5, a6, b6, a7, b7)


@jit
def _qk8_amx(qf, qr, d, kc, ka, kb, b, sbuf, so, ss, vc, pf, vcs, do_pf):
    q0, q1, q2, q3, q4, q5, q6, q7 = qr[0], qr[1], qr[2], qr[3], qr[4], qr[5], qr[6], qr[7]
    pa = ka >> 1
    pb = kb >> 1
    a0 = a1 = a2 = a3 = a4 = a5 = a6 = a7 = vsplat(0.0)
    b0 = b1 = b2 = b3 = b4 = b5 = b6 = b7 = vsplat(0.0)
    pka, pkb, pva, pvb = pf[0] >> 1, pf[1] >> 1, pf[2], pf[3]
    for d2 in range(d // 2):
        xe, xo = vload_pairs(kc, pa + d2 * 16)
        ye, yo = vload_pairs(kc, pb + d2 * 16)
        if do_pf:
            _prefetch_amx(kc, vc, pka, pkb, pva, pvb, d2, vcs)
        e = 2 * d2
        u = vbcast(qf, q0 + e)
        w = vbcast(qf, q0 + e + 1)
        a0 = vfma(w, xo, vfma(u, xe, a0))
        b0 = vfma(w, yo, vfma(u, ye, b0))
        u = vbcast(qf, q1 + e)
        w = vbcast(qf, q1 + e + 1)
        a1 = vfma(w, xo, vfma(u, xe, a1))
        b1 = vfma(w, yo, vfma(u, ye, b1))
        u = vbcast(qf, q2 + e)
        w = vbcast(qf, q2 + e + 1)
        a2 = vfma(w, xo, vfma(u, xe, a2))
        b2 = vfma(w, yo, vfma(u, ye, b2))
        u = vbcast(qf, q3 + e)
        w = vbcast(qf, q3 + e + 1)
        a3 = vfma(w, xo, vfma(u, xe, a3))
        b3 = vfma(w, yo, vfma(u, ye, b3))
        u = vbcast(qf, q4 + e)
        w = vbcast(qf, q4 + e + 1)
        a4 = vfma(w, xo, vfma(u, xe, a4))
        b4 = vfma(w, yo, vfma(u, ye, b4))
        u = vbcast(qf, q5 + e)
        w = vbcast(qf, q5 + e + 1)
        a5 = vfma(w, xo, vfma(u, xe, a5))
        b5 = vfma(w, yo, vfma(u, ye, b5))
        u = vbcast(qf, q6 + e)
        w = vbcast(qf, q6 + e + 1)
        a6 = vfma(w, xo, vfma(u, xe, a6))
        b6 = vfma(w, yo, vfma(u, ye, b6))
        u = vbcast(qf, q7 + e)
        w = vbcast(qf, q7 + e + 1)
        a7 = vfma(w, xo, vfma(u, xe, a7))
        b7 = vfma(w, yo, vfma(u, ye, b7))
    _store8(sbuf, so, ss, a0, b0, a1, b1, a2, b2, a3, b3)
    _store8(sbuf, so + 4 * ss, ss, a4, b4, a5, b5, a6, b6, a7, b7)


def _stage(kc, vc, ka, kb, va, vb, nva, nvb, d, b, vcs, ks, k0, kst, vs, v0):
    """A 32-key tile's K and V widened to fp32 for the row groups of an item to share: K
    transposed at ``ks[k0 + e*kst : +32]`` (dim e), V rows at ``vs[v0 + t*d : +d]``.
    ``vs`` rows of keys that do not exist are left as they are (P·V never reads them)."""


@overload(_stage)
def _stage_impl(kc, vc, ka, kb, va, vb, nva, nvb, d, b, vcs, ks, k0, kst, vs, v0):
    f = _stage_amx if kc.dtype == types.uint32 else _stage_vec
    return lambda kc, vc, ka, kb, va, vb, nva, nvb, d, b, vcs, ks, k0, kst, vs, v0: f(
        kc, vc, ka, kb, va, vb, nva, nvb, d, b, vcs, ks, k0, kst, vs, v0
    )


@jit
def _stage_vec(kc, vc, ka, kb, va, vb, nva, nvb, d, b, vcs, ks, k0, kst, vs, v0):
    for e in range(d):
        vstore(ks, k0 + e * kst, vload(kc, ka + e * b))
        vstore(ks, k0 + e * kst + 16, vload(kc, kb + e * b))
    for i in range(nva):
        for c in range(0, d, 16):
            vstore(vs, v0 + i * d + c, vload(vc, va + i * d + c))
    for i in range(nvb):
        for c in range(0, d, 16):
            vstore(vs, v0 + (16 + i) * d + c, vload(vc, vb + i * d + c))


@jit
def _stage_amx(kc, vc, ka, kb, va, vb, nva, nvb, d, b, vcs, ks, k0, kst, vs, v0):
    pa = ka >> 1
    pb = kb >> 1
    for d2 in range(d // 2):
        xe, xo = vload_pairs(kc, pa + d2 * 16)
        ye, yo = vload_pairs(kc, pb + d2 * 16)
        vstore(ks, k0 + 2 * d2 * kst, xe)
        vstore(ks, k0 + 2 * d2 * kst + 16, ye)
        vstore(ks, k0 + (2 * d2 + 1) * kst, xo)
        vstore(ks, k0 + (2 * d2 + 1) * kst + 16, yo)
    cs = vcs >> 1
    for h in range(2):
        base = (va if h == 0 else vb) >> 1
        n = nva if h == 0 else nvb
        for c in range(d // 16):
            for tp in range((n + 1) // 2):
                e0, f0 = vload_pairs(vc, base + c * cs + tp * 16)
                t = 16 * h + 2 * tp
                vstore(vs, v0 + t * d + c * 16, e0)
                if 2 * tp + 1 < n:
                    vstore(vs, v0 + (t + 1) * d + c * 16, f0)


@jit
def _softmax_rows(sbuf, rg, gr, j0, info, slopes, softcap, m, lv, alpha):
    """Scores of rows rg..rg+gr-1 in ``sbuf`` -> probabilities, online softmax state.

    Transform (soft-cap, ALiBi), mask only tiles a row does not fully see, and fold into
    (max ``m``, 16-lane running sum ``lv``); ``alpha[r]`` is the rescale of the row's
    accumulator, applied in the P·V pass. A fully masked row gets P = 0, alpha = 1.
    """
    ninf = vsplat(-np.inf)
    ja = vfma(vsplat(1.0), viota(), vsplat(float(j0)))
    jb = vadd(ja, vsplat(16.0))
    for i in range(gr):
        r = rg + i
        so = i * KT
        sa = vload(sbuf, so)
        sb = vload(sbuf, so + 16)
        if softcap != 0.0:
            c = vsplat(softcap)
            ic = vsplat(1.0 / softcap)
            sa = vmul(vtanh(vmul(sa, ic)), c)
            sb = vmul(vtanh(vmul(sb, ic)), c)
        slope = slopes[r]
        if slope != 0.0:
            sl = vsplat(slope)
            p = vsplat(float(info[r, 0]))
            sa = vfma(sl, vsub(ja, p), sa)
            sb = vfma(sl, vsub(jb, p), sb)
        lo = info[r, 2]
        hi = info[r, 3]
        if j0 < lo or j0 + KT > hi:
            vlo = vsplat(float(lo))
            vhi = vsplat(float(hi))
            sa = vselect_lt(ja, vhi, vselect_lt(ja, vlo, ninf, sa), ninf)
            sb = vselect_lt(jb, vhi, vselect_lt(jb, vlo, ninf, sb), ninf)
        mt = vhmax(vselect_lt(sa, sb, sb, sa))
        if mt == -np.inf:
            alpha[r] = 1.0
            vstore(sbuf, so, vsplat(0.0))
            vstore(sbuf, so + 16, vsplat(0.0))
            continue
        m_old = m[r]
        a = np.float32(1.0)
        if mt > m_old:
            if m_old > -np.inf:
                a = np.float32(math.exp(m_old - mt))
            else:
                a = np.float32(0.0)
            m[r] = mt
            m_old = mt
        mv = vsplat(m_old)
        pa = vexp(vsub(sa, mv))
        pb = vexp(vsub(sb, mv))
        alpha[r] = a
        vstore(lv, r * 16, vadd(vfma(vload(lv, r * 16), vsplat(a), pa), pb))
        vstore(sbuf, so, pa)
        vstore(sbuf, so + 16, pb)


@jit
def _softmax_wide(sbuf, ss, rg, gr, j0, s_lo, s_hi, info, slopes, softcap, m, lv, alpha):
    """:func:`_softmax_rows` over the 32-key tiles ``s_lo..s_hi-1`` of a super-tile at key
    ``j0`` (row stride ``ss`` in ``sbuf``): one max, one rescale per row for all of them."""
    ninf = vsplat(-np.inf)
    for i in range(gr):
        r = rg + i
        slope = slopes[r]
        lo = info[r, 2]
        hi = info[r, 3]
        mx = ninf
        for t in range(s_lo, s_hi):
            so = i * ss + t * KT
            jt = j0 + t * KT
            sa = vload(sbuf, so)
            sb = vload(sbuf, so + 16)
            edit = False
            if softcap != 0.0:
                c = vsplat(softcap)
                ic = vsplat(1.0 / softcap)
                sa = vmul(vtanh(vmul(sa, ic)), c)
                sb = vmul(vtanh(vmul(sb, ic)), c)
                edit = True
            if slope != 0.0:
                ja = vfma(vsplat(1.0), viota(), vsplat(float(jt)))
                sl = vsplat(slope)
                p = vsplat(float(info[r, 0]))
                sa = vfma(sl, vsub(ja, p), sa)
                sb = vfma(sl, vsub(vadd(ja, vsplat(16.0)), p), sb)
                edit = True
            if jt < lo or jt + KT > hi:
                ja = vfma(vsplat(1.0), viota(), vsplat(float(jt)))
                jb = vadd(ja, vsplat(16.0))
                vlo = vsplat(float(lo))
                vhi = vsplat(float(hi))
                sa = vselect_lt(ja, vhi, vselect_lt(ja, vlo, ninf, sa), ninf)
                sb = vselect_lt(jb, vhi, vselect_lt(jb, vlo, ninf, sb), ninf)
                edit = True
            if edit:
                vstore(sbuf, so, sa)
                vstore(sbuf, so + 16, sb)
            mx = vselect_lt(mx, sa, sa, mx)
            mx = vselect_lt(mx, sb, sb, mx)
        mt = vhmax(mx)
        if mt == -np.inf:
            alpha[r] = 1.0
            for t in range(s_lo, s_hi):
                vstore(sbuf, i * ss + t * KT, vsplat(0.0))
                vstore(sbuf, i * ss + t * KT + 16, vsplat(0.0))
            continue
        m_old = m[r]
        a = np.float32(1.0)
        if mt > m_old:
            if m_old > -np.inf:
                a = np.float32(math.exp(m_old - mt))
            else:
                a = np.float32(0.0)
            m[r] = mt
            m_old = mt
        mv = vsplat(m_old)
        acc_l = vmul(vload(lv, r * 16), vsplat(a))
        for t in range(s_lo, s_hi):
            so = i * ss + t * KT
            pa = vexp(vsub(vload(sbuf, so), mv))
            pb = vexp(vsub(vload(sbuf, so + 16), mv))
            acc_l = vadd(acc_l, vadd(pa, pb))
            vstore(sbuf, so, pa)
            vstore(sbuf, so + 16, pb)
        alpha[r] = a
        vstore(lv, r * 16, acc_l)


def _pv4(acc, ar, alpha, sbuf, pr, d, vc, va, nva, vb, nvb, vcs):
    """acc[row] = acc[row] * alpha + P @ V_tile for 4 (possibly repeated) rows.

    ``ar[0:4]``: the rows' offsets into ``acc``; ``pr[0:4]``: into ``sbuf`` (probabilities
    of half A at +0, half B at +16); ``nva``/``nvb``: keys of each half that exist (the
    rest of a tail tile is never read: an unwritten slot may hold NaN).
    """


@overload(_pv4)
def _pv4_impl(acc, ar, alpha, sbuf, pr, d, vc, va, nva, vb, nvb, vcs):
    f = _pv4_amx if vc.dtype == types.uint32 else _pv4_vec
    return lambda acc, ar, alpha, sbuf, pr, d, vc, va, nva, vb, nvb, vcs: f(
        acc, ar, alpha, sbuf, pr, d, vc, va, nva, vb, nvb, vcs
    )


@jit
def _pv4_vec(acc, ar, alpha, sbuf, pr, d, vc, va, nva, vb, nvb, vcs):
    # V row-major (V[t*D + d]): each key's row is contiguous; 4 rows x 64 dims in registers
    r0, r1, r2, r3 = ar[0], ar[1], ar[2], ar[3]
    p0, p1, p2, p3 = pr[0], pr[1], pr[2], pr[3]
    g0 = vsplat(alpha[0])
    g1 = vsplat(alpha[1])
    g2 = vsplat(alpha[2])
    g3 = vsplat(alpha[3])
    c0 = 0
    while c0 + 64 <= d:
        x00 = vmul(vload(acc, r0 + c0), g0)
        x01 = vmul(vload(acc, r0 + c0 + 16), g0)
        x02 = vmul(vload(acc, r0 + c0 + 32), g0)
        x03 = vmul(vload(acc, r0 + c0 + 48), g0)
        x10 = vmul(vload(acc, r1 + c0), g1)
        x11 = vmul(vload(acc, r1 + c0 + 16), g1)
        x12 = vmul(vload(acc, r1 + c0 + 32), g1)
        x13 = vmul(vload(acc, r1 + c0 + 48), g1)
        x20 = vmul(vload(acc, r2 + c0), g2)
        x21 = vmul(vload(acc, r2 + c0 + 16), g2)
        x22 = vmul(vload(acc, r2 + c0 + 32), g2)
        x23 = vmul(vload(acc, r2 + c0 + 48), g2)
        x30 = vmul(vload(acc, r3 + c0), g3)
        x31 = vmul(vload(acc, r3 + c0 + 16), g3)
        x32 = vmul(vload(acc, r3 + c0 + 32), g3)
        x33 = vmul(vload(acc, r3 + c0 + 48), g3)
        for h in range(2):
            base = (va if h == 0 else vb) + c0
            n = nva if h == 0 else nvb
            po = 16 * h
            for i in range(n):
                row = base + i * d
                v0 = vload(vc, row)
                v1 = vload(vc, row + 16)
                v2 = vload(vc, row + 32)
                v3 = vload(vc, row + 48)
                w = vbcast(sbuf, p0 + po + i)
                x00 = vfma(w, v0, x00)
                x01 = vfma(w, v1, x01)
                x02 = vfma(w, v2, x02)
                x03 = vfma(w, v3, x03)
                w = vbcast(sbuf, p1 + po + i)
                x10 = vfma(w, v0, x10)
                x11 = vfma(w, v1, x11)
                x12 = vfma(w, v2, x12)
                x13 = vfma(w, v3, x13)
                w = vbcast(sbuf, p2 + po + i)
                x20 = vfma(w, v0, x20)
                x21 = vfma(w, v1, x21)
                x22 = vfma(w, v2, x22)
                x23 = vfma(w, v3, x23)
                w = vbcast(sbuf, p3 + po + i)
                x30 = vfma(w, v0, x30)
                x31 = vfma(w, v1, x31)
                x32 = vfma(w, v2, x32)
                x33 = vfma(w, v3, x33)
        # repeated rows compute identical values: storing them twice is harmless
        _store4(acc, r3 + c0, x30, x31, x32, x33)
        _store4(acc, r2 + c0, x20, x21, x22, x23)
        _store4(acc, r1 + c0, x10, x11, x12, x13)
        _store4(acc, r0 + c0, x00, x01, x02, x03)
        c0 += 64
    while c0 < d:  # head_dim % 64: 16 dims at a time
        x00 = vmul(vload(acc, r0 + c0), g0)
        x10 = vmul(vload(acc, r1 + c0), g1)
        x20 = vmul(vload(acc, r2 + c0), g2)
        x30 = vmul(vload(acc, r3 + c0), g3)
        for h in range(2):
            base = (va if h == 0 else vb) + c0
            n = nva if h == 0 else nvb
            po = 16 * h
            for i in range(n):
                v0 = vload(vc, base + i * d)
                x00 = vfma(vbcast(sbuf, p0 + po + i), v0, x00)
                x10 = vfma(vbcast(sbuf, p1 + po + i), v0, x10)
                x20 = vfma(vbcast(sbuf, p2 + po + i), v0, x20)
                x30 = vfma(vbcast(sbuf, p3 + po + i), v0, x30)
        vstore(acc, r3 + c0, x30)
        vstore(acc, r2 + c0, x20)
        vstore(acc, r1 + c0, x10)
        vstore(acc, r0 + c0, x00)
        c0 += 16


@jit(inline="always")
def _store4(acc, o, x0, x1, x2, x3):
    vstore(acc, o, x0)
    vstore(acc, o + 16, x1)
    vstore(acc, o + 32, x2)
    vstore(acc, o + 48, x3)


@jit
def _pv4_amx(acc, ar, alpha, sbuf, pr, d, vc, va, nva, vb, nvb, vcs):
    # V[(d//16)*B*16 + (t//2)*32 + (d%16)*2 + t%2]: one pair load = 16 dims x 2 keys;
    # ``vcs``: elements between 16-dim groups (B * 16)
    r0, r1, r2, r3 = ar[0], ar[1], ar[2], ar[3]
    p0, p1, p2, p3 = pr[0], pr[1], pr[2], pr[3]
    g0 = vsplat(alpha[0])
    g1 = vsplat(alpha[1])
    g2 = vsplat(alpha[2])
    g3 = vsplat(alpha[3])
    cs = vcs >> 1
    c0 = 0
    while c0 + 64 <= d:
        x00 = vmul(vload(acc, r0 + c0), g0)
        x01 = vmul(vload(acc, r0 + c0 + 16), g0)
        x02 = vmul(vload(acc, r0 + c0 + 32), g0)
        x03 = vmul(vload(acc, r0 + c0 + 48), g0)
        x10 = vmul(vload(acc, r1 + c0), g1)
        x11 = vmul(vload(acc, r1 + c0 + 16), g1)
        x12 = vmul(vload(acc, r1 + c0 + 32), g1)
        x13 = vmul(vload(acc, r1 + c0 + 48), g1)
        x20 = vmul(vload(acc, r2 + c0), g2)
        x21 = vmul(vload(acc, r2 + c0 + 16), g2)
        x22 = vmul(vload(acc, r2 + c0 + 32), g2)
        x23 = vmul(vload(acc, r2 + c0 + 48), g2)
        x30 = vmul(vload(acc, r3 + c0), g3)
        x31 = vmul(vload(acc, r3 + c0 + 16), g3)
        x32 = vmul(vload(acc, r3 + c0 + 32), g3)
        x33 = vmul(vload(acc, r3 + c0 + 48), g3)
        grp = (c0 // 16) * cs
        for h in range(2):
            base = ((va if h == 0 else vb) >> 1) + grp
            n = nva if h == 0 else nvb
            po = 16 * h
            for tp in range((n + 1) // 2):
                o = base + tp * 16
                e0, f0 = vload_pairs(vc, o)
                e1, f1 = vload_pairs(vc, o + cs)
                e2, f2 = vload_pairs(vc, o + 2 * cs)
                e3, f3 = vload_pairs(vc, o + 3 * cs)
                i = po + 2 * tp
                if 2 * tp + 1 == n:  # the odd last key: its pair partner does not exist
                    f0 = f1 = f2 = f3 = vsplat(0.0)
                w = vbcast(sbuf, p0 + i)
                z = vbcast(sbuf, p0 + i + 1)
                x00 = vfma(z, f0, vfma(w, e0, x00))
                x01 = vfma(z, f1, vfma(w, e1, x01))
                x02 = vfma(z, f2, vfma(w, e2, x02))
                x03 = vfma(z, f3, vfma(w, e3, x03))
                w = vbcast(sbuf, p1 + i)
                z = vbcast(sbuf, p1 + i + 1)
                x10 = vfma(z, f0, vfma(w, e0, x10))
                x11 = vfma(z, f1, vfma(w, e1, x11))
                x12 = vfma(z, f2, vfma(w, e2, x12))
                x13 = vfma(z, f3, vfma(w, e3, x13))
                w = vbcast(sbuf, p2 + i)
                z = vbcast(sbuf, p2 + i + 1)
                x20 = vfma(z, f0, vfma(w, e0, x20))
                x21 = vfma(z, f1, vfma(w, e1, x21))
                x22 = vfma(z, f2, vfma(w, e2, x22))
                x23 = vfma(z, f3, vfma(w, e3, x23))
                w = vbcast(sbuf, p3 + i)
                z = vbcast(sbuf, p3 + i + 1)
                x30 = vfma(z, f0, vfma(w, e0, x30))
                x31 = vfma(z, f1, vfma(w, e1, x31))
                x32 = vfma(z, f2, vfma(w, e2, x32))
                x33 = vfma(z, f3, vfma(w, e3, x33))
        _store4(acc, r3 + c0, x30, x31, x32, x33)
        _store4(acc, r2 + c0, x20, x21, x22, x23)
        _store4(acc, r1 + c0, x10, x11, x12, x13)
        _store4(acc, r0 + c0, x00, x01, x02, x03)
        c0 += 64
    while c0 < d:
        x00 = vmul(vload(acc, r0 + c0), g0)
        x10 = vmul(vload(acc, r1 + c0), g1)
        x20 = vmul(vload(acc, r2 + c0), g2)
        x30 = vmul(vload(acc, r3 + c0), g3)
        grp = (c0 // 16) * cs
        for h in range(2):
            base = ((va if h == 0 else vb) >> 1) + grp
            n = nva if h == 0 else nvb
            po = 16 * h
            for tp in range((n + 1) // 2):
                e0, f0 = vload_pairs(vc, base + tp * 16)
                if 2 * tp + 1 == n:
                    f0 = vsplat(0.0)
                i = po + 2 * tp
                x00 = vfma(vbcast(sbuf, p0 + i + 1), f0, vfma(vbcast(sbuf, p0 + i), e0, x00))
                x10 = vfma(vbcast(sbuf, p1 + i + 1), f0, vfma(vbcast(sbuf, p1 + i), e0, x10))
                x20 = vfma(vbcast(sbuf, p2 + i + 1), f0, vfma(vbcast(sbuf, p2 + i), e0, x20))
                x30 = vfma(vbcast(sbuf, p3 + i + 1), f0, vfma(vbcast(sbuf, p3 + i), e0, x30))
        vstore(acc, r3 + c0, x30)
        vstore(acc, r2 + c0, x20)
        vstore(acc, r1 + c0, x10)
        vstore(acc, r0 + c0, x00)
        c0 += 16


@jit
def _row_info(r, ng, req, hk, pos0, g0, grp, ctx, kv_len, causal, window):
    """(query position, q head, first visible key, end of visible keys) of an item row."""
    pi = r // ng
    h = hk * grp + g0 + r % ng
    p = ctx + pos0 + pi
    lo = max(0, p - window + 1) if window > 0 else 0
    if causal:
        hi = p + 1
    elif window > 0:
        hi = p + window
    else:
        hi = kv_len
    return p, h, lo, min(hi, kv_len)


@jit
def _tile(j0, req, hk, kv_len, bt, b, d, kb_s, kh_s, vb_s, vh_s, amx):
    """Cache offsets of the tile at key j0: K and V of half A and half B, and how many
    keys of each half exist (a tail tile's others are never read by P·V)."""
    n_keys = min(KT, kv_len - j0)
    pb = np.int64(bt[req, j0 // b])
    off = j0 % b
    ka = pb * kb_s + hk * kh_s
    va = pb * vb_s + hk * vh_s
    kb = ka
    vb = va
    off_b = off + 16
    if n_keys > 16 and off_b >= b:  # vec16: half B starts the next block
        pb = np.int64(bt[req, (j0 + 16) // b])
        kb = pb * kb_s + hk * kh_s
        vb = pb * vb_s + hk * vh_s
        off_b = 0
    elif off_b >= b:  # no half B: point it at half A (read by QK, masked)
        off_b = off
    if amx:  # 16-token groups of K, token pairs of V
        ka += (off // 16) * 16 * d
        kb += (off_b // 16) * 16 * d
        va += (off // 2) * 32
        vb += (off_b // 2) * 32
    else:
        ka += off
        kb += off_b
        va += off * d
        vb += off_b * d
    return ka, kb, va, vb, min(n_keys, 16), max(n_keys - 16, 0)


@jit
def _decode(qf, acc, m, lv, info, slopes, softcap, kc, vc, req, hk, kv_len, bt, b, d, kb_s,
            kh_s, vb_s, vh_s, v_cs, amx, key_lo, key_hi, rows):  # fmt: skip
    """The keys [key_lo, key_hi) of one row group (at most NR rows) tile by tile, straight
    from the cache, prefetching the next tile while this one is computed."""
    sbuf = np.empty(NR * KT, np.float32)  # the group's scores, then probabilities
    alpha = np.ones(rows, np.float32)
    qr = np.empty(NR, np.int64)
    ar = np.empty(4, np.int64)
    pr = np.empty(4, np.int64)
    al = np.empty(4, np.float32)
    gr = rows
    for i in range(NR):
        qr[i] = min(i, gr - 1) * d
    j0 = key_lo - key_lo % KT
    while j0 < key_hi:
        ka, kb_, va, vb_, nva, nvb = _tile(j0, req, hk, kv_len, bt, b, d, kb_s, kh_s, vb_s,
                                           vh_s, amx)  # fmt: skip
        pf = (ka, kb_, va, vb_, nva, nvb)
        if j0 + KT < key_hi:
            pf = _tile(j0 + KT, req, hk, kv_len, bt, b, d, kb_s, kh_s, vb_s, vh_s, amx)
        seen = False
        for i in range(gr):
            seen = seen or (info[i, 2] < j0 + KT and info[i, 3] > j0)
        if seen:
            if gr <= 4:
                _qk4(qf, qr[0], qr[1], qr[2], qr[3], d, kc, ka, kb_, b, sbuf, vc, pf, v_cs, True)
            else:
                _qk8(qf, qr, d, kc, ka, kb_, b, sbuf, 0, KT, vc, pf, v_cs, True)
            _softmax_rows(sbuf, 0, gr, j0, info, slopes, softcap, m, lv, alpha)
            for h4 in range(0, gr, 4):
                last = min(gr - h4, 4) - 1
                for i in range(4):
                    r = h4 + min(i, last)
                    ar[i] = r * d
                    pr[i] = r * KT
                    al[i] = alpha[r]
                _pv4(acc, ar, al, sbuf, pr, d, vc, va, nva, vb_, nvb, v_cs)
        j0 += KT


@jit
def _prefill(qf, acc, m, lv, info, slopes, softcap, kc, vc, req, hk, kv_len, bt, b, d, kb_s,
             kh_s, vb_s, vh_s, v_cs, amx, key_lo, key_hi, rows):  # fmt: skip
    """The keys [key_lo, key_hi) of an item's row groups in super-tiles of KS keys (fewer
    above head_dim 128): each is widened to fp32 once; per row group, QK of its tiles, one
    softmax pass and one P·V pass with the accumulators in registers across the whole
    super-tile."""
    kst = max(KT, KS * 128 // max(d, 128) // KT * KT)  # keys per super-tile: ~256 KB staged
    ks = np.empty(d * kst, np.float32)  # K^T: dim e at ks[e*kst:], tile t at column t*KT
    vs = np.empty(kst * d, np.float32)  # V rows
    sbuf = np.empty(NR * kst, np.float32)  # a group's scores, then probabilities
    alpha = np.ones(rows, np.float32)
    qr = np.empty(NR, np.int64)
    ar = np.empty(4, np.int64)
    pr = np.empty(4, np.int64)
    al = np.empty(4, np.float32)
    pf = (0, 0, 0, 0, 0, 0)  # no prefetch: the super-tile is staged
    j0 = key_lo - key_lo % KT
    while j0 < key_hi:
        j1 = min(j0 + kst, key_hi)
        nsub = (j1 - j0 + KT - 1) // KT
        for t in range(nsub):
            ka, kb_, va, vb_, nva, nvb = _tile(j0 + t * KT, req, hk, kv_len, bt, b, d, kb_s,
                                               kh_s, vb_s, vh_s, amx)  # fmt: skip
            _stage(kc, vc, ka, kb_, va, vb_, nva, nvb, d, b, v_cs, ks, t * KT, kst, vs,
                   t * KT * d)  # fmt: skip
        for rg in range(0, rows, NR):
            gr = min(NR, rows - rg)
            lo = info[rg, 2]
            hi = info[rg, 3]
            for i in range(1, gr):
                lo = min(lo, info[rg + i, 2])
                hi = max(hi, info[rg + i, 3])
            t_lo = max(0, (lo - j0) // KT)
            t_hi = min(nsub, (hi - j0 + KT - 1) // KT)
            if t_lo >= t_hi:  # every row of the group masks this whole super-tile
                continue
            for i in range(NR):
                qr[i] = (rg + min(i, gr - 1)) * d
            for t in range(t_lo, t_hi):
                _qk8(qf, qr, d, ks, t * KT, t * KT + 16, kst, sbuf, t * KT, kst, vs, pf, 0,
                     False)  # fmt: skip
            _softmax_wide(sbuf, kst, rg, gr, j0, t_lo, t_hi, info, slopes, softcap, m, lv,
                          alpha)  # fmt: skip
            k0 = t_lo * KT
            n = min(t_hi * KT, j1 - j0) - k0  # keys that exist (unwritten slots: never read)
            for h4 in range(0, gr, 4):
                last = min(gr - h4, 4) - 1
                for i in range(4):
                    r = rg + h4 + min(i, last)
                    ar[i] = r * d
                    pr[i] = (h4 + min(i, last)) * kst + k0
                    al[i] = alpha[r]
                _pv4(acc, ar, al, sbuf, pr, d, vs, k0 * d, n, 0, 0, 0)
        j0 = j1


@jit
def _item(it, items, q, kc, vc, out, qsl, seq_lens, bt, part_m, part_l, part_acc, scale,
          causal, window, softcap, alibi, has_alibi, sinks, has_sinks, hq, hkv, d, b,
          q_ts, q_hs, o_ts, o_hs, kb_s, kh_s, vb_s, vh_s, v_cs, amx):  # fmt: skip
    req = items[it, I_REQ]
    hk = items[it, I_HK]
    pos0 = items[it, I_POS]
    npos = items[it, I_NPOS]
    g0 = items[it, I_G0]
    ng = items[it, I_NG]
    key_lo = items[it, I_LO]
    key_hi = items[it, I_HI]
    part = items[it, I_PART]
    grp = hq // hkv
    q_len = qsl[req + 1] - qsl[req]
    kv_len = np.int64(seq_lens[req])
    ctx = kv_len - q_len
    rows = npos * ng
    qf = np.empty(rows * d, np.float32)
    acc = np.zeros(rows * d, np.float32)
    m = np.full(rows, -np.inf, np.float32)
    lv = np.zeros(rows * 16, np.float32)  # each row's running sum, 16 lanes
    info = np.empty((rows, 4), np.int64)
    slopes = np.zeros(rows, np.float32)
    sc = vsplat(scale)
    for r in range(rows):
        p, h, lo, hi = _row_info(r, ng, req, hk, pos0, g0, grp, ctx, kv_len, causal, window)
        info[r, 0] = p
        info[r, 1] = h
        info[r, 2] = lo
        info[r, 3] = hi
        if has_alibi:
            slopes[r] = alibi[h]
        t = qsl[req] + pos0 + r // ng
        for e in range(0, d, 16):
            vstore(qf, r * d + e, vmul(vload(q, t * q_ts + h * q_hs + e), sc))
    if rows > NR:  # several row groups share each K/V super-tile, widened to fp32 once
        _prefill(qf, acc, m, lv, info, slopes, softcap, kc, vc, req, hk, kv_len, bt, b, d,
                 kb_s, kh_s, vb_s, vh_s, v_cs, amx, key_lo, key_hi, rows)  # fmt: skip
    else:
        _decode(qf, acc, m, lv, info, slopes, softcap, kc, vc, req, hk, kv_len, bt, b, d,
                kb_s, kh_s, vb_s, vh_s, v_cs, amx, key_lo, key_hi, rows)  # fmt: skip
    for r in range(rows):
        h = info[r, 1]
        l = vsum(vload(lv, r * 16))
        if part >= 0:  # a split: leave the unnormalised partial for the merge
            slot = part * part_m.shape[1] + r  # part_m/part_l [partials, rows of a slot]
            part_m[part, r] = m[r]
            part_l[part, r] = l
            for e in range(0, d, 16):
                vstore(part_acc, slot * d + e, vload(acc, r * d + e))
            continue
        _finish(out, (qsl[req] + pos0 + r // ng) * o_ts + h * o_hs, acc, r * d, m[r], l,
                sinks, has_sinks, h, d)  # fmt: skip


@jit
def _finish(out, o, acc, a0, m, l, sinks, has_sinks, h, d):
    """out = acc / l (with the sink's extra logit), rounded to the output dtype."""
    scale_acc = 1.0
    if has_sinks:
        sink = to_f32(sinks, h)
        m_new = max(m, sink)
        scale_acc = math.exp(m - m_new) if m > -np.inf else 0.0
        l = l * scale_acc + math.exp(sink - m_new)
    inv = vsplat(scale_acc / l if l > 0.0 else 0.0)
    for e in range(0, d, 16):
        vstore(out, o + e, vmul(vload(acc, a0 + e), inv))


@jit
def _merge(mg, merges, out, qsl, part_m, part_l, part_acc, sinks, has_sinks, hq, hkv, d,
           o_ts, o_hs):  # fmt: skip
    first = merges[mg, M_FIRST]
    count = merges[mg, M_COUNT]
    req = merges[mg, M_REQ]
    hk = merges[mg, M_HK]
    pos0 = merges[mg, M_POS]
    ng = merges[mg, M_NG]
    rows = merges[mg, M_NPOS] * ng
    grp = hq // hkv
    prn = part_m.shape[1]
    acc = np.zeros(d, np.float32)
    for r in range(rows):
        mx = -np.inf
        for i in range(count):
            mx = max(mx, part_m[first + i, r])
        lsum = 0.0
        acc[:] = 0.0
        for i in range(count):
            slot = (first + i) * prn + r
            if part_m[first + i, r] == -np.inf:
                continue
            w = math.exp(part_m[first + i, r] - mx)
            lsum += part_l[first + i, r] * w
            wv = vsplat(w)
            for e in range(0, d, 16):
                vstore(acc, e, vfma(vload(part_acc, slot * d + e), wv, vload(acc, e)))
        h = hk * grp + merges[mg, M_G0] + r % ng
        _finish(out, (qsl[req] + pos0 + r // ng) * o_ts + h * o_hs, acc, 0, mx, lsum, sinks,
                has_sinks, h, d)  # fmt: skip


@jit(parallel=True)
def _attention(q, kc, vc, out, qsl, seq_lens, bt, items, merges, part_m, part_l, part_acc,
               scale, causal, window, softcap, alibi, has_alibi, sinks, has_sinks, hq, hkv,
               d, b, q_ts, q_hs, o_ts, o_hs, kb_s, kh_s, vb_s, vh_s, v_cs, amx):  # fmt: skip
    # dynamic schedule: each thread takes the next item until none are left, so a thread
    # that is slowed (a costlier item, or a vCPU the hypervisor takes away) holds no work
    # the others could do; prange alone would fix each thread's share up front
    n = items.shape[0]
    nxt = np.zeros(1, np.int64)
    for _ in prange(min(n, WORKERS)):  # (more workers than threads: the extra ones find none)
        it = fetch_add(nxt, 0, 1)
        while it < n:
            _item(it, items, q, kc, vc, out, qsl, seq_lens, bt, part_m, part_l, part_acc,
                  scale, causal, window, softcap, alibi, has_alibi, sinks, has_sinks, hq, hkv,
                  d, b, q_ts, q_hs, o_ts, o_hs, kb_s, kh_s, vb_s, vh_s, v_cs, amx)  # fmt: skip
            it = fetch_add(nxt, 0, 1)
    if merges.shape[0] == 0:  # no splits: skip the second parallel region (~5 us)
        return
    for mg in prange(merges.shape[0]):
        _merge(mg, merges, out, qsl, part_m, part_l, part_acc, sinks, has_sinks, hq, hkv, d,
               o_ts, o_hs)  # fmt: skip


# ---------------------------------------------------------------------------------------
# plan


@dataclass(frozen=True, eq=False)
class AttentionPlan:
    """The work split of one step, built and validated once, reused by every layer.

    ``items [n, 9]`` int64: request, kv head, first query position, positions, first q
    head of the group, heads, key range [lo, hi), partial slot (-1: writes the output).
    ``merges [m, 8]``: first partial slot, count, and the rows they merge into.
    """

    items: np.ndarray
    merges: np.ndarray
    num_partials: int
    part_rows: int  # rows of a partial slot: the most rows of a split item
    num_requests: int
    num_tokens: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    causal: bool
    sliding_window: int
    isa: str
    # (tensor, its version counter, num_blocks) of a block table validated with the plan
    block_table_checked: tuple | None = None

    def blocks_visited(self):
        """Cache blocks read per kv head (an item's key range, in blocks)."""
        lo = self.items[:, I_LO] // self.block_size
        hi = (self.items[:, I_HI] + self.block_size - 1) // self.block_size
        return int(np.maximum(hi - lo, 0).sum())

    def partial_buffers(self):
        """Workspaces of the splits' partial results: (max, sum) ``[partials, rows]`` and
        accumulators ``[partials * rows * head_dim]`` fp32."""
        shape = (max(self.num_partials, 1), self.part_rows)
        n = shape[0] * shape[1]
        return (np.empty(shape, np.float32), np.empty(shape, np.float32),
                np.empty(n * self.head_dim, np.float32))  # fmt: skip


def _check_config(num_heads, num_kv_heads, head_dim, block_size, sliding_window, isa):
    hq = C.check_int("num_heads", num_heads, low=1)
    hkv = C.check_int("num_kv_heads", num_kv_heads, low=1)
    if hq % hkv:
        raise ValueError(f"num_heads: expected a multiple of num_kv_heads={hkv}, got {hq}")
    if isa not in ATTN_ISAS:
        raise ValueError(f"isa: expected one of {ATTN_ISAS}, got {isa!r}")
    d = C.check_int("head_dim", head_dim, low=16)
    dmul = 32 if isa == "amx" else 16
    if d % dmul or d > 512:
        raise ValueError(f"head_dim: expected a multiple of {dmul} up to 512 for {isa}, got {d}")
    b = C.check_int("block_size", block_size, low=1)
    if b % BLOCK_MULTIPLE[isa]:
        raise ValueError(
            f"block_size: expected a multiple of {BLOCK_MULTIPLE[isa]} for isa {isa!r}, got {b}"
        )
    w = C.check_int("sliding_window", sliding_window)
    if w == 0 or w < -1:
        raise ValueError(f"sliding_window: expected -1 (none) or >= 1, got {w}")
    return hq, hkv, d, b, w


def _index_array(name, x, dtype, ndim):
    C.check_dtype(name, x, (dtype,))
    C.check_ndim(name, x, (ndim,))
    return C.as_torch(x).contiguous()


def plan_attention(query_start_loc, seq_lens, *, num_heads, num_kv_heads, head_dim,
                   block_size, causal=True, sliding_window=-1, isa, num_threads=None,
                   block_table=None, num_blocks=None):  # fmt: skip
    """Validate a step's request layout and split its attention into work items.

    ``query_start_loc [R+1]`` int32 (non-decreasing, from 0), ``seq_lens [R]`` int32
    (each >= its q_len). The plan is reused by every layer's :func:`paged_attention` of
    the step; ``num_threads`` (default: Numba's) decides how far long ranges are split.
    With ``block_table`` and ``num_blocks`` the table is validated here, once, and the
    layers' calls with this plan and this (unmodified) table skip that check.
    """
    hq, hkv, d, b, w = _check_config(num_heads, num_kv_heads, head_dim, block_size,
                                     sliding_window, isa)  # fmt: skip
    qsl = _index_vector("query_start_loc", query_start_loc)
    sl = _index_vector("seq_lens", seq_lens)
    r_n = sl.shape[0]
    if qsl.shape[0] != r_n + 1:
        raise ValueError(f"query_start_loc: expected {r_n + 1} entries (R+1), got {qsl.shape[0]}")
    grp = hq // hkv
    cap = max(NR, NRI * 128 // max(d, 128))  # rows per item: acc and q stay L2-sized
    ng = min(grp, cap)
    npos_max = max(1, cap // ng)
    threads = numba.get_num_threads() if num_threads is None else int(num_threads)
    items, merges, n_part, part_rows, fault = _plan(qsl, sl, hkv, grp, ng, npos_max, w,
                                                    bool(causal), ITEMS_PER_THREAD * threads,
                                                    SPLIT_KEYS)  # fmt: skip
    if fault:
        _raise_lengths(qsl, sl)
    checked = None
    if block_table is not None:
        nb = C.check_int("num_blocks", num_blocks, low=1)
        bt = _check_block_table(block_table, seq_lens, b, nb, r_n)
        if bt is block_table:  # already an int32 contiguous tensor: remember it
            checked = (block_table, block_table._version, nb)
    return AttentionPlan(items=items, merges=merges, num_partials=n_part, part_rows=part_rows,
                         num_requests=r_n,
                         num_tokens=int(qsl[-1]) if r_n else 0, num_heads=hq,
                         num_kv_heads=hkv, head_dim=d, block_size=b, causal=bool(causal),
                         sliding_window=w, isa=isa, block_table_checked=checked)  # fmt: skip


def _index_vector(name, x):
    """An int32 vector (tensor or array) as a contiguous int64 NumPy copy."""
    C.check_dtype(name, x, (torch.int32,))
    C.check_ndim(name, x, (1,))
    return C.as_numpy(x).astype(np.int64)


def _raise_lengths(qsl, sl):
    """The ValueError for query_start_loc/seq_lens that ``_plan`` found inconsistent."""
    if qsl[0] != 0:
        raise ValueError(f"query_start_loc: expected to start at 0, got {qsl[0]}")
    q_len = np.diff(qsl)
    if (q_len < 0).any():
        r = int(np.argmax(q_len < 0))
        raise ValueError(
            f"query_start_loc: expected non-decreasing, got {qsl[r]} then {qsl[r + 1]}"
        )
    r = int(np.argmax(q_len > sl))
    raise ValueError(f"seq_lens: request {r} has q_len {q_len[r]} > seq_len {sl[r]}")


@jit
def _plan(qsl, sl, hkv, grp, ng, npos_max, w, causal, target, split_keys):
    """A step's items, split to ``target``: (items, merges, partial slots, rows of a
    partial slot, fault). One Numba call: as NumPy and torch ops (~5-15 us each here)
    the plan cost 0.3-0.45 ms of a decode step. ``fault``: query_start_loc does not
    start at 0, decreases, or gives a request more queries than keys (nothing planned).
    """
    r_n = sl.shape[0]
    q_len = np.empty(r_n, np.int64)
    fault = qsl[0] != 0
    for r in range(r_n):
        q_len[r] = qsl[r + 1] - qsl[r]
        fault = fault or q_len[r] < 0 or q_len[r] > sl[r]
    if fault:
        empty = np.zeros((0, 9), np.int64)
        return empty, np.zeros((0, 8), np.int64), 0, 1, True
    items, merges, n_part = _split(_plan_items(q_len, sl, hkv, grp, ng, npos_max, w, causal),
                                   target, split_keys)  # fmt: skip
    part_rows = 1
    for i in range(items.shape[0]):
        if items[i, I_PART] >= 0:
            part_rows = max(part_rows, items[i, I_NPOS] * items[i, I_NG])
    return items, merges, n_part, part_rows, False


@jit
def _plan_items(q_len, kv_len, hkv, grp, ng, npos_max, w, causal):
    """Items ``[n, 9]`` of requests with these query and key lengths: per request, kv
    head and group of ``ng`` q heads, runs of ``npos_max`` query positions with their
    key range. A step's plan in Numba: the NumPy version cost ~0.2 ms a decode step."""
    n = 0
    for r in range(q_len.shape[0]):
        n += (q_len[r] + npos_max - 1) // npos_max * hkv * ((grp + ng - 1) // ng)
    items = np.empty((n, 9), np.int64)
    i = 0
    for r in range(q_len.shape[0]):
        ql = q_len[r]
        kl = kv_len[r]
        for hk in range(hkv):
            for g0 in range(0, grp, ng):
                for pos0 in range(0, ql, npos_max):
                    npos = min(npos_max, ql - pos0)
                    first = kl - ql + pos0
                    last = first + npos - 1
                    lo = max(0, first - w + 1) if w > 0 else 0
                    if causal:
                        hi = last + 1
                    elif w > 0:
                        hi = min(kl, last + w)
                    else:
                        hi = kl
                    it = items[i]
                    it[I_REQ], it[I_HK], it[I_POS], it[I_NPOS] = r, hk, pos0, npos
                    it[I_G0], it[I_NG], it[I_LO], it[I_HI] = g0, min(ng, grp - g0), lo, hi
                    it[I_PART] = -1
                    i += 1
    return items


@jit
def _split(items, target, split_keys):
    """Split long key ranges until there are ``target`` items (or ranges get short):
    (items, merges ``[m, 8]``, partial slots)."""
    n = items.shape[0]
    if n == 0 or n >= target:
        return items, np.zeros((0, 8), np.int64), 0
    want = (target + n - 1) // n
    steps = np.zeros(n, np.int64)  # keys per piece of a split item (0: kept whole)
    count = 0
    n_merge = 0
    for i in range(n):
        span = items[i, I_HI] - items[i, I_LO]
        pieces = min(want, span // split_keys)
        if pieces <= 1:
            count += 1
            continue
        step = (span + pieces - 1) // pieces
        steps[i] = step + (KT - step % KT) % KT  # split points on tile boundaries
        count += (span + steps[i] - 1) // steps[i]
        n_merge += 1
    out = np.empty((count, 9), np.int64)
    merges = np.empty((n_merge, 8), np.int64)
    j = 0
    m = 0
    n_part = 0
    for i in range(n):
        if steps[i] == 0:
            out[j] = items[i]
            j += 1
            continue
        first = n_part
        for lo in range(items[i, I_LO], items[i, I_HI], steps[i]):
            out[j] = items[i]
            out[j, I_LO] = lo
            out[j, I_HI] = min(lo + steps[i], items[i, I_HI])
            out[j, I_PART] = n_part
            n_part += 1
            j += 1
        it = items[i]
        mg = merges[m]
        mg[M_FIRST], mg[M_COUNT], mg[M_REQ], mg[M_HK] = first, n_part - first, it[I_REQ], it[I_HK]
        mg[M_POS], mg[M_NPOS], mg[M_G0], mg[M_NG] = it[I_POS], it[I_NPOS], it[I_G0], it[I_NG]
        m += 1
    return out, merges, n_part


# ---------------------------------------------------------------------------------------
# public ops


def _flat(name, x, carrier_pairs):
    """The cache view's memory as one 1-D array from its first element, and its strides
    in elements (``carrier_pairs``: viewed as uint32 bf16 pairs; strides still count
    16-bit elements)."""
    st = C.strides_of(x)
    span = (x.shape[0] - 1) * st[0] + (x.shape[1] - 1) * st[1] + x.shape[2] * x.shape[3]
    flat = C.as_numpy(x.as_strided((span,), (1,)))
    if carrier_pairs:
        return flat.view(np.uint32), st[0], st[1]
    return flat, st[0], st[1]


def _check_cache(name, cache, dtype, shape, isa):
    C.check_dtype(name, cache, C.FLOATS)
    if not isinstance(cache, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor view of the KV cache")
    if dtype is not None and cache.dtype != dtype:
        raise TypeError(
            f"{name}: expected dtype {C.dtype_name(dtype)}, got {C.dtype_name(cache.dtype)}"
        )
    C.check_ndim(name, cache, (4,))
    if shape is not None:
        C.check_shape(name, cache, shape)
    nb, hkv, b, d = cache.shape
    st = cache.stride()
    if st[3] != 1 or st[2] != d:
        raise ValueError(
            f"{name}: expected each (block, head) half-slab contiguous (strides [*, *, {d}, 1]), "
            f"got strides {list(st)}"
        )
    if isa == "amx" and cache.dtype != torch.bfloat16:
        raise TypeError(
            f"{name}: isa 'amx' needs a bfloat16 cache, got {C.dtype_name(cache.dtype)}"
        )
    return nb, hkv, b, d


def reshape_and_cache(key, value, key_cache, value_cache, slot_mapping, isa):
    """Write ``key``/``value [T, Hkv, D]`` into the cache at ``slot_mapping [T]`` (int64;
    slot s -> block s // B, offset s % B; negative slots are skipped) in ``isa``'s layout.
    """
    if isa not in ATTN_ISAS:
        raise ValueError(f"isa: expected one of {ATTN_ISAS}, got {isa!r}")
    nb, hkv, b, d = _check_cache("key_cache", key_cache, None, None, isa)
    _check_cache("value_cache", value_cache, key_cache.dtype, (nb, hkv, b, d), isa)
    _check_config(hkv, hkv, d, b, -1, isa)
    for name, x in (("key", key), ("value", value)):
        C.check_same_dtype(name, x, key_cache.dtype, "the cache")
        C.check_ndim(name, x, (3,))
        C.check_inner_contiguous(name, x)
    t_n = key.shape[0]
    C.check_shape("key", key, (t_n, hkv, d))
    C.check_shape("value", value, (t_n, hkv, d))
    C.check_dtype("slot_mapping", slot_mapping, (torch.int64,))
    C.check_shape("slot_mapping", slot_mapping, (t_n,))
    slots = C.as_torch(slot_mapping).contiguous()
    if t_n and int(slots.max()) >= nb * b:
        raise ValueError(
            f"slot_mapping: expected slots < num_blocks * block_size = {nb * b}, "
            f"got {int(slots.max())}"
        )
    if t_n == 0:
        return
    amx = isa == "amx"
    kc, kb_s, kh_s = _flat("key_cache", key_cache, False)
    vc, vb_s, vh_s = _flat("value_cache", value_cache, False)
    ks, vs = C.strides_of(key), C.strides_of(value)
    kspan = C.as_torch(key).as_strided(((t_n - 1) * ks[0] + (hkv - 1) * ks[1] + d,), (1,))
    vspan = C.as_torch(value).as_strided(((t_n - 1) * vs[0] + (hkv - 1) * vs[1] + d,), (1,))
    _reshape_and_cache(C.as_numpy(kspan), C.as_numpy(vspan), kc, vc, slots.numpy(), t_n, hkv,
                       d, b, ks[0], ks[1], vs[0], vs[1], kb_s, kh_s, vb_s, vh_s, amx)  # fmt: skip


@jit
def _table_ok(bt, sl, b, nb):
    """Whether each request's blocks in use (``ceil(seq_len / b)`` of its row) are in the
    table and in [0, nb). One Numba call (as NumPy ops: ~50 us of a decode step)."""
    for r in range(bt.shape[0]):
        need = (sl[r] + b - 1) // b
        if need > bt.shape[1]:
            return False
        for j in range(need):
            if bt[r, j] < 0 or bt[r, j] >= nb:
                return False
    return True


def _check_block_table(block_table, seq_lens, b, nb, r_n):
    bt = _index_array("block_table", block_table, torch.int32, 2)
    if bt.shape[0] != r_n:
        raise ValueError(f"block_table: expected {r_n} rows (one per request), got {bt.shape[0]}")
    sl = _index_vector("seq_lens", seq_lens)
    if sl.shape[0] != r_n:
        raise ValueError(f"seq_lens: expected {r_n} entries (one per request), got {sl.shape[0]}")
    if _table_ok(C.as_numpy(bt), sl, b, nb):
        return bt
    # the fault, named (NumPy: a step's tables are small, each torch op costs ~10-20 us)
    need = (sl + b - 1) // b
    if r_n and int(need.max()) > bt.shape[1]:
        r = int(np.argmax(need))
        raise ValueError(
            f"seq_lens: request {r} needs {int(need[r])} blocks of {b}, but block_table holds "
            f"{bt.shape[1]} per request"
        )
    used = np.arange(bt.shape[1])[None, :] < need[:, None]
    vals = bt.numpy()[used]
    if vals.size and (int(vals.min()) < 0 or int(vals.max()) >= nb):
        raise ValueError(
            f"block_table: expected entries in [0, {nb}) for the blocks in use, got range "
            f"[{int(vals.min())}, {int(vals.max())}]"
        )
    return bt


def paged_attention(query, key_cache, value_cache, output, query_start_loc, seq_lens,
                    block_table, *, scale, causal=True, sliding_window=-1, softcap=0.0,
                    alibi_slopes=None, sinks=None, isa, plan=None):  # fmt: skip
    """Attention of a varlen batch over the paged cache, into ``output`` (module docstring)."""
    C.check_dtype("query", query, C.FLOATS)
    C.check_ndim("query", query, (3,))
    C.check_inner_contiguous("query", query)
    t_n, hq, d = query.shape
    nb, hkv, b, dk = _check_cache("key_cache", key_cache, query.dtype, None, isa)
    _check_cache("value_cache", value_cache, query.dtype, (nb, hkv, b, dk), isa)
    if dk != d:
        raise ValueError(f"key_cache: expected head_dim {d} (that of query), got {dk}")
    C.check_same_dtype("output", output, query.dtype, "query")
    C.check_shape("output", output, (t_n, hq, d))
    C.check_inner_contiguous("output", output)
    if plan is None:
        plan = plan_attention(query_start_loc, seq_lens, num_heads=hq, num_kv_heads=hkv,
                              head_dim=d, block_size=b, causal=causal,
                              sliding_window=sliding_window, isa=isa)  # fmt: skip
    else:
        want = (plan.num_heads, plan.num_kv_heads, plan.head_dim, plan.block_size,
                plan.causal, plan.sliding_window, plan.isa)  # fmt: skip
        got = (hq, hkv, d, b, bool(causal), sliding_window, isa)
        if want != got:
            raise ValueError(
                f"plan: built for (heads, kv heads, head_dim, block_size, causal, window, isa)"
                f" = {want}, used with {got}"
            )
        shapes = (tuple(query_start_loc.shape), tuple(seq_lens.shape), t_n)
        if shapes != ((plan.num_requests + 1,), (plan.num_requests,), plan.num_tokens):
            raise ValueError(
                f"plan: built for {plan.num_requests} requests and {plan.num_tokens} tokens, "
                f"used with query_start_loc {list(query_start_loc.shape)}, seq_lens "
                f"{list(seq_lens.shape)} and {t_n} tokens"
            )
    if plan.num_tokens != t_n:
        raise ValueError(
            f"query: expected {plan.num_tokens} tokens (query_start_loc[-1]), got {t_n}"
        )
    ck = plan.block_table_checked
    if ck is not None and ck[0] is block_table and ck[1] == block_table._version and ck[2] == nb:
        bt = block_table  # validated with the plan, unmodified since
    else:
        bt = _check_block_table(block_table, seq_lens, b, nb, plan.num_requests)
    extras = _extras(alibi_slopes, sinks, hq)
    if t_n == 0 or plan.items.shape[0] == 0:
        return
    amx = isa == "amx"
    kc, kb_s, kh_s = _flat("key_cache", key_cache, amx)
    vc, vb_s, vh_s = _flat("value_cache", value_cache, amx)
    qs, os_ = C.strides_of(query), C.strides_of(output)
    qspan = C.as_torch(query).as_strided(((t_n - 1) * qs[0] + (hq - 1) * qs[1] + d,), (1,))
    ospan = C.as_torch(output).as_strided(((t_n - 1) * os_[0] + (hq - 1) * os_[1] + d,), (1,))
    _launch(plan, C.as_numpy(qspan), (qs[0], qs[1]), C.as_numpy(ospan), (os_[0], os_[1]),
            (kc, kb_s, kh_s), (vc, vb_s, vh_s), C.as_torch(query_start_loc).long().numpy(),
            C.as_numpy(C.as_torch(seq_lens)), C.as_numpy(bt), scale, softcap, extras,
            bool(causal), int(sliding_window), hkv, b, amx)  # fmt: skip


def _extras(alibi_slopes, sinks, hq):
    """Validated ALiBi slopes and sinks as fp32 arrays (empty when absent) and their flags."""
    empty = np.zeros(0, np.float32)
    alibi = sink_a = empty
    if alibi_slopes is not None:
        C.check_dtype("alibi_slopes", alibi_slopes, (torch.float32,))
        C.check_shape("alibi_slopes", alibi_slopes, (hq,))
        alibi = C.as_numpy(C.as_torch(alibi_slopes).contiguous())
    if sinks is not None:
        C.check_dtype("sinks", sinks, (torch.float32, torch.bfloat16))
        C.check_shape("sinks", sinks, (hq,))
        sink_a = C.as_numpy(C.as_torch(sinks).float().contiguous())
    return alibi, alibi_slopes is not None, sink_a, sinks is not None


def _launch(plan, q, q_st, out, o_st, kcache, vcache, qsl, sl, bt, scale, softcap, extras,
            causal, window, hkv, b, amx):  # fmt: skip
    """Run the kernel for a validated call: partial buffers for the plan's splits."""
    d = plan.head_dim
    part_m, part_l, part_acc = plan.partial_buffers()
    kc, kb_s, kh_s = kcache
    vc, vb_s, vh_s = vcache
    _attention(q, kc, vc, out, qsl, sl, bt, plan.items, plan.merges, part_m, part_l, part_acc,
               float(scale), causal, window, float(softcap), *extras, plan.num_heads, hkv, d,
               b, q_st[0], q_st[1], o_st[0], o_st[1], kb_s, kh_s, vb_s, vh_s, b * 16,
               amx)  # fmt: skip


# ---------------------------------------------------------------------------------------
# the engine's fast path: a layer's cache and a step's indices, each validated once


@dataclass(frozen=True, eq=False)
class StepIndices:
    """A step's indices as validated NumPy arrays, shared by every layer of the step.

    Built by :func:`step_indices`; ``query_start_loc``/``seq_lens``/``block_table``/
    ``slot_mapping`` as in :func:`paged_attention` and :func:`reshape_and_cache`.
    """

    plan: AttentionPlan
    qsl: np.ndarray  # [R+1] int64
    seq_lens: np.ndarray  # [R] int32
    block_table: np.ndarray  # [R, max_blocks] int32
    slots: np.ndarray  # [T] int64
    num_blocks: int


def step_indices(plan, query_start_loc, seq_lens, block_table, slot_mapping, num_blocks):
    """Validate a step's indices once (block table entries and slots against
    ``num_blocks``) for :class:`PagedLayerCache` calls with ``plan``."""
    nb = C.check_int("num_blocks", num_blocks, low=1)
    bt = _check_block_table(block_table, seq_lens, plan.block_size, nb, plan.num_requests)
    C.check_dtype("slot_mapping", slot_mapping, (torch.int64,))
    C.check_shape("slot_mapping", slot_mapping, (plan.num_tokens,))
    slots = np.ascontiguousarray(C.as_numpy(slot_mapping))
    if plan.num_tokens and int(slots.max()) >= nb * plan.block_size:
        raise ValueError(
            f"slot_mapping: expected slots < num_blocks * block_size = "
            f"{nb * plan.block_size}, got {int(slots.max())}"
        )
    qsl = _index_vector("query_start_loc", query_start_loc)
    sl = np.ascontiguousarray(C.as_numpy(seq_lens))  # int32 [R], checked with the table
    if qsl.shape[0] != plan.num_requests + 1:
        raise ValueError(
            f"plan: built for {plan.num_requests} requests, used with query_start_loc "
            f"{list(qsl.shape)}, seq_lens {list(sl.shape)}"
        )
    return StepIndices(plan, qsl, sl, C.as_numpy(bt), slots, nb)


class PagedLayerCache:
    """One layer's KV cache (a ``kv_cache_shape`` tensor) validated once for ``isa``.

    ``write`` and ``attend`` check only the tensors that change per call (dtype, shape,
    contiguity of key/value/query/output); the indices come from :func:`step_indices`.
    A decode step calls them once per layer, where :func:`reshape_and_cache` and
    :func:`paged_attention`, re-deriving views and re-checking everything, cost
    ~0.3 ms each in Python on a 2-core machine.
    """

    def __init__(self, kv_cache, isa):
        if isa not in ATTN_ISAS:
            raise ValueError(f"isa: expected one of {ATTN_ISAS}, got {isa!r}")
        self.key_cache, self.value_cache = split_kv_cache(kv_cache)
        nb, hkv, b, d = _check_cache("kv_cache", self.key_cache, None, None, isa)
        _check_config(hkv, hkv, d, b, -1, isa)
        self.num_blocks, self.hkv, self.b, self.d, self.isa = nb, hkv, b, d, isa
        self.dtype = kv_cache.dtype
        self.amx = isa == "amx"
        # element views (writes) and the kernel's carrier views (reads: pairs for amx)
        self._kw, self._kwb, self._kwh = _flat("key_cache", self.key_cache, False)
        self._vw, self._vwb, self._vwh = _flat("value_cache", self.value_cache, False)
        self._kr, self._krb, self._krh = _flat("key_cache", self.key_cache, self.amx)
        self._vr, self._vrb, self._vrh = _flat("value_cache", self.value_cache, self.amx)

    def _check(self, name, x, shape):
        if not (isinstance(x, torch.Tensor) and x.dtype == self.dtype and x.is_cpu
                and tuple(x.shape) == shape and x.is_contiguous()):  # fmt: skip
            C.check_same_dtype(name, x, self.dtype, "the cache")
            C.check_shape(name, x, shape)
            C.check_contiguous(name, x)

    def _check_plan(self, plan, idx):
        if (plan.num_kv_heads, plan.head_dim, plan.block_size, plan.isa) != (
            self.hkv,
            self.d,
            self.b,
            self.isa,
        ) or idx.num_blocks != self.num_blocks:
            raise ValueError(
                f"plan: built for kv heads {plan.num_kv_heads}, head_dim {plan.head_dim}, "
                f"block {plan.block_size}, isa {plan.isa!r} and {idx.num_blocks} blocks; this "
                f"cache has {self.hkv}, {self.d}, {self.b}, {self.isa!r}, {self.num_blocks}"
            )

    def write(self, key, value, idx):
        """Write ``key``/``value [T, Hkv, D]`` (contiguous) at the step's slots."""
        self._check_plan(idx.plan, idx)
        t_n = idx.plan.num_tokens
        self._check("key", key, (t_n, self.hkv, self.d))
        self._check("value", value, (t_n, self.hkv, self.d))
        if t_n == 0:
            return
        hd = self.hkv * self.d
        _reshape_and_cache(C.as_numpy(key).reshape(-1), C.as_numpy(value).reshape(-1),
                           self._kw, self._vw, idx.slots, t_n, self.hkv, self.d, self.b, hd,
                           self.d, hd, self.d, self._kwb, self._kwh, self._vwb, self._vwh,
                           self.amx)  # fmt: skip

    def attend(self, query, output, idx, *, scale, softcap=0.0, alibi_slopes=None,
               sinks=None):  # fmt: skip
        """``paged_attention`` of ``query [T, Hq, D]`` into ``output`` with the step's plan."""
        plan = idx.plan
        self._check_plan(plan, idx)
        t_n, hq, d = plan.num_tokens, plan.num_heads, self.d
        self._check("query", query, (t_n, hq, d))
        self._check("output", output, (t_n, hq, d))
        extras = _extras(alibi_slopes, sinks, hq)
        if t_n == 0 or plan.items.shape[0] == 0:
            return
        _launch(plan, C.as_numpy(query).reshape(-1), (hq * d, d), C.as_numpy(output).reshape(-1),
                (hq * d, d), (self._kr, self._krb, self._krh), (self._vr, self._vrb, self._vrh),
                idx.qsl, idx.seq_lens, idx.block_table, scale, softcap, extras, plan.causal,
                plan.sliding_window, self.hkv, self.b, self.amx)  # fmt: skip
