"""Fused MoE: routing, prepacked expert GEMMs, activations, 64-bit workspace (DESIGN §3).

Layouts
-------
Routing: ``logits [T, E]`` any float dtype, computed in fp32; results ``topk_weights``
fp32 and ``topk_ids`` int32, both contiguous ``[T, k]``; ties go to the lowest expert id.

``prepack_moe_weight(weight [E, N, K], isa)`` (vLLM's layouts, N and K multiples of 32):
rows in tiles of 16; ``vec`` stores each tile ``[K][16]`` (bf16/fp16/fp32), ``amx``
stores it ``[K/2][16][2]`` (K pairs interleaved; bf16 only).

``fused_moe(output [T, H], input [T, H], w13 [E, 2I, H], w2 [E, H, I], w13_bias [E, 2I]
| None, w2_bias [E, H] | None, topk_weights [T, k] fp32, topk_ids [T, k] int32, *,
activation, skip_weighted, isa)``: weights packed for ``isa``, biases in the weight
dtype, output in the input dtype. w13 rows are gate ``0..I-1`` then up ``I..2I-1``; for
``swigluoai`` they interleave (row ``2i`` gate i, row ``2i+1`` up i).

Kernel
------
1. Sort (serial; T*k entries): tokens per expert, exclusive prefix sum, (token, slot)
   pairs scattered in token order; the inverse map slot -> sorted row.
2. Widen the input rows to fp32 once.
3. w13 + activation, parallel over (expert, 16 columns of I) work items: gate and up
   columns of one tile are the two column groups of one register tile
   (``numkern._tiles``), so gate/up never leave registers before the activation, which
   is applied in fp32 and rounded to the input dtype (kept in an fp32 buffer).
4. w2, parallel over (expert, 32 columns of H) items, into the fp32 ``w2_output``.
5. Combine, parallel over tokens: ``out[t] = round(sum_j w[t, j] * y[slot(t, j)])`` in
   slot order, one rounding.
Only experts that received tokens have work items, so decode streams only the chosen
experts' weights. Every size and offset is int64 (``moe_workspace_plan``). The scratch
is the calling thread's own (``workspace``), so threads may call at once.

bf16 calls with many rows per expert take the ``dpbf16`` path where the CPU has
AVX512-BF16 (``isa.gemm_path()``, ``DP_MIN_ROWS_PER_EXPERT`` from ``isa.GEMM``): steps 3
and 4 run ``vdpbf16ps`` tiles on the bf16 input and a bf16 activation buffer (step 2 is
skipped), 1.3-1.56x the widening tiles from 8 rows per expert on a Zen 4 EPYC.
"""

import math
import threading
from dataclasses import dataclass, field

import numba
import numpy as np
import torch
from numba import prange, types
from numba.extending import overload

from . import _check as C
from . import isa as _isa
from . import memory as _memory
from ._jit import jit
from ._tiles import (
    tile1,
    tile1_dp,
    tile4_dp_gathered,
    tile4_dp_rows,
    tile4_gathered,
    tile4_rows,
    tile4x16_both,
    tile6_gathered,
    tile8_dp_gathered,
    tile8_dp_rows,
    tile8_gathered,
    tile8_rows,
    widen_panel,
)
from .isa import MOE_ISAS
from .simd import store_f32, to_f32, vfma, vload, vsplat, vstore, vzero

TILE = 16  # rows per packed tile (vLLM's prepack_moe_weight)
NT = 32  # output columns per register tile (two 16-lane groups)
MR = 8  # rows per large register tile (16 accumulators)
# Rows (tokens x k) per expert from which a bf16 call takes vdpbf16ps where the CPU has it
DP_MIN_ROWS_PER_EXPERT = _isa.GEMM["dpbf16"].moe_min_rows
# Rows per expert (on average over the call) from which a call takes the panel tiles where
# the CPU's path is fma256 (isa.GEMM), and the rows an expert needs to take them there
PANEL_MIN_ROWS_PER_EXPERT = _isa.GEMM["fma256"].moe_min_rows
PANEL_MIN_ROWS = 6  # one full 6-row panel tile (_tiles.tile6)
KB_PANEL = _isa.GEMM["fma256"].k_slice  # K per widened fp32 panel
ALIGN = 64  # workspace buffers start on cache lines
ACTIVATIONS = {"silu": 0, "gelu": 1, "gelu_tanh": 2, "swigluoai": 3}
SWIGLU_LIMIT = 7.0  # GPT-OSS clamp
SWIGLU_ALPHA = 1.702
GELU_TANH_C = 0.7978845608028654  # sqrt(2 / pi)


# ---------------------------------------------------------------------------------------
# routing


@jit
def _select_topk(scores, allowed, k, ids_row, vals_row):
    """k largest ``scores[e]`` with ``allowed[e]``; ties -> lowest id; descending order."""
    e_n = scores.shape[0]
    taken = np.zeros(e_n, np.bool_)
    for j in range(k):
        best = -1
        for e in range(e_n):
            if allowed[e] and not taken[e]:
                if best < 0 or scores[e] > scores[best]:
                    best = e
        taken[best] = True
        ids_row[j] = best
        vals_row[j] = scores[best]


