"""A paper estimate of Qwen3-235B-A22B decode at batch 1 across machines, from bench_tp's
measured figures (docs/scale-out.md, "Qwen3-235B-A22B on paper").

    python bench/tp_estimate.py bench/results/bench_tp.json   # docs/scale-out.md's table

Per layout (TP4: one rank per machine, 4 machines; TP8/EP: attention split 8 ways, whole
experts 16 a rank, 8 machines) and link speed (25 and 100 Gb/s):

* **bytes a token reads per rank** (bf16, batch 1): the rank's share of the attention
  (q and o by heads; k and v by KV heads, one KV head a rank where ranks outnumber them,
  as vLLM), the router and norms (replicated), its LM-head rows, and its experts: under
  TP each of the 8 routed experts' 1/N slice of the intermediate dimension; under EP the
  routed experts that live on the rank -- the step waits for the busiest rank, so
  ``E[max over ranks]`` of 8 experts drawn from 128 (16 a rank), by exact enumeration.
* **all-reduce bytes a token per rank**: 1 + 2 x 94 all-reduces of [1, 4096] (the
  embedding; each layer's o and experts), reduced in fp32 (``engine.dist.Comm``), sent
  by a ring: 2 (N-1)/N x 16 KiB each; the vocab-parallel logits' all-gather: (N-1)/N x V x
  4 bytes.
* **time a token**: memory (bytes per rank / (the measured share of the stream bound x
  the stream bandwidth of one machine like the one measured)) + wire (bytes / link) +
  latency (each all-reduce 2 (N-1) ring steps of ``hop_us``: the measured gloo cost of a
  step on loopback plus :data:`NETWORK_US` of network; ``--gloo-step-us`` sets the
  first where the run's figure came from a loaded machine); ``tok_s_without_latency``:
  the memory and wire terms alone.
"""

import argparse
import json
import math
import sys
from functools import lru_cache

QWEN3_235B = {  # Qwen3-235B-A22B's config.json (the fields the arithmetic reads)
    "hidden_size": 4096, "num_hidden_layers": 94, "num_attention_heads": 64,
    "num_key_value_heads": 4, "head_dim": 128, "num_experts": 128, "num_experts_per_tok": 8,
    "moe_intermediate_size": 1536, "vocab_size": 151936,
}  # fmt: skip
# one-way latency of a small message between two machines, kernel TCP on 25-100 GbE
# (an assumption, not measured here: the bench has one machine)
NETWORK_US = 15.0
LINKS_GBPS = (25, 100)
LAYOUTS = (("TP4", 4, False), ("TP8/EP", 8, True))
BF16 = 2


@lru_cache
def busiest_rank_experts(experts, top_k, ranks):
    """E[max over ranks of the routed experts on it]: ``top_k`` distinct experts drawn
    uniformly from ``experts`` split evenly over ``ranks`` (multivariate hypergeometric,
    enumerated exactly)."""
    per = experts // ranks
    total = math.comb(experts, top_k)

    def ways(left_ranks, left_k, cap):  # draws of left_k over left_ranks, each <= cap
        if left_ranks == 0:
            return 1 if left_k == 0 else 0
        return sum(math.comb(per, c) * ways(left_ranks - 1, left_k - c, cap)
                   for c in range(min(cap, left_k) + 1))  # fmt: skip

    # E[max] = sum over m >= 1 of P(max >= m) = sum of (1 - P(max <= m - 1))
    return sum(1 - ways(ranks, top_k, m - 1) / total for m in range(1, top_k + 1))


def per_rank(cfg, n, ep):
    """(resident weight bytes, bytes a batch-1 token reads) of one of ``n`` ranks."""
    h, hd, layers = cfg["hidden_size"], cfg["head_dim"], cfg["num_hidden_layers"]
    hq, hkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    e, k, inter = cfg["num_experts"], cfg["num_experts_per_tok"], cfg["moe_intermediate_size"]
    q_o = 2 * hq * hd * h / n
    k_v = 2 * hd * h * (hkv / n if n <= hkv else 1)  # one KV head a rank beyond hkv ranks
    replicated = e * h + 2 * h + 2 * hd  # router, 2 norms, q/k norms
    expert = 3 * inter * h
    if ep:
        held, read = e / n * expert, busiest_rank_experts(e, k, n) * expert
    else:
        held, read = e * expert / n, k * expert / n
    layer_held = q_o + k_v + replicated + held
    layer_read = q_o + k_v + replicated + read
    head = math.ceil(cfg["vocab_size"] / n) * h
    embed = head  # vocab-parallel: held, one row looked up
    final_norm = h
    return (
        BF16 * (layers * layer_held + head + embed + final_norm),
        BF16 * (layers * layer_read + head + final_norm),
    )


