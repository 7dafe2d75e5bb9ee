"""Paper estimates of batch-1 MoE decode under tensor parallelism, from bench_tp's measured
figures (docs/scale-out.md: "Qwen3-235B-A22B on paper", "On one 2-socket host, on paper").

    python bench/tp_estimate.py machines bench/results/bench_tp.json  # across machines
    python bench/tp_estimate.py host bench/results/bench_tp.json      # one 2-socket host

Both count, per rank and per token, for bf16 weights at batch 1:

* **bytes a token reads per rank** (:func:`per_rank`): the rank's share of the attention
  (q and o by heads; k and v by KV heads, one KV head a rank where ranks outnumber them,
  as vLLM), the router and norms (replicated), its LM-head rows, and its experts: under
  TP each of the 8 routed experts' 1/N slice of the intermediate dimension; under EP the
  routed experts that live on the rank -- the step waits for the busiest rank, so
  ``E[max over ranks]`` of 8 experts drawn from 128 (16 a rank), by exact enumeration.
* **collectives a token** (:func:`collectives`): 1 + 2 x layers all-reduces of [1, hidden]
  fp32 (the vocab-parallel embedding; each layer's o and experts), reduced in fp32
  (``engine.dist.Comm``), and one all-gather of the vocab-parallel logits ([1, V/N] fp32
  a rank).

**machines** (:func:`estimate`; TP4: one rank per machine, 4 machines; TP8/EP: attention
split 8 ways, whole experts 16 a rank, 8 machines; links of 25 and 100 Gb/s):

* the all-reduces sent by a ring: 2 (N-1)/N x 4 hidden bytes each, the gather (N-1)/N x V
  x 4 bytes;
* **time a token**: memory (bytes per rank / (the measured share of the stream bound x
  the stream bandwidth of one machine like the one measured)) + wire (bytes / link) +
  latency (each all-reduce 2 (N-1) ring steps of ``hop_us``: the measured gloo cost of a
  step on loopback plus :data:`NETWORK_US` of network; ``--gloo-step-us`` sets the
  first where the run's figure came from a loaded machine); ``tok_s_without_latency``:
  the memory and wire terms alone.

**host** (:func:`host_estimate`; Qwen3-30B-A3B and Qwen3-235B-A22B at TP 2, 4 and 8, plain
TP, the ranks spread evenly over :data:`SOCKETS` sockets):

* **memory** per token: bytes per rank / (the rank's bandwidth x the measured share of
  the bound); the rank's bandwidth: its socket's stream bandwidth (:data:`SOCKET_GBPS`,
  an assumption, ``--socket-GBps``) over the ranks on that socket.
* **collectives** per token: each at the cost of issue 43's shared-memory collective
  (:class:`ShmCost`, fitted to the run's ``shm_latency_us``, measured between 2 ranks of
  one socket) times :data:`CROSS_SOCKET` (an assumption, ``--cross-socket``): every
  layout's ranks span both sockets. The rule: each rank reads every rank's slot, so a
  collective between ``world`` ranks costs ``fixed + world x slot bytes x per byte``; the
  fixed part and the all-reduce's per-byte part from the two measured all-reduce sizes,
  the gather's per-byte part from the measured gather (an all-reduce's slot: [1, hidden]
  fp32; a gather's: [1, ceil(V/N)] fp32).
* **tok/s**: 1 / (memory + collectives); the collectives' share of that step.
"""

import argparse
import json
import math
import re
import sys
from dataclasses import dataclass
from functools import lru_cache

QWEN3_235B = {  # Qwen3-235B-A22B's config.json (the fields the arithmetic reads)
    "hidden_size": 4096, "num_hidden_layers": 94, "num_attention_heads": 64,
    "num_key_value_heads": 4, "head_dim": 128, "num_experts": 128, "num_experts_per_tok": 8,
    "moe_intermediate_size": 1536, "vocab_size": 151936,
}  # fmt: skip
QWEN3_30B = {  # Qwen3-30B-A3B's config.json (bench_tp's MoE at its 48 layers; untied head)
    "hidden_size": 2048, "num_hidden_layers": 48, "num_attention_heads": 32,
    "num_key_value_heads": 4, "head_dim": 128, "num_experts": 128, "num_experts_per_tok": 8,
    "moe_intermediate_size": 768, "vocab_size": 151936,
}  # fmt: skip
BF16 = 2
FP32 = 4

# -- across machines
# one-way latency of a small message between two machines, kernel TCP on 25-100 GbE
# (an assumption, not measured here: the bench has one machine)
NETWORK_US = 15.0
LINKS_GBPS = (25, 100)
LAYOUTS = (("TP4", 4, False), ("TP8/EP", 8, True))

