"""numkern.torch_ops.gdn: the GDN ops as torch custom ops. ``opcheck`` on each, results
equal to the direct ``numkern.gdn`` calls (bit for bit: the same kernels) and, where
vLLM's ops load, to ``torch.ops._C`` within the GDN tests' tolerances; a GDN layer's
prefill and decode under ``torch.compile(fullgraph=True)`` and ``torch.export``; the
schema differences from vLLM's; errors from the real and the fake kernels.

Small shapes (dim 64, D 16 or 64): the Numba kernels are the ones tests/test_gdn_*.py
compile (fp32 and bf16)."""

import shutil

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.library import opcheck

import numkern.torch_ops  # noqa: F401  (defines torch.ops.numkern.*)
from numkern import gdn
from numkern.testing.tolerances import tolerance

from . import oracle
from .close import assert_within

BF, FP32 = torch.bfloat16, torch.float32
I32 = torch.int32
OPS = torch.ops.numkern
W = 4
HK, HV, D = 1, 2, 16  # q, k heads, v heads, head dim of the small GDN layer
DIM = 2 * HK * D + HV * D  # the conv's channels: q, k and v (64)
EPS = 1e-6


def i32(values):
    return torch.tensor(values, dtype=I32)


def conv_fwd_args(dtype, packed=True):
    """A varlen chunk of three requests (one padded, one new) in vLLM's layouts."""
    torch.manual_seed(0)
    w = torch.randn(DIM, W).to(dtype)
    return dict(
        x=torch.randn(9, DIM).to(dtype).t(),  # [dim, T], a transposed [T, dim] buffer
        weight=gdn.causal_conv1d_weight_pack(w) if packed else w,
        bias=torch.randn(DIM).to(dtype),
        conv_states=torch.randn(4, W - 1, DIM).to(dtype).transpose(1, 2),  # [S, dim, W-1]
        query_start_loc=i32([0, 5, 6, 9]),
        cache_indices=i32([2, -1, 0]),
        has_initial_state=torch.tensor([True, False, False]),
        silu_activation=True,
        pad_slot_id=-1,
        is_weight_packed=packed,
    )


def conv_update_args(dtype, spec=False):
    torch.manual_seed(1)
    w = torch.randn(DIM, W).to(dtype)
    cols = W - 1 + (2 if spec else 0)
    return dict(
        x=torch.randn(3, 3, DIM).to(dtype) if spec else torch.randn(3, DIM).to(dtype),
        conv_states=torch.randn(4, cols, DIM).to(dtype).transpose(1, 2),
        weight=gdn.causal_conv1d_weight_pack(w),
        bias=torch.randn(DIM).to(dtype),
        silu_activation=True,
        num_accepted_tokens=i32([1, 3, 2]) if spec else None,
        conv_state_indices=i32([1, 3, -1]),
        pad_slot_id=-1,
        is_weight_packed=True,
    )


def gating_args(dtype, t_n=5, h=HV):
    torch.manual_seed(2)
    return dict(
        A_log=torch.randn(h),
        a=(torch.randn(t_n, h) * 4).to(dtype),
        b=(torch.randn(t_n, h) * 4).to(dtype),
        dt_bias=torch.randn(h).to(dtype),
    )


def chunked_args(dtype, lens=(4, 0, 70), hk=HK, hv=HV, d=D):
    """Requests of 4, 0 (padded) and 70 tokens (two chunks of 64)."""
    torch.manual_seed(3)
    t_n = sum(lens)
    cu = [0]
    for n in lens:
        cu.append(cu[-1] + n)
    return dict(
        query=torch.randn(1, t_n, hk, d).to(dtype),
        key=torch.randn(1, t_n, hk, d).to(dtype),
        value=torch.randn(1, t_n, hv, d).to(dtype),
        g=-torch.rand(1, t_n, hv) * 0.2,
        beta=torch.rand(1, t_n, hv).to(dtype),
        initial_state=torch.randn(4, hv, d, d) * 0.1,
        output_final_state=True,
        cu_seqlens=i32(cu),
        head_first=False,
        use_qk_l2norm_in_kernel=True,
        initial_state_indices=i32([3, -1, 1][: len(lens)]),
        eps=1e-5,
    )


