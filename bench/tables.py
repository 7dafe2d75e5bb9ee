"""The docs' generated parts: speed tables, the op map and kernels.md's contents.

    python bench/tables.py                 # collect the results, then render every part
    python bench/tables.py --render-only   # render from docs/speed.json as it is
    python -m bench --tables               # the same as the first line

Nothing here is typed into the docs by hand. Three parts live between markers
(``<!-- generated:NAME start ... -->`` and ``<!-- generated:NAME end -->``):

* ``speed`` (docs/kernels.md) and ``speed-short`` (README.md): the speed tables, rendered
  from ``docs/speed.json``. :func:`collect` writes that file from the suites' results
  (``harness.write_results``'s ``{"name", "environment", "notes", "columns", "rows"}``,
  in ``bench/results/`` for a suite run alone and ``bench/results/report/results/<suite>/``
  for ``python -m bench``): per op and case the numkern time in µs, the share of its bound
  (the row's ``of_stream`` / ``of_fma_peak`` columns), the ratios against vLLM's op and
  torch (``x_*`` = peer time / numkern time), and per engine row its tokens/s, each with
  the CPU it ran on and the result it came from. A suite with no result has no rows.
* ``op-map`` (docs/kernels.md): each public op's file, its Numba kernels and the tiles
  they call. The file is where the op is defined (``inspect.getsourcefile``); each kernel
  and tile is found by its ``def`` in ``numkern/`` (the op's own file first), so the map
  follows code that moves and fails, naming the name, when a kernel is renamed
  (:data:`OPS` is then to update).
* ``contents`` (docs/kernels.md): its numbered sections, linked.

tests/test_bench_report.py checks that the Markdown between the markers is exactly what
rendering gives, so an edit by hand fails the test.
"""

import argparse
import datetime
import importlib
import inspect
import json
import math
import re
import sys
from dataclasses import dataclass
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make ``bench`` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import report

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
SPEED = ROOT / "docs" / "speed.json"
KERNELS_MD = ROOT / "docs" / "kernels.md"
README = ROOT / "README.md"
NUMKERN = ROOT / "numkern"

# ---------------------------------------------------------------------------------------
# the suites' results -> docs/speed.json


@dataclass(frozen=True)
class KernelSuite:
    """How one kernel suite's rows read: ``op`` (a function of the row's case),
    ``time_ms`` (numkern's time), ``bounds`` (share-of-bound columns, first present
    wins), ``vllm`` and ``torch`` (ratio columns) and ``torch_peer`` (what torch ran)."""

    op: object
    time_ms: str
    bounds: tuple
    vllm: str
    torch: str
    torch_peer: str


def _gdn_op(case):
    """The op of a bench_gdn case (its case names: "decode B=8", "conv fwd T=512", ...)."""
    for prefix, op in (
        ("decode", "gdn.rule.fused_sigmoid_gating_delta_rule_update"),
        ("prefill", "gdn.rule.chunk_gated_delta_rule"),
        ("conv update", "gdn.conv.causal_conv1d_update"),
        ("conv", "gdn.conv.causal_conv1d_fwd"),
        ("gating", "gdn.gating.fused_gdn_gating"),
        ("rms_norm_gated", "gdn.norm.rms_norm_gated"),
    ):
        if case.startswith(prefix):
            return op
    return "gdn"


