"""Fused MoE with quantised experts (docs/kernels.md §5.7): the bf16 op's routing, token
sort, activations, biases, combine and 64-bit workspace, with the two expert GEMMs on
weights kept in their quantised type, through ``numkern.quant``'s building blocks
(``quantize_rows``, ``qblocks``).

Layouts
-------
``w13``, ``w2``: :class:`numkern.quant.QuantWeight` of shape ``[E, 2I, H]`` and ``[E, H,
I]`` (``data`` uint8 ``[E, nbytes]``, one buffer per expert in numkern's quantised
layout, ``numkern.quant.formats``); any of ``numkern.quant.QUANT_TYPES``, the two may
differ. H must be a multiple of w13's GGML block (32, 256 for the K-quants), I of w2's.
w13's rows as the bf16 op's: gate rows ``0..I-1`` then up rows ``I..2I-1``, interleaved
(row ``2i`` gate i, ``2i+1`` up i) for ``swigluoai`` (GPT-OSS's own order).
``input``/``output [T, H]`` bf16, fp16 or fp32; biases fp32 or the input dtype (then
widened per call: keep them fp32).

Kernel
------
1. Sort (serial) as the bf16 op, then gather: each sorted row ``r`` (expert e's rows
   contiguous, token order kept) takes its token's input row widened to fp32.
2. Activations of the sorted rows for the GEMM (``quantize_rows``): on the int8 paths
   (16-bit inputs) int8 per 32 K (symmetric, ``amax / 127``), on the fp32 path (fp32
   inputs: never quantised) the fp32 rows and their sums.
3. w13, parallel over (expert, ``RB_ITEM`` row blocks of 16 rows) items of the experts
   with rows (``qblocks`` on the expert's contiguous rows): ``gate_up [rows, 2I]`` fp32
   (+ bias).
4. Activation, parallel over sorted rows: fp32, rounded to the input dtype (as the bf16
   op), then made the w2 GEMM's activations as in step 2.
5. w2, parallel over (expert, ``RB_ITEM`` row blocks of H) items into ``w2_output`` fp32
   (+ bias).
6. Combine: ``out[t] = round(sum_j w[t, j] * y[slot(t, j)])`` in slot order, one rounding.

Three kernels: :func:`_prepare` (1-2) and :func:`_combine` (6) compile per input dtype
(small bodies), :func:`_experts` (3-5) once per path (fp32, or this CPU's int8 path):
the input dtype (its rounding) and the weight types are runtime ints there. The per-row
steps run on the calling thread below ``SERIAL_MAX`` values, so a decode call enters two
parallel regions (w13's and w2's work items).

Accuracy: fp32 inputs as the fp32 product of the dequantised weights (fp32 summation
order apart); 16-bit inputs: the product of the dequantised weights with the int8
activations (docs/kernels.md §5.7 states the bound).
"""

import numba
import numpy as np
import torch
from numba import prange

from .. import _check as C
from .. import isa as _isa
from .._jit import jit
from ..quant import _kernels as qk
from ..quant import linear as qk_linear
from ..simd import store_f32, to_f32
from ..simd_int8 import path_witness
from .scratch import QROWS, moe_workspace_plan, part_of, workspace
from .steps import ACTIVATIONS, _activate, _round_like, _sort_tokens, check_ids, check_topk

RB = qk.R  # rows per row block of the quantised layout
# Row blocks per w13 / w2 work item: 4 row blocks = 64 output columns, so GPT-OSS-20B at
# T=1 (top-4, 2I = 5760, H = 2880) has 360 w13 and 180 w2 items for 2-16 threads.
RB_ITEM = QROWS // RB
QK = qk.QK  # K per int8 activation scale
ROUNDING = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}  # _round_to's modes


# ---------------------------------------------------------------------------------------
# the kernels


@jit
def _qparts(buf, lay):
    """The quantised call's workspace buffers (``moe_workspace_plan(quantized=True)``'s,
    by name)."""
    offsets = part_of(buf, lay.expert_offsets, _I64)
    sorted_slots = part_of(buf, lay.sorted_slots, _I64)
    slot_rows = part_of(buf, lay.slot_rows, _I64)
    items = part_of(buf, lay.work_items, _I64)
    act_buf = part_of(buf, lay.activation, _F32)
    y_buf = part_of(buf, lay.w2_output, _F32)
    xs = part_of(buf, lay.sorted_input, _F32)
    gate_up = part_of(buf, lay.gate_up, _F32)
    return offsets, sorted_slots, slot_rows, items, act_buf, y_buf, xs, gate_up


_I64, _F32 = np.empty(0, np.int64), np.empty(0, np.float32)
_I8, _I32 = np.empty(0, np.int8), np.empty(0, np.int32)


@jit
def _act_of(buf, lay, xf, wit):
    """``qblocks``' activation tuple over the workspace: int8 codes, scales and sums
    (int8 paths), or the fp32 rows ``xf`` themselves and their sums (fp32 path)."""
    return (
        part_of(buf, lay.act_codes, _I8),
        part_of(buf, lay.act_scales, _F32),
        part_of(buf, lay.act_sums, _I32),
        xf,
        part_of(buf, lay.act_fsums, _F32),
        wit,
    )


