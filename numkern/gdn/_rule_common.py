"""What the gated delta rule's two forms share (``numkern.gdn.rule`` documents the ops;
``rule_recurrent`` and ``rule_chunked`` hold them): the kernels' named inputs, the row
helper both forms load q and k with, and the checks both wrappers (and
``numkern.torch_ops.gdn``'s fakes) run.
"""

import math
from typing import NamedTuple

import numpy as np
import torch

from .. import _check as C
from .._jit import jit
from ..attention.plan import index_vector
from ..simd import LANES, vbcast, vfma, vload, vmul, vsplat, vstore, vsub, vsum, vzero

# Columns of the state per pass of both forms' kernels: four vectors, each row's part
# one 256-byte run.
STATE_COLS = 4 * LANES


class Layout(NamedTuple):  # how the kernels address one call's arrays (strides: elements)
    q_token: int
    q_head: int
    k_token: int
    k_head: int
    v_token: int
    v_head: int
    gate_token: int  # a (recurrent) or g (chunked): [T, Hv] rows
    beta_token: int  # b (recurrent) or beta (chunked): [T, Hv] rows
    slot: int  # state slot stride
    dk: int
    dv: int
    hv: int
    group: int  # Hv // Hk: v head h reads k head h // group


class Gating(NamedTuple):  # the recurrent op's fused gating
    softplus_beta: float
    softplus_threshold: float
    l2norm: bool
    eps: float  # the L2 norm's


# --- row helpers (fp32 scratch rows, or carrier rows widened on load) -------------------


@jit
def _load_scaled(src, s0, dst, d0, n, l2norm, eps, scale):
    """``dst[d0:d0+n] = src[s0:s0+n] * scale``, first divided by ``sqrt(sum(src^2) + eps)``
    when ``l2norm``; fp32, n a multiple of 16."""
    s = np.float32(scale)
    if l2norm:
        acc = vzero()
        for i in range(0, n, LANES):
            x = vload(src, s0 + i)
            acc = vfma(x, x, acc)
        s = np.float32(scale / math.sqrt(np.float64(vsum(acc)) + eps))
    sv = vsplat(s)
    for i in range(0, n, LANES):
        vstore(dst, d0 + i, vmul(vload(src, s0 + i), sv))


# Tokens per chunk of the chunked form: flash-linear-attention's and vLLM's size (the
# results do not depend on it beyond rounding). 64 keeps the per-pair scratch (4 chunk
# x Dk/Dv panels and two 64 x 64 matrices, ~160 KB at Dk = Dv = 128) inside L2.
CHUNK = 64


# --- the chunked form's vector-block helpers (``rule_chunked``) ------------------------
# Register-blocked products (as the GEMM tiles of numkern/_tiles.py: accumulators kept
# as vector values, each load used by several FMAs): 64 columns (four vectors) of a row
# at a time.


@jit
def _load4(src, p, nv, scale):
    """``src[p + 16c : +16] * scale`` for c < nv (1..4), the other vectors zero."""
    sv = vsplat(np.float32(scale))
    z = vzero()
    a0 = vmul(vload(src, p), sv)
    a1 = vmul(vload(src, p + LANES), sv) if nv > 1 else z
    a2 = vmul(vload(src, p + 2 * LANES), sv) if nv > 2 else z
    a3 = vmul(vload(src, p + 3 * LANES), sv) if nv > 3 else z
    return a0, a1, a2, a3


@jit
def _store4(dst, p, nv, a0, a1, a2, a3):
    """The first nv (1..4) of a0..a3 to ``dst[p + 16c]``, rounded to its carrier."""
    vstore(dst, p, a0)
    if nv > 1:
        vstore(dst, p + LANES, a1)
    if nv > 2:
        vstore(dst, p + 2 * LANES, a2)
    if nv > 3:
        vstore(dst, p + 3 * LANES, a3)


