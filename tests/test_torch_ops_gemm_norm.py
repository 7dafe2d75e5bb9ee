"""numkern.torch_ops (gemm, norm, rope): vLLM's schemas, opcheck, results against the
Python ops and vLLM's, torch.compile / torch.export of a module using them, errors."""

import shutil

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import numkern
import numkern.torch_ops  # defines torch.ops.numkern.*
from numkern import norm as N
from numkern import rope as R
from numkern.testing.tolerances import tolerance

from . import oracle
from .conftest import run_child

OPS = torch.ops.numkern
BF, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32

# vLLM 0.32's schemas as torch prints them (torch.ops._C.<op>.default._schema).
VLLM_SCHEMAS = {
    "convert_weight_packed": "convert_weight_packed(Tensor($0! -> ) weight) -> Tensor",
    "weight_packed_linear": "weight_packed_linear(Tensor(a0!) out, Tensor(a1) mat1, "
    "Tensor(a2) mat2, Tensor(a3)? bias, bool is_vnni) -> ()",
    "rms_norm": "rms_norm(Tensor($0! -> ) out, Tensor input, Tensor? weight, float epsilon) -> ()",
    "fused_add_rms_norm": "fused_add_rms_norm(Tensor($0! -> ) input, Tensor($1! -> ) residual, "
    "Tensor? weight, float epsilon) -> ()",
    "rotary_embedding": "rotary_embedding(Tensor positions, Tensor($0! -> ) query, "
    "Tensor($1! -> )? key, int head_size, Tensor cos_sin_cache, bool is_neox, "
    "int rope_dim_offset=0, bool inverse=False) -> ()",
}


def schema(ns, name):
    return str(getattr(getattr(torch.ops, ns), name).default._schema).split("::", 1)[1]


@pytest.mark.parametrize("name", sorted(VLLM_SCHEMAS))
def test_schema_is_vllms(name):
    assert schema("numkern", name) == VLLM_SCHEMAS[name]


def test_schemas_match_installed_vllm():
    theirs = oracle.schemas(VLLM_SCHEMAS)  # (_C's packed linear from a child on other CPUs)
    for name in VLLM_SCHEMAS:
        assert schema("numkern", name) == theirs[name]


# --- inputs: a pairwise set of shapes x dtypes (each dtype, each layout feature once) ---


def linear_args(m, n, k, dt, wdt, bias):
    """(out, mat1, mat2, bias, is_vnni) for torch.ops.numkern.weight_packed_linear."""
    x = torch.randn(m, k).to(dt)
    w = numkern.convert_weight_packed(torch.randn(n, k).to(wdt))
    out_dt = FP32 if wdt == FP32 else dt
    return torch.empty(m, n, dtype=out_dt), x, w, torch.randn(n) if bias else None, True


LINEAR = [  # (M, N, K, mat1 dtype, mat2 dtype, bias)
    (1, 32, 64, BF, BF, True),
    (5, 48, 96, FP16, FP16, False),
    (3, 33, 17, FP32, FP32, True),  # short last block, odd K (fp32 weights only)
    (4, 16, 32, BF, FP32, False),  # a router kept in fp32: fp32 logits
]
PACK = [((32, 64), BF), ((3, 33, 16), FP16), ((40, 17), FP32)]
NORM = [  # (shape, dtype, weight dtype or None)
    ((5, 64), BF, BF),
    ((3, 2, 33), FP16, FP32),
    ((7, 16), FP32, None),
]
ROPE = [  # (T, Hq, Hk or None, head_size, rot_dim, dtype, cache dtype, is_neox, 3-D)
    (5, 4, 2, 64, 64, BF, BF, True, False),
    (3, 2, None, 32, 16, FP16, FP32, False, True),
    (6, 3, 1, 48, 40, FP32, FP32, True, False),
]


def norm_args(shape, dt, wdt):
    x = torch.randn(shape).to(dt)
    w = None if wdt is None else torch.randn(shape[-1]).to(wdt)
    return x, w


def rope_args(t_n, hq, hk, d, rot, dt, cdt, neox, three_d):
    """(positions, query, key, head_size, cos_sin_cache, is_neox)."""
    q = torch.randn(t_n, hq, d).to(dt)
    q = q if three_d else q.reshape(t_n, hq * d)
    k = None if hk is None else torch.randn(t_n, hk * d).to(dt)
    cache = torch.randn(17, rot).to(cdt)
    return torch.randint(0, 17, (t_n,)), q, k, d, cache, neox


