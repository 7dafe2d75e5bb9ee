"""torch.ops.numkern's MoE ops (numkern.torch_ops.moe): opcheck, equality with the direct
numkern calls and with vLLM's torch.ops._C, the routed block under torch.compile and
torch.export, and the errors of the real op and its fake."""

import math
import os
import shutil

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import numkern
import numkern.torch_ops  # defines torch.ops.numkern
from numkern import moe

from . import oracle
from .conftest import run_child
from .test_moe import assert_close_moe, moe_reference

ops = torch.ops.numkern
BF, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32

SCHEMAS = {
    "prepack_moe_weight": "(Tensor weight, Tensor(a1!) packed_weight, str isa) -> ()",
    "cpu_fused_moe": "(Tensor(a0!) output, Tensor input, Tensor w13, Tensor w2, "
    "Tensor? w13_bias, Tensor? w2_bias, Tensor topk_weights, Tensor topk_id, "
    "bool skip_weighted, str act, str isa) -> ()",
}


def weights(e_n, h, i_n, dtype, isa, bias, g):
    """Unpacked and packed expert weights, biases: torch code only (no kernel runs)."""
    w13 = (torch.randn(e_n, 2 * i_n, h, generator=g) / math.sqrt(h)).to(dtype)
    w2 = (torch.randn(e_n, h, i_n, generator=g) / math.sqrt(i_n)).to(dtype)
    return {
        "w13": moe.prepack_moe_weight(w13, isa),
        "w2": moe.prepack_moe_weight(w2, isa),
        "w13_bias": torch.randn(e_n, 2 * i_n, generator=g).to(dtype) if bias else None,
        "w2_bias": torch.randn(e_n, h, generator=g).to(dtype) if bias else None,
        "raw": (w13, w2),
    }


def case(t_n=5, e_n=4, k=2, h=32, i_n=32, dtype=BF, isa="vec", bias=False, seed=0):
    """Inputs of cpu_fused_moe (weights packed for ``isa``) as a dict by schema name."""
    g = torch.Generator().manual_seed(seed)
    c = weights(e_n, h, i_n, dtype, isa, bias, g)
    tw, ti = moe.topk_softmax(torch.randn(t_n, e_n, generator=g), k, True)
    c.update(
        output=torch.empty(t_n, h, dtype=dtype),
        input=torch.randn(t_n, h, generator=g).to(dtype),
        topk_weights=tw,
        topk_id=ti,
    )
    return c


def fused_args(c, skip_weighted=False, act="silu", isa="vec"):
    names = ("output", "input", "w13", "w2", "w13_bias", "w2_bias", "topk_weights", "topk_id")
    return (*(c[n] for n in names), skip_weighted, act, isa)


# ---------------------------------------------------------------------------------------
# schemas and opcheck


def test_vllm_schemas_verbatim():
    for name, tail in SCHEMAS.items():
        assert str(getattr(ops, name).default._schema) == f"numkern::{name}{tail}"
    theirs = oracle.ops()
    for name, tail in SCHEMAS.items():
        assert str(getattr(theirs, name).default._schema) == f"_C::{name}{tail}"


@pytest.mark.parametrize("isa,dtype", [("vec", BF), ("vec", FP16), ("vec", FP32), ("amx", BF)])
def test_opcheck_prepack(isa, dtype):
    w = torch.randn(2, 64, 32).to(dtype)
    torch.library.opcheck(ops.prepack_moe_weight, (w, torch.empty_like(w), isa))


# (dtype, isa, act, bias, k, skip_weighted): every dtype, isa and act at least once
FUSED = [
    (BF, "vec", "silu", True, 2, False),
    (FP16, "vec", "gelu", False, 2, False),
    (FP32, "vec", "gelu_tanh", True, 3, False),
    (BF, "amx", "swigluoai", False, 2, False),
    (FP32, "vec", "silu", False, 1, True),
]


@pytest.mark.parametrize("dtype,isa,act,bias,k,skip_weighted", FUSED)
def test_opcheck_cpu_fused_moe(dtype, isa, act, bias, k, skip_weighted):
    c = case(k=k, dtype=dtype, isa=isa, bias=bias)
    torch.library.opcheck(ops.cpu_fused_moe, fused_args(c, skip_weighted, act, isa))


