"""512-bit vector values for Numba kernels: 16 x fp32 in one SSA value.

Numba's auto-vectoriser keeps accumulators in memory and prefers 256-bit registers;
on register-blocked GEMM that measured 4-15x slower here than the same loop written
with explicit ``<16 x float>`` values. This module gives kernels such a value type,
``f32x16``, and the few intrinsics they need. Everything is emitted as target-neutral
LLVM vector IR, which LLVM lowers for the features Numba targets: one zmm register
per value on AVX-512, two ymm (or four xmm) on CPUs without it. That lowering *is* the
fallback: it never emits an instruction the (possibly masked) host lacks, and it is
the same source, so it cannot drift from the fast path. The one x86-only intrinsic,
``dpbf16`` (``vdpbf16ps``), must only be compiled where ``isa.has("avx512bf16")``
(its operands, ``vload_raw_pairs``, ``vbcast_raw_pair`` and ``vinterleave_raw``, are
plain loads and shuffles that compile anywhere).

Storage dtypes (the arrays kernels see: ``numkern._check.CARRIER``, docs/kernels.md §2.2):

* ``uint16`` holds bf16 bits: widened by ``u32 << 16``, rounded back to nearest-even;
* ``int16`` holds fp16 bits (Numba has no fp16 arrays): ``fpext``/``fptrunc`` (RNE), or
  the same bits from integer operations where the CPU lacks F16C (``_F16C``);
* ``float32`` is itself.

All loads and stores take a 1-D C-contiguous array and a flat element index; they do
no bounds checking (the wrappers validate shapes before a kernel runs).
"""

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic, models, register_model

# numkern's start-up first: a kernel using these may compile next
from . import _boot, isa  # noqa: F401

LANES = 16
_F32 = ir.FloatType()
_I32 = ir.IntType(32)
_I16 = ir.IntType(16)
_VF = ir.VectorType(_F32, LANES)
_VI = ir.VectorType(_I32, LANES)
_VH = ir.VectorType(_I16, LANES)


class F32x16Type(types.Type):
    """16 x float32 held in one LLVM vector register value."""

    def __init__(self):
        super().__init__(name="f32x16")


class I32x16Type(types.Type):
    """16 x int32 raw lanes (packed bf16 pairs for ``dpbf16``)."""

    def __init__(self):
        super().__init__(name="i32x16")


f32x16 = F32x16Type()
i32x16 = I32x16Type()


@register_model(F32x16Type)
class _F32x16Model(models.PrimitiveModel):
    def __init__(self, dmm, fe_type):
        super().__init__(dmm, fe_type, _VF)


@register_model(I32x16Type)
class _I32x16Model(models.PrimitiveModel):
    def __init__(self, dmm, fe_type):
        super().__init__(dmm, fe_type, _VI)


_STORAGE = (types.uint16, types.int16, types.float32)


def _check_array(arr):
    if not (isinstance(arr, types.Array) and arr.ndim == 1 and arr.dtype in _STORAGE):
        raise TypeError(f"simd: expected a 1-D uint16/int16/float32 array, got {arr}")


def _ptr(context, builder, arrty, arr, idxty, idx):
    """Pointer to ``arr[idx]`` (no bounds check)."""
    ary = context.make_array(arrty)(context, builder, arr)
    idx = context.cast(builder, idx, idxty, types.intp)
    return builder.gep(ary.data, [idx])


def _splat(builder, scalar, vecty):
    undef = ir.Constant(vecty, ir.Undefined)
    v = builder.insert_element(undef, scalar, ir.Constant(_I32, 0))
    return builder.shuffle_vector(v, undef, ir.Constant(ir.VectorType(_I32, LANES), [0] * LANES))