def recurrent_args(dtype, n=3, hk=HK, hv=HV, d=D):
    torch.manual_seed(4)
    return dict(
        A_log=torch.randn(hv) * 0.5,
        dt_bias=torch.randn(hv).to(dtype),
        q=torch.randn(1, n, hk, d).to(dtype),
        k=torch.randn(1, n, hk, d).to(dtype),
        v=torch.randn(1, n, hv, d).to(dtype),
        a=torch.randn(n, hv).to(dtype),
        b=torch.randn(n, hv).to(dtype),
        initial_state_source=torch.randn(4, hv, d, d) * 0.1,
        initial_state_indices=i32([2, -1, 0, 3][:n]),
        cu_seqlens=torch.arange(n + 1, dtype=I32),
        use_qk_l2norm_in_kernel=True,
        softplus_beta=1.0,
        softplus_threshold=20.0,
    )


def norm_args(dtype, shape=(3, HV, D)):
    torch.manual_seed(5)
    return dict(
        x=torch.randn(shape).to(dtype),
        z=torch.randn(shape).to(dtype),
        weight=torch.randn(shape[-1]).to(dtype),
        eps=EPS,
    )


CASES = {
    "causal_conv1d_fwd_cpu": conv_fwd_args,
    "causal_conv1d_update_cpu": conv_update_args,
    "fused_gdn_gating_cpu": gating_args,
    "chunk_gated_delta_rule_cpu": chunked_args,
    "fused_sigmoid_gating_delta_rule_update_cpu": recurrent_args,
    "rms_norm_gated": norm_args,
}
MUTATED = {
    "causal_conv1d_fwd_cpu": "conv_states",
    "causal_conv1d_update_cpu": "conv_states",
    "chunk_gated_delta_rule_cpu": "initial_state",
    "fused_sigmoid_gating_delta_rule_update_cpu": "initial_state_source",
}


def clone(args):
    return {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in args.items()}


def positional(name, args):
    """``args`` in the schema's order (opcheck passes them as given)."""
    names = [a.name for a in getattr(OPS, name).default._schema.arguments]
    return tuple(args[n] for n in names if n in args)


# --- opcheck ----------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [BF, FP32])
@pytest.mark.parametrize("name", list(CASES))
def test_opcheck(name, dtype):
    opcheck(getattr(OPS, name), positional(name, CASES[name](dtype)))


@pytest.mark.parametrize(
    "name, make",
    [
        ("causal_conv1d_fwd_cpu", lambda: conv_fwd_args(FP32, packed=False)),
        ("causal_conv1d_update_cpu", lambda: conv_update_args(BF, spec=True)),
        ("chunk_gated_delta_rule_cpu", lambda: chunked_args(BF, lens=(3,), hk=1, hv=2, d=32)),
        ("fused_sigmoid_gating_delta_rule_update_cpu", lambda: recurrent_args(FP32, n=1)),
        ("rms_norm_gated", lambda: norm_args(BF, shape=(5, 48))),
    ],
)
def test_opcheck_other_forms(name, make):
    """The plain weight, speculative decoding, other head and row shapes."""
    opcheck(getattr(OPS, name), positional(name, make()))


# --- equal to numkern.gdn ---------------------------------------------------------------


def direct(name, args):
    """The same call through numkern.gdn's Python op: (outputs, mutated state)."""
    a = dict(args)
    a.pop("pad_slot_id", None)
    if name == "causal_conv1d_fwd_cpu":
        out = gdn.causal_conv1d_fwd(**a)
    elif name == "causal_conv1d_update_cpu":
        out = gdn.causal_conv1d_update(**a)
    elif name == "fused_gdn_gating_cpu":
        out = gdn.fused_gdn_gating(**a)
    elif name == "chunk_gated_delta_rule_cpu":
        out = gdn.chunk_gated_delta_rule(**a)[0]
    elif name == "fused_sigmoid_gating_delta_rule_update_cpu":
        out = gdn.fused_sigmoid_gating_delta_rule_update(**a)
    else:
        out = gdn.rms_norm_gated(**a)
    return out, a.get(MUTATED.get(name))


