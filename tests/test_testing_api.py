"""numkern.testing's public helpers: ``assert_close`` (its unit is the output dtype's
last place: n ulps pass, n+1 fail and are named) and the input builders (valid inputs of
the ops, accepted by them)."""

import ast
import importlib
import inspect
import os
import platform
import re
import subprocess
import sys

import numpy as np
import pytest
import torch

import numkern
from numkern import attention as A
from numkern.testing import assert_close, packed_weight, random_block_table, random_routing
from numkern.testing import reference as refs
from numkern.testing.compare import DEFAULT_ULPS, ulp
from numkern.testing.tolerances import tolerance

from .conftest import ROOT, run_child


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_assert_close_counts_ulps(dtype):
    e = torch.tensor([1.5, -3.25, 1000.0, 0.0625], dtype=torch.float64)
    unit = ulp(e.to(dtype), dtype)
    n = DEFAULT_ULPS[dtype]
    assert_close((e + n * unit).to(dtype), e)  # n ulps: close
    assert_close((e - n * unit).to(dtype), e)
    bad = e + n * unit
    bad[2] = e[2] + (n + 1) * unit[2]  # one ulp too many, at index 2
    with pytest.raises(AssertionError) as info:
        assert_close(bad.to(dtype), e)
    msg = str(info.value)
    assert msg.startswith(f"1 of 4 elements differ by more than {n} ulp")
    assert "index (2,)" in msg and "index (0,)" not in msg
    assert_close(bad.to(dtype), e, ulps=n + 1)  # the bound moves with ulps


def test_assert_close_nan_inf_shape_and_atol():
    e = torch.tensor([[float("nan"), float("inf")], [1.0, 0.0]])
    assert_close(e.clone(), e)
    with pytest.raises(AssertionError, match=r"index \(0, 0\)"):
        assert_close(torch.tensor([[0.0, float("inf")], [1.0, 0.0]]), e)  # NaN expected
    with pytest.raises(AssertionError, match=r"index \(0, 1\)"):
        assert_close(torch.tensor([[float("nan"), -float("inf")], [1.0, 0.0]]), e)
    near_zero = torch.tensor([[float("nan"), float("inf")], [1.0, 1e-6]])
    with pytest.raises(AssertionError, match=r"index \(1, 1\)"):
        assert_close(near_zero, e)
    assert_close(near_zero, e, atol=1e-5)
    with pytest.raises(ValueError, match="expected: shape"):
        assert_close(e, e[0])
    with pytest.raises(TypeError, match="actual: expected a float dtype"):
        assert_close(e.int(), e)


def test_random_block_table_is_a_valid_step():
    bt = random_block_table([5, 37, 1], [5, 1, 1], block_size=16, num_blocks=8, seed=3)
    assert bt.block_table.dtype == torch.int32 and bt.block_table.shape == (3, 3)
    used = bt.block_table[bt.block_table >= 0]
    assert used.unique().numel() == used.numel() == 1 + 3 + 1  # distinct blocks
    assert bt.query_start_loc.tolist() == [0, 5, 6, 7]
    assert bt.slot_mapping.unique().numel() == 7
    # request 1's new key is position 36: block 36 // 16 = 2 of its row, offset 4
    assert bt.slot_mapping[5] == bt.block_table[1, 2] * 16 + 4
    A.plan_attention(
        bt.query_start_loc,
        bt.seq_lens,
        num_heads=4,
        num_kv_heads=2,
        head_dim=32,
        block_size=16,
        isa="vec16",
        block_table=bt.block_table,
        slot_mapping=bt.slot_mapping,
        num_blocks=8,
    )  # fmt: skip  (the op's own checks accept it)
    with pytest.raises(ValueError, match="num_blocks: the requests need 5 blocks"):
        random_block_table([5, 37, 1], [5, 1, 1], block_size=16, num_blocks=4)
    with pytest.raises(ValueError, match=r"query_lens\[0\]: expected <= seq_lens\[0\]"):
        random_block_table([5], [6], block_size=16, num_blocks=4)


