"""The public ops: validate, build the kernels' named inputs, dispatch."""

from dataclasses import dataclass

import numpy as np
import torch

from .. import _check as C
from .. import isa as nk_isa
from .._jit import jit
from .kernels import (
    CacheLayout,
    Heads,
    RowStrides,
    Scores,
    StepArrays,
    attention,
    cache_write,
    item,
    merge,
)
from .layout import cache_layout, cache_view, check_cache
from .plan import (
    AttentionPlan,
    check_block_table,
    check_config,
    check_slots,
    index_vector,
    plan_attention,
)


def _span(x, t_n, heads, d):
    """A ``[T, H, D]`` tensor with ``stride(-1) == 1`` as a 1-D NumPy array from its first
    element, and its (token, head) strides."""
    st = C.strides_of(x)
    span = C.as_torch(x).as_strided(((t_n - 1) * st[0] + (heads - 1) * st[1] + d,), (1,))
    return C.as_numpy(span), st[0], st[1]


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
    slots = check_slots(slot_mapping, t_n, nb * b)
    if t_n == 0:
        return
    kc, vc, layout = cache_layout(key_cache, value_cache, isa, False)
    k, k_token, k_head = _span(key, t_n, hkv, d)
    v, v_token, v_head = _span(value, t_n, hkv, d)
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
    bt = plan.table_for(block_table, nb)
    scores = _scores(plan, scale, softcap, alibi_slopes, sinks)
    if t_n == 0 or plan.items.shape[0] == 0:
        return
    kc, vc, layout = cache_layout(key_cache, value_cache, isa, True)
    q, q_token, q_head = _span(query, t_n, hq, d)
    out, o_token, o_head = _span(output, t_n, hq, d)
    rows = RowStrides(q_token, q_head, o_token, o_head)
    step = StepArrays(plan.items, plan.merges, plan.qsl, plan.seq_lens, bt, *plan.partial_buffers())
    attention(step, q, out, rows, kc, vc, layout, Heads(hq, hkv, d), scores)


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
        scale=float(scale),
        causal=plan.causal,
        window=plan.sliding_window,
        softcap=float(softcap),
        alibi=alibi,
        has_alibi=alibi_slopes is not None,
        sinks=sink_a,
        has_sinks=sinks is not None,
    )


# ---------------------------------------------------------------------------------------
# The engine's per-layer fast path and its fused calls of the kernels by position, as the
# committed engine uses them: removed when the engine runs numkern.decoder (which uses
# cache_view, the plan's step_arrays and the kernels' named inputs directly).


@dataclass(frozen=True, eq=False)
class StepIndices:
    """A step's indices as validated NumPy arrays, shared by every layer of the step.

    Built by :func:`step_indices`; ``query_start_loc``/``seq_lens``/``block_table``/
    ``slot_mapping`` as in :func:`paged_attention` and :func:`reshape_and_cache`.
    """

    plan: AttentionPlan
    qsl: np.ndarray  # [R+1] int64
    seq_lens: np.ndarray  # [R] int32
    block_table: np.ndarray  # [R, max_blocks] int32
    slots: np.ndarray  # [T] int64
    num_blocks: int


def step_indices(plan, query_start_loc, seq_lens, block_table, slot_mapping, num_blocks):
    """Validate a step's indices once (block table entries and slots against
    ``num_blocks``) for :class:`PagedLayerCache` calls with ``plan``."""
    nb = C.check_int("num_blocks", num_blocks, low=1)
    qsl = index_vector("query_start_loc", query_start_loc)
    sl = index_vector("seq_lens", seq_lens).astype(np.int32)
    if qsl.shape[0] != plan.num_requests + 1 or sl.shape[0] != plan.num_requests:
        raise ValueError(
            f"plan: built for {plan.num_requests} requests, used with query_start_loc "
            f"{list(qsl.shape)}, seq_lens {list(sl.shape)}"
        )
    bt = check_block_table(block_table, sl, plan.block_size, nb)
    slots = check_slots(slot_mapping, plan.num_tokens, nb * plan.block_size)
    return StepIndices(plan, qsl, sl, bt, slots, nb)


