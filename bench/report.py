"""The Markdown report of ``python -m bench``, built from the suites' JSON results.

:func:`write_report` reads what the suites wrote through ``harness.write_results``
(``{"name", "environment", "notes", "columns", "rows"}`` per result) and the machine's
facts (``harness.machine``) and writes ``report.md`` with its figures under ``figures/``:

* the header: CPU model and features (as ``numkern.cpu_features()`` reports them), cores,
  L3, the stream bandwidth and compute peaks measured in the run, package versions;
* a summary line per suite (ok, failed with its exit status and stderr tail, skipped);
* per result: its facts, its table (the suite's own columns), its notes and three figures
  where its rows allow: throughput against size (kernel rows carrying ``harness.roofline``
  fields; the engine's tokens/s against batch or context), numkern against its peers (the
  ``x_*`` ratio columns) and a roofline (GFLOP/s against FLOP per byte under the stream
  bandwidth and the compute peaks), with a table of each point's share of its roof;
* a roofline of every kernel row of the run, under the bandwidth the runner measured.

Nothing here imports torch or Numba: a report can be rebuilt from recorded results.
"""

import json
import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

# Lines of a failed suite's stderr the report quotes.
STDERR_TAIL_LINES = 40
# Per-case timing detail every kernel row carries (in the CSV): left out of the tables
# of results that do not name their columns.
_DETAIL = re.compile(r"_(min_ms|samples|calls_per_sample)$|^roof_")
# The engine's throughput columns: decode tokens/s at batch N, and per context.
_BATCH_COLUMN = re.compile(r"^decode_b(\d+)_tok_s$")
_CONTEXT_COLUMN = re.compile(r"_decode_tok_s$")
# The row label's columns, in order, for results without a "case" column.
_LABEL_COLUMNS = ("model", "system", "path", "T", "run")


@dataclass
class SuiteRun:
    """One suite of a run, as the report tells it.

    ``status``: "ok", "failed" or "skipped"; ``reason``: why (failed or skipped), one
    line; ``results``: the JSON files it wrote, in the order written; ``stderr_tail``: the
    end of its stderr (quoted when it failed); ``log``: its stdout and stderr in full."""

    name: str
    kind: str  # "kernel" or "engine"
    command: str
    status: str
    returncode: int | None = None
    wall_s: float | None = None
    reason: str = ""
    results: list = field(default_factory=list)
    stderr_tail: str = ""
    log: Path | None = None


def load_result(path):
    """A result written by ``harness.write_results``; ValueError naming the file when it
    is not one."""
    try:
        doc = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"{path}: expected a benchmark result (JSON), got {e}") from e
    if not (isinstance(doc, dict) and isinstance(doc.get("rows"), list)):
        raise ValueError(f"{path}: expected a JSON object with a 'rows' list")
    for key, default in (("name", Path(path).stem), ("environment", {}), ("notes", [])):
        doc.setdefault(key, default)
    return doc


# ---------------------------------------------------------------------------------------
# Markdown


def _cell(value):
    """One table cell: numbers to 4 significant digits (integers in full from 1000 up)."""
    if value is None:
        return ""
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        if math.isnan(value) or math.isinf(value):
            return str(value)
        if abs(value) >= 1000 or value == 0:
            return f"{value:.0f}"
        return f"{value:.4g}"
    if isinstance(value, (list, dict)):
        value = json.dumps(value)
    return str(value).replace("|", "\\|").replace("\n", " ")


def _table(rows, columns):
    out = ["| " + " | ".join(_cell(c) for c in columns) + " |"]
    out.append("|" + "|".join("---" for _ in columns) + "|")
    out += ["| " + " | ".join(_cell(row.get(c)) for c in columns) + " |" for row in rows]
    return out


def _columns(doc):
    """The suite's own table columns, or every column but the per-case timing detail."""
    rows = doc["rows"]
    if doc.get("columns"):
        columns = doc["columns"]
    else:
        columns = [
            k for k in dict.fromkeys(k for row in rows for k in row) if not _DETAIL.search(k)
        ]
    return [c for c in columns if any(row.get(c) not in (None, "") for row in rows)]


