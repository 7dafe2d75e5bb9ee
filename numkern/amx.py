"""AMX tiles for Numba kernels: the primitives, real or emulated (docs/kernels.md §4.4).

Intel's AMX (Sapphire, Emerald, Granite Rapids) holds eight tile registers ``tmm0-7``
of up to 16 rows x 64 bytes; ``tdpbf16ps c, a, b`` adds ``a[16 x 32 bf16] @ b`` to the
fp32 tile ``c[16 x 16]``, ``b`` in pairs: ``b`` row ``r`` holds K ``2r, 2r+1`` of 16
columns. A kernel writes its tiles with these functions:

* ``tile_shape(ctx, t, rows, colsb)`` records tile ``t``'s shape in the configuration,
  ``tile_begin(ctx)`` loads it (``ldtilecfg``: every tile zeroed), ``tile_end(ctx)``
  releases the tile state (``tilerelease``).
* ``tile_zero(ctx, t)``, ``tile_load(ctx, t, arr, idx, stride)`` (``tileloadd``: the
  tile's rows from ``&arr[idx]`` every ``stride`` bytes), ``tile_store(ctx, t, arr,
  idx, stride)`` (``tilestored``), ``tile_dpbf16(ctx, c, a, b)`` (``tdpbf16ps``),
  ``tile_dpbssd`` / ``tile_dpbusd(ctx, c, a, b)`` (``tdpbssd``, ``tdpbusd``: ``c[16 x 16]``
  int32 += ``a[16 x 64 bytes] @ b``, ``b`` in quads: row ``r`` holds K ``4r .. 4r+3`` of 16
  columns; AMX-INT8).

Tile numbers are literal constants of the kernel (the instructions encode them).

``ctx`` is the tile context, and its dtype picks the lowering at compile time:

* ``uint8[64]`` (:func:`new_context` with ``emulate=False``): the real tiles. The
  array is the 64-byte configuration, written by the kernel itself before
  ``ldtilecfg``: the configuration belongs to the thread, and torch's oneDNN and vLLM's
  ops load their own on the same OpenMP workers, so every kernel entry (each ``prange``
  body) loads its own and releases it at exit, never assuming it persists. Compile
  these only where :func:`numkern.isa.amx_permitted` (the process holds Linux's grant
  of the tile state: without it the first tile instruction is SIGILL).
* ``uint16[EMU_SIZE]``: emulated tiles, the same kernel bodies with every tile operation
  on a register file in memory (8 tiles of 1 KB, then the shapes) and the products in
  fp32 FMA, bf16 denormal inputs read as zero as the tiles read them. Tests run the AMX
  kernels' indexing, tails, strides and thread split with them on any CPU (the
  test-only switch ``NUMKERN_AMX_EMULATE=1``, :func:`numkern.isa.amx_emulated`); they
  are not a fast path.

The real instructions are LLVM's fixed-register AMX intrinsics (``llvm.x86.tileloadd64``
and friends), chosen over inline assembly: the same code (measured equal within noise
on an Emerald Rapids Xeon, docs/kernels.md §4.4) without LLVM's assembly parser, and
LLVM knows which memory each one reads or writes. The configuration's store is a
volatile write, so it is never sunk past ``ldtilecfg``.
"""

import functools

import numpy as np
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.core.errors import TypingError
from numba.extending import intrinsic, overload

from . import _boot  # noqa: F401  (numkern's start-up, before any kernel is defined)
from ._jit import jit

TILES = 8
ROWS = 16  # rows of a full tile
COLSB = 64  # bytes of a full tile row
TILE_BYTES = ROWS * COLSB
EMU_TILE = TILE_BYTES // 2  # uint16 elements of one emulated tile
EMU_SIZE = TILES * EMU_TILE + 2 * TILES  # the register file, then rows[8], colsb[8]

_I8 = ir.IntType(8)
_I16 = ir.IntType(16)
_I64 = ir.IntType(64)
_P = _I8.as_pointer()


