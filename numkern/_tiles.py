"""Register tiles shared by the GEMM and MoE kernels.

A tile multiplies a few activation rows by two groups of 16 weight columns and adds the
result into an fp32 accumulator buffer ``part``. Each weight group is a packed block in
which every pair of K holds an (even row, odd row) of 16 columns, in one of two forms:

* pair carriers (``uint32`` bf16 pairs, ``int32`` fp16 pairs): one 16-lane load gives the
  16 (k even, k odd) pairs — the VNNI layout of ``gemm`` and of MoE's ``amx`` layout;
* row carriers (``uint16`` bf16, ``int16`` fp16, ``float32``): the even row at ``ofs``
  and the odd row at ``ofs + rstep`` — MoE's ``vec`` layout and the fp32 GEMM layout.

A tile reads its weight through :class:`Weights`: group g of K pair k2 starts at
``wb_g + kstep * k2`` (array elements); :func:`geometry` derives ``kstep`` and ``rstep``
(and a weight row's length) from the carrier. Activation rows are addressed by element
offsets ``x_r`` (so gathered MoE rows need no copy), accumulator rows by offsets ``p_r``
(group 0 at ``p_r``, group 1 at ``p_r + 16``), each a tuple with one entry per row.

One body per tile size serves both ways of multiplying, chosen at compile time by the
activations' dtype (as ``numkern.attention.tiles.k_pair`` chooses a layout by the cache's
carrier), in two small helpers: :func:`k2_weights` (the weight of one K pair) and
:func:`mac` (one row's multiply-accumulate):

* fp32 activations (widened once by the caller): the weight pair is widened to two fp32
  rows and each row does four FMAs with its two broadcast activations;
* bf16 activations as they are (``uint16``; AVX512-BF16 only: compile them only where
  ``isa.has("avx512bf16")``): the weight stays bf16 pairs — pair carriers (``uint32``)
  or rows (``uint16``, MoE's vec layout: the odd row right after the even one,
  ``rstep`` 16, interleaved into pairs by one shuffle per K pair and group, shared by
  every row of the tile; measured 13% faster than two row loads and a two-source
  shuffle, 7% behind pair carriers, on Zen 4). Per K pair, one 32-bit broadcast gives a
  row's (x[k even], x[k odd]) and ``dpbf16`` (``vdpbf16ps``) adds both exact products
  to 16 accumulators: two instructions per row and K pair instead of four FMAs.

The 8-row tile holds 16 zmm accumulators (measured best here); the 4-row tile serves the
memory-bound decode case and remainders, and handles an odd last K of fp32 weights.
Rows may repeat (callers clamp to the last row): duplicates store identical values.
"""

from typing import NamedTuple

import numpy as np
from numba import types
from numba.extending import overload

from . import isa as _isa
from ._jit import jit
from .simd import (
    dpbf16,
    i32x16,
    prefetch,
    vadd,
    vbcast,
    vbcast_raw_pair,
    vfma,
    vinterleave_raw,
    vload,
    vload_pairs,
    vload_raw_pairs,
    vstore,
    vzero,
)

# K pairs ahead that the tiles prefetch their weights, per CPU (``isa.STREAM``); 0: none
PREFETCH_K2 = _isa.stream_rule().prefetch_k2


class Weights(NamedTuple):
    """The packed weight a tile streams: two groups of 16 columns in one carrier."""

    w: np.ndarray  # the carrier: uint32/int32 K pairs, or uint16/int16/float32 K rows
    wb0: int  # group 0's first element
    wb1: int  # group 1's
    kstep: int  # elements from one K pair to the next
    rstep: int  # from an even K row to the odd one (row carriers; 0 for pairs)


def geometry(w, k, width):
    """``(ku, kstep, rstep)`` of a weight packed in carrier ``w`` with ``width`` columns
    per K row of a block (gemm's 32-column blocks, MoE's 16-row tiles): ``ku`` carrier
    elements per weight row (K/2 pairs, or K rows), ``kstep`` and ``rstep`` as in
    :class:`Weights`. A constant of the compiled code per carrier."""


