"""The gated delta rule of Gated DeltaNet, with vLLM 0.32's CPU op argument lists.

Per v head h and token t (all fp32), with ``q_t``, ``k_t`` of k head ``h // (Hv // Hk)``
(L2-normalised when asked, ``q_t`` then scaled by ``Dk ** -0.5``), a state ``S [Dk, Dv]``,
a log decay ``g_t <= 0`` and a write strength ``beta_t``::

    S   = S * exp(g_t)
    S  += k_t^T ((v_t - k_t S) * beta_t)          # the delta rule: replace k_t's value
    o_t = q_t S

Layouts (T tokens of N requests packed along one axis, request n owning tokens
``cu_seqlens[n]:cu_seqlens[n+1]`` and state slot ``initial_state_indices[n]``):

* ``q``/``query``, ``k``/``key`` ``[1, T, Hk, Dk]``; ``v``/``value`` ``[1, T, Hv, Dv]``:
  bf16/fp16/fp32, one dtype, ``stride(-1) == 1`` (tokens and heads may be strided: the
  q/k/v column windows of one fused buffer). ``Hv`` a multiple of ``Hk`` (v head h reads
  k head ``h // (Hv // Hk)``); ``Dk`` and ``Dv`` multiples of 16.
* state ``[num_slots, Hv, Dk, Dv]`` fp32: ``S[k, v]`` of slot s, head h at
  ``[s, h, k, v]`` — the order vLLM's CPU kernels use (vLLM allocates the cache as
  ``[num_slots, Hv, Dv, Dk]`` and hands the CPU ops a ``.view`` of it with the last two
  sizes swapped, not a transpose; its Triton kernels use the transpose ``[.., Dv, Dk]``).
  Each slot contiguous; the slot stride may be larger (a pooled cache). Updated in place.
* ``initial_state_indices [N]`` int32: a slot per request, below ``num_slots``, no slot
  twice; slot -1 (vLLM's PAD_SLOT_ID) marks padding: its tokens' outputs are
  zero and no state is read or written. ``cu_seqlens [N+1]`` int32: 0, non-decreasing,
  ending at T.

Ops:

* ``fused_sigmoid_gating_delta_rule_update(A_log, dt_bias, q, k, v, a, b,
  initial_state_source, initial_state_indices, cu_seqlens, use_qk_l2norm_in_kernel,
  softplus_beta=1.0, softplus_threshold=20.0) -> out [T, 1, Hv, Dv]`` (vLLM's
  ``[batch_size, seq_len, ..]`` for ``q [seq_len=1, batch_size=T, ..]``; the memory of
  ``[1, T, Hv, Dv]``): the recurrent form, token by token, for decode. The gating is fused:
  ``g = -exp(A_log) * softplus(a + dt_bias)``, ``beta = sigmoid(b)`` with ``a, b [T, Hv]``
  in q's dtype and ``A_log``, ``dt_bias [Hv]`` in fp32 or q's dtype; torch's softplus
  (``x`` where ``softplus_beta * x > softplus_threshold``, else
  ``log1p(exp(softplus_beta * x)) / softplus_beta``). L2 norm: ``x / sqrt(sum(x^2) + eps)``,
  ``eps`` a keyword after vLLM's arguments (default 1e-5, vLLM's fixed value).
* ``chunk_gated_delta_rule(query, key, value, g, beta, initial_state, output_final_state,
  cu_seqlens, head_first, use_qk_l2norm_in_kernel, initial_state_indices, eps=1e-5) ->
  (out [1, T, Hv, Dv], initial_state)``: the chunked (WY / UT-transform) form of
  flash-linear-attention for prefill. ``g [1, T, Hv]`` fp32 (log decay, gating already
  applied), ``beta [1, T, Hv]`` in query's dtype or fp32. L2 norm with ``eps``.

Chunked form, per request and v head, chunks of C = 64 tokens, ``gc`` the cumulative sum
of g inside the chunk, ``L[i, j] = beta_i (k_i . k_j) exp(gc_i - gc_j)`` for j < i::

    (I + L) W = beta * exp(gc) * K     (I + L) U = beta * V   (forward substitution)
    V' = U - W S
    O  = (Q * exp(gc)) S + tril((Q K^T) * exp(gc_i - gc_j)) V'
    S  = S * exp(gc_last) + (K * exp(gc_last - gc))^T V'

Every product is fp32 and each output element is rounded once, so the two forms agree to
fp32 rounding (vLLM's chunked op rounds q, k, W, U and V' to bf16 on the way).

Kernels: one ``prange`` iteration per (request, v head) pair owns that pair's state and
output rows, with its own scratch, so no two threads write one element. Inner loops run
over 16 lanes of Dv (``numkern.simd``). The recurrent form reads the state row by row,
64 columns (four vectors, four accumulators) a pass, in address order. The chunked
form's products are register blocked, 16 vector accumulators each: ``W S`` and ``Q S``
two rows by 64 state columns at a time, ``K^T V'`` four state rows by 64 columns, the
chunk's scores two rows against up to 64 keys (transposed first, so no horizontal sums),
the forward substitution and the intra-chunk output one row by 64 columns.

The recurrent op is called once per GDN layer per decode step: its common call (CPU
tensors in the documented layouts) is recognised from tensor attributes alone and the
tensors reach the kernel by address (``numkern._ptr``); ``_requests_verdict`` checks the
index vectors' values, and the checks that name a problem run only when it rejects them.
"""

