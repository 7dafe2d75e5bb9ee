"""Register tiles shared by the GEMM and MoE kernels.

A tile multiplies a few activation rows by two groups of 16 weight columns and adds the
result into an fp32 accumulator buffer ``part``. Each weight group is a packed block in
which every pair of K holds an (even row, odd row) of 16 columns, in one of two forms:

* pair carriers (``uint32`` bf16 pairs, ``int32`` fp16 pairs): one 16-lane load gives the
  16 (k even, k odd) pairs — the VNNI layout of ``gemm`` and of MoE's ``amx`` layout;
* row carriers (``uint16`` bf16, ``int16`` fp16, ``float32``): the even row at ``ofs``
  and the odd row at ``ofs + rstep`` — MoE's ``vec`` layout and the fp32 GEMM layout.

Group g of K pair k2 starts at ``wb_g + kstep * k2`` (array elements). Activation rows
are fp32 and addressed by element offsets ``x_r`` (so gathered MoE rows need no copy);
accumulator rows by offsets ``p_r`` (group 0 at ``p_r``, group 1 at ``p_r + 16``).

The 8-row tile holds 16 zmm accumulators (measured best here); the 4-row tile serves the
memory-bound decode case and remainders, and handles an odd last K of fp32 weights.
Rows may repeat (callers clamp to the last row): duplicates store identical values.
"""

from numba import types
from numba.extending import overload

