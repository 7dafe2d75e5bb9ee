"""Gated DeltaNet hybrids end to end against HF transformers on tiny random models (fp32):
Qwen3-Next (MoE with a shared expert, grouped in_proj_qkvz/ba), Qwen3.5 (dense, as the
text model of Qwen3_5ForConditionalGeneration) and Qwen3.5-MoE (its wrapper too); the
state groups beside the KV-cache group, a batch mixing prefill and decode, preemption,
the skipped vision and mtp tensors, and the config fields refused by name; a GDN layer
as two tensor-parallel ranks' heads summed against the whole layer."""

import json
import logging
import shutil
import zlib

import pytest
import torch
import transformers

from engine.llm import SamplingParams
from engine.loader import ModelConfig
from numkern.testing.tolerances import tolerance

from . import hf_models as hm
from .close import rtol_atol
from .shard_layers import LAYER, hf_config, load_layer, shards

TEXT = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=4,  # layers 0-2 linear attention, 3 full (the default interval 4)
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,  # rotary on 8 of 32 dims (partial_rotary_factor 0.25)
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=16,
    linear_value_head_dim=32,
    linear_conv_kernel_dim=4,
    max_position_embeddings=512,
)
MOE = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32)
VISION = dict(depth=1, hidden_size=32, intermediate_size=48, num_heads=2, out_hidden_size=64)
FAMILIES = {
    # layer 1: a dense MLP after a linear-attention mixer; the others MoE
    "qwen3_next": lambda: transformers.Qwen3NextConfig(
        **TEXT, **MOE, shared_expert_intermediate_size=48, mlp_only_layers=[1]
    ),
    "qwen3_5": lambda: transformers.Qwen3_5Config(text_config=TEXT, vision_config=VISION),
    "qwen3_5_moe": lambda: transformers.Qwen3_5MoeConfig(
        text_config=dict(TEXT, **MOE, shared_expert_intermediate_size=48),
        vision_config=VISION,
    ),
}


def _randomize(model, seed):
    """(1 + w) norms around 1 (Qwen3-Next's zero-centred RMSNorm); the GDN output norm,
    a plain w, around 1 too."""
    hm.randomize(model, seed, norm=(0.0, 0.3))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("linear_attn.norm.weight"):
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
    return model


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    made = {}

    def get(name):
        if name not in made:
            cfg = FAMILIES[name]()
            torch.manual_seed(zlib.crc32(name.encode()))
            if name == "qwen3_next":
                hf = transformers.AutoModelForCausalLM.from_config(cfg)
            else:
                hf = transformers.AutoModelForImageTextToText.from_config(cfg)
            hf = _randomize(hf, None).eval()
            path = tmp_path_factory.mktemp(name)
            hf.save_pretrained(path)
            made[name] = (str(path), hf)
        return made[name]

    return get


GREEDY = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
TOL = rtol_atol("engine_logits_gdn")  # numkern.testing.tolerances, with why


@pytest.mark.parametrize("name", list(FAMILIES))
def test_fp32_parity_with_hf(checkpoint, name):
    """A 70-token prompt (two 64-token chunks of the chunked rule): prompt logits, 32
    greedy tokens and every decode step's logits as HF's; the state group beside the
    KV-cache group."""
    path, hf = checkpoint(name)
    llm = hm.engine(path)
    prompt = hm.prompt(70)
    with torch.no_grad():
        ref = hf(input_ids=torch.tensor([prompt])).logits[0]
    torch.testing.assert_close(llm.prompt_logits(prompt), ref, **TOL)
    llm.record_logits = True
    out = llm.generate([prompt], GREEDY)[0]
    assert out.token_ids == hm.hf_greedy(hf, prompt, 32)
    with torch.no_grad():
        ids = torch.tensor([prompt + out.token_ids])
        ref_steps = hf(input_ids=ids).logits[0, len(prompt) - 1 : -1]
    torch.testing.assert_close(torch.stack(out.logits), ref_steps, **TOL)
    (kv,) = llm.kv_cache_groups
    assert kv.layer_names == ("layer3",)
    (st,) = llm.state_groups
    assert st.layer_names == ("layer0", "layer1", "layer2")
    conv_dim = 2 * 2 * 16 + 4 * 32
    assert (st.conv_state_shape, st.conv_state_dtype) == ((conv_dim, 3), torch.float32)
    assert (st.ssm_state_shape, st.ssm_state_dtype) == ((4, 16, 32), torch.float32)
    assert st.num_slots == llm.scheduler.max_num_seqs