import math
from typing import NamedTuple

import numpy as np
import torch
from numba import prange

from .. import _check as C
from .._jit import jit
from .._ptr import view
from ..attention.plan import index_vector
from ..simd import LANES, to_f32, vexp, vfma, vload, vmul, vsplat, vstore, vsub, vsum, vzero

# Tokens per chunk of the chunked form: flash-linear-attention's and vLLM's size (the
# results do not depend on it beyond rounding). 64 keeps the per-pair scratch (4 chunk
# x Dk/Dv panels and two 64 x 64 matrices, ~160 KB at Dk = Dv = 128) inside L2.
CHUNK = 64
# vLLM's CPU recurrent kernel (and its Triton one, 1e-6) fix the L2 norm's epsilon: the
# recurrent op's default; its ``eps`` keyword (numkern's own) sets another.
RECURRENT_EPS = 1e-5
# Columns of the state per pass of the recurrent kernel: four vectors, each row's part
# one 256-byte run.
STATE_COLS = 4 * LANES
_F32 = C.WITNESS[torch.float32]
_I32 = C.WITNESS[torch.int32]


class Layout(NamedTuple):  # how the kernels address one call's arrays (strides: elements)
    q_token: int
    q_head: int
    k_token: int
    k_head: int
    v_token: int
    v_head: int
    gate_token: int  # a (recurrent) or g (chunked): [T, Hv] rows
    beta_token: int  # b (recurrent) or beta (chunked): [T, Hv] rows
    slot: int  # state slot stride
    dk: int
    dv: int
    hv: int
    group: int  # Hv // Hk: v head h reads k head h // group


class Gating(NamedTuple):  # the recurrent op's fused gating
    softplus_beta: float
    softplus_threshold: float
    l2norm: bool
    eps: float  # the L2 norm's


# --- row helpers (fp32 scratch rows, or carrier rows widened on load) -------------------


@jit
def _load_scaled(src, s0, dst, d0, n, l2norm, eps, scale):
    """``dst[d0:d0+n] = src[s0:s0+n] * scale``, first divided by ``sqrt(sum(src^2) + eps)``
    when ``l2norm``; fp32, n a multiple of 16."""
    s = np.float32(scale)
    if l2norm:
        acc = vzero()
        for i in range(0, n, LANES):
            x = vload(src, s0 + i)
            acc = vfma(x, x, acc)
        s = np.float32(scale / math.sqrt(np.float64(vsum(acc)) + eps))
    sv = vsplat(s)
    for i in range(0, n, LANES):
        vstore(dst, d0 + i, vmul(vload(src, s0 + i), sv))


@jit
def _gates(a, b, ai, bi, alog, dtb, gating):
    """(exp(g), beta) of one token and head: ``g = -exp(A_log) * softplus(a + dt_bias)``,
    ``beta = sigmoid(b)``; scalars in float64, rounded to fp32 at the end."""
    x = np.float64(to_f32(a, ai)) + np.float64(dtb)
    sb = gating.softplus_beta
    sp = x if sb * x > gating.softplus_threshold else math.log1p(math.exp(sb * x)) / sb
    decay = math.exp(-math.exp(np.float64(alog)) * sp)
    beta = 1.0 / (1.0 + math.exp(-np.float64(to_f32(b, bi))))
    return np.float32(decay), np.float32(beta)


