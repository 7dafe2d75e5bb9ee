"""numkern.quant.quant_linear against dequantise-then-fp64 matmul (docs/kernels.md §13.7).

Weights: a NumPy quantiser's GGUF bytes (numkern.testing.quantize) repacked by
numkern.quant.repack; the reference multiplies numkern.quant.dequantize's weight (bit-exact
with gguf's) in fp64. The int8 path is held to its stated bound, the fp32 path to fp32
rounding. Compile variants are few (each ~10-30 s on a 2-vCPU EPYC): bf16 -> bf16 on this
CPU's path, fp32 -> fp32, fp16 -> fp32 forced onto ``maddubs`` (the no-VNNI AVX-512 code
where AVX512-BW is present), bf16 -> bf16 on ``vnni256``, and one child process with
AVX-512 masked (the AVX2 code).
"""

import numpy as np
import pytest
import torch

from numkern import isa
from numkern.quant import QUANT_TYPES, dequantize, formats, repack
from numkern.quant import _kernels as K
from numkern.quant.linear import quant_linear
from numkern.simd_int8 import MXFP4_LUT, PATH_WITNESS
from numkern.testing.quantize import quantize
from numkern.testing.tolerances import tolerance

from .conftest import run_child

BF, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32
MS = (1, 3, 16, 77)
INT8 = isa.quant_path()[0] != "fp32"
# (x dtype, out dtype, path) rotated over (type, M): pairwise coverage, three variants
COMBOS = ((BF, BF, None), (FP32, FP32, None), (FP16, FP32, "maddubs" if INT8 else None))


def make_weight(qtype, n, k, seed=0):
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((n, k)).astype(np.float32) * 0.05
    qw = repack(quantize(w, qtype), qtype, (n, k))
    return qw, dequantize(qw).double()


def odd_k(qtype, mult=3):
    """An odd multiple of the type's GGML block."""
    return int(formats.BLOCK[formats.CODE[qtype]]) * mult


