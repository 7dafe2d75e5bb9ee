"""The server against the engine offline: ``python -m engine serve`` under 1, 4 and 16
concurrent clients, and ``LLM.generate`` of the same prompts in the same run.

    python bench/bench_serve.py           # 64 new tokens a request, 2 rounds of clients
    python bench/bench_serve.py --quick   # 16 new tokens, 1 round

On the default model (SmolLM2-135M-Instruct, GGUF, bf16; ``--model`` for another), greedy
with EOS ignored, so every request makes its tokens. First offline, in this process:
``LLM.generate`` of each level's prompts, ``clients`` at a time as the clients send them
(output tokens/s), and the first token of one prompt alone (``generate_stream``). Then
the server in a subprocess (the same engine options, ``--max-num-seqs 16``) and one async
load process (this one, httpx): at each level ``clients`` streamed completions at a time,
each client sending its next request when one ends, ``rounds x clients`` in all. Per
level: requests/s, output tokens/s and their ratio to offline, time to first token
(request sent to first chunk) p50/p99, and this process's CPU seconds during the load
(what the load generator itself cost; on 2 cores it competes with the server).
Targets: output tokens/s at 16 clients >= 0.8x offline; the TTFT p50 at 1 client
within 20 ms of the offline first token.
"""

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import time

import harness
import httpx

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LEVELS = (1, 4, 16)
PROMPTS = [
    "The capital of France is",
    "Write a short poem about the sea.",
    "Explain how a transistor works in two sentences.",
    "List three uses of copper.",
    "What is the boiling point of water at sea level?",
    "Translate 'good morning' into Spanish.",
    "Give a one-line summary of the water cycle.",
    "Why is the sky blue?",
]
START_TIMEOUT = 600  # s: a cold compile cache compiles the model's kernels first


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _prompts(n, level):
    return [f"{PROMPTS[(level + i) % len(PROMPTS)]} ({i})" for i in range(n)]


def offline(model, engine_args, max_tokens, levels, rounds):
    """{level: output tok/s of LLM.generate of that level's prompts} and the seconds to
    the first token of one prompt alone (median of 5)."""
    from engine import LLM, SamplingParams

    llm = LLM(model, progress=False, **engine_args)
    llm.warmup(progress=False)
    sp = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    rates = {}
    for level in levels:
        prompts = _prompts(level * rounds, level)
        llm.generate(prompts[:level], sp)  # warm
        t0 = time.perf_counter()
        n = 0
        for r in range(rounds):  # as the clients: level requests at a time
            n += sum(len(o.token_ids) for o in llm.generate(prompts[r::rounds], sp))
        rates[level] = n / (time.perf_counter() - t0)
    firsts = []
    for _ in range(5):
        t0 = time.perf_counter()
        stream = llm.generate_stream([PROMPTS[0]], sp)
        next(stream)
        firsts.append(time.perf_counter() - t0)
        stream.close()
    llm.close()
    return rates, statistics.median(firsts)


async def _client(http, url, prompts, max_tokens, stats):
    for prompt in prompts:
        body = {
            "model": "bench",
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        t0 = time.perf_counter()
        first = None
        async with http.stream("POST", f"{url}/v1/completions", json=body) as r:
            r.raise_for_status()
            async for line in r.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("usage"):
                    stats["tokens"] += chunk["usage"]["completion_tokens"]
                elif first is None:
                    first = time.perf_counter()
        stats["ttft"].append(first - t0)
        stats["requests"] += 1


async def load(url, level, rounds, max_tokens):
    """``level`` clients, ``rounds`` requests each: wall seconds and the stats."""
    stats = {"ttft": [], "tokens": 0, "requests": 0}
    limits = httpx.Limits(max_connections=level + 1)
    async with httpx.AsyncClient(timeout=600, limits=limits) as http:
        prompts = _prompts(level * rounds, level)
        warm = {"ttft": [], "tokens": 0, "requests": 0}
        await _client(http, url, prompts[:1], max_tokens, warm)
        t0 = time.perf_counter()
        await asyncio.gather(
            *(_client(http, url, prompts[c::level], max_tokens, stats) for c in range(level))
        )
        return time.perf_counter() - t0, stats


def _pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(q * (len(xs) - 1)))]


def main():
    extra = argparse.ArgumentParser(add_help=False)
    extra.add_argument("--model", default=None)
    extra.add_argument("--dtype", default="bfloat16")
    more, rest = extra.parse_known_args()
    bench = harness.start(
        "bench_serve",
        rest,
        description=__doc__.split("\n")[0] + " (--model PATH, --dtype D: the engine's)",
        quick_help="16 new tokens a request and 1 round of clients",
        timer_options=False,
        stream=False,
    )
    sys.path.insert(0, ROOT)
    from engine.__main__ import default_model

    model = more.model or default_model()
    max_tokens, rounds = (16, 1) if bench.quick else (64, 2)
    engine_args = dict(dtype=more.dtype, max_num_seqs=max(LEVELS), max_model_len=512)
    rates, first_offline = offline(model, engine_args, max_tokens, LEVELS, rounds)
    print(
        f"offline: {', '.join(f'{k}: {v:.1f} tok/s' for k, v in rates.items())}; first "
        f"token {first_offline * 1e3:.1f} ms",
        flush=True,
    )
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [
        sys.executable,
        "-m",
        "engine",
        "serve",
        model,
        "--served-model-name",
        "bench",
        "--port",
        str(port),
        "--dtype",
        more.dtype,
        "--max-num-seqs",
        str(max(LEVELS)),
        "--max-model-len",
        "512",
    ]
    server = subprocess.Popen(cmd, cwd=ROOT, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL)
    rows = []
    try:
        deadline = time.monotonic() + START_TIMEOUT
        while True:
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if server.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the server did not start: {server.stderr.read()[-2000:]}")
            time.sleep(0.2)
        for level in LEVELS:
            cpu0 = time.process_time()
            wall, st = asyncio.run(load(url, level, rounds, max_tokens))
            cpu = time.process_time() - cpu0
            row = {
                "clients": level,
                "requests": st["requests"],
                "req_per_s": st["requests"] / wall,
                "out_tok_per_s": st["tokens"] / wall,
                "offline_tok_per_s": rates[level],
                "x_offline": st["tokens"] / wall / rates[level],
                "ttft_p50_ms": 1e3 * statistics.median(st["ttft"]),
                "ttft_p99_ms": 1e3 * _pct(st["ttft"], 0.99),
                "offline_first_token_ms": 1e3 * first_offline,
                "load_cpu_s": cpu,
                "load_cpu_share": cpu / wall,
            }
            rows.append(row)
            print(
                f"{level} clients: {row['out_tok_per_s']:.1f} tok/s "
                f"({row['x_offline']:.2f}x offline), TTFT p50 {row['ttft_p50_ms']:.1f} ms",
                flush=True,
            )
    finally:
        server.terminate()
        server.wait(60)
    by = {r["clients"]: r for r in rows}
    bench.finish(
        rows,
        extra={
            "model": os.path.basename(model),
            "dtype": more.dtype,
            "max_tokens": max_tokens,
            "rounds": rounds,
        },
        notes=[
            f"16 clients: {by[16]['x_offline']:.2f}x offline output tokens/s (target >= 0.8)",
            f"1 client: TTFT p50 {by[1]['ttft_p50_ms']:.1f} ms against the offline first "
            f"token {1e3 * first_offline:.1f} ms (target: within 20 ms)",
        ],
        stream_after=False,
    )


if __name__ == "__main__":
    main()
