"""AMX-INT8 tiles for the quantised weights (``numkern.amx.tile_dpbssd`` / ``tile_dpbusd``,
``numkern.quant._kernels.qtiles``; docs/kernels.md §4.4, §13.8).

Every host runs the int8 tile kernels on emulated tiles (``NUMKERN_AMX_EMULATE=1``): the
primitives against NumPy's integer products, and ``quant_linear`` and the quantised fused
MoE against the vector int8 path of the same call. Both
take exact integer sums per scale group and apply the scales in the same order, so they
agree bit for bit (and the vector path is held to the fp64 reference by
test_quant_linear and test_quant_moe). An AMX host runs the same on its tiles. The
assembly for a CPU with tiles is read on every host (a child compiles for
``sapphirerapids``; nothing runs); masked features and a refused permission, and the
tiles beside torch's and vLLM's in the same threads, as test_amx does for bf16.
"""

import json
import threading

import numpy as np
import pytest
import torch

from numkern import amx, isa
from numkern._jit import jit
from numkern.quant import QUANT_TYPES, formats, repack
from numkern.quant.linear import quant_linear
from numkern.simd_int8 import EMULATED_VECTOR_PATH
from numkern.testing.quantize import quantize

from .conftest import run_child
from .test_amx import REFUSE_GRANT, codegen_counts

REAL = isa.quant_path()[0] == "amx"  # this CPU's quantised GEMMs run on int8 tiles
needs_tiles = pytest.mark.skipif(
    not REAL, reason=f"no AMX-INT8 tiles in use on this CPU (quant path {isa.quant_path()[0]!r})"
)
# the vector path the tiles are compared with: the amx path's own below 5 rows
VEC = "vnni512" if REAL else EMULATED_VECTOR_PATH
needs_int8 = pytest.mark.skipif(
    isa.quant_path()[0] == "fp32", reason="no int8 vector path on this CPU (emulated amx refused)"
)
EMULATE = [True, pytest.param(False, marks=needs_tiles)]


def _on(monkeypatch, emulate):
    if emulate:
        monkeypatch.setenv(isa.AMX_EMULATE_ENV, "1")
    else:
        monkeypatch.delenv(isa.AMX_EMULATE_ENV, raising=False)


# --- the primitives --------------------------------------------------------------------