@jit
def _softmax_row(src, t, e_n, dst):
    mx = -np.inf
    for e in range(e_n):
        mx = max(mx, src[t, e])
    s = 0.0
    for e in range(e_n):
        v = math.exp(src[t, e] - mx)
        dst[e] = v
        s += v
    for e in range(e_n):
        dst[e] = dst[e] / s


@jit(parallel=True)
def _topk_softmax(logits, k, renormalize, weights, ids):
    t_n, e_n = logits.shape
    for t in prange(t_n):
        probs = np.empty(e_n, np.float32)
        _softmax_row(logits, t, e_n, probs)
        allowed = np.ones(e_n, np.bool_)
        vals = np.empty(k, np.float32)
        _select_topk(probs, allowed, k, ids[t], vals)
        s = 0.0
        for j in range(k):
            s += vals[j]
        for j in range(k):
            weights[t, j] = vals[j] / s if renormalize else vals[j]


@jit(parallel=True)
def _grouped_topk(
    logits, k, renormalize, n_group, topk_group, sigmoid, bias, has_bias, scale, weights, ids
):
    t_n, e_n = logits.shape
    per = e_n // n_group
    for t in prange(t_n):
        scores = np.empty(e_n, np.float32)
        if sigmoid:
            for e in range(e_n):  # float64 exp (docs §5.1): an fp32 exp ties saturated scores
                scores[e] = 1.0 / (1.0 + math.exp(-np.float64(logits[t, e])))
        else:
            _softmax_row(logits, t, e_n, scores)
        choice = np.empty(e_n, np.float32)  # the scores experts are chosen by
        for e in range(e_n):
            choice[e] = scores[e] + bias[e] if has_bias else scores[e]
        gscore = np.empty(n_group, np.float32)
        for g in range(n_group):
            if has_bias:  # sum of the group's top-2 biased scores
                a = -np.inf
                b = -np.inf
                for e in range(g * per, (g + 1) * per):
                    v = choice[e]
                    if v > a:
                        b = a
                        a = v
                    elif v > b:
                        b = v
                gscore[g] = a + (b if per > 1 else 0.0)
            else:
                m = -np.inf
                for e in range(g * per, (g + 1) * per):
                    m = max(m, scores[e])
                gscore[g] = m
        gids = np.empty(topk_group, np.int32)
        gvals = np.empty(topk_group, np.float32)
        _select_topk(gscore, np.ones(n_group, np.bool_), topk_group, gids, gvals)
        allowed = np.zeros(e_n, np.bool_)
        for gi in range(topk_group):
            g = gids[gi]
            for e in range(g * per, (g + 1) * per):
                allowed[e] = True
        vals = np.empty(k, np.float32)
        _select_topk(choice, allowed, k, ids[t], vals)
        s = 0.0
        for j in range(k):
            vals[j] = scores[ids[t, j]]  # weights come from the unbiased scores
            s += vals[j]
        for j in range(k):
            w = vals[j] / s if renormalize else vals[j]
            weights[t, j] = w * scale


def _routing_inputs(logits, topk):
    C.check_dtype("logits", logits, C.FLOATS)
    C.check_ndim("logits", logits, (2,))
    t_n, e_n = logits.shape
    topk = C.check_int("topk", topk, low=1)
    if topk > e_n:
        raise ValueError(f"topk: expected 1 <= topk <= E={e_n}, got {topk}")
    logits = C.as_torch(logits).float().contiguous().numpy()
    weights = torch.empty((t_n, topk), dtype=torch.float32)
    ids = torch.empty((t_n, topk), dtype=torch.int32)
    return logits, topk, weights, ids


def topk_softmax(logits, topk, renormalize):
    """Top-k of ``softmax(logits)`` per token -> ``(topk_weights fp32, topk_ids int32)``.

    ``renormalize`` divides the chosen weights by their sum. Ties: lowest expert id.
    """
    logits, topk, weights, ids = _routing_inputs(logits, topk)
    if logits.shape[0]:
        _topk_softmax(logits, topk, bool(renormalize), weights.numpy(), ids.numpy())
    return weights, ids


