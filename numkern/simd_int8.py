"""Integer vector intrinsics for the quantised kernels (``numkern.quant``).

The values are :data:`numkern.simd.i32x16` (``<16 x i32>``: 16 lanes of 4 bytes, lane j
= row j of a 16-row block, docs/kernels.md's quant layout) and :data:`numkern.simd.f32x16`.
The loads take an *address* (an int: ``arr.ctypes.data``) and a byte offset, since one
buffer holds every section of a weight (codes, high bits, scales) and since an array
passed to the inlined helpers of a loop costs an ``NRT_incref``/``NRT_decref`` call pair
per iteration (Numba's reference-count pruning does not remove them there: measured 5x
slower GEMV).

Bitwise ops, conversions and shuffles are plain LLVM vector IR (LLVM lowers them for the
features Numba targets). The int8 dot product and the 16-entry byte lookup (MXFP4's
E2M1 table) are x86 instructions; which one is emitted is decided by the *path witness*
``wit``, an empty array whose dtype names the path (the kernels receive it from the
wrapper, which takes it from ``numkern.isa.quant_path``; never an instruction the masked
host lacks):

* ``int32``: ``vpdpbusd`` on 512 bits (AVX512-VNNI; ``PATH_VNNI512``);
* ``int16``: ``vpdpbusd`` on two 256-bit halves (AVX-VNNI, or AVX512-VNNI with VL;
  ``PATH_VNNI256``);
* ``int8``: ``vpmaddubsw`` + ``vpmaddwd`` (AVX2, 512-bit with AVX512-BW;
  ``PATH_MADDUBS``); its int16 pair sums saturate past 32767, so codes above 63 (Q8_0)
  go through :func:`dot4_u8`, which splits them into nibbles;
* ``uint8`` / ``uint16``: the amx path on real / emulated tiles (``PATH_AMX``): the
  quantised blocks switch to ``numkern.quant._kernels.qtiles`` from 5 rows and hand fewer
  to the vector path (VNNI-512; under emulated tiles this CPU's own);
* ``float32``: the fp32 path: no dot product is called, and :func:`dot4` compiles to
  plain multiplies and adds (never reached, but typed).
"""

import numpy as np
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from . import isa
from .simd import _F32, _I32, _VF, _VH, _VI, LANES, _splat, _widen16, f32x16, i32x16

_I8 = ir.IntType(8)
_I16 = ir.IntType(16)
_VB = ir.VectorType(_I8, 4 * LANES)  # the 64 bytes of an i32x16

# The path witnesses (see the module docstring): passed down, never built in a kernel.
PATH_VNNI512 = np.empty(0, np.int32)
PATH_VNNI256 = np.empty(0, np.int16)
PATH_MADDUBS = np.empty(0, np.int8)
PATH_FP32 = np.empty(0, np.float32)
# the amx path: AMX-INT8 tiles from 5 rows (numkern.quant._kernels.qtiles), real or
# emulated (numkern.amx's context dtypes), the vector path below
PATH_AMX = np.empty(0, np.uint8)
PATH_AMX_EMULATED = np.empty(0, np.uint16)
PATH_WITNESS = {
    "amx": PATH_AMX,
    "amx-emulated": PATH_AMX_EMULATED,
    "vnni512": PATH_VNNI512,
    "vnni256": PATH_VNNI256,
    "maddubs": PATH_MADDUBS,
    "fp32": PATH_FP32,
}
# The vector path under emulated tiles (their rows <= 4): this CPU's own int8 path
# (``maddubs`` typed where it has none: ``isa.check_quant_path`` refuses amx there).
EMULATED_VECTOR_PATH = {"amx": "vnni512", "fp32": "maddubs"}.get(
    isa.decision().quant, isa.decision().quant
)


def path_witness(path):
    """The witness of the quantised linear's ``path`` (one of ``isa.QUANT_PATHS``):
    ``"amx"`` runs on emulated tiles where this CPU's path is not amx or the test-only
    ``NUMKERN_AMX_EMULATE=1`` asks (``isa.amx_emulated``)."""
    if path == "amx" and (isa.decision().quant != "amx" or isa.amx_emulated()):
        return PATH_AMX_EMULATED
    return PATH_WITNESS[path]


def vector_path(path):
    """The int8 vector path that runs ``path``'s calls of 4 rows or fewer: ``path`` itself,
    for ``"amx"`` VNNI-512 under real tiles and :data:`EMULATED_VECTOR_PATH` under
    emulated ones (the rule ``numkern.quant._kernels`` compiles in, by witness)."""
    if path != "amx":
        return path
    return EMULATED_VECTOR_PATH if path_witness(path) is PATH_AMX_EMULATED else "vnni512"


