"""Gated DeltaNet's short causal depthwise convolution, with vLLM 0.32's CPU op argument
lists (``causal_conv1d_fwd_cpu`` / ``causal_conv1d_update_cpu`` in ``vllm/_custom_ops.py``,
kernels in vLLM's ``csrc/cpu/sgl-kernels/conv.cpp``) and its per-request rolling state.

Each of the ``dim`` channels is convolved with its own ``width`` taps over time:
``out[t, c] = act(bias[c] + sum_k w[c, k] * s[t + k, c])`` where ``s`` is the request's
history (the last ``width - 1`` inputs of its earlier chunks, zeros for a new request)
followed by its new tokens; ``act`` is SiLU (``y / (1 + exp(-y))``) or the identity. fp32
math, one rounding to ``x``'s dtype. The history lives in ``conv_states`` by slot and is
rewritten in place.

Layouts (R requests, T tokens in the chunk, S state slots, L = conv_states.shape[2] >=
width - 1; every float tensor in one dtype, bf16/fp16/fp32; any strides unless named):

* ``causal_conv1d_fwd(x, weight, bias, conv_states, query_start_loc, cache_indices,
  has_initial_state, silu_activation, is_weight_packed) -> out`` (prefill):
  - ``x [dim, T]``: a varlen chunk, request r owning columns ``query_start_loc[r]`` to
    ``query_start_loc[r+1]`` (vLLM passes ``mixed_qkv.transpose(0, 1)``, a view of a
    ``[T, dim]`` buffer); or ``x [R, dim, T]`` with ``query_start_loc`` None.
  - ``query_start_loc [R+1]`` int32, from 0 to T, non-decreasing.
  - ``cache_indices [R]`` int32: request r's slot, or -1 (``PAD_SLOT_ID``: the request is
    padding, its output is zero and no state is read or written); None: slot r.
  - ``has_initial_state [R]`` bool: whether the slot's history is read (else zeros); None:
    all False.
  - ``conv_states [S, dim, L]``: column j of a slot is input ``j`` of its last
    ``width - 1`` (oldest first) — vLLM's layout, whose memory is ``[S, L, dim]``
    (``stride(1) == 1``); a dim-first ``[S, dim, L]`` buffer works too (both without a
    copy). Only columns ``0 .. width-2`` are read and written.
  - returns ``out``, ``torch.empty_like(x)`` (so the strides of x).
* ``causal_conv1d_update(x, conv_states, weight, bias, silu_activation,
  conv_state_indices, is_weight_packed, num_accepted_tokens=None) -> out`` (decode):
  - ``x [B, dim]``: one token per request; history = columns ``0 .. width-2``, which
    shift left by one with the token appended.
  - ``x [B, q, dim]`` with ``num_accepted_tokens [B]`` int32 (speculative decoding over a
    wide buffer, ``q <= L``): history = columns ``n-1 .. n+width-3`` (n = accepted
    tokens, ``1 <= n <= q``, ``n + width - 2 <= L``); afterwards the slot holds columns
    ``n .. n+L-q-1`` of before, then the q new tokens (vLLM's rollback buffer).
  - ``conv_state_indices [B]`` int32 (or None: slot b), -1 as above.
  - returns ``out``, ``torch.empty_like(x)``.
* ``weight``: ``[dim, width]`` or ``[dim, 1, width]`` (nn.Conv1d's), contiguous.
  ``is_weight_packed=True``: the weight is ``causal_conv1d_weight_pack``'s output (vLLM's
  VNNI layout, below) and is read in that layout; False: plain.
* ``bias [dim]`` or None, contiguous.

``causal_conv1d_weight_pack(weight)``: vLLM's layout, a permutation of ``[dim, width]``
(dim a multiple of 32, width even): channels in blocks of 32, each block
``[width/2, 32, 2]`` — ``packed.flat[(c//32)*32*width + (k//2)*64 + (c%32)*2 + k%2] =
weight[c, k]``.

Kernel: the taps and bias are widened once per call to an fp32 ``[width + 1, dim]``
table. A work item is up to BLOCK_T tokens of one request over every channel (16 channels
per vector where x and out have unit channel stride, scalars otherwise); the first block
of a request stages its history in fp32. Only then, in a second loop, is each slot rolled
(the items read the history the roll overwrites). Items write disjoint outputs and
requests disjoint slots (distinct slots are checked up front), so ``prange`` runs both
loops without atomics.
"""

