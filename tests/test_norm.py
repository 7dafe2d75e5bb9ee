"""numkern.norm: RMS norm and the fused residual add against float64 loops, row kernels,
strided rows, errors, vLLM."""

import numpy as np
import pytest
import torch

from numkern import _check as C
from numkern import norm as N
from numkern.testing import reference as refs

from . import oracle
from .close import assert_within, within

BF, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32


def reference(x, w, eps):
    """float64 over rows: x / sqrt(mean(x^2) + eps) * w."""
    return refs.rms_norm(None, x, w, eps)


def data(shape, dtype, scale=1.0):
    return (torch.randn(shape) * scale).to(dtype)


@pytest.mark.parametrize(
    "shape,dtype,wdtype",
    [
        ((1, 13), FP32, FP32),
        ((7, 97), BF, FP32),  # the engine's case: bf16 activations, fp32 norm weight
        ((3, 5, 1000), FP16, FP16),
        ((70, 97), BF, BF),  # >= PARALLEL_ROWS: the prange path
        ((2, 16), FP32, None),  # weight None: all ones, as vLLM's schema allows
        ((0, 13), BF, FP32),
    ],
)
def test_rms_norm(shape, dtype, wdtype):
    x = data(shape, dtype)
    w = None if wdtype is None else data(shape[-1], wdtype)
    out = torch.full_like(x, float("nan"))
    assert N.rms_norm(out, x, w, 1e-6) is None
    ref = reference(x, w, 1e-6)
    assert_within(out, ref, ref.abs(), dtype, "norm")


def test_rms_norm_in_place_and_numpy():
    x = data((4, 97), FP32).numpy()
    w = data(97, FP32).numpy()
    ref = reference(torch.from_numpy(x), torch.from_numpy(w), 1e-5)
    N.rms_norm(x, x, w, 1e-5)
    assert_within(torch.from_numpy(x), ref, ref.abs(), FP32, "norm")


def test_rms_norm_strided_rows():
    """Input and out are column windows of wider buffers (3-D, collapsible leading dims);
    the columns around them stay as they were."""
    src = data((2, 3, 150), BF)
    x = src[:, :, 7:104]  # [2, 3, 97], row stride 150
    dst = torch.full((2, 3, 120), 7.0, dtype=BF)
    out = dst[:, :, 11:108]
    w = data(97, FP32)
    N.rms_norm(out, x, w, 1e-6)
    ref = reference(x, w, 1e-6)
    assert_within(out, ref, ref.abs(), BF, "norm")
    assert (dst[:, :, :11] == 7).all() and (dst[:, :, 108:] == 7).all()


@pytest.mark.parametrize(
    "shape,dtype,wdtype",
    [((5, 13), BF, FP32), ((70, 1000), FP16, FP16), ((3, 97), FP32, FP32)],
)
def test_fused_add_rms_norm(shape, dtype, wdtype):
    x, res, w = data(shape, dtype), data(shape, dtype, 4.0), data(shape[-1], wdtype)
    summed = (x.float() + res.float()).to(dtype)  # one rounding of the fp32 sum
    ref = reference(summed, w, 1e-6)
    assert N.fused_add_rms_norm(x, res, w, 1e-6) is None
    assert torch.equal(res, summed)
    assert_within(x, ref, ref.abs(), dtype, "norm")


def test_fused_add_rms_norm_refuses_shared_memory():
    """input and residual sharing elements would give garbage: a ValueError, through the
    fast path (contiguous) and the checked one (strided, NumPy); the values stay."""
    x = data((4, 32), BF)
    x0 = x.clone()
    for inp, res in [(x, x), (x[:2], x.view(-1)[32:96].view(2, 32)), (x[:, 1:17], x[:, 16:32])]:
        with pytest.raises(ValueError, match=r"^residual: expected memory apart from input"):
            N.fused_add_rms_norm(inp, res, None, 1e-6)
    f = data((3, 16), FP32)
    with pytest.raises(ValueError, match=r"^residual: expected memory apart from input"):
        N.fused_add_rms_norm(f.numpy(), f, None, 1e-6)
    assert torch.equal(x, x0)
    N.fused_add_rms_norm(x[:, :16], x[:, 16:], None, 1e-6)  # adjacent windows: fine