def new_context(emulate):
    """A tile context for one kernel entry: the real tiles' configuration (``uint8[64]``)
    or an emulated register file (``uint16[EMU_SIZE]``). Kernels allocate their own
    (``np.zeros(64, np.uint8)`` in the ``prange`` body); this is for Python callers and
    notebooks."""
    return np.zeros(EMU_SIZE, np.uint16) if _flag(emulate) else np.zeros(64, np.uint8)


def witness(emulate):
    """The empty array whose dtype names the lowering (uint16: emulated)."""
    return np.empty(0, np.uint16 if _flag(emulate) else np.uint8)


def _flag(emulate):
    if not isinstance(emulate, (bool, np.bool_)):
        raise TypeError(f"emulate: expected a bool, got {emulate!r:.80}")
    return bool(emulate)


def _emulated(ctx):
    if not (isinstance(ctx, types.Array) and ctx.ndim == 1):
        raise TypingError(
            f"amx: expected a tile context (uint8[64] or uint16[EMU_SIZE]), got {ctx}"
        )
    if ctx.dtype == types.uint16:
        return True
    if ctx.dtype == types.uint8:
        return False
    raise TypingError(f"amx: expected a tile context (uint8 or uint16), got {ctx}")


def _literal(t, name="tile"):
    if not isinstance(t, types.IntegerLiteral) or not 0 <= t.literal_value < TILES:
        raise TypingError(f"amx: {name} must be a literal tile number 0..7, got {t}")
    return t.literal_value


# ---------------------------------------------------------------------------------------
# the real tiles: LLVM's fixed-register AMX intrinsics


def _ptr_of(context, builder, arrty, arr, idxty, idx):
    """``&arr[idx]`` as an i8*; ``arr`` an array, or an address (an int: ``idx`` bytes)."""
    idx = context.cast(builder, idx, idxty, types.intp)
    if isinstance(arrty, types.Integer):
        addr = context.cast(builder, arr, arrty, types.intp)
        return builder.inttoptr(builder.add(addr, idx), _P)
    ary = context.make_array(arrty)(context, builder, arr)
    return builder.bitcast(builder.gep(ary.data, [idx]), _P)


def _decl(builder, name, ret, args):
    return cgutils.get_or_insert_function(builder.module, ir.FunctionType(ret, args), name)


@intrinsic
def _ldtilecfg(typingctx, cfg):
    def codegen(context, builder, sig, args):
        p = _ptr_of(context, builder, sig.args[0], args[0], types.intp, ir.Constant(_I64, 0))
        builder.call(_decl(builder, "llvm.x86.ldtilecfg", ir.VoidType(), [_P]), [p])
        return context.get_dummy_value()

    return types.void(cfg), codegen


@intrinsic
def _tilerelease(typingctx):
    def codegen(context, builder, sig, args):
        builder.call(_decl(builder, "llvm.x86.tilerelease", ir.VoidType(), []), [])
        return context.get_dummy_value()

    return types.void(), codegen


@intrinsic
def _store_u8_volatile(typingctx, arr, idx, val):
    """``arr[idx] = val`` (uint8) as a volatile store: the configuration is read by
    ``ldtilecfg`` through a pointer LLVM cannot follow."""

    def codegen(context, builder, sig, args):
        p = _ptr_of(context, builder, sig.args[0], args[0], sig.args[1], args[1])
        v = context.cast(builder, args[2], sig.args[2], types.uint8)
        builder.store(v, p).volatile = True
        return context.get_dummy_value()

    return types.void(arr, idx, val), codegen


# the tile products: bf16 pairs into fp32; int8 quads into int32 (s: signed, u: unsigned
# bytes, a's then b's)
_DP_OPS = ("tdpbf16ps", "tdpbssd", "tdpbusd")


