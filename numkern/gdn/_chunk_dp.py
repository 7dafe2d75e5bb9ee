"""The chunked gated delta rule's bf16 path: its products on ``vdpbf16ps`` (AVX512-BF16
only; ``rule_chunked`` compiles it only where ``rule_chunked.DP_BF16`` and only for bf16
inputs). The math is ``rule_chunked``'s (see its docstring); what differs is which
operands are rounded to bf16 (round to nearest even) before a product, every product
accumulated in fp32 (docs/kernels.md states the error measured):

* the scores ``Q K^T`` and ``K K^T``: the L2-normalised (and scaled) q and k rows;
* ``W S`` and ``Q S``: W (solved in fp32) and the state S (the state itself stays fp32);
* the intra-chunk output ``tril(Q K^T decay) V'``: the decayed scores and V';
* the state update ``(K decay)^T V'``: the decayed keys and V'.

The forward substitution (``_rule_common._solve``), the decays and the state stay fp32.

Pair layouts (``uint16`` arrays, each 32-bit word one bf16 pair, the operand of
``dpbf16``): ``ktp[(d2 C + j) 2 + e] = k_j[2 d2 + e]`` (keys along lanes, pairs along
Dk); ``sp[(r2 Dv + c) 2 + e] = S[2 r2 + e, c]``; ``vp[(i2 Dv + c) 2 + e] = V'[2 i2 + e,
c]`` (row n of an odd chunk zero); row-major ``qb``, ``kb``, ``wb`` (rows of Dk) and
``qmb`` (rows of CHUNK, zero past the diagonal) broadcast one pair at a time; ``kdt``
``[Dk, CHUNK]`` the decayed keys transposed (zero past the chunk's n tokens).

Register blocks as the fp32 path's: 16 accumulators (two rows of two operands by 64
columns, or four state rows by 64 columns); the intra-chunk output two rows by 64
columns (8 accumulators: ``vdpbf16ps`` has a latency of several cycles, so 8 chains).
"""

import math

import numpy as np

