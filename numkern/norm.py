"""RMS norm, alone and fused with the residual add, with vLLM's CPU op argument lists.

Layouts (H: hidden size, R: the number of rows, the product of the leading dims):

* ``rms_norm(out, input, weight, epsilon) -> None``
  - ``input [..., H]`` bf16/fp16/fp32, ``stride(-1) == 1``; the rows may be strided
    (any row stride >= H, e.g. a column slice of a wider buffer) as long as the
    leading dims collapse into one row stride.
  - ``out``: the shape and dtype of ``input``, same stride rules; ``input`` itself (in
    place) or apart from it (ValueError naming ``out`` when they share elements).
  - ``weight [H]`` contiguous, in ``input``'s dtype or fp32 (the engine keeps fp32
    norm weights); None means all ones (vLLM's schema allows it).
  - ``out = round(x / sqrt(mean(x^2) + epsilon) * weight)`` per row, fp32 math and one
    rounding to ``out``'s dtype (``x`` and ``weight`` widened exactly).
* ``fused_add_rms_norm(input, residual, weight, epsilon) -> None``, both in place:
  - ``input``, ``residual``: ``[..., H]``, same shape and dtype, stride rules as above;
    no element in both (ValueError naming ``residual``; windows of one buffer are fine).
  - ``residual = round(input + residual)``, then ``input = round(norm(residual) *
    weight)`` — the norm of the residual as stored. vLLM's CPU kernel takes the
    variance of the unrounded fp32 sum instead; the two differ by at most a rounding
    unit of the 16-bit dtypes (fp32: identical).

Kernels: a row is read twice — a sum of squares 16 lanes at a time (``numkern.simd``,
then a scalar tail, so H need not be a multiple of 16), then the scaled store. Rows are
independent: few rows run on the calling thread, many over rows with ``prange``.

Row kernels for fused callers (``numkern.decoder``), 1-D arrays, row stride ``n``:

* ``_rows(x, w, out, r0, r1, n, eps)``: ``out = norm(x) * w`` for rows r0..r1.
* ``_add_rows(inp, residual, w, out, r0, r1, n, eps, has_norm)``: rows r0..r1,
  ``residual += inp`` (rounded to residual's dtype), then, if ``has_norm``,
  ``out = norm(residual) * w``.

``x``, ``out``, ``inp``, ``residual``: uint16 (bf16 bits), int16 (fp16 bits) or float32
carriers (``numkern._check.CARRIER``); ``w`` any of the three, length ``n``.
"""

import math

import numpy as np
import torch
from numba import prange

from . import _check as C
from ._jit import jit
from .simd import LANES, store_f32, to_f32, vadd, vfma, vload, vmul, vsplat, vstore, vsum, vzero

# Below this many rows (tokens) the ops here and in numkern.rope stay on the calling
# thread: starting a parallel region costs ~5 us, about what one thread needs for 64 rows
# of a 4096-wide norm, and more than rotating a decode batch's heads.
PARALLEL_ROWS = 64


@jit
def _norm_strided(x, xs, w, out, os, r0, r1, n, eps):
    """Rows r0..r1: ``out[r*os:][:n] = norm(x[r*xs:][:n]) * w``."""
    nv = n - n % LANES  # 16 lanes at a time, then a scalar tail
    for r in range(r0, r1):
        xo = r * xs
        oo = r * os
        acc = vzero()
        for i in range(0, nv, LANES):
            v = vload(x, xo + i)
            acc = vfma(v, v, acc)
        s = vsum(acc)
        for i in range(nv, n):
            v = to_f32(x, xo + i)
            s += v * v
        inv = np.float32(1.0 / math.sqrt(s / n + eps))
        iv = vsplat(inv)
        for i in range(0, nv, LANES):
            vstore(out, oo + i, vmul(vmul(vload(x, xo + i), iv), vload(w, i)))
        for i in range(nv, n):
            store_f32(out, oo + i, to_f32(x, xo + i) * inv * to_f32(w, i))


