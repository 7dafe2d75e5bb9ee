"""MoE under tensor / expert parallelism (issue 29): ``numkern.moe.fused_moe``'s id -1
(no expert on this rank, docs/kernels.md §5.3) on the bf16, fp32 and quantised ops and
the torch op; the engine's sharded ``FusedMoE`` (TP: the intermediate dimension split,
EP: whole experts, Qwen2-MoE's shared expert split along S), two shards' partial outputs
summed against the unsplit layer in fp32 (the sharded GDN layer: tests/test_engine_gdn.py)."""

import math

import pytest
import torch

import numkern.torch_ops  # noqa: F401  (defines torch.ops.numkern)
from numkern import moe, quant
from numkern.testing import reference as refs
from numkern.testing.quantize import quantize

from .close import rtol_atol
from .shard_layers import LAYER, hf_config, load_layer, shards
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
        assert torch.allclose(total, whole, **rtol_atol("moe_ep_halves"))


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
        assert torch.allclose(halves[0], ref, **rtol_atol("moe_shards"))
        assert torch.allclose(total, whole, **rtol_atol("moe_shards"))
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


# ---------------------------------------------------------------------------------------
# the engine's layers: two shards' partial outputs summed == the unsplit layer (fp32)


def expert_tensors(cfg, seed, mxfp4=False):
    """Random fp32 tensors of layer 0's experts as the checkpoint names them (GPT-OSS's
    fused and transposed, with biases; ``mxfp4``: its blocks and scales)."""
    g = torch.Generator().manual_seed(seed)
    e_n, i_n, h = cfg.num_experts, cfg.moe_intermediate_size, cfg.hidden_size
    fam = cfg.family.experts
    m = LAYER + fam.prefix

    def rnd(*shape, scale=0.2):
        return scale * torch.randn(*shape, generator=g)

    if fam.fused:
        e = m + "experts."
        t = {
            m + "router.weight": rnd(e_n, h, scale=1.0),
            m + "router.bias": rnd(e_n),
            e + "gate_up_proj_bias": rnd(e_n, 2 * i_n),
            e + "down_proj_bias": rnd(e_n, h),
        }
        if not mxfp4:
            t[e + "gate_up_proj"] = rnd(e_n, h, 2 * i_n)
            t[e + "down_proj"] = rnd(e_n, i_n, h)
            return t
        for name, n, k in (("gate_up_proj", 2 * i_n, h), ("down_proj", h, i_n)):
            t[e + name + "_blocks"] = torch.randint(0, 256, (e_n, n, k // 32, 16), generator=g,
                                                    dtype=torch.uint8)  # fmt: skip
            t[e + name + "_scales"] = torch.randint(118, 124, (e_n, n, k // 32), generator=g,
                                                    dtype=torch.uint8)  # fmt: skip
        return t
    t = {m + "gate.weight": rnd(e_n, h, scale=1.0)}
    gate, up, down = fam.names
    for x in range(e_n):
        ex = m + f"experts.{x}."
        t[ex + gate + ".weight"] = rnd(i_n, h)
        t[ex + up + ".weight"] = rnd(i_n, h)
        t[ex + down + ".weight"] = rnd(h, i_n)
    s_n = cfg.shared_expert_intermediate_size
    if s_n:
        s = m + "shared_expert."
        t[s + "gate_proj.weight"] = rnd(s_n, h)
        t[s + "up_proj.weight"] = rnd(s_n, h)
        t[s + "down_proj.weight"] = rnd(h, s_n)
        t[m + "shared_expert_gate.weight"] = rnd(1, h)
    return t


MOE_CASES = {
    # (config class, architecture, fields): I splits to 32 a rank, or to 16 (padded to 32)
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                  dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64)),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM",
                dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=32)),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM",
                  dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                       shared_expert_intermediate_size=96)),
    "gpt_oss": ("GptOssConfig", "GptOssForCausalLM",
                dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=64)),
}  # fmt: skip


