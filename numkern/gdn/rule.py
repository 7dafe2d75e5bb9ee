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
  ``log1p(exp(softplus_beta * x)) / softplus_beta``). L2 norm: ``x / sqrt(sum(x^2) + 1e-5)``.
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
over 16 lanes of Dv (``numkern.simd``); the state is read as columns of 16 lanes, 4 rows
of the reduction at a time (four independent FMA chains).
"""

import math
from typing import NamedTuple

import numpy as np
import torch
from numba import prange

from .. import _check as C
from .._jit import jit
from ..attention.plan import index_vector
from ..simd import LANES, to_f32, vadd, vfma, vload, vmul, vsplat, vstore, vsub, vsum, vzero

# Tokens per chunk of the chunked form: flash-linear-attention's and vLLM's size (the
# results do not depend on it beyond rounding). 64 keeps the per-pair scratch (4 chunk
# x Dk/Dv panels and two 64 x 64 matrices, ~160 KB at Dk = Dv = 128) inside L2.
CHUNK = 64
# vLLM's CPU recurrent kernel (and its Triton one, 1e-6) fix the L2 norm's epsilon; the
# recurrent op has no eps argument.
RECURRENT_EPS = 1e-5


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
def _dot(x, x0, y, y0, n):
    """fp32 dot product of two rows; n a multiple of 16."""
    acc = vzero()
    for i in range(0, n, LANES):
        acc = vfma(vload(x, x0 + i), vload(y, y0 + i), acc)
    return vsum(acc)


@jit
def _gates(a, b, ai, bi, alog, dtb, gating):
    """(exp(g), beta) of one token and head: ``g = -exp(A_log) * softplus(a + dt_bias)``,
    ``beta = sigmoid(b)``; scalars in float64, rounded to fp32 at the end."""
    x = np.float64(to_f32(a, ai)) + dtb
    sb = gating.softplus_beta
    sp = x if sb * x > gating.softplus_threshold else math.log1p(math.exp(sb * x)) / sb
    decay = math.exp(-math.exp(alog) * sp)
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
        _load_scaled(q, t * lay.q_token + hk * lay.q_head, qn, 0, dk, l2, RECURRENT_EPS, scale)
        _load_scaled(k, t * lay.k_token + hk * lay.k_head, kn, 0, dk, l2, RECURRENT_EPS, 1.0)
        vo = t * lay.v_token + h * lay.v_head
        oo = (t * lay.hv + h) * dv
        dec = vsplat(decay)
        bv = vsplat(beta)
        for j in range(0, dv, LANES):
            # k S over columns j..j+15, four rows at a time (four FMA chains)
            a0 = vzero()
            a1 = vzero()
            a2 = vzero()
            a3 = vzero()
            for r in range(0, dk, 4):
                p = s0 + r * dv + j
                a0 = vfma(vsplat(kn[r]), vload(state, p), a0)
                a1 = vfma(vsplat(kn[r + 1]), vload(state, p + dv), a1)
                a2 = vfma(vsplat(kn[r + 2]), vload(state, p + 2 * dv), a2)
                a3 = vfma(vsplat(kn[r + 3]), vload(state, p + 3 * dv), a3)
            kv = vmul(vadd(vadd(a0, a1), vadd(a2, a3)), dec)
            delta = vmul(vsub(vload(v, vo + j), kv), bv)
            # S = S * exp(g) + k^T delta, and o = q S, two rows at a time
            o0 = vzero()
            o1 = vzero()
            for r in range(0, dk, 2):
                p = s0 + r * dv + j
                s_a = vfma(vload(state, p), dec, vmul(vsplat(kn[r]), delta))
                s_b = vfma(vload(state, p + dv), dec, vmul(vsplat(kn[r + 1]), delta))
                vstore(state, p, s_a)
                vstore(state, p + dv, s_b)
                o0 = vfma(vsplat(qn[r]), s_a, o0)
                o1 = vfma(vsplat(qn[r + 1]), s_b, o1)
            vstore(out, oo + j, vadd(o0, o1))


@jit(parallel=True)
def _recurrent(q, k, v, a, b, alog, dtb, state, out, slots, cu, lay, gating):
    """One prange iteration per (request, v head) pair; padded requests are skipped."""
    hv = lay.hv
    for p in prange(slots.shape[0] * hv):
        n = p // hv
        h = p - n * hv
        s = slots[n]
        if s >= 0:
            s0 = s * lay.slot + h * lay.dk * lay.dv
            _recurrent_pair(
                q, k, v, a, b, alog, dtb, state, out, s0, cu[n], cu[n + 1], h, lay, gating
            )


# --- chunked form -----------------------------------------------------------------------


@jit
def _chunk_pair(q, k, v, g, beta, state, out, s0, t0, t1, h, lay, l2norm, eps):
    """Tokens t0..t1 of v head h in chunks of CHUNK; its state S [Dk, Dv] at
    ``state[s0:]``, in place. Scratch rows (fp32, row i = token i of the chunk): qs, ks
    (normalised q, k; ks later decayed to the chunk's end), w, u (the WY right-hand sides,
    solved in place; u then becomes V'), ob (O's inter-chunk part), lm and qm (C x C)."""
    dk, dv, hv, hk = lay.dk, lay.dv, lay.hv, h // lay.group
    qs = np.empty(CHUNK * dk, np.float32)
    ks = np.empty(CHUNK * dk, np.float32)
    w = np.empty(CHUNK * dk, np.float32)
    u = np.empty(CHUNK * dv, np.float32)
    ob = np.empty(CHUNK * dv, np.float32)
    lm = np.empty(CHUNK * CHUNK, np.float32)
    qm = np.empty(CHUNK * CHUNK, np.float32)
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
        for i in range(n):
            for j in range(i + 1):
                e = math.exp(gc[i] - gc[j])
                qm[i * CHUNK + j] = np.float32(_dot(qs, i * dk, ks, j * dk, dk) * e)
                if j < i:
                    lm[i * CHUNK + j] = np.float32(bt[i] * _dot(ks, i * dk, ks, j * dk, dk) * e)
        # (I + L) W = beta exp(gc) K and (I + L) U = beta V by forward substitution
        for i in range(n):
            t = c0 + i
            ws = vsplat(np.float32(bt[i] * math.exp(gc[i])))
            for d in range(0, dk, LANES):
                acc = vmul(vload(ks, i * dk + d), ws)
                for j in range(i):
                    acc = vfma(vsplat(-lm[i * CHUNK + j]), vload(w, j * dk + d), acc)
                vstore(w, i * dk + d, acc)
            bs = vsplat(bt[i])
            vo = t * lay.v_token + h * lay.v_head
            for d in range(0, dv, LANES):
                acc = vmul(vload(v, vo + d), bs)
                for j in range(i):
                    acc = vfma(vsplat(-lm[i * CHUNK + j]), vload(u, j * dv + d), acc)
                vstore(u, i * dv + d, acc)
        # V' = U - W S and O's inter-chunk part exp(gc) q S: one pass over S per row
        for i in range(n):
            eq = vsplat(np.float32(math.exp(gc[i])))
            for j in range(0, dv, LANES):
                w0 = vzero()
                w1 = vzero()
                q0 = vzero()
                q1 = vzero()
                for r in range(0, dk, 2):
                    p = s0 + r * dv + j
                    s_a = vload(state, p)
                    s_b = vload(state, p + dv)
                    w0 = vfma(vsplat(w[i * dk + r]), s_a, w0)
                    w1 = vfma(vsplat(w[i * dk + r + 1]), s_b, w1)
                    q0 = vfma(vsplat(qs[i * dk + r]), s_a, q0)
                    q1 = vfma(vsplat(qs[i * dk + r + 1]), s_b, q1)
                vstore(u, i * dv + j, vsub(vload(u, i * dv + j), vadd(w0, w1)))
                vstore(ob, i * dv + j, vmul(vadd(q0, q1), eq))
        # O = inter + tril(QK^T * decay) V', rounded once to the output
        for i in range(n):
            oo = ((c0 + i) * hv + h) * dv
            for j in range(0, dv, LANES):
                acc = vload(ob, i * dv + j)
                for m in range(i + 1):
                    acc = vfma(vsplat(qm[i * CHUNK + m]), vload(u, m * dv + j), acc)
                vstore(out, oo + j, acc)
        # S = S exp(gc_last) + (K exp(gc_last - gc))^T V'
        last = gc[n - 1]
        for i in range(n):
            ki = vsplat(np.float32(math.exp(last - gc[i])))
            for d in range(0, dk, LANES):
                vstore(ks, i * dk + d, vmul(vload(ks, i * dk + d), ki))
        el = vsplat(np.float32(math.exp(last)))
        for r in range(dk):
            for j in range(0, dv, LANES):
                p = s0 + r * dv + j
                a0 = vmul(vload(state, p), el)
                a1 = vzero()
                for i in range(0, n - 1, 2):
                    a0 = vfma(vsplat(ks[i * dk + r]), vload(u, i * dv + j), a0)
                    a1 = vfma(vsplat(ks[(i + 1) * dk + r]), vload(u, (i + 1) * dv + j), a1)
                if n % 2:
                    a0 = vfma(vsplat(ks[(n - 1) * dk + r]), vload(u, (n - 1) * dv + j), a0)
                vstore(state, p, vadd(a0, a1))


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


def _check_float(name, x, *, positive=False, low=None):
    if isinstance(x, (bool, np.bool_)) or not isinstance(x, (int, float, np.integer, np.floating)):
        raise TypeError(f"{name}: expected a float, got {type(x).__name__}")
    x = float(x)
    if not math.isfinite(x) or (positive and x <= 0.0) or (low is not None and x < low):
        want = "> 0" if positive else f">= {low}" if low is not None else ""
        raise ValueError(f"{name}: expected a finite float {want}".rstrip() + f", got {x}")
    return x


def _check_strides(name, x):
    """stride(-1) == 1 and no negative stride (a NumPy view may have one)."""
    C.check_inner_contiguous(name, x)
    if any(s < 0 for s in C.strides_of(x)):
        raise ValueError(f"{name}: expected non-negative strides, got {list(C.strides_of(x))}")


def _check_qkv(names, q, k, v):
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


def _check_state(name, state, hv, dk, dv):
    """The slot stride of ``state [num_slots, Hv, Dk, Dv]`` fp32, each slot contiguous."""
    C.check_dtype(name, state, (torch.float32,))
    C.check_shape(name, state, (None, hv, dk, dv))
    st = C.strides_of(state)
    per_slot = hv * dk * dv
    if tuple(st[1:]) != (dk * dv, dv, 1) or (state.shape[0] > 1 and st[0] < per_slot):
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


def _check_rows(name, x, dtypes, t_n, hv, lead=()):
    """``x [*lead, T, Hv]`` in one of ``dtypes``, stride(-1) == 1: the token stride."""
    C.check_dtype(name, x, dtypes)
    C.check_shape(name, x, (*lead, t_n, hv))
    _check_strides(name, x)
    return C.strides_of(x)[-2]


def _check_param(name, x, dt, hv):
    """``x [Hv]`` in fp32 or ``dt``, as a float64 copy (the per-head gating constants)."""
    C.check_dtype(name, x, (torch.float32, dt))
    C.check_shape(name, x, (hv,))
    if isinstance(x, torch.Tensor):
        return x.detach().double().numpy()
    return x.astype(np.float64)


def _output(shape, dt, padded):
    """The output tensor and its flat carrier; zeros where a padded request leaves rows."""
    out = (torch.zeros if padded else torch.empty)(shape, dtype=dt)
    return out, C.as_numpy(out).reshape(-1)


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
):
    """The recurrent gated delta rule with its gating fused in (decode), as vLLM's
    ``fused_sigmoid_gating_delta_rule_update_cpu``: returns ``out [T, 1, Hv, Dv]`` in q's
    dtype and updates each live request's state slot of ``initial_state_source`` in place.
    See the module docstring for shapes, dtypes and layouts."""
    l2norm = C.check_bool("use_qk_l2norm_in_kernel", use_qk_l2norm_in_kernel)
    sp_beta = _check_float("softplus_beta", softplus_beta, positive=True)
    sp_thr = _check_float("softplus_threshold", softplus_threshold)
    dt, t_n, hk, dk, hv, dv = _check_qkv(("q", "k", "v"), q, k, v)
    alog = _check_param("A_log", A_log, dt, hv)
    dtb = _check_param("dt_bias", dt_bias, dt, hv)
    a_t = _check_rows("a", a, (dt,), t_n, hv)
    b_t = _check_rows("b", b, (dt,), t_n, hv)
    slot = _check_state("initial_state_source", initial_state_source, hv, dk, dv)
    slots, cu, padded = _check_requests(
        initial_state_indices, cu_seqlens, t_n, initial_state_source.shape[0]
    )
    out, o = _output((t_n, 1, hv, dv), dt, padded)
    if t_n == 0:
        return out
    qs, ks, vs = C.strides_of(q), C.strides_of(k), C.strides_of(v)
    lay = Layout(qs[1], qs[2], ks[1], ks[2], vs[1], vs[2], a_t, b_t, slot, dk, dv, hv, hv // hk)
    _recurrent(
        C.span(q),
        C.span(k),
        C.span(v),
        C.span(a),
        C.span(b),
        alog,
        dtb,
        C.span(initial_state_source),
        o,
        slots,
        cu,
        lay,
        Gating(sp_beta, sp_thr, l2norm),
    )
    return out


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
    eps = _check_float("eps", eps, low=0.0)
    dt, t_n, hk, dk, hv, dv = _check_qkv(("query", "key", "value"), query, key, value)
    g_t = _check_rows("g", g, (torch.float32,), t_n, hv, lead=(1,))
    _check_rows("beta", beta, (dt, torch.float32), t_n, hv, lead=(1,))
    if C.dtype_of("beta", beta) != torch.float32:  # widened once: [T, Hv] is small
        beta = beta.float() if isinstance(beta, torch.Tensor) else beta.astype(np.float32)
    b_t = C.strides_of(beta)[-2]
    slot = _check_state("initial_state", initial_state, hv, dk, dv)
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