@functools.cache
def _real(op, *tiles):
    """The intrinsic of ``op`` on the fixed tile registers ``tiles``."""
    imm = [ir.Constant(_I8, t) for t in tiles]

    if op == "zero":

        def typer(typingctx):
            def codegen(context, builder, sig, args):
                builder.call(_decl(builder, "llvm.x86.tilezero", ir.VoidType(), [_I8]), imm)
                return context.get_dummy_value()

            return types.void(), codegen

    elif op in _DP_OPS:

        def typer(typingctx):
            def codegen(context, builder, sig, args):
                fn = _decl(builder, f"llvm.x86.{op}", ir.VoidType(), [_I8, _I8, _I8])
                builder.call(fn, imm)
                return context.get_dummy_value()

            return types.void(), codegen

    else:  # load / store

        def typer(typingctx, arr, idx, stride):
            def codegen(context, builder, sig, args):
                p = _ptr_of(context, builder, sig.args[0], args[0], sig.args[1], args[1])
                s = context.cast(builder, args[2], sig.args[2], types.int64)
                name = "llvm.x86.tileloadd64" if op == "load" else "llvm.x86.tilestored64"
                builder.call(_decl(builder, name, ir.VoidType(), [_I8, _P, _I64]), [*imm, p, s])
                return context.get_dummy_value()

            return types.void(arr, idx, stride), codegen

    return intrinsic(typer)


# ---------------------------------------------------------------------------------------
# the emulated tiles: the register file in ``ctx`` (uint16), products in fp32


@intrinsic
def _bits_to_f32(typingctx, u):
    def codegen(context, builder, sig, args):
        v = context.cast(builder, args[0], sig.args[0], types.uint32)
        return builder.bitcast(v, ir.FloatType())

    return types.float32(u), codegen


@intrinsic
def _f32_to_bits(typingctx, x):
    def codegen(context, builder, sig, args):
        return builder.bitcast(args[0], ir.IntType(32))

    return types.uint32(x), codegen


@intrinsic
def _byte_at(typingctx, arr, idx, off):
    """The byte ``off`` bytes past ``&arr[idx]`` (any 1-D array)."""

    def codegen(context, builder, sig, args):
        p = _ptr_of(context, builder, sig.args[0], args[0], sig.args[1], args[1])
        o = context.cast(builder, args[2], sig.args[2], types.intp)
        return builder.load(builder.gep(p, [o]))

    return types.uint8(arr, idx, off), codegen


@intrinsic
def _set_byte_at(typingctx, arr, idx, off, val):
    def codegen(context, builder, sig, args):
        p = _ptr_of(context, builder, sig.args[0], args[0], sig.args[1], args[1])
        o = context.cast(builder, args[2], sig.args[2], types.intp)
        builder.store(context.cast(builder, args[3], sig.args[3], types.uint8), builder.gep(p, [o]))
        return context.get_dummy_value()

    return types.void(arr, idx, off, val), codegen


@jit(inline="always")
def _emu_rows(ctx, t):
    return np.int64(ctx[TILES * EMU_TILE + t]), np.int64(ctx[TILES * EMU_TILE + TILES + t])


