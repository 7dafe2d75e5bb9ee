"""Run numkern's benchmark suites and write one Markdown report.

    python -m bench                        # every suite (an hour or more on 2 cores)
    python -m bench --quick                # each suite's smoke run
    python -m bench --quick --only gemm,moe --out /tmp/bench-report

First the machine's facts are gathered in a child process (``harness.machine``: CPU model
and features, cores, L3, package versions, the stream bandwidth and the compute peaks),
then each suite runs as ``python bench/bench_<suite>.py [--quick]`` in a process of its
own, one after another, its results in ``OUT/results/<suite>/`` (``harness`` writes
there when ``NUMKERN_BENCH_RESULTS`` names a folder) and its output in
``OUT/logs/<suite>.log`` as well as on the terminal. A suite that fails is reported as
failed with its stderr's tail; the others still run, and the exit status is 1. Last,
``bench/report.py`` writes ``OUT/report.md`` and its figures from the suites' JSON.
"""

import argparse
import collections
import json
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from bench import report

BENCH_DIR = Path(__file__).resolve().parent
ROOT = BENCH_DIR.parent
# harness.RESULTS_ENV (not imported: harness loads torch and Numba, this process need not)
RESULTS_ENV = "NUMKERN_BENCH_RESULTS"
DEFAULT_OUT = BENCH_DIR / "results" / "report"


@dataclass(frozen=True)
class Suite:
    name: str
    kind: str  # "kernel" or "engine"
    script: str  # a file of bench/ (or an absolute path)
    about: str
    args: tuple = ()
    has_quick: bool = True  # False: its run ignores --quick (skipped by a quick run)


SUITES = (
    Suite("gemm", "kernel", "bench_gemm.py", "packed bf16 linear vs torch and vLLM"),
    Suite("moe", "kernel", "bench_moe.py", "fused MoE vs a torch loop and vLLM"),
    Suite("attention", "kernel", "bench_attention.py", "paged attention vs SDPA and vLLM"),
    Suite("gdn", "kernel", "bench_gdn.py", "Gated DeltaNet ops vs torch and vLLM"),
    Suite("torch_ops", "kernel", "bench_torch_ops.py", "torch.ops.numkern dispatch cost"),
    Suite("e2e", "engine", "bench_e2e.py", "engine tokens/s vs HF transformers"),
    Suite(
        "e2e_gdn",
        "engine",
        "bench_e2e.py",
        "the Qwen3.5-shaped hybrid vs HF (~10 min)",
        args=("--gdn-only",),
        has_quick=False,
    ),
    Suite("start", "engine", "bench_start.py", "warm start: first token and peak RSS"),
    Suite("serve", "engine", "bench_serve.py", "the OpenAI server vs LLM.generate, 1/4/16 clients"),
    Suite("detokenize", "engine", "bench_detokenize.py", "streamed text: a step, 1st vs last"),
    Suite(
        "quant_models",
        "engine",
        "bench_quant_models.py",
        "Q4_K_M Llama 2048h 16L and Qwen3-30B-A3B-shaped 4L MoE: decode share of the "
        "quantised-bytes bound, prefill vs bf16 (~15 min; ~3 GB of files in /tmp)",
    ),
    Suite(
        "tp",
        "engine",
        "bench_tp.py",
        "decode at TP=1 / TP=2 / EP=2 on a Qwen3-30B-A3B-shaped 4L MoE and a 2048h Llama: "
        "all-reduce share, per-rank weights, gloo latency (~25 min; ~9 GB of files in /tmp)",
    ),
)

# Run in a child: the machine's facts (harness.machine) into the JSON file argv[1].
MACHINE_CODE = """
import json, sys
sys.path.insert(0, sys.argv[2])
import harness
facts = harness.machine(measure=True)
with open(sys.argv[1], "w") as f:
    json.dump(facts, f, indent=1)
"""


def _tee(stream, sinks, tail=None):
    for line in stream:
        for sink in sinks:
            sink.write(line)
            sink.flush()
        if tail is not None:
            tail.append(line)


def run_child(cmd, log, env=None):
    """Run ``cmd`` from the repository root, its stdout and stderr both shown and written
    to ``log``; returns ``(returncode, wall seconds, the last lines of stderr)``."""
    tail = collections.deque(maxlen=report.STDERR_TAIL_LINES)
    log.parent.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    with open(log, "w") as f:
        f.write("$ " + " ".join(cmd) + "\n")
        f.flush()
        with subprocess.Popen(
            cmd,
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            errors="replace",
            bufsize=1,
        ) as proc:
            threads = [
                threading.Thread(target=_tee, args=(proc.stdout, [sys.stdout, f])),
                threading.Thread(target=_tee, args=(proc.stderr, [sys.stderr, f], tail)),
            ]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            code = proc.wait()
    return code, time.perf_counter() - start, "".join(tail)


def _exit_reason(code):
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit status {code}"