# -- one host
HOST_MODELS = {"Qwen3-30B-A3B": QWEN3_30B, "Qwen3-235B-A22B": QWEN3_235B}
HOST_TP = (2, 4, 8)
SOCKETS = 2
# A socket's stream (read) bandwidth, an assumption: an Emerald Rapids Xeon (the CPU of
# the shm figures) has 8 DDR5-5600 channels a socket, 8 x 5600 MT/s x 8 bytes = 358 GB/s
# at the DIMMs' rate, of which a read stream is taken to sustain 0.75 (an assumed ratio,
# in the 0.7-0.8 that STREAM results commonly show); not measured: the VM has 2 vCPUs.
SOCKET_GBPS = 0.75 * 8 * 5600e6 * 8 / 1e9
# A collective whose ranks span both sockets costs this many times the same collective
# between ranks of one socket (an assumption: the measured figures are 2 vCPUs of one VM,
# presumably of one socket; on 2-socket Xeons a cache line from the other socket takes
# about twice the time of one from the same socket, and the shm collective is such line
# transfers: its flags, and copies that one core runs latency-bound).
CROSS_SOCKET = 2.0
# bench_tp measures its collectives between 2 ranks (tests/ranks.run_ranks, world=2)
MEASURED_WORLD = 2
# the keys of bench_tp's shm figures that --shm-reduce-us and --shm-gather-us set (its
# MoE's logits: V / 2 = 75968 columns a rank)
SHM_REDUCE_KEYS = ("all_reduce [1, 2048] fp32", "all_reduce [32, 2048] fp32")
SHM_GATHER_KEY = "all_gather [1, 75968] fp32"
_SHM_KEY = re.compile(r"^(all_reduce|all_gather) \[(\d+), (\d+)\] fp32$")


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


def collectives(cfg):
    """(all-reduces, all-gathers) a decode step makes: the embedding's and each layer's o
    and experts' all-reduce, the logits' gather."""
    return 1 + 2 * cfg["num_hidden_layers"], 1


# -- across machines ----------------------------------------------------------------------


def wire(cfg, n):
    """(bytes each rank sends a token, all-reduces a token)."""
    reduces, gathers = collectives(cfg)
    ring = 2 * (n - 1) / n * FP32 * cfg["hidden_size"]
    gather = (n - 1) / n * FP32 * cfg["vocab_size"]
    return reduces * ring + gathers * gather, reduces


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


def _moe_tp2(result):
    """The run's qwen3moe TP=2 batch-1 row."""
    rows = [r for r in result["rows"] if r["mode"] == "TP=2" and r["batch"] == 1]
    moe = [r for r in rows if r["model"].startswith("qwen3moe")]
    if not moe:
        raise ValueError("result: expected a qwen3moe TP=2 batch-1 row (a bench_tp result)")
    return moe[0]


def of_bound_outside_collectives(row):
    """A row's share of the bound outside the collectives: its rate's share over the share
    of the step not in them (the estimates count the collectives apart)."""
    return row["of_bound"] / (1 - row["collective_share"])


def measured_from(result):
    """The across-machines inputs from a bench_tp result (its JSON): the MoE's TP=2 batch-1
    share of the bound outside the collectives, the run's highest stream figure and half
    the gloo [1, 2048] fp32 all-reduce latency (2 ring steps at world 2)."""
    moe = _moe_tp2(result)
    env = result["environment"]
    latency = env["gloo_latency_us"]["all_reduce [1, 2048] fp32"]
    return {"stream_GBps": moe["stream_GBps"], "of_bound": of_bound_outside_collectives(moe),
            "gloo_step_us": latency / 2, "cpu": env.get("cpu_model")}  # fmt: skip


# -- one host -------------------------------------------------------------------------------


@dataclass(frozen=True)
class ShmCost:
    """A shared-memory collective's cost between ``world`` ranks of one socket, in µs:
    ``fixed_us + world x slot bytes x us_per_byte`` (each rank reads every rank's slot: an
    all-reduce's is the whole [1, hidden] fp32 partial, a gather's the rank's part)."""

    fixed_us: float
    reduce_us_per_byte: float
    gather_us_per_byte: float

    def all_reduce_us(self, nbytes, world):
        return self.fixed_us + world * nbytes * self.reduce_us_per_byte

    def all_gather_us(self, slot_bytes, world):
        return self.fixed_us + world * slot_bytes * self.gather_us_per_byte


