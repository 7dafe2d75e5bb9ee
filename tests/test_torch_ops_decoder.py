"""``torch.ops.numkern.decoder_run`` (docs/kernels.md §12.5) against the direct
``DecoderStack.run`` on the same stack and inputs: bit-equal logits, hand-off rows and KV
caches, through the op, ``opcheck``, ``torch.compile(fullgraph=True)`` (eager,
aot_eager, inductor), ``torch.export`` and a cold child process; and its refusals.

The stack is test_decoder's (dense, MLP outside, dense; one or two KV-cache groups); the
op runs on caches of its own (clones of the stack's), as a functionalised graph does.
"""

import pytest
import torch

import numkern.torch_ops  # noqa: F401  (defines torch.ops.numkern.*)
from numkern import attention as A
from numkern.torch_ops import register_stack

from .conftest import run_child
from .test_decoder import (
    HKV,
    HQ,
    STEPS,
    TABLE,
    VOCAB,
    D,
    _caches,
    _cos_sin,
    _forward,
    _lin,
    _plan,
    _slots,
    _stack,
    _weights,
)
from .test_torch_ops_attention import has_cxx

OPS = torch.ops.numkern
N_BLOCKS = 8


def build(dt, *, qk_norm=True, bias=False, name="t_decoder"):
    """(stack, its name, the MLP stand-in): the stack kept alive by the caller."""
    layers, fnorm, head, outside = _weights(dt, qk_norm=qk_norm, bias=bias)
    stack = _stack(layers, fnorm, head, _caches(dt), "vec")
    return stack, register_stack(name, stack), outside


def step_inputs(dt, si, seed=0):
    """Step ``si`` of test_decoder's STEPS: (hidden, positions, rows, block table, slots,
    query_start_loc, seq_lens)."""
    qsl, sl, reqs, positions, rows = STEPS[si]
    slots = [s for r, _, n in reqs for s in _slots(r, positions[qsl[r] : qsl[r] + n])]
    g = torch.Generator().manual_seed(seed + si)
    h = (torch.randn(len(positions), 64, generator=g) * 0.5).to(dt)
    return (
        h,
        torch.tensor(positions, dtype=torch.int64),
        torch.tensor(rows, dtype=torch.int64),
        torch.tensor(TABLE, dtype=torch.int32),
        torch.tensor(slots, dtype=torch.int64),
        torch.tensor(qsl, dtype=torch.int32),
        torch.tensor(sl, dtype=torch.int32),
    )


def metadata(dt, qsl, sl):
    return OPS.get_scheduler_metadata(
        sl.shape[0], HQ, HKV, D, sl, dt, qsl, True, -1, "vec", True, None
    )


def op_forward(name, runs, n_layers, outside, h, kv, meta, bt, slots, pos, cs, rows):
    """The engine's loop through the op: the runs, the MLP stand-in between them, the
    head with the last run. ``h`` and ``kv`` are written."""
    logits = torch.empty(rows.shape[0], VOCAB)
    add = None
    for l0, l1, after, _ in runs:
        head = (rows, logits) if after is None and l1 == n_layers else (None, None)
        out = OPS.decoder_run(name, h, kv, [meta], [bt], [slots], pos, [cs], l0, l1, add, *head)
        assert out.shape[0] == (h.shape[0] if after is not None else 0)
        add = _lin(out, outside, None, h.dtype) if after == "mlp" else None
    return logits


