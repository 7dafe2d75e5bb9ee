"""Register tiles of the attention kernels: Q·K scores, P·V accumulation, staging.

A tile is 32 keys of one (request, kv head): half A (keys j0..j0+15) and half B
(j0+16..j0+31), each with its own offsets (:class:`Tile`), so a ``vec16`` tile may
straddle two blocks. Scores of a row are two 16-lane vectors, (A, B).

The K/V memory (:class:`Source`) is the cache or a super-tile staged in fp32. Its carrier
dtype decides the layout at compile time, in two small load helpers, so each tile has one
body for both layouts (as ``numkern._tiles.load_k2`` does for the GEMM weights):

* :func:`k_pair` — the (even dim, odd dim) K vectors of one dim pair for 16 keys: the
  plain layout (``K[d*B + t]``, any 16-bit or fp32 carrier) loads rows 2e and 2e+1; the
  ``amx`` layout (``uint32`` bf16 pairs, ``[D/2][16][2]``) loads one pair vector;
* :func:`v_pair` — the V vectors of 16 dims for one key pair (2t, 2t+1): plain rows
  ``V[t*D + d]``, or one pair vector of the ``amx`` layout ``[B/2][16][2]`` per 16 dims.

Walking dims (and keys) in pairs in both layouts keeps each accumulator's FMA order that
of a walk one by one, so the plain layout's results are the ones a per-dim loop gives.
Offsets are in elements of the 16-bit (or fp32) cache; the pair loads halve them.

A prefill group's tiles are this CPU's row of ``isa.PREFILL_TILES`` (:data:`PREFILL`):
:func:`qk_group` and :func:`pv_group` compile :func:`qk8` / :func:`pv4` (16 zmm
accumulators) with AVX-512 and :func:`qk6` / :func:`pv6` (12 ymm) without it, the same
FMAs in the same order per accumulator, so the same bits.
"""

from typing import NamedTuple

import numpy as np
from numba import types
from numba.extending import overload

from .. import isa as _isa
from .._jit import jit
from ..simd import (
    prefetch,
    vbcast,
    vfma,
    vload,
    vload_pairs,
    vmul,
    vselect_lt,
    vsplat,
    vstore,
)

KT = 32  # keys per tile: two 16-lane score vectors per row
# The prefill's register tiles on this CPU's vector registers (isa.PREFILL_TILES): a
# constant of the compiled code, so one build compiles one set of tiles
PREFILL = _isa.prefill_tiles()[0]


class Tile(NamedTuple):
    """Offsets of a 32-key tile's halves in its :class:`Source` and their key counts."""

    ka: int  # K of half A
    kb: int  # K of half B
    va: int  # V of half A
    vb: int  # V of half B
    nva: int  # keys of half A that exist (P·V reads no others: an unwritten slot may be NaN)
    nvb: int


class Source(NamedTuple):
    """The K/V memory a tile reads: the cache (carrier views) or a staged super-tile."""

    kc: np.ndarray  # K: uint32 bf16 pairs (amx) or 16-bit/fp32 elements
    vc: np.ndarray  # V: same carrier
    k_step: int  # plain K: elements between the rows of two dims (block size, or keys staged)
    v_chunk: int  # amx V: elements between 16-dim groups (16 * block size)


def k_pair(kc, ka, k_step, d2):
    """(even-dim, odd-dim) fp32 K vectors of dim pair ``d2`` for 16 keys at ``ka``."""


@overload(k_pair, inline="always")
def _k_pair(kc, ka, k_step, d2):
    if kc.dtype == types.uint32:  # amx: K[(d//2)*32 + t*2 + d%2]
        return lambda kc, ka, k_step, d2: vload_pairs(kc, (ka >> 1) + d2 * 16)
    return lambda kc, ka, k_step, d2: (
        vload(kc, ka + 2 * d2 * k_step),
        vload(kc, ka + (2 * d2 + 1) * k_step),
    )