def _widen16(builder, raw, dtype):
    """<16 x i16> storage bits of ``dtype`` -> <16 x float>."""
    if dtype == types.uint16:  # bf16
        wide = builder.zext(raw, _VI)
        return builder.bitcast(builder.shl(wide, _splat(builder, ir.Constant(_I32, 16), _VI)), _VF)
    if not _F16C:
        return _half_bits_to_float(builder, builder.zext(raw, _VI), _VI, _VF)
    return builder.fpext(builder.bitcast(raw, ir.VectorType(ir.HalfType(), LANES)), _VF)


# Without F16C (the 128-bit SSE code: an x86-64 without AVX, or CI's fallback run on an
# AVX2-only CPU), LLVM lowers fp16 <-> fp32 to compiler-rt's __extendhfsf2/__truncsfhf2,
# which Numba's JIT cannot resolve ("LLVM ERROR: Symbol not found", an abort). These
# integer forms give the same bits (fp16 -> fp32 is exact; fp32 -> fp16 rounds to nearest
# even; NaN stays NaN) and compile anywhere. Checked against torch's conversion of every
# fp16 value and of fp32 values around every fp16 rounding boundary (tests/test_simd.py).
_F16C = isa.has("f16c")


def _const(ty, value):
    """``value`` as a constant of ``ty`` (an int or float type, or a vector of one)."""
    if isinstance(ty, ir.VectorType):
        return ir.Constant(ty, [value] * ty.count)
    return ir.Constant(ty, value)


def _half_bits_to_float(builder, h, ity, fty):
    """fp16 bits (zero-extended to ``ity``: i32 or a vector of it) -> float (``fty``)."""
    c = lambda x: _const(ity, x)  # noqa: E731
    sign = builder.shl(builder.and_(h, c(0x8000)), c(16))
    o = builder.shl(builder.and_(h, c(0x7FFF)), c(13))  # exponent and mantissa, in place
    exp = builder.and_(o, c(0x7C00 << 13))
    o = builder.add(o, c((127 - 15) << 23))  # rebias the exponent
    inf_nan = builder.icmp_unsigned("==", exp, c(0x7C00 << 13))
    o_inf = builder.add(o, c((128 - 16) << 23))  # to the fp32 Inf/NaN exponent
    # zero and subnormals: one more exponent step, then the implicit 1 taken away in fp32
    magic = builder.bitcast(c(113 << 23), fty)
    sub = builder.fsub(builder.bitcast(builder.add(o, c(1 << 23)), fty), magic)
    o = builder.select(inf_nan, o_inf, o)
    o = builder.select(builder.icmp_unsigned("==", exp, c(0)), builder.bitcast(sub, ity), o)
    return builder.bitcast(builder.or_(o, sign), fty)


def _float_to_half_bits(builder, v, ity):
    """float (scalar or vector) -> fp16 bits in the low 16 bits of ``ity``, to nearest even;
    NaN -> a quiet NaN (0x7E00 with the sign), past the fp16 range -> Inf."""
    c = lambda x: _const(ity, x)  # noqa: E731
    bits = builder.bitcast(v, ity)
    sign = builder.and_(bits, c(0x80000000))
    f = builder.xor(bits, sign)
    big = builder.icmp_unsigned(">=", f, c((127 + 16) << 23))  # overflow, Inf or NaN
    special = builder.select(builder.icmp_unsigned(">", f, c(255 << 23)), c(0x7E00), c(0x7C00))
    # below fp16's smallest normal: add a magic float whose exponent puts the subnormal's
    # bits at the bottom (the fp32 add rounds to nearest even), then take it away
    magic = c(((127 - 15) + (23 - 10) + 1) << 23)
    fty = v.type
    small_f = builder.fadd(builder.bitcast(f, fty), builder.bitcast(magic, fty))
    small = builder.sub(builder.bitcast(small_f, ity), magic)
    odd = builder.and_(builder.lshr(f, c(13)), c(1))
    normal = builder.add(f, c((((15 - 127) << 23) + 0xFFF) & 0xFFFFFFFF))
    normal = builder.lshr(builder.add(normal, odd), c(13))
    o = builder.select(builder.icmp_unsigned("<", f, c(113 << 23)), small, normal)
    o = builder.select(big, special, o)
    return builder.or_(o, builder.lshr(sign, c(16)))


