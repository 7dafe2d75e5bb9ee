"""``chunk_gated_delta_rule``: the chunked (WY / UT-transform) form of the gated delta
rule, flash-linear-attention's, for prefill (``numkern.gdn.rule`` documents its
arguments and layouts).

Chunked form, per request and v head, chunks of C = 64 tokens, ``gc`` the cumulative sum
of g inside the chunk, ``L[i, j] = beta_i (k_i . k_j) exp(gc_i - gc_j)`` for j < i::

    (I + L) W = beta * exp(gc) * K     (I + L) U = beta * V   (forward substitution)
    V' = U - W S
    O  = (Q * exp(gc)) S + tril((Q K^T) * exp(gc_i - gc_j)) V'
    S  = S * exp(gc_last) + (K * exp(gc_last - gc))^T V'

Here every product is fp32 and each output element is rounded once, so the two forms
agree to fp32 rounding: the fp32 path, for fp32 and fp16 inputs and CPUs without
AVX512-BF16. bf16 inputs where the CPU has it (:data:`DP_BF16`) take ``_chunk_dp``'s
path instead: the same steps with the products on ``vdpbf16ps`` (bf16-rounded operands,
fp32 sums), ``(I + L)^-1`` formed and multiplied rather than substituted.

Kernel: one ``prange`` iteration per (request, v head) pair owns that pair's state and
output rows, with its own scratch, so no two threads write one element. The products
are register blocked, 16 vector accumulators each: ``W S`` and ``Q S`` two rows by 64
state columns at a time, ``K^T V'`` four state rows by 64 columns, the chunk's scores
two rows against up to 64 keys (transposed first, so no horizontal sums), the forward
substitution one row by 128 columns, the intra-chunk output one row by 64 columns.
"""

import math

import numpy as np
import torch
from numba import prange, types
from numba.extending import overload

from .. import _check as C
from .. import isa
from .._jit import jit
from ..simd import LANES, vexp, vfma, vload, vmul, vsplat, vstore, vsub, vzero
from ._chunk_dp import chunk_group_dp
from ._rule_common import (
    CHUNK,
    STATE_COLS,
    Layout,
    _check_requests,
    _lincomb,
    _load4,
    _load_scaled,
    _solve,
    _store4,
    check_qkv,
    check_rows,
    check_state,
)

# Whether bf16 inputs take the vdpbf16ps path (``_chunk_dp``): a constant of the compiled
# code, numkern.isa's decision for the (possibly masked) CPU. fp16 and fp32 inputs always
# take the fp32 products here (their callers asked for more than bf16's precision).
DP_BF16 = isa.decision().gdn_bf16


