"""The one jit decorator of numkern.

Every kernel is compiled through :func:`jit` so that caching, the error model and the
fast-math flags are decided in one place:

* ``cache=True``: compiled code lands in ``__pycache__`` next to the module and a later
  process loads it in ~0.3 s instead of compiling for 2-7 s.
* ``error_model="numpy"``: no Python exception checks for division in hot loops.
* ``fastmath``: reassociation and contraction (needed for reductions to vectorise and
  for FMA) but *not* ``nnan``/``ninf``: the attention softmax relies on ``-inf``.
* ``nogil=True``: kernels release the GIL so Python threads can overlap them.

Numba keys a cached function on its own file only: when a kernel it calls changes in
another module, the stale machine code is still loaded (it may then call with an old
signature and crash). So the cache entries of a kernel tree (numkern; a package of a
user's own kernels that call numkern's registers itself with :func:`cache_tree`) are
stamped with the contents of every module of the tree and of the trees it depends on:
any edit there recompiles them.
"""

import functools
import hashlib
import os

import numba
from numba.core import caching

_TREES = {}  # package directory -> directories whose sources stamp its cache entries


def cache_tree(path, *depends):
    """Stamp the cache entries of kernels under ``path`` with its sources and those of
    ``depends`` (package directories)."""
    dirs = [os.path.realpath(d) for d in (path, *depends)]
    for d in dirs:
        if not os.path.isdir(d):
            raise ValueError(f"cache_tree: expected package directories, got {d!r}")
    _TREES[dirs[0]] = tuple(dirs)


@functools.cache
def _file_digest(path, mtime_ns, size):
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).digest()


def _tree_of(py_file):
    d = os.path.dirname(os.path.realpath(py_file))
    for root in _TREES:
        if d == root or d.startswith(root + os.sep):
            return root
    return None


def _tree_stamp(root):
    h = hashlib.sha256()
    for top in _TREES[root]:
        for base, dirs, files in os.walk(top):
            dirs[:] = sorted(x for x in dirs if x != "__pycache__")
            for name in sorted(files):
                if name.endswith(".py"):
                    f = os.path.join(base, name)
                    st = os.stat(f)
                    h.update(os.path.relpath(f, top).encode())
                    h.update(_file_digest(f, st.st_mtime_ns, st.st_size))
    return h.digest()


class _TreeStamped:
    """A cache locator for kernels of a registered tree, stamped by the whole tree."""

    def get_source_stamp(self):
        return _tree_stamp(_tree_of(self._py_file))

    @classmethod
    def from_function(cls, py_func, py_file):
        if _tree_of(py_file) is None:
            return None
        return super().from_function(py_func, py_file)


class _TreeUserLocator(_TreeStamped, caching.UserProvidedCacheLocator):
    pass


class _TreeInTreeLocator(_TreeStamped, caching.InTreeCacheLocator):
    pass


caching.CacheImpl._locator_classes[:0] = [_TreeUserLocator, _TreeInTreeLocator]
cache_tree(os.path.dirname(__file__))

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