@pytest.mark.parametrize("dtype,renormalize", [(BF, True), (FP16, False), (FP32, True)])
def test_opcheck_topk_softmax(dtype, renormalize):
    torch.library.opcheck(ops.topk_softmax, (torch.randn(7, 8).to(dtype), 3, renormalize))


@pytest.mark.parametrize(
    "dtype,scoring_func,bias", [(FP32, "softmax", False), (BF, "sigmoid", True)]
)
def test_opcheck_grouped_topk(dtype, scoring_func, bias):
    kwargs = {"scoring_func": scoring_func, "routed_scaling_factor": 2.5}
    if bias:
        kwargs["e_score_correction_bias"] = torch.randn(8).to(dtype)
    torch.library.opcheck(ops.grouped_topk, (torch.randn(7, 8).to(dtype), 3, True, 4, 2), kwargs)


# ---------------------------------------------------------------------------------------
# results: the direct numkern call, vLLM's op


@pytest.mark.parametrize("dtype,isa,act,bias,k,skip_weighted", FUSED)
def test_equals_direct_call(dtype, isa, act, bias, k, skip_weighted):
    c = case(t_n=13, e_n=8, k=k, h=64, i_n=32, dtype=dtype, isa=isa, bias=bias)
    w13, w2 = c["raw"]
    for w in (w13, w2):
        packed = torch.full_like(w, float("nan"))
        ops.prepack_moe_weight(w, packed, isa)
        assert torch.equal(packed, moe.prepack_moe_weight(w, isa))
    args = fused_args(c, skip_weighted, act, isa)
    ops.cpu_fused_moe(*args)
    ours = torch.empty_like(c["output"])
    moe.fused_moe(ours, *args[1:8], activation=act, skip_weighted=skip_weighted, isa=isa)
    assert torch.equal(c["output"], ours)


def test_routing_equals_direct_call():
    logits = torch.randn(13, 16)
    for got, want in (
        (ops.topk_softmax(logits, 4, False), moe.topk_softmax(logits, 4, False)),
        (
            ops.grouped_topk(logits, 4, True, 4, 2, scoring_func="sigmoid"),
            moe.grouped_topk(logits, 4, True, 4, 2, scoring_func="sigmoid"),
        ),
    ):
        assert all(torch.equal(a, b) for a, b in zip(got, want))


VLLM_PROBE = """
T, E, k, H, I = 3, 4, 2, 32, 32
for dt in (torch.bfloat16, torch.float32):
    w13 = torch.randn(E, 2 * I, H).to(dt); w2 = torch.randn(E, H, I).to(dt)
    p13 = torch.empty_like(w13); p2 = torch.empty_like(w2)
    torch.ops._C.prepack_moe_weight(w13, p13, "vec"); torch.ops._C.prepack_moe_weight(w2, p2, "vec")
    ti = torch.randint(0, E, (T, k), dtype=torch.int32); tw = torch.rand(T, k)
    torch.ops._C.cpu_fused_moe(torch.empty(T, H, dtype=dt), torch.randn(T, H).to(dt), p13, p2,
                               None, None, tw, ti, False, "silu", "vec")
"""


@pytest.mark.parametrize(
    "dtype,act,bias", [(BF, "silu", True), (BF, "gelu_tanh", False), (FP32, "swigluoai", True)]
)
def test_vllm_oracle(dtype, act, bias):
    """The same inputs through torch.ops.numkern and torch.ops._C (vLLM's ``vec`` kernels:
    its ``amx`` ones need AMX); tolerances as in test_moe."""
    oracle.require_op("prepack_moe_weight / cpu_fused_moe (vec)", VLLM_PROBE)
    theirs_ops = oracle.ops()
    c = case(t_n=13, e_n=8, k=2, h=64, i_n=64, dtype=dtype, bias=bias)
    w13, w2 = c["raw"]
    for w, ours in ((w13, c["w13"]), (w2, c["w2"])):
        theirs = torch.empty_like(w)
        theirs_ops.prepack_moe_weight(w, theirs, "vec")
        assert torch.equal(ours, theirs)
    args = fused_args(c, False, act)
    ops.cpu_fused_moe(*args)
    theirs = torch.empty_like(c["output"])
    theirs_ops.cpu_fused_moe(theirs, *args[1:])
    ref, scale = moe_reference(c["input"], w13, w2, *args[4:8], act)
    assert_close_moe(c["output"], ref, scale)
    assert_close_moe(c["output"], theirs.float(), scale, units=3.0)


