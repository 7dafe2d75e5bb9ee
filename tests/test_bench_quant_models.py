"""bench/bench_quant_models.py's file writer: a tiny Q4_K_M file of random valid blocks
that gguf reads back (finite weights, llama.cpp's type mix) and the engine loads. No
forward pass (no compile): the benchmark itself runs the models."""

import sys
from pathlib import Path

import gguf
import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
import bench_quant_models as bqm

TINY = {
    "llama": dict(bqm.LLAMA, hidden_size=256, intermediate_size=512, num_hidden_layers=8,
                  num_attention_heads=4, num_key_value_heads=2, vocab_size=300),
    "qwen3moe": dict(bqm.QWEN3_MOE, hidden_size=256, moe_intermediate_size=256,
                     num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                     head_dim=64, num_experts=4, num_experts_per_tok=2, vocab_size=300),
}  # fmt: skip


def test_use_more_bits_halves():
    # llama.cpp's rule picks half the layers at the model sizes the bench writes
    assert [i for i in range(16) if bqm.use_more_bits(i, 16)] == [0, 1, 4, 7, 10, 13, 14, 15]
    assert [i for i in range(4) if bqm.use_more_bits(i, 4)] == [2, 3]


@pytest.mark.parametrize("arch", sorted(TINY))
def test_written_file_loads(tmp_path, arch):
    cfg = TINY[arch]
    path = str(tmp_path / f"{arch}.gguf")
    types = bqm.write_q4_k_m(cfg, path)
    reader = gguf.GGUFReader(path)
    assert reader.fields["general.architecture"].contents() == arch
    stored, expected = 0, 0
    n_exp, top_k = cfg.get("num_experts"), cfg.get("num_experts_per_tok")
    for t in reader.tensors:
        assert t.tensor_type.name == types[t.name]
        w = gguf.quants.dequantize(t.data, t.tensor_type)
        assert np.isfinite(w).all() and w.std() < 0.1, t.name
        share = top_k / n_exp if "_exps" in t.name else 1
        stored += t.n_bytes * share
        lookup = t.name == "token_embd.weight" and not cfg["tie_word_embeddings"]
        expected += 0 if lookup else t.n_bytes * share
    assert bqm.token_bytes(path)[0] == pytest.approx(expected, abs=len(reader.tensors))
    layer_v = [types[f"blk.{i}.attn_v.weight"] for i in range(cfg["num_hidden_layers"])]
    assert layer_v.count("Q6_K") == cfg["num_hidden_layers"] // 2

    from engine.llm import LLM

    llm = LLM(path, kv_cache_memory=1 << 22, progress=False)
    assert any(s.startswith("Q4_K") for s in llm.weight_summary)