from . import isa as _isa
from ._jit import jit
from .simd import (
    dpbf16,
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


@jit(inline="always")
def _prefetch_ahead(w, wb0, wb1, kstep, rstep, k2):
    """Prefetch both column groups PREFETCH_K2 K pairs ahead (2 KB in bf16 at 16): on the
    Skylake-SP Xeon the hardware streamer restarts at every 4 KB page, and a decode GEMV
    is nothing but this stream; past the block's end it fetches the next block, which this
    thread computes next. Where ``PREFETCH_K2`` is 0 (a constant of the compiled code)
    nothing is issued: the hardware prefetchers alone stream faster there (Zen 4)."""
    if PREFETCH_K2 == 0:
        return
    prefetch(w, wb0 + kstep * (k2 + PREFETCH_K2))
    prefetch(w, wb1 + kstep * (k2 + PREFETCH_K2))
    if rstep:  # K rows (not pairs): the odd row's lines too
        prefetch(w, wb0 + kstep * (k2 + PREFETCH_K2) + rstep)
        prefetch(w, wb1 + kstep * (k2 + PREFETCH_K2) + rstep)


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


@jit
def tile4(xf, xa, xb, xc, xd, w, wb0, wb1, kstep, rstep, k2a, k2b, odd_k, part, pa, pb, pc, pd):
    """part[p_r + 0:32] += x_r[2*k2a : 2*k2b (+1 if odd_k)] @ (group0 | group1), 4 rows."""
    a0 = vload(part, pa)
    a1 = vload(part, pa + 16)
    b0 = vload(part, pb)
    b1 = vload(part, pb + 16)
    c0 = vload(part, pc)
    c1 = vload(part, pc + 16)
    d0 = vload(part, pd)
    d1 = vload(part, pd + 16)
    for k2 in range(k2a, k2b):
        e0, o0 = load_k2(w, wb0 + kstep * k2, rstep)
        e1, o1 = load_k2(w, wb1 + kstep * k2, rstep)
        _prefetch_ahead(w, wb0, wb1, kstep, rstep, k2)  # 2-4 rows are still memory-bound
        i = 2 * k2
        s = vbcast(xf, xa + i)
        t = vbcast(xf, xa + i + 1)
        a0 = vfma(t, o0, vfma(s, e0, a0))
        a1 = vfma(t, o1, vfma(s, e1, a1))
        s = vbcast(xf, xb + i)
        t = vbcast(xf, xb + i + 1)
        b0 = vfma(t, o0, vfma(s, e0, b0))
        b1 = vfma(t, o1, vfma(s, e1, b1))
        s = vbcast(xf, xc + i)
        t = vbcast(xf, xc + i + 1)
        c0 = vfma(t, o0, vfma(s, e0, c0))
        c1 = vfma(t, o1, vfma(s, e1, c1))
        s = vbcast(xf, xd + i)
        t = vbcast(xf, xd + i + 1)
        d0 = vfma(t, o0, vfma(s, e0, d0))
        d1 = vfma(t, o1, vfma(s, e1, d1))
    if odd_k:
        e0 = load_k_last(w, wb0 + kstep * k2b)
        e1 = load_k_last(w, wb1 + kstep * k2b)
        i = 2 * k2b
        a0 = vfma(vbcast(xf, xa + i), e0, a0)
        a1 = vfma(vbcast(xf, xa + i), e1, a1)
        b0 = vfma(vbcast(xf, xb + i), e0, b0)
        b1 = vfma(vbcast(xf, xb + i), e1, b1)
        c0 = vfma(vbcast(xf, xc + i), e0, c0)
        c1 = vfma(vbcast(xf, xc + i), e1, c1)
        d0 = vfma(vbcast(xf, xd + i), e0, d0)
        d1 = vfma(vbcast(xf, xd + i), e1, d1)
    vstore(part, pd, d0)
    vstore(part, pd + 16, d1)
    vstore(part, pc, c0)
    vstore(part, pc + 16, c1)
    vstore(part, pb, b0)
    vstore(part, pb + 16, b1)
    vstore(part, pa, a0)
    vstore(part, pa + 16, a1)


@jit
def tile8(
    xf,
    xa,
    xb,
    xc,
    xd,
    xe,
    xg,
    xh,
    xq,
    w,
    wb0,
    wb1,
    kstep,
    rstep,
    k2a,
    k2b,
    part,
    pa,
    pb,
    pc,
    pd,
    pe,
    pg,
    ph,
    pq,
):
    """part[p_r + 0:32] += x_r[2*k2a : 2*k2b] @ (group0 | group1), 8 rows."""
    a0 = vload(part, pa)
    a1 = vload(part, pa + 16)
    b0 = vload(part, pb)
    b1 = vload(part, pb + 16)
    c0 = vload(part, pc)
    c1 = vload(part, pc + 16)
    d0 = vload(part, pd)
    d1 = vload(part, pd + 16)
    f0 = vload(part, pe)
    f1 = vload(part, pe + 16)
    g0 = vload(part, pg)
    g1 = vload(part, pg + 16)
    h0 = vload(part, ph)
    h1 = vload(part, ph + 16)
    q0 = vload(part, pq)
    q1 = vload(part, pq + 16)
    for k2 in range(k2a, k2b):
        e0, o0 = load_k2(w, wb0 + kstep * k2, rstep)
        e1, o1 = load_k2(w, wb1 + kstep * k2, rstep)
        _prefetch_ahead(w, wb0, wb1, kstep, rstep, k2)  # 2-4 rows are still memory-bound
        i = 2 * k2
        s = vbcast(xf, xa + i)
        t = vbcast(xf, xa + i + 1)
        a0 = vfma(t, o0, vfma(s, e0, a0))
        a1 = vfma(t, o1, vfma(s, e1, a1))
        s = vbcast(xf, xb + i)
        t = vbcast(xf, xb + i + 1)
        b0 = vfma(t, o0, vfma(s, e0, b0))
        b1 = vfma(t, o1, vfma(s, e1, b1))
        s = vbcast(xf, xc + i)
        t = vbcast(xf, xc + i + 1)
        c0 = vfma(t, o0, vfma(s, e0, c0))
        c1 = vfma(t, o1, vfma(s, e1, c1))
        s = vbcast(xf, xd + i)
        t = vbcast(xf, xd + i + 1)
        d0 = vfma(t, o0, vfma(s, e0, d0))
        d1 = vfma(t, o1, vfma(s, e1, d1))
        s = vbcast(xf, xe + i)
        t = vbcast(xf, xe + i + 1)
        f0 = vfma(t, o0, vfma(s, e0, f0))
        f1 = vfma(t, o1, vfma(s, e1, f1))
        s = vbcast(xf, xg + i)
        t = vbcast(xf, xg + i + 1)
        g0 = vfma(t, o0, vfma(s, e0, g0))
        g1 = vfma(t, o1, vfma(s, e1, g1))
        s = vbcast(xf, xh + i)
        t = vbcast(xf, xh + i + 1)
        h0 = vfma(t, o0, vfma(s, e0, h0))
        h1 = vfma(t, o1, vfma(s, e1, h1))
        s = vbcast(xf, xq + i)
        t = vbcast(xf, xq + i + 1)
        q0 = vfma(t, o0, vfma(s, e0, q0))
        q1 = vfma(t, o1, vfma(s, e1, q1))
    vstore(part, pa, a0)
    vstore(part, pa + 16, a1)
    vstore(part, pb, b0)
    vstore(part, pb + 16, b1)
    vstore(part, pc, c0)
    vstore(part, pc + 16, c1)
    vstore(part, pd, d0)
    vstore(part, pd + 16, d1)
    vstore(part, pe, f0)
    vstore(part, pe + 16, f1)
    vstore(part, pg, g0)
    vstore(part, pg + 16, g1)
    vstore(part, ph, h0)
    vstore(part, ph + 16, h1)
    vstore(part, pq, q0)
    vstore(part, pq + 16, q1)


@jit
def tile1(xf, xa, w, wb0, wb1, kstep, rstep, k2a, k2b, odd_k, part, pa):
    """One row: the memory-bound decode case, with no FMAs spent on repeated rows."""
    a0 = vload(part, pa)
    a1 = vload(part, pa + 16)
    c0 = vzero()
    c1 = vzero()
    for k2 in range(k2a, k2b):
        e0, o0 = load_k2(w, wb0 + kstep * k2, rstep)
        e1, o1 = load_k2(w, wb1 + kstep * k2, rstep)
        _prefetch_ahead(w, wb0, wb1, kstep, rstep, k2)
        s = vbcast(xf, xa + 2 * k2)
        t = vbcast(xf, xa + 2 * k2 + 1)
        a0 = vfma(s, e0, a0)
        c0 = vfma(t, o0, c0)
        a1 = vfma(s, e1, a1)
        c1 = vfma(t, o1, c1)
    if odd_k:
        s = vbcast(xf, xa + 2 * k2b)
        a0 = vfma(s, load_k_last(w, wb0 + kstep * k2b), a0)
        a1 = vfma(s, load_k_last(w, wb1 + kstep * k2b), a1)
    vstore(part, pa, vadd(a0, c0))
    vstore(part, pa + 16, vadd(a1, c1))


# The callers' forms of the tiles: rows named by a first row and a stride (or an array of
# gathered offsets) instead of 8 (or 4) listed offsets. inline="always" inlines them at
# Numba's IR level, so the caller makes exactly the tile call it would have spelt out.


@jit(inline="always")
def tile8_rows(xf, r, xs, w, wb0, wb1, kstep, rstep, k2a, k2b, part, p0, ps):
    """tile8 over rows ``r .. r+7``: activation row q at ``q*xs``, accumulator at ``p0 + q*ps``."""
    xa = r * xs
    pa = p0 + r * ps
    tile8(
        xf,
        xa,
        xa + xs,
        xa + 2 * xs,
        xa + 3 * xs,
        xa + 4 * xs,
        xa + 5 * xs,
        xa + 6 * xs,
        xa + 7 * xs,
        w,
        wb0,
        wb1,
        kstep,
        rstep,
        k2a,
        k2b,
        part,
        pa,
        pa + ps,
        pa + 2 * ps,
        pa + 3 * ps,
        pa + 4 * ps,
        pa + 5 * ps,
        pa + 6 * ps,
        pa + 7 * ps,
    )


@jit(inline="always")
def tile4_rows(xf, r, last, xs, w, wb0, wb1, kstep, rstep, k2a, k2b, odd_k, part, p0, ps):
    """tile4 over rows ``r .. r+3`` clamped to ``last`` (addressed as in :func:`tile8_rows`)."""
    rb = min(r + 1, last)
    rc = min(r + 2, last)
    rd = min(r + 3, last)
    xa, xb, xc, xd = r * xs, rb * xs, rc * xs, rd * xs
    pa, pb, pc, pd = p0 + r * ps, p0 + rb * ps, p0 + rc * ps, p0 + rd * ps
    tile4(xf, xa, xb, xc, xd, w, wb0, wb1, kstep, rstep, k2a, k2b, odd_k, part, pa, pb, pc, pd)


@jit(inline="always")
def tile8_gathered(xf, x, w, wb0, wb1, kstep, rstep, k2a, k2b, part, p0, ps):
    """tile8 over the activation rows at offsets ``x[0:8]``, accumulator q at ``p0 + q*ps``."""
    tile8(
        xf,
        x[0],
        x[1],
        x[2],
        x[3],
        x[4],
        x[5],
        x[6],
        x[7],
        w,
        wb0,
        wb1,
        kstep,
        rstep,
        k2a,
        k2b,
        part,
        p0,
        p0 + ps,
        p0 + 2 * ps,
        p0 + 3 * ps,
        p0 + 4 * ps,
        p0 + 5 * ps,
        p0 + 6 * ps,
        p0 + 7 * ps,
    )


@jit(inline="always")
def tile4_gathered(xf, x, w, wb0, wb1, kstep, rstep, k2a, k2b, odd_k, part, p0, ps):
    """tile4 over the activation rows at offsets ``x[0:4]`` (as :func:`tile8_gathered`)."""
    xa, xb, xc, xd = x[0], x[1], x[2], x[3]
    pa, pb, pc, pd = p0, p0 + ps, p0 + 2 * ps, p0 + 3 * ps
    tile4(xf, xa, xb, xc, xd, w, wb0, wb1, kstep, rstep, k2a, k2b, odd_k, part, pa, pb, pc, pd)


# ---------------------------------------------------------------------------------------
# vdpbf16ps tiles (AVX512-BF16 only: compile them only where isa.has("avx512bf16")).
#
# Activations stay bf16 bits (a uint16 array, element offsets ``x_r``) and so do weights,
# in either form above for bf16: pair carriers (``uint32``) or rows (``uint16``, MoE's
# vec layout: the odd row right after the even one, ``rstep`` 16, interleaved into pairs
# by one shuffle per K pair and group, shared by every row of the tile; measured 13%
# faster than two row loads and a two-source shuffle, 7% behind pair carriers, on Zen 4).
# Per K pair, one 32-bit broadcast gives a row's (x[k even], x[k odd]) and ``dpbf16``
# adds both exact products to 16 accumulators.


def load_raw_k2(w, ofs, rstep):
    """The 16 (k even, k odd) bf16 pairs of one K pair for 16 columns, as ``i32x16``."""


@overload(load_raw_k2, inline="always")
def _load_raw_k2(w, ofs, rstep):
    if w.dtype == types.uint32:
        return lambda w, ofs, rstep: vload_raw_pairs(w, ofs)
    if w.dtype == types.uint16:  # the odd row right after the even one (rstep 16)
        return lambda w, ofs, rstep: vinterleave_raw(w, ofs)
    raise TypeError(f"load_raw_k2: expected bf16 weights (uint32 pairs or uint16 rows), got {w}")


@jit(inline="always")
def _dp_row(x, xr, w0, w1, acc0, acc1):
    s = vbcast_raw_pair(x, xr)
    return dpbf16(acc0, w0, s), dpbf16(acc1, w1, s)


@jit
def tile8_dp(
    x,
    xa,
    xb,
    xc,
    xd,
    xe,
    xg,
    xh,
    xq,
    w,
    wb0,
    wb1,
    kstep,
    rstep,
    k2a,
    k2b,
    part,
    pa,
    pb,
    pc,
    pd,
    pe,
    pg,
    ph,
    pq,
):
    """part[p_r + 0:32] += x_r[2*k2a : 2*k2b] @ (group0 | group1), 8 rows, vdpbf16ps."""
    a0 = vload(part, pa)
    a1 = vload(part, pa + 16)
    b0 = vload(part, pb)
    b1 = vload(part, pb + 16)
    c0 = vload(part, pc)
    c1 = vload(part, pc + 16)
    d0 = vload(part, pd)
    d1 = vload(part, pd + 16)
    f0 = vload(part, pe)
    f1 = vload(part, pe + 16)
    g0 = vload(part, pg)
    g1 = vload(part, pg + 16)
    h0 = vload(part, ph)
    h1 = vload(part, ph + 16)
    q0 = vload(part, pq)
    q1 = vload(part, pq + 16)
    for k2 in range(k2a, k2b):
        w0 = load_raw_k2(w, wb0 + kstep * k2, rstep)
        w1 = load_raw_k2(w, wb1 + kstep * k2, rstep)
        _prefetch_ahead(w, wb0, wb1, kstep, rstep, k2)
        i = 2 * k2
        a0, a1 = _dp_row(x, xa + i, w0, w1, a0, a1)
        b0, b1 = _dp_row(x, xb + i, w0, w1, b0, b1)
        c0, c1 = _dp_row(x, xc + i, w0, w1, c0, c1)
        d0, d1 = _dp_row(x, xd + i, w0, w1, d0, d1)
        f0, f1 = _dp_row(x, xe + i, w0, w1, f0, f1)
        g0, g1 = _dp_row(x, xg + i, w0, w1, g0, g1)
        h0, h1 = _dp_row(x, xh + i, w0, w1, h0, h1)
        q0, q1 = _dp_row(x, xq + i, w0, w1, q0, q1)
    vstore(part, pa, a0)
    vstore(part, pa + 16, a1)
    vstore(part, pb, b0)
    vstore(part, pb + 16, b1)
    vstore(part, pc, c0)
    vstore(part, pc + 16, c1)
    vstore(part, pd, d0)
    vstore(part, pd + 16, d1)
    vstore(part, pe, f0)
    vstore(part, pe + 16, f1)
    vstore(part, pg, g0)
    vstore(part, pg + 16, g1)
    vstore(part, ph, h0)
    vstore(part, ph + 16, h1)
    vstore(part, pq, q0)
    vstore(part, pq + 16, q1)


@jit
def tile4_dp(x, xa, xb, xc, xd, w, wb0, wb1, kstep, rstep, k2a, k2b, part, pa, pb, pc, pd):
    """part[p_r + 0:32] += x_r[2*k2a : 2*k2b] @ (group0 | group1), 4 rows, vdpbf16ps."""
    a0 = vload(part, pa)
    a1 = vload(part, pa + 16)
    b0 = vload(part, pb)
    b1 = vload(part, pb + 16)
    c0 = vload(part, pc)
    c1 = vload(part, pc + 16)
    d0 = vload(part, pd)
    d1 = vload(part, pd + 16)
    for k2 in range(k2a, k2b):
        w0 = load_raw_k2(w, wb0 + kstep * k2, rstep)
        w1 = load_raw_k2(w, wb1 + kstep * k2, rstep)
        _prefetch_ahead(w, wb0, wb1, kstep, rstep, k2)
        i = 2 * k2
        a0, a1 = _dp_row(x, xa + i, w0, w1, a0, a1)
        b0, b1 = _dp_row(x, xb + i, w0, w1, b0, b1)
        c0, c1 = _dp_row(x, xc + i, w0, w1, c0, c1)
        d0, d1 = _dp_row(x, xd + i, w0, w1, d0, d1)
    vstore(part, pd, d0)
    vstore(part, pd + 16, d1)
    vstore(part, pc, c0)
    vstore(part, pc + 16, c1)
    vstore(part, pb, b0)
    vstore(part, pb + 16, b1)
    vstore(part, pa, a0)
    vstore(part, pa + 16, a1)


@jit
def tile1_dp(x, xa, w, wb0, wb1, kstep, rstep, k2a, k2b, part, pa):
    """part[pa + 0:32] += x[xa + 2*k2a : xa + 2*k2b] @ (group0 | group1), one row,
    vdpbf16ps: the memory-bound decode case, one instruction per 16 columns and K pair
    (the widening tile1 spends two more on the weight). Two accumulator pairs take
    alternate K pairs, so consecutive vdpbf16ps do not wait on each other."""
    a0 = vload(part, pa)
    a1 = vload(part, pa + 16)
    c0 = vzero()
    c1 = vzero()
    k2 = k2a
    while k2 + 2 <= k2b:
        _prefetch_ahead(w, wb0, wb1, kstep, rstep, k2)
        _prefetch_ahead(w, wb0, wb1, kstep, rstep, k2 + 1)
        s = vbcast_raw_pair(x, xa + 2 * k2)
        a0 = dpbf16(a0, load_raw_k2(w, wb0 + kstep * k2, rstep), s)
        a1 = dpbf16(a1, load_raw_k2(w, wb1 + kstep * k2, rstep), s)
        t = vbcast_raw_pair(x, xa + 2 * k2 + 2)
        c0 = dpbf16(c0, load_raw_k2(w, wb0 + kstep * (k2 + 1), rstep), t)
        c1 = dpbf16(c1, load_raw_k2(w, wb1 + kstep * (k2 + 1), rstep), t)
        k2 += 2
    if k2 < k2b:
        s = vbcast_raw_pair(x, xa + 2 * k2)
        a0 = dpbf16(a0, load_raw_k2(w, wb0 + kstep * k2, rstep), s)
        a1 = dpbf16(a1, load_raw_k2(w, wb1 + kstep * k2, rstep), s)
    vstore(part, pa, vadd(a0, c0))
    vstore(part, pa + 16, vadd(a1, c1))


@jit(inline="always")
def tile8_dp_rows(x, r, xs, w, wb0, wb1, kstep, rstep, k2a, k2b, part, p0, ps):
    """tile8_dp over rows ``r .. r+7`` (addressed as in :func:`tile8_rows`)."""
    xa = r * xs
    pa = p0 + r * ps
    tile8_dp(
        x,
        xa,
        xa + xs,
        xa + 2 * xs,
        xa + 3 * xs,
        xa + 4 * xs,
        xa + 5 * xs,
        xa + 6 * xs,
        xa + 7 * xs,
        w,
        wb0,
        wb1,
        kstep,
        rstep,
        k2a,
        k2b,
        part,
        pa,
        pa + ps,
        pa + 2 * ps,
        pa + 3 * ps,
        pa + 4 * ps,
        pa + 5 * ps,
        pa + 6 * ps,
        pa + 7 * ps,
    )


@jit(inline="always")
def tile4_dp_rows(x, r, last, xs, w, wb0, wb1, kstep, rstep, k2a, k2b, part, p0, ps):
    """tile4_dp over rows ``r .. r+3`` clamped to ``last`` (as :func:`tile4_rows`)."""
    rb = min(r + 1, last)
    rc = min(r + 2, last)
    rd = min(r + 3, last)
    xa, xb, xc, xd = r * xs, rb * xs, rc * xs, rd * xs
    pa, pb, pc, pd = p0 + r * ps, p0 + rb * ps, p0 + rc * ps, p0 + rd * ps
    tile4_dp(x, xa, xb, xc, xd, w, wb0, wb1, kstep, rstep, k2a, k2b, part, pa, pb, pc, pd)


@jit(inline="always")
def tile8_dp_gathered(x, xo, w, wb0, wb1, kstep, rstep, k2a, k2b, part, p0, ps):
    """tile8_dp over the activation rows at offsets ``xo[0:8]`` (as :func:`tile8_gathered`)."""
    tile8_dp(
        x,
        xo[0],
        xo[1],
        xo[2],
        xo[3],
        xo[4],
        xo[5],
        xo[6],
        xo[7],
        w,
        wb0,
        wb1,
        kstep,
        rstep,
        k2a,
        k2b,
        part,
        p0,
        p0 + ps,
        p0 + 2 * ps,
        p0 + 3 * ps,
        p0 + 4 * ps,
        p0 + 5 * ps,
        p0 + 6 * ps,
        p0 + 7 * ps,
    )


@jit(inline="always")
def tile4_dp_gathered(x, xo, w, wb0, wb1, kstep, rstep, k2a, k2b, part, p0, ps):
    """tile4_dp over the activation rows at offsets ``xo[0:4]`` (as :func:`tile4_gathered`)."""
    xa, xb, xc, xd = xo[0], xo[1], xo[2], xo[3]
    pa, pb, pc, pd = p0, p0 + ps, p0 + 2 * ps, p0 + 3 * ps
    tile4_dp(x, xa, xb, xc, xd, w, wb0, wb1, kstep, rstep, k2a, k2b, part, pa, pb, pc, pd)


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
def widen_panel(w, wb0, wb1, kstep, rstep, k2a, k2b, last_k, panel, gs):
    """``panel[g*gs + (k - 2*k2a)*16 + j]`` = fp32 weight of K row k, column ``16*g + j``
    (group g at ``wb_g``, addressed as the tiles above), for the K rows ``2*k2a`` to
    ``2*k2b`` and, with ``last_k``, the odd last one (fp32 weights)."""
    for k2 in range(k2a, k2b):
        e0, o0 = load_k2(w, wb0 + kstep * k2, rstep)
        e1, o1 = load_k2(w, wb1 + kstep * k2, rstep)
        p = 32 * (k2 - k2a)
        vstore(panel, p, e0)
        vstore(panel, p + 16, o0)
        vstore(panel, gs + p, e1)
        vstore(panel, gs + p + 16, o1)
    if last_k:
        p = 32 * (k2b - k2a)
        vstore(panel, p, load_k_last(w, wb0 + kstep * k2b))
        vstore(panel, gs + p, load_k_last(w, wb1 + kstep * k2b))


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
def tile4x16_both(xf, xo, nr, w, wb0, wb1, kstep, rstep, k2a, k2b, part, po):
    """tile4x16 over group 0 (accumulators at ``po``) and group 1 (at ``po`` + 16), in
    turns of STREAM_TURN_K2 K pairs, so the two weight streams are read together."""
    p1 = (po[0] + 16, po[1] + 16, po[2] + 16, po[3] + 16)
    for ka in range(k2a, k2b, STREAM_TURN_K2):
        kz = min(k2b, ka + STREAM_TURN_K2)
        tile4x16(xf, xo, nr, w, wb0, kstep, rstep, ka, kz, part, po)
        tile4x16(xf, xo, nr, w, wb1, kstep, rstep, ka, kz, part, p1)
