"""tests/oracle.py's policy, with fake probes run in real children that loaded vLLM's
native build: a probe that raises or dies of another signal fails, SIGILL skips only on a
CPU that lacks a feature the op needs, a build that does not load is an absent oracle."""

import pytest

from numkern.testing import vllm

from . import oracle

RAISES = "raise RuntimeError('the op rejected its arguments')"
SIGILL = "import os, signal\nos.kill(os.getpid(), signal.SIGILL)"
SIGSEGV = "import os, signal\nos.kill(os.getpid(), signal.SIGSEGV)"
FINE = "x = torch.ones(3)"
NEEDS = ("amx-tile",)  # what the fake op claims to need


@pytest.fixture(autouse=True)
def installed():
    oracle.require_library()  # skips, or fails under NUMKERN_REQUIRE_VLLM=1


def _cpu(monkeypatch, *, has_needs):
    """A host with (or without) the fake op's needs, and every feature of its build."""
    build = oracle.BUILD_NEEDS[oracle.native_library()]
    host = dict.fromkeys(build, True) | dict.fromkeys(NEEDS, has_needs)
    monkeypatch.setattr(oracle, "_host_features", lambda: host)


@pytest.fixture(params=[True, False], ids=["required", "optional"])
def required(request, monkeypatch):
    monkeypatch.setattr(oracle, "REQUIRED", request.param)
    return request.param


def test_a_clean_probe_passes(required):
    oracle.require_op("fake op", FINE)


@pytest.mark.parametrize("snippet", [RAISES, SIGSEGV], ids=["raises", "sigsegv"])
def test_a_probe_that_fails_otherwise_fails_even_on_a_cpu_without_the_needs(
    snippet, required, monkeypatch
):
    _cpu(monkeypatch, has_needs=False)
    with pytest.raises(pytest.fail.Exception, match="not by a CPU limit"):
        oracle.require_op("fake op", snippet, needs=NEEDS)


def test_sigill_skips_where_the_cpu_lacks_a_need(required, monkeypatch):
    _cpu(monkeypatch, has_needs=False)
    with pytest.raises(pytest.skip.Exception, match=r"lacks amx-tile: .* died: SIGILL"):
        oracle.require_op("fake op", SIGILL, needs=NEEDS)


def test_sigill_fails_where_the_cpu_has_every_need(required, monkeypatch):
    # e.g. an AMX kernel run without the tile permission: a bug, not this CPU's limit
    _cpu(monkeypatch, has_needs=True)
    with pytest.raises(pytest.fail.Exception, match="died of SIGILL on a CPU that has"):
        oracle.require_op("fake op", SIGILL, needs=NEEDS)


def test_sigill_of_an_op_without_needs_fails_on_its_builds_cpu(required, monkeypatch):
    _cpu(monkeypatch, has_needs=False)
    with pytest.raises(pytest.fail.Exception, match="died of SIGILL"):
        oracle.require_op("fake op", SIGILL)


def test_a_build_that_does_not_load_is_an_absent_oracle(required, monkeypatch):
    dead = vllm.Availability(False, "_C.abi3.so probe exit 1: OSError: undefined symbol")
    monkeypatch.setattr(oracle.vllm, "probe", lambda *a, **k: dead)
    outcome = pytest.fail.Exception if required else pytest.skip.Exception
    with pytest.raises(outcome, match=r"does not load: .*undefined symbol"):
        oracle.require_op("fake op", RAISES)
