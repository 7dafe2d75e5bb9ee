"""The disk cache of compiled kernels (numkern/_jit.py): damage, a read-only directory,
processes compiling at once, and entries of another CPU.

Each case runs kernels in child processes with their own environment: a temporary
``NUMBA_CACHE_DIR`` and the CPU features the case means to test (an inherited
``NUMKERN_CPU_FEATURES`` is removed). The children import a copy of numkern taken when the
module starts, so the repo's ``__pycache__`` is never touched and an edit to the working
tree during the run (which changes the cache stamp) cannot turn a load into a compile. The
kernels are numkern's RMS norms, the cheapest to compile (about 3 s for both ops in two
dtypes).
"""

import hashlib
import json
import os
import shutil
import stat
import subprocess
import sys

import pytest

from numkern import _jit, isa

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CHILD_TIMEOUT_S = 600  # a cold compile on a busy 2-core machine, with room to spare

# The child: optionally enforces a read-only directory (by an audit hook, since root
# ignores file modes), runs the norms for the dtypes asked, checks them against torch,
# and prints what it compiled, what it loaded and the warnings it saw.
_CHILD = r"""
import json, os, sys, warnings

args = json.loads(sys.argv[1])
if args["read_only"]:
    ro = args["read_only"]
    writes = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC

    def _read_only(event, a):
        if event == "open" and isinstance(a[0], (str, bytes, os.PathLike)) and a[2] & writes:
            path = a[0]
        elif event in ("os.mkdir", "os.remove", "os.rmdir", "os.chmod"):
            path = a[0]
        elif event == "os.rename":
            path = a[1]
        else:
            return
        path = os.path.abspath(os.fsdecode(path))
        if path == ro or path.startswith(ro + os.sep):
            raise PermissionError(13, "Read-only file system (test)", path)

    sys.addaudithook(_read_only)

from numba.core import event

compiles = []


class _Count(event.Listener):
    def on_start(self, ev):
        compiles.append(ev.data["dispatcher"].py_func.__name__)

    def on_end(self, ev):
        pass


event.register("numba:compile", _Count())
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    import torch
    import numkern
    from numba.core.dispatcher import Dispatcher
    from numkern import norm
    from numkern.testing.tolerances import tolerance

    g = torch.Generator().manual_seed(0)
    for name in args["dtypes"]:
        dt = getattr(torch, name)
        x, r = (torch.randn(7, 80, generator=g).to(dt) for _ in range(2))
        w = torch.randn(80, generator=g).to(dt)
        t = tolerance("norm_torch", dt)
        tol = dict(rtol=t.rel, atol=t.abs)

        def ref(v):
            v = v.float()
            return (v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + 1e-6) * w.float()).to(dt)

        out = torch.empty_like(x)
        norm.rms_norm(out, x, w, 1e-6)
        torch.testing.assert_close(out.float(), ref(x).float(), **tol)
        if args["fused"]:
            s = (x.float() + r.float()).to(dt)
            norm.fused_add_rms_norm(x, r, w, 1e-6)
            torch.testing.assert_close(r, s, rtol=0, atol=0)
            torch.testing.assert_close(x.float(), ref(s).float(), **tol)

dispatchers = [d for d in vars(norm).values() if isinstance(d, Dispatcher)]
print(json.dumps({
    "compiled": compiles,
    "loaded": {d.py_func.__name__: sum(d.stats.cache_hits.values()) for d in dispatchers},
    "warnings": [f"{w.category.__name__}: {w.message}" for w in caught],
    "cpu": numkern.isa.describe(),
    "file": numkern.__file__,
}))
"""

# what stays out of a child's environment: it sets the features and cache it tests
_INHERITED_OFF = ("NUMKERN_CPU_FEATURES", "NUMBA_CPU_FEATURES", "NUMBA_CPU_NAME", "NUMBA_CACHE_DIR")
# a mask of a feature this host has (the fallback CI run's): its code differs from the
# unmasked code, so the cache must keep the two apart
MASK = isa.narrower_mask()[0]


def _env(cache_dir, mask):
    env = {k: v for k, v in os.environ.items() if k not in _INHERITED_OFF}
    env["NUMBA_CACHE_DIR"] = str(cache_dir)
    if mask:
        env["NUMKERN_CPU_FEATURES"] = mask
    return env


