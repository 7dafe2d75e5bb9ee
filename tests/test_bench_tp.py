"""bench/bench_tp.py's plumbing on a tiny config: the streamed safetensors writer (read
back by safetensors), the bytes a decode token reads, the weight bytes counted on an
engine's model, and the collective clock. No forward pass (no compile): the benchmark
runs the models; tests/test_engine_tp*.py test the engine under TP."""

import math
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
import bench_tp as bt

TINY = {
    "qwen3moe": dict(bt.QWEN3_MOE, hidden_size=256, moe_intermediate_size=128,
                     num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                     head_dim=64, num_experts=4, num_experts_per_tok=2, vocab_size=300),
    "llama": dict(bt.LLAMA, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, vocab_size=300),
}  # fmt: skip


@pytest.mark.parametrize("arch", sorted(TINY))
def test_checkpoint_reads_back(tmp_path, arch):
    cfg = TINY[arch]
    path = bt.cached_checkpoint(arch, cfg, tmp_path)
    assert Path(path) == bt.checkpoint_dir(arch, cfg, tmp_path)
    assert bt.checkpoint_dir(arch, dict(cfg, vocab_size=301), tmp_path) != Path(path)
    shapes = dict(bt.hf_tensors(cfg))
    read = 0
    with safe_open(str(Path(path) / "model.safetensors"), "pt") as f:
        assert set(f.keys()) == set(shapes)
        for name in f.keys():
            t = f.get_tensor(name)
            assert t.dtype == torch.bfloat16 and tuple(t.shape) == shapes[name], name
            if name.endswith("norm.weight"):
                assert bool((t == 1).all()), name
            else:
                assert 0.015 < t.float().std() < 0.025 and abs(t.float().mean()) < 0.01, name
            per_token = 0 if name == "model.embed_tokens.weight" else t.numel() * 2
            if ".experts." in name:
                per_token = per_token * cfg["num_experts_per_tok"] // cfg["num_experts"]
            if name == "model.embed_tokens.weight" and cfg["tie_word_embeddings"]:
                per_token = t.numel() * 2  # read as the LM head
            read += per_token
    assert bt.token_bytes(cfg) == read
    # the same path again: reused, not rewritten
    mtime = (Path(path) / "model.safetensors").stat().st_mtime_ns
    assert bt.cached_checkpoint(arch, cfg, tmp_path) == path
    assert (Path(path) / "model.safetensors").stat().st_mtime_ns == mtime

    from engine.llm import LLM

    llm = LLM(path, dtype="float32", kv_cache_memory=1 << 22, progress=False)
    file_bytes = sum(2 * math.prod(s) for s in shapes.values())
    # fp32: twice the file's bf16 bytes (norms included), plus the rotary tables
    got = bt.tensor_bytes(llm.model)
    assert 2 * file_bytes <= got < 2 * file_bytes + 4 * cfg["max_position_embeddings"] * 64
    assert bt.worker_pids(llm) == []
    with bt.CommClock(bt.engine_comm(llm)) as clock:
        x = torch.ones(3)
        assert bt.engine_comm(llm).all_reduce(x) is x
    assert clock.calls == {"all_reduce": 1, "all_gather": 0, "broadcast_object": 0}
    assert clock.snapshot()[1:] == (1, 0.0)
    assert "all_reduce" not in vars(bt.engine_comm(llm))  # unwrapped on exit


def test_paper_estimate_arithmetic():
    import itertools

    import tp_estimate as te

    # one rank: the whole model, counted tensor by tensor by the bench's own list
    cfg = dict(bt.QWEN3_MOE, **te.QWEN3_235B)
    held, read = te.per_rank(te.QWEN3_235B, 1, False)
    assert held == sum(2 * math.prod(s) for _, s in bt.hf_tensors(cfg))
    assert read == bt.token_bytes(cfg)
    # TP=4 splits all but the replicated router and norms
    held4, read4 = te.per_rank(te.QWEN3_235B, 4, False)
    assert held / 4 < held4 < held / 4 * 1.001 and read / 4 < read4 < read / 4 * 1.01
    # the busiest rank's experts, against enumerating every draw of a small case
    for experts, k, ranks in ((8, 2, 2), (12, 3, 4), (8, 4, 4)):
        draws = list(itertools.combinations(range(experts), k))
        per = experts // ranks
        mean = sum(max(sum(1 for x in d if x // per == r) for r in range(ranks)) for d in draws)
        assert te.busiest_rank_experts(experts, k, ranks) == pytest.approx(mean / len(draws))
    rows = te.estimate({"stream_GBps": 40.0, "of_bound": 0.5, "gloo_step_us": 20.0})
    assert [r["layout"] for r in rows] == ["TP4", "TP4", "TP8/EP", "TP8/EP"]
    tp4 = rows[0]
    assert tp4["allreduces_per_token"] == 1 + 2 * 94
    assert tp4["sent_per_token_per_rank_MB"] == pytest.approx(
        (189 * 1.5 * 4 * 4096 + 0.75 * 4 * 151936) / 1e6
    )
    assert rows[1]["wire_ms"] == pytest.approx(tp4["wire_ms"] / 4)
