"""numkern's start-up, run once per process before any of its kernels exists.

* :func:`numkern.isa._host` reads the CPU's features and hands a ``NUMKERN_CPU_FEATURES``
  mask to Numba's target string. It must run before Numba's code generator exists, and
  the first kernel module creates it (defining a kernel or an overload does; so does any
  compilation): a mask that arrived later would be a ``RuntimeError``.
* :func:`numkern._threads.require_threadsafe_layer` narrows Numba's threading layer to
  one that takes launches from several Python threads, before numkern's first parallel
  launch.

* :func:`numkern._compile_log.install_from_env` logs each compilation where
  ``NUMKERN_COMPILE_LOG`` names a directory (the test suite's compile report).

``import numkern`` stays cheap (no torch, no Numba), so this module is imported by the
two modules every kernel module goes through, :mod:`numkern._jit` and
:mod:`numkern.simd`, ahead of any kernel definition or type registration; and by
``import numkern`` itself when a mask is set (it must reach Numba before the caller's
own Numba code compiles) or Numba is already imported (the caller may compile or launch
next). A failure (a bad mask, a workqueue layer) leaves this module unimported, so the
next import raises it again.
"""

from . import isa

isa._host()

# isort: split
from . import _threads  # noqa: E402  (imports Numba: after the mask reached its config)

_threads.require_threadsafe_layer()

# isort: split
from . import _compile_log  # noqa: E402

_compile_log.install_from_env()  # NUMKERN_COMPILE_LOG: where compile time goes
