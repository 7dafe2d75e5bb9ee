"""Tensor parallelism (issue 29) at the model level: each rank's DecoderModel holds its
part (engine.shard.Shard), and two ranks joined in a gloo group on loopback
(tests.ranks.run_ranks) give the same greedy tokens as one process, fp32 logits within
1e-4, on tiny random checkpoints: Llama (GQA heads split, q|k|v and o biases, an odd
vocabulary padded on the last rank), Qwen3 (q/k norms, one KV head replicated on both
ranks, tied embeddings), Gemma 3 (sandwich norms, sliding and full groups, two ropes,
the scaled embedding) and a GGUF file kept quantised (rows and whole blocks sliced; a
row-parallel tensor whose K per rank splits a block dequantised for that shard). The
configs that do not split are refused by name before any weight is read.

One process pair serves every model (the ranks load and run them in turn); the TP=1
reference runs first in this process, so the ranks load the compiled kernels from
Numba's cache (no rank compiles while the other waits at a collective)."""

import contextlib
import zlib

import pytest
import torch
import transformers

from engine.dist import LOCAL, Comm
from engine.loader import ModelConfig, load_checkpoint
from engine.models.decoder import DecoderModel
from engine.platform import get_moe_isa
from engine.runner import ModelRunner
from engine.shard import SINGLE, Shard, check_split
from numkern.testing.quantize import quantize

from . import hf_models as hm
from .gguf_convert import convert
from .ranks import run_ranks

PROMPTS = [hm.prompt(7), hm.prompt(20, 1)]  # 20 > Gemma's window of 16
DECODE_STEPS = 4
TOL = 1e-4  # fp32: the ranks' partial sums, reduced in fp32, against one process's

MODELS = {
    "llama": lambda: transformers.LlamaConfig(
        vocab_size=255, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, attention_bias=True,
        max_position_embeddings=256, tie_word_embeddings=False,
    ),
    "qwen3": lambda: transformers.Qwen3Config(
        vocab_size=256, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, head_dim=32,
        max_position_embeddings=256, tie_word_embeddings=True,
    ),
    "gemma3": lambda: transformers.Gemma3TextConfig(
        vocab_size=256, hidden_size=64, intermediate_size=96, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, max_position_embeddings=256,
        query_pre_attn_scalar=24, sliding_window=16, num_hidden_layers=3,
        sliding_window_pattern=2,
        rope_parameters={
            "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e5},
            "sliding_attention": {"rope_type": "default", "rope_theta": 1e3},
        },
    ),
}  # fmt: skip
# a GGUF Qwen3 kept quantised: o's K per rank (128) is whole Q4_0 blocks (sliced as
# stored), down's (192) splits a Q6_K block of 256 (dequantised for the shard, logged)
GGUF_SIZES = dict(
    vocab_size=320, hidden_size=256, intermediate_size=256, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=256,
    tie_word_embeddings=False,
)  # fmt: skip
GGUF_TYPES = {
    "attn_q.": "Q8_0", "attn_k.": "Q8_0", "attn_v.": "Q8_0", "attn_output": "Q4_0",
    "ffn_gate": "Q5_1", "ffn_up": "Q5_1", "ffn_down": "Q6_K", "token_embd": "Q4_K",
    "output.": "Q6_K",
}  # fmt: skip


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """name -> checkpoint path (HF directories in fp32, one GGUF file)."""
    out = {}
    for name, make in MODELS.items():
        norm = (0.0, 0.3) if name.startswith("gemma") else (1.0, 0.2)
        hf = hm.random_model(make(), zlib.crc32(name.encode()), norm=norm)
        path = tmp_path_factory.mktemp(name)
        hf.save_pretrained(path)
        out[name] = str(path)
    hf = hm.random_model(transformers.Qwen3Config(**GGUF_SIZES), 5)
    folder = tmp_path_factory.mktemp("gguf")
    hf.save_pretrained(folder / "hf")

    def types(name, shape):
        return next((t for key, t in GGUF_TYPES.items() if key in name), None)

    convert(folder / "hf", folder / "q.gguf", types=types, quantize=quantize)
    out["gguf"] = str(folder / "q.gguf")
    return out


