"""numkern's attention ops as torch custom ops (see ``_lib``; ``docs/kernels.md`` §12.3).

vLLM 0.32's three CPU attention ops under their names and schemas:

* ``cpu_attn_reshape_and_cache(key [T, Hkv, D], value [T, Hkv, D], key_cache!, value_cache!
  [num_blocks, Hkv, B, D] views, slot_mapping [T] int64, isa, k_scale, v_scale,
  kv_cache_dtype)`` -> :func:`numkern.attention.reshape_and_cache`;
* ``get_scheduler_metadata(num_req, num_heads_q, num_heads_kv, head_dim, seq_lens [R]
  int32, dtype, query_start_loc [R+1] int32, casual, window_size, isa_hint,
  enable_kv_split, dynamic_causal, kv_cache_dtype)`` -> int64 ``[L]``:
  :func:`numkern.attention.plan_attention`'s plan serialised
  (:mod:`numkern.attention.serial`). ``L`` depends on the values of ``seq_lens`` and
  ``query_start_loc``, so the fake returns a data-dependent size
  (``ctx.new_dynamic_size()``, an unbacked SymInt under ``torch.compile``/``export``);
* ``cpu_attention_with_kv_cache(query [T, Hq, D], key_cache, value_cache, output! [T, Hq,
  D], query_start_loc, seq_lens, scale, causal, alibi_slopes [Hq]?, sliding_window_size,
  block_table [R, max_blocks] int32, softcap, scheduler_metadata, s_aux [Hq]?,
  dynamic_causal, k_scale, v_scale, kv_cache_dtype)`` -> :func:`paged_attention` with the
  metadata's plan (``s_aux`` = sinks; the isa is the metadata's, as in vLLM).

Windows: vLLM's ``window_size`` / ``sliding_window_size`` and numkern's
``sliding_window`` are the same number (-1: none; a key j is visible from position p when
``p - j < W``). vLLM builds one metadata per KV-cache group with window -1 when its layers'
windows differ; a call with a window on such metadata re-plans with the call's window
(the only re-plan: any other mismatch between the metadata and the call is a ValueError).

Not implemented, so refused (ValueError naming the argument): ``k_scale``/``v_scale`` other
than 1, ``kv_cache_dtype`` other than ``"auto"`` and a ``dynamic_causal`` tensor. Inputs
that require grad (with grad mode on) are refused by the mutating ops' Autograd kernels
(``_lib.refuse_grad``: no backward exists; the write would silently drop the gradient).
"""

import numpy as np
import torch

from .. import _check as C
from .. import isa as nk_isa
from ..attention import paged_attention, plan_attention, reshape_and_cache
from ..attention.layout import check_cache
from ..attention.plan import check_config
from ..attention.serial import HEADER, plan_from_tensor, plan_to_tensor
from ._lib import define, dtype_of, refuse_grad

RESHAPE_AND_CACHE_SCHEMA = (
    "cpu_attn_reshape_and_cache(Tensor key, Tensor value, Tensor(a2!) key_cache, "
    "Tensor(a3!) value_cache, Tensor slot_mapping, str isa, float k_scale=1., "
    'float v_scale=1., str kv_cache_dtype="auto") -> ()'
)
SCHEDULER_METADATA_SCHEMA = (
    "get_scheduler_metadata(int num_req, int num_heads_q, int num_heads_kv, int head_dim, "
    "Tensor seq_lens, ScalarType dtype, Tensor query_start_loc, bool casual, int window_size, "
    "str isa_hint, bool enable_kv_split, Tensor? dynamic_causal, "
    'str kv_cache_dtype="auto") -> Tensor'
)
ATTENTION_SCHEMA = (
    "cpu_attention_with_kv_cache(Tensor query, Tensor key_cache, Tensor value_cache, "
    "Tensor(a3!) output, Tensor query_start_loc, Tensor seq_lens, float scale, bool causal, "
    "Tensor? alibi_slopes, SymInt sliding_window_size, Tensor block_table, float softcap, "
    "Tensor scheduler_metadata, Tensor? s_aux, Tensor? dynamic_causal, float k_scale=1., "
    'float v_scale=1., str kv_cache_dtype="auto") -> ()'
)


# ---------------------------------------------------------------------------------------
# checks shared by the kernels and the fakes


def _check_cpu(**tensors):
    for name, x in tensors.items():
        if x is not None and x.device.type != "cpu":
            raise TypeError(f"{name}: expected a CPU tensor, got device {x.device}")


