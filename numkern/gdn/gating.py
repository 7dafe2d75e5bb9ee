"""Gated DeltaNet's gates, with vLLM 0.32's ``fused_gdn_gating_cpu`` argument list and
outputs (``vllm/_custom_ops.py``; kernel in vLLM's ``csrc/cpu/sgl-kernels/fla.cpp``).

``fused_gdn_gating(A_log, a, b, dt_bias) -> (g, beta)``, T tokens, H value heads:

* ``a``, ``b [T, H]``: bf16/fp16/fp32, one dtype, ``stride(-1) == 1`` (rows may be
  strided, e.g. column windows of the projection output).
* ``A_log [H]``: fp32 or ``a``'s dtype; ``dt_bias [H]``: ``a``'s dtype; contiguous.
* ``g [1, T, H]`` fp32: ``-exp(A_log) * softplus(a + dt_bias)``, softplus with beta 1 and
  threshold 20 (``x`` itself above 20, else ``log1p(exp(x))``).
* ``beta [1, T, H]`` in ``b``'s dtype: ``sigmoid(b)``, rounded once.

Both new, contiguous tensors. fp32 math from the exactly widened inputs.
"""

import math

import numpy as np
import torch
from numba import prange

from .. import _check as C
from .._jit import jit
from ..simd import store_f32, to_f32

SOFTPLUS_THRESHOLD = np.float32(20.0)  # torch's F.softplus default, vLLM's kernel's
# Below this many gates one thread runs the call: a parallel region costs ~5 us
# (numkern.norm), about one thread's time for 4096 exp/log1p pairs.
PARALLEL_GATES = 4096


@jit
def _rows(A_log, a, a_rs, b, b_rs, dt_bias, g, beta, t0, t1, H):
    for t in range(t0, t1):
        for h in range(H):
            x = to_f32(a, t * a_rs + h) + to_f32(dt_bias, h)
            sp = x if x > SOFTPLUS_THRESHOLD else np.float32(math.log1p(math.exp(x)))
            g[t * H + h] = -np.float32(math.exp(to_f32(A_log, h))) * sp
            bv = to_f32(b, t * b_rs + h)
            store_f32(beta, t * H + h, np.float32(1.0) / (np.float32(1.0) + math.exp(-bv)))


@jit(parallel=True)
def _gating(A_log, a, a_rs, b, b_rs, dt_bias, g, beta, T, H):
    if T * H < PARALLEL_GATES:
        _rows(A_log, a, a_rs, b, b_rs, dt_bias, g, beta, 0, T, H)
    else:
        for t in prange(T):
            _rows(A_log, a, a_rs, b, b_rs, dt_bias, g, beta, t, t + 1, H)


def _rows_of(name, x, dt, H):
    """Row stride of ``x [T, H]`` (same dtype ``dt``, ``stride(-1) == 1``)."""
    C.check_same_dtype(name, x, dt, "a")
    C.check_ndim(name, x, (2,))
    if x.shape[1] != H:
        raise ValueError(f"{name}: expected shape [*, {H}] (H of A_log), got {list(x.shape)}")
    C.check_inner_contiguous(name, x)
    return C.strides_of(x)[0]


def fused_gdn_gating(A_log, a, b, dt_bias):
    """``(g, beta)``: ``g = -exp(A_log) * softplus(a + dt_bias)`` (fp32) and ``beta =
    sigmoid(b)`` (b's dtype), both ``[1, T, H]``. See the module docstring."""
    dt = C.check_dtype("a", a, C.FLOATS)
    C.check_ndim("a", a, (2,))
    T, H = a.shape
    C.check_dtype("A_log", A_log, (torch.float32, dt))
    C.check_shape("A_log", A_log, (H,))
    C.check_contiguous("A_log", A_log)
    C.check_same_dtype("dt_bias", dt_bias, dt, "a")
    C.check_shape("dt_bias", dt_bias, (H,))
    C.check_contiguous("dt_bias", dt_bias)
    a_rs = _rows_of("a", a, dt, H)
    if tuple(b.shape) != (T, H):
        C.check_dtype("b", b, C.FLOATS)
        raise ValueError(f"b: expected shape [{T}, {H}] (that of a), got {list(b.shape)}")
    b_rs = _rows_of("b", b, dt, H)
    g = torch.empty((1, T, H), dtype=torch.float32)
    beta = torch.empty((1, T, H), dtype=dt)
    if T and H:
        _gating(
            C.as_numpy(A_log),
            C.span(a),
            a_rs,
            C.span(b),
            b_rs,
            C.as_numpy(dt_bias),
            g.numpy().reshape(-1),
            C.as_numpy(beta).reshape(-1),
            T,
            H,
        )
    return g, beta