def _check_addr(addr):
    if not isinstance(addr, types.Integer):
        raise TypeError(f"simd_int8: expected an integer address, got {addr}")


def _bptr(context, builder, sig, args, ty, scale=1):
    """Pointer of LLVM type ``ty*`` to byte ``args[0] + scale * args[1]``."""
    addr = context.cast(builder, args[0], sig.args[0], types.intp)
    idx = context.cast(builder, args[1], sig.args[1], types.intp)
    if scale != 1:
        idx = builder.mul(idx, ir.Constant(idx.type, scale))
    return builder.inttoptr(builder.add(addr, idx), ty.as_pointer())


def _call(builder, name, ret, args):
    fn = cgutils.get_or_insert_function(
        builder.module, ir.FunctionType(ret, [a.type for a in args]), name
    )
    return builder.call(fn, list(args))


def _c(value):
    return ir.Constant(_VI, [value] * LANES)


@intrinsic
def bload(typingctx, addr, byte):
    """The 64 bytes at ``addr + byte`` as ``i32x16``."""
    _check_addr(addr)

    def codegen(context, builder, sig, args):
        return builder.load(_bptr(context, builder, sig, args, _VI), align=1)

    return i32x16(addr, byte), codegen


@intrinsic
def bprefetch(typingctx, addr, byte):
    """Hint the cache line at ``addr + byte`` into L1 (``prefetcht0``): no fault, no effect
    on results (an address past the buffer is harmless)."""
    _check_addr(addr)

    def codegen(context, builder, sig, args):
        p = _bptr(context, builder, sig, args, _I8)
        c = lambda v: ir.Constant(_I32, v)  # noqa: E731
        _call(builder, "llvm.prefetch.p0", ir.VoidType(), [p, c(0), c(3), c(1)])
        return context.get_dummy_value()

    return types.void(addr, byte), codegen


@intrinsic
def bstore(typingctx, addr, byte, v):
    """Store ``v`` (``i32x16``) to the 64 bytes at ``addr + byte``."""
    _check_addr(addr)
    if v != i32x16:
        return None

    def codegen(context, builder, sig, args):
        builder.store(args[2], _bptr(context, builder, sig, args, _VI), align=1)
        return context.get_dummy_value()

    return types.void(addr, byte, v), codegen


@intrinsic
def bsub_c(typingctx, v, c):
    """Every byte of ``v`` minus ``c``, modulo 256 (``vpsubb``): codes ``u`` to the signed
    ``u - offset`` of the int8 tiles."""
    if not (v == i32x16 and isinstance(c, types.Integer)):
        return None

    def codegen(context, builder, sig, args):
        b = context.cast(builder, args[1], sig.args[1], types.int8)
        undef = ir.Constant(_VB, ir.Undefined)
        one = builder.insert_element(undef, b, ir.Constant(_I32, 0))
        cb = builder.shuffle_vector(one, undef, ir.Constant(ir.VectorType(_I32, 64), [0] * 64))
        return builder.bitcast(builder.sub(builder.bitcast(args[0], _VB), cb), _VI)

    return i32x16(v, c), codegen


@intrinsic
def bload_f16(typingctx, addr, byte):
    """16 fp16 values (bits) at ``addr + byte`` widened to fp32 (exact)."""
    _check_addr(addr)

    def codegen(context, builder, sig, args):
        raw = builder.load(_bptr(context, builder, sig, args, _VH), align=1)
        return _widen16(builder, raw, types.int16)

    return f32x16(addr, byte), codegen


@intrinsic
def bload_f32(typingctx, addr, byte):
    """16 fp32 values at ``addr + byte``."""
    _check_addr(addr)

    def codegen(context, builder, sig, args):
        return builder.load(_bptr(context, builder, sig, args, _VF), align=1)

    return f32x16(addr, byte), codegen


def _bytes_to_f32(signed):
    @intrinsic
    def load(typingctx, addr, byte):
        _check_addr(addr)

        def codegen(context, builder, sig, args):
            raw = builder.load(_bptr(context, builder, sig, args, ir.VectorType(_I8, LANES)))
            if signed:
                return builder.sitofp(raw, _VF)
            return builder.uitofp(raw, _VF)

        return f32x16(addr, byte), codegen

    return load


