"""Tensor and expert parallelism: decode tokens/s at TP=1, TP=2 and EP=2 on one machine.

    python bench/bench_tp.py               # both models, TP=1 / TP=2 / EP=2 (~15 min, 2 cores)
    python bench/bench_tp.py --quick       # the MoE only, 1 round, fewer tokens
    python bench/bench_tp.py --moe-only    # or --dense-only
    python -m bench --only tp              # the same run inside the report

Two checkpoints of random bf16 weights, written as safetensors at bench time into
``NUMKERN_BENCH_CACHE`` (default ``/tmp/numkern-bench-models``), each in a folder named
by a hash of its config (``tp-<label>-<hash>/``: ``config.json`` + ``model.safetensors``),
reused when there; ``--delete-models`` deletes them at the end (in a ``finally``):

* **Qwen3-30B-A3B-shaped MoE**, 4 of its 48 layers (hidden 2048; 32 q / 4 kv heads of
  128 with q/k norms; 128 experts top-8 of moe_intermediate 768; vocab 151,936, untied
  LM head): 6.2 GB.
* **Llama-shaped dense** (Llama-3.2-1B's shapes: hidden 2048, 16 layers, 32 q / 8 kv
  heads of 64, intermediate 8192, vocab 128,256, tied embedding): 2.5 GB. No target: its
  collectives weigh more against its shorter step.

Each (model, mode) runs in a process of its own, one after another (TP=1 and TP=2 never
share the machine): **TP=1** ``LLM(path)`` on 2 Numba threads; **TP=2**
``LLM(path, tensor_parallel_size=2, threads_per_rank=1)`` (the engine spawns rank 1;
this process is rank 0); **EP=2** the same with ``enable_expert_parallel=True`` (the MoE
only). In each, ``ROUNDS`` rounds of (a stream pass, a batch-1 run, a batch-8 run): each
run a ``PROMPT``-token prompt per sequence then ``NEW`` greedy tokens, the decode rate
timed from the first token's arrival to the last's (:func:`harness.token_rates`); the
rate is the best of the rounds, the stream the highest pass of the process.

* **all-reduce share**: rank 0's ``Comm.all_reduce`` / ``Comm.all_gather`` calls are
  timed (wrapped on the engine's comm object) between the first and the last token of
  the batch-1 run: their time over the decode time, and the collectives per step. Rank
  0's wait for rank 1 inside a collective is in it (what a step loses to the split).
* **resident weight bytes per rank**: the weight bytes rank 0's model holds
  (``DecoderModel.weight_bytes``: its share of the split tensors plus the replicated
  ones; :func:`tensor_bytes` where the engine has no such count), and every rank's
  anonymous resident memory (``RssAnon`` of /proc) after the load.
* **bound**: a decode token reads every layer weight but the experts, top-k / E of the
  experts, and the LM head (an untied embedding's lookup reads one row): batch-1 decode
  cannot pass stream / those bytes, batch 8 not 8x it (8 tokens may share their
  experts); across ranks on one machine the bytes are the same and the bandwidth is
  shared. The stream figure: the highest pass of the whole run (:func:`check_bounds`
  says why). A rate above its bound is a :class:`harness.MeasurementError`.
* **gloo latency**: ``Comm.all_reduce`` of [1, 2048] bf16 and fp32 and ``all_gather`` of
  a rank's logits [1, V/2] fp32, between 2 spawned processes (tests/ranks.run_ranks),
  median of ``LATENCY_CALLS``; in the same pair of processes, the stream bandwidth of 2
  processes of 1 thread each streaming at once (:func:`ranks_stream`: the ranks' shape).

Targets: TP=2 decode b1 >= 0.85x TP=1 on the MoE; per-rank resident weights <= 0.55 of
TP=1's. The 1-minute load average is printed beside every figure (the machine is shared).
"""

import argparse
import gc
import hashlib
import itertools
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import harness
import numba
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

CACHE_ENV = "NUMKERN_BENCH_CACHE"
DEFAULT_CACHE = "/tmp/numkern-bench-models"
PROMPT = 64
NEW = 32  # 16 with --quick
ROUNDS = 3  # 1 with --quick
BATCHES = (1, 8)
LATENCY_CALLS = 300
KV_MEMORY = 1 << 28  # per rank; 256 MB holds 8 x 96 tokens of either model many times