def _round_bf16(builder, v):
    """<16 x float> -> <16 x i16> bf16 bits, round to nearest even; NaN stays (quiet) NaN."""
    bits = builder.bitcast(v, _VI)
    c = lambda x: _splat(builder, ir.Constant(_I32, x), _VI)  # noqa: E731
    lsb = builder.and_(builder.lshr(bits, c(16)), c(1))
    rounded = builder.lshr(builder.add(builder.add(bits, c(0x7FFF)), lsb), c(16))
    quiet = builder.or_(builder.lshr(bits, c(16)), c(0x40))
    is_nan = builder.fcmp_unordered("uno", v, v)
    return builder.trunc(builder.select(is_nan, quiet, rounded), _VH)


def _narrow16(builder, v, dtype):
    if dtype == types.uint16:
        return _round_bf16(builder, v)
    if not _F16C:
        return builder.trunc(_float_to_half_bits(builder, v, _VI), _VH)
    return builder.bitcast(builder.fptrunc(v, ir.VectorType(ir.HalfType(), LANES)), _VH)


def _scalar_to_f32(builder, val, dtype):
    if dtype == types.uint16:
        return builder.bitcast(builder.shl(builder.zext(val, _I32), ir.Constant(_I32, 16)), _F32)
    if dtype == types.int16:
        if not _F16C:
            return _half_bits_to_float(builder, builder.zext(val, _I32), _I32, _F32)
        return builder.fpext(builder.bitcast(val, ir.HalfType()), _F32)
    return val


@intrinsic
def vzero(typingctx):
    """All-zero vector."""

    def codegen(context, builder, sig, args):
        return ir.Constant(_VF, None)

    return f32x16(), codegen


@intrinsic
def vsplat(typingctx, x):
    """Broadcast one float to 16 lanes."""
    if not isinstance(x, (types.Float, types.Integer)):
        return None

    def codegen(context, builder, sig, args):
        return _splat(builder, context.cast(builder, args[0], sig.args[0], types.float32), _VF)

    return f32x16(x), codegen


@intrinsic
def vbcast(typingctx, arr, idx):
    """Broadcast ``arr[idx]`` (bf16/fp16/fp32 storage) widened to fp32."""
    _check_array(arr)

    def codegen(context, builder, sig, args):
        p = _ptr(context, builder, sig.args[0], args[0], sig.args[1], args[1])
        return _splat(builder, _scalar_to_f32(builder, builder.load(p), arr.dtype), _VF)

    return f32x16(arr, idx), codegen


@intrinsic
def vload(typingctx, arr, idx):
    """``arr[idx:idx+16]`` widened to fp32."""
    _check_array(arr)

    def codegen(context, builder, sig, args):
        p = _ptr(context, builder, sig.args[0], args[0], sig.args[1], args[1])
        if arr.dtype == types.float32:
            return builder.load(builder.bitcast(p, _VF.as_pointer()), align=4)
        raw = builder.load(builder.bitcast(p, _VH.as_pointer()), align=2)
        return _widen16(builder, raw, arr.dtype)

    return f32x16(arr, idx), codegen


