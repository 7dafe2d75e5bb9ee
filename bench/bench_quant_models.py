"""Q4_K_M models kept quantised: decode against the quantised-bytes bound, prefill against bf16.

    python bench/bench_quant_models.py              # both models, 3 rounds (~15 min, 2 cores)
    python bench/bench_quant_models.py --quick      # both models, 2 rounds, 16 new tokens
    python bench/bench_quant_models.py --llama-only # or --moe-only
    python bench/bench_quant_models.py --moe-only --prefill-only  # 9 prefill rounds
    python -m bench --only quant_models             # the same run inside the report

Two models of random weights written as llama.cpp's Q4_K_M at bench time (into
``NUMKERN_BENCH_CACHE``, default ``/tmp/numkern-bench-models``; reused when there):

* **Llama-shaped** (Llama-3.2-1B's shapes): hidden 2048, 16 layers, 32 q / 8 kv heads of
  64, intermediate 8192, vocab 128256, embedding tied as the LM head (~0.9 GB).
* **Qwen3-30B-A3B-shaped MoE**, 4 of its 48 layers (its config.json: hidden 2048, 32 q / 4
  kv heads of 128, q/k norms, 128 experts top-8 of moe_intermediate 768, no shared
  expert, norm_topk_prob, vocab 151936, untied LM head) (~1.9 GB).

Per model ``ROUNDS`` interleaved rounds in one process, each a stream pass (median of 3)
then one run of the engine with the weights kept in their types (``quantization="auto"``)
and one of the same file dequantised to bf16 at load (``"none"``): a 512-token prompt
(the prefill rate: 512 / time to the first token) then ``NEW`` greedy tokens (the
decode rate: from the first token's arrival to the last's, batch 1). Then the medians.

The quantised-bytes bound of a decode token: stream / the bytes a token reads as stored
in the file: every layer weight (norms and the router in F32 too) and the LM head (the
tied embedding, read as the head, counted once; an untied embedding's lookup reads one
row and is not counted); for experts only the routed ones, top-k of E (``8/128`` of each
``*_exps`` tensor). The KV cache read (after 512 tokens: 16.8 MB for the Llama, 4.2 MB for
the MoE) is not counted either. Where q, k and v differ in type (Q6_K v in the
``use_more_bits`` layers) the engine keeps them as one weight of parts
(``numkern.quant.join_rows``, issue 41); until then it fused them dequantised to bf16:
+70 MB a token for the Llama (8 layers x 8.8 MB), +30 MB for the MoE (2 x 14.8 MB).
Targets: quantised decode >= 0.8 of that bound; quantised prefill >= 0.8x the ``"none"``
(bf16) prefill. A share of the bound is quoted only where a token's bytes lie past the
CPU's L3 (``harness.share_of_bound``; blank otherwise: the cache may serve them).

The weights are random, valid K-quant blocks written directly (random code bytes, the
blocks' fp16 ``d``/``dmin`` set to finite scales giving weights of std ~0.02), not
quantised floats: ``numkern.testing.quantize`` (NumPy) takes minutes a GB, and a
bandwidth and FLOP bench reads the same bytes whatever the codes are. The file's
metadata, tokenizer keys and tensor names are ``tests/gguf_convert.py``'s (llama.cpp's
converter's).
"""

import gc
import math
import os
import statistics
import sys
import time
from pathlib import Path

import gguf
import harness
import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench_e2e import _threads, engine_run, run_engine  # noqa: E402

from engine.llm import LLM  # noqa: E402
from tests.gguf_convert import _metadata, _tokenizer, byte_vocab  # noqa: E402

CACHE_ENV = "NUMKERN_BENCH_CACHE"
DEFAULT_CACHE = "/tmp/numkern-bench-models"
PROMPT = 512
NEW = 32
ROUNDS = 3  # 2 with --quick
PREFILL_ROUNDS = 9  # --prefill-only (the decode columns then time one step)
# GGUF general.file_type of llama.cpp's LLAMA_FTYPE_MOSTLY_Q4_K_M
FTYPE_Q4_K_M = 15

