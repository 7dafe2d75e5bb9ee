"""Numba's threading layer for numkern: one that takes launches from several threads.

numkern's kernels release the GIL (``nogil=True``), so two Python threads can start
parallel regions at the same time. Numba's ``tbb`` and ``omp`` layers take that; its
``workqueue`` layer aborts the process (numba#8563, #10565). Numba picks the layer at its
first parallel launch from ``NUMBA_THREADING_LAYER``, by default ``tbb``, then ``omp``,
then ``workqueue``: on a machine with neither TBB nor an OpenMP runtime the default ends
on ``workqueue`` without a word. So at import numkern narrows the default to
``threadsafe`` (``tbb`` or ``omp``; with neither, the first parallel kernel raises Numba's
"No threading layer could be loaded") and refuses a setting or a running layer that can
be ``workqueue``.
"""

import numba
from numba.np.ufunc import parallel

THREADSAFE = ("tbb", "omp")  # the layers that take concurrent launches
# NUMBA_THREADING_LAYER values that never end on workqueue ("default" is narrowed)
SETTINGS = ("default", "threadsafe", "safe", "tbb", "omp")


def require_threadsafe_layer():
    """Make Numba's threading layer ``tbb`` or ``omp``; RuntimeError when it cannot be."""
    why = (
        "numkern's kernels run from several Python threads at once, and workqueue aborts "
        "the process when two of them start parallel regions"
    )
    if parallel._is_initialized:  # launched before numkern was imported: check what runs
        layer = numba.threading_layer()
        if layer not in THREADSAFE:
            raise RuntimeError(
                f"numba.threading_layer(): expected tbb or omp ({why}), got {layer!r}; "
                f"import numkern before the first parallel Numba call, or set "
                f"NUMBA_THREADING_LAYER=threadsafe"
            )
        return
    setting = str(numba.config.THREADING_LAYER).lower()
    if setting == "default":
        numba.config.THREADING_LAYER = "threadsafe"
    elif setting not in SETTINGS:
        raise RuntimeError(
            f"NUMBA_THREADING_LAYER: expected one of {SETTINGS} ({why}), got {setting!r}"
        )