def check_grouping(e_n, topk, num_expert_group, topk_group, scoring_func, bias, scaling=1.0):
    """:func:`grouped_topk`'s checks of its grouping arguments for ``E = e_n`` experts
    (``numkern.torch_ops``' fake runs them too), ``scaling`` its finite
    ``routed_scaling_factor``; returns ``(num_expert_group, topk_group)``."""
    C.check_float("routed_scaling_factor", scaling)
    n_group = C.check_int("num_expert_group", num_expert_group, low=1)
    if e_n % n_group:
        raise ValueError(f"num_expert_group: expected a divisor of E={e_n}, got {n_group}")
    tg = C.check_int("topk_group", topk_group, low=1)
    if tg > n_group:
        raise ValueError(f"topk_group: expected 1..num_expert_group={n_group}, got {tg}")
    if topk > tg * (e_n // n_group):
        raise ValueError(
            f"topk: expected <= topk_group * experts per group = {tg * (e_n // n_group)}, "
            f"got {topk}"
        )
    if scoring_func not in ("softmax", "sigmoid"):
        raise ValueError(f"scoring_func: expected 'softmax' or 'sigmoid', got {scoring_func!r}")
    if bias is not None:
        C.check_dtype("e_score_correction_bias", bias, C.FLOATS)
        C.check_shape("e_score_correction_bias", bias, (e_n,))
    return n_group, tg


def grouped_topk(
    logits,
    topk,
    renormalize,
    num_expert_group,
    topk_group,
    *,
    scoring_func="softmax",
    routed_scaling_factor=1.0,
    e_score_correction_bias=None,
):
    """DeepSeek-style grouped routing (DESIGN §3) -> ``(topk_weights, topk_ids)``."""
    logits, topk, weights, ids = _routing_inputs(logits, topk)
    e_n = logits.shape[1]
    n_group, tg = check_grouping(
        e_n, topk, num_expert_group, topk_group, scoring_func, e_score_correction_bias,
        routed_scaling_factor,
    )  # fmt: skip
    if e_score_correction_bias is not None:
        bias = C.as_torch(e_score_correction_bias).float().contiguous().numpy()
    else:
        bias = np.zeros(e_n, np.float32)
    if logits.shape[0]:
        _grouped_topk(
            logits,
            topk,
            bool(renormalize),
            n_group,
            tg,
            scoring_func == "sigmoid",
            bias,
            e_score_correction_bias is not None,
            float(routed_scaling_factor),
            weights.numpy(),
            ids.numpy(),
        )
    return weights, ids


# ---------------------------------------------------------------------------------------
# packing


def prepack_moe_weight(weight, isa):
    """Pack ``weight [E, N, K]`` for :func:`fused_moe` (same shape and dtype; new tensor)."""
    if isa not in MOE_ISAS:
        raise ValueError(f"isa: expected one of {MOE_ISAS}, got {isa!r}")
    weight = C.as_torch(weight)
    C.check_dtype("weight", weight, (torch.bfloat16,) if isa == "amx" else C.FLOATS)
    C.check_ndim("weight", weight, (3,))
    C.check_contiguous("weight", weight)
    e_n, n, k = weight.shape
    if n % 32 or k % 32:
        raise ValueError(f"weight: expected N and K multiples of 32, got N={n}, K={k}")
    if isa == "amx":  # [E, N/16, 16, K/2, 2] -> [E, N/16, K/2, 16, 2]
        tiles = weight.reshape(e_n, n // TILE, TILE, k // 2, 2).permute(0, 1, 3, 2, 4)
    else:  # [E, N/16, 16, K] -> [E, N/16, K, 16]
        tiles = weight.reshape(e_n, n // TILE, TILE, k).permute(0, 1, 3, 2)
    out = _memory.weight_empty(weight.shape, weight.dtype)  # streamed: huge pages
    out.view(tiles.shape).copy_(tiles)
    return out


# ---------------------------------------------------------------------------------------
# workspace


def _aligned(nbytes):
    return (int(nbytes) + ALIGN - 1) // ALIGN * ALIGN


@dataclass(frozen=True)
class MoEWorkspacePlan:
    """Scratch layout of one :func:`fused_moe` call; every number is a Python int (64-bit+).

    ``buffers`` maps a name to ``(offset, size)`` in bytes (sizes padded to 64 bytes);
    ``total_bytes`` is the sum of the sizes.
    """

    buffers: dict = field(default_factory=dict)
    total_bytes: int = 0


def moe_workspace_plan(
    num_tokens, topk, num_experts, hidden_size, intermediate_size, dtype, num_threads
):
    """The scratch :func:`fused_moe` needs, computed without running it (int64-safe)."""
    t_n = C.check_int("num_tokens", num_tokens, low=0)
    k = C.check_int("topk", topk, low=1)
    e_n = C.check_int("num_experts", num_experts, low=1)
    h = C.check_int("hidden_size", hidden_size, low=1)
    i = C.check_int("intermediate_size", intermediate_size, low=1)
    threads = C.check_int("num_threads", num_threads, low=1)
    if dtype not in C.FLOATS:
        raise TypeError(f"dtype: expected bfloat16, float16 or float32, got {dtype}")
    rows = t_n * k
    sizes = {
        "input_f32": t_n * h * 4,  # input rows widened once
        "expert_offsets": (e_n + 1) * 8,  # exclusive prefix sum of tokens per expert
        "sorted_slots": rows * 8,  # token * k + slot, grouped by expert, token order kept
        "slot_rows": rows * 8,  # inverse: sorted row of each (token, slot)
        "work_items": (e_n * (i // TILE) + e_n * (h // NT)) * 8,  # (expert, tile) items
        "activation": rows * i * 4,  # act(gate, up) rounded to the input dtype, fp32
        "w2_output": rows * h * 4,  # fp32 result of the w2 GEMM per sorted row
        "tile_scratch": threads * MR * NT * 4,  # one register-tile spill area per thread
    }
    buffers = {}
    offset = 0
    for name, size in sizes.items():
        size = _aligned(size)
        buffers[name] = (offset, size)
        offset += size
    return MoEWorkspacePlan(buffers=buffers, total_bytes=offset)


class _Workspace(threading.local):
    """The scratch of the calling thread's fused_moe calls: allocated by its first call,
    grown (never shrunk) when a call needs more, freed with the thread.

    One per thread, not one per process: the kernels release the GIL, so calls from two
    threads run at once, and neither may write, regrow or free a buffer the other is
    using. A process-wide buffer behind a lock costs the same at T=1 but serialises the
    threads (docs/kernels.md §5.5 has the figures).
    """

    def __init__(self):
        self.buffer = np.empty(0, np.uint8)

    def carve(self, plan):
        if self.buffer.nbytes < plan.total_bytes:
            self.buffer = np.empty(plan.total_bytes, np.uint8)
        views = {}
        for name, (off, size) in plan.buffers.items():
            dt = (
                np.int64
                if name in ("expert_offsets", "sorted_slots", "slot_rows", "work_items")
                else np.float32
            )
            views[name] = self.buffer[off : off + size].view(dt)
        return views


workspace = _Workspace()  # .buffer and .carve() are the calling thread's


# ---------------------------------------------------------------------------------------
# kernels


@jit
def _sort_tokens(ids, t_n, k, e_n, offsets, sorted_slots, slot_rows):
    """Counting sort of the (token, slot) pairs by expert, token order kept (stable)."""
    for e in range(e_n + 1):
        offsets[e] = 0
    for t in range(t_n):
        for j in range(k):
            offsets[np.int64(ids[t, j]) + 1] += 1
    for e in range(e_n):
        offsets[e + 1] += offsets[e]
    fill = offsets[:e_n].copy()
    for t in range(t_n):
        for j in range(k):
            e = np.int64(ids[t, j])
            r = fill[e]
            fill[e] = r + 1
            sorted_slots[r] = np.int64(t) * k + j
            slot_rows[np.int64(t) * k + j] = r


@jit
def _activate(g, u, act):
    if act == 0:  # silu
        return u * g / (1.0 + math.exp(-g))
    if act == 1:  # gelu (erf)
        return u * 0.5 * g * (1.0 + math.erf(g / math.sqrt(2.0)))
    if act == 2:  # gelu_tanh
        return u * 0.5 * g * (1.0 + math.tanh(GELU_TANH_C * (g + 0.044715 * g * g * g)))
    g = min(g, SWIGLU_LIMIT)  # swigluoai
    u = min(max(u, -SWIGLU_LIMIT), SWIGLU_LIMIT)
    return (u + 1.0) * g / (1.0 + math.exp(-SWIGLU_ALPHA * g))


@jit
def _round_like(v, carrier):
    """``v`` rounded to the carrier's dtype (RNE), returned as fp32."""
    store_f32(carrier, 0, v)
    return to_f32(carrier, 0)


@jit
def _w13_item(
    xf,
    x_in,
    dp,
    h,
    i_n,
    w13,
    b13,
    has_b13,
    k,
    e,
    it,
    offsets,
    sorted_slots,
    act_buf,
    act,
    kstep,
    rstep,
    ku,
    part,
    carrier,
):
    """Activation columns ``it*16 .. +16`` of every row routed to expert ``e`` (``dp``:
    the path witness, see :func:`_w13_rows`)."""
    swiglu = act == 3
    # the two 16-row tiles of w13 that hold this item's gate and up rows
    t0 = 2 * it if swiglu else it
    t1 = 2 * it + 1 if swiglu else i_n // TILE + it
    ebase = e * (2 * i_n) * ku
    wb0 = ebase + t0 * TILE * ku
    wb1 = ebase + t1 * TILE * ku
    lo = offsets[e]
    hi = offsets[e + 1]
    k2n = h // 2
    r = lo
    if _is_panel(dp) and hi - lo >= PANEL_MIN_ROWS:
        _w13_panel(xf, h, i_n, w13, b13, has_b13, k, e, it, t0, t1, wb0, wb1, lo, hi,
                   sorted_slots, act_buf, act, kstep, rstep, carrier)  # fmt: skip
        r = hi
    while r < hi:
        nr = min(MR, hi - r)
        for q in range(MR):  # accumulators start at the bias (fp32)
            for c in range(TILE):
                part[q * NT + c] = to_f32(b13, e * 2 * i_n + t0 * TILE + c) if has_b13 else 0.0
                part[q * NT + TILE + c] = (
                    to_f32(b13, e * 2 * i_n + t1 * TILE + c) if has_b13 else 0.0
                )
        x = np.empty(MR, np.int64)
        for q in range(MR):
            x[q] = (sorted_slots[r + min(q, nr - 1)] // k) * h
        _w13_rows(dp, xf, x_in, x, nr, w13, wb0, wb1, kstep, rstep, k2n, part)
        for q in range(nr):
            dst = (r + q) * i_n + it * TILE
            for c in range(TILE):
                if swiglu:  # lanes alternate gate, up across the two tiles
                    src = q * NT + 2 * c
                    g = part[src]
                    u = part[src + 1]
                else:
                    g = part[q * NT + c]
                    u = part[q * NT + TILE + c]
                _store_act(dp, act_buf, dst + c, _activate(g, u, act), carrier)
        r += MR


@jit
def _w13_panel(
    xf, h, i_n, w13, b13, has_b13, k, e, it, t0, t1, wb0, wb1, lo, hi, sorted_slots,
    act_buf, act, kstep, rstep, carrier,
):  # fmt: skip
    """:func:`_w13_item` with the panel tiles (the fma256 path): the gate and up columns
    widened to fp32 once per K slice, then 6-row tiles over every row of the expert."""
    nr = hi - lo
    x = np.empty(nr, np.int64)
    for q in range(nr):
        x[q] = (sorted_slots[lo + q] // k) * h
    part = np.empty(nr * NT, np.float32)  # this item's own: [rows, gate | up] fp32
    for q in range(nr):  # accumulators start at the bias (fp32)
        for c in range(TILE):
            part[q * NT + c] = to_f32(b13, e * 2 * i_n + t0 * TILE + c) if has_b13 else 0.0
            part[q * NT + TILE + c] = to_f32(b13, e * 2 * i_n + t1 * TILE + c) if has_b13 else 0.0
    _panel_rows(xf, x, nr, w13, wb0, wb1, kstep, rstep, h // 2, part, 0, NT)
    swiglu = act == 3
    for q in range(nr):
        dst = (lo + q) * i_n + it * TILE
        for c in range(TILE):
            if swiglu:  # lanes alternate gate, up across the two tiles
                g = part[q * NT + 2 * c]
                u = part[q * NT + 2 * c + 1]
            else:
                g = part[q * NT + c]
                u = part[q * NT + TILE + c]
            act_buf[dst + c] = _round_like(_activate(g, u, act), carrier)


@jit(inline="always")
def _panel_rows(a, x, nr, w, wb0, wb1, kstep, rstep, k2n, part, p0, ps):
    """``part[p0 + q*ps : +32] += a[x[q] : x[q] + 2*k2n] @ (group0 | group1)`` for the
    ``nr`` rows at offsets ``x``: per K slice both groups widened to fp32 once into this call's own
    panel (kernels may run from two Python threads at once), then 6-row tiles."""
    panel = np.empty(KB_PANEL * NT, np.float32)  # [2][<= KB_PANEL][16]: in L1/L2
    for ka in range(0, k2n, KB_PANEL // 2):
        kz = min(k2n, ka + KB_PANEL // 2)
        kn = 2 * (kz - ka)
        widen_panel(w, wb0, wb1, kstep, rstep, ka, kz, False, panel, 16 * kn)
        for g in range(2):
            q = 0
            while q < nr:
                tile6_gathered(a, x, q, nr, 2 * ka, panel, g * 16 * kn, kn, part, p0 + g * 16, ps)
                q += 6


@jit
def _w2_item(act_buf, dp, i_n, h, w2, b2, has_b2, e, ht, offsets, y_buf, kstep, rstep, ku):
    """w2 output columns ``ht*32 .. +32`` (fp32) of every row routed to expert ``e``."""
    ebase = e * h * ku
    wb0 = ebase + (2 * ht) * TILE * ku
    wb1 = wb0 + TILE * ku
    lo = offsets[e]
    hi = offsets[e + 1]
    for r in range(lo, hi):  # accumulators start at the bias
        for c in range(NT):
            y_buf[r * h + ht * NT + c] = to_f32(b2, e * h + ht * NT + c) if has_b2 else 0.0
    if _is_panel(dp) and hi - lo >= PANEL_MIN_ROWS:
        x = np.empty(hi - lo, np.int64)
        for q in range(hi - lo):
            x[q] = (lo + q) * i_n
        p0 = lo * h + ht * NT
        _panel_rows(act_buf, x, hi - lo, w2, wb0, wb1, kstep, rstep, i_n // 2, y_buf, p0, h)
        return
    _w2_rows(dp, act_buf, lo, hi, i_n, w2, wb0, wb1, kstep, rstep, i_n // 2, y_buf, ht * NT, h)


# The two paths of the expert GEMMs, chosen in Python per call and passed down as a
# witness whose dtype is the path: float32 widens (the activations fp32, ``xf`` and the
# fp32 activation buffer), uint16 multiplies bf16 pairs with vdpbf16ps (the bf16 input
# ``x_in`` as it is, and the activation buffer viewed as bf16). Each kernel variant
# compiles only its own tiles, so the widening one never holds vdpbf16ps.


def _w13_rows(dp, xf, x_in, x, nr, w13, wb0, wb1, kstep, rstep, k2n, part):
    """``part[q] += row q @ (gate | up)`` for the ``nr`` gathered rows at offsets ``x``."""


@overload(_w13_rows, inline="always")
def _w13_rows_impl(dp, xf, x_in, x, nr, w13, wb0, wb1, kstep, rstep, k2n, part):
    if dp.dtype == types.uint16:

        def impl(dp, xf, x_in, x, nr, w13, wb0, wb1, kstep, rstep, k2n, part):
            if nr == 1:
                tile1_dp(x_in, x[0], w13, wb0, wb1, kstep, rstep, 0, k2n, part, 0)
            elif nr > 4:
                tile8_dp_gathered(x_in, x, w13, wb0, wb1, kstep, rstep, 0, k2n, part, 0, NT)
            else:
                tile4_dp_gathered(x_in, x, w13, wb0, wb1, kstep, rstep, 0, k2n, part, 0, NT)

        return impl

    if dp.dtype == types.float64:  # the panel witness: rows too few for a panel

        def impl(dp, xf, x_in, x, nr, w13, wb0, wb1, kstep, rstep, k2n, part):
            for q in range(0, nr, 4):
                xo = (x[q], x[min(q + 1, nr - 1)], x[min(q + 2, nr - 1)], x[min(q + 3, nr - 1)])
                po = (q * NT, min(q + 1, nr - 1) * NT, min(q + 2, nr - 1) * NT,
                      min(q + 3, nr - 1) * NT)  # fmt: skip
                n4 = min(4, nr - q)
                tile4x16_both(xf, xo, n4, w13, wb0, wb1, kstep, rstep, 0, k2n, part, po)

        return impl

    def impl(dp, xf, x_in, x, nr, w13, wb0, wb1, kstep, rstep, k2n, part):
        if nr == 1:
            tile1(xf, x[0], w13, wb0, wb1, kstep, rstep, 0, k2n, False, part, 0)
        elif nr > 4:
            tile8_gathered(xf, x, w13, wb0, wb1, kstep, rstep, 0, k2n, part, 0, NT)
        else:
            tile4_gathered(xf, x, w13, wb0, wb1, kstep, rstep, 0, k2n, False, part, 0, NT)

    return impl


def _is_dp(dp):
    """Whether the witness names the dpbf16 path (a constant of the compiled variant)."""


@overload(_is_dp, inline="always")
def _is_dp_impl(dp):
    is_dp = dp.dtype == types.uint16
    return lambda dp: is_dp


def _is_panel(dp):
    """Whether the witness names the panel tiles of the fma256 path (float64: widening as
    float32's, but an expert with PANEL_MIN_ROWS rows or more takes the panel tiles)."""


@overload(_is_panel, inline="always")
def _is_panel_impl(dp):
    panel = dp.dtype == types.float64
    return lambda dp: panel


def _store_act(dp, act_buf, i, v, carrier):
    """The activation ``v`` rounded to the input dtype, into the activation buffer."""


@overload(_store_act, inline="always")
def _store_act_impl(dp, act_buf, i, v, carrier):
    if dp.dtype == types.uint16:  # bf16 bits, read by the dpbf16 w2 tiles

        def impl(dp, act_buf, i, v, carrier):
            store_f32(act_buf.view(np.uint16), i, v)

        return impl

    def impl(dp, act_buf, i, v, carrier):
        act_buf[i] = _round_like(v, carrier)

    return impl


def _w2_rows(dp, act_buf, lo, hi, i_n, w2, wb0, wb1, kstep, rstep, k2n, y_buf, c0, h):
    """``y[r, c0:c0+32] += act[r] @ W2`` columns for the sorted rows ``lo .. hi-1``."""


@overload(_w2_rows, inline="always")
def _w2_rows_impl(dp, act_buf, lo, hi, i_n, w2, wb0, wb1, kstep, rstep, k2n, y_buf, c0, h):
    if dp.dtype == types.uint16:

        def impl(dp, act_buf, lo, hi, i_n, w2, wb0, wb1, kstep, rstep, k2n, y_buf, c0, h):
            a16 = act_buf.view(np.uint16)
            r = lo
            while r + MR <= hi:
                tile8_dp_rows(a16, r, i_n, w2, wb0, wb1, kstep, rstep, 0, k2n, y_buf, c0, h)
                r += MR
            last = hi - 1
            while r < hi:
                if r == last:
                    tile1_dp(a16, r * i_n, w2, wb0, wb1, kstep, rstep, 0, k2n, y_buf, r * h + c0)
                    break
                tile4_dp_rows(a16, r, last, i_n, w2, wb0, wb1, kstep, rstep, 0, k2n, y_buf, c0, h)
                r += 4

        return impl

    if dp.dtype == types.float64:  # the panel witness: rows too few for a panel

        def impl(dp, act_buf, lo, hi, i_n, w2, wb0, wb1, kstep, rstep, k2n, y_buf, c0, h):
            last = hi - 1
            for r in range(lo, hi, 4):
                rs = (r, min(r + 1, last), min(r + 2, last), min(r + 3, last))
                xo = (rs[0] * i_n, rs[1] * i_n, rs[2] * i_n, rs[3] * i_n)
                po = (rs[0] * h + c0, rs[1] * h + c0, rs[2] * h + c0, rs[3] * h + c0)
                n4 = min(4, hi - r)
                tile4x16_both(act_buf, xo, n4, w2, wb0, wb1, kstep, rstep, 0, k2n, y_buf, po)

        return impl

    def impl(dp, act_buf, lo, hi, i_n, w2, wb0, wb1, kstep, rstep, k2n, y_buf, c0, h):
        a = act_buf
        r = lo
        while r + MR <= hi:
            tile8_rows(a, r, i_n, w2, wb0, wb1, kstep, rstep, 0, k2n, y_buf, c0, h)
            r += MR
        last = hi - 1
        while r < hi:
            if r == last:
                tile1(a, r * i_n, w2, wb0, wb1, kstep, rstep, 0, k2n, False, y_buf, r * h + c0)
                break
            tile4_rows(a, r, last, i_n, w2, wb0, wb1, kstep, rstep, 0, k2n, False, y_buf, c0, h)
            r += 4

    return impl


@jit
def _list_items(offsets, e_n, tiles, items):
    """Work items ``expert * tiles + tile`` of the experts that received tokens."""
    n = 0
    for e in range(e_n):
        if offsets[e + 1] > offsets[e]:
            for t in range(tiles):
                items[n] = e * tiles + t
                n += 1
    return n


@jit(parallel=True)
def _fused_moe(
    out,
    x,
    w13,
    w2,
    b13,
    b2,
    has_b13,
    has_b2,
    topk_w,
    topk_ids,
    t_n,
    e_n,
    k,
    h,
    i_n,
    act,
    skip_weighted,
    kstep,
    rstep,
    ku13,
    ku2,
    xf,
    offsets,
    sorted_slots,
    slot_rows,
    items,
    act_buf,
    y_buf,
    scratch,
    dp,
):
    _sort_tokens(topk_ids, t_n, k, e_n, offsets, sorted_slots, slot_rows)
    if not _is_dp(dp):  # the dpbf16 tiles read the bf16 input as it is
        for t in prange(t_n):
            for c in range(h):
                xf[t * h + c] = to_f32(x, t * h + c)
    # w13 + activation: (expert, 16 activation columns) items of experts with tokens
    tiles_i = i_n // TILE
    n_items = _list_items(offsets, e_n, tiles_i, items)
    for q in prange(n_items):
        tid = numba.get_thread_id()
        part = scratch[tid * MR * NT : (tid + 1) * MR * NT]
        carrier = out[:1].copy()
        e = items[q] // tiles_i
        _w13_item(
            xf,
            x,
            dp,
            h,
            i_n,
            w13,
            b13,
            has_b13,
            k,
            e,
            items[q] % tiles_i,
            offsets,
            sorted_slots,
            act_buf,
            act,
            kstep,
            rstep,
            ku13,
            part,
            carrier,
        )
    # w2: (expert, 32 output columns) items
    tiles_h = h // NT
    n_items = _list_items(offsets, e_n, tiles_h, items)
    for q in prange(n_items):
        _w2_item(
            act_buf,
            dp,
            i_n,
            h,
            w2,
            b2,
            has_b2,
            items[q] // tiles_h,
            items[q] % tiles_h,
            offsets,
            y_buf,
            kstep,
            rstep,
            ku2,
        )
    # combine in slot order, one rounding
    for t in prange(t_n):
        for c0 in range(0, h, TILE):
            acc = vzero()
            for j in range(k):
                wgt = vsplat(1.0) if skip_weighted else vsplat(topk_w[t, j])
                acc = vfma(wgt, vload(y_buf, slot_rows[t * k + j] * h + c0), acc)
            vstore(out, t * h + c0, acc)


def check_fused_moe(
    output,
    input,
    w13,
    w2,
    w13_bias,
    w2_bias,
    topk_weights,
    topk_ids,
    *,
    activation,
    skip_weighted,
    isa,
):
    """:func:`fused_moe`'s checks of everything but the ids' values (what a fake tensor
    has: ``numkern.torch_ops`` runs them in its fake); returns ``(dtype, T, H, E, I, k)``."""
    if isa not in MOE_ISAS:
        raise ValueError(f"isa: expected one of {MOE_ISAS}, got {isa!r}")
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation: expected one of {tuple(ACTIVATIONS)}, got {activation!r}")
    dt = C.check_dtype("input", input, (torch.bfloat16,) if isa == "amx" else C.FLOATS)
    C.check_ndim("input", input, (2,))
    C.check_contiguous("input", input)
    t_n, h = input.shape
    C.check_same_dtype("output", output, dt, "input")
    C.check_shape("output", output, (t_n, h))
    C.check_contiguous("output", output)
    C.check_same_dtype("w13", w13, dt, "input")
    C.check_ndim("w13", w13, (3,))
    C.check_contiguous("w13", w13)
    e_n, i2, h13 = w13.shape
    if h13 != h:
        raise ValueError(f"w13: expected shape [E, 2I, {h}] (H of input), got {list(w13.shape)}")
    i_n = i2 // 2
    if h % 32 or i_n % 32 or i2 % 2:
        raise ValueError(f"w13: expected H and I multiples of 32, got H={h}, I={i2 / 2:g}")
    C.check_same_dtype("w2", w2, dt, "input")
    C.check_shape("w2", w2, (e_n, h, i_n))
    C.check_contiguous("w2", w2)
    for name, b, shape in (("w13_bias", w13_bias, (e_n, i2)), ("w2_bias", w2_bias, (e_n, h))):
        if b is not None:
            C.check_same_dtype(name, b, dt, "the weights")
            C.check_shape(name, b, shape)
            C.check_contiguous(name, b)
    C.check_dtype("topk_weights", topk_weights, (torch.float32,))
    C.check_dtype("topk_ids", topk_ids, (torch.int32,))
    C.check_ndim("topk_ids", topk_ids, (2,))
    k = topk_ids.shape[1]
    C.check_shape("topk_ids", topk_ids, (t_n, k))
    C.check_shape("topk_weights", topk_weights, (t_n, k))
    C.check_contiguous("topk_ids", topk_ids)
    C.check_contiguous("topk_weights", topk_weights)
    if skip_weighted and k != 1:
        raise ValueError(f"skip_weighted: requires topk == 1, got topk={k}")
    return dt, t_n, h, e_n, i_n, k


def fused_moe(
    output,
    input,
    w13,
    w2,
    w13_bias,
    w2_bias,
    topk_weights,
    topk_ids,
    *,
    activation="silu",
    skip_weighted=False,
    isa,
    path=None,
):
    """Run the MoE block into ``output``; see the module docstring for shapes and dtypes.

    ``path``: how the expert GEMMs multiply. None takes this CPU's path
    (``isa.gemm_path()``) where the call has at least its ``moe_min_rows`` rows (tokens x
    k) per expert on average, else widens with the register tiles: ``vdpbf16ps`` (bf16
    only) where the CPU has AVX512-BF16, the panel tiles (``fma256``, any dtype; an expert
    with fewer than ``PANEL_MIN_ROWS`` rows keeps the register tiles) where it lacks
    AVX-512. ``"widen"`` / ``"fma256"`` / ``"dpbf16"`` force one (dpbf16 only on a CPU
    with AVX512-BF16: a ValueError otherwise). Other dtypes never take dpbf16."""
    if path is None:
        dp, panel = _dp_default, _panel_default
    else:
        path = _isa.check_gemm_path(path)
        dp, panel = path == "dpbf16", path == "fma256"
    dt, t_n, h, e_n, i_n, k = check_fused_moe(
        output, input, w13, w2, w13_bias, w2_bias, topk_weights, topk_ids,
        activation=activation, skip_weighted=skip_weighted, isa=isa,
    )  # fmt: skip
    ids_t = C.as_torch(topk_ids)
    if t_n and k:
        lo, hi = int(ids_t.min()), int(ids_t.max())
        if lo < 0 or hi >= e_n:
            raise ValueError(f"topk_ids: expected expert ids in [0, {e_n}), got range [{lo}, {hi}]")
    if t_n == 0:
        return
    plan = moe_workspace_plan(t_n, k, e_n, h, i_n, dt, numba.get_num_threads())
    ws = workspace.carve(plan)
    if path is None:
        dp = dp and t_n * k >= DP_MIN_ROWS_PER_EXPERT * e_n
        panel = panel and t_n * k >= PANEL_MIN_ROWS_PER_EXPERT * e_n
    dp = dp and dt == torch.bfloat16
    pairs = isa == "amx"
    w13a = C.as_numpy(w13).reshape(-1)
    w2a = C.as_numpy(w2).reshape(-1)
    if pairs:  # bf16 K pairs travel as uint32 (see numkern._tiles)
        w13a, w2a = w13a.view(np.uint32), w2a.view(np.uint32)
        kstep, rstep, ku13, ku2 = TILE, 0, h // 2, i_n // 2
    else:
        kstep, rstep, ku13, ku2 = 2 * TILE, TILE, h, i_n
    out_a = C.as_numpy(output).reshape(-1)
    empty = C.as_numpy(w13).reshape(-1)[:0]  # "no bias": an empty array of the bias dtype
    b13 = C.as_numpy(w13_bias).reshape(-1) if w13_bias is not None else empty
    b2 = C.as_numpy(w2_bias).reshape(-1) if w2_bias is not None else empty
    _fused_moe(
        out_a,
        C.as_numpy(input).reshape(-1),
        w13a,
        w2a,
        b13,
        b2,
        w13_bias is not None,
        w2_bias is not None,
        C.as_numpy(topk_weights),
        C.as_numpy(ids_t),
        t_n,
        e_n,
        k,
        h,
        i_n,
        ACTIVATIONS[activation],
        bool(skip_weighted),
        kstep,
        rstep,
        ku13,
        ku2,
        ws["input_f32"],
        ws["expert_offsets"],
        ws["sorted_slots"],
        ws["slot_rows"],
        ws["work_items"],
        ws["activation"],
        ws["w2_output"],
        ws["tile_scratch"],
        _DP_WITNESS if dp else (_PANEL_WITNESS if panel else _WIDEN_WITNESS),
    )


# the path witnesses of _fused_moe (see _w13_rows and _is_panel)
_DP_WITNESS = np.empty(0, np.uint16)
_WIDEN_WITNESS = np.empty(0, np.float32)
_PANEL_WITNESS = np.empty(0, np.float64)
_dp_default = _isa.gemm_path()[0] == "dpbf16"
_panel_default = _isa.gemm_path()[0] == "fma256"
