"""MoE routing: the top-k experts of each token and their weights (docs/kernels.md §5.1).

``logits [T, E]`` any float dtype, computed in fp32; results ``topk_weights`` fp32 and
``topk_ids`` int32, both contiguous ``[T, k]``; ties go to the lowest expert id.
"""

import math

import numpy as np
import torch
from numba import prange

from .. import _check as C
from .._jit import jit


@jit
def _select_topk(scores, allowed, k, ids_row, vals_row):
    """k largest ``scores[e]`` with ``allowed[e]``; ties -> lowest id; descending order."""
    e_n = scores.shape[0]
    taken = np.zeros(e_n, np.bool_)
    for j in range(k):
        best = -1
        for e in range(e_n):
            if allowed[e] and not taken[e]:
                if best < 0 or scores[e] > scores[best]:
                    best = e
        taken[best] = True
        ids_row[j] = best
        vals_row[j] = scores[best]


@jit
def _softmax_row(src, t, e_n, dst):
    mx = -np.inf
    for e in range(e_n):
        mx = max(mx, src[t, e])
    s = 0.0
    for e in range(e_n):
        v = math.exp(src[t, e] - mx)
        dst[e] = v
        s += v
    for e in range(e_n):
        dst[e] = dst[e] / s


@jit(parallel=True)
def _topk_softmax(logits, k, renormalize, weights, ids):
    t_n, e_n = logits.shape
    for t in prange(t_n):
        probs = np.empty(e_n, np.float32)
        _softmax_row(logits, t, e_n, probs)
        allowed = np.ones(e_n, np.bool_)
        vals = np.empty(k, np.float32)
        _select_topk(probs, allowed, k, ids[t], vals)
        s = 0.0
        for j in range(k):
            s += vals[j]
        for j in range(k):
            weights[t, j] = vals[j] / s if renormalize else vals[j]


@jit(parallel=True)
def _grouped_topk(
    logits, k, renormalize, n_group, topk_group, sigmoid, bias, has_bias, scale, weights, ids
):
    t_n, e_n = logits.shape
    per = e_n // n_group
    for t in prange(t_n):
        scores = np.empty(e_n, np.float32)
        if sigmoid:
            for e in range(e_n):  # float64 exp (docs §5.1): an fp32 exp ties saturated scores
                scores[e] = 1.0 / (1.0 + math.exp(-np.float64(logits[t, e])))
        else:
            _softmax_row(logits, t, e_n, scores)
        choice = np.empty(e_n, np.float32)  # the scores experts are chosen by
        for e in range(e_n):
            choice[e] = scores[e] + bias[e] if has_bias else scores[e]
        gscore = np.empty(n_group, np.float32)
        for g in range(n_group):
            if has_bias:  # sum of the group's top-2 biased scores
                a = -np.inf
                b = -np.inf
                for e in range(g * per, (g + 1) * per):
                    v = choice[e]
                    if v > a:
                        b = a
                        a = v
                    elif v > b:
                        b = v
                gscore[g] = a + (b if per > 1 else 0.0)
            else:
                m = -np.inf
                for e in range(g * per, (g + 1) * per):
                    m = max(m, scores[e])
                gscore[g] = m
        gids = np.empty(topk_group, np.int32)
        gvals = np.empty(topk_group, np.float32)
        _select_topk(gscore, np.ones(n_group, np.bool_), topk_group, gids, gvals)
        allowed = np.zeros(e_n, np.bool_)
        for gi in range(topk_group):
            g = gids[gi]
            for e in range(g * per, (g + 1) * per):
                allowed[e] = True
        vals = np.empty(k, np.float32)
        _select_topk(choice, allowed, k, ids[t], vals)
        s = 0.0
        for j in range(k):
            vals[j] = scores[ids[t, j]]  # weights come from the unbiased scores
            s += vals[j]
        for j in range(k):
            w = vals[j] / s if renormalize else vals[j]
            weights[t, j] = w * scale


