"""Packaging habits: a cheap import, warm-up, zero-copy interop, the checking helper."""

import os

import numpy as np
import pytest
import torch

import numkern
from numkern import _check as C

from .conftest import run_child

_IMPORT_COST = """
import time, numba, torch
t = time.perf_counter()
import numkern
dt = time.perf_counter() - t
from numkern import gemm
compiled = sum(len(d.signatures) for d in (gemm._linear, gemm._linear_at, gemm._block))
print(dt, compiled)
"""


def test_import_compiles_nothing_and_is_fast():
    dt, compiled = run_child(_IMPORT_COST).split()
    assert int(compiled) == 0
    assert float(dt) < 1.0, f"import numkern took {float(dt):.2f} s beyond numba and torch"


def test_warmup_compiles_and_reports(capsys):
    timings = numkern.warmup(progress=True)
    assert {"gemm torch.bfloat16", "gemm torch.float16", "gemm torch.float32"} <= set(timings)
    assert all(t >= 0 for t in timings.values())
    assert numkern.gemm._linear_at.signatures  # compiled (or loaded from the disk cache)
    assert "numkern warmup" in capsys.readouterr().err


@pytest.mark.parametrize(
    "dtype,carrier",
    [
        (torch.bfloat16, np.uint16),
        (torch.float16, np.int16),
        (torch.float32, np.float32),
        (torch.int32, np.int32),
        (torch.int64, np.int64),
    ],
)
def test_zero_copy_views(dtype, carrier):
    t = torch.arange(12).reshape(3, 4).to(dtype)
    a = C.as_numpy(t)
    assert a.dtype == carrier and a.shape == (3, 4)
    assert a.__array_interface__["data"][0] == t.data_ptr()  # same memory, no copy
    a[1, 2] = a[0, 1]  # a write through the view is visible in the tensor
    assert t[1, 2] == t[0, 1]
    s = t[:, 1:3]  # strided view stays a view
    assert C.as_numpy(s).__array_interface__["data"][0] == s.data_ptr()


def test_numpy_inputs_and_checks():
    assert C.as_numpy(np.zeros(3, np.float16)).dtype == np.int16
    with pytest.raises(TypeError, match="x: NumPy dtype float64"):
        C.dtype_of("x", np.zeros(3))
    with pytest.raises(TypeError, match=r"y: expected a torch\.Tensor or numpy\.ndarray, got list"):
        C.dtype_of("y", [1.0])
    with pytest.raises(TypeError, match="z: expected dtype bfloat16 or float32, got float16"):
        C.check_dtype("z", torch.zeros(2, dtype=torch.half), (torch.bfloat16, torch.float32))
    with pytest.raises(ValueError, match=r"w: expected shape \[2, \*\], got \[3, 4\]"):
        C.check_shape("w", torch.zeros(3, 4), (2, None))
    with pytest.raises(ValueError, match="v: expected a contiguous tensor"):
        C.check_contiguous("v", torch.zeros(4, 4).T)
    with pytest.raises(ValueError, match="n: expected an int >= 1, got 0"):
        C.check_int("n", 0, low=1)
    meta = torch.zeros(2, device="meta")
    with pytest.raises(TypeError, match="expected a CPU tensor"):
        C.dtype_of("m", meta)


_TREE_CHILD = """
import sys
sys.path.insert(0, {root!r})
from numkern._jit import cache_tree
cache_tree({pkg!r})
from kt import a
print(a.f(3))
"""


def test_cache_follows_callee_edits_in_other_modules(tmp_path):
    # Numba keys a cached function on its own file; numkern stamps a whole kernel tree, so
    # editing a callee in another module recompiles the caller instead of loading stale
    # machine code (which returned the old value here, or crashed on a new signature)
    pkg = tmp_path / "kt"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text(
        "from numkern._jit import jit\nfrom .b import g\n\n\n@jit\ndef f(x):\n    return g(x) + 1\n"
    )
    b_src = "from numkern._jit import jit\n\n\n@jit\ndef g(x):\n    return x * {}\n"
    (pkg / "b.py").write_text(b_src.format(10))
    code = _TREE_CHILD.format(root=str(tmp_path), pkg=str(pkg))
    assert run_child(code).split() == ["31"]
    assert any(p.suffix == ".nbi" for p in (pkg / "__pycache__").iterdir())  # it was cached
    (pkg / "b.py").write_text(b_src.format(100))
    assert run_child(code).split() == ["301"]


def test_cache_tree_rejects_a_missing_directory(tmp_path):
    from numkern._jit import cache_tree

    with pytest.raises(ValueError, match="cache_tree: expected package directories"):
        cache_tree(str(tmp_path / "missing"))


def test_cache_tree_outside_dirs_leave_the_stamp(tmp_path):
    # glue subpackages (numkern's torch_ops and testing) are not in the tree's stamp:
    # editing them recompiles nothing; editing a kernel module still does
    from numkern import _jit

    pkg = tmp_path / "kt2"
    (pkg / "glue").mkdir(parents=True)
    (pkg / "a.py").write_text("x = 1\n")
    (pkg / "glue" / "g.py").write_text("y = 1\n")
    _jit.cache_tree(str(pkg), outside=("glue",))
    root = os.path.realpath(pkg)
    try:
        before = _jit._tree_stamp(root)
        (pkg / "glue" / "g.py").write_text("y = 2\n")
        assert _jit._tree_stamp(root) == before
        assert _jit._tree_of(str(pkg / "glue" / "g.py")) is None  # cached by its own file
        assert _jit._tree_of(str(pkg / "a.py")) == root
        (pkg / "a.py").write_text("x = 2\n")
        assert _jit._tree_stamp(root) != before
        with pytest.raises(ValueError, match="outside= expects subdirectories"):
            _jit.cache_tree(str(pkg), outside=("nope",))
    finally:
        del _jit._TREES[root]
        _jit._OUTSIDE.discard(os.path.realpath(pkg / "glue"))