@pytest.mark.parametrize("name", list(CASES))
def test_equals_direct_call(name):
    args = CASES[name](BF)
    ours_args, theirs_args = clone(args), clone(args)
    ours = getattr(OPS, name)(**ours_args)
    theirs, state = direct(name, theirs_args)
    if name == "chunk_gated_delta_rule_cpu":
        ours, final = ours
    for o, t in zip(*(x if isinstance(x, tuple) else (x,) for x in (ours, theirs))):
        assert o.shape == t.shape and o.stride() == t.stride() and o.dtype == t.dtype
        assert torch.equal(o, t)
    if state is not None:
        assert torch.equal(ours_args[MUTATED[name]], state)
        assert not torch.equal(state, args[MUTATED[name]])  # the op did write
    if name == "chunk_gated_delta_rule_cpu":
        # a new tensor: the requests' final states (vLLM returns the pool itself)
        idx = args["initial_state_indices"]
        assert final.shape == (len(idx), HV, D, D)
        assert final.data_ptr() != ours_args["initial_state"].data_ptr()
        for n, s in enumerate(idx.tolist()):
            want = torch.zeros_like(final[n]) if s == -1 else state[s]
            assert torch.equal(final[n], want)


@pytest.mark.parametrize("shape, dt", [((64, 4), BF), ((32, 1, 2), FP32)])
def test_conv_weight_pack_op(shape, dt):
    """numkern's own ``causal_conv1d_weight_pack``: the direct call's tensor; opcheck;
    a dim that is no multiple of 32 refused by the op and its fake alike."""
    w = torch.randn(shape).to(dt)
    assert torch.equal(OPS.causal_conv1d_weight_pack(w), gdn.causal_conv1d_weight_pack(w))
    opcheck(OPS.causal_conv1d_weight_pack, (w,))
    bad = torch.randn(48, 4).to(dt)
    with pytest.raises(ValueError, match="dim a multiple of 32"):
        OPS.causal_conv1d_weight_pack(bad)
    with FakeTensorMode() as mode, pytest.raises(ValueError, match="dim a multiple of 32"):
        OPS.causal_conv1d_weight_pack(mode.from_tensor(bad))


def test_schemas_match_vllm():
    """vLLM's schema strings, apart from the declared writes (see docs §12.4)."""
    added = {
        "causal_conv1d_fwd_cpu": ("Tensor? conv_states,", "Tensor(a!)? conv_states,"),
        "chunk_gated_delta_rule_cpu": ("Tensor initial_state,", "Tensor(a!) initial_state,"),
    }
    # (the conv ops from _C in a child where this CPU's build lacks them: docs §9.1)
    schemas = oracle.schemas([name for name in CASES if name != "rms_norm_gated"])
    for name, theirs in schemas.items():
        if name in added:
            theirs = theirs.replace(*added[name])
        ours = str(getattr(OPS, name).default._schema).replace("numkern::", "", 1)
        assert ours == theirs


# --- vLLM -------------------------------------------------------------------------------

# vLLM's CPU GDN kernels: bf16, conv width 4 with dim a multiple of 32, D 64 for the rule;
# they use AVX512-BF16 (a build without it may die): probed once in a child.
PROBE = """
import numkern.torch_ops
from tests import test_torch_ops_gdn as t
for name, args in t.vllm_cases().items():
    if hasattr(torch.ops._C, name):  # (_C_AVX2 has no conv ops: test_vllm skips them)
        getattr(torch.ops._C, name)(**args)
"""


def vllm_cases():
    """Each op's bf16 case in vLLM's subset, keyword arguments of vLLM's schema."""
    cases = {
        "causal_conv1d_fwd_cpu": conv_fwd_args(BF),
        "causal_conv1d_update_cpu": conv_update_args(BF),
        "fused_gdn_gating_cpu": gating_args(BF, t_n=9, h=32),
        "chunk_gated_delta_rule_cpu": chunked_args(BF, lens=(1, 65, 30), hk=2, hv=4, d=64),
        "fused_sigmoid_gating_delta_rule_update_cpu": recurrent_args(BF, hk=2, hv=4, d=64),
    }
    # no padded request: vLLM's conv update with a slot of -1 corrupts the heap (seen:
    # munmap_chunk() abort), and its tests and callers pass live slots only
    cases["causal_conv1d_fwd_cpu"]["cache_indices"] = i32([2, 1, 0])
    cases["causal_conv1d_update_cpu"]["conv_state_indices"] = i32([1, 3, 0])
    cases["chunk_gated_delta_rule_cpu"]["initial_state_indices"] = i32([3, 0, 1])
    cases["fused_sigmoid_gating_delta_rule_update_cpu"]["initial_state_indices"] = i32([2, 1, 0])
    return cases