@pytest.mark.parametrize("name", list(FAMILIES))
def test_mixed_batch_and_preemption(checkpoint, name):
    """Prompts of 28, 3 and 37 tokens with 16-token chunks (a step mixes a prefill chunk
    with decodes, and a request continues its state across chunks); then a KV pool so
    small that requests are preempted and recompute their state: every request gets
    HF's greedy tokens of a solo run."""
    path, hf = checkpoint(name)
    prompts = [hm.prompt(28, 1), hm.prompt(3, 2), hm.prompt(37, 3)]
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    want = [hm.hf_greedy(hf, p, 12) for p in prompts]
    mixed = hm.engine(path, max_num_batched_tokens=16)
    assert [o.token_ids for o in mixed.generate(prompts, sp)] == want
    assert max(mixed.steps) == 3  # steps ran all three requests together
    per_token = 2 * 2 * 32 * 4  # K+V x kv heads x head_dim x fp32, one attention layer
    state = 3 * sum(layer.spec().bytes_per_slot() for layer in mixed.model.gdn_layers())
    small = hm.engine(  # 3 blocks of 32 tokens for the 5 the requests reach at once
        path, kv_cache_memory=state + 96 * per_token, max_num_batched_tokens=16, max_num_seqs=3
    )
    assert small.kv_cache_groups[0].num_blocks == 3
    assert [o.token_ids for o in small.generate(prompts, sp)] == want
    assert small.scheduler.num_preemptions > 0
    assert small.scheduler.slots.num_free == 3  # every slot back
    with pytest.raises(ValueError, match=r"kv_cache_memory.*GDN states"):
        hm.engine(path, kv_cache_memory=state, max_num_seqs=3)  # no byte left for KV


def _plain_norms(m):
    """An edit: the zero-centred RMSNorms read as plain ones (w, not 1 + w); the GDN output
    norm, plain already, stays."""
    for name, p in m.named_parameters():
        if name.endswith("norm.weight") and "linear_attn" not in name:
            p.sub_(1.0)


def test_qwen3_next_bf16_parity_with_hf(checkpoint):
    """Qwen3-Next (GDN layers 0-2, MoE with a shared expert, a dense layer 1) in bf16
    against HF in bf16 and fp32 by the bound of ``hm.assert_bf16_parity``: a 70-token
    prompt, then 8 decode steps (the recurrent rule and the conv update). Measured:
    bounds (max, median token) 5.04 (routing flips) and 0.237 on the prompt; on the
    median token layer 0's norms swapped lie 3.2 from HF bf16, the norms read as plain
    2.52 (both past 2 x 0.237)."""
    path, hf32 = checkpoint("qwen3_next")
    norms = hm.swap_norms("input_layernorm", "post_attention_layernorm")
    wrong = [hm.variant(hf32, norms), hm.variant(hf32, _plain_norms)]
    llm = hm.engine(path, dtype="bfloat16")
    hm.assert_bf16_parity(llm, hf32, hm.hf_bf16(path), hm.prompt(70, 2), wrong=wrong)


