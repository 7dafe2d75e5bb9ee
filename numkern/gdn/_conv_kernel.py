"""The causal conv's kernel and what its two ops' wrappers share (``numkern.gdn.conv``
documents the ops; ``conv_fwd`` and ``conv_update`` hold them).

Kernels: ``_plan`` turns the index tensors into one row per request (first token, token
count, slot, history column, state shift, whether the history is read) and checks them
on the way — slots in range and distinct, ``query_start_loc`` from 0 to T and
non-decreasing, ``num_accepted_tokens`` in range — so the wrappers' own checks of those
tensors run only to explain a failure. ``_conv`` then runs work items of up to BLOCK_T
tokens of one request over a block of channels. At width 4 with unit channel strides
(every vLLM layout) ``_window4`` walks 16 channels at a time down the item's tokens with
the taps (from the packed 16-bit weight, two per vector load) and the last three inputs
in registers, each input read once, straight from ``x`` or, before the chunk, from the
slot's history columns; any other width or layout goes through ``_rows``, which stages
the block's taps in fp32 and then goes token by token (strided channels lane by lane).
Only then, in a second loop, is each slot rolled (the items read the history the roll
overwrites), its rows copied as raw bits (``_copy_row``). Items write disjoint outputs
and requests disjoint slots, so ``prange`` runs both loops without atomics. ``_plan``
runs inside ``_conv``'s dispatch (one Numba call per op call), which writes nothing
when the plan refuses the index values.
Tensors reach the kernels by address (``numkern._ptr``): a decode step calls the update
once per GDN layer, and NumPy views cost ~4 us each here, about what the kernel needs
for one request at 8192 channels.
"""

import math
from typing import NamedTuple

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
    vget,
    vload,
    vload_pairs,
    vset,
    vsplat,
    vstore,
    vsub,
    vzero,
)
from ._common import elements_spanned

PAD_SLOT_ID = C.PAD_SLOT  # vLLM's pad slot (vllm.v1.attention.backends.utils.PAD_SLOT_ID)
BLOCK_T = 32  # tokens per work item: vLLM's block; a 16-channel strip walks down at most
# 32 + 3 rows (one that walked down 1000 tokens of an 8192-wide chunk took a TLB miss per
# token and ran ~10x slower)
PACK_N = 32  # channels per block of the packed weight (vLLM's block_size_n())
# Channels per work item, a multiple of PACK_N: a one-request prefill splits over threads
# by channel blocks too (512 channels x 32 tokens: ~10 us of one thread at width 4), and
# ``_rows``'s staged taps stay in L1.
BLOCK_C = 512
# A call run by one thread whose requests have at most this many tokens (a decode step)
# takes one item per request over every channel: fewer, longer items.
STEP_TOKENS = 4
# Below this many (token, channel) pairs one thread runs the call: a parallel region costs
# ~5 us (numkern.norm) and splits unevenly; on Zen 4 at 8192 channels, 8 decode requests
# (64k pairs) ran in 44 us on two threads against 58 us on one.
PARALLEL_WORK = 1 << 16
# Slots rolled by one thread below this many requests: a roll moves 3 rows (~1 us at
# 8192 bf16 channels, Zen 4), less than a second parallel region costs.
PARALLEL_ROLLS = 4

# How the kernels find each request's tokens (the form of the call)
FWD_VARLEN = 0  # x [dim, T], requests split by query_start_loc
FWD_BATCH = 1  # x [R, dim, T]
UPDATE = 2  # x [B, dim], one token each
UPDATE_SPEC = 3  # x [B, q, dim] with num_accepted_tokens
# _plan's verdicts: which index tensor the wrapper's checks must explain
PLAN_OK, BAD_SLOTS, BAD_STARTS, BAD_ACCEPTED = 0, 1, 2, 3

_I32 = C.WITNESS[torch.int32]
_F32 = C.WITNESS[torch.float32]
_BOOL = np.empty(0, np.bool_)


class ConvShape(NamedTuple):
    dim: int
    width: int
    keep: int  # state columns rewritten per slot (width - 1, or L for the wide update)
    has_bias: bool
    silu: bool
    packed: bool
    pairs: bool  # packed 16-bit weight: two taps of 16 channels per vector load


