"""Gated DeltaNet's gates, with vLLM 0.32's ``fused_gdn_gating_cpu`` argument list and
outputs (``vllm/_custom_ops.py``; kernel in vLLM's ``csrc/cpu/sgl-kernels/fla.cpp``).

``fused_gdn_gating(A_log, a, b, dt_bias) -> (g, beta)``, T tokens, H value heads:

* ``a``, ``b [T, H]``: bf16/fp16/fp32, one dtype, ``stride(-1) == 1`` (rows may be
  strided, e.g. column windows of the projection output).
* ``A_log [H]``: fp32 or ``a``'s dtype; ``dt_bias [H]``: ``a``'s dtype; contiguous.
* ``g [1, T, H]`` fp32: ``-exp(A_log) * softplus(a + dt_bias)``, softplus with beta 1 and
  threshold 20 (``x`` itself above 20, else ``log1p(exp(x))``).
* ``beta [1, T, H]`` in ``b``'s dtype: ``sigmoid(b)``, rounded once.

Both new, contiguous tensors. fp32 math from the exactly widened inputs: ``-exp(A_log)``
once per head (in float64, rounded), then 16 heads at a time (``numkern.simd``, a scalar
tail for the rest): ``softplus(x) = max(x, 0) + log1p(exp(-|x|))`` with ``log1p(y) =
2 atanh(y / (2 + y))`` as its odd series (``y <= 1``, so the ratio is at most 1/3 and
eight terms reach fp32 precision), ``sigmoid(b) = 1 / (1 + exp(-b))``; ``exp`` is
``simd.vexp`` (relative error ~2e-7).
"""

import math
from typing import NamedTuple

import numpy as np
import torch
from numba import prange

from .. import _check as C
from .._jit import jit
from .._ptr import view
from ..simd import (
    LANES,
    store_f32,
    to_f32,
    vadd,
    vdiv,
    vexp,
    vfma,
    vload,
    vmax,
    vmul,
    vselect_lt,
    vsplat,
    vstore,
    vsub,
    vzero,
)
from ._common import Memo

SOFTPLUS_THRESHOLD = np.float32(20.0)  # torch's F.softplus default, vLLM's kernel's
# Below this many gates one thread runs the call: a parallel region costs ~5 us
# (numkern.norm), about one thread's time for 4096 gates here (~1.5 ns a gate on Zen 4).
PARALLEL_GATES = 4096
# 2 atanh(s) = 2 (s + s^3/3 + s^5/5 + ...): the coefficients of s^(2i+1), i = 0..8, for
# s <= 1/3 (the last term is below 2^-26 of the sum).
_ATANH2 = tuple(2.0 / (2 * i + 1) for i in range(9))
_F32_WITNESS = C.WITNESS[torch.float32]


@jit(inline="always")
def _softplus(x):
    """softplus of 16 lanes (threshold 20; NaN stays NaN)."""
    zero = vzero()
    y = vexp(vsub(zero, vmax(x, vsub(zero, x))))  # exp(-|x|), in (0, 1]
    s = vdiv(y, vadd(vsplat(np.float32(2.0)), y))
    s2 = vmul(s, s)
    p = vsplat(np.float32(_ATANH2[8]))
    for i in range(7, -1, -1):
        p = vfma(p, s2, vsplat(np.float32(_ATANH2[i])))
    nan_only = vselect_lt(x, vsplat(np.inf), zero, vsplat(np.nan))  # 0, NaN for NaN (not -inf)
    sp = vfma(p, s, vadd(vmax(x, zero), nan_only))
    return vselect_lt(vsplat(SOFTPLUS_THRESHOLD), x, x, sp)