QWEN3_MOE = {  # Qwen3-30B-A3B's config.json with 4 of its 48 layers
    "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
    "hidden_size": 2048, "intermediate_size": 6144, "moe_intermediate_size": 768,
    "num_hidden_layers": 4, "num_attention_heads": 32, "num_key_value_heads": 4,
    "head_dim": 128, "num_experts": 128, "num_experts_per_tok": 8, "norm_topk_prob": True,
    "decoder_sparse_step": 1, "mlp_only_layers": [], "vocab_size": 151936,
    "rope_theta": 1000000.0, "rms_norm_eps": 1e-6, "max_position_embeddings": 4096,
    "tie_word_embeddings": False, "hidden_act": "silu", "torch_dtype": "bfloat16",
    "bos_token_id": 1, "eos_token_id": 2,
}  # fmt: skip
LLAMA = {  # Llama-3.2-1B's config.json, rope scaling left out (plain rope at its theta)
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 2048,
    "intermediate_size": 8192, "num_hidden_layers": 16, "num_attention_heads": 32,
    "num_key_value_heads": 8, "head_dim": 64, "vocab_size": 128256, "rope_theta": 500000.0,
    "rms_norm_eps": 1e-5, "max_position_embeddings": 4096, "tie_word_embeddings": True,
    "hidden_act": "silu", "torch_dtype": "bfloat16", "bos_token_id": 1, "eos_token_id": 2,
}  # fmt: skip
MODELS = {"qwen3moe-30b-a3b-4L": QWEN3_MOE, "llama-2048h-16L": LLAMA}
# mode -> (tensor_parallel_size, enable_expert_parallel)
MODES = {"TP=1": (1, False), "TP=2": (2, False), "EP=2": (2, True)}


# -- the checkpoints -------------------------------------------------------------------------


def hf_tensors(cfg):
    """[(HF tensor name, shape)] of a Llama / Qwen3-MoE config, as transformers names them
    (Qwen3-MoE's experts one tensor each, as the published checkpoints store them)."""
    h, hd = cfg["hidden_size"], cfg["head_dim"]
    q, kv = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd
    out = [("model.embed_tokens.weight", (cfg["vocab_size"], h)), ("model.norm.weight", (h,))]
    if not cfg["tie_word_embeddings"]:
        out.append(("lm_head.weight", (cfg["vocab_size"], h)))
    for i in range(cfg["num_hidden_layers"]):
        b = f"model.layers.{i}."
        out += [(b + "input_layernorm.weight", (h,)), (b + "post_attention_layernorm.weight", (h,))]
        a = b + "self_attn."
        out += [(a + "q_proj.weight", (q, h)), (a + "k_proj.weight", (kv, h))]
        out += [(a + "v_proj.weight", (kv, h)), (a + "o_proj.weight", (h, q))]
        if "num_experts" in cfg:
            out += [(a + "q_norm.weight", (hd,)), (a + "k_norm.weight", (hd,))]
            e, f = cfg["num_experts"], cfg["moe_intermediate_size"]
            out.append((b + "mlp.gate.weight", (e, h)))
            for j in range(e):
                x = f"{b}mlp.experts.{j}."
                out += [(x + "gate_proj.weight", (f, h)), (x + "up_proj.weight", (f, h))]
                out.append((x + "down_proj.weight", (h, f)))
        else:
            f = cfg["intermediate_size"]
            out += [(b + "mlp.gate_proj.weight", (f, h)), (b + "mlp.up_proj.weight", (f, h))]
            out.append((b + "mlp.down_proj.weight", (h, f)))
    return out


# random values are drawn this many at a time (fp32 staging: 64 MB)
_CHUNK = 1 << 24


def write_safetensors(path, tensors, *, seed=0):
    """Write ``tensors`` ([(name, shape)]) as one bf16 safetensors file at ``path``,
    streamed a chunk at a time (the format: an 8-byte little-endian header length, the
    JSON header of dtype, shape and byte offsets, then the data): never the model in
    memory. Norms are ones, every other weight N(0, 0.02)."""
    header, at = {"__metadata__": {"format": "pt"}}, 0
    for name, shape in tensors:
        n = 2 * math.prod(shape)
        header[name] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [at, at + n]}
        at += n
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)  # the data starts 8-byte aligned
    gen = torch.Generator().manual_seed(seed)
    tmp = f"{path}.part"
    with open(tmp, "wb") as f:
        f.write(len(head).to_bytes(8, "little"))
        f.write(head)
        for name, shape in tensors:
            numel = math.prod(shape)
            if name.endswith("norm.weight"):
                f.write(torch.ones(numel, dtype=torch.bfloat16).view(torch.int16).numpy())
                continue
            for lo in range(0, numel, _CHUNK):
                x = torch.randn(min(_CHUNK, numel - lo), generator=gen).mul_(0.02)
                f.write(x.to(torch.bfloat16).view(torch.int16).numpy())
    size, want = os.path.getsize(tmp), 8 + len(head) + at
    if size != want:
        raise RuntimeError(f"{tmp}: wrote {size} bytes, expected {want}")
    os.replace(tmp, path)


