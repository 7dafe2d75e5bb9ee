"""The decoder run as a torch custom op (see ``_lib`` and docs/kernels.md, "The decoder
run" under "Torch custom ops").

``decoder_run`` runs :meth:`numkern.decoder.DecoderStack.prepare`, then ``run``, on a
stack registered under a name (:func:`register_stack`), as vLLM's attention ops find
their layer by name: the stack's weights are constants of the model, bound once, and a
schema of tensors, lists of tensors, ints and strings cannot carry them. What a step
changes is passed in: the residual stream (written), every attention layer's KV cache
(written: the run writes the caches it is handed, so a functionalised graph's copies are
what it writes), one ``scheduler_metadata`` (``get_scheduler_metadata``'s plan) with its
block table and slot mapping per KV-cache group, the positions and the rotary tables.

It returns the normed rows ``[T, H]`` the run hands to an op outside (``DecoderStack.run``'s
non-None return), or an empty ``[0, H]`` tensor when the run hands off nothing (a custom op
that writes its inputs may return tensors, not an optional one nor a list).
"""

import weakref

import torch

from .. import _check as C
from ..attention import cache_view, with_tables
from ..attention.serial import plan_from_tensor
from ..decoder import DecoderStack
from ._lib import define, refuse_grad

_STACKS = weakref.WeakValueDictionary()  # name -> DecoderStack


def register_stack(name, stack):
    """Make ``stack`` (a :class:`DecoderStack`) the one ``decoder_run(name, ...)`` runs and
    return ``name``. The registry holds a weak reference: keep the stack alive while
    graphs that name it run. A name is bound to one stack while that stack lives
    (ValueError for another); registering the same stack again is a no-op."""
    if not isinstance(name, str) or not name:
        raise TypeError(f"name: expected a non-empty str, got {name!r:.60}")
    if not isinstance(stack, DecoderStack):
        raise TypeError(f"stack: expected a numkern.decoder.DecoderStack, got {type(stack)}")
    held = _STACKS.get(name)
    if held is not None and held is not stack:
        raise ValueError(f"name: {name!r} already names another live DecoderStack")
    _STACKS[name] = stack
    return name


def _stack(name):
    stack = _STACKS.get(name)
    if stack is None:
        raise ValueError(
            f"stack: expected the name of a registered DecoderStack "
            f"(numkern.torch_ops.register_stack), got {name!r}"
        )
    return stack


def _attention_layers(stack):
    return [i for i, g in enumerate(stack.kv_groups) if g is not None]


def _check_list(name, xs, n):
    if len(xs) != n:
        raise ValueError(f"{name}: expected {n} tensors, got {len(xs)}")


def _check_cpu(name, x):
    if x.device.type != "cpu":
        raise TypeError(f"{name}: expected a CPU tensor, got device {x.device}")


def _check_run(a):
    """What the fake can check of a call (``a``: the arguments by name): shapes, dtypes
    and devices, the run's layers and the lists' lengths, not index values nor the
    metadata's contents. Returns the stack."""
    stack = _stack(a["stack"])
    l0, l1 = stack._layers((a["l0"], a["l1"]))[:2]
    dt, hid, n_g = stack.dtype, stack.hidden_size, len(stack.isas)
    hidden = a["hidden"]
    _check_cpu("hidden", hidden)
    C.check_same_dtype("hidden", hidden, dt, "the stack")
    C.check_ndim("hidden", hidden, (2,))
    t_n = hidden.shape[0]
    C.check_shape("hidden", hidden, (t_n, hid))
    C.check_contiguous("hidden", hidden)
    attention = _attention_layers(stack)
    _check_list("kv_caches", a["kv_caches"], len(attention))
    for j, (i, kv) in enumerate(zip(attention, a["kv_caches"])):
        name = f"kv_caches[{j}]"
        _check_cpu(name, kv)
        C.check_same_dtype(name, kv, dt, "the stack")
        k = stack.caches[i].key_cache
        C.check_shape(name, kv, (*k.shape[:3], 2 * k.shape[3]))
        C.check_contiguous(name, kv)
    for name in ("scheduler_metadata", "block_table", "slot_mapping"):
        _check_list(name, a[name], n_g)
    for g in range(n_g):
        for name, dtype, ndim in (
            ("scheduler_metadata", torch.int64, 1),
            ("block_table", torch.int32, 2),
            ("slot_mapping", torch.int64, 1),
        ):
            x = a[name][g]
            _check_cpu(f"{name}[{g}]", x)
            C.check_dtype(f"{name}[{g}]", x, (dtype,))
            C.check_ndim(f"{name}[{g}]", x, (ndim,))
        C.check_shape(f"slot_mapping[{g}]", a["slot_mapping"][g], (t_n,))
    positions = a["positions"]
    _check_cpu("positions", positions)
    C.check_dtype("positions", positions, (torch.int64,))
    C.check_shape("positions", positions, (t_n,))
    tables = a["cos_sin_cache"]
    if len(tables) not in (1, n_g):
        raise ValueError(f"cos_sin_cache: expected 1 or {n_g} tensors, got {len(tables)}")
    for g, cs in enumerate(tables):
        _check_cpu(f"cos_sin_cache[{g}]", cs)
        C.check_dtype(f"cos_sin_cache[{g}]", cs, (torch.float32,))
        C.check_ndim(f"cos_sin_cache[{g}]", cs, (2,))
        C.check_contiguous(f"cos_sin_cache[{g}]", cs)
    if a["residual_add"] is not None:
        _check_cpu("residual_add", a["residual_add"])
        C.check_same_dtype("residual_add", a["residual_add"], dt, "the stack")
        C.check_shape("residual_add", a["residual_add"], (t_n, hid))
    rows, logits = a["logits_rows"], a["logits"]
    if rows is None and logits is not None:
        raise ValueError("logits: given without logits_rows")
    if rows is not None:
        if l1 != stack.num_layers or (l1 > l0 and not stack.dense[l1 - 1]):
            raise ValueError(
                f"logits_rows: the head runs after the last layer, once its MLP has run; "
                f"this run ends at layer {l1} of {stack.num_layers}"
            )
        _check_cpu("logits_rows", rows)
        C.check_dtype("logits_rows", rows, (torch.int64,))
        C.check_ndim("logits_rows", rows, (1,))
        if logits is None:
            raise TypeError("logits: expected an fp32 tensor [R, vocab] with logits_rows")
        _check_cpu("logits", logits)
        C.check_dtype("logits", logits, (torch.float32,))
        C.check_shape("logits", logits, (rows.shape[0], stack.vocab_size))
    return stack