@jit
def _rows(act, lo, hi, k):
    """The activation tuple of rows ``lo .. hi-1`` of ``act`` (rows of ``k``)."""
    return (
        act[0][lo * k : hi * k],
        act[1][lo * (k // QK) : hi * (k // QK)],
        act[2][lo * (k // 16) : hi * (k // 16)],
        act[3][lo * k : hi * k],
        act[4][lo * (k // QK) : hi * (k // QK)],
        act[5],
    )


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


# Rows x K below which a per-row step (gather, quantise, activation, combine) runs on the
# calling thread: each parallel region costs ~6 us to start on a quiet machine (and a
# scheduler time slice when another process holds a core), a step of 64K values about as
# much serially; so a decode call enters two parallel regions, w13's and w2's.
SERIAL_MAX = qk_linear.QUANT_PARALLEL


@jit
def _gather_rows(x, r0, r1, k, h, sorted_slots, xs, act):
    """Sorted rows ``r0 .. r1-1``: their tokens' inputs widened into ``xs``, then made
    the GEMM activations ``act`` (``quantize_rows``)."""
    for r in range(r0, r1):
        src = (sorted_slots[r] // k) * h
        for c in range(h):
            xs[r * h + c] = to_f32(x, src + c)
    qk.quantize_rows(xs, h, h, r0, r1, act)


@jit(parallel=True)
def _prepare(x, topk_ids, buf, lay, dims, wit):
    """Steps 1-2: the token sort, then each sorted row's input (``x [T*H]`` flat, the
    input dtype) widened to fp32 into ``sorted_input`` and made w13's activations."""
    t_n, e_n, k, h = dims[:4]
    offsets, sorted_slots, slot_rows, _, _, _, xs, _ = _qparts(buf, lay)
    _sort_tokens(topk_ids, t_n, k, e_n, offsets, sorted_slots, slot_rows)
    act = _act_of(buf, lay, xs, wit)  # the fp32 path's rows are xs itself
    rows = offsets[e_n]  # T*k less the slots of id -1
    if rows * h < SERIAL_MAX:
        _gather_rows(x, 0, rows, k, h, sorted_slots, xs, act)
    else:
        for r in prange(rows):
            i = np.int64(r)  # (int64 in and out of the parallel body: one signature)
            _gather_rows(x, i, i + 1, k, h, sorted_slots, xs, act)


@jit
def _round_to(v, mode, c_bf16, c_f16):
    """``v`` rounded to bf16 (``mode`` 1), fp16 (2) or kept (0), as fp32: the input
    dtype as a runtime int, so one kernel serves every dtype."""
    if mode == 1:
        return _round_like(v, c_bf16)
    if mode == 2:
        return _round_like(v, c_f16)
    return v


@jit
def _activation_rows(r0, r1, i_n, act, mode, gate_up, act_buf, a2):
    """Sorted rows ``r0 .. r1-1``: ``act(gate, up)`` rounded to the input dtype
    (``mode``), then made w2's activations ``a2``."""
    swiglu = act == 3
    c_bf16 = np.empty(1, np.uint16)
    c_f16 = np.empty(1, np.int16)
    for r in range(r0, r1):
        for c in range(i_n):
            gi = 2 * c if swiglu else c
            ui = 2 * c + 1 if swiglu else i_n + c
            v = _activate(gate_up[r * 2 * i_n + gi], gate_up[r * 2 * i_n + ui], act)
            act_buf[r * i_n + c] = _round_to(v, mode, c_bf16, c_f16)
    qk.quantize_rows(act_buf, i_n, i_n, r0, r1, a2)


@jit
def _gemm_item(w, code, n, k, act, offsets, item, per, out, bias, has_bias):
    """``out[r, :n] = act[r] @ w[e].T (+ bias[e])`` for the sorted rows ``r`` of work
    item ``item``'s expert ``e``, over the item's ``RB_ITEM`` row blocks."""
    e = item // per
    rb0 = (item % per) * RB_ITEM
    lo, hi = offsets[e], offsets[e + 1]
    b = bias[e * n : (e + 1) * n] if has_bias else bias
    rb1 = min(rb0 + RB_ITEM, (n + RB - 1) // RB)
    qk.qblocks(out[lo * n :], n, _rows(act, lo, hi, k), w[e], code, hi - lo, n, k, rb0, rb1,
               b, has_bias)  # fmt: skip


@jit(parallel=True)
def _experts(w13, w2, b13, b2, buf, lay, dims, flags, wit):
    """Steps 3-5 on the activations :func:`_prepare` made: w13 (+ bias), the activation
    rounded to the input dtype, w2 (+ bias) into ``w2_output``. ``w13 [E, nbytes13]``,
    ``w2 [E, nbytes2]`` uint8; ``b13``, ``b2`` fp32 flat (empty where absent); ``dims =
    (T, E, k, H, I, activation)``; ``flags = (code13, code2, has_b13, has_b2, rounding
    mode of :func:`_round_to`)``; ``wit``: the path witness (``PATH_WITNESS``)."""
    _, e_n, _, h, i_n, act = dims
    code13, code2, has_b13, has_b2, mode = flags
    offsets, _, _, items, act_buf, y_buf, xs, gate_up = _qparts(buf, lay)
    rows = offsets[e_n]  # T*k less the slots of id -1
    a13 = _act_of(buf, lay, xs, wit)
    per = ((2 * i_n + RB - 1) // RB + RB_ITEM - 1) // RB_ITEM
    n_items = _list_items(offsets, e_n, per, items)
    for q in prange(n_items):
        _gemm_item(w13, code13, 2 * i_n, h, a13, offsets, items[q], per, gate_up, b13, has_b13)
    a2 = _act_of(buf, lay, act_buf, wit)
    if rows * i_n < SERIAL_MAX:
        _activation_rows(0, rows, i_n, act, mode, gate_up, act_buf, a2)
    else:
        for r in prange(rows):
            i = np.int64(r)
            _activation_rows(i, i + 1, i_n, act, mode, gate_up, act_buf, a2)
    per = ((h + RB - 1) // RB + RB_ITEM - 1) // RB_ITEM
    n_items = _list_items(offsets, e_n, per, items)
    for q in prange(n_items):
        _gemm_item(w2, code2, h, i_n, a2, offsets, items[q], per, y_buf, b2, has_b2)


@jit
def _combine_rows(out, topk_w, t0, t1, k, h, slot_rows, y_buf, skip_weighted):
    for t in range(t0, t1):
        for c in range(h):
            acc = np.float32(0.0)
            for j in range(k):
                r = slot_rows[t * k + j]
                if r < 0:  # id -1: no expert on this rank
                    continue
                wgt = np.float32(1.0) if skip_weighted else topk_w[t, j]
                acc += wgt * y_buf[r * h + c]
            store_f32(out, t * h + c, acc)


@jit(parallel=True)
def _combine(out, topk_w, buf, lay, dims, skip_weighted):
    """Step 6: ``out[t] = round(sum_j w[t, j] * y[slot(t, j)])`` in slot order (``out``
    flat, the input dtype)."""
    t_n, k, h = dims[0], dims[2], dims[3]
    _, _, slot_rows, _, _, y_buf, _, _ = _qparts(buf, lay)
    if t_n * k * h < SERIAL_MAX:
        _combine_rows(out, topk_w, 0, t_n, k, h, slot_rows, y_buf, skip_weighted)
    else:
        for t in prange(t_n):
            i = np.int64(t)
            _combine_rows(out, topk_w, i, i + 1, k, h, slot_rows, y_buf, skip_weighted)


# ---------------------------------------------------------------------------------------
# the op


def is_quantized(w):
    """Whether ``w`` is a :class:`numkern.quant.QuantWeight` (not imported otherwise)."""
    return type(w).__name__ == "QuantWeight" and hasattr(w, "code")


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
    from ..quant import formats as f

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
    k = check_topk(topk_weights, topk_ids, t_n, skip_weighted)
    return dt, t_n, h, e_n, i_n, k


def fused_moe_quant(
    output, input, w13, w2, w13_bias, w2_bias, topk_weights, topk_ids, *,
    activation="silu", skip_weighted=False, path=None,
):  # fmt: skip
    """:func:`numkern.moe.fused_moe` with quantised experts (module docstring).

    ``path``: as ``numkern.quant.quant_linear``'s: None (fp32 input: ``"fp32"``; 16-bit:
    this CPU's int8 path, ``isa.quant_path()``) or one of ``isa.QUANT_PATHS`` this CPU
    runs; an int8 path with fp32 input is a ValueError (never quantised)."""
    dt, t_n, h, e_n, i_n, k = check_fused_moe_quant(
        output, input, w13, w2, w13_bias, w2_bias, topk_weights, topk_ids,
        activation=activation, skip_weighted=skip_weighted,
    )  # fmt: skip
    if path is None:
        path = "fp32" if dt == torch.float32 else _QUANT_DEFAULT
    else:
        path = _isa.check_quant_path(path)
        if path != "fp32" and dt == torch.float32:
            raise ValueError(
                f"path: expected None or 'fp32' for float32 input (fp32 activations are "
                f"never quantised), got {path!r}"
            )
    ids_t = C.as_torch(topk_ids)
    check_ids(ids_t, t_n, k, e_n)
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
    wit = path_witness(path)
    _prepare(C.as_numpy(input).reshape(-1), C.as_numpy(ids_t), buf, lay, dims, wit)
    _experts(
        C.as_numpy(w13.data).reshape(e_n, -1),
        C.as_numpy(w2.data).reshape(e_n, -1),
        b13,
        b2,
        buf,
        lay,
        dims,
        (int(w13.code), int(w2.code), w13_bias is not None, w2_bias is not None, ROUNDING[dt]),
        wit,
    )
    _combine(C.as_numpy(output).reshape(-1), C.as_numpy(topk_weights), buf, lay, dims,
             bool(skip_weighted))  # fmt: skip


_QUANT_DEFAULT = _isa.quant_path()[0]