def _check_unquantised(k_scale=1.0, v_scale=1.0, kv_cache_dtype="auto", dynamic_causal=None):
    """ValueError for what numkern does not implement: fp8 KV (scales, cache dtype) and a
    per-request causal tensor."""
    if kv_cache_dtype != "auto":
        raise ValueError(
            f"kv_cache_dtype: expected 'auto' (numkern keeps the cache in the model dtype), "
            f"got {kv_cache_dtype!r}"
        )
    for name, s in (("k_scale", k_scale), ("v_scale", v_scale)):
        if s != 1.0:
            raise ValueError(f"{name}: expected 1.0 (numkern has no quantised KV cache), got {s}")
    if dynamic_causal is not None:
        raise ValueError("dynamic_causal: expected None (numkern has no per-request causality)")


def _check_index(name, x, shape):
    C.check_dtype(name, x, (torch.int32,))
    C.check_shape(name, x, shape)


def _check_reshape_and_cache(key, value, key_cache, value_cache, slot_mapping, isa, scales):
    """What the fake can check of :func:`reshape_and_cache`: all but the slots' values."""
    _check_unquantised(*scales)
    _check_cpu(key=key, value=value, key_cache=key_cache, value_cache=value_cache)
    _check_cpu(slot_mapping=slot_mapping)
    nk_isa.attention_rule(isa)
    nb, hkv, b, d = check_cache("key_cache", key_cache, None, None, isa)
    check_cache("value_cache", value_cache, key_cache.dtype, (nb, hkv, b, d), isa)
    # the isa's rules on int sizes: a fake under dynamic shapes specialises the cache's
    # heads, block size and head dim (model constants); token counts stay symbolic
    check_config(int(hkv), int(hkv), int(d), int(b), -1, isa)
    for name, x in (("key", key), ("value", value)):
        C.check_same_dtype(name, x, key_cache.dtype, "the cache")
        C.check_ndim(name, x, (3,))
        C.check_inner_contiguous(name, x)
        C.check_shape(name, x, (key.shape[0], hkv, d))
    C.check_dtype("slot_mapping", slot_mapping, (torch.int64,))
    C.check_shape("slot_mapping", slot_mapping, (key.shape[0],))


_METADATA_ARGS = (
    "num_req", "num_heads_q", "num_heads_kv", "head_dim", "seq_lens", "dtype",
    "query_start_loc", "casual", "window_size", "isa_hint", "enable_kv_split",
    "dynamic_causal", "kv_cache_dtype",
)  # fmt: skip


def _check_metadata_args(args, kwargs):
    """``get_scheduler_metadata``'s arguments by name, checked: the plan's configuration
    (``block_size``: the isa's smallest; the metadata holds none, the attention call
    checks its cache's) and the index vectors' shapes. Returns ``(arguments, block)``."""
    a = {"kv_cache_dtype": "auto", **dict(zip(_METADATA_ARGS, args)), **kwargs}
    _check_unquantised(kv_cache_dtype=a["kv_cache_dtype"], dynamic_causal=a["dynamic_causal"])
    _check_cpu(seq_lens=a["seq_lens"], query_start_loc=a["query_start_loc"])
    isa, d = a["isa_hint"], a["head_dim"]
    block = nk_isa.attention_rule(isa).block_multiple
    check_config(a["num_heads_q"], a["num_heads_kv"], d, block, a["window_size"], isa)
    nk_isa.check_attention(isa, block_size=block, head_dim=d, dtype=a["dtype"])
    r_n = C.check_int("num_req", a["num_req"], low=0)
    _check_index("seq_lens", a["seq_lens"], (r_n,))
    _check_index("query_start_loc", a["query_start_loc"], (r_n + 1,))
    return a, block


def _check_attention(a):
    """What the fake can check of a :func:`paged_attention` call (``a``: the arguments by
    name): shapes and dtypes, not the indices' values nor the metadata's contents (the
    isa is in them: the cache dtype is checked against it by the kernel)."""
    _check_unquantised(a["k_scale"], a["v_scale"], a["kv_cache_dtype"], a["dynamic_causal"])
    names = ("query", "key_cache", "value_cache", "output", "query_start_loc", "seq_lens")
    names += ("alibi_slopes", "block_table", "scheduler_metadata", "s_aux")
    _check_cpu(**{n: a[n] for n in names})
    q = a["query"]
    C.check_dtype("query", q, C.FLOATS)
    C.check_ndim("query", q, (3,))
    C.check_inner_contiguous("query", q)
    t_n, hq, d = q.shape
    nb, hkv, b, dk = check_cache("key_cache", a["key_cache"], q.dtype, None, "vec")
    check_cache("value_cache", a["value_cache"], q.dtype, (nb, hkv, b, dk), "vec")
    if dk != d:
        raise ValueError(f"key_cache: expected head_dim {d} (that of query), got {dk}")
    C.check_same_dtype("output", a["output"], q.dtype, "query")
    C.check_shape("output", a["output"], (t_n, hq, d))
    C.check_inner_contiguous("output", a["output"])
    C.check_ndim("seq_lens", a["seq_lens"], (1,))
    r_n = a["seq_lens"].shape[0]
    _check_index("seq_lens", a["seq_lens"], (r_n,))
    _check_index("query_start_loc", a["query_start_loc"], (r_n + 1,))
    C.check_dtype("block_table", a["block_table"], (torch.int32,))
    C.check_ndim("block_table", a["block_table"], (2,))
    C.check_dtype("scheduler_metadata", a["scheduler_metadata"], (torch.int64,))
    C.check_ndim("scheduler_metadata", a["scheduler_metadata"], (1,))
    if a["alibi_slopes"] is not None:
        C.check_dtype("alibi_slopes", a["alibi_slopes"], (torch.float32,))
        C.check_shape("alibi_slopes", a["alibi_slopes"], (hq,))
    if a["s_aux"] is not None:
        C.check_dtype("s_aux", a["s_aux"], (torch.float32, torch.bfloat16))
        C.check_shape("s_aux", a["s_aux"], (hq,))
    w = a["sliding_window_size"]
    if w == 0 or w < -1:
        raise ValueError(f"sliding_window_size: expected -1 (none) or >= 1, got {w}")
    return b