def _greedy(comm, path, world, spy=False):
    """This rank's run of PROMPTS (prefilled in one step, then DECODE_STEPS batched
    decode steps, greedy): ``(tokens, [step logits [2, vocab]], weight bytes, names read
    whole)``."""
    from engine.loader import hf

    whole = []
    if spy:  # which safetensors tensors this rank reads whole (not only its part)
        get = hf.SafetensorsTensors.__getitem__
        hf.SafetensorsTensors.__getitem__ = lambda self, n: (whole.append(n), get(self, n))[1]
    try:
        shard = Shard(comm.rank, world)
        ckpt = load_checkpoint(path, dtype=torch.float32, progress=False, shard=shard)
        model = DecoderModel(
            ckpt, dtype=torch.float32, moe_isa=get_moe_isa(torch.float32), shard=shard, comm=comm
        )
    finally:
        if spy:
            hf.SafetensorsTensors.__getitem__ = get
    runner = ModelRunner(model)
    runner.initialize_kv_cache(
        4 << 20,
        block_size=32,
        dtype=torch.float32,
        max_num_seqs=2,
        max_num_batched_tokens=64,
        max_model_len=64,
    )
    with contextlib.ExitStack() as stack:
        taken = [stack.enter_context(runner.reserve(len(p) + DECODE_STEPS)) for p in PROMPTS]
        chunks = [(p, 0, b, s) for p, (b, s) in zip(PROMPTS, taken)]
        ends = torch.tensor([len(p) for p in PROMPTS]).cumsum(0) - 1
        logits = [runner.execute(chunks, ends.tolist())]
        tokens = [logits[-1].argmax(-1).tolist()]
        for step in range(DECODE_STEPS):
            chunks = [
                ([t], len(p) + step, b, s) for t, p, (b, s) in zip(tokens[-1], PROMPTS, taken)
            ]
            logits.append(runner.execute(chunks, [0, 1]))
            tokens.append(logits[-1].argmax(-1).tolist())
    return tokens, logits, model.weight_bytes(), whole


def _ranks_greedy(comm, paths):
    return {name: _greedy(comm, path, comm.world, spy=True) for name, path in paths.items()}


def test_tp2_matches_one_process(models):
    ref = {name: _greedy(LOCAL, path, 1) for name, path in models.items()}
    ranks = run_ranks(_ranks_greedy, models, world=2)
    for name in models:
        tokens, logits, nbytes, _ = ref[name]
        for rank, got in enumerate(ranks):
            got_tokens, got_logits, got_bytes, whole = got[name]
            assert got_tokens == tokens, (name, rank)
            for step, (a, b) in enumerate(zip(got_logits, logits)):
                assert a.shape == b.shape, (name, rank, step)
                err = (a - b).abs().max().item()
                assert err <= TOL, (name, rank, step, err)
            # a rank holds its share plus the replicated norms (and, with one KV head
            # for two ranks, that head's k|v rows on both)
            limit = 0.62 if name == "qwen3" else 0.55
            assert got_bytes <= limit * nbytes, (name, rank, got_bytes, nbytes)
            # every split tensor read as its part alone; only norms (replicated) whole
            assert all("norm" in n for n in whole), (name, rank, whole)


