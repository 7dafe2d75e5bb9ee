"""AMX tiles from Numba (numkern.amx, numkern.amx_gemm; docs/kernels.md §4.3).

Every host runs the tile kernels on emulated tiles (the same bodies, each tile operation
on a register file in memory: ``NUMKERN_AMX_EMULATE=1``) against plain fp32 references;
an AMX host also runs them on its tiles and checks the two against each other. The
assembly for a CPU with tiles is read on every host (a child compiles for
``sapphirerapids``; nothing runs). A masked CPU, a refused permission and other
libraries' tiles in the same threads are checked in children or on an AMX host.
"""

import json
import threading

import numpy as np
import pytest
import torch

from numkern import amx, convert_weight_packed, gemm, isa, weight_packed_linear
from numkern._jit import jit
from numkern.amx import (
    tile_begin,
    tile_dpbf16,
    tile_end,
    tile_load,
    tile_shape,
    tile_store,
    tile_zero,
)
from numkern.testing import vllm as vllm_ops
from numkern.testing.tolerances import tolerance

from .conftest import run_child
from .test_gemm import assert_close_linear

REAL = gemm.PATH == "amx"  # this CPU multiplies bf16 on tiles (isa's decision)
needs_tiles = pytest.mark.skipif(
    not REAL, reason=f"no AMX tiles in use on this CPU (gemm path {gemm.PATH!r})"
)