def _label(row):
    if "case" in row:
        return str(row["case"])
    return " / ".join(str(row[k]) for k in _LABEL_COLUMNS if k in row) or "?"


def _number(value):
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _gb(nbytes):
    return f"{nbytes / (1 << 20):.0f} MiB" if nbytes is not None else "unknown"


# ---------------------------------------------------------------------------------------
# the facts the figures need


def cpu_label(machine, environment=None):
    """The CPU as figures name it: model and LLVM's name for it (``AMD EPYC (znver4)``)."""
    describe = (machine or {}).get("cpu") or (environment or {}).get("cpu") or ""
    llvm = re.match(r"cpu=(\S+)", describe)
    model = (machine or {}).get("cpu_model") or (environment or {}).get("cpu_model")
    if model and llvm:
        return f"{model} ({llvm.group(1)})"
    return model or (llvm.group(1) if llvm else "unknown CPU")


def stream_of(environment, machine):
    """``(GB/s, where measured)``: the largest stream figure a result measured (load only
    slows a stream pass), else the runner's; ``(None, "")`` when neither has one."""
    keys = ("stream_GBps", "stream_GBps_before", "stream_GBps_after", "stream_GBps_max")
    found = [environment[k] for k in keys if _number(environment.get(k))]
    if found:
        return max(found), "measured by this suite"
    if machine and _number(machine.get("stream_GBps")):
        return machine["stream_GBps"], "measured by the runner"
    return None, ""


def roof_points(rows):
    """The rows carrying ``harness.roofline`` fields, with GFLOP/s, GB/s and FLOP/byte."""
    points = []
    for row in rows:
        if not all(_number(row.get(k)) for k in ("roof_flop", "roof_bytes", "roof_s")):
            continue
        if row["roof_s"] <= 0 or row["roof_bytes"] <= 0 or row["roof_flop"] <= 0:
            continue
        points.append(
            {
                "kernel": str(row.get("roof_kernel", _label(row))),
                "size_name": str(row.get("roof_size_name", "size")),
                "size": row.get("roof_size"),
                "label": _label(row),
                "tag": f"{row.get('roof_kernel', '')} {row.get('roof_size_name', '')}="
                f"{row.get('roof_size')}".strip(),
                "GFLOPs": row["roof_flop"] / row["roof_s"] / 1e9,
                "GBps": row["roof_bytes"] / row["roof_s"] / 1e9,
                "intensity": row["roof_flop"] / row["roof_bytes"],
            }
        )
    return points


def attainable(intensity, bandwidth, peak):
    """The roof over one point: ``(GFLOP/s, bound)``, the lower of the bandwidth's line
    (``bandwidth`` GB/s x FLOP/byte) and the compute ``peak`` (either may be None)."""
    memory = bandwidth * intensity if bandwidth else None
    if peak is None or (memory is not None and memory < peak):
        return memory, "memory"
    return peak, "compute"


def _peaks(machine):
    peaks = (machine or {}).get("peak_GFLOPs") or {}
    return {k: v for k, v in peaks.items() if _number(v) and v > 0}


def engine_series(rows):
    """The engine's throughput lines: ``(label, x name, [(x, tokens/s)])`` from the
    ``decode_b<N>_tok_s`` columns (against batch) and, for rows with a ``context``, the
    ``*_decode_tok_s`` columns (against context, one line per model and column)."""
    series = []
    for row in rows:
        pts = [
            (int(m.group(1)), row[k])
            for k in row
            if (m := _BATCH_COLUMN.match(k)) and _number(row[k])
        ]
        if len(pts) > 1:
            series.append((_label(row), "batch", sorted(pts)))
    lines = {}
    for row in rows:
        if not _number(row.get("context")):
            continue
        for k in row:
            if _CONTEXT_COLUMN.search(k) and not _BATCH_COLUMN.match(k) and _number(row[k]):
                key = (str(row.get("model", "")), k.removesuffix("_decode_tok_s"))
                lines.setdefault(key, []).append((row["context"], row[k]))
    for (model, who), pts in lines.items():
        if len(pts) > 1:
            series.append((f"{model} {who}".strip(), "context", sorted(pts)))
    return series