# --- recurrent form ---------------------------------------------------------------------


@jit
def _recurrent_pair(q, k, v, a, b, alog, dtb, state, out, s0, t0, t1, h, lay, gating):
    """Tokens t0..t1 of v head h; its state S [Dk, Dv] at ``state[s0:]``, in place."""
    dk, dv, hk = lay.dk, lay.dv, h // lay.group
    qn = np.empty(dk, np.float32)
    kn = np.empty(dk, np.float32)
    scale = 1.0 / math.sqrt(dk)
    for t in range(t0, t1):
        decay, beta = _gates(
            a, b, t * lay.gate_token + h, t * lay.beta_token + h, alog[h], dtb[h], gating
        )
        l2 = gating.l2norm
        _load_scaled(q, t * lay.q_token + hk * lay.q_head, qn, 0, dk, l2, gating.eps, scale)
        _load_scaled(k, t * lay.k_token + hk * lay.k_head, kn, 0, dk, l2, gating.eps, 1.0)
        vo = t * lay.v_token + h * lay.v_head
        oo = (t * lay.hv + h) * dv
        dec = vsplat(decay)
        bv = vsplat(beta)
        # Row by row over column blocks of up to 64 (four vectors): the state streams
        # through in address order, which the prefetchers follow (a 16-column strip down
        # the rows crossed a 4 KB page every 8 rows and ran ~2x slower out of L3 / DRAM).
        for j in range(0, dv, STATE_COLS):
            n = min(STATE_COLS, dv - j) // LANES  # vectors in this block, 1..4
            # k S over the block's columns
            a0 = vzero()
            a1 = vzero()
            a2 = vzero()
            a3 = vzero()
            for r in range(dk):
                p = s0 + r * dv + j
                kr = vsplat(kn[r])
                a0 = vfma(kr, vload(state, p), a0)
                if n > 1:
                    a1 = vfma(kr, vload(state, p + LANES), a1)
                if n > 2:
                    a2 = vfma(kr, vload(state, p + 2 * LANES), a2)
                if n > 3:
                    a3 = vfma(kr, vload(state, p + 3 * LANES), a3)
            # delta = (v - exp(g) k S) * beta
            d0 = vmul(vsub(vload(v, vo + j), vmul(a0, dec)), bv)
            d1 = d2 = d3 = vzero()
            if n > 1:
                d1 = vmul(vsub(vload(v, vo + j + LANES), vmul(a1, dec)), bv)
            if n > 2:
                d2 = vmul(vsub(vload(v, vo + j + 2 * LANES), vmul(a2, dec)), bv)
            if n > 3:
                d3 = vmul(vsub(vload(v, vo + j + 3 * LANES), vmul(a3, dec)), bv)
            # S = S * exp(g) + k^T delta, and o = q S
            o0 = vzero()
            o1 = vzero()
            o2 = vzero()
            o3 = vzero()
            for r in range(dk):
                p = s0 + r * dv + j
                kr = vsplat(kn[r])
                qr = vsplat(qn[r])
                s_0 = vfma(vload(state, p), dec, vmul(kr, d0))
                vstore(state, p, s_0)
                o0 = vfma(qr, s_0, o0)
                if n > 1:
                    s_1 = vfma(vload(state, p + LANES), dec, vmul(kr, d1))
                    vstore(state, p + LANES, s_1)
                    o1 = vfma(qr, s_1, o1)
                if n > 2:
                    s_2 = vfma(vload(state, p + 2 * LANES), dec, vmul(kr, d2))
                    vstore(state, p + 2 * LANES, s_2)
                    o2 = vfma(qr, s_2, o2)
                if n > 3:
                    s_3 = vfma(vload(state, p + 3 * LANES), dec, vmul(kr, d3))
                    vstore(state, p + 3 * LANES, s_3)
                    o3 = vfma(qr, s_3, o3)
            vstore(out, oo + j, o0)
            if n > 1:
                vstore(out, oo + j + LANES, o1)
            if n > 2:
                vstore(out, oo + j + 2 * LANES, o2)
            if n > 3:
                vstore(out, oo + j + 3 * LANES, o3)


