"""Gated DeltaNet's gated RMS norm, per head: transformers' ``Qwen3NextRMSNormGated`` /
``Qwen3_5RMSNormGated`` (vLLM's ``RMSNormGated`` with ``norm_before_gate``), applied to
the core attention output with the ``z`` gate of the fused in-projection.

``rms_norm_gated(x, z, weight, eps, out=None) -> out``, rows of D (one head of a token):

* ``x [N, D]`` or ``[T, Hv, D]``: bf16/fp16/fp32, ``stride(-1) == 1``, other strides free
  (non-negative).
* ``z``: ``x``'s shape and dtype, ``stride(-1) == 1``, any other strides (a column window
  of the projection buffer).
* ``weight [D]``: ``x``'s dtype or fp32 (an engine that keeps norm weights in fp32),
  contiguous. ``eps``: a finite float >= 0.
* ``out``: None (a new contiguous tensor) or a contiguous tensor of ``x``'s shape and
  dtype, apart from ``x`` and ``z`` or one of them exactly (in place). Returned.

Rounding exactly as transformers' module, with ``r()`` rounding to x's dtype and every
product in fp32::

    h = r(x * rsqrt(mean(x^2) + eps))
    h = r(weight * h)             # no rounding when weight is fp32 (torch's promotion)
    y = r(h * silu(z))            # silu(z) = z / (1 + exp(-z))

Each ``r()`` is a store of the row chunk to ``out`` (x's dtype) and a load back, so the
roundings are those of the store intrinsics (RNE). 16-bit results differ from torch's
only where its ``exp``, ``rsqrt`` or sum order moves an fp32 value across a rounding
boundary; fp32 ones by a few units (``simd.vexp``'s relative error is ~2e-7).

Kernel: a row is read twice, 16 lanes at a time (``numkern.simd``) with a scalar tail, so
D need not be a multiple of 16: the sum of squares, then the three steps above per chunk.
Rows are independent: small calls (a decode step's Hv rows) run on the calling thread,
larger ones with ``prange`` over rows.
"""

import math

import numpy as np
import torch
from numba import prange

from .. import _check as C
from .._jit import jit
from .._ptr import view
from ..simd import (
    LANES,
    store_f32,
    to_f32,
    vadd,
    vdiv,
    vexp,
    vfma,
    vload,
    vmul,
    vsplat,
    vstore,
    vsub,
    vsum,
    vzero,
)
from ._common import elements_spanned

# Below this many elements one thread runs the call: a parallel region costs ~5 us
# (numkern.norm), and one thread needs ~0.9 ns an element here (Zen 4: a decode step's
# 32 heads x 128 in ~4 us; 16k elements ran in 9.5 us on two threads, ~15 us on one).
PARALLEL_ELEMENTS = 1 << 14


@jit(inline="always")
def _rows(x, xs0, xs1, z, zs0, zs1, w, out, r0, r1, hv, d, eps, round_wh):
    """Rows r0..r1 (row r: token r // hv, head r % hv) -> out rows (contiguous, d each)."""
    nv = d - d % LANES  # 16 lanes at a time, then a scalar tail
    one = vsplat(np.float32(1.0))
    zero = vzero()
    for r in range(r0, r1):
        t = r // hv
        h = r - t * hv
        xo = t * xs0 + h * xs1
        zo = t * zs0 + h * zs1
        oo = r * d
        acc = vzero()
        for i in range(0, nv, LANES):
            v = vload(x, xo + i)
            acc = vfma(v, v, acc)
        s = vsum(acc)
        for i in range(nv, d):
            v = to_f32(x, xo + i)
            s += v * v
        inv = np.float32(1.0 / math.sqrt(np.float32(s / d) + eps))
        iv = vsplat(inv)
        for i in range(0, nv, LANES):
            zv = vload(z, zo + i)  # before out is written: out may be z itself
            vstore(out, oo + i, vmul(vload(x, xo + i), iv))
            hw = vmul(vload(w, i), vload(out, oo + i))
            if round_wh:
                vstore(out, oo + i, hw)
                hw = vload(out, oo + i)
            silu = vdiv(zv, vadd(one, vexp(vsub(zero, zv))))
            vstore(out, oo + i, vmul(hw, silu))
        for i in range(nv, d):
            zs = to_f32(z, zo + i)
            store_f32(out, oo + i, to_f32(x, xo + i) * inv)
            hs = to_f32(w, i) * to_f32(out, oo + i)
            if round_wh:
                store_f32(out, oo + i, hs)
                hs = to_f32(out, oo + i)
            silu = np.float32(zs / (1.0 + math.exp(-zs)))
            store_f32(out, oo + i, hs * silu)