@intrinsic
def vload_pairs(typingctx, arr, idx):
    """16 (even, odd) pairs of 16-bit values at ``arr[idx]`` -> (even, odd) fp32 vectors.

    The VNNI layout stores, for each pair of K, a column's (k even, k odd) values next to
    each other; lane j of the result is column j. ``arr`` is either the 16-bit carrier
    (``uint16`` bf16 / ``int16`` fp16; ``idx`` counts elements and must be even) or a
    pair carrier (``uint32`` bf16 pairs / ``int32`` fp16 pairs; ``idx`` counts pairs).
    """
    pair_dtypes = (types.uint32, types.int32)
    if not (isinstance(arr, types.Array) and arr.ndim == 1):
        raise TypeError(f"simd.vload_pairs: expected a 1-D array, got {arr}")
    if arr.dtype not in (types.uint16, types.int16, *pair_dtypes):
        raise TypeError(f"simd.vload_pairs: expected 16-bit or pair storage, got {arr.dtype}")
    half = types.uint16 if arr.dtype in (types.uint16, types.uint32) else types.int16
    ret = types.UniTuple(f32x16, 2)

    def codegen(context, builder, sig, args):
        p = _ptr(context, builder, sig.args[0], args[0], sig.args[1], args[1])
        raw = builder.load(builder.bitcast(p, _VI.as_pointer()), align=2)
        c16 = _splat(builder, ir.Constant(_I32, 16), _VI)
        if half == types.uint16:
            even = builder.bitcast(builder.shl(raw, c16), _VF)
            odd = builder.bitcast(
                builder.and_(raw, _splat(builder, ir.Constant(_I32, -65536), _VI)), _VF
            )
        else:
            even = _widen16(builder, builder.trunc(raw, _VH), half)
            odd = _widen16(builder, builder.trunc(builder.lshr(raw, c16), _VH), half)
        return context.make_tuple(builder, ret, (even, odd))

    return ret(arr, idx), codegen


@intrinsic
def vload_raw_pairs(typingctx, arr, idx):
    """16 raw bf16 pairs at ``arr[idx]`` as ``i32x16`` (operand of ``dpbf16``): 32 values
    of a 16-bit carrier (``idx`` counts elements) or 16 of a pair carrier (``uint32``
    bf16 pairs; ``idx`` counts pairs)."""
    if not (isinstance(arr, types.Array) and arr.ndim == 1 and arr.dtype == types.uint32):
        _check_array(arr)

    def codegen(context, builder, sig, args):
        p = _ptr(context, builder, sig.args[0], args[0], sig.args[1], args[1])
        return builder.load(builder.bitcast(p, _VI.as_pointer()), align=2)

    return i32x16(arr, idx), codegen


