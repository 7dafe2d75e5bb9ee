"""numkern.warmup's compile helpers: on a cold cache, helper processes compile the
``leaves`` beside the caller's cases, each entry compiled once among them (the cache's
compile locks); a warm start starts none; a failing helper is a warning; bad arguments
are errors. Each case runs in a child with its own empty ``NUMBA_CACHE_DIR``."""

import collections
import glob
import json
import os

import pytest

from numkern import warmup as warmup_fn
from numkern.warmup import LEAVES

from .conftest import run_child

CHILD = """
import json, sys, warnings
import torch
import numkern
from numkern.warmup import _gemm_run
warnings.simplefilter("error")
leaves = json.loads(sys.argv[1]) if len(sys.argv) > 1 else LEAVES_JSON
t = numkern.warmup(
    cases=[("gemm float32", lambda: (_gemm_run(torch.float32, 1), _gemm_run(torch.float32, 9)))],
    leaves=leaves, workers=2, progress=False,
)
print(json.dumps({"helpers": t.helpers, "compiled": t.compiled}))
"""


def _run(tmp_path, leaves, log):
    env = {
        "NUMBA_CACHE_DIR": str(tmp_path / "cache"),
        "NUMKERN_COMPILE_LOG": str(log),
        "NUMKERN_COMPILE_WORKERS": "",
    }
    code = CHILD.replace("LEAVES_JSON", repr(leaves))
    return json.loads(run_child(code, env).strip().splitlines()[-1])


def _compiles(log):
    """``{(jit function, signature): times compiled}`` over every process that logged."""
    got = collections.Counter()
    for path in glob.glob(os.path.join(log, "*.jsonl")):
        with open(path, encoding="utf-8") as f:
            for line in f:
                r = json.loads(line)
                # numkern's jit functions (disk-cached); overload implementations
                # (``.impl``, lambdas) are typed inline into each caller, in each process
                if r["fn"].startswith("numkern.") and not r["fn"].endswith((".impl", ">")):
                    got[(r["fn"], r["sig"])] += 1
    return got


def test_helpers_compile_beside_the_cases_once_each(tmp_path):
    leaves = [["packed_linear", {"dtype": "float32"}], ["quant_linear", {"dtype": "float32"}]]
    cold = _run(tmp_path, leaves, tmp_path / "log1")
    assert cold["helpers"] == 1 and cold["compiled"] > 0, cold
    counts = _compiles(tmp_path / "log1")
    assert counts and max(counts.values()) == 1, [k for k, n in counts.items() if n > 1]
    names = {fn for fn, _ in counts}
    assert "numkern.gemm._linear" in names, names  # the case's (or a helper's) kernel
    assert "numkern.quant._kernels.qblocks" in names, names  # only a helper runs it
    # the helper's pid logged qblocks: the leaves ran in another process
    pids = {os.path.basename(p) for p in glob.glob(str(tmp_path / "log1" / "*.jsonl"))}
    assert len(pids) == 2, pids
    warm = _run(tmp_path, leaves, tmp_path / "log2")
    assert warm == {"helpers": 0, "compiled": 0}, warm  # nothing to compile: no helper


def test_a_failing_helper_is_a_warning(tmp_path):
    leaves = [["packed_linear", {"dtype": "bfloat17"}]]  # the helper's getattr fails
    with pytest.raises(pytest.fail.Exception, match="compile helper exited with 1"):
        _run(tmp_path, leaves, tmp_path / "log")


def test_bad_arguments():
    with pytest.raises(ValueError, match="leaves: expected"):
        warmup_fn(cases=[], leaves=[("no_such_leaf", {})])
    with pytest.raises(ValueError, match="workers: expected an int >= 1, got 0"):
        warmup_fn(cases=[], workers=0)
    assert set(LEAVES) == {"quant_linear", "packed_linear", "attention"}