# ---------------------------------------------------------------------------------------
# the routed block under torch.compile and torch.export


class MoEBlock(torch.nn.Module):
    """Router GEMM -> top-k softmax routing -> fused MoE, every weight a buffer (inference:
    nothing requires grad)."""

    def __init__(self, e_n=8, k=2, h=64, i_n=32, dtype=BF, act="silu", isa="vec"):
        super().__init__()
        g = torch.Generator().manual_seed(1)
        c = weights(e_n, h, i_n, dtype, isa, True, g)
        router = torch.randn(e_n, h, generator=g).to(dtype)
        self.register_buffer("router", numkern.convert_weight_packed(router))
        self.e_n = e_n
        for name in ("w13", "w2", "w13_bias", "w2_bias"):
            self.register_buffer(name, c[name])
        self.k, self.act, self.isa = k, act, isa

    def forward(self, x):  # x [T, H]
        logits = x.new_empty(x.shape[0], self.e_n)  # [T, E]
        ops.weight_packed_linear(logits, x, self.router, None, True)
        tw, ti = ops.topk_softmax(logits, self.k, True)  # [T, k] fp32, int32
        out = torch.empty_like(x)
        ops.cpu_fused_moe(
            out, x, self.w13, self.w2, self.w13_bias, self.w2_bias, tw, ti, False, self.act,
            self.isa,
        )  # fmt: skip
        return out


def block_inputs(dtype=BF):
    return [torch.randn(t_n, 64).to(dtype) for t_n in (5, 11)]


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_block_compiles(backend):
    torch._dynamo.reset()
    block = MoEBlock()
    compiled = torch.compile(block, backend=backend, fullgraph=True, dynamic=True)
    for x in block_inputs():
        assert torch.equal(compiled(x), block(x))


CXX = shutil.which(os.environ.get("CXX", "g++")) or shutil.which("clang++")


@pytest.mark.skipif(CXX is None, reason="inductor's CPU backend needs a C++ compiler")
# importing inductor imports torch.utils.mkldnn, which warns (filterwarnings = error)
@pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")
def test_block_compiles_inductor():
    torch._dynamo.reset()
    block = MoEBlock(dtype=FP32, act="gelu")
    compiled = torch.compile(block, backend="inductor", fullgraph=True)
    x = block_inputs(FP32)[0]
    assert torch.equal(compiled(x), block(x))


def test_block_exports():
    block = MoEBlock(act="swigluoai")
    x5, x11 = block_inputs()
    ep = torch.export.export(block, (x5,), dynamic_shapes={"x": {0: torch.export.Dim("T")}})
    targets = {str(n.target) for n in ep.graph.nodes if n.op == "call_function"}
    assert any("numkern.topk_softmax" in t for t in targets), targets
    assert any("numkern.cpu_fused_moe" in t for t in targets), targets
    for x in (x5, x11):
        assert torch.equal(ep.module()(x), block(x))


def test_block_compiles_cold():
    """A fresh process in which no numkern kernel ran before the compiled call."""
    out = run_child(
        """
import torch
from tests.test_torch_ops_moe import MoEBlock, block_inputs
block = MoEBlock(dtype=torch.float16, act="gelu")
x = block_inputs(torch.float16)[1]
got = torch.compile(block, backend="aot_eager", fullgraph=True)(x)
print(torch.equal(got, block(x)))
""",
        timeout=300,
    )
    assert out.strip().endswith("True"), out


# ---------------------------------------------------------------------------------------
# errors: the real op and its fake raise the same


def raises_same(op, args, kwargs=None, *, exc, match):
    """``op`` raises ``exc`` matching ``match``, on real tensors and on fake ones alike."""
    kwargs = kwargs or {}
    with pytest.raises(exc, match=match) as real:
        op(*args, **kwargs)
    with FakeTensorMode(allow_non_fake_inputs=False) as mode:
        fake_args, fake_kwargs = torch.utils._pytree.tree_map_only(
            torch.Tensor, mode.from_tensor, (args, kwargs)
        )
        with pytest.raises(exc) as fake:
            op(*fake_args, **fake_kwargs)
    assert str(fake.value) == str(real.value)


