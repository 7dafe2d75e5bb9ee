"""numkern.gdn.norm: the gated RMS norm against a plain torch transcription of
transformers' Qwen3NextRMSNormGated (its roundings), strided z windows, out= and in
place, the serial/parallel split, and errors raised before the kernel runs.

Compile budget: bf16 with a bf16 weight, bf16 with an fp32 weight, fp32."""

import pytest
import torch
import torch.nn.functional as F

from numkern import gdn
from numkern.gdn import norm as N
from numkern.testing import reference as refs
from numkern.testing.tolerances import tolerance

BF, FP32 = torch.bfloat16, torch.float32


def hf_reference(x, z, weight, eps):
    """transformers' ``Qwen3NextRMSNormGated.forward`` (= ``Qwen3_5RMSNormGated``), as
    written there: fp32 norm, rounded; times the weight (rounded unless the weight is
    fp32: torch's promotion); times silu(z) in fp32; rounded."""
    return refs.rms_norm_gated(x, z, weight, eps)


def one_rounding(x, z, weight, eps):
    """The same math with a single rounding at the end: what the checks must tell apart."""
    h = x.double()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps) * weight.double()
    return (h * F.silu(z.double())).to(x.dtype)


def units_apart(out, ref):
    """|out - ref| in bf16 units at ``ref``'s magnitude (float64)."""
    _, e = torch.frexp(ref.double())
    unit = torch.ldexp(torch.ones_like(ref, dtype=torch.float64), (e - 1).clamp(min=-126) - 7)
    return (out.double() - ref.double()).abs() / unit


def assert_matches_hf(out, ref):
    """bf16: bit-equal on all but 1 in 1000 elements, and at most two units off elsewhere
    (torch's exp, rsqrt or sum order can move an fp32 value across a bf16 rounding
    boundary; a flip in the first rounding carries into the next two). A single rounding
    at the end instead of three is bit-equal on only ~65%. fp32: within 2^-20 relative
    (the kernel's vector exp is a polynomial with ~2e-7 relative error; exp, rsqrt and the
    division each round once more). The bounds: the table's gdn_norm."""
    assert out.shape == ref.shape and out.dtype == ref.dtype
    t = tolerance("gdn_norm", ref.dtype)
    if ref.dtype == BF:
        apart = units_apart(out, ref)
        assert apart.max().item() <= t.ulps, f"{apart.max().item()} units apart"
        assert (apart == 0).double().mean().item() >= 0.999
    else:
        rel = (out.double() - ref.double()).abs() / ref.double().abs().clamp(min=2.0**-126)
        assert rel.max().item() <= t.rel, f"{rel.max().item():.3g} relative error"


def window(shape, dtype, offset=5, extra=37):
    """A column window of a wider [T, width] buffer viewed as ``shape`` (row stride =
    width, head stride D): how z comes out of the fused in-projection."""
    t_n, inner = shape[0], 1
    for s in shape[1:]:
        inner *= s
    buf = (torch.randn(t_n, inner + offset + extra) * 3).to(dtype)
    return buf[:, offset : offset + inner].unflatten(1, shape[1:])


@pytest.mark.parametrize(
    "shape,dtype,wdtype",
    [
        ((13, 97), BF, BF),  # 2-D, D not a multiple of 16: the scalar tail
        ((5, 7, 128), BF, BF),  # [T, Hv, D]
        ((3, 4, 40), BF, FP32),  # an fp32 weight: the product is not rounded
        ((1, 32, 128), FP32, FP32),  # a decode step
        ((41, 24), FP32, FP32),
    ],
)
def test_matches_transformers(shape, dtype, wdtype):
    x = (torch.randn(shape) * 2).to(dtype)
    z = window(shape, dtype)
    weight = (torch.randn(shape[-1]) * 0.5 + 1).to(wdtype)
    out = gdn.rms_norm_gated(x, z, weight, 1e-6)
    assert out.is_contiguous()
    assert_matches_hf(out, hf_reference(x, z, weight, 1e-6))


def test_roundings_are_checked():
    """The bf16 check bites: one rounding at the end (no intermediate ones) fails it."""
    shape = (16, 8, 64)
    x, z = torch.randn(shape).to(BF), window(shape, BF)
    weight = (torch.randn(64) * 0.5 + 1).to(BF)
    ref = hf_reference(x, z, weight, 1e-6)
    with pytest.raises(AssertionError):
        assert_matches_hf(one_rounding(x, z, weight, 1e-6), ref)


def test_out_given_and_in_place():
    shape = (6, 4, 48)
    x, z = torch.randn(shape).to(BF), window(shape, BF)
    weight = torch.randn(48).to(BF)
    ref = hf_reference(x, z, weight, 1e-5)
    out = torch.full(shape, float("nan"), dtype=BF)
    assert gdn.rms_norm_gated(x, z, weight, 1e-5, out=out) is out
    assert_matches_hf(out, ref)
    assert gdn.rms_norm_gated(x, z, weight, 1e-5, out=x) is x  # out = x: in place
    assert torch.equal(x, out)
    zc = z.contiguous()
    assert gdn.rms_norm_gated(out.clone(), zc, weight, 1e-5, out=zc) is zc  # out = z
    assert_matches_hf(zc, hf_reference(out, z, weight, 1e-5))