def checkpoint_dir(label, cfg, root=None):
    """The folder of ``cfg``'s checkpoint: ``tp-<label>-<hash of the config>`` in the
    cache folder (``root``, else ``NUMKERN_BENCH_CACHE``, else :data:`DEFAULT_CACHE`)."""
    key = hashlib.sha1(json.dumps(cfg, sort_keys=True).encode()).hexdigest()[:10]
    root = Path(root or os.environ.get(CACHE_ENV, DEFAULT_CACHE))
    return root / f"tp-{label}-{key}"


def cached_checkpoint(label, cfg, root=None, *, seed=0):
    """The path of ``cfg``'s random bf16 checkpoint (:func:`checkpoint_dir`), written when
    absent (config.json last: a folder with one holds a whole file)."""
    folder = checkpoint_dir(label, cfg, root)
    if not (folder / "config.json").exists():
        folder.mkdir(parents=True, exist_ok=True)
        t = time.perf_counter()
        write_safetensors(folder / "model.safetensors", hf_tensors(cfg), seed=seed)
        (folder / "config.json").write_text(json.dumps(cfg, indent=1))
        size = (folder / "model.safetensors").stat().st_size
        print(f"wrote {folder} ({size / 1e9:.2f} GB, {time.perf_counter() - t:.0f} s)", flush=True)
    return str(folder)


def token_bytes(cfg):
    """Bytes (bf16) a decode token reads at least: every layer weight but the experts,
    top-k / E of the experts, the final norm and the LM head (the tied embedding counted
    once, as the head; an untied embedding's lookup reads one row: not counted)."""
    k, e = cfg.get("num_experts_per_tok", 0), cfg.get("num_experts", 1)
    total = 0
    for name, shape in hf_tensors(cfg):
        n = 2 * math.prod(shape)
        if name == "model.embed_tokens.weight" and not cfg["tie_word_embeddings"]:
            continue
        total += n * k // e if ".experts." in name else n
    return total


# -- one (model, mode) in this process ----------------------------------------------------


def tensor_bytes(obj, skip=("stack",)):
    """Bytes of the distinct tensors (by address and size) reachable from ``obj`` through
    dicts, lists, tuples and the attributes of the engine's and numkern's own objects
    (attributes named in ``skip`` not followed: the model's ``stack`` binds the KV
    caches). Views counted, not their storages: the engine's weights are views of 64 MB
    arena chunks (engine.memory), the last of them partly filled."""
    seen, storages, todo = set(), {}, [obj]
    while todo:
        o = todo.pop()
        if id(o) in seen:
            continue
        seen.add(id(o))
        if isinstance(o, torch.Tensor):
            n = o.numel() * o.element_size()
            storages[(o.data_ptr(), n)] = n
        elif isinstance(o, dict):
            todo += list(o.values())
        elif isinstance(o, (list, tuple)):
            todo += list(o)
        elif type(o).__module__.split(".")[0] in ("engine", "numkern"):
            fields = getattr(o, "__dict__", None) or {
                k: getattr(o, k, None) for k in getattr(type(o), "__slots__", ())
            }
            todo += [v for k, v in fields.items() if k not in skip]
    return sum(storages.values())