_ARGS = (
    "stack",
    "hidden",
    "kv_caches",
    "scheduler_metadata",
    "block_table",
    "slot_mapping",
    "positions",
    "cos_sin_cache",
    "l0",
    "l1",
    "residual_add",
    "logits_rows",
    "logits",
)
_DEFAULTS = {"residual_add": None, "logits_rows": None, "logits": None}


def _named(args, kwargs):
    return {**_DEFAULTS, **dict(zip(_ARGS, args)), **kwargs}


def _decoder_run(*args, **kwargs):
    a = _named(args, kwargs)
    stack = _check_run(a)
    layers = _attention_layers(stack)
    caches = None  # the stack's own (the common eager call): no views to build
    if any(kv.data_ptr() != stack.caches[i].key_cache.data_ptr() for i, kv in
           zip(layers, a["kv_caches"])):  # fmt: skip
        caches = [None] * stack.num_layers
        for i, kv in zip(layers, a["kv_caches"]):
            caches[i] = cache_view(kv, stack.caches[i].isa)
    plans = []
    for g in range(len(stack.isas)):
        first = stack.caches[stack.kv_groups.index(g)]
        plan, dtype = plan_from_tensor(
            a["scheduler_metadata"][g], block_size=first.layout.block_size
        )
        if dtype != stack.dtype:
            raise ValueError(
                f"scheduler_metadata[{g}]: built for dtype {C.dtype_name(dtype)}, the stack's "
                f"is {C.dtype_name(stack.dtype)}"
            )
        bt, slots = a["block_table"][g], a["slot_mapping"][g]
        plans.append(with_tables(plan, bt, slots, first.num_blocks))
    tables = tuple(cs.numpy() for cs in a["cos_sin_cache"])
    # a call is one run: its plans are made here, so its step is prepared here too
    step = stack.prepare(tuple(plans), a["positions"], tables[0] if len(tables) == 1 else tables)
    out = stack.run(
        step,
        a["hidden"],
        layers=(a["l0"], a["l1"]),
        residual_add=a["residual_add"],
        logits_rows=a["logits_rows"],
        logits=a["logits"],
        caches=caches,
    )
    return a["hidden"].new_empty((0, stack.hidden_size)) if out is None else out


def _decoder_run_fake(*args, **kwargs):
    a = _named(args, kwargs)
    stack = _check_run(a)
    rows = a["hidden"].shape[0] if stack.hands_off(a["l0"], a["l1"]) else 0
    return a["hidden"].new_empty((rows, stack.hidden_size))


decoder_run = define(
    "decoder_run(str stack, Tensor(a!) hidden, Tensor(b!)[] kv_caches, "
    "Tensor[] scheduler_metadata, Tensor[] block_table, Tensor[] slot_mapping, "
    "Tensor positions, Tensor[] cos_sin_cache, int l0, int l1, Tensor? residual_add=None, "
    "Tensor? logits_rows=None, Tensor(c!)? logits=None) -> Tensor",
    impl=_decoder_run,
    fake=_decoder_run_fake,
)
refuse_grad(decoder_run)

__all__ = ["decoder_run", "register_stack"]
