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
from ..simd import LANES, vfma, vload, vmul, vsplat, vstore, vsum, vzero

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


def check_param(name, x, dt, hv):
    """``x [Hv]`` in fp32 or ``dt``, as an fp32 tensor or array (itself when fp32; 16-bit
    widened, exactly): the per-head gating constants."""
    C.check_dtype(name, x, (torch.float32, dt))
    C.check_shape(name, x, (hv,))
    x = C.as_torch(x)
    return x.float().contiguous()
