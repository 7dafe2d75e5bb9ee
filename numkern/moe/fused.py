"""The fused MoE kernel and its wrapper (docs/kernels.md §5.2-5.6; the package docstring
has the layouts and the steps): prepacking, the checks, the expert GEMMs on
``numkern._tiles``' register tiles, the activation and the combine."""

import functools

import numba
import numpy as np
import torch
from numba import prange, types
from numba.extending import overload

from .. import _check as C
from .. import amx as _amx
from .. import amx_gemm
from .. import isa as _isa
from .. import memory as _memory
from .._jit import jit
from .._tiles import (
    Weights,
    geometry,
    tile1,
    tile4_gathered,
    tile4_rows,
    tile4x16_both,
    tile6_gathered,
    tile8_gathered,
    tile8_rows,
    widen_panel,
)
from ..isa import MOE_ISAS
from ..simd import (
    atomic_load,
    fetch_add,
    prefetch,
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
    vtanh,
    vzero,
)
from .quant import fused_moe_quant, is_quantized
from .scratch import MR, NT, TILE, moe_workspace_plan, part_of, workspace
from .steps import (  # noqa: F401  (re-exported: numkern.moe's names)
    ACTIVATIONS,
    GELU_TANH_C,
    SWIGLU_ALPHA,
    SWIGLU_LIMIT,
    _activate,
    _round_like,
    _sort_tokens,
    check_ids,
    check_topk,
)

# Rows (tokens x k) per expert from which a bf16 call takes vdpbf16ps where the CPU has it
DP_MIN_ROWS_PER_EXPERT = _isa.GEMM["dpbf16"].moe_min_rows
# Rows per expert (on average over the call) from which a call takes the panel tiles where
# the CPU's path is fma256 (isa.GEMM), and the rows an expert needs to take them there
PANEL_MIN_ROWS_PER_EXPERT = _isa.GEMM["fma256"].moe_min_rows
PANEL_MIN_ROWS = 6  # one full 6-row panel tile (_tiles.tile6)
KB_PANEL = _isa.GEMM["fma256"].k_slice  # K per widened fp32 panel


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
# kernels


@jit(inline="always")
def _bias_rows(part, rows, b, has_b, b0, b1):
    """Accumulators ``part[q, 0:32]`` of ``rows`` rows start at the bias: group 0 at
    ``b[b0:]``, group 1 at ``b[b1:]`` (fp32), or zero."""
    for q in range(rows):
        for c in range(TILE):
            part[q * NT + c] = to_f32(b, b0 + c) if has_b else 0.0
            part[q * NT + TILE + c] = to_f32(b, b1 + c) if has_b else 0.0