class ConvStrides(NamedTuple):  # element strides
    x_req: int  # x [R, dim, T] / [B, dim] / [B, q, dim]: per request (0 for varlen)
    x_dim: int
    x_token: int
    o_req: int
    o_dim: int
    o_token: int
    s_slot: int
    s_dim: int
    s_col: int


class Requests(NamedTuple):  # int64 [R] each: the rows of _plan's array, in this order
    tok0: np.ndarray  # the request's first token along x's token axis
    tokens: np.ndarray
    slot: np.ndarray  # -1: padding
    history: np.ndarray  # first state column of its history
    advance: np.ndarray  # new column j = old column j + advance (while j < keep - tokens)
    initial: np.ndarray  # 1: read the history and kept columns from the slot; 0: zeros


PLAN_ROWS = len(Requests._fields)


@jit(inline="always")
def _requests(plan):
    return Requests(plan[0], plan[1], plan[2], plan[3], plan[4], plan[5])


@jit
def _plan(form, counts, idx_a, aux_a, init_a, flags):
    """(verdict, plan int64 [PLAN_ROWS, R]) from the index tensors (by address):
    ``idx`` the slots (int32 [R], or slot r when absent), ``aux`` query_start_loc (int32
    [R+1], FWD_VARLEN) or num_accepted_tokens (int32 [R], UPDATE_SPEC), ``init``
    has_initial_state (bool [R], or all False when absent). ``counts``: (R, x's tokens
    (T, or q per request), slots, state columns L, width). Stops at the first bad entry."""
    n_req, n_tok, num_slots, cols, width = counts
    has_idx, has_init = flags
    plan = np.zeros((PLAN_ROWS, n_req), np.int64)
    rq = _requests(plan)
    idx = view(idx_a, n_req if has_idx else 0, _I32)
    n_aux = n_req + 1 if form == FWD_VARLEN else n_req if form == UPDATE_SPEC else 0
    aux = view(aux_a, n_aux, _I32)
    init = view(init_a, n_req if has_init else 0, _BOOL)
    seen = np.zeros(num_slots, np.uint8)
    for r in range(n_req):
        s = idx[r] if has_idx else r
        if s != PAD_SLOT_ID:
            if s < 0 or s >= num_slots or seen[s]:
                return BAD_SLOTS, plan
            seen[s] = 1
        rq.slot[r] = s
    if form == FWD_VARLEN and (aux[0] != 0 or aux[n_req] != n_tok):
        return BAD_STARTS, plan
    for r in range(n_req):
        if form == FWD_VARLEN or form == FWD_BATCH:
            if form == FWD_VARLEN:
                if aux[r + 1] < aux[r]:
                    return BAD_STARTS, plan
                rq.tok0[r] = aux[r]
                rq.tokens[r] = aux[r + 1] - aux[r]
            else:
                rq.tokens[r] = n_tok
            rq.advance[r] = rq.tokens[r]
            rq.initial[r] = 1 if has_init and init[r] else 0
        elif form == UPDATE:
            rq.tokens[r] = 1
            rq.advance[r] = 1
            rq.initial[r] = 1
        else:
            n = aux[r]
            if n < 1 or n > n_tok or n + width - 2 > cols:
                return BAD_ACCEPTED, plan
            rq.tokens[r] = n_tok
            rq.history[r] = n - 1
            rq.advance[r] = n
            rq.initial[r] = 1
    return PLAN_OK, plan


