"""Fused MoE with quantised experts (docs/kernels.md §5.7): the bf16 op's routing, token
sort, activations, biases, combine and 64-bit workspace, with the two expert GEMMs on
weights kept in their quantised type.

Layouts
-------
``w13``, ``w2``: :class:`numkern.quant.QuantWeight` of shape ``[E, 2I, H]`` and ``[E, H,
I]`` (``data`` uint8 ``[E, nbytes]``, one buffer per expert in numkern's quantised
layout, ``numkern.quant.formats``); any of ``numkern.quant.QUANT_TYPES``, the two may
differ. H must be a multiple of w13's GGML block (32, 256 for the K-quants), I of w2's.
w13's rows as the bf16 op's: gate rows ``0..I-1`` then up rows ``I..2I-1``, interleaved
(row ``2i`` gate i, ``2i+1`` up i) for ``swigluoai`` (GPT-OSS's own order).
``input``/``output [T, H]`` bf16, fp16 or fp32; biases fp32 or the input dtype.

Kernel
------
1. Sort (serial): as the bf16 op (``fused._sort_tokens``).
2. Gather: each sorted row ``r`` (expert e's rows contiguous) reads its token's input
   row once: 16-bit inputs quantised to int8 per 32 K (symmetric, fp32 scale ``amax /
   127``, ``numkern.quant``'s activation format), fp32 inputs kept fp32 (never quantised).
3. w13, parallel over (expert, ``RB_ITEM`` row blocks of 16 rows) items of the experts
   with rows: ``gate_up [rows, 2I]`` fp32 (+ bias) from the quantised blocks.
4. Activation, parallel over sorted rows: fp32, rounded to the input dtype (as the bf16
   op), then quantised to int8 for the w2 GEMM (16-bit inputs) or kept fp32.
5. w2, parallel over (expert, row blocks of H) items, into ``w2_output`` fp32 (+ bias).
6. Combine (slot order, one rounding), as the bf16 op.

Three kernels: :func:`_prepare` (1-2) and :func:`_combine` (6) compile per input dtype
(small), :func:`_experts` (3-5) once for every dtype and type (the input dtype and the
weight types are runtime values), to keep the compile time of the large body to one.

Accuracy (16-bit inputs): the int8 activation rounding adds at most ``amax_g / 254`` per
activation of each 32-K group ``g``; docs/kernels.md §5.7 states the bound the tests use.
"""

import math

import numba
import numpy as np
import torch
from numba import prange

from .. import _check as C
from .._jit import jit
from ..simd import store_f32, to_f32
from .scratch import QROWS, moe_workspace_plan, workspace
from .steps import ACTIVATIONS, _activate, _round_like, _sort_tokens

RB = 16  # rows per row block of the quantised layout (numkern.quant.formats.ROWS)
# Row blocks per w13 / w2 work item: 4 row blocks = 64 output columns, so GPT-OSS-20B at
# T=1 (top-4, 2I = 5760, H = 2880) has 360 w13 and 180 w2 items for 2-16 threads.
RB_ITEM = QROWS // RB
QK = 32  # K per int8 activation scale (the GGML block every type's K is a multiple of)
QSUM = 16  # K per kept sum of int8 codes (Q6_K's 16-K scale groups need them)


def _formats():
    """``numkern.quant.formats`` (H1's table), imported where the kernels are compiled."""
    from ..quant import formats

    return formats


# ---------------------------------------------------------------------------------------
# activations to int8 (16-bit inputs)