def same(a, b):
    """Bit-equal, NaN where NaN (the caches' unwritten slots)."""
    torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize(
    "dtype, qk_norm, bias", [(torch.float32, True, False), (torch.bfloat16, False, True)]
)
def test_op_equals_the_direct_run(dtype, qk_norm, bias):
    stack, name, outside = build(dtype, qk_norm=qk_norm, bias=bias)
    kv = [c.clone() for c in _caches(dtype)]  # the op's own caches (NaN, as the stack's)
    bound = [A.split_kv_cache(c)[0] for c in kv]
    cs = _cos_sin(64)
    for si in range(len(STEPS)):
        h, pos, rows, bt, slots, qsl, sl = step_inputs(dtype, si)
        plan = _plan(qsl.tolist(), sl.tolist(), TABLE, slots.tolist(), "vec")
        want = _forward(stack, outside, h, plan, pos, cs, rows)
        meta = metadata(dtype, qsl, sl)
        h_op = h.clone()
        got = op_forward(
            name, stack.runs, stack.num_layers, outside, h_op, kv, meta, bt, slots, pos,
            torch.from_numpy(cs), rows,
        )  # fmt: skip
        same(got, want)
        for c, cv in zip(bound, stack.caches):
            same(c, cv.key_cache)  # the op wrote its caches as the run wrote the stack's


def test_op_on_the_stacks_own_caches():
    """The common eager call hands the op the stack's own cache tensors: the same writes
    as the direct run of a twin stack."""
    dt = torch.bfloat16
    layers, fnorm, head, outside = _weights(dt, qk_norm=True, bias=True)
    mine, twin = _caches(dt), _caches(dt)
    stack = _stack(layers, fnorm, head, mine, "vec")
    name = register_stack("t_decoder_own", stack)
    ref = _stack(layers, fnorm, head, twin, "vec")
    cs = _cos_sin(64)
    for si in range(len(STEPS)):
        h, pos, rows, bt, slots, qsl, sl = step_inputs(dt, si)
        plan = _plan(qsl.tolist(), sl.tolist(), TABLE, slots.tolist(), "vec")
        want = _forward(ref, outside, h, plan, pos, cs, rows)
        got = op_forward(
            name, stack.runs, stack.num_layers, outside, h.clone(), mine,
            metadata(dt, qsl, sl), bt, slots, pos, torch.from_numpy(cs), rows,
        )  # fmt: skip
        same(got, want)
    for a, b in zip(mine, twin):
        same(a, b)


def test_opcheck():
    dt = torch.float32
    stack, name, _ = build(dt)
    h, pos, rows, bt, slots, qsl, sl = step_inputs(dt, 0)
    meta = metadata(dt, qsl, sl)
    cs = torch.from_numpy(_cos_sin(64))
    for (l0, l1, _after, _), head in zip(stack.runs, (False, True)):
        kv = [torch.zeros(A.kv_cache_shape(N_BLOCKS, HKV, 32, D), dtype=dt) for _ in range(3)]
        extra = (None, rows, torch.empty(rows.shape[0], VOCAB)) if head else (h.clone(),)
        args = (name, h.clone(), kv, [meta], [bt], [slots], pos, [cs], l0, l1, *extra)
        torch.library.opcheck(OPS.decoder_run.default, args)