def int8_bound(x, w):
    """The int8 path's bound (docs/kernels.md §13.7): per row, per block of 32 K,
    ``dx = max |x| / 127`` and ``|x - dx * round(x / dx)| <= dx / 2``, so
    ``|y - y_fp32| <= sum_k |w[n, k]| * dx(k) / 2`` (0.502: the fp32 scale's rounding)."""
    m, k = x.shape
    dx = x.abs().reshape(m, k // 32, 32).amax(-1) / 127.0  # [M, K/32]
    return 0.502 * torch.repeat_interleave(dx, 32, dim=1) @ w.abs().T


def check(out, x, w, bias, int8):
    x64 = x.double()
    ref = x64 @ w.T
    absref = x64.abs() @ w.abs().T
    if bias is not None:
        ref = ref + bias.double()
        absref = absref + bias.double().abs()
    t = tolerance("quant_linear", out.dtype)  # relative rounding of one output, fp32 sums
    tol = t.mag * absref + t.rel * ref.abs() + 1e-30
    if int8:
        tol = tol + int8_bound(x64, w) * (1 + t.rel)
    err = (out.double() - ref).abs()
    assert bool((err <= tol).all()), f"max err/tol {float((err / tol).max()):.3f}"
    return float((err / absref.clamp_min(1e-30)).max())


def run_case(qtype, i, n):
    k = odd_k(qtype)
    qw, w = make_weight(qtype, n, k, seed=i)
    for j, m in enumerate(MS):
        xdt, odt, path = COMBOS[(i + j) % len(COMBOS)]
        x = torch.randn(m, k).to(xdt)
        if m == 3:  # rows with a stride: a view of a wider buffer
            x = torch.randn(m, k + 40).to(xdt)[:, 5 : 5 + k]
        bias = torch.randn(n) if (i + j) % 2 else None
        out = torch.full((m, n), float("nan"), dtype=odt)
        quant_linear(out, x, qw, bias, path=path)
        check(out, x, w, bias, int8=INT8 and xdt != FP32)


@pytest.mark.parametrize("qtype", QUANT_TYPES)
def test_quant_linear_vs_fp64(qtype):
    i = QUANT_TYPES.index(qtype)
    run_case(qtype, i, n=21 + 16 * (i % 3))  # N 21, 37, 53: a partial last row block


def test_fp32_path_is_tight_for_16_bit_x():
    """``path="fp32"`` never quantises: a bf16 x within fp32 rounding of the reference."""
    qw, w = make_weight("Q5_K", 40, 512)
    x = torch.randn(5, 512).to(BF)
    out = torch.empty(5, 40, dtype=FP32)
    quant_linear(out, x, qw, path="fp32")
    check(out, x, w, None, int8=False)


@pytest.mark.skipif(
    not (isa.has("avx512vnni") and isa.has("avx512vl")), reason="needs AVX512-VNNI + VL"
)
def test_vnni256_path():
    """The AVX-VNNI code (vpdpbusd on ymm halves), run through AVX512-VNNI + VL."""
    for i, qtype in enumerate(("Q8_0", "Q4_1", "MXFP4", "Q6_K")):
        qw, w = make_weight(qtype, 37, odd_k(qtype), seed=i)
        x = torch.randn(3, odd_k(qtype)).to(BF)
        out = torch.empty(3, 37, dtype=BF)
        quant_linear(out, x, qw, path="vnni256")
        check(out, x, w, None, int8=True)


_AVX2_CHILD = """
import torch
from numkern import isa
from numkern.quant._kernels import qblocks
from tests.test_quant_linear import check, make_weight, odd_k
from numkern.quant.linear import quant_linear
print(isa.quant_path()[0])
for i, qtype in enumerate(("Q8_0", "Q4_K", "MXFP4", "Q5_0")):
    qw, w = make_weight(qtype, 37, odd_k(qtype), seed=i)
    for m in (1, 5):
        x = torch.randn(m, odd_k(qtype)).to(torch.bfloat16)
        out = torch.empty(m, 37, dtype=torch.bfloat16)
        quant_linear(out, x, qw)
        check(out, x, w, None, int8=True)
asm = qblocks.inspect_asm(qblocks.signatures[0])
print("zmm" in asm, "vpdpbusd" in asm, "vpmaddubsw" in asm)
"""


@pytest.mark.skipif(not isa.has("avx512f"), reason="the host's own run is the AVX2 code")
def test_avx2_path_masked(tmp_path):
    """AVX-512 masked (a child process): the int8 path numkern decides for the mask, on ymm
    (no zmm): vpdpbusd where AVX-VNNI is left (vnni256), else vpmaddubsw + vpmaddwd
    (maddubs; Q8_0's codes up to 255 split into nibbles: no int16 saturation)."""
    want = isa.decision_under("-avx512f").quant
    assert want in ("vnni256", "maddubs")
    env = {"NUMKERN_CPU_FEATURES": "-avx512f", "NUMBA_CACHE_DIR": str(tmp_path)}
    path, flags = run_child(_AVX2_CHILD, env).split("\n")[:2]
    assert path == want
    vnni = want == "vnni256"
    assert flags.split() == ["False", str(vnni), str(not vnni)]


def test_quantize_rows_matches_numpy():
    """The building block's activation codes, scales and sums (docs/kernels.md §13.7)."""
    m, k = 3, 96
    x = torch.randn(m, k).to(BF)
    x[1, 32:64] = 0  # an all-zero block: scale 0, codes 0
    act = K.new_act(m, k, PATH_WITNESS["vnni512"])
    K.quantize_rows(x.view(torch.uint16).numpy().reshape(-1), k, k, 0, m, act)
    xq, xd, xs = act[K.XQ].reshape(m, k), act[K.XD].reshape(m, -1), act[K.XS].reshape(m, -1)
    blocks = x.double().numpy().reshape(m, k // 32, 32)
    amax = np.abs(blocks).max(-1)
    np.testing.assert_allclose(xd, amax / 127, rtol=tolerance("int8_scale", FP32).rel)
    a32 = amax.astype(np.float32)
    inv = np.where(amax > 0, np.float32(127) / np.maximum(a32, np.float32(1e-30)), 0)
    q = np.round(blocks.astype(np.float32) * inv[..., None].astype(np.float32)).reshape(m, k)
    np.testing.assert_array_equal(xq, q)
    np.testing.assert_array_equal(xs, xq.reshape(m, k // 16, 16).sum(-1))


def test_mxfp4_lut_is_the_layouts():
    assert tuple(MXFP4_LUT) == tuple(int(v) for v in formats.MXFP4_LUT)


def test_errors_name_the_argument():
    qw, _ = make_weight("Q4_0", 32, 64)
    x = torch.randn(2, 64).to(BF)
    out = torch.full((2, 32), float("nan"), dtype=BF)
    cases = [
        (TypeError, "weight", (out, x, torch.zeros(32, 64)), {}),
        (ValueError, "x", (out, torch.randn(2, 96).to(BF), qw), {}),
        (TypeError, "x", (out, x.to(torch.int32), qw), {}),
        (TypeError, "out", (torch.empty(2, 32, dtype=FP16), x, qw), {}),
        (ValueError, "out", (torch.empty(2, 31, dtype=BF), x, qw), {}),
        (ValueError, "x", (out, torch.randn(64, 2).to(BF).T, qw), {}),
        (TypeError, "bias", (out, x, qw, torch.zeros(32, dtype=FP16)), {}),
        (ValueError, "bias", (out, x, qw, torch.zeros(31)), {}),
        (ValueError, "path", (out, x, qw), {"path": "avx"}),
        (TypeError, "path", (out, x, qw), {"path": 3}),
        (ValueError, "path", (torch.empty(2, 32), x.float(), qw), {"path": "maddubs"}),
    ]
    for exc, name, args, kw in cases:
        with pytest.raises(exc, match=f"^{name}:"):
            quant_linear(*args, **kw)
    assert torch.isnan(out).all()  # a refusal writes nothing