@overload(geometry, inline="always")
def _geometry(w, k, width):
    if w.dtype in (types.uint32, types.int32):  # K pairs of ``width`` columns
        return lambda w, k, width: (k // 2, width, 0)
    return lambda w, k, width: (k, 2 * width, width)  # K rows: even, then odd


@jit(inline="always")
def _prefetch_ahead(wt, k2):
    """Prefetch both column groups PREFETCH_K2 K pairs ahead (2 KB in bf16 at 16): on the
    Skylake-SP Xeon the hardware streamer restarts at every 4 KB page, and a decode GEMV
    is nothing but this stream; past the block's end it fetches the next block, which this
    thread computes next. Where ``PREFETCH_K2`` is 0 (a constant of the compiled code)
    nothing is issued: the hardware prefetchers alone stream faster there (Zen 4)."""
    if PREFETCH_K2 == 0:
        return
    w, kstep, rstep = wt.w, wt.kstep, wt.rstep
    prefetch(w, wt.wb0 + kstep * (k2 + PREFETCH_K2))
    prefetch(w, wt.wb1 + kstep * (k2 + PREFETCH_K2))
    if rstep:  # K rows (not pairs): the odd row's lines too
        prefetch(w, wt.wb0 + kstep * (k2 + PREFETCH_K2) + rstep)
        prefetch(w, wt.wb1 + kstep * (k2 + PREFETCH_K2) + rstep)


def load_k2(w, ofs, rstep):
    """(even, odd) fp32 rows of one K pair for 16 columns."""


@overload(load_k2, inline="always")
def _load_k2(w, ofs, rstep):
    if w.dtype in (types.uint32, types.int32):

        def impl(w, ofs, rstep):
            return vload_pairs(w, ofs)

    else:

        def impl(w, ofs, rstep):
            return vload(w, ofs), vload(w, ofs + rstep)

    return impl


def load_k_last(w, ofs):
    """The even row alone (fp32 weights with an odd K); pair carriers never have one."""


@overload(load_k_last, inline="always")
def _load_k_last(w, ofs):
    if w.dtype in (types.uint32, types.int32):
        return lambda w, ofs: vzero()
    return lambda w, ofs: vload(w, ofs)


def load_raw_k2(w, ofs, rstep):
    """The 16 (k even, k odd) bf16 pairs of one K pair for 16 columns, as ``i32x16``."""


@overload(load_raw_k2, inline="always")
def _load_raw_k2(w, ofs, rstep):
    if w.dtype == types.uint32:
        return lambda w, ofs, rstep: vload_raw_pairs(w, ofs)
    if w.dtype == types.uint16:  # the odd row right after the even one (rstep 16)
        return lambda w, ofs, rstep: vinterleave_raw(w, ofs)
    raise TypeError(f"load_raw_k2: expected bf16 weights (uint32 pairs or uint16 rows), got {w}")


def _dp(x):
    """Whether activations ``x`` name the vdpbf16ps tiles (bf16 bits) rather than the
    widening ones (fp32): a constant of the compiled code."""
    return x.dtype == types.uint16


def k2_weights(x, wt, k2):
    """Both groups' weights of K pair ``k2`` as activations ``x`` multiply them: fp32
    ``((even, odd), (even, odd))`` rows to widen against, or two ``i32x16`` of raw bf16
    pairs for ``dpbf16``."""


@overload(k2_weights, inline="always")
def _k2_weights(x, wt, k2):
    if _dp(x):
        return lambda x, wt, k2: (
            load_raw_k2(wt.w, wt.wb0 + wt.kstep * k2, wt.rstep),
            load_raw_k2(wt.w, wt.wb1 + wt.kstep * k2, wt.rstep),
        )
    return lambda x, wt, k2: (
        load_k2(wt.w, wt.wb0 + wt.kstep * k2, wt.rstep),
        load_k2(wt.w, wt.wb1 + wt.kstep * k2, wt.rstep),
    )


def mac(x, xr, g0, g1, acc0, acc1):
    """``acc_g += (x[xr], x[xr + 1]) @ g_g`` for both groups of one K pair (weights
    from :func:`k2_weights`): four FMAs on two fp32 broadcasts, or two ``vdpbf16ps`` on
    one broadcast bf16 pair. Given one fp32 row per group (:func:`last_weights`), the odd
    last K: ``acc_g += x[xr] * g_g`` (widening; nothing for bf16, whose K is even)."""


@overload(mac, inline="always")
def _mac(x, xr, g0, g1, acc0, acc1):
    if _dp(x):
        if g0 != i32x16:  # the odd last K
            return lambda x, xr, g0, g1, acc0, acc1: (acc0, acc1)

        def impl(x, xr, g0, g1, acc0, acc1):
            s = vbcast_raw_pair(x, xr)
            return dpbf16(acc0, g0, s), dpbf16(acc1, g1, s)

        return impl

    if not isinstance(g0, types.BaseTuple):  # the odd last K row
        return lambda x, xr, g0, g1, acc0, acc1: (
            vfma(vbcast(x, xr), g0, acc0),
            vfma(vbcast(x, xr), g1, acc1),
        )

    def impl(x, xr, g0, g1, acc0, acc1):
        s = vbcast(x, xr)
        t = vbcast(x, xr + 1)
        return vfma(t, g0[1], vfma(s, g0[0], acc0)), vfma(t, g1[1], vfma(s, g1[0], acc1))

    return impl


def last_weights(x, wt, k2):
    """Both groups' even K row at K pair ``k2`` alone (fp32 weights with an odd K; bf16
    has none: zeros that :func:`mac` ignores, so the compiler drops the branch)."""


@overload(last_weights, inline="always")
def _last_weights(x, wt, k2):
    if _dp(x):  # bf16 K is even
        return lambda x, wt, k2: (vzero(), vzero())
    return lambda x, wt, k2: (
        load_k_last(wt.w, wt.wb0 + wt.kstep * k2),
        load_k_last(wt.w, wt.wb1 + wt.kstep * k2),
    )


# The 4- and 8-row tiles are made of 4-row groups: a group's 8 accumulators travel as one
# tuple (SSA values after LLVM's scalar replacement: 8, or 16 for two groups, zmm
# registers, as when spelt out one by one).


@jit(inline="always")
def _load4(part, po):
    """The accumulators of 4 rows at offsets ``po``: (row a group 0, group 1, row b ...)."""
    pa, pb, pc, pd = po
    return (
        vload(part, pa), vload(part, pa + 16), vload(part, pb), vload(part, pb + 16),
        vload(part, pc), vload(part, pc + 16), vload(part, pd), vload(part, pd + 16),
    )  # fmt: skip


@jit(inline="always")
def _store4(part, po, acc):
    pa, pb, pc, pd = po
    a0, a1, b0, b1, c0, c1, d0, d1 = acc
    vstore(part, pd, d0)
    vstore(part, pd + 16, d1)
    vstore(part, pc, c0)
    vstore(part, pc + 16, c1)
    vstore(part, pb, b0)
    vstore(part, pb + 16, b1)
    vstore(part, pa, a0)
    vstore(part, pa + 16, a1)


@jit(inline="always")
def _mac4(x, xo, i, w0, w1, acc):
    """:func:`mac` of 4 rows (activation offsets ``xo``, K offset ``i``)."""
    a0, a1, b0, b1, c0, c1, d0, d1 = acc
    a0, a1 = mac(x, xo[0] + i, w0, w1, a0, a1)
    b0, b1 = mac(x, xo[1] + i, w0, w1, b0, b1)
    c0, c1 = mac(x, xo[2] + i, w0, w1, c0, c1)
    d0, d1 = mac(x, xo[3] + i, w0, w1, d0, d1)
    return a0, a1, b0, b1, c0, c1, d0, d1


@jit
def tile4(x, xo, wt, k2a, k2b, odd_k, part, po):
    """part[p_r + 0:32] += x_r[2*k2a : 2*k2b (+1 if odd_k)] @ (group0 | group1), 4 rows
    (``xo``, ``po``: 4-tuples of offsets)."""
    acc = _load4(part, po)
    for k2 in range(k2a, k2b):
        w0, w1 = k2_weights(x, wt, k2)
        _prefetch_ahead(wt, k2)  # 2-4 rows are still memory-bound
        acc = _mac4(x, xo, 2 * k2, w0, w1, acc)
    if odd_k:
        l0, l1 = last_weights(x, wt, k2b)
        acc = _mac4(x, xo, 2 * k2b, l0, l1, acc)
    _store4(part, po, acc)


@jit
def tile8(x, xo, wt, k2a, k2b, part, po):
    """part[p_r + 0:32] += x_r[2*k2a : 2*k2b] @ (group0 | group1), 8 rows (``xo``,
    ``po``: 8-tuples of offsets): two 4-row groups, 16 accumulators."""
    lo, hi = xo[:4], xo[4:]
    acc = _load4(part, po[:4])
    acd = _load4(part, po[4:])
    for k2 in range(k2a, k2b):
        w0, w1 = k2_weights(x, wt, k2)
        _prefetch_ahead(wt, k2)
        acc = _mac4(x, lo, 2 * k2, w0, w1, acc)
        acd = _mac4(x, hi, 2 * k2, w0, w1, acd)
    _store4(part, po[:4], acc)
    _store4(part, po[4:], acd)


# One row (decode) keeps two accumulator chains per group so consecutive multiply-adds do
# not wait on each other. A step of tile1 feeds both chains: widening, one K pair (the
# even K row into one chain, the odd into the other, no FMAs spent on repeated rows);
# vdpbf16ps, two K pairs (one instruction per 16 columns and K pair: the widening step
# spends two more on the weight), one into each chain.


def k2_per_step(x):
    """K pairs per step of :func:`tile1`: 1 widening, 2 vdpbf16ps."""


@overload(k2_per_step, inline="always")
def _k2_per_step(x):
    step = 2 if _dp(x) else 1
    return lambda x: step


def step1(x, xa, wt, k2, a0, a1, c0, c1):
    """One step of :func:`tile1` from K pair ``k2``: chains ``a`` and ``c``."""


@overload(step1, inline="always")
def _step1(x, xa, wt, k2, a0, a1, c0, c1):
    if _dp(x):

        def impl(x, xa, wt, k2, a0, a1, c0, c1):
            _prefetch_ahead(wt, k2)
            _prefetch_ahead(wt, k2 + 1)
            s0, s1 = k2_weights(x, wt, k2)
            a0, a1 = mac(x, xa + 2 * k2, s0, s1, a0, a1)
            t0, t1 = k2_weights(x, wt, k2 + 1)
            c0, c1 = mac(x, xa + 2 * k2 + 2, t0, t1, c0, c1)
            return a0, a1, c0, c1

        return impl

    def impl(x, xa, wt, k2, a0, a1, c0, c1):
        (e0, o0), (e1, o1) = k2_weights(x, wt, k2)
        _prefetch_ahead(wt, k2)
        s = vbcast(x, xa + 2 * k2)
        t = vbcast(x, xa + 2 * k2 + 1)
        return vfma(s, e0, a0), vfma(s, e1, a1), vfma(t, o0, c0), vfma(t, o1, c1)

    return impl


def rest1(x, xa, wt, k2, k2b, odd_k, a0, a1):
    """What :func:`tile1`'s steps left from K pair ``k2``: the odd last K row (widening,
    ``odd_k``) or the odd last K pair (vdpbf16ps)."""


@overload(rest1, inline="always")
def _rest1(x, xa, wt, k2, k2b, odd_k, a0, a1):
    if _dp(x):

        def impl(x, xa, wt, k2, k2b, odd_k, a0, a1):
            if k2 < k2b:
                s0, s1 = k2_weights(x, wt, k2)
                a0, a1 = mac(x, xa + 2 * k2, s0, s1, a0, a1)
            return a0, a1

        return impl

    def impl(x, xa, wt, k2, k2b, odd_k, a0, a1):
        if odd_k:
            l0, l1 = last_weights(x, wt, k2b)
            a0, a1 = mac(x, xa + 2 * k2b, l0, l1, a0, a1)
        return a0, a1

    return impl


@jit
def tile1(x, xa, wt, k2a, k2b, odd_k, part, pa):
    """part[pa + 0:32] += x[xa + 2*k2a : xa + 2*k2b (+1 if odd_k)] @ (group0 | group1),
    one row: the memory-bound decode case."""
    a0 = vload(part, pa)
    a1 = vload(part, pa + 16)
    c0 = vzero()
    c1 = vzero()
    step = k2_per_step(x)
    n = max(0, (k2b - k2a) // step)
    for j in range(n):  # a counted loop: LLVM unrolls it (a while loop it left rolled)
        a0, a1, c0, c1 = step1(x, xa, wt, k2a + step * j, a0, a1, c0, c1)
    a0, a1 = rest1(x, xa, wt, k2a + step * n, k2b, odd_k, a0, a1)
    vstore(part, pa, vadd(a0, c0))
    vstore(part, pa + 16, vadd(a1, c1))


# The callers' forms of the tiles: rows named by a first row and a stride (or an array of
# gathered offsets) instead of 8 (or 4) listed offsets. inline="always" inlines them at
# Numba's IR level, so the caller makes exactly the tile call it would have spelt out.


@jit(inline="always")
def tile8_rows(x, r, xs, wt, k2a, k2b, part, p0, ps):
    """tile8 over rows ``r .. r+7``: activation row q at ``q*xs``, accumulator at ``p0 + q*ps``."""
    xa = r * xs
    pa = p0 + r * ps
    xo = (xa, xa + xs, xa + 2 * xs, xa + 3 * xs, xa + 4 * xs, xa + 5 * xs, xa + 6 * xs, xa + 7 * xs)
    po = (pa, pa + ps, pa + 2 * ps, pa + 3 * ps, pa + 4 * ps, pa + 5 * ps, pa + 6 * ps, pa + 7 * ps)
    tile8(x, xo, wt, k2a, k2b, part, po)


@jit(inline="always")
def tile4_rows(x, r, last, xs, wt, k2a, k2b, odd_k, part, p0, ps):
    """tile4 over rows ``r .. r+3`` clamped to ``last`` (addressed as in :func:`tile8_rows`)."""
    rb = min(r + 1, last)
    rc = min(r + 2, last)
    rd = min(r + 3, last)
    xo = (r * xs, rb * xs, rc * xs, rd * xs)
    po = (p0 + r * ps, p0 + rb * ps, p0 + rc * ps, p0 + rd * ps)
    tile4(x, xo, wt, k2a, k2b, odd_k, part, po)


@jit(inline="always")
def tile8_gathered(x, xr, wt, k2a, k2b, part, p0, ps):
    """tile8 over the activation rows at offsets ``xr[0:8]``, accumulator q at ``p0 + q*ps``."""
    xo = (xr[0], xr[1], xr[2], xr[3], xr[4], xr[5], xr[6], xr[7])
    po = (p0, p0 + ps, p0 + 2 * ps, p0 + 3 * ps, p0 + 4 * ps, p0 + 5 * ps, p0 + 6 * ps, p0 + 7 * ps)
    tile8(x, xo, wt, k2a, k2b, part, po)


@jit(inline="always")
def tile4_gathered(x, xr, wt, k2a, k2b, odd_k, part, p0, ps):
    """tile4 over the activation rows at offsets ``xr[0:4]`` (as :func:`tile8_gathered`)."""
    xo = (xr[0], xr[1], xr[2], xr[3])
    po = (p0, p0 + ps, p0 + 2 * ps, p0 + 3 * ps)
    tile4(x, xo, wt, k2a, k2b, odd_k, part, po)


# ---------------------------------------------------------------------------------------
# Panel tiles (the "fma256" path of ``isa.GEMM``: CPUs without AVX-512).
#
# On AVX2 an f32x16 value is two ymm registers and there are 16 of them: the 8x32 tile's
# 16 accumulators (32 ymm) spill, and its weight is widened again for every row tile. So
# here a weight panel (32 columns x one K slice) is widened to fp32 once into scratch the
# caller owns, laid out [group][K][16] (each 16-column group contiguous, one 64-byte line
# per K row), and a 6-row x 16-column tile of pure FMAs runs over it: 6 accumulators (12
# ymm), the weight row (2 ymm) and one broadcast fit the 16 ymm registers. Per K row: one
# weight load, 6 broadcasts, 12 ymm FMAs (6 cycles on Zen 3's two FMA pipes).


@jit(inline="always")
def widen_panel(wt, k2a, k2b, last_k, panel, gs):
    """``panel[g*gs + (k - 2*k2a)*16 + j]`` = fp32 weight of K row k, column ``16*g + j``
    of :class:`Weights` ``wt``, for the K rows ``2*k2a`` to ``2*k2b`` and, with
    ``last_k``, the odd last one (fp32 weights)."""
    w, kstep = wt.w, wt.kstep
    for k2 in range(k2a, k2b):
        e0, o0 = load_k2(w, wt.wb0 + kstep * k2, wt.rstep)
        e1, o1 = load_k2(w, wt.wb1 + kstep * k2, wt.rstep)
        p = 32 * (k2 - k2a)
        vstore(panel, p, e0)
        vstore(panel, p + 16, o0)
        vstore(panel, gs + p, e1)
        vstore(panel, gs + p + 16, o1)
    if last_k:
        p = 32 * (k2b - k2a)
        vstore(panel, p, load_k_last(w, wt.wb0 + kstep * k2b))
        vstore(panel, gs + p, load_k_last(w, wt.wb1 + kstep * k2b))


@jit
def tile6(xf, xo, panel, w0, kn, part, po):
    """``part[po[q] : po[q] + 16] += xf[xo[q] : xo[q] + kn] @ panel[w0 : w0 + 16*kn]``
    (K rows of 16 fp32 columns) for the 6 rows q; ``xo``, ``po``: 6-tuples of offsets."""
    xa, xb, xc, xd, xe, xg = xo
    a = vload(part, po[0])
    b = vload(part, po[1])
    c = vload(part, po[2])
    d = vload(part, po[3])
    f = vload(part, po[4])
    g = vload(part, po[5])
    for kk in range(kn):
        wv = vload(panel, w0 + 16 * kk)
        a = vfma(vbcast(xf, xa + kk), wv, a)
        b = vfma(vbcast(xf, xb + kk), wv, b)
        c = vfma(vbcast(xf, xc + kk), wv, c)
        d = vfma(vbcast(xf, xd + kk), wv, d)
        f = vfma(vbcast(xf, xe + kk), wv, f)
        g = vfma(vbcast(xf, xg + kk), wv, g)
    vstore(part, po[5], g)
    vstore(part, po[4], f)
    vstore(part, po[3], d)
    vstore(part, po[2], c)
    vstore(part, po[1], b)
    vstore(part, po[0], a)


@jit(inline="always")
def tile6_rows(xf, r, last, xs, x0, panel, w0, kn, part, p0, ps):
    """tile6 over rows ``r .. r+5`` clamped to ``last`` (a repeated row stores the same
    values twice): activation row q at ``q*xs + x0``, accumulator at ``p0 + q*ps``."""
    rb = min(r + 1, last)
    rc = min(r + 2, last)
    rd = min(r + 3, last)
    re = min(r + 4, last)
    rg = min(r + 5, last)
    xo = (r * xs + x0, rb * xs + x0, rc * xs + x0, rd * xs + x0, re * xs + x0, rg * xs + x0)
    po = (p0 + r * ps, p0 + rb * ps, p0 + rc * ps, p0 + rd * ps, p0 + re * ps, p0 + rg * ps)
    tile6(xf, xo, panel, w0, kn, part, po)


@jit(inline="always")
def tile6_gathered(xf, x, q, nr, x0, panel, w0, kn, part, p0, ps):
    """tile6 over the gathered activation rows at offsets ``x[q .. q+5] + x0`` clamped to
    the ``nr`` rows of ``x``; accumulator of row i at ``p0 + i*ps``."""
    last = nr - 1
    rb = min(q + 1, last)
    rc = min(q + 2, last)
    rd = min(q + 3, last)
    re = min(q + 4, last)
    rg = min(q + 5, last)
    xo = (x[q] + x0, x[rb] + x0, x[rc] + x0, x[rd] + x0, x[re] + x0, x[rg] + x0)
    po = (p0 + q * ps, p0 + rb * ps, p0 + rc * ps, p0 + rd * ps, p0 + re * ps, p0 + rg * ps)
    tile6(xf, xo, panel, w0, kn, part, po)


@jit
def tile4x16(xf, xo, nr, w, wb, kstep, rstep, k2a, k2b, part, po):
    """``part[po[q] : po[q] + 16] += xf[xo[q] + 2*k2a : xo[q] + 2*k2b] @ group`` for the
    rows q < ``nr`` (1 to 4; 4-tuples of offsets), straight from the packed group at
    ``wb`` (as tile4, one group): 4 accumulators (8 ymm) and the K pair's two weight rows
    (4 ymm) fit 16 ymm, where tile4's 8 accumulators spill. For the few rows per expert of
    a fused_moe call (fma256 path), too few to pay for a widened panel. Rows past ``nr``
    cost nothing (LLVM unswitches the loop on them): at 2 rows per expert (Qwen3-30B-A3B,
    T = 32) FMAs on clamped rows cost a third of the call on the masked Zen 4."""
    xa, xb, xc, xd = xo
    a = vload(part, po[0])
    b = vload(part, po[1])
    c = vload(part, po[2])
    d = vload(part, po[3])
    for k2 in range(k2a, k2b):
        e, o = load_k2(w, wb + kstep * k2, rstep)
        i = 2 * k2
        a = vfma(vbcast(xf, xa + i + 1), o, vfma(vbcast(xf, xa + i), e, a))
        if nr > 1:
            b = vfma(vbcast(xf, xb + i + 1), o, vfma(vbcast(xf, xb + i), e, b))
        if nr > 2:
            c = vfma(vbcast(xf, xc + i + 1), o, vfma(vbcast(xf, xc + i), e, c))
        if nr > 3:
            d = vfma(vbcast(xf, xd + i + 1), o, vfma(vbcast(xf, xd + i), e, d))
    if nr > 3:
        vstore(part, po[3], d)
    if nr > 2:
        vstore(part, po[2], c)
    if nr > 1:
        vstore(part, po[1], b)
    vstore(part, po[0], a)


# K pairs per turn of tile4x16_both: both groups' weight streams advance together
STREAM_TURN_K2 = 64


@jit(inline="always")
def tile4x16_both(xf, xo, nr, wt, k2a, k2b, part, po):
    """tile4x16 over group 0 (accumulators at ``po``) and group 1 (at ``po`` + 16), in
    turns of STREAM_TURN_K2 K pairs, so the two weight streams are read together."""
    p1 = (po[0] + 16, po[1] + 16, po[2] + 16, po[3] + 16)
    for ka in range(k2a, k2b, STREAM_TURN_K2):
        kz = min(k2b, ka + STREAM_TURN_K2)
        tile4x16(xf, xo, nr, wt.w, wt.wb0, wt.kstep, wt.rstep, ka, kz, part, po)
        tile4x16(xf, xo, nr, wt.w, wt.wb1, wt.kstep, wt.rstep, ka, kz, part, p1)
