import collections
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import time

import pytest
import torch

from numkern import isa
from numkern.testing import vllm

from . import compile_report, oracle

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# --fallback-run: the tests marked fallback again, in a second pytest process with the
# host's widest vector features masked (isa.narrower_mask: AVX-512 and AMX on an AVX-512
# CPU, for the code an AVX2-only CPU gets; AVX/AVX2/FMA on an AVX2-only CPU, for the
# 128-bit SSE code), alongside this run, so every host tests a path its main run does not.
# Most of a cold run is Numba compiling on one thread, so on CI's 2 cores the second
# process mostly uses the core this one leaves idle (AMD EPYC Zen 4 VM, cold cache: 120 s
# after the main run, 38 s more wall time alongside it; README for the figure with -n 2).
# This run fails if that one does. Under xdist (-n), only the controller starts it.
FALLBACK_FEATURES, FALLBACK_REASON = isa.narrower_mask()
FALLBACK_TIMEOUT = 1800  # seconds the masked run may take after this one ends
# The paths a host without the feature cannot run, and the tests that compile them for
# another CPU (nothing runs) and check the instructions: the report header names them.
CODEGEN_ONLY = (
    ("avx512f", "512-bit vector code", "tests/test_gemm.py::test_gemm_paths_codegen"),
    (
        "avx512bf16",
        "vdpbf16ps (dpbf16 GEMM and MoE tiles)",
        "tests/test_gemm.py::test_gemm_paths_codegen, tests/test_simd.py::test_dpbf16_codegen",
    ),
)


def pytest_report_header(config):
    lib = oracle.native_library()
    forced = " (named by NUMKERN_VLLM_LIBRARY)" if os.environ.get(vllm.LIBRARY_ENV) else ""
    where = vllm.installed(lib)
    lines = [
        f"numkern: {isa.describe()}",
        f"vLLM oracle: {lib}{forced}"
        + ("" if where.ok else f", unavailable: {where.reason}")
        + (" (required: NUMKERN_REQUIRE_VLLM=1)" if oracle.REQUIRED else ""),
    ]
    if config.getoption("--fallback-run"):
        if FALLBACK_FEATURES:
            lines.append(
                f"fallback run: NUMKERN_CPU_FEATURES={FALLBACK_FEATURES} ({FALLBACK_REASON})"
            )
        else:
            lines.append(f"fallback run: skipped ({FALLBACK_REASON})")
    for feature, path, tests in CODEGEN_ONLY:
        if not isa.has(feature):
            lines.append(f"not run here (no {feature}): {path}; its codegen checked by {tests}")
    return lines


def pytest_addoption(parser):
    parser.addoption(
        "--fallback-run",
        action="store_true",
        help=f"also run -m fallback with NUMKERN_CPU_FEATURES={FALLBACK_FEATURES} "
        f"({FALLBACK_REASON}), in a second pytest process alongside this one; fail if it fails",
    )


_REPORT = pytest.StashKey()  # (log directory made by this run, {test file: wall s})


def pytest_configure(config):
    if not hasattr(config, "workerinput") and not os.environ.get("NUMKERN_FALLBACK_RUN"):
        # the compile report: every process of the run (xdist workers, the fallback run,
        # children) inherits the log directory (tests/compile_report.py)
        made = None
        if not os.environ.get(compile_report.ENV):
            made = tempfile.mkdtemp(prefix="numkern-compile-log-")
            os.environ[compile_report.ENV] = made
        from numkern import _compile_log

        _compile_log.install(os.environ[compile_report.ENV])
        config.stash[_REPORT] = (made, collections.Counter())
        # the run's processes fill the cores already: engines warm up without compile
        # helpers (tests/test_warmup_helpers.py starts them itself)
        os.environ.setdefault("NUMKERN_COMPILE_WORKERS", "1")
    if not config.getoption("--fallback-run") or hasattr(config, "workerinput"):
        return  # (an xdist worker: the controller starts the masked run)
    if not FALLBACK_FEATURES:
        return  # nothing narrower: the header prints why
    if os.environ.get("NUMKERN_CPU_FEATURES"):
        raise pytest.UsageError(
            "--fallback-run: expected no NUMKERN_CPU_FEATURES in this run (the masked run "
            f"sets its own), got {os.environ['NUMKERN_CPU_FEATURES']!r}"
        )
    log = tempfile.NamedTemporaryFile(prefix="numkern-fallback-", suffix=".log", delete=False)
    env = {**os.environ, "NUMKERN_CPU_FEATURES": FALLBACK_FEATURES, "NUMKERN_FALLBACK_RUN": "1"}
    cmd = [sys.executable, "-m", "pytest", "-m", "fallback", "-p", "no:cacheprovider"]
    cmd += shlex.split(os.environ.get("NUMKERN_FALLBACK_ARGS", ""))  # (the harness's test)
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    config.stash[_FALLBACK] = (proc, log, time.monotonic())


_FALLBACK = pytest.StashKey()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """Compilations (this process's and its children's) are logged under the test's id."""
    fallback = "[fallback run] " if os.environ.get("NUMKERN_FALLBACK_RUN") else ""
    os.environ[compile_report.TAG_ENV] = fallback + item.nodeid
    try:
        return (yield)
    finally:
        os.environ.pop(compile_report.TAG_ENV, None)


def pytest_runtest_logreport(report):
    if _report_stash is not None:
        _report_stash[1][report.nodeid.split("::")[0]] += report.duration


_report_stash = None


@pytest.hookimpl(tryfirst=True)
def pytest_sessionstart(session):
    global _report_stash
    _report_stash = session.config.stash.get(_REPORT, None)


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    report = config.stash.get(_REPORT, None)
    if report is None:
        return  # a worker: the controller reports
    tr = terminalreporter
    made, file_wall = report
    tr.write_sep("=", "compile report (tests/compile_report.py)")
    for line in compile_report.lines(os.environ[compile_report.ENV], file_wall):
        tr.write_line(line)
    if made:  # a directory the caller named is kept for them
        shutil.rmtree(made, ignore_errors=True)


def pytest_sessionfinish(session, exitstatus):
    run = session.config.stash.get(_FALLBACK, None)
    if run is None:
        return
    proc, log, t0 = run
    if exitstatus == pytest.ExitCode.INTERRUPTED:
        proc.kill()
    try:
        rc = proc.wait(timeout=FALLBACK_TIMEOUT)
    except subprocess.TimeoutExpired:
        proc.kill()
        rc = proc.wait()
    log.close()
    with open(log.name, encoding="utf-8", errors="replace") as f:
        lines = f.read().splitlines()
    os.unlink(log.name)
    tr = session.config.pluginmanager.get_plugin("terminalreporter")
    if tr is not None:
        tr.write_sep("=", f"fallback run, NUMKERN_CPU_FEATURES={FALLBACK_FEATURES}")
        for line in lines if rc != 0 else lines[-3:]:
            tr.write_line(line)
        tr.write_line(f"fallback run: exit {rc} after {time.monotonic() - t0:.1f} s")
    if rc != 0 and session.exitstatus == pytest.ExitCode.OK:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def run_child(code, env_extra=None, timeout=900):
    """Run Python code in a fresh interpreter; returns stdout (fails the test on error)."""
    env = dict(os.environ)
    env.update(env_extra or {})
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=ROOT,
        timeout=timeout,
    )  # fmt: skip
    if proc.returncode != 0:
        pytest.fail(f"child process failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    return proc.stdout
