"""``fused_sigmoid_gating_delta_rule_update``: the recurrent form of the gated delta rule
with its gating fused in, token by token, for decode (``numkern.gdn.rule`` documents its
arguments, layouts and math).

Kernel: one ``prange`` iteration per (request, v head) pair owns that pair's state and
output rows, with its own scratch, so no two threads write one element. Inner loops run
over 16 lanes of Dv (``numkern.simd``); the state is read row by row, 64 columns (four
vectors, four accumulators) a pass, in address order.

The op is called once per GDN layer per decode step with the same metadata each time:
the checks that read only dtypes, shapes, strides and the flags (:func:`check_recurrent`)
run once per metadata and their plan is memoised (``numkern.gdn._common``); the tensors
reach the kernel by address (``numkern._ptr``), and on every call ``_requests_verdict``
checks the index vectors' values (the checks that name a problem run only when it
rejects them).
"""

import math
from typing import NamedTuple

import numpy as np
import torch
from numba import prange

from .. import _check as C
from .._jit import jit
from .._ptr import view
from ..simd import LANES, to_f32, vfma, vload, vmul, vsplat, vstore, vsub, vzero
from ._common import Memo, elements_spanned, tensor_meta
from ._rule_common import (
    STATE_COLS,
    Gating,
    Layout,
    _check_requests,
    _load_scaled,
    check_qkv,
    check_state,
)
from .gating import check_gating

# vLLM's CPU recurrent kernel (and its Triton one, 1e-6) fix the L2 norm's epsilon: the
# recurrent op's default; its ``eps`` keyword (numkern's own) sets another.
RECURRENT_EPS = 1e-5
_F32 = C.WITNESS[torch.float32]
_I32 = C.WITNESS[torch.int32]


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


# --- wrapper ----------------------------------------------------------------------------


class RecurrentPlan(NamedTuple):
    """What :func:`check_recurrent` derives from one call's metadata."""

    dt: torch.dtype
    out_shape: tuple  # (T, 1, Hv, Dv)
    t_n: int
    n_req: int
    num_slots: int
    extents: tuple  # elements of q, k, v, a, b, the state pool
    lay: tuple  # Layout's fields
    gating: tuple  # Gating's fields
    carrier: np.ndarray  # q's (C.WITNESS)
    widen: tuple  # A_log, dt_bias: widened to contiguous fp32 per call (else by address)
    contiguous: tuple  # initial_state_indices, cu_seqlens: by address (else a copy's)
    direct: bool  # torch tensors, the index vectors contiguous: every address a data_ptr


def _check_index(name, x):
    """An int32 vector (tensor or array); whether it is contiguous."""
    C.check_dtype(name, x, (torch.int32,))
    C.check_ndim(name, x, (1,))
    return x.is_contiguous() if isinstance(x, torch.Tensor) else x.flags.c_contiguous


