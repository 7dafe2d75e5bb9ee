"""``chunk_gated_delta_rule``: the chunked (WY / UT-transform) form of the gated delta
rule, flash-linear-attention's, for prefill (``numkern.gdn.rule`` documents its
arguments and layouts).

Chunked form, per request and v head, chunks of C = 64 tokens, ``gc`` the cumulative sum
of g inside the chunk, ``L[i, j] = beta_i (k_i . k_j) exp(gc_i - gc_j)`` for j < i::

    (I + L) W = beta * exp(gc) * K     (I + L) U = beta * V
    V' = U - W S
    O  = (Q * exp(gc)) S + tril((Q K^T) * exp(gc_i - gc_j)) V'
    S  = S * exp(gc_last) + (K * exp(gc_last - gc))^T V'

One kernel body (:func:`_chunk_group`) serves two ways of multiplying, chosen when it
compiles by the operand carrier the wrapper passes (``op``, as ``numkern._tiles``
chooses by the activations' carrier):

* fp32 operands (fp32 and fp16 inputs, and CPUs without AVX512-BF16): every product
  fp32, W and U solved by forward substitution, each output element rounded once, so
  the two forms agree to fp32 rounding;
* bf16 operands (``uint16``; bf16 inputs where the CPU has it, :data:`DP_BF16`): the
  products on ``vdpbf16ps``, each operand rounded to bf16 (nearest even) first, every
  product accumulated in fp32 (docs/kernels.md §11.5 states the error measured): the
  L2-normalised q and k rows (the scores), W and the state S (``W S``, ``Q S``; the
  state itself stays fp32), the decayed scores and V' (the intra-chunk output), the
  decayed keys and V' (the state update). ``(I + L)^-1`` is formed (fp32) and
  multiplied rather than substituted. The decays stay fp32.

What differs is said by a few operations on operands, chosen by their carrier at
compile time: :func:`_bcast` (a row's operand to 16 lanes), :func:`_load` (16 lanes of
operands), :func:`_mac` (multiply-accumulate: an FMA, or ``vdpbf16ps`` on pairs) and
:func:`_store_tokens`; these are intrinsics (no compilation of their own). Only two
steps are two algorithms (:func:`wy`, :func:`intra`), overloads on the carrier. An
operand row of fp32 is one value per Dk (or token) index, of bf16 a pair: ``per`` = 1
or 2 elements per step. Layouts of bf16 pairs: keys transposed ``kt[(d2 C + j) 2 + e] =
k_j[2 d2 + e]`` (keys along lanes, pairs along Dk); state ``sp[(r2 Dv + c) 2 + e] =
S[2 r2 + e, c]``; rows along tokens ``vp[(i2 Dv + c) 2 + e] = V'[2 i2 + e, c]`` (row n
of an odd chunk zero); q, k, W row-major (rows of Dk), the decayed scores rows of C
(zero past the diagonal), broadcast one pair at a time. With fp32 operands the same
names hold plain rows (``per`` = 1): kt ``[Dk, C]``, the state read in place.

Kernel: one ``prange`` iteration per (request, k head) owns its v heads' states and
output rows, with its own scratch, so no two threads write one element; q and k rows
and their raw scores ``Q K^T``, ``K K^T`` are computed once per chunk for the k head's
v heads. The products are register blocked, 16 vector accumulators each, in one helper
(:func:`_four_rows`, four broadcast rows by 64 columns): ``W S`` and ``Q S`` two rows by
64 state columns at a time, ``K^T V'`` four state rows by 64 columns, the chunk's scores
two rows against up to 64 keys (transposed first, so no horizontal sums). On the fp32
path the forward substitution runs one row by 128 columns and the intra-chunk output one
row by 64 columns; on the bf16 path ``(I + L)^-1`` times pairs along tokens two rows by
64 columns (8 accumulators: ``vdpbf16ps`` has a latency of several cycles, so 8 chains).
"""

import math

import numpy as np
import torch
from numba import prange, types
from numba.extending import intrinsic, overload

from .. import _check as C
from .. import isa
from .._jit import jit
from ..simd import (
    LANES,
    dpbf16,
    f32x16,
    i32x16,
    to_f32,
    vadd,
    vbcast,
    vbcast_raw_pair,
    vexp,
    vfma,
    viota,
    vload,
    vload_pairs,
    vload_raw_pairs,
    vmul,
    vselect_lt,
    vsplat,
    vstore,
    vstore_pairs,
    vsub,
    vzero,
)
from ._rule_common import (
    CHUNK,
    STATE_COLS,
    Layout,
    _check_requests,
    _lincomb,
    _load4,
    _load_scaled,
    _solve_rows,
    _store4,
    check_qkv,
    check_rows,
    check_state,
)