def ratio_columns(rows):
    """The ``x_*`` columns (numkern's speedup over a peer) with a number in some row."""
    keys = dict.fromkeys(k for row in rows for k in row if k.startswith("x_"))
    return [k for k in keys if any(_number(row.get(k)) for row in rows)]


# ---------------------------------------------------------------------------------------
# figures (matplotlib's object API: no pyplot state, no backend to choose)


def _figure(n_axes=1):
    from matplotlib.figure import Figure

    fig = Figure(figsize=(10, 4.2 * n_axes), layout="constrained")
    return fig, [fig.add_subplot(n_axes, 1, i + 1) for i in range(n_axes)]


def _log(ax, axis, base=10):
    """A log scale whose ticks read as plain numbers (512, 0.5), not powers."""
    from matplotlib import ticker

    getattr(ax, f"set_{axis}scale")("log", base=base)
    fmt = ticker.FormatStrFormatter("%g")
    target = ax.xaxis if axis == "x" else ax.yaxis
    target.set_major_formatter(fmt)
    if base == 10:  # minor ticks labelled only where the axis spans about a decade
        target.set_minor_formatter(
            ticker.LogFormatter(labelOnlyBase=False, minor_thresholds=(1, 0.5))
        )


def _legend(ax):
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=7)


def _save(fig, path, title):
    fig.suptitle(title, fontsize=9)
    fig.savefig(path, dpi=100)
    return path


def plot_throughput(path, points, engine, *, stream, peaks, title):
    """Kernel GFLOP/s and GB/s against size (one line per kernel), or the engine's
    tokens/s against batch or context."""
    points = [p for p in points if _number(p["size"]) and p["size"] > 0]
    if points:
        fig, (ax_f, ax_b) = _figure(2)
        kernels = dict.fromkeys(p["kernel"] for p in points)
        for kernel in kernels:
            sel = sorted((p for p in points if p["kernel"] == kernel), key=lambda p: p["size"])
            xs = [p["size"] for p in sel]
            name = f"{kernel} ({sel[0]['size_name']})"
            ax_f.plot(xs, [p["GFLOPs"] for p in sel], marker="o", label=name)
            ax_b.plot(xs, [p["GBps"] for p in sel], marker="o", label=name)
        for dtype, peak in peaks.items():
            ax_f.axhline(peak, color="black", lw=0.8, ls="--", label=f"torch.mm {dtype} {peak:.0f}")
        if stream:
            ax_b.axhline(stream, color="black", lw=0.8, ls="--", label=f"stream {stream:.1f}")
        ax_f.set_ylabel("GFLOP/s")
        ax_b.set_ylabel("GB/s (compulsory bytes)")
        names = sorted({p["size_name"] for p in points})
        for ax in (ax_f, ax_b):
            _log(ax, "x", base=2)
            _log(ax, "y")
            ax.set_xlabel(" / ".join(names))
            ax.grid(alpha=0.3, which="both")
            _legend(ax)
    else:
        fig, (ax,) = _figure(1)
        for label, _, pts in engine:
            ax.plot([x for x, _ in pts], [y for _, y in pts], marker="o", label=label)
        _log(ax, "x", base=2)
        ax.set_xlabel(" / ".join(sorted({xname for _, xname, _ in engine})))
        ax.set_ylabel("tokens/s")
        ax.grid(alpha=0.3, which="both")
        _legend(ax)
    return _save(fig, path, title)


