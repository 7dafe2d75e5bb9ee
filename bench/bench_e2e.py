"""End-to-end engine throughput against HF transformers on the same weights.

    python bench/bench_e2e.py            # SmolLM2 (GGUF) and a random Qwen3-MoE, bf16
    python bench/bench_e2e.py --quick    # SmolLM2 only, fewer tokens

Per model: prefill tokens/s (one 512-token prompt), decode tokens/s at batch 1 and 8
(64 new tokens each, greedy, EOS ignored; each the best of 3 runs), for the numkern
engine and for HF ``generate`` on the same bf16 weights. Decode at batch 1 reads every
weight once per token, so its bound is stream bandwidth / bf16 weight bytes, with the
highest stream bandwidth of the run (measured at the start and after each batch-1
pair). The engine is also run with torch limited to one thread: numkern's kernels do
the heavy work on Numba's pool, and torch's idle OpenMP threads spin on the cores
Numba needs. Where llama-cpp-python is installed (it compiles llama.cpp: not a
dependency), llama.cpp on the GGUF file as stored (4-bit weights, so its b1 share of
the bf16 bound can pass 1) is a batch-1 row of its own.
"""

import copy
import os
import tempfile
import time

import harness
import torch
import transformers

from engine.__main__ import default_model
from engine.llm import LLM, SamplingParams

NEW = 64


def hf_from_gguf(path):
    """transformers' own GGUF loader (its dequantization and q/k handling) in bf16: the
    independent HF baseline for the GGUF file the engine runs (needs accelerate)."""
    folder, name = os.path.split(path)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, gguf_file=name,
                                                              dtype=torch.bfloat16)  # fmt: skip
    return model.eval()