STREAM, FMA = "stream", "fp32 FMA peak"
KERNEL_SUITES = {
    "bench_gemm": KernelSuite(
        lambda case: "weight_packed_linear",
        "numkern_ms",
        (("of_stream", STREAM), ("of_fma_peak", FMA)),
        "x_vllm",
        "x_torch_bf16",
        "torch bf16 mm",
    ),
    "bench_moe": KernelSuite(
        lambda case: "moe.fused_moe",
        "numkern_vec_ms",
        (("of_stream", STREAM), ("touched_of_stream", STREAM)),
        "x_vllm_vec",
        "x_torch_loop",
        "torch loop over experts",
    ),
    "bench_attention": KernelSuite(
        lambda case: "attention.paged_attention",
        "numkern_vec_ms",
        (("of_stream", STREAM),),
        "x_vllm_vec",
        "x_sdpa_bf16",
        "torch SDPA bf16",
    ),
    "bench_gdn": KernelSuite(
        _gdn_op, "numkern_ms", (("of_stream", STREAM),), "x_vllm", "x_torch", "torch"
    ),
}
ENGINE_SUITE = "bench_e2e"
ENGINE_FIELDS = ("prefill_tok_s", "decode_b1_tok_s", "decode_b8_tok_s", "b1_of_bound")
# the engine row the README's ratios are taken from (bench_e2e's own naming)
ENGINE_DEFAULT = "numkern engine (engine default)"


def _number(value):
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def cpu_name(environment, cpu_model=None):
    """The CPU a result ran on, as the tables name it: model and LLVM name, core count,
    the vector features numkern used, and whether ``NUMKERN_CPU_FEATURES`` masked them.
    ``cpu_model`` names the model where the result does not (results written before
    harness.environment recorded it)."""
    env = dict(environment)
    if cpu_model and not env.get("cpu_model"):
        env["cpu_model"] = cpu_model
    label = report.cpu_label(None, env)
    if label == "unknown CPU":
        return ""
    describe = env.get("cpu") or ""
    parts = [label]
    if _number(env.get("cpus")):
        parts.append(f"{env['cpus']} cores")
    features = re.search(r"features=\[([^\]]*)\]", describe)
    if features:
        masked = " masked by NUMKERN_CPU_FEATURES" if "masked" in describe else ""
        parts.append(f"features{masked}: {features.group(1)}")
    return ", ".join(parts)


def _base(name):
    return name[: -len("_quick")] if name.endswith("_quick") else name


def find_results(results_dir=RESULTS):
    """Per suite (``bench_gemm``, ...) the result its tables come from: a full run over a
    quick one, then the newest; from ``results_dir`` and the runner's
    ``report/results/<suite>/`` under it."""
    results_dir = Path(results_dir)
    paths = sorted(results_dir.glob("*.json")) + sorted(results_dir.glob("report/results/*/*.json"))
    chosen = {}
    for path in paths:
        base = _base(path.stem)
        if base not in KERNEL_SUITES and base != ENGINE_SUITE:
            continue
        doc = report.load_result(path)
        rank = (not doc["name"].endswith("_quick"), doc["environment"].get("date", ""))
        if base not in chosen or rank > chosen[base][0]:
            chosen[base] = (rank, doc)
    return {base: doc for base, (_, doc) in sorted(chosen.items())}


def _ratio(value):
    """A ratio cell as stored: a number, or "n/a" for a peer that could not run."""
    if _number(value):
        return value
    return "n/a" if value not in (None, "") else None


def kernel_rows(doc, suite, cpu):
    rows = []
    for row in doc["rows"]:
        if not _number(row.get(suite.time_ms)) or suite.vllm not in row:
            continue  # not a case of the op (e.g. bench_gemm's torch.ops dispatch row)
        share, bound = None, None
        for column, what in suite.bounds:
            if _number(row.get(column)):
                share, bound = row[column], what
                break
        case = str(row.get("case", ""))
        rows.append(
            {
                "op": suite.op(case),
                "case": case,
                "numkern_us": row[suite.time_ms] * 1e3,
                "bound_share": share,
                "bound": bound,
                "x_vllm": _ratio(row.get(suite.vllm)),
                "x_torch": _ratio(row.get(suite.torch)),
                "torch_peer": suite.torch_peer,
                "cpu": cpu,
                "source": doc["name"],
            }
        )
    return rows


def engine_rows(doc, cpu):
    rows = []
    for row in doc["rows"]:
        if not _number(row.get("decode_b1_tok_s")):
            continue
        kept = {k: row[k] if _number(row.get(k)) else None for k in ENGINE_FIELDS}
        rows.append({"model": row.get("model"), "system": row.get("system")} | kept)
        rows[-1] |= {"cpu": cpu, "source": doc["name"]}
    return rows


