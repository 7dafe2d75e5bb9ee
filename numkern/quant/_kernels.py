"""Numba building blocks of the quantised linear (docs/kernels.md §13.7, §13.8).

The decoder (``numkern.decoder``) and the fused MoE (``numkern.moe``) call these inside
their own parallel regions; :func:`numkern.quant.quant_linear` is one caller of them.

Signatures (all arrays 1-D, C-contiguous; sizes are ints):

``new_act(m, k, wit) -> act``
    per-call activation scratch for ``m`` rows of ``k`` (``k`` a multiple of 32), for the
    path named by the witness ``wit`` (``numkern.simd_int8.PATH_WITNESS[path]``). Each
    caller owns its own (two Python threads may run kernels at once).
``quantize_rows(x, x_rs, k, r0, r1, act)``
    rows ``r0 .. r1-1`` of ``x`` (carrier uint16 bf16 / int16 fp16 / float32, row stride
    ``x_rs`` elements) into ``act``: int8 paths quantise per 32 K (symmetric:
    ``xd = amax / 127``, ``xq = roundeven(x / xd)``) and keep the per-16-K sums of the
    codes ``xs``; the fp32 path copies the rows widened to fp32 into ``xf`` and keeps
    their per-32-K sums ``xfs`` (int8 paths: ``xd * sum xq`` there, the sums of the
    quantised rows). Rows are independent: split them across threads freely.
``qblocks(out, out_rs, act, w, code, m, n, k, rb0, rb1, bias, has_bias)``
    ``out[r, 16*rb : 16*rb+16] = x[r] @ W[16*rb : 16*rb+16].T (+ bias)`` for every row
    ``r < m`` and row block ``rb0 <= rb < rb1`` (columns past ``n`` not written): ``w``
    the weight's uint8 buffer (``QuantWeight.data``, one weight), ``code`` its type code
    (``QuantWeight.code``, a runtime int: every type is compiled in one body), ``out``
    a carrier array (row stride ``out_rs``), ``bias`` fp32 ``[n]`` read only where
    ``has_bias``. Allocates its own ``[m, 16]`` fp32 scratch.

The arithmetic, per output ``(r, n)`` and scale group ``g`` of the weight (``d_g, m_g``,
offset ``o``, codes ``u``):

* int8 paths: ``acc += d_g * xd * (sum u * xq - o * sum xq) + m_g * xd * sum xq``: exactly
  the product of the dequantised weight with the quantised activations (integer sums are
  exact; fp32 from there).
* fp32 path: ``acc += d_g * sum (u - o) * x + m_g * sum x`` in fp32.
"""

from typing import NamedTuple

import numba
import numpy as np
from numba import types
from numba.extending import overload

from .. import amx
from .. import isa as _isa
from .._jit import jit
from .._ptr import _to_voidptr, keep_alive
from ..simd import (
    store_f32,
    vadd,
    vfma,
    vget,
    vhmax,
    vload,
    vmax,
    vmul,
    vsplat,
    vstore,
    vsub,
    vsum,
    vzero,
)
from ..simd_int8 import (
    EMULATED_VECTOR_PATH,
    PATH_FP32,
    PATH_MADDUBS,
    PATH_VNNI256,
    PATH_VNNI512,
    PATH_WITNESS,
    bload,
    bload_e8m0,
    bload_f16,
    bload_f32,
    bload_i8f,
    bload_u8f,
    bprefetch,
    bstore,
    bsub_c,
    dot4,
    dot4_u8,
    fbcast,
    iadd,
    iand_c,
    ibcast4,
    ibyte_f,
    ihsum,
    ior,
    ishl_c,
    ishr_c,
    isplat,
    isub,
    itof,
    izero,
    ld_f32,
    ld_i32,
    lut_mxfp4,
    vabs,
    vquant,
)
from .formats import (
    BITS,
    GROUP,
    HAS_MIN,
    KIND,
    MXFP4,
    OFFSET,
    PART_FIELDS,
    PART_HEADER,
    PARTS,
    Q6_K,
    SUPER,
    sections,
)

R = 16  # rows per row block: the 16 int32 lanes of one vector (docs/kernels.md)
QK = 32  # K per activation scale: the smallest GGML block, so every group lies in one
# Per call, K per cache slice at M > 4: every 4-row tile of the call passes over the row
# block's slice of weight (16 rows x 1024 K: 8 KB at 4 bits) while it is in L1.
K_SLICE = 1024
SMALL_M = 4  # rows per tile; up to this M the weight is streamed once
# bytes of codes ahead the GEMV (M = 1) prefetches its weight (numkern.isa.STREAM)
PF_BYTES = _isa.stream_rule().quant_ahead