def shm_cost(latency_us, world=MEASURED_WORLD):
    """The :class:`ShmCost` through ``latency_us`` ({"all_reduce [R, C] fp32": µs, ...} as
    bench_tp writes it, measured between ``world`` ranks): two all-reduce sizes fix the
    fixed part and the per-byte part, the gather its own per-byte part (other keys, such
    as bf16 ones, are not read)."""
    found = {"all_reduce": [], "all_gather": []}
    for key, us in latency_us.items():
        if m := _SHM_KEY.match(key):
            found[m[1]].append((int(m[2]) * int(m[3]) * FP32, us))
    if len(found["all_reduce"]) != 2 or len(found["all_gather"]) != 1:
        raise ValueError(
            f"shm latency: expected two fp32 all_reduce sizes and one fp32 all_gather, got "
            f"{sorted(latency_us)} (give --shm-reduce-us and --shm-gather-us)"
        )
    (b1, t1), (b2, t2) = sorted(found["all_reduce"])
    if b1 == b2:
        raise ValueError(f"shm latency: expected two all_reduce sizes, got {sorted(latency_us)}")
    per_byte = (t2 - t1) / (world * (b2 - b1))
    fixed = t1 - world * b1 * per_byte
    ((bg, tg),) = found["all_gather"]
    gather_per_byte = (tg - fixed) / (world * bg)
    if per_byte <= 0 or fixed < 0 or gather_per_byte <= 0:
        raise ValueError(
            f"shm latency {latency_us}: not a fixed part >= 0 plus a cost growing with the "
            f"bytes (fixed {fixed:.3g} us, all-reduce {per_byte:.3g} us/B, gather "
            f"{gather_per_byte:.3g} us/B)"
        )
    return ShmCost(fixed, per_byte, gather_per_byte)


def host_measured_from(result, shm_us=None):
    """The one-host inputs from a bench_tp result: the MoE's TP=2 batch-1 share of the
    bound outside the collectives, the :class:`ShmCost` fitted to its ``shm_latency_us``
    with ``shm_us`` ({key: µs}, the command line's) over it, and the stream figures (for
    the log). A result without ``shm_latency_us`` needs all three figures in ``shm_us``."""
    moe = _moe_tp2(result)
    env = result["environment"]
    latency = env.get("shm_latency_us")
    given = dict(shm_us or {})
    if not latency and set(given) != {*SHM_REDUCE_KEYS, SHM_GATHER_KEY}:
        raise ValueError(
            "result: no shm_latency_us (a bench_tp run from before the shared-memory "
            "collectives): give --shm-reduce-us SMALL LARGE and --shm-gather-us "
            f"({', '.join(SHM_REDUCE_KEYS)}; {SHM_GATHER_KEY}; µs between 2 ranks)"
        )
    shm = shm_cost({**(latency or {}), **given})
    return {"of_bound": of_bound_outside_collectives(moe), "shm": shm,
            "bound_stream_GBps": env.get("bound_stream_GBps"),
            "stream_2x1_GBps": env.get("stream_2x1_GBps"), "cpu": env.get("cpu_model")}  # fmt: skip


