"""The one jit decorator of numkern.

Every kernel is compiled through :func:`jit` so that caching, the error model and the
fast-math flags are decided in one place:

* a disk cache: compiled code lands in ``__pycache__`` next to the module (or under
  ``NUMBA_CACHE_DIR``) and a later process loads it in ~0.3 s instead of compiling for
  2-7 s.
* ``error_model="numpy"``: no Python exception checks for division in hot loops.
* ``fastmath``: reassociation and contraction (needed for reductions to vectorise and
  for FMA) but *not* ``nnan``/``ninf``: the attention softmax relies on ``-inf``.
* ``nogil=True``: kernels release the GIL so Python threads can overlap them.

Numba keys a cached function on its own file only: when a kernel it calls changes in
another module, the stale machine code is still loaded (it may then call with an old
signature and crash). So the cache entries of a kernel tree (numkern; a package of a
user's own kernels that call numkern's registers itself with :func:`cache_tree`) are
stamped with the contents of every module of the tree and of the trees it depends on:
any edit there recompiles them. A tree's kernels are cached only where the stamp goes
with them (``NUMBA_CACHE_DIR``, else the tree's ``__pycache__``, else the user-wide
Numba cache), never in a location Numba would stamp by the function's own file.

A kernel defined in a notebook cell or at an IPython prompt compiles in memory, never from
the disk cache: Numba keys such an entry by the function's own source text only, so after a
global it reads (a tile size) or a kernel it calls (in another cell, or in numkern)
changed, running the cell again would load the old machine code (seen with
``numba.njit(cache=True)`` as well). Such a kernel compiles again each time its cell runs
(a second or two).

A cache entry is keyed, as in Numba, by the signature, the bytecode and the code
generator's target: the LLVM triple, the CPU name and the CPU feature string it compiles
for. ``NUMKERN_CPU_FEATURES`` changes that feature string (:mod:`numkern.isa` hands the
masked string to Numba before its first compilation), so a masked process and an
unmasked one, or two CPUs with different features, never load each other's entries.

The cache never makes a kernel fail. Where the cache cannot be written (a read-only
``NUMBA_CACHE_DIR``, which still serves the entries it holds; a full disk) or an entry
cannot be read (a damaged file), kernels compile in memory and the process warns once
(:class:`CacheWarning`, an exception only where a warnings filter says "error"); a
damaged entry is rewritten by the next save. The kernels of a registered tree use
numkern's own index and data files (:class:`_EntryFiles`), safe for several processes
compiling at once.
"""

import contextlib
import functools
import hashlib
import itertools
import os
import warnings

import numba
from numba.core import caching, event

from . import _boot  # noqa: F401  (numkern's start-up, before any kernel is defined)

try:
    import fcntl
except ImportError:  # not POSIX: index updates go unlocked (Numba's own behaviour)
    fcntl = None

_TREES = {}  # package directory -> directories whose sources stamp its cache entries
_OUTSIDE = set()  # subdirectories of a tree that hold no kernels: not in its stamp


def cache_tree(path, *depends, outside=()):
    """Stamp the cache entries of kernels under ``path`` with its sources and those of
    ``depends`` (package directories). ``outside`` names subdirectories of ``path`` with
    Python glue only (no kernel of the tree calls into them): editing them recompiles
    nothing, and a kernel defined there is cached like any kernel outside a tree (stamped
    by its own file)."""
    dirs = [os.path.realpath(d) for d in (path, *depends)]
    for d in dirs:
        if not os.path.isdir(d):
            raise ValueError(f"cache_tree: expected package directories, got {d!r}")
    for sub in outside:
        d = os.path.realpath(os.path.join(dirs[0], sub))
        if not os.path.isdir(d):
            raise ValueError(
                f"cache_tree: outside= expects subdirectories of {path!r}, got {sub!r}"
            )
        _OUTSIDE.add(d)
    _TREES[dirs[0]] = tuple(dirs)


def _is_outside(d):
    return any(d == o or d.startswith(o + os.sep) for o in _OUTSIDE)


@functools.cache
def _file_digest(path, mtime_ns, size):
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).digest()


def _tree_of(py_file):
    d = os.path.dirname(os.path.realpath(py_file))
    if _is_outside(d):
        return None
    for root in _TREES:
        if d == root or d.startswith(root + os.sep):
            return root
    return None


def _tree_stamp(root):
    h = hashlib.sha256()
    for top in _TREES[root]:
        for base, dirs, files in os.walk(top):
            dirs[:] = sorted(
                x for x in dirs if x != "__pycache__" and not _is_outside(os.path.join(base, x))
            )
            for name in sorted(files):
                if name.endswith(".py"):
                    f = os.path.join(base, name)
                    st = os.stat(f)
                    h.update(os.path.relpath(f, top).encode())
                    h.update(_file_digest(f, st.st_mtime_ns, st.st_size))
    return h.digest()


# ---------------------------------------------------------------------------------------
# when the cache fails: one warning per process


class CacheWarning(UserWarning):
    """numkern's disk cache could not be read or written; kernels compile in memory."""


_warned = False


