"""numkern.moe: routing, packing, fused_moe against a per-expert torch loop, workspace."""

import itertools
import math

import numpy as np
import pytest
import torch

from numkern import isa as isa_mod
from numkern import moe
from numkern.testing import reference as refs
from numkern.testing.tolerances import tolerance

from . import oracle

# ---------------------------------------------------------------------------------------
# reference


def act_reference(gu, activation, dtype):
    """Activation in fp32 of ``gu [rows, 2I]``, rounded to ``dtype`` as the kernel does."""
    return refs.moe_activation(gu, activation, dtype)


def moe_reference(x, w13, w2, b13, b2, tw, ti, activation, skip_weighted=False):
    """Loop over experts in fp32; returns (out fp32 [T, H], scale = sum of |terms|)."""
    return refs.moe_experts(x, w13, w2, b13, b2, tw, ti, activation, skip_weighted, magnitude=True)


def assert_close_moe(out, ref, scale, units=1.0):
    """One output rounding (one unit of the dtype) plus activation roundings that may land
    one unit apart (a quarter unit of the sum of |terms|): the table's moe bound, ``units``
    times (numkern.testing.tolerances)."""
    t = tolerance("moe", out.dtype)
    u = t.rel * units
    bound = u * ref.abs() + max(u / 4, t.mag) * scale + t.abs
    ratio = ((out.float() - ref).abs() / bound).max().item()
    assert ratio <= 1.0, f"max err/bound {ratio:.3g}"


def make_case(t_n, e_n, k, h, i_n, dtype, bias, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t_n, h, generator=g).to(dtype)
    w13 = (torch.randn(e_n, 2 * i_n, h, generator=g) / math.sqrt(h)).to(dtype)
    w2 = (torch.randn(e_n, h, i_n, generator=g) / math.sqrt(i_n)).to(dtype)
    b13 = torch.randn(e_n, 2 * i_n, generator=g).to(dtype) if bias else None
    b2 = torch.randn(e_n, h, generator=g).to(dtype) if bias else None
    tw, ti = moe.topk_softmax(torch.randn(t_n, e_n, generator=g), k, True)
    return x, w13, w2, b13, b2, tw, ti


def run_moe(x, w13, w2, b13, b2, tw, ti, activation, isa, skip_weighted=False):
    out = torch.full_like(x, float("nan"))
    moe.fused_moe(out, x, moe.prepack_moe_weight(w13, isa), moe.prepack_moe_weight(w2, isa),
                  b13, b2, tw, ti, activation=activation, skip_weighted=skip_weighted,
                  isa=isa)  # fmt: skip
    return out


BF, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32
# the fallback run (tests/test_fallback.py): the bf16 and fp32 vec kernels an AVX2 CPU runs
FALLBACK = pytest.mark.fallback

# (T, E, k, H, I, dtype, isa, activation, bias): every listed value at least once
CASES = [
    pytest.param(1, 8, 1, 128, 128, BF, "vec", "silu", False, marks=FALLBACK),
    (3, 8, 2, 2880, 256, BF, "amx", "swigluoai", True),
    (1, 8, 2, 256, 2880, BF, "vec", "gelu", True),
    pytest.param(64, 128, 8, 256, 128, BF, "vec", "gelu", True, marks=FALLBACK),
    (257, 64, 4, 128, 256, FP32, "vec", "gelu_tanh", True),
    (257, 8, 2, 256, 128, FP16, "vec", "silu", True),
    (64, 8, 4, 128, 128, BF, "amx", "gelu_tanh", False),
    (3, 128, 8, 128, 256, FP16, "vec", "swigluoai", False),
    pytest.param(64, 64, 2, 128, 256, FP32, "vec", "swigluoai", True, marks=FALLBACK),
    (257, 128, 1, 256, 128, BF, "amx", "silu", True),
]


@pytest.mark.parametrize("t_n,e_n,k,h,i_n,dtype,isa,activation,bias", CASES)
def test_fused_moe_matches_reference(t_n, e_n, k, h, i_n, dtype, isa, activation, bias):
    case = make_case(t_n, e_n, k, h, i_n, dtype, bias)
    tw_before = case[5].clone()
    out = run_moe(*case, activation, isa)
    ref, scale = moe_reference(*case, activation)
    assert_close_moe(out, ref, scale)
    assert torch.equal(case[5], tw_before)  # topk_weights never modified


