"""numkern.warmup's compile helpers: on a cold cache, helper processes compile the
``leaves`` into the disk cache beside the caller's cases; a warm start starts none; a
failing helper is a warning; bad arguments are errors. Each case runs in a child with its
own empty ``NUMBA_CACHE_DIR``."""

import collections
import glob
import json
import os

import pytest

from numkern import warmup as warmup_fn
from numkern.warmup import LEAVES

from .conftest import run_child

CHILD = """
import json, os, sys, warnings
import torch
import numkern
warnings.simplefilter("error")
leaves = json.loads(sys.argv[1]) if len(sys.argv) > 1 else LEAVES_JSON
x = torch.randn(3, 64)
norm = lambda: numkern.norm.rms_norm(torch.empty_like(x), x, torch.ones(64), 1e-6)
t = numkern.warmup(cases=[("rms_norm float32", norm)], leaves=leaves, workers=2, progress=False)
print(json.dumps({"helpers": t.helpers, "compiled": t.compiled, "pid": os.getpid()}))
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
    """``{pid: {(jit function, signature): times compiled}}`` of every process that logged."""
    got = {}
    for path in glob.glob(os.path.join(log, "*.jsonl")):
        pid = int(os.path.basename(path).split(".")[0])
        got[pid] = collections.Counter()
        with open(path, encoding="utf-8") as f:
            for line in f:
                r = json.loads(line)
                # numkern's jit functions (disk-cached); overload implementations
                # (``.impl``, lambdas) are typed inline into each caller, in each process
                if r["fn"].startswith("numkern.") and not r["fn"].endswith((".impl", ">")):
                    got[pid][(r["fn"], r["sig"])] += 1
    return got


def test_helpers_compile_the_leaves_beside_the_cases(tmp_path):
    """The case is an RMS norm; the helper's leaf the packed linear: the helper compiles
    it into the cache while the norm compiles here (each entry once in all: the locks'
    own test is test_compile_cache's); a warm start starts no helper."""
    leaves = [["packed_linear", {"dtype": "bfloat16"}]]
    cold = _run(tmp_path, leaves, tmp_path / "log1")
    assert cold["helpers"] == 1 and cold["compiled"] > 0, cold
    per_pid = _compiles(tmp_path / "log1")
    assert len(per_pid) == 2 and cold["pid"] in per_pid, (cold, list(per_pid))
    ours = per_pid.pop(cold["pid"])
    (helper,) = per_pid.values()
    assert {fn for fn, _ in ours} >= {"numkern.norm._rms_norm"}, ours
    assert any(fn.startswith("numkern.gemm.") for fn, _ in helper), helper
    assert not set(ours) & set(helper), set(ours) & set(helper)
    warm = _run(tmp_path, leaves, tmp_path / "log2")
    assert (warm["helpers"], warm["compiled"]) == (0, 0), warm  # nothing to compile


def test_a_failing_helper_is_a_warning(tmp_path):
    leaves = [["packed_linear", {"dtype": "bfloat17"}]]  # the helper's getattr fails
    with pytest.raises(pytest.fail.Exception, match="compile helper exited with 1"):
        _run(tmp_path, leaves, tmp_path / "log")


def test_bad_arguments():
    with pytest.raises(ValueError, match="leaves: expected"):
        warmup_fn(cases=[], leaves=[("no_such_leaf", {})])
    with pytest.raises(TypeError, match="leaves: attention: missing a required argument"):
        warmup_fn(cases=[], leaves=[("attention", {"dtype": "float32"})])
    with pytest.raises(TypeError, match="leaves: packed_linear: got an unexpected keyword"):
        warmup_fn(cases=[], leaves=[("packed_linear", {"dtype": "float32", "m": 3})])
    with pytest.raises(ValueError, match="workers: expected an int >= 1, got 0"):
        warmup_fn(cases=[], workers=0)
    assert set(LEAVES) == {"quant_blocks", "packed_linear", "attention"}


QUANT = """
import json, os, sys, torch
from numkern.quant import quant_linear
from numkern.warmup import run_leaves
from tests.test_quant_linear import check, make_weight
run_leaves([("quant_blocks", {"dtype": "float32"})])
qw, w = make_weight("Q4_K", 20, 256)
x = torch.randn(3, 256)
out = torch.empty(3, 20)
quant_linear(out, x, qw)
check(out, x, w, None, int8=False)
print("ok")
"""


def test_the_quant_blocks_leaf_is_what_quant_linear_calls(tmp_path):
    """After the leaf, quant_linear (right, against the reference) compiles no block
    kernel of its own: the leaf compiled the entry it loads."""
    env = {"NUMBA_CACHE_DIR": str(tmp_path / "cache"), "NUMKERN_COMPILE_LOG": str(tmp_path / "log")}
    assert run_child(QUANT, env).strip().endswith("ok")
    (counts,) = _compiles(tmp_path / "log").values()
    blocks = [sig for fn, sig in counts if fn == "numkern.quant._kernels.qblocks"]
    assert len(blocks) == 1 and counts[("numkern.quant._kernels.qblocks", blocks[0])] == 1