def plot_ratios(path, rows, columns, *, title):
    """Grouped bars of the ``x_*`` ratios per row (log scale; 1 = parity)."""
    sel = [r for r in rows if any(_number(r.get(c)) and r[c] > 0 for c in columns)]
    fig, (ax,) = _figure(1)
    width = 0.8 / len(columns)
    for i, col in enumerate(columns):
        xs, ys = [], []
        for j, row in enumerate(sel):
            if _number(row.get(col)) and row[col] > 0:
                xs.append(j + (i - (len(columns) - 1) / 2) * width)
                ys.append(row[col])
        if ys:
            bars = ax.bar(xs, ys, width, label=col)
            ax.bar_label(bars, fmt="%.3g", fontsize=6)
        else:
            ax.plot([], [], " ", label=f"{col}: n/a")
    ax.axhline(1.0, color="black", lw=0.8, ls="--", label="parity")
    ax.set_xticks(range(len(sel)), [_label(r) for r in sel], rotation=20, ha="right", fontsize=7)
    _log(ax, "y")
    ax.set_ylabel("times faster than the peer (> 1: numkern)")
    ax.grid(axis="y", alpha=0.3, which="both")
    _legend(ax)
    return _save(fig, path, title)


def plot_roofline(path, groups, *, stream, stream_note, peaks, title, label="label"):
    """GFLOP/s against FLOP/byte, log-log, under the bandwidth line and the compute peaks.
    ``groups``: ``{legend name: points}``; each point is annotated with its ``label``
    ("label": the row's case; "tag": kernel and size, for figures of several suites)."""
    fig, (ax,) = _figure(1)
    allp = [p for pts in groups.values() for p in pts]
    lo = min(p["intensity"] for p in allp) / 4
    hi = max(p["intensity"] for p in allp) * 4
    top = max(peaks.values(), default=None)
    if top is not None and stream:
        hi = max(hi, 4 * top / stream)  # show the ridge
    xs = [lo * (hi / lo) ** (i / 200) for i in range(201)]
    if stream:
        ax.plot(
            xs,
            [min(stream * x, top or math.inf) for x in xs],
            color="black",
            lw=1.2,
            label=f"stream {stream:.1f} GB/s ({stream_note})",
        )
    for dtype, peak in peaks.items():
        ax.axhline(
            peak, color="gray", lw=0.8, ls="--", label=f"torch.mm {dtype}: {peak:.0f} GFLOP/s"
        )
    for name, pts in groups.items():
        ax.scatter([p["intensity"] for p in pts], [p["GFLOPs"] for p in pts], s=18, label=name)
        for p in pts:
            ax.annotate(
                p[label],
                (p["intensity"], p["GFLOPs"]),
                fontsize=6,
                xytext=(3, 3),
                textcoords="offset points",
            )
    _log(ax, "x")
    _log(ax, "y")
    ax.set_xlabel("arithmetic intensity (FLOP per compulsory byte)")
    ax.set_ylabel("GFLOP/s")
    ax.grid(alpha=0.3, which="both")
    _legend(ax)
    return _save(fig, path, title)


# ---------------------------------------------------------------------------------------
# the report


def _header(machine, command, wall_s, machine_error):
    lines = ["# numkern benchmark report", ""]
    run = [f"`{command}`"]
    if machine:
        run.append(machine.get("date", ""))
        commit = machine.get("commit")
        if commit:
            dirty = " (with uncommitted changes)" if commit.endswith("+") else ""
            run.append(f"commit {commit.removesuffix('+')}{dirty}")
    if wall_s is not None:
        run.append(f"{wall_s:.0f} s")
    lines += [" · ".join(x for x in run if x), "", "## Machine", ""]
    if not machine:
        why = f": {machine_error}" if machine_error else ""
        return [*lines, f"**Machine facts were not measured**{why} (see logs/machine.log).", ""]
    feats = machine.get("cpu_features") or {}
    rows = [
        ("CPU", machine.get("cpu_model")),
        ("features (numkern.cpu_features())", " ".join(k for k, v in feats.items() if v) or "none"),
        ("features absent", " ".join(k for k, v in feats.items() if not v) or "none"),
        ("numkern ISAs", ", ".join(machine.get("isas") or [])),
        ("numkern.isa.describe()", machine.get("cpu")),
    ]
    if machine.get("feature_mask"):
        rows.append(("NUMKERN_CPU_FEATURES", machine["feature_mask"]))
    rows += [
        ("cores", f"{machine.get('cores')} ({machine.get('usable_cores')} usable by this run)"),
        ("L3", _gb(machine.get("l3_bytes"))),
        ("threads", f"Numba {machine.get('numba_threads')}, torch {machine.get('torch_threads')}"),
    ]
    if _number(machine.get("stream_GBps")):
        rows.append(
            (
                "stream read bandwidth",
                f"{machine['stream_GBps']:.1f} GB/s: {machine.get('stream_method', '')}",
            )
        )
    for dtype, peak in _peaks(machine).items():
        rows.append(
            (f"compute peak {dtype}", f"{peak:.0f} GFLOP/s: {machine.get('peak_method', '')}")
        )
    lines += ["| | |", "|---|---|"] + [f"| {k} | {_cell(v)} |" for k, v in rows]
    packages = machine.get("packages") or {}
    lines += ["", "| package | version |", "|---|---|"]
    lines += [f"| {k} | {v or 'not installed'} |" for k, v in packages.items()]
    return [*lines, ""]