@jit
def _lincomb(coef, c0, m, sign, src, width, p0, nv, a0, a1, a2, a3):
    """``a_c + sign * sum_{i < m} coef[c0 + i] src[p0 + i*width + 16c : +16]`` for the nv
    (1..4) vectors c: one broadcast per row of src for up to four FMAs. The coefficient
    is read through ``vbcast`` (a plain indexed read of ``coef[c0 + i]`` made Numba emit
    its negative-index wraparound, five scalar instructions per FMA row: this loop ran at
    a quarter of the FMA rate on Zen 4)."""
    z = vzero()
    s0 = s1 = s2 = s3 = z
    for i in range(m):
        x = vbcast(coef, c0 + i)
        p = p0 + i * width
        s0 = vfma(x, vload(src, p), s0)
        if nv > 1:
            s1 = vfma(x, vload(src, p + LANES), s1)
        if nv > 2:
            s2 = vfma(x, vload(src, p + 2 * LANES), s2)
        if nv > 3:
            s3 = vfma(x, vload(src, p + 3 * LANES), s3)
    sg = vsplat(np.float32(sign))
    return vfma(sg, s0, a0), vfma(sg, s1, a1), vfma(sg, s2, a2), vfma(sg, s3, a3)


@jit
def _lincomb8(coef, c0, m, src, width, p0):
    """``sum_{i < m} coef[c0 + i] src[p0 + i*width + 16c : +16]`` for c < 8 (128 columns),
    eight values: eight independent FMA chains per broadcast, no branch in the loop (four
    chains with a run-time vector count left the forward substitution at a quarter of the
    FMA rate: 34 us a 64-token chunk at Dk = Dv = 128 on Zen 4, 9 us of FMAs)."""
    z = vzero()
    s0 = s1 = s2 = s3 = s4 = s5 = s6 = s7 = z
    for i in range(m):
        x = vbcast(coef, c0 + i)
        p = p0 + i * width
        s0 = vfma(x, vload(src, p), s0)
        s1 = vfma(x, vload(src, p + LANES), s1)
        s2 = vfma(x, vload(src, p + 2 * LANES), s2)
        s3 = vfma(x, vload(src, p + 3 * LANES), s3)
        s4 = vfma(x, vload(src, p + 4 * LANES), s4)
        s5 = vfma(x, vload(src, p + 5 * LANES), s5)
        s6 = vfma(x, vload(src, p + 6 * LANES), s6)
        s7 = vfma(x, vload(src, p + 7 * LANES), s7)
    return s0, s1, s2, s3, s4, s5, s6, s7


@jit
def _solve_rows(lm, rhs, r0, rscale, x, i, width):
    """Row i of ``(I + L) X = rscale RHS`` by forward substitution: x's rows (of
    ``width``) before i are solved; RHS row i at ``rhs[r0:]``. 128 columns at a time
    (:func:`_lincomb8`), a last part of 16..112 columns 64 at a time (:func:`_lincomb`)."""
    d = 0
    while d + 8 * LANES <= width:
        s0, s1, s2, s3, s4, s5, s6, s7 = _lincomb8(lm, i * CHUNK, i, x, width, d)
        a0, a1, a2, a3 = _load4(rhs, r0 + d, 4, rscale)
        _store4(x, i * width + d, 4, vsub(a0, s0), vsub(a1, s1), vsub(a2, s2), vsub(a3, s3))
        a0, a1, a2, a3 = _load4(rhs, r0 + d + 4 * LANES, 4, rscale)
        _store4(
            x, i * width + d + 4 * LANES, 4, vsub(a0, s4), vsub(a1, s5), vsub(a2, s6), vsub(a3, s7)
        )
        d += 8 * LANES
    while d < width:
        nv = min(STATE_COLS, width - d) // LANES
        a0, a1, a2, a3 = _load4(rhs, r0 + d, nv, rscale)
        a0, a1, a2, a3 = _lincomb(lm, i * CHUNK, i, -1.0, x, width, d, nv, a0, a1, a2, a3)
        _store4(x, i * width + d, nv, a0, a1, a2, a3)
        d += STATE_COLS


# --- checks ----------------------------------------------------------------------------


def _check_strides(name, x):
    """stride(-1) == 1 and no negative stride (a NumPy view may have one)."""
    C.check_inner_contiguous(name, x)
    C.check_non_negative_strides(name, x)


