"""Quantised linear: ``out = x @ dequantise(weight).T + bias`` on the repacked weight.

Arguments (docs/kernels.md §13.7, §13.8):

* ``out [M, N]``: x's dtype or float32, ``stride(-1) == 1``, rows not overlapping;
* ``x [M, K]``: bfloat16, float16 or float32, ``stride(-1) == 1``;
* ``weight``: a ``numkern.quant.QuantWeight`` of shape ``(N, K)``;
* ``bias [N]``: float32, contiguous, or None.

Paths (``path=None`` chooses once per call from ``numkern.isa.quant_path``):

* fp32 ``x`` is never quantised: the codes are dequantised to fp32 in registers and
  multiplied with FMA (``"fp32"``); 16-bit ``x`` may take it too (``path="fp32"``).
* 16-bit ``x`` is quantised per 32 K to int8 and multiplied with integer dot products:
  ``"vnni512"`` (``vpdpbusd`` zmm, AVX512-VNNI), ``"vnni256"`` (ymm halves: AVX-VNNI, or
  AVX512-VNNI + VL), ``"maddubs"`` (``vpmaddubsw`` + ``vpmaddwd``: AVX2, AVX-512 without
  VNNI); ``"fp32"`` where the CPU has none of them.

The kernel is :mod:`numkern.quant._kernels` (``quantize_rows`` then ``qblocks``), parallel
over row blocks of 16 output columns.
"""

import numba
import numpy as np
import torch
from numba import prange

from .. import _check as C
from .. import isa as _isa
from .._jit import jit
from .._ptr import _to_voidptr as _voidptr
from .._ptr import view
from ..simd_int8 import path_witness, vector_path
from ._kernels import SMALL_M, R, new_act, qblocks, quantize_rows

# Each parallel region costs ~6 us to start here; quantising 64K activations serially
# costs about as much, so smaller activations are quantised on the calling thread.
QUANT_PARALLEL = 1 << 16
CHUNKS = 64


@jit(parallel=True)
def _linear(out, out_rs, x, x_rs, w, code, bias, has_bias, m, n, k, wit):
    act = new_act(m, k, wit)
    if m * k < QUANT_PARALLEL:
        quantize_rows(x, x_rs, k, 0, m, act)
    else:
        for r in prange(m):
            i = np.int64(r)  # (int64 in and out of the parallel body: one signature)
            quantize_rows(x, x_rs, k, i, i + 1, act)
    # row blocks in chunks (a call per row block costs its scratch; 64 chunks keep the
    # threads of a many-core host balanced)
    nrb = (n + R - 1) // R
    per = max(1, nrb // CHUNKS)
    for c in prange((nrb + per - 1) // per):
        b = np.int64(c) * per  # (qblocks compiled once, not for a uint64 index too: 8-10 s)
        qblocks(out, out_rs, act, w, code, m, n, k, b, min(b + per, nrb), bias, has_bias)


@jit
def _linear_at(out_addr, out_rs, x_addr, x_rs, w, code, b_addr, has_bias, m, n, k, carriers):
    """``_linear`` on tensors given by address; ``carriers``: (x, out) carrier witnesses
    and the path witness."""
    xwit, owit, wit = carriers
    out = view(out_addr, (m - 1) * out_rs + n, owit)
    x = view(x_addr, (m - 1) * x_rs + k, xwit)
    bias = numba.carray(_voidptr(b_addr), (n if has_bias else 0,), np.float32)
    _linear(out, out_rs, x, x_rs, w, code, bias, has_bias, m, n, k, wit)


_QUANT_DEFAULT = _isa.quant_path()[0]
_FLOATS = C.FLOATS


def _check(out, x, weight, bias):
    """Every check of :func:`quant_linear`, each naming the argument; returns (m, n, k)."""
    if not all(hasattr(weight, a) for a in ("code", "shape", "data", "qtype")):
        raise TypeError(
            f"weight: expected a numkern.quant.QuantWeight, got {type(weight).__name__}"
        )
    if len(weight.shape) != 2:
        raise ValueError(
            f"weight: expected a QuantWeight of shape (N, K) (one weight, not experts), "
            f"got shape {tuple(weight.shape)}"
        )
    n, k = weight.shape
    dt = C.check_dtype("x", x, _FLOATS)
    C.check_ndim("x", x, (2,))
    m = x.shape[0]
    if x.shape[1] != k:
        raise ValueError(f"x: expected shape [M, {k}] (K of weight), got {list(x.shape)}")
    C.check_dtype("out", out, (dt, torch.float32) if dt != torch.float32 else (dt,))
    C.check_shape("out", out, (m, n))
    for name, t, inner in (("x", x, k), ("out", out, n)):
        st = C.strides_of(t)
        if (st[1] != 1 and inner > 1) or st[0] < inner:
            raise ValueError(
                f"{name}: expected stride(-1) == 1 and rows that do not overlap, got strides "
                f"{list(st)} for shape {list(t.shape)}"
            )
    if bias is not None:
        C.check_dtype("bias", bias, (torch.float32,))
        C.check_shape("bias", bias, (n,))
        C.check_contiguous("bias", bias)
    return m, n, k


def quant_linear(out, x, weight, bias=None, *, path=None):
    """``out = x @ dequantise(weight).T + bias`` (see the module docstring); returns None.

    ``path``: None (fp32 ``x``: ``"fp32"``; 16-bit: this CPU's int8 path) or one of
    ``numkern.isa.QUANT_PATHS`` this CPU can run; an int8 path with fp32 ``x`` is a
    ValueError (fp32 activations are never quantised).
    """
    m, n, k = _check(out, x, weight, bias)
    if path is None:
        path = "fp32" if x.dtype == torch.float32 else _QUANT_DEFAULT
    else:
        path = _isa.check_quant_path(path)
        if path != "fp32" and x.dtype == torch.float32:
            raise ValueError(
                f"path: expected None or 'fp32' for float32 x (fp32 activations are never "
                f"quantised), got {path!r}"
            )
    if m == 0:
        return
    if m <= SMALL_M:  # decode sizes: the amx path's vector code, handed to it directly
        path = vector_path(path)
    carriers = (C.WITNESS[x.dtype], C.WITNESS[out.dtype], path_witness(path))
    w = weight.data
    w = (w.numpy() if isinstance(w, torch.Tensor) else np.asarray(w)).reshape(-1)
    b_a = 0 if bias is None else C.address(bias)
    o_rs, x_rs = C.strides_of(out)[0], C.strides_of(x)[0]
    _linear_at(
        C.address(out), o_rs, C.address(x), x_rs, w, int(weight.code), b_a, b_a != 0, m, n, k,
        carriers,
    )  # fmt: skip