# ---------------------------------------------------------------------------------------
# cpu_attn_reshape_and_cache


def _reshape_and_cache(
    key,
    value,
    key_cache,
    value_cache,
    slot_mapping,
    isa,
    k_scale=1.0,
    v_scale=1.0,
    kv_cache_dtype="auto",
):
    _check_unquantised(k_scale, v_scale, kv_cache_dtype)
    reshape_and_cache(key, value, key_cache, value_cache, slot_mapping, isa)


def _reshape_and_cache_fake(
    key,
    value,
    key_cache,
    value_cache,
    slot_mapping,
    isa,
    k_scale=1.0,
    v_scale=1.0,
    kv_cache_dtype="auto",
):
    scales = (k_scale, v_scale, kv_cache_dtype)
    _check_reshape_and_cache(key, value, key_cache, value_cache, slot_mapping, isa, scales)


cpu_attn_reshape_and_cache = define(
    RESHAPE_AND_CACHE_SCHEMA, impl=_reshape_and_cache, fake=_reshape_and_cache_fake
)
refuse_grad(cpu_attn_reshape_and_cache.default)


# ---------------------------------------------------------------------------------------
# get_scheduler_metadata


def _get_scheduler_metadata(*args, **kwargs):
    a, block = _check_metadata_args(args, kwargs)
    plan = plan_attention(
        a["query_start_loc"],
        a["seq_lens"],
        num_heads=a["num_heads_q"],
        num_kv_heads=a["num_heads_kv"],
        head_dim=a["head_dim"],
        block_size=block,
        causal=a["casual"],
        sliding_window=a["window_size"],
        isa=a["isa_hint"],
        num_threads=None if a["enable_kv_split"] else 0,  # a split target of 0: no split
    )
    return plan_to_tensor(plan, a["dtype"])


def _get_scheduler_metadata_fake(*args, **kwargs):
    a, _ = _check_metadata_args(args, kwargs)
    # the plan's item count depends on the values of seq_lens and query_start_loc
    size = torch.library.get_ctx().new_dynamic_size(min=HEADER)
    return a["seq_lens"].new_empty((size,), dtype=torch.int64)


get_scheduler_metadata = define(
    SCHEDULER_METADATA_SCHEMA, impl=_get_scheduler_metadata, fake=_get_scheduler_metadata_fake
)


# ---------------------------------------------------------------------------------------
# plan_attention: numkern's planning function under its name, the plan serialised as
# get_scheduler_metadata's (read by cpu_attention_with_kv_cache and decoder_run)


def _plan_args(qsl, seq_lens, kw):
    """The checks :func:`plan_attention` makes that a fake can (not the index values) on
    the op's arguments (``kw``: the keyword ones), and the dtype the plan is for."""
    _check_cpu(query_start_loc=qsl, seq_lens=seq_lens)
    hd = (kw["num_heads"], kw["num_kv_heads"], kw["head_dim"], kw["block_size"])
    check_config(*hd, kw.get("sliding_window", -1), kw["isa"])
    dt = dtype_of("dtype", kw["dtype"])
    nk_isa.check_attention(kw["isa"], block_size=hd[3], head_dim=hd[2], dtype=dt)
    C.check_ndim("seq_lens", seq_lens, (1,))
    _check_index("seq_lens", seq_lens, (seq_lens.shape[0],))
    _check_index("query_start_loc", qsl, (seq_lens.shape[0] + 1,))
    return dt


