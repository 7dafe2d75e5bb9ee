"""bench/bench_tp.py's plumbing on a tiny config: the streamed safetensors writer (read
back by safetensors), the bytes a decode token reads, the weight bytes counted on an
engine's model, and the collective clock. No forward pass (no compile): the benchmark
runs the models; tests/test_engine_tp*.py test the engine under TP."""

import json
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


# a bench_tp result's fields the one-host estimate reads: issue 43's shared-memory and gloo
# figures (an Emerald Rapids Xeon VM, 2 ranks) and the MoE's TP=2 batch-1 row of the run in
# docs/scale-out.md (an AMD EPYC); the figures docs/scale-out.md's one-host table came from
SYNTHETIC = {
    "environment": {
        "gloo_latency_us": {"all_reduce [1, 2048] fp32": 300.0,
                            "all_gather [1, 75968] fp32": 717.0},
        "shm_latency_us": {"all_reduce [1, 2048] fp32": 5.0, "all_reduce [32, 2048] fp32": 50.0,
                           "all_gather [1, 75968] fp32": 95.0},
        "bound_stream_GBps": 44.6, "stream_2x1_GBps": 32.8,
    },
    "rows": [{"model": "qwen3moe-30b-a3b-4L", "mode": "TP=2", "batch": 1, "of_bound": 0.33,
              "collective_share": 0.36, "stream_GBps": 44.6}],
}  # fmt: skip


def test_shm_cost_reproduces_the_measured_points():
    import tp_estimate as te

    shm = SYNTHETIC["environment"]["shm_latency_us"]
    cost = te.shm_cost({**shm, "all_reduce [1, 2048] bf16": 4.0})  # bf16: not read
    assert cost == te.shm_cost(shm)
    assert cost.all_reduce_us(4 * 2048, 2) == pytest.approx(5.0, rel=1e-12)
    assert cost.all_reduce_us(4 * 32 * 2048, 2) == pytest.approx(50.0, rel=1e-12)
    assert cost.all_gather_us(4 * 75968, 2) == pytest.approx(95.0, rel=1e-12)
    # the rule: each rank reads world slots, so fixed + world x slot bytes x per byte
    per_byte = (50.0 - 5.0) / (2 * 4 * (32 - 1) * 2048)
    fixed = 5.0 - 2 * 4 * 2048 * per_byte
    assert cost.all_reduce_us(4 * 4096, 8) == pytest.approx(fixed + 8 * 4 * 4096 * per_byte)
    gather_per_byte = (95.0 - fixed) / (2 * 4 * 75968)
    # a gather reads V x 4 bytes whatever the world (but for ceil(V / N)'s padding)
    assert cost.all_gather_us(4 * 18992, 8) == pytest.approx(
        fixed + 8 * 4 * 18992 * gather_per_byte
    )
    # the keys the command line sets are the bench's shapes
    assert te.SHM_GATHER_KEY == f"all_gather [1, {bt.QWEN3_MOE['vocab_size'] // 2}] fp32"
    assert set(te.SHM_REDUCE_KEYS) | {te.SHM_GATHER_KEY} == set(shm)
    # a larger all-reduce no slower than the small one: not the rule's shape
    with pytest.raises(ValueError, match="growing with the bytes"):
        te.shm_cost({**shm, "all_reduce [32, 2048] fp32": 5.0})
    with pytest.raises(ValueError, match="two fp32 all_reduce sizes"):
        te.shm_cost({"all_reduce [1, 2048] fp32": 5.0, "all_gather [1, 75968] fp32": 95.0})