from .._jit import jit
from ..simd import (
    LANES,
    dpbf16,
    to_f32,
    vadd,
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
from ._rule_common import CHUNK, STATE_COLS, _lincomb, _load4, _load_scaled, _store4

PAIR = 2 * LANES  # uint16 elements of one vector of 16 bf16 pairs


@jit
def _pick(c, a0, a1, a2, a3):
    return a0 if c == 0 else a1 if c == 1 else a2 if c == 2 else a3


@jit
def _raw_scores(kb, qb, ktp, qkr, kkr, n, dk):
    """``qkr[i, j] = q_i . k_j`` and ``kkr[i, j] = k_i . k_j`` (fp32, rows of CHUNK) for the
    key vectors up to the row's diagonal, from bf16 q and k: once per k head and chunk,
    shared by the k head's v heads. The keys' bf16 pairs (32-bit words) transposed into
    ``ktp`` (``uint32 [Dk/2, CHUNK]``: lanes are keys); rows i, i+1 against up to 64 keys."""
    kw = kb.view(np.uint32)
    half = dk // 2
    for j in range(n):
        for d2 in range(half):
            ktp[d2 * CHUNK + j] = kw[j * half + d2]
    zero = vzero()
    for i in range(0, n, 2):
        i1 = min(i + 1, n - 1)
        nv = i1 // LANES + 1
        qa0 = qa1 = qa2 = qa3 = qb0 = qb1 = qb2 = qb3 = zero
        ka0 = ka1 = ka2 = ka3 = kb0 = kb1 = kb2 = kb3 = zero
        for d2 in range(half):
            xa = vbcast_raw_pair(qb, i * dk + 2 * d2)
            xb = vbcast_raw_pair(qb, i1 * dk + 2 * d2)
            ya = vbcast_raw_pair(kb, i * dk + 2 * d2)
            yb = vbcast_raw_pair(kb, i1 * dk + 2 * d2)
            p = d2 * CHUNK
            kv = vload_raw_pairs(ktp, p)
            qa0, qb0 = dpbf16(qa0, xa, kv), dpbf16(qb0, xb, kv)
            ka0, kb0 = dpbf16(ka0, ya, kv), dpbf16(kb0, yb, kv)
            if nv > 1:
                kv = vload_raw_pairs(ktp, p + LANES)
                qa1, qb1 = dpbf16(qa1, xa, kv), dpbf16(qb1, xb, kv)
                ka1, kb1 = dpbf16(ka1, ya, kv), dpbf16(kb1, yb, kv)
            if nv > 2:
                kv = vload_raw_pairs(ktp, p + 2 * LANES)
                qa2, qb2 = dpbf16(qa2, xa, kv), dpbf16(qb2, xb, kv)
                ka2, kb2 = dpbf16(ka2, ya, kv), dpbf16(kb2, yb, kv)
            if nv > 3:
                kv = vload_raw_pairs(ktp, p + 3 * LANES)
                qa3, qb3 = dpbf16(qa3, xa, kv), dpbf16(qb3, xb, kv)
                ka3, kb3 = dpbf16(ka3, ya, kv), dpbf16(kb3, yb, kv)
        for c in range(nv):
            pa = i * CHUNK + c * LANES
            pb = i1 * CHUNK + c * LANES
            vstore(qkr, pa, _pick(c, qa0, qa1, qa2, qa3))
            vstore(qkr, pb, _pick(c, qb0, qb1, qb2, qb3))
            vstore(kkr, pa, _pick(c, ka0, ka1, ka2, ka3))
            vstore(kkr, pb, _pick(c, kb0, kb1, kb2, kb3))


@jit
def _decay_scores(qkr, kkr, gf, bt, qmb, lm, n):
    """One v head's decayed scores from the raw ones: ``qmb[i, j] = bf16(qkr[i, j] exp(gc_i
    - gc_j))`` for j <= i, 0 past the diagonal (within the row's vectors), and ``lm[i, j] =
    beta_i kkr[i, j] exp(gc_i - gc_j)`` (fp32) for j < i. ``gf``: gc in fp32, its lanes
    past n finite (the exponents there are masked or never read)."""
    zero = vzero()
    iota = viota()
    for i in range(n):
        gi = vsplat(gf[i])
        bi = vsplat(bt[i])
        lim = vsplat(np.float32(i) + np.float32(0.5))
        nv = min(i - i % 2 + 1, n - 1) // LANES + 1  # the row pair's, as _raw_scores
        for c in range(nv):
            e = vexp(vsub(gi, vload(gf, c * LANES)))
            p = i * CHUNK + c * LANES
            cols = vadd(iota, vsplat(np.float32(c * LANES)))
            vstore(qmb, p, vselect_lt(lim, cols, zero, vmul(vload(qkr, p), e)))
            vstore(lm, p, vmul(vmul(vload(kkr, p), e), bi))


@jit
def _times_state_dp(wb, qb, sp, state, s0, u, ob, gc, n, dk, dv):
    """``u -= W S`` and ``ob = exp(gc) (Q S)`` with W, Q, S rounded to bf16 (S paired along
    Dk into ``sp`` first): rows i, i+1 of W and Q by 64 columns, 16 accumulators."""
    for r2 in range(dk // 2):
        for c in range(0, dv, LANES):
            a = vload(state, s0 + 2 * r2 * dv + c)
            b = vload(state, s0 + (2 * r2 + 1) * dv + c)
            vstore_pairs(sp, (r2 * dv + c) * 2, a, b)
    zero = vzero()
    for j in range(0, dv, STATE_COLS):
        nv = min(STATE_COLS, dv - j) // LANES
        for i in range(0, n, 2):
            i1 = min(i + 1, n - 1)
            wa0 = wa1 = wa2 = wa3 = wb0 = wb1 = wb2 = wb3 = zero
            qa0 = qa1 = qa2 = qa3 = qb0 = qb1 = qb2 = qb3 = zero
            for r2 in range(dk // 2):
                xa = vbcast_raw_pair(wb, i * dk + 2 * r2)
                xb = vbcast_raw_pair(wb, i1 * dk + 2 * r2)
                ya = vbcast_raw_pair(qb, i * dk + 2 * r2)
                yb = vbcast_raw_pair(qb, i1 * dk + 2 * r2)
                p = (r2 * dv + j) * 2
                st = vload_raw_pairs(sp, p)
                wa0, wb0 = dpbf16(wa0, xa, st), dpbf16(wb0, xb, st)
                qa0, qb0 = dpbf16(qa0, ya, st), dpbf16(qb0, yb, st)
                if nv > 1:
                    st = vload_raw_pairs(sp, p + PAIR)
                    wa1, wb1 = dpbf16(wa1, xa, st), dpbf16(wb1, xb, st)
                    qa1, qb1 = dpbf16(qa1, ya, st), dpbf16(qb1, yb, st)
                if nv > 2:
                    st = vload_raw_pairs(sp, p + 2 * PAIR)
                    wa2, wb2 = dpbf16(wa2, xa, st), dpbf16(wb2, xb, st)
                    qa2, qb2 = dpbf16(qa2, ya, st), dpbf16(qb2, yb, st)
                if nv > 3:
                    st = vload_raw_pairs(sp, p + 3 * PAIR)
                    wa3, wb3 = dpbf16(wa3, xa, st), dpbf16(wb3, xb, st)
                    qa3, qb3 = dpbf16(qa3, ya, st), dpbf16(qb3, yb, st)
            ea = vsplat(np.float32(math.exp(gc[i])))
            eb = vsplat(np.float32(math.exp(gc[i1])))
            for c in range(nv):
                pa = i * dv + j + c * LANES
                pb = i1 * dv + j + c * LANES
                ua = vsub(vload(u, pa), _pick(c, wa0, wa1, wa2, wa3))
                ub = vsub(vload(u, pb), _pick(c, wb0, wb1, wb2, wb3))
                vstore(u, pa, ua)
                vstore(u, pb, ub)
                vstore(ob, pa, vmul(_pick(c, qa0, qa1, qa2, qa3), ea))
                vstore(ob, pb, vmul(_pick(c, qb0, qb1, qb2, qb3), eb))


@jit
def _pairs(src, s0, s_row, sc, dst, n, width):
    """``dst[(i2 width + c) 2 + e] = bf16(src[s0 + (2 i2 + e) s_row + c] sc[2 i2 + e])``:
    n rows (of ``width``, any carrier) paired two tokens at a time, each row scaled; an odd
    n's last row paired with zeros."""
    zero = vzero()
    for i2 in range((n + 1) // 2):
        ra = 2 * i2
        sa = vsplat(sc[ra])
        sb = vsplat(sc[ra + 1]) if ra + 1 < n else zero
        for c in range(0, width, LANES):
            a = vmul(vload(src, s0 + ra * s_row + c), sa)
            b = vmul(vload(src, s0 + (ra + 1) * s_row + c), sb) if ra + 1 < n else zero
            vstore_pairs(dst, (i2 * width + c) * 2, a, b)


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
    ``pairs`` (:func:`_pairs`). Rows i, i+1 by 64 columns; row i of out at ``out[oo0 + i
    * o_row]``, rounded once to its carrier."""
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
                    x = vload_raw_pairs(pairs, p + PAIR)
                    a1, b1 = dpbf16(a1, xa, x), dpbf16(b1, xb, x)
                if nv > 2:
                    x = vload_raw_pairs(pairs, p + 2 * PAIR)
                    a2, b2 = dpbf16(a2, xa, x), dpbf16(b2, xb, x)
                if nv > 3:
                    x = vload_raw_pairs(pairs, p + 3 * PAIR)
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
                x = vload_raw_pairs(pairs, p + PAIR)
                b1, (xe, _) = dpbf16(b1, xb, x), vload_pairs(pairs, p + PAIR)
                a1 = vfma(ca, xe, a1)
            if nv > 2:
                x = vload_raw_pairs(pairs, p + 2 * PAIR)
                b2, (xe, _) = dpbf16(b2, xb, x), vload_pairs(pairs, p + 2 * PAIR)
                a2 = vfma(ca, xe, a2)
            if nv > 3:
                x = vload_raw_pairs(pairs, p + 3 * PAIR)
                b3, (xe, _) = dpbf16(b3, xb, x), vload_pairs(pairs, p + 3 * PAIR)
                a3 = vfma(ca, xe, a3)
            _store4(out, oo0 + i1 * o_row + j, nv, b0, b1, b2, b3)
            _store4(out, oo0 + i * o_row + j, nv, a0, a1, a2, a3)


@jit
def _update_dp(kdp, vp, state, s0, el, n, dk, dv):
    """``S = S el + (K dec)^T V'``: the decayed keys and V' paired two tokens at a time
    (:func:`_pairs`), four state rows by 64 columns, 16 accumulators."""
    elv = vsplat(el)
    zero = vzero()
    m2 = (n + 1) // 2
    for j in range(0, dv, STATE_COLS):
        nv = min(STATE_COLS, dv - j) // LANES
        for r in range(0, dk, 4):
            a00 = a01 = a02 = a03 = a10 = a11 = a12 = a13 = zero
            a20 = a21 = a22 = a23 = a30 = a31 = a32 = a33 = zero
            for i2 in range(m2):
                kp = (i2 * dk + r) * 2
                k0 = vbcast_raw_pair(kdp, kp)
                k1 = vbcast_raw_pair(kdp, kp + 2)
                k2 = vbcast_raw_pair(kdp, kp + 4)
                k3 = vbcast_raw_pair(kdp, kp + 6)
                p = (i2 * dv + j) * 2
                x = vload_raw_pairs(vp, p)
                a00, a10 = dpbf16(a00, k0, x), dpbf16(a10, k1, x)
                a20, a30 = dpbf16(a20, k2, x), dpbf16(a30, k3, x)
                if nv > 1:
                    x = vload_raw_pairs(vp, p + PAIR)
                    a01, a11 = dpbf16(a01, k0, x), dpbf16(a11, k1, x)
                    a21, a31 = dpbf16(a21, k2, x), dpbf16(a31, k3, x)
                if nv > 2:
                    x = vload_raw_pairs(vp, p + 2 * PAIR)
                    a02, a12 = dpbf16(a02, k0, x), dpbf16(a12, k1, x)
                    a22, a32 = dpbf16(a22, k2, x), dpbf16(a32, k3, x)
                if nv > 3:
                    x = vload_raw_pairs(vp, p + 3 * PAIR)
                    a03, a13 = dpbf16(a03, k0, x), dpbf16(a13, k1, x)
                    a23, a33 = dpbf16(a23, k2, x), dpbf16(a33, k3, x)
            p0 = s0 + r * dv + j
            for c in range(nv):
                q = p0 + c * LANES
                vstore(state, q, vfma(vload(state, q), elv, _pick(c, a00, a01, a02, a03)))
                q += dv
                vstore(state, q, vfma(vload(state, q), elv, _pick(c, a10, a11, a12, a13)))
                q += dv
                vstore(state, q, vfma(vload(state, q), elv, _pick(c, a20, a21, a22, a23)))
                q += dv
                vstore(state, q, vfma(vload(state, q), elv, _pick(c, a30, a31, a32, a33)))


@jit
def chunk_group_dp(q, k, v, g, beta, state, out, s_slot, t0, t1, kh, lay, l2norm, eps):
    """``rule_chunked._chunk_pair`` with the bf16 products (see the module docstring), for
    the v heads of k head ``kh`` together (q, k, their bf16 rows and raw scores loaded
    once per chunk for the group): tokens t0..t1 in chunks of CHUNK, the slot's states at
    ``state[s_slot:]``."""
    dk, dv, hv, grp = lay.dk, lay.dv, lay.hv, lay.group
    qs = np.empty(CHUNK * dk, np.float32)
    ks = np.empty(CHUNK * dk, np.float32)
    u = np.empty(CHUNK * dv, np.float32)
    ob = np.empty(CHUNK * dv, np.float32)
    qkr = np.empty(CHUNK * CHUNK, np.float32)
    kkr = np.empty(CHUNK * CHUNK, np.float32)
    lm = np.empty(CHUNK * CHUNK, np.float32)
    am = np.empty(CHUNK * CHUNK, np.float32)
    sc = np.empty(CHUNK, np.float32)
    gf = np.empty(CHUNK, np.float32)
    gc = np.empty(CHUNK, np.float64)
    bt = np.empty(CHUNK, np.float32)
    qb = np.empty(CHUNK * dk, np.uint16)
    kb = np.empty(CHUNK * dk, np.uint16)
    wb = np.empty(CHUNK * dk, np.uint16)
    qmb = np.empty(CHUNK * CHUNK, np.uint16)
    ab = np.empty(CHUNK * CHUNK, np.uint16)
    ktp = np.zeros(dk // 2 * CHUNK, np.uint32)  # lanes past n: finite, never kept
    kp = np.empty(CHUNK * dk, np.uint16)
    sp = np.empty(dk * dv, np.uint16)
    vp = np.empty(CHUNK * dv, np.uint16)
    scale = 1.0 / math.sqrt(dk)
    for c0 in range(t0, t1, CHUNK):
        n = min(CHUNK, t1 - c0)
        for i in range(n):
            t = c0 + i
            _load_scaled(q, t * lay.q_token + kh * lay.q_head, qs, i * dk, dk, l2norm, eps, scale)
            _load_scaled(k, t * lay.k_token + kh * lay.k_head, ks, i * dk, dk, l2norm, eps, 1.0)
            for d in range(0, dk, LANES):
                vstore(qb, i * dk + d, vload(qs, i * dk + d))
                vstore(kb, i * dk + d, vload(ks, i * dk + d))
        # the chunk's q.k and k.k (bf16 products), shared by the group's v heads
        _raw_scores(kb, qb, ktp, qkr, kkr, n, dk)
        for h in range(kh * grp, (kh + 1) * grp):
            s0 = s_slot + h * dk * dv
            cum = 0.0
            for i in range(n):
                t = c0 + i
                cum += g[t * lay.gate_token + h]
                gc[i] = cum
                bt[i] = beta[t * lay.beta_token + h]
            for i in range(CHUNK):
                gf[i] = np.float32(gc[min(i, n - 1)])
            # L (strictly lower, fp32) and the causal q.k scores (bf16), both decayed
            _decay_scores(qkr, kkr, gf, bt, qmb, lm, n)
            # W = (I + L)^-1 beta exp(gc) K (bf16 rows), U = (I + L)^-1 beta V (fp32 rows)
            _inverse(lm, am, ab, n)
            for i in range(n):
                sc[i] = np.float32(bt[i] * math.exp(gc[i]))
            _pairs(ks, 0, dk, sc, kp, n, dk)
            _tril_dp(ab, kp, ks, False, wb, 0, dk, n, dk)
            _pairs(v, c0 * lay.v_token + h * lay.v_head, lay.v_token, bt, vp, n, dv)
            _tril_dp(ab, vp, ks, False, u, 0, dv, n, dv)
            # V' = U - W S and O's inter-chunk part exp(gc) Q S
            _times_state_dp(wb, qb, sp, state, s0, u, ob, gc, n, dk, dv)
            # O = inter + tril(Q K^T decay) V', rounded once to the output
            for i in range(n):
                sc[i] = np.float32(1.0)
            _pairs(u, 0, dv, sc, vp, n, dv)
            _tril_dp(qmb, vp, ob, True, out, (c0 * hv + h) * dv, hv * dv, n, dv)
            # S = S exp(gc_last) + (K exp(gc_last - gc))^T V'
            last = gc[n - 1]
            for i in range(n):
                sc[i] = np.float32(math.exp(last - gc[i]))
            _pairs(ks, 0, dk, sc, kp, n, dk)
            _update_dp(kp, vp, state, s0, np.float32(math.exp(last)), n, dk, dv)