def _summary(runs, docs):
    lines = [
        "## Suites",
        "",
        "| suite | kind | status | wall s | results |",
        "|---|---|---|---|---|",
    ]
    for run in runs:
        status = run.status + (f": {run.reason}" if run.reason else "")
        names = ", ".join(f"[{d['name']}](#{_anchor(d['name'])})" for d in docs[run.name])
        wall = f"{run.wall_s:.0f}" if run.wall_s is not None else ""
        lines.append(f"| {run.name} | {run.kind} | {_cell(status)} | {wall} | {names} |")
    return [*lines, ""]


def _anchor(name):
    return re.sub(r"[^a-z0-9_-]", "", name.lower().replace(" ", "-"))


def _result_section(doc, path, out, figures, machine, plots):
    """The Markdown of one result; its figures into ``figures`` (when ``plots``)."""
    env, rows, name = doc["environment"], doc["rows"], doc["name"]
    cpu = cpu_label(machine, env)
    lines = [f"### {name}", ""]
    facts = [
        f"{k}: {_cell(env[k])}"
        for k in ("date", "wall_s", "numba_threads", "torch_threads", "other_processes_cores")
        if k in env
    ]
    stream, stream_note = stream_of(env, machine)
    if stream:
        facts.append(f"stream {stream:.1f} GB/s ({stream_note})")
    lines += [" · ".join(facts), ""] if facts else []
    columns = _columns(doc)
    lines += _table(rows, columns) if rows else ["(no rows)"]
    lines += [""] + [f"- {_cell(n)}" for n in doc["notes"]] + ([""] if doc["notes"] else [])
    own = path.with_suffix(".png")
    if own.exists():
        lines += [f"The suite's own figure: [{own.name}]({_rel(own, out)})", ""]
    points = roof_points(rows)
    engine = engine_series(rows)
    ratios = ratio_columns(rows)
    peaks = _peaks(machine)
    if not plots:
        return lines, points
    if points or engine:
        png = plot_throughput(
            figures / f"{name}_throughput.png",
            points,
            engine,
            stream=stream,
            peaks=peaks,
            title=f"{name}: throughput against size — {cpu}",
        )
        lines += [f"![{name}: throughput against size — {cpu}]({_rel(png, out)})", ""]
    if ratios:
        png = plot_ratios(
            figures / f"{name}_ratios.png",
            rows,
            ratios,
            title=f"{name}: numkern against its peers — {cpu}",
        )
        lines += [f"![{name}: numkern against its peers — {cpu}]({_rel(png, out)})", ""]
    if points:
        png = plot_roofline(
            figures / f"{name}_roofline.png",
            {name: points},
            stream=stream,
            stream_note=stream_note,
            peaks=peaks,
            title=f"{name}: roofline — {cpu}",
        )
        lines += [f"![{name}: roofline — {cpu}]({_rel(png, out)})", ""]
        lines += _roof_table(points, stream, peaks)
    return lines, points