# The activation scratch ``act`` is a plain tuple (a named tuple cannot cross into a
# parfor gufunc: Numba's gufunc source cannot name its class), indexed by these:
XQ = 0  # int8 [m * k]: codes (int8 paths)
XD = 1  # float32 [m * k / 32]: scale per 32 K (int8 paths)
XS = 2  # int32 [m * k / 16]: sum of the codes per 16 K (int8 paths)
XF = 3  # float32 [m * k]: the rows in fp32 (fp32 path)
XFS = 4  # float32 [m * k / 32]: their sums per 32 K (fp32 path); int8 paths: the sums
# of the quantised rows, ``xd * sum xq`` (the tiles' min term)
WIT = 5  # the path witness (numkern.simd_int8)


class QParams(NamedTuple):
    bits: int  # 4, 6 or 8 bits of code
    group: int  # K per scale group
    offset: int  # code offset: w = d * (u - offset) + m
    kind: int  # 0: fp16 d (and m); 1: K-quant D * sc (and -M * mn); 2: E8M0
    has_min: int
    sc_signed: int  # K-quant sc is int8 (Q6_K)
    lut: int  # codes through the MXFP4 table


class Sections(NamedTuple):
    """Byte offsets of a weight's sections (``formats.sections``; -1 where absent)."""

    codes: int
    high: int
    d: int  # kind 0: fp16 d; kind 1: fp32 D; kind 2: E8M0 e
    m: int  # kind 0: fp16 m; kind 1: fp32 M
    sc: int
    mn: int


@jit(inline="always")
def params(code):
    """The :class:`QParams` of a type code (``numkern.quant.formats``' table)."""
    return QParams(
        BITS[code], GROUP[code], OFFSET[code], KIND[code], HAS_MIN[code],
        code == Q6_K, code == MXFP4,
    )  # fmt: skip


@jit(inline="always")
def _sections(code, n, k):
    t = sections(code, n, k)
    return Sections(t[0], t[1], t[2], t[3], t[4], t[5])


def _fp32(wit):
    """Whether the witness names the fp32 path (a constant of the compiled code)."""


@overload(_fp32, inline="always")
def _fp32_impl(wit):
    fp = wit.dtype == types.float32
    return lambda wit: fp