def random_qwen3_moe(folder):
    cfg = transformers.Qwen3MoeConfig(
        vocab_size=32000, hidden_size=1024, intermediate_size=2048, moe_intermediate_size=256,
        num_hidden_layers=8, num_attention_heads=16, num_key_value_heads=4, head_dim=64,
        num_experts=64, num_experts_per_tok=8, norm_topk_prob=True, max_position_embeddings=4096,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.Qwen3MoeForCausalLM(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.02) if p.dim() > 1 else p.fill_(1.0)
    model.save_pretrained(folder)
    return model.to(torch.bfloat16)


def weight_bytes(model):
    return sum(p.numel() * 2 for p in model.parameters())


def run_engine(llm, prompts, new):
    sp = SamplingParams(temperature=0, max_tokens=new, ignore_eos=True)
    t = time.perf_counter()
    llm.generate(prompts, sp)
    return time.perf_counter() - t


# Each rate is the best of this many (t(1), t(new)) pairs: the machine is shared and one
# pair varied by up to 30% between runs.
REPEATS = 3


def _best(pairs, prompt_len, batch, new):
    """(prefill tok/s, decode tok/s) from (t1, tn) pairs: the fastest of each."""
    pre = max(batch * prompt_len / t1 for t1, _ in pairs)
    dec = max(batch * (new - 1) / (tn - t1) for t1, tn in pairs)
    return pre, dec


def engine_rates(llm, prompt_len, batch, new, streams=None):
    """(prefill tok/s, decode tok/s at this batch): decode time = (t(new) - t(1)) per token.
    With ``streams`` (a list), a stream-bandwidth pass follows each pair and is appended."""
    prompts = [[(7 * i + j) % 1000 + 10 for j in range(prompt_len)] for i in range(batch)]
    run_engine(llm, prompts, 2)  # warm-up (compiles, page faults)
    pairs = []
    for _ in range(REPEATS):
        pairs.append((run_engine(llm, prompts, 1), run_engine(llm, prompts, new)))
        if streams is not None:
            streams.append(harness.stream_bandwidth(repeats=3))
    return _best(pairs, prompt_len, batch, new)


def hf_rates(model, prompt_len, batch, new):
    ids = torch.tensor([[(7 * i + j) % 1000 + 10 for j in range(prompt_len)] for i in range(batch)])
    kw = dict(do_sample=False, eos_token_id=None, pad_token_id=0)
    pairs = []
    with torch.no_grad():
        model.generate(ids, max_new_tokens=2, min_new_tokens=2, **kw)
        for _ in range(REPEATS):
            t = time.perf_counter()
            model.generate(ids, max_new_tokens=1, min_new_tokens=1, **kw)
            t1 = time.perf_counter() - t
            t = time.perf_counter()
            model.generate(ids, max_new_tokens=new, min_new_tokens=new, **kw)
            pairs.append((t1, time.perf_counter() - t))
    return _best(pairs, prompt_len, batch, new)


def llama_cpp_rates(path, prompt_len, new):
    """(prefill tok/s, decode tok/s at batch 1) of llama.cpp on the GGUF file itself (its
    4-bit weights), or None when llama-cpp-python is not installed."""
    try:
        import llama_cpp
    except ImportError:
        return None
    llm = llama_cpp.Llama(model_path=path, n_ctx=prompt_len + new + 8, n_batch=prompt_len,
                          n_threads=torch.get_num_threads(), verbose=False)  # fmt: skip
    prompt = [(7 * j) % 1000 + 10 for j in range(prompt_len)]

    def run(n):
        llm.reset()  # no prefix reuse: the prompt is evaluated again
        t = time.perf_counter()
        for i, _ in enumerate(llm.generate(prompt, top_k=1, temp=0.0, reset=True)):
            if i + 1 == n:
                break
        return time.perf_counter() - t

    run(2)
    pairs = [(run(1), run(new)) for _ in range(REPEATS)]
    return _best(pairs, prompt_len, 1, new)


def bench_model(name, path, hf, streams, new):
    """Rows of one model. ``streams``: stream bandwidths measured so far (GB/s); the engine's
    batch-1 runs add one after each (t(1), t(new)) pair, and the bound uses the highest, so
    a decode run in a quiet moment of this shared VM is not set against a stream figure
    from a busy one (a single figure from the start once gave a share of 1.04)."""
    rows = []
    for torch_threads in (torch.get_num_threads(), 1):
        saved = torch.get_num_threads()
        torch.set_num_threads(torch_threads)
        try:
            llm = LLM(path, dtype="bfloat16", kv_cache_memory=1 << 30, progress=False)
            pre, dec1 = engine_rates(llm, 512, 1, new, streams)
            _, dec8 = engine_rates(llm, 32, 8, new)
        finally:
            torch.set_num_threads(saved)
        rows.append({"model": name, "system": f"numkern engine (torch threads {torch_threads})",
                     "prefill_tok_s": pre, "decode_b1_tok_s": dec1,
                     "decode_b8_tok_s": dec8})  # fmt: skip
    bound = max(streams) * 1e9 / weight_bytes(hf)
    for r in rows:
        r["b1_of_bound"] = r["decode_b1_tok_s"] / bound
    lcpp = llama_cpp_rates(path, 512, new) if path.endswith(".gguf") else None
    if lcpp is not None:  # batch 1 only: llama-cpp-python's API runs one sequence
        rows.append({"model": name, "system": "llama.cpp (llama-cpp-python, GGUF as stored)",
                     "prefill_tok_s": lcpp[0], "decode_b1_tok_s": lcpp[1],
                     "decode_b8_tok_s": float("nan"), "b1_of_bound": lcpp[1] / bound})  # fmt: skip
    pre, dec1 = hf_rates(hf, 512, 1, new)
    _, dec8 = hf_rates(hf, 32, 8, new)
    rows.append({"model": name, "system": "HF transformers generate", "prefill_tok_s": pre,
                 "decode_b1_tok_s": dec1, "decode_b8_tok_s": dec8,
                 "b1_of_bound": dec1 / bound})  # fmt: skip
    for r in rows:
        r["b1_bound_tok_s"] = bound
        r["x_hf_b8"] = r["decode_b8_tok_s"] / rows[-1]["decode_b8_tok_s"]
        r["x_hf_b1"] = r["decode_b1_tok_s"] / rows[-1]["decode_b1_tok_s"]
    return rows


def main(argv=None):
    bench = harness.start(
        "bench_e2e",
        argv,
        description=__doc__.splitlines()[0],
        quick_help="SmolLM2 only, fewer tokens",
        timer_options=False,
    )
    streams = [bench.stream_before]
    new = 16 if bench.quick else NEW
    smol = default_model()
    rows = bench_model("SmolLM2-135M (GGUF, bf16)", smol, hf_from_gguf(smol), streams, new)
    if not bench.quick:
        with tempfile.TemporaryDirectory() as tmp:
            hf = random_qwen3_moe(tmp)
            moe = "random Qwen3-MoE (1024h, 8L, 64e top-8)"
            rows += bench_model(moe, tmp, copy.deepcopy(hf), streams, new)
    cols = ["model", "system", "prefill_tok_s", "decode_b1_tok_s", "decode_b8_tok_s"]
    cols += ["b1_bound_tok_s", "b1_of_bound", "x_hf_b1", "x_hf_b8"]
    bench.finish(
        rows,
        columns=cols,
        extra={
            "stream_GBps_max": max(streams),
            "stream_GBps_all": [round(x, 2) for x in streams],
        },
        plots=[
            {
                "x": "system",
                "y": ["decode_b1_tok_s", "decode_b8_tok_s"],
                "kind": "bar",
                "ylabel": "tokens/s",
            }
        ],
        stream_after=False,
    )


if __name__ == "__main__":
    main()