@FALLBACK
@pytest.mark.parametrize("activation,other", [("gelu", "gelu_tanh"), ("gelu_tanh", "gelu")])
def test_fp32_gelu_is_the_one_asked_for(activation, other):
    """erf-GELU and its tanh approximation differ by up to 4.7e-4 (|g| near 2.7): within the
    bf16 tolerance, far outside fp32's. Gate pre-activations of variance 2 (with the bias)."""
    case = make_case(33, 8, 2, 128, 128, FP32, True)
    out = run_moe(*case, activation, "vec")
    ref, scale = moe_reference(*case, activation)
    assert_close_moe(out, ref, scale)
    swapped, _ = moe_reference(*case, other)
    with pytest.raises(AssertionError):
        assert_close_moe(out, swapped, scale)


@pytest.mark.parametrize("dtype,isa", [pytest.param(FP32, "vec", marks=FALLBACK), (BF, "amx")])
def test_saturated_silu(dtype, isa):
    """Inputs scaled by 100 (gate values of standard deviation 100, a third of them past
    ±89, where exp(-g) overflows fp32): SiLU is g there or 0, never NaN or garbage."""
    x, w13, w2, b13, b2, tw, ti = make_case(33, 8, 2, 128, 128, dtype, True)
    x = (x.float() * 100).to(dtype)
    gates = torch.cat([x.float() @ w13[e, :128].float().T for e in range(8)])
    assert (gates < -89).float().mean() > 0.15 and (gates > 89).float().mean() > 0.15
    out = run_moe(x, w13, w2, b13, b2, tw, ti, "silu", isa)
    assert torch.isfinite(out).all()
    ref, scale = moe_reference(x, w13, w2, b13, b2, tw, ti, "silu")
    assert_close_moe(out, ref, scale)


@pytest.mark.parametrize("isa", ["vec", "amx"])
def test_skip_weighted_top1(isa):
    case = make_case(9, 8, 1, 128, 128, BF, True)
    out = run_moe(*case, "silu", isa, skip_weighted=True)
    ref, scale = moe_reference(*case, "silu", skip_weighted=True)
    assert_close_moe(out, ref, scale)
    x, w13, w2, b13, b2, tw, _ = make_case(4, 8, 2, 128, 128, BF, False)
    with pytest.raises(ValueError, match="skip_weighted: requires topk == 1"):
        run_moe(x, w13, w2, b13, b2, tw, moe.topk_softmax(torch.randn(4, 8), 2, True)[1],
                "silu", isa, skip_weighted=True)  # fmt: skip


@FALLBACK
def test_one_token_kernel():
    """T = 1 runs its own one-region kernel (docs §5.3): against the reference with a
    repeated id and an id -1, for both activation layouts (silu: gate and up in separate
    tile pairs; swigluoai: interleaved); with distinct ids bit-identical to the same token
    in a T = 2 call (the T > 1 kernel; a repeated id's rows take other tiles there); zeros
    where every id is -1. H = 160: 5 column blocks."""
    x, w13, w2, b13, b2, tw, ti = make_case(1, 8, 4, 160, 96, BF, True)
    odd = torch.tensor([[5, 2, 5, -1]], dtype=torch.int32)
    for act in ("silu", "swigluoai"):
        out = run_moe(x, w13, w2, b13, b2, tw, odd, act, "vec")
        ref, scale = moe_reference(x, w13, w2, b13, b2, tw, odd, act)
        assert_close_moe(out, ref, scale)
        out = run_moe(x, w13, w2, b13, b2, tw, ti, act, "vec")
        two = run_moe(torch.cat([x, -x]), w13, w2, b13, b2, torch.cat([tw, tw]),
                      torch.cat([ti, ti.flip(1)]), act, "vec")  # fmt: skip
        assert torch.equal(out[0], two[0])
    none = run_moe(x, w13, w2, b13, b2, tw, torch.full_like(ti, -1), "silu", "vec")
    assert torch.equal(none, torch.zeros_like(none))


