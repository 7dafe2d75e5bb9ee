"""The engine's start: how soon ``python -m engine generate`` shows its first token.

    python bench/bench_start.py           # 5 fresh processes, compile cache warm
    python bench/bench_start.py --quick   # 3
    python bench/bench_start.py --cold    # also one first run on an empty compile cache

Each run is a fresh process of the README's main command on the default model
(SmolLM2-135M-Instruct, GGUF), greedy, 8 new tokens. Per run: the seconds from ``import
torch`` returning (stamped by the child) to the first generated token's arrival on its
stdout (the CLI writes and flushes each token), the seconds to the end of the process,
and the child's peak resident memory (``wait4``'s ``ru_maxrss``). The first run warms
the compile cache and the page cache and is not counted; the median of the others is the
figure (target: the first token at most 1.5 s after ``import torch``, under 1.5 GB).
``--cold`` adds a first run on an empty ``NUMBA_CACHE_DIR``: every kernel of the model
compiled, as on a fresh machine (target: within 60 s).
"""

import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time

import harness

PROMPT = "The capital of France is"
MAX_TOKENS = 8
# the child: stamp the wall clock once torch is imported, then run the CLI as `python -m
# engine generate ...` would
CHILD = """
import sys, time
import torch
sys.stderr.write(f"@torch {time.time():.6f}\\n")
sys.stderr.flush()
import runpy
sys.argv = ["engine", *sys.argv[1:]]
runpy.run_module("engine", run_name="__main__", alter_sys=True)
"""
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def cpu_model():
    """The CPU's model name and how many CPUs this process has."""
    return f"{harness.cpu_model()}, {len(os.sched_getaffinity(0))} CPUs"


def one_run(env=None):
    """One fresh process: {first_token_s, total_s, peak_rss_MB, text}."""
    cmd = [sys.executable, "-c", CHILD, "generate", PROMPT, "--max-tokens", str(MAX_TOKENS)]
    t_start = time.time()
    p = subprocess.Popen(
        cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, bufsize=0, env=env
    )
    err = []
    reader = threading.Thread(target=lambda: err.append(p.stderr.read()), daemon=True)
    reader.start()
    first = p.stdout.read(1)  # blocks until the first token's text is flushed
    t_first = time.time()
    rest = p.stdout.read()
    _, status, usage = os.wait4(p.pid, 0)
    p.returncode = os.waitstatus_to_exitcode(status)
    t_end = time.time()
    reader.join()
    stderr = err[0].decode(errors="replace") if err else ""
    if p.returncode != 0 or not first:
        raise RuntimeError(f"the run failed (exit {p.returncode}):\n{stderr[-2000:]}")
    stamp = next(line for line in stderr.splitlines() if line.startswith("@torch "))
    t_torch = float(stamp.split()[1])
    text = (first + rest).decode(errors="replace")
    return {
        "first_token_s": t_first - t_torch,
        "total_s": t_end - t_start,
        "peak_rss_MB": usage.ru_maxrss / 1024,  # KB on Linux
        "last_line": text.strip().splitlines()[-1],
    }


def main():
    bench = harness.start(
        "bench_start",
        description=__doc__.split("\n")[0],
        quick_help="3 runs instead of 5",
        timer_options=False,
        stream=False,
        flags=[("--cold", "also one first run on an empty compile cache")],
    )
    runs = 3 if bench.quick else 5
    rows = []
    if bench.args.cold:
        with tempfile.TemporaryDirectory() as cache:
            r = one_run(env={**os.environ, "NUMBA_CACHE_DIR": cache})
        rows.append({"run": "cold", **r})
        print(f"cold: {r['total_s']:.1f} s to the end; {r['last_line']}", flush=True)
    one_run()  # warms the compile cache (and the page cache): not counted
    for i in range(runs):
        r = one_run()
        rows.append({"run": i, **r})
        first, rss = r["first_token_s"], r["peak_rss_MB"]
        print(f"run {i}: first token {first:.2f} s after import torch, peak RSS {rss:.0f} MB")
    warm = [r for r in rows if r["run"] != "cold"]
    median = statistics.median(r["first_token_s"] for r in warm)
    peak = max(r["peak_rss_MB"] for r in warm)
    bench.finish(
        rows,
        columns=["run", "first_token_s", "total_s", "peak_rss_MB"],
        extra={
            "cpu_model": cpu_model(),
            "first_token_median_s": median,
            "peak_rss_max_MB": peak,
        },
        notes=[
            f"median first token {median:.2f} s after import torch over {runs} fresh "
            f"processes (target <= 1.5 s); peak RSS {peak:.0f} MB (target < 1500 MB)"
        ],
        stream_after=False,
    )


if __name__ == "__main__":
    main()