def _roof_table(points, stream, peaks):
    """Each point against its roof: the bandwidth line or the highest compute peak."""
    top = max(peaks.values(), default=None)
    rows = []
    for p in points:
        roof, bound = attainable(p["intensity"], stream, top)
        rows.append(
            {
                "case": p["label"],
                "GFLOP/s": p["GFLOPs"],
                "GB/s": p["GBps"],
                "FLOP/byte": p["intensity"],
                "roof GFLOP/s": roof,
                "bound": bound,
                "of roof": p["GFLOPs"] / roof if roof else None,
            }
        )
    return [*_table(rows, list(rows[0])), ""]


def _rel(path, out):
    """A link from ``out/report.md`` to ``path``."""
    return Path(os.path.relpath(Path(path).resolve(), Path(out).resolve())).as_posix()


def write_report(out, machine, runs, *, command="python -m bench", wall_s=None, machine_error=""):
    """Write ``out/report.md`` (and ``out/figures/*.png``) for ``runs`` (:class:`SuiteRun`,
    in run order) on ``machine`` (``harness.machine()``'s dict, or None where it was not
    measured, ``machine_error`` saying why). Returns the report's path. Figures need
    matplotlib; without it the report says so and has the tables."""
    out = Path(out)
    figures = out / "figures"
    figures.mkdir(parents=True, exist_ok=True)
    try:
        import matplotlib  # noqa: F401

        plots = True
    except ImportError:
        plots = False
    docs = {run.name: [(load_result(p), Path(p)) for p in run.results] for run in runs}
    lines = _header(machine, command, wall_s, machine_error)
    lines += _summary(runs, {k: [d for d, _ in v] for k, v in docs.items()})
    if not plots:
        lines += ["matplotlib is not installed: no figures (`pip install -e .[bench]`).", ""]
    body, everything = [], {}
    for run in runs:
        body += [f"## {run.name} ({run.kind} suite): {run.status}", ""]
        body += [f"`{run.command}`", ""] if run.command else []
        if run.status == "failed":
            body += [f"**FAILED**: {run.reason}", ""]
            if run.stderr_tail:
                body += ["stderr (last lines):", "", "```", run.stderr_tail.rstrip(), "```", ""]
        elif run.status == "skipped":
            body += [f"Skipped: {run.reason}", ""]
        if run.log is not None:
            body += [f"Log: [{Path(run.log).name}]({_rel(run.log, out)})", ""]
        for doc, path in docs[run.name]:
            section, points = _result_section(doc, path, out, figures, machine, plots)
            body += section
            if points:
                everything[doc["name"]] = points
    if everything and plots:
        stream = (machine or {}).get("stream_GBps")
        note = "measured by the runner"
        if not _number(stream):  # the suites' own figures, the largest
            streams = [stream_of(d["environment"], None)[0] for v in docs.values() for d, _ in v]
            stream, note = max((s for s in streams if s), default=None), "the suites' largest"
        envs = [d["environment"] for v in docs.values() for d, _ in v]
        cpu = cpu_label(machine, envs[0] if envs else None)
        png = plot_roofline(
            figures / "roofline.png",
            everything,
            stream=stream,
            stream_note=note,
            peaks=_peaks(machine),
            title=f"every kernel row: roofline — {cpu}",
            label="tag",
        )
        lines += ["## Roofline", "", f"![every kernel row: roofline — {cpu}]({_rel(png, out)})", ""]
        lines += [
            "Points: one call's FLOPs and compulsory bytes (each operand read once, each output "
            "written once) over its median time; rows whose bench claims a bandwidth use the "
            "time on rotated copies (a working set past the L3). Roofs: the stream read "
            "bandwidth and the compute peaks measured in this run (see Machine; torch.mm is "
            "a measured ceiling, not the datasheet's, and a kernel can pass it).",
            "",
        ]
    path = out / "report.md"
    path.write_text("\n".join(lines + body).rstrip() + "\n")
    return path
