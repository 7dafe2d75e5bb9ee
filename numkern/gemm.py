"""VNNI-packed linear: the small GEMMs of a CPU inference step (docs/kernels.md §4).

Layouts
-------
``weight [N, K]`` or ``[E, N, K]``, contiguous, bf16/fp16/fp32, is packed by
:func:`convert_weight_packed` into a tensor of the same shape and dtype whose rows are
cut into blocks of ``NB = 32`` (the last block may be shorter, ``nb = min(32, N - n0)``):

* 16-bit: each block's ``[nb, K]`` slice is stored ``[K/2, nb, 2]`` —
  ``packed[e, n0:n0+nb].flat[k2*nb*2 + j*2 + d] = weight[e, n0+j, 2*k2+d]``
  (vLLM's ``convert_weight_packed`` layout, byte for byte);
* fp32: each block is stored ``[K, nb]`` (no pairing).

``weight_packed_linear(out, mat1, mat2, bias, is_vnni)``: ``mat1 [M, K]``
(``stride(-1) == 1``, any row stride), ``mat2`` packed ``[N, K]`` of mat1's dtype,
``bias [N]`` fp32 or None, ``out [M, N]`` of mat1's dtype (``stride(-1) == 1``);
``out = round(fp32(mat1) @ fp32(W).T + bias)``, accumulated in fp32, rounded to
nearest-even. A 16-bit ``mat1`` may also take an fp32 ``mat2`` (a router or gate kept
in fp32): ``out`` is then mat1's dtype (as vLLM's op: fp32 sums rounded once) or fp32
(the logits of a plain fp32 linear of the same inputs, unrounded: numkern's extension).

Kernel
------
Parallel over blocks of 32 output columns (``prange``; each thread owns its columns of
``out``). Activations are widened to fp32 once per call. Inside a block, register tiles
of rows x 32 columns are held in 512-bit values (``numkern.simd``): per pair of K, the
weight's (even, odd) values of 32 columns are four vectors, and every row does four
FMAs with its two broadcast activations.

* M <= 4 (decode): one 4-row tile streams the block's weight exactly once; the kernel
  is memory-bound, so rows past M just repeat row M-1 (their FMAs are free).
* M > 4: 8-row tiles (16 accumulators), K cut into ``KB`` slices so one slice of the
  block's weight stays in L1/L2 while every row tile of the call passes over it;
  partial sums live in a small fp32 scratch per block.
* M > 4 where the CPU lacks AVX-512 (``PATH == "fma256"``; any dtype): there a 16-lane
  value is two of the 16 ymm registers and the 8-row tile spills, so per ``KB_PANEL``
  slice the block's 32 columns are widened to fp32 once into a panel the call owns
  (``_tiles.widen_panel``), and 6-row x 16-column tiles of plain FMAs (12 ymm
  accumulators) run over each half (``_tiles.tile6``): 2.7x the 8-row tiles at M = 128
  on a Zen 4 EPYC masked to AVX2 (``isa.GEMM["fma256"]`` has the figures).

Where the CPU has AVX512-BF16 (``PATH == "dpbf16"``, from ``isa.gemm_path()``, so
``NUMKERN_CPU_FEATURES=-avx512bf16`` takes the widening path), bf16 x bf16 from
``DP_MIN_M`` rows (1 where ``isa.GEMM`` says decode takes it too, else 5) runs
``_linear_dp`` instead (M = 1: ``tile1`` on bf16, which streams the weight with one
instruction per load, where the widening tile spends three): the activations stay
bf16 (not widened), and per K pair one ``vdpbf16ps`` adds a row's two products to the
accumulators of 16 columns, so each row costs two instructions per K pair instead of four
FMAs (measured 2x the widening path on a Zen 4 EPYC). Its K slices are ``KB_DP`` long;
the per-CPU values live in ``isa.GEMM``. fp16 and fp32 inputs, and bf16 activations with
an fp32 weight, always widen: nothing is rounded to bf16 (docs/kernels.md §4.2 states
each path's arithmetic).
"""

import numba
import numpy as np
import torch
from numba import prange, types
from numba.extending import overload

from . import _check as C
from . import amx as _amx
from . import amx_gemm
from . import isa as _isa
from . import memory as _memory
from ._jit import jit
from ._ptr import _to_voidptr as _voidptr
from ._ptr import view
from ._tiles import Weights, geometry, tile1, tile4_rows, tile6_rows, tile8_rows, widen_panel
from .amx_gemm import store_rows
from .simd import (
    dpbf16,
    to_f32,
    vadd,
    vbcast_raw_pair,
    vload,
    vload_raw_pairs,
    vstore,
    vzero,
)