def test_random_routing_and_packed_weight():
    w, ids = random_routing(9, 16, 4, seed=1)
    assert ids.dtype == torch.int32 and w.dtype == torch.float32 and ids.shape == (9, 4)
    assert all(len(set(r)) == 4 for r in ids.tolist()) and 0 <= ids.min() and ids.max() < 16
    torch.testing.assert_close(w.sum(1), torch.ones(9))
    with pytest.raises(ValueError, match="topk: expected <= num_experts"):
        random_routing(1, 2, 3)
    raw, packed = packed_weight(48, 64, torch.bfloat16, seed=2)
    x = torch.randn(3, 64).to(torch.bfloat16)
    out = torch.empty(3, 48, dtype=torch.bfloat16)
    numkern.weight_packed_linear(out, x, packed, None, True)
    assert_close(out, x.float() @ raw.float().T)


# ---------------------------------------------------------------------------------------
# numkern.testing.reference: each op's reference takes the op's own arguments, returns
# what the op writes or returns, writes nothing, and agrees with the op

BF = torch.bfloat16

# the modules of the ops: every public op of docs/kernels.md §4-§7 and §11
OPS = {
    "numkern.gemm": ("convert_weight_packed", "weight_packed_linear", "weight_packed_linear_cpu"),
    "numkern.moe": ("topk_softmax", "grouped_topk", "prepack_moe_weight", "fused_moe"),
    "numkern.attention": ("reshape_and_cache", "paged_attention"),
    "numkern.norm": ("rms_norm", "fused_add_rms_norm"),
    "numkern.rope": ("rotary_embedding",),
    "numkern.gdn.conv": ("causal_conv1d_fwd", "causal_conv1d_update", "causal_conv1d_weight_pack"),
    "numkern.gdn.gating": ("fused_gdn_gating",),
    "numkern.gdn.rule": ("fused_sigmoid_gating_delta_rule_update", "chunk_gated_delta_rule"),
    "numkern.gdn.norm": ("rms_norm_gated",),
}