@jit
def _scores(qs, ks, kt, gc, bt, dg, qm, lm, n, dk):
    """``qm[i, j] = (q_i . k_j) exp(gc_i - gc_j)`` for j <= i and ``lm[i, j] = beta_i
    (k_i . k_j) exp(gc_i - gc_j)`` for j < i (rows of CHUNK; entries past the triangle
    hold anything). The keys are transposed into ``kt`` first, so a row's scores are
    vectors over 16 keys (no horizontal sums): rows i, i+1 against up to 64 keys, 16
    accumulators. The exponents are differences in float64, then ``vexp``."""
    for i in range(n):
        for d in range(dk):
            kt[d * CHUNK + i] = ks[i * dk + d]
    zero = vzero()
    for i in range(0, n, 2):
        i1 = min(i + 1, n - 1)
        nv = i1 // LANES + 1  # key vectors up to key i1, 1..4 (kt's columns past n: unused)
        qa0 = qa1 = qa2 = qa3 = qb0 = qb1 = qb2 = qb3 = zero
        ka0 = ka1 = ka2 = ka3 = kb0 = kb1 = kb2 = kb3 = zero
        for d in range(dk):
            xa = vsplat(qs[i * dk + d])
            xb = vsplat(qs[i1 * dk + d])
            ya = vsplat(ks[i * dk + d])
            yb = vsplat(ks[i1 * dk + d])
            p = d * CHUNK
            kv = vload(kt, p)
            qa0, qb0 = vfma(xa, kv, qa0), vfma(xb, kv, qb0)
            ka0, kb0 = vfma(ya, kv, ka0), vfma(yb, kv, kb0)
            if nv > 1:
                kv = vload(kt, p + LANES)
                qa1, qb1 = vfma(xa, kv, qa1), vfma(xb, kv, qb1)
                ka1, kb1 = vfma(ya, kv, ka1), vfma(yb, kv, kb1)
            if nv > 2:
                kv = vload(kt, p + 2 * LANES)
                qa2, qb2 = vfma(xa, kv, qa2), vfma(xb, kv, qb2)
                ka2, kb2 = vfma(ya, kv, ka2), vfma(yb, kv, kb2)
            if nv > 3:
                kv = vload(kt, p + 3 * LANES)
                qa3, qb3 = vfma(xa, kv, qa3), vfma(xb, kv, qb3)
                ka3, kb3 = vfma(ya, kv, ka3), vfma(yb, kv, kb3)
        for j in range(nv * LANES):  # only j <= i is kept (vexp clamps the rest)
            jj = min(j, n - 1)
            dg[j] = np.float32(gc[i] - gc[jj])
            dg[CHUNK + j] = np.float32(gc[i1] - gc[jj])
        ba = vsplat(bt[i])
        bb = vsplat(bt[i1])
        for c in range(nv):
            qa = qa0 if c == 0 else qa1 if c == 1 else qa2 if c == 2 else qa3
            qb = qb0 if c == 0 else qb1 if c == 1 else qb2 if c == 2 else qb3
            ka = ka0 if c == 0 else ka1 if c == 1 else ka2 if c == 2 else ka3
            kb = kb0 if c == 0 else kb1 if c == 1 else kb2 if c == 2 else kb3
            ea = vexp(vload(dg, c * LANES))
            eb = vexp(vload(dg, CHUNK + c * LANES))
            pa = i * CHUNK + c * LANES
            pb = i1 * CHUNK + c * LANES
            vstore(qm, pa, vmul(qa, ea))
            vstore(qm, pb, vmul(qb, eb))
            vstore(lm, pa, vmul(vmul(ka, ea), ba))
            vstore(lm, pb, vmul(vmul(kb, eb), bb))


@jit
def _times_state(w, qs, state, s0, u, ob, gc, n, dk, dv):
    """``u -= W S`` and ``ob = exp(gc) (Q S)`` for the chunk's n rows (W, Q: fp32 rows of
    dk; u, ob: rows of dv; S at ``state[s0:]``): rows i, i+1 of W and Q at once (a lone
    last row computed twice, all loads before the stores), 16 accumulators, each state
    vector loaded once for four FMAs."""
    zero = vzero()
    for j in range(0, dv, STATE_COLS):
        nv = min(STATE_COLS, dv - j) // LANES  # vectors in this block, 1..4
        for i in range(0, n, 2):
            i1 = min(i + 1, n - 1)
            wa0 = wa1 = wa2 = wa3 = wb0 = wb1 = wb2 = wb3 = zero
            qa0 = qa1 = qa2 = qa3 = qb0 = qb1 = qb2 = qb3 = zero
            for r in range(dk):
                p = s0 + r * dv + j
                xa = vsplat(w[i * dk + r])
                xb = vsplat(w[i1 * dk + r])
                ya = vsplat(qs[i * dk + r])
                yb = vsplat(qs[i1 * dk + r])
                st = vload(state, p)
                wa0, wb0 = vfma(xa, st, wa0), vfma(xb, st, wb0)
                qa0, qb0 = vfma(ya, st, qa0), vfma(yb, st, qb0)
                if nv > 1:
                    st = vload(state, p + LANES)
                    wa1, wb1 = vfma(xa, st, wa1), vfma(xb, st, wb1)
                    qa1, qb1 = vfma(ya, st, qa1), vfma(yb, st, qb1)
                if nv > 2:
                    st = vload(state, p + 2 * LANES)
                    wa2, wb2 = vfma(xa, st, wa2), vfma(xb, st, wb2)
                    qa2, qb2 = vfma(ya, st, qa2), vfma(yb, st, qb2)
                if nv > 3:
                    st = vload(state, p + 3 * LANES)
                    wa3, wb3 = vfma(xa, st, wa3), vfma(xb, st, wb3)
                    qa3, qb3 = vfma(ya, st, qa3), vfma(yb, st, qb3)
            ea = vsplat(np.float32(math.exp(gc[i])))
            eb = vsplat(np.float32(math.exp(gc[i1])))
            for c in range(nv):
                wa = wa0 if c == 0 else wa1 if c == 1 else wa2 if c == 2 else wa3
                wb = wb0 if c == 0 else wb1 if c == 1 else wb2 if c == 2 else wb3
                qa = qa0 if c == 0 else qa1 if c == 1 else qa2 if c == 2 else qa3
                qb = qb0 if c == 0 else qb1 if c == 1 else qb2 if c == 2 else qb3
                pa = i * dv + j + c * LANES
                pb = i1 * dv + j + c * LANES
                ua = vsub(vload(u, pa), wa)
                ub = vsub(vload(u, pb), wb)
                vstore(u, pa, ua)
                vstore(u, pb, ub)
                vstore(ob, pa, vmul(qa, ea))
                vstore(ob, pb, vmul(qb, eb))