import math
from typing import NamedTuple

import numpy as np
import torch
from numba import prange

from .. import _check as C
from .._jit import jit
from ..simd import LANES, store_f32, to_f32, vadd, vdiv, vexp, vfma, vload, vsplat, vstore, vsub

PAD_SLOT_ID = C.PAD_SLOT  # vLLM's pad slot (vllm.v1.attention.backends.utils.PAD_SLOT_ID)
BLOCK_T = 32  # tokens per work item (all channels): vLLM's block; a [T, dim] chunk is
# read row by row (an item that walked one narrow channel strip down 1000 tokens of an
# 8192-wide chunk took a TLB miss per token and ran ~10x slower)
PACK_N = 32  # channels per block of the packed weight (vLLM's block_size_n())
# Below this many (token, channel) pairs one thread runs the call: a parallel region costs
# ~5 us (numkern.norm), about what one thread needs for 64k pairs at width 4.
PARALLEL_WORK = 1 << 16


class ConvShape(NamedTuple):
    dim: int
    width: int
    keep: int  # state columns rewritten per slot (width - 1, or L for the wide update)
    has_bias: bool
    silu: bool
    packed: bool


class ConvStrides(NamedTuple):  # element strides
    x_dim: int
    x_token: int
    o_dim: int
    o_token: int
    s_slot: int
    s_dim: int
    s_col: int


class Requests(NamedTuple):  # int64 [R] each, then int64 [items] each
    x_start: np.ndarray  # element offset of the request's first token in x
    o_start: np.ndarray  # ... in out
    tokens: np.ndarray
    slot: np.ndarray  # -1: padding
    history: np.ndarray  # first state column of its history
    advance: np.ndarray  # new column j = old column j + advance (while j < keep - tokens)
    initial: np.ndarray  # 1: read the history and kept columns from the slot; 0: zeros
    item_req: np.ndarray  # work item -> its request
    item_t0: np.ndarray  # work item -> its first token (a multiple of BLOCK_T)