@jit
def _requests_verdict(slots_a, n, cu_a, t_n, num_slots):
    """0 when ``initial_state_indices [n]`` and ``cu_seqlens [n+1]`` (int32, by address)
    are valid — cu from 0 to T, non-decreasing; each slot below num_slots or -1, no slot
    twice — else 1 (``_check_requests`` then says which and why)."""
    slots = view(slots_a, n, _I32)
    cu = view(cu_a, n + 1, _I32)
    if cu[0] != 0 or cu[n] != t_n:
        return 1
    seen = np.zeros(num_slots, np.uint8)
    for i in range(n):
        s = slots[i]
        if cu[i + 1] < cu[i] or (s != C.PAD_SLOT and (s < 0 or s >= num_slots or seen[s])):
            return 1
        if s != C.PAD_SLOT:
            seen[s] = 1
    return 0


@jit(parallel=True)
def _recurrent(addresses, extents, n_req, lay, gating, carrier):
    """Tensors by address (``numkern._ptr``): q, k, v, a, b (``carrier``), A_log and
    dt_bias (fp32), the state pool (fp32), out (``carrier``), slots and cu_seqlens
    (int32); ``extents`` in elements of q, k, v, a, b, the pool; ``lay`` and ``gating``
    the fields of Layout and Gating. One prange iteration per (request, v head) pair;
    a padded request's output rows are zeroed."""
    q_a, k_a, v_a, a_a, b_a, alog_a, dtb_a, s_a, o_a, slots_a, cu_a = addresses
    q_n, k_n, v_n, a_n, b_n, s_n = extents
    ly = Layout(*lay)
    gt = Gating(*gating)
    hv, dv = ly.hv, ly.dv
    q = view(q_a, q_n, carrier)
    k = view(k_a, k_n, carrier)
    v = view(v_a, v_n, carrier)
    a = view(a_a, a_n, carrier)
    b = view(b_a, b_n, carrier)
    alog = view(alog_a, hv, _F32)
    dtb = view(dtb_a, hv, _F32)
    state = view(s_a, s_n, _F32)
    slots = view(slots_a, n_req, _I32)
    cu = view(cu_a, n_req + 1, _I32)
    out = view(o_a, cu[n_req] * hv * dv, carrier)
    for p in prange(n_req * hv):
        n = p // hv
        h = p - n * hv
        s = slots[n]
        if s >= 0:
            s0 = s * ly.slot + h * ly.dk * dv
            _recurrent_pair(q, k, v, a, b, alog, dtb, state, out, s0, cu[n], cu[n + 1], h, ly, gt)
        else:
            zero = vzero()
            for t in range(cu[n], cu[n + 1]):
                for j in range(0, dv, LANES):
                    vstore(out, (t * hv + h) * dv + j, zero)


# --- chunked form -----------------------------------------------------------------------


# Register-blocked products of the chunked form (the NUMBA_NOTES lesson: accumulators
# kept as vector values, each load used by several FMAs): 64 columns of the state (four
# vectors, as the recurrent kernel) times two rows, or four state rows, at a time.


@jit
def _load4(src, p, nv, scale):
    """``src[p + 16c : +16] * scale`` for c < nv (1..4), the other vectors zero."""
    sv = vsplat(np.float32(scale))
    z = vzero()
    a0 = vmul(vload(src, p), sv)
    a1 = vmul(vload(src, p + LANES), sv) if nv > 1 else z
    a2 = vmul(vload(src, p + 2 * LANES), sv) if nv > 2 else z
    a3 = vmul(vload(src, p + 3 * LANES), sv) if nv > 3 else z
    return a0, a1, a2, a3


@jit
def _store4(dst, p, nv, a0, a1, a2, a3):
    """The first nv (1..4) of a0..a3 to ``dst[p + 16c]``, rounded to its carrier."""
    vstore(dst, p, a0)
    if nv > 1:
        vstore(dst, p + LANES, a1)
    if nv > 2:
        vstore(dst, p + 2 * LANES, a2)
    if nv > 3:
        vstore(dst, p + 3 * LANES, a3)


