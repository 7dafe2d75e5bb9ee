"""Gemma 2 and Gemma 3 (text, and the text model of Gemma3ForConditionalGeneration)
against HF transformers on tiny random models in fp32: (1 + w) norms, sandwich norms,
tanh-GELU, the scaled embedding, soft-caps, query_pre_attn_scalar, alternating sliding
and full layers, and Gemma 3's local and global rope; Gemma 2 in bf16. Mixed batches and
preemption on both: test_engine_batching."""

import zlib

import pytest
import torch
import transformers

from engine.llm import SamplingParams
from engine.loader import ModelConfig

from . import hf_models as hm
from .close import rtol_atol

TEXT = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=96,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    max_position_embeddings=512,
    query_pre_attn_scalar=24,  # a scale other than head_dim ** -0.5
    sliding_window=16,
)
FAMILIES = {
    # soft-caps small enough to bite on random weights; layers 0, 2 slide (the default
    # pattern), 1, 3 attend to all
    "gemma2": lambda: transformers.Gemma2Config(
        **TEXT, num_hidden_layers=4, attn_logit_softcapping=3.0, final_logit_softcapping=2.0
    ),
    # every 2nd layer full (sliding_window_pattern 2), a linear-scaled global rope and a
    # local one of another base
    "gemma3": lambda: transformers.Gemma3TextConfig(
        **TEXT,
        num_hidden_layers=3,
        sliding_window_pattern=2,
        rope_parameters={
            "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e5},
            "sliding_attention": {"rope_type": "default", "rope_theta": 1e3},
        },
    ),
}

GEMMA_NORMS = (0.0, 0.3)  # Gemma's norms scale by 1 + w


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    out = {}
    for name, make in FAMILIES.items():
        model = transformers.AutoModelForCausalLM.from_config(make(), attn_implementation="eager")
        model = hm.randomize(model, zlib.crc32(name.encode()), norm=GEMMA_NORMS)
        path = tmp_path_factory.mktemp(name)
        model.save_pretrained(path)
        out[name] = (str(path), model)
    return out


@pytest.mark.parametrize("name", list(FAMILIES))
def test_fp32_parity_with_hf(checkpoints, name):
    """A 40-token prompt (past the 16-token window): prompt logits, 32 greedy tokens and
    each decode step's logits as HF's (eager attention: its soft-cap)."""
    path, hf = checkpoints[name]
    llm = hm.engine(path)
    prompt = hm.prompt(40)
    with torch.no_grad():
        ref = hf(torch.tensor([prompt])).logits[0]
    torch.testing.assert_close(llm.prompt_logits(prompt), ref, **rtol_atol("engine_logits"))
    llm.record_logits = True
    sp = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    out = llm.generate([prompt], sp)[0]
    assert out.token_ids == hm.hf_greedy(hf, prompt, 32)
    with torch.no_grad():
        ref_steps = hf(torch.tensor([prompt + out.token_ids])).logits[0, len(prompt) - 1 : -1]
    torch.testing.assert_close(torch.stack(out.logits), ref_steps, **rtol_atol("engine_logits"))
    windows = [(g.sliding_window, g.block_size) for g in llm.kv_cache_groups]
    assert windows == [(16, 32), (-1, 32)]  # layer 0 slides: its group comes first


def test_gemma2_bf16_parity_with_hf(checkpoints):
    """Gemma 2 in bf16 against HF in bf16 and fp32 by the bound of
    ``hm.assert_bf16_parity``: a 40-token prompt past the 16-token window, then 8 decode
    steps. Measured: bounds (max, median token) 0.098 and 0.060 on the prompt; on the
    median token the window dropped lies 1.02 from HF bf16, layer 0's sandwich norms
    swapped 0.997 (both past 2 x 0.060)."""
    path, hf32 = checkpoints["gemma2"]
    sandwich = hm.swap_norms("post_attention_layernorm", "pre_feedforward_layernorm")
    wrong = [hm.variant(hf32, hm.no_window), hm.variant(hf32, sandwich)]
    llm = hm.engine(path, dtype="bfloat16")
    hm.assert_bf16_parity(llm, hf32, hm.hf_bf16(path), hm.prompt(40), wrong=wrong)