class PagedLayerCache:
    """One layer's KV cache (a ``kv_cache_shape`` tensor) validated once for ``isa``
    (:func:`cache_view`); ``write`` and ``attend`` check only the tensors that change per
    call, the indices come from :func:`step_indices`."""

    def __init__(self, kv_cache, isa):
        self.view = v = cache_view(kv_cache, isa)
        self.key_cache, self.value_cache = v.key_cache, v.value_cache
        self.num_blocks, self.hkv, self.d, self.isa = v.num_blocks, v.num_kv_heads, v.head_dim, isa
        self.b = v.layout.block_size
        self.dtype = v.dtype
        # what engine/models/decoder.py's _bind of the fused engine reads (before numkern.decoder)
        self.amx = v.layout.amx
        self._kw, self._vw, self._kr = v.kw, v.vw, v.kr
        self._kwb, self._kwh = v.layout.k_block, v.layout.k_head

    def _check(self, name, x, shape):
        ok = isinstance(x, torch.Tensor) and x.dtype == self.dtype and x.is_cpu
        if not (ok and tuple(x.shape) == shape and x.is_contiguous()):
            C.check_same_dtype(name, x, self.dtype, "the cache")
            C.check_shape(name, x, shape)
            C.check_contiguous(name, x)

    def _check_plan(self, plan, idx):
        want = (plan.num_kv_heads, plan.head_dim, plan.block_size, plan.isa, idx.num_blocks)
        if want != (self.hkv, self.d, self.b, self.isa, self.num_blocks):
            raise ValueError(
                f"plan: built for kv heads {plan.num_kv_heads}, head_dim {plan.head_dim}, "
                f"block {plan.block_size}, isa {plan.isa!r} and {idx.num_blocks} blocks; this "
                f"cache has {self.hkv}, {self.d}, {self.b}, {self.isa!r}, {self.num_blocks}"
            )

    def write(self, key, value, idx):
        """Write ``key``/``value [T, Hkv, D]`` (contiguous) at the step's slots."""
        self._check_plan(idx.plan, idx)
        t_n, hkv, d, v = idx.plan.num_tokens, self.hkv, self.d, self.view
        self._check("key", key, (t_n, hkv, d))
        self._check("value", value, (t_n, hkv, d))
        if t_n == 0:
            return
        k = C.as_numpy(key).reshape(-1)
        val = C.as_numpy(value).reshape(-1)
        heads = Heads(idx.plan.num_heads, hkv, d)
        cache_write(k, val, hkv * d, d, hkv * d, d, v.kw, v.vw, idx.slots, t_n, heads, v.layout)

    def attend(self, query, output, idx, *, scale, softcap=0.0, alibi_slopes=None, sinks=None):
        """``paged_attention`` of ``query [T, Hq, D]`` into ``output`` with the step's plan."""
        plan = idx.plan
        self._check_plan(plan, idx)
        t_n, hq, d, v = plan.num_tokens, plan.num_heads, self.d, self.view
        self._check("query", query, (t_n, hq, d))
        self._check("output", output, (t_n, hq, d))
        scores = _scores(plan, scale, softcap, alibi_slopes, sinks)
        if t_n == 0 or plan.items.shape[0] == 0:
            return
        arrays = (plan.items, plan.merges, idx.qsl, idx.seq_lens, idx.block_table)
        step = StepArrays(*arrays, *plan.partial_buffers())
        q = C.as_numpy(query).reshape(-1)
        out = C.as_numpy(output).reshape(-1)
        rows = RowStrides(hq * d, d, hq * d, d)
        attention(step, q, out, rows, v.kr, v.vr, v.layout, Heads(hq, self.hkv, d), scores)


# engine/fused.py's calls of the kernels, by position (before numkern.decoder)


@jit
def _reshape_and_cache(
    key, value, kc, vc, slots, t_n, hkv, d, b, k_ts, k_hs, v_ts, v_hs, kb_s, kh_s, vb_s, vh_s, amx
):
    layout = CacheLayout(b, kb_s, kh_s, vb_s, vh_s, 16 * b, amx)
    cache_write(key, value, k_ts, k_hs, v_ts, v_hs, kc, vc, slots, t_n, Heads(hkv, hkv, d), layout)


@jit
def _item(
    it,
    items,
    q,
    kc,
    vc,
    out,
    qsl,
    seq_lens,
    bt,
    part_m,
    part_l,
    part_acc,
    scale,
    causal,
    window,
    softcap,
    alibi,
    has_alibi,
    sinks,
    has_sinks,
    hq,
    hkv,
    d,
    b,
    q_ts,
    q_hs,
    o_ts,
    o_hs,
    kb_s,
    kh_s,
    vb_s,
    vh_s,
    v_cs,
    amx,
):
    step = StepArrays(items, items, qsl, seq_lens, bt, part_m, part_l, part_acc)
    scores = Scores(scale, causal, window, softcap, alibi, has_alibi, sinks, has_sinks)
    layout = CacheLayout(b, kb_s, kh_s, vb_s, vh_s, v_cs, amx)
    rows = RowStrides(q_ts, q_hs, o_ts, o_hs)
    item(it, step, q, out, rows, kc, vc, layout, Heads(hq, hkv, d), scores)


@jit
def _merge(
    mg, merges, out, qsl, part_m, part_l, part_acc, sinks, has_sinks, hq, hkv, d, o_ts, o_hs
):
    none = np.zeros(0, np.float32)
    step = StepArrays(
        merges,
        merges,
        qsl,
        np.zeros(0, np.int32),
        np.zeros((0, 0), np.int32),
        part_m,
        part_l,
        part_acc,
    )
    scores = Scores(1.0, True, -1, 0.0, none, False, sinks, has_sinks)
    merge(mg, step, out, RowStrides(0, 0, o_ts, o_hs), Heads(hq, hkv, d), scores)