def test_configs_that_do_not_split_are_refused_by_name(tmp_path):
    # SmolLM2-135M's heads: 9 query / 3 KV heads at TP=2; the safetensors file is not
    # a safetensors file at all, so the refusal comes before any weight is read
    cfg = transformers.LlamaConfig(
        vocab_size=64, hidden_size=72, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=64,
    )  # fmt: skip
    cfg.save_pretrained(tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(ValueError, match=r"^num_attention_heads: .*tensor_parallel_size=2, got 9"):
        load_checkpoint(tmp_path, progress=False, shard=Shard(0, 2))
    with pytest.raises(ValueError, match=r"^num_key_value_heads: .*divisor of .*=4, got 6"):
        check_split(
            _llama(num_attention_heads=12, num_key_value_heads=6, hidden_size=96), Shard(0, 4)
        )
    with pytest.raises(ValueError, match=r"^intermediate_size: .*=2, got 63"):
        check_split(_llama(intermediate_size=63), Shard(1, 2))
    with pytest.raises(ValueError, match=r"^enable_expert_parallel: expected a model with experts"):
        check_split(_llama(), Shard(0, 2, True))
    moe = dict(num_experts=3, num_experts_per_tok=1, moe_intermediate_size=32)
    with pytest.raises(ValueError, match=r"^num_experts: .*=2, got 3"):
        check_split(_qwen3_moe(**moe), Shard(0, 2, True))
    with pytest.raises(ValueError, match=r"^num_experts: expected at least .*=4 .*got 2"):
        check_split(_qwen3_moe(**dict(moe, num_experts=2)), Shard(0, 4, True))
    with pytest.raises(ValueError, match=r"^moe_intermediate_size: .*=2, got 31"):
        check_split(_qwen3_moe(**dict(moe, moe_intermediate_size=31)), Shard(0, 2))
    # what splits: KV heads fewer than ranks (replicated), a vocabulary of any size
    check_split(_llama(num_key_value_heads=1, vocab_size=7), Shard(1, 4))
    check_split(_qwen3_moe(**dict(moe, num_experts=4)), Shard(1, 2, True))
    check_split(_llama(), SINGLE)


def _llama(**over):
    d = dict(
        vocab_size=64, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
    )  # fmt: skip
    cfg = transformers.LlamaConfig(**{**d, **over}, architectures=["LlamaForCausalLM"])
    return ModelConfig.from_hf_dict(cfg.to_dict())


def _qwen3_moe(**over):
    d = dict(
        vocab_size=64, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=64,
    )  # fmt: skip
    cfg = transformers.Qwen3MoeConfig(**{**d, **over}, architectures=["Qwen3MoeForCausalLM"])
    return ModelConfig.from_hf_dict(cfg.to_dict())


def test_a_rank_holds_its_heads_neurons_and_vocabulary(models):
    """Rank 1 of 2 (loaded in this process; no collective runs at load): its heads'
    q|k|v rows, its o columns, its MLP neurons, its vocabulary rows (the last rank's
    padded with zero rows), o's bias on rank 0 only; ``comm`` must be the shard's."""
    path = models["llama"]
    whole = DecoderModel(
        load_checkpoint(path, progress=False),
        dtype=torch.float32,
        moe_isa=get_moe_isa(torch.float32),
    )
    parts = []
    for rank in range(2):
        shard = Shard(rank, 2)
        ckpt = load_checkpoint(path, progress=False, shard=shard)
        parts.append(
            DecoderModel(
                ckpt,
                dtype=torch.float32,
                moe_isa=get_moe_isa(torch.float32),
                shard=shard,
                comm=Comm(rank, 2),
            )
        )
    r0, r1 = parts
    assert (r1.hq, r1.hkv, whole.hq, whole.hkv) == (2, 1, 4, 2)
    assert [a.num_heads for a in r1.attention_layers()] == [2, 2]
    assert [a.num_kv_heads for a in r1.attention_layers()] == [1, 1]
    d = whole.d
    assert r1.weights[0].qkv_bias.shape == ((2 + 1 + 1) * d,)
    q = whole.weights[0].qkv_bias
    assert torch.equal(r1.weights[0].qkv_bias[: 2 * d], q[2 * d : 4 * d])  # q heads 2, 3
    assert torch.equal(r1.weights[0].qkv_bias[2 * d : 3 * d], q[5 * d : 6 * d])  # k head 1
    assert r0.weights[0].o_bias is not None and r1.weights[0].o_bias is None
    # vocabulary 255: rows [0, 128) and [128, 255) + one zero row
    assert (r0.v0, r0.v1, r1.v0, r1.v1) == (0, 128, 128, 255)
    assert torch.equal(r1.embed[:127], whole.embed[128:]) and not r1.embed[127].any()
    assert r1.lm_head.shape[0] == 128
    with pytest.raises(ValueError, match=r"^comm: expected rank 1 of 2"):
        DecoderModel(
            load_checkpoint(path, progress=False, shard=Shard(1, 2)),
            dtype=torch.float32,
            moe_isa=get_moe_isa(torch.float32),
            shard=Shard(1, 2),
            comm=LOCAL,
        )
