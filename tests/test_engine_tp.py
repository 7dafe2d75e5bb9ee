"""Tensor parallelism (issue 29) at the model level: each rank's DecoderModel holds its
part (engine.shard.Shard), and two ranks joined in a gloo group on loopback
(tests.ranks.run_ranks) give the same greedy tokens as one process, fp32 logits within
1e-4, on tiny random checkpoints: Llama (GQA heads split, q|k|v and o biases), Qwen3
(q/k norms, one KV head replicated on both ranks, tied embeddings, an odd vocabulary
padded on the last rank: compared with transformers, see ODD_VOCAB), Gemma 3 (sandwich
norms, sliding and full groups, two ropes, the scaled embedding) and a GGUF file kept
quantised (rows and whole blocks sliced; a row-parallel tensor whose K per rank splits a
block dequantised for that shard). The configs that do not split are refused by name
before any weight is read.

The MoE and Gated DeltaNet families (issue 29), at TP=2 (every expert's neurons split)
and EP=2 (whole experts per rank; attention, dense MLPs and GDN heads split as under
TP): Qwen3-MoE (a dense and an MoE layer), Mixtral (a share of 16 neurons padded to
32), GPT-OSS (sinks, sliding and full layers, expert biases), Qwen2-MoE (the shared
expert split along S) and Qwen3-Next (GDN heads, MoE with a shared expert, a dense
layer), the same way.

One process pair (tests.ranks.run_ranks: the ranks joined over the engine's transport,
shared memory on this host) serves every model of this file, dense and MoE, in both
modes (the ranks load and run them in turn); the TP=1 references run first in this
process, so the ranks load the compiled kernels from Numba's cache (no rank compiles
while the other waits at a collective)."""

import contextlib
import pickle
import zlib

import pytest
import torch
import transformers

from engine.dist import LOCAL, Comm
from engine.llm import SamplingParams
from engine.loader import ModelConfig, load_checkpoint
from engine.loader.checkpoint import select_part
from engine.models.decoder import DecoderModel
from engine.platform import get_moe_isa
from engine.runner import ModelRunner
from engine.shard import SINGLE, Shard, check_split
from numkern.testing.quantize import quantize
from numkern.testing.tolerances import tolerance

from . import hf_models as hm
from .gguf_convert import convert
from .ranks import run_ranks
from .test_engine_tp_launch import _gone

PROMPTS = [hm.prompt(7), hm.prompt(20, 1)]  # 20 > Gemma's window of 16
DECODE_STEPS = 4
# fp32: the ranks' partial sums, reduced in fp32, against one process's (the table's)
TOL = tolerance("engine_tp", torch.float32).abs
# The model whose vocabulary (255) does not split in two is compared with transformers'
# fp32 logits, not with the one-process engine: numkern's fp32 LM head on main (555c7c9)
# writes wrong values into the last columns of the second logits row when the vocabulary
# is not a multiple of 8 (seen with 250 and 255; 248 and 256 are right), a bug of the
# unsplit head that the two ranks' 128-row heads do not meet.
ODD_VOCAB = "qwen3"
# the names of the tensors a rank reads only its part of (o's bias: rank 0 reads it whole,
# the others none of it)
SPLIT = ("_proj.weight", "q_proj.bias", "k_proj.bias", "v_proj.bias", "embed_tokens.weight",
         "lm_head.weight", "sinks")  # fmt: skip