@intrinsic
def vinterleave_raw(typingctx, arr, idx):
    """Lane j = the bf16 pair ``(arr[idx + j], arr[idx + 16 + j])``, j < 16, as ``i32x16``:
    a row of 16 values and the next (a K row and the next, as MoE's ``vec`` layout
    stores them) interleaved into the pair operand of ``dpbf16``: one 64-byte load and
    one shuffle (``vpermw`` on AVX-512)."""
    if not (isinstance(arr, types.Array) and arr.ndim == 1 and arr.dtype == types.uint16):
        raise TypeError(f"simd.vinterleave_raw: expected a 1-D uint16 array, got {arr}")

    def codegen(context, builder, sig, args):
        p = _ptr(context, builder, sig.args[0], args[0], sig.args[1], args[1])
        vh32 = ir.VectorType(_I16, 2 * LANES)
        rows = builder.load(builder.bitcast(p, vh32.as_pointer()), align=2)
        mask = [j // 2 + (LANES if j % 2 else 0) for j in range(2 * LANES)]
        both = builder.shuffle_vector(
            rows, ir.Constant(vh32, ir.Undefined), ir.Constant(ir.VectorType(_I32, 2 * LANES), mask)
        )
        return builder.bitcast(both, _VI)

    return i32x16(arr, idx), codegen


@intrinsic
def vstore_pairs(typingctx, arr, idx, a, b):
    """``arr[idx + 2j] = a[j]``, ``arr[idx + 2j + 1] = b[j]`` for j < 16, rounded to bf16
    (RNE; ``arr`` uint16): two rows interleaved into the pair operand of ``dpbf16``, read
    back by ``vload_raw_pairs`` (one shuffle per 16 pairs, done once where the pairs are
    read many times)."""
    if not (isinstance(arr, types.Array) and arr.ndim == 1 and arr.dtype == types.uint16):
        raise TypeError(f"simd.vstore_pairs: expected a 1-D uint16 array, got {arr}")
    if not (a == b == f32x16):
        return None

    def codegen(context, builder, sig, args):
        p = _ptr(context, builder, sig.args[0], args[0], sig.args[1], args[1])
        mask = [j // 2 + (LANES if j % 2 else 0) for j in range(2 * LANES)]
        both = builder.shuffle_vector(
            _round_bf16(builder, args[2]),
            _round_bf16(builder, args[3]),
            ir.Constant(ir.VectorType(_I32, 2 * LANES), mask),
        )
        builder.store(
            both, builder.bitcast(p, ir.VectorType(_I16, 2 * LANES).as_pointer()), align=2
        )
        return context.get_dummy_value()

    return types.void(arr, idx, a, b), codegen


@intrinsic
def vbcast_raw_pair(typingctx, arr, idx):
    """Broadcast the bf16 pair ``arr[idx], arr[idx+1]`` as one int32 to 16 lanes."""
    _check_array(arr)

    def codegen(context, builder, sig, args):
        p = _ptr(context, builder, sig.args[0], args[0], sig.args[1], args[1])
        return _splat(builder, builder.load(builder.bitcast(p, _I32.as_pointer()), align=2), _VI)

    return i32x16(arr, idx), codegen


@intrinsic
def prefetch(typingctx, arr, idx):
    """Hint the cache line of ``arr[idx]`` into L1 (``prefetcht0``); no fault, no effect
    on results. For streams the hardware prefetchers miss (strided K tiles)."""
    if not (isinstance(arr, types.Array) and arr.ndim == 1):
        raise TypeError(f"simd.prefetch: expected a 1-D array, got {arr}")

    def codegen(context, builder, sig, args):
        p = _ptr(context, builder, sig.args[0], args[0], sig.args[1], args[1])
        i8p = ir.IntType(8).as_pointer()
        fn = cgutils.get_or_insert_function(
            builder.module,
            ir.FunctionType(ir.VoidType(), [i8p, _I32, _I32, _I32]),
            "llvm.prefetch.p0",
        )
        c = lambda v: ir.Constant(_I32, v)  # noqa: E731
        builder.call(fn, [builder.bitcast(p, i8p), c(0), c(3), c(1)])
        return context.get_dummy_value()

    return types.void(arr, idx), codegen


@intrinsic
def fetch_add(typingctx, arr, idx, val):
    """Atomically ``old = arr[idx]; arr[idx] += val``; returns ``old`` (int64 arrays): the
    shared work counter of a dynamically scheduled parallel loop."""
    if not (isinstance(arr, types.Array) and arr.ndim == 1 and arr.dtype == types.int64):
        raise TypeError(f"simd.fetch_add: expected a 1-D int64 array, got {arr}")

    def codegen(context, builder, sig, args):
        p = _ptr(context, builder, sig.args[0], args[0], sig.args[1], args[1])
        v = context.cast(builder, args[2], sig.args[2], types.int64)
        return builder.atomic_rmw("add", p, v, "seq_cst")

    return types.int64(arr, idx, val), codegen


@intrinsic
def atomic_load(typingctx, arr, idx):
    """``arr[idx]`` read atomically (int64 arrays, acquire): a value another thread
    updates with :func:`fetch_add`, read in a wait loop that the compiler may neither
    hoist out of the loop nor reorder later reads before."""
    if not (isinstance(arr, types.Array) and arr.ndim == 1 and arr.dtype == types.int64):
        raise TypeError(f"simd.atomic_load: expected a 1-D int64 array, got {arr}")

    def codegen(context, builder, sig, args):
        p = _ptr(context, builder, sig.args[0], args[0], sig.args[1], args[1])
        return builder.load_atomic(p, "acquire", 8)

    return types.int64(arr, idx), codegen


@intrinsic
def atomic_store(typingctx, arr, idx, val):
    """``arr[idx] = val`` stored atomically (int64 arrays, release): the writes before it
    are visible to a thread (or process, through shared memory) that reads the value with
    :func:`atomic_load`."""
    if not (isinstance(arr, types.Array) and arr.ndim == 1 and arr.dtype == types.int64):
        raise TypeError(f"simd.atomic_store: expected a 1-D int64 array, got {arr}")

    def codegen(context, builder, sig, args):
        p = _ptr(context, builder, sig.args[0], args[0], sig.args[1], args[1])
        v = context.cast(builder, args[2], sig.args[2], types.int64)
        builder.store_atomic(v, p, "release", 8)
        return context.get_dummy_value()

    return types.void(arr, idx, val), codegen


class _BFloat(ir.types.Type):
    """llvmlite has no ``bfloat``; this prints it so the BF16 intrinsic can be declared."""

    def _to_string(self):
        return "bfloat"

    def __eq__(self, other):
        return isinstance(other, _BFloat)

    def __hash__(self):
        return hash("bfloat")


@intrinsic
def dpbf16(typingctx, acc, a, b):
    """``acc[i] + a[2i]*b[2i] + a[2i+1]*b[2i+1]`` in one ``vdpbf16ps`` (AVX512-BF16 only).

    Compile only where ``isa.has("avx512bf16")``; elsewhere LLVM cannot select it.
    """
    if not (acc == f32x16 and a == i32x16 and b == i32x16):
        return None

    def codegen(context, builder, sig, args):
        vbf = ir.VectorType(_BFloat(), 2 * LANES)
        fnty = ir.FunctionType(_VF, [_VF, vbf, vbf])
        fn = cgutils.get_or_insert_function(
            builder.module, fnty, "llvm.x86.avx512bf16.dpbf16ps.512"
        )
        return builder.call(
            fn, [args[0], builder.bitcast(args[1], vbf), builder.bitcast(args[2], vbf)]
        )

    return f32x16(acc, a, b), codegen


def _binary(llvm_op):
    @intrinsic
    def op(typingctx, a, b):
        if not (a == f32x16 and b == f32x16):
            return None

        def codegen(context, builder, sig, args):
            return getattr(builder, llvm_op)(args[0], args[1])

        return f32x16(a, b), codegen

    return op


vadd = _binary("fadd")
vsub = _binary("fsub")
vmul = _binary("fmul")
vdiv = _binary("fdiv")


@intrinsic
def vfma(typingctx, a, b, c):
    """``a * b + c`` fused (``llvm.fma``)."""
    if not (a == f32x16 and b == f32x16 and c == f32x16):
        return None

    def codegen(context, builder, sig, args):
        fn = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(_VF, [_VF, _VF, _VF]), "llvm.fma.v16f32"
        )
        return builder.call(fn, list(args))

    return f32x16(a, b, c), codegen


def _minmax(name):
    @intrinsic
    def op(typingctx, a, b):
        if not (a == f32x16 and b == f32x16):
            return None

        def codegen(context, builder, sig, args):
            fn = cgutils.get_or_insert_function(
                builder.module, ir.FunctionType(_VF, [_VF, _VF]), f"llvm.{name}.v16f32"
            )
            return builder.call(fn, list(args))

        return f32x16(a, b), codegen

    return op


vmax = _minmax("maxnum")
vmin = _minmax("minnum")


@intrinsic
def vsum(typingctx, v):
    """Sum of the 16 lanes (tree order)."""
    if v != f32x16:
        return None

    def codegen(context, builder, sig, args):
        fn = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(_F32, [_F32, _VF]), "llvm.vector.reduce.fadd.v16f32"
        )
        call = builder.call(fn, [ir.Constant(_F32, 0.0), args[0]])
        call.fastmath.add("reassoc")
        return call

    return types.float32(v), codegen