def check_routing(logits, topk):
    """The routing ops' checks of ``logits [T, E]`` and ``topk`` (``numkern.torch_ops``'
    fakes run them too); returns ``(T, E, topk)``."""
    C.check_dtype("logits", logits, C.FLOATS)
    C.check_ndim("logits", logits, (2,))
    t_n, e_n = logits.shape
    topk = C.check_int("topk", topk, low=1)
    if topk > e_n:
        raise ValueError(f"topk: expected 1 <= topk <= E={e_n}, got {topk}")
    return t_n, e_n, topk


def _routing_inputs(logits, topk):
    t_n, _, topk = check_routing(logits, topk)
    logits = C.as_torch(logits).float().contiguous().numpy()
    weights = torch.empty((t_n, topk), dtype=torch.float32)
    ids = torch.empty((t_n, topk), dtype=torch.int32)
    return logits, topk, weights, ids


def topk_softmax(logits, topk, renormalize):
    """Top-k of ``softmax(logits)`` per token -> ``(topk_weights fp32, topk_ids int32)``.

    ``renormalize`` divides the chosen weights by their sum. Ties: lowest expert id.
    """
    logits, topk, weights, ids = _routing_inputs(logits, topk)
    if logits.shape[0]:
        _topk_softmax(logits, topk, bool(renormalize), weights.numpy(), ids.numpy())
    return weights, ids


def check_grouping(e_n, topk, num_expert_group, topk_group, scoring_func, bias, scaling=1.0):
    """:func:`grouped_topk`'s checks of its grouping arguments for ``E = e_n`` experts
    (``numkern.torch_ops``' fake runs them too), ``scaling`` its finite
    ``routed_scaling_factor``; returns ``(num_expert_group, topk_group)``."""
    C.check_float("routed_scaling_factor", scaling)
    n_group = C.check_int("num_expert_group", num_expert_group, low=1)
    if e_n % n_group:
        raise ValueError(f"num_expert_group: expected a divisor of E={e_n}, got {n_group}")
    tg = C.check_int("topk_group", topk_group, low=1)
    if tg > n_group:
        raise ValueError(f"topk_group: expected 1..num_expert_group={n_group}, got {tg}")
    if topk > tg * (e_n // n_group):
        raise ValueError(
            f"topk: expected <= topk_group * experts per group = {tg * (e_n // n_group)}, "
            f"got {topk}"
        )
    if scoring_func not in ("softmax", "sigmoid"):
        raise ValueError(f"scoring_func: expected 'softmax' or 'sigmoid', got {scoring_func!r}")
    if bias is not None:
        C.check_dtype("e_score_correction_bias", bias, C.FLOATS)
        C.check_shape("e_score_correction_bias", bias, (e_n,))
    return n_group, tg


def grouped_topk(
    logits, topk, renormalize, num_expert_group, topk_group, *,
    scoring_func="softmax", routed_scaling_factor=1.0, e_score_correction_bias=None,
):  # fmt: skip
    """DeepSeek-style grouped routing (docs/kernels.md §5.1) -> ``(topk_weights, topk_ids)``."""
    logits, topk, weights, ids = _routing_inputs(logits, topk)
    e_n = logits.shape[1]
    n_group, tg = check_grouping(
        e_n, topk, num_expert_group, topk_group, scoring_func, e_score_correction_bias,
        routed_scaling_factor,
    )  # fmt: skip
    if e_score_correction_bias is not None:
        bias = C.as_torch(e_score_correction_bias).float().contiguous().numpy()
    else:
        bias = np.zeros(e_n, np.float32)
    if logits.shape[0]:
        _grouped_topk(
            logits,
            topk,
            bool(renormalize),
            n_group,
            tg,
            scoring_func == "sigmoid",
            bias,
            e_score_correction_bias is not None,
            float(routed_scaling_factor),
            weights.numpy(),
            ids.numpy(),
        )
    return weights, ids