# Whether bf16 inputs take the vdpbf16ps path (bf16 operands): a constant of the compiled
# code, numkern.isa's decision for the (possibly masked) CPU. fp16 and fp32 inputs always
# take fp32 operands (their callers asked for more than bf16's precision).
DP_BF16 = isa.decision().gdn_bf16

# The operand carriers the wrapper passes down (an empty array: its dtype is the choice)
_F32_OPERANDS = np.empty(0, np.float32)
_BF16_OPERANDS = np.empty(0, np.uint16)


# --- operations on operands (fp32 rows or bf16 pairs), chosen by the carrier ------------


@intrinsic
def _bcast(typingctx, arr, idx):
    """A row's operand at ``arr[idx]`` in 16 lanes: fp32, or the bf16 pair ``arr[idx],
    arr[idx + 1]`` as ``i32x16``."""
    return (vbcast if arr.dtype == types.float32 else vbcast_raw_pair)._defn(typingctx, arr, idx)


@intrinsic
def _per(typingctx, arr):
    """Operand values per element step of ``arr``'s carrier: 1 (fp32) or 2 (a bf16 pair),
    a constant of the compiled code (``arr.itemsize`` is read from the array at run time,
    so the loops and branches on it stayed in the bf16 path's inner loops)."""
    per = 1 if arr.dtype == types.float32 else 2

    def codegen(context, builder, sig, args):
        return context.get_constant(types.intp, per)

    return types.intp(arr), codegen


@intrinsic
def _load(typingctx, arr, idx):
    """16 lanes of operands at ``arr[idx]``: fp32, or 16 raw bf16 pairs (``i32x16``)."""
    return (vload if arr.dtype == types.float32 else vload_raw_pairs)._defn(typingctx, arr, idx)


@intrinsic
def _mac(typingctx, acc, a, b):
    """``acc + a b`` per lane: an FMA of fp32 operands, or ``vdpbf16ps`` (both products of
    each lane's bf16 pair) of ``i32x16`` ones."""
    if a == i32x16:
        return dpbf16._defn(typingctx, acc, a, b)
    typed = vfma._defn(typingctx, a, b, acc)
    if typed is None:
        return None
    sig, fma = typed

    def codegen(context, builder, _sig, args):
        return fma(context, builder, sig, (args[1], args[2], args[0]))

    return f32x16(acc, a, b), codegen


@intrinsic
def _store_tokens(typingctx, arr, idx, a, b):
    """Rows of two tokens as operands at ``arr[idx]``: bf16 pairs (a's and b's lanes
    interleaved, rounded), or a's lanes alone in fp32 (one token a step; b unused)."""
    if arr.dtype != types.float32:
        return vstore_pairs._defn(typingctx, arr, idx, a, b)
    typed = vstore._defn(typingctx, arr, idx, a)
    if typed is None:
        return None
    sig, store = typed

    def codegen(context, builder, _sig, args):
        return store(context, builder, sig, args[:3])

    return types.void(arr, idx, a, b), codegen


@jit
def _pick(c, a):
    """Vector c of the four ``a`` (a run-time c, the vectors kept as values)."""
    return a[0] if c == 0 else a[1] if c == 1 else a[2] if c == 2 else a[3]