@intrinsic
def vhmax(typingctx, v):
    """Maximum of the 16 lanes (a tree of 4 shuffles; a NaN lane is ignored unless all are).

    ``llvm.vector.reduce.fmax`` without ``nnan`` lowers to 16 serial scalar max/NaN-check
    steps on x86 (measured: the largest cost of the attention softmax).
    """
    if v != f32x16:
        return None

    def codegen(context, builder, sig, args):
        x = args[0]
        undef = ir.Constant(_VF, ir.Undefined)
        for width in (8, 4, 2, 1):
            mask = [i + width if i < width else i for i in range(LANES)]
            y = builder.shuffle_vector(x, undef, ir.Constant(ir.VectorType(_I32, LANES), mask))
            x = builder.select(builder.fcmp_ordered(">", y, x), y, x)
        return builder.extract_element(x, ir.Constant(_I32, 0))

    return types.float32(v), codegen


@intrinsic
def vget(typingctx, v, lane):
    """Lane ``lane`` of ``v`` as a float32."""
    if v != f32x16 or not isinstance(lane, types.Integer):
        return None

    def codegen(context, builder, sig, args):
        return builder.extract_element(
            args[0], builder.trunc(args[1], _I32) if args[1].type != _I32 else args[1]
        )

    return types.float32(v, lane), codegen