@jit
def _rows(alog, a, a_rs, b, b_rs, dtb, g, beta, t0, t1, H):
    """Tokens t0..t1: 16 heads at a time, then scalars. ``alog`` holds -exp(A_log)."""
    hv = H - H % LANES
    one = vsplat(np.float32(1.0))
    zero = vzero()
    for t in range(t0, t1):
        for h in range(0, hv, LANES):
            x = vadd(vload(a, t * a_rs + h), vload(dtb, h))
            vstore(g, t * H + h, vmul(vload(alog, h), _softplus(x)))
            bv = vload(b, t * b_rs + h)
            vstore(beta, t * H + h, vdiv(one, vadd(one, vexp(vsub(zero, bv)))))
        for h in range(hv, H):
            x = to_f32(a, t * a_rs + h) + to_f32(dtb, h)
            sp = x if x > SOFTPLUS_THRESHOLD else np.float32(math.log1p(math.exp(x)))
            g[t * H + h] = alog[h] * sp
            bv = to_f32(b, t * b_rs + h)
            store_f32(beta, t * H + h, np.float32(1.0) / (np.float32(1.0) + math.exp(-bv)))


@jit(parallel=True)
def _gating(alog_a, a_a, a_rs, b_a, b_rs, dtb_a, g_a, beta_a, T, H, carriers):
    """Tensors by address; ``carriers``: (a/b/dt_bias/beta carrier, A_log's)."""
    xwit, lwit = carriers
    a = view(a_a, (T - 1) * a_rs + H, xwit)
    b = view(b_a, (T - 1) * b_rs + H, xwit)
    dtb = view(dtb_a, H, xwit)
    g = view(g_a, T * H, _F32_WITNESS)
    beta = view(beta_a, T * H, xwit)
    a_log = view(alog_a, H, lwit)
    alog = np.empty(H, np.float32)
    for h in range(H):
        alog[h] = np.float32(-math.exp(np.float64(to_f32(a_log, h))))
    if T * H < PARALLEL_GATES:
        _rows(alog, a, a_rs, b, b_rs, dtb, g, beta, 0, T, H)
    else:
        for t in prange(T):
            i = np.int64(t)  # (int64 in and out of the parallel body: one signature)
            _rows(alog, a, a_rs, b, b_rs, dtb, g, beta, i, i + 1, H)


# --- checks and wrapper ------------------------------------------------------------------

_CARRIERS = {
    (dt, ldt): (C.WITNESS[dt], C.WITNESS[ldt]) for dt in C.FLOATS for ldt in {dt, torch.float32}
}
_F32 = torch.float32
_Tensor = torch.Tensor
_empty = torch.empty


class GatingPlan(NamedTuple):
    """What :func:`check_gating` derives from the gating inputs' metadata."""

    t_n: int
    h: int
    a_rs: int  # a's token (row) stride
    b_rs: int  # b's
    dt: torch.dtype  # a's and b's
    ldt: torch.dtype  # A_log's
    widen: tuple  # (A_log, dt_bias): not a contiguous fp32 vector (the rule widens them)
    carriers: tuple  # fused_gdn_gating's kernel's witnesses of (dt, ldt)


def _check_rows(name, x, dt, other, t_n, h):
    """The token stride of ``x [T, H]`` in ``dt`` (``other``'s dtype), ``stride(-1) ==
    1``, no negative stride."""
    C.check_same_dtype(name, x, dt, other)
    C.check_shape(name, x, (t_n, h))
    C.check_inner_contiguous(name, x)
    C.check_non_negative_strides(name, x)
    return C.strides_of(x)[0]


def _is_f32(name, x):
    """Whether a checked per-head constant is already a contiguous fp32 vector."""
    return C.dtype_of(name, x) is _F32 and (
        x.is_contiguous() if isinstance(x, torch.Tensor) else x.flags.c_contiguous
    )