@jit
def _lincomb(coef, c0, m, sign, src, width, p0, nv, a0, a1, a2, a3):
    """``a_c + sign * sum_{i < m} coef[c0 + i] src[p0 + i*width + 16c : +16]`` for the nv
    (1..4) vectors c: one broadcast per row of src for up to four FMAs."""
    sg = np.float32(sign)
    for i in range(m):
        x = vsplat(sg * coef[c0 + i])
        p = p0 + i * width
        a0 = vfma(x, vload(src, p), a0)
        if nv > 1:
            a1 = vfma(x, vload(src, p + LANES), a1)
        if nv > 2:
            a2 = vfma(x, vload(src, p + 2 * LANES), a2)
        if nv > 3:
            a3 = vfma(x, vload(src, p + 3 * LANES), a3)
    return a0, a1, a2, a3


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
        for i in range(n):
            t = c0 + i
            ws = np.float32(bt[i] * math.exp(gc[i]))
            for d in range(0, dk, STATE_COLS):
                nv = min(STATE_COLS, dk - d) // LANES
                a0, a1, a2, a3 = _load4(ks, i * dk + d, nv, ws)
                a0, a1, a2, a3 = _lincomb(lm, i * CHUNK, i, -1.0, w, dk, d, nv, a0, a1, a2, a3)
                _store4(w, i * dk + d, nv, a0, a1, a2, a3)
            vo = t * lay.v_token + h * lay.v_head
            for d in range(0, dv, STATE_COLS):
                nv = min(STATE_COLS, dv - d) // LANES
                a0, a1, a2, a3 = _load4(v, vo + d, nv, bt[i])
                a0, a1, a2, a3 = _lincomb(lm, i * CHUNK, i, -1.0, u, dv, d, nv, a0, a1, a2, a3)
                _store4(u, i * dv + d, nv, a0, a1, a2, a3)
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


@jit(parallel=True)
def _chunked(q, k, v, g, beta, state, out, slots, cu, lay, l2norm, eps):
    """One prange iteration per (request, v head) pair; padded requests are skipped."""
    hv = lay.hv
    for p in prange(slots.shape[0] * hv):
        n = p // hv
        h = p - n * hv
        s = slots[n]
        if s >= 0:
            s0 = s * lay.slot + h * lay.dk * lay.dv
            _chunk_pair(q, k, v, g, beta, state, out, s0, cu[n], cu[n + 1], h, lay, l2norm, eps)


# --- wrappers ---------------------------------------------------------------------------


def _check_strides(name, x):
    """stride(-1) == 1 and no negative stride (a NumPy view may have one)."""
    C.check_inner_contiguous(name, x)
    C.check_non_negative_strides(name, x)


def check_qkv(names, q, k, v):
    """(dtype, T, Hk, Dk, Hv, Dv) of ``q``, ``k [1, T, Hk, Dk]`` and ``v [1, T, Hv, Dv]``."""
    qn, kn, vn = names
    dt = C.check_dtype(qn, q, C.FLOATS)
    C.check_ndim(qn, q, (4,))
    if q.shape[0] != 1:
        raise ValueError(
            f"{qn}: expected shape [1, T, Hk, Dk] (one packed batch, requests split by "
            f"cu_seqlens), got {list(q.shape)}"
        )
    _, t_n, hk, dk = q.shape
    if hk < 1 or dk < LANES or dk % LANES:
        raise ValueError(
            f"{qn}: expected Hk >= 1 and Dk a multiple of {LANES}, got shape {list(q.shape)}"
        )
    C.check_same_dtype(kn, k, dt, qn)
    C.check_shape(kn, k, (1, t_n, hk, dk))
    C.check_same_dtype(vn, v, dt, qn)
    C.check_shape(vn, v, (1, t_n, None, None))
    hv, dv = v.shape[2], v.shape[3]
    if hv < 1 or hv % hk:
        raise ValueError(f"{vn}: expected Hv a multiple of Hk = {hk}, got shape {list(v.shape)}")
    if dv < LANES or dv % LANES:
        raise ValueError(f"{vn}: expected Dv a multiple of {LANES}, got shape {list(v.shape)}")
    for name, x in zip(names, (q, k, v)):
        _check_strides(name, x)
    return dt, t_n, hk, dk, hv, dv


