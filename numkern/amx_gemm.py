"""bf16 GEMM blocks on AMX tiles (docs/kernels.md §4.4): the ``amx`` path.

One call of :func:`block` computes one packed block of 32 output columns for every row
of ``x`` (the unit the packed linear's ``prange`` and the decoder's claimed chunks hand
out, as ``gemm._block_dp``), in 2 x 2 tiles: rows ``i .. i+31`` (A tiles 4 and 5, 16
rows each) times the block's two 16-column halves (B tiles 6 and 7) into the fp32 tiles
0-3, K in steps of 32. The packed weight is vLLM's ``[K/2][32][2]`` block: one K pair
row is 128 bytes (32 columns x 2), so a half block's 16 pairs load as a B tile with a
128-byte stride, straight from the packed weight (no new packing). A tiles load straight
from the bf16 activations with their row stride.

Tails, all inside the tile code (no vector fallback, so the emulated tiles cover them):

* M not a multiple of 32: the last row group configures its A and C tiles with the rows
  it has (one tile pair when 16 or fewer): a new ``ldtilecfg`` per row-group shape;
* K not a multiple of 32: the last step's A rows and B pairs are copied zero-padded
  into this call's scratch (``tdpbf16ps`` cannot take a shorter K without a new
  configuration, which would zero the accumulators);
* a last block narrower than 32 columns: copied into the full block layout, zero
  padded (as ``gemm._pad_block``), its extra columns never stored.

The loop order keeps the block's weight panel (K x 32 bf16: 256 KB at K = 4096) in the
L2 while every row group of the call passes over it; the weight streams from memory
once per call. Each block is one kernel entry: it writes and loads its configuration and
releases the tiles at exit (``numkern.amx``). The tile context's dtype (``tiles``, a
witness) picks real or emulated tiles.
"""

import numpy as np

from ._jit import jit
from .amx import (
    context,
    tile_begin,
    tile_dpbf16,
    tile_end,
    tile_load,
    tile_shape,
    tile_store,
    tile_zero,
)
from .simd import prefetch, store_f32, vadd, vload, vstore

NB = 32  # columns per packed block (gemm.NB)
KT = 32  # K per tile step (bf16: 64 bytes of an A row)
PF_STEPS = 8  # K steps ahead a streamed weight is prefetched (8 KB a tile stream)


@jit(inline="always")
def _configure(ctx, top, bot):
    """The 2 x 2 configuration of a row group: A 4 and C 0, 1 with ``top`` rows, A 5 and
    C 2, 3 with ``bot``. A group of 16 rows or fewer (``bot`` 0) has no second row tile:
    5 is a second A tile of ``top`` rows and 2, 3 a second pair of B tiles, so that
    consecutive K steps load into other tiles than the products before them read (tile
    registers are not renamed: a load into a tile waits for the product reading it)."""
    tile_shape(ctx, 0, top, 64)
    tile_shape(ctx, 1, top, 64)
    tile_shape(ctx, 2, bot if bot else 16, 64)
    tile_shape(ctx, 3, bot if bot else 16, 64)
    tile_shape(ctx, 4, top, 64)
    tile_shape(ctx, 5, bot if bot else top, 64)
    tile_shape(ctx, 6, 16, 64)
    tile_shape(ctx, 7, 16, 64)
    tile_begin(ctx)


@jit(inline="always")
def group(ctx, shape, rows):
    """Start a row group of ``rows`` (<= 32) rows: a new configuration where its shape
    differs from ``shape`` (the last group's; -1 for none: every tile zeroed), else the C
    tiles zeroed. Returns the group's shape, the next call's ``shape``."""
    top = min(16, rows)
    bot = rows - top
    key = top * 32 + bot
    if key != shape:
        _configure(ctx, top, bot)
    else:
        tile_zero(ctx, 0)
        tile_zero(ctx, 1)
        tile_zero(ctx, 2)
        tile_zero(ctx, 3)
    return key


