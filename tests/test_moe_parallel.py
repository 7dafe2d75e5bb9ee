"""MoE under tensor / expert parallelism (issue 29): ``numkern.moe.fused_moe``'s id -1
(no expert on this rank, docs/kernels.md §5.3) on the bf16, fp32 and quantised ops and
the torch op; the engine's sharded ``FusedMoE`` (TP: the intermediate dimension split,
EP: whole experts, Qwen2-MoE's shared expert split along S) and GDN layers, two shards'
partial outputs summed against the unsplit layer in fp32."""

import math

import pytest
import torch

import numkern.torch_ops  # noqa: F401  (defines torch.ops.numkern)
from numkern import moe, quant
from numkern.testing import reference as refs
from numkern.testing.quantize import quantize

from .test_moe import assert_close_moe, make_case, moe_reference, run_moe

BF, FP32 = torch.bfloat16, torch.float32


def ep_ids(ti, e0, e1):
    """Global ids -> this rank's local ids of experts ``[e0, e1)``, -1 elsewhere."""
    return torch.where((ti >= e0) & (ti < e1), ti - e0, -1).to(torch.int32)


# ---------------------------------------------------------------------------------------
# numkern.moe: id -1


@pytest.mark.parametrize("dtype,isa", [(FP32, "vec"), (BF, "vec"), (BF, "amx")])
def test_ep_halves_sum_to_the_whole(dtype, isa):
    """Experts split in two halves, each half run with the other's ids as -1: each half is
    the reference over its own experts, and the two halves' sum is the unsplit call (fp32:
    to fp32 rounding; bf16: each half rounded once). A token whose ids are all -1 on a
    half gets exact zeros there (its biases are not added); 13 tokens of top-3 over 8."""
    x, w13, w2, b13, b2, tw, ti = make_case(13, 8, 3, 128, 96, dtype, True)
    ti[0] = torch.tensor([0, 1, 2], dtype=torch.int32)  # token 0: every id on half 0
    tw[0] = torch.tensor([0.5, 0.3, 0.2])
    whole = run_moe(x, w13, w2, b13, b2, tw, ti, "silu", isa)
    parts = []
    for e0, e1 in ((0, 4), (4, 8)):
        li = ep_ids(ti, e0, e1)
        out = run_moe(x, w13[e0:e1].contiguous(), w2[e0:e1].contiguous(), b13[e0:e1].contiguous(),
                      b2[e0:e1].contiguous(), tw, li, "silu", isa)  # fmt: skip
        ref, scale = moe_reference(x, w13[e0:e1], w2[e0:e1], b13[e0:e1], b2[e0:e1], tw, li, "silu")
        assert_close_moe(out, ref, scale)
        parts.append(out)
    assert torch.equal(parts[1][0], torch.zeros_like(parts[1][0]))
    total = parts[0].float() + parts[1].float()
    ref, scale = moe_reference(x, w13, w2, b13, b2, tw, ti, "silu")
    assert_close_moe(total.to(dtype), ref, scale, units=2.0)  # two roundings, then a sum
    if dtype == FP32:
        assert torch.allclose(total, whole, rtol=1e-6, atol=1e-6)


def test_all_ids_minus_one_and_the_range_check():
    """Every id -1: zeros (nothing computed); an id below -1 is a ValueError naming
    ``topk_ids``, the output untouched."""
    x, w13, w2, b13, b2, tw, ti = make_case(5, 8, 2, 128, 96, FP32, True)
    out = run_moe(x, w13, w2, b13, b2, tw, torch.full_like(ti, -1), "silu", "vec")
    assert torch.equal(out, torch.zeros_like(out))
    bad = ti.clone()
    bad[2, 1] = -2
    with pytest.raises(ValueError, match=r"topk_ids: expected expert ids in \[0, 8\) or -1"):
        run_moe(x, w13, w2, b13, b2, tw, bad, "silu", "vec")


@pytest.mark.parametrize("dtype", [FP32, BF])
def test_quantised_ep_halves(dtype):
    """The quantised op (§5.7) with id -1: Q8_0 experts split in two halves; each half the
    exact-dequantisation reference over its experts (fp32 input) or close to the unsplit
    call's share (bf16 input, int8 activations), their sum the unsplit call's result."""
    t_n, e_n, k, h, i_n = 9, 4, 2, 64, 64
    x, w13, w2, b13, b2, tw, ti = make_case(t_n, e_n, k, h, i_n, FP32, True, seed=3)
    x = x.to(dtype)
    b13, b2 = b13.float(), b2.float()

    def q(w):
        return quant.repack(quantize(w.numpy(), "Q8_0"), "Q8_0", tuple(w.shape))

    def run(e0, e1, ids):
        out = torch.full_like(x, float("nan"))
        moe.fused_moe(out, x, q(w13[e0:e1]), q(w2[e0:e1]), b13[e0:e1].contiguous(),
                      b2[e0:e1].contiguous(), tw, ids)  # fmt: skip
        return out

    whole = run(0, e_n, ti)
    halves = [run(e0, e1, ep_ids(ti, e0, e1)) for e0, e1 in ((0, 2), (2, 4))]
    total = halves[0].float() + halves[1].float()
    if dtype == FP32:
        ref = refs.fused_moe(torch.empty_like(x), x, q(w13[:2]), q(w2[:2]), b13[:2], b2[:2], tw,
                             ep_ids(ti, 0, 2))  # fmt: skip
        assert torch.allclose(halves[0], ref, rtol=1e-5, atol=1e-5)
        assert torch.allclose(total, whole, rtol=1e-5, atol=1e-5)
    else:
        _, scale = moe_reference(x, w13, w2, b13, b2, tw, ti, "silu")
        assert_close_moe(total.to(dtype), whole.float(), scale, units=2.0)


def test_torch_op_takes_minus_one():
    """``torch.ops.numkern.cpu_fused_moe`` passes id -1 through (its fake makes no range
    check) and gives the direct call's bits."""
    x, w13, w2, _, _, tw, ti = make_case(7, 8, 2, 128, 96, BF, False)
    li = ep_ids(ti, 0, 4)
    p13, p2 = (
        moe.prepack_moe_weight(w13[:4].contiguous(), "vec"),
        moe.prepack_moe_weight(w2[:4].contiguous(), "vec"),
    )
    out = torch.empty_like(x)
    torch.ops.numkern.cpu_fused_moe(out, x, p13, p2, None, None, tw, li, False, "silu", "vec")
    direct = torch.empty_like(x)
    moe.fused_moe(direct, x, p13, p2, None, None, tw, li, isa="vec")
    assert torch.equal(out, direct)
    assert math.isfinite(out.float().abs().sum().item())