def test_two_kv_cache_groups():
    """Layers 0 and 2 in group 0 (vec, blocks of 32, window 8), layer 1 in group 1
    (vec16, blocks of 16): one metadata, table and slot mapping per group."""
    dt = torch.bfloat16
    layers, fnorm, head, outside = _weights(dt, qk_norm=True, bias=False, seed=3)
    groups, isas, sizes, windows = [0, 1, 0], ("vec", "vec16"), (32, 16), (8, -1)
    caches = [torch.full(A.kv_cache_shape(8, HKV, sizes[g], D), float("nan"), dtype=dt)
              for g in groups]  # fmt: skip
    views = [A.cache_view(kv, isas[g]) for kv, g in zip(caches, groups)]
    from numkern.decoder import DecoderStack

    from .test_decoder import EPS, _layer_weights, _pack

    kw = dict(num_heads=HQ, num_kv_heads=HKV, head_dim=D, eps=EPS, kv_groups=groups)
    stack = DecoderStack(_layer_weights(layers), views, final_norm=fnorm, lm_head=_pack(head), **kw)
    name = register_stack("t_decoder_groups", stack)
    kv = [c.clone() for c in caches]
    qsl, sl = torch.tensor([0, 5, 75], dtype=torch.int32), torch.tensor([5, 70], dtype=torch.int32)
    positions = [*range(5), *range(70)]
    tables = ([[3, 0, 5], [6, 1, 2]], [[7, 0, 1, 2, 3], [4, 5, 6, 3, 2]])
    plans, metas, bts, slot_maps = [], [], [], []
    for g in (0, 1):
        b, bt = sizes[g], tables[g]
        req = [0] * 5 + [1] * 70
        slots = torch.tensor([bt[r][p // b] * b + p % b for r, p in zip(req, positions)])
        bt = torch.tensor(bt, dtype=torch.int32)
        heads = dict(num_heads=HQ, num_kv_heads=HKV, head_dim=D, isa=isas[g])
        plans.append(A.plan_attention(
            qsl, sl, **heads, block_size=b, sliding_window=windows[g], block_table=bt,
            slot_mapping=slots, num_blocks=8,
        ))  # fmt: skip
        metas.append(OPS.get_scheduler_metadata(
            2, HQ, HKV, D, sl, dt, qsl, True, windows[g], isas[g], True, None
        ))  # fmt: skip
        bts.append(bt)
        slot_maps.append(slots)
    pos = torch.tensor(positions, dtype=torch.int64)
    h = (torch.randn(75, 64, generator=torch.Generator().manual_seed(4)) * 0.5).to(dt)
    rows = torch.tensor([4, 74])
    cs = _cos_sin(128)
    want = _forward(stack, outside, h, tuple(plans), pos, cs, rows)
    logits, add, h_op = torch.empty(2, VOCAB), None, h.clone()
    for l0, l1, after, _ in stack.runs:
        head = (rows, logits) if l1 == 3 else (None, None)
        out = OPS.decoder_run(
            name, h_op, kv, metas, bts, slot_maps, pos, [torch.from_numpy(cs)], l0, l1, add, *head
        )
        add = _lin(out, outside, None, dt) if after == "mlp" else None
    same(logits, want)
    for c, cv in zip(kv, stack.caches):
        same(A.split_kv_cache(c)[0], cv.key_cache)
    with pytest.raises(ValueError, match="scheduler_metadata: expected 2 tensors, got 1"):
        OPS.decoder_run(name, h_op, kv, metas[:1], bts, slot_maps, pos, [torch.from_numpy(cs)],
                        0, 1)  # fmt: skip


# ---------------------------------------------------------------------------------------
# torch.compile and torch.export


def compile_case(dt=torch.bfloat16, name="t_decoder_compile"):
    """(stack, outside, function of the step, its inputs): step 0 of STEPS, the metadata
    computed inside the compiled region."""
    stack, name, outside = build(dt, name=name)
    runs, n = stack.runs, stack.num_layers

    def fn(h, kv, bt, slots, pos, cs, rows, qsl, sl):
        meta = metadata(h.dtype, qsl, sl)
        return op_forward(name, runs, n, outside, h, kv, meta, bt, slots, pos, cs, rows)

    h, pos, rows, bt, slots, qsl, sl = step_inputs(dt, 0)
    kv = [torch.zeros(A.kv_cache_shape(N_BLOCKS, HKV, 32, D), dtype=dt) for _ in range(3)]
    cs = torch.from_numpy(_cos_sin(64))
    return stack, fn, (h, kv, bt, slots, pos, cs, rows, qsl, sl)


def clone_inputs(inputs):
    return tuple([t.clone() for t in x] if isinstance(x, list) else x.clone() for x in inputs)


# importing inductor imports torch.utils.mkldnn, which warns (filterwarnings = error)
@pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")
@pytest.mark.parametrize("backend", ["eager", "aot_eager", "inductor"])
def test_compile_fullgraph(backend):
    if backend == "inductor" and not has_cxx():
        pytest.skip("inductor needs a C++ compiler (none on PATH)")
    _stack_alive, fn, inputs = compile_case()
    eager_in = clone_inputs(inputs)
    want = fn(*eager_in)
    torch._dynamo.reset()
    got = torch.compile(fn, fullgraph=True, backend=backend)(*inputs)
    same(got, want)
    same(inputs[0], eager_in[0])  # the residual stream written through the graph
    for a, b in zip(inputs[1], eager_in[1]):
        same(a, b)  # and every KV cache


class _Step(torch.nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, h, kv, bt, slots, pos, cs, rows, qsl, sl):
        return self.fn(h, kv, bt, slots, pos, cs, rows, qsl, sl)


def test_export_runs_from_the_exported_program():
    _stack_alive, fn, inputs = compile_case(name="t_decoder_export")
    ep = torch.export.export(_Step(fn), clone_inputs(inputs))
    eager_in = clone_inputs(inputs)
    want = fn(*eager_in)
    got = ep.module()(*inputs)
    same(got, want)
    for a, b in zip(inputs[1], eager_in[1]):
        same(a, b)


def test_compile_cold_in_a_child():
    out = run_child(
        "import torch\n"
        "from tests.test_torch_ops_decoder import clone_inputs, compile_case, same\n"
        "stack, fn, inputs = compile_case()\n"
        "eager_in = clone_inputs(inputs)\n"
        "f = torch.compile(fn, fullgraph=True, backend='aot_eager')\n"
        "got = f(*inputs)\n"
        "same(got, fn(*eager_in))\n"
        "[same(a, b) for a, b in zip(inputs[1], eager_in[1])]\n"
        "print('ok')\n"
    )
    assert out.strip().endswith("ok")


# ---------------------------------------------------------------------------------------
# refusals


def test_refusals():
    dt = torch.float32
    stack, name, _ = build(dt, name="t_decoder_refusals")
    h, pos, _rows, bt, slots, qsl, sl = step_inputs(dt, 0)
    meta = metadata(dt, qsl, sl)
    cs = torch.from_numpy(_cos_sin(64))
    kv = [torch.zeros(A.kv_cache_shape(N_BLOCKS, HKV, 32, D), dtype=dt) for _ in range(3)]

    def call(**over):
        a = dict(stack=name, hidden=h.clone(), kv_caches=kv, scheduler_metadata=[meta],
                 block_table=[bt], slot_mapping=[slots], positions=pos, cos_sin_cache=[cs],
                 l0=0, l1=2)  # fmt: skip
        a.update(over)
        return OPS.decoder_run(*a.values())

    with pytest.raises(ValueError, match="stack: expected the name of a registered"):
        call(stack="nope")
    with pytest.raises(ValueError, match="kv_caches: expected 3 tensors, got 2"):
        call(kv_caches=kv[:2])
    with pytest.raises(ValueError, match=r"kv_caches\[1\]: expected shape"):
        call(kv_caches=[kv[0], kv[1][:4], kv[2]])
    with pytest.raises(TypeError, match="hidden: expected dtype float32"):
        call(hidden=h.to(torch.bfloat16))
    with pytest.raises(ValueError, match="layers: every layer but the last"):
        call(l0=0, l1=3)
    with pytest.raises(ValueError, match=r"scheduler_metadata\[0\]: built for dtype bfloat16"):
        call(scheduler_metadata=[metadata(torch.bfloat16, qsl, sl)])
    bad = bt.clone()
    bad[0, 0] = N_BLOCKS  # past the cache
    with pytest.raises(ValueError, match="block_table"):
        call(block_table=[bad])
    with pytest.raises(ValueError, match="slot_mapping"):
        call(slot_mapping=[slots + N_BLOCKS * 32])
    with pytest.raises(TypeError, match=r"hidden: .*requires_grad=True"):
        call(hidden=h.clone().requires_grad_())
    with pytest.raises(ValueError, match="name: 't_decoder_refusals' already names"):
        register_stack(name, build(dt, name="t_decoder_other")[0])
    assert register_stack(name, stack) == name  # the same stack again: a no-op
    with pytest.raises(TypeError, match="plan: expected an AttentionPlan"):
        A.with_tables(meta, bt, slots, N_BLOCKS)
    with pytest.raises(TypeError, match=r"stack: expected a numkern\.decoder\.DecoderStack"):
        register_stack("x", object())