def _warn_once(what, path, exc):
    """Warn about the first cache failure of the process; later ones stay quiet (a
    read-only directory fails for every kernel, and one line says it)."""
    global _warned
    if _warned:
        return
    _warned = True
    warnings.warn(
        f"numkern: cannot {what} the kernel cache at {path} ({type(exc).__name__}: {exc}); "
        f"kernels compile in memory (further cache failures in this process are not reported)",
        CacheWarning,
        stacklevel=2,
    )


# ---------------------------------------------------------------------------------------
# where a tree's kernels are cached


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


class _TreeUserWideLocator(_TreeStamped, caching.UserWideCacheLocator):
    pass


class _TreeUserDirLocator(_TreeUserLocator):
    """``NUMBA_CACHE_DIR`` for numkern's own caches, also when it cannot be written: the
    user chose it, so a read-only one still serves the entries it holds (a cache built
    into an image) and the kernels it lacks compile in memory rather than land somewhere
    else. (Numba's own caches skip a read-only one: see :class:`_TreeUserLocator`.)"""

    @classmethod
    def from_function(cls, py_func, py_file):
        if not numba.config.CACHE_DIR or _tree_of(py_file) is None:
            return None
        return cls(py_func, py_file)


class _NoTreeLocator(RuntimeError):
    """No location for a tree's cache entries can be written."""


class _TreeNoLocator:
    """After the tree's locators: a tree's kernel must not fall through to Numba's own
    locators, whose entries are stamped by the function's file only."""

    @classmethod
    def from_function(cls, py_func, py_file):
        if _tree_of(py_file) is None:
            return None
        raise _NoTreeLocator(
            f"no writable cache location for {py_file} (NUMBA_CACHE_DIR, its __pycache__ "
            f"and the user-wide Numba cache)"
        )


_TREE_LOCATORS = (_TreeUserLocator, _TreeInTreeLocator, _TreeUserWideLocator, _TreeNoLocator)
# Numba's own caches (``numba.njit(cache=True)`` in a registered tree) find these first.
caching.CacheImpl._locator_classes[:0] = _TREE_LOCATORS
# the torch custom ops and the testing helpers call kernels from Python only
cache_tree(os.path.dirname(__file__), outside=("testing", "torch_ops"))


# ---------------------------------------------------------------------------------------
# the files of a cache


class _EntryFiles(caching.IndexDataCacheFile):
    """Numba's index and data files of one function, safe with concurrent writers and
    damaged files.

    Numba reads the index, picks the first free data-file number and writes the index and
    the data without a lock, so two processes adding different entries at once (other
    signatures, other CPU features) can both take number 1: the index then names one
    entry's file while the file holds the other's machine code, which a later process
    runs for the wrong signature or CPU. Here an entry is added under a lock on the
    directory (data first, then the index), and a data file holds the stamp and key it
    was written for, checked on load. An unreadable index or data file is a miss (one
    :class:`CacheWarning`) that the next save overwrites. Data files end in ``.nkc``, not
    Numba's ``.nbc``, so that a process running Numba's own format never reads one.
    """

    def __init__(self, cache_path, filename_base, source_stamp):
        super().__init__(cache_path, filename_base, source_stamp)
        self._data_name_pattern = f"{filename_base}.{{number:d}}.nkc"

    def save(self, key, data):
        blob = self._dump((self._source_stamp, key, data))
        with self._index_lock():
            overloads = self._load_index()
            name = overloads.get(key)
            if name is None:
                taken = set(overloads.values())
                name = next(n for n in map(self._data_name, itertools.count(1)) if n not in taken)
            with self._open_for_write(self._data_path(name)) as f:
                f.write(blob)
            if overloads.get(key) != name:
                overloads[key] = name
                self._save_index(overloads)

    def load(self, key):
        name = self._load_index().get(key)
        if name is None:
            return None
        try:
            stamp, saved_key, data = self._load_data(name)
        except FileNotFoundError:  # removed since the index named it
            return None
        except Exception as exc:  # any damage to a file is a miss, never a failed call
            _warn_once("read", self._data_path(name), exc)
            return None
        if stamp != self._source_stamp or saved_key != key:  # written for another entry
            return None
        return data

    def _load_index(self):
        try:
            overloads = super()._load_index()  # {} when absent, stale or of another Numba
        except Exception as exc:
            _warn_once("read", self._index_path, exc)
            return {}
        if not isinstance(overloads, dict):
            _warn_once("read", self._index_path, TypeError("the index is not a dict"))
            return {}
        return overloads

    @contextlib.contextmanager
    def _index_lock(self):
        if fcntl is None:
            yield
            return
        # one lock file per directory: entries are added rarely and quickly
        with open(os.path.join(self._cache_path, ".numkern-cache.lock"), "a") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(f, fcntl.LOCK_UN)


class _TreeImpl(caching.CompileResultCacheImpl):
    _locator_classes = (_TreeUserDirLocator, *_TREE_LOCATORS[1:])