def collect(results_dir=RESULTS, *, cpu_model=None):
    """docs/speed.json's content from the results in ``results_dir``."""
    found = find_results(results_dir)
    speed = {
        "generated_by": "python bench/tables.py",
        "sources": [],
        "kernels": [],
        "engine": [],
    }
    for base, doc in found.items():
        env = doc["environment"]
        cpu = cpu_name(env, cpu_model)
        speed["sources"].append({"result": doc["name"], "date": env.get("date"), "cpu": cpu})
        if base == ENGINE_SUITE:
            speed["engine"] += engine_rows(doc, cpu)
        else:
            speed["kernels"] += kernel_rows(doc, KERNEL_SUITES[base], cpu)
    return speed


# ---------------------------------------------------------------------------------------
# docs/speed.json -> Markdown


def _checked(speed):
    """The rows, each with a CPU: a ValueError names a row without one."""
    for part in ("kernels", "engine"):
        for i, row in enumerate(speed.get(part, [])):
            if not (isinstance(row.get("cpu"), str) and row["cpu"].strip()):
                raise ValueError(f"speed {part}[{i}] ({row.get('case') or row.get('system')}): "
                                 "no CPU named; a figure without its CPU is not shown")  # fmt: skip
    return speed


def _fig(value, digits=3):
    if value is None:
        return "—"
    if isinstance(value, str):
        return value
    if abs(value) >= 100:
        return f"{value:.0f}"
    return f"{value:.{digits}g}"


def _x(value):
    return "—" if value is None else (value if isinstance(value, str) else f"{value:.2f}x")


def _share(row):
    if row["bound_share"] is None:
        return "—"
    return f"{row['bound_share']:.2f} of {row['bound']}"


def _by_cpu(rows):
    groups = {}
    for row in rows:
        groups.setdefault(row["cpu"], []).append(row)
    return groups


def _sources(speed, cpu):
    named = [f"`{s['result']}` ({(s.get('date') or '?')[:10]})" for s in speed["sources"]]
    named = [n for s, n in zip(speed["sources"], named) if s["cpu"] == cpu]
    return ", ".join(named)


RATIO_NOTE = (
    "Nx = peer time / numkern time (above 1: numkern is faster; below 1: the peer is); "
    "n/a: the peer could not run this case here."
)


def render_kernels(speed):
    """The per-op table of docs/kernels.md."""
    rows = _checked(speed)["kernels"]
    if not rows:
        return "No kernel results yet: run `python -m bench`, then `python -m bench --tables`."
    out = [RATIO_NOTE]
    for cpu, group in _by_cpu(rows).items():
        out += ["", f"On {cpu}; from {_sources(speed, cpu)}:", ""]
        out.append("| op | case | numkern µs | share of its bound | vs vLLM | vs torch |")
        out.append("|---|---|---|---|---|---|")
        for r in group:
            torch_cell = f"{_x(r['x_torch'])} ({r['torch_peer']})"
            out.append(
                f"| `{r['op']}` | {r['case']} | {_fig(r['numkern_us'])} | {_share(r)} | "
                f"{_x(r['x_vllm'])} | {torch_cell} |"
            )
    return "\n".join(out)


def _engine_ratio(rows, metric):
    """``{peer prefix: ratio}`` of the engine default's ``metric`` over each peer's."""
    ours = next((r for r in rows if r["system"] == ENGINE_DEFAULT), None)
    ours = ours or next((r for r in rows if str(r["system"]).startswith("numkern")), None)
    out = {}
    for peer in ("HF", "llama.cpp"):
        theirs = next((r for r in rows if str(r["system"]).startswith(peer)), None)
        if ours is None or theirs is None:
            out[peer] = "not measured"
        elif _number(ours.get(metric)) and _number(theirs.get(metric)) and theirs[metric] > 0:
            out[peer] = ours[metric] / theirs[metric]
        else:
            out[peer] = f"not measured ({metric})"
    return ours, out