# --- opcheck ---------------------------------------------------------------------------


@pytest.mark.parametrize("case", LINEAR)
def test_opcheck_weight_packed_linear(case):
    torch.library.opcheck(OPS.weight_packed_linear, linear_args(*case))


@pytest.mark.parametrize("shape,dt", PACK)
def test_opcheck_convert_weight_packed(shape, dt):
    torch.library.opcheck(OPS.convert_weight_packed, (torch.randn(shape).to(dt),))


@pytest.mark.parametrize("shape,dt,wdt", NORM)
def test_opcheck_norms(shape, dt, wdt):
    x, w = norm_args(shape, dt, wdt)
    torch.library.opcheck(OPS.rms_norm, (torch.empty_like(x), x, w, 1e-6))
    torch.library.opcheck(OPS.fused_add_rms_norm, (x, torch.randn(shape).to(dt), w, 1e-5))


@pytest.mark.parametrize("case", ROPE)
def test_opcheck_rotary_embedding(case):
    torch.library.opcheck(OPS.rotary_embedding, rope_args(*case))


# --- results: the dispatcher runs numkern's op (bitwise), and agrees with vLLM's -------


@pytest.mark.parametrize("case", LINEAR)
def test_linear_equals_direct(case):
    out, x, w, bias, _ = linear_args(*case)
    ref = torch.empty_like(out)
    numkern.weight_packed_linear(ref, x, w, bias, True)
    OPS.weight_packed_linear(out, x, w, bias, True)
    assert torch.equal(out, ref)
    raw = torch.randn(case[1], case[2]).to(case[4])
    assert torch.equal(OPS.convert_weight_packed(raw), numkern.convert_weight_packed(raw))


@pytest.mark.parametrize("case", LINEAR)
def test_linear_cpu_op(case):
    """numkern's own ``weight_packed_linear_cpu``: a new ``[..., n]`` output (3-D input
    for the first case), bit-equal to the direct call; opcheck; its fake's errors."""
    _, x, w, bias, _ = linear_args(*case)
    if case[0] == 1:
        x = torch.randn(2, 3, x.shape[1]).to(x.dtype)
    n = w.shape[0]
    got = OPS.weight_packed_linear_cpu(x, w, n, bias)
    want = numkern.weight_packed_linear_cpu(x, w, n, bias)
    assert got.shape == (*x.shape[:-1], n) and got.dtype == want.dtype
    assert torch.equal(got, want)
    torch.library.opcheck(OPS.weight_packed_linear_cpu, (x, w, n, bias))
    with FakeTensorMode() as mode:
        fx, fw = mode.from_tensor(x), mode.from_tensor(w)
        with pytest.raises(ValueError, match="packed_weight: expected shape"):
            OPS.weight_packed_linear_cpu(fx, fw, n + 1, None)
    with pytest.raises(ValueError, match="packed_weight: expected shape"):
        OPS.weight_packed_linear_cpu(x, w, n + 1, None)


@pytest.mark.parametrize("shape,dt,wdt", NORM)
def test_norms_equal_direct(shape, dt, wdt):
    x, w = norm_args(shape, dt, wdt)
    ours, ref = torch.empty_like(x), torch.empty_like(x)
    OPS.rms_norm(ours, x, w, 1e-6)
    N.rms_norm(ref, x, w, 1e-6)
    assert torch.equal(ours, ref)
    res = torch.randn(shape).to(dt)
    x2, res2 = x.clone(), res.clone()
    OPS.fused_add_rms_norm(x, res, w, 1e-5)
    N.fused_add_rms_norm(x2, res2, w, 1e-5)
    assert torch.equal(x, x2) and torch.equal(res, res2)


@pytest.mark.parametrize("case", ROPE)
def test_rotary_equals_direct(case):
    pos, q, k, d, cache, neox = rope_args(*case)
    q2, k2 = q.clone(), None if k is None else k.clone()
    OPS.rotary_embedding(pos, q, k, d, cache, neox)
    R.rotary_embedding(pos, q2, k2, d, cache, neox)
    assert torch.equal(q, q2) and (k is None or torch.equal(k, k2))