def host_estimate(measured, *, socket_GBps=SOCKET_GBPS, cross_socket=CROSS_SOCKET,
                  models=HOST_MODELS, tps=HOST_TP):  # fmt: skip
    """Rows of the one-host estimate from ``measured`` (``of_bound``, ``shm``: a
    :class:`ShmCost`): per model and TP size, the ranks spread evenly over :data:`SOCKETS`
    sockets of ``socket_GBps`` each, every collective ``cross_socket`` times its
    within-socket cost."""
    rows, shm = [], measured["shm"]
    for name, cfg in models.items():
        reduces, gathers = collectives(cfg)
        for n in tps:
            if n % SOCKETS:
                raise ValueError(f"tp: expected a multiple of {SOCKETS} sockets, got {n}")
            held, read = per_rank(cfg, n, False)
            rank_GBps = socket_GBps / (n // SOCKETS)
            memory_ms = read / (measured["of_bound"] * rank_GBps * 1e9) * 1e3
            reduce_us = cross_socket * shm.all_reduce_us(FP32 * cfg["hidden_size"], n)
            slot = FP32 * math.ceil(cfg["vocab_size"] / n)
            gather_us = cross_socket * shm.all_gather_us(slot, n)
            collective_ms = (reduces * reduce_us + gathers * gather_us) / 1e3
            step_ms = memory_ms + collective_ms
            rows.append({
                "model": name, "tp": n, "ranks_per_socket": n // SOCKETS,
                "weights_per_rank_GB": held / 1e9, "read_per_token_per_rank_GB": read / 1e9,
                "rank_GBps": rank_GBps, "memory_ms": memory_ms,
                "allreduces_per_token": reduces, "gathers_per_token": gathers,
                "allreduce_us": reduce_us, "gather_us": gather_us,
                "collective_ms": collective_ms, "tok_s": 1e3 / step_ms,
                "collective_share": collective_ms / step_ms,
            })  # fmt: skip
    return rows


# the one-host table's columns (its gathers: one a token, in the all-reduces' title)
HOST_HEADERS = {
    "model": "model", "tp": "TP", "ranks_per_socket": "ranks a socket",
    "weights_per_rank_GB": "weights a rank (GB)",
    "read_per_token_per_rank_GB": "read a token a rank (GB)",
    "rank_GBps": "a rank's stream (GB/s)", "memory_ms": "memory (ms)",
    "allreduces_per_token": "all-reduces a token (+ 1 gather)",
    "allreduce_us": "an all-reduce (µs)", "gather_us": "the gather (µs)",
    "collective_ms": "collectives (ms)", "tok_s": "tok/s",
    "collective_share": "collectives' share",
}  # fmt: skip


def table(rows, headers=None):
    """``rows`` as a Markdown table: the columns and their titles ``headers`` ({key:
    title}) names, else every key."""
    headers = headers or {c: c for c in rows[0]}
    out = ["| " + " | ".join(headers.values()) + " |", "|" + "---|" * len(headers)]
    for r in rows:
        cells = [f"{r[c]:.3g}" if isinstance(r[c], float) else str(r[c]) for c in headers]
        out.append("| " + " | ".join(cells) + " |")
    return "\n".join(out)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="what", required=True)
    machines = sub.add_parser("machines", help="Qwen3-235B-A22B across machines")
    host = sub.add_parser("host", help="Qwen3-30B-A3B and -235B-A22B on one 2-socket host")
    for q in (machines, host):
        q.add_argument("result", help="a bench_tp result (bench/results/bench_tp.json)")
    machines.add_argument(
        "--gloo-step-us",
        type=float,
        default=None,
        help="a ring step's software cost instead of the measured one (µs)",
    )
    host.add_argument(
        "--socket-GBps",
        type=float,
        default=SOCKET_GBPS,
        help=f"a socket's stream bandwidth (default {SOCKET_GBPS:.0f}, assumed)",
    )
    host.add_argument(
        "--cross-socket",
        type=float,
        default=CROSS_SOCKET,
        help=f"a collective across sockets over one within one (default {CROSS_SOCKET})",
    )
    host.add_argument(
        "--shm-reduce-us",
        type=float,
        nargs=2,
        metavar=("SMALL", "LARGE"),
        help=f"µs of the shm {' and '.join(SHM_REDUCE_KEYS)} between 2 ranks",
    )
    host.add_argument(
        "--shm-gather-us", type=float, help=f"µs of the shm {SHM_GATHER_KEY} between 2 ranks"
    )
    a = p.parse_args(argv)
    with open(a.result) as f:
        result = json.load(f)
    if a.what == "machines":
        m = measured_from(result)
        if a.gloo_step_us is not None:
            m["gloo_step_us"] = a.gloo_step_us
        print(f"measured ({m['cpu']}): stream {m['stream_GBps']:.1f} GB/s, TP=2 decode b1 at "
              f"{m['of_bound']:.2f} of its bound outside the collectives, a gloo ring step "
              f"{m['gloo_step_us']:.0f} us "
              f"(+ {NETWORK_US:.0f} us network assumed)\n")  # fmt: skip
        print(table(estimate(m)))
        return
    given = dict(zip(SHM_REDUCE_KEYS, a.shm_reduce_us or ()))
    if a.shm_gather_us is not None:
        given[SHM_GATHER_KEY] = a.shm_gather_us
    try:
        m = host_measured_from(result, given)
    except ValueError as e:
        host.error(str(e))
    shm = m["shm"]
    print(f"measured ({m['cpu']}): TP=2 decode b1 at {m['of_bound']:.2f} of its bound outside "
          f"the collectives (the bound: stream {m['bound_stream_GBps']:.1f} GB/s; the ranks' "
          f"2 x 1 thread stream {m['stream_2x1_GBps']:.1f} GB/s); a shm collective between "
          f"ranks of one socket {shm.fixed_us:.2f} us + world x slot bytes at "
          f"{1e-3 / shm.reduce_us_per_byte:.1f} GB/s (all-reduce), "
          f"{1e-3 / shm.gather_us_per_byte:.1f} GB/s (gather); assumed: {SOCKETS} sockets of "
          f"{a.socket_GBps:.0f} GB/s, a collective across them x{a.cross_socket:g}\n")  # fmt: skip
    print(table(host_estimate(m, socket_GBps=a.socket_GBps, cross_socket=a.cross_socket),
                HOST_HEADERS))  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
