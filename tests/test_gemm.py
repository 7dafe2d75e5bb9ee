"""numkern.gemm: packing layout, the packed linear against fp32 torch, errors, vLLM."""

import json

import numba
import numpy as np
import pytest
import torch
from numba import types

import numkern
from numkern import (
    _jit,
    _tiles,
    convert_weight_packed,
    gemm,
    isa,
    moe,
    weight_packed_linear,
    weight_packed_linear_cpu,
)
from numkern.testing import reference as refs
from numkern.testing.tolerances import tolerance

from . import oracle
from .conftest import run_child
from .test_moe import make_case as make_moe_case

DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def reference_pack(weight):
    """§4.1's index formula, element by element (independent of the implementation)."""
    return refs.convert_weight_packed(weight)


@pytest.mark.parametrize(
    "shape,dtype",
    [
        ((16, 32), torch.bfloat16),
        ((48, 96), torch.float16),
        ((200, 2050), torch.bfloat16),
        ((3, 200, 96), torch.bfloat16),
        ((2, 48, 2050), torch.float16),
        ((200, 33), torch.float32),
        ((2, 16, 96), torch.float32),
    ],
)
def test_pack_formula(shape, dtype):
    w = torch.randn(shape).to(dtype)
    packed = convert_weight_packed(w)
    assert packed.shape == w.shape and packed.dtype == dtype
    bits = torch.int32 if dtype == torch.float32 else torch.int16
    assert torch.equal(packed.view(-1).view(bits), reference_pack(w).view(-1).view(bits))
    # a permutation: nothing lost, nothing duplicated
    assert torch.equal(packed.float().flatten().sort().values, w.float().flatten().sort().values)


# Tolerance per dtype (numkern.testing.tolerances' linear, with why): the kernel and the
# reference both accumulate in fp32 (different order: ~K * 2^-24 relative to the sum of
# |terms|), then the output is rounded once to the dtype, which can land one unit (2^-8
# bf16, 2^-11 fp16, relative) away from the rounded reference. So: |out - ref32| <=
# rel * |ref32| + mag * sum|x*w|.


def reference_linear(x, w, bias):
    return refs.linear(x, w, bias)


def assert_close_linear(out, x, w, bias):
    ref = reference_linear(x, w, bias)
    scale = x.float().abs() @ w.float().abs().T  # sum of |terms| per output
    err = (out.float() - ref).abs()
    t = tolerance("linear", out.dtype)
    bound = t.rel * ref.abs() + t.mag * scale + 1e-30
    worst = (err / bound).max().item()
    assert worst <= 1.0, f"max err/bound {worst:.3g} (max abs err {err.max().item():.3g})"


# M x dtype complete (compilation is per dtype, shapes are free); N, K and bias rotate.
M_VALUES = (1, 3, 4, 5, 16, 33, 128)
NK = ((200, 2050), (48, 96), (16, 32), (97, 130), (33, 4096), (64, 512), (1000, 64))
CASES = [
    (m, dt, *NK[(i + j) % len(NK)], (i + j) % 2 == 0)
    for i, m in enumerate(M_VALUES)
    for j, dt in enumerate(DTYPES)
]


# the fallback run (tests/test_fallback.py): decode (M = 1) and a blocked M, bf16 and fp32
# (fp16's tiles are the same code on another carrier, whose widening test_simd checks
# under the mask: its GEMM would cost the 2-minute run 6 s of compilation)
FALLBACK_M = (1, 33)


def _fallback_case(c):
    return c[0] in FALLBACK_M and c[1] is not torch.float16


@pytest.mark.parametrize(
    "m,dtype,n,k,with_bias",
    [pytest.param(*c, marks=pytest.mark.fallback) if _fallback_case(c) else c for c in CASES],
)
def test_linear_matches_fp32_reference(m, dtype, n, k, with_bias):
    if dtype == torch.float32:
        k += 1  # fp32 takes odd K
    w = torch.randn(n, k).to(dtype)
    x = torch.randn(m, k).to(dtype)
    bias = torch.randn(n) if with_bias else None
    out = torch.full((m, n), float("nan"), dtype=dtype)
    weight_packed_linear(out, x, convert_weight_packed(w), bias, True)
    assert_close_linear(out, x, w, bias)