@jit(inline="always")
def _quantize_row(src, s0, k, codes, scales, sums, r):
    """Row ``src[s0 : s0 + k]`` (any float carrier) -> int8 ``codes[r*k:]``, fp32
    ``scales[r*k/32:]`` (``amax/127`` per 32 K) and int32 ``sums[r*k/16:]`` (per 16 K)."""
    for g in range(k // QK):
        amax = np.float32(0.0)
        for i in range(QK):
            amax = max(amax, abs(to_f32(src, s0 + g * QK + i)))
        d = amax / np.float32(127.0)
        inv = np.float32(1.0) / d if amax > 0 else np.float32(0.0)
        scales[r * (k // QK) + g] = d
        for h in range(QK // QSUM):
            s = 0
            for i in range(QSUM):
                c = g * QK + h * QSUM + i
                q = np.int32(np.rint(to_f32(src, s0 + c) * inv))
                codes[r * k + c] = q
                s += q
            sums[r * (k // QSUM) + g * (QK // QSUM) + h] = s


# ---------------------------------------------------------------------------------------
# the quantised layout, one element at a time (numkern.quant.formats' module docstring)


@jit(inline="always")
def _half(bits):
    """An fp16 bit pattern (int) as float32."""
    s = -1.0 if bits & 0x8000 else 1.0
    e = (bits >> 10) & 31
    m = bits & 1023
    if e == 0:
        return np.float32(s * math.ldexp(m, -24))
    if e == 31:
        return np.float32(np.nan)
    return np.float32(s * math.ldexp(m + 1024, e - 25))


@jit(inline="always")
def _u8(w, p):
    return np.int64(w[p])


@jit(inline="always")
def _f32_at(w, p):
    """fp32 at byte ``p`` of ``w`` (little endian)."""
    bits = np.uint32(w[p]) | np.uint32(w[p + 1]) << 8 | np.uint32(w[p + 2]) << 16
    bits |= np.uint32(w[p + 3]) << 24
    return np.array([bits], np.uint32).view(np.float32)[0]


@jit
def _decode_block(w, k, tab, rb, g, wt, lut):
    """Row block ``rb``'s weights of scale group ``g`` as fp32 into ``wt[i*16 + j]``
    (``i`` < group, lane ``j`` = row): the one decode every type goes through here.
    ``tab``: the weight's table row (:func:`_table`)."""
    bits, grp, off, kind, has_min = tab[7], tab[8], tab[9], tab[10], tab[11]
    sec = tab
    ng = k // grp
    for j in range(RB):
        if kind == 0:
            p = sec[2] + ((rb * ng + g) * RB + j) * 2
            d = _half(_u8(w, p) | _u8(w, p + 1) << 8)
            m = np.float32(0.0)
            if has_min:
                p = sec[3] + ((rb * ng + g) * RB + j) * 2
                m = _half(_u8(w, p) | _u8(w, p + 1) << 8)
        elif kind == 1:
            s = g * grp // 256
            dd = _f32_at(w, sec[2] + ((rb * (k // 256) + s) * RB + j) * 4)
            sc = _u8(w, sec[4] + (rb * ng + g) * RB + j)
            if not has_min and sc >= 128:  # Q6_K: int8 scales
                sc -= 256
            d = np.float32(dd * sc)
            m = np.float32(0.0)
            if has_min:
                mm = _f32_at(w, sec[3] + ((rb * (k // 256) + s) * RB + j) * 4)
                m = -np.float32(mm * _u8(w, sec[5] + (rb * ng + g) * RB + j))
        else:
            d = np.float32(math.ldexp(1.0, _u8(w, sec[2] + (rb * ng + g) * RB + j) - 128))
            m = np.float32(0.0)
        for i in range(grp):
            kk = g * grp + i
            if bits == 8:
                u = _u8(w, (rb * (k // 4) + kk // 4) * 64 + j * 4 + (kk & 3))
            else:
                b = _u8(w, (rb * (k // 8) + kk // 8) * 64 + j * 4 + (kk & 3))
                u = (b >> (4 * ((kk >> 2) & 1))) & 15
                if bits == 6:
                    hb = _u8(w, sec[1] + (rb * (k // 16) + kk // 16) * 64 + j * 4 + (kk & 3))
                    u |= ((hb >> (2 * ((kk >> 2) & 3))) & 3) << 4
                elif kind == 2:
                    u = np.int64(lut[u])
            wt[i * RB + j] = d * np.float32(u - off) + m


# ---------------------------------------------------------------------------------------
# the expert GEMM on quantised row blocks


@jit
def _qgemm(w, tab, lut, n, k, rb0, rb1, a, rows, out, out_rs, bias, b0, has_bias):
    """``out[q*out_rs + c] = a_q . w[c] (+ bias[b0 + c])`` for the rows ``q < rows`` of
    the activation tuple ``a`` and the columns ``c < n`` of row blocks ``rb0..rb1-1``.
    ``a = (x fp32 [rows*k], codes int8, scales fp32 [rows*k/32], sums int32
    [rows*k/16], int8)``: fp32 rows, or int8 rows where ``a[4]``; ``tab``, ``lut``: the
    weight's table row (:func:`_table`) and ``formats.MXFP4_LUT``."""
    grp = tab[8]
    wt = np.empty(grp * RB, np.float32)
    acc = np.empty(rows * RB, np.float32)
    x, codes, scales, _, int8 = a
    for rb in range(rb0, rb1):
        acc[:] = 0.0
        for g in range(k // grp):
            _decode_block(w, k, tab, rb, g, wt, lut)
            for q in range(rows):
                base = q * k + g * grp
                for j in range(RB):
                    s = np.float32(0.0)
                    if int8:
                        dx = scales[(q * k + g * grp) // QK]
                        for i in range(grp):
                            s += wt[i * RB + j] * np.float32(codes[base + i])
                        s *= dx
                    else:
                        for i in range(grp):
                            s += wt[i * RB + j] * x[base + i]
                    acc[q * RB + j] += s
        for q in range(rows):
            for j in range(RB):
                c = rb * RB + j
                if c < n:
                    v = acc[q * RB + j]
                    out[q * out_rs + c] = v + to_f32(bias, b0 + c) if has_bias else v


# ---------------------------------------------------------------------------------------
# the kernel


@jit
def _qparts(buf, lay):
    """The quantised call's workspace buffers (``moe_workspace_plan(quantized=True)``)."""
    offsets = buf[lay[2] : lay[2] + lay[3]].view(np.int64)
    sorted_slots = buf[lay[4] : lay[4] + lay[5]].view(np.int64)
    slot_rows = buf[lay[6] : lay[6] + lay[7]].view(np.int64)
    items = buf[lay[8] : lay[8] + lay[9]].view(np.int64)
    act_buf = buf[lay[10] : lay[10] + lay[11]].view(np.float32)
    y_buf = buf[lay[12] : lay[12] + lay[13]].view(np.float32)
    xs = buf[lay[16] : lay[16] + lay[17]].view(np.float32)
    gate_up = buf[lay[18] : lay[18] + lay[19]].view(np.float32)
    codes = buf[lay[20] : lay[20] + lay[21]].view(np.int8)
    scales = buf[lay[22] : lay[22] + lay[23]].view(np.float32)
    sums = buf[lay[24] : lay[24] + lay[25]].view(np.int32)
    return offsets, sorted_slots, slot_rows, items, act_buf, y_buf, xs, gate_up, (
        codes, scales, sums)  # fmt: skip


@jit
def _list_items(offsets, e_n, per, items):
    """Work items ``expert * per + chunk`` of the experts that received tokens."""
    n = 0
    for e in range(e_n):
        if offsets[e + 1] > offsets[e]:
            for t in range(per):
                items[n] = e * per + t
                n += 1
    return n


@jit
def _rows_of(lo, hi, k, xs, codes, scales, sums, int8):
    """The activation tuple of sorted rows ``lo..hi-1`` (``_qgemm``'s ``a``)."""
    return (
        xs[lo * k : hi * k] if not int8 else xs[:0],
        codes[lo * k : hi * k],
        scales[lo * k // QK : hi * k // QK],
        sums[lo * k // QSUM : hi * k // QSUM],
        int8,
    )


@jit(parallel=True)
def _prepare(x, topk_ids, buf, lay, dims, int8):
    """Steps 1-2: the token sort, then each sorted row's input (``x [T*H]`` flat, the
    input dtype): int8 codes, scales and sums, or fp32 (``int8`` False). One variant per
    input dtype; the expert kernel has one for all."""
    t_n, e_n, k, h = dims[:4]
    offsets, sorted_slots, slot_rows, _, _, _, xs, _, qa = _qparts(buf, lay)
    codes, scales, sums = qa
    _sort_tokens(topk_ids, t_n, k, e_n, offsets, sorted_slots, slot_rows)
    for r in prange(t_n * k):
        src = (sorted_slots[r] // k) * h
        if int8:
            _quantize_row(x, src, h, codes, scales, sums, r)
        else:
            for c in range(h):
                xs[r * h + c] = to_f32(x, src + c)


@jit
def _round_to(v, mode, c_bf16, c_f16):
    """``v`` rounded to bf16 (``mode`` 1), fp16 (2) or kept (0), as fp32: the input
    dtype as a runtime int, so one kernel serves every dtype."""
    if mode == 1:
        return _round_like(v, c_bf16)
    if mode == 2:
        return _round_like(v, c_f16)
    return v


@jit(parallel=True)
def _experts(w13, w2, b13, b2, buf, lay, dims, flags, tab, lut):
    """Steps 3-5 on the sorted rows :func:`_prepare` wrote: w13 (+ bias), the activation
    rounded to the input dtype (and quantised again for int8), w2 (+ bias) into
    ``w2_output``. ``w13 [E, nbytes13]``, ``w2 [E, nbytes2]`` uint8; ``b13``, ``b2``
    fp32 flat (empty where absent); ``dims = (T, E, k, H, I, activation)``; ``flags =
    (has_b13, has_b2, int8, rounding mode of :func:`_round_to`)``; ``tab [2, 12]``: w13's
    and w2's table rows (:func:`_table`); ``lut``: ``formats.MXFP4_LUT``."""
    t_n, e_n, k, h, i_n, act = dims
    has_b13, has_b2, int8, mode = flags
    offsets, _, _, items, act_buf, y_buf, xs, gate_up, qa = _qparts(buf, lay)
    codes, scales, sums = qa
    tab13, tab2 = tab[0], tab[1]
    rows = t_n * k
    # w13: (expert, RB_ITEM row blocks) items -> gate_up [rows, 2I] fp32
    nrb13 = (2 * i_n + RB - 1) // RB
    per = (nrb13 + RB_ITEM - 1) // RB_ITEM
    n_items = _list_items(offsets, e_n, per, items)
    for q in prange(n_items):
        e = items[q] // per
        rb0 = (items[q] % per) * RB_ITEM
        lo, hi = offsets[e], offsets[e + 1]
        a = _rows_of(lo, hi, h, xs, codes, scales, sums, int8)
        _qgemm(w13[e], tab13, lut, 2 * i_n, h, rb0, min(rb0 + RB_ITEM, nrb13), a, hi - lo,
               gate_up[lo * 2 * i_n :], 2 * i_n, b13, e * 2 * i_n, has_b13)  # fmt: skip
    # activation, rounded to the input dtype; int8 again for w2 (16-bit x)
    swiglu = act == 3
    for r in prange(rows):
        c_bf16 = np.empty(1, np.uint16)
        c_f16 = np.empty(1, np.int16)
        for c in range(i_n):
            gi = 2 * c if swiglu else c
            ui = 2 * c + 1 if swiglu else i_n + c
            v = _activate(gate_up[r * 2 * i_n + gi], gate_up[r * 2 * i_n + ui], act)
            act_buf[r * i_n + c] = _round_to(v, mode, c_bf16, c_f16)
        if int8:
            _quantize_row(act_buf, r * i_n, i_n, codes, scales, sums, r)
    # w2: (expert, RB_ITEM row blocks of H) items -> y_buf [rows, H] fp32
    nrb2 = (h + RB - 1) // RB
    per = (nrb2 + RB_ITEM - 1) // RB_ITEM
    n_items = _list_items(offsets, e_n, per, items)
    for q in prange(n_items):
        e = items[q] // per
        rb0 = (items[q] % per) * RB_ITEM
        lo, hi = offsets[e], offsets[e + 1]
        a = _rows_of(lo, hi, i_n, act_buf, codes, scales, sums, int8)
        _qgemm(w2[e], tab2, lut, h, i_n, rb0, min(rb0 + RB_ITEM, nrb2), a, hi - lo,
               y_buf[lo * h :], h, b2, e * h, has_b2)  # fmt: skip


@jit(parallel=True)
def _combine(out, topk_w, buf, lay, dims, skip_weighted):
    """Step 6: ``out[t] = round(sum_j w[t, j] * y[slot(t, j)])`` in slot order (``out``
    flat, the input dtype)."""
    t_n, k, h = dims[0], dims[2], dims[3]
    _, _, slot_rows, _, _, y_buf, _, _, _ = _qparts(buf, lay)
    for t in prange(t_n):
        for c in range(h):
            acc = np.float32(0.0)
            for j in range(k):
                wgt = np.float32(1.0) if skip_weighted else topk_w[t, j]
                acc += wgt * y_buf[slot_rows[t * k + j] * h + c]
            store_f32(out, t * h + c, acc)


# ---------------------------------------------------------------------------------------
# the op


def is_quantized(w):
    """Whether ``w`` is a :class:`numkern.quant.QuantWeight` (not imported otherwise)."""
    return type(w).__name__ == "QuantWeight" and hasattr(w, "code")


def _table(w):
    """The kernel's table row of the quantised weight ``w`` ([E, N, K]): its section
    offsets (``formats.sections``: codes, high, d, m, sc, mn, nbytes), then bits, group,
    offset, kind, has_min (int64 [12])."""
    f = _formats()
    code, (n, k) = w.code, w.shape[1:]
    sec = [int(v) for v in f.sections.py_func(code, n, k)]
    return sec + [int(t[code]) for t in (f.BITS, f.GROUP, f.OFFSET, f.KIND, f.HAS_MIN)]


def check_fused_moe_quant(
    output, input, w13, w2, w13_bias, w2_bias, topk_weights, topk_ids, *,
    activation, skip_weighted,
):  # fmt: skip
    """:func:`fused_moe_quant`'s checks of everything but the ids' values; returns
    ``(dtype, T, H, E, I, k)``."""
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation: expected one of {tuple(ACTIVATIONS)}, got {activation!r}")
    dt = C.check_dtype("input", input, C.FLOATS)
    C.check_ndim("input", input, (2,))
    C.check_contiguous("input", input)
    t_n, h = input.shape
    C.check_same_dtype("output", output, dt, "input")
    C.check_shape("output", output, (t_n, h))
    C.check_contiguous("output", output)
    f = _formats()
    for name, w in (("w13", w13), ("w2", w2)):
        if not is_quantized(w):
            raise TypeError(f"{name}: expected a numkern.quant.QuantWeight (w13 is one), "
                            f"got {type(w).__name__}")  # fmt: skip
        if len(w.shape) != 3:
            raise ValueError(f"{name}: expected a 3-D [E, N, K] QuantWeight, got shape "
                             f"{list(w.shape)}")  # fmt: skip
    e_n, i2, h13 = w13.shape
    if h13 != h:
        raise ValueError(f"w13: expected shape [E, 2I, {h}] (H of input), got {list(w13.shape)}")
    if i2 % 2:
        raise ValueError(f"w13: expected an even 2I, got shape {list(w13.shape)}")
    i_n = i2 // 2
    if tuple(w2.shape) != (e_n, h, i_n):
        raise ValueError(f"w2: expected shape {[e_n, h, i_n]}, got {list(w2.shape)}")
    for name, w, kk in (("w13", w13, h), ("w2", w2, i_n)):
        blk = int(f.BLOCK[w.code])
        if kk % blk:
            raise ValueError(f"{name}: expected K a multiple of {blk} ({w.qtype}), got K={kk}")
    for name, b, shape in (("w13_bias", w13_bias, (e_n, i2)), ("w2_bias", w2_bias, (e_n, h))):
        if b is not None:
            C.check_dtype(name, b, tuple({torch.float32, dt}))
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


def fused_moe_quant(
    output, input, w13, w2, w13_bias, w2_bias, topk_weights, topk_ids, *,
    activation="silu", skip_weighted=False,
):  # fmt: skip
    """:func:`numkern.moe.fused_moe` with quantised experts (module docstring)."""
    dt, t_n, h, e_n, i_n, k = check_fused_moe_quant(
        output, input, w13, w2, w13_bias, w2_bias, topk_weights, topk_ids,
        activation=activation, skip_weighted=skip_weighted,
    )  # fmt: skip
    ids_t = C.as_torch(topk_ids)
    if t_n and k:
        lo, hi = int(ids_t.min()), int(ids_t.max())
        if lo < 0 or hi >= e_n:
            raise ValueError(f"topk_ids: expected expert ids in [0, {e_n}), got range [{lo}, {hi}]")
    if t_n == 0:
        return
    plan = moe_workspace_plan(t_n, k, e_n, h, i_n, dt, numba.get_num_threads(), quantized=True)
    buf, lay = workspace.take(plan)
    # biases reach the kernel as fp32 (one variant; the engine keeps them so, others pay
    # one conversion per call)
    empty = np.empty(0, np.float32)
    b13 = C.as_numpy(C.as_torch(w13_bias).float()).reshape(-1) if w13_bias is not None else empty
    b2 = C.as_numpy(C.as_torch(w2_bias).float()).reshape(-1) if w2_bias is not None else empty
    dims = (t_n, e_n, k, h, i_n, ACTIVATIONS[activation])
    int8 = dt != torch.float32
    _prepare(C.as_numpy(input).reshape(-1), C.as_numpy(ids_t), buf, lay, dims, int8)
    mode = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}[dt]
    _experts(
        C.as_numpy(w13.data).reshape(e_n, -1),
        C.as_numpy(w2.data).reshape(e_n, -1),
        b13,
        b2,
        buf,
        lay,
        dims,
        (w13_bias is not None, w2_bias is not None, int8, mode),
        np.array([_table(w13), _table(w2)], np.int64),
        _formats().MXFP4_LUT,
    )
    _combine(C.as_numpy(output).reshape(-1), C.as_numpy(topk_weights), buf, lay, dims,
             bool(skip_weighted))  # fmt: skip