@jit(inline="always")
def products(ctx, rows, a, a0, a_rs, b, b0, b1, b_rs, b_step, steps):
    """C += A @ (B0 | B1) over ``steps`` K steps of 32: A's ``rows`` rows from ``a[a0]``
    (``a_rs`` elements apart, bf16), the two 16-column B tiles from ``b[b0]`` and
    ``b[b1]`` (pair rows ``b_rs`` bytes apart, the next step ``b_step`` elements on)."""
    if rows > 16:
        for s in range(steps):
            _step(ctx, a, a0 + s * KT, a_rs, b, b0 + s * b_step, b1 + s * b_step, b_rs, True)
        return
    for s in range(0, steps - 1, 2):  # 16 rows or fewer: two K steps in other tiles
        _step16(ctx, a, a0 + s * KT, a_rs, b, b0 + s * b_step, b1 + s * b_step, b_rs, b_step)
    if steps % 2:
        s = steps - 1
        _step(ctx, a, a0 + s * KT, a_rs, b, b0 + s * b_step, b1 + s * b_step, b_rs, False)


@jit(inline="always")
def _step16(ctx, a, a0, a_rs, b, b0, b1, b_rs, b_step):
    """Two K steps of a group of 16 rows or fewer: the first in A 4 and B 6, 7, the
    second in A 5 and B 2, 3 (see :func:`_configure`)."""
    tile_load(ctx, 4, a, a0, 2 * a_rs)
    tile_load(ctx, 6, b, b0, b_rs)
    tile_load(ctx, 7, b, b1, b_rs)
    tile_load(ctx, 5, a, a0 + KT, 2 * a_rs)
    tile_load(ctx, 2, b, b0 + b_step, b_rs)
    tile_load(ctx, 3, b, b1 + b_step, b_rs)
    tile_dpbf16(ctx, 0, 4, 6)
    tile_dpbf16(ctx, 1, 4, 7)
    tile_dpbf16(ctx, 0, 5, 2)
    tile_dpbf16(ctx, 1, 5, 3)


@jit(inline="always")
def streamed(ctx, rows, a, a0, a_rs, b, b0, b1, b_step, steps):
    """:func:`products` for B tiles of 64-byte pair rows (each tile 1 KB contiguous) read
    once from memory: each step prefetches the B tiles ``PF_STEPS`` steps ahead, one line
    at a time (the hardware prefetchers alone left a weight stream of 16-row experts well
    short of the bandwidth)."""
    lines = 64 // b.itemsize  # elements per cache line
    for s in range(0, steps, 2):
        for u in range(s + PF_STEPS, min(s + PF_STEPS + 2, steps)):
            for r in range(16):
                prefetch(b, b0 + u * b_step + r * lines)
                prefetch(b, b1 + u * b_step + r * lines)
        products(ctx, rows, a, a0 + s * KT, a_rs, b, b0 + s * b_step, b1 + s * b_step, 64,
                 b_step, min(2, steps - s))  # fmt: skip


@jit(inline="always")
def _step(ctx, a, a0, a_rs, b, b0, b1, b_rs, bot):
    """One K step of a row group: A rows from ``a[a0]`` (``a_rs`` elements apart), the
    two B halves from ``b[b0]`` and ``b[b1]`` (pair rows ``b_rs`` bytes apart)."""
    tile_load(ctx, 4, a, a0, 2 * a_rs)
    tile_load(ctx, 6, b, b0, b_rs)
    tile_load(ctx, 7, b, b1, b_rs)
    tile_dpbf16(ctx, 0, 4, 6)
    tile_dpbf16(ctx, 1, 4, 7)
    if bot:
        tile_load(ctx, 5, a, a0 + 16 * a_rs, 2 * a_rs)
        tile_dpbf16(ctx, 2, 5, 6)
        tile_dpbf16(ctx, 3, 5, 7)


@jit(inline="always")
def load_c(ctx, rows, c, c0, c_rs):
    """The C tiles from fp32 ``c[c0]``: rows ``c_rs`` elements apart, 32 columns."""
    tile_load(ctx, 0, c, c0, 4 * c_rs)
    tile_load(ctx, 1, c, c0 + 16, 4 * c_rs)
    if rows > 16:
        tile_load(ctx, 2, c, c0 + 16 * c_rs, 4 * c_rs)
        tile_load(ctx, 3, c, c0 + 16 * c_rs + 16, 4 * c_rs)


