"""tests/oracle.py's policy, with fake probes run in real children that loaded vLLM's
native build: a probe that raises or dies of another signal fails, SIGILL skips only on a
CPU that lacks a feature the op needs, a build that does not load is an absent oracle."""

import os

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


# an op of no build: its probe fails with AttributeError in the child
MISSING = "torch.ops._C.weight_packed_linear_xyz(torch.ones(1))"


def test_an_op_this_build_lacks_but_another_has_skips(required, monkeypatch):
    # e.g. _C_AVX2 (an AVX2-only CPU's build) without the packed linear, which _C has
    real = oracle.vllm.op_names
    other = next(b for b in vllm.LIBRARIES if b != oracle.native_library())

    def names(lib=None):
        return real(lib) | ({"weight_packed_linear_xyz"} if lib == other else set())

    monkeypatch.setattr(oracle.vllm, "op_names", names)
    with pytest.raises(
        pytest.skip.Exception, match=rf"has no weight_packed_linear_xyz \(only {other}"
    ):
        oracle.require_op("fake op", MISSING)


def test_an_op_no_build_has_fails(required):
    with pytest.raises(pytest.fail.Exception, match="weight_packed_linear_xyz: no vLLM build has"):
        oracle.require_op("fake op", MISSING)


def test_a_refusal_of_this_build_on_this_cpu_skips(required, monkeypatch):
    # e.g. _C_AVX2's "Unsupported CPU attention configuration" for the amx layout
    monkeypatch.setitem(oracle.REFUSALS, oracle.native_library(), ("refuses this CPU",))
    with pytest.raises(pytest.skip.Exception, match="refuses fake op on this CPU"):
        oracle.require_op("fake op", "raise RuntimeError('the op refuses this CPU')")
    with pytest.raises(pytest.fail.Exception, match="not by a CPU limit"):
        oracle.require_op("fake op", RAISES)  # any other message still fails


def test_every_difference_is_in_the_docs_table():
    with open(os.path.join(os.path.dirname(__file__), "..", "docs", "kernels.md")) as f:
        table = f.read().split("### 9.1")[1].split("## 10.")[0]
    for diff in oracle.DIFFERENCES:
        for op in diff.ops:
            assert f"`{op}`" in table, op
        for build in diff.builds:
            assert f"`{build.split('.')[0]}`" in table, build