def _check_gating(A_log, a, b, dt_bias, dt, t_n, h):
    """:func:`check_gating` unmemoised."""
    fused = dt is not None
    if not fused:  # fused_gdn_gating: a gives the dtype, T and H
        dt = C.check_dtype("a", a, C.FLOATS)
        C.check_ndim("a", a, (2,))
        t_n, h = a.shape
    ldt = C.check_dtype("A_log", A_log, (_F32, dt))
    C.check_shape("A_log", A_log, (h,))
    if fused:
        C.check_dtype("dt_bias", dt_bias, (_F32, dt))
    else:
        C.check_contiguous("A_log", A_log)
        C.check_same_dtype("dt_bias", dt_bias, dt, "a")
    C.check_shape("dt_bias", dt_bias, (h,))
    if not fused:
        C.check_contiguous("dt_bias", dt_bias)
    other = "q" if fused else "a"
    a_rs = _check_rows("a", a, dt, other, t_n, h)
    b_rs = _check_rows("b", b, dt, other, t_n, h)
    widen = (not _is_f32("A_log", A_log), not _is_f32("dt_bias", dt_bias))
    return GatingPlan(t_n, h, a_rs, b_rs, dt, ldt, widen, _CARRIERS.get((dt, ldt)))


_PLANS = Memo()


def check_gating(A_log, a, b, dt_bias, dt=None, t_n=None, h=None):
    """Every check of the gating inputs, each naming the argument: a :class:`GatingPlan`.
    ``a``, ``b [T, H]`` of one dtype, ``stride(-1) == 1``, no negative stride; ``A_log``,
    ``dt_bias [H]``. Two forms:

    * :func:`fused_gdn_gating`'s (``dt`` None): a's dtype (bf16/fp16/fp32) and shape give
      dt, T and H; A_log fp32 or dt, dt_bias dt, both contiguous;
    * the recurrent rule's fused gating (``dt``, ``t_n``, ``h``: q's dtype, T and Hv):
      a, b ``[t_n, h]`` in dt; A_log and dt_bias fp32 or dt, any strides (``widen``).

    Memoised on what it reads — each tensor's dtype, device, shape and strides, and the
    form (``numkern.gdn._common.Memo``): a decode step asks once per layer with the same
    metadata. NumPy arrays and tensor subclasses are checked afresh."""
    Tn = _Tensor
    key = None
    if type(A_log) is Tn and type(a) is Tn and type(b) is Tn and type(dt_bias) is Tn:
        # tensor_meta of each, written out: a decode step's gating was 16% slower through
        # four calls of it and C.address (ab.py, fused_gdn_gating B=1 and 8)
        key = (
            A_log.dtype, a.dtype, b.dtype, dt_bias.dtype, A_log.shape, a.shape, b.shape,
            dt_bias.shape, A_log.stride(), a.stride(), b.stride(), dt_bias.stride(),
            A_log.is_cpu, a.is_cpu, b.is_cpu, dt_bias.is_cpu, dt, t_n, h,
        )  # fmt: skip
    return _PLANS.plan(key, _check_gating, (A_log, a, b, dt_bias, dt, t_n, h))


def fused_gdn_gating(A_log, a, b, dt_bias):
    """``(g, beta)``: ``g = -exp(A_log) * softplus(a + dt_bias)`` (fp32) and ``beta =
    sigmoid(b)`` (b's dtype), both ``[1, T, H]``. See the module docstring. The checks
    are :func:`check_gating`'s, memoised on the inputs' metadata."""
    # one unpacking: eight attribute reads of the plan cost ~0.3 us of a ~5 us call
    t_n, h, a_rs, b_rs, dt, _, _, carriers = check_gating(A_log, a, b, dt_bias)
    g = _empty(1, t_n, h, dtype=_F32)  # sizes as arguments: ~0.5 us less than a tuple
    beta = _empty(1, t_n, h, dtype=dt)
    if t_n and h:
        at = C.address
        ga, ba = g.data_ptr(), beta.data_ptr()
        _gating(at(A_log), at(a), a_rs, at(b), b_rs, at(dt_bias), ga, ba, t_n, h, carriers)
    return g, beta