def run_suite(suite, out, *, quick):
    """Run one suite in a child process; returns its :class:`report.SuiteRun`."""
    results = Path(out) / "results" / suite.name
    if results.exists():  # this folder is the runner's own: results of an earlier run
        for old in results.iterdir():
            if old.is_file():
                old.unlink()
    results.mkdir(parents=True, exist_ok=True)
    script = Path(suite.script)
    script = script if script.is_absolute() else BENCH_DIR / script
    cmd = [sys.executable, str(script), *suite.args, *(["--quick"] if quick else [])]
    where = script.relative_to(ROOT) if script.is_relative_to(ROOT) else script
    shown = " ".join(["python", str(where), *cmd[2:]])
    env = os.environ | {RESULTS_ENV: str(results.resolve()), "PYTHONUNBUFFERED": "1"}
    log = Path(out) / "logs" / f"{suite.name}.log"
    print(f"=== {suite.name}: {shown}", flush=True)
    code, wall, tail = run_child(cmd, log, env)
    run = report.SuiteRun(
        suite.name,
        suite.kind,
        shown,
        "ok",
        returncode=code,
        wall_s=wall,
        stderr_tail=tail,
        log=log,
    )
    run.results = sorted(results.glob("*.json"), key=lambda p: p.stat().st_mtime)
    if code != 0:
        run.status, run.reason = "failed", _exit_reason(code)
    elif not run.results:
        run.status, run.reason = "failed", f"wrote no results in {results}"
    else:
        try:
            for path in run.results:
                report.load_result(path)
        except ValueError as e:
            run.status, run.reason = "failed", str(e)
    said = f"{run.status}: {run.reason}" if run.reason else run.status
    print(f"=== {suite.name}: {said} ({wall:.0f} s)", flush=True)
    return run


def measure_machine(out):
    """The machine's facts from a child process (``harness.machine``), or None (and the
    reason) when it failed."""
    path = Path(out) / "machine.json"
    cmd = [sys.executable, "-c", MACHINE_CODE, str(path), str(BENCH_DIR)]
    print("=== machine: CPU, versions, stream bandwidth, compute peaks", flush=True)
    code, _, tail = run_child(cmd, Path(out) / "logs" / "machine.log")
    if code != 0:
        last = tail.strip().splitlines()[-1:]
        return None, ": ".join([_exit_reason(code), *last])
    facts = json.loads(path.read_text())
    peaks = ", ".join(f"{k} {v:.0f}" for k, v in facts["peak_GFLOPs"].items())
    print(
        f"=== machine: {facts['cpu_model']}, {facts['cores']} cores; stream "
        f"{facts['stream_GBps']:.1f} GB/s; torch.mm GFLOP/s: {peaks}",
        flush=True,
    )
    return facts, ""


def _parse(argv):
    names = [s.name for s in SUITES]
    parser = argparse.ArgumentParser(
        prog="python -m bench",
        description="Run numkern's benchmark suites (each in a process of its own, one after "
        "another) and write one Markdown report with tables and figures.",
        epilog="suites: " + "; ".join(f"{s.name} ({s.kind}): {s.about}" for s in SUITES),
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="each suite's smoke run (suites without one are skipped unless named in --only)",
    )
    parser.add_argument(
        "--only",
        default=None,
        metavar="NAMES",
        help=f"comma-separated suites to run, of: {','.join(names)}",
    )
    parser.add_argument(
        "--tables",
        action="store_true",
        help="run nothing: regenerate the docs' speed tables from the results (bench/tables.py)",
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=DEFAULT_OUT,
        metavar="DIR",
        help="folder of the report, its figures, results and logs (default: bench/results/report/)",
    )
    args = parser.parse_args(argv)
    args.chosen = list(names)
    if args.only is not None:
        args.chosen = [n.strip() for n in args.only.split(",") if n.strip()]
        unknown = [n for n in args.chosen if n not in names]
        if unknown or not args.chosen:
            parser.error(f"--only: expected names of {names}, got {args.only!r}")
    return args


def main(argv=None):
    args = _parse(argv)
    if args.tables:
        from bench import tables

        return tables.main([])
    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    machine, machine_error = measure_machine(out)
    runs = []
    for suite in SUITES:
        if suite.name not in args.chosen:
            continue
        if args.quick and not suite.has_quick and args.only is None:
            runs.append(
                report.SuiteRun(
                    suite.name,
                    suite.kind,
                    "",
                    "skipped",
                    reason="no quick mode: run without --quick, or name it in --only",
                )
            )
            continue
        runs.append(run_suite(suite, out, quick=args.quick and suite.has_quick))
    command = "python -m bench" + (" " + " ".join(argv if argv is not None else sys.argv[1:]))
    path = report.write_report(
        out,
        machine,
        runs,
        command=command.strip(),
        wall_s=time.perf_counter() - started,
        machine_error=machine_error,
    )
    failed = [r.name for r in runs if r.status == "failed"]
    if machine is None:
        failed.append(f"machine ({machine_error})")
    print(f"report: {path}" + (f"; FAILED: {', '.join(failed)}" if failed else ""), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