def check_state(name, state, hv, dk, dv):
    """The slot stride of ``state [num_slots, Hv, Dk, Dv]`` fp32, each slot contiguous."""
    C.check_dtype(name, state, (torch.float32,))
    C.check_shape(name, state, (None, hv, dk, dv))
    st = C.strides_of(state)
    per_slot = hv * dk * dv
    inner = zip(state.shape[1:], st[1:], (dk * dv, dv, 1))  # a size-1 dim's stride is moot
    if any(n > 1 and s != want for n, s, want in inner) or (
        state.shape[0] > 1 and st[0] < per_slot
    ):
        raise ValueError(
            f"{name}: expected [num_slots, {hv}, {dk}, {dv}] with each slot contiguous "
            f"(strides [>= {per_slot}, {dk * dv}, {dv}, 1]), got strides {list(st)}"
        )
    return st[0] if state.shape[0] > 1 else per_slot


def _check_requests(initial_state_indices, cu_seqlens, t_n, num_slots):
    """(slots, cu) int64 copies; whether a request is padding (slot -1)."""
    slots = index_vector("initial_state_indices", initial_state_indices)
    cu = index_vector("cu_seqlens", cu_seqlens)
    n = slots.shape[0]
    if cu.shape[0] != n + 1:
        raise ValueError(
            f"cu_seqlens: expected {n + 1} entries (N+1, N = len(initial_state_indices)), "
            f"got {cu.shape[0]}"
        )
    if cu[0] != 0:
        raise ValueError(f"cu_seqlens: expected to start at 0, got {cu[0]}")
    lens = np.diff(cu)
    if (lens < 0).any():
        r = int(np.argmax(lens < 0))
        raise ValueError(f"cu_seqlens: expected non-decreasing, got {cu[r]} then {cu[r + 1]}")
    if cu[-1] != t_n:
        raise ValueError(f"cu_seqlens: expected to end at T = {t_n} (the tokens), got {cu[-1]}")
    C.check_slots("initial_state_indices", slots, num_slots)
    return slots, cu, bool((slots == C.PAD_SLOT).any())


def check_rows(name, x, dtypes, t_n, hv, lead=()):
    """``x [*lead, T, Hv]`` in one of ``dtypes``, stride(-1) == 1: the token stride."""
    C.check_dtype(name, x, dtypes)
    C.check_shape(name, x, (*lead, t_n, hv))
    _check_strides(name, x)
    return C.strides_of(x)[-2]


def check_param(name, x, dt, hv):
    """``x [Hv]`` in fp32 or ``dt``, as an fp32 tensor or array (itself when fp32; 16-bit
    widened, exactly): the per-head gating constants."""
    C.check_dtype(name, x, (torch.float32, dt))
    C.check_shape(name, x, (hv,))
    x = C.as_torch(x)
    return x.float().contiguous()


def _output(shape, dt, padded):
    """The output tensor and its flat carrier; zeros where a padded request leaves rows."""
    out = (torch.zeros if padded else torch.empty)(shape, dtype=dt)
    return out, C.as_numpy(out).reshape(-1)


class _RecurrentCall(NamedTuple):
    """One checked recurrent call: its output and the kernels' arguments, with the fp32
    copies and index arrays the addresses point into (alive until the kernel ran)."""

    out: torch.Tensor
    t_n: int
    num_slots: int
    kernel_args: tuple  # of _recurrent
    index_args: tuple  # of _requests_verdict
    keep: tuple


_Tensor = torch.Tensor
_F32_DT = torch.float32
_I32_DT = torch.int32
_FLOATS = frozenset(C.FLOATS)
_INF = float("inf")