def assert_units(ours, theirs, units):
    """Within ``units`` rounding units of ``theirs``' dtype (relative), plus an absolute
    term: the table's torch_ops_vllm (numkern.testing.tolerances)."""
    t = tolerance("torch_ops_vllm", theirs.dtype)
    err = (ours.double() - theirs.double()).abs()
    assert (err <= units * t.rel * theirs.double().abs() + t.abs).all(), err.max().item()


# vLLM's CPU norm and rotary need the weight / cache in the input's dtype and 2-D rows of
# a multiple of 16 elements: compared on that subset (see tests/test_norm.py, test_rope.py).
@pytest.mark.parametrize("dt", [BF, FP16, FP32])
def test_norm_rope_vllm(dt):
    ops = oracle.ops()
    x, w = torch.randn(5, 128).to(dt), torch.randn(128).to(dt)
    ours, theirs = torch.empty_like(x), torch.empty_like(x)
    OPS.rms_norm(ours, x, w, 1e-6)
    ops.rms_norm(theirs, x, w, 1e-6)
    assert_units(ours, theirs, 1)
    res = torch.randn(5, 128).to(dt)
    x0, res0 = x.clone(), res.clone()
    x2, res2 = x.clone(), res.clone()
    OPS.fused_add_rms_norm(x, res, w, 1e-6)
    ops.fused_add_rms_norm(x2, res2, w, 1e-6)
    assert torch.equal(res, (x0.float() + res0.float()).to(dt))  # the sum, rounded once
    model, model_res = oracle.vllm_fused_add_rms_norm(x0, res0, w, 1e-6)
    assert torch.equal(res2, model_res)  # that build's own stores (docs §9.1)
    assert_units(x2, model, 1)
    if oracle.native_library() not in oracle.TRUNCATING_BF16 or dt != BF:
        assert_units(x, x2, 1)
    pos, q, k, d, cache, neox = rope_args(7, 4, 2, 64, 64, dt, dt, True, False)
    q2, k2 = q.clone(), k.clone()
    OPS.rotary_embedding(pos, q, k, d, cache, neox)
    ops.rotary_embedding(pos, q2, k2, d, cache, neox)
    assert_units(q, q2, 1)
    assert_units(k, k2, 1)


# The packed linear exists only in vLLM's _C build (AVX512-BF16): probed, then run in a
# child (the build this process loads may be another).
_VLLM_LINEAR_PROBE = """
x = torch.randn(4, 64).bfloat16(); w = torch.randn(32, 64).bfloat16()
out = torch.empty(4, 32, dtype=torch.bfloat16)
torch.ops._C.weight_packed_linear(out, x, torch.ops._C.convert_weight_packed(w), None, True)
"""


def test_linear_vllm():
    oracle.require_op("weight_packed_linear", _VLLM_LINEAR_PROBE, lib="_C.abi3.so")
    x, w, b = torch.randn(5, 256).bfloat16(), torch.randn(48, 256).bfloat16(), torch.randn(48)
    code = """
x, w, b = inputs["x"], inputs["w"], inputs["b"]
packed = torch.ops._C.convert_weight_packed(w)
out = torch.empty(x.shape[0], w.shape[0], dtype=torch.bfloat16)
torch.ops._C.weight_packed_linear(out, x, packed, b, True)
result = {"packed": packed, "out": out}
"""
    theirs = oracle.run_in_child(
        "_C.abi3.so", code, probe=_VLLM_LINEAR_PROBE, name="weight_packed_linear", x=x, w=w, b=b
    )
    packed = OPS.convert_weight_packed(w)
    assert torch.equal(packed.view(torch.int16), theirs["packed"].view(torch.int16))
    ours = torch.empty(5, 48, dtype=BF)
    OPS.weight_packed_linear(ours, x, packed, b, True)
    assert_units(ours, theirs["out"], 2)  # each side rounds once from its own fp32 sum


# --- torch.compile and torch.export of a module that uses the ops -----------------------


class Block(torch.nn.Module):
    """RMS norm then a packed linear: ``[M, K] -> [M, N]`` (bf16, fp32 norm weight)."""

    def __init__(self, n=48, k=64):
        super().__init__()
        self.register_buffer("norm_w", torch.randn(k))
        self.register_buffer("w", numkern.convert_weight_packed(torch.randn(n, k).bfloat16()))
        self.register_buffer("b", torch.randn(n))

    def forward(self, x):
        h = torch.empty_like(x)
        torch.ops.numkern.rms_norm(h, x, self.norm_w, 1e-6)
        out = x.new_empty(x.shape[0], self.w.shape[0])
        torch.ops.numkern.weight_packed_linear(out, h, self.w, self.b, True)
        return out * 2