@intrinsic
def vset(typingctx, v, lane, x):
    """``v`` with lane ``lane`` replaced by ``x``."""
    if v != f32x16 or not isinstance(lane, types.Integer):
        return None

    def codegen(context, builder, sig, args):
        lane_v = builder.trunc(args[1], _I32) if args[1].type != _I32 else args[1]
        val = context.cast(builder, args[2], sig.args[2], types.float32)
        return builder.insert_element(args[0], val, lane_v)

    return f32x16(v, lane, x), codegen


@intrinsic
def vstore(typingctx, arr, idx, v):
    """Store 16 lanes to ``arr[idx:idx+16]``, rounded to the storage dtype (RNE)."""
    _check_array(arr)
    if v != f32x16:
        return None

    def codegen(context, builder, sig, args):
        p = _ptr(context, builder, sig.args[0], args[0], sig.args[1], args[1])
        if arr.dtype == types.float32:
            builder.store(args[2], builder.bitcast(p, _VF.as_pointer()), align=4)
        else:
            builder.store(
                _narrow16(builder, args[2], arr.dtype),
                builder.bitcast(p, _VH.as_pointer()),
                align=2,
            )
        return context.get_dummy_value()

    return types.void(arr, idx, v), codegen


@intrinsic
def to_f32(typingctx, arr, idx):
    """Scalar ``arr[idx]`` widened to float32."""
    _check_array(arr)

    def codegen(context, builder, sig, args):
        p = _ptr(context, builder, sig.args[0], args[0], sig.args[1], args[1])
        return _scalar_to_f32(builder, builder.load(p), arr.dtype)

    return types.float32(arr, idx), codegen


@intrinsic
def store_f32(typingctx, arr, idx, x):
    """Scalar store of a float32 to ``arr[idx]``, rounded to the storage dtype (RNE)."""
    _check_array(arr)

    def codegen(context, builder, sig, args):
        p = _ptr(context, builder, sig.args[0], args[0], sig.args[1], args[1])
        val = context.cast(builder, args[2], sig.args[2], types.float32)
        if arr.dtype == types.float32:
            builder.store(val, p)
        else:
            vec = _splat(builder, val, _VF)
            narrowed = _narrow16(builder, vec, arr.dtype)
            builder.store(builder.extract_element(narrowed, ir.Constant(_I32, 0)), p)
        return context.get_dummy_value()

    return types.void(arr, idx, x), codegen