@jit(inline="always")
def _tap(c, k, width, packed):
    """Flat index of weight[c, k] in the plain or packed layout."""
    if packed:
        return (c // PACK_N) * PACK_N * width + (k // 2) * (2 * PACK_N) + (c % PACK_N) * 2 + k % 2
    return c * width + k


# The strided forms of a 16-channel load and store, for layouts whose channel stride is
# not 1. Callers branch to them (``vload(a, i) if stride == 1 else _gather(a, i, stride)``)
# rather than hiding the branch in an inlined helper: an array passed to an inlined
# helper inside a loop costs an NRT incref/decref call pair per use (measured: 4x on the
# decode update).


@jit
def _gather(a, i, stride):
    """``a[i + j * stride]`` for the 16 lanes j, widened."""
    v = vzero()
    for j in range(LANES):
        v = vset(v, j, to_f32(a, i + j * stride))
    return v


@jit
def _scatter(a, i, stride, v):
    """The 16 lanes of ``v`` to ``a[i + j * stride]``, rounded."""
    for j in range(LANES):
        store_f32(a, i + j * stride, vget(v, j))


@jit
def _stage_taps(w, w16, bias, c0, c1, sh, taps):
    """``taps`` (fp32 [width + 1, n], n = c1 - c0): row k = tap k of channels c0..c1,
    the last row the bias (or 0)."""
    K = sh.width
    n = c1 - c0
    for c in range(c0, c1, LANES):
        j = c - c0
        if sh.pairs:  # [width/2, 32, 2] per block of 32 channels: two taps per load
            base = (c // PACK_N) * PACK_N * K + (c % PACK_N) * 2
            for i in range(K // 2):
                even, odd = vload_pairs(w16, base + i * 2 * PACK_N)
                vstore(taps, 2 * i * n + j, even)
                vstore(taps, (2 * i + 1) * n + j, odd)
        elif not sh.packed:  # [dim, width]: tap k of 16 channels at stride width
            for k in range(K):
                vstore(taps, k * n + j, _gather(w, c * K + k, K))
        else:
            for k in range(K):
                for lane in range(LANES):
                    taps[k * n + j + lane] = to_f32(w, _tap(c + lane, k, K, True))
        vstore(taps, K * n + j, vload(bias, c) if sh.has_bias else vzero())


@jit
def _rows(x, out, w, w16, bias, state, c0, c1, xb, ob, hist, t0, t1, sh, st):
    """Channels c0..c1 (multiples of 16) of tokens t0..t1 of one request (offsets of its
    token 0 in x and out: xb, ob; ``hist``: (offset of its history column 0 in the state,
    whether the history is read)), any width and strides: the taps staged once, then
    token by token, each token's rows read contiguously where the channel stride is 1."""
    hb, init = hist
    K = sh.width
    H = K - 1
    n = c1 - c0
    x_unit, s_unit, o_unit = st.x_dim == 1, st.s_dim == 1, st.o_dim == 1
    one = vsplat(np.float32(1.0))
    zero = vzero()
    taps = np.empty((K + 1) * n, np.float32)
    _stage_taps(w, w16, bias, c0, c1, sh, taps)
    for t in range(t0, t1):
        kh = min(max(H - t, 0), K)  # taps k < kh read the history (input t + k - H < 0)
        for c in range(c0, c1, LANES):
            j = c - c0
            acc = vload(taps, K * n + j)
            if init:
                for k in range(kh):
                    p = hb + (t + k) * st.s_col + c * st.s_dim
                    v = vload(state, p) if s_unit else _gather(state, p, st.s_dim)
                    acc = vfma(vload(taps, k * n + j), v, acc)
            for k in range(kh, K):
                p = xb + (t + k - H) * st.x_token + c * st.x_dim
                v = vload(x, p) if x_unit else _gather(x, p, st.x_dim)
                acc = vfma(vload(taps, k * n + j), v, acc)
            if sh.silu:
                acc = vdiv(acc, vadd(one, vexp(vsub(zero, acc))))
            o = ob + t * st.o_token + c * st.o_dim
            if o_unit:
                vstore(out, o, acc)
            else:
                _scatter(out, o, st.o_dim, acc)


@jit
def _window4(x, out, w, w16, bias, state, c0, c1, xb, ob, hist, t0, t1, sh, st):
    """:func:`_rows` at width 4 (Qwen3-Next's, and the only one vLLM's CPU kernels take)
    with unit channel strides: 16 channels at a time down the tokens, the taps and the
    last three inputs in registers, so each input is loaded once (measured on Zen 4: 2x
    on a decode step, 1.5x on a 512-token prefill). Two such strips walk down together
    where the block has them: the 32 channels of a 64-byte line of bf16 x and out per
    token (x's token rows sit 16 KB apart at 8192 channels, all in one L1 set, so a
    line used by one strip was evicted before the next strip came to it) and two
    independent SiLU chains."""
    hb, init = hist
    one = vsplat(np.float32(1.0))
    zero = vzero()
    c = c0
    while c < c1:
        n = 2 if c + 2 * LANES <= c1 else 1
        # strip a: channels c.., strip b: c+16.. (zeros when n == 1, never stored)
        wa0 = wa1 = wa2 = wa3 = wb0 = wb1 = wb2 = wb3 = zero
        ba = bb = zero
        a0 = a1 = a2 = b0 = b1 = b2 = zero
        for s in range(n):
            cs = c + s * LANES
            if sh.pairs:
                base = (cs // PACK_N) * PACK_N * 4 + (cs % PACK_N) * 2
                w0, w1 = vload_pairs(w16, base)
                w2, w3 = vload_pairs(w16, base + 2 * PACK_N)
            elif not sh.packed:
                w0 = _gather(w, cs * 4, 4)
                w1 = _gather(w, cs * 4 + 1, 4)
                w2 = _gather(w, cs * 4 + 2, 4)
                w3 = _gather(w, cs * 4 + 3, 4)
            else:  # packed fp32: (tap 2i, 2i+1) pairs of 16 channels, 32 floats apart
                base = (cs // PACK_N) * PACK_N * 4 + (cs % PACK_N) * 2
                w0 = _gather(w, base, 2)
                w1 = _gather(w, base + 1, 2)
                w2 = _gather(w, base + 2 * PACK_N, 2)
                w3 = _gather(w, base + 2 * PACK_N + 1, 2)
            bv = vload(bias, cs) if sh.has_bias else zero
            # the inputs t0-3 .. t0-1 (before the request's tokens: its history, or zeros)
            h0 = h1 = h2 = zero
            for k in range(3):
                i = t0 - 3 + k
                if i >= 0:
                    v = vload(x, xb + i * st.x_token + cs)
                elif init:
                    v = vload(state, hb + (i + 3) * st.s_col + cs)
                else:
                    v = zero
                if k == 0:
                    h0 = v
                elif k == 1:
                    h1 = v
                else:
                    h2 = v
            if s == 0:
                wa0, wa1, wa2, wa3, ba, a0, a1, a2 = w0, w1, w2, w3, bv, h0, h1, h2
            else:
                wb0, wb1, wb2, wb3, bb, b0, b1, b2 = w0, w1, w2, w3, bv, h0, h1, h2
        d = c + LANES
        for t in range(t0, t1):
            xt = xb + t * st.x_token
            ot = ob + t * st.o_token
            a3 = vload(x, xt + c)
            acc = vfma(wa3, a3, vfma(wa2, a2, vfma(wa1, a1, vfma(wa0, a0, ba))))
            if sh.silu:
                acc = vdiv(acc, vadd(one, vexp(vsub(zero, acc))))
            vstore(out, ot + c, acc)
            a0, a1, a2 = a1, a2, a3
            if n == 2:
                b3 = vload(x, xt + d)
                acc = vfma(wb3, b3, vfma(wb2, b2, vfma(wb1, b1, vfma(wb0, b0, bb))))
                if sh.silu:
                    acc = vdiv(acc, vadd(one, vexp(vsub(zero, acc))))
                vstore(out, ot + d, acc)
                b0, b1, b2 = b1, b2, b3
        c += n * LANES


@jit(inline="always")
def _window(sh, st):
    """Whether :func:`_window4` runs the vector channels: width 4, unit channel strides."""
    return sh.width == 4 and st.x_dim == 1 and st.s_dim == 1 and st.o_dim == 1


@jit
def _tokens(x, out, w, w16, bias, state, rq, item, sh, st):
    """Work item ``item`` (request, first token, first channel, channels): up to BLOCK_T
    tokens of the request, 16 channels at a time, then (in the last block) a scalar
    tail."""
    r, t0, c0, nc = item
    q = rq.tokens[r]
    t1 = min(t0 + BLOCK_T, q)
    slot = rq.slot[r]
    dim, K = sh.dim, sh.width
    H = K - 1
    c1 = min(c0 + nc, dim)
    cv = min(c1, dim - dim % LANES)  # vectors up to cv, scalars from there
    xb = r * st.x_req + rq.tok0[r] * st.x_token
    ob = r * st.o_req + rq.tok0[r] * st.o_token
    if slot < 0:  # padding: zero output, state untouched
        zero = vzero()
        if st.o_dim != 1:
            cv = c0
        for t in range(t0, t1):
            o = ob + t * st.o_token
            for c in range(c0, cv, LANES):
                vstore(out, o + c, zero)
            for c in range(cv, c1):
                out[o + c * st.o_dim] = 0  # +0.0: all zero bits in every carrier
        return
    init = rq.initial[r] != 0
    hb = slot * st.s_slot + rq.history[r] * st.s_col  # history column 0 (input -H)
    if _window(sh, st):
        _window4(x, out, w, w16, bias, state, c0, cv, xb, ob, (hb, init), t0, t1, sh, st)
    elif cv > c0:
        _rows(x, out, w, w16, bias, state, c0, cv, xb, ob, (hb, init), t0, t1, sh, st)
    for c in range(cv, c1):
        for t in range(t0, t1):
            a = to_f32(bias, c) if sh.has_bias else np.float32(0.0)
            for k in range(K):
                i = t + k - H
                if i >= 0:
                    v = to_f32(x, xb + i * st.x_token + c * st.x_dim)
                elif init:
                    v = to_f32(state, hb + (t + k) * st.s_col + c * st.s_dim)
                else:
                    v = np.float32(0.0)
                a += to_f32(w, _tap(c, k, K, sh.packed)) * v
            if sh.silu:
                a = a / (np.float32(1.0) + np.float32(math.exp(-a)))
            store_f32(out, ob + t * st.o_token + c * st.o_dim, a)


@jit
def _copy_row(src, s0, ss, dst, d0, ds, n, src32, dst32):
    """``dst[d0 + c*ds] = src[s0 + c*ss]`` for c < n, as stored (one carrier). With unit
    strides, vectors of raw bits: 32 values a vector through ``src32`` / ``dst32`` (the
    same memory as float32; 16-bit carriers only, else empty) where both offsets are even
    and the rows apart, else 16 (fp32: loads and stores move the bits as they are). (A
    plain loop with signed indices does not vectorise in Numba, whose wraparound checks
    stay in: ~10x slower on an 8192-wide row.)"""
    c = 0
    if ss == 1 and ds == 1:
        if src32.size and s0 % 2 == 0 and d0 % 2 == 0 and abs(d0 - s0) >= n:
            p, q, m = s0 // 2, d0 // 2, n // 2
            mv = m - m % LANES
            for i in range(0, mv, LANES):
                vstore(dst32, q + i, vload(src32, p + i))
            for i in range(mv, m):
                dst32[q + i] = src32[p + i]
            c = 2 * m
        else:
            c = n - n % LANES
            for i in range(0, c, LANES):
                vstore(dst, d0 + i, vload(src, s0 + i))
    for i in range(c, n):
        dst[d0 + i * ds] = src[s0 + i * ss]


@jit
def _roll(x, state, x32, s32, rq, r, sh, st):
    """Request r's slot, columns 0..keep-1: old columns shifted by ``advance`` (ascending,
    so the in-place copy reads before it writes), then its newest tokens. A request with
    no tokens leaves its slot as it was (vLLM's torch reference skips it). ``x32``,
    ``s32``: x and the state as float32 (16-bit carriers; else empty), for
    :func:`_copy_row`."""
    slot = rq.slot[r]
    q = rq.tokens[r]
    if slot < 0 or q == 0:
        return
    keep, n, sd = sh.keep, sh.dim, st.s_dim
    xb = r * st.x_req + rq.tok0[r] * st.x_token
    for j in range(keep):
        src = j - (keep - q)  # token index when >= 0
        d = slot * st.s_slot + j * st.s_col
        if src >= 0:
            _copy_row(x, xb + src * st.x_token, st.x_dim, state, d, sd, n, x32, s32)
        elif rq.initial[r] != 0:
            _copy_row(state, d + rq.advance[r] * st.s_col, sd, state, d, sd, n, s32, s32)
        else:
            for c in range(n):
                state[d + c * sd] = 0  # +0.0: all zero bits in every carrier


@jit
def _items(tokens, dim):
    """The work items (int64 [4, items]: request, first token, first channel, channels)
    and whether the call is worth a parallel region. An item is up to BLOCK_T tokens of
    one request over BLOCK_C channels, or over every channel when one thread runs a
    decode step (fewer, longer items). Apart from ``_conv``: in a parallel function Numba
    turns array expressions into parallel loops, a thread-pool start each."""
    n_req = tokens.shape[0]
    work = 0
    longest = 0
    for r in range(n_req):
        work += tokens[r] * dim
        longest = max(longest, tokens[r])
    parallel = work >= PARALLEL_WORK
    nc = BLOCK_C if parallel or longest > STEP_TOKENS else dim
    per_t = (dim + nc - 1) // nc
    items = 0
    for r in range(n_req):
        items += (tokens[r] + BLOCK_T - 1) // BLOCK_T * per_t
    item = np.empty((4, items), np.int64)
    i = 0
    for r in range(n_req):
        for t0 in range(0, tokens[r], BLOCK_T):
            for c0 in range(0, dim, nc):
                item[0, i] = r
                item[1, i] = t0
                item[2, i] = c0
                item[3, i] = nc
                i += 1
    return item, parallel


@jit(parallel=True)
def _conv(plan_args, conv_args):
    """:func:`_plan` of ``plan_args``, then (when its verdict is PLAN_OK; nothing is
    written otherwise) the conv of ``conv_args``: tensors by address with their extents
    in elements (x, out, state), ``shape`` and ``strides`` the fields of ConvShape and
    ConvStrides, ``carriers`` (the float carrier, the 16-bit carrier of the pairs, or
    uint16's when unused). Outputs first (items read the slots' history), then the slots
    rolled. Returns the verdict. One dispatch for both: a decode step calls this once
    per GDN layer, and each Numba call of these tuples costs ~1.3 us (Zen 4)."""
    verdict, plan = _plan(*plan_args)
    if verdict != PLAN_OK:
        return verdict
    x_a, o_a, w_a, b_a, s_a, extents, shape, strides, carriers = conv_args
    xwit, pwit = carriers
    x_n, o_n, s_n = extents
    sh = ConvShape(*shape)
    st = ConvStrides(*strides)
    x = view(x_a, x_n, xwit)
    out = view(o_a, o_n, xwit)
    w = view(w_a, sh.dim * sh.width, xwit)
    w16 = view(w_a, sh.dim * sh.width if sh.pairs else 0, pwit)
    bias = view(b_a, sh.dim if sh.has_bias else 0, xwit)
    state = view(s_a, s_n, xwit)
    half = xwit.itemsize == 2
    x32 = view(x_a, x_n // 2 if half else 0, _F32)
    s32 = view(s_a, s_n // 2 if half else 0, _F32)
    rq = _requests(plan)
    item, parallel = _items(rq.tokens, sh.dim)
    items, n_req = item.shape[1], plan.shape[1]
    if parallel:
        for i in prange(items):
            it = (item[0, i], item[1, i], item[2, i], item[3, i])
            _tokens(x, out, w, w16, bias, state, rq, it, sh, st)
    else:
        for i in range(items):
            it = (item[0, i], item[1, i], item[2, i], item[3, i])
            _tokens(x, out, w, w16, bias, state, rq, it, sh, st)
    if parallel and n_req >= PARALLEL_ROLLS:
        for r in prange(n_req):
            _roll(x, state, x32, s32, rq, np.int64(r), sh, st)
    else:
        for r in range(n_req):
            _roll(x, state, x32, s32, rq, r, sh, st)
    return PLAN_OK


# --- wrappers -------------------------------------------------------------------------

# dtype -> (float carrier, 16-bit carrier of a packed weight's pairs: uint16's for fp32,
# whose pairs are never loaded as such)
CARRIERS = {
    torch.bfloat16: (C.WITNESS[torch.bfloat16], C.WITNESS[torch.bfloat16]),
    torch.float16: (C.WITNESS[torch.float16], C.WITNESS[torch.float16]),
    torch.float32: (C.WITNESS[torch.float32], C.WITNESS[torch.bfloat16]),
}
empty_like = torch.empty_like


class Call(NamedTuple):
    """One checked call: its output, the arguments of ``_plan`` and the conv's (the two
    tuples ``_conv`` takes), and the index arrays the addresses point into (alive until
    the kernel ran)."""

    out: object
    plan_args: tuple
    conv_args: tuple
    keep: tuple = ()

    @property
    def counts(self):
        """_plan's (R, x's tokens, slots, state columns, width)."""
        return self.plan_args[1]


def run_call(call, explain):
    """``_conv`` (its plan, then the conv); a failed plan (nothing written) is explained by
    ``explain(call.counts)``, which raises (the plan checks what the explaining checks
    check)."""
    verdict = _conv(call.plan_args, call.conv_args)
    if verdict != PLAN_OK:
        explain(call.counts)
        raise RuntimeError(f"causal_conv1d: index verdict {verdict} not explained")
    return call.out


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
    out = torch.empty_like(w)  # a new tensor even where the permutation moves nothing
    out.view(dim // PACK_N, width // 2, PACK_N, 2).copy_(w.permute(0, 2, 1, 3))
    return out.view(weight.shape)


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


def check_conv_args(x, weight, bias, conv_states, silu_activation, is_weight_packed):
    """(dtype, dim, width, packed, silu), each argument checked (what both conv ops
    check of their common arguments; ``numkern.torch_ops``' fakes run it too)."""
    dt = C.check_dtype("x", x, C.FLOATS)
    C.check_non_negative_strides("x", x)
    silu = C.check_bool("silu_activation", silu_activation)
    packed = C.check_bool("is_weight_packed", is_weight_packed)
    C.check_same_dtype("weight", weight, dt, "x")
    dim, width = _weight_dims(weight)
    if packed and (dim % PACK_N or width % 2):
        raise ValueError(
            f"is_weight_packed: the packed layout needs dim a multiple of {PACK_N} and an "
            f"even width, got dim {dim}, width {width}"
        )
    if bias is not None:
        C.check_same_dtype("bias", bias, dt, "x")
        C.check_shape("bias", bias, (dim,))
        C.check_contiguous("bias", bias)
    if conv_states is None:
        raise TypeError("conv_states: expected a tensor [num_slots, dim, width-1+], got None")
    C.check_same_dtype("conv_states", conv_states, dt, "x")
    C.check_ndim("conv_states", conv_states, (3,))
    C.check_non_negative_strides("conv_states", conv_states)
    if conv_states.shape[1] != dim or conv_states.shape[2] < width - 1:
        raise ValueError(
            f"conv_states: expected shape [*, {dim}, >= {width - 1}] (dim and width - 1 of "
            f"weight), got {list(conv_states.shape)}"
        )
    return dt, dim, width, packed, silu


def check_index(name, t, dtype, n):
    """``t`` checked as ``[n]`` of exactly ``dtype``; whether it is contiguous (its own
    address then reaches the kernels)."""
    C.check_dtype(name, t, (dtype,))
    C.check_shape(name, t, (n,))
    return t.is_contiguous() if isinstance(t, torch.Tensor) else t.flags.c_contiguous


def index_copy(t):
    """(address, the contiguous array it points into) of an index vector."""
    a = np.ascontiguousarray(C.as_numpy(t))
    return C.address(a), a


def index_arg(name, t, dtype, n):
    """``t`` checked as ``[n]`` of exactly ``dtype``: (address, what keeps the memory it
    points into alive: ``t`` itself where it is a contiguous tensor, else a contiguous
    copy)."""
    if check_index(name, t, dtype, n) and isinstance(t, torch.Tensor):
        return t.data_ptr(), t
    return index_copy(t)


def explain_slots(name, idx, n, num_slots):
    """ValueError naming ``name`` unless the slots are valid (``idx`` checked, or slot r
    for request r when None)."""
    if idx is None:
        if n > num_slots:
            raise ValueError(
                f"{name}: None means slot r for request r, but there are {n} requests and "
                f"{num_slots} slots"
            )
        return
    C.check_slots(name, np.asarray(C.as_numpy(idx)).astype(np.int64), num_slots)


def kernel_extents(x, out, conv_states):
    """The kernels' extents in elements of x, out and the state pool."""
    return tuple(elements_spanned(t.shape, C.strides_of(t)) for t in (x, out, conv_states))


def conv_shape(dim, width, keep, has_bias, silu, packed, dt):
    """The fields of :class:`ConvShape` (pairs: a packed 16-bit weight)."""
    return (dim, width, keep, has_bias, silu, packed, packed and dt is not torch.float32)