@pytest.mark.parametrize("kind", ["tp", "ep"])
@pytest.mark.parametrize("family", list(MOE_CASES))
def test_sharded_fused_moe_sums_to_the_whole(family, kind):
    """Each family's MoE layer loaded whole and as the two ranks' parts (TP: every
    expert's neurons split, GPT-OSS's interleaved gate_up rows [2 i0, 2 i1) and its down
    bias on rank 0 only, a share of 16 neurons padded to 32; EP: whole experts, other
    ranks' ids -1; Qwen2-MoE's shared expert split along S under both): the ranks' fp32
    outputs summed equal the whole layer's, and each rank holds only its share."""
    cls, arch, fields = MOE_CASES[family]
    cfg = hf_config(cls, arch, **fields)
    tensors = expert_tensors(cfg, seed=len(family))
    whole = load_layer(cfg, tensors, shards(kind)[0]._replace(world=1))
    parts = [load_layer(cfg, tensors, s) for s in shards(kind)]
    x = torch.randn(11, cfg.hidden_size, generator=torch.Generator().manual_seed(1))
    want = whole(x)
    got = parts[0](x) + parts[1](x)
    assert torch.allclose(got, want, **rtol_atol("moe_shards")), (got - want).abs().max()
    e_n, i_n = cfg.num_experts, cfg.moe_intermediate_size
    for r, p in enumerate(parts):
        routed = p.w13.shape[0] - (0 if p.shared_ids is None else p.shared_ids.shape[1])
        if kind == "ep":
            assert p.experts == (r * e_n // 2, (r + 1) * e_n // 2) and routed == e_n // 2
            assert p.w13.shape[1] == whole.w13.shape[1]
        else:
            assert p.experts == (0, e_n) and p.w13.shape[1] == 2 * max(32, i_n // 2)
    if family == "gpt_oss" and kind == "tp":
        assert parts[0].w2_bias is not None and parts[1].w2_bias is None


@pytest.mark.parametrize("i_n", [64, 32])
def test_gpt_oss_mxfp4_shards(i_n):
    """GPT-OSS's MXFP4 experts under TP=2: a share of 32 neurons is whole MXFP4 blocks of
    down's K and stays MXFP4; a share of 16 is not, so that rank's experts are
    dequantised (logged by name); either way the two ranks sum to the whole MXFP4 layer
    (fp32 activations: the dequantised product)."""
    fields = dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=i_n)
    cfg = hf_config("GptOssConfig", "GptOssForCausalLM", **fields)
    cfg.quant_method = "mxfp4"
    tensors = expert_tensors(cfg, seed=5, mxfp4=True)
    whole = load_layer(cfg, tensors, shards("tp")[0]._replace(world=1))
    parts = [load_layer(cfg, tensors, s) for s in shards("tp")]
    assert whole.quantized and all(p.quantized == (i_n == 64) for p in parts)
    x = torch.randn(5, cfg.hidden_size, generator=torch.Generator().manual_seed(2))
    got, want = parts[0](x) + parts[1](x), whole(x)
    assert torch.allclose(got, want, **rtol_atol("moe_shards_quant")), (got - want).abs().max()


def test_gguf_experts_sliced_by_rank(tmp_path, caplog):
    """A GGUF Qwen3-MoE's experts kept quantised, loaded as the two ranks' parts of a
    DecoderModel (no collective runs at load): layer 0's Q8_0 experts under TP keep
    their type (gate/up rows sliced, down's K of 128 per rank whole 32-value blocks);
    layer 1's Q4_K experts cannot (128 splits a 256-value block): dequantised for the
    shard and logged by name; under EP both keep their type, whole experts per rank.
    Each layer's two parts sum to the unsplit model's layer (fp32 activations)."""
    import logging

    import transformers

    from engine.dist import Comm
    from engine.loader import load_checkpoint
    from engine.models.decoder import DecoderModel
    from engine.shard import SINGLE, Shard

    from . import hf_models as hm
    from .gguf_convert import convert

    cfg = transformers.Qwen3MoeConfig(
        vocab_size=320, hidden_size=256, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=64, num_experts=4,
        num_experts_per_tok=2, moe_intermediate_size=256, max_position_embeddings=64,
        norm_topk_prob=True,
    )  # fmt: skip
    hm.random_model(cfg, 11).save_pretrained(tmp_path / "hf")

    def types(name, shape):
        return {"blk.0": "Q8_0", "blk.1": "Q4_K"}[name[:5]] if "_exps" in name else None

    convert(tmp_path / "hf", tmp_path / "m.gguf", types=types, quantize=quantize)

    def model(shard=SINGLE):
        ckpt = load_checkpoint(str(tmp_path / "m.gguf"), progress=False, shard=shard)
        comm = Comm(shard.rank, shard.world)
        return DecoderModel(ckpt, dtype=FP32, moe_isa="vec", shard=shard, comm=comm)

    whole = model()
    assert whole.experts[0].quantized and whole.experts[1].quantized
    x = torch.randn(6, 256, generator=torch.Generator().manual_seed(4))
    for ep in (False, True):
        with caplog.at_level(logging.INFO, logger="engine"):
            caplog.clear()
            parts = [model(Shard(r, 2, ep)) for r in range(2)]
        logged = "dequantised for this shard (Q4_K a rank's K of 128" in caplog.text
        assert logged == (not ep) and ("layers.1.mlp.experts.0.down_proj" in caplog.text) == (
            not ep
        )
        for i in (0, 1):
            kept = [p.experts[i].quantized for p in parts]
            assert kept == [ep or i == 0] * 2, (ep, i)
            got = parts[0].experts[i](x) + parts[1].experts[i](x)
            want = whole.experts[i](x)
            assert torch.allclose(got, want, **rtol_atol("moe_shards_quant")), (
                ep,
                i,
                (got - want).abs().max(),
            )