@jit
def _update_state(ks, u, state, s0, el, n, dk, dv):
    """``S = S el + K^T V'`` (K: the chunk's n fp32 rows of dk, decayed; V': u, rows of
    dv): four state rows by up to 64 columns at a time, 16 accumulators."""
    elv = vsplat(el)
    for j in range(0, dv, STATE_COLS):
        nv = min(STATE_COLS, dv - j) // LANES  # vectors in this block, 1..4
        for r in range(0, dk, 4):  # dk is a multiple of 16
            p = s0 + r * dv + j
            a00 = a01 = a02 = a03 = a10 = a11 = a12 = a13 = vzero()
            a20 = a21 = a22 = a23 = a30 = a31 = a32 = a33 = vzero()
            for i in range(n):
                k0 = vsplat(ks[i * dk + r])
                k1 = vsplat(ks[i * dk + r + 1])
                k2 = vsplat(ks[i * dk + r + 2])
                k3 = vsplat(ks[i * dk + r + 3])
                ui = i * dv + j
                x = vload(u, ui)
                a00, a10 = vfma(k0, x, a00), vfma(k1, x, a10)
                a20, a30 = vfma(k2, x, a20), vfma(k3, x, a30)
                if nv > 1:
                    x = vload(u, ui + LANES)
                    a01, a11 = vfma(k0, x, a01), vfma(k1, x, a11)
                    a21, a31 = vfma(k2, x, a21), vfma(k3, x, a31)
                if nv > 2:
                    x = vload(u, ui + 2 * LANES)
                    a02, a12 = vfma(k0, x, a02), vfma(k1, x, a12)
                    a22, a32 = vfma(k2, x, a22), vfma(k3, x, a32)
                if nv > 3:
                    x = vload(u, ui + 3 * LANES)
                    a03, a13 = vfma(k0, x, a03), vfma(k1, x, a13)
                    a23, a33 = vfma(k2, x, a23), vfma(k3, x, a33)
            for c in range(nv):
                for rr in range(4):
                    if rr == 0:
                        a = a00 if c == 0 else a01 if c == 1 else a02 if c == 2 else a03
                    elif rr == 1:
                        a = a10 if c == 0 else a11 if c == 1 else a12 if c == 2 else a13
                    elif rr == 2:
                        a = a20 if c == 0 else a21 if c == 1 else a22 if c == 2 else a23
                    else:
                        a = a30 if c == 0 else a31 if c == 1 else a32 if c == 2 else a33
                    q = p + rr * dv + c * LANES
                    vstore(state, q, vfma(vload(state, q), elv, a))