def test_fused_add_rms_norm_strided_rows():
    buf = data((6, 40), FP16)
    x, res = buf[:, :13], buf[:, 20:33]  # both in one buffer, row stride 40
    x0, res0, between = x.clone(), res.clone(), buf[:, 13:20].clone()
    w = data(13, FP16)
    N.fused_add_rms_norm(x, res, w, 1e-6)
    summed = (x0.float() + res0.float()).to(FP16)
    assert torch.equal(res, summed)
    ref = reference(summed, w, 1e-6)
    assert_within(x, ref, ref.abs(), FP16, "norm")
    assert torch.equal(buf[:, 13:20], between)


def test_span():
    """numkern._check.span: the carrier view from the first element to the last, no copy
    (tensors and arrays; the 1-D view the strided kernels of norm, rope and attention
    index with the operand's own strides)."""
    buf = torch.arange(6 * 40, dtype=torch.float32).reshape(6, 40).to(BF)
    x = buf[1:, 3:16]  # 5 rows of 13, row stride 40
    s = C.span(x)
    assert s.dtype == np.uint16 and s.shape == (4 * 40 + 13,)
    assert s.ctypes.data == x.data_ptr()
    assert np.array_equal(s[40 : 40 + 13], C.as_numpy(x[1]))
    assert C.span(x, 7).shape == (7,) and C.span(buf[:0]).shape == (0,)
    a = buf.to(FP16).numpy()[2:, 5:9]
    sa = C.span(a)
    assert sa.dtype == np.int16 and sa.shape == (3 * 40 + 4,)
    assert np.shares_memory(sa, a) and np.array_equal(sa[40:44], a[1].view(np.int16))
    assert C.span(torch.zeros(3, 4)).dtype == np.float32


@pytest.mark.parametrize("dtype", [BF, FP16, FP32])
def test_row_kernels(dtype):
    """The decoder's contract: 1-D carriers, row stride n, only rows r0..r1 written."""
    n, rows, r0, r1 = 37, 6, 2, 5
    x, res, w = data((rows, n), dtype), data((rows, n), dtype), data(n, FP32)
    out = torch.full((rows, n), 3.0, dtype=dtype)
    a = lambda t: C.as_numpy(t).reshape(-1)  # noqa: E731
    N._rows(a(x), a(w), a(out), r0, r1, n, 1e-6)
    ref = reference(x[r0:r1], w, 1e-6)
    assert_within(out[r0:r1], ref, ref.abs(), dtype, "norm")
    assert (out[:r0] == 3).all() and (out[r1:] == 3).all()

    res0 = res.clone()
    out.fill_(3.0)
    N._add_rows(a(x), a(res), a(w), a(out), r0, r1, n, 1e-6, False)
    summed = (x[r0:r1].float() + res0[r0:r1].float()).to(dtype)
    assert torch.equal(res[r0:r1], summed)
    assert torch.equal(res[:r0], res0[:r0]) and torch.equal(res[r1:], res0[r1:])
    assert (out == 3).all()  # has_norm False: out untouched

    res.copy_(res0)
    N._add_rows(a(x), a(res), a(w), a(out), r0, r1, n, 1e-6, True)
    ref = reference(summed, w, 1e-6)
    assert_within(out[r0:r1], ref, ref.abs(), dtype, "norm")
    assert (out[:r0] == 3).all() and (out[r1:] == 3).all()


def test_tolerance_bites():
    """A wrong eps (1e-2 for 1e-6, on rows of rms ~0.3) or a result two units off fails."""
    x, w = data((4, 97), BF, 0.3), data(97, FP32)
    ref = reference(x, w, 1e-6)
    out = torch.empty_like(x)
    N.rms_norm(out, x, w, 1e-2)
    assert not within(out, ref, ref.abs(), BF, "norm")[0]
    N.rms_norm(out, x, w, 1e-6)
    assert within(out, ref, ref.abs(), BF, "norm")[0]
    bits = out.view(torch.int16).clone()
    bits[1, 5] += 2  # two bf16 units away
    assert not within(bits.view(BF), ref, ref.abs(), BF, "norm")[0]


def _x(shape=(3, 16), dtype=BF):
    return torch.zeros(shape, dtype=dtype)