def _compiler():
    return shutil.which("g++") or shutil.which("c++") or shutil.which("cc")


BACKENDS = [
    "eager",
    "aot_eager",
    pytest.param(
        "inductor",
        marks=[
            pytest.mark.skipif(_compiler() is None, reason="inductor needs a C++ compiler"),
            # torch 2.13's inductor calls its own deprecated torch.jit.script_method
            pytest.mark.filterwarnings("ignore:`torch.jit.script_method`:DeprecationWarning"),
        ],
    ),
]


@pytest.mark.parametrize("backend", BACKENDS)
def test_compile_fullgraph(backend):
    torch._dynamo.reset()
    block, x = Block(), torch.randn(5, 64).bfloat16()
    want = block(x)
    compiled = torch.compile(block, fullgraph=True, backend=backend)
    assert torch.equal(compiled(x), want)
    x3 = torch.randn(3, 64).bfloat16()  # another M: a recompile or a dynamic graph
    assert torch.equal(compiled(x3), block(x3))


def test_export():
    block, x = Block(), torch.randn(5, 64).bfloat16()
    ep = torch.export.export(block, (x,))
    targets = {str(n.target) for n in ep.graph.nodes}
    assert any("numkern" in t for t in targets), targets
    assert torch.equal(ep.module()(x), block(x))


def test_compile_cold_process():
    """A fresh process where no numkern kernel has run: the first call is the compiled one."""
    code = """
import torch
import numkern, numkern.torch_ops
x = torch.randn(6, 32)
w = numkern.convert_weight_packed(torch.randn(16, 32))
nw = torch.randn(32)
def f(x):
    h = torch.empty_like(x)
    torch.ops.numkern.rms_norm(h, x, nw, 1e-6)
    out = x.new_empty(6, 16)
    torch.ops.numkern.weight_packed_linear(out, h, w, None, True)
    return out + 1
got = torch.compile(f, fullgraph=True, backend="aot_eager")(x)
h = torch.empty_like(x); numkern.norm.rms_norm(h, x, nw, 1e-6)
ref = torch.empty(6, 16); numkern.weight_packed_linear(ref, h, w, None, True)
assert torch.equal(got, ref + 1)
print("OK")
"""
    assert "OK" in run_child(code, timeout=300)


# --- errors ------------------------------------------------------------------------------


def test_unsupported_rotary_arguments():
    pos, q, k, d, cache, neox = rope_args(*ROPE[0])
    q0 = q.clone()
    with pytest.raises(ValueError, match=r"^rope_dim_offset: "):
        OPS.rotary_embedding(pos, q, k, d, cache, neox, 8)
    with pytest.raises(ValueError, match=r"^inverse: "):
        OPS.rotary_embedding(pos, q, k, d, cache, neox, inverse=True)
    assert torch.equal(q, q0)
    with FakeTensorMode() as mode:  # the fake refuses them too
        fake = [mode.from_tensor(t) if isinstance(t, torch.Tensor) else t for t in (pos, q)]
        with pytest.raises(ValueError, match=r"^inverse: "):
            OPS.rotary_embedding(*fake, None, d, mode.from_tensor(cache), neox, 0, True)


def test_fake_raises_as_the_op():
    """The fakes name the same argument with the same exception type as the kernels."""
    out, x, w, bias, _ = linear_args(*LINEAR[0])
    bad = [
        ((out, x, w, bias, False), ValueError, "is_vnni"),
        ((out.float(), x, w, bias, True), TypeError, "out"),
        ((out, x[:, :32], w, bias, True), ValueError, "mat2"),
        ((out, x, w, bias.bfloat16(), True), TypeError, "bias"),
    ]
    xn, wn = norm_args((5, 64), BF, BF)
    norms = [
        (OPS.rms_norm, (torch.empty(5, 32, dtype=BF), xn, wn, 1e-6), ValueError, "out"),
        (OPS.rms_norm, (torch.empty_like(xn), xn, wn, -1.0), ValueError, "epsilon"),
        (OPS.fused_add_rms_norm, (xn, xn.float(), wn, 1e-6), TypeError, "residual"),
        (OPS.fused_add_rms_norm, (xn, xn.clone(), wn[:32], 1e-6), ValueError, "weight"),
    ]
    pos, q, k, d, cache, neox = rope_args(*ROPE[0])
    ropes = [
        (OPS.rotary_embedding, (pos.int(), q, k, d, cache, neox), TypeError, "positions"),
        (OPS.rotary_embedding, (pos, q, k, 48, cache, neox), ValueError, "query"),
        (OPS.rotary_embedding, (pos, q, k.half(), d, cache, neox), TypeError, "key"),
        (OPS.rotary_embedding, (pos, q, k, d, cache[:, :9].contiguous(), neox), ValueError, "cos"),
    ]
    cases = [(OPS.weight_packed_linear, *b) for b in bad] + norms + ropes
    cases.append((OPS.convert_weight_packed, (torch.randn(4, 5).bfloat16(),), ValueError, "weight"))
    for op, args, exc, name in cases:
        with pytest.raises(exc, match=rf"^{name}"):
            op(*args)
        with FakeTensorMode() as mode:
            fake = [mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args]
            with pytest.raises(exc, match=rf"^{name}"):
                op(*fake)