def _bits(t):
    """A float tensor's raw bits (compares NaNs too); other tensors as they are."""
    if not t.is_floating_point():
        return t
    return t.view({2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def call(name, *args, **kwargs):
    """``reference.<name>(...)``, checking that it wrote none of its tensor arguments."""
    tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
    before = [t.clone() for t in tensors]
    result = getattr(refs, name)(*args, **kwargs)
    for t, b in zip(tensors, before):
        assert torch.equal(_bits(t), _bits(b)), f"reference.{name} wrote an argument"
    return result


@pytest.mark.parametrize("module", sorted(OPS))
def test_references_take_the_ops_arguments(module):
    """Same names, order, kinds and defaults as the op."""
    mod = importlib.import_module(module)
    for name in OPS[module]:
        assert name in refs.__all__
        assert inspect.signature(getattr(refs, name)) == inspect.signature(getattr(mod, name))


def test_gemm_references():
    g = torch.Generator().manual_seed(1)
    w, packed = packed_weight(40, 64, BF, seed=1)  # N = 40: a 32-row block and a short one
    assert torch.equal(call("convert_weight_packed", w), packed)
    assert torch.equal(refs.unpack_weight_packed(packed), w)
    x, bias = torch.randn(3, 64, generator=g).to(BF), torch.randn(40, generator=g)
    out = torch.empty(3, 40, dtype=BF)
    numkern.weight_packed_linear(out, x, packed, bias, True)
    # atol: fp32 sums of 64 terms of ~1 in two orders, where they cancel to near zero
    t = tolerance("linear_assert_close", BF)
    expected = call("weight_packed_linear", out, x, packed, bias, True)
    assert_close(out, expected, ulps=t.ulps, atol=t.abs)
    x3 = torch.randn(2, 3, 64, generator=g).to(BF)
    expected = call("weight_packed_linear_cpu", x3, packed, 40, bias=bias)
    assert expected.shape == (2, 3, 40)
    out3 = numkern.weight_packed_linear_cpu(x3, packed, 40, bias)
    assert_close(out3, expected, ulps=t.ulps, atol=t.abs)
    w32 = torch.randn(33, 5, generator=g)  # fp32: [K, nb] blocks, any K
    assert torch.equal(call("convert_weight_packed", w32), numkern.convert_weight_packed(w32))


def test_routing_and_moe_references():
    from numkern import moe

    g = torch.Generator().manual_seed(2)
    logits = torch.randn(13, 16, generator=g).to(BF)  # bf16 logits tie often
    w, ids = moe.topk_softmax(logits, 4, True)
    ref_w, ref_ids = call("topk_softmax", logits, 4, True)
    assert torch.equal(ids, ref_ids)
    assert_close(w, ref_w)
    bias = torch.randn(16, generator=g) * 0.1
    kw = dict(scoring_func="sigmoid", routed_scaling_factor=2.5, e_score_correction_bias=bias)
    w, ids = moe.grouped_topk(logits, 4, True, 4, 2, **kw)
    ref_w, ref_ids = call("grouped_topk", logits, 4, True, 4, 2, **kw)
    assert torch.equal(ids, ref_ids)
    assert_close(w, ref_w)

    tw, ti = random_routing(9, 8, 2, seed=3)
    x = torch.randn(9, 128, generator=g).to(BF)
    w13 = (torch.randn(8, 256, 128, generator=g) / 128**0.5).to(BF)
    w2 = (torch.randn(8, 128, 128, generator=g) / 128**0.5).to(BF)
    for isa in ("vec", "amx"):
        packed = moe.prepack_moe_weight(w13, isa)
        assert torch.equal(call("prepack_moe_weight", w13, isa), packed)
        assert torch.equal(refs.unpack_moe_weight(packed, isa), w13)
    p13, p2 = moe.prepack_moe_weight(w13, "vec"), moe.prepack_moe_weight(w2, "vec")
    out = torch.full_like(x, float("nan"))
    moe.fused_moe(out, x, p13, p2, None, None, tw, ti, activation="silu", isa="vec")
    ref = call("fused_moe", out, x, p13, p2, None, None, tw, ti, activation="silu", isa="vec")
    # atol: an activation rounded one unit the other way moves a sum by a fraction of one
    t = tolerance("moe_assert_close", BF)
    assert_close(out, ref, ulps=t.ulps, atol=t.peak * ref.abs().max().item())


@pytest.mark.parametrize("isa", ["vec", "amx"])
def test_attention_references(isa):
    """A mixed step (two decodes, a chunked prefill) through shuffled blocks; the cache
    written for all keys first (unwritten slots NaN), then attention with sinks; with a
    plan, the reference reads the plan's copies of the indices as the op does."""
    g = torch.Generator().manual_seed(4)
    hq, hkv, d, b, nb = 4, 2, 64, 32, 12
    seq_lens, query_lens = [70, 5, 33], [1, 1, 9]
    full = random_block_table(seq_lens, seq_lens, b, nb, seed=5)  # every key, for the write
    step = random_block_table(seq_lens, query_lens, b, nb, seed=5)  # this step's queries
    assert torch.equal(full.block_table, step.block_table)
    kc, vc = A.split_kv_cache(torch.full(A.kv_cache_shape(nb, hkv, b, d), float("nan"), dtype=BF))
    k = torch.randn(sum(seq_lens), hkv, d, generator=g).to(BF)
    v = torch.randn(sum(seq_lens), hkv, d, generator=g).to(BF)
    exp_k, exp_v = call("reshape_and_cache", k, v, kc, vc, full.slot_mapping, isa)
    A.reshape_and_cache(k, v, kc, vc, full.slot_mapping, isa)
    assert torch.equal(_bits(kc), _bits(exp_k)) and torch.equal(_bits(vc), _bits(exp_v))
    if isa == "amx":
        return  # the amx layout computes as vec (tests/test_attention.py)
    q = torch.randn(sum(query_lens), hq, d, generator=g).to(BF)
    sinks = torch.randn(hq, generator=g)
    kw = dict(scale=d**-0.5, sinks=sinks, isa=isa)
    out = torch.full_like(q, float("nan"))
    args = (step.query_start_loc, step.seq_lens, step.block_table)
    A.paged_attention(q, kc, vc, out, *args, **kw)
    ref = call("paged_attention", q, kc, vc, out, *args, **kw)
    t = tolerance("attention_assert_close", BF)
    assert_close(out, ref, ulps=t.ulps, atol=t.abs)  # fp32 accumulation
    plan = A.plan_attention(
        step.query_start_loc,
        step.seq_lens,
        num_heads=hq,
        num_kv_heads=hkv,
        head_dim=d,
        block_size=b,
        isa=isa,
        block_table=step.block_table,
        num_blocks=nb,
    )
    zeros = (torch.zeros_like(step.query_start_loc), torch.zeros_like(step.seq_lens))
    planned = call("paged_attention", q, kc, vc, None, *zeros, step.block_table, plan=plan, **kw)
    assert torch.equal(planned, ref)


def test_norm_and_rotary_references():
    from numkern import norm, rope

    g = torch.Generator().manual_seed(6)
    x, res = torch.randn(5, 96, generator=g).to(BF), torch.randn(5, 96, generator=g).to(BF)
    w = torch.randn(96, generator=g)
    out = torch.empty_like(x)
    norm.rms_norm(out, x, w, 1e-6)
    assert_close(out, call("rms_norm", out, x, w, 1e-6))
    x_np, w_np = x.float().numpy(), w.numpy()  # NumPy inputs, as the op takes them
    out_np = np.empty_like(x_np)
    norm.rms_norm(out_np, x_np, w_np, 1e-6)
    assert_close(torch.from_numpy(out_np), call("rms_norm", None, x_np, w_np, 1e-6))
    exp_x, exp_res = call("fused_add_rms_norm", x, res, w, 1e-6)
    norm.fused_add_rms_norm(x, res, w, 1e-6)
    assert torch.equal(res, exp_res)
    assert_close(x, exp_x)

    pos = torch.tensor([0, 7, 3, 11], dtype=torch.int64)
    ang = torch.arange(12.0)[:, None] * 10000 ** (-torch.arange(0, 24, 2) / 24)
    cache = torch.cat([ang.cos(), ang.sin()], 1)  # rot 24 of a 32 head: partial rotary
    for neox in (True, False):
        q = torch.randn(4, 3 * 32, generator=g).to(BF)
        k = torch.randn(4, 2, 32, generator=g).to(BF)
        exp_q, exp_k = call("rotary_embedding", pos, q, k, 32, cache, neox)
        rope.rotary_embedding(pos, q, k, 32, cache, neox)
        assert_close(q, exp_q)
        assert_close(k, exp_k)
        assert call("rotary_embedding", pos, q, None, 32, cache, neox)[1] is None


def test_gdn_conv_and_gating_references():
    from numkern.gdn import conv, gating

    g = torch.Generator().manual_seed(7)
    dim, width = 64, 4
    w = torch.randn(dim, width, generator=g).to(BF)
    packed = conv.causal_conv1d_weight_pack(w)
    assert torch.equal(call("causal_conv1d_weight_pack", w), packed)
    assert torch.equal(refs.unpack_conv_weight(packed), w)
    bias = torch.randn(dim, generator=g).to(BF)
    # vLLM's layouts: x [dim, T] over [T, dim]; states [S, dim, L] over [S, L, dim]
    x = torch.randn(9, dim, generator=g).to(BF).t()
    st = torch.randn(4, width - 1, dim, generator=g).to(BF).transpose(1, 2)
    qsl, slots = torch.tensor([0, 5, 5, 9], dtype=torch.int32), torch.tensor([2, 0, -1])
    init = torch.tensor([True, False, False])
    args = (x, packed, bias, st, qsl, slots.int(), init, True, True)
    exp_out, exp_st = call("causal_conv1d_fwd", *args)
    out = conv.causal_conv1d_fwd(*args)
    # atol: fp32 sums of 4 taps of ~1 cancelling near zero
    t = tolerance("gdn_conv_assert_close", BF)
    assert_close(out, exp_out, ulps=t.ulps, atol=t.abs)
    assert torch.equal(st, exp_st)
    x3 = torch.randn(2, 5, dim, generator=g).to(BF).transpose(1, 2)  # [R, dim, T]
    args = (x3, w, None, st, None, None, None, False, False)
    exp_out, exp_st = call("causal_conv1d_fwd", *args)
    assert_close(conv.causal_conv1d_fwd(*args), exp_out, ulps=t.ulps, atol=t.abs)
    assert torch.equal(st, exp_st)
    xu = torch.randn(3, dim, generator=g).to(BF)
    args = (xu, st, packed, bias, True, torch.tensor([3, -1, 1], dtype=torch.int32), True)
    exp_out, exp_st = call("causal_conv1d_update", *args)
    assert_close(conv.causal_conv1d_update(*args), exp_out, ulps=t.ulps, atol=t.abs)
    assert torch.equal(st, exp_st)
    wide = torch.randn(3, width + 1, dim, generator=g).to(BF).transpose(1, 2)  # L = W + 1
    xs = torch.randn(2, 2, dim, generator=g).to(BF)  # q = 2 tokens each
    slots, accepted = torch.tensor([2, 0], dtype=torch.int32), torch.tensor([2, 1]).int()
    args = (xs, wide, w, bias, False, slots, False, accepted)
    exp_out, exp_st = call("causal_conv1d_update", *args)
    assert_close(conv.causal_conv1d_update(*args), exp_out, ulps=t.ulps, atol=t.abs)
    assert torch.equal(wide, exp_st)

    A_log, dt_bias = torch.randn(8, generator=g), (torch.randn(8, generator=g) * 8).to(BF)
    a, b = (torch.randn(2, 5, 8, generator=g) * 8).to(BF)
    g_out, beta = gating.fused_gdn_gating(A_log, a, b, dt_bias)
    exp_g, exp_beta = call("fused_gdn_gating", A_log, a, b, dt_bias)
    assert exp_g.shape == g_out.shape == (1, 5, 8)
    assert_close(g_out, exp_g)
    assert_close(beta, exp_beta)


def test_gdn_rule_and_norm_references():
    from numkern.gdn import norm, rule

    g = torch.Generator().manual_seed(8)
    hk, hv, dk, dv, t_n = 1, 2, 16, 32, 7
    q, k = (torch.randn(2, 1, t_n, hk, dk, generator=g) * dk**-0.5).to(BF)
    v = torch.randn(1, t_n, hv, dv, generator=g).to(BF)
    cu, slots = torch.tensor([0, 1, 3, 7], dtype=torch.int32), torch.tensor([2, -1, 0]).int()
    A_log, dt_bias = torch.randn(hv, generator=g) * 0.5, torch.randn(hv, generator=g).to(BF)
    a, b = torch.randn(2, t_n, hv, generator=g).to(BF)
    pool = torch.randn(3, hv, dk, dv, generator=g) * 0.1
    args = (A_log, dt_bias, q, k, v, a, b, pool, slots, cu, True)
    exp_out, exp_pool = call("fused_sigmoid_gating_delta_rule_update", *args)
    out = rule.fused_sigmoid_gating_delta_rule_update(*args)
    # atol: fp32 arithmetic over the recurrence, relative to the largest output (the
    # table's gdn_rule, as tests/test_gdn_rule.py)
    slack = tolerance("gdn_rule", torch.float32).peak
    assert_close(out, exp_out, atol=slack * exp_out.abs().max().item())
    assert_close(pool, exp_pool, atol=slack * exp_pool.abs().max().item())
    gate = -torch.rand(1, t_n, hv, generator=g) * 0.2
    beta = torch.rand(1, t_n, hv, generator=g).to(BF)
    args = (q, k, v, gate, beta, pool, True, cu, False, False, slots)
    exp_out, exp_pool = call("chunk_gated_delta_rule", *args)
    out, same = rule.chunk_gated_delta_rule(*args)
    assert same is pool
    # bf16 inputs where the CPU has AVX512-BF16: the bf16 path, held to DP_BOUND of the
    # largest entry (the table's gdn_rule_dp, docs/kernels.md §11.5)
    rel = tolerance("gdn_rule_dp", BF).peak if rule.DP_BF16 else slack
    assert_close(out, exp_out, atol=rel * exp_out.abs().max().item())
    assert_close(pool, exp_pool, atol=rel * exp_pool.abs().max().item())

    x, z = torch.randn(2, 5, 3, 128, generator=g).to(BF)
    weight = torch.randn(128, generator=g).to(BF)
    assert_close(
        norm.rms_norm_gated(x, z, weight, 1e-6), call("rms_norm_gated", x, z, weight, 1e-6)
    )


# ---------------------------------------------------------------------------------------
# a light `import numkern`: no torch, no Numba; the start-up still precedes every kernel

_LIGHT = """
import sys
import numkern, numkern.testing
heavy = [m for m in ("torch", "numba", "numkern._boot") if m in sys.modules]
assert not heavy, heavy
import torch
from numkern.testing import assert_close, reference
x, w = torch.randn(3, 32).bfloat16(), torch.randn(32)
out = torch.empty_like(x)
numkern.norm.rms_norm(out, x, w, 1e-6)  # the first op: the boot, then the kernel
assert_close(out, reference.rms_norm(out, x, w, 1e-6))
import numba
assert numba.config.THREADING_LAYER == "threadsafe", numba.config.THREADING_LAYER
from numkern.warmup import prepare  # loads the submodule numkern.warmup ...
assert numkern.warmup.__name__ == "warmup" and callable(numkern.warmup)  # ... the function
print("ok")
"""

# a mask set after `import numkern` still reaches Numba's code generator: the first
# kernel module runs the boot before it defines a kernel (a mask set before the import
# is applied by the import itself: tests/test_isa.py's bad masks fail `import numkern`)
_LATE_MASK = """
import os, sys
import numkern
assert "numkern._boot" not in sys.modules
os.environ["NUMKERN_CPU_FEATURES"] = "-{f}"
from numkern import norm  # defines kernels: creates Numba's code generator
from numba.core import config, registry
assert "_toplevel_target_context" in vars(registry.cpu_target)
assert "-{f}" in config.CPU_FEATURES.split(","), config.CPU_FEATURES
assert not numkern.cpu_features()["{f}"]
print("ok")
"""


def _x86():
    return platform.machine().lower() in ("x86_64", "amd64")


def test_import_numkern_is_light_and_an_op_then_works():
    assert run_child(_LIGHT).split() == ["ok"]


def test_a_mask_set_after_import_reaches_numba():
    f = "avx2" if _x86() else "neon"
    assert run_child(_LATE_MASK.replace("{f}", f)).split() == ["ok"]


def _imports(path):
    """The module names a file imports at its top level (relative ones as '.name')."""
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read())
    names = set()
    for node in tree.body:
        if isinstance(node, ast.Import):
            names |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                mod = node.module.split(".")[-1] if node.module else None
                names |= {f".{mod}"} if mod else {f".{a.name}" for a in node.names}
            else:
                names.add(node.module.split(".")[0])
    return names


def test_every_module_that_imports_numba_boots_first():
    """A numkern module that imports Numba imports the boot, directly or through
    numkern._jit or numkern.simd (which import it before anything else of theirs)."""
    root = os.path.dirname(numkern.__file__)
    gateways = {"._boot", "._jit", ".simd"}
    assert {"._boot"} <= _imports(os.path.join(root, "_jit.py"))
    assert {"._boot"} <= _imports(os.path.join(root, "simd.py"))
    missing = []
    for folder, _, files in os.walk(root):
        for name in files:
            path = os.path.join(folder, name)
            rel = os.path.relpath(path, root)
            if not name.endswith(".py") or rel in ("_boot.py", "_threads.py"):
                continue
            found = _imports(path)
            if "numba" in found and not found & gateways:
                missing.append(rel)
    assert not missing, f"import numba without numkern's boot first: {missing}"


# ---------------------------------------------------------------------------------------
# docs/testing.md runs as written

DOC = os.path.join(ROOT, "docs", "testing.md")
_FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)


def test_testing_doc_runs_as_written(tmp_path):
    """The Python blocks in order in one fresh process (each ``text`` block must be in
    what they print); each block opening with ``# test_*.py`` as a pytest file there."""
    with open(DOC, encoding="utf-8") as f:
        blocks = _FENCE.findall(f.read())
    script, files = [], []
    for lang, body in blocks:
        first = body.split("\n", 1)[0]
        if lang == "python" and re.fullmatch(r"# (test_\w+\.py)", first):
            files.append(first[2:])
            (tmp_path / first[2:]).write_text(body)
        elif lang == "python":
            script.append(body)
    assert len(script) >= 2 and files, "docs/testing.md: the examples are missing"
    printed = run_child("\n".join(script))
    if os.environ.get("NUMKERN_REQUIRE_VLLM") == "1":  # CI: the vLLM example must run
        assert "vLLM's CPU ops:" not in printed, printed
    for lang, body in blocks:
        if lang == "text":
            assert body.strip() in printed, f"not printed by the examples:\n{body}"
    env = {k: v for k, v in os.environ.items() if k != "PYTEST_DISABLE_PLUGIN_AUTOLOAD"}
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", *files],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=env,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