LLAMA = {  # Llama-3.2-1B's config.json, rope scaling left out (plain rope at its theta)
    "architectures": ["LlamaForCausalLM"], "hidden_size": 2048, "intermediate_size": 8192,
    "num_hidden_layers": 16, "num_attention_heads": 32, "num_key_value_heads": 8,
    "head_dim": 64, "vocab_size": 128256, "rope_theta": 500000.0, "rms_norm_eps": 1e-5,
    "max_position_embeddings": 4096, "tie_word_embeddings": True,
    "bos_token_id": 1, "eos_token_id": 2,
}  # fmt: skip
QWEN3_MOE = {  # Qwen3-30B-A3B's config.json with 4 of its 48 layers
    "architectures": ["Qwen3MoeForCausalLM"], "hidden_size": 2048, "intermediate_size": 6144,
    "moe_intermediate_size": 768, "num_hidden_layers": 4, "num_attention_heads": 32,
    "num_key_value_heads": 4, "head_dim": 128, "num_experts": 128, "num_experts_per_tok": 8,
    "norm_topk_prob": True, "vocab_size": 151936, "rope_theta": 1000000.0,
    "rms_norm_eps": 1e-6, "max_position_embeddings": 4096, "tie_word_embeddings": False,
    "bos_token_id": 1, "eos_token_id": 2,
}  # fmt: skip


# -- llama.cpp's Q4_K_M mix ------------------------------------------------------------------


