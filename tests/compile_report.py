"""The compile report CI prints: where a test run's compile time goes.

Every process of the run (xdist workers, the masked fallback run, child processes and TP
ranks) logs its Numba compilations through :mod:`numkern._compile_log` into one
directory; the controller reads it at the end and prints, per process, the compile
CPU-seconds per (function, signature, feature set); the functions compiled more than
once in the run (in several processes, or twice in one); and per test file its wall time
and the compile time spent inside it (wall minus compile is about the file's warm time).
"""

import collections
import glob
import json
import os

from numkern import _compile_log

TOP = 25  # rows of the heaviest (function, signature, features)


def read(directory):
    """``[(pid, line), ...]`` of every compile line in ``directory``."""
    rows = []
    for path in sorted(glob.glob(os.path.join(directory, "*.jsonl"))):
        pid = os.path.basename(path).split(".")[0]
        with open(path, encoding="utf-8") as f:
            for text in f:
                try:
                    rows.append((pid, json.loads(text)))
                except json.JSONDecodeError:  # a process killed mid-line
                    continue
    return rows


_KEY_FEATURES = ("avx512f", "avx512bf16", "amx-tile", "avx2", "avx")


def _features(f):
    """``host``, or the key features a mask removed (``-avx512f-amx-tile``)."""
    if f == "host":
        return f
    off = {x[1:] for x in f.split(",") if x.startswith("-")}
    return "".join(f"-{k}" for k in _KEY_FEATURES if k in off) or "masked"


def _file(tag):
    return tag.split("::")[0] if tag else "(outside a test)"


def lines(directory, file_wall):
    """The report's lines. ``file_wall``: ``{test file: seconds}`` of the main run."""
    rows = read(directory)
    out = []
    if not rows:
        return [f"no compilation logged in {directory}"]
    procs = collections.defaultdict(lambda: [0.0, 0.0, 0, collections.Counter()])
    for pid, r in rows:
        p = procs[pid]
        p[0] += r["cpu_s"]
        p[1] += r["wall_s"]
        p[2] += 1
        p[3][_file(r["tag"])] += r["cpu_s"]
    total_cpu = sum(p[0] for p in procs.values())
    out.append(
        f"{len(rows)} compilations in {len(procs)} processes, {total_cpu:.0f} CPU-s "
        f"(exclusive of callees; functions loaded from the disk cache are not compilations)"
    )
    out.append("-- processes by compile CPU-s (pid: CPU-s, compilations, busiest test file)")
    for pid, (cpu, _, n, files) in sorted(procs.items(), key=lambda kv: -kv[1][0])[:20]:
        top_file, _ = files.most_common(1)[0]
        out.append(f"  {pid:>8}: {cpu:7.1f} s  {n:5d}  {top_file}")
    if len(procs) > 20:
        rest = sorted(procs.values(), key=lambda p: -p[0])[20:]
        out.append(f"  {len(rest)} more processes: {sum(p[0] for p in rest):.1f} s")

    per_key = collections.defaultdict(lambda: [0.0, 0, set()])
    for pid, r in rows:
        k = (r["fn"], r["sig"], _features(r["features"]))
        per_key[k][0] += r["cpu_s"]
        per_key[k][1] += 1
        per_key[k][2].add(pid)
    out.append(f"-- top {TOP} (function, signature, features) by compile CPU-s (times compiled)")
    for (fn, sig, feats), (cpu, n, _) in sorted(per_key.items(), key=lambda kv: -kv[1][0])[:TOP]:
        out.append(f"  {cpu:7.1f} s x{n:<3d} {feats:<14} {fn} {sig[:140]}")

    per_fn = collections.defaultdict(lambda: [0.0, set()])
    for (fn, sig, feats), (cpu, _, _) in per_key.items():
        per_fn[fn][0] += cpu
        per_fn[fn][1].add((sig, feats))
    out.append("-- functions by compile CPU-s over all signatures (signatures x features)")
    for fn, (cpu, sigs) in sorted(per_fn.items(), key=lambda kv: -kv[1][0])[:TOP]:
        out.append(f"  {cpu:7.1f} s  {len(sigs):3d}  {fn}")

    dups = [(k, v) for k, v in per_key.items() if v[1] > 1]
    dup_cpu = sum(v[0] * (v[1] - 1) / v[1] for _, v in dups)
    out.append(
        f"-- compiled more than once in this run: {len(dups)} (function, signature, "
        f"features), {dup_cpu:.0f} CPU-s beyond the first compilation of each"
    )
    for (fn, sig, feats), (cpu, n, pids) in sorted(dups, key=lambda kv: -kv[1][0])[:TOP]:
        out.append(f"  {cpu:7.1f} s x{n:<3d} in {len(pids)} processes {feats:<14} {fn} {sig[:100]}")

    compile_wall = collections.Counter()
    for _, r in rows:
        compile_wall[_file(r["tag"])] += r["wall_s"]
    fallback = {f: c for f, c in compile_wall.items() if f.startswith("[fallback run]")}
    out.append(
        f"-- the fallback run (a process of its own beside this run): {len(fallback)} test "
        f"files compiled {sum(fallback.values()):.0f} s"
    )
    for f, c in sorted(fallback.items(), key=lambda kv: -kv[1])[:10]:
        out.append(f"  {c:7.1f}  {f}")
    out.append("-- test files by wall time (s): wall, compile inside it, wall - compile")
    for f, wall in sorted(file_wall.items(), key=lambda kv: -kv[1]):
        c = compile_wall.get(f, 0.0)
        out.append(f"  {wall:7.1f} {c:7.1f} {max(wall - c, 0.0):7.1f}  {f}")
    return out


ENV = _compile_log.ENV
TAG_ENV = _compile_log.TAG_ENV