def test_bf16_within_bf16_tolerance(checkpoint):
    """Qwen3.5-MoE in bf16 against HF in bf16 (its model cast so), with the bound the
    other bf16 tests use: at most twice as far from HF's bf16 logits as those lie from
    HF fp32's, the median token's error likewise, and HF bf16's argmax wherever its top-2
    gap exceeds that bound. (The conv state is kept in bf16 as HF's and vLLM's; the
    recurrent state in fp32.)"""
    import copy

    path, hf32 = checkpoint("qwen3_5_moe")
    hf = copy.deepcopy(hf32).to(torch.bfloat16)
    llm = hm.engine(path, dtype="bfloat16")
    prompt = hm.prompt(70, 2)
    with torch.no_grad():
        ref32 = hf32(input_ids=torch.tensor([prompt])).logits[0]
        ref = hf(input_ids=torch.tensor([prompt])).logits[0].float()
    tol = 2 * (ref - ref32).abs().max().item()
    ours = llm.prompt_logits(prompt)
    assert (ours - ref).abs().max().item() <= tol
    per_token = (ours - ref32).abs().mean(1)
    assert per_token.median() <= 2 * (ref - ref32).abs().mean(1).median()
    top2 = ref.topk(2).values
    clear = (top2[:, 0] - top2[:, 1]) > tol
    assert torch.equal(ours.argmax(-1)[clear], ref.argmax(-1)[clear])
    # decode steps (the recurrent form and the conv update) stay within the bound too
    llm.record_logits = True
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    with torch.no_grad():
        ids = torch.tensor([prompt + out[0].token_ids])
        steps = hf(input_ids=ids).logits[0, len(prompt) - 1 : -1].float()
        steps32 = hf32(input_ids=ids).logits[0, len(prompt) - 1 : -1]
    tol = 2 * (steps - steps32).abs().max().item()
    assert (torch.stack(out[0].logits) - steps).abs().max().item() <= tol


def test_wrapper_skips_vision_and_mtp_tensors(checkpoint, tmp_path, caplog):
    """Qwen3_5MoeForConditionalGeneration with mtp.* tensors beside its vision tower:
    the text model runs, both kinds are skipped by name and each logged once; a tensor
    of any other unknown name is still an error."""
    from safetensors.torch import load_file, save_file

    path, hf = checkpoint("qwen3_5_moe")
    tensors = load_file(f"{path}/model.safetensors")
    assert any(k.startswith("model.visual.") for k in tensors)
    tensors["mtp.fc.weight"] = torch.zeros(64, 128)
    tensors["mtp.layers.0.input_layernorm.weight"] = torch.zeros(64)
    shutil.copy(f"{path}/config.json", tmp_path / "config.json")
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with caplog.at_level(logging.INFO, logger="engine"):
        llm = hm.engine(str(tmp_path))
    msgs = [r.getMessage() for r in caplog.records]
    assert sum("vision tensors" in m for m in msgs) == 1
    assert sum("multi-token-prediction tensors" in m for m in msgs) == 1
    assert llm.config.text_of == "Qwen3_5MoeForConditionalGeneration"
    prompt = hm.prompt(20, 4)
    with torch.no_grad():
        ref = hf(input_ids=torch.tensor([prompt])).logits[0]
    torch.testing.assert_close(llm.prompt_logits(prompt), ref, **TOL)
    tensors["model.language_model.layers.0.linear_attn.extra"] = torch.zeros(4)
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"linear_attn\.extra"):
        hm.engine(str(tmp_path))


def _config(**over):
    d = FAMILIES["qwen3_5"]().to_dict()
    d["text_config"].update(over)
    return d


def test_mrope_section_is_plain_rope_for_text():
    """Qwen3.5's published rope_parameters (mrope_section, mrope_interleaved, a theta of
    1e7): plain rope over the rotary quarter of each head."""
    rope = {
        "rope_type": "default",
        "rope_theta": 1e7,
        "partial_rotary_factor": 0.25,
        "mrope_section": [1, 2, 1],
        "mrope_interleaved": True,
    }
    cfg = ModelConfig.from_hf_dict(_config(rope_parameters=rope))
    assert (cfg.rope_theta, cfg.rope_scaling, cfg.partial_rotary_factor) == (1e7, None, 0.25)
    assert cfg.layer_mixers == ["linear_attention"] * 3 + ["attention"]
    assert cfg.attn_output_gate and cfg.norm_offset == 1.0


@pytest.mark.parametrize(
    "over, match",
    [
        (dict(rope_parameters={"rope_type": "default", "mrope_section": [4, 4, 4]}), "mrope_s"),
        (dict(rope_parameters={"rope_type": "default", "partial_rotary_factor": 0.1}), "partial"),
        (dict(layer_types=["linear_attention"] * 3 + ["sliding_attention"]), r"layer_types\[3\]"),
        (dict(linear_num_value_heads=3), "linear_num_value_heads"),
        (dict(hidden_act="gelu"), "hidden_act"),
        (dict(quantization_config={"quant_method": "fp8"}), "quantization_config"),
        (dict(attn_output_gate=False), "attn_output_gate"),
        (dict(mamba_ssm_dtype="bfloat16"), "mamba_ssm_dtype"),
    ],
)
def test_refused_fields(over, match):
    with pytest.raises(ValueError, match=match):
        ModelConfig.from_hf_dict(json.loads(json.dumps(_config(**over))))


