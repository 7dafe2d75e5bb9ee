"""The one jit decorator of numkern.

Every kernel is compiled through :func:`jit` so that caching, the error model and the
fast-math flags are decided in one place:

* ``cache=True``: compiled code lands in ``__pycache__`` next to the module and a later
  process loads it in ~0.3 s instead of compiling for 2-7 s.
* ``error_model="numpy"``: no Python exception checks for division in hot loops.
* ``fastmath``: reassociation and contraction (needed for reductions to vectorise and
  for FMA) but *not* ``nnan``/``ninf``: the attention softmax relies on ``-inf``.
* ``nogil=True``: kernels release the GIL so Python threads can overlap them.
"""

import numba

FASTMATH = frozenset({"reassoc", "contract", "nsz", "arcp"})


def jit(fn=None, *, parallel=False, inline="never"):
    """``numba.njit`` with numkern's settings; ``parallel=True`` for ``prange`` kernels."""
    options = dict(
        cache=True,
        nogil=True,
        error_model="numpy",
        fastmath=set(FASTMATH),
        parallel=parallel,
        inline=inline,
    )
    if fn is None:
        return lambda f: numba.njit(**options)(f)
    return numba.njit(**options)(fn)