def _vcall(builder, name, args, ret=_VF):
    fn = cgutils.get_or_insert_function(
        builder.module, ir.FunctionType(ret, [a.type for a in args]), name
    )
    return builder.call(fn, list(args))


# The largest float32 whose exp is finite (ln(FLT_MAX) = 88.7228390...): clamped there, the
# scaled result 2^128 * p stays finite (p < 1 there); above it (and at +inf) exp is +inf.
EXP_MAX_ARG = 88.72283172607422


def _vexp_ir(builder, x):
    """exp of 16 lanes: Cody-Waite reduction to r in [-ln2/2, ln2/2], degree-6 polynomial
    (relative error ~2e-7), scaled by 2^n through the exponent bits; < -87.3 gives 0,
    > :data:`EXP_MAX_ARG` gives +inf, NaN stays NaN."""
    c = lambda v: _splat(builder, ir.Constant(_F32, v), _VF)  # noqa: E731
    lo = builder.fcmp_ordered("<", x, c(-87.3))
    over = builder.fcmp_unordered(">", x, c(EXP_MAX_ARG))  # or NaN: x * inf is the result
    xc = _vcall(
        builder,
        "llvm.minnum.v16f32",
        [_vcall(builder, "llvm.maxnum.v16f32", [x, c(-87.3)]), c(EXP_MAX_ARG)],
    )
    n = _vcall(builder, "llvm.roundeven.v16f32", [builder.fmul(xc, c(1.4426950408889634))])
    fma = lambda a, b, d: _vcall(builder, "llvm.fma.v16f32", [a, b, d])  # noqa: E731
    r = fma(n, c(-0.693359375), xc)
    r = fma(n, c(2.12194440e-4), r)
    p = c(1.0 / 720.0)
    for coef in (1.0 / 120.0, 1.0 / 24.0, 1.0 / 6.0, 0.5, 1.0, 1.0):
        p = fma(p, r, c(coef))
    ni = builder.fptosi(n, _VI)
    bits = builder.add(
        builder.bitcast(p, _VI), builder.shl(ni, _splat(builder, ir.Constant(_I32, 23), _VI))
    )
    small = builder.select(lo, c(0.0), builder.bitcast(bits, _VF))
    return builder.select(over, builder.fmul(x, c(float("inf"))), small)


@intrinsic
def vexp(typingctx, v):
    """exp of 16 lanes (relative error ~2e-7; underflows to 0 below -87.3, -inf -> 0;
    overflows to +inf above :data:`EXP_MAX_ARG`; NaN -> NaN)."""
    if v != f32x16:
        return None

    def codegen(context, builder, sig, args):
        return _vexp_ir(builder, args[0])

    return f32x16(v), codegen


@intrinsic
def vtanh(typingctx, v):
    """tanh of 16 lanes as ``1 - 2 / (exp(2x) + 1)`` (absolute error ~1e-7; NaN -> NaN)."""
    if v != f32x16:
        return None

    def codegen(context, builder, sig, args):
        c = lambda x: _splat(builder, ir.Constant(_F32, x), _VF)  # noqa: E731
        e = _vexp_ir(builder, builder.fmul(args[0], c(2.0)))
        return builder.fsub(c(1.0), builder.fdiv(c(2.0), builder.fadd(e, c(1.0))))

    return f32x16(v), codegen


@intrinsic
def viota(typingctx):
    """(0.0, 1.0, ..., 15.0)."""

    def codegen(context, builder, sig, args):
        return ir.Constant(_VF, [float(i) for i in range(LANES)])

    return f32x16(), codegen


@intrinsic
def vselect_lt(typingctx, a, b, x, y):
    """Per lane ``x if a < b else y``."""
    if not (a == b == x == y == f32x16):
        return None

    def codegen(context, builder, sig, args):
        return builder.select(builder.fcmp_ordered("<", args[0], args[1]), args[2], args[3])

    return f32x16(a, b, x, y), codegen