# Inlined where Numba types its callers: a function of its own would return its 16
# accumulators through memory, and compile once more per operand carrier.
@jit(inline="always")
def _four_rows(xo, yo, x0, x1, y0, y1, bstep, src, p0, sstep, steps, nv):
    """Four operand rows broadcast — of ``xo`` at x0 and x1, of ``yo`` at y0 and y1, each
    ``bstep`` further a step — times the operand rows of ``src`` at ``p0 + s sstep``, up
    to 64 columns (nv vectors, 1..4), summed over ``steps`` steps: ``(x0's, x1's, y0's,
    y1's)``, each four fp32 vectors (those past nv zero). Each vector of src is loaded
    once for four products, 16 accumulators: the register block of the scores, of W S
    and Q S (two rows of two matrices) and of K^T V' (four state rows)."""
    per = _per(xo)
    zero = vzero()
    xa0 = xa1 = xa2 = xa3 = xb0 = xb1 = xb2 = xb3 = zero
    ya0 = ya1 = ya2 = ya3 = yb0 = yb1 = yb2 = yb3 = zero
    for st in range(steps):
        o = st * bstep
        xa = _bcast(xo, x0 + o)
        xb = _bcast(xo, x1 + o)
        ya = _bcast(yo, y0 + o)
        yb = _bcast(yo, y1 + o)
        p = p0 + st * sstep
        s = _load(src, p)
        xa0, xb0 = _mac(xa0, xa, s), _mac(xb0, xb, s)
        ya0, yb0 = _mac(ya0, ya, s), _mac(yb0, yb, s)
        if nv > 1:
            s = _load(src, p + LANES * per)
            xa1, xb1 = _mac(xa1, xa, s), _mac(xb1, xb, s)
            ya1, yb1 = _mac(ya1, ya, s), _mac(yb1, yb, s)
        if nv > 2:
            s = _load(src, p + 2 * LANES * per)
            xa2, xb2 = _mac(xa2, xa, s), _mac(xb2, xb, s)
            ya2, yb2 = _mac(ya2, ya, s), _mac(yb2, yb, s)
        if nv > 3:
            s = _load(src, p + 3 * LANES * per)
            xa3, xb3 = _mac(xa3, xa, s), _mac(xb3, xb, s)
            ya3, yb3 = _mac(ya3, ya, s), _mac(yb3, yb, s)
    return (
        (xa0, xa1, xa2, xa3),
        (xb0, xb1, xb2, xb3),
        (ya0, ya1, ya2, ya3),
        (yb0, yb1, yb2, yb3),
    )


# --- the steps ----------------------------------------------------------------------------