def _recurrent_fast(A_log, dt_bias, q, k, v, a, b, state, idx, cu, l2norm, sp_beta, sp_thr, eps):
    """The common decode call — CPU tensors, q, k, v [1, T, H, D] with unit inner strides,
    a, b [T, Hv] likewise, contiguous per-head constants and index vectors, a pool of
    contiguous fp32 slots, float arguments — as a :class:`_RecurrentCall`, or None:
    anything else goes through :func:`_recurrent_checked`, which names the problem. Only
    tensor attributes are read (~9 us here, against ~40 us through the checks, Zen 4); the
    index values are checked by ``_requests_verdict``."""
    T = _Tensor
    if not (
        type(q) is T
        and type(k) is T
        and type(v) is T
        and type(a) is T
        and type(b) is T
        and type(A_log) is T
        and type(dt_bias) is T
        and type(state) is T
        and type(idx) is T
        and type(cu) is T
        and (l2norm is True or l2norm is False)
        and type(sp_beta) is float
        and type(sp_thr) is float
        and type(eps) is float
    ):
        return None
    dt = q.dtype
    qs, ks, vs, ss = q.shape, k.shape, v.shape, state.shape
    if (
        dt not in _FLOATS
        or k.dtype is not dt
        or v.dtype is not dt
        or a.dtype is not dt
        or b.dtype is not dt
        or A_log.dtype not in (_F32_DT, dt)
        or dt_bias.dtype not in (_F32_DT, dt)
        or state.dtype is not _F32_DT
        or idx.dtype is not _I32_DT
        or cu.dtype is not _I32_DT
        or not (q.is_cpu and k.is_cpu and v.is_cpu and a.is_cpu and b.is_cpu)
        or not (A_log.is_cpu and dt_bias.is_cpu and state.is_cpu and idx.is_cpu and cu.is_cpu)
        or len(qs) != 4
        or ks != qs
        or len(vs) != 4
        or len(ss) != 4
        or not (0.0 < sp_beta < _INF and -_INF < sp_thr < _INF and 0.0 <= eps < _INF)
    ):
        return None
    one, t_n, hk, dk = qs
    _, t_v, hv, dv = vs
    n_slots, s_hv, s_dk, s_dv = ss
    n_req = idx.shape[0]
    if (
        one != 1
        or vs[0] != 1
        or t_v != t_n
        or hk < 1
        or dk < LANES
        or dk % LANES
        or hv < 1
        or hv % hk
        or dv < LANES
        or dv % LANES
        or a.shape != (t_n, hv)
        or b.shape != (t_n, hv)
        or A_log.shape != (hv,)
        or dt_bias.shape != (hv,)
        or (s_hv, s_dk, s_dv) != (hv, dk, dv)
        or idx.shape != (n_req,)
        or cu.shape != (n_req + 1,)
        or not (A_log.is_contiguous() and dt_bias.is_contiguous())
        or not (idx.is_contiguous() and cu.is_contiguous())
    ):
        return None
    qst, kst, vst, ast, bst, sst = (
        q.stride(),
        k.stride(),
        v.stride(),
        a.stride(),
        b.stride(),
        state.stride(),
    )
    per_slot = hv * dk * dv
    if (
        qst[3] != 1
        or kst[3] != 1
        or vst[3] != 1
        or ast[1] != 1
        or bst[1] != 1
        or sst[1:] != (dk * dv, dv, 1)
        or (n_slots > 1 and sst[0] < per_slot)
    ):
        return None
    alog = A_log if A_log.dtype is _F32_DT else A_log.float()
    dtb = dt_bias if dt_bias.dtype is _F32_DT else dt_bias.float()
    out = torch.empty(t_n, 1, hv, dv, dtype=dt)
    tl = t_n - 1
    extents = (
        tl * qst[1] + (hk - 1) * qst[2] + dk,
        tl * kst[1] + (hk - 1) * kst[2] + dk,
        tl * vst[1] + (hv - 1) * vst[2] + dv,
        tl * ast[0] + hv,
        tl * bst[0] + hv,
        (n_slots - 1) * sst[0] + per_slot,
    )
    slot = sst[0] if n_slots > 1 else per_slot
    lay = (
        qst[1],
        qst[2],
        kst[1],
        kst[2],
        vst[1],
        vst[2],
        ast[0],
        bst[0],
        slot,
        dk,
        dv,
        hv,
        hv // hk,
    )
    idx_a, cu_a = idx.data_ptr(), cu.data_ptr()
    addresses = (
        q.data_ptr(),
        k.data_ptr(),
        v.data_ptr(),
        a.data_ptr(),
        b.data_ptr(),
        alog.data_ptr(),
        dtb.data_ptr(),
        state.data_ptr(),
        out.data_ptr(),
        idx_a,
        cu_a,
    )
    kernel_args = (addresses, extents, n_req, lay, (sp_beta, sp_thr, l2norm, eps), C.WITNESS[dt])
    return _RecurrentCall(
        out, t_n, n_slots, kernel_args, (idx_a, n_req, cu_a, t_n, n_slots), (alog, dtb)
    )