@pytest.fixture(scope="module")
def vllm_ops():
    oracle.require_op("GDN ops", PROBE)
    return oracle.ops()


def rel_err(ours, theirs):
    """Largest difference relative to the largest entry of ``theirs``."""
    return ((ours.double() - theirs.double()).abs().max() / theirs.double().abs().max()).item()


VLLM_OPS = (
    "causal_conv1d_fwd_cpu",
    "causal_conv1d_update_cpu",
    "fused_gdn_gating_cpu",
    "chunk_gated_delta_rule_cpu",
    "fused_sigmoid_gating_delta_rule_update_cpu",
)


@pytest.mark.parametrize("name", VLLM_OPS)
def test_vllm(vllm_ops, name):
    """numkern's ops against vLLM's on the same inputs (each op where the build vLLM loads
    here has it). Tolerances as in tests/test_gdn_conv.py, test_gdn_gating.py and
    test_gdn_rule.py (numkern.testing.tolerances): conv states
    bit equal and outputs within a bf16 unit (vLLM sums pairs of taps in another order); g
    within 2^-14 relative (vLLM's exp and log approximations), beta within a unit; the
    rule's outputs and states within 1.5% of the largest entry (vLLM rounds q, k, W, U and
    V' to bf16 on the way, and computes sigmoid(b) in bf16)."""
    oracle.require_in_build(name)
    args = vllm_cases()[name]
    ours_args, theirs_args = clone(args), clone(args)
    ours = getattr(OPS, name)(**ours_args)
    theirs = getattr(vllm_ops, name)(**theirs_args)
    if name.startswith("causal_conv1d"):
        assert torch.equal(ours_args["conv_states"], theirs_args["conv_states"])
        assert_within(ours, theirs.double(), theirs.double().abs(), ours.dtype, "gdn_conv")
    elif name == "fused_gdn_gating_cpu":
        t = tolerance("gdn_gating_vllm", FP32)
        assert torch.allclose(ours[0], theirs[0], rtol=t.rel, atol=t.abs)
        beta = theirs[1].double()
        assert_within(ours[1], beta, beta.abs(), ours[1].dtype, "gdn_gating")
    else:
        key = MUTATED[name]
        if name == "chunk_gated_delta_rule_cpu":
            (ours, final), (theirs, pool) = ours, theirs
            assert pool is theirs_args[key]  # vLLM returns the pool itself
            idx = args["initial_state_indices"].long()
            assert torch.equal(final, ours_args[key][idx])
        assert ours.shape == theirs.shape and ours.dtype == theirs.dtype
        bound = tolerance("gdn_rule_dp", BF).peak  # vLLM's bound
        assert rel_err(ours, theirs) <= bound, name
        assert rel_err(ours_args[key], theirs_args[key]) <= bound, name


# --- a GDN layer under torch.compile and torch.export -----------------------------------