@jit
def _chunk_pair(q, k, v, g, beta, state, out, s0, t0, t1, h, lay, l2norm, eps):
    """Tokens t0..t1 of v head h in chunks of CHUNK; its state S [Dk, Dv] at
    ``state[s0:]``, in place. Scratch rows (fp32, row i = token i of the chunk): qs, ks
    (normalised q, k; ks later decayed to the chunk's end), w, u (the WY right-hand sides,
    solved in place; u then becomes V'), ob (O's inter-chunk part), lm and qm (C x C), kt
    (ks transposed, [Dk, C]) and dg (two rows of decay exponents)."""
    dk, dv, hv, hk = lay.dk, lay.dv, lay.hv, h // lay.group
    qs = np.empty(CHUNK * dk, np.float32)
    ks = np.empty(CHUNK * dk, np.float32)
    w = np.empty(CHUNK * dk, np.float32)
    u = np.empty(CHUNK * dv, np.float32)
    ob = np.empty(CHUNK * dv, np.float32)
    lm = np.empty(CHUNK * CHUNK, np.float32)
    qm = np.empty(CHUNK * CHUNK, np.float32)
    kt = np.empty(dk * CHUNK, np.float32)
    dg = np.empty(2 * CHUNK, np.float32)
    gc = np.empty(CHUNK, np.float64)
    bt = np.empty(CHUNK, np.float32)
    scale = 1.0 / math.sqrt(dk)
    for c0 in range(t0, t1, CHUNK):
        n = min(CHUNK, t1 - c0)
        cum = 0.0
        for i in range(n):
            t = c0 + i
            _load_scaled(q, t * lay.q_token + hk * lay.q_head, qs, i * dk, dk, l2norm, eps, scale)
            _load_scaled(k, t * lay.k_token + hk * lay.k_head, ks, i * dk, dk, l2norm, eps, 1.0)
            cum += g[t * lay.gate_token + h]
            gc[i] = cum
            bt[i] = beta[t * lay.beta_token + h]
        # L (strictly lower) and the causal q.k scores, both decayed
        _scores(qs, ks, kt, gc, bt, dg, qm, lm, n, dk)
        # (I + L) W = beta exp(gc) K and (I + L) U = beta V by forward substitution
        _solve(lm, ks, bt, gc, v, lay.v_token, c0 * lay.v_token + h * lay.v_head, w, u, n, dk, dv)
        # V' = U - W S and O's inter-chunk part exp(gc) q S
        _times_state(w, qs, state, s0, u, ob, gc, n, dk, dv)
        # O = inter + tril(QK^T * decay) V', rounded once to the output
        for i in range(n):
            oo = ((c0 + i) * hv + h) * dv
            for j in range(0, dv, STATE_COLS):
                nv = min(STATE_COLS, dv - j) // LANES
                a0, a1, a2, a3 = _load4(ob, i * dv + j, nv, 1.0)
                a0, a1, a2, a3 = _lincomb(qm, i * CHUNK, i + 1, 1.0, u, dv, j, nv, a0, a1, a2, a3)
                _store4(out, oo + j, nv, a0, a1, a2, a3)
        # S = S exp(gc_last) + (K exp(gc_last - gc))^T V'
        last = gc[n - 1]
        for i in range(n):
            ki = vsplat(np.float32(math.exp(last - gc[i])))
            for d in range(0, dk, LANES):
                vstore(ks, i * dk + d, vmul(vload(ks, i * dk + d), ki))
        _update_state(ks, u, state, s0, np.float32(math.exp(last)), n, dk, dv)


@jit
def _chunk_group(q, k, v, g, beta, state, out, s_slot, t0, t1, kh, lay, l2norm, eps):
    """The fp32 path for the v heads of k head ``kh``, one after the other."""
    for h in range(kh * lay.group, (kh + 1) * lay.group):
        s0 = s_slot + h * lay.dk * lay.dv
        _chunk_pair(q, k, v, g, beta, state, out, s0, t0, t1, h, lay, l2norm, eps)


def chunk_group(q, k, v, g, beta, state, out, s_slot, t0, t1, kh, lay, l2norm, eps):
    """One request's tokens for the v heads of k head ``kh``: ``_chunk_group`` (fp32
    products) or, for bf16 inputs where :data:`DP_BF16`, ``_chunk_dp.chunk_group_dp``
    (vdpbf16ps); chosen when the kernel compiles, so the other is never compiled."""


@overload(chunk_group, inline="always")
def _chunk_group_for(q, k, v, g, beta, state, out, s_slot, t0, t1, kh, lay, l2norm, eps):
    body = chunk_group_dp if DP_BF16 and q.dtype == types.uint16 else _chunk_group
    return lambda q, k, v, g, beta, state, out, s_slot, t0, t1, kh, lay, l2norm, eps: body(
        q, k, v, g, beta, state, out, s_slot, t0, t1, kh, lay, l2norm, eps
    )


@jit(parallel=True)
def _chunked(q, k, v, g, beta, state, out, slots, cu, lay, l2norm, eps):
    """One prange iteration per (request, k head) pair, which owns the k head's v heads'
    states and output rows; padded requests are skipped."""
    hk = lay.hv // lay.group
    for p in prange(slots.shape[0] * hk):
        n = p // hk
        kh = p - n * hk
        s = slots[n]
        if s >= 0:
            chunk_group(
                q, k, v, g, beta, state, out, s * lay.slot, cu[n], cu[n + 1], kh, lay, l2norm, eps
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
    )
    return out, initial_state
