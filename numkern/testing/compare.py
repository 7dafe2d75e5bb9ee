"""``assert_close``: a kernel's output against a reference, in units of the output
dtype's last place (ulp).

The reference (any float dtype: an fp32 or fp64 reference is usual) is rounded to the
output's dtype first, so the unit is the one the kernel could have hit. Element ``i``
passes when ``|actual - expected| <= ulps * ulp(expected)``, or ``<= atol``; NaN must
stand where the reference has NaN, and an infinity where it has the same infinity. On a
failure the message says how many elements fail, the largest error in ulps and the first
failing indices with their values.
"""

import torch

from .tolerances import TOLERANCES

# ulps allowed by default: the table's ("assert_close", dtype) entries (why: there)
DEFAULT_ULPS = {dt: int(t.ulps) for (kind, dt), t in TOLERANCES.items() if kind == "assert_close"}
_MANTISSA = {torch.bfloat16: 7, torch.float16: 10, torch.float32: 23, torch.float64: 52}


def ulp(x, dtype):
    """The spacing of ``dtype`` at ``|x|`` (float64 tensor): ``2^(e - mantissa bits)``
    with ``e`` the exponent of ``|x|``, at least that of the smallest normal number."""
    fi = torch.finfo(dtype)
    a = x.double().abs().clamp(min=fi.tiny)
    e = torch.floor(torch.log2(a))
    return torch.exp2(e - _MANTISSA[dtype])


def assert_close(actual, expected, *, ulps=None, atol=0.0, max_report=5):
    """Raise ``AssertionError`` unless ``actual`` is within ``ulps`` units of its dtype's
    last place of ``expected`` (rounded to that dtype) everywhere, or within ``atol``.

    ``ulps`` defaults to :data:`DEFAULT_ULPS` of ``actual``'s dtype; ``atol`` (default 0)
    admits small absolute errors where the values cancel to near zero. Shapes must
    match (``ValueError``); the message names at most ``max_report`` failing indices.
    """
    if not isinstance(actual, torch.Tensor) or not isinstance(expected, torch.Tensor):
        raise TypeError(
            f"actual, expected: expected torch.Tensors, got {type(actual).__name__} and "
            f"{type(expected).__name__}"
        )
    dt = actual.dtype
    if dt not in _MANTISSA:
        raise TypeError(f"actual: expected a float dtype of {tuple(_MANTISSA)}, got {dt}")
    if tuple(actual.shape) != tuple(expected.shape):
        raise ValueError(
            f"expected: shape {list(expected.shape)} differs from actual's {list(actual.shape)}"
        )
    ulps = DEFAULT_ULPS[dt] if ulps is None else ulps
    if not (isinstance(ulps, (int, float)) and ulps >= 0):
        raise ValueError(f"ulps: expected a number >= 0, got {ulps!r}")
    a = actual.detach().cpu().double()
    e = expected.detach().cpu().to(dt).double()  # the reference at the output's precision
    err = (a - e).abs()
    unit = ulp(e, dt)
    finite = torch.isfinite(a) & torch.isfinite(e)
    ok = finite & ((err <= ulps * unit) | (err <= atol))
    ok |= (torch.isnan(a) & torch.isnan(e)) | (torch.isinf(a) & (a == e))
    if bool(ok.all()):
        return
    bad = (~ok).nonzero()
    n_bad, n = bad.shape[0], ok.numel()
    in_ulps = torch.where(finite, err / unit, torch.full_like(err, float("inf")))
    worst = float(in_ulps[~ok].max())
    lines = [
        f"{n_bad} of {n} elements differ by more than {ulps} ulp of {str(dt)[6:]} "
        f"(atol {atol}); largest error {worst:.4g} ulp; first failing:"
    ]
    for idx in bad[:max_report].tolist():
        i = tuple(idx)
        lines.append(
            f"  index {i}: actual {a[i].item()!r}, expected {e[i].item()!r} "
            f"(err {err[i].item():.4g} = {in_ulps[i].item():.4g} ulp)"
        )
    raise AssertionError("\n".join(lines))