@jit
def int8_product(ctx, a, b, c, m, kb, signed_a):
    """``c[m, 16] += a[m, kb] @ b`` (int32; ``b`` in quads ``[kb/4][16][4]``) with the
    primitives alone: ``tdpbssd`` (``signed_a``) or ``tdpbusd`` (``a``'s bytes unsigned)."""
    amx.tile_shape(ctx, 0, m, kb)
    amx.tile_shape(ctx, 1, kb // 4, 64)
    amx.tile_shape(ctx, 2, m, 64)
    amx.tile_begin(ctx)
    amx.tile_load(ctx, 0, a, 0, kb)
    amx.tile_load(ctx, 1, b, 0, 64)
    amx.tile_load(ctx, 2, c, 0, 64)
    if signed_a:
        amx.tile_dpbssd(ctx, 2, 0, 1)
    else:
        amx.tile_dpbusd(ctx, 2, 0, 1)
    amx.tile_store(ctx, 2, c, 0, 64)
    amx.tile_end(ctx)


# (emulate, signed a, rows, K bytes): each value once
PRIMITIVE_CASES = [
    (True, True, 16, 64),
    (True, False, 5, 32),
    pytest.param(False, True, 7, 16, marks=needs_tiles),
    pytest.param(False, False, 16, 64, marks=needs_tiles),
]


@pytest.mark.parametrize("emulate,signed_a,m,kb", PRIMITIVE_CASES)
def test_int8_primitives_match_numpy(emulate, signed_a, m, kb):
    """Signed x signed and unsigned x signed bytes, full and short tiles, K 16-64 bytes,
    accumulated onto a C tile of random int32 (extremes included): exactly NumPy's."""
    rng = np.random.default_rng(m * kb)
    a = rng.integers(-128, 128, (m, kb)).astype(np.int8)
    a[0, :4] = -128  # the extremes, whose products need the full int32
    b = rng.integers(-128, 128, (kb // 4, 16, 4)).astype(np.int8)
    b[0, 0] = -128
    c0 = rng.integers(-(1 << 20), 1 << 20, (m, 16)).astype(np.int32)
    c = c0.copy()
    int8_product(amx.new_context(emulate), a.ravel(), b.ravel(), c.ravel(), m, kb, signed_a)
    av = a.astype(np.int64) if signed_a else a.view(np.uint8).astype(np.int64)
    want = c0 + av @ b.transpose(0, 2, 1).reshape(kb, 16).astype(np.int64)
    assert np.array_equal(c, want)


def test_int8_products_need_three_different_tiles():
    @jit
    def same(ctx):
        amx.tile_dpbssd(ctx, 1, 1, 2)

    with pytest.raises(Exception, match="three different tiles"):
        same(amx.new_context(True))


# --- the quantised linear on tiles ------------------------------------------------------


def _weight(qtype, n, k, seed):
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((n, k)).astype(np.float32) * 0.05
    return repack(quantize(w, qtype), qtype, (n, k))


def _linear(x, qw, bias, path):
    out = torch.full((x.shape[0], qw.shape[0]), float("nan"), dtype=x.dtype)
    quant_linear(out, x, qw, bias, path=path)
    return out


# M: 5 (one short row tile), 16, 20 (a last tile overlapping the one before), 77; N with a
# partial row block; K two or more K slices (1024) where the type allows, an odd number
# of scale groups; bias and a row stride alternating
M_OF = {t: (5, 16, 20, 77)[i % 4] for i, t in enumerate(QUANT_TYPES)}


@needs_int8
@pytest.mark.parametrize("emulate", EMULATE)
@pytest.mark.parametrize("qtype", QUANT_TYPES)
def test_quant_linear_on_tiles_equals_the_vector_path(qtype, emulate, monkeypatch):
    """Every type, bf16 x: the tiles' result (M > 4) bit for bit the vector int8 path's."""
    i = QUANT_TYPES.index(qtype)
    m = M_OF[qtype]
    block = int(formats.BLOCK[formats.CODE[qtype]])
    k = block * (35 if block == 32 else 5)  # 1120 or 1280: two K slices
    n = 21 + 16 * (i % 3)
    qw = _weight(qtype, n, k, seed=i)
    x = torch.randn(m, k + 24, generator=torch.Generator().manual_seed(i)).bfloat16()
    x = x[:, 8 : 8 + k] if i % 2 else x[:, :k].contiguous()
    bias = torch.randn(n) if i % 2 == 0 else None
    want = _linear(x, qw, bias, VEC)
    _on(monkeypatch, emulate)
    got = _linear(x, qw, bias, "amx")
    assert torch.isfinite(got).all()
    assert torch.equal(got, want), float((got.float() - want.float()).abs().max())


@needs_int8
def test_amx_path_below_five_rows_is_the_vector_path(monkeypatch):
    """M <= 4 under ``path="amx"``: the vector path's code (decode never touches tiles)."""
    qw = _weight("Q4_K", 40, 512, seed=3)
    x = torch.randn(4, 512).bfloat16()
    _on(monkeypatch, True)
    assert torch.equal(_linear(x, qw, None, "amx"), _linear(x, qw, None, VEC))


def test_amx_path_is_refused_where_it_cannot_run(monkeypatch):
    """``path="amx"`` without AMX-INT8 and without the test-only emulation: a ValueError
    naming the path (and never for fp32 x: those are never quantised)."""
    qw = _weight("Q8_0", 16, 64, seed=0)
    monkeypatch.delenv(isa.AMX_EMULATE_ENV, raising=False)
    if not REAL:
        with pytest.raises(ValueError, match="'amx' cannot run on this CPU"):
            _linear(torch.randn(8, 64).bfloat16(), qw, None, "amx")
    _on(monkeypatch, True)  # the path allowed (emulated where no tiles): fp32 x refused
    if isa.quant_path()[0] != "fp32":
        with pytest.raises(ValueError, match="fp32 activations are never quantised"):
            quant_linear(torch.empty(8, 16), torch.randn(8, 64), qw, path="amx")


# --- the quantised fused MoE on tiles ---------------------------------------------------


@needs_int8
@pytest.mark.parametrize("emulate", EMULATE)
def test_quant_moe_on_tiles_equals_the_vector_path(emulate, monkeypatch):
    """Experts of 1-30 rows (tiles from 5, the vector path below), w13 Q4_K and w2 Q6_K
    (group 16), silu with biases: bit for bit the vector int8 path's output."""
    from .test_quant_moe import make_case, run

    x, args, _ = make_case(40, 4, 2, 256, 256, torch.bfloat16, "Q4_K", "Q6_K", True, seed=5)
    want = run(x, args, "silu", path=VEC)
    _on(monkeypatch, emulate)
    got = run(x, args, "silu", path="amx")
    assert torch.isfinite(got).all()
    assert torch.equal(got, want), float((got.float() - want.float()).abs().max())


# The decoder's quantised GEMMs call the same blocks (``qblocks`` on chunks of row blocks,
# as the MoE's work items above): on an AMX host test_engine_quant runs its prompts'
# prefill on the tiles (the default path there) against the fp32 "none" run within the
# int8 contract; a decoder compiled once more for the vector path or emulated tiles here
# would cost ~40 CPU-s of the suite's compile budget for no other code.


# --- the CPU's decision, masks, a refused permission, the code for a tile CPU -----------


def test_decision_takes_amx_int8_only_with_its_features():
    """The decision table: AMX-INT8 + tiles + AVX512-VNNI -> quant amx; without amx-int8
    (or the tiles, or the kernel's grant, which strips every amx-* feature) the VNNI-512
    path; the Emerald Rapids class decides amx."""
    feats = set(isa.CPU_CLASSES["Emerald Rapids"].features)
    assert isa.decide("sapphirerapids", feats).quant == "amx"
    assert isa.decide("sapphirerapids", feats - {"amx-int8"}).quant == "vnni512"
    assert isa.decide("sapphirerapids", feats - {"amx-tile"}).quant == "vnni512"
    no_amx = {f for f in feats if not f.startswith("amx-")}
    assert isa.decide("sapphirerapids", no_amx).quant == "vnni512"


_MASKED = """
import json, torch
from numkern import isa
from numkern.quant import repack
from numkern.quant.linear import quant_linear
from numkern.testing.quantize import quantize
import numpy as np
w = np.random.default_rng(0).standard_normal((16, 64)).astype(np.float32)
qw = repack(quantize(w, "Q8_0"), "Q8_0", (16, 64))
out = torch.empty(8, 16, dtype=torch.bfloat16)
quant_linear(out, torch.randn(8, 64).bfloat16(), qw)
try:
    quant_linear(out, torch.randn(8, 64).bfloat16(), qw, path="amx")
    refused = ""
except ValueError as e:
    refused = str(e)
print(json.dumps({"quant": isa.quant_path()[0], "refused": refused,
                  "describe": isa.describe()}))
"""


@pytest.mark.parametrize("mask", ["-amx-int8", "-amx-tile"])
def test_masked_int8_tiles_take_the_vector_path(mask):
    """``NUMKERN_CPU_FEATURES`` without AMX-INT8 or without the tiles (a child): the quant
    path is not amx and says so, asking for it is refused, a call runs (no SIGILL)."""
    r = json.loads(run_child(_MASKED, {"NUMKERN_CPU_FEATURES": mask}).splitlines()[-1])
    assert r["quant"] != "amx" and "quant=amx" not in r["describe"], r
    assert "'amx' cannot run on this CPU" in r["refused"], r


_CODEGEN = """
from numba import types
from numkern.quant import _kernels as K
A = lambda t: types.Array(t, 1, "C")
i = types.int64
xa = types.UniTuple(i, 5)  # the activation scratch's addresses
sig = (A(types.uint16), i, xa, A(types.uint8), i, i, i, i, i, i, A(types.float32),
       types.boolean, A(types.uint8))
K.qtiles.compile(sig)
asm = K.qtiles.inspect_asm(sig)
"""


def test_int8_tile_codegen(tmp_path):
    """Compiled for a CPU with tiles (a child, ``sapphirerapids``; nothing runs): the
    quantised blocks configure (``ldtilecfg``) and release (``tilerelease``) their tiles,
    multiply with ``tdpbssd`` into two pairs of C tiles, and no function holds a tile
    instruction without both."""
    counts = codegen_counts(_CODEGEN, "tdpbssd", tmp_path)
    assert counts["ldtilecfg"] >= 1 and counts["tilerelease"] >= 1, counts
    assert counts["tdpbssd"] >= 4 and counts["tilestored"] >= 4 and counts["tileloadd"] >= 8
    assert counts["tilezero"] >= 4 and counts["outside"] == 0, counts


_REFUSED = (
    REFUSE_GRANT
    + """
import json
import numpy as np, torch
from numkern import isa
from numkern.quant import repack
from numkern.quant.linear import quant_linear
from numkern.testing.quantize import quantize
w = np.random.default_rng(0).standard_normal((32, 256)).astype(np.float32)
qw = repack(quantize(w, "Q4_K"), "Q4_K", (32, 256))
x = torch.randn(40, 256).bfloat16()
out = torch.empty(40, 32, dtype=torch.bfloat16)
quant_linear(out, x, qw)
print(json.dumps({"permitted": isa.amx_permitted(), "quant": isa.quant_path()[0],
                  "finite": bool(torch.isfinite(out).all())}))
"""
)


@pytest.mark.skipif(
    not (isa.has("amx-tile") and isa.has("amx-int8")), reason="this CPU has no AMX to refuse"
)
def test_refused_permission_takes_the_vector_path():
    """Where Linux refuses the tile state (a child whose arch_prctl fails): the quantised
    linear at M = 40 runs on VNNI-512, no SIGILL."""
    r = json.loads(run_child(_REFUSED).splitlines()[-1])
    assert not r["permitted"] and r["quant"] == "vnni512" and r["finite"], r


@needs_tiles
def test_int8_tiles_beside_torch_and_vllm_in_the_same_threads():
    """torch's AMX matmuls, vLLM's tile ops (where they load), numkern's bf16 tiles and its
    int8 tiles interleaved in the same threads, then from two Python threads at once:
    every result equals its solo run."""
    from .test_amx import _neighbours

    calls = _neighbours()
    qw = _weight("Q4_K", 64, 512, seed=7)
    x = torch.randn(48, 512).bfloat16()
    quant = lambda: _linear(x, qw, None, "amx")  # noqa: E731
    calls["numkern-int8"] = (quant, quant())
    for _ in range(3):
        for name, (f, want) in calls.items():
            assert torch.equal(f(), want), name
    errors = []

    def worker():
        try:
            for _ in range(20):
                for name, (f, want) in calls.items():
                    if not torch.equal(f(), want):
                        errors.append(name)
        except Exception as e:
            errors.append(repr(e))

    threads = [threading.Thread(target=worker) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