@jit
def _add_strided(inp, si, residual, sr, r0, r1, n):
    """Rows r0..r1: ``residual[r*sr:][:n] += inp[r*si:][:n]``, rounded to residual's dtype."""
    nv = n - n % LANES
    for r in range(r0, r1):
        io = r * si
        ro = r * sr
        for i in range(0, nv, LANES):
            vstore(residual, ro + i, vadd(vload(residual, ro + i), vload(inp, io + i)))
        for i in range(nv, n):
            store_f32(residual, ro + i, to_f32(residual, ro + i) + to_f32(inp, io + i))


@jit
def _rows(x, w, out, r0, r1, n, eps):
    """Rows r0..r1 of ``x`` (row stride n) -> ``out`` (row stride n): norm(x) * w."""
    _norm_strided(x, n, w, out, n, r0, r1, n, eps)


@jit
def _add_rows(inp, residual, w, out, r0, r1, n, eps, has_norm):
    """Rows r0..r1 (row stride n): ``residual += inp``; if has_norm, out = norm(residual) * w."""
    _add_strided(inp, n, residual, n, r0, r1, n)
    if has_norm:
        _norm_strided(residual, n, w, out, n, r0, r1, n, eps)


@jit(parallel=True)
def _rms_norm(x, xs, w, out, os, rows, n, eps):
    if rows < PARALLEL_ROWS:
        _norm_strided(x, xs, w, out, os, 0, rows, n, eps)
    else:
        for r in prange(rows):
            i = np.int64(r)  # (int64 in and out of the parallel body: one signature)
            _norm_strided(x, xs, w, out, os, i, i + 1, n, eps)


@jit(parallel=True)
def _fused_add(inp, si, residual, sr, w, rows, n, eps):
    if rows < PARALLEL_ROWS:
        _add_strided(inp, si, residual, sr, 0, rows, n)
        _norm_strided(residual, sr, w, inp, si, 0, rows, n, eps)
    else:
        for r in prange(rows):
            i = np.int64(r)
            _add_strided(inp, si, residual, sr, i, i + 1, n)
            _norm_strided(residual, sr, w, inp, si, i, i + 1, n, eps)


# --- wrappers -------------------------------------------------------------------------

_ONES = {}  # H -> fp32 ones [H], the weight of weight=None


def _row_stride(name, x):
    """The one stride of the rows of ``x [..., H]`` (leading dims collapsed); ValueError
    when the last dim is not unit-stride or the leading dims do not collapse."""
    C.check_inner_contiguous(name, x)
    strides = C.strides_of(x)
    n = x.shape[-1]
    if 0 in x.shape[:-1]:  # no rows: nothing to collapse
        return n
    rs = None
    expect = None
    for size, st in zip(reversed(x.shape[:-1]), reversed(strides[:-1])):
        if size == 1:
            continue
        if rs is None:
            rs = st
        elif st != expect:
            raise ValueError(
                f"{name}: expected leading dims that collapse into one row stride, got shape "
                f"{list(x.shape)} with strides {list(strides)}"
            )
        expect = st * size
    rs = n if rs is None else rs
    if rs < n:
        raise ValueError(
            f"{name}: expected a row stride >= {n} (rows must not overlap), got strides "
            f"{list(strides)}"
        )
    return rs


def _check_eps(epsilon):
    if isinstance(epsilon, bool) or not isinstance(epsilon, (int, float, np.floating, np.integer)):
        raise TypeError(f"epsilon: expected a float, got {type(epsilon).__name__}")
    eps = float(epsilon)
    if not (eps >= 0.0 and math.isfinite(eps)):
        raise ValueError(f"epsilon: expected a finite float >= 0, got {eps}")
    return eps


def _check_weight(weight, dt, n):
    if weight is None:
        w = _ONES.get(n)
        if w is None:
            w = _ONES[n] = np.ones(n, np.float32)
        return w
    C.check_dtype("weight", weight, (dt, torch.float32))
    C.check_shape("weight", weight, (n,))
    C.check_contiguous("weight", weight)
    return C.as_numpy(weight)