bload_u8f = _bytes_to_f32(False)  # 16 uint8 at addr + byte -> fp32
bload_i8f = _bytes_to_f32(True)  # 16 int8 at addr + byte -> fp32


@intrinsic
def bload_e8m0(typingctx, addr, byte):
    """16 E8M0 exponents at ``addr + byte`` -> fp32 ``2**(e - 128)`` (gguf's
    ``e8m0_to_fp32_half``: ``(e - 1) << 23`` as fp32 bits, ``0x00200000 << e`` for e < 2).
    Exact; e = 255 is refused at repack."""
    _check_addr(addr)

    def codegen(context, builder, sig, args):
        raw = builder.load(_bptr(context, builder, sig, args, ir.VectorType(_I8, LANES)))
        e = builder.zext(raw, _VI)
        normal = builder.shl(builder.sub(e, _c(1)), _c(23))
        tiny = builder.shl(_c(0x00200000), e)
        bits = builder.select(builder.icmp_unsigned("<", e, _c(2)), tiny, normal)
        return builder.bitcast(bits, _VF)

    return f32x16(addr, byte), codegen


@intrinsic
def ibcast4(typingctx, addr, idx):
    """The 4 bytes at ``addr + idx`` as one int32, broadcast to 16 lanes."""
    _check_addr(addr)

    def codegen(context, builder, sig, args):
        return _splat(builder, builder.load(_bptr(context, builder, sig, args, _I32), align=1), _VI)

    return i32x16(addr, idx), codegen


@intrinsic
def fbcast(typingctx, addr, idx):
    """The float32 at element ``idx`` of ``addr``, broadcast to 16 lanes."""
    _check_addr(addr)

    def codegen(context, builder, sig, args):
        return _splat(builder, builder.load(_bptr(context, builder, sig, args, _F32, 4)), _VF)

    return f32x16(addr, idx), codegen


def _scalar_load(nbty, llty):
    @intrinsic
    def load(typingctx, addr, idx):
        _check_addr(addr)

        def codegen(context, builder, sig, args):
            return builder.load(_bptr(context, builder, sig, args, llty, 4))

        return nbty(addr, idx), codegen

    return load


ld_i32 = _scalar_load(types.int32, _I32)  # element idx of an int32 array at addr
ld_f32 = _scalar_load(types.float32, _F32)  # element idx of a float32 array at addr


@intrinsic
def isplat(typingctx, x):
    """One integer in 16 int32 lanes."""
    if not isinstance(x, types.Integer):
        return None

    def codegen(context, builder, sig, args):
        return _splat(builder, context.cast(builder, args[0], sig.args[0], types.int32), _VI)

    return i32x16(x), codegen


@intrinsic
def izero(typingctx):
    """All-zero ``i32x16``."""

    def codegen(context, builder, sig, args):
        return ir.Constant(_VI, None)

    return i32x16(), codegen


def _ibinary(op):
    @intrinsic
    def f(typingctx, a, b):
        if not (a == i32x16 and b == i32x16):
            return None

        def codegen(context, builder, sig, args):
            return getattr(builder, op)(args[0], args[1])

        return i32x16(a, b), codegen

    return f


iadd = _ibinary("add")
isub = _ibinary("sub")
ior = _ibinary("or_")


def _iconst(op):
    """``v OP c`` for an integer constant ``c`` (a compile-time literal or a runtime int)."""

    @intrinsic
    def f(typingctx, v, c):
        if not (v == i32x16 and isinstance(c, types.Integer)):
            return None

        def codegen(context, builder, sig, args):
            cv = _splat(builder, context.cast(builder, args[1], sig.args[1], types.int32), _VI)
            return getattr(builder, op)(args[0], cv)

        return i32x16(v, c), codegen

    return f


iand_c = _iconst("and_")  # v & c
ishr_c = _iconst("lshr")  # v >> c (logical)
ishl_c = _iconst("shl")  # v << c


@intrinsic
def itof(typingctx, v):
    """int32 lanes -> fp32 (exact below 2**24, as every group sum here is)."""
    if v != i32x16:
        return None

    def codegen(context, builder, sig, args):
        return builder.sitofp(args[0], _VF)

    return f32x16(v), codegen