def check_qkv(names, q, k, v):
    """(dtype, T, Hk, Dk, Hv, Dv) of ``q``, ``k [1, T, Hk, Dk]`` and ``v [1, T, Hv, Dv]``."""
    qn, kn, vn = names
    dt = C.check_dtype(qn, q, C.FLOATS)
    C.check_ndim(qn, q, (4,))
    if q.shape[0] != 1:
        raise ValueError(
            f"{qn}: expected shape [1, T, Hk, Dk] (one packed batch, requests split by "
            f"cu_seqlens), got {list(q.shape)}"
        )
    _, t_n, hk, dk = q.shape
    if hk < 1 or dk < LANES or dk % LANES:
        raise ValueError(
            f"{qn}: expected Hk >= 1 and Dk a multiple of {LANES}, got shape {list(q.shape)}"
        )
    C.check_same_dtype(kn, k, dt, qn)
    C.check_shape(kn, k, (1, t_n, hk, dk))
    C.check_same_dtype(vn, v, dt, qn)
    C.check_shape(vn, v, (1, t_n, None, None))
    hv, dv = v.shape[2], v.shape[3]
    if hv < 1 or hv % hk:
        raise ValueError(f"{vn}: expected Hv a multiple of Hk = {hk}, got shape {list(v.shape)}")
    if dv < LANES or dv % LANES:
        raise ValueError(f"{vn}: expected Dv a multiple of {LANES}, got shape {list(v.shape)}")
    for name, x in zip(names, (q, k, v)):
        _check_strides(name, x)
    return dt, t_n, hk, dk, hv, dv


def check_state(name, state, hv, dk, dv):
    """The slot stride of ``state [num_slots, Hv, Dk, Dv]`` fp32, each slot contiguous."""
    C.check_dtype(name, state, (torch.float32,))
    C.check_shape(name, state, (None, hv, dk, dv))
    st = C.strides_of(state)
    per_slot = hv * dk * dv
    inner = zip(state.shape[1:], st[1:], (dk * dv, dv, 1))  # a size-1 dim's stride is moot
    if any(n > 1 and s != want for n, s, want in inner) or (
        state.shape[0] > 1 and st[0] < per_slot
    ):
        raise ValueError(
            f"{name}: expected [num_slots, {hv}, {dk}, {dv}] with each slot contiguous "
            f"(strides [>= {per_slot}, {dk * dv}, {dv}, 1]), got strides {list(st)}"
        )
    return st[0] if state.shape[0] > 1 else per_slot


def _check_requests(initial_state_indices, cu_seqlens, t_n, num_slots):
    """(slots, cu) int64 copies; whether a request is padding (slot -1)."""
    slots = index_vector("initial_state_indices", initial_state_indices)
    cu = index_vector("cu_seqlens", cu_seqlens)
    n = slots.shape[0]
    if cu.shape[0] != n + 1:
        raise ValueError(
            f"cu_seqlens: expected {n + 1} entries (N+1, N = len(initial_state_indices)), "
            f"got {cu.shape[0]}"
        )
    if cu[0] != 0:
        raise ValueError(f"cu_seqlens: expected to start at 0, got {cu[0]}")
    lens = np.diff(cu)
    if (lens < 0).any():
        r = int(np.argmax(lens < 0))
        raise ValueError(f"cu_seqlens: expected non-decreasing, got {cu[r]} then {cu[r + 1]}")
    if cu[-1] != t_n:
        raise ValueError(f"cu_seqlens: expected to end at T = {t_n} (the tokens), got {cu[-1]}")
    C.check_slots("initial_state_indices", slots, num_slots)
    return slots, cu, bool((slots == C.PAD_SLOT).any())


def check_rows(name, x, dtypes, t_n, hv, lead=()):
    """``x [*lead, T, Hv]`` in one of ``dtypes``, stride(-1) == 1: the token stride."""
    C.check_dtype(name, x, dtypes)
    C.check_shape(name, x, (*lead, t_n, hv))
    _check_strides(name, x)
    return C.strides_of(x)[-2]