def test_amx_layout_computes_as_vec():
    """The vector kernels read the amx weight layout on any CPU and give vec's bits, on
    the one-row, 4-row and 8-row tile paths (the AMX tiles on that layout:
    tests/test_amx.py)."""
    path = "dpbf16" if isa_mod.decision().dp else "widen"
    for t_n in (1, 3, 64):
        x, w13, w2, b13, b2, tw, ti = make_case(t_n, 8, 2, 128, 128, BF, True)
        outs = []
        for isa in ("amx", "vec"):
            p13, p2 = moe.prepack_moe_weight(w13, isa), moe.prepack_moe_weight(w2, isa)
            out = torch.empty_like(x)
            moe.fused_moe(
                out, x, p13, p2, b13, b2, tw, ti, activation="gelu_tanh", isa=isa, path=path
            )
            outs.append(out)
        assert torch.equal(*outs)


@pytest.mark.parametrize("path", ["widen", "dpbf16"])
@pytest.mark.parametrize("isa,dtype", [("vec", BF), ("amx", BF), ("vec", FP32)])
def test_fused_moe_paths(path, isa, dtype):
    """Both paths of the expert GEMMs against the reference: 74 rows over 4 experts (8-row
    tiles, 4-row remainders), swigluoai's interleaved gate and up, biases. fp32 always
    widens (its tolerance is 2^15 times tighter than bf16 rounding would allow); where the
    CPU lacks AVX512-BF16, dpbf16 is a ValueError naming ``path``."""
    x, w13, w2, b13, b2, tw, ti = make_case(37, 4, 2, 128, 96, dtype, True)
    p13, p2 = moe.prepack_moe_weight(w13, isa), moe.prepack_moe_weight(w2, isa)
    out = torch.full_like(x, float("nan"))
    args = (out, x, p13, p2, b13, b2, tw, ti)
    if path == "dpbf16" and not isa_mod.decision().dp:
        with pytest.raises(ValueError, match="path: 'dpbf16' cannot run on this CPU"):
            moe.fused_moe(*args, activation="swigluoai", isa=isa, path=path)
        assert out.isnan().all()
        return
    moe.fused_moe(*args, activation="swigluoai", isa=isa, path=path)
    ref, scale = moe_reference(x, w13, w2, b13, b2, tw, ti, "swigluoai")
    assert_close_moe(out, ref, scale)
    if dtype != BF:
        return
    # the check fails for a kernel that drops the odd (or the even) element of a K pair
    for drop in (1, 0):
        xd = x.clone()
        xd[:, drop::2] = 0
        wrong, _ = moe_reference(xd, w13, w2, b13, b2, tw, ti, "swigluoai")
        with pytest.raises(AssertionError):
            assert_close_moe(out, wrong, scale)


@FALLBACK
@pytest.mark.parametrize("isa", ["vec", "amx"])
def test_fused_moe_fma256_tiles(isa):
    """The fma256 path (CPUs without AVX-512; CI's fallback run, skipped where AVX-512 is
    present: forcing it there would compile its tiles as zmm code no CPU runs) against the
    reference: 74 rows on 4 experts take the panel tiles over H = 1056 (K slices 512, 512,
    32), 10 rows on 4 experts the 4x16 tiles with 1 to 4 rows; swigluoai, biases."""
    if isa_mod.gemm_path()[0] != "fma256":
        pytest.skip("AVX-512 present: the fma256 path is CI's fallback run's")
    for t_n in (37, 5):
        x, w13, w2, b13, b2, tw, ti = make_case(t_n, 4, 2, 1056, 96, BF, True)
        p13, p2 = moe.prepack_moe_weight(w13, isa), moe.prepack_moe_weight(w2, isa)
        out = torch.full_like(x, float("nan"))
        moe.fused_moe(out, x, p13, p2, b13, b2, tw, ti, activation="swigluoai", isa=isa)
        ref, scale = moe_reference(x, w13, w2, b13, b2, tw, ti, "swigluoai")
        assert_close_moe(out, ref, scale)
    witnesses = {str(sig[-1].dtype) for sig in moe._fused_moe.signatures}
    assert "float64" in witnesses  # the panel witness took the calls


def test_fused_moe_bad_path():
    x, w13, w2, b13, b2, tw, ti = make_case(4, 8, 2, 128, 128, BF, False)
    p13, p2 = moe.prepack_moe_weight(w13, "vec"), moe.prepack_moe_weight(w2, "vec")
    out = torch.empty_like(x)
    for bad, exc in (("fast", ValueError), (3, TypeError)):
        with pytest.raises(exc, match="path"):
            moe.fused_moe(out, x, p13, p2, b13, b2, tw, ti, isa="vec", path=bad)