def v_pair(vc, va, d, v_chunk, tp, c):
    """fp32 V vectors of dims ``c..c+15`` for keys ``2*tp`` and ``2*tp + 1`` of a half."""


@overload(v_pair, inline="always")
def _v_pair(vc, va, d, v_chunk, tp, c):
    if vc.dtype == types.uint32:  # amx: V[(d//16)*B*16 + (t//2)*32 + (d%16)*2 + t%2]
        return lambda vc, va, d, v_chunk, tp, c: vload_pairs(
            vc, ((va + (c // 16) * v_chunk) >> 1) + tp * 16
        )
    return lambda vc, va, d, v_chunk, tp, c: (
        vload(vc, va + 2 * tp * d + c),
        vload(vc, va + (2 * tp + 1) * d + c),
    )


def prefetch_next(src, nxt, d2):
    """Dim pair ``d2``'s share of the next tile's lines: its K rows of both halves and
    1/(d/2) of its V (``d/2`` calls cover the whole tile)."""


@overload(prefetch_next, inline="always")
def _prefetch_next(src, nxt, d2):
    if src.types[0].dtype == types.uint32:  # the K carrier (field kc)

        def impl(src, nxt, d2):
            prefetch(src.kc, (nxt.ka >> 1) + d2 * 16)
            prefetch(src.kc, (nxt.kb >> 1) + d2 * 16)
            o = d2 * 32  # 64 bytes of the half's V: 256 elements per 16-dim group
            c = o // 256
            w = o % 256
            prefetch(src.vc, (nxt.va + c * src.v_chunk + w) >> 1)
            prefetch(src.vc, (nxt.vb + c * src.v_chunk + w) >> 1)

        return impl

    def impl(src, nxt, d2):
        b = src.k_step
        prefetch(src.kc, nxt.ka + 2 * d2 * b)
        prefetch(src.kc, nxt.kb + 2 * d2 * b)
        prefetch(src.kc, nxt.ka + (2 * d2 + 1) * b)
        prefetch(src.kc, nxt.kb + (2 * d2 + 1) * b)
        prefetch(src.vc, nxt.va + d2 * 32)
        prefetch(src.vc, nxt.vb + d2 * 32)
        prefetch(src.vc, nxt.va + d2 * 32 + 16)
        prefetch(src.vc, nxt.vb + d2 * 32 + 16)

    return impl


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


@jit
def qk4(qf, qr, d, src, t, sbuf, nxt, do_pf):
    """Scores of 4 (possibly repeated) rows (``qf`` offsets ``qr[0:4]``) against tile ``t``
    into ``sbuf[i*32 : (i+1)*32]``; with ``do_pf``, prefetch tile ``nxt``."""
    q0, q1, q2, q3 = qr[0], qr[1], qr[2], qr[3]
    a0 = a1 = a2 = a3 = b0 = b1 = b2 = b3 = vsplat(0.0)
    for d2 in range(d // 2):
        xe, xo = k_pair(src.kc, t.ka, src.k_step, d2)
        ye, yo = k_pair(src.kc, t.kb, src.k_step, d2)
        if do_pf:
            prefetch_next(src, nxt, d2)
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


@jit
def qk8(qf, qr, d, src, t, sbuf, so, ss, nxt, do_pf):
    """Scores of 8 rows (``qf`` offsets ``qr[0:8]``) against tile ``t`` into ``sbuf`` at
    ``so`` (row stride ``ss``); with ``do_pf``, prefetch tile ``nxt``."""
    q0, q1, q2, q3, q4, q5, q6, q7 = qr[0], qr[1], qr[2], qr[3], qr[4], qr[5], qr[6], qr[7]
    a0 = a1 = a2 = a3 = a4 = a5 = a6 = a7 = vsplat(0.0)
    b0 = b1 = b2 = b3 = b4 = b5 = b6 = b7 = vsplat(0.0)
    for d2 in range(d // 2):
        xe, xo = k_pair(src.kc, t.ka, src.k_step, d2)
        ye, yo = k_pair(src.kc, t.kb, src.k_step, d2)
        if do_pf:
            prefetch_next(src, nxt, d2)
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


@jit
def qk6(qf, qr, d, src, ka, sbuf, so, ss):
    """Scores of 6 rows (``qf`` offsets ``qr[0:6]``) against the 16 keys at ``ka`` of
    ``src`` into ``sbuf`` at ``so`` (row stride ``ss``): the AVX2 tile (12 ymm of
    accumulators, isa.PREFILL_TILES). Each accumulator sees the FMAs of :func:`qk8` in its
    order; the rows take a dim pair's even dim before its odd one, so the odd dim's K
    vector is loaded once the even one is dead (16 ymm in all)."""
    q0, q1, q2, q3, q4, q5 = qr[0], qr[1], qr[2], qr[3], qr[4], qr[5]
    a0 = a1 = a2 = a3 = a4 = a5 = vsplat(0.0)
    for d2 in range(d // 2):
        xe, xo = k_pair(src.kc, ka, src.k_step, d2)
        e = 2 * d2
        a0 = vfma(vbcast(qf, q0 + e), xe, a0)
        a1 = vfma(vbcast(qf, q1 + e), xe, a1)
        a2 = vfma(vbcast(qf, q2 + e), xe, a2)
        a3 = vfma(vbcast(qf, q3 + e), xe, a3)
        a4 = vfma(vbcast(qf, q4 + e), xe, a4)
        a5 = vfma(vbcast(qf, q5 + e), xe, a5)
        a0 = vfma(vbcast(qf, q0 + e + 1), xo, a0)
        a1 = vfma(vbcast(qf, q1 + e + 1), xo, a1)
        a2 = vfma(vbcast(qf, q2 + e + 1), xo, a2)
        a3 = vfma(vbcast(qf, q3 + e + 1), xo, a3)
        a4 = vfma(vbcast(qf, q4 + e + 1), xo, a4)
        a5 = vfma(vbcast(qf, q5 + e + 1), xo, a5)
    vstore(sbuf, so, a0)
    vstore(sbuf, so + ss, a1)
    vstore(sbuf, so + 2 * ss, a2)
    vstore(sbuf, so + 3 * ss, a3)
    vstore(sbuf, so + 4 * ss, a4)
    vstore(sbuf, so + 5 * ss, a5)


@jit
def stage(src, t, d, ks, k0, kst, vs, v0):
    """Tile ``t`` of ``src`` widened to fp32 for the row groups of an item to share: K
    transposed at ``ks[k0 + e*kst : +32]`` (dim e), V rows at ``vs[v0 + j*d : +d]``. Rows
    of keys that do not exist are left as they are (P·V never reads them)."""
    for d2 in range(d // 2):
        xe, xo = k_pair(src.kc, t.ka, src.k_step, d2)
        ye, yo = k_pair(src.kc, t.kb, src.k_step, d2)
        vstore(ks, k0 + 2 * d2 * kst, xe)
        vstore(ks, k0 + 2 * d2 * kst + 16, ye)
        vstore(ks, k0 + (2 * d2 + 1) * kst, xo)
        vstore(ks, k0 + (2 * d2 + 1) * kst + 16, yo)
    stage_v(src, t, d, vs, v0)


@jit
def stage_v(src, t, d, vs, v0):
    """Tile ``t``'s V rows widened to fp32 at ``vs[v0 + j*d : +d]`` (keys that exist)."""
    for h in range(2):
        va = t.va if h == 0 else t.vb
        n = t.nva if h == 0 else t.nvb
        for tp in range((n + 1) // 2):
            j = 16 * h + 2 * tp
            for c in range(0, d, 16):
                e0, f0 = v_pair(src.vc, va, d, src.v_chunk, tp, c)
                vstore(vs, v0 + j * d + c, e0)
                if 2 * tp + 1 < n:
                    vstore(vs, v0 + (j + 1) * d + c, f0)


@jit(inline="always")
def _store4(acc, o, x0, x1, x2, x3):
    vstore(acc, o, x0)
    vstore(acc, o + 16, x1)
    vstore(acc, o + 32, x2)
    vstore(acc, o + 48, x3)


def pfma(w, v, x, masked):
    """``x + w * v``; with ``masked`` (not None) a key of weight ``w`` 0 adds nothing, even
    where ``v`` holds a NaN or an inf (a NaN weight still propagates)."""


@overload(pfma, inline="always")
def _pfma(w, v, x, masked):
    if masked is types.none:
        return lambda w, v, x, masked: vfma(w, v, x)
    return lambda w, v, x, masked: vfma(w, vselect_lt(vsplat(0.0), w, v, vsplat(0.0)), x)


@jit(inline="always")
def _pv_pair(sbuf, p, e, f, x, masked):
    """``x`` plus the weights at ``sbuf[p]``, ``sbuf[p + 1]`` times the V vectors ``e``,
    ``f`` of a key pair (:func:`pfma`)."""
    return pfma(vbcast(sbuf, p + 1), f, pfma(vbcast(sbuf, p), e, x, masked), masked)


@jit
def pv4(acc, ar, alpha, sbuf, pr, d, src, t, masked):
    """acc[row] = acc[row] * alpha + P @ V for 4 (possibly repeated) rows over tile ``t``.

    ``ar[0:4]``: the rows' offsets into ``acc``; ``pr[0:4]``: into ``sbuf`` (probabilities
    of half A at +0, half B at +16; a staged ``src`` may have one half of any length).
    Keys are taken in pairs, 4 rows x 64 dims of accumulators in registers; the partner of
    an odd last key is zeroed, never read into the sum (an unwritten slot may hold NaN),
    but its weight (one past the half's keys in ``sbuf``) is read and multiplied by that
    zero in either variant: it must be finite (a probability the softmax wrote).
    ``masked`` (chosen at compile time: None, or True where one of the rows masks a key of
    the tile): a key a row masks (weight 0) adds nothing to that row even where its V is
    NaN or inf (0 x NaN is NaN). Another row may see that key, so V is read and the
    product is dropped. Only boundary tiles (the causal diagonal, a window's start) pay.
    """
    r0, r1, r2, r3 = ar[0], ar[1], ar[2], ar[3]
    p0, p1, p2, p3 = pr[0], pr[1], pr[2], pr[3]
    g0 = vsplat(alpha[0])
    g1 = vsplat(alpha[1])
    g2 = vsplat(alpha[2])
    g3 = vsplat(alpha[3])
    vc, cs = src.vc, src.v_chunk
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
            va = t.va if h == 0 else t.vb
            n = t.nva if h == 0 else t.nvb
            po = 16 * h
            for tp in range((n + 1) // 2):
                e0, f0 = v_pair(vc, va, d, cs, tp, c0)
                e1, f1 = v_pair(vc, va, d, cs, tp, c0 + 16)
                e2, f2 = v_pair(vc, va, d, cs, tp, c0 + 32)
                e3, f3 = v_pair(vc, va, d, cs, tp, c0 + 48)
                i = po + 2 * tp
                if 2 * tp + 1 == n:  # the odd last key: its pair partner does not exist
                    f0 = f1 = f2 = f3 = vsplat(0.0)
                w = vbcast(sbuf, p0 + i)
                z = vbcast(sbuf, p0 + i + 1)
                x00 = pfma(z, f0, pfma(w, e0, x00, masked), masked)
                x01 = pfma(z, f1, pfma(w, e1, x01, masked), masked)
                x02 = pfma(z, f2, pfma(w, e2, x02, masked), masked)
                x03 = pfma(z, f3, pfma(w, e3, x03, masked), masked)
                w = vbcast(sbuf, p1 + i)
                z = vbcast(sbuf, p1 + i + 1)
                x10 = pfma(z, f0, pfma(w, e0, x10, masked), masked)
                x11 = pfma(z, f1, pfma(w, e1, x11, masked), masked)
                x12 = pfma(z, f2, pfma(w, e2, x12, masked), masked)
                x13 = pfma(z, f3, pfma(w, e3, x13, masked), masked)
                w = vbcast(sbuf, p2 + i)
                z = vbcast(sbuf, p2 + i + 1)
                x20 = pfma(z, f0, pfma(w, e0, x20, masked), masked)
                x21 = pfma(z, f1, pfma(w, e1, x21, masked), masked)
                x22 = pfma(z, f2, pfma(w, e2, x22, masked), masked)
                x23 = pfma(z, f3, pfma(w, e3, x23, masked), masked)
                w = vbcast(sbuf, p3 + i)
                z = vbcast(sbuf, p3 + i + 1)
                x30 = pfma(z, f0, pfma(w, e0, x30, masked), masked)
                x31 = pfma(z, f1, pfma(w, e1, x31, masked), masked)
                x32 = pfma(z, f2, pfma(w, e2, x32, masked), masked)
                x33 = pfma(z, f3, pfma(w, e3, x33, masked), masked)
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
            va = t.va if h == 0 else t.vb
            n = t.nva if h == 0 else t.nvb
            po = 16 * h
            for tp in range((n + 1) // 2):
                e0, f0 = v_pair(vc, va, d, cs, tp, c0)
                if 2 * tp + 1 == n:
                    f0 = vsplat(0.0)
                i = po + 2 * tp
                x00 = _pv_pair(sbuf, p0 + i, e0, f0, x00, masked)
                x10 = _pv_pair(sbuf, p1 + i, e0, f0, x10, masked)
                x20 = _pv_pair(sbuf, p2 + i, e0, f0, x20, masked)
                x30 = _pv_pair(sbuf, p3 + i, e0, f0, x30, masked)
        vstore(acc, r3 + c0, x30)
        vstore(acc, r2 + c0, x20)
        vstore(acc, r1 + c0, x10)
        vstore(acc, r0 + c0, x00)
        c0 += 16


@jit(inline="always")
def _pv6_key(sbuf, p, i, v, x0, x1, x2, x3, x4, x5, masked):
    """The 6 rows' accumulators plus their weights of key ``i`` (``sbuf[p[r] + i]``)
    times its V vector ``v`` (:func:`pfma`)."""
    x0 = pfma(vbcast(sbuf, p[0] + i), v, x0, masked)
    x1 = pfma(vbcast(sbuf, p[1] + i), v, x1, masked)
    x2 = pfma(vbcast(sbuf, p[2] + i), v, x2, masked)
    x3 = pfma(vbcast(sbuf, p[3] + i), v, x3, masked)
    x4 = pfma(vbcast(sbuf, p[4] + i), v, x4, masked)
    x5 = pfma(vbcast(sbuf, p[5] + i), v, x5, masked)
    return x0, x1, x2, x3, x4, x5


@jit
def pv6(acc, ar, alpha, sbuf, pr, d, src, t, masked):
    """:func:`pv4` for 6 rows, 16 dims at a time: the AVX2 tile (12 ymm of accumulators,
    isa.PREFILL_TILES). Arguments, the odd last key and ``masked`` as in :func:`pv4`,
    whose FMA order each accumulator keeps; the rows take a key pair's first key before
    its second, so the second key's V vector is loaded once the first one is dead, and
    the odd last key is taken after the loop (a zeroed partner selected inside it cost
    the register allocator every accumulator: all 12 went to the stack)."""
    r0, r1, r2, r3, r4, r5 = ar[0], ar[1], ar[2], ar[3], ar[4], ar[5]
    g0 = vsplat(alpha[0])
    g1 = vsplat(alpha[1])
    g2 = vsplat(alpha[2])
    g3 = vsplat(alpha[3])
    g4 = vsplat(alpha[4])
    g5 = vsplat(alpha[5])
    vc, cs = src.vc, src.v_chunk
    for c in range(0, d, 16):
        x0 = vmul(vload(acc, r0 + c), g0)
        x1 = vmul(vload(acc, r1 + c), g1)
        x2 = vmul(vload(acc, r2 + c), g2)
        x3 = vmul(vload(acc, r3 + c), g3)
        x4 = vmul(vload(acc, r4 + c), g4)
        x5 = vmul(vload(acc, r5 + c), g5)
        for h in range(2):
            va = t.va if h == 0 else t.vb
            n = t.nva if h == 0 else t.nvb
            po = 16 * h
            for tp in range(n // 2):
                e, f = v_pair(vc, va, d, cs, tp, c)
                i = po + 2 * tp
                x0, x1, x2, x3, x4, x5 = _pv6_key(sbuf, pr, i, e, x0, x1, x2, x3, x4, x5, masked)
                x0, x1, x2, x3, x4, x5 = _pv6_key(
                    sbuf, pr, i + 1, f, x0, x1, x2, x3, x4, x5, masked
                )
            if n % 2:  # the odd last key: its pair partner does not exist (zeroed)
                e, f = v_pair(vc, va, d, cs, n // 2, c)
                i = po + n - 1
                x0, x1, x2, x3, x4, x5 = _pv6_key(sbuf, pr, i, e, x0, x1, x2, x3, x4, x5, masked)
                z = vsplat(0.0)
                x0, x1, x2, x3, x4, x5 = _pv6_key(
                    sbuf, pr, i + 1, z, x0, x1, x2, x3, x4, x5, masked
                )
        # repeated rows compute identical values: storing them twice is harmless
        vstore(acc, r5 + c, x5)
        vstore(acc, r4 + c, x4)
        vstore(acc, r3 + c, x3)
        vstore(acc, r2 + c, x2)
        vstore(acc, r1 + c, x1)
        vstore(acc, r0 + c, x0)


# ---------------------------------------------------------------------------------------
# the prefill's tiles, chosen at compile time by isa.PREFILL_TILES (PREFILL)


def _tile_choice(kind, shape, tiles):
    if shape not in tiles:
        raise NotImplementedError(f"isa.PREFILL_TILES: no {kind} tile {shape}; have {list(tiles)}")
    return tiles[shape]


def qk_group(qf, qr, d, src, k0, sbuf, so, ss):
    """Scores of a prefill group's ``PREFILL.group_rows`` rows (``qf`` offsets ``qr``)
    against the 32 keys at ``k0`` of a staged ``src`` into ``sbuf`` at ``so`` (row stride
    ``ss``)."""


def _qk8_staged(qf, qr, d, src, k0, sbuf, so, ss):
    tile = Tile(k0, k0 + 16, 0, 0, 0, 0)  # no prefetch: it is staged
    qk8(qf, qr, d, src, tile, sbuf, so, ss, tile, False)


def _qk6_pair(qf, qr, d, src, k0, sbuf, so, ss):
    qk6(qf, qr, d, src, k0, sbuf, so, ss)
    qk6(qf, qr, d, src, k0 + 16, sbuf, so + 16, ss)


@overload(qk_group, inline="always")
def _qk_group(qf, qr, d, src, k0, sbuf, so, ss):
    return _tile_choice(
        "Q·K", (PREFILL.group_rows, PREFILL.qk_keys), {(8, 32): _qk8_staged, (6, 16): _qk6_pair}
    )


def pv_group(acc, ar, alpha, sbuf, pr, d, src, t, masked):
    """:func:`pv4` for ``PREFILL.pv_rows`` rows (the arrays' lengths)."""


@overload(pv_group, inline="always")
def _pv_group(acc, ar, alpha, sbuf, pr, d, src, t, masked):
    tile = _tile_choice("P·V", (PREFILL.pv_rows, PREFILL.pv_dims), {(4, 64): pv4, (6, 16): pv6})
    return lambda acc, ar, alpha, sbuf, pr, d, src, t, masked: tile(
        acc, ar, alpha, sbuf, pr, d, src, t, masked
    )