class GDNLayer(torch.nn.Module):
    """The ops of a GDN layer: prefill (conv fwd, gating, chunked rule, gated norm) or
    decode (conv update, recurrent rule, gated norm) on its state buffers in vLLM's
    layouts, the conv state [S, W-1, dim] passed as a transposed view."""

    def __init__(self, dtype, num_slots=4):
        super().__init__()
        torch.manual_seed(6)
        w = torch.randn(DIM, W).to(dtype)
        self.register_buffer("conv_w", gdn.causal_conv1d_weight_pack(w))
        self.register_buffer("conv_b", torch.randn(DIM).to(dtype))
        self.A_log = torch.nn.Parameter(torch.randn(HV) * 0.5)
        self.dt_bias = torch.nn.Parameter(torch.randn(HV).to(dtype))
        self.norm_w = torch.nn.Parameter(torch.randn(D).to(dtype))
        self.register_buffer("conv_state", torch.randn(num_slots, W - 1, DIM).to(dtype))
        self.register_buffer("ssm_state", torch.randn(num_slots, HV, D, D) * 0.1)

    def qkv(self, y):
        """[T, dim] -> q, k [1, T, Hk, D], v [1, T, Hv, D]: column windows, no copy."""
        q = y[:, : HK * D].unflatten(1, (HK, D))[None]
        k = y[:, HK * D : 2 * HK * D].unflatten(1, (HK, D))[None]
        v = y[:, 2 * HK * D :].unflatten(1, (HV, D))[None]
        return q, k, v

    def forward(self, mixed, a, b, z, qsl, slots, init, prefill: bool):
        conv_state = self.conv_state.transpose(1, 2)
        if prefill:
            y = OPS.causal_conv1d_fwd_cpu(
                mixed.t(), self.conv_w, self.conv_b, conv_state, qsl, slots, init, True, -1, True
            ).t()
            q, k, v = self.qkv(y)
            g, beta = OPS.fused_gdn_gating_cpu(self.A_log, a, b, self.dt_bias)
            o, _ = OPS.chunk_gated_delta_rule_cpu(
                q, k, v, g, beta, self.ssm_state, True, qsl, False, True, slots
            )
            o = o[0]
        else:
            y = OPS.causal_conv1d_update_cpu(
                mixed, conv_state, self.conv_w, self.conv_b, True, None, slots, -1, True
            )
            q, k, v = self.qkv(y)
            o = OPS.fused_sigmoid_gating_delta_rule_update_cpu(
                self.A_log, self.dt_bias, q, k, v, a, b, self.ssm_state, slots, qsl, True
            )[:, 0]
        return OPS.rms_norm_gated(o, z, self.norm_w, EPS)


def layer_inputs(prefill):
    torch.manual_seed(7)
    lens = (5, 0, 70) if prefill else (1, 1, 1)
    t_n = sum(lens)
    cu = [0]
    for n in lens:
        cu.append(cu[-1] + n)
    return (
        torch.randn(t_n, DIM).to(BF),
        torch.randn(t_n, HV).to(BF),
        torch.randn(t_n, HV).to(BF),
        torch.randn(t_n, HV, D).to(BF),
        i32(cu),
        i32([2, -1, 0]),
        torch.tensor([True, False, False]),
        prefill,
    )


def run_layer(fn, prefill):
    """``fn(*inputs)`` on a fresh layer: (output, conv state, ssm state)."""
    layer = GDNLayer(BF)
    with torch.no_grad():
        out = fn(layer)(*layer_inputs(prefill))
    return out, layer.conv_state, layer.ssm_state


def assert_same_run(got, want):
    for g, w in zip(got, want):
        assert torch.equal(g, w)
    assert not torch.equal(want[1], GDNLayer(BF).conv_state)  # the states were written
    assert not torch.equal(want[2], GDNLayer(BF).ssm_state)


def _inductor_reason():
    return "" if shutil.which("g++") or shutil.which("c++") else "no C++ compiler for inductor"


# inductor's import of torch.jit code warns (torch's own, not ours to fix)
@pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")
@pytest.mark.parametrize("prefill", [True, False], ids=["prefill", "decode"])
@pytest.mark.parametrize("backend", ["eager", "aot_eager", "inductor"])
def test_compile(backend, prefill):
    if backend == "inductor" and _inductor_reason():
        pytest.skip(_inductor_reason())
    torch._dynamo.reset()
    want = run_layer(lambda m: m, prefill)
    got = run_layer(lambda m: torch.compile(m, backend=backend, fullgraph=True), prefill)
    assert_same_run(got, want)


@pytest.mark.parametrize("prefill", [True, False], ids=["prefill", "decode"])
def test_export(prefill):
    want = run_layer(lambda m: m, prefill)
    layer = GDNLayer(BF)
    with torch.no_grad():
        ep = torch.export.export(layer, layer_inputs(prefill))
    names = {str(n.target) for n in ep.graph.nodes if n.op == "call_function"}
    assert any("numkern" in n for n in names)
    mod = ep.module()  # the exported program writes the mutated buffers back into it
    with torch.no_grad():
        out = mod(*layer_inputs(prefill))
    assert torch.equal(out, want[0])
    assert torch.equal(mod.conv_state, want[1]) and torch.equal(mod.ssm_state, want[2])


# --- errors -----------------------------------------------------------------------------