@jit(parallel=True)
def _norm_gated(x_a, x_n, xs0, xs1, z_a, z_n, zs0, zs1, w_a, o_a, rows, hv, d, eps, carriers):
    """Tensors by address (``numkern._ptr``); ``carriers``: (x/z/out carrier, weight
    carrier, whether r(weight * h) is rounded), one entry of ``_CARRIERS``."""
    xwit, wwit, round_wh = carriers
    x = view(x_a, x_n, xwit)
    z = view(z_a, z_n, xwit)
    w = view(w_a, d, wwit)
    out = view(o_a, rows * d, xwit)
    if rows * d < PARALLEL_ELEMENTS:
        _rows(x, xs0, xs1, z, zs0, zs1, w, out, 0, rows, hv, d, eps, round_wh)
    else:
        for r in prange(rows):
            i = np.int64(r)  # (int64 in and out of the parallel body: one signature)
            _rows(x, xs0, xs1, z, zs0, zs1, w, out, i, i + 1, hv, d, eps, round_wh)


# --- wrapper ----------------------------------------------------------------------------

# (x dtype, weight dtype) -> (x carrier, weight carrier, round r(weight * h)): the weight
# in x's dtype gives a product rounded to that dtype; an fp32 weight promotes it to fp32.
_CARRIERS = {
    (dt, wdt): (C.WITNESS[dt], C.WITNESS[wdt], wdt is dt)
    for dt in C.FLOATS
    for wdt in {dt, torch.float32}
}
_Tensor = torch.Tensor
_INF = float("inf")


def _layout(x):
    """(rows, heads, token stride, head stride, extent) of ``x [N, D]`` or ``[T, Hv, D]``
    (tensor or array; extent: elements from the first to one past the last)."""
    shape, st = x.shape, C.strides_of(x)
    extent = elements_spanned(shape, st)
    if len(shape) == 2:
        return shape[0], 1, st[0], 0, extent
    return shape[0] * shape[1], shape[1], st[0], st[1], extent


def _overlaps(out, other, other_extent):
    """Whether contiguous ``out`` and ``other``'s memory spans intersect, unless ``other``
    is ``out`` exactly (same address and layout: safe in place)."""
    o0, x0 = out.data_ptr(), other.data_ptr()
    if o0 == x0 and out.stride() == other.stride():
        return False
    size = out.element_size()
    return o0 < x0 + other_extent * size and x0 < o0 + out.numel() * size


def _fast(x, z, weight, eps, out):
    """The common case — CPU tensors, matching dtypes, unit inner strides, a float eps,
    ``out`` None or apart from x and z — as (out, the kernel's arguments), or None:
    anything else goes through :func:`_check`, which names the problem. Only tensor
    attributes are read, as few as can be (a decode step calls this once per GDN layer:
    ~3 us here against ~7 us through the checks, Zen 4)."""
    T = _Tensor
    if not (type(x) is T and type(z) is T and type(weight) is T and type(eps) is float):
        return None
    dt = x.dtype
    carriers = _CARRIERS.get((dt, weight.dtype))
    shape = x.shape
    if (
        carriers is None
        or z.dtype is not dt
        or not (x.is_cpu and z.is_cpu and weight.is_cpu)
        or z.shape != shape
        or weight.shape != shape[-1:]
        or not weight.is_contiguous()
        or not 0.0 <= eps < _INF
    ):
        return None
    xs, zs = x.stride(), z.stride()
    if len(shape) == 3:
        t_n, hv, d = shape
        xs0, xs1, xi = xs
        zs0, zs1, zi = zs
        span = (t_n - 1, hv - 1)
    elif len(shape) == 2:
        t_n, d = shape
        hv, xs1, zs1 = 1, 0, 0
        xs0, xi = xs
        zs0, zi = zs
        span = (t_n - 1, 0)
    else:
        return None
    rows = t_n * hv
    if xi != 1 or zi != 1 or not d:
        return None
    if rows:
        xn = span[0] * xs0 + span[1] * xs1 + d
        zn = span[0] * zs0 + span[1] * zs1 + d
    else:
        xn = zn = 0
    if out is None:
        out = _empty_like(x, memory_format=_CONTIGUOUS)
    elif (
        type(out) is not T
        or out.dtype is not dt
        or not out.is_cpu
        or out.shape != shape
        or not out.is_contiguous()
        or _overlaps(out, x, xn)
        or _overlaps(out, z, zn)
    ):
        return None
    x_a, z_a, w_a, o_a = x.data_ptr(), z.data_ptr(), weight.data_ptr(), out.data_ptr()
    return out, (x_a, xn, xs0, xs1, z_a, zn, zs0, zs1, w_a, o_a, rows, hv, d, eps, carriers)