# --- the layer as two ranks' heads -------------------------------------------------

GDN_TEXT = dict(
    intermediate_size=96,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=16,
    linear_value_head_dim=32,
    linear_conv_kernel_dim=4,
)


def gdn_tensors(cfg, seed):
    """Random fp32 tensors of layer 0's Gated DeltaNet as the checkpoint names them."""
    g = torch.Generator().manual_seed(seed)
    c = cfg.gdn
    hk, hv, dk, dv, h = c.num_k_heads, c.num_v_heads, c.k_head_dim, c.v_head_dim, cfg.hidden_size
    m = LAYER + "linear_attn."

    def rnd(*shape, scale=0.2):
        return scale * torch.randn(*shape, generator=g)

    t = {
        m + "conv1d.weight": rnd(c.conv_dim, 1, c.conv_kernel, scale=0.5),
        m + "A_log": rnd(hv, scale=0.5),
        m + "dt_bias": rnd(hv, scale=0.5),
        m + "norm.weight": 1.0 + rnd(dv),
        m + "out_proj.weight": rnd(h, hv * dv),
    }
    if cfg.family.gdn_in_proj == "qkvz_ba":
        r = hv // hk
        t[m + "in_proj_qkvz.weight"] = rnd(hk * (2 * dk + 2 * r * dv), h)
        t[m + "in_proj_ba.weight"] = rnd(hk * 2 * r, h)
    else:
        t[m + "in_proj_qkv.weight"] = rnd(c.conv_dim, h)
        t[m + "in_proj_z.weight"] = rnd(hv * dv, h)
        t[m + "in_proj_b.weight"] = rnd(hv, h)
        t[m + "in_proj_a.weight"] = rnd(hv, h)
    return t


@pytest.mark.parametrize("family", ["qwen3_next", "qwen3_5"])
def test_sharded_gdn_sums_to_the_whole(family):
    """A Gated DeltaNet layer as two ranks' heads (Qwen3-Next's grouped in_proj_qkvz /
    ba, Qwen3.5's four projections; conv channels, A_log, dt_bias by head; out_proj's
    columns): over a chunked prefill of two requests and a decode step the ranks' fp32
    outputs summed equal the whole layer's, each rank's recurrent state is its v heads of
    the whole one's, and its state spec holds its heads only."""
    from engine.gdn import StateGroup, gdn_step

    if family == "qwen3_next":
        cfg = hf_config("Qwen3NextConfig", "Qwen3NextForCausalLM", **GDN_TEXT)
    else:
        cfg = hf_config("Qwen3_5Config", "Qwen3_5ForConditionalGeneration", True, **GDN_TEXT)
    assert cfg.family.gdn_in_proj == ("qkvz_ba" if family == "qwen3_next" else "apart")
    tensors = gdn_tensors(cfg, seed=7)
    layers = [load_layer(cfg, tensors, s, "gdn") for s in shards("tp")]
    whole = load_layer(cfg, tensors, shards("tp")[0]._replace(world=1), "gdn")
    for layer in (whole, *layers):
        group = StateGroup(layer.spec(), [layer.name])
        group.allocate(2)
        layer.bind(group.conv[layer.name], group.ssm[layer.name])
    assert layers[0].spec().num_v_heads == 2 and layers[0].spec().conv_dim == 96
    gen = torch.Generator().manual_seed(3)
    for lens, has_state in (([5, 3], [False, False]), ([1, 1], [True, True])):
        step = gdn_step(lens, [0, 1], has_state)
        x = torch.randn(sum(lens), cfg.hidden_size, generator=gen)
        want = whole(x, step)
        got = layers[0](x, step) + layers[1](x, step)
        assert torch.allclose(got, want, **rtol_atol("gdn_shards")), (got - want).abs().max()
    state = tolerance("gdn_shards_state", torch.float32).abs
    for r, layer in enumerate(layers):
        assert torch.allclose(layer.ssm_state, whole.ssm_state[:, 2 * r : 2 * r + 2], atol=state)