def fake_call(name, args):
    """The op's fake kernel, through FakeTensorMode."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode() as mode:
        fake = {
            k: mode.from_tensor(v) if isinstance(v, torch.Tensor) else v for k, v in args.items()
        }
        return getattr(OPS, name)(**fake)


@pytest.mark.parametrize("fake", [False, True], ids=["real", "fake"])
@pytest.mark.parametrize("name", ["causal_conv1d_fwd_cpu", "causal_conv1d_update_cpu"])
def test_pad_slot_id(name, fake):
    args = CASES[name](BF)
    args["pad_slot_id"] = -2
    before = args["conv_states"].clone()
    with pytest.raises(ValueError, match=r"^pad_slot_id: expected -1 .*got -2"):
        (fake_call if fake else lambda n, a: getattr(OPS, n)(**a))(name, args)
    assert torch.equal(args["conv_states"], before)


@pytest.mark.parametrize("name", list(CASES))
def test_requires_grad_refused(name):
    args = CASES[name](FP32)
    arg = next(k for k, v in args.items() if isinstance(v, torch.Tensor) and v.is_floating_point())
    args[arg].requires_grad_(True)
    with pytest.raises(TypeError, match=rf"^{arg}: expected a tensor that does not require grad"):
        getattr(OPS, name)(**args)
    with torch.no_grad():  # a Parameter in an inference run is fine
        getattr(OPS, name)(**args)


WRONG = [
    # (op, argument, new value, exception, message)
    ("causal_conv1d_fwd_cpu", "bias", torch.zeros(DIM + 1, dtype=BF), ValueError, "shape"),
    ("causal_conv1d_fwd_cpu", "conv_states", None, TypeError, "got None"),
    ("causal_conv1d_fwd_cpu", "cache_indices", i32([0, 1]), ValueError, "shape"),
    ("causal_conv1d_update_cpu", "x", torch.zeros(3, DIM + 32, dtype=BF), ValueError, "dim"),
    ("causal_conv1d_update_cpu", "conv_state_indices", torch.zeros(3, dtype=torch.int64),
     TypeError, "int32"),
    ("fused_gdn_gating_cpu", "b", torch.zeros(5, HV + 1, dtype=BF), ValueError, "shape"),
    ("fused_gdn_gating_cpu", "dt_bias", torch.zeros(HV), TypeError, "dtype"),
    ("chunk_gated_delta_rule_cpu", "value", torch.zeros(1, 74, HV, D + 1, dtype=BF),
     ValueError, "Dv"),
    ("chunk_gated_delta_rule_cpu", "initial_state", torch.zeros(4, HV, D, D, dtype=BF),
     TypeError, "float32"),
    ("chunk_gated_delta_rule_cpu", "cu_seqlens", i32([0, 74]), ValueError, "4 entries"),
    ("chunk_gated_delta_rule_cpu", "head_first", True, ValueError, "False"),
    ("fused_sigmoid_gating_delta_rule_update_cpu", "a", torch.zeros(4, HV, dtype=BF),
     ValueError, "shape"),
    ("fused_sigmoid_gating_delta_rule_update_cpu", "initial_state_source",
     torch.zeros(4, HV, D, 2 * D), ValueError, "shape"),
    ("rms_norm_gated", "z", torch.zeros(3, HV, D + 1, dtype=BF), ValueError, "shape"),
    ("rms_norm_gated", "weight", torch.zeros(D, dtype=torch.float16), TypeError, "dtype"),
    ("rms_norm_gated", "x", torch.zeros(3, HV, D, device="meta", dtype=BF), TypeError, "CPU"),
]  # fmt: skip


@pytest.mark.parametrize("fake", [False, True], ids=["real", "fake"])
@pytest.mark.parametrize("name, arg, value, exc, match", WRONG)
def test_wrong_inputs(name, arg, value, exc, match, fake):
    """The real and the fake kernel refuse the same inputs, naming the argument; the real
    one writes nothing."""
    args = CASES[name](BF)
    args[arg] = value
    key = MUTATED.get(name)
    before = None if args.get(key) is None else args[key].clone()
    call = fake_call if fake else lambda n, a: getattr(OPS, n)(**a)
    with pytest.raises(exc, match=rf"^{arg}: .*{match}"):
        call(name, args)
    if before is not None:
        assert torch.equal(args[key], before)