@intrinsic
def ibyte_f(typingctx, v, i, off):
    """Byte ``i`` of every lane, minus ``off``, as fp32: 16 codes of one K."""
    if not (v == i32x16 and isinstance(i, types.Integer) and isinstance(off, types.Integer)):
        return None

    def codegen(context, builder, sig, args):
        sh = _splat(builder, builder.mul(context.cast(builder, args[1], sig.args[1], types.int32),
                                         ir.Constant(_I32, 8)), _VI)  # fmt: skip
        b = builder.and_(builder.lshr(args[0], sh), _c(0xFF))
        o = _splat(builder, context.cast(builder, args[2], sig.args[2], types.int32), _VI)
        return builder.sitofp(builder.sub(b, o), _VF)

    return f32x16(v, i, off), codegen


def _halves(builder, v, n, elem):
    """``v`` (an i32x16) as ``n`` vectors of ``elem`` with 64/n bytes each."""
    count = 64 // n // (elem.width // 8)
    whole = builder.bitcast(v, ir.VectorType(elem, count * n))
    undef = ir.Constant(whole.type, ir.Undefined)
    out = []
    for h in range(n):
        mask = ir.Constant(ir.VectorType(_I32, count), list(range(h * count, (h + 1) * count)))
        out.append(builder.shuffle_vector(whole, undef, mask))
    return out


def _join(builder, parts):
    """Concatenate equal vectors back into one i32x16."""
    while len(parts) > 1:
        a, b = parts[0], parts[1]
        n = a.type.count
        mask = ir.Constant(ir.VectorType(_I32, 2 * n), list(range(2 * n)))
        parts = [builder.shuffle_vector(a, b, mask), *parts[2:]]
    return builder.bitcast(parts[0], _VI)


# MXFP4's E2M1 codes as unsigned bytes: gguf's doubled values (kvalues) + 12 (the layout
# in docs/kernels.md; numkern.quant.formats repacks with the same table).
MXFP4_LUT = (12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0)


@intrinsic
def lut_mxfp4(typingctx, v):
    """Every byte (0..15) of ``v`` replaced by :data:`MXFP4_LUT` of it: ``vpshufb`` (on 512
    bits with AVX512-BW, 256 with AVX2, 128 with SSSE3), else 16 compares and selects."""
    if v != i32x16:
        return None

    def codegen(context, builder, sig, args):
        if isa.has("avx512bw"):
            parts, name, n = [builder.bitcast(args[0], _VB)], "llvm.x86.avx512.pshuf.b.512", 64
        elif isa.has("avx2"):
            parts, name, n = _halves(builder, args[0], 2, _I8), "llvm.x86.avx2.pshuf.b", 32
        elif isa.has("ssse3"):
            parts, name, n = _halves(builder, args[0], 4, _I8), "llvm.x86.ssse3.pshuf.b.128", 16
        else:
            b = builder.bitcast(args[0], _VB)
            out = ir.Constant(_VB, None)
            for t, val in enumerate(MXFP4_LUT):
                hit = builder.icmp_unsigned("==", b, ir.Constant(_VB, [t] * 64))
                out = builder.select(hit, ir.Constant(_VB, [val] * 64), out)
            return builder.bitcast(out, _VI)
        vt = ir.VectorType(_I8, n)
        table = ir.Constant(vt, [MXFP4_LUT[i % 16] for i in range(n)])
        return _join(builder, [_call(builder, name, vt, [table, p]) for p in parts])

    return i32x16(v), codegen


def _path(wit):
    """The path a witness names: the array, or its ``.dtype`` (no reference count)."""
    if not isinstance(wit, (types.Array, types.DType)):
        raise TypeError(f"simd_int8: expected a path witness array or its dtype, got {wit}")
    return {types.int32: "vnni512", types.int16: "vnni256", types.int8: "maddubs"}.get(
        wit.dtype, "fp32"
    )


def _maddubs(builder, w, x, scale):
    """Per lane sum of 4 ``u8(w) * s8(x)`` products (int16 pair sums, then
    ``vpmaddwd`` with ``scale``): 512-bit with AVX512-BW, else two 256-bit halves."""
    if isa.has("avx512bw"):
        pairs = _call(builder, "llvm.x86.avx512.pmaddubs.w.512", ir.VectorType(_I16, 32),
                      [builder.bitcast(w, _VB), builder.bitcast(x, _VB)])  # fmt: skip
        sc = ir.Constant(ir.VectorType(_I16, 32), [scale] * 32)
        return _call(builder, "llvm.x86.avx512.pmaddw.d.512", _VI, [pairs, sc])
    out = []
    sc = ir.Constant(ir.VectorType(_I16, 16), [scale] * 16)
    for wh, xh in zip(_halves(builder, w, 2, _I8), _halves(builder, x, 2, _I8), strict=True):
        pairs = _call(builder, "llvm.x86.avx2.pmadd.ub.sw", ir.VectorType(_I16, 16), [wh, xh])
        out.append(_call(builder, "llvm.x86.avx2.pmadd.wd", ir.VectorType(_I32, 8), [pairs, sc]))
    return _join(builder, out)