@pytest.fixture(scope="module")
def src(tmp_path_factory):
    """A copy of numkern (without caches) that the children import."""
    d = tmp_path_factory.mktemp("src")
    ignore = shutil.ignore_patterns("__pycache__")
    shutil.copytree(os.path.join(ROOT, "numkern"), d / "numkern", ignore=ignore)
    return d


def _start(src, cache_dir, *, dtypes=("bfloat16",), fused=False, mask=None, read_only=False):
    cache_dir = os.path.realpath(cache_dir)
    args = dict(dtypes=list(dtypes), fused=fused, read_only=cache_dir if read_only else None)
    proc = subprocess.Popen(
        [sys.executable, "-c", _CHILD, json.dumps(args)],
        cwd=src,  # "" heads sys.path: the copy wins over the editable install
        env=_env(cache_dir, mask),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    proc.src = str(src)
    return proc


def _finish(proc):
    try:
        out, err = proc.communicate(timeout=CHILD_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        pytest.fail(f"cache child hung past {CHILD_TIMEOUT_S} s")
    if proc.returncode != 0:
        pytest.fail(f"cache child failed ({proc.returncode}):\n{err[-4000:]}")
    result = json.loads(out.strip().splitlines()[-1])
    assert result["file"].startswith(proc.src + os.sep), result["file"]
    return result


def _run(src, cache_dir, **kw):
    return _finish(_start(src, cache_dir, **kw))


def _loaded(result):
    return sum(result["loaded"].values())


def _snapshot(root):
    files = {}
    for base, _, names in os.walk(root):
        for name in names:
            path = os.path.join(base, name)
            with open(path, "rb") as f:
                files[os.path.relpath(path, root)] = hashlib.sha256(f.read()).hexdigest()
    return files


def _cache_files(root, suffix, function):
    found = [
        os.path.join(base, n)
        for base, _, names in os.walk(root)
        for n in names
        if n.startswith(f"norm.{function}-") and n.endswith(suffix)
    ]
    assert found, f"no {suffix} file of {function} under {root}"
    return found


@pytest.fixture(scope="module")
def filled(src, tmp_path_factory):
    """A cache written by an unmasked child: both norms in bf16 (each entry a compilation
    of about 1.3 s: one dtype is all the cases below need)."""
    d = tmp_path_factory.mktemp("filled")
    first = _run(src, d, fused=True)
    assert first["compiled"] and not first["warnings"], first
    return d


def _copy(src, dst):
    shutil.copytree(src, dst)
    return dst


def test_read_only_dir_serves_its_entries_and_compiles_the_rest_in_memory(src, filled, tmp_path):
    d = _copy(filled, tmp_path / "ro")
    before = _snapshot(d)
    modes = {p: os.stat(p).st_mode for p in [d, *d.rglob("*")]}
    for p in modes:  # for a non-root user the directory is read-only for real
        os.chmod(p, modes[p] & ~(stat.S_IWUSR | stat.S_IWGRP | stat.S_IWOTH))
    try:
        # bf16 is in the cache; fp16 is not and cannot be written
        res = _run(src, d, dtypes=("bfloat16", "float16"), read_only=True)
    finally:
        for p, mode in modes.items():
            os.chmod(p, mode)
    assert res["loaded"]["_rms_norm"] >= 1, res  # bf16 from the read-only cache
    assert "_rms_norm" in res["compiled"], res  # fp16 compiled in memory
    assert len(res["warnings"]) == 1, res["warnings"]
    assert res["warnings"][0].startswith("CacheWarning: numkern: cannot write"), res
    assert _snapshot(d) == before  # nothing written


def test_damaged_entries_are_misses_and_are_rewritten(src, filled, tmp_path):
    d = _copy(filled, tmp_path / "damaged")
    for path in _cache_files(d, ".nbi", "_rms_norm"):  # an index that does not unpickle
        with open(path, "wb") as f:
            f.write(b"\x80\x05not a numba index")
    for path in _cache_files(d, ".nkc", "_fused_add"):  # truncated data files
        with open(path, "r+b") as f:
            f.truncate(os.path.getsize(path) // 2)
    res = _run(src, d, fused=True)  # results checked in the child
    assert {"_rms_norm", "_fused_add"} <= set(res["compiled"]), res
    assert res["loaded"]["_rms_norm"] == 0 and res["loaded"]["_fused_add"] == 0, res
    assert len(res["warnings"]) == 1, res["warnings"]
    assert res["warnings"][0].startswith("CacheWarning: numkern: cannot read"), res
    again = _run(src, d, fused=True)
    assert again["compiled"] == [] and not again["warnings"], again  # rewritten
    assert again["loaded"]["_rms_norm"] == 1 and again["loaded"]["_fused_add"] == 1, again


def test_two_processes_compiling_at_once_leave_a_cache_both_can_use(src, tmp_path):
    # opposite dtype orders, so the two add different entries to one index at once
    a = _start(src, tmp_path, dtypes=("bfloat16", "float32"), fused=True)
    b = _start(src, tmp_path, dtypes=("float32", "bfloat16"), fused=True)
    ra, rb = _finish(a), _finish(b)
    assert not ra["warnings"] and not rb["warnings"], (ra, rb)
    third = _run(src, tmp_path, dtypes=("float32", "bfloat16"), fused=True)
    assert third["compiled"] == [] and not third["warnings"], third
    assert third["loaded"]["_rms_norm"] == 2 and third["loaded"]["_fused_add"] == 2, third


def test_processes_missing_the_same_entry_compile_it_once(src, tmp_path):
    """Started together on an empty cache with the same kernels in the same order, the
    two children meet on every entry: under its compile lock one compiles it and the other
    loads it (each entry compiled once in all: numkern/_jit.py's _TreeCache)."""
    a = _start(src, tmp_path, dtypes=("bfloat16", "float32"), fused=True)
    b = _start(src, tmp_path, dtypes=("bfloat16", "float32"), fused=True)
    ra, rb = _finish(a), _finish(b)
    assert not ra["warnings"] and not rb["warnings"], (ra, rb)
    for fn in ("_rms_norm", "_fused_add"):
        compiled = ra["compiled"].count(fn) + rb["compiled"].count(fn)
        assert compiled == 2, (fn, ra, rb)  # one entry per dtype, in one of the two
        assert ra["loaded"][fn] + rb["loaded"][fn] == 2, (fn, ra, rb)


@pytest.mark.skipif(MASK is None, reason=isa.narrower_mask()[1])
def test_entries_of_other_cpu_features_are_not_loaded(src, filled, tmp_path):
    # masked on the unmasked child's cache, and unmasked on a masked child's cache: each
    # compiles, loading nothing; afterwards both kinds of entries serve their own CPU. The
    # children of a step need nothing of each other and run at once (two steps, not four)
    theirs = _copy(filled, tmp_path / "unmasked_first")
    masked = _start(src, theirs, mask=MASK)
    fresh = _run(src, tmp_path / "masked_first", mask=MASK)
    masked = _finish(masked)
    assert "masked by NUMKERN_CPU_FEATURES" in masked["cpu"], masked
    assert masked["compiled"] and _loaded(masked) == 0, masked
    assert fresh["compiled"], fresh
    unmasked = _start(src, tmp_path / "masked_first")
    both = {mask: _start(src, theirs, mask=mask) for mask in (None, MASK)}
    unmasked = _finish(unmasked)
    assert unmasked["compiled"] and _loaded(unmasked) == 0, unmasked
    for mask, proc in both.items():
        res = _finish(proc)
        assert res["compiled"] == [] and _loaded(res) >= 1, (mask, res)


def test_an_entry_file_written_for_another_key_is_a_miss(tmp_path):
    # what Numba's unlocked numbering could leave behind: the index names a file that
    # holds another entry's code
    files = _jit._EntryFiles(str(tmp_path), "f-1.py311", source_stamp=b"stamp")
    files.save(("sig a", "cpu a"), "code a")
    files.save(("sig b", "cpu b"), "code b")
    assert files.load(("sig a", "cpu a")) == "code a"
    index = files._load_index()
    a, b = index[("sig a", "cpu a")], index[("sig b", "cpu b")]
    assert a != b
    os.replace(tmp_path / b, tmp_path / a)
    assert files.load(("sig a", "cpu a")) is None
    assert files.load(("sig c", "cpu a")) is None