def _bad(name, value):
    def edit(c):
        c[name] = value(c) if callable(value) else value

    return edit


BAD_FUSED = [  # (edit of the case, exception, message)
    (_bad("act", "relu2"), ValueError, "act: expected one of"),
    (_bad("isa", "avx2"), ValueError, "isa: expected one of"),
    (_bad("output", lambda c: c["output"][:, :16]), ValueError, "output: expected shape"),
    (_bad("output", lambda c: c["output"].float()), TypeError, "output: expected dtype"),
    (_bad("input", lambda c: c["input"].t().contiguous().t()), ValueError, "input: expected"),
    (_bad("w13", lambda c: c["w13"][:, :48].contiguous()), ValueError, "w13: expected H and I"),
    (_bad("w2", lambda c: c["w2"][:2]), ValueError, "w2: expected shape"),
    (_bad("w2_bias", torch.zeros(4, 16, dtype=BF)), ValueError, "w2_bias: expected shape"),
    (_bad("topk_id", lambda c: c["topk_id"].long()), TypeError, "topk_ids: expected dtype"),
    (_bad("topk_weights", lambda c: c["topk_weights"][:, :1]), ValueError, "topk_weights"),
    (_bad("skip_weighted", True), ValueError, "skip_weighted: requires topk == 1"),
]


@pytest.mark.parametrize("edit,exc,match", BAD_FUSED)
def test_cpu_fused_moe_errors(edit, exc, match):
    c = case()
    c.update(skip_weighted=False, act="silu", isa="vec")
    edit(c)
    args = (*fused_args(c)[:8], c["skip_weighted"], c["act"], c["isa"])
    before = c["output"].fill_(7.0).clone()
    raises_same(ops.cpu_fused_moe, args, exc=exc, match=match)
    assert torch.equal(c["output"], before)  # written nothing


def test_cpu_fused_moe_amx_needs_bf16():
    c = case(dtype=FP32)
    raises_same(ops.cpu_fused_moe, fused_args(c, isa="amx"), exc=TypeError, match="input:")


def test_cpu_fused_moe_id_range_real_only():
    """The one data-dependent check: the real op refuses an id >= E; the fake cannot see it."""
    c = case()
    c["topk_id"][0, 0] = 4
    with pytest.raises(ValueError, match=r"topk_ids: expected expert ids in \[0, 4\)"):
        ops.cpu_fused_moe(*fused_args(c))


@pytest.mark.parametrize(
    "weight,packed,isa,exc,match",
    [
        (torch.randn(2, 64, 32), torch.empty(2, 64, 32), "nope", ValueError, "isa:"),
        (torch.randn(2, 64, 32), torch.empty(2, 64, 32), "amx", TypeError, "weight:"),
        (torch.randn(2, 64, 48), torch.empty(2, 64, 48), "vec", ValueError, "multiples of 32"),
        (torch.randn(64, 32), torch.empty(64, 32), "vec", ValueError, "weight: expected 3-D"),
        (torch.randn(2, 64, 32), torch.empty(2, 32, 64), "vec", ValueError, "packed_weight:"),
        (torch.randn(2, 64, 32), torch.empty(2, 64, 32).half(), "vec", TypeError, "packed_w"),
    ],
)
def test_prepack_errors(weight, packed, isa, exc, match):
    raises_same(ops.prepack_moe_weight, (weight, packed, isa), exc=exc, match=match)