def wire(cfg, n):
    """(bytes each rank sends a token, all-reduces a token)."""
    reduces = 1 + 2 * cfg["num_hidden_layers"]
    ring = 2 * (n - 1) / n * 4 * cfg["hidden_size"]
    gather = (n - 1) / n * 4 * cfg["vocab_size"]
    return reduces * ring + gather, reduces


def estimate(measured, cfg=QWEN3_235B):
    """Rows of the estimate from ``measured``: ``stream_GBps`` (one machine's), ``of_bound``
    (the share of the stream bound a rank's decode reaches) and ``gloo_step_us`` (the
    software cost of one ring step, from the loopback latency)."""
    rows = []
    for name, n, ep in LAYOUTS:
        held, read = per_rank(cfg, n, ep)
        sent, reduces = wire(cfg, n)
        memory_ms = read / (measured["of_bound"] * measured["stream_GBps"] * 1e9) * 1e3
        hop_us = measured["gloo_step_us"] + NETWORK_US
        latency_ms = (reduces * 2 * (n - 1) + (n - 1)) * hop_us / 1e3
        for gbps in LINKS_GBPS:
            wire_ms = sent * 8 / (gbps * 1e9) * 1e3
            total = memory_ms + wire_ms + latency_ms
            rows.append({
                "layout": name, "link_Gbps": gbps, "weights_per_rank_GB": held / 1e9,
                "read_per_token_per_rank_GB": read / 1e9, "allreduces_per_token": reduces,
                "sent_per_token_per_rank_MB": sent / 1e6, "memory_ms": memory_ms,
                "wire_ms": wire_ms, "latency_ms": latency_ms, "tok_s": 1e3 / total,
                "tok_s_without_latency": 1e3 / (memory_ms + wire_ms),
            })  # fmt: skip
    return rows


def measured_from(result):
    """The estimate's inputs from a bench_tp result (its JSON): the MoE's TP=2 batch-1
    share of the bound outside the collectives (its rate's share over the share of the
    step not in them: the latency term counts those), the run's highest stream figure
    and half the gloo [1, 2048] fp32 all-reduce latency (2 ring steps at world 2)."""
    rows = [r for r in result["rows"] if r["mode"] == "TP=2" and r["batch"] == 1]
    moe = [r for r in rows if r["model"].startswith("qwen3moe")]
    if not moe:
        raise ValueError("result: expected a qwen3moe TP=2 batch-1 row (a bench_tp result)")
    env = result["environment"]
    latency = env["gloo_latency_us"]["all_reduce [1, 2048] fp32"]
    of_bound = moe[0]["of_bound"] / (1 - moe[0]["collective_share"])
    return {"stream_GBps": moe[0]["stream_GBps"], "of_bound": of_bound,
            "gloo_step_us": latency / 2, "cpu": env.get("cpu_model")}  # fmt: skip


def table(rows):
    cols = list(rows[0])
    out = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        cells = [f"{v:.3g}" if isinstance(v, float) else str(v) for v in r.values()]
        out.append("| " + " | ".join(cells) + " |")
    return "\n".join(out)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("result", help="a bench_tp result (bench/results/bench_tp.json)")
    p.add_argument("--gloo-step-us", type=float, default=None,
                   help="a ring step's software cost instead of the measured one (µs)")  # fmt: skip
    a = p.parse_args(argv)
    with open(a.result) as f:
        m = measured_from(json.load(f))
    if a.gloo_step_us is not None:
        m["gloo_step_us"] = a.gloo_step_us
    print(f"measured ({m['cpu']}): stream {m['stream_GBps']:.1f} GB/s, TP=2 decode b1 at "
          f"{m['of_bound']:.2f} of its bound outside the collectives, a gloo ring step "
          f"{m['gloo_step_us']:.0f} us "
          f"(+ {NETWORK_US:.0f} us network assumed)\n")  # fmt: skip
    print(table(estimate(m)))


if __name__ == "__main__":
    sys.exit(main())