NB = 32  # columns per packed block: vLLM's layout, and 2 x 16 fp32 lanes
MR = 8  # rows per large-M tile: 8 x 32 = 16 zmm accumulators (isa.GemmRule says why)
SMALL_M = 4  # up to this M one 4-row tile streams the weight once (memory-bound regime)
# Each parallel region costs ~6 us to start here; widening 64K elements serially costs
# about as much, so smaller activations are widened on the calling thread.
WIDEN_PARALLEL = 1 << 16
KB = _isa.GEMM["widen"].k_slice  # K per cache slice of the widening tiles (per CPU: isa.GEMM)
MR_PANEL = 6  # rows per panel tile: 6 x 16 columns = 12 ymm accumulators (_tiles.tile6)
KB_PANEL = _isa.GEMM["fma256"].k_slice  # K per widened fp32 panel (per CPU: isa.GEMM)
# The smallest M the panel tiles take (below it the 4-row tile streams the weight once)
PANEL_MIN_M = _isa.GEMM["fma256"].min_m
# The path of bf16 x bf16 at M > SMALL_M, chosen once per process from the (masked) CPU
# features: the dpbf16 kernel is never compiled where it is not chosen or asked for.
PATH = _isa.gemm_path()[0]
KB_DP = _isa.GEMM["dpbf16"].k_slice
# The smallest M the dpbf16 path takes (1 where the table says decode takes it too)
DP_MIN_M = 1 if _isa.GEMM["dpbf16"].small_m else SMALL_M + 1
_U16 = np.empty(0, np.uint16)  # carrier witnesses of the bf16 dpbf16 kernel
_U32 = np.empty(0, np.uint32)
# The tile witnesses of the widening blocks (_block's ``tile``), chosen in Python and
# passed down; each compiles only its own tiles: float32 runs the panel tiles of the
# fma256 path from PANEL_MIN_M rows, uint8 the 8x32 tiles on the packed weight.
PANEL_TILES = np.empty(0, np.float32)
REGISTER_TILES = np.empty(0, np.uint8)
TILES = PANEL_TILES if PATH == "fma256" else REGISTER_TILES  # this CPU's (isa.GEMM)


def _panel(tile):
    """Whether the tile witness names the panel tiles (a constant of the compiled code)."""


@overload(_panel, inline="always")
def _panel_impl(tile):
    panel = tile.dtype == types.float32
    return lambda tile: panel


@jit
def _pad_block(w, base, nb, rows):
    """Copy a short block (nb < 32 columns) into the full-block layout, zero-padded.

    ``rows`` K units (pairs for pair carriers, single K for fp32) of ``nb`` elements each.
    """
    pad = np.zeros(rows * NB, w.dtype)
    for r in range(rows):
        for j in range(nb):
            pad[r * NB + j] = w[base + r * nb + j]
    return pad


@jit
def _widen_rows(x, x_rs, xf, k, r0, r1):
    for r in range(r0, r1):
        for j in range(k):
            xf[r * k + j] = to_f32(x, r * x_rs + j)


