"""Batching and preemption on every family with sliding layers or its own structure:
long prompts (past every window) and short ones in one batch, prefilled in chunks
beside the short ones' decodes, and a KV pool so small that requests are preempted and
recomputed. Each request's greedy tokens are HF transformers' for that prompt alone
(no padding), on tiny random models in fp32 (eager attention). The one place for this
check on attention families (test_engine_gdn's covers the GDN state slots)."""

import zlib

import pytest
import torch
import transformers

from engine.llm import SamplingParams

from . import hf_models as hm

SMALL = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=96,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=4200,
)
GEMMA = dict(head_dim=32, query_pre_attn_scalar=24, sliding_window=16)
# (config class, fields): every window shorter than the long prompts below
FAMILIES = {
    # one sliding group, no full layer
    "mistral": ("MistralConfig", dict(num_hidden_layers=2, sliding_window=20)),
    # full layer 0, sliding layers 1-2 (from max_window_layers); a window of 40 keeps
    # the engine's blocks of 64 (the others get blocks of 32)
    "qwen2": (
        "Qwen2Config",
        dict(num_hidden_layers=3, use_sliding_window=True, sliding_window=40, max_window_layers=1),
    ),
    "qwen3": (
        "Qwen3Config",
        dict(
            num_hidden_layers=3,
            head_dim=32,
            use_sliding_window=True,
            sliding_window=24,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        ),
    ),
    # the shared expert, a dense layer 2, sliding layers 0 and 2
    "qwen2_moe": (
        "Qwen2MoeConfig",
        dict(
            num_hidden_layers=4,
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=80,
            mlp_only_layers=[2],
            use_sliding_window=True,
            sliding_window=24,
            max_window_layers=3,
        ),
    ),
    # soft-caps small enough to bite on random weights
    "gemma2": (
        "Gemma2Config",
        dict(GEMMA, num_hidden_layers=4, attn_logit_softcapping=3.0, final_logit_softcapping=2.0),
    ),
    # a linear-scaled global rope, a local one of another base
    "gemma3": (
        "Gemma3TextConfig",
        dict(
            GEMMA,
            num_hidden_layers=3,
            sliding_window_pattern=2,
            rope_parameters={
                "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e5},
                "sliding_attention": {"rope_type": "default", "rope_theta": 1e3},
            },
        ),
    ),
    # sinks, biased experts, YaRN; sliding layers 0 and 2
    "gpt_oss": (
        "GptOssConfig",
        dict(
            num_hidden_layers=3,
            intermediate_size=64,
            head_dim=32,
            num_local_experts=8,
            num_experts_per_tok=2,
            sliding_window=24,
        ),
    ),
}
# (mean, std) of parameters drawn at other scales (as in test_engine_families): GPT-OSS's
# sinks as large as the attention scores, its experts so that swigluoai's clamps bite
# Gemma's norms scale by 1 + w
NORMS = {"gemma2": (0.0, 0.3), "gemma3": (0.0, 0.3)}
# saved as bf16 (as published); the reference is that checkpoint run in fp32
BF16 = ("gpt_oss",)

# long (60-90 tokens, past every window) and short (3-5) prompts, interleaved
PROMPT_LENGTHS = (70, 3, 90, 5, 62)
SP = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
# KV bytes per token (all layers) that the preemption test's pool holds: measured to
# preempt every family here (13-22 preemptions) while the longest request still fits
# alone (at 100, a 64-token block of the full group is too few and long requests fail)
SMALL_POOL_TOKENS = 140


def _random(name):
    cls, fields = FAMILIES[name]
    cfg = getattr(transformers, cls)(**{**SMALL, **fields})
    return hm.random_model(cfg, zlib.crc32(name.encode()), norm=NORMS.get(name, (1.0, 0.2)))


PROMPTS = [hm.prompt(n, salt) for salt, n in enumerate(PROMPT_LENGTHS)]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """name -> (directory, HF model in fp32, HF's tokens for each of PROMPTS), each made
    once, when a test first asks."""
    made = {}

    def get(name):
        if name not in made:
            model = _random(name)
            path = tmp_path_factory.mktemp(name)
            if name in BF16:  # loaded back in fp32, not model.float() (rope's inv_freq)
                model.to(torch.bfloat16).save_pretrained(path)
                model = transformers.AutoModelForCausalLM.from_pretrained(
                    path, dtype=torch.float32, attn_implementation="eager"
                ).eval()
            else:
                model.save_pretrained(path)
            want = [hm.hf_greedy(model, p, SP.max_tokens) for p in PROMPTS]
            made[name] = (str(path), model, want)
        return made[name]

    return get


def _llm(path, **kw):
    # blocks of 64: the full-attention groups' block size differs from the small
    # windows' (32); the default KV budget unless a test sets one
    kw = {"block_size": 64, "max_num_batched_tokens": 64, "kv_cache_memory": None, **kw}
    return hm.engine(path, **kw)


def _all_blocks_returned(llm):
    return all(g.pool.num_free == g.pool.num_blocks for g in llm.scheduler.groups)


@pytest.mark.parametrize("name", list(FAMILIES))
def test_mixed_long_and_short_prompts_give_hf_tokens(checkpoint, name):
    """Chunks of 64 tokens per step: the long prompts prefill over several steps while
    the short ones already decode; every request's tokens are HF's."""
    path, hf, want = checkpoint(name)
    llm = _llm(path, kv_cache_memory=8 << 20)
    windows = llm.config.layer_windows
    assert windows == hm.hf_windows(hf)
    assert 0 < min(w for w in windows if w > 0) < min(n for n in PROMPT_LENGTHS if n > 5)
    assert {g.sliding_window for g in llm.kv_cache_groups} == set(windows)
    outs = llm.generate(PROMPTS, SP)
    assert [o.token_ids for o in outs] == want
    assert max(llm.steps) == len(PROMPTS) and llm.scheduler.num_preemptions == 0
    assert _all_blocks_returned(llm)


@pytest.mark.parametrize("name", list(FAMILIES))
def test_preemption_keeps_hf_tokens(checkpoint, name):
    """A pool of SMALL_POOL_TOKENS tokens' bytes, shared by the groups: the newest
    requests are preempted and recomputed, and every request's tokens are still HF's."""
    path, hf, want = checkpoint(name)
    cfg = hf.config
    d = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    per_token = 2 * cfg.num_key_value_heads * d * 4 * cfg.num_hidden_layers  # K+V, fp32
    llm = _llm(path, kv_cache_memory=SMALL_POOL_TOKENS * per_token, max_num_batched_tokens=32)
    outs = llm.generate(PROMPTS, SP)
    assert [o.finish_reason for o in outs] == ["length"] * len(PROMPTS)
    assert [o.token_ids for o in outs] == want
    assert llm.scheduler.num_preemptions > 0
    assert _all_blocks_returned(llm)