def _check_rows(name, x, other_name=None, other=None):
    """(dtype, rows, row stride) of ``x [..., H]``; same shape/dtype as ``other``."""
    if other is None:
        dt = C.check_dtype(name, x, C.FLOATS)
    else:
        dt = C.dtype_of(other_name, other)
        C.check_same_dtype(name, x, dt, other_name)
        if tuple(x.shape) != tuple(other.shape):
            raise ValueError(
                f"{name}: expected shape {list(other.shape)} (that of {other_name}), "
                f"got {list(x.shape)}"
            )
    if x.ndim < 1 or x.shape[-1] < 1:
        raise ValueError(f"{name}: expected shape [..., H] with H >= 1, got {list(x.shape)}")
    rows = math.prod(x.shape[:-1])
    return dt, rows, _row_stride(name, x)


def _fast(x, like, weight, epsilon):
    """The common case — CPU tensors, contiguous, matching dtypes, a float epsilon — as
    (flat x, flat like, weight carrier, rows, n), or None: anything else goes through the
    checks that name the problem. A decode step calls these ops per layer, so the common
    case reads as few tensor attributes as it can: about 7 us a call on one 4096-wide bf16
    row (Zen 4), against about 25 us through the checks."""
    T = _Tensor
    if not (type(x) is T and type(like) is T and type(weight) is T and type(epsilon) is float):
        return None
    dt = x.dtype
    view = _VIEW.get(dt)  # None: not a float dtype
    shape = x.shape
    if (
        view is None
        or like.dtype is not dt
        or not (weight.dtype is dt or weight.dtype is _F32)
        or not x.is_cpu
        or not like.is_cpu
        or not weight.is_cpu
        or like.shape != shape
        or not shape
        or weight.shape != shape[-1:]
        or not shape[-1]
        or not x.is_contiguous()
        or not like.is_contiguous()
        or not weight.is_contiguous()
        or not 0.0 <= epsilon < _INF
    ):
        return None
    n = shape[-1]
    w = weight.numpy() if weight.dtype is _F32 else weight.view(view).numpy()
    return (
        x.view(view).numpy().reshape(-1),
        like.view(view).numpy().reshape(-1),
        w,
        x.numel() // n,
        n,
    )


_Tensor = torch.Tensor
_F32 = torch.float32
_VIEW = C.TORCH_CARRIER
_INF = float("inf")
_shares_memory = np.shares_memory


def rms_norm(out, input, weight, epsilon):
    """``out = round(input / sqrt(mean(input^2) + epsilon) * weight)`` over the last dim.

    See the module docstring for shapes and dtypes. Returns None.
    """
    fast = _fast(input, out, weight, epsilon)
    if fast is not None:  # contiguous and of one shape: in place, or byte ranges apart
        x0, o0, size = input.data_ptr(), out.data_ptr(), fast[0].nbytes
        if not (x0 == o0 or x0 >= o0 + size or o0 >= x0 + size):
            fast = None  # partly overlapping: the checks below name out
    if fast is not None:
        x, o, w, rows, n = fast
        if rows:
            _rms_norm(x, n, w, o, n, rows, n, epsilon)
        return
    eps = _check_eps(epsilon)
    dt, rows, xs = _check_rows("input", input)
    _, _, os = _check_rows("out", out, "input", input)
    if C.address(out) != C.address(input) or C.strides_of(out) != C.strides_of(input):
        C.check_disjoint("out", out, "input", input, "out is written")  # in place, or apart
    n = input.shape[-1]
    w = _check_weight(weight, dt, n)
    if rows == 0:
        return
    _rms_norm(C.span(input), xs, w, C.span(out), os, rows, n, eps)


def fused_add_rms_norm(input, residual, weight, epsilon):
    """In place: ``residual = round(input + residual)``, then ``input =
    round(norm(residual) * weight)``. See the module docstring. Returns None.
    """
    fast = _fast(input, residual, weight, epsilon)
    if fast is not None and not _shares_memory(fast[0], fast[1]):
        x, r, w, rows, n = fast
        if rows:
            _fused_add(x, n, r, n, w, rows, n, epsilon)
        return
    eps = _check_eps(epsilon)
    dt, rows, si = _check_rows("input", input)
    _, _, sr = _check_rows("residual", residual, "input", input)
    C.check_disjoint("residual", residual, "input", input)
    n = input.shape[-1]
    w = _check_weight(weight, dt, n)
    if rows == 0:
        return
    _fused_add(C.span(input), si, C.span(residual), sr, w, rows, n, eps)