def check_recurrent(A_log, dt_bias, q, k, v, a, b, state, idx, cu, l2norm, sp_beta, sp_thr, eps):
    """Every check of :func:`fused_sigmoid_gating_delta_rule_update` that reads no values
    (the index values are ``_requests_verdict``'s, on every call), each naming the
    argument: a :class:`RecurrentPlan`."""
    l2norm = C.check_bool("use_qk_l2norm_in_kernel", l2norm)
    eps = C.check_float("eps", eps, low=0.0)
    sp_beta = C.check_float("softplus_beta", sp_beta, positive=True)
    sp_thr = C.check_float("softplus_threshold", sp_thr)
    dt, t_n, hk, dk, hv, dv = check_qkv(("q", "k", "v"), q, k, v)
    gates = check_gating(A_log, a, b, dt_bias, dt, t_n, hv)
    a_t, b_t = gates.a_rs, gates.b_rs
    slot = check_state("initial_state_source", state, hv, dk, dv)
    idx_contiguous = _check_index("initial_state_indices", idx)
    cu_contiguous = _check_index("cu_seqlens", cu)
    n_req = idx.shape[0]
    if cu.shape[0] != n_req + 1:
        _check_requests(idx, cu, t_n, state.shape[0])  # raises, naming cu_seqlens
    qs, ks, vs = C.strides_of(q), C.strides_of(k), C.strides_of(v)
    return RecurrentPlan(
        dt,
        (t_n, 1, hv, dv),
        t_n,
        n_req,
        state.shape[0],
        tuple(elements_spanned(x.shape, C.strides_of(x)) for x in (q, k, v, a, b, state)),
        (qs[1], qs[2], ks[1], ks[2], vs[1], vs[2], a_t, b_t, slot, dk, dv, hv, hv // hk),
        (sp_beta, sp_thr, l2norm, eps),
        C.WITNESS[dt],
        gates.widen,
        (idx_contiguous, cu_contiguous),
        idx_contiguous
        and cu_contiguous
        and not any(isinstance(x, np.ndarray) for x in (A_log, dt_bias, q, k, v, a, b, state)),
    )


class _RecurrentCall(NamedTuple):
    """One planned call: its output and the kernels' arguments, with the fp32 copies and
    index arrays the addresses point into (alive until the kernel ran)."""

    out: torch.Tensor
    kernel_args: tuple  # of _recurrent
    index_args: tuple  # of _requests_verdict
    keep: tuple


def _widen(x):
    return C.as_torch(x).float().contiguous()


def _index_address(x, contiguous):
    """(address, the array it points into) of an int32 index vector."""
    if contiguous:
        return C.address(x), x
    a = np.ascontiguousarray(C.as_numpy(x))
    return C.address(a), a


def _call(p, A_log, dt_bias, q, k, v, a, b, state, idx, cu):
    """A planned call's :class:`_RecurrentCall`: its output and the addresses."""
    alog = _widen(A_log) if p.widen[0] else A_log
    dtb = _widen(dt_bias) if p.widen[1] else dt_bias
    out = _empty(p.out_shape, dtype=p.dt)
    if p.direct:
        idx_a, cu_a = idx.data_ptr(), cu.data_ptr()
        at = (q.data_ptr(), k.data_ptr(), v.data_ptr(), a.data_ptr(), b.data_ptr())
        at = (*at, alog.data_ptr(), dtb.data_ptr(), state.data_ptr(), out.data_ptr())
        keep = (alog, dtb)
    else:
        at = tuple(C.address(x) for x in (q, k, v, a, b, alog, dtb, state, out))
        idx_a, idx_k = _index_address(idx, p.contiguous[0])
        cu_a, cu_k = _index_address(cu, p.contiguous[1])
        keep = (alog, dtb, idx_k, cu_k)
    kernel_args = ((*at, idx_a, cu_a), p.extents, p.n_req, p.lay, p.gating, p.carrier)
    return _RecurrentCall(out, kernel_args, (idx_a, p.n_req, cu_a, p.t_n, p.num_slots), keep)


_PLANS = Memo()
_empty = torch.empty


def _key(A_log, dt_bias, q, k, v, a, b, state, idx, cu, l2norm, sp_beta, sp_thr, eps):
    """The memo's key of a call: the metadata of each tensor, the flag and the floats;
    None (no memo) unless the tensors are torch.Tensors, the flag a bool and the floats
    floats."""
    metas = (
        tensor_meta(A_log),
        tensor_meta(dt_bias),
        tensor_meta(q),
        tensor_meta(k),
        tensor_meta(v),
        tensor_meta(a),
        tensor_meta(b),
        tensor_meta(state),
        tensor_meta(idx),
        tensor_meta(cu),
    )
    if (
        None in metas
        or type(l2norm) is not bool
        or type(sp_beta) is not float
        or type(sp_thr) is not float
        or type(eps) is not float
    ):
        return None
    return (metas, l2norm, sp_beta, sp_thr, eps)


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
    default (transformers' and FLA's is 1e-6). See ``numkern.gdn.rule``'s docstring for
    shapes, dtypes and layouts."""
    args = (A_log, dt_bias, q, k, v, a, b, initial_state_source, initial_state_indices,
            cu_seqlens, use_qk_l2norm_in_kernel, softplus_beta, softplus_threshold,
            eps)  # fmt: skip
    plan = _PLANS.plan(_key(*args), check_recurrent, args)
    call = _call(plan, *args[:10])
    if _requests_verdict(*call.index_args):
        _check_requests(initial_state_indices, cu_seqlens, plan.t_n, plan.num_slots)
        raise RuntimeError("initial_state_indices / cu_seqlens: rejected, but not explained")
    if plan.t_n:
        _recurrent(*call.kernel_args)
    return call.out