def use_more_bits(i_layer, n_layers):
    """llama.cpp ``src/llama-quant.cpp`` ``use_more_bits``: the first and last eighth of
    the layers and every third one between (8 of 16 layers; layers 2 and 3 of 4)."""
    return (
        i_layer < n_layers // 8
        or i_layer >= 7 * n_layers // 8
        or (i_layer - n_layers // 8) % 3 == 2
    )


def q4_k_m_type(name, n_layers, tied):
    """The GGML type llama.cpp's ``llama_tensor_get_type`` gives a weight of a Q4_K_M file
    (``src/llama-quant.cpp``): ``output.weight`` (or the embedding when it is tied, as the
    head) Q6_K; ``attn_v`` and ``ffn_down`` (``ffn_down_exps`` too: one tensor a layer)
    Q6_K in the layers ``use_more_bits`` picks ("Q4_K_M ... use_more_bits(i_layer,
    n_layer) ? Q6_K"), Q4_K in the others; every other weight the ftype's Q4_K. Norms and
    the router (``ffn_gate_inp``) stay F32 (the converter's rule, not quantised)."""
    if name.endswith("norm.weight") or "ffn_gate_inp" in name:
        return "F32"
    if name == "output.weight" or (tied and name == "token_embd.weight"):
        return "Q6_K"
    if ".attn_v." in name or ".ffn_down" in name:
        layer = int(name.split(".")[1])
        return "Q6_K" if use_more_bits(layer, n_layers) else "Q4_K"
    return "Q4_K"


# -- random valid blocks ---------------------------------------------------------------------

# (block bytes, byte offset of the fp16 scales, their values): Q4_K = d, dmin, 12 bytes of
# 6-bit scales/mins, 128 code bytes, w = d*sc*q - dmin*mn (std ~0.022 with random bytes);
# Q6_K = 128 ql, 64 qh, 16 int8 scales, d, w = d*sc*(q-32) (std ~0.014).
_BLOCKS = {"Q4_K": (144, 0, (1e-4, 1e-5)), "Q6_K": (210, 208, (1e-5,))}


def random_blocks(rng, qtype, shape):
    """GGUF bytes ``[*shape[:-1], row_bytes]`` of a ``qtype`` weight of ``shape`` (K =
    ``shape[-1]``, a multiple of 256): random code and scale bytes, fp16 block scales set
    to the finite values of :data:`_BLOCKS`."""
    size, at, scales = _BLOCKS[qtype]
    n_blocks = math.prod(shape) // 256
    raw = np.frombuffer(rng.bytes(n_blocks * size), np.uint8).reshape(n_blocks, size).copy()
    raw[:, at : at + 2 * len(scales)] = np.array(scales, np.float16).view(np.uint8)
    return raw.reshape(*shape[:-1], shape[-1] // 256 * size)


def model_tensors(cfg):
    """[(GGUF name, numpy shape [.., N, K])] of a llama / qwen3moe config, in the order the
    converter writes them."""
    h, hd = cfg["hidden_size"], cfg["head_dim"]
    q, kv = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd
    out = [("token_embd.weight", (cfg["vocab_size"], h)), ("output_norm.weight", (h,))]
    if not cfg["tie_word_embeddings"]:
        out.append(("output.weight", (cfg["vocab_size"], h)))
    for i in range(cfg["num_hidden_layers"]):
        b = f"blk.{i}."
        out += [(b + "attn_norm.weight", (h,)), (b + "attn_q.weight", (q, h))]
        out += [(b + "attn_k.weight", (kv, h)), (b + "attn_v.weight", (kv, h))]
        out += [(b + "attn_output.weight", (h, q)), (b + "ffn_norm.weight", (h,))]
        if "num_experts" in cfg:
            e, f = cfg["num_experts"], cfg["moe_intermediate_size"]
            out += [(b + "attn_q_norm.weight", (hd,)), (b + "attn_k_norm.weight", (hd,))]
            out += [(b + "ffn_gate_inp.weight", (e, h)), (b + "ffn_gate_exps.weight", (e, f, h))]
            out += [(b + "ffn_up_exps.weight", (e, f, h)), (b + "ffn_down_exps.weight", (e, h, f))]
        else:
            f = cfg["intermediate_size"]
            out += [(b + "ffn_gate.weight", (f, h)), (b + "ffn_up.weight", (f, h))]
            out += [(b + "ffn_down.weight", (h, f))]
    return out


def write_q4_k_m(cfg, path, *, seed=0):
    """Write a Q4_K_M GGUF of random weights of ``cfg`` (an HF config dict of a llama or
    qwen3moe) to ``path``, one tensor at a time (never the whole model in memory).
    Returns {GGUF name: type name}."""
    arch = "qwen3moe" if "num_experts" in cfg else "llama"
    n, tied = cfg["num_hidden_layers"], cfg["tie_word_embeddings"]
    tensors = [(name, shape, q4_k_m_type(name, n, tied)) for name, shape in model_tensors(cfg)]
    tmp = f"{path}.part"
    w = gguf.GGUFWriter(tmp, arch)
    _metadata(w, cfg, arch)
    w.add_file_type(FTYPE_Q4_K_M)
    tokens, merges = byte_vocab(cfg["vocab_size"])
    _tokenizer(w, cfg, tokens, merges, set(), None, None, "default", None)
    for name, shape, qtype in tensors:
        if qtype == "F32":
            w.add_tensor_info(name, shape, np.dtype(np.float32), 4 * math.prod(shape))
        else:
            k = shape[-1] // 256 * _BLOCKS[qtype][0]
            byte_shape = (*shape[:-1], k)
            w.add_tensor_info(name, byte_shape, np.dtype(np.uint8), math.prod(byte_shape),
                              raw_dtype=gguf.GGMLQuantizationType[qtype])  # fmt: skip
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    rng = np.random.default_rng(seed)
    for name, shape, qtype in tensors:
        if qtype != "F32":
            w.write_tensor_data(random_blocks(rng, qtype, shape))
        elif "ffn_gate_inp" in name:  # the router: random logits
            w.write_tensor_data(rng.standard_normal(shape, np.float32) * np.float32(0.02))
        else:  # RMS norms
            w.write_tensor_data(np.ones(shape, np.float32))
    w.close()
    os.replace(tmp, path)
    return {name: qtype for name, _, qtype in tensors}


def cached_model(label, cfg):
    """The path of ``cfg``'s Q4_K_M file in the cache folder, written when absent."""
    folder = Path(os.environ.get(CACHE_ENV, DEFAULT_CACHE))
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{label}-Q4_K_M.gguf"
    if not path.exists():
        t = time.perf_counter()
        write_q4_k_m(cfg, str(path))
        print(f"wrote {path} ({path.stat().st_size / 1e9:.2f} GB, "
              f"{time.perf_counter() - t:.0f} s)", flush=True)  # fmt: skip
    return str(path)


# -- the bound ------------------------------------------------------------------------------


def token_bytes(path):
    """(bytes a decode token reads as stored, the same in bf16 (F32 tensors at 4 bytes),
    the arithmetic as text) of a GGUF file: every layer tensor and the head in full, the
    ``*_exps`` tensors' top-k of E share, an untied embedding not at all."""
    reader = gguf.GGUFReader(path)
    kv = {f.name: f.contents() for f in reader.fields.values() if f.name.endswith("count")}
    arch = reader.fields["general.architecture"].contents()
    top_k, n_exp = kv.get(f"{arch}.expert_used_count"), kv.get(f"{arch}.expert_count")
    names = {t.name for t in reader.tensors}
    parts = {}  # kind -> (stored bytes read, bf16 bytes read)
    for t in reader.tensors:
        name, stored = t.name, int(t.n_bytes)
        wide = 4 if t.tensor_type == gguf.GGMLQuantizationType.F32 else 2
        bf16 = int(t.n_elements) * wide
        if name == "token_embd.weight":
            if "output.weight" in names:
                continue  # a lookup of one row
            kind = "head (tied embedding)"
        elif name == "output.weight":
            kind = "head"
        elif name.endswith("norm.weight") or "ffn_gate_inp" in name:
            kind = "norms, router"
        elif "_exps" in name:
            kind = f"experts ({top_k}/{n_exp})"
            stored, bf16 = stored * top_k // n_exp, bf16 * top_k // n_exp
        elif ".ffn_" in name:
            kind = "ffn"
        else:
            kind = "attention"
        a, b = parts.get(kind, (0, 0))
        parts[kind] = (a + stored, b + bf16)
    total = sum(a for a, _ in parts.values())
    text = " + ".join(f"{k} {a / 1e6:.1f}" for k, (a, _) in parts.items())
    return total, sum(b for _, b in parts.values()), f"{text} = {total / 1e6:.1f} MB"


# -- the runs -------------------------------------------------------------------------------


def load_1m():
    return os.getloadavg()[0]


def bench_model(label, cfg, new, rounds):
    """Rows of ``rounds`` interleaved (stream, quantised run, none run) rounds of one model
    and their median; and the note of its bytes and types."""
    path = cached_model(label, cfg)
    qbytes, bbytes, arithmetic = token_bytes(path)
    kw = dict(dtype="bfloat16", kv_cache_memory=1 << 28, progress=False)
    auto = LLM(path, **kw)
    types = "; ".join(auto.weight_summary)
    none = LLM(path, quantization="none", **kw)
    prompts = [[(7 * j) % 1000 + 10 for j in range(PROMPT)]]
    for llm in (auto, none):
        run_engine(llm, prompts, 2)  # warm-up (compiles, page faults)
    rows = []
    for i in range(rounds):
        gbs = harness.stream_bandwidth(repeats=3)
        load = load_1m()
        qp, qd = engine_run(auto, prompts, new)
        bp, bd = engine_run(none, prompts, new)
        qb, bb = gbs * 1e9 / qbytes, gbs * 1e9 / bbytes
        rows.append({"model": label, "round": i + 1, "load_1m": load, "stream_GBps": gbs,
                     "quant_decode_tok_s": qd, "quant_bound_tok_s": qb,
                     "quant_of_bound": harness.share_of_bound(qd, qb, qbytes),
                     "none_decode_tok_s": bd,
                     "none_of_bf16_bound": harness.share_of_bound(bd, bb, bbytes),
                     "decode_quant_x_none": qd / bd, "quant_prefill_tok_s": qp,
                     "none_prefill_tok_s": bp, "prefill_quant_x_none": qp / bp,
                     "threads": _threads(auto)})  # fmt: skip
        print(f"  {label} round {i + 1} (load {load:.1f}): stream {gbs:.1f} GB/s; decode "
              f"quantised {qd:.1f} tok/s (bound {qb:.1f}), none {bd:.1f}; prefill "
              f"quantised {qp:.0f} tok/s, none {bp:.0f} ({qp / bp:.2f}x)", flush=True)  # fmt: skip
    top = max(r["stream_GBps"] for r in rows) * 1e9  # the run's quietest moment
    for r in rows:
        what = f"{label} round {r['round']}"
        harness.check_bound(f"{what} quantised (tok/s)", r["quant_decode_tok_s"], top / qbytes)
        harness.check_bound(f"{what} none (tok/s)", r["none_decode_tok_s"], top / bbytes)
    keys = [k for k, v in rows[0].items() if isinstance(v, float)]
    med = {k: statistics.median(r[k] for r in rows) for k in keys}
    rows.append({"model": label, "round": "median", **med, "threads": rows[0]["threads"]})
    del auto, none
    gc.collect()
    size = os.path.getsize(path) / 1e9
    note = (f"{label}: {size:.2f} GB file; a decode token reads {arithmetic} as stored "
            f"(bf16: {bbytes / 1e6:.1f} MB); quantised: {types}")  # fmt: skip
    print(note, flush=True)
    return rows, note


def main(argv=None):
    bench = harness.start(
        "bench_quant_models",
        argv,
        description=__doc__.splitlines()[0],
        quick_help="2 rounds, 16 new tokens",
        timer_options=False,
        flags=[
            ("--llama-only", "only the Llama-shaped 16-layer model"),
            ("--moe-only", "only the Qwen3-30B-A3B-shaped 4-layer MoE"),
            ("--prefill-only", f"prefill rounds only: {PREFILL_ROUNDS}, 2 tokens each"),
        ],
    )
    new, rounds = (16, 2) if bench.quick else (NEW, ROUNDS)
    if bench.args.prefill_only:  # issue 40's prefill target: >= 9 interleaved rounds
        new, rounds = 2, PREFILL_ROUNDS
    models = []
    if not bench.args.moe_only:
        models.append(("llama-2048h-16L", LLAMA))
    if not bench.args.llama_only:
        models.append(("qwen3moe-30b-a3b-4L", QWEN3_MOE))
    rows, notes = [], []
    for label, cfg in models:
        r, note = bench_model(label, cfg, new, rounds)
        rows += r
        notes.append(note)
    cols = ["model", "round", "threads", "load_1m", "stream_GBps", "quant_decode_tok_s"]
    cols += ["quant_bound_tok_s", "quant_of_bound", "none_decode_tok_s", "none_of_bf16_bound"]
    cols += ["decode_quant_x_none", "quant_prefill_tok_s", "none_prefill_tok_s"]
    cols += ["prefill_quant_x_none"]
    notes.append(
        f"each round: a stream pass (median of 3), then one run each of the quantised "
        f"engine and quantization='none' (bf16): a {PROMPT}-token prompt, {new} greedy "
        "tokens at batch 1; load_1m: the 1-minute load average (os.getloadavg) at the "
        "round's start; targets: median quant_of_bound >= 0.8, prefill_quant_x_none >= 0.8"
    )
    bench.finish(rows, columns=cols, notes=notes, extra={"load_1m_end": load_1m()})


if __name__ == "__main__":
    main()