ENGINE_METRICS = (
    ("decode_b1_tok_s", "decode, batch 1"),
    ("decode_b8_tok_s", "decode, batch 8"),
    ("prefill_tok_s", "prefill, 512 tokens"),
)


def render_readme(speed):
    """The README's short table: the engine against HF and llama.cpp, and the kernels'
    smallest and largest case per op against vLLM's op."""
    speed = _checked(speed)
    out = [RATIO_NOTE]
    rows = speed["engine"] + speed["kernels"]
    if not rows:
        return "No results yet: run `python -m bench`, then `python -m bench --tables`."
    for cpu in _by_cpu(rows):
        out += ["", f"On {cpu}; from {_sources(speed, cpu)}:", ""]
        out.append("| what | numkern | vs HF transformers | vs llama.cpp | vs vLLM's op |")
        out.append("|---|---|---|---|---|")
        engine = [r for r in speed["engine"] if r["cpu"] == cpu]
        for model in dict.fromkeys(r["model"] for r in engine):
            mine = [r for r in engine if r["model"] == model]
            for metric, what in ENGINE_METRICS:
                ours, ratios = _engine_ratio(mine, metric)
                if ours is None or not _number(ours.get(metric)):
                    continue
                cells = [_x(ratios["HF"]), _x(ratios["llama.cpp"]), "—"]
                out.append(
                    f"| engine {what}, {model} | {ours[metric]:.0f} tok/s | "
                    + " | ".join(cells)
                    + " |"
                )
        kernels = [r for r in speed["kernels"] if r["cpu"] == cpu]
        for op in dict.fromkeys(r["op"] for r in kernels):
            cases = [r for r in kernels if r["op"] == op]
            for r in dict.fromkeys([id(cases[0]), id(cases[-1])]):
                r = next(c for c in cases if id(c) == r)
                share = f", {_share(r)}" if r["bound_share"] is not None else ""
                out.append(
                    f"| `{op}` {r['case']} | {_fig(r['numkern_us'])} µs{share} | — | — | "
                    f"{_x(r['x_vllm'])} |"
                )
    return "\n".join(out)


# ---------------------------------------------------------------------------------------
# the op map


@dataclass(frozen=True)
class Op:
    """A public op (dotted, under ``numkern``), its Numba kernels (parallel entry points)
    and the tiles or inner loops they call."""

    name: str
    kernels: tuple = ()
    tiles: tuple = ()


_GEMM_TILES = ("tile8", "tile4", "tile1", "tile6")
OPS = (
    Op("convert_weight_packed"),
    Op("weight_packed_linear", ("_linear", "_linear_dp"), _GEMM_TILES),
    Op("weight_packed_linear_cpu", ("_linear", "_linear_dp"), _GEMM_TILES),
    Op("moe.topk_softmax", ("_topk_softmax",)),
    Op("moe.grouped_topk", ("_grouped_topk",)),
    Op("moe.prepack_moe_weight"),
    Op(
        "moe.fused_moe",
        ("_fused_moe",),
        ("tile8_rows", "tile8_gathered", "tile6_gathered"),
    ),
    Op("attention.reshape_and_cache", ("cache_write",)),
    Op("attention.plan_attention", ("_plan",)),
    Op("attention.paged_attention", ("attention",), ("qk_group", "pv_group", "k_pair", "v_pair")),
    Op("norm.rms_norm", ("_rms_norm",)),
    Op("norm.fused_add_rms_norm", ("_fused_add",)),
    Op("rope.rotary_embedding", ("_rotary",)),
    Op("gdn.conv.causal_conv1d_fwd", ("_conv",), ("_window4", "_rows")),
    Op("gdn.conv.causal_conv1d_update", ("_conv",), ("_window4", "_rows")),
    Op("gdn.gating.fused_gdn_gating", ("_gating",)),
    Op("gdn.rule.fused_sigmoid_gating_delta_rule_update", ("_recurrent",), ("_recurrent_pair",)),
    Op("gdn.rule.chunk_gated_delta_rule", ("_chunked",), ("_chunk_group",)),
    Op("gdn.norm.rms_norm_gated", ("_norm_gated",)),
    Op("decoder.DecoderStack", ("_run",), ("_block", "_block_dp", "item", "merge")),
    Op("collective.ShmGroup", ("_all_reduce", "_wait", "_post"), ("_await",)),
)