@jit
def new_act(m, k, wit):
    """Scratch for ``m`` rows of ``k`` on the path of ``wit`` (unused arrays are empty)."""
    if _fp32(wit):
        return (
            np.empty(0, np.int8),
            np.empty(0, np.float32),
            np.empty(0, np.int32),
            np.empty(m * k, np.float32),
            np.empty(m * (k // QK), np.float32),
            wit,
        )
    return (
        np.empty(m * k, np.int8),
        np.empty(m * (k // QK), np.float32),
        np.empty(m * (k // 16), np.int32),
        np.empty(0, np.float32),
        np.empty(m * (k // QK), np.float32),
        wit,
    )


@jit
def quantize_rows(x, x_rs, k, r0, r1, act):
    for r in range(r0, r1):
        for b in range(k // QK):
            src = r * x_rs + b * QK
            v0 = vload(x, src)
            v1 = vload(x, src + 16)
            if _fp32(act[WIT]):
                vstore(act[XF], r * k + b * QK, v0)
                vstore(act[XF], r * k + b * QK + 16, v1)
                act[XFS][r * (k // QK) + b] = vsum(vadd(v0, v1))
            else:
                amax = vhmax(vmax(vabs(v0), vabs(v1)))
                # amax below 1e-30: 127 / amax would overflow; such a block is zero
                d = amax / np.float32(127.0) if amax > 1e-30 else np.float32(0.0)
                inv = np.float32(127.0) / amax if amax > 1e-30 else np.float32(0.0)
                q0 = vquant(act[XQ], r * k + b * QK, v0, inv)
                q1 = vquant(act[XQ], r * k + b * QK + 16, v1, inv)
                s0, s1 = ihsum(q0), ihsum(q1)
                act[XD][r * (k // QK) + b] = d
                act[XS][r * (k // 16) + 2 * b] = s0
                act[XS][r * (k // 16) + 2 * b + 1] = s1
                act[XFS][r * (k // QK) + b] = d * np.float32(s0 + s1)


@jit(inline="always")
def _nibbles(w, p, s, rb, k, cc):
    """Codes of nibble chunk ``cc`` (K 8cc .. 8cc+7) of row block ``rb``: (lo, hi), lane j's
    byte i the code of K 8cc+i (lo) and 8cc+4+i (hi), the high plane's bits added for
    6-bit types, through the LUT for MXFP4."""
    v = bload(w, s.codes + (rb * (k // 8) + cc) * 64)
    lo = iand_c(v, 0x0F0F0F0F)
    hi = iand_c(ishr_c(v, 4), 0x0F0F0F0F)
    if p.bits == 6:
        h = bload(w, s.high + (rb * (k // 16) + cc // 2) * 64)
        sh = 4 * (cc % 2)
        lo = ior(lo, ishl_c(iand_c(ishr_c(h, sh), 0x03030303), 4))
        hi = ior(hi, ishl_c(iand_c(ishr_c(h, sh + 2), 0x03030303), 4))
    if p.lut:
        lo = lut_mxfp4(lo)
        hi = lut_mxfp4(hi)
    return lo, hi


@jit(inline="always")
def _scales(w, p, s, rb, g, k):
    """(d_g, m_g) of group ``g`` of row block ``rb``, 16 rows each, fp32."""
    gi = (rb * (k // p.group) + g) * R
    mv = vzero()
    if p.kind == 0:
        d = bload_f16(w, s.d + 2 * gi)
        if p.has_min:
            mv = bload_f16(w, s.m + 2 * gi)
    elif p.kind == 1:
        si = (rb * (k // 256) + (g * p.group) // 256) * R
        if p.sc_signed:
            sc = bload_i8f(w, s.sc + gi)
        else:
            sc = bload_u8f(w, s.sc + gi)
        d = vmul(bload_f32(w, s.d + 4 * si), sc)
        if p.has_min:
            mv = vsub(mv, vmul(bload_f32(w, s.m + 4 * si), bload_u8f(w, s.mn + gi)))
    else:
        d = bload_e8m0(w, s.d + gi)
    return d, mv


@jit(inline="always")
def _fma8(acc, wl, wh, xf, xk):
    """``acc + wl * x[xk] + wh * x[xk + 4]`` (K and K + 4 of one row, fp32)."""
    return vfma(wh, fbcast(xf, xk + 4), vfma(wl, fbcast(xf, xk), acc))


# A group is one or two straight-line units of 16 K (no loop: the group's 2-8 chunks
# left as a loop of runtime trip count measured ~2x slower for their overhead), and
# each unit has its own accumulators: vpdpbusd has a latency of 5 cycles on Zen 4, and
# one chain per row through a group's 8 instructions bound the GEMV well below stream.


@jit(inline="always")
def _u16(w, p, s, rb, k, kk):
    """The codes of K ``kk .. kk+15`` (``kk`` a multiple of 16) of row block ``rb``: four
    vectors, vector ``q`` holding K ``kk + 4q .. kk + 4q + 3`` (lane j = row j)."""
    if p.bits == 8:
        base = s.codes + (rb * (k // 4) + kk // 4) * 64
        return bload(w, base), bload(w, base + 64), bload(w, base + 128), bload(w, base + 192)
    lo0, hi0 = _nibbles(w, p, s, rb, k, kk // 8)
    lo1, hi1 = _nibbles(w, p, s, rb, k, kk // 8 + 1)
    return lo0, hi0, lo1, hi1


@jit(inline="always")
def _dot16(acc, u0, u1, u2, u3, xq, xk, full, wit):
    """``acc`` + one row's dot products of 16 K (codes at ``xq + xk``), in two chains."""
    if full:  # 8-bit codes (Q8_0)
        a = dot4_u8(dot4_u8(acc, u0, ibcast4(xq, xk), wit), u2, ibcast4(xq, xk + 8), wit)
        b = dot4_u8(dot4_u8(izero(), u1, ibcast4(xq, xk + 4), wit), u3, ibcast4(xq, xk + 12), wit)
    else:
        a = dot4(dot4(acc, u0, ibcast4(xq, xk), wit), u2, ibcast4(xq, xk + 8), wit)
        b = dot4(dot4(izero(), u1, ibcast4(xq, xk + 4), wit), u3, ibcast4(xq, xk + 12), wit)
    return iadd(a, b)


@jit(inline="always")
def _isums(w, p, s, rb, k, kg, xq, x0, x1, x2, x3, wit):
    """Integer sums ``sum u * xq`` of one group for 4 activation rows (codes at
    ``xq + x_t + K``; rows may repeat)."""
    full = p.bits == 8
    u0, u1, u2, u3 = _u16(w, p, s, rb, k, kg)
    i0 = _dot16(izero(), u0, u1, u2, u3, xq, x0 + kg, full, wit)
    i1 = _dot16(izero(), u0, u1, u2, u3, xq, x1 + kg, full, wit)
    i2 = _dot16(izero(), u0, u1, u2, u3, xq, x2 + kg, full, wit)
    i3 = _dot16(izero(), u0, u1, u2, u3, xq, x3 + kg, full, wit)
    if p.group == 32:
        u0, u1, u2, u3 = _u16(w, p, s, rb, k, kg + 16)
        i0 = _dot16(i0, u0, u1, u2, u3, xq, x0 + kg + 16, full, wit)
        i1 = _dot16(i1, u0, u1, u2, u3, xq, x1 + kg + 16, full, wit)
        i2 = _dot16(i2, u0, u1, u2, u3, xq, x2 + kg + 16, full, wit)
        i3 = _dot16(i3, u0, u1, u2, u3, xq, x3 + kg + 16, full, wit)
    return i0, i1, i2, i3


@jit(inline="always")
def _isum1(w, p, s, rb, k, kg, xq, x0, wit):
    """:func:`_isums` for one row (decode: no duplicate rows' work)."""
    full = p.bits == 8
    u0, u1, u2, u3 = _u16(w, p, s, rb, k, kg)
    i0 = _dot16(izero(), u0, u1, u2, u3, xq, x0 + kg, full, wit)
    if p.group == 32:
        u0, u1, u2, u3 = _u16(w, p, s, rb, k, kg + 16)
        i0 = iadd(i0, _dot16(izero(), u0, u1, u2, u3, xq, x0 + kg + 16, full, wit))
    return i0


@jit(inline="always")
def _xsum(xa, row, kg, p, k):
    """``sum xq`` of one row over group ``kg``'s K."""
    xs = ld_i32(xa[XS], row * (k // 16) + kg // 16)
    if p.group == 32:
        xs += ld_i32(xa[XS], row * (k // 16) + kg // 16 + 1)
    return xs


@jit(inline="always")
def _scaled(acc, t, d, mv, xa, row, kg, p, k, xs):
    """``acc += d * xd * t + m * xd * sum xq`` for one row, ``t`` the group's exact
    ``sum (u - offset) * xq`` in fp32 (the vector and the tile paths' one epilogue)."""
    dx = ld_f32(xa[XD], row * (k // QK) + kg // QK)
    acc = vfma(t, vmul(d, vsplat(dx)), acc)
    if p.has_min:
        acc = vfma(mv, vsplat(dx * np.float32(xs)), acc)
    return acc


@jit(inline="always")
def _apply(acc, isum, d, mv, xa, row, kg, p, k):
    """``acc += d * xd * (isum - offset * sum xq) + m * xd * sum xq`` for one row."""
    xs = _xsum(xa, row, kg, p, k)
    return _scaled(acc, itof(isub(isum, isplat(p.offset * xs))), d, mv, xa, row, kg, p, k, xs)


@jit(inline="always")
def _fsums(w, p, s, rb, k, kg, xf, x0, x1, x2, x3):
    """fp32 sums ``sum (u - offset) * x`` of one group for 4 rows (rows may repeat)."""
    a0 = vzero()
    a1 = vzero()
    a2 = vzero()
    a3 = vzero()
    off = p.offset
    if p.bits == 8:
        for c in range(p.group // 4):
            kk = kg + 4 * c
            v = bload(w, s.codes + (rb * (k // 4) + kk // 4) * 64)
            for i in range(4):
                wk = ibyte_f(v, i, off)
                a0 = vfma(wk, fbcast(xf, x0 + kk + i), a0)
                a1 = vfma(wk, fbcast(xf, x1 + kk + i), a1)
                a2 = vfma(wk, fbcast(xf, x2 + kk + i), a2)
                a3 = vfma(wk, fbcast(xf, x3 + kk + i), a3)
    else:
        for c in range(p.group // 8):
            kk = kg + 8 * c
            lo, hi = _nibbles(w, p, s, rb, k, kk // 8)
            for i in range(4):
                wl = ibyte_f(lo, i, off)
                wh = ibyte_f(hi, i, off)
                a0 = _fma8(a0, wl, wh, xf, x0 + kk + i)
                a1 = _fma8(a1, wl, wh, xf, x1 + kk + i)
                a2 = _fma8(a2, wl, wh, xf, x2 + kk + i)
                a3 = _fma8(a3, wl, wh, xf, x3 + kk + i)
    return a0, a1, a2, a3


@jit(inline="always")
def _fsum1(w, p, s, rb, k, kg, xf, x0):
    """:func:`_fsums` for one row (four FMA chains)."""
    a0 = vzero()
    a1 = vzero()
    a2 = vzero()
    a3 = vzero()
    off = p.offset
    if p.bits == 8:
        for c in range(p.group // 4):
            kk = kg + 4 * c
            v = bload(w, s.codes + (rb * (k // 4) + kk // 4) * 64)
            a0 = vfma(ibyte_f(v, 0, off), fbcast(xf, x0 + kk), a0)
            a1 = vfma(ibyte_f(v, 1, off), fbcast(xf, x0 + kk + 1), a1)
            a2 = vfma(ibyte_f(v, 2, off), fbcast(xf, x0 + kk + 2), a2)
            a3 = vfma(ibyte_f(v, 3, off), fbcast(xf, x0 + kk + 3), a3)
    else:
        for c in range(p.group // 8):
            kk = kg + 8 * c
            lo, hi = _nibbles(w, p, s, rb, k, kk // 8)
            a0 = _fma8(a0, ibyte_f(lo, 0, off), ibyte_f(hi, 0, off), xf, x0 + kk)
            a1 = _fma8(a1, ibyte_f(lo, 1, off), ibyte_f(hi, 1, off), xf, x0 + kk + 1)
            a2 = _fma8(a2, ibyte_f(lo, 2, off), ibyte_f(hi, 2, off), xf, x0 + kk + 2)
            a3 = _fma8(a3, ibyte_f(lo, 3, off), ibyte_f(hi, 3, off), xf, x0 + kk + 3)
    return vadd(vadd(a0, a1), vadd(a2, a3))


@jit(inline="always")
def _fapply(acc, a, d, mv, xa, row, kg, p, k):
    """``acc += d * a + m * sum x`` for one row (fp32 path)."""
    acc = vfma(a, d, acc)
    if p.has_min:
        acc = vfma(mv, vsplat(ld_f32(xa[XFS], row * (k // QK) + kg // QK)), acc)
    return acc


@jit(inline="always")
def _prefetch_ahead(w, p, s, rb, g, k):
    """Prefetch the lines of the scale group :data:`PF_BYTES` of codes ahead of group ``g``
    of row block ``rb``, with its scales. Every section is laid out [row block][K], so
    counting on past a row block's last group reaches the next row block's first (a
    hint past the buffer's end is harmless)."""
    code_bytes = p.group * (16 if p.bits == 8 else 8)  # a group's code bytes (16 rows)
    gg = rb * (k // p.group) + g + max(1, PF_BYTES // code_bytes)  # global group index
    for off in range(0, code_bytes, 64):
        bprefetch(w, s.codes + gg * code_bytes + off)
    if p.bits == 6:
        bprefetch(w, s.high + gg * p.group * 4)
    if p.kind == 0:
        bprefetch(w, s.d + 32 * gg)
        if p.has_min:
            bprefetch(w, s.m + 32 * gg)
    elif p.kind == 1:
        bprefetch(w, s.sc + 16 * gg)
        bprefetch(w, s.d + 64 * ((gg * p.group) // SUPER))
        if p.has_min:
            bprefetch(w, s.mn + 16 * gg)
            bprefetch(w, s.m + 64 * ((gg * p.group) // SUPER))
    else:
        bprefetch(w, s.d + 16 * gg)


@jit(inline="always")
def _tile1(part, xa, pw, w, p, s, rb, k):
    """``part[0] = x[0] @ W[row block rb].T`` (M = 1)."""
    acc = vzero()
    for g in range(k // p.group):
        kg = g * p.group
        if PF_BYTES:
            _prefetch_ahead(w, p, s, rb, g, k)
        d, mv = _scales(w, p, s, rb, g, k)
        if _fp32(pw):
            acc = _fapply(acc, _fsum1(w, p, s, rb, k, kg, xa[XF], 0), d, mv, xa, 0, kg, p, k)
        else:
            acc = _apply(acc, _isum1(w, p, s, rb, k, kg, xa[XQ], 0, pw), d, mv, xa, 0, kg, p, k)
    vstore(part, 0, acc)


@jit(inline="always")
def _tile4(part, xa, pw, w, p, s, rb, r0, m, k, ga, gz):
    """``part[r] += x[r] @ W[row block rb, groups ga .. gz-1].T`` for the rows
    ``r0 .. min(r0 + 4, m) - 1``; past ``m`` the last row repeats (its work is discarded:
    every row runs unconditionally, branches in the loop would be unswitched into 8
    copies of it, which measured several times the compile time)."""
    r1 = min(r0 + 1, m - 1)
    r2 = min(r0 + 2, m - 1)
    r3 = min(r0 + 3, m - 1)
    acc0 = vload(part, r0 * R)
    acc1 = vload(part, r1 * R)
    acc2 = vload(part, r2 * R)
    acc3 = vload(part, r3 * R)
    for g in range(ga, gz):
        kg = g * p.group
        d, mv = _scales(w, p, s, rb, g, k)
        if _fp32(pw):
            xf = xa[XF]
            a0, a1, a2, a3 = _fsums(w, p, s, rb, k, kg, xf, r0 * k, r1 * k, r2 * k, r3 * k)
            acc0 = _fapply(acc0, a0, d, mv, xa, r0, kg, p, k)
            acc1 = _fapply(acc1, a1, d, mv, xa, r1, kg, p, k)
            acc2 = _fapply(acc2, a2, d, mv, xa, r2, kg, p, k)
            acc3 = _fapply(acc3, a3, d, mv, xa, r3, kg, p, k)
        else:
            xq = xa[XQ]
            i0, i1, i2, i3 = _isums(w, p, s, rb, k, kg, xq, r0 * k, r1 * k, r2 * k, r3 * k, pw)
            acc0 = _apply(acc0, i0, d, mv, xa, r0, kg, p, k)
            acc1 = _apply(acc1, i1, d, mv, xa, r1, kg, p, k)
            acc2 = _apply(acc2, i2, d, mv, xa, r2, kg, p, k)
            acc3 = _apply(acc3, i3, d, mv, xa, r3, kg, p, k)
    # duplicates hold the same sums as the row they repeat: store from the last down
    vstore(part, r3 * R, acc3)
    vstore(part, r2 * R, acc2)
    vstore(part, r1 * R, acc1)
    vstore(part, r0 * R, acc0)


@jit(inline="always")
def _store(out, out_rs, part, bias, has_bias, m, n, rb):
    n0 = rb * R
    full = n0 + R <= n
    for r in range(m):
        v = vload(part, r * R)
        if full:
            if has_bias:
                v = vadd(v, vload(bias, n0))
            vstore(out, r * out_rs + n0, v)
        else:
            for j in range(n - n0):
                val = vget(v, j)
                if has_bias:
                    val += bias[n0 + j]
                store_f32(out, r * out_rs + n0 + j, val)


@jit
def _qvec(out, out_rs, xa, wit, w, code, m, n, k, rb0, rb1, bias, has_bias):
    """:func:`qblocks` on the vector path of the witness ``wit``, the activation scratch
    given by the addresses ``xa`` of its arrays (indexed as ``act``)."""
    p = params(code)
    s = _sections(code, n, k)
    ng = k // p.group
    # M <= 4: one tile streams the weight once; else K slices that stay in L1
    gs = ng if m <= SMALL_M else max(1, K_SLICE // p.group)
    part = np.empty(m * R, np.float32)
    # addresses, not arrays, into the loops (numkern.simd_int8 says why)
    wa = w.ctypes.data
    pw = wit.dtype
    for rb in range(rb0, rb1):
        if m == 1:
            _tile1(part, xa, pw, wa, p, s, rb, k)
            _store(out, out_rs, part, bias, has_bias, m, n, rb)
            continue
        part[:] = 0.0
        for ga in range(0, ng, gs):
            gz = min(ng, ga + gs)
            for r0 in range(0, m, SMALL_M):
                _tile4(part, xa, pw, wa, p, s, rb, r0, m, k, ga, gz)
        _store(out, out_rs, part, bias, has_bias, m, n, rb)


# ---------------------------------------------------------------------------------------
# M > 4 on AMX-INT8 tiles (the witness "amx": real tiles, "amx-emulated": emulated)
#
# Per row block (16 columns) and K slice, the weight's codes are unpacked once to signed
# bytes ``u - offset`` in the tiles' quad order (``_unpack``: row ``K/4`` of 16 lanes x 4
# bytes, the layout's own lane order, so a group of 32 K is one 8-row B tile); then per
# 16 rows and scale group one ``tdpbssd`` (A: the rows' int8 codes of the group, straight
# from the activation scratch) gives the group's exact integer sums, stored and scaled
# into the fp32 rows as the vector path's ``_scaled`` does, in the same order, so the
# two paths agree bit for bit (integer sums are exact on both; ``xd * sum xq`` is the
# same fp32 product, made once per row by ``quantize_rows``).

TA0, TB0, TA1, TB1, TC0, TC1, TC2, TC3 = range(8)  # tile numbers
PAIR_BYTES = 2 * 16 * 64  # a pair's two stored C tiles


@jit(inline="always")
def _unpack(bw, wa, p, s, rb, k, k0, k1):
    """Signed codes ``u - offset`` of K ``k0 .. k1-1`` of row block ``rb`` to the address
    ``bw``: 64 bytes per 4 K (lane j = row j's four codes), the B tiles' quads."""
    if p.bits == 8:
        for q in range(k0 // 4, k1 // 4):
            v = bload(wa, s.codes + (rb * (k // 4) + q) * 64)
            bstore(bw, (q - k0 // 4) * 64, bsub_c(v, p.offset))
    else:
        for cc in range(k0 // 8, k1 // 8):
            lo, hi = _nibbles(wa, p, s, rb, k, cc)
            bstore(bw, (cc - k0 // 8) * 128, bsub_c(lo, p.offset))
            bstore(bw, (cc - k0 // 8) * 128 + 64, bsub_c(hi, p.offset))


# A pair of scale groups of one row tile: A rows from ``xq + a0`` (``k`` bytes apart,
# ``step`` K a group), B from ``bw + b0``; group j's sums in the pair's C tile j, stored
# to ``cb + 1024 j`` (addresses: no array in the loop). Two pairs are in flight (C tiles
# 4, 5 and 6, 7): a pair's products are issued before the previous pair's epilogue, so
# the tile unit works while the vector units scale (tiles are not renamed: a product
# waits for the one before it on the same tile).


@jit(inline="always")
def _pair(ctx, c0, c1, xq, a0, k, bw, b0, step, cb, nb):
    """The pair's products into C tiles ``c0``, ``c1`` (literal numbers), then stored."""
    amx.tile_load(ctx, TA0, xq, a0, k)
    amx.tile_load(ctx, TB0, bw, b0, 64)
    amx.tile_zero(ctx, c0)
    amx.tile_dpbssd(ctx, c0, TA0, TB0)
    if nb > 1:
        amx.tile_load(ctx, TA1, xq, a0 + step, k)
        amx.tile_load(ctx, TB1, bw, b0 + 16 * step, 64)
        amx.tile_zero(ctx, c1)
        amx.tile_dpbssd(ctx, c1, TA1, TB1)
    amx.tile_store(ctx, c0, cb, 0, 64)
    if nb > 1:
        amx.tile_store(ctx, c1, cb, 1024, 64)


@jit(inline="always")
def _pair_epilogue(part, cb, wa, p, s, rb, g, nb, xa, t0, skip, rows, k):
    """``part`` rows ``t0 + skip .. t0 + rows - 1`` += the pair's scaled sums (groups
    ``g``, ``g + 1`` where ``nb`` is 2; stored at the address ``cb``), group by group as
    :func:`_scaled`, ``xd * sum xq`` read from ``XFS``."""
    d0, m0 = _scales(wa, p, s, rb, g, k)
    d1, m1 = _scales(wa, p, s, rb, g + nb - 1, k)
    kq = k // QK
    for r in range(skip, rows):
        row = t0 + r
        i0 = row * kq + (g * p.group) // QK
        acc = vfma(itof(bload(cb, r * 64)), vmul(d0, vsplat(ld_f32(xa[XD], i0))),
                   vload(part, row * R))  # fmt: skip
        if p.has_min:
            acc = vfma(m0, vsplat(ld_f32(xa[XFS], i0)), acc)
        if nb > 1:
            i1 = row * kq + ((g + 1) * p.group) // QK
            acc = vfma(itof(bload(cb, 1024 + r * 64)), vmul(d1, vsplat(ld_f32(xa[XD], i1))), acc)
            if p.has_min:
                acc = vfma(m1, vsplat(ld_f32(xa[XFS], i1)), acc)
        vstore(part, row * R, acc)


@jit
def qtiles(out, out_rs, xa, w, code, m, n, k, rb0, rb1, bias, has_bias, tiles):
    """:func:`qblocks` on AMX-INT8 tiles (``tiles``: the witness, real or emulated) for
    ``m > SMALL_M``. Row tiles of ``min(m, 16)`` rows; a last partial one starts at row
    ``m - 16`` (rows already summed are skipped), so one configuration serves every M."""
    p = params(code)
    s = _sections(code, n, k)
    ng = k // p.group
    gs = max(1, K_SLICE // p.group)  # groups per K slice (as the vector path's)
    part = np.empty(m * R, np.float32)
    bw = np.empty(K_SLICE * R, np.int8)
    cb = np.empty(2 * PAIR_BYTES // 4, np.int32)
    wa, bwa, cba = w.ctypes.data, bw.ctypes.data, cb.ctypes.data
    xq, step = xa[XQ], p.group
    rows = min(m, 16)
    ctx = amx.context(tiles)
    amx.tile_shape(ctx, TA0, rows, step)
    amx.tile_shape(ctx, TA1, rows, step)
    amx.tile_shape(ctx, TB0, step // 4, 64)
    amx.tile_shape(ctx, TB1, step // 4, 64)
    amx.tile_shape(ctx, TC0, rows, 64)
    amx.tile_shape(ctx, TC1, rows, 64)
    amx.tile_shape(ctx, TC2, rows, 64)
    amx.tile_shape(ctx, TC3, rows, 64)
    amx.tile_begin(ctx)
    for rb in range(rb0, rb1):
        part[:] = 0.0
        for ga in range(0, ng, gs):
            gz = min(ng, ga + gs)
            k0 = ga * step
            _unpack(bwa, wa, p, s, rb, k, k0, gz * step)
            npairs = (gz - ga + 1) // 2
            for r0 in range(0, m, 16):
                t0 = min(r0, m - rows)  # the tile's first row
                a0 = t0 * k + k0
                _pair(ctx, TC0, TC1, xq, a0, k, bwa, 0, step, cba, min(2, gz - ga))
                for i in range(1, npairs + 1):
                    if i < npairs:  # the next pair's products, then this one's epilogue
                        nb = min(2, gz - ga - 2 * i)
                        a, b = a0 + 2 * i * step, 32 * i * step
                        if i % 2:
                            _pair(ctx, TC2, TC3, xq, a, k, bwa, b, step, cba + PAIR_BYTES, nb)
                        else:
                            _pair(ctx, TC0, TC1, xq, a, k, bwa, b, step, cba, nb)
                    g = ga + 2 * (i - 1)
                    _pair_epilogue(part, cba + PAIR_BYTES * ((i - 1) % 2), wa, p, s, rb, g,
                                   min(2, gz - g), xa, t0, r0 - t0, rows, k)  # fmt: skip
        _store(out, out_rs, part, bias, has_bias, m, n, rb)
    amx.tile_end(ctx)
    keep_alive(bw)  # written and read through their addresses until here
    keep_alive(cb)


def _on_tiles(out, out_rs, xa, wit, w, code, m, n, k, rb0, rb1, bias, has_bias):
    """:func:`qtiles` where the witness ``wit`` names tiles and ``m > SMALL_M``; whether it
    ran (no tile code is typed for the other witnesses)."""


@overload(_on_tiles, inline="always")
def _on_tiles_impl(out, out_rs, xa, wit, w, code, m, n, k, rb0, rb1, bias, has_bias):
    if wit.dtype not in (types.uint8, types.uint16):
        return lambda out, out_rs, xa, wit, w, code, m, n, k, rb0, rb1, bias, has_bias: False

    def impl(out, out_rs, xa, wit, w, code, m, n, k, rb0, rb1, bias, has_bias):
        if m <= SMALL_M:
            return False
        qtiles(out, out_rs, xa, w, code, m, n, k, rb0, rb1, bias, has_bias, wit)
        return True

    return impl


# The vector path's witness, a module constant (no reference count, and one compiled
# vector body whichever witness reached it): VNNI-512 under real tiles (the amx path
# needs it), the host's own int8 path under emulated ones, else the path's own.
_VEC = {
    types.uint8: PATH_VNNI512,
    types.uint16: PATH_WITNESS[EMULATED_VECTOR_PATH],
    types.int32: PATH_VNNI512,
    types.int16: PATH_VNNI256,
    types.int8: PATH_MADDUBS,
    types.float32: PATH_FP32,
}


def _vector_witness(wit):
    """The (constant) witness of ``wit``'s vector path."""


@overload(_vector_witness, inline="always")
def _vector_witness_impl(wit):
    vec = _VEC[wit.dtype]
    return lambda wit: vec


@jit(inline="always")
def _blocks(out, out_rs, xa, wit, w, code, m, n, k, rb0, rb1, bias, has_bias):
    """:func:`qblocks` on one weight of one type."""
    if not _on_tiles(out, out_rs, xa, wit, w, code, m, n, k, rb0, rb1, bias, has_bias):
        _qvec(out, out_rs, xa, _vector_witness(wit), w, code, m, n, k, rb0, rb1, bias, has_bias)


@jit
def qblocks(out, out_rs, act, w, code, m, n, k, rb0, rb1, bias, has_bias):
    # the scratch by address: no tuple or array built per call (reference counts on the
    # arrays every worker shares would be contended atomics, ~10% at M = 4)
    xa = (act[XQ].ctypes.data, act[XD].ctypes.data, act[XS].ctypes.data, act[XF].ctypes.data,
          act[XFS].ctypes.data)  # fmt: skip
    wit = act[WIT]
    if code != PARTS:
        _blocks(out, out_rs, xa, wit, w, code, m, n, k, rb0, rb1, bias, has_bias)
        return
    # a weight of parts: each part's row blocks in [rb0, rb1) on its own type, its output
    # columns (and bias) from the part's first row (whole row blocks but for the last)
    head = w[:PART_HEADER].view(np.int64)
    for i in range(head[0]):
        f = 2 + PART_FIELDS * i
        p0, pcode, off, rows = head[f], head[f + 1], head[f + 2], head[f + 3]
        a, b = max(rb0, p0), min(rb1, p0 + (rows + R - 1) // R)
        if a < b:
            c0 = p0 * R
            _blocks(out[c0:], out_rs, xa, wit, w[off:], pcode, m, rows, k, a - p0, b - p0,
                    bias[c0:], has_bias)  # fmt: skip


@jit(inline="always")
def weight_bytes(addr, code, n, k):
    """Bytes of the weight buffer at ``addr`` of type ``code`` (``PARTS``: its header's)."""
    if code == PARTS:
        return numba.carray(_to_voidptr(addr), (2,), np.int64)[1]
    return sections(code, n, k)[6]
