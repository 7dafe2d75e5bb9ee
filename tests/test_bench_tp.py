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