def test_gemma3_for_conditional_generation_runs_its_text_model(tmp_path, caplog):
    """The multimodal wrapper (text_config, model.language_model.* tensors, a vision
    tower and projector): the engine runs the text model, skips the vision tensors by
    name and says so once; its logits are HF's on a text-only prompt."""
    vision = transformers.SiglipVisionConfig(
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=1,
        num_attention_heads=2,
        image_size=28,
        patch_size=14,
    )
    cfg = transformers.Gemma3Config(
        text_config=FAMILIES["gemma3"]().to_dict(), vision_config=vision, mm_tokens_per_image=4
    )
    hf = transformers.Gemma3ForConditionalGeneration(cfg)
    hf.config.text_config._attn_implementation = "eager"
    hf = hm.randomize(hf, 7, norm=GEMMA_NORMS)
    hf.save_pretrained(tmp_path)
    prompt = hm.prompt(20, 5)
    with caplog.at_level("INFO", logger="engine"):
        llm = hm.engine(str(tmp_path))
    assert llm.config.text_of == "Gemma3ForConditionalGeneration"
    assert sum("vision tensors" in r.getMessage() for r in caplog.records) == 1
    with torch.no_grad():
        ref = hf(input_ids=torch.tensor([prompt])).logits[0]
    torch.testing.assert_close(llm.prompt_logits(prompt), ref, **rtol_atol("engine_logits"))


BASE = dict(TEXT, num_hidden_layers=2, rms_norm_eps=1e-6)


@pytest.mark.parametrize(
    "arch, fields, match",
    [
        ("Gemma2ForCausalLM", dict(hidden_activation="gelu"), "hidden_activation"),
        ("Gemma3ForCausalLM", dict(use_bidirectional_attention=True), "use_bidirectional"),
        ("Gemma3ForCausalLM", dict(layer_types=["sliding_attention"]), "layer_types"),
        ("Gemma2ForCausalLM", dict(query_pre_attn_scalar=0), "query_pre_attn_scalar"),
        ("Gemma2ForCausalLM", dict(final_logit_softcapping=-1.0), "final_logit_softcapping"),
        ("Gemma3ForCausalLM", dict(sliding_window_pattern=0), "sliding_window_pattern"),
        (
            "Gemma3ForCausalLM",
            dict(rope_parameters={"full_attention": {"rope_type": "dynamic", "factor": 2.0}}),
            "rope_type",
        ),
    ],
)
def test_refused_fields(arch, fields, match):
    with pytest.raises(ValueError, match=match):
        ModelConfig.from_hf_dict(dict(BASE, architectures=[arch], **fields))


def test_config_defaults_as_transformers():
    """A Gemma 2 config.json that leaves the soft-caps and window out gets the class
    defaults (50, 30, 4096, alternating layers); Gemma 3's default pattern is 6."""
    d = {k: v for k, v in BASE.items() if k not in ("sliding_window", "num_hidden_layers")}
    c = ModelConfig.from_hf_dict(dict(d, architectures=["Gemma2ForCausalLM"], num_hidden_layers=4))
    hf = transformers.Gemma2Config(**d, num_hidden_layers=4)
    assert (c.attn_softcap, c.logit_softcap) == (50.0, 30.0)
    assert c.attn_softcap == hf.attn_logit_softcapping
    want = [hf.sliding_window if t == "sliding_attention" else -1 for t in hf.layer_types]
    assert c.layer_windows == want == [4096, -1, 4096, -1]
    assert c.tie_word_embeddings and c.embed_scale == 64**0.5
    c = ModelConfig.from_hf_dict(dict(d, architectures=["Gemma3ForCausalLM"], num_hidden_layers=7))
    hf = transformers.Gemma3TextConfig(**d, num_hidden_layers=7)
    want = [hf.sliding_window if t == "sliding_attention" else -1 for t in hf.layer_types]
    assert c.layer_windows == want
    assert (c.attn_softcap, c.logit_softcap) == (0.0, 0.0)
    full = hf.rope_parameters["full_attention"]["rope_theta"]
    local = hf.rope_parameters["sliding_attention"]["rope_theta"]
    assert [r[0] for r in c.layer_ropes] == [full if w < 0 else local for w in c.layer_windows]