MODELS = {
    "llama": lambda: transformers.LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, attention_bias=True,
        max_position_embeddings=256, tie_word_embeddings=False,
    ),
    "qwen3": lambda: transformers.Qwen3Config(
        vocab_size=255, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
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
    """name -> checkpoint path (HF directories in fp32, one GGUF file); the HF model of
    ODD_VOCAB under "hf"."""
    out = {}
    for name, make in MODELS.items():
        norm = (0.0, 0.3) if name.startswith("gemma") else (1.0, 0.2)
        hf = hm.random_model(make(), zlib.crc32(name.encode()), norm=norm)
        path = tmp_path_factory.mktemp(name)
        hf.save_pretrained(path)
        out[name] = str(path)
        if name == ODD_VOCAB:
            out["hf"] = hf
    hf = hm.random_model(transformers.Qwen3Config(**GGUF_SIZES), 5)
    folder = tmp_path_factory.mktemp("gguf")
    hf.save_pretrained(folder / "hf")

    def types(name, shape):
        return next((t for key, t in GGUF_TYPES.items() if key in name), None)

    convert(folder / "hf", folder / "q.gguf", types=types, quantize=quantize)
    out["gguf"] = str(folder / "q.gguf")
    return out


def _greedy(comm, path, world, spy=False, expert_parallel=False):
    """This rank's run of PROMPTS (prefilled in one step, then DECODE_STEPS batched
    decode steps, greedy): ``(tokens, [step logits [2, vocab]], weight bytes, names read
    whole)``; ``expert_parallel``: the shard's (the MoE tests below)."""
    from engine.loader import hf

    whole = []
    if spy:  # which safetensors tensors this rank reads whole (not only its part)
        get = hf.SafetensorsTensors.__getitem__
        hf.SafetensorsTensors.__getitem__ = lambda self, n: (whole.append(n), get(self, n))[1]
    try:
        shard = Shard(comm.rank, world, expert_parallel)
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
    out = {}
    for name, path in paths.items():
        tokens, logits, nbytes, whole = _greedy(comm, path, comm.world, spy=True)
        # NumPy arrays: torch's own pickling would share the storage with a process
        # that has exited by the time the parent reads it
        out[name] = (tokens, [t.numpy() for t in logits], nbytes, whole)
    return out


def _hf_greedy(hf):
    """transformers' greedy run of PROMPTS as :func:`_greedy` returns it (tokens and
    logits per step)."""
    seqs = [list(p) + hm.hf_greedy(hf, p, DECODE_STEPS + 1) for p in PROMPTS]
    with torch.no_grad():
        out = [hf(torch.tensor([s])).logits[0] for s in seqs]
    logits = [
        torch.stack([o[len(p) - 1 + step] for o, p in zip(out, PROMPTS)])
        for step in range(DECODE_STEPS + 1)
    ]
    return [t.argmax(-1).tolist() for t in logits], logits


def test_tp2_matches_one_process(models):
    paths = {n: p for n, p in models.items() if n != "hf"}
    ref = {n: _greedy(LOCAL, p, 1) for n, p in paths.items()}
    ref[ODD_VOCAB] = (*_hf_greedy(models["hf"]), *ref[ODD_VOCAB][2:])
    ranks = run_ranks(_ranks_greedy, paths, world=2)
    for name in paths:
        tokens, logits, nbytes, _ = ref[name]
        for rank, got in enumerate(ranks):
            got_tokens, got_logits, got_bytes, whole = got[name]
            assert got_tokens == tokens, (name, rank)
            for step, (a, b) in enumerate(zip(got_logits, logits)):
                a = torch.from_numpy(a)
                assert a.shape == b.shape, (name, rank, step)
                err = (a - b).abs().max().item()
                assert err <= TOL, (name, rank, step, err)
            # a rank holds its share plus the replicated norms (and, with one KV head
            # for two ranks, that head's k|v rows on both; the GGUF's down_proj, whose
            # K per rank splits a Q6_K block, in fp32 for the shard: 2.4x its bytes)
            limit = {"qwen3": 0.62, "gguf": 0.8}.get(name, 0.55)
            assert got_bytes <= limit * nbytes, (name, rank, got_bytes, nbytes)
            # every split tensor read as its part alone (only replicated ones whole)
            assert not [n for n in whole if n.endswith(SPLIT)], (name, rank, whole)


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


def _rank_models(path, world=2):
    """(the one-process model, [each rank's model]) of ``path``, loaded in this process
    (no collective runs at load)."""
    isa = get_moe_isa(torch.float32)
    whole = DecoderModel(load_checkpoint(path, progress=False), dtype=torch.float32, moe_isa=isa)
    parts = []
    for rank in range(world):
        shard = Shard(rank, world)
        ckpt = load_checkpoint(path, progress=False, shard=shard)
        kw = dict(dtype=torch.float32, moe_isa=isa, shard=shard, comm=Comm(rank, world))
        parts.append(DecoderModel(ckpt, **kw))
    return whole, parts


def test_a_rank_holds_its_heads_neurons_and_vocabulary(models):
    """Each rank's heads' q|k|v rows and biases, o's bias on rank 0 only (Llama); one KV
    head replicated, the vocabulary's rows with the last rank's padded with a zero row
    (Qwen3, vocab 255, tied); ``comm`` must be the shard's."""
    whole, (r0, r1) = _rank_models(models["llama"])
    assert (r1.hq, r1.hkv, whole.hq, whole.hkv) == (2, 1, 4, 2)
    assert [(a.num_heads, a.num_kv_heads) for a in r1.attention_layers()] == [(2, 1)] * 2
    d = whole.d
    q = whole.weights[0].qkv_bias
    assert r1.weights[0].qkv_bias.shape == ((2 + 1 + 1) * d,)
    assert torch.equal(r1.weights[0].qkv_bias[: 2 * d], q[2 * d : 4 * d])  # q heads 2, 3
    assert torch.equal(r1.weights[0].qkv_bias[2 * d : 3 * d], q[5 * d : 6 * d])  # k head 1
    assert torch.equal(r1.weights[0].qkv_bias[3 * d :], q[7 * d :])  # v head 1
    assert r0.weights[0].o_bias is not None and r1.weights[0].o_bias is None
    whole, (r0, r1) = _rank_models(models["qwen3"])
    assert (r0.hkv, r1.hkv) == (1, 1)  # the one KV head on both ranks
    # vocabulary 255: rows [0, 128) and [128, 255) + one zero row
    assert (r0.v0, r0.v1, r1.v0, r1.v1) == (0, 128, 128, 255)
    assert torch.equal(r0.embed, whole.embed[:128])
    assert torch.equal(r1.embed[:127], whole.embed[128:]) and not r1.embed[127].any()
    assert r0.lm_head.shape[0] == r1.lm_head.shape[0] == 128
    with pytest.raises(ValueError, match=r"^comm: expected rank 1 of 2"):
        DecoderModel(
            load_checkpoint(models["qwen3"], progress=False, shard=Shard(1, 2)),
            dtype=torch.float32,
            moe_isa=get_moe_isa(torch.float32),
            shard=Shard(1, 2),
            comm=LOCAL,
        )


def test_a_part_read_alone_is_that_part_of_the_tensor(models, tmp_path):
    """``Checkpoint.take(name, part)`` reads only the part (a safetensors slice; a GGUF
    tensor's rows, Llama's q rows put back in HF order first) and gives the whole
    tensor's part; ``take_raw`` gives its stored rows and whole blocks of its columns,
    or None (the tensor left in place) for columns that split a block."""
    q8 = ("attn_q", "ffn_down")

    def types(name, shape):
        return "Q8_0" if any(k in name for k in q8) else None

    gguf = tmp_path / "llama.gguf"
    convert(models["llama"], gguf, types=types, quantize=quantize)
    q, down = "model.layers.0.self_attn.q_proj.weight", "model.layers.0.mlp.down_proj.weight"
    parts = [
        (q, (slice(16, 48),)),
        (q, (torch.tensor([40, 3, 1, 33]),)),  # any rows, in any order
        (down, (None, slice(32, 64))),
        (down, (slice(5, 9), slice(0, 32))),
        ("model.embed_tokens.weight", (slice(128, 256),)),
        ("model.layers.1.self_attn.k_proj.bias", (slice(16, 32),)),
    ]
    for path in (models["llama"], gguf):
        for name, part in parts:
            whole = load_checkpoint(path, progress=False).take(name)
            got = load_checkpoint(path, progress=False).take(name, part)
            assert torch.equal(got, select_part(whole, part)), (path, name, part)
    full = load_checkpoint(gguf, progress=False).take_raw(down)
    ckpt = load_checkpoint(gguf, progress=False)
    raw = ckpt.take_raw(down, (slice(5, 9), slice(32, 64)))  # Q8_0: 34 bytes a block of 32
    assert raw.shape == (4, 32) and torch.equal(raw.data, full.data[5:9, 34:68])
    raw = ckpt.take_raw(q, (torch.tensor([40, 3]),))
    assert torch.equal(raw.data, load_checkpoint(gguf, progress=False).take_raw(q).data[[40, 3]])
    down1 = "model.layers.1.mlp.down_proj.weight"
    assert ckpt.take_raw(down1, (None, slice(16, 48))) is None  # splits a block
    assert ckpt.take(down1).shape == (64, 96)  # left in place for take


def test_llm_tp2_mixed_batch_with_preemption(models):
    """``LLM(tensor_parallel_size=2)``: four requests admitted together whose growth past
    one block each a pool of 4 blocks per rank cannot hold, so the newest is preempted
    and recomputed, give one process's greedy tokens and step logits (within TOL)."""
    path = models["llama"]
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    grow = [list(range(5, 35)), list(range(40, 70)), [7] * 30, list(range(100, 130))]
    one = hm.engine(path)
    one.record_logits = True
    ref = one.generate(grow, sp)
    # a rank's block: K+V x 32 positions x its 1 KV head x head_dim 16 x fp32 x 2 layers
    block_bytes = 2 * 32 * 1 * 16 * 4 * 2
    with hm.engine(path, tensor_parallel_size=2, dist_timeout=10.0,
                   kv_cache_memory=4 * block_bytes) as two:  # fmt: skip
        assert [g.num_blocks for g in two.kv_cache_groups] == [4]
        two.record_logits = True
        outs = two.generate(grow, sp)
        assert two.scheduler.num_preemptions > 0
    for o, r in zip(outs, ref, strict=True):
        assert o.token_ids == r.token_ids
        for a, b in zip(o.logits, r.logits, strict=True):
            assert (a - b).abs().max().item() <= TOL


_ATTN = dict(vocab_size=256, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
             max_position_embeddings=256)  # fmt: skip
MOE_MODELS = {
    "qwen3_moe": lambda: transformers.Qwen3MoeConfig(
        **_ATTN, intermediate_size=96, num_hidden_layers=2, head_dim=16, num_experts=8,
        num_experts_per_tok=2, moe_intermediate_size=64, decoder_sparse_step=2,
        norm_topk_prob=False,
    ),
    "mixtral": lambda: transformers.MixtralConfig(
        **_ATTN, intermediate_size=32, num_hidden_layers=2, num_local_experts=4,
        num_experts_per_tok=2,
    ),
    "gpt_oss": lambda: transformers.GptOssConfig(
        **_ATTN, intermediate_size=64, num_hidden_layers=2, head_dim=16, num_local_experts=4,
        num_experts_per_tok=2, sliding_window=16,
    ),
    "qwen2_moe": lambda: transformers.Qwen2MoeConfig(
        **_ATTN, intermediate_size=96, num_hidden_layers=2, num_experts=4,
        num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=64,
    ),
    "qwen3_next": lambda: transformers.Qwen3NextConfig(
        **_ATTN, intermediate_size=96, num_hidden_layers=4, head_dim=32,
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
        linear_value_head_dim=32, linear_conv_kernel_dim=4, num_experts=8,
        num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48,
        mlp_only_layers=[1],
    ),
}  # fmt: skip


PADDED = ("mixtral", "qwen2_moe", "qwen3_next")  # moe_intermediate_size 32: 16 a rank


@pytest.fixture(scope="module")
def moe_models(tmp_path_factory):
    """name -> fp32 HF checkpoint directory."""
    out = {}
    for name, make in MOE_MODELS.items():
        norm = (0.0, 0.3) if name == "qwen3_next" else (1.0, 0.2)  # (1 + w) norms
        hf = hm.random_model(make(), zlib.crc32(name.encode()), norm=norm)
        path = tmp_path_factory.mktemp(name)
        hf.save_pretrained(path)
        out[name] = str(path)
    return out


def _ranks_greedy_moe(comm, paths):
    """Every model in both modes on this rank, pickled here: a tensor put on a
    multiprocessing queue travels as a file descriptor its sender must outlive, and the
    rank exits once it has put its result."""
    return pickle.dumps({
        (name, ep): _greedy(comm, path, comm.world, expert_parallel=ep)
        for name, path in paths.items()
        for ep in (False, True)
    })  # fmt: skip


def test_tp2_and_ep2_match_one_process(moe_models):
    ref = {name: _greedy(LOCAL, path, 1) for name, path in moe_models.items()}
    ranks = [pickle.loads(r) for r in run_ranks(_ranks_greedy_moe, moe_models, world=2)]
    for (name, ep), _ in ranks[0].items():
        tokens, logits, nbytes, _ = ref[name]
        for rank, got in enumerate(ranks):
            got_tokens, got_logits, got_bytes, _ = got[name, ep]
            what = (name, "ep" if ep else "tp", rank)
            assert got_tokens == tokens, what
            for step, (a, b) in enumerate(zip(got_logits, logits)):
                assert a.shape == b.shape, (*what, step)
                err = (a - b).abs().max().item()
                assert err <= TOL, (*what, step, err)
            # a rank holds its share plus the replicated norms and routers (under TP a
            # share of 16 neurons is padded to 32: those models' experts are whole again)
            if ep or name not in PADDED:
                assert got_bytes <= 0.6 * nbytes, (*what, got_bytes, nbytes)


def test_llm_ep2_qwen3_next_matches_tp1(moe_models):
    """The LLM-level path (engine.dist's spawned worker): Qwen3-Next (GDN states per rank,
    experts whole per rank, the shared expert split) with ``enable_expert_parallel`` at
    ``tensor_parallel_size=2`` gives TP=1's greedy tokens and step logits within 1e-4 on a
    batch of three prompts; close() leaves no worker."""
    from engine.llm import SamplingParams

    greedy = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    prompts = [hm.prompt(5), hm.prompt(19, 1), hm.prompt(33, 2)]
    one = hm.engine(moe_models["qwen3_next"])
    one.record_logits = True
    ref = one.generate(prompts, greedy)
    one.close()
    two = hm.engine(
        moe_models["qwen3_next"],
        tensor_parallel_size=2,
        enable_expert_parallel=True,
        dist_timeout=10.0,
    )
    try:
        (pid,) = two.runtime.pids
        two.record_logits = True
        outs = two.generate(prompts, greedy)
    finally:
        two.close()
    for o, r in zip(outs, ref, strict=True):
        assert o.token_ids == r.token_ids
        for a, b in zip(o.logits, r.logits, strict=True):
            torch.testing.assert_close(a, b, atol=TOL, rtol=0)
    assert _gone(pid, within=1.0)


def _connect_as(comm, collectives, hosts):
    """This rank's transport from ``engine.dist.connect`` when the ranks report ``hosts``
    (one host identity per rank), or the ValueError's text; and its all-reduce of
    ``rank + 1`` in bf16."""
    from engine import dist
    from numkern import collective

    real = collective.host_identity
    collective.host_identity = lambda: hosts[comm.rank]
    try:
        c = dist.connect(comm.rank, comm.world, 10.0, collectives)
    except ValueError as e:
        return str(e)
    finally:
        collective.host_identity = real
    try:
        got = c.all_reduce(torch.full((3, 5), comm.rank + 1.0, dtype=torch.bfloat16))
        return c.transport, got.dtype, got.tolist()
    finally:
        if c.shm is not None:
            c.shm.close()


def test_the_transport_is_shared_memory_only_on_one_host():
    """Ranks on one host reduce over shared memory (``collectives`` auto or shm), ranks
    that report two hosts over gloo (auto) or not at all (shm: a ValueError on every
    rank); gloo when asked. Every transport gives the same fp32 sum, rounded once."""
    from numkern import collective

    one, two = ["h"] * 2, ["h0", "h1"]
    if collective.host_identity() is None:
        pytest.skip("no /dev/shm on this host")
    want = [[3.0] * 5] * 3
    cases = [("auto", one, "shm"), ("shm", one, "shm"), ("gloo", one, "gloo"),
             ("auto", two, "gloo")]  # fmt: skip
    for collectives, hosts, transport in cases:
        got = run_ranks(_connect_as, collectives, hosts, world=2)
        assert got == [(transport, torch.bfloat16, want)] * 2, (collectives, hosts)
    got = run_ranks(_connect_as, "shm", two, world=2)
    assert got == ["collectives: expected every rank on one host with /dev/shm for 'shm', got "
                   "2 host identities (auto falls back to gloo)"] * 2  # fmt: skip


def _broadcasts(comm):
    """Rank 0's objects as every rank receives them: one that fits a shared-memory slot,
    one past it (gloo carries it), then a small one again (the two stay in step)."""
    big = bytes(range(256)) * (5 << 12)  # 5 MiB: more than a slot's 4 MiB
    sent = [{"step": 1, "rows": [3, 4]}, big, ("execute", [1, 2])]
    return [comm.broadcast_object(o if comm.rank == 0 else None) for o in sent], comm.transport


def test_broadcast_object_past_a_slot_goes_over_gloo():
    got = run_ranks(_broadcasts, world=2)
    want = [{"step": 1, "rows": [3, 4]}, bytes(range(256)) * (5 << 12), ("execute", [1, 2])]
    assert [g[0] for g in got] == [want] * 2 and got[0][1] == got[1][1]