# --- the two paths of bf16 x bf16 at M > 4 (docs §4.2): vdpbf16ps where AVX512-BF16 is ---
# present, else widening. M = 13 takes an 8-row tile, a 4-row tile and a clamped one; N =
# 200 a short last block; K = 4100 more than one K slice of either path, and a last one
# that is not full; rows strided on both sides.


def _path_case(dtype, m=13, n=200, k=4100):
    w = torch.randn(n, k).to(dtype)
    x = torch.randn(m, k + 6).to(dtype)[:, 3 : 3 + k]  # row stride k + 6
    bias = torch.randn(n)
    out = torch.full((m, n + 5), float("nan"), dtype=dtype)[:, :n]
    return out, x, w, bias


@pytest.mark.parametrize("path", ["widen", "dpbf16", "amx"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_linear_paths_match_fp32_reference(path, dtype, monkeypatch):
    """Each path against the fp32 reference. fp16 and fp32 always widen (nothing is rounded
    to bf16: their tolerances are 8x and 2000x tighter than bf16 rounding would allow);
    where the CPU lacks AVX512-BF16, asking for dpbf16 is a ValueError naming ``path``.
    amx runs on emulated tiles where the CPU's path is not amx (numkern.amx: the same
    kernel body; M, K and N tails, strided rows)."""
    out, x, w, bias = _path_case(dtype)
    packed = convert_weight_packed(w)
    if path == "amx" and gemm.PATH != "amx":
        monkeypatch.setenv(isa.AMX_EMULATE_ENV, "1")
    if path == "dpbf16" and not isa.decision().dp:
        with pytest.raises(ValueError, match="path: 'dpbf16' cannot run on this CPU"):
            weight_packed_linear(out, x, packed, bias, True, path=path)
        assert out.isnan().all()
        return
    weight_packed_linear(out, x, packed, bias, True, path=path)
    assert_close_linear(out, x, w, bias)
    if dtype != torch.bfloat16:
        return
    # the same check fails for a kernel that drops the odd (or the even) element of each
    # K pair, or pairs x[k] with w[k + 1]
    odd_dropped, even_dropped, swapped = x.clone(), x.clone(), x.clone()
    odd_dropped[:, 1::2] = 0
    even_dropped[:, 0::2] = 0
    swapped[:, 0::2], swapped[:, 1::2] = x[:, 1::2], x[:, 0::2]
    for wrong in (odd_dropped, even_dropped, swapped):
        with pytest.raises(AssertionError):
            assert_close_linear(out, wrong, w, bias)


def test_dpbf16_denormals_count_as_zero():
    """vdpbf16ps treats bf16 denormal inputs as zero (docs §4.2); widening keeps them."""
    m, n, k = 9, 32, 64
    x = torch.zeros(m, k, dtype=torch.bfloat16)
    x[:, 5] = 1e-39  # a bf16 denormal (below 2^-126)
    w = torch.zeros(n, k, dtype=torch.bfloat16)
    w[:, 5] = 2.0**100
    want = x[0, 5].float() * w[0, 5].float()  # 1.28e-9: the product is a normal number
    packed = convert_weight_packed(w)
    out = torch.empty(m, n, dtype=torch.bfloat16)
    weight_packed_linear(out, x, packed, None, True, path="widen")
    assert torch.equal(out.float(), torch.full((m, n), want.item()).bfloat16().float())
    if not isa.decision().dp:
        with pytest.raises(ValueError, match="path"):
            weight_packed_linear(out, x, packed, None, True, path="dpbf16")
        return
    weight_packed_linear(out, x, packed, None, True, path="dpbf16")
    assert torch.equal(out.float(), torch.zeros(m, n))


@pytest.mark.parametrize(
    "path,exc", [("AMX", ValueError), ("DPBF16", ValueError), (1, TypeError), (True, TypeError)]
)
def test_linear_bad_path(path, exc):
    out, x, w, b = _good()
    with pytest.raises(exc, match="path"):
        weight_packed_linear(out, x, w, b, True, path=path)


_MASKED_PATH = """
import json, torch, numkern
from numkern import gemm, isa
torch.manual_seed(0)
m, n, k = 9, 64, 96
x, w, b = torch.randn(m, k).bfloat16(), torch.randn(n, k).bfloat16(), torch.randn(n)
out = torch.empty(m, n, dtype=torch.bfloat16)
numkern.weight_packed_linear(out, x, numkern.convert_weight_packed(w), b, True)
try:
    numkern.weight_packed_linear(out, x, numkern.convert_weight_packed(w), b, True, path="dpbf16")
    refused = ""
except ValueError as e:
    refused = str(e)
print(json.dumps({
    "path": isa.gemm_path(), "describe": isa.describe(), "bf16": isa.has("avx512bf16"),
    "avx512": isa.has_avx512(), "dp_compiled": len(gemm._linear_dp_at.signatures),
    "refused": refused,
    "out": out.float().tolist(), "x": x.float().tolist(), "w": w.float().tolist(), "b": b.tolist(),
}))
"""


def test_masked_avx512bf16_takes_the_widening_path():
    """NUMKERN_CPU_FEATURES=-avx512bf16 (a child process; AVX-512 itself stays): the
    widening path is chosen and named, the dpbf16 kernel is never compiled, asking for it
    is refused, and the result matches the fp32 reference. (Its code has no vdpbf16ps:
    test_gemm_paths_codegen; fused_moe under a mask: test_paths_follow_the_cpu.)"""
    env = {"NUMKERN_CPU_FEATURES": "-avx512bf16", "NUMBA_CPU_FEATURES": ""}
    r = json.loads(run_child(_MASKED_PATH, env).splitlines()[-1])
    assert r["path"][0] == "widen" and not r["bf16"]
    assert "gemm=widen" in r["describe"] and "moe=widen" in r["describe"]
    assert r["dp_compiled"] == 0
    assert r["refused"].startswith("path: 'dpbf16' cannot run on this CPU")
    t = {key: torch.tensor(r[key]) for key in ("out", "x", "w", "b")}
    assert_close_linear(t["out"].bfloat16(), t["x"].bfloat16(), t["w"].bfloat16(), t["b"])


# --- the fma256 path (CPUs without AVX-512): fp32 weight panels under 6x16 tiles ---
@pytest.mark.fallback
def test_fma256_panel_tiles():
    """The fma256 path (CPUs without AVX-512: the main run on an AVX2 host, CI's fallback
    run elsewhere; skipped where AVX-512 is present, whose CPUs never take it) is chosen
    and named with its tile; its panel tiles match the fp32 reference on odd shapes: M
    from 5 (the path's first M) through tiles that clamp (7, 13, 97) to full ones (6, 128);
    N = 200 a short last block; K = 1030 three panels (512, 512, 6); fp32 weights with K =
    1025, a full last panel that also holds the odd row (it once overran the panel); the
    check fails for a kernel that drops every odd K. Its tile is ymm code, every FMA on ymm
    (the 6x16 tile alone is 12 per K row). fp16 is bf16's code on another carrier."""
    if gemm.PATH != "fma256":
        pytest.skip("AVX-512 present: the fma256 path is CI's fallback run's")
    assert gemm.TILES is gemm.PANEL_TILES
    assert "gemm=fma256(tile=6x16," in isa.describe() and "moe=fma256(" in isa.describe()
    g = torch.Generator().manual_seed(0)
    n, k = 200, 1030
    w, b = torch.randn(n, k, generator=g).bfloat16(), torch.randn(n, generator=g)
    packed = convert_weight_packed(w)
    for m in (5, 6, 7, 13, 97, 128):
        x = torch.randn(m, k, generator=g).bfloat16()
        out = torch.full((m, n), float("nan"), dtype=torch.bfloat16)
        weight_packed_linear(out, x, packed, b, True)
        assert_close_linear(out, x, w, b)
        wrong = x.clone()
        wrong[:, 1::2] = 0
        with pytest.raises(AssertionError):
            assert_close_linear(out, wrong, w, b)
    for m in (7, 13):  # fp32 weights, odd K
        w32, x32 = torch.randn(40, 1025, generator=g), torch.randn(m, 1025, generator=g)
        out = torch.full((m, 40), float("nan"))
        weight_packed_linear(out, x32, convert_weight_packed(w32), None, True)
        assert_close_linear(out, x32, w32, None)
    # the tile alone, compiled here with numkern's flags but no disk cache (Numba cannot
    # show the assembly of cached code)
    f32, i, six = types.Array(types.float32, 1, "C"), types.int64, types.UniTuple(types.int64, 6)
    sig = (f32, six, f32, i, i, f32, six)
    flags = dict(nogil=True, error_model="numpy", fastmath=set(_jit.FASTMATH), cache=False)
    tile = numba.njit(**flags)(_tiles.tile6.py_func)
    tile.compile(sig)
    asm = tile.inspect_asm(sig)
    fma = [line for line in asm.splitlines() if "vfmadd" in line]
    assert "zmm" not in asm and len(fma) >= 12 and all("ymm" in f for f in fma), asm


@pytest.mark.fallback
def test_paths_follow_the_cpu():
    """Both ops take vdpbf16ps exactly where the (masked) CPU has AVX512-BF16: in CI's
    fallback run (AVX-512 masked) neither dpbf16 kernel is compiled by calls that would take
    it, and forcing it is refused; here they are. No new compilation in either run."""
    dp = isa.has_avx512() and isa.has("avx512bf16")
    tiles = dp and isa.amx_usable()  # AMX tiles (and the kernel's grant): the amx path
    path = "amx" if tiles else "dpbf16" if dp else ("widen" if isa.has_avx512() else "fma256")
    assert gemm.PATH == isa.gemm_path()[0] == path
    assert (gemm.TILES is gemm.PANEL_TILES) == (path == "fma256")
    assert f"gemm={path}(" in isa.describe() and f"moe={path}" in isa.describe()
    out, x, w, b = _good(m=9)  # M > 4: dpbf16's territory (amx's on a CPU with tiles)
    weight_packed_linear(out, x, w, b, True)
    x2, w13, w2, _, _, tw, ti = make_moe_case(16, 2, 2, 128, 128, torch.bfloat16, False)
    p13, p2 = moe.prepack_moe_weight(w13, "vec"), moe.prepack_moe_weight(w2, "vec")
    moe_args = (torch.empty_like(x2), x2, p13, p2, None, None, tw, ti)
    moe.fused_moe(*moe_args, isa="vec")  # 16 rows per expert: vdpbf16ps on the vec layout
    if not tiles:  # (with tiles, other tests of this process ask for dpbf16 by name)
        assert bool(gemm._linear_dp_at.signatures) == dp
    # the real tiles' kernel (uint8 context witness; emulated tiles are uint16's)
    assert any(str(sig[-1].dtype) == "uint8" for sig in gemm._linear_amx_at.signatures) == tiles
    witnesses = {str(sig[-1].dtype) for sig in moe._fused_moe.signatures}
    assert ("uint16" in witnesses) == dp  # the vec layout: vdpbf16ps, tiles or not
    assert ("float64" in witnesses) == (path == "fma256")  # the panel witness
    if not dp:
        with pytest.raises(ValueError, match="path: 'dpbf16' cannot run on this CPU"):
            weight_packed_linear(out, x, w, b, True, path="dpbf16")
        with pytest.raises(ValueError, match="path: 'dpbf16' cannot run on this CPU"):
            moe.fused_moe(*moe_args, isa="vec", path="dpbf16")


_PATH_CODEGEN = """
import numba, numkern
from numba import types
from numkern import gemm
u16, u32, f32 = (types.Array(t, 1, "C") for t in (types.uint16, types.uint32, types.float32))
i, flag = types.int64, types.boolean
dp = (u16, i, u16, i, u32, f32, flag, i, i, i, i)
widen = (u16, i, f32, u32, i, i, i, f32, flag, i, i, i, i, types.Array(types.uint8, 1, "C"))
kernels = {"_block_dp": (gemm._block_dp, dp), "_block": (gemm._block, widen)}
for name in KERNELS:
    kernel, sig = kernels[name]
    kernel.compile(sig)
    asm = kernel.inspect_asm(sig)
    print(name, asm.count("vdpbf16ps"), asm.count("vfmadd"), asm.count("prefetcht0"))
"""


def _codegen(cpu, kernels, tmp_path):
    """{kernel: (vdpbf16ps, vfmadd, prefetcht0 count)} of the blocks compiled for ``cpu``
    in a child (nothing runs)."""
    env = {
        "NUMBA_CPU_NAME": cpu,
        "NUMBA_CPU_FEATURES": "",
        "NUMKERN_CPU_FEATURES": "",
        "NUMBA_CACHE_DIR": str(tmp_path / cpu),
    }
    out = run_child(f"KERNELS = {kernels!r}\n" + _PATH_CODEGEN, env)
    return {name: tuple(map(int, rest)) for name, *rest in map(str.split, out.splitlines())}


def test_gemm_paths_codegen(tmp_path):
    """Compiled for a CPU with AVX512-BF16 (a child; nothing runs): the dpbf16 block's
    tiles are vdpbf16ps, the widening block's are FMAs with no vdpbf16ps. The tiles
    prefetch their weights as ``isa.STREAM`` says for the CPU compiled for: Sapphire
    Rapids takes the default (16 K pairs ahead), Zen 4 none."""
    counts = _codegen("sapphirerapids", ("_block_dp", "_block"), tmp_path)
    assert counts["_block_dp"][0] >= 8 + 4  # at least one 8-row and one 4-row tile
    assert counts["_block"][:2] == (0, counts["_block"][1]) and counts["_block"][1] >= 16
    assert "sapphirerapids" not in isa.STREAM and isa.STREAM_DEFAULT.prefetch_k2 > 0
    assert counts["_block"][2] >= 2 and counts["_block_dp"][2] >= 2
    assert isa.STREAM["znver4"].prefetch_k2 == 0
    assert _codegen("znver4", ("_block",), tmp_path)["_block"][2] == 0


def test_linear_strided_rows_and_numpy_inputs():
    k, n = 96, 48
    w = torch.randn(n, k)
    big = torch.randn(7, 2 * k)
    x = big[:, 10 : 10 + k]  # row stride 2k, no copy
    out_big = torch.zeros(7, 3 * n)
    out = out_big[:, n : 2 * n]
    weight_packed_linear(out, x, convert_weight_packed(w), None, True)
    assert_close_linear(out, x, w, None)
    assert out_big[:, :n].abs().max() == 0 and out_big[:, 2 * n :].abs().max() == 0
    # NumPy fp16 arrays are accepted too (zero-copy), result in the caller's array
    xh = x.contiguous().half()
    wh = w.half()
    out_np = np.zeros((7, n), np.float16)
    weight_packed_linear(out_np, xh.numpy(), convert_weight_packed(wh.numpy()).numpy(), None, True)
    assert_close_linear(torch.from_numpy(out_np), xh, wh, None)


@pytest.mark.parametrize("lead", [(), (3,), (2, 5)])
def test_linear_cpu_leading_dims(lead):
    k, n = 64, 80
    w = torch.randn(n, k).bfloat16()
    x = torch.randn(*lead, k).bfloat16()
    bias = torch.randn(n)
    y = weight_packed_linear_cpu(x, convert_weight_packed(w), n, bias)
    assert y.shape == (*lead, n) and y.dtype == torch.bfloat16
    assert_close_linear(y.reshape(-1, n), x.reshape(-1, k), w, bias)


def test_tolerance_bites():
    """A reference that drops the bias or transposes a block fails the same check."""
    m, n, k = 5, 64, 256
    w = torch.randn(n, k).bfloat16()
    x = torch.randn(m, k).bfloat16()
    bias = torch.randn(n)
    out = torch.empty(m, n, dtype=torch.bfloat16)
    weight_packed_linear(out, x, convert_weight_packed(w), bias, True)
    assert_close_linear(out, x, w, bias)
    with pytest.raises(AssertionError):
        assert_close_linear(out, x, w, None)  # dropped bias
    w_t = w.clone()
    w_t[:32, :32] = w[:32, :32].T  # one block transposed
    with pytest.raises(AssertionError):
        assert_close_linear(out, x, w_t, bias)
    off = out.clone()
    off[2, 7] = (off[2, 7].float() * 1.02).bfloat16()  # a 2% error in one element
    with pytest.raises(AssertionError):
        assert_close_linear(off, x, w, bias)


def _good(m=3, n=32, k=64, dtype=torch.bfloat16):
    return (
        torch.empty(m, n, dtype=dtype),
        torch.randn(m, k).to(dtype),
        convert_weight_packed(torch.randn(n, k).to(dtype)),
        torch.randn(n),
    )


@pytest.mark.parametrize(
    "mutate,exc,match",
    [
        (lambda a: a.update(is_vnni=False), ValueError, "is_vnni"),
        (
            lambda a: a.update(mat1=a["mat1"].float()),
            TypeError,
            "mat2.*float32|mat2: expected dtype",
        ),
        (lambda a: a.update(mat2=a["mat2"][:, :32].contiguous()), ValueError, "mat2"),
        (lambda a: a.update(out=torch.empty(3, 16, dtype=torch.bfloat16)), ValueError, "out"),
        (lambda a: a.update(out=torch.empty(3, 32)), TypeError, "out"),
        (lambda a: a.update(bias=torch.randn(31)), ValueError, "bias"),
        (lambda a: a.update(bias=torch.randn(32).bfloat16()), TypeError, "bias"),
        (lambda a: a.update(mat1=torch.randn(64, 3).bfloat16().T), ValueError, "mat1.*stride"),
        (lambda a: a.update(mat1=torch.randn(3, 64).bfloat16()[0]), ValueError, "mat1"),
        (lambda a: a.update(mat2=torch.randn(64, 32).bfloat16().T), ValueError, "mat2.*contiguous"),
        (lambda a: a.update(mat1="x"), TypeError, "mat1"),
        (lambda a: a.update(mat1=np.zeros((3, 64), np.float64)), TypeError, "mat1.*float64"),
    ],
)
def test_linear_bad_input(mutate, exc, match):
    out, x, w, b = _good()
    args = dict(out=out, mat1=x, mat2=w, bias=b, is_vnni=True)
    mutate(args)
    before = args["out"].clone() if isinstance(args["out"], torch.Tensor) else None
    with pytest.raises(exc, match=match):
        weight_packed_linear(args["out"], args["mat1"], args["mat2"], args["bias"], args["is_vnni"])
    if before is not None:
        assert torch.equal(before.view(torch.uint8), args["out"].view(torch.uint8))


def test_odd_k_16bit_is_an_error():
    with pytest.raises(ValueError, match="even K"):
        convert_weight_packed(torch.randn(32, 63).bfloat16())
    x = torch.randn(2, 63).half()
    w = torch.randn(32, 63).half()  # not packable; pass it raw to hit the linear's check
    with pytest.raises(ValueError, match="even K"):
        weight_packed_linear(torch.empty(2, 32, dtype=torch.half), x, w, None, True)


def test_wrapper_checks_n():
    w = convert_weight_packed(torch.randn(48, 64).bfloat16())
    with pytest.raises(ValueError, match="packed_weight"):
        weight_packed_linear_cpu(torch.randn(2, 64).bfloat16(), w, 32, None)


# --- vLLM cross-checks (its subset: bf16, N % 16 == 0, K % 32 == 0) -----------------------
# The packed linear exists only in vLLM's _C build (run in a child when that is not the
# build vLLM loads on this CPU).

_VLLM_LINEAR_PROBE = """
x = torch.randn(4, 64).bfloat16(); w = torch.randn(32, 64).bfloat16()
out = torch.empty(4, 32, dtype=torch.bfloat16)
torch.ops._C.weight_packed_linear(out, x, torch.ops._C.convert_weight_packed(w), None, True)
"""


def test_vllm_pack_byte_identical():
    shapes = [(16, 32), (48, 96), (208, 2048), (64, 4096)]
    ws = {f"w{i}": torch.randn(n, k).bfloat16() for i, (n, k) in enumerate(shapes)}
    theirs = oracle.run_in_child(
        "_C.abi3.so",
        "result = {n: torch.ops._C.convert_weight_packed(w) for n, w in inputs.items()}",
        probe="torch.ops._C.convert_weight_packed(torch.randn(32, 64).bfloat16())",
        name="convert_weight_packed",
        **ws,
    )
    for name, w in ws.items():
        assert torch.equal(
            convert_weight_packed(w).view(torch.int16), theirs[name].view(torch.int16)
        )


def test_vllm_linear_outputs():
    oracle.require_op("weight_packed_linear", _VLLM_LINEAR_PROBE, lib="_C.abi3.so")
    cases = [(1, 64, 128), (5, 48, 256), (33, 208, 2048)]
    inputs = {}
    for i, (m, n, k) in enumerate(cases):
        inputs[f"x{i}"] = torch.randn(m, k).bfloat16()
        inputs[f"w{i}"] = torch.randn(n, k).bfloat16()
        inputs[f"b{i}"] = torch.randn(n)
    code = f"""
result = {{}}
for i in range({len(cases)}):
    x, w, b = inputs[f"x{{i}}"], inputs[f"w{{i}}"], inputs[f"b{{i}}"]
    out = torch.empty(x.shape[0], w.shape[0], dtype=torch.bfloat16)
    torch.ops._C.weight_packed_linear(out, x, torch.ops._C.convert_weight_packed(w), b, True)
    result[i] = out
"""
    theirs = oracle.run_in_child(
        "_C.abi3.so", code, probe=_VLLM_LINEAR_PROBE, name="weight_packed_linear", **inputs
    )
    for i in range(len(cases)):
        x, w, bias = inputs[f"x{i}"], inputs[f"w{i}"], inputs[f"b{i}"]
        ours = torch.empty(x.shape[0], w.shape[0], dtype=torch.bfloat16)
        weight_packed_linear(ours, x, convert_weight_packed(w), bias, True)
        assert_close_linear(theirs[i], x, w, bias)  # the oracle agrees with the reference ...
        assert_close_linear(ours, x, w, bias)
        # ... and with us, within two bf16 units (each side rounds once from fp32)
        diff = (ours.float() - theirs[i].float()).abs()
        t = tolerance("linear_vllm", torch.bfloat16)
        assert (diff <= t.rel * theirs[i].float().abs() + t.abs).all()


def test_numkern_api_surface():
    assert callable(numkern.warmup)
    assert set(numkern.supported_isas()) <= {"amx", "vec", "vec16", "neon"}


@pytest.mark.parametrize(
    "xdt, m, n, k",
    [(torch.bfloat16, 1, 40, 64), (torch.float16, 5, 32, 63), (torch.bfloat16, 20, 72, 130)],
)
def test_16bit_activations_with_an_fp32_weight(xdt, m, n, k):
    """A router kept in fp32 (docs §4.2): 16-bit activations times an fp32 packed weight
    with an fp32 bias give, in an fp32 ``out``, the logits of a plain fp32 linear of the
    same inputs (only the summation order differs); in an ``out`` of x's dtype (what vLLM's
    op allocates, and the wrapper's dtype) the same fp32 sums rounded once, bit for bit."""
    g = torch.Generator().manual_seed(m * 1000 + k)
    x = torch.randn(m, k, generator=g).to(xdt)
    w = torch.randn(n, k, generator=g)
    b = torch.randn(n, generator=g)
    ref = x.double() @ w.double().T + b.double()
    out = torch.full((m, n), float("nan"))
    weight_packed_linear(out, x, convert_weight_packed(w), b, True)
    t = tolerance("linear_fp32_weight", torch.float32)
    torch.testing.assert_close(out.double(), ref, rtol=t.rel, atol=t.peak * ref.abs().max().item())
    rounded = torch.full((m, n), float("nan"), dtype=xdt)
    weight_packed_linear(rounded, x, convert_weight_packed(w), b, True)
    assert torch.equal(rounded, out.to(xdt))  # one rounding to nearest even of the fp32 sums
    y = weight_packed_linear_cpu(x, convert_weight_packed(w), n, b)
    assert y.dtype == xdt and torch.equal(y, rounded)
    with pytest.raises(TypeError, match="out"):  # fp32 or x's dtype, nothing else
        other = torch.float16 if xdt == torch.bfloat16 else torch.bfloat16
        weight_packed_linear(torch.empty(m, n, dtype=other), x, convert_weight_packed(w), b, True)
    w16 = convert_weight_packed(w[:, : k - k % 2].to(xdt))  # fp32 activations, 16-bit weight
    with pytest.raises(TypeError, match="mat2"):
        weight_packed_linear(out, x[:, : k - k % 2].float(), w16, b, True)


@pytest.mark.parametrize("m", [1, 9])
def test_linear_in_place_over_its_input(m):
    """``out`` over ``mat1``'s memory (bf16, exactly on it and one row on): the result of
    the input as it was. The dpbf16 kernel reads ``mat1`` while other blocks write
    ``out``, so such a call takes the widening path, which copies ``mat1`` first (the
    fuzz found the dpbf16 path writing over rows it had yet to read)."""
    k = n = 64
    w = torch.randn(n, k).bfloat16()
    packed = convert_weight_packed(w)
    for shift in (0, k):
        base = torch.randn((m + 1) * k).bfloat16()
        x = base[: m * k].view(m, k)
        x0 = x.clone()
        out = base[shift : shift + m * n].view(m, n)
        weight_packed_linear(out, x, packed, None, True)
        assert_close_linear(out, x0, w, None)
