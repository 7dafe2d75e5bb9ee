"""The steps the fused MoE ops share (docs/kernels.md §5.3): the token sort, the
activations and their rounding, for the bf16 op (:mod:`.fused`) and the quantised one
(:mod:`.quant`)."""

import math

import numpy as np
import torch

from .. import _check as C
from .._jit import jit
from ..simd import store_f32, to_f32

ACTIVATIONS = {"silu": 0, "gelu": 1, "gelu_tanh": 2, "swigluoai": 3}
SWIGLU_LIMIT = 7.0  # GPT-OSS clamp
SWIGLU_ALPHA = 1.702
GELU_TANH_C = 0.7978845608028654  # sqrt(2 / pi)


@jit
def _sort_tokens(ids, t_n, k, e_n, offsets, sorted_slots, slot_rows):
    """Counting sort of the (token, slot) pairs by expert, token order kept (stable). An
    id of -1 (no expert on this rank: expert parallelism) is left out: its slot's row is
    -1, and the sorted rows number ``offsets[e_n]`` (<= T*k)."""
    for e in range(e_n + 1):
        offsets[e] = 0
    for t in range(t_n):
        for j in range(k):
            e = np.int64(ids[t, j])
            if e >= 0:
                offsets[e + 1] += 1
    for e in range(e_n):
        offsets[e + 1] += offsets[e]
    fill = offsets[:e_n].copy()
    for t in range(t_n):
        for j in range(k):
            e = np.int64(ids[t, j])
            if e < 0:
                slot_rows[np.int64(t) * k + j] = -1
                continue
            r = fill[e]
            fill[e] = r + 1
            sorted_slots[r] = np.int64(t) * k + j
            slot_rows[np.int64(t) * k + j] = r


@jit
def _activate(g, u, act):
    if act == 0:  # silu
        return u * g / (1.0 + math.exp(-g))
    if act == 1:  # gelu (erf)
        return u * 0.5 * g * (1.0 + math.erf(g / math.sqrt(2.0)))
    if act == 2:  # gelu_tanh
        return u * 0.5 * g * (1.0 + math.tanh(GELU_TANH_C * (g + 0.044715 * g * g * g)))
    g = min(g, SWIGLU_LIMIT)  # swigluoai
    u = min(max(u, -SWIGLU_LIMIT), SWIGLU_LIMIT)
    return (u + 1.0) * g / (1.0 + math.exp(-SWIGLU_ALPHA * g))


@jit
def _round_like(v, carrier):
    """``v`` rounded to the carrier's dtype (RNE), returned as fp32."""
    store_f32(carrier, 0, v)
    return to_f32(carrier, 0)


def check_ids(topk_ids, t_n, k, e_n):
    """The one check that reads the ids' values: each in ``[0, E)``, or -1 (no expert on
    this rank: skipped, its weight ignored; docs/kernels.md §5.3)."""
    if t_n and k:
        lo, hi = int(topk_ids.min()), int(topk_ids.max())
        if lo < -1 or hi >= e_n:
            raise ValueError(
                f"topk_ids: expected expert ids in [0, {e_n}) or -1, got range [{lo}, {hi}]"
            )


def check_topk(topk_weights, topk_ids, t_n, skip_weighted):
    """The routing tensors' checks both fused MoE ops make (``topk_ids`` int32 and
    ``topk_weights`` fp32, both ``[T, k]`` contiguous; ``skip_weighted`` needs k == 1);
    returns k."""
    C.check_dtype("topk_weights", topk_weights, (torch.float32,))
    C.check_dtype("topk_ids", topk_ids, (torch.int32,))
    C.check_ndim("topk_ids", topk_ids, (2,))
    k = topk_ids.shape[1]
    C.check_shape("topk_ids", topk_ids, (t_n, k))
    C.check_shape("topk_weights", topk_weights, (t_n, k))
    C.check_contiguous("topk_ids", topk_ids)
    C.check_contiguous("topk_weights", topk_weights)
    if skip_weighted and k != 1:
        raise ValueError(f"skip_weighted: requires topk == 1, got topk={k}")
    return k