class _TreeCache(caching.FunctionCache):
    """Numba's per-function cache, for a registered tree: its locators only, with
    :class:`_EntryFiles`; a failure to load or save is a compile in memory and one
    warning. A miss is compiled under a lock per entry: of several processes that miss
    the same entry at once (xdist workers, an engine's compile workers), one compiles it
    and the others load it (Numba's compiler lock serialises the compilations within a
    process; across processes the call graph is acyclic, so waits cannot cycle)."""

    _impl_class = _TreeImpl

    def __init__(self, py_func):
        super().__init__(py_func)
        self._held = {}  # signature -> its compile lock's open file, from miss to save
        numba_files = self._cache_file
        self._cache_file = _EntryFiles(
            cache_path=self._cache_path,
            filename_base=self._impl.filename_base,
            source_stamp=numba_files._source_stamp,  # the tree's, computed once
        )

    def _load(self, sig, target_context):
        try:
            return super().load_overload(sig, target_context)
        except CacheWarning:  # raised by a warnings filter ("error"): the caller's choice
            raise
        except Exception as exc:  # an entry that does not rebuild is compiled again
            _warn_once("load from", self._cache_path, exc)
            return None

    def load_overload(self, sig, target_context):
        """The entry of ``sig``; on a miss, first the entry's compile lock (see
        :meth:`_compile_lock`): when another process was compiling it, its entry is
        loaded once that process has saved it, instead of being compiled twice."""
        data = self._load(sig, target_context)
        if data is not None or not self._enabled or fcntl is None:
            return data
        key = self._index_key(sig, target_context.codegen())
        if not self._compile_lock(sig, key):
            return None
        data = self._load(sig, target_context)
        if data is not None:
            self._unlock(sig)
        return data

    def _compile_lock(self, sig, key):
        """Take the lock file of one entry (its key's hash, beside the index), waiting
        while another process holds it; held from a miss until the entry is saved (or
        the process ends: the OS releases it). True when held."""
        if sig in self._held:  # a compilation of ours that failed earlier: still ours
            return True
        name = hashlib.sha256(repr(key).encode()).hexdigest()[:20]
        try:
            self._impl.locator.ensure_cache_path()
            f = open(os.path.join(self._cache_path, f".{name}.compiling"), "a")
        except OSError:  # a read-only cache: compile without the lock
            return False
        fcntl.flock(f, fcntl.LOCK_EX)
        self._held[sig] = f
        return True

    def _unlock(self, sig):
        f = self._held.pop(sig, None)
        if f is not None:
            fcntl.flock(f, fcntl.LOCK_UN)
            f.close()

    def save_overload(self, sig, data):
        try:
            super().save_overload(sig, data)
        except OSError as exc:  # read-only, full disk: stop trying for this function
            _warn_once("write", self._cache_path, exc)
            self.disable()
        finally:
            self._unlock(sig)


class _ReleaseOnFailure(event.Listener):
    """A compilation that raises (a typing error a test provokes) never reaches
    ``save_overload``: its compile locks are released here, so no other process waits
    on them until this one exits."""

    def on_start(self, ev):
        pass

    def on_end(self, ev):
        # (Numba 0.68's Event.is_failed is True when *no* exception came: read the
        # details themselves, None unless the compilation raised)
        if getattr(ev, "_exc_details", None) is not None:
            cache = getattr(ev.data.get("dispatcher"), "_cache", None)
            if isinstance(cache, _TreeCache):
                for sig in list(cache._held):
                    cache._unlock(sig)


event.register("numba:compile", _ReleaseOnFailure())


def _typed_in_ipython(py_file):
    """Whether a function was defined in a notebook cell or at an IPython prompt (Numba's
    rule for its IPython cache locator)."""
    folder = os.path.basename(os.path.dirname(py_file))  # ipykernel's /tmp/ipykernel_<pid>/
    return py_file.startswith("<ipython-") or folder.startswith("ipykernel_")


def _cache_of(py_func):
    """The disk cache of a kernel: :class:`_TreeCache` for a registered tree, Numba's
    own elsewhere (a test module's kernels), in memory only when neither has a place or
    the kernel was defined in a notebook cell (see the module docstring)."""
    if _typed_in_ipython(py_func.__code__.co_filename):
        return caching.NullCache()
    try:
        if _tree_of(py_func.__code__.co_filename) is not None:
            return _TreeCache(py_func)
        return caching.FunctionCache(py_func)
    except RuntimeError as exc:  # no location (_NoTreeLocator or Numba's own error)
        _warn_once("place", numba.config.CACHE_DIR or "any location", exc)
        return caching.NullCache()


FASTMATH = frozenset({"reassoc", "contract", "nsz", "arcp"})


def jit(fn=None, *, parallel=False, inline="never"):
    """``numba.njit`` with numkern's settings; ``parallel=True`` for ``prange`` kernels."""
    options = dict(
        nogil=True,
        error_model="numpy",
        fastmath=set(FASTMATH),
        parallel=parallel,
        inline=inline,
    )

    def compile_(f):
        dispatcher = numba.njit(**options)(f)
        # what ``cache=True`` does (Dispatcher.enable_caching), with numkern's cache
        dispatcher._cache = _cache_of(dispatcher.py_func)
        return dispatcher

    return compile_ if fn is None else compile_(fn)