def test_host_estimate_arithmetic():
    import tp_estimate as te

    # Qwen3-30B-A3B is bench_tp's MoE at its 48 layers: one rank's bytes, tensor by tensor
    cfg = dict(bt.QWEN3_MOE, num_hidden_layers=48)
    assert te.QWEN3_30B == {k: cfg[k] for k in te.QWEN3_30B}
    assert te.per_rank(te.QWEN3_30B, 1, False) == (
        sum(2 * math.prod(s) for _, s in bt.hf_tensors(cfg)),
        bt.token_bytes(cfg),
    )
    m = te.host_measured_from(SYNTHETIC)
    assert m["of_bound"] == pytest.approx(0.33 / (1 - 0.36))
    rows = te.host_estimate(m, socket_GBps=300.0, cross_socket=1.5)
    assert [(r["model"], r["tp"]) for r in rows] == [
        (name, n) for name in ("Qwen3-30B-A3B", "Qwen3-235B-A22B") for n in (2, 4, 8)
    ]
    for r in rows:
        cfg = te.HOST_MODELS[r["model"]]
        h, layers, n = cfg["hidden_size"], cfg["num_hidden_layers"], r["tp"]
        # collectives a token: the embedding's and 2 a layer, the logits' gather
        assert (r["allreduces_per_token"], r["gathers_per_token"]) == (1 + 2 * layers, 1)
        assert r["ranks_per_socket"] == n // 2 and r["rank_GBps"] == 300.0 / (n // 2)
        memory_ms = r["read_per_token_per_rank_GB"] / (m["of_bound"] * r["rank_GBps"]) * 1e3
        assert r["memory_ms"] == pytest.approx(memory_ms)
        reduce_us = 1.5 * m["shm"].all_reduce_us(4 * h, n)
        gather_us = 1.5 * m["shm"].all_gather_us(4 * math.ceil(cfg["vocab_size"] / n), n)
        collective_ms = ((1 + 2 * layers) * reduce_us + gather_us) / 1e3
        assert r["collective_ms"] == pytest.approx(collective_ms)
        assert r["tok_s"] == pytest.approx(1e3 / (memory_ms + collective_ms))
        assert r["collective_share"] == pytest.approx(collective_ms / (memory_ms + collective_ms))
    # Qwen3-30B-A3B at TP 2: its all-reduce is the measured [1, 2048] fp32 at world 2
    assert rows[0]["allreduce_us"] == pytest.approx(1.5 * 5.0)
    # TP 2 -> 4 halves a rank's bytes but the replicated router and norms (4 KV heads: still
    # split at 4 ranks; the vocab splits exactly)
    for name, cfg in te.HOST_MODELS.items():
        h, hd, layers = cfg["hidden_size"], cfg["head_dim"], cfg["num_hidden_layers"]
        replicated = 2 * (layers * (cfg["num_experts"] * h + 2 * h + 2 * hd) + h)
        tp2, tp4 = (next(r for r in rows if r["model"] == name and r["tp"] == n) for n in (2, 4))
        for key in ("read_per_token_per_rank_GB", "weights_per_rank_GB"):
            assert 2 * tp4[key] - tp2[key] == pytest.approx(replicated / 1e9, rel=1e-9), key
            assert tp2[key] / 2 < tp4[key] < tp2[key] / 2 * 1.02, key


def test_host_estimate_needs_shm_figures(tmp_path, capsys):
    import tp_estimate as te

    env = {k: v for k, v in SYNTHETIC["environment"].items() if k != "shm_latency_us"}
    old = dict(SYNTHETIC, environment=env)
    shm = SYNTHETIC["environment"]["shm_latency_us"]
    with pytest.raises(ValueError, match="no shm_latency_us"):
        te.host_measured_from(old)
    with pytest.raises(ValueError, match="no shm_latency_us"):
        te.host_measured_from(old, {te.SHM_GATHER_KEY: 95.0})
    assert te.host_measured_from(old, shm) == te.host_measured_from(SYNTHETIC)
    path = tmp_path / "bench_tp.json"
    path.write_text(json.dumps(old))
    with pytest.raises(SystemExit) as exit_:
        te.main(["host", str(path)])
    assert exit_.value.code == 2 and "--shm-reduce-us" in capsys.readouterr().err
    te.main(["host", str(path), "--shm-reduce-us", "5", "50", "--shm-gather-us", "95"])
    lines = capsys.readouterr().out.splitlines()
    assert sum(line.startswith("| Qwen3-") for line in lines) == 6
    te.main(["machines", str(path)])  # the across-machines table reads no shm figure
    assert sum(line.startswith("| TP") for line in capsys.readouterr().out.splitlines()) == 4