def _rel(path):
    return Path(path).resolve().relative_to(ROOT).as_posix()


# Python glue, no kernels: not searched (reference.py defines ops' namesakes)
NOT_KERNELS = ("testing", "torch_ops")


def _definitions(name, root=NUMKERN):
    """The files under ``root`` (but :data:`NOT_KERNELS`) that define ``name`` at module
    level (``def name(``)."""
    pattern = re.compile(rf"^def {re.escape(name)}\(", re.M)
    return [
        p
        for p in sorted(root.rglob("*.py"))
        if p.relative_to(root).parts[0] not in NOT_KERNELS
        and pattern.search(p.read_text(encoding="utf-8"))
    ]


def where_defined(name, near, root=NUMKERN):
    """The file defining the kernel or tile ``name``: the op's own file ``near`` when it
    does, else the one file that does, else the one in ``near``'s folder; a ValueError
    when none or several do."""
    files = _definitions(name, root)
    if Path(near) in files:
        return Path(near)
    nearby = [f for f in files if f.parent == Path(near).parent]
    for found in (files, nearby):
        if len(found) == 1:
            return found[0]
    found = [f.relative_to(root.parent).as_posix() for f in files]
    raise ValueError(f"{name}: expected one definition under numkern/, found {found or 'none'} "
                     "(update bench/tables.py's OPS)")  # fmt: skip


def _module_of(path):
    """The dotted module name of a file under the repo (``numkern/gdn/conv.py`` ->
    ``numkern.gdn.conv``)."""
    parts = Path(path).resolve().relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _defined_in(name, module, near):
    """The file defining ``name`` as ``module`` sees it (what its code calls, wherever
    the definition moved), else :func:`where_defined`'s search."""
    obj = getattr(importlib.import_module(module), name, None)
    obj = getattr(obj, "py_func", obj)  # a Numba dispatcher: its Python function
    try:
        path = Path(inspect.getsourcefile(obj)).resolve()
    except TypeError:  # not a function or class (or absent): search the tree
        return where_defined(name, near)
    if path in _definitions(name, path.parent):
        return path
    return where_defined(name, near)


def op_map(ops=OPS):
    """``[(op, file, [(kernel, file)], [(tile, file)])]`` from the code as it is."""
    rows = []
    for op in ops:
        module, _, attr = f"numkern.{op.name}".rpartition(".")
        obj = getattr(importlib.import_module(module), attr)
        path = Path(inspect.getsourcefile(obj)).resolve()
        kernels = [(k, _defined_in(k, module, path)) for k in op.kernels]
        # a tile is looked up from its op's first kernel's module, then as a kernel is
        kernel_module = _module_of(kernels[0][1]) if kernels else module
        tiles = [(t, _defined_in(t, kernel_module, path)) for t in op.tiles]
        rows.append((op.name, path, kernels, tiles))
    return rows


def _named(items, own):
    if not items:
        return "—"
    groups = {}
    for name, path in items:
        groups.setdefault(path, []).append(f"`{name}`")
    return "; ".join(
        ", ".join(names) + ("" if path == own else f" (`{_rel(path)}`)")
        for path, names in groups.items()
    )


def render_op_map(rows=None):
    rows = op_map() if rows is None else rows
    out = [
        "| op | file | Numba kernel | tiles and inner loops |",
        "|---|---|---|---|",
    ]
    for name, path, kernels, tiles in rows:
        out.append(
            f"| `{name}` | `{_rel(path)}` | {_named(kernels, path)} | {_named(tiles, path)} |"
        )
    return "\n".join(out)


# ---------------------------------------------------------------------------------------
# kernels.md's contents