def _dot(builder, path, acc, w, x, full_bytes):
    if path == "vnni512":
        return _call(builder, "llvm.x86.avx512.vpdpbusd.512", _VI,
                     [acc, builder.bitcast(w, _VB), builder.bitcast(x, _VB)])  # fmt: skip
    if path == "vnni256":
        parts = [
            _call(builder, "llvm.x86.avx512.vpdpbusd.256", ir.VectorType(_I32, 8), [a, wh, xh])
            for a, wh, xh in zip(
                _halves(builder, acc, 2, _I32),
                _halves(builder, w, 2, _I8),
                _halves(builder, x, 2, _I8),
                strict=True,
            )
        ]
        return _join(builder, parts)
    if path == "maddubs":
        if not full_bytes:
            return builder.add(acc, _maddubs(builder, w, x, 1))
        lo = builder.and_(w, _c(0x0F0F0F0F))
        hi = builder.and_(builder.lshr(w, _c(4)), _c(0x0F0F0F0F))
        both = builder.add(_maddubs(builder, lo, x, 1), _maddubs(builder, hi, x, 16))
        return builder.add(acc, both)
    # fp32 path: never called there, but typed; plain IR that compiles anywhere
    wb = builder.zext(builder.bitcast(w, _VB), ir.VectorType(_I32, 64))
    xb = builder.sext(builder.bitcast(x, _VB), ir.VectorType(_I32, 64))
    prod = builder.mul(wb, xb)
    for h in range(4):
        mask = ir.Constant(ir.VectorType(_I32, LANES), [4 * j + h for j in range(LANES)])
        acc = builder.add(acc, builder.shuffle_vector(prod, prod, mask))
    return acc


def _dot_intrinsic(full_bytes):
    @intrinsic
    def dot(typingctx, acc, w, x, wit):
        if not (acc == i32x16 and w == i32x16 and x == i32x16):
            return None
        path = _path(wit)

        def codegen(context, builder, sig, args):
            return _dot(builder, path, args[0], args[1], args[2], full_bytes)

        return i32x16(acc, w, x, wit), codegen

    return dot


# acc[j] + sum_i u8(w[j].byte i) * s8(x[j].byte i): codes up to 63 (4- and 6-bit, MXFP4)
dot4 = _dot_intrinsic(False)
# the same for codes up to 255 (Q8_0): nibble-split where vpmaddubsw would saturate
dot4_u8 = _dot_intrinsic(True)


@intrinsic
def vquant(typingctx, arr, idx, v, inv):
    """``q = roundeven(v * inv)`` (int8; ``|v * inv| <= 127`` by the caller's scale)
    stored to ``arr[idx:idx+16]`` (an int8 array); returns ``q`` as ``i32x16``."""
    if not (isinstance(arr, types.Array) and arr.dtype == types.int8 and v == f32x16):
        return None

    def codegen(context, builder, sig, args):
        ary = context.make_array(sig.args[0])(context, builder, args[0])
        idx = context.cast(builder, args[1], sig.args[1], types.intp)
        s = _splat(builder, context.cast(builder, args[3], sig.args[3], types.float32), _VF)
        r = _call(builder, "llvm.roundeven.v16f32", _VF, [builder.fmul(args[2], s)])
        q = builder.fptosi(r, _VI)
        p = builder.bitcast(builder.gep(ary.data, [idx]), ir.VectorType(_I8, LANES).as_pointer())
        builder.store(builder.trunc(q, ir.VectorType(_I8, LANES)), p, align=1)
        return q

    return i32x16(arr, idx, v, inv), codegen


@intrinsic
def ihsum(typingctx, v):
    """Sum of the 16 int32 lanes."""
    if v != i32x16:
        return None

    def codegen(context, builder, sig, args):
        return _call(builder, "llvm.vector.reduce.add.v16i32", _I32, [args[0]])

    return types.int32(v), codegen


@intrinsic
def vabs(typingctx, v):
    """|v| of 16 fp32 lanes."""
    if v != f32x16:
        return None

    def codegen(context, builder, sig, args):
        return _call(builder, "llvm.fabs.v16f32", _VF, [args[0]])

    return f32x16(v), codegen