@jit
def _w13_item(
    xf, x_in, xg, dp, dims, w13, b13, has_b13, e, it, offsets, sorted_slots, act_buf, part
):
    """Activation columns ``it*16 .. +16`` of every row routed to expert ``e`` (``dp``:
    the path witness, see :func:`_w13_rows`; ``dims``: ``_fused_moe``'s; ``xg``: the
    rows gathered by expert for the tiles, see :func:`_gather`)."""
    k, h, i_n, act = dims[2:]
    ku, kstep, rstep = geometry(w13, h, TILE)
    swiglu = act == 3
    # the two 16-row tiles of w13 that hold this item's gate and up rows
    t0 = 2 * it if swiglu else it
    t1 = 2 * it + 1 if swiglu else i_n // TILE + it
    ebase = e * (2 * i_n) * ku
    wt = Weights(w13, ebase + t0 * TILE * ku, ebase + t1 * TILE * ku, kstep, rstep)
    b0 = e * 2 * i_n + t0 * TILE
    b1 = e * 2 * i_n + t1 * TILE
    lo = offsets[e]
    hi = offsets[e + 1]
    carrier = x_in[:1].copy()  # a scalar of the input dtype, to round through
    r = lo
    if _on_tiles(dp, hi - lo):  # [rows, gate | up] on AMX tiles, 32 rows at a time
        _w13_tiles(dp, xg, lo, hi, h, w13, 2 * wt.wb0, 2 * wt.wb1, b13, has_b13, b0, b1, part)
        if act == 0 or act == 2:  # silu, gelu_tanh: 16 columns at a time
            _acts16(part, hi - lo, act_buf.view(np.uint16), lo * i_n + it * TILE, i_n, act)
            return
        for i in range(lo, hi, 32):
            rows = min(32, hi - i)
            _store_acts(
                dp, part[(i - lo) * NT :], rows, act_buf, i * i_n + it * TILE, i_n, act, carrier
            )
        return
    if _is_panel(dp) and hi - lo >= PANEL_MIN_ROWS:
        # the panel tiles (fma256 path) over every row of the expert, in this item's own
        # accumulators: [rows, gate | up] fp32
        r = hi
        nr = hi - lo
        own = np.empty(nr * NT, np.float32)
        x = np.empty(nr, np.int64)
        for q in range(nr):
            x[q] = (sorted_slots[lo + q] // k) * h
        _bias_rows(own, nr, b13, has_b13, b0, b1)
        _panel_rows(xf, x, nr, wt, h // 2, own, 0, NT)
        _store_acts(dp, own, nr, act_buf, lo * i_n + it * TILE, i_n, act, carrier)
    while r < hi:
        nr = min(MR, hi - r)
        _bias_rows(part, MR, b13, has_b13, b0, b1)
        x = np.empty(MR, np.int64)
        for q in range(MR):
            x[q] = (sorted_slots[r + min(q, nr - 1)] // k) * h
        _w13_rows(dp, xf, x_in, x, nr, wt, h // 2, part)
        _store_acts(dp, part, nr, act_buf, r * i_n + it * TILE, i_n, act, carrier)
        r += MR


@jit
def _acts16(part, nr, acts, dst, i_n, act):
    """:func:`_store_acts` of the tiles' rows for silu and gelu_tanh, 16 columns a vector
    (``vexp``/``vtanh``: within 2e-7 of libm's, below the bf16 rounding of the result):
    the scalar form took a quarter of a T = 1024 call on tiles (Qwen3-30B-A3B shapes)."""
    one = vsplat(1.0)
    for q in range(nr):
        g = vload(part, q * NT)
        u = vload(part, q * NT + TILE)
        if act == 0:  # u * g / (1 + exp(-g))
            a = vdiv(vmul(u, g), vadd(one, vexp(vsub(vzero(), g))))
        else:  # u * 0.5 g (1 + tanh(c (g + 0.044715 g^3)))
            inner = vmul(vsplat(GELU_TANH_C), vfma(vmul(vsplat(0.044715), vmul(g, g)), g, g))
            a = vmul(u, vmul(vmul(vsplat(0.5), g), vadd(one, vtanh(inner))))
        vstore(acts, dst + q * i_n, a)


@jit(inline="always")
def _store_acts(dp, part, nr, act_buf, dst, i_n, act, carrier):
    """``act_buf[dst + q*i_n + c] = act(gate, up)`` of accumulator row q < ``nr``, column
    c < 16, rounded to the input dtype (``carrier``'s)."""
    swiglu = act == 3
    for q in range(nr):
        for c in range(TILE):
            if swiglu:  # lanes alternate gate, up across the two tiles
                g = part[q * NT + 2 * c]
                u = part[q * NT + 2 * c + 1]
            else:
                g = part[q * NT + c]
                u = part[q * NT + TILE + c]
            _store_act(dp, act_buf, dst + q * i_n + c, _activate(g, u, act), carrier)


@jit(inline="always")
def _panel_rows(a, x, nr, wt, k2n, part, p0, ps):
    """``part[p0 + q*ps : +32] += a[x[q] : x[q] + 2*k2n] @ (group0 | group1)`` for the
    ``nr`` rows at offsets ``x``: per K slice both groups widened to fp32 once into this
    call's own panel (kernels may run from two Python threads at once), then 6-row tiles."""
    panel = np.empty(KB_PANEL * NT, np.float32)  # [2][<= KB_PANEL][16]: in L1/L2
    for ka in range(0, k2n, KB_PANEL // 2):
        kz = min(k2n, ka + KB_PANEL // 2)
        kn = 2 * (kz - ka)
        widen_panel(wt, ka, kz, False, panel, 16 * kn)
        for g in range(2):
            q = 0
            while q < nr:
                tile6_gathered(a, x, q, nr, 2 * ka, panel, g * 16 * kn, kn, part, p0 + g * 16, ps)
                q += 6


@jit
def _w2_item(act_buf, dp, dims, w2, b2, has_b2, e, ht, offsets, y_buf):
    """w2 output columns ``ht*32 .. +32`` (fp32) of every row routed to expert ``e``."""
    h, i_n = dims[3], dims[4]
    ku, kstep, rstep = geometry(w2, i_n, TILE)
    wb0 = e * h * ku + (2 * ht) * TILE * ku
    wt = Weights(w2, wb0, wb0 + TILE * ku, kstep, rstep)
    lo = offsets[e]
    hi = offsets[e + 1]
    c0 = ht * NT
    for r in range(lo, hi):  # accumulators start at the bias
        for c in range(0, NT, TILE):
            b = vload(b2, e * h + c0 + c) if has_b2 else vzero()
            vstore(y_buf, r * h + c0 + c, b)
    if _on_tiles(dp, hi - lo):
        _w2_tiles(dp, act_buf, lo, hi, i_n, w2, 2 * wt.wb0, 2 * wt.wb1, y_buf, ht * NT, h)
        return
    if _is_panel(dp) and hi - lo >= PANEL_MIN_ROWS:
        x = np.empty(hi - lo, np.int64)
        for q in range(hi - lo):
            x[q] = (lo + q) * i_n
        _panel_rows(act_buf, x, hi - lo, wt, i_n // 2, y_buf, lo * h + ht * NT, h)
        return
    _w2_rows(dp, act_buf, lo, hi, i_n, wt, i_n // 2, y_buf, ht * NT, h)


# The paths of the expert GEMMs, chosen in Python per call and passed down as a witness
# whose dtype is the path: float32 widens (the activations fp32, ``xf`` and the fp32
# activation buffer), uint16 multiplies bf16 pairs with vdpbf16ps (the bf16 input ``x_in``
# as it is, and the activation buffer viewed as bf16), float64 widens but gives an expert
# with PANEL_MIN_ROWS rows or more the panel tiles of the fma256 path and fewer rows the
# 4x16 tiles. The tiles multiply as their activations' dtype says (``numkern._tiles``),
# so each kernel variant compiles only its own: the widening one never holds vdpbf16ps.


# The tile witnesses: uint8 takes AMX tiles for an expert of more than SMALL_ROWS rows and
# vdpbf16ps (the dpbf16 tiles) for fewer; int8 takes emulated tiles for every expert
# (numkern.amx: the test-only switch; never for one token, whose kernel is vdpbf16ps').
# Both read the bf16 input as it is and keep the activations as bf16, as dpbf16 does.
_RAW = (types.uint16, types.uint8, types.int8)  # the bf16 input as it is
SMALL_ROWS = 4  # an expert with this many rows or fewer stays on vdpbf16ps (uint8)


def _is_dp(dp):
    """Whether the witness's tiles read the bf16 input as it is (dpbf16 and the tile
    witnesses: a constant of the compiled variant)."""


@overload(_is_dp, inline="always")
def _is_dp_impl(dp):
    is_dp = dp.dtype in _RAW
    return lambda dp: is_dp


def _on_tiles(dp, rows):
    """Whether an expert's ``rows`` rows run on AMX tiles (real or emulated)."""


@overload(_on_tiles, inline="always")
def _on_tiles_impl(dp, rows):
    if dp.dtype == types.uint8:
        return lambda dp, rows: rows > SMALL_ROWS
    if dp.dtype == types.int8:
        return lambda dp, rows: rows > 0
    return lambda dp, rows: False


def _tile_witness(dp):
    """The tile context witness of a tile witness (numkern.amx: uint8 real, uint16 emulated)."""


@overload(_tile_witness, inline="always")
def _tile_witness_impl(dp):
    w = _amx.witness(emulate=dp.dtype != types.uint8)
    return lambda dp: w


@jit
def _w13_tiles(dp, xg, lo, hi, h, w13, g0, g1, b13, has_b13, b0, b1, part):
    """``part[q, 0:32] = xg[lo + q] @ (w13 tiles at g0 | g1) + bias`` (fp32, rows of NT)
    for the expert's gathered rows ``lo .. hi-1``, on tiles: 32 rows per group, the B
    tiles straight from the amx layout (``[K/2][16][2]`` per 16 rows: 64-byte pair rows,
    512 elements per K step of 32). ``g0``, ``g1``: the tiles' first bf16 element."""
    w = w13.view(np.uint16)
    ctx = _amx.context(_tile_witness(dp))
    shape = -1
    for i in range(lo, hi, 32):
        rows = min(32, hi - i)
        shape = amx_gemm.group(ctx, shape, rows)
        amx_gemm.streamed(ctx, rows, xg, i * h, h, w, g0, g1, 512, h // 32)
        amx_gemm.store_c(ctx, rows, part, (i - lo) * NT, NT)
    _amx.tile_end(ctx)
    for q in range(hi - lo):
        for c in range(TILE):
            part[q * NT + c] += to_f32(b13, b0 + c) if has_b13 else 0.0
            part[q * NT + TILE + c] += to_f32(b13, b1 + c) if has_b13 else 0.0


@jit
def _w2_tiles(dp, act_buf, lo, hi, i_n, w2, g0, g1, y_buf, c0, h):
    """``y[r, c0 : c0+32] += act[r] @ (w2 tiles at g0 | g1)`` for the rows ``lo .. hi-1``
    on tiles (the C tiles loaded from ``y_buf``, which holds the bias)."""
    a = act_buf.view(np.uint16)  # the activations' bf16 bits, rows of I
    w = w2.view(np.uint16)
    ctx = _amx.context(_tile_witness(dp))
    shape = -1
    for i in range(lo, hi, 32):
        rows = min(32, hi - i)
        shape = amx_gemm.group(ctx, shape, rows)
        amx_gemm.load_c(ctx, rows, y_buf, i * h + c0, h)
        amx_gemm.streamed(ctx, rows, a, i * i_n, i_n, w, g0, g1, 512, i_n // 32)
        amx_gemm.store_c(ctx, rows, y_buf, i * h + c0, h)
    _amx.tile_end(ctx)


def _gather(dp, x, xg, sorted_slots, r, k, h):
    """``xg[r] = x[sorted_slots[r] // k]`` (bf16 rows: the tiles' A rows are contiguous
    per expert); nothing for a witness without tiles."""


@overload(_gather, inline="always")
def _gather_impl(dp, x, xg, sorted_slots, r, k, h):
    if dp.dtype in (types.uint8, types.int8):

        def impl(dp, x, xg, sorted_slots, r, k, h):
            src = (sorted_slots[r] // k) * h
            for c in range(h):
                xg[r * h + c] = x[src + c]

        return impl
    return lambda dp, x, xg, sorted_slots, r, k, h: None


def _tiled(dp):
    """Whether the witness takes tiles (a constant of the compiled variant)."""


@overload(_tiled, inline="always")
def _tiled_impl(dp):
    tiled = dp.dtype in (types.uint8, types.int8)
    return lambda dp: tiled


def _is_panel(dp):
    """Whether the witness names the panel tiles of the fma256 path."""


@overload(_is_panel, inline="always")
def _is_panel_impl(dp):
    panel = dp.dtype == types.float64
    return lambda dp: panel


def _operand(dp, wide, raw):
    """The activations the path's tiles read: fp32 ``wide``, or on the dpbf16 path the
    bf16 bits ``raw`` (an fp32 buffer holding them is viewed as uint16)."""


@overload(_operand, inline="always")
def _operand_impl(dp, wide, raw):
    # (int8, the emulated tiles, never runs the vector tiles: they compile on fp32 there)
    if dp.dtype not in (types.uint16, types.uint8):
        return lambda dp, wide, raw: wide
    if raw.dtype == types.float32:  # the activation buffer: bf16 bits at its start
        return lambda dp, wide, raw: raw.view(np.uint16)
    return lambda dp, wide, raw: raw


def _w13_rows(dp, xf, x_in, x, nr, wt, k2n, part):
    """``part[q] += row q @ (gate | up)`` for the ``nr`` gathered rows at offsets ``x``:
    of the bf16 input ``x_in`` (dpbf16), else of its widened ``xf``."""


@overload(_w13_rows, inline="always")
def _w13_rows_impl(dp, xf, x_in, x, nr, wt, k2n, part):
    if dp.dtype == types.float64:  # the panel witness: rows too few for a panel

        def impl(dp, xf, x_in, x, nr, wt, k2n, part):
            for q in range(0, nr, 4):
                xo = (x[q], x[min(q + 1, nr - 1)], x[min(q + 2, nr - 1)], x[min(q + 3, nr - 1)])
                po = (q * NT, min(q + 1, nr - 1) * NT, min(q + 2, nr - 1) * NT,
                      min(q + 3, nr - 1) * NT)  # fmt: skip
                tile4x16_both(xf, xo, min(4, nr - q), wt, 0, k2n, part, po)

        return impl

    def impl(dp, xf, x_in, x, nr, wt, k2n, part):
        a = _operand(dp, xf, x_in)
        if nr == 1:
            tile1(a, x[0], wt, 0, k2n, False, part, 0)
        elif nr > 4:
            tile8_gathered(a, x, wt, 0, k2n, part, 0, NT)
        else:
            tile4_gathered(a, x, wt, 0, k2n, False, part, 0, NT)

    return impl


def _store_act(dp, act_buf, i, v, carrier):
    """The activation ``v`` rounded to the input dtype, into the activation buffer."""


@overload(_store_act, inline="always")
def _store_act_impl(dp, act_buf, i, v, carrier):
    if dp.dtype in _RAW:  # bf16 bits, read by the dpbf16 (or AMX) w2 tiles

        def impl(dp, act_buf, i, v, carrier):
            store_f32(act_buf.view(np.uint16), i, v)

        return impl

    def impl(dp, act_buf, i, v, carrier):
        act_buf[i] = _round_like(v, carrier)

    return impl


def _w2_rows(dp, act_buf, lo, hi, i_n, wt, k2n, y_buf, c0, h):
    """``y[r, c0:c0+32] += act[r] @ W2`` columns for the sorted rows ``lo .. hi-1``."""


@overload(_w2_rows, inline="always")
def _w2_rows_impl(dp, act_buf, lo, hi, i_n, wt, k2n, y_buf, c0, h):
    if dp.dtype == types.float64:  # the panel witness: rows too few for a panel

        def impl(dp, act_buf, lo, hi, i_n, wt, k2n, y_buf, c0, h):
            last = hi - 1
            for r in range(lo, hi, 4):
                rs = (r, min(r + 1, last), min(r + 2, last), min(r + 3, last))
                xo = (rs[0] * i_n, rs[1] * i_n, rs[2] * i_n, rs[3] * i_n)
                po = (rs[0] * h + c0, rs[1] * h + c0, rs[2] * h + c0, rs[3] * h + c0)
                tile4x16_both(act_buf, xo, min(4, hi - r), wt, 0, k2n, y_buf, po)

        return impl

    def impl(dp, act_buf, lo, hi, i_n, wt, k2n, y_buf, c0, h):
        a = _operand(dp, act_buf, act_buf)
        r = lo
        while r + MR <= hi:
            tile8_rows(a, r, i_n, wt, 0, k2n, y_buf, c0, h)
            r += MR
        last = hi - 1
        while r < hi:
            if r == last:
                tile1(a, r * i_n, wt, 0, k2n, False, y_buf, r * h + c0)
                break
            tile4_rows(a, r, last, i_n, wt, 0, k2n, False, y_buf, c0, h)
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


_I64, _F32, _U16 = np.empty(0, np.int64), np.empty(0, np.float32), np.empty(0, np.uint16)


@jit
def _parts(buf, lay):
    """The workspace's buffers (``moe_workspace_plan``'s, by name) viewed in ``buf``."""
    xf = part_of(buf, lay.input_f32, _F32)
    offsets = part_of(buf, lay.expert_offsets, _I64)
    sorted_slots = part_of(buf, lay.sorted_slots, _I64)
    slot_rows = part_of(buf, lay.slot_rows, _I64)
    items = part_of(buf, lay.work_items, _I64)
    act_buf = part_of(buf, lay.activation, _F32)
    y_buf = part_of(buf, lay.w2_output, _F32)
    scratch = part_of(buf, lay.tile_scratch, _F32)
    return xf, offsets, sorted_slots, slot_rows, items, act_buf, y_buf, scratch


# One token (T = 1, the decode step): one parallel region whose workers claim units (a
# shared flag per unit, numkern.simd.fetch_add), each its own share forward, then the
# others' from their ends, so a worker slowed by a neighbour on its core is relieved (the
# static prange split left the other idle at each phase's end) and no fork-join separates
# the phases. Units are expert-major and each reads one run of memory (a pair of adjacent
# w13 tiles; 32 columns of w2), so a worker's share is one stream per expert rather than
# the gate and up streams 2I/2 rows apart. Phase 1: (expert, w13 tile pair) into fp32
# gate/up rows; the unit completing 32 (swigluoai: 16) activation columns applies the
# activation. A spin wait on phase 1's count, prefetching the worker's first w2 lines
# (at most WAIT_PREFETCH bytes). Phase 2: (expert, 32 columns of w2) into the fp32 w2
# rows; the unit adding the last rows of 32 output columns combines them in slot order.
# Every sum is the T > 1 kernel's, in its order: the outputs are bit-identical to it for
# k distinct experts (a repeated id's rows take one-row tiles here, 4-row tiles there).
# Measured against the static-prange form (AMD EPYC Zen 4, 2 cores, bf16, dpbf16 tiles,
# disjoint routings past the L3, 15-21 interleaved rounds): Qwen3-30B-A3B shape 2.81 ->
# 2.76 ms (0.93 -> 0.96x vLLM's vec op), GPT-OSS-20B shape 5.39 -> 4.66 ms (0.93 ->
# 1.09x vLLM).
WAIT_PREFETCH = 256 << 10


@jit(inline="always")
def _claim(flags, f0, q):
    """Whether this worker claimed unit ``q`` (flag ``f0 + q`` was 0)."""
    return fetch_add(flags, f0 + q, 1) == 0


@jit
def _wait_prefetching(done, g, n, w, lo, hi):
    """Until ``done[g]`` reaches ``n``, prefetching ``w[lo:hi]`` a cache line at a time."""
    step = 64 // w.itemsize
    i = lo
    while atomic_load(done, g) < n:
        if i < hi:
            prefetch(w, i)
            i += step


@jit
def _gate_up_pair(xf, x, dp, dims, w13, b13, has_b13, e, p, lo, hi, sorted_slots, gu):
    """``gu[r*2I + 32p : +32]`` (fp32) for the sorted rows ``lo .. hi-1`` of expert ``e``:
    the bias plus the row's product with w13 tiles ``2p`` and ``2p + 1`` (adjacent: one
    run of memory)."""
    k, h, i_n = dims[2], dims[3], dims[4]
    ku, kstep, rstep = geometry(w13, h, TILE)
    wb0 = e * (2 * i_n) * ku + 2 * p * TILE * ku
    wt = Weights(w13, wb0, wb0 + TILE * ku, kstep, rstep)
    a = _operand(dp, xf, x)
    for r in range(lo, hi):
        po = r * 2 * i_n + p * NT
        for c in range(NT):
            gu[po + c] = to_f32(b13, e * 2 * i_n + p * NT + c) if has_b13 else 0.0
        tile1(a, (sorted_slots[r] // k) * h, wt, 0, h // 2, False, gu, po)


@jit
def _acts_from(dp, gu, lo, hi, i_n, act, c0, nc, act_buf, carrier):
    """``act_buf[r*I + c] = act(gate, up)`` for rows ``lo .. hi-1``, columns ``c0 .. c0+nc-1``
    from ``gu``'s fp32 gate and up (swigluoai: interleaved), rounded to the input dtype."""
    for r in range(lo, hi):
        g0 = r * 2 * i_n
        for c in range(c0, c0 + nc):
            if act == 3:
                g = gu[g0 + 2 * c]
                u = gu[g0 + 2 * c + 1]
            else:
                g = gu[g0 + c]
                u = gu[g0 + i_n + c]
            _store_act(dp, act_buf, r * i_n + c, _activate(g, u, act), carrier)


@jit
def _combine_block(out, y_buf, topk_w, slot_rows, k, h, c, skip_weighted):
    """``out[c*32 : +32]`` of the one token: its slots' w2 rows weighted, in slot order."""
    for c0 in range(c * NT, c * NT + NT, TILE):
        acc = vzero()
        for j in range(k):
            r = slot_rows[j]
            if r < 0:  # id -1: no expert on this rank
                continue
            wgt = vsplat(1.0) if skip_weighted else vsplat(topk_w[0, j])
            acc = vfma(wgt, vload(y_buf, r * h + c0), acc)
        vstore(out, c0, acc)


@jit
def _one_token(me, out, x, w13, w2, b13, b2, topk_w, topk_ids, parts, dims, flags3, dp):
    """Worker ``me`` of the one-token kernel, contiguous form: phase 1's units are (expert,
    pair of w13 tiles), phase 2's (expert, 32 columns of w2), both expert-major, so a
    worker's share is one run of memory per expert; the activation of 32 (16) columns is
    computed by the unit that completes its gate and up, the combine of 32 output
    columns by the unit that adds their last rows (fetch_add counters)."""
    e_n, k, h, i_n, act = dims[1], dims[2], dims[3], dims[4], dims[5]
    has_b13, has_b2, skip_weighted = flags3
    offsets, sorted_slots, slot_rows, items, act_buf, gu, y_buf, xf, claims, ctl = parts
    carrier = x[:1].copy()  # a scalar of the input dtype, to round through
    n_e = ctl[1]  # experts with rows, listed in items[:n_e]
    nw = ctl[2]
    pairs = i_n // TILE  # w13 tile pairs per expert (2I rows / 32)
    blocks = h // NT
    n1 = n_e * pairs
    n2 = n_e * blocks
    total = offsets[e_n]
    swiglu = act == 3
    f_dep = n1 + n2  # silu: a counter per (expert, 32 activation columns)
    f_comb = f_dep + n_e * (pairs // 2)  # a counter per 32 output columns
    for d in range(nw):
        s = (me + d) % nw
        lo = s * n1 // nw
        hi = (s + 1) * n1 // nw
        for u in range(hi - lo):
            q = lo + u if d == 0 else hi - 1 - u
            if not _claim(claims, 0, q):
                break
            ei = q // pairs
            p = q % pairs
            e = items[ei]
            r0 = offsets[e]
            r1 = offsets[e + 1]
            _gate_up_pair(xf, x, dp, dims, w13, b13, has_b13, e, p, r0, r1, sorted_slots, gu)
            if swiglu:
                _acts_from(dp, gu, r0, r1, i_n, act, p * TILE, TILE, act_buf, carrier)
            else:
                pp = p % (pairs // 2)
                if fetch_add(claims, f_dep + ei * (pairs // 2) + pp, 1) == 1:
                    _acts_from(dp, gu, r0, r1, i_n, act, pp * NT, NT, act_buf, carrier)
            fetch_add(ctl, 0, 1)
    # while others finish: this worker's first w2 columns
    ku = geometry(w2, i_n, TILE)[0]  # w2 carrier elements per row
    q0 = me * n2 // nw
    w_lo = items[min(q0 // blocks, max(n_e - 1, 0))] * h * ku + (q0 % blocks) * NT * ku
    _wait_prefetching(ctl, 0, n1, w2, w_lo, min(w2.size, w_lo + WAIT_PREFETCH // w2.itemsize))
    for d in range(nw):
        s = (me + d) % nw
        lo = s * n2 // nw
        hi = (s + 1) * n2 // nw
        for u in range(hi - lo):
            q = lo + u if d == 0 else hi - 1 - u
            if not _claim(claims, n1, q):
                break
            e = items[q // blocks]
            c = q % blocks
            _w2_item(act_buf, dp, dims, w2, b2, has_b2, e, c, offsets, y_buf)
            rows = offsets[e + 1] - offsets[e]
            if fetch_add(claims, f_comb + c, rows) + rows == total:
                _combine_block(out, y_buf, topk_w, slot_rows, k, h, c, skip_weighted)


@jit(parallel=True)
def _fused_moe(out, x, w13, w2, b13, b2, topk_w, topk_ids, buf, lay, dims, flags, dp):
    """``out [T*H] = fused_moe(x [T*H])`` (flat, the input dtype) with the packed experts
    ``w13``, ``w2`` (flat, in their carriers) and biases ``b13``, ``b2`` (flat, the
    weight dtype; empty where absent); ``buf``: the workspace, ``lay`` its layout
    (``MoEWorkspacePlan.layout``: a ``scratch.Layout``); ``dims = (T, E, k, H, I,
    activation)``; ``flags =
    (has_b13, has_b2, skip_weighted)``; ``dp``: the path witness (see :func:`_w13_rows`)."""
    t_n, e_n, k, h, i_n = dims[:5]
    has_b13, has_b2, skip_weighted = flags
    xf, offsets, sorted_slots, slot_rows, items, act_buf, y_buf, scratch = _parts(buf, lay)
    _sort_tokens(topk_ids, t_n, k, e_n, offsets, sorted_slots, slot_rows)
    if t_n == 1:  # one token: the kernel above, one parallel region
        if not _is_dp(dp):
            for c in range(h):
                xf[c] = to_f32(x, c)
        if offsets[e_n] == 0:  # every id -1: no expert on this rank adds anything
            for c0 in range(0, h, TILE):
                vstore(out, c0, vzero())
            return
        n_e = _list_items(offsets, e_n, 1, items)  # the experts with rows
        pairs = i_n // TILE
        blocks = h // NT
        claims = np.zeros(n_e * (pairs + blocks + pairs // 2) + blocks, np.int64)
        gu = np.empty(offsets[e_n] * 2 * i_n, np.float32)  # [rows, 2I] gate and up
        nw = scratch.size // (MR * NT)  # the plan's thread count (a worker each)
        ctl = np.zeros(3, np.int64)
        ctl[1] = n_e
        ctl[2] = nw
        parts = (offsets, sorted_slots, slot_rows, items, act_buf, gu, y_buf, xf, claims, ctl)
        for me in prange(nw):
            i = np.int64(me)  # (int64 in and out of the parallel body: one signature)
            _one_token(i, out, x, w13, w2, b13, b2, topk_w, topk_ids, parts, dims, flags, dp)
        return
    if not _is_dp(dp):  # the dpbf16 tiles read the bf16 input as it is
        for t in prange(t_n):
            for c in range(h):
                xf[t * h + c] = to_f32(x, t * h + c)
    # the AMX tiles' A rows: the input's rows in sorted order (contiguous per expert)
    total = offsets[e_n] if _tiled(dp) else 0
    xg = part_of(buf, lay.gathered_input, _U16)[: total * h]
    for r in prange(total):
        _gather(dp, x, xg, sorted_slots, np.int64(r), k, h)
    # w13 + activation: (expert, 16 activation columns) items of experts with tokens
    tiles_i = i_n // TILE
    n_items = _list_items(offsets, e_n, tiles_i, items)
    for q in prange(n_items):
        tid = numba.get_thread_id()
        e = items[q] // tiles_i
        it = items[q] % tiles_i
        if _on_tiles(dp, offsets[e + 1] - offsets[e]):  # the expert's rows: [rows, NT] fp32
            part = np.empty((offsets[e + 1] - offsets[e]) * NT, np.float32)
        else:
            part = scratch[tid * MR * NT : (tid + 1) * MR * NT]
        _w13_item(
            xf, x, xg, dp, dims, w13, b13, has_b13, e, it, offsets, sorted_slots, act_buf, part
        )
    # w2: (expert, 32 output columns) items
    tiles_h = h // NT
    n_items = _list_items(offsets, e_n, tiles_h, items)
    for q in prange(n_items):
        e = items[q] // tiles_h
        _w2_item(act_buf, dp, dims, w2, b2, has_b2, e, items[q] % tiles_h, offsets, y_buf)
    # combine in slot order (a slot of id -1 adds nothing), one rounding
    for t in prange(t_n):
        for c0 in range(0, h, TILE):
            acc = vzero()
            for j in range(k):
                r = slot_rows[t * k + j]
                if r < 0:  # id -1: no expert on this rank
                    continue
                wgt = vsplat(1.0) if skip_weighted else vsplat(topk_w[t, j])
                acc = vfma(wgt, vload(y_buf, r * h + c0), acc)
            vstore(out, t * h + c0, acc)


# ---------------------------------------------------------------------------------------
# the op


def check_fused_moe(
    output, input, w13, w2, w13_bias, w2_bias, topk_weights, topk_ids, *,
    activation, skip_weighted, isa,
):  # fmt: skip
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
    k = check_topk(topk_weights, topk_ids, t_n, skip_weighted)
    return dt, t_n, h, e_n, i_n, k


def fused_moe(
    output, input, w13, w2, w13_bias, w2_bias, topk_weights, topk_ids, *,
    activation="silu", skip_weighted=False, isa=None, path=None,
):  # fmt: skip
    """Run the MoE block into ``output``; see the package docstring for shapes and dtypes.

    ``path``: how the expert GEMMs multiply. None takes this CPU's path
    (``isa.gemm_path()``) where the call has at least its ``moe_min_rows`` rows (tokens x
    k) per expert on average, else widens with the register tiles: ``vdpbf16ps`` (bf16
    only) where the CPU has AVX512-BF16, the panel tiles (``fma256``, any dtype; an expert
    with fewer than ``PANEL_MIN_ROWS`` rows keeps the register tiles) where it lacks
    AVX-512. ``"widen"`` / ``"fma256"`` / ``"dpbf16"`` force one (dpbf16 only on a CPU
    with AVX512-BF16: a ValueError otherwise). Other dtypes never take dpbf16.

    ``w13`` and ``w2`` as :class:`numkern.quant.QuantWeight` (``[E, 2I, H]``, ``[E, H,
    I]``): the quantised experts (:func:`numkern.moe.quant.fused_moe_quant`, §5.7); then
    ``isa`` (the bf16 weights' layout) is None or one of ``MOE_ISAS``, and ``path`` None
    or one of ``isa.QUANT_PATHS`` (as ``numkern.quant.quant_linear``'s)."""
    if is_quantized(w13) or is_quantized(w2):
        if isa is not None and isa not in MOE_ISAS:
            raise ValueError(f"isa: expected None or one of {MOE_ISAS}, got {isa!r}")
        fused_moe_quant(
            output, input, w13, w2, w13_bias, w2_bias, topk_weights, topk_ids,
            activation=activation, skip_weighted=skip_weighted, path=path,
        )  # fmt: skip
        return
    if path is None:
        tiles, dp, panel = _tiles_default, _dp_default, _panel_default
    else:
        path = _isa.check_gemm_path(path)
        tiles, panel = path == "amx", path == "fma256"
        dp = path == "dpbf16" or (tiles and _isa.decision().dp)
        if tiles and isa != "amx":
            raise ValueError(
                f"path: 'amx' needs the amx weight layout (isa='amx'), got isa={isa!r}"
            )
    dt, t_n, h, e_n, i_n, k = check_fused_moe(
        output, input, w13, w2, w13_bias, w2_bias, topk_weights, topk_ids,
        activation=activation, skip_weighted=skip_weighted, isa=isa,
    )  # fmt: skip
    ids_t = C.as_torch(topk_ids)
    check_ids(ids_t, t_n, k, e_n)
    if t_n == 0:
        return
    buf, lay = workspace.take(_plan(t_n, k, e_n, h, i_n, dt, numba.get_num_threads()))
    if path is None:
        dp = dp and t_n * k >= DP_MIN_ROWS_PER_EXPERT * e_n
        panel = panel and t_n * k >= PANEL_MIN_ROWS_PER_EXPERT * e_n
    dp = dp and dt == torch.bfloat16
    tiles = tiles and isa == "amx"  # (amx needs bf16)
    if tiles and (_isa.decision().moe != "amx" or _isa.amx_emulated()):
        # emulated tiles (test-only): never for one token, whose kernel is vdpbf16ps'
        witness = _EMULATED_WITNESS if t_n > 1 else (_DP_WITNESS if dp else _WIDEN_WITNESS)
    elif tiles:
        witness = _TILE_WITNESS
    else:
        witness = _DP_WITNESS if dp else (_PANEL_WITNESS if panel else _WIDEN_WITNESS)
    w13a = C.as_numpy(w13).reshape(-1)
    w2a = C.as_numpy(w2).reshape(-1)
    if isa == "amx":  # bf16 K pairs travel as uint32 (see numkern._tiles)
        w13a, w2a = w13a.view(np.uint32), w2a.view(np.uint32)
    empty = C.as_numpy(w13).reshape(-1)[:0]  # "no bias": an empty array of the bias dtype
    b13 = C.as_numpy(w13_bias).reshape(-1) if w13_bias is not None else empty
    b2 = C.as_numpy(w2_bias).reshape(-1) if w2_bias is not None else empty
    _fused_moe(
        C.as_numpy(output).reshape(-1),
        C.as_numpy(input).reshape(-1),
        w13a,
        w2a,
        b13,
        b2,
        C.as_numpy(topk_weights),
        C.as_numpy(ids_t),
        buf,
        lay,
        (t_n, e_n, k, h, i_n, ACTIVATIONS[activation]),
        (w13_bias is not None, w2_bias is not None, bool(skip_weighted)),
        witness,
    )


@functools.lru_cache(maxsize=64)
def _plan(t_n, k, e_n, h, i_n, dt, threads):
    """``moe_workspace_plan`` of a call, remembered: a decode step asks for the same one
    every layer, and planning costs ~11 us against the op's ~8 us overhead in vLLM."""
    return moe_workspace_plan(t_n, k, e_n, h, i_n, dt, threads)


# the path witnesses of _fused_moe (see _w13_rows and _is_panel)
_DP_WITNESS = np.empty(0, np.uint16)
_TILE_WITNESS = np.empty(0, np.uint8)
_EMULATED_WITNESS = np.empty(0, np.int8)
_WIDEN_WITNESS = np.empty(0, np.float32)
_PANEL_WITNESS = np.empty(0, np.float64)
_tiles_default = _isa.decision().moe == "amx"
_dp_default = _isa.decision().moe in ("amx", "dpbf16")
_panel_default = _isa.decision().moe == "fma256"