def test_tolerance_bites():
    x, w13, w2, b13, b2, tw, ti = make_case(16, 8, 2, 128, 128, BF, True)
    out = run_moe(x, w13, w2, b13, b2, tw, ti, "silu", "vec")
    ref, scale = moe_reference(x, w13, w2, b13, b2, tw, ti, "silu")
    assert_close_moe(out, ref, scale)
    no_bias, _ = moe_reference(x, w13, w2, b13, None, tw, ti, "silu")
    with pytest.raises(AssertionError):
        assert_close_moe(out, no_bias, scale)
    wrong = ti.clone()
    wrong[5, 0] = (wrong[5, 0] + 1) % 8
    if wrong[5, 0] == wrong[5, 1]:
        wrong[5, 0] = (wrong[5, 0] + 1) % 8
    bad, _ = moe_reference(x, w13, w2, b13, b2, tw, wrong, "silu")
    with pytest.raises(AssertionError):
        assert_close_moe(out, bad, scale)


# ---------------------------------------------------------------------------------------
# routing


def topk_reference(probs, k):
    return refs.stable_topk(probs, k)


@pytest.mark.parametrize("t_n,e_n,k,renorm", [(1, 8, 2, True), (13, 64, 8, False),
                                              (97, 128, 4, True), (5, 6, 6, True)])  # fmt: skip
def test_topk_softmax(t_n, e_n, k, renorm):
    logits = torch.randn(t_n, e_n).bfloat16()  # bf16 logits tie often
    logits[0, :] = 0.5  # a token whose experts all tie: ids 0..k-1
    w, ids = moe.topk_softmax(logits, k, renorm)
    assert w.dtype == torch.float32 and ids.dtype == torch.int32
    assert w.is_contiguous() and ids.is_contiguous() and ids.shape == (t_n, k)
    vals, ref_ids = topk_reference(torch.softmax(logits.float(), dim=1), k)
    assert torch.equal(ids, ref_ids)
    assert torch.equal(ids[0], torch.arange(k, dtype=torch.int32))
    ref_w = vals / vals.sum(1, keepdim=True) if renorm else vals
    t = tolerance("topk_softmax", torch.float32)
    torch.testing.assert_close(w, ref_w, rtol=t.rel, atol=t.abs)
    # invariants: k distinct ids per token, counts per expert sum to T*k
    assert all(len(set(r.tolist())) == k for r in ids)
    assert torch.bincount(ids.flatten().long(), minlength=e_n).sum() == t_n * k


def grouped_reference(logits, k, renorm, n_group, topk_group, scoring, scale, bias):
    return refs.grouped_topk(
        logits,
        k,
        renorm,
        n_group,
        topk_group,
        scoring_func=scoring,
        routed_scaling_factor=scale,
        e_score_correction_bias=bias,
    )