@jit
def _raw_scores(qs, ks, qo, ko, kt, qkr, kkr, n, dk):
    """``qkr[i, j] = q_i . k_j`` and ``kkr[i, j] = k_i . k_j`` (fp32, rows of CHUNK) for
    the key vectors up to the row pair's diagonal: once per k head and chunk, shared by
    its v heads. q and k's fp32 rows (``qs``, ``ks``) are first stored as operands
    (``qo``, ``ko``, rounded to the carrier), the keys also transposed into ``kt``; rows
    i, i+1 against up to 64 keys."""
    per = _per(ko)
    for p in range(0, n * dk, LANES):
        vstore(qo, p, vload(qs, p))
        vstore(ko, p, vload(ks, p))
    for j in range(n):
        for d in range(dk):
            kt[((d // per) * CHUNK + j) * per + d % per] = ko[j * dk + d]
    for i in range(0, n, 2):
        i1 = min(i + 1, n - 1)
        nv = i1 // LANES + 1  # key vectors up to key i1, 1..4 (kt's lanes past n: unused)
        ia, ib = i * dk, i1 * dk
        qa, qb, ka, kb = _four_rows(qo, ko, ia, ib, ia, ib, per, kt, 0, CHUNK * per, dk // per, nv)
        for c in range(nv):
            pa = i * CHUNK + c * LANES
            pb = i1 * CHUNK + c * LANES
            vstore(qkr, pa, _pick(c, qa))
            vstore(qkr, pb, _pick(c, qb))
            vstore(kkr, pa, _pick(c, ka))
            vstore(kkr, pb, _pick(c, kb))


# Inlined where Numba types its one caller: a function of its own is a compilation of
# its own per carrier (~0.2 s each here).
@jit(inline="always")
def _decay_scores(qkr, kkr, gc, gf, bt, dg, qm, lm, n):
    """One v head's decayed scores from the raw ones: ``qm[i, j] = qkr[i, j] exp(gc_i -
    gc_j)`` for j <= i, 0 past the diagonal (within the row pair's vectors), rounded to
    the operand carrier, and ``lm[i, j] = beta_i kkr[i, j] exp(gc_i - gc_j)`` (fp32;
    entries from the diagonal on hold anything). fp32 operands: the exponents are
    differences in float64, rounded, then ``vexp`` (two rows of them in ``dg``); bf16
    operands: differences of ``gf`` (gc rounded to fp32, lanes past n finite) in fp32
    vectors, as the bf16 path computed them before the two paths were one body (its
    outputs bit-equal to dd50c12's; the scores are rounded to bf16 after)."""
    zero = vzero()
    iota = viota()
    pairs = _per(qm) == 2
    for i in range(0, n, 2):
        i1 = min(i + 1, n - 1)
        nv = i1 // LANES + 1  # as _raw_scores
        if not pairs:
            for j in range(nv * LANES):  # only j <= i is kept (vexp clamps the rest)
                jj = min(j, n - 1)
                dg[j] = np.float32(gc[i] - gc[jj])
                dg[CHUNK + j] = np.float32(gc[i1] - gc[jj])
        ga = vsplat(gf[i])
        gb = vsplat(gf[i1])
        ba = vsplat(bt[i])
        bb = vsplat(bt[i1])
        lim_a = vsplat(np.float32(i) + np.float32(0.5))
        lim_b = vsplat(np.float32(i1) + np.float32(0.5))
        for c in range(nv):
            cols = vadd(iota, vsplat(np.float32(c * LANES)))
            if pairs:
                gj = vload(gf, c * LANES)
                ea = vexp(vsub(ga, gj))
                eb = vexp(vsub(gb, gj))
            else:
                ea = vexp(vload(dg, c * LANES))
                eb = vexp(vload(dg, CHUNK + c * LANES))
            pa = i * CHUNK + c * LANES
            pb = i1 * CHUNK + c * LANES
            vstore(qm, pa, vselect_lt(lim_a, cols, zero, vmul(vload(qkr, pa), ea)))
            vstore(qm, pb, vselect_lt(lim_b, cols, zero, vmul(vload(qkr, pb), eb)))
            vstore(lm, pa, vmul(vmul(vload(kkr, pa), ea), ba))
            vstore(lm, pb, vmul(vmul(vload(kkr, pb), eb), bb))


@jit
def _token_operands(src, s0, s_row, sc, dst, n, width):
    """n rows of ``width`` (any carrier; row i at ``src[s0 + i s_row]``), each scaled by
    ``sc[i]``, as operands along tokens: fp32 rows, or bf16 pairs of two tokens
    (``dst[(i2 width + c) 2 + e] = bf16(row 2 i2 + e)[c]``, an odd n's last row paired
    with zeros)."""
    per = _per(dst)
    zero = vzero()
    for i2 in range((n + per - 1) // per):
        ra = per * i2
        pair = per == 2 and ra + 1 < n
        sa = vsplat(sc[ra])
        sb = vsplat(sc[ra + 1]) if pair else zero
        for c in range(0, width, LANES):
            a = vmul(vload(src, s0 + ra * s_row + c), sa)
            b = vmul(vload(src, s0 + (ra + 1) * s_row + c), sb) if pair else zero
            _store_tokens(dst, (i2 * width + c) * per, a, b)


@jit
def _times_state(wo, qo, so, s0, u, ob, gc, n, dk, dv):
    """``u -= W S`` and ``ob = exp(gc) (Q S)`` for the chunk's n rows (W, Q: operand rows
    of dk; S: operands at ``so[s0:]``, :func:`wy`; u, ob: fp32 rows of dv): rows i, i+1
    of W and Q at once (a lone last row computed twice, all loads before the stores), 16
    accumulators, each state vector loaded once for four products."""
    per = _per(wo)
    for j in range(0, dv, STATE_COLS):
        nv = min(STATE_COLS, dv - j) // LANES  # vectors in this block, 1..4
        for i in range(0, n, 2):
            i1 = min(i + 1, n - 1)
            ia, ib = i * dk, i1 * dk
            wa, wb, qa, qb = _four_rows(
                wo, qo, ia, ib, ia, ib, per, so, s0 + j * per, dv * per, dk // per, nv
            )
            ea = vsplat(np.float32(math.exp(gc[i])))
            eb = vsplat(np.float32(math.exp(gc[i1])))
            for c in range(nv):
                pa = i * dv + j + c * LANES
                pb = i1 * dv + j + c * LANES
                ua = vsub(vload(u, pa), _pick(c, wa))
                ub = vsub(vload(u, pb), _pick(c, wb))
                vstore(u, pa, ua)
                vstore(u, pb, ub)
                vstore(ob, pa, vmul(_pick(c, qa), ea))
                vstore(ob, pb, vmul(_pick(c, qb), eb))


@jit
def _update_state(ko, vo, state, s0, el, n, dk, dv):
    """``S = S el + K^T V'`` (K: the decayed keys, V': operands along tokens,
    :func:`_token_operands`): four state rows by up to 64 columns, 16 accumulators."""
    per = _per(ko)
    elv = vsplat(el)
    for j in range(0, dv, STATE_COLS):
        nv = min(STATE_COLS, dv - j) // LANES  # vectors in this block, 1..4
        for r in range(0, dk, 4):  # dk is a multiple of 16
            k0, k1, k2, k3 = r * per, (r + 1) * per, (r + 2) * per, (r + 3) * per
            steps = (n + per - 1) // per  # tokens, or token pairs
            a0, a1, a2, a3 = _four_rows(
                ko, ko, k0, k1, k2, k3, dk * per, vo, j * per, dv * per, steps, nv
            )
            p0 = s0 + r * dv + j
            for c in range(nv):
                q = p0 + c * LANES
                vstore(state, q, vfma(vload(state, q), elv, _pick(c, a0)))
                q += dv
                vstore(state, q, vfma(vload(state, q), elv, _pick(c, a1)))
                q += dv
                vstore(state, q, vfma(vload(state, q), elv, _pick(c, a2)))
                q += dv
                vstore(state, q, vfma(vload(state, q), elv, _pick(c, a3)))


# --- the bf16 path's products with (I + L)^-1 ---------------------------------------------


@jit
def _inverse(lm, a, ab, n):
    """``a = (I + L)^-1`` (fp32, rows of CHUNK, zero past the diagonal) by forward
    substitution, and ``ab`` its bf16 copy: row i = e_i - sum_{j < i} L[i, j] a_j."""
    for i in range(n):
        for c in range(0, CHUNK, LANES):
            vstore(a, i * CHUNK + c, vzero())
        a[i * CHUNK + i] = np.float32(1.0)
        a0, a1, a2, a3 = _load4(a, i * CHUNK, 4, 1.0)
        a0, a1, a2, a3 = _lincomb(lm, i * CHUNK, i, -1.0, a, CHUNK, 0, 4, a0, a1, a2, a3)
        _store4(a, i * CHUNK, 4, a0, a1, a2, a3)
        _store4(ab, i * CHUNK, 4, a0, a1, a2, a3)


@jit
def _tril_dp(coef, pairs, init, with_init, out, oo0, o_row, n, width):
    """``out[row i] = init_i + sum_{j <= i} coef[i, j] X_j`` (init_i zero unless
    ``with_init``): coef bf16 rows of CHUNK, zero past the diagonal; X the rows paired in
    ``pairs`` (:func:`_token_operands`). Rows i, i+1 by 64 columns; row i of out at
    ``out[oo0 + i * o_row]``, rounded once to its carrier."""
    z = vzero()
    for j in range(0, width, STATE_COLS):
        nv = min(STATE_COLS, width - j) // LANES
        for i in range(0, n, 2):
            i1 = min(i + 1, n - 1)
            a0 = a1 = a2 = a3 = b0 = b1 = b2 = b3 = z
            if with_init:
                a0, a1, a2, a3 = _load4(init, i * width + j, nv, 1.0)
                b0, b1, b2, b3 = _load4(init, i1 * width + j, nv, 1.0)
            for j2 in range(i // 2):  # pairs of columns below row i's diagonal
                xa = vbcast_raw_pair(coef, i * CHUNK + 2 * j2)
                xb = vbcast_raw_pair(coef, i1 * CHUNK + 2 * j2)
                p = (j2 * width + j) * 2
                x = vload_raw_pairs(pairs, p)
                a0, b0 = dpbf16(a0, xa, x), dpbf16(b0, xb, x)
                if nv > 1:
                    x = vload_raw_pairs(pairs, p + 2 * LANES)
                    a1, b1 = dpbf16(a1, xa, x), dpbf16(b1, xb, x)
                if nv > 2:
                    x = vload_raw_pairs(pairs, p + 4 * LANES)
                    a2, b2 = dpbf16(a2, xa, x), dpbf16(b2, xb, x)
                if nv > 3:
                    x = vload_raw_pairs(pairs, p + 6 * LANES)
                    a3, b3 = dpbf16(a3, xa, x), dpbf16(b3, xb, x)
            # the diagonal pair (columns i, i + 1): row i1 takes both, row i only column i
            # (its coefficient past the diagonal is 0, but 0 x a non-finite X_{i+1} is NaN:
            # a NaN or inf in token i + 1 must not reach token i's row)
            xb = vbcast_raw_pair(coef, i1 * CHUNK + i)
            ca = vsplat(to_f32(coef, i * CHUNK + i))
            p = ((i // 2) * width + j) * 2
            x = vload_raw_pairs(pairs, p)
            b0, (xe, _) = dpbf16(b0, xb, x), vload_pairs(pairs, p)
            a0 = vfma(ca, xe, a0)
            if nv > 1:
                x = vload_raw_pairs(pairs, p + 2 * LANES)
                b1, (xe, _) = dpbf16(b1, xb, x), vload_pairs(pairs, p + 2 * LANES)
                a1 = vfma(ca, xe, a1)
            if nv > 2:
                x = vload_raw_pairs(pairs, p + 4 * LANES)
                b2, (xe, _) = dpbf16(b2, xb, x), vload_pairs(pairs, p + 4 * LANES)
                a2 = vfma(ca, xe, a2)
            if nv > 3:
                x = vload_raw_pairs(pairs, p + 6 * LANES)
                b3, (xe, _) = dpbf16(b3, xb, x), vload_pairs(pairs, p + 6 * LANES)
                a3 = vfma(ca, xe, a3)
            _store4(out, oo0 + i1 * o_row + j, nv, b0, b1, b2, b3)
            _store4(out, oo0 + i * o_row + j, nv, a0, a1, a2, a3)


# --- the two steps that are two algorithms ------------------------------------------------


def wy(lm, ks, bt, gc, v, vo, v_row, wo, u, state, s0, n, dk, dv, tmp):
    """W (operand rows of Dk, into ``wo``) and U (fp32 rows of Dv, into ``u``) of
    ``(I + L) W = beta exp(gc) K`` and ``(I + L) U = beta V`` (L strictly lower in
    ``lm``; K the fp32 rows ``ks``; the chunk's v row i at ``v[vo + i v_row]``), and the
    state as operands of ``W S``: ``(operands, offset)``. fp32 operands: forward
    substitution, the state read in place; bf16: ``(I + L)^-1`` (fp32) times the
    right-hand sides paired along tokens, the state paired along Dk into ``tmp``'s sp.
    ``tmp``: the scratch ``(sc, am, ab, kp, vp, sp)``."""


@overload(wy)
def _wy(lm, ks, bt, gc, v, vo, v_row, wo, u, state, s0, n, dk, dv, tmp):
    if wo.dtype == types.float32:

        def solved(lm, ks, bt, gc, v, vo, v_row, wo, u, state, s0, n, dk, dv, tmp):
            for i in range(n):
                _solve_rows(lm, ks, i * dk, np.float32(bt[i] * math.exp(gc[i])), wo, i, dk)
                _solve_rows(lm, v, vo + i * v_row, bt[i], u, i, dv)
            return state, s0

        return solved

    def inverted(lm, ks, bt, gc, v, vo, v_row, wo, u, state, s0, n, dk, dv, tmp):
        sc, am, ab, kp, vp, sp = tmp
        _inverse(lm, am, ab, n)
        for i in range(n):
            sc[i] = np.float32(bt[i] * math.exp(gc[i]))
        _token_operands(ks, 0, dk, sc, kp, n, dk)
        _tril_dp(ab, kp, ks, False, wo, 0, dk, n, dk)
        _token_operands(v, vo, v_row, bt, vp, n, dv)
        _tril_dp(ab, vp, ks, False, u, 0, dv, n, dv)
        for r2 in range(dk // 2):
            for c in range(0, dv, LANES):
                a = vload(state, s0 + 2 * r2 * dv + c)
                b = vload(state, s0 + (2 * r2 + 1) * dv + c)
                vstore_pairs(sp, (r2 * dv + c) * 2, a, b)
        return sp, s0 - s0

    return inverted


def intra(qm, u, vp, ob, out, oo0, o_row, n, dv, sc):
    """``O = ob + tril(qm) V'`` (V' the fp32 rows ``u``; qm the decayed scores, zero past
    the diagonal), row i to ``out[oo0 + i o_row]``, rounded once; returns V' as operands
    along tokens (``u`` itself, or paired into ``vp``). fp32: one row by 64 columns,
    :func:`_lincomb`; bf16: rows i, i+1 by 64 columns, :func:`_tril_dp`."""


@overload(intra)
def _intra(qm, u, vp, ob, out, oo0, o_row, n, dv, sc):
    if qm.dtype == types.float32:

        def rows(qm, u, vp, ob, out, oo0, o_row, n, dv, sc):
            for i in range(n):
                for j in range(0, dv, STATE_COLS):
                    nv = min(STATE_COLS, dv - j) // LANES
                    a0, a1, a2, a3 = _load4(ob, i * dv + j, nv, 1.0)
                    a0, a1, a2, a3 = _lincomb(
                        qm, i * CHUNK, i + 1, 1.0, u, dv, j, nv, a0, a1, a2, a3
                    )
                    _store4(out, oo0 + i * o_row + j, nv, a0, a1, a2, a3)
            return u

        return rows

    def paired(qm, u, vp, ob, out, oo0, o_row, n, dv, sc):
        for i in range(n):
            sc[i] = np.float32(1.0)
        _token_operands(u, 0, dv, sc, vp, n, dv)
        _tril_dp(qm, vp, ob, True, out, oo0, o_row, n, dv)
        return vp

    return paired


# --- the kernel ---------------------------------------------------------------------------


@jit
def _chunk_group(q, k, v, g, beta, state, out, s_slot, t0, t1, kh, lay, l2norm, eps, op):
    """One request's tokens t0..t1 for the v heads of k head ``kh`` (the slot's states at
    ``state[s_slot:]``), in chunks of CHUNK, with operands of ``op``'s carrier. Scratch
    rows (row i = token i of the chunk): qs, ks (normalised q, k, fp32) and their
    operands qo, ko; wo (W's operands), u (U, then V'), ob (O's inter-chunk part); qkr,
    kkr (raw scores), qm (decayed, as operands), lm (L) and, on the bf16 path, am, ab
    ((I + L)^-1), C x C; kt (ko transposed), kd (the decayed keys), vp (V' paired), sp
    (the state paired)."""
    dk, dv, hv, grp = lay.dk, lay.dv, lay.hv, lay.group
    od = op.dtype
    pairs = _per(op) == 2  # bf16 operands: the bf16 path's own scratch
    qs = np.empty(CHUNK * dk, np.float32)
    ks = np.empty(CHUNK * dk, np.float32)
    u = np.empty(CHUNK * dv, np.float32)
    ob = np.empty(CHUNK * dv, np.float32)
    qkr = np.empty(CHUNK * CHUNK, np.float32)
    kkr = np.empty(CHUNK * CHUNK, np.float32)
    lm = np.empty(CHUNK * CHUNK, np.float32)
    dg = np.empty(2 * CHUNK, np.float32)
    gc = np.empty(CHUNK, np.float64)
    gf = np.zeros(CHUNK, np.float32)  # gc in fp32 (bf16 operands); lanes past n finite
    bt = np.empty(CHUNK, np.float32)
    sc = np.empty(CHUNK, np.float32)
    qo = np.empty(CHUNK * dk, od)
    ko = np.empty(CHUNK * dk, od)
    wo = np.empty(CHUNK * dk, od)
    kd = np.empty(CHUNK * dk, od)
    qm = np.empty(CHUNK * CHUNK, od)
    kt = np.zeros(dk * CHUNK, od)  # lanes past n: finite, never kept
    am = np.empty(CHUNK * CHUNK if pairs else 0, np.float32)
    ab = np.empty(CHUNK * CHUNK if pairs else 0, od)
    vp = np.empty(CHUNK * dv if pairs else 0, od)
    sp = np.empty(dk * dv if pairs else 0, od)
    tmp = (sc, am, ab, kd, vp, sp)
    scale = 1.0 / math.sqrt(dk)
    for c0 in range(t0, t1, CHUNK):
        n = min(CHUNK, t1 - c0)
        for i in range(n):
            t = c0 + i
            _load_scaled(q, t * lay.q_token + kh * lay.q_head, qs, i * dk, dk, l2norm, eps, scale)
            _load_scaled(k, t * lay.k_token + kh * lay.k_head, ks, i * dk, dk, l2norm, eps, 1.0)
        # the chunk's q.k and k.k, shared by the group's v heads
        _raw_scores(qs, ks, qo, ko, kt, qkr, kkr, n, dk)
        for h in range(kh * grp, (kh + 1) * grp):
            s0 = s_slot + h * dk * dv
            cum = 0.0
            for i in range(n):
                t = c0 + i
                cum += g[t * lay.gate_token + h]
                gc[i] = cum
                gf[i] = np.float32(cum)
                bt[i] = beta[t * lay.beta_token + h]
            # L (strictly lower) and the causal q.k scores, both decayed
            _decay_scores(qkr, kkr, gc, gf, bt, dg, qm, lm, n)
            # W and U, and the state as operands of W S
            vo = c0 * lay.v_token + h * lay.v_head
            so, so0 = wy(lm, ks, bt, gc, v, vo, lay.v_token, wo, u, state, s0, n, dk, dv, tmp)
            # V' = U - W S and O's inter-chunk part exp(gc) Q S
            _times_state(wo, qo, so, so0, u, ob, gc, n, dk, dv)
            # O = inter + tril(Q K^T decay) V', rounded once to the output
            vprime = intra(qm, u, vp, ob, out, (c0 * hv + h) * dv, hv * dv, n, dv, sc)
            # S = S exp(gc_last) + (K exp(gc_last - gc))^T V'
            last = gc[n - 1]
            for i in range(n):
                sc[i] = np.float32(math.exp(last - gc[i]))
            _token_operands(ks, 0, dk, sc, kd, n, dk)
            _update_state(kd, vprime, state, s0, np.float32(math.exp(last)), n, dk, dv)


@jit(parallel=True)
def _chunked(q, k, v, g, beta, state, out, slots, cu, lay, l2norm, eps, op):
    """One prange iteration per (request, k head) pair, which owns the k head's v heads'
    states and output rows; padded requests are skipped. ``op``: the operand carrier."""
    hk = lay.hv // lay.group
    for p in prange(slots.shape[0] * hk):
        n = p // hk
        kh = p - n * hk
        s = slots[n]
        if s >= 0:
            _chunk_group(
                q,
                k,
                v,
                g,
                beta,
                state,
                out,
                s * lay.slot,
                cu[n],
                cu[n + 1],
                kh,
                lay,
                l2norm,
                eps,
                op,
            )


# --- wrapper ---------------------------------------------------------------------------


def _output(shape, dt, padded):
    """The output tensor and its flat carrier; zeros where a padded request leaves rows."""
    out = (torch.zeros if padded else torch.empty)(shape, dtype=dt)
    return out, C.as_numpy(out).reshape(-1)


def chunk_gated_delta_rule(
    query,
    key,
    value,
    g,
    beta,
    initial_state,
    output_final_state,
    cu_seqlens,
    head_first,
    use_qk_l2norm_in_kernel,
    initial_state_indices,
    eps=1e-5,
):
    """The chunked gated delta rule (prefill), as vLLM's ``chunk_gated_delta_rule_cpu``:
    returns ``(out [1, T, Hv, Dv], initial_state)`` — out in query's dtype, the state pool
    itself, each live request's slot updated in place (vLLM returns it whatever
    ``output_final_state`` says). See the module docstring."""
    C.check_bool("output_final_state", output_final_state)
    if C.check_bool("head_first", head_first):
        raise ValueError("head_first: expected False ([1, T, H, D] inputs), got True")
    l2norm = C.check_bool("use_qk_l2norm_in_kernel", use_qk_l2norm_in_kernel)
    eps = C.check_float("eps", eps, low=0.0)
    dt, t_n, hk, dk, hv, dv = check_qkv(("query", "key", "value"), query, key, value)
    g_t = check_rows("g", g, (torch.float32,), t_n, hv, lead=(1,))
    check_rows("beta", beta, (dt, torch.float32), t_n, hv, lead=(1,))
    if C.dtype_of("beta", beta) != torch.float32:  # widened once: [T, Hv] is small
        beta = beta.float() if isinstance(beta, torch.Tensor) else beta.astype(np.float32)
    b_t = C.strides_of(beta)[-2]
    slot = check_state("initial_state", initial_state, hv, dk, dv)
    slots, cu, padded = _check_requests(
        initial_state_indices, cu_seqlens, t_n, initial_state.shape[0]
    )
    out, o = _output((1, t_n, hv, dv), dt, padded)
    if t_n == 0:
        return out, initial_state
    qs, ks, vs = C.strides_of(query), C.strides_of(key), C.strides_of(value)
    lay = Layout(qs[1], qs[2], ks[1], ks[2], vs[1], vs[2], g_t, b_t, slot, dk, dv, hv, hv // hk)
    _chunked(
        C.span(query),
        C.span(key),
        C.span(value),
        C.span(g),
        C.span(beta),
        C.span(initial_state),
        o,
        slots,
        cu,
        lay,
        l2norm,
        eps,
        _BF16_OPERANDS if DP_BF16 and dt == torch.bfloat16 else _F32_OPERANDS,
    )
    return out, initial_state