@pytest.mark.parametrize(
    "args,kwargs,exc,match",
    [
        ((torch.randn(4, 8).int(), 2, True, 4, 2), {}, TypeError, "logits:"),
        ((torch.randn(4, 8), 9, True, 4, 2), {}, ValueError, "topk:"),
        ((torch.randn(4, 8), 2, True, 3, 2), {}, ValueError, "num_expert_group:"),
        ((torch.randn(4, 8), 2, True, 4, 5), {}, ValueError, "topk_group:"),
        ((torch.randn(4, 8), 5, True, 4, 2), {}, ValueError, "topk: expected <="),
        ((torch.randn(4, 8), 2, True, 4, 2), {"scoring_func": "tanh"}, ValueError, "scoring"),
        (
            (torch.randn(4, 8), 2, True, 4, 2),
            {"e_score_correction_bias": torch.randn(4)},
            ValueError,
            "e_score_correction_bias:",
        ),
    ],
)
def test_routing_errors(args, kwargs, exc, match):
    raises_same(ops.grouped_topk, args, kwargs, exc=exc, match=match)
    if not kwargs and match in ("logits:", "topk:"):
        raises_same(ops.topk_softmax, args[:3], exc=exc, match=match)


def test_non_cpu_refused():
    x = torch.empty(4, 8, device="meta")
    with pytest.raises(TypeError, match="logits: expected a CPU tensor, got device meta"):
        ops.topk_softmax(x, 2, True)
    w = torch.empty(2, 64, 32, device="meta")
    with pytest.raises(TypeError, match="weight: expected a CPU tensor"):
        ops.prepack_moe_weight(w, torch.empty_like(w), "vec")


def test_requires_grad_refused():
    c = case()
    c["input"].requires_grad_()
    with pytest.raises(TypeError, match="input: expected a tensor that does not require grad"):
        ops.cpu_fused_moe(*fused_args(c))
    w = torch.randn(2, 64, 32, requires_grad=True)
    with pytest.raises(TypeError, match="weight: expected a tensor that does not require"):
        ops.prepack_moe_weight(w, torch.empty_like(w), "vec")
    logits = torch.randn(4, 8, requires_grad=True)
    with pytest.raises(TypeError, match="logits: expected a tensor that does not require"):
        ops.topk_softmax(logits, 2, True)
    with torch.no_grad():  # allowed without grad mode
        ops.cpu_fused_moe(*fused_args(c))
        ops.grouped_topk(logits, 2, True, 4, 2)
    # what opcheck's autograd-registration test asks: a kernel at the Autograd key
    torch.library.opcheck(
        ops.topk_softmax, (logits, 2, True), test_utils=("test_autograd_registration",)
    )
    torch.library.opcheck(
        ops.cpu_fused_moe, fused_args(c), test_utils=("test_autograd_registration",)
    )


def test_moe_workspace_plan_op():
    """``moe_workspace_plan`` (ints in, ints out): ``[total, offset_0, bytes_0, ...]`` in
    the order of ``WORKSPACE_BUFFERS``, equal to the Python plan, sizes past 2^31 exact;
    usable inside a compiled region with a dynamic token count."""
    from numkern.torch_ops.moe import WORKSPACE_BUFFERS

    cases = [
        (1, 1, 1, 16, 16, "float32", 1),
        (513, 8, 128, 2048, 768, "bfloat16", 2),
        (0, 2, 8, 64, 32, "float16", 1),
        (1 << 20, 8, 256, 7168, 2048, "bfloat16", 64),  # past 2^31 bytes
    ]
    for args in cases:
        plan = moe.moe_workspace_plan(*args[:5], getattr(torch, args[5]), args[6])
        got = ops.moe_workspace_plan(*args)
        assert tuple(plan.buffers) == WORKSPACE_BUFFERS
        assert got == [plan.total_bytes, *(n for span in plan.buffers.values() for n in span)]
    assert got[0] > 1 << 31
    torch.library.opcheck(ops.moe_workspace_plan.default, cases[1])

    def scratch(x):
        total = ops.moe_workspace_plan(x.shape[0], 2, 8, x.shape[1], 32, "bfloat16", 1)[0]
        return x.new_empty(total, dtype=torch.uint8)

    torch._dynamo.reset()
    f = torch.compile(scratch, fullgraph=True, backend="aot_eager", dynamic=True)
    for t in (3, 17):
        x = torch.zeros(t, 64, dtype=torch.bfloat16)
        assert f(x).shape == scratch(x).shape
    with pytest.raises(TypeError, match="dtype: expected one of"):
        ops.moe_workspace_plan(1, 1, 1, 16, 16, "int8", 1)
    with pytest.raises(ValueError, match="num_tokens"):
        ops.moe_workspace_plan(-1, 1, 1, 16, 16, "float32", 1)