@pytest.mark.parametrize(
    "scoring,with_bias,renorm,scale",
    [("softmax", False, True, 1.0), ("sigmoid", True, True, 2.5), ("sigmoid", False, False, 1.0)],
)
def test_grouped_topk(scoring, with_bias, renorm, scale):
    t_n, e_n, k, n_group, topk_group = 37, 64, 6, 8, 3
    logits = torch.randn(t_n, e_n).bfloat16()
    bias = torch.randn(e_n) * 0.1 if with_bias else None
    w, ids = moe.grouped_topk(
        logits, k, renorm, n_group, topk_group, scoring_func=scoring,
        routed_scaling_factor=scale, e_score_correction_bias=bias,
    )  # fmt: skip
    ref_w, ref_ids = grouped_reference(logits, k, renorm, n_group, topk_group, scoring, scale, bias)
    assert torch.equal(ids, ref_ids)
    t = tolerance("grouped_topk", torch.float32)
    torch.testing.assert_close(w, ref_w, rtol=t.rel, atol=t.abs)
    groups = (ids // (e_n // n_group)).long()
    assert all(len(set(r.tolist())) <= topk_group for r in groups)


def test_routing_edge_cases():
    # every token to one expert; other experts get no tokens
    logits = torch.full((7, 8), -10.0)
    logits[:, 5] = 10.0
    _w, ids = moe.topk_softmax(logits, 1, False)
    assert (ids == 5).all()
    counts = torch.bincount(ids.flatten().long(), minlength=8)
    assert counts[5] == 7 and counts.sum() == 7
    # k == E: every expert, sorted by probability
    logits = torch.randn(3, 8)
    _, ids = moe.topk_softmax(logits, 8, True)
    assert torch.equal(ids.sort(1).values, torch.arange(8, dtype=torch.int32).expand(3, 8))
    # one token, and the fused op with experts that receive nothing
    x, w13, w2, b13, b2, _, _ = make_case(1, 8, 1, 128, 128, BF, True)
    tw, ti = moe.topk_softmax(torch.randn(1, 8), 1, True)
    out = run_moe(x, w13, w2, b13, b2, tw, ti, "silu", "vec")
    ref, scale = moe_reference(x, w13, w2, b13, b2, tw, ti, "silu")
    assert_close_moe(out, ref, scale)
    with pytest.raises(ValueError, match="topk"):
        moe.topk_softmax(torch.randn(2, 4), 5, True)


# ---------------------------------------------------------------------------------------
# packing


@pytest.mark.parametrize("isa,dtype", [("vec", BF), ("vec", FP16), ("vec", FP32), ("amx", BF)])
def test_prepack_layout(isa, dtype):
    e_n, n, k = 2, 64, 96
    w = torch.randn(e_n, n, k).to(dtype)
    p = moe.prepack_moe_weight(w, isa).reshape(e_n, n // 16, -1)
    ee, tt, kk, jj = np.meshgrid(range(e_n), range(n // 16), range(k), range(16), indexing="ij")
    src = w[ee, tt * 16 + jj, kk]
    if isa == "vec":
        dst = p[ee, tt, kk * 16 + jj]
    else:
        dst = p[ee, tt, (kk // 2) * 32 + jj * 2 + kk % 2]
    assert torch.equal(dst, src)


def test_prepack_errors():
    with pytest.raises(TypeError, match="weight"):
        moe.prepack_moe_weight(torch.randn(2, 32, 32), "amx")  # amx is bf16 only
    with pytest.raises(ValueError, match="multiples of 32"):
        moe.prepack_moe_weight(torch.randn(2, 48, 32), "vec")
    with pytest.raises(ValueError, match="isa"):
        moe.prepack_moe_weight(torch.randn(2, 32, 32), "avx")


# ---------------------------------------------------------------------------------------
# workspace


def test_plan_for_qwen3_235b_tp4_is_64bit():
    plan = moe.moe_workspace_plan(16384, 8, 128, 4096, 384, torch.bfloat16, 2)
    _off, size = plan.buffers["w2_output"]
    assert size == 2147483648 == 2**31
    assert plan.total_bytes > 2**31
    assert plan.total_bytes == sum(s for _, s in plan.buffers.values())
    for o, s in plan.buffers.values():
        assert o >= 0 and s >= 0 and o % 64 == 0
    ends = sorted((o, o + s) for o, s in plan.buffers.values())
    assert all(a[1] <= b[0] for a, b in itertools.pairwise(ends))  # no overlap


def test_workspace_is_reused_and_grown():
    small = make_case(3, 8, 2, 128, 128, BF, False)
    run_moe(*small, "silu", "vec")
    buf = moe.workspace.buffer
    plan = moe.moe_workspace_plan(3, 2, 8, 128, 128, BF, moe.numba.get_num_threads())
    assert buf.nbytes >= plan.total_bytes
    run_moe(*small, "silu", "vec")
    assert moe.workspace.buffer is buf  # same buffer across calls
    big = make_case(300, 8, 2, 128, 128, BF, False)
    run_moe(*big, "silu", "vec")
    big_plan = moe.moe_workspace_plan(300, 2, 8, 128, 128, BF, moe.numba.get_num_threads())
    assert moe.workspace.buffer.nbytes == max(big_plan.total_bytes, buf.nbytes)


@pytest.mark.heavy
def test_fused_moe_past_2_31_bytes():
    """T*k*H*4 = 2^31 bytes of fp32 w2 output: rows whose offsets lie past 2^31 are right."""
    t_n, e_n, k, h, i_n = 16384, 8, 8, 4096, 32
    g = torch.Generator().manual_seed(3)
    x = torch.randn(t_n, h, generator=g).bfloat16()
    w13 = (torch.randn(e_n, 2 * i_n, h, generator=g) / 64).bfloat16()
    w2 = (torch.randn(e_n, h, i_n, generator=g) / 6).bfloat16()
    # every token uses all 8 experts in a token-dependent order
    ti = torch.stack([torch.roll(torch.arange(e_n), t % e_n) for t in range(t_n)]).int()
    tw = torch.softmax(torch.randn(t_n, k, generator=g), 1)
    plan = moe.moe_workspace_plan(t_n, k, e_n, h, i_n, BF, moe.numba.get_num_threads())
    assert plan.buffers["w2_output"][1] == 2**31
    out = torch.empty_like(x)
    moe.fused_moe(out, x, moe.prepack_moe_weight(w13, "vec"), moe.prepack_moe_weight(w2, "vec"),
                  None, None, tw, ti, activation="silu", isa="vec")  # fmt: skip
    assert moe.workspace.buffer.nbytes >= plan.total_bytes > 2**31
    # last tokens (sorted rows near T*k, offsets past 2^31) and the highest expert's tokens
    rows = torch.tensor([0, 1, t_n // 2, t_n - 3, t_n - 2, t_n - 1])
    ref, scale = moe_reference(x[rows], w13, w2, None, None, tw[rows], ti[rows], "silu")
    assert (ti[rows] == e_n - 1).any(1).all()
    assert_close_moe(out[rows], ref, scale)


# ---------------------------------------------------------------------------------------
# bad input


def _args(**over):
    x, w13, w2, b13, b2, tw, ti = make_case(4, 8, 2, 128, 128, BF, True)
    a = dict(output=torch.zeros_like(x), input=x, w13=moe.prepack_moe_weight(w13, "vec"),
             w2=moe.prepack_moe_weight(w2, "vec"), w13_bias=b13, w2_bias=b2, topk_weights=tw,
             topk_ids=ti, activation="silu", isa="vec")  # fmt: skip
    a.update(over)
    return a


@pytest.mark.parametrize(
    "over,exc,match",
    [
        (lambda a: {"topk_ids": a["topk_ids"].clone().fill_(8)}, ValueError, r"topk_ids.*\[0, 8\)"),
        # -1 is "no expert on this rank" (expert parallelism): below it, refused
        (lambda a: {"topk_ids": a["topk_ids"].clone().fill_(-2)}, ValueError,
         r"topk_ids.*\[0, 8\) or -1"),
        (lambda a: {"topk_ids": a["topk_ids"].long()}, TypeError, "topk_ids: expected dtype int32"),
        (lambda a: {"topk_weights": a["topk_weights"].double()}, TypeError, "topk_weights"),
        (lambda a: {"topk_weights": a["topk_weights"][:, :1].contiguous()}, ValueError,
         "topk_weights"),
        (lambda a: {"w13": a["w13"][:, :, :96].contiguous()}, ValueError, "w13"),
        (lambda a: {"w2": a["w2"].float()}, TypeError, "w2"),
        (lambda a: {"w2_bias": a["w2_bias"][:, :64].contiguous()}, ValueError, "w2_bias"),
        (lambda a: {"activation": "relu"}, ValueError, "activation"),
        (lambda a: {"isa": "vec16"}, ValueError, "isa"),
        (lambda a: {"input": a["input"].float(), "output": a["output"].float(), "isa": "amx"},
         TypeError, "input"),
    ],
)  # fmt: skip
def test_fused_moe_bad_input(over, exc, match):
    a = _args()
    a.update(over(a))
    before = a["output"].clone()
    out = a.pop("output")
    with pytest.raises(exc, match=match):
        moe.fused_moe(out, **{k: a[k] for k in ("input", "w13", "w2", "w13_bias", "w2_bias",
                                                "topk_weights", "topk_ids")},
                      activation=a["activation"], isa=a["isa"])  # fmt: skip
    assert torch.equal(out, before)


def test_fused_moe_rejects_i_not_multiple_of_32():
    x = torch.randn(2, 128).bfloat16()
    w13 = torch.randn(4, 2 * 48, 128).bfloat16()  # I = 48
    w2 = torch.randn(4, 128, 48).bfloat16()
    tw, ti = moe.topk_softmax(torch.randn(2, 4), 1, True)
    with pytest.raises(ValueError, match="multiples of 32"):
        moe.fused_moe(torch.empty_like(x), x, w13, w2, None, None, tw, ti, isa="vec")


# ---------------------------------------------------------------------------------------
# vLLM


def test_vllm_prepack_vec_byte_identical():
    """The vec layouts against the build vLLM loads on this CPU (every build packs them
    alike)."""
    ops = oracle.ops()
    for dt in (BF, FP16, FP32):
        w = torch.randn(4, 64, 96).to(dt)
        theirs = torch.empty_like(w)
        ops.prepack_moe_weight(w, theirs, "vec")
        bits = torch.int32 if dt == FP32 else torch.int16
        assert torch.equal(moe.prepack_moe_weight(w, "vec").view(bits), theirs.view(bits)), dt


def test_vllm_prepack_amx_byte_identical():
    """The amx layout against vLLM's _C build, whose amx layout is the AMX kernels' (the
    AVX-512 and AVX2 builds store their own under that name: docs §9.1), in a child."""
    w = torch.randn(4, 64, 96).to(BF)
    code = """
result = torch.empty_like(inputs["w"])
torch.ops._C.prepack_moe_weight(inputs["w"], result, "amx")
"""
    probe = "w = torch.randn(2, 32, 32).bfloat16()\n" + (
        "torch.ops._C.prepack_moe_weight(w, torch.empty_like(w), 'amx')"
    )
    theirs = oracle.run_in_child("_C.abi3.so", code, probe=probe, name="prepack_moe_weight", w=w)
    ours = moe.prepack_moe_weight(w, "amx")
    assert torch.equal(ours.view(torch.int16), theirs.view(torch.int16))


def _vllm_probe(isa, dtype):
    return f"""
T, E, k, H, I = 3, 8, 2, 128, 128
dt = torch.{str(dtype).split(".")[1]}
x = torch.randn(T, H).to(dt)
w13 = torch.randn(E, 2 * I, H).to(dt); w2 = torch.randn(E, H, I).to(dt)
p13 = torch.empty_like(w13); p2 = torch.empty_like(w2)
torch.ops._C.prepack_moe_weight(w13, p13, "{isa}"); torch.ops._C.prepack_moe_weight(w2, p2, "{isa}")
ti = torch.randint(0, E, (T, k), dtype=torch.int32); tw = torch.rand(T, k)
torch.ops._C.cpu_fused_moe(torch.empty(T, H, dtype=dt), x, p13, p2, None, None, tw, ti, False,
                           "silu", "{isa}")
"""


@pytest.mark.parametrize("isa,dtype,activation,bias",
                         [("vec", BF, "silu", True), ("amx", BF, "swigluoai", True),
                          ("vec", FP32, "silu", True), ("vec", FP32, "gelu", False)])  # fmt: skip
def test_vllm_fused_moe_outputs(isa, dtype, activation, bias):
    oracle.require_op(
        f"cpu_fused_moe ({isa}, {dtype})", _vllm_probe(isa, dtype), needs=oracle.isa_needs(isa)
    )
    ops = oracle.ops()
    x, w13, w2, b13, b2, tw, ti = make_case(33, 16, 4, 256, 128, dtype, bias)
    ours = run_moe(x, w13, w2, b13, b2, tw, ti, activation, isa)
    p13, p2 = torch.empty_like(w13), torch.empty_like(w2)
    ops.prepack_moe_weight(w13, p13, isa)
    ops.prepack_moe_weight(w2, p2, isa)
    theirs = torch.empty_like(x)
    ops.cpu_fused_moe(theirs, x, p13, p2, b13, b2, tw.clone(), ti.clone(), False, activation, isa)
    ref, scale = moe_reference(x, w13, w2, b13, b2, tw, ti, activation)
    # vLLM's bf16 kernels round inside (measured up to 1.6 units off the fp32 path here):
    # the oracle is held to two units of our reference, numkern to one
    assert_close_moe(theirs, ref, scale, units=2.0)
    assert_close_moe(ours, ref, scale)
    assert_close_moe(ours, theirs.float(), scale, units=3.0)


@pytest.mark.parametrize(
    "factor, exc", [("2.5", TypeError), (True, TypeError), (float("nan"), ValueError)]
)
def test_grouped_topk_refuses_a_bad_scaling_factor(factor, exc):
    """Found by the fuzz: a string or bool factor was converted silently, NaN gave NaN
    weights."""
    with pytest.raises(exc, match="routed_scaling_factor"):
        moe.grouped_topk(torch.randn(2, 8), 2, True, 2, 1, routed_scaling_factor=factor)