def rss_anon(pid="self"):
    """Anonymous resident bytes of process ``pid`` (/proc's RssAnon), or None."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("RssAnon:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


class CommClock:
    """Times the engine's collectives on this rank: wraps ``all_reduce``, ``all_gather``
    and ``broadcast_object`` (rank 0's step command) of one comm object, restored on exit.
    ``seconds`` / ``calls``: per name."""

    NAMES = ("all_reduce", "all_gather", "broadcast_object")

    def __init__(self, comm):
        self.comm = comm
        self.seconds = dict.fromkeys(self.NAMES, 0.0)
        self.calls = dict.fromkeys(self.NAMES, 0)

    def _wrap(self, name, fn):
        def timed(*args, **kw):
            s = time.perf_counter()
            out = fn(*args, **kw)
            self.seconds[name] += time.perf_counter() - s
            self.calls[name] += 1
            return out

        return timed

    def __enter__(self):
        for name in self.NAMES:
            setattr(self.comm, name, self._wrap(name, getattr(self.comm, name)))
        return self

    def __exit__(self, *exc):
        for name in self.NAMES:
            vars(self.comm).pop(name, None)

    def snapshot(self):
        """(seconds in all_reduce + all_gather, their calls, seconds in broadcast_object)."""
        pair = ("all_reduce", "all_gather")
        return (sum(self.seconds[n] for n in pair), sum(self.calls[n] for n in pair),
                self.seconds["broadcast_object"])  # fmt: skip


def engine_comm(llm):
    """The comm object of rank 0's engine (its runtime's; ``engine.dist.LOCAL`` for one
    process)."""
    runtime = getattr(llm, "runtime", None)
    if runtime is not None:
        return runtime.comm
    from engine.dist import LOCAL

    return LOCAL


def decode_run(llm, batch, new, clock):
    """One run: ``batch`` prompts of :data:`PROMPT` tokens, ``new`` greedy tokens each;
    (decode tok/s, then over the same span (the first step's tokens to the last's): the
    seconds in all-reduce / all-gather, their calls, the seconds in step broadcasts, the
    steps)."""
    from engine.llm import SamplingParams

    prompts = [[(7 * i + j) % 1000 + 10 for j in range(PROMPT)] for i in range(batch)]
    sp = SamplingParams(temperature=0, max_tokens=new, ignore_eos=True)
    t0 = time.perf_counter()
    stamps, marks = [], []
    for i, _ in enumerate(llm.generate_stream(prompts, sp)):
        stamps.append(time.perf_counter())
        if i % batch == batch - 1:  # a step's last token
            marks.append(clock.snapshot())
    if len(stamps) != batch * new:
        raise harness.MeasurementError(f"expected {batch * new} tokens, got {len(stamps)}")
    _, rate = harness.token_rates(t0, stamps[batch - 1 :: batch], batch, PROMPT)
    spent = [b - a for a, b in zip(marks[0], marks[-1])]
    return rate, *spent, len(marks) - 1


def _stream(threads):
    """A stream pass (median of 3) on ``threads`` Numba threads (the machine's bandwidth,
    also where this rank runs on fewer)."""
    was = numba.get_num_threads()
    numba.set_num_threads(threads)
    try:
        return harness.stream_bandwidth(repeats=3)
    finally:
        numba.set_num_threads(was)


def measure(label, path, mode, *, rounds, new):
    """One row per batch size of ``mode`` on the checkpoint ``path`` (this process is
    rank 0), with the facts of the load."""
    from engine.llm import LLM

    world, ep = MODES[mode]
    threads = numba.get_num_threads()  # the machine's: the stream's and TP=1's
    streams = [_stream(threads)]
    kw = dict(dtype="bfloat16", kv_cache_memory=KV_MEMORY, progress=False)
    if world > 1:
        kw |= dict(tensor_parallel_size=world, enable_expert_parallel=ep, threads_per_rank=1)
    anon0 = rss_anon()
    t = time.perf_counter()
    llm = LLM(path, **kw)
    load_s = time.perf_counter() - t
    try:
        counted = getattr(llm.model, "weight_bytes", None)  # the engine's own count
        weights = counted() if counted is not None else tensor_bytes(llm.model)
        pids = [os.getpid(), *worker_pids(llm)]
        anon = [rss_anon(p) for p in pids]
        comm = engine_comm(llm)
        runs = {b: [] for b in BATCHES}
        with CommClock(comm) as clock:
            for b in BATCHES:  # warm-up: compiles, page faults
                decode_run(llm, b, 3, clock)
            for _ in range(rounds):
                for b in BATCHES:
                    load = os.getloadavg()[0]
                    runs[b].append((*decode_run(llm, b, new, clock), load))
                streams.append(_stream(threads))
        # the engine sets each rank's count inside its calls (engine.dist: threads_per_rank)
        rank_threads = getattr(getattr(llm, "runtime", None), "numba_threads", None) or threads
    finally:
        close = getattr(llm, "close", None)
        if close is not None:
            close()
    rows = []
    for b in BATCHES:
        best = max(runs[b], key=lambda r: r[0])
        rate, comm_s, calls, bcast_s, steps, load = best
        step_s = b / rate
        rows.append({
            "model": label, "mode": mode, "batch": b, "decode_tok_s": rate,
            "runs_tok_s": " ".join(f"{r[0]:.2f}" for r in runs[b]), "step_ms": step_s * 1e3,
            "collective_share": comm_s / (steps * step_s),
            "collectives_per_step": calls / steps, "collective_us": comm_s / max(calls, 1) * 1e6,
            "broadcast_share": bcast_s / (steps * step_s),
            "weights_rank0_GB": weights / 1e9,
            "rss_anon_GB": " / ".join(f"{a / 1e9:.2f}" if a else "?" for a in anon),
            "rss_anon_at_start_GB": anon0 / 1e9 if anon0 else None,
            "load_s": load_s, "load_1m": load, "stream_GBps": max(streams),
            "threads": f"{world} x numba {rank_threads}",
        })  # fmt: skip
        print(f"  {label} {mode} b{b} (load {load:.1f}): {rate:.2f} tok/s (runs "
              f"{rows[-1]['runs_tok_s']}); collectives {rows[-1]['collective_share']:.1%} of "
              f"a step ({calls / steps:.1f} a step)", flush=True)  # fmt: skip
    del llm
    gc.collect()
    return rows


def interleaved(path, *, rounds, new):
    """TP=1 and TP=2 (1 thread a rank) engines of the checkpoint ``path`` held at once in
    this process (each idles while the other runs: TP=2's worker naps in its wait for the
    next command), their batch-1 decode runs alternated ``rounds`` times, the order
    swapped every round (A B, B A, ...). Per round: both rates, TP=2's over TP=1's, and
    TP=2's collective share (rank 0's all-reduce and all-gather time over its decode
    time)."""
    from engine.llm import LLM

    kw = dict(dtype="bfloat16", kv_cache_memory=KV_MEMORY, progress=False)
    engines = {"TP=1": LLM(path, **kw)}
    try:
        engines["TP=2"] = LLM(path, tensor_parallel_size=2, threads_per_rank=1, **kw)
        clocks = {mode: CommClock(engine_comm(llm)) for mode, llm in engines.items()}
        out = []
        with clocks["TP=1"], clocks["TP=2"]:
            for mode, llm in engines.items():  # warm-up: compiles, page faults
                decode_run(llm, 1, 3, clocks[mode])
            for r in range(rounds):
                row = {"load_1m": os.getloadavg()[0]}
                for mode in sorted(engines, reverse=r % 2 == 1):
                    rate, comm_s, _, _, steps = decode_run(engines[mode], 1, new, clocks[mode])
                    row[mode] = rate
                    if mode == "TP=2":
                        row["collective_share"] = comm_s / (steps / rate)
                row["ratio"] = row["TP=2"] / row["TP=1"]
                print(f"  round {r}: TP=1 {row['TP=1']:.2f} tok/s, TP=2 {row['TP=2']:.2f} "
                      f"({row['ratio']:.3f}x), collectives {row['collective_share']:.1%} of "
                      f"TP=2's step (load {row['load_1m']:.1f})", flush=True)  # fmt: skip
                out.append(row)
    finally:
        for llm in engines.values():
            llm.close()
    return out


def worker_pids(llm):
    """The pids of the ranks ``llm`` spawned, rank 1 first (none for one process)."""
    runtime = getattr(llm, "runtime", None)
    return list(runtime.pids) if runtime is not None else []


# -- gloo latency --------------------------------------------------------------------------


def _latency_rank(comm, vocab, calls):
    """``{transport: {collective: [µs of each call]}}`` on this rank: the engine's comm
    (shared memory where the ranks share this host) and a gloo one on the same group, the
    cases interleaved call by call, each call started in lockstep: after a barrier of its
    own transport (an all-reduce of one element: every rank leaves it once all have
    entered; gloo's barrier), so a rank's time is the call's, not the other's lateness."""
    import torch.distributed as dist

    from engine.dist import Comm

    comms = {comm.transport: comm, "gloo": Comm(comm.rank, comm.world)}
    shapes = {"all_reduce [1, 2048] bf16": ((1, 2048), torch.bfloat16),
              "all_reduce [1, 2048] fp32": ((1, 2048), torch.float32),
              "all_reduce [32, 2048] fp32": ((32, 2048), torch.float32),
              f"all_gather [1, {vocab // comm.world}] fp32": ((1, vocab // comm.world),
                                                              torch.float32)}  # fmt: skip
    out = {t: {name: [] for name in shapes} for t in comms}
    barrier = {t: (lambda c=c: c.all_reduce(torch.zeros(1))) for t, c in comms.items()}
    barrier["gloo"] = dist.barrier
    for i in range(20 + calls):
        for name, (shape, dtype) in shapes.items():
            for transport, c in comms.items():
                fn = c.all_gather if name.startswith("all_gather") else c.all_reduce
                x = torch.ones(shape, dtype=dtype)
                barrier[transport]()
                t = time.perf_counter()
                fn(x)
                if i >= 20:
                    out[transport][name].append((time.perf_counter() - t) * 1e6)
    return out


def collective_latency(vocab, calls=LATENCY_CALLS):
    """``{transport: {collective: median µs}}`` between 2 spawned ranks (tests/ranks), the
    slower rank's; ``transport``: the engine's (``shm`` where the ranks share this host)
    and ``gloo``."""
    from tests.ranks import run_ranks

    per_rank = run_ranks(_latency_rank, vocab, calls, world=2, timeout=30.0)
    return {t: {k: max(statistics.median(r[t][k]) for r in per_rank) for k in per_rank[0][t]}
            for t in per_rank[0]}  # fmt: skip


def _stream_rank(comm, repeats):
    """(bytes, seconds of each pass) of this rank's 1-thread stream passes over half the
    working set, each pass started with the other rank's (a barrier)."""
    import torch.distributed as dist

    read, nbytes = harness.stream_reader(harness.WORKING_SET_BYTES // 2)
    times = []
    for _ in range(repeats):
        dist.barrier()
        t = time.perf_counter()
        read()
        times.append(time.perf_counter() - t)
    return nbytes, times


def ranks_stream(repeats=5):
    """GB/s of 2 processes of 1 Numba thread streaming at once (the TP=2 ranks' shape):
    per pass both ranks' bytes over the slower rank's time; the median pass."""
    from tests.ranks import run_ranks

    per_rank = run_ranks(_stream_rank, repeats, world=2, timeout=60.0)
    total = sum(n for n, _ in per_rank)
    passes = [total / max(ts) for ts in zip(*(t for _, t in per_rank))]
    return statistics.median(passes) / 1e9


# -- the run --------------------------------------------------------------------------------


def _child(argv):
    """A child's command line: ``--child OUT --what measure|latency --model L --path P
    --mode M --rounds R --new N``; its result as JSON in the file OUT."""
    p = argparse.ArgumentParser(prog="bench_tp.py --child")
    p.add_argument("--child", required=True)
    p.add_argument("--what", required=True, choices=("measure", "ranks", "interleaved"))
    p.add_argument("--model", required=True, choices=sorted(MODELS))
    p.add_argument("--path", default="")
    p.add_argument("--mode", default="TP=1", choices=sorted(MODES))
    p.add_argument("--rounds", type=int, default=ROUNDS)
    p.add_argument("--new", type=int, default=NEW)
    a = p.parse_args(argv)
    if a.what == "ranks":
        # the 2-thread figure beside the 2 x 1-thread one, before and after it
        single = [_stream(numba.config.NUMBA_NUM_THREADS)]
        stream = ranks_stream()
        single.append(_stream(numba.config.NUMBA_NUM_THREADS))
        threads = numba.config.NUMBA_NUM_THREADS
        print(f"stream read bandwidth, 2 processes x 1 thread: {stream:.2f} GB/s; 1 process x "
              f"{threads} threads: {max(single):.2f}", flush=True)  # fmt: skip
        result = {"latency": collective_latency(MODELS[a.model]["vocab_size"]), "stream": stream,
                  "stream_one_process": max(single)}  # fmt: skip
    elif a.what == "interleaved":
        result = interleaved(a.path, rounds=a.rounds, new=a.new)
    else:
        result = measure(a.model, a.path, a.mode, rounds=a.rounds, new=a.new)
    Path(a.child).write_text(json.dumps(result))


def run_child(what, label, path="", mode="TP=1", *, rounds=ROUNDS, new=NEW):
    """:func:`measure` (``what="measure"``) or :func:`ranks_stream` and
    :func:`gloo_latency` (``"ranks"``) in a process of its own (so no two cases share the
    machine, nor one's memory the next's); its result. The child's output goes to this terminal."""
    with tempfile.TemporaryDirectory(prefix="bench-tp-") as d:
        out = Path(d) / "result.json"
        cmd = [sys.executable, __file__, "--child", str(out), "--what", what]
        cmd += ["--model", label, "--path", path, "--mode", mode]
        cmd += ["--rounds", str(rounds), "--new", str(new)]
        print(f"--- {what} {label} {mode} (load {os.getloadavg()[0]:.2f})", flush=True)
        done = subprocess.run(cmd, cwd=ROOT)
        if done.returncode != 0:
            raise RuntimeError(f"{what} {label} {mode}: the child exited with {done.returncode}")
        return json.loads(out.read_text())


def check_bounds(rows, streams):
    """Each row's bound (tok/s: batch x the run's highest stream figure / the bytes a token
    reads, :func:`token_bytes`) and its share of it; a rate above its bound is a
    :class:`harness.MeasurementError`. The highest figure of the whole run (this process's
    passes and every child's): on this shared 2-core VM a 2-thread stream pass loses the
    most to other processes' load (one thread descheduled stalls every barrier), more
    than the engine's ranks of 1 thread each do, so one child's own figure can sit under
    what its ranks stream."""
    top = max([*streams, *(r["stream_GBps"] for r in rows)]) * 1e9
    for r in rows:
        bound = r["batch"] * top / token_bytes(MODELS[r["model"]])
        what = f"{r['model']} {r['mode']} decode b{r['batch']} (tok/s)"
        harness.check_bound(what, r["decode_tok_s"], bound)
        r["bound_tok_s"], r["of_bound"] = bound, r["decode_tok_s"] / bound
    return top / 1e9


def _ratios(rows):
    """Each row's decode rate over its model's TP=1 rate at the same batch, and its
    rank-0 weight bytes over TP=1's."""
    base = {(r["model"], r["batch"]): r for r in rows if r["mode"] == "TP=1"}
    for r in rows:
        b = base.get((r["model"], r["batch"]))
        r["x_tp1"] = r["decode_tok_s"] / b["decode_tok_s"] if b else None
        r["weights_of_tp1"] = r["weights_rank0_GB"] / b["weights_rank0_GB"] if b else None


def _targets(rows, moe):
    """Lines saying each target's figure and whether it was met."""
    lines = []
    for r in rows:
        if r["model"] != moe or r["mode"] == "TP=1" or r["x_tp1"] is None:
            continue
        if r["batch"] == 1 and r["mode"] == "TP=2":
            ok = "met" if r["x_tp1"] >= 0.85 else "MISSED"
            lines.append(f"target {ok}: {moe} TP=2 decode b1 {r['x_tp1']:.2f}x TP=1 (>= 0.85)")
        if r["batch"] == 1:
            ok = "met" if r["weights_of_tp1"] <= 0.55 else "MISSED"
            lines.append(f"target {ok}: {moe} {r['mode']} rank-0 resident weights "
                         f"{r['weights_of_tp1']:.3f} of TP=1's (<= 0.55)")  # fmt: skip
    return lines


MOE = "qwen3moe-30b-a3b-4L"
INTERLEAVED_ROUNDS = 9  # a ratio target is the median of at least 9 interleaved rounds
COLLECTIVE_SHARE = 0.05  # the most of TP=2's decode step in its collectives
TP2_FACTOR = 0.9  # TP=2 >= this x TP=1 x the 2 x 1-thread / 1 x 2-thread stream ratio


def _interleaved_targets(rounds, ranks):
    """The interleaved run's medians and target lines: TP=2 over TP=1 against 0.9x the
    stream ratio of the ranks' shape (2 processes of 1 thread over 1 process of 2, both
    in the ranks child), TP=2's collective share against 5%, and TP=1's round-to-round
    spread (identical code twice: the run's noise)."""
    ratio = statistics.median(r["ratio"] for r in rounds)
    share = statistics.median(r["collective_share"] for r in rounds)
    tp1 = [r["TP=1"] for r in rounds]
    steps = [abs(b / a - 1) for a, b in itertools.pairwise(tp1)]
    spread = statistics.median(steps) if steps else 0.0
    stream_ratio = ranks["stream"] / ranks["stream_one_process"]
    want = TP2_FACTOR * stream_ratio
    n = len(rounds)

    def ok(met):
        if not met:
            return "MISSED"
        return "met" if n >= INTERLEAVED_ROUNDS else f"not judged ({n} rounds)"

    lines = [
        f"target {ok(ratio >= want or ratio >= want * (1 - spread))}: {MOE} TP=2 decode b1 "
        f"{ratio:.3f}x TP=1 (median of {n} interleaved rounds; >= {TP2_FACTOR} x the stream "
        f"ratio {ranks['stream']:.1f} / {ranks['stream_one_process']:.1f} GB/s = {want:.3f}; "
        f"TP=1 round-to-round spread {spread:.1%})",
        f"target {ok(share <= COLLECTIVE_SHARE)}: {MOE} TP=2 collectives {share:.1%} of the "
        f"decode step (median of {n} rounds; <= {COLLECTIVE_SHARE:.0%})",
    ]
    return {"ratio": ratio, "collective_share": share, "stream_ratio": stream_ratio,
            "tp1_spread": spread, "lines": lines}  # fmt: skip


# the shared-memory all-reduce's targets (µs, between 2 ranks on one host)
LATENCY_TARGETS = {"all_reduce [1, 2048] fp32": 40.0, "all_reduce [32, 2048] fp32": 100.0}


def _latency_targets(shm):
    """Lines saying whether the shared-memory collectives met their targets."""
    if not shm:
        return ["no shared-memory figures: the ranks did not share this host (gloo only)"]
    return [f"target {'met' if shm[k] <= v else 'MISSED'}: shm {k} {shm[k]:.1f} us (<= {v:.0f})"
            for k, v in LATENCY_TARGETS.items()]  # fmt: skip


COLUMNS = ["model", "mode", "batch", "decode_tok_s", "runs_tok_s", "x_tp1", "of_bound", "step_ms",
           "collective_share", "collectives_per_step", "collective_us", "broadcast_share",
           "weights_rank0_GB", "weights_of_tp1", "rss_anon_GB", "load_s", "load_1m",
           "stream_GBps", "threads"]  # fmt: skip


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if "--child" in argv:
        return _child(argv)
    bench = harness.start(
        "bench_tp",
        argv,
        description=__doc__.splitlines()[0],
        quick_help=f"the MoE only (unless --dense-only), 1 round, {NEW // 2} new tokens",
        timer_options=False,
        flags=[
            ("--moe-only", "only the Qwen3-30B-A3B-shaped 4-layer MoE"),
            ("--dense-only", "only the Llama-shaped dense model"),
            ("--tp1-only", "only TP=1 (an engine without tensor_parallel_size)"),
            ("--delete-models", "delete the checkpoints written at the end"),
        ],
    )
    a = bench.args
    rounds, new = (1, NEW // 2) if bench.quick else (ROUNDS, NEW)
    labels = [m for m in MODELS if not (a.dense_only and m != "llama-2048h-16L")]
    moe_only = a.moe_only or (bench.quick and not a.dense_only)
    labels = [m for m in labels if not (moe_only and m != "qwen3moe-30b-a3b-4L")]
    paths = []
    try:
        rows = []
        for label in labels:
            cfg = MODELS[label]
            paths.append(cached_checkpoint(label, cfg))
            modes = ["TP=1"] if a.tp1_only else ["TP=1", "TP=2"]
            if "num_experts" in cfg and not a.tp1_only:
                modes.append("EP=2")
            for mode in modes:
                rows += run_child("measure", label, paths[-1], mode, rounds=rounds, new=new)
        ranks = {} if a.tp1_only else run_child("ranks", labels[0])
        latency = ranks.get("latency", {})
        inter = []
        if MOE in labels and not a.tp1_only:
            n = 3 if bench.quick else INTERLEAVED_ROUNDS
            path = paths[labels.index(MOE)]
            inter = run_child("interleaved", MOE, path, rounds=n, new=new)
    finally:
        if a.delete_models:
            for p in paths:
                shutil.rmtree(p, ignore_errors=True)
    streams = [bench.stream_before, bench.end_stream(), *([ranks["stream"]] if ranks else [])]
    top = check_bounds(rows, streams)
    _ratios(rows)
    notes = _targets(rows, "qwen3moe-30b-a3b-4L")
    notes += [f"{t} {k}: {v:.1f} us (median of {LATENCY_CALLS}, slower rank)"
              for t, cases in latency.items() for k, v in cases.items()]  # fmt: skip
    notes += _latency_targets(latency.get("shm", {}))
    summary = _interleaved_targets(inter, ranks) if inter else {}
    notes += summary.pop("lines", [])
    notes.append(
        f"each (model, mode) in its own process, one after another; per batch the best of "
        f"{rounds} runs of a {PROMPT}-token prompt and {new} greedy tokens; of_bound: the "
        f"rate over batch x the run's highest stream pass / the bf16 bytes a token reads "
        f"(module docstring); "
        f"collective_share: rank 0's all_reduce + all_gather time over the decode time "
        f"(collective_us: per call); broadcast_share: rank 0's step broadcasts' time; "
        f"weights_rank0_GB: the tensors rank 0's model holds; rss_anon_GB: each rank's "
        f"anonymous resident memory after the load; load_1m: the 1-minute load average"
    )
    extra = {"gloo_latency_us": latency.get("gloo"), "shm_latency_us": latency.get("shm"),
             "checkpoints": paths, "bound_stream_GBps": top,
             "stream_2x1_GBps": ranks.get("stream"),
             "stream_one_process_GBps": ranks.get("stream_one_process"),
             "interleaved": {"rounds": inter, **summary},
             "token_bytes": {m: token_bytes(MODELS[m]) for m in labels}}  # fmt: skip
    bench.finish(rows, columns=COLUMNS, notes=notes, extra=extra)


if __name__ == "__main__":
    main()
