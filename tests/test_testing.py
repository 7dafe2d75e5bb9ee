"""numkern.testing.vllm, the loader of vLLM's CPU ops: which build, probes in a child."""

import signal

import pytest
import torch

import numkern
from numkern.testing import vllm

from . import oracle
from .conftest import run_child


def test_native_library_follows_cpu_flags():
    f = numkern.cpu_features()
    if f["avx512f"] and f["avx512bw"] and f["avx512vl"] and f["avx512dq"]:
        expected = "_C.abi3.so" if f["avx512bf16"] else "_C_AVX512.abi3.so"
    else:
        expected = "_C_AVX2.abi3.so"
    assert vllm.native_library() == expected


def test_unknown_library_is_an_error():
    with pytest.raises(ValueError, match="library: expected None or one of"):
        vllm.probe("pass", "_C_AVX9.abi3.so")


def test_probe_of_a_clean_snippet_is_ok():
    oracle.require_library()
    assert vllm.probe("assert hasattr(torch.ops._C, 'silu_and_mul')") == vllm.Availability(True)


def test_probe_reports_a_child_killed_by_a_signal():
    oracle.require_library()
    avail = vllm.probe("import os, signal; os.kill(os.getpid(), signal.SIGABRT)")
    assert not avail.ok
    assert f"{vllm.native_library()} probe died: {signal.SIGABRT.name}" == avail.reason
    assert avail.na() == f"n/a ({avail.reason})"


def test_run_in_child_round_trip():
    oracle.require_library()
    a = torch.arange(6.0).reshape(2, 3)
    assert torch.equal(vllm.run_in_child("result = inputs['a'] * 2", a=a), a * 2)
    with pytest.raises(vllm.ChildError, match="exit 1: ZeroDivisionError"):
        vllm.run_in_child("result = 1 / 0")


def test_import_numkern_leaves_testing_alone():
    run_child("import sys, numkern\nassert 'numkern.testing' not in sys.modules, sys.modules")


def test_probe_and_run_in_child_check_their_arguments():
    for call in (vllm.probe, vllm.run_in_child):
        name = "snippet" if call is vllm.probe else "code"
        with pytest.raises(TypeError, match=f"^{name}: expected a str"):
            call(b"pass")
        with pytest.raises(TypeError, match=r"^timeout: expected a number"):
            call("pass", timeout="5")
        for bad in (0, -1.0):
            with pytest.raises(ValueError, match=r"^timeout: expected seconds > 0"):
                call("pass", timeout=bad)


def test_child_loads_the_located_path(monkeypatch, tmp_path):
    """The child loads the file this process located (no search of its own)."""
    fake = str(tmp_path / "located_here.so")
    monkeypatch.setattr(vllm, "_locate", lambda library: (fake, ""))
    avail = vllm.probe("pass  # test_child_loads_the_located_path")
    assert not avail.ok and "located_here.so" in avail.reason