def test_device_refused():
    """Meta tensors reach the fake (the Meta kernel), CUDA ones under tracing reach it
    too: both are refused as non-CPU tensors, never given a shape as if served."""
    x = torch.empty(4, 64, device="meta", dtype=BF)
    with pytest.raises(TypeError, match=r"^input: expected a CPU tensor, got device meta"):
        OPS.rms_norm(torch.empty_like(x), x, None, 1e-6)
    with pytest.raises(TypeError, match=r"^weight: expected a CPU tensor, got device meta"):
        OPS.convert_weight_packed(torch.empty(32, 64, device="meta"))
    with FakeTensorMode():
        x = torch.empty(4, 64, device="cuda", dtype=BF)
        w = torch.empty(32, 64, device="cuda", dtype=BF)
        out = torch.empty(4, 32, device="cuda", dtype=BF)
        with pytest.raises(TypeError, match=r"^mat1: expected a CPU tensor, got device cuda"):
            OPS.weight_packed_linear(out, x, w, None, True)
        with pytest.raises(TypeError, match=r"^input: expected a CPU tensor, got device cuda"):
            OPS.fused_add_rms_norm(x, x.clone(), None, 1e-6)


def test_requires_grad_refused():
    out, x, w, bias, _ = linear_args(*LINEAR[0])
    with pytest.raises(TypeError, match=r"^mat1: expected a tensor that does not require grad"):
        OPS.weight_packed_linear(out, x.requires_grad_(), w, bias, True)
    xn, wn = norm_args((5, 64), FP32, FP32)
    with pytest.raises(TypeError, match=r"^weight: expected a tensor that does not require"):
        OPS.rms_norm(torch.empty_like(xn), xn, torch.nn.Parameter(wn), 1e-6)
    pos, q, k, d, cache, neox = rope_args(*ROPE[0])
    with pytest.raises(TypeError, match=r"^key: expected a tensor that does not require grad"):
        OPS.rotary_embedding(pos, q, k.requires_grad_(), d, cache, neox)
    with pytest.raises(TypeError, match=r"^weight: expected a tensor that does not require"):
        OPS.convert_weight_packed(torch.randn(32, 64, requires_grad=True))
    for op, args in (
        (OPS.rms_norm, (torch.empty_like(xn), xn, torch.nn.Parameter(wn), 1e-6)),
        (OPS.weight_packed_linear, (out, x, w, bias, True)),  # x requires grad
    ):  # opcheck's test: an Autograd kernel is registered (the rest would hit the refusal)
        torch.library.opcheck(op, args, test_utils="test_autograd_registration")
    with torch.no_grad():  # no graph: the op runs (an nn.Parameter weight, for example)
        ours = torch.empty_like(xn)
        OPS.rms_norm(ours, xn, torch.nn.Parameter(wn), 1e-6)
    ref = torch.empty_like(xn)
    N.rms_norm(ref, xn, wn, 1e-6)
    assert torch.equal(ours, ref)
    block = Block()
    block.norm_w = torch.nn.Parameter(block.norm_w)  # a trainable weight under tracing
    # dynamo wraps the fake-tensor run's TypeError in its own RuntimeError
    with pytest.raises(RuntimeError, match=r"weight: expected a tensor that does not require"):
        torch.compile(block, fullgraph=True, backend="aot_eager")(torch.randn(2, 64).bfloat16())