def slug(title):
    """GitHub's anchor of a heading (before the ``-1``, ``-2`` of repeated ones)."""
    return re.sub(r"[^\w\- ]", "", title.lower()).replace(" ", "-")


def render_contents(text):
    """One list item per ``##`` section of ``text`` (``## Contents`` itself left out), its
    ``###`` subsections linked by number."""
    sections, seen, in_fence = [], {}, False
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            in_fence = not in_fence
        m = None if in_fence else re.match(r"^(#{1,6})\s+(.*?)\s*$", line)
        if not m:
            continue
        title, s = m.group(2), slug(m.group(2))
        n = seen.get(s, 0)
        seen[s] = n + 1
        anchor = s if n == 0 else f"{s}-{n}"
        if len(m.group(1)) == 2 and title != "Contents":
            sections.append((f"[{title}](#{anchor})", []))
        elif len(m.group(1)) == 3 and sections:
            number = re.match(r"^([\dA-Z]+(?:\.\d+)+)\s", title)
            sections[-1][1].append(f"[{number.group(1) if number else title}](#{anchor})")
    return "\n".join(
        f"- {head}" + (": " + " · ".join(subs) if subs else "") for head, subs in sections
    )


# ---------------------------------------------------------------------------------------
# markers


def _markers(name):
    start = re.compile(rf"^<!-- generated:{re.escape(name)} start\b.*?-->\n", re.M | re.S)
    end = re.compile(rf"^<!-- generated:{re.escape(name)} end -->$", re.M)
    return start, end


def between(text, name):
    """The text between ``name``'s markers; a ValueError when they are missing."""
    start, end = _markers(name)
    s = start.search(text)
    e = end.search(text, s.end()) if s else None
    if not (s and e):
        raise ValueError(f"no '<!-- generated:{name} start/end -->' markers")
    return text[s.end() : e.start()].removesuffix("\n")


def replace_between(text, name, body):
    start, end = _markers(name)
    s = start.search(text)
    e = end.search(text, s.end()) if s else None
    if not (s and e):
        raise ValueError(f"no '<!-- generated:{name} start/end -->' markers")
    return text[: s.end()] + body + "\n" + text[e.start() :]


def load_speed(path=SPEED):
    return json.loads(Path(path).read_text(encoding="utf-8"))


def rendered(speed, kernels_text, *, op_rows=None):
    """``{(file, part): Markdown}``: what every generated part should hold."""
    return {
        (KERNELS_MD, "speed"): render_kernels(speed),
        (README, "speed-short"): render_readme(speed),
        (KERNELS_MD, "op-map"): render_op_map(op_rows),
        (KERNELS_MD, "contents"): render_contents(kernels_text),
    }


def render_all(speed):
    """Write every generated part into its file."""
    texts = {}
    for path in (KERNELS_MD, README):
        texts[path] = path.read_text(encoding="utf-8")
    for (path, part), body in rendered(speed, texts[KERNELS_MD]).items():
        texts[path] = replace_between(texts[path], part, body)
    for path, text in texts.items():
        path.write_text(text, encoding="utf-8")


def main(argv=None):
    parser = argparse.ArgumentParser(
        prog="python bench/tables.py", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--results", type=Path, default=RESULTS, help="folder of the results")
    parser.add_argument(
        "--render-only", action="store_true", help="render docs/speed.json as it is"
    )
    parser.add_argument(
        "--cpu-model",
        default=None,
        help="the CPU model, for results that do not record it (harness.environment records "
        "it since this script exists)",
    )
    args = parser.parse_args(argv)
    if not args.render_only:
        speed = collect(args.results, cpu_model=args.cpu_model)
        if not speed["sources"]:
            parser.error(
                f"no results in {args.results}: run python -m bench first, or --render-only"
            )
        speed["collected"] = datetime.date.today().isoformat()
        SPEED.write_text(json.dumps(speed, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
        print(f"wrote {_rel(SPEED)} from {', '.join(s['result'] for s in speed['sources'])}")
    render_all(load_speed())
    print(f"rendered the generated parts of {_rel(KERNELS_MD)} and {_rel(README)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