def _plan_attention(query_start_loc, seq_lens, **kw):
    dt = _plan_args(query_start_loc, seq_lens, kw)
    del kw["dtype"]  # plan_attention's own keywords remain
    return plan_to_tensor(plan_attention(query_start_loc, seq_lens, **kw), dt)


def _plan_attention_fake(query_start_loc, seq_lens, **kw):
    _plan_args(query_start_loc, seq_lens, kw)
    size = torch.library.get_ctx().new_dynamic_size(min=HEADER)  # (see the metadata's fake)
    return seq_lens.new_empty((size,), dtype=torch.int64)


plan_attention_op = define(
    "plan_attention(Tensor query_start_loc, Tensor seq_lens, *, int num_heads, "
    "int num_kv_heads, int head_dim, int block_size, bool causal=True, "
    "int sliding_window=-1, str isa, str dtype, int? num_threads=None) -> Tensor",
    impl=_plan_attention,
    fake=_plan_attention_fake,
)


# ---------------------------------------------------------------------------------------
# cpu_attention_with_kv_cache

_ATTENTION_ARGS = (
    "query",
    "key_cache",
    "value_cache",
    "output",
    "query_start_loc",
    "seq_lens",
    "scale",
    "causal",
    "alibi_slopes",
    "sliding_window_size",
    "block_table",
    "softcap",
    "scheduler_metadata",
    "s_aux",
    "dynamic_causal",
    "k_scale",
    "v_scale",
    "kv_cache_dtype",
)
_ATTENTION_DEFAULTS = {"k_scale": 1.0, "v_scale": 1.0, "kv_cache_dtype": "auto"}


def _named(args, kwargs):
    """The arguments of a call by name (the dispatcher may pass defaults or not)."""
    return {**_ATTENTION_DEFAULTS, **dict(zip(_ATTENTION_ARGS, args)), **kwargs}


def _metadata_plan(a, block_size):
    """The plan of ``a["scheduler_metadata"]``, checked against the call: ValueError when
    it was built for another configuration, dtype or request layout."""
    plan, dtype = plan_from_tensor(a["scheduler_metadata"], block_size=block_size)
    q = a["query"]
    if dtype != q.dtype:
        raise ValueError(
            f"scheduler_metadata: built for dtype {C.dtype_name(dtype)}, used with a "
            f"{C.dtype_name(q.dtype)} query"
        )
    same = tuple(a["seq_lens"].shape) == (plan.num_requests,)
    same = same and np.array_equal(C.as_numpy(a["seq_lens"]), plan.seq_lens)
    same = same and np.array_equal(C.as_numpy(a["query_start_loc"]), plan.qsl)
    if not same:
        raise ValueError(
            f"scheduler_metadata: built for other query_start_loc/seq_lens (R = "
            f"{plan.num_requests}, T = {plan.num_tokens}) than this call's (R = "
            f"{a['seq_lens'].shape[0]})"
        )
    window = a["sliding_window_size"]
    if plan.sliding_window == -1 and window != -1 and plan.causal == bool(a["causal"]):
        # vLLM's group metadata (window -1: the group's layers differ) used by a layer
        # with a window: the plan for this layer's window
        plan = plan_attention(
            a["query_start_loc"],
            a["seq_lens"],
            num_heads=plan.num_heads,
            num_kv_heads=plan.num_kv_heads,
            head_dim=plan.head_dim,
            block_size=block_size,
            causal=plan.causal,
            sliding_window=window,
            isa=plan.isa,
        )
    return plan


def _attention(*args, **kwargs):
    a = _named(args, kwargs)
    _check_unquantised(a["k_scale"], a["v_scale"], a["kv_cache_dtype"], a["dynamic_causal"])
    _check_index("seq_lens", a["seq_lens"], (a["seq_lens"].shape[0],))
    _check_index("query_start_loc", a["query_start_loc"], (a["seq_lens"].shape[0] + 1,))
    C.check_ndim("key_cache", a["key_cache"], (4,))
    plan = _metadata_plan(a, a["key_cache"].shape[2])
    paged_attention(
        a["query"],
        a["key_cache"],
        a["value_cache"],
        a["output"],
        a["query_start_loc"],
        a["seq_lens"],
        a["block_table"],
        scale=a["scale"],
        causal=a["causal"],
        sliding_window=a["sliding_window_size"],
        softcap=a["softcap"],
        alibi_slopes=a["alibi_slopes"],
        sinks=a["s_aux"],
        isa=plan.isa,
        plan=plan,
    )


def _attention_fake(*args, **kwargs):
    _check_attention(_named(args, kwargs))


cpu_attention_with_kv_cache = define(ATTENTION_SCHEMA, impl=_attention, fake=_attention_fake)
refuse_grad(cpu_attention_with_kv_cache.default)