@jit(inline="always")
def _tap(c, k, width, packed):
    """Flat index of weight[c, k] in the plain or packed layout."""
    if packed:
        return (c // PACK_N) * PACK_N * width + (k // 2) * (2 * PACK_N) + (c % PACK_N) * 2 + k % 2
    return c * width + k


@jit
def _stage_weights(w, bias, sh):
    """fp32 [width + 1, dim]: tap k of every channel in row k, the bias (or 0) in the last."""
    dim, K = sh.dim, sh.width
    wt = np.empty((K + 1) * dim, np.float32)
    for c in range(dim):
        for k in range(K):
            wt[k * dim + c] = to_f32(w, _tap(c, k, K, sh.packed))
        wt[K * dim + c] = to_f32(bias, c) if sh.has_bias else np.float32(0.0)
    return wt


@jit
def _tokens(x, out, wt, state, rq, it, sh, st):
    """Item ``it``: up to BLOCK_T tokens of one request, every channel."""
    r = rq.item_req[it]
    t0 = rq.item_t0[it]
    q = rq.tokens[r]
    t1 = min(t0 + BLOCK_T, q)
    slot = rq.slot[r]
    dim, K = sh.dim, sh.width
    H = K - 1
    xb = rq.x_start[r]
    ob = rq.o_start[r]
    if slot < 0:  # padding: zero output, state untouched
        for t in range(t0, t1):
            for c in range(dim):
                store_f32(out, ob + t * st.o_token + c * st.o_dim, np.float32(0.0))
        return
    # history [H, dim] fp32 for the tokens whose taps reach before the chunk
    hist = np.empty(H * dim if t0 < H else 0, np.float32)
    if t0 < H:
        h0 = slot * st.s_slot + rq.history[r] * st.s_col
        for i in range(H):
            for c in range(dim):
                v = np.float32(0.0)
                if rq.initial[r] != 0:
                    v = to_f32(state, h0 + i * st.s_col + c * st.s_dim)
                hist[i * dim + c] = v
    nv = dim - dim % LANES if st.x_dim == 1 and st.o_dim == 1 else 0
    one = vsplat(np.float32(1.0))
    zero = vsplat(np.float32(0.0))
    for t in range(t0, t1):
        xt = xb + (t - H) * st.x_token  # x[t + k - H] is at xt + k * x_token
        ot = ob + t * st.o_token
        for c in range(0, nv, LANES):
            acc = vload(wt, K * dim + c)
            for k in range(K):
                if t + k < H:
                    v = vload(hist, (t + k) * dim + c)
                else:
                    v = vload(x, xt + k * st.x_token + c)
                acc = vfma(vload(wt, k * dim + c), v, acc)
            if sh.silu:
                acc = vdiv(acc, vadd(one, vexp(vsub(zero, acc))))
            vstore(out, ot + c, acc)
        for c in range(nv, dim):
            a = wt[K * dim + c]
            for k in range(K):
                if t + k < H:
                    v = hist[(t + k) * dim + c]
                else:
                    v = to_f32(x, xt + k * st.x_token + c * st.x_dim)
                a += wt[k * dim + c] * v
            if sh.silu:
                a = a / (np.float32(1.0) + np.float32(math.exp(-a)))
            store_f32(out, ot + c * st.o_dim, a)


@jit
def _roll(x, state, rq, r, sh, st):
    """Request r's slot, columns 0..keep-1: old columns shifted by ``advance`` (ascending,
    so the in-place copy reads before it writes), then its newest tokens. A request with
    no tokens leaves its slot as it was (vLLM's torch reference skips it)."""
    slot = rq.slot[r]
    q = rq.tokens[r]
    if slot < 0 or q == 0:
        return
    keep = sh.keep
    adv = rq.advance[r]
    init = rq.initial[r] != 0
    sb = slot * st.s_slot
    xb = rq.x_start[r]
    for j in range(keep):
        src = j - (keep - q)  # token index when >= 0
        for c in range(sh.dim):
            d = sb + c * st.s_dim + j * st.s_col
            if src >= 0:
                store_f32(state, d, to_f32(x, xb + src * st.x_token + c * st.x_dim))
            elif init:
                store_f32(state, d, to_f32(state, d + adv * st.s_col))
            else:
                store_f32(state, d, np.float32(0.0))


@jit(parallel=True)
def _conv(x, out, w, bias, state, rq, sh, st, work):
    """Outputs first (items read the slots' history), then every slot rolled."""
    wt = _stage_weights(w, bias, sh)
    items = rq.item_req.shape[0]
    R = rq.tokens.shape[0]
    if work < PARALLEL_WORK:
        for it in range(items):
            _tokens(x, out, wt, state, rq, it, sh, st)
        for r in range(R):
            _roll(x, state, rq, r, sh, st)
    else:
        for it in prange(items):
            _tokens(x, out, wt, state, rq, it, sh, st)
        for r in prange(R):
            _roll(x, state, rq, r, sh, st)


# --- wrappers -------------------------------------------------------------------------


def causal_conv1d_weight_pack(weight):
    """vLLM's packed conv weight (see the module docstring): a new tensor, the shape of
    ``weight`` ([dim, width] or [dim, 1, width]), elements permuted."""
    dim, width = _weight_dims(weight)
    if dim % PACK_N or width % 2:
        raise ValueError(
            f"weight: expected dim a multiple of {PACK_N} and an even width to pack, got "
            f"dim {dim}, width {width}"
        )
    w = C.as_torch(weight).reshape(dim // PACK_N, PACK_N, width // 2, 2)
    return w.permute(0, 2, 1, 3).contiguous().reshape(weight.shape)


def _weight_dims(weight):
    C.check_dtype("weight", weight, C.FLOATS)
    C.check_ndim("weight", weight, (2, 3))
    if weight.ndim == 3 and weight.shape[1] != 1:
        raise ValueError(
            f"weight: expected shape [dim, width] or [dim, 1, width], got {list(weight.shape)}"
        )
    C.check_contiguous("weight", weight)
    dim, width = weight.shape[0], weight.shape[-1]
    if dim < 1 or width < 1:
        raise ValueError(f"weight: expected dim >= 1 and width >= 1, got {list(weight.shape)}")
    return dim, width


def _check_common(x, weight, bias, conv_states, silu_activation, is_weight_packed):
    """(dim, width, weight carrier, bias carrier, packed, silu)."""
    dt = C.check_dtype("x", x, C.FLOATS)
    silu = C.check_bool("silu_activation", silu_activation)
    packed = C.check_bool("is_weight_packed", is_weight_packed)
    C.check_same_dtype("weight", weight, dt, "x")
    dim, width = _weight_dims(weight)
    if packed and (dim % PACK_N or width % 2):
        raise ValueError(
            f"is_weight_packed: the packed layout needs dim a multiple of {PACK_N} and an "
            f"even width, got dim {dim}, width {width}"
        )
    if bias is None:
        b = C.WITNESS[dt]
    else:
        C.check_same_dtype("bias", bias, dt, "x")
        C.check_shape("bias", bias, (dim,))
        C.check_contiguous("bias", bias)
        b = C.as_numpy(bias)
    if conv_states is None:
        raise TypeError("conv_states: expected a tensor [num_slots, dim, width-1+], got None")
    C.check_same_dtype("conv_states", conv_states, dt, "x")
    C.check_ndim("conv_states", conv_states, (3,))
    if conv_states.shape[1] != dim or conv_states.shape[2] < width - 1:
        raise ValueError(
            f"conv_states: expected shape [*, {dim}, >= {width - 1}] (dim and width - 1 of "
            f"weight), got {list(conv_states.shape)}"
        )
    return dim, width, C.as_numpy(weight).reshape(-1), b, packed, silu


def _index_array(name, t, dtype, n):
    """``t`` checked as a 1-D [n] tensor/array of exactly ``dtype``, as an int64 array."""
    C.check_dtype(name, t, (dtype,))
    C.check_shape(name, t, (n,))
    return np.asarray(C.as_numpy(t)).astype(np.int64)


def _slots(name, idx, n, num_slots):
    """Slot per request (int64): ``idx`` checked, or 0..n-1 when None."""
    if idx is None:
        if n > num_slots:
            raise ValueError(
                f"{name}: None means slot r for request r, but there are {n} requests and "
                f"{num_slots} slots"
            )
        return np.arange(n, dtype=np.int64)
    return C.check_slots(name, _index_array(name, idx, torch.int32, n), num_slots)


def _requests(*per_request):
    """:class:`Requests` with the work items: each request's tokens in blocks of BLOCK_T."""
    tokens = per_request[2]
    blocks = (tokens + BLOCK_T - 1) // BLOCK_T
    first = np.cumsum(blocks) - blocks
    item_req = np.repeat(np.arange(tokens.size, dtype=np.int64), blocks)
    item_t0 = (np.arange(item_req.size, dtype=np.int64) - first[item_req]) * BLOCK_T
    return Requests(*per_request, item_req, item_t0)


def causal_conv1d_fwd(
    x,
    weight,
    bias,
    conv_states,
    query_start_loc,
    cache_indices,
    has_initial_state,
    silu_activation,
    is_weight_packed,
):
    """Prefill over a varlen chunk; rewrites ``conv_states`` of the requests' slots in
    place. Returns ``out`` shaped like ``x``. See the module docstring."""
    dim, width, w, b, packed, silu = _check_common(
        x, weight, bias, conv_states, silu_activation, is_weight_packed
    )
    if query_start_loc is None:
        C.check_ndim("x", x, (3,))
        R, xd, T = x.shape
        if xd != dim:
            raise ValueError(
                f"x: expected shape [*, {dim}, *] (dim of weight), got {list(x.shape)}"
            )
        sx = C.strides_of(x)
        tokens = np.full(R, T, np.int64)
        starts = np.arange(R, dtype=np.int64)
        x_start = starts * sx[0]
        x_dim, x_token = sx[1], sx[2]
    else:
        C.check_ndim("x", x, (2,))
        if x.shape[0] != dim:
            raise ValueError(f"x: expected shape [{dim}, *] (dim of weight), got {list(x.shape)}")
        T = x.shape[1]
        C.check_ndim("query_start_loc", query_start_loc, (1,))
        R = query_start_loc.shape[0] - 1
        if R < 0:
            raise ValueError("query_start_loc: expected shape [R+1] with R >= 0, got [0]")
        qsl = _index_array("query_start_loc", query_start_loc, torch.int32, R + 1)
        if qsl[0] != 0 or qsl[-1] != T or (np.diff(qsl) < 0).any():
            raise ValueError(
                f"query_start_loc: expected non-decreasing offsets from 0 to {T} (the tokens "
                f"of x), got {qsl.tolist()}"
            )
        sx = C.strides_of(x)
        tokens = np.diff(qsl)
        x_start = qsl[:-1] * sx[1]
        x_dim, x_token = sx[0], sx[1]
    slot = _slots("cache_indices", cache_indices, R, conv_states.shape[0])
    if has_initial_state is None:
        initial = np.zeros(R, np.int64)
    else:
        initial = _index_array("has_initial_state", has_initial_state, torch.bool, R)
    out = torch.empty_like(C.as_torch(x))
    so = C.strides_of(out)
    if query_start_loc is None:
        o_start = starts * so[0]
        st = ConvStrides(x_dim, x_token, so[1], so[2], *C.strides_of(conv_states))
    else:
        o_start = qsl[:-1] * so[1]
        st = ConvStrides(x_dim, x_token, so[0], so[1], *C.strides_of(conv_states))
    zeros = np.zeros(R, np.int64)
    rq = _requests(x_start, o_start, tokens, slot, zeros, tokens, initial)
    sh = ConvShape(dim, width, width - 1, bias is not None, silu, packed)
    if R and T:
        _conv(
            C.span(x), C.span(out), w, b, C.span(conv_states), rq, sh, st, int(tokens.sum()) * dim
        )
    return out


def causal_conv1d_update(
    x,
    conv_states,
    weight,
    bias,
    silu_activation,
    conv_state_indices,
    is_weight_packed,
    num_accepted_tokens=None,
):
    """Decode: one token per request (or q with ``num_accepted_tokens``); rewrites
    ``conv_states`` of the requests' slots in place. Returns ``out`` shaped like ``x``.
    See the module docstring."""
    dim, width, w, b, packed, silu = _check_common(
        x, weight, bias, conv_states, silu_activation, is_weight_packed
    )
    C.check_ndim("x", x, (2, 3))
    if x.shape[-1] != dim:
        raise ValueError(f"x: expected shape [..., {dim}] (dim of weight), got {list(x.shape)}")
    B = x.shape[0]
    L = conv_states.shape[2]
    sx = C.strides_of(x)
    slot = _slots("conv_state_indices", conv_state_indices, B, conv_states.shape[0])
    out = torch.empty_like(C.as_torch(x))
    so = C.strides_of(out)
    if x.ndim == 2:
        if num_accepted_tokens is not None:
            raise ValueError(
                "num_accepted_tokens: expected None for a 2-D x (one token per request), got "
                "a tensor"
            )
        q = 1
        history = np.zeros(B, np.int64)
        advance = np.ones(B, np.int64)
        keep = width - 1
        st = ConvStrides(sx[1], 0, so[1], 0, *C.strides_of(conv_states))
    else:
        q = x.shape[1]
        if num_accepted_tokens is None:
            raise ValueError(
                "num_accepted_tokens: expected int32 [B] for a 3-D x (speculative decoding), "
                "got None"
            )
        if not 1 <= q <= L:
            raise ValueError(
                f"x: expected 1 <= q <= {L} (conv_states' columns) tokens per request, got "
                f"shape {list(x.shape)}"
            )
        na = _index_array("num_accepted_tokens", num_accepted_tokens, torch.int32, B)
        bad = (na < 1) | (na > q) | (na + width - 2 > L)
        if bad.any():
            i = int(np.flatnonzero(bad)[0])
            raise ValueError(
                f"num_accepted_tokens: expected values in [1, {min(q, L - width + 2)}] (q = "
                f"{q}, width {width}, {L} state columns), got {int(na[i])} at {i}"
            )
        history = na - 1
        advance = na
        keep = L
        st = ConvStrides(sx[2], sx[1], so[2], so[1], *C.strides_of(conv_states))
    starts = np.arange(B, dtype=np.int64)
    tokens = np.full(B, q, np.int64)
    ones = np.ones(B, np.int64)
    rq = _requests(starts * sx[0], starts * so[0], tokens, slot, history, advance, ones)
    sh = ConvShape(dim, width, keep, bias is not None, silu, packed)
    if B:
        _conv(C.span(x), C.span(out), w, b, C.span(conv_states), rq, sh, st, B * q * dim)
    return out