@jit(inline="always")
def store_c(ctx, rows, c, c0, c_rs):
    """The C tiles to fp32 ``c[c0]``: rows ``c_rs`` elements apart, 32 columns."""
    tile_store(ctx, 0, c, c0, 4 * c_rs)
    tile_store(ctx, 1, c, c0 + 16, 4 * c_rs)
    if rows > 16:
        tile_store(ctx, 2, c, c0 + 16 * c_rs, 4 * c_rs)
        tile_store(ctx, 3, c, c0 + 16 * c_rs + 16, 4 * c_rs)


@jit
def _pad_block16(w, base, nb, k2n):
    """A short block ``[k2n][nb][2]`` (bf16, uint16 elements) in the full layout, zero padded."""
    pad = np.zeros(k2n * 2 * NB, np.uint16)
    for r in range(k2n):
        for j in range(2 * nb):
            pad[r * 2 * NB + j] = w[base + r * 2 * nb + j]
    return pad


@jit
def block(tiles, out, out_rs, x, x_rs, w, bias, has_bias, m, n, k, blk):
    """``out[:m, blk*32 : blk*32+32] = round(x[:m] @ W_blk.T + bias)`` on tiles.

    ``x``: bf16 activations (uint16, rows ``x_rs`` apart), ``w``: the packed weight as
    uint16 (bf16; K even), ``out``: bf16 (uint16, rows ``out_rs`` apart), ``bias`` fp32.
    """
    n0 = blk * NB
    nb = min(NB, n - n0)
    k2n = k // 2
    if nb == NB:
        wb = w
        w0 = n0 * k
    else:
        wb = _pad_block16(w, n0 * k, nb, k2n)
        w0 = 0
    steps = k // KT
    kr = k - steps * KT  # the tail's K (even)
    part = np.empty(32 * NB, np.float32)  # the C tiles staged for the epilogue
    ta = np.zeros(32 * KT if kr else 0, np.uint16)  # the tail's A rows, zero padded
    tb = np.zeros(KT * NB if kr else 0, np.uint16)  # the tail's B pairs, zero padded
    if kr:
        tail = w0 + steps * KT * NB
        for j in range(kr * NB):
            tb[j] = wb[tail + j]
    ctx = context(tiles)
    shape = -1
    for i in range(0, m, 32):
        rows = min(32, m - i)
        shape = group(ctx, shape, rows)
        products(ctx, rows, x, i * x_rs, x_rs, wb, w0, w0 + 32, 128, KT * NB, steps)
        if kr:
            for r in range(rows):
                for j in range(kr):
                    ta[r * KT + j] = x[(i + r) * x_rs + steps * KT + j]
            products(ctx, rows, ta, 0, KT, tb, 0, 32, 128, 0, 1)
        store_c(ctx, rows, part, 0, NB)
        store_rows(out, out_rs, part, bias, has_bias, i, rows, n0, nb)
    tile_end(ctx)


@jit(inline="always")
def store_rows(out, out_rs, part, bias, has_bias, i, rows, n0, nb):
    """``out[i + r, n0 : n0+nb] = round(part[r] + bias[n0 : n0+nb])`` for ``r < rows``
    (``part``: fp32 rows of 32; the packed linear's every path ends a block with it)."""
    for r in range(rows):
        o = (i + r) * out_rs + n0
        if nb == NB:
            v0 = vload(part, r * NB)
            v1 = vload(part, r * NB + 16)
            if has_bias:
                v0 = vadd(v0, vload(bias, n0))
                v1 = vadd(v1, vload(bias, n0 + 16))
            vstore(out, o, v0)
            vstore(out, o + 16, v1)
        else:
            for j in range(nb):
                acc = part[r * NB + j]
                if has_bias:
                    acc += bias[n0 + j]
                store_f32(out, o + j, acc)