@jit
def tile_product(ctx, a, b, c, m, k):
    """``c[m, 32] = a[m, k] @ b`` with the primitives alone: ``a`` bf16 rows of ``k`` (m <=
    16), ``b`` one packed block ``[k/2][32][2]``, ``c`` fp32 rows of 32 (k a multiple of 32)."""
    tile_shape(ctx, 0, m, 64)
    tile_shape(ctx, 1, m, 64)
    tile_shape(ctx, 4, m, 64)
    tile_shape(ctx, 6, 16, 64)
    tile_shape(ctx, 7, 16, 64)
    tile_begin(ctx)
    tile_zero(ctx, 0)
    tile_zero(ctx, 1)
    for s in range(k // 32):
        tile_load(ctx, 4, a, s * 32, 2 * k)
        tile_load(ctx, 6, b, s * 1024, 128)
        tile_load(ctx, 7, b, s * 1024 + 32, 128)
        tile_dpbf16(ctx, 0, 4, 6)
        tile_dpbf16(ctx, 1, 4, 7)
    tile_store(ctx, 0, c, 0, 128)
    tile_store(ctx, 1, c, 16, 128)
    tile_end(ctx)


def _product_case(m, k, seed=0):
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(m, k, generator=g).bfloat16()
    w = torch.randn(32, k, generator=g).bfloat16()
    packed = convert_weight_packed(w)  # one block: [k/2][32][2]
    return a, w, packed


def _run_product(a, packed, emulate):
    m, k = a.shape
    c = np.full(m * 32, np.nan, np.float32)
    ua = a.view(torch.uint16).numpy().ravel()
    ub = packed.view(torch.uint16).numpy().ravel()
    tile_product(amx.new_context(emulate), ua, ub, c, m, k)
    return torch.from_numpy(c.reshape(m, 32))


def test_context_checks_its_argument():
    """``new_context`` / ``witness`` take a bool (a TypeError naming ``emulate`` else)."""
    assert amx.new_context(True).dtype == np.uint16 and amx.new_context(False).size == 64
    for bad in (1, "yes", None):
        with pytest.raises(TypeError, match="emulate"):
            amx.new_context(bad)
        with pytest.raises(TypeError, match="emulate"):
            amx.witness(bad)


@pytest.mark.parametrize("m,k", [(16, 64), (5, 96)])
def test_primitives_emulated(m, k):
    """The primitives on emulated tiles: a tile product of ``m`` rows equals the fp32
    product (fp32 sums of exact bf16 products: a few fp32 ulps), rows past ``m`` unwritten."""
    a, w, packed = _product_case(m, k)
    got = _run_product(a, packed, emulate=True)
    want = a.float() @ w.float().T
    t = tolerance("amx_product", torch.float32)
    assert torch.allclose(got, want, rtol=t.rel, atol=t.abs), (got - want).abs().max()


@needs_tiles
@pytest.mark.parametrize("m,k", [(16, 64), (5, 96)])
def test_primitives_real_match_emulated(m, k):
    """On this CPU's tiles the same product matches the fp32 product and the emulated
    tiles (the order of sums differs: about an fp32 ulp)."""
    a, w, packed = _product_case(m, k, seed=1)
    real = _run_product(a, packed, emulate=False)
    emu = _run_product(a, packed, emulate=True)
    want = a.float() @ w.float().T
    t, e = tolerance("amx_product", torch.float32), tolerance("amx_emulated", torch.float32)
    assert torch.allclose(real, want, rtol=t.rel, atol=t.abs)
    assert torch.allclose(real, emu, rtol=e.rel, atol=e.abs)


@pytest.mark.parametrize("emulate", [True, pytest.param(False, marks=needs_tiles)])
def test_tiles_read_bf16_denormals_as_zero(emulate):
    """The tile contract (docs/kernels.md §4.3): bf16 denormal inputs count as zero."""
    a = torch.zeros(3, 32, dtype=torch.bfloat16)
    a[:, 7] = 1e-39  # a bf16 denormal
    w = torch.zeros(32, 32, dtype=torch.bfloat16)
    w[:, 7] = 2.0**100
    a[:, 8] = 1.0
    w[:, 8] = 3.0
    got = _run_product(a, convert_weight_packed(w), emulate)
    assert torch.equal(got, torch.full((3, 32), 3.0))


# M: 5 (one short tile), 16, 17 (a full and a 1-row tile), 33, 70 (row groups of 32 and a
# short one); K: 32, 34 and 130 (a K tail), 96; N: 32, 33 and 100 (a short last block),
# 64; strided rows on both sides and bias on and off, each value at least once
LINEAR_CASES = [
    (5, 34, 33, True, 0),
    (16, 96, 64, False, 3),
    (17, 32, 100, True, 0),
    (33, 130, 32, False, 5),
    (70, 96, 100, True, 2),
    (48, 64, 64, True, 0),
]


def _linear_case(m, k, n, with_bias, pad, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g).bfloat16()
    x = torch.randn(m, k + pad, generator=g).bfloat16()[:, :k]
    bias = torch.randn(n, generator=g) if with_bias else None
    out = torch.full((m, n + pad), float("nan"), dtype=torch.bfloat16)[:, :n]
    return out, x, w, bias


@pytest.mark.parametrize("m,k,n,with_bias,pad", LINEAR_CASES)
def test_linear_on_emulated_tiles(m, k, n, with_bias, pad, monkeypatch):
    """``weight_packed_linear(path="amx")`` on emulated tiles (every host): the M, K and N
    tails and strided rows against the fp32 reference at bf16 rounding."""
    monkeypatch.setenv(isa.AMX_EMULATE_ENV, "1")
    out, x, w, bias = _linear_case(m, k, n, with_bias, pad)
    weight_packed_linear(out, x, convert_weight_packed(w), bias, True, path="amx")
    assert_close_linear(out, x, w, bias)


@needs_tiles
@pytest.mark.parametrize("m,k,n,with_bias,pad", LINEAR_CASES)
def test_linear_on_tiles_matches_emulated(m, k, n, with_bias, pad, monkeypatch):
    """The default path (tiles from 5 rows) against the reference and the emulated tiles
    (outputs within one bf16 rounding of each other: the order of fp32 sums differs)."""
    out, x, w, bias = _linear_case(m, k, n, with_bias, pad, seed=2)
    packed = convert_weight_packed(w)
    weight_packed_linear(out, x, packed, bias, True)
    assert gemm._linear_amx_at.signatures  # the tiles ran
    assert_close_linear(out, x, w, bias)
    emu = out.clone()
    monkeypatch.setenv(isa.AMX_EMULATE_ENV, "1")
    weight_packed_linear(emu, x, packed, bias, True, path="amx")
    t = tolerance("amx_emulated", torch.bfloat16)
    assert torch.allclose(out.float(), emu.float(), rtol=t.rel, atol=t.abs)


_MASKED = """
import json, torch, numkern
from numkern import gemm, isa
torch.manual_seed(0)
x, w = torch.randn(9, 64).bfloat16(), torch.randn(64, 64).bfloat16()
out = torch.empty(9, 64, dtype=torch.bfloat16)
numkern.weight_packed_linear(out, x, numkern.convert_weight_packed(w), None, True)
try:
    numkern.weight_packed_linear(out, x, numkern.convert_weight_packed(w), None, True, path="amx")
    refused = ""
except ValueError as e:
    refused = str(e)
err = float((out.float() - (x.float() @ w.float().T)).abs().max())
print(json.dumps({"path": gemm.PATH, "describe": isa.describe(), "refused": refused,
                  "tiles_compiled": len(gemm._linear_amx_at.signatures), "err": err}))
"""


def test_masked_tiles_take_the_vector_path():
    """``NUMKERN_CPU_FEATURES=-amx-tile`` (a child): the GEMM path is not amx and says so,
    asking for amx is refused, the tile kernel is never compiled, the result is right."""
    r = json.loads(run_child(_MASKED, {"NUMKERN_CPU_FEATURES": "-amx-tile"}).splitlines()[-1])
    assert r["path"] != "amx" and "gemm=amx" not in r["describe"], r
    assert "path: 'amx' cannot run on this CPU" in r["refused"]
    assert r["tiles_compiled"] == 0 and r["err"] < 0.5


# a child's first lines: Linux refusing the tile state (arch_prctl fails with EPERM)
REFUSE_GRANT = """
import ctypes
real = ctypes.CDLL
class _Refusing:
    def __init__(self, lib):
        self._lib = lib
    def __getattr__(self, name):
        return getattr(self._lib, name)
    def syscall(self, *args):
        if args and args[0] == 158:  # arch_prctl: the tile permission, refused
            ctypes.set_errno(1)
            return -1
        return self._lib.syscall(*args)
ctypes.CDLL = lambda *a, **k: _Refusing(real(*a, **k))
"""
_REFUSED = (
    REFUSE_GRANT
    + """
import json, logging
logging.basicConfig(level=logging.WARNING)
import torch, numkern
from numkern import gemm, isa
x, w = torch.randn(40, 64).bfloat16(), torch.randn(64, 64).bfloat16()
out = torch.empty(40, 64, dtype=torch.bfloat16)
numkern.weight_packed_linear(out, x, numkern.convert_weight_packed(w), None, True)
err = float((out.float() - (x.float() @ w.float().T)).abs().max())
print(json.dumps({"permitted": isa.amx_permitted(), "path": gemm.PATH, "err": err,
                  "isas": list(isa.decision().isas)}))
"""
)


@pytest.mark.skipif(
    not (isa.has("amx-tile") and isa.has("amx-bf16")), reason="this CPU has no AMX to refuse"
)
def test_refused_permission_takes_the_vector_path():
    """Where Linux refuses the tile state (a child whose arch_prctl fails): one log line,
    no amx anywhere in the decision, and a bf16 linear at M = 40 runs on the vector path
    (no SIGILL)."""
    import subprocess
    import sys

    from .conftest import ROOT

    proc = subprocess.run(
        [sys.executable, "-c", _REFUSED], cwd=ROOT, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    r = json.loads(proc.stdout.splitlines()[-1])
    assert not r["permitted"] and r["path"] == "dpbf16" and "amx" not in r["isas"], r
    assert r["err"] < 0.5
    assert proc.stderr.count("Linux refused the AMX tile state") == 1, proc.stderr[-2000:]


_COUNT_TAIL = """
for name in ("ldtilecfg", "tilerelease", "tileloadd", "PRODUCT", "tilestored", "tilezero"):
    print(name, len(re.findall(r"\\b" + name + r"\\b", asm)))
# per function of the module: its tile instructions, and whether it configures and releases
funcs = re.split(r"\\.type\\s+[^,]+,@function", asm)[1:]
bad = 0
for f in funcs:
    tiles = len(re.findall(r"\\b(tileloadd|PRODUCT|tilestored|tilezero)\\b", f))
    if tiles and not ("ldtilecfg" in f and "tilerelease" in f):
        bad += 1
print("outside", bad)
print("functions", len(funcs))
"""


def codegen_counts(setup, product, tmp_path):
    """Run ``setup`` (Python leaving a kernel's assembly in ``asm``) in a child compiling
    for ``sapphirerapids`` (nothing runs); ``{instruction: count}`` of the tile
    instructions (``product`` the tile product's), ``outside`` (functions holding one
    without both ``ldtilecfg`` and ``tilerelease``) and ``functions``."""
    env = {
        "NUMBA_CPU_NAME": "sapphirerapids",
        "NUMBA_CPU_FEATURES": "",
        "NUMKERN_CPU_FEATURES": "",
        "NUMBA_CACHE_DIR": str(tmp_path),
    }
    out = run_child("import re\n" + setup + _COUNT_TAIL.replace("PRODUCT", product), env)
    return {name: int(n) for name, n in map(str.split, out.strip().splitlines()[-8:])}


_CODEGEN = """
from numba import types
from numkern import amx_gemm
u8, u16, f32 = (types.Array(t, 1, "C") for t in (types.uint8, types.uint16, types.float32))
i = types.int64
sig = (u8, u16, i, u16, i, u16, f32, types.boolean, i, i, i, i)
amx_gemm.block.compile(sig)
asm = amx_gemm.block.inspect_asm(sig)
"""


def test_tile_codegen(tmp_path):
    """Compiled for a CPU with tiles (a child, ``sapphirerapids``; nothing runs): the
    GEMM block configures its tiles (``ldtilecfg``) and releases them (``tilerelease``),
    runs 2 x 2 ``tdpbf16ps`` per K step, and no function holds a tile instruction
    without both."""
    counts = codegen_counts(_CODEGEN, "tdpbf16ps", tmp_path)
    assert counts["ldtilecfg"] >= 1 and counts["tilerelease"] >= 1, counts
    assert counts["tdpbf16ps"] >= 4 and counts["tileloadd"] >= 4 and counts["tilestored"] >= 2
    assert counts["outside"] == 0 and counts["functions"] >= 1, counts


def _neighbours():
    """``{name: (call, want)}``: torch's bf16 matmul (oneDNN: AMX tiles on this CPU),
    vLLM's ``weight_packed_linear`` where its ops load (its brgemm tiles), numkern's amx
    linear; each call's result computed alone first."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(64, 256, generator=g).bfloat16()
    w = torch.randn(256, 256, generator=g).bfloat16()
    packed = convert_weight_packed(w)
    calls = {
        "torch": lambda: x @ w.T,
        "numkern": lambda: _numkern_linear(x, packed),
    }
    if "weight_packed_linear" in vllm_ops.op_names() and vllm_ops.load().ok:
        vpacked = torch.ops._C.convert_weight_packed(w)

        def vllm():
            out = torch.empty(x.shape[0], w.shape[0], dtype=torch.bfloat16)
            torch.ops._C.weight_packed_linear(out, x, vpacked, None, True)
            return out

        calls["vllm"] = vllm
    return {name: (f, f()) for name, f in calls.items()}


def _numkern_linear(x, packed):
    out = torch.empty(x.shape[0], packed.shape[0], dtype=torch.bfloat16)
    weight_packed_linear(out, x, packed, None, True)
    return out


@needs_tiles
def test_tiles_beside_torch_and_vllm_in_the_same_threads():
    """torch's AMX matmuls, vLLM's tile ops (where they load) and numkern's tile linear
    interleaved in the same threads, then from two Python threads at once: every result
    equals its solo run (each kernel entry loads its own configuration), nothing crashes."""
    calls = _neighbours()
    for _ in range(3):
        for name, (f, want) in calls.items():
            assert torch.equal(f(), want), name
    errors = []

    def worker(names):
        try:
            for _ in range(20):
                for name in names:
                    f, want = calls[name]
                    if not torch.equal(f(), want):
                        errors.append(name)
        except Exception as e:
            errors.append(repr(e))

    threads = [threading.Thread(target=worker, args=(list(calls),)) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors


# --- the fused MoE's expert GEMMs on tiles (the amx weight layout, bf16) ---------------


def _moe_case(seed=0):
    """40 tokens, top-2 over 4 experts, routed so the experts hold 36 rows (a group of 32
    and one of 4), 4 rows (vdpbf16ps on a CPU with tiles), 3 and 37 rows."""
    from .test_moe import make_case

    x, w13, w2, b13, b2, tw, _ = make_case(40, 4, 2, 128, 96, torch.bfloat16, True, seed)
    ti = torch.empty(40, 2, dtype=torch.int32)
    ti[:, 0] = torch.where(torch.arange(40) < 36, 0, 1)
    ti[:, 1] = torch.where(torch.arange(40) < 3, 2, 3)
    return x, w13, w2, b13, b2, tw, ti


def _moe(case, activation, path=None):
    from numkern import moe

    x, w13, w2, b13, b2, tw, ti = case
    p13, p2 = moe.prepack_moe_weight(w13, "amx"), moe.prepack_moe_weight(w2, "amx")
    out = torch.full_like(x, float("nan"))
    moe.fused_moe(out, x, p13, p2, b13, b2, tw, ti, activation=activation, isa="amx", path=path)
    return out


@pytest.mark.parametrize("activation", ["swigluoai", "silu", "gelu_tanh"])
def test_moe_on_emulated_tiles(activation, monkeypatch):
    """``fused_moe(path="amx")`` on emulated tiles (every host; every expert on tiles):
    row groups of 32 and short ones, biases, swigluoai's interleaved gate and up, against
    the fp32 reference; asking for amx on the vec layout is refused."""
    from numkern import moe

    from .test_moe import assert_close_moe, moe_reference

    monkeypatch.setenv(isa.AMX_EMULATE_ENV, "1")
    case = _moe_case()
    out = _moe(case, activation, "amx")
    ref, scale = moe_reference(*case, activation)
    assert_close_moe(out, ref, scale)
    x, w13, w2, b13, b2, tw, ti = case
    with pytest.raises(ValueError, match="path: 'amx' needs the amx weight layout"):
        moe.fused_moe(
            torch.empty_like(x), x, moe.prepack_moe_weight(w13, "vec"),
            moe.prepack_moe_weight(w2, "vec"), b13, b2, tw, ti, isa="vec", path="amx",
        )  # fmt: skip


@needs_tiles
def test_moe_on_tiles_matches_emulated(monkeypatch):
    """This CPU's default MoE path on the amx layout (tiles for experts of 5 rows or more,
    vdpbf16ps for fewer) against the reference and the emulated tiles."""
    from numkern.moe import fused

    from .test_moe import assert_close_moe, moe_reference

    case = _moe_case(seed=1)
    out = _moe(case, "silu")
    assert any(sig[-1].dtype.name == "uint8" for sig in fused._fused_moe.signatures)
    ref, scale = moe_reference(*case, "silu")
    assert_close_moe(out, ref, scale)
    monkeypatch.setenv(isa.AMX_EMULATE_ENV, "1")
    emu = _moe(case, "silu", "amx")
    assert_close_moe(out, emu.float(), scale)


# --- prefill attention on tiles (the amx cache layout, bf16) -----------------------------

# (requests (q_len, kv_len), window, extras): varlen with a context before the prompt, a
# decode beside a prefill, GQA 8/2; a window; soft-cap, ALiBi and sinks together
ATTENTION_CASES = [
    ([(40, 40), (1, 70), (45, 100)], -1, False),
    ([(70, 90)], 24, False),
    ([(50, 50)], -1, True),
]


def _attention(reqs, window, extras, monkeypatch, emulate):
    from .test_attention import BF, assert_close_attn, build, reference, run

    if emulate:
        monkeypatch.setenv(isa.AMX_EMULATE_ENV, "1")
    else:
        monkeypatch.delenv(isa.AMX_EMULATE_ENV, raising=False)
    g = torch.Generator().manual_seed(5)
    kw = dict(scale=0.125, window=window)
    if extras:
        kw |= dict(
            softcap=30.0, alibi=torch.rand(8, generator=g), sinks=torch.randn(8, generator=g)
        )
    q, kc, vc, qsl, sl, bt, ks, vs = build(reqs, 8, 2, 64, 32, BF, "amx")
    run_kw = {("sliding_window" if k == "window" else k): v for k, v in kw.items()}
    run_kw = {("alibi_slopes" if k == "alibi" else k): v for k, v in run_kw.items()}
    out = run(q, kc, vc, qsl, sl, bt, "amx", **run_kw)
    ref = reference(q, qsl, sl, ks, vs, 2, **kw)
    assert_close_attn(out, ref)
    return out


@pytest.mark.parametrize("reqs,window,extras", ATTENTION_CASES)
def test_prefill_attention_on_emulated_tiles(reqs, window, extras, monkeypatch):
    """The tile prefill on emulated tiles (every host): row groups of 32 and short ones,
    the causal diagonal and a window's start on the vector P·V, GQA, varlen, soft-cap,
    ALiBi and sinks, against the fp32 reference at one bf16 rounding of the output."""
    from numkern.attention import kernels

    _attention(reqs, window, extras, monkeypatch, emulate=True)
    assert any(sig[-1].types[-1].dtype.name == "uint16" for sig in kernels.attention.signatures)


@needs_tiles
@pytest.mark.parametrize("reqs,window,extras", ATTENTION_CASES)
def test_prefill_attention_on_tiles_matches_emulated(reqs, window, extras, monkeypatch):
    """On this CPU's tiles: the reference, and the emulated tiles within a unit of bf16."""
    real = _attention(reqs, window, extras, monkeypatch, emulate=False)
    emu = _attention(reqs, window, extras, monkeypatch, emulate=True)
    t = tolerance("amx_attention_emulated", torch.bfloat16)
    assert torch.allclose(real.float(), emu.float(), rtol=t.rel, atol=t.abs)


@pytest.mark.parametrize("emulate", [True, pytest.param(False, marks=needs_tiles)])
def test_decoder_on_tiles(emulate, monkeypatch):
    """The fused decoder run on the amx cache layout with its tiles (emulated on every host:
    the prefill attention's; and on a CPU with tiles its GEMMs too): a 42-row prefill and
    a decode step against the fp32 reference forward at the bf16 tolerance."""
    from .test_decoder import _run_steps, logits_tolerance

    if emulate:
        monkeypatch.setenv(isa.AMX_EMULATE_ENV, "1")
    got, want = _run_steps(torch.bfloat16, "amx", qk_norm=True, bias=True)
    for a, b in zip(got, want):
        assert torch.isfinite(a).all()
        assert float((a - b).abs().max()) <= logits_tolerance(torch.bfloat16) * float(b.abs().max())