def test_strided_x_and_numpy():
    """x itself a strided view (heads of [1, T, Hv, D] with a token stride past Hv*D), and
    fp32 NumPy arrays (a torch result)."""
    base = torch.randn(5, 3, 40, dtype=FP32)
    x = base[:, 1:, :]  # token stride 120, head stride 40
    z = window(x.shape, FP32)
    weight = torch.randn(40)
    out = gdn.rms_norm_gated(x, z, weight, 1e-6)
    assert_matches_hf(out, hf_reference(x, z, weight, 1e-6))
    out_np = gdn.rms_norm_gated(x.contiguous().numpy(), z.numpy(), weight.numpy(), 1e-6)
    assert torch.equal(out_np, out)


def test_parallel_rows_equal_serial():
    """A call past PARALLEL_ELEMENTS (prange over rows) equals the same rows in calls
    small enough for one thread, bit for bit."""
    shape = (40, 8, 64)
    assert shape[0] * shape[1] * shape[2] >= N.PARALLEL_ELEMENTS > 8 * 64
    x, z = torch.randn(shape).to(BF), window(shape, BF)
    weight = torch.randn(64).to(BF)
    whole = gdn.rms_norm_gated(x, z, weight, 1e-6)
    for t in range(shape[0]):
        assert torch.equal(
            whole[t : t + 1], gdn.rms_norm_gated(x[t : t + 1], z[t : t + 1], weight, 1e-6)
        )


def test_empty():
    x = torch.empty(0, 4, 16, dtype=BF)
    out = gdn.rms_norm_gated(x, x.clone(), torch.ones(16, dtype=BF), 1e-6)
    assert out.shape == (0, 4, 16)


# --- errors: raised before the kernel runs (out unchanged) ------------------------------


def _valid():
    shape = (3, 2, 16)
    return dict(
        x=torch.randn(shape).to(BF),
        z=window(shape, BF),
        weight=torch.ones(16, dtype=BF),
        eps=1e-6,
        out=torch.zeros(shape, dtype=BF),
    )


BAD = [
    ("x", torch.zeros(3, 2, 16, dtype=torch.float64), TypeError, "bfloat16"),
    ("x", torch.zeros(3, 2, 2, 16, dtype=BF), ValueError, "2-D or 3-D"),
    ("x", [[1.0]], TypeError, "torch.Tensor"),
    ("x", torch.zeros(3, 2, 32, dtype=BF)[..., ::2], ValueError, r"stride\(-1\) == 1"),
    ("z", torch.zeros(3, 2, 16), TypeError, "that of x"),
    ("z", torch.zeros(3, 16, dtype=BF), ValueError, r"\[3, 2, 16\]"),
    ("z", torch.zeros(3, 2, 32, dtype=BF)[..., ::2], ValueError, r"stride\(-1\) == 1"),
    ("weight", torch.ones(15, dtype=BF), ValueError, r"\[16\]"),
    ("weight", torch.ones(16, dtype=torch.float16), TypeError, "bfloat16 or float32"),
    ("weight", torch.ones(32, dtype=BF)[::2], ValueError, "contiguous"),
    ("eps", -1e-6, ValueError, ">= 0"),
    ("eps", float("nan"), ValueError, "finite"),
    ("eps", True, TypeError, "float"),
    ("eps", None, TypeError, "float"),
    ("out", torch.zeros(3, 2, 16), TypeError, "that of x"),
    ("out", torch.zeros(3, 32, dtype=BF), ValueError, r"\[3, 2, 16\]"),
    ("out", torch.zeros(3, 2, 32, dtype=BF)[..., :16], ValueError, "contiguous"),
    ("out", "buffer", TypeError, "torch.Tensor"),
]


@pytest.mark.parametrize("name,value,exc,match", BAD)
def test_rejects(name, value, exc, match):
    args = _valid()
    out = args["out"]
    args[name] = value
    with pytest.raises(exc, match=f"^{name}: .*{match}"):
        gdn.rms_norm_gated(**args)
    assert not out.any()


def test_rejects_out_sharing_memory():
    """out overlapping x or z other than exactly (a shifted window) is refused; so is a
    shifted copy of x's memory."""
    args = _valid()
    buf = torch.zeros(3 * 2 * 16 + 8, dtype=BF)
    args["x"] = buf[:96].view(3, 2, 16)
    args["out"] = buf[8:].view(3, 2, 16)
    with pytest.raises(ValueError, match=r"^out: .*shares elements with it"):
        gdn.rms_norm_gated(**args)
    args = _valid()
    wide = args["z"]._base
    args["out"] = wide.view(-1)[: 3 * 2 * 16].view(3, 2, 16)  # z's buffer, shifted
    with pytest.raises(ValueError, match=r"^out: .*z's"):
        gdn.rms_norm_gated(**args)
