"""The public ops: validate, build the kernels' named inputs, dispatch."""

import numpy as np
import torch

from .. import _check as C
from .. import isa as nk_isa
from .kernels import (
    Heads,
    RowStrides,
    Scores,
    attention,
    cache_write,
    tile_witness,
)
from .layout import cache_layout, check_cache
from .plan import (
    check_config,
    check_slots,
    plan_attention,
)


def _span(x):
    """A ``[T, H, D]`` tensor with ``stride(-1) == 1`` as a 1-D carrier from its first
    element (:func:`numkern._check.span`), and its (token, head) strides."""
    st = C.strides_of(x)
    return C.span(x), st[0], st[1]


def reshape_and_cache(key, value, key_cache, value_cache, slot_mapping, isa):
    """Write ``key``/``value [T, Hkv, D]`` into the cache at ``slot_mapping [T]`` (int64;
    slot s -> block s // B, offset s % B; negative slots are skipped) in ``isa``'s layout.
    """
    nk_isa.attention_rule(isa)
    nb, hkv, b, d = check_cache("key_cache", key_cache, None, None, isa)
    check_cache("value_cache", value_cache, key_cache.dtype, (nb, hkv, b, d), isa)
    check_config(hkv, hkv, d, b, -1, isa)
    for name, x in (("key", key), ("value", value)):
        C.check_same_dtype(name, x, key_cache.dtype, "the cache")
        C.check_ndim(name, x, (3,))
        C.check_inner_contiguous(name, x)
    t_n = key.shape[0]
    C.check_shape("key", key, (t_n, hkv, d))
    C.check_shape("value", value, (t_n, hkv, d))
    for name, x in (("key", key), ("value", value)):  # read while the cache is written
        for cache_name, cache in (("key_cache", key_cache), ("value_cache", value_cache)):
            C.check_disjoint(name, x, cache_name, cache, f"{cache_name} is written")
    slots = check_slots(slot_mapping, t_n, nb * b)
    if t_n == 0:
        return
    kc, vc, layout = cache_layout(key_cache, value_cache, isa, False)
    k, k_token, k_head = _span(key)
    v, v_token, v_head = _span(value)
    heads = Heads(hkv, hkv, d)
    cache_write(k, v, k_token, k_head, v_token, v_head, kc, vc, slots, t_n, heads, layout)


def paged_attention(
    query,
    key_cache,
    value_cache,
    output,
    query_start_loc,
    seq_lens,
    block_table,
    *,
    scale,
    causal=True,
    sliding_window=-1,
    softcap=0.0,
    alibi_slopes=None,
    sinks=None,
    isa,
    plan=None,
):
    """Attention of a varlen batch over the paged cache, into ``output`` (package docstring).

    With a ``plan`` the kernels read the plan's validated copies of ``query_start_loc``,
    ``seq_lens`` and (when the plan holds one) ``block_table``; the tensors given must
    have the plan's shapes, and a ``block_table`` other than the plan's (not the same
    tensor, nor equal to it) is a ValueError.
    """
    C.check_dtype("query", query, C.FLOATS)
    C.check_ndim("query", query, (3,))
    C.check_inner_contiguous("query", query)
    t_n, hq, d = query.shape
    nb, hkv, b, dk = check_cache("key_cache", key_cache, query.dtype, None, isa)
    check_cache("value_cache", value_cache, query.dtype, (nb, hkv, b, dk), isa)
    if dk != d:
        raise ValueError(f"key_cache: expected head_dim {d} (that of query), got {dk}")
    C.check_same_dtype("output", output, query.dtype, "query")
    C.check_shape("output", output, (t_n, hq, d))
    C.check_inner_contiguous("output", output)
    _check_output_apart(output, query, key_cache, value_cache)
    if plan is None:
        plan = plan_attention(
            query_start_loc,
            seq_lens,
            num_heads=hq,
            num_kv_heads=hkv,
            head_dim=d,
            block_size=b,
            causal=causal,
            sliding_window=sliding_window,
            isa=isa,
        )
    else:
        _check_plan(
            plan, query_start_loc, seq_lens, t_n, hq, hkv, d, b, causal, sliding_window, isa
        )
    if plan.num_tokens != t_n:
        raise ValueError(
            f"query: expected {plan.num_tokens} tokens (query_start_loc[-1]), got {t_n}"
        )
    step = plan.step_arrays(block_table, nb)
    scores = _scores(plan, scale, softcap, alibi_slopes, sinks)
    if t_n == 0 or plan.items.shape[0] == 0:
        return
    kc, vc, layout = cache_layout(key_cache, value_cache, isa, True)
    q, q_token, q_head = _span(query)
    out, o_token, o_head = _span(output)
    rows = RowStrides(q_token, q_head, o_token, o_head)
    attention(step, q, out, rows, kc, vc, layout, Heads(hq, hkv, d), scores)


def _check_output_apart(output, query, key_cache, value_cache):
    """ValueError when ``output`` shares elements with a cache, or with ``query`` other
    than as ``query`` itself (in place: each row's query is read before its output is
    written; a partial overlap would read rows already written)."""
    for name, cache in (("key_cache", key_cache), ("value_cache", value_cache)):
        C.check_disjoint("output", output, name, cache, "output is written")
    in_place = C.address(output) == C.address(query)
    if not (in_place and C.strides_of(output) == C.strides_of(query)):
        C.check_disjoint("output", output, "query", query, "output is written")


def _check_plan(plan, qsl, sl, t_n, hq, hkv, d, b, causal, window, isa):
    """ValueError when ``plan`` was built for another configuration or other shapes."""
    want = (plan.num_heads, plan.num_kv_heads, plan.head_dim, plan.block_size)
    want += (plan.causal, plan.sliding_window, plan.isa)
    got = (hq, hkv, d, b, bool(causal), window, isa)
    if want != got:
        raise ValueError(
            f"plan: built for (heads, kv heads, head_dim, block_size, causal, window, isa)"
            f" = {want}, used with {got}"
        )
    shapes = (tuple(qsl.shape), tuple(sl.shape), t_n)
    if shapes != ((plan.num_requests + 1,), (plan.num_requests,), plan.num_tokens):
        raise ValueError(
            f"plan: built for {plan.num_requests} requests and {plan.num_tokens} tokens, "
            f"used with query_start_loc {list(qsl.shape)}, seq_lens {list(sl.shape)} and "
            f"{t_n} tokens"
        )


def _scores(plan, scale, softcap, alibi_slopes, sinks):
    """The :class:`Scores` of a call: validated ALiBi slopes and sinks as fp32 arrays (empty
    when absent) with their flags, and the plan's mask."""
    hq = plan.num_heads
    empty = np.zeros(0, np.float32)
    alibi = sink_a = empty
    if alibi_slopes is not None:
        C.check_dtype("alibi_slopes", alibi_slopes, (torch.float32,))
        C.check_shape("alibi_slopes", alibi_slopes, (hq,))
        alibi = C.as_numpy(C.as_torch(alibi_slopes).contiguous())
    if sinks is not None:
        C.check_dtype("sinks", sinks, (torch.float32, torch.bfloat16))
        C.check_shape("sinks", sinks, (hq,))
        sink_a = C.as_numpy(C.as_torch(sinks).float().contiguous())
    return Scores(
        scale=C.check_float("scale", scale, positive=True),
        causal=plan.causal,
        window=plan.sliding_window,
        softcap=C.check_float("softcap", softcap, low=0.0),
        alibi=alibi,
        has_alibi=alibi_slopes is not None,
        sinks=sink_a,
        has_sinks=sinks is not None,
        tiles=tile_witness(),
    )