_empty_like = torch.empty_like
_CONTIGUOUS = torch.contiguous_format


def check_norm_args(x, z, weight, eps):
    """The checks of :func:`rms_norm_gated` of all but ``out``, each naming the argument
    (``numkern.torch_ops``' fake runs them too): (x's dtype, eps as a float)."""
    dt = C.check_dtype("x", x, C.FLOATS)
    C.check_ndim("x", x, (2, 3))
    C.check_inner_contiguous("x", x)
    C.check_non_negative_strides("x", x)
    C.check_same_dtype("z", z, dt, "x")
    if tuple(z.shape) != tuple(x.shape):
        raise ValueError(f"z: expected shape {list(x.shape)} (that of x), got {list(z.shape)}")
    C.check_inner_contiguous("z", z)
    C.check_non_negative_strides("z", z)
    d = x.shape[-1]
    if d < 1:
        raise ValueError(f"x: expected a last dim D >= 1, got shape {list(x.shape)}")
    C.check_dtype("weight", weight, (dt, torch.float32))
    C.check_shape("weight", weight, (d,))
    C.check_contiguous("weight", weight)
    return dt, C.check_float("eps", eps, low=0.0)


def _check(x, z, weight, eps, out):
    """Every check of :func:`rms_norm_gated`, each naming the argument; (eps, out)."""
    dt, eps = check_norm_args(x, z, weight, eps)
    if out is None:
        return eps, torch.empty(tuple(x.shape), dtype=dt)
    C.check_same_dtype("out", out, dt, "x")
    if tuple(out.shape) != tuple(x.shape):
        raise ValueError(f"out: expected shape {list(x.shape)} (that of x), got {list(out.shape)}")
    C.check_contiguous("out", out)
    for name, other in (("x", x), ("z", z)):
        same = C.address(out) == C.address(other) and C.strides_of(out) == C.strides_of(other)
        if not same:
            C.check_disjoint("out", out, name, other)
    return eps, out


def rms_norm_gated(x, z, weight, eps, out=None):
    """``out = r(r(weight * r(x * rsqrt(mean(x^2) + eps))) * silu(z))`` over the last dim
    (transformers' Qwen3-Next / Qwen3.5 gated RMS norm). Returns ``out`` (a new tensor
    when None). See the module docstring for shapes, dtypes and rounding."""
    fast = _fast(x, z, weight, eps, out)
    if fast is None:
        eps, out = _check(x, z, weight, eps, out)
        rows, hv, xs0, xs1, xn = _layout(x)
        _, _, zs0, zs1, zn = _layout(z)
        carriers = _CARRIERS[(C.dtype_of("x", x), C.dtype_of("weight", weight))]
        x_a, z_a, w_a, o_a = (C.address(a) for a in (x, z, weight, out))
        args = (x_a, xn, xs0, xs1, z_a, zn, zs0, zs1, w_a, o_a, rows, hv, x.shape[-1], eps)
        fast = out, (*args, carriers)
    out, args = fast
    _norm_gated(*args)  # no rows: the loops run zero times
    return out