@jit
def _emu_load(ctx, t, arr, idx, stride):
    rows, colsb = _emu_rows(ctx, t)
    base = t * EMU_TILE
    for i in range(EMU_TILE):
        ctx[base + i] = 0
    for r in range(rows):
        for b in range(0, colsb, 2):
            lo = np.uint16(_byte_at(arr, idx, r * stride + b))
            hi = np.uint16(_byte_at(arr, idx, r * stride + b + 1))
            ctx[base + r * 32 + b // 2] = lo | (hi << 8)


@jit
def _emu_store(ctx, t, arr, idx, stride):
    rows, colsb = _emu_rows(ctx, t)
    base = t * EMU_TILE
    for r in range(rows):
        for b in range(0, colsb, 2):
            u = ctx[base + r * 32 + b // 2]
            _set_byte_at(arr, idx, r * stride + b, u & 0xFF)
            _set_byte_at(arr, idx, r * stride + b + 1, u >> 8)


@jit(inline="always")
def _emu_bf16(u):
    """A bf16 input as the tiles read it: denormals (and -0) as zero."""
    if (u & 0x7F80) == 0:
        return np.float32(0.0)
    return _bits_to_f32(np.uint32(u) << 16)


@jit(inline="always")
def _emu_byte(ctx, word, hi, signed):
    """Byte ``hi`` (0: low, 1: high) of the register-file word ``word``, as int32."""
    u = np.int32((ctx[word] >> (8 * hi)) & 0xFF)
    return u - 256 if signed and u >= 128 else u


@jit(inline="always")
def _emu_pairs(ctx, acc, ar, br, j, ka):
    """``acc`` + the products over K of a bf16 A row (word ``ar``) and B's column ``j`` in
    pairs (rows from word ``br``), pair by pair, each pair's two products in fp32."""
    for p in range(ka // 4):
        x0 = _emu_bf16(ctx[ar + 2 * p])
        x1 = _emu_bf16(ctx[ar + 2 * p + 1])
        w0 = _emu_bf16(ctx[br + p * 32 + 2 * j])
        w1 = _emu_bf16(ctx[br + p * 32 + 2 * j + 1])
        acc = acc + (x0 * w0 + x1 * w1)
    return acc


@jit(inline="always")
def _emu_quads(ctx, ar, br, j, ka, a_signed):
    """int64 sum over K of an int8 A row (word ``ar``; bytes signed or not) times B's
    column ``j`` in quads of signed bytes (rows from word ``br``)."""
    acc = np.int64(0)
    for p in range(ka // 4):
        for q in range(4):
            x = _emu_byte(ctx, ar + (4 * p + q) // 2, q % 2, a_signed)
            y = _emu_byte(ctx, br + p * 32 + (4 * j + q) // 2, q % 2, True)
            acc += np.int64(x * y)
    return acc


@jit
def _emu_dp(ctx, c, a, b, kind):
    """``c += a @ b`` of ``kind`` 0: fp32 from bf16 pairs (``tdpbf16ps``, whose order of
    sums differs: the contract allows it); 1 / 2: int32 from signed / unsigned A bytes and
    signed B quads (``tdpbssd`` / ``tdpbusd``: exact, wrapping as the instructions do).
    c [rows(a) x colsb(c)/4], B's row r holds K 2r, 2r+1 (pairs) or 4r..4r+3 (quads)."""
    m, cb = _emu_rows(ctx, c)
    _, ka = _emu_rows(ctx, a)
    cc, aa, bb = c * EMU_TILE, a * EMU_TILE, b * EMU_TILE
    for i in range(m):
        for j in range(cb // 4):
            o = cc + i * 32 + 2 * j
            u = np.uint32(ctx[o]) | (np.uint32(ctx[o + 1]) << 16)
            if kind == 0:
                u = _f32_to_bits(_emu_pairs(ctx, _bits_to_f32(u), aa + i * 32, bb, j, ka))
            else:
                s = np.int64(u) + _emu_quads(ctx, aa + i * 32, bb, j, ka, kind == 1)
                u = np.uint32(s & 0xFFFFFFFF)
            ctx[o] = u & 0xFFFF
            ctx[o + 1] = u >> 16


# ---------------------------------------------------------------------------------------
# the primitives


def tile_shape(ctx, t, rows, colsb):
    """Record tile ``t``'s shape (``rows`` <= 16, ``colsb`` <= 64 bytes a row)."""


@overload(tile_shape, prefer_literal=True, inline="always")
def _tile_shape(ctx, t, rows, colsb):
    n = _literal(t)
    if _emulated(ctx):

        def impl(ctx, t, rows, colsb):
            ctx[TILES * EMU_TILE + n] = rows
            ctx[TILES * EMU_TILE + TILES + n] = colsb

        return impl

    def impl(ctx, t, rows, colsb):
        _store_u8_volatile(ctx, 0, 1)  # palette 1
        _store_u8_volatile(ctx, 16 + 2 * n, colsb & 0xFF)
        _store_u8_volatile(ctx, 17 + 2 * n, colsb >> 8)
        _store_u8_volatile(ctx, 48 + n, rows)

    return impl


def tile_begin(ctx):
    """Load the configuration (every tile zeroed): at each kernel entry, on its thread."""


@overload(tile_begin, inline="always")
def _tile_begin(ctx):
    if _emulated(ctx):

        def impl(ctx):
            for i in range(TILES * EMU_TILE):
                ctx[i] = 0

        return impl
    return lambda ctx: _ldtilecfg(ctx)


def tile_end(ctx):
    """Release the tile state (``tilerelease``) before the kernel returns."""


@overload(tile_end, inline="always")
def _tile_end(ctx):
    if _emulated(ctx):
        return lambda ctx: None
    return lambda ctx: _tilerelease()


def tile_zero(ctx, t):
    """Zero tile ``t``."""


@overload(tile_zero, prefer_literal=True, inline="always")
def _tile_zero(ctx, t):
    n = _literal(t)
    if _emulated(ctx):

        def impl(ctx, t):
            for i in range(n * EMU_TILE, (n + 1) * EMU_TILE):
                ctx[i] = 0

        return impl
    f = _real("zero", n)
    return lambda ctx, t: f()


def tile_load(ctx, t, arr, idx, stride):
    """Tile ``t``'s rows from ``&arr[idx]``, ``stride`` bytes apart (``tileloadd``);
    ``arr`` may be an address (an int, ``idx`` in bytes): no array, so no reference
    count, crosses a kernel's inner loop."""


@overload(tile_load, prefer_literal=True, inline="always")
def _tile_load(ctx, t, arr, idx, stride):
    n = _literal(t)
    if _emulated(ctx):
        return lambda ctx, t, arr, idx, stride: _emu_load(ctx, n, arr, idx, stride)
    f = _real("load", n)
    return lambda ctx, t, arr, idx, stride: f(arr, idx, stride)


def tile_store(ctx, t, arr, idx, stride):
    """Tile ``t``'s rows to ``&arr[idx]``, ``stride`` bytes apart (``tilestored``; ``arr``
    an array or an address, as :func:`tile_load`'s)."""


@overload(tile_store, prefer_literal=True, inline="always")
def _tile_store(ctx, t, arr, idx, stride):
    n = _literal(t)
    if _emulated(ctx):
        return lambda ctx, t, arr, idx, stride: _emu_store(ctx, n, arr, idx, stride)
    f = _real("store", n)
    return lambda ctx, t, arr, idx, stride: f(arr, idx, stride)


def tile_dpbf16(ctx, c, a, b):
    """``c += a @ b`` in fp32 from bf16 (``tdpbf16ps``): literal tile numbers."""


@overload(tile_dpbf16, prefer_literal=True, inline="always")
def _tile_dpbf16(ctx, c, a, b):
    nc, na, nb = _literal(c, "c"), _literal(a, "a"), _literal(b, "b")
    if len({nc, na, nb}) != 3:
        raise TypingError(f"amx: tile_dpbf16 needs three different tiles, got {nc}, {na}, {nb}")
    if _emulated(ctx):
        return lambda ctx, c, a, b: _emu_dp(ctx, nc, na, nb, 0)
    f = _real("tdpbf16ps", nc, na, nb)
    return lambda ctx, c, a, b: f()


def tile_dpbssd(ctx, c, a, b):
    """``c += a @ b`` in int32 from signed bytes (``tdpbssd``): literal tile numbers; ``b``
    in quads (row ``r`` holds K ``4r .. 4r+3`` of 16 columns)."""


def tile_dpbusd(ctx, c, a, b):
    """``c += a @ b`` in int32, ``a``'s bytes unsigned, ``b``'s signed (``tdpbusd``)."""


def _dp_int8(op, kind):
    def impl_of(ctx, c, a, b):
        nc, na, nb = _literal(c, "c"), _literal(a, "a"), _literal(b, "b")
        if len({nc, na, nb}) != 3:
            raise TypingError(f"amx: {op} needs three different tiles, got {nc}, {na}, {nb}")
        if _emulated(ctx):
            return lambda ctx, c, a, b: _emu_dp(ctx, nc, na, nb, kind)
        f = _real(op, nc, na, nb)
        return lambda ctx, c, a, b: f()

    return impl_of


overload(tile_dpbssd, prefer_literal=True, inline="always")(_dp_int8("tdpbssd", 1))
overload(tile_dpbusd, prefer_literal=True, inline="always")(_dp_int8("tdpbusd", 2))


def context(tiles):
    """A fresh tile context (inside a kernel) of the witness ``tiles``' kind: the real
    tiles' configuration (uint8) or an emulated register file (uint16)."""


@overload(context, inline="always")
def _context(tiles):
    if _emulated(tiles):
        return lambda tiles: np.zeros(EMU_SIZE, np.uint16)
    return lambda tiles: np.zeros(64, np.uint8)