ERRORS = [
    ("input", TypeError, lambda: N.rms_norm(_x(), _x(dtype=torch.int32), None, 1e-6)),
    ("out", TypeError, lambda: N.rms_norm(_x(dtype=FP16), _x(), None, 1e-6)),
    ("out", ValueError, lambda: N.rms_norm(_x((3, 15)), _x(), None, 1e-6)),
    ("weight", TypeError, lambda: N.rms_norm(_x(), _x(), _x((16,), FP16), 1e-6)),
    ("weight", ValueError, lambda: N.rms_norm(_x(), _x(), _x((17,), FP32), 1e-6)),
    ("weight", ValueError, lambda: N.rms_norm(_x(), _x(), _x((32,), FP32)[::2], 1e-6)),
    ("input", ValueError, lambda: N.rms_norm(_x(), _x((16, 3)).t(), None, 1e-6)),
    ("input", ValueError, lambda: N.rms_norm(_x((2, 3, 4)), _x((2, 4, 4))[:, :3], None, 1e-6)),
    ("input", ValueError, lambda: N.rms_norm(_x((3, 0)), _x((3, 0)), None, 1e-6)),
    ("input", ValueError, lambda: N.rms_norm(_x(()), _x(()), None, 1e-6)),
    ("input", TypeError, lambda: N.rms_norm(_x(), [[0.0] * 16] * 3, None, 1e-6)),
    ("input", TypeError, lambda: N.rms_norm(_x(), np.zeros((3, 16)), None, 1e-6)),  # float64
    ("epsilon", TypeError, lambda: N.rms_norm(_x(), _x(), None, "1e-6")),
    ("epsilon", ValueError, lambda: N.rms_norm(_x(), _x(), None, -1.0)),
    ("residual", TypeError, lambda: N.fused_add_rms_norm(_x(), _x(dtype=FP32), None, 1e-6)),
    ("residual", ValueError, lambda: N.fused_add_rms_norm(_x(), _x((4, 16)), None, 1e-6)),
    ("residual", ValueError, lambda: N.fused_add_rms_norm(_x(), _x((16, 3)).t(), None, 1e-6)),
    ("weight", ValueError, lambda: N.fused_add_rms_norm(_x(), _x(), _x((15,), BF), 1e-6)),
]


@pytest.mark.parametrize("name,exc,call", ERRORS, ids=[f"{e[0]}-{i}" for i, e in enumerate(ERRORS)])
def test_errors(name, exc, call):
    with pytest.raises(exc, match=rf"^{name}: "):
        call()


# vLLM's CPU kernels take the weight in the input's dtype, rows of a multiple of 16
# (8 fp32 lanes x 2 for 16-bit), and contiguous rows: compared on that subset.
@pytest.mark.parametrize("dtype,shape", [(BF, (5, 1024)), (FP32, (70, 64)), (FP16, (3, 96))])
def test_vllm_rms_norm(dtype, shape):
    ops = oracle.ops()
    x, w = data(shape, dtype), data(shape[-1], dtype)
    ours, theirs = torch.empty_like(x), torch.empty_like(x)
    N.rms_norm(ours, x, w, 1e-6)
    ops.rms_norm(theirs, x, w, 1e-6)
    assert_within(ours, theirs.double(), theirs.double().abs(), dtype, "norm")


@pytest.mark.parametrize("dtype,shape", [(BF, (5, 1024)), (FP32, (70, 64))])
def test_vllm_fused_add_rms_norm(dtype, shape):
    """numkern's residual is the sum rounded once to nearest even; vLLM's is its build's
    own stores (oracle.vllm_fused_add_rms_norm, docs §9.1: _C_AVX2 truncates), bit for
    bit; outputs within one unit of that model, and of numkern's where the build rounds
    as numkern does (vLLM's variance is of the unrounded sum, see numkern.norm)."""
    ops = oracle.ops()
    x, res, w = data(shape, dtype), data(shape, dtype, 4.0), data(shape[-1], dtype)
    x0, res0 = x.clone(), res.clone()
    x2, res2 = x.clone(), res.clone()
    N.fused_add_rms_norm(x, res, w, 1e-6)
    ops.fused_add_rms_norm(x2, res2, w, 1e-6)
    assert torch.equal(res, (x0.float() + res0.float()).to(dtype))
    model, model_res = oracle.vllm_fused_add_rms_norm(x0, res0, w, 1e-6)
    assert torch.equal(res2, model_res)  # the build's own stores (docs §9.1)
    assert_within(x2, model.double(), model.double().abs(), dtype, "norm")
    if oracle.native_library() not in oracle.TRUNCATING_BF16 or dtype != BF:
        assert_within(x, x2.double(), x2.double().abs(), dtype, "norm")