def _index_copy(name, x):
    """An int32 vector (tensor or array) as a contiguous int32 NumPy array."""
    C.check_dtype(name, x, (torch.int32,))
    C.check_ndim(name, x, (1,))
    return np.ascontiguousarray(C.as_numpy(x))


def _recurrent_checked(A_log, dt_bias, q, k, v, a, b, state, idx, cu, l2norm, sp_beta, sp_thr, eps):
    """Every check of :func:`fused_sigmoid_gating_delta_rule_update` but the index values'
    (``_requests_verdict``'s), each naming the argument; a :class:`_RecurrentCall`."""
    l2norm = C.check_bool("use_qk_l2norm_in_kernel", l2norm)
    eps = C.check_float("eps", eps, low=0.0)
    sp_beta = C.check_float("softplus_beta", sp_beta, positive=True)
    sp_thr = C.check_float("softplus_threshold", sp_thr)
    dt, t_n, hk, dk, hv, dv = check_qkv(("q", "k", "v"), q, k, v)
    alog = check_param("A_log", A_log, dt, hv)
    dtb = check_param("dt_bias", dt_bias, dt, hv)
    a_t = check_rows("a", a, (dt,), t_n, hv)
    b_t = check_rows("b", b, (dt,), t_n, hv)
    slot = check_state("initial_state_source", state, hv, dk, dv)
    slots = _index_copy("initial_state_indices", idx)
    cus = _index_copy("cu_seqlens", cu)
    n_req = slots.shape[0]
    if cus.shape[0] != n_req + 1:
        _check_requests(idx, cu, t_n, state.shape[0])  # raises, naming cu_seqlens
    out = torch.empty((t_n, 1, hv, dv), dtype=dt)
    qs, ks, vs = C.strides_of(q), C.strides_of(k), C.strides_of(v)
    lay = (qs[1], qs[2], ks[1], ks[2], vs[1], vs[2], a_t, b_t, slot, dk, dv, hv, hv // hk)
    extents = tuple(_extent(x) for x in (q, k, v, a, b, state))
    idx_a, cu_a = C.address(slots), C.address(cus)
    addresses = tuple(C.address(x) for x in (q, k, v, a, b, alog, dtb, state, out))
    kernel_args = (
        (*addresses, idx_a, cu_a),
        extents,
        n_req,
        lay,
        (sp_beta, sp_thr, l2norm, eps),
        C.WITNESS[dt],
    )
    index_args = (idx_a, n_req, cu_a, t_n, state.shape[0])
    return _RecurrentCall(
        out, t_n, state.shape[0], kernel_args, index_args, (alog, dtb, slots, cus)
    )


def _extent(x):
    """Elements from x's first to one past its last (0 when empty)."""
    if 0 in x.shape:
        return 0
    return 1 + sum((n - 1) * s for n, s in zip(x.shape, C.strides_of(x)))


def fused_sigmoid_gating_delta_rule_update(
    A_log,
    dt_bias,
    q,
    k,
    v,
    a,
    b,
    initial_state_source,
    initial_state_indices,
    cu_seqlens,
    use_qk_l2norm_in_kernel,
    softplus_beta=1.0,
    softplus_threshold=20.0,
    eps=RECURRENT_EPS,
):
    """The recurrent gated delta rule with its gating fused in (decode), as vLLM's
    ``fused_sigmoid_gating_delta_rule_update_cpu``: returns ``out [T, 1, Hv, Dv]`` in q's
    dtype and updates each live request's state slot of ``initial_state_source`` in place.
    ``eps`` (numkern's, after vLLM's arguments): the L2 norm's, vLLM's fixed 1e-5 by
    default (transformers' and FLA's is 1e-6). See the module docstring for shapes, dtypes
    and layouts."""
    args = (
        A_log,
        dt_bias,
        q,
        k,
        v,
        a,
        b,
        initial_state_source,
        initial_state_indices,
        cu_seqlens,
        use_qk_l2norm_in_kernel,
        softplus_beta,
        softplus_threshold,
        eps,
    )
    call = _recurrent_fast(*args) or _recurrent_checked(*args)
    if _requests_verdict(*call.index_args):
        _check_requests(initial_state_indices, cu_seqlens, call.t_n, call.num_slots)
        raise RuntimeError("initial_state_indices / cu_seqlens: rejected, but not explained")
    if call.t_n:
        _recurrent(*call.kernel_args)
    return call.out


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
