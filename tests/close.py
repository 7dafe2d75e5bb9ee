"""How the tests apply numkern.testing.tolerances' entries, one copy each so the test files
(and fuzz_cases) do not import each other's: :func:`within` / :func:`assert_within`, the
element-wise comparison of the norm, rotary and Gated DeltaNet conv/gating tests (the
table's ulps at the float64 reference rounded to the output dtype, plus its ``mag`` of the
terms' magnitudes and its ``abs``: the kinds ``norm``, ``rope``, ``gdn_conv``,
``gdn_gating``, ``gdn_gating_fuzz``), and :func:`rtol_atol`, an entry as
``torch.testing.assert_close``'s keywords."""

import torch

from numkern.testing.tolerances import tolerance

BF, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32
MANTISSA = {BF: 7, FP16: 10, FP32: 23}  # explicit mantissa bits
MIN_EXP = {BF: -126, FP16: -14, FP32: -126}  # exponent of the smallest normal


def ulp(x, dtype):
    """One unit in the last place of ``dtype`` at the magnitude of ``x`` (float64)."""
    _, e = torch.frexp(x.double())  # |x| in [2^(e-1), 2^e)
    exp = (e - 1).clamp(min=MIN_EXP[dtype]) - MANTISSA[dtype]
    return torch.ldexp(torch.ones_like(x, dtype=torch.float64), exp)


def within(out, ref, mag, dtype, kind):
    """``(ok, worst)``: whether ``out`` (the op's ``dtype`` result) is within
    ``tolerance(kind, dtype)``'s ulps of ``ref`` (float64) rounded to the dtype plus its
    ``mag`` of ``mag`` (the size of the terms that made ``ref``) and its ``abs``, and the
    largest error in units of that bound."""
    t = tolerance(kind, dtype)
    r = ref.to(dtype).double()
    err = (out.double() - r).abs()
    tol = t.ulps * ulp(r, dtype) + t.mag * mag.double() + t.abs
    return bool((err <= tol).all()), (err / tol).max().item() if err.numel() else 0.0


def assert_within(out, ref, mag, dtype, kind):
    ok, worst = within(out, ref, mag, dtype, kind)
    assert ok, f"worst error {worst:.3g} x tolerance"


def rtol_atol(kind, dtype=FP32):
    """``tolerance(kind, dtype)`` as ``torch.testing.assert_close``'s keywords: its
    ``rel`` and ``abs`` (an element passes within ``atol + rtol * |expected|``)."""
    t = tolerance(kind, dtype)
    return dict(rtol=t.rel, atol=t.abs)