@jit
def _block(out, out_rs, xf, w, ku, kstep, rstep, bias, has_bias, m, n, k, blk, tile):
    """One block of 32 output columns, all rows: the work of one prange iteration.

    ``w`` is the packed weight in its carrier, ``ku, kstep, rstep`` its
    ``_tiles.geometry``: ``ku`` carrier elements per weight row (K/2 pairs, or K fp32),
    ``kstep`` per K pair, ``rstep`` from an even to the odd K row (fp32 only). ``tile``:
    the tile witness (``TILES``).
    """
    k2n = k // 2
    odd_k = (k % 2) == 1
    n0 = blk * NB
    nb = min(NB, n - n0)
    part = np.zeros(m * NB, np.float32)
    if nb == NB:
        wb = w
        w0 = n0 * ku
    else:
        wb = _pad_block(w, n0 * ku, nb, ku)
        w0 = 0
    wt = Weights(wb, w0, w0 + 16, kstep, rstep)
    m1 = m - 1
    if m == 1:
        tile1(xf, 0, wt, 0, k2n, odd_k, part, 0)
    elif m <= SMALL_M:
        tile4_rows(xf, 0, m1, k, wt, 0, k2n, odd_k, part, 0, NB)
    elif _panel(tile) and m >= PANEL_MIN_M:
        _panel_block(xf, wt, m, k, part)
    else:
        for ka in range(0, max(k2n, 1), KB // 2):
            kz = min(k2n, ka + KB // 2)
            r = 0
            while r + MR <= m:
                tile8_rows(xf, r, k, wt, ka, kz, part, 0, NB)
                r += MR
            while r < m:
                tile4_rows(xf, r, m1, k, wt, ka, kz, False, part, 0, NB)
                r += 4
        r = 0
        while odd_k and r < m:
            tile4_rows(xf, r, m1, k, wt, k2n, k2n, True, part, 0, NB)
            r += 4
    store_rows(out, out_rs, part, bias, has_bias, 0, m, n0, nb)


@jit(inline="always")
def _panel_block(xf, wt, m, k, part):
    """``part[m, 32] += xf[m, k] @ block`` with the panel tiles: per K slice, the block's
    32 columns widened to fp32 once into this call's own panel (this thread's: kernels
    may run from two Python threads at once), then 6-row tiles over each 16-column half."""
    k2n = k // 2
    # [2][<= KB_PANEL + 1][16] fp32, in L1/L2 (a full last slice also holds an odd K's row)
    panel = np.empty((KB_PANEL + 1) * NB, np.float32)
    for ka in range(0, max(k2n, 1), KB_PANEL // 2):
        kz = min(k2n, ka + KB_PANEL // 2)
        last_k = (k % 2) == 1 and kz == k2n
        kn = 2 * (kz - ka) + (1 if last_k else 0)  # K rows in this slice
        widen_panel(wt, ka, kz, last_k, panel, 16 * kn)
        for g in range(2):
            r = 0
            while r < m:
                tile6_rows(xf, r, m - 1, k, 2 * ka, panel, g * 16 * kn, kn, part, g * 16, NB)
                r += MR_PANEL


@jit(parallel=True)
def _linear(out, out_rs, x, x_rs, w, ku, kstep, rstep, bias, has_bias, m, n, k, tile):
    """out[m, n] (row stride out_rs) = x[m, k] (row stride x_rs) @ W.T (+ bias)."""
    xf = np.empty(m * k, np.float32)  # activations widened once: [m, k] fp32
    if m * k < WIDEN_PARALLEL:
        _widen_rows(x, x_rs, xf, k, 0, m)
    else:
        for r in prange(m):
            i = np.int64(r)  # (int64 in and out of the parallel body: one signature)
            _widen_rows(x, x_rs, xf, k, i, i + 1)
    for blk in prange((n + NB - 1) // NB):
        _block(out, out_rs, xf, w, ku, kstep, rstep, bias, has_bias, m, n, k, np.int64(blk), tile)


@jit
def _linear_at(out_addr, out_rs, x_addr, x_rs, w_addr, b_addr, has_bias, m, n, k, carriers, tile):
    """``_linear`` on tensors given by address (the per-call cost of a NumPy view is ~5 us);
    ``carriers``: the (activation, weight, output) carriers and whether the weight is
    fp32 (rows of K), one entry of ``_COMBOS``."""
    xwit, wwit, owit, fp32_weight = carriers
    out = view(out_addr, (m - 1) * out_rs + n, owit)
    x = view(x_addr, (m - 1) * x_rs + k, xwit)
    w = view(w_addr, n * (k if fp32_weight else k // 2), wwit)  # fp32 rows of K, or K pairs
    ku, kstep, rstep = geometry(w, k, NB)
    bias = numba.carray(_voidptr(b_addr), (n if has_bias else 0,), np.float32)
    _linear(out, out_rs, x, x_rs, w, ku, kstep, rstep, bias, has_bias, m, n, k, tile)


@jit(inline="always")
def _gemv_block_dp(out, x, w, bias, has_bias, n0, k2n):
    """``out[0, n0 : n0+32] = round(x[0] @ block + bias)`` of one full block at M = 1 with
    ``vdpbf16ps``: tile1's arithmetic (chain a the even K pairs, chain c the odd ones, a
    + c, then the bias: bit-identical) with the block's offsets as constants and no
    per-block scratch. A decode step is this loop over every weight: on a Zen 4 EPYC
    (2 vCPUs, 49152 x 576 bf16, 7 copies past the L3) 0.90 of a 48.9 GB/s stream
    against 0.77 for tile1 through a zeroed ``part`` per block (its allocation, load and
    store per 36 KB block, and the strides read from the ``Weights`` tuple)."""
    base = n0 * k2n  # the block: [k2n, 32] pairs
    a0 = vzero()
    a1 = vzero()
    c0 = vzero()
    c1 = vzero()
    for j in range(k2n // 2):
        o = base + 64 * j
        s = vbcast_raw_pair(x, 4 * j)
        a0 = dpbf16(a0, vload_raw_pairs(w, o), s)
        a1 = dpbf16(a1, vload_raw_pairs(w, o + 16), s)
        t = vbcast_raw_pair(x, 4 * j + 2)
        c0 = dpbf16(c0, vload_raw_pairs(w, o + 32), t)
        c1 = dpbf16(c1, vload_raw_pairs(w, o + 48), t)
    if k2n % 2:  # the odd last K pair: chain a
        o = base + 32 * (k2n - 1)
        s = vbcast_raw_pair(x, 2 * (k2n - 1))
        a0 = dpbf16(a0, vload_raw_pairs(w, o), s)
        a1 = dpbf16(a1, vload_raw_pairs(w, o + 16), s)
    v0 = vadd(a0, c0)
    v1 = vadd(a1, c1)
    if has_bias:
        v0 = vadd(v0, vload(bias, n0))
        v1 = vadd(v1, vload(bias, n0 + 16))
    vstore(out, n0, v0)
    vstore(out, n0 + 16, v1)


@jit
def _block_dp(out, out_rs, x, x_rs, w, bias, has_bias, m, n, k, blk):
    """``_block`` for bf16 x bf16 at M > SMALL_M with ``vdpbf16ps`` (AVX512-BF16 only).

    ``x`` is the bf16 activations as they are (uint16, row stride ``x_rs``), ``w`` the
    packed weight as bf16 pairs (uint32, K/2 per weight row).
    """
    k2n, kstep, rstep = geometry(w, k, NB)
    n0 = blk * NB
    nb = min(NB, n - n0)
    if m == 1 and nb == NB:  # decode, a full block: straight from registers to out
        _gemv_block_dp(out, x, w, bias, has_bias, n0, k2n)
        return
    part = np.zeros(m * NB, np.float32)
    if nb == NB:
        wb = w
        w0 = n0 * k2n
    else:
        wb = _pad_block(w, n0 * k2n, nb, k2n)
        w0 = 0
    wt = Weights(wb, w0, w0 + 16, kstep, rstep)  # group 1: the next 16 pairs
    m1 = m - 1
    if m == 1:  # decode: the weight streamed once, no K slices
        tile1(x, 0, wt, 0, k2n, False, part, 0)
        store_rows(out, out_rs, part, bias, has_bias, 0, m, n0, nb)
        return
    for ka in range(0, k2n, KB_DP // 2):
        kz = min(k2n, ka + KB_DP // 2)
        r = 0
        while r + MR <= m:
            tile8_rows(x, r, x_rs, wt, ka, kz, part, 0, NB)
            r += MR
        while r < m:
            tile4_rows(x, r, m1, x_rs, wt, ka, kz, False, part, 0, NB)
            r += 4
    store_rows(out, out_rs, part, bias, has_bias, 0, m, n0, nb)


@jit(parallel=True)
def _linear_dp(out, out_rs, x, x_rs, w, bias, has_bias, m, n, k):
    for blk in prange((n + NB - 1) // NB):
        _block_dp(out, out_rs, x, x_rs, w, bias, has_bias, m, n, k, np.int64(blk))


@jit
def _linear_dp_at(out_addr, out_rs, x_addr, x_rs, w_addr, b_addr, has_bias, m, n, k):
    """``_linear_dp`` on bf16 tensors given by address (as ``_linear_at``)."""
    out = view(out_addr, (m - 1) * out_rs + n, _U16)
    x = view(x_addr, (m - 1) * x_rs + k, _U16)
    w = view(w_addr, n * (k // 2), _U32)
    bias = numba.carray(_voidptr(b_addr), (n if has_bias else 0,), np.float32)
    _linear_dp(out, out_rs, x, x_rs, w, bias, has_bias, m, n, k)


@jit(parallel=True)
def _linear_amx(out, out_rs, x, x_rs, w, bias, has_bias, m, n, k, tiles):
    for blk in prange((n + NB - 1) // NB):
        amx_gemm.block(tiles, out, out_rs, x, x_rs, w, bias, has_bias, m, n, k, np.int64(blk))


@jit
def _linear_amx_at(out_addr, out_rs, x_addr, x_rs, w_addr, b_addr, has_bias, m, n, k, tiles):
    """``_linear_amx`` on bf16 tensors given by address (as ``_linear_at``); ``tiles``:
    the tile witness (``amx.witness``: real or emulated)."""
    out = view(out_addr, (m - 1) * out_rs + n, _U16)
    x = view(x_addr, (m - 1) * x_rs + k, _U16)
    w = view(w_addr, n * k, _U16)
    bias = numba.carray(_voidptr(b_addr), (n if has_bias else 0,), np.float32)
    _linear_amx(out, out_rs, x, x_rs, w, bias, has_bias, m, n, k, tiles)


# ---------------------------------------------------------------------------------------
# the GEMM entry of the kernels that run GEMMs inside their own parallel region

# The path of a GEMM's blocks, chosen once in Python (the decoder's stack; fused_moe) and
# passed down as an empty array whose dtype names it (a compile-time witness): uint8 the
# amx path (bf16 from SMALL_M + 1 rows on real tiles, dpbf16 below), int8 the same on
# emulated tiles (the widening tiles below: a test-only path, numkern.amx), uint16
# dpbf16 (bf16 from DP_MIN_M rows), float32 the widening tiles (TILES: the fma256 path's
# panel tiles where that is the CPU's path). A variant compiles only its own blocks: a
# CPU without AVX512-BF16 never compiles _block_dp, one without AMX no tile code.
GEMM_WITNESS = {
    "amx": np.empty(0, np.uint8),
    "amx-emulated": np.empty(0, np.int8),
    "dpbf16": np.empty(0, np.uint16),
    "widen": np.empty(0, np.float32),
    "fma256": np.empty(0, np.float32),
}
_REAL_TILES = _amx.witness(emulate=False)
_EMU_TILES = _amx.witness(emulate=True)


def _bf16_pairs(x, w):
    return x.dtype == types.uint16 and w.dtype == types.uint32


def takes_tiles(path, x, w, m):
    """Whether ``m`` rows of ``x @ W.T`` run on AMX tiles (``path``: a witness)."""


@overload(takes_tiles, inline="always")
def _takes_tiles(path, x, w, m):
    tiles = path.dtype in (types.uint8, types.int8) and _bf16_pairs(x, w)
    return lambda path, x, w, m: tiles and m > SMALL_M


def takes_dp(path, x, w, m):
    """Whether ``m`` rows of ``x @ W.T`` run on vdpbf16ps (``path``: a witness)."""


@overload(takes_dp, inline="always")
def _takes_dp(path, x, w, m):
    dp = path.dtype in (types.uint8, types.uint16) and _bf16_pairs(x, w)
    return lambda path, x, w, m: dp and m >= DP_MIN_M


def blocks(path, dp, out, out_rs, src, x, x_rs, w, geo, bias, has_bias, mnk, b0, b1):
    """Blocks ``b0 .. b1-1`` of ``out[m, n] = x[m, k] @ W.T (+ bias)`` (``out`` rows
    ``out_rs`` apart, ``x`` rows ``x_rs``): on tiles where ``takes_tiles``, on vdpbf16ps
    where ``dp`` (the caller's ``takes_dp``), else the widening blocks on ``src`` (``x``
    widened to fp32, rows of ``k``). ``w`` is the packed weight in its carrier, ``geo =
    (ku, kstep, rstep)`` its ``_tiles.geometry``, ``mnk = (m, n, k)``."""


@overload(blocks, inline="always")
def _blocks(path, dp, out, out_rs, src, x, x_rs, w, geo, bias, has_bias, mnk, b0, b1):
    bf16 = _bf16_pairs(x, w)
    tiles = bf16 and path.dtype in (types.uint8, types.int8)
    has_dp = bf16 and path.dtype in (types.uint8, types.uint16)
    tw = _EMU_TILES if path.dtype == types.int8 else _REAL_TILES

    def impl(path, dp, out, out_rs, src, x, x_rs, w, geo, bias, has_bias, mnk, b0, b1):
        ku, kstep, rstep = geo
        m, n, k = mnk
        if tiles and m > SMALL_M:
            w16 = w.view(np.uint16)
            for blk in range(b0, b1):
                amx_gemm.block(tw, out, out_rs, x, x_rs, w16, bias, has_bias, m, n, k, blk)
        elif has_dp and dp:
            for blk in range(b0, b1):
                _block_dp(out, out_rs, x, x_rs, w, bias, has_bias, m, n, k, blk)
        else:
            for blk in range(b0, b1):
                _block(out, out_rs, src, w, ku, kstep, rstep, bias, has_bias, m, n, k, blk, TILES)

    return impl


# ---------------------------------------------------------------------------------------
# public API


def convert_weight_packed(weight):
    """Pack ``weight [N, K]`` or ``[E, N, K]`` (bf16/fp16/fp32, contiguous) for the linear.

    Returns a new tensor of the same shape and dtype (see the module docstring for the
    layout). K must be even for 16-bit dtypes; any N >= 1.
    """
    if not isinstance(weight, torch.Tensor):
        weight = C.as_torch(weight)
    C.check_dtype("weight", weight, C.FLOATS)
    C.check_ndim("weight", weight, (2, 3))
    C.check_contiguous("weight", weight)
    n, k = weight.shape[-2:]
    if n < 1 or k < 1:
        raise ValueError(f"weight: expected N >= 1 and K >= 1, got shape {list(weight.shape)}")
    pair = 1 if weight.dtype == torch.float32 else 2
    if k % pair:
        raise ValueError(f"weight: expected an even K for {weight.dtype}, got K={k}")
    w = weight.reshape(-1, n, k)
    e = w.shape[0]
    out = _memory.weight_empty(w.shape, w.dtype)  # streamed by every call: huge pages
    nf = n - n % NB
    if nf:  # full blocks: [E, N/32, 32, K/p, p] -> [E, N/32, K/p, 32, p]
        blocks = w[:, :nf].reshape(e, nf // NB, NB, k // pair, pair).permute(0, 1, 3, 2, 4)
        out[:, :nf] = blocks.reshape(e, nf, k)
    if nf < n:  # the short last block: [E, nb, K/p, p] -> [E, K/p, nb, p]
        tail = w[:, nf:].reshape(e, n - nf, k // pair, pair).permute(0, 2, 1, 3)
        out[:, nf:] = tail.reshape(e, n - nf, k)
    return out.reshape(weight.shape)


def weight_packed_linear(out, mat1, mat2, bias, is_vnni, *, path=None):
    """``out = round(fp32(mat1) @ fp32(W).T + bias)`` with ``mat2`` packed by
    :func:`convert_weight_packed`. See the module docstring for shapes and dtypes.

    ``path`` picks how bf16 x bf16 multiplies from ``DP_MIN_M`` rows: None takes this CPU's
    (:data:`PATH`, from ``isa.gemm_path()``), ``"widen"``, ``"fma256"`` or ``"dpbf16"``
    force one (dpbf16: a ValueError where the CPU lacks AVX512-BF16). Other dtypes, and
    M < DP_MIN_M, widen: with the panel tiles from ``PANEL_MIN_M`` rows where the path is
    fma256, else with the 8x32 tiles.

    A decode step calls this hundreds of times, so the common case (CPU tensors of the
    right dtypes and strides) is checked with as few tensor attribute reads as possible;
    anything unusual falls through to :func:`_check_linear`, which names the problem.
    """
    if path is None:
        dp, tile, tiles = _DP_DEFAULT, TILES, _AMX_TILES
    else:
        path = _isa.check_gemm_path(path)
        dp, tile = (
            path == "dpbf16" or (path == "amx" and _DP_DEFAULT),
            (PANEL_TILES if path == "fma256" else REGISTER_TILES),
        )
        tiles = _amx_tiles() if path == "amx" else None
    T = _Tensor
    if is_vnni is True and type(mat1) is T and type(mat2) is T and type(out) is T:
        wit = _COMBOS.get((mat1.dtype, mat2.dtype, out.dtype))
        try:
            m, k = mat1.shape
            n, k_w = mat2.shape
            m_o, n_o = out.shape
            x_rs, x_cs = mat1.stride()
            o_rs, o_cs = out.stride()
        except ValueError:  # not 2-D: the slow path names the argument
            wit = None
        if (
            wit is not None
            and mat1.is_cpu
            and mat2.is_cpu
            and out.is_cpu
            and k_w == k
            and m_o == m
            and n_o == n
            and (x_cs == 1 or k == 1)
            and x_rs >= k
            and (o_cs == 1 or n == 1)
            and o_rs >= n
            and (k % 2 == 0 or wit[3])
            and mat2.is_contiguous()
            and (
                bias is None
                or (
                    type(bias) is T
                    and bias.dtype is _F32
                    and bias.is_cpu
                    and bias.shape == (n,)
                    and bias.is_contiguous()
                )
            )
        ):
            if m:
                o_a, x_a, w_a = out.data_ptr(), mat1.data_ptr(), mat2.data_ptr()
                b_a = 0 if bias is None else bias.data_ptr()
                if (
                    tiles is not None
                    and m > SMALL_M
                    and wit is _BF16
                    and _apart(o_a, o_rs, n, x_a, x_rs, k, m)
                ):
                    _linear_amx_at(o_a, o_rs, x_a, x_rs, w_a, b_a, b_a != 0, m, n, k, tiles)
                elif (
                    dp and m >= DP_MIN_M and wit is _BF16 and _apart(o_a, o_rs, n, x_a, x_rs, k, m)
                ):
                    _linear_dp_at(o_a, o_rs, x_a, x_rs, w_a, b_a, b_a != 0, m, n, k)
                else:
                    _linear_at(o_a, o_rs, x_a, x_rs, w_a, b_a, b_a != 0, m, n, k, wit, tile)
            return
    _check_linear(out, mat1, mat2, bias, is_vnni)
    m, k = mat1.shape
    if m == 0:
        return
    n = mat2.shape[0]
    wit = _COMBOS[(C.dtype_of("mat1", mat1), C.dtype_of("mat2", mat2), C.dtype_of("out", out))]
    o_a, x_a, w_a = C.address(out), C.address(mat1), C.address(mat2)
    b_a = 0 if bias is None else C.address(bias)
    o_rs, x_rs = C.strides_of(out)[0], C.strides_of(mat1)[0]
    if tiles is not None and m > SMALL_M and wit is _BF16 and _apart(o_a, o_rs, n, x_a, x_rs, k, m):
        _linear_amx_at(o_a, o_rs, x_a, x_rs, w_a, b_a, bias is not None, m, n, k, tiles)
    elif dp and m >= DP_MIN_M and wit is _BF16 and _apart(o_a, o_rs, n, x_a, x_rs, k, m):
        _linear_dp_at(o_a, o_rs, x_a, x_rs, w_a, b_a, bias is not None, m, n, k)
    else:
        _linear_at(o_a, o_rs, x_a, x_rs, w_a, b_a, bias is not None, m, n, k, wit, tile)


_F32 = torch.float32
# (activation carrier, weight carrier): 16-bit weights travel as K pairs (see _tiles)
_WITNESS = {
    torch.bfloat16: (C.WITNESS[torch.bfloat16], np.empty(0, np.uint32)),
    torch.float16: (C.WITNESS[torch.float16], np.empty(0, np.int32)),
    torch.float32: (C.WITNESS[torch.float32], C.WITNESS[torch.float32]),
}
# (mat1 dtype, mat2 dtype) -> the dtypes ``out`` may have, the first being the one
# weight_packed_linear_cpu allocates: each dtype with itself, and 16-bit activations with
# an fp32 weight (a router or gate kept in fp32), whose ``out`` is mat1's dtype, as vLLM's
# op allocates it (one rounding of the fp32 sums), or fp32 (numkern's extension: the
# unrounded logits of a plain fp32 linear of the same inputs)
_OUT_DTYPES = {
    (torch.bfloat16, torch.bfloat16): (torch.bfloat16,),
    (torch.float16, torch.float16): (torch.float16,),
    (torch.float32, torch.float32): (torch.float32,),
    (torch.bfloat16, torch.float32): (torch.bfloat16, torch.float32),
    (torch.float16, torch.float32): (torch.float16, torch.float32),
}
# (mat1, mat2, out dtype) -> the carriers of _linear_at
_COMBOS = {
    (*pair, out): (_WITNESS[pair[0]][0], _WITNESS[pair[1]][1], C.WITNESS[out], pair[1] == _F32)
    for pair, outs in _OUT_DTYPES.items()
    for out in outs
}
_Tensor = torch.Tensor
# the one combination the dpbf16 path serves
_BF16 = _COMBOS[(torch.bfloat16, torch.bfloat16, torch.bfloat16)]
_DP_DEFAULT = _isa.decision().dp  # vdpbf16ps: the dpbf16 path, and the amx path's M <= 4


def _amx_tiles():
    """The tile witness of the amx path (``numkern.amx``): real tiles where this CPU's path
    is amx, emulated where the test-only switch asks (``isa.amx_emulated``)."""
    return _amx.witness(emulate=PATH != "amx" or _isa.amx_emulated())


_AMX_TILES = _amx_tiles() if PATH == "amx" else None  # None: the path is not this CPU's


def _apart(o_a, o_rs, n, x_a, x_rs, k, m):
    """Whether the bf16 rows of ``out`` and ``mat1`` (addresses, row strides) share no
    byte. The dpbf16 kernel reads ``mat1`` while other blocks write ``out``, so an
    in-place call (``out`` over ``mat1``, which the widening kernel serves: it copies
    ``mat1`` to fp32 first) takes the widening path."""
    return o_a >= x_a + 2 * ((m - 1) * x_rs + k) or x_a >= o_a + 2 * ((m - 1) * o_rs + n)


def _check_linear(out, mat1, mat2, bias, is_vnni):
    """Every check of :func:`weight_packed_linear`, each with a message naming the argument."""
    if is_vnni is not True:
        raise ValueError(
            f"is_vnni: expected True (pack the weight once with convert_weight_packed), "
            f"got {is_vnni!r}"
        )
    dt = C.check_dtype("mat1", mat1, C.FLOATS)
    C.check_ndim("mat1", mat1, (2,))
    m, k = mat1.shape
    wdt = C.check_dtype("mat2", mat2, C.FLOATS)
    C.check_ndim("mat2", mat2, (2,))
    n = mat2.shape[0]
    if (dt, wdt) not in _OUT_DTYPES:
        raise TypeError(
            f"mat2: expected mat1's dtype ({C.dtype_name(dt)}) or float32 (16-bit mat1 with "
            f"an fp32 weight), got {C.dtype_name(wdt)}"
        )
    C.check_dtype("out", out, _OUT_DTYPES[(dt, wdt)])
    if mat2.shape[1] != k:
        raise ValueError(f"mat2: expected shape [N, {k}] (K of mat1), got {list(mat2.shape)}")
    if k % 2 and wdt != torch.float32:
        raise ValueError(f"mat1: expected an even K for {C.dtype_name(wdt)} weights, got K={k}")
    C.check_shape("out", out, (m, n))
    for name, t, inner in (("mat1", mat1, k), ("out", out, n)):
        st = C.strides_of(t)
        if (st[1] != 1 and inner > 1) or st[0] < inner:
            raise ValueError(
                f"{name}: expected stride(-1) == 1 and rows that do not overlap, got strides "
                f"{list(st)} for shape {list(t.shape)}"
            )
    C.check_contiguous("mat2", mat2)
    if bias is not None:
        C.check_dtype("bias", bias, (torch.float32,))
        C.check_shape("bias", bias, (n,))
        C.check_contiguous("bias", bias)


def weight_packed_linear_cpu(x, packed_weight, n, bias=None):
    """``x [..., K] @ W.T + bias`` into a new tensor ``[..., n]`` of x's dtype (any leading
    dims), as vLLM's op: an fp32 weight's sums are rounded once to x's dtype."""
    out, args = linear_cpu_args(x, packed_weight, n, bias)
    weight_packed_linear(*args)
    return out


def linear_cpu_args(x, packed_weight, n, bias):
    """:func:`weight_packed_linear_cpu`'s checks, its new output ``[..., n]`` and the
    arguments of its :func:`weight_packed_linear` call (a torch fake checks them with
    ``_check_linear``)."""
    dt = C.check_dtype("x", x, C.FLOATS)
    n = C.check_int("n", n, low=1)
    if packed_weight.ndim != 2 or packed_weight.shape[0] != n:
        raise ValueError(
            f"packed_weight: expected shape [{n}, K] (N == n), got {list(packed_weight.shape)}"
        )
    x = C.as_torch(x)
    x2 = x.reshape(-1, x.shape[-1]) if x.ndim != 2 else x
    if x2.ndim == 2 and x2.shape[-1] > 1 and x2.stride(-1) != 1:
        x2 = x2.contiguous()
    out = torch.empty((*x.shape[:-1], n), dtype=dt, device=x.device)  # x's, as vLLM's
    b = C.as_torch(bias) if bias is not None else None
    return out, (out.view(-1, n), x2, C.as_torch(packed_weight), b, True)
