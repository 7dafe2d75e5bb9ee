"""The decoder's layer body: the Numba kernels of a run (docs/kernels.md, "The decoder
run").

:func:`_run` runs layers ``l0..l1`` of one step in one parallel region: each thread is a
:func:`_worker` that walks the phases of :mod:`numkern.decoder.phases` in order (per
layer :func:`_attention_half`, then the dense MLP; then the head) and takes each phase's
units from shared counters. A decode step of a small model is ~20 kernels per layer;
issued from Python each costs 10-30 us of wrapper and tensor plumbing, and a fork-join
region per kernel ~5-10 us (~150 per SmolLM2 token): hence one region.

* GEMM arithmetic is :mod:`numkern.gemm`'s, by block (:func:`_gemm`): the widening tiles,
  or for a bf16 model where ``gemm.PATH`` is ``dpbf16`` and M >= ``gemm.DP_MIN_M`` (every
  M on a Zen 4 EPYC, else a prefill) its ``vdpbf16ps`` blocks on the bf16 activations as
  they are (2x the widening tiles at M = 16-128 there). The path is a compile-time
  witness (``_blocks``).
* Inputs reach the kernel as named tuples (``_Stream``, ``_Work``, ``_Model``,
  ``_Cache``, ``_Tokens``, the plan's :class:`~numkern.attention.kernels.StepArrays`,
  ``Scores``, ``_Head``, ``_Schedule``) and one record array of per-layer addresses
  (:data:`LAYER`): Numba caches kernels taking module-level named tuples and records on
  disk, and a call costs ~1 us more than with flat arguments. They are kernel plumbing,
  built by :class:`numkern.decoder.DecoderStack`; no caller builds one.
"""

import math
from typing import NamedTuple

import numpy as np
import torch
from numba import prange, types
from numba.extending import overload

from .. import norm, rope
from .._jit import jit
from .._ptr import view
from .._tiles import geometry
from ..attention.kernels import RowStrides, Scores, cache_write, item, merge
from ..gemm import NB, _widen_rows, blocks, takes_dp, takes_tiles
from ..moe import GELU_TANH_C
from ..moe import _activate as activate
from ..quant._kernels import weight_bytes
from ..simd import (
    fetch_add,
    prefetch,
    store_f32,
    to_f32,
    vadd,
    vdiv,
    vexp,
    vload,
    vmul,
    vsplat,
    vstore,
    vtanh,
)
from .phases import (
    CHUNKS_PER_WORKER,
    GEMM_UNITS,
    N_HEAD,
    N_PHASE,
    P_ACT,
    P_ADD1,
    P_ADD2,
    P_ATTN,
    P_DOWN,
    P_GATE,
    P_GU,
    P_MERGE,
    P_O,
    P_QKV,
    P_ROPE,
    WIDEN_UNIT,
    _next,
    _share,
    _wait,
)
from .qgemm import _act, _qgemm


class LayerWeights(NamedTuple):
    """One decoder layer's tensors (contiguous CPU tensors; ``H`` hidden size, ``D`` head
    dim, ``I`` the MLP's intermediate size). Each projection (``qkv``, ``o``, ``gate_up``,
    ``down``) may instead be a :class:`numkern.quant.QuantWeight` of the same shape: it
    then runs through numkern.quant's blocks (``qgemm._qgemm``)."""

    input_norm: torch.Tensor  # fp32 [H]
    # packed [(Hq + 2 Hkv) D, H], the model dtype: q rows, k rows, v rows (then Hq D gate
    # rows with DecoderStack's attn_output_gate)
    qkv: torch.Tensor
    o: torch.Tensor  # packed [H, Hq D]
    post_norm: torch.Tensor  # fp32 [H]
    gate_up: torch.Tensor | None = None  # packed [2 I, H]: gate rows, then up rows
    down: torch.Tensor | None = None  # packed [H, I]; both None: the MLP runs outside (MoE)
    qkv_bias: torch.Tensor | None = None  # fp32, one per qkv row
    o_bias: torch.Tensor | None = None  # fp32 [H]
    q_norm: torch.Tensor | None = None  # fp32 [D]: per-head RMS norm of q (Qwen3)
    k_norm: torch.Tensor | None = None  # fp32 [D]
    sinks: torch.Tensor | None = None  # fp32 [Hq]: attention sink logits (GPT-OSS)
    # "sandwich" norms (Gemma 2/3): the attention output and the MLP output are normed
    # before their residual adds; post_norm is then the norm before the MLP
    post_attn_norm: torch.Tensor | None = None  # fp32 [H]
    post_mlp_norm: torch.Tensor | None = None  # fp32 [H], dense layers only


# the projections that may be a numkern.quant.QuantWeight
QUANTISABLE = ("qkv", "o", "gate_up", "down")
# the kernel's table of a layer's addresses (0: absent): its tensors, then its KV cache,
# then each projection's type (0: packed in the model dtype; numkern.quant's code + 1)
LAYER = np.dtype(
    [
        (name, np.int64)
        for name in (*LayerWeights._fields, "k_cache", "v_cache", *(f"{q}_q" for q in QUANTISABLE))
    ]
)


# -- the kernel's inputs (plumbing: DecoderStack builds them) ------------------------------


class _Stream(NamedTuple):
    h: np.ndarray  # the residual stream [T * H], updated in place
    add: np.ndarray  # [T * H] added to h before the first layer (an MoE's output) or empty
    has_add: bool
    t_n: int
    # the address of an fp32 [H] norm applied to add's rows before the add (0: none): the
    # sandwich norm after the reduced o or down of a partial stack (DecoderStack.partial)
    add_norm: int
    start_mlp: bool  # the run starts at layer l0's MLP half (its mixer ran before)
    # a partial stack's run of one half layer: it ends with that half's o or down
    # projection, written to work.x, without the residual add
    reduce: bool


class _Work(NamedTuple):  # the step's workspaces in the model dtype
    x: np.ndarray  # [T, H] normed rows: the GEMMs' input; the MoE's input at the end
    qkv: np.ndarray  # [T, (Hq + 2 Hkv) D] (+ Hq D gate columns: _qkv_width)
    att: np.ndarray  # [T, Hq D]
    tmp: np.ndarray  # [T, H] o and down outputs
    gu: np.ndarray  # [T, 2 I]
    act: np.ndarray  # [T, I]


class _Model(NamedTuple):
    hidden: int
    inter: int
    eps: float
    rot: int  # rotary dims of each head
    is_neox: bool
    w_wit: np.ndarray  # the packed weights' carrier (16-bit as K pairs), empty
    act: int  # the dense MLP's activation (ACTIVATIONS)
    logit_softcap: float  # 0: none
    attn_gate: bool  # att *= sigmoid(gate) before o (Qwen3-Next's attn_output_gate)
    gemm_path: np.ndarray  # the GEMMs' path witness (gemm.GEMM_WITNESS), empty
    # empty: numkern.quant's path witness when a weight is quantised (the variant holds
    # its blocks: _linear), bool when none is
    quant: np.ndarray


class _Cache(NamedTuple):
    w_wit: np.ndarray  # the carrier the cache is written in (16-bit elements), empty
    r_wit: np.ndarray  # the carrier attention reads (bf16 pairs for amx), empty
    length: int  # elements of one layer's key (or value) span


class _Tokens(NamedTuple):
    pos: np.ndarray  # int64 [T]
    cos_sin: np.ndarray  # fp32 [P, rot]: cos, then sin
    slots: np.ndarray  # int64 [T], from the plan


class _Head(NamedTuple):
    rows: np.ndarray  # int64 [R]: the token rows whose logits are wanted (empty: no head)
    norm: np.ndarray  # fp32 [H]
    w: np.ndarray  # packed [vocab, H] in the carrier (or empty)
    qw: np.ndarray  # uint8: the quantised head's buffer (or empty)
    qt: int  # the head's type: 0 packed, else numkern.quant's code + 1
    y: np.ndarray  # [R, H] workspace
    lg: np.ndarray  # [R, vocab] in the model dtype
    logits: np.ndarray  # fp32 [R * vocab]
    vocab: int


class _Schedule(NamedTuple):
    workers: int
    shared_from: int  # GEMM inputs of this many elements or more are widened together
    # int64 [phases of the longest run]: each phase's done count after a run (_run
    # copies it out once at the end: DecoderStep.phase_units, what tests read)
    units: np.ndarray


@jit
def _gemm(out, x, w, bias, has_bias, m, n, k, g, pf, ctx):
    """Phases ``g``, ``g + 1``: ``out[m, n] = x[m, k] @ W.T (+ bias)``, prefetching ``pf``
    while waiting for the others' chunks (see ``_wait``).

    ``ctx = (xf, xs, (ctr, done, flags), me, nw, shared_from, path, qa, qs)``: the
    worker's context (``qa``, ``qs``: the quantised GEMMs' activation scratches,
    ``qgemm._qgemm``). Activations are widened to fp32 once: small ones (decode) by each worker
    that computes, into its ``xf``, without a wait; from ``shared_from`` elements (a
    prefill chunk: widening 2 x T x K per GEMM cost 2-3% of a 512-token prefill) by all
    workers into the shared ``xs`` in phase ``g``. Blocks that take vdpbf16ps (``path``,
    see ``gemm.blocks``) read the bf16 activations as they are: nothing is widened, and phase
    ``g`` has no units (every worker still passes it). ``flags[(g + 1) * nw * GEMM_UNITS +
    c]`` claims chunk c of phase ``g + 1``.
    """
    xf, xs, ph, me, nw, shared_from, path, _, _ = ctx
    ctr, done, flags = ph
    dp = takes_tiles(path, x, w, m) or takes_dp(path, x, w, m)  # nothing widened
    shared = m * k >= shared_from
    if shared:
        rows_per = max(1, m // (nw * 4))
        n_units = 0 if dp else (m + rows_per - 1) // rows_per
        c = _next(ctr, done, g, False)
        while c < n_units:
            _widen_rows(x, k, xs, k, c * rows_per, min(m, (c + 1) * rows_per))
            c = _next(ctr, done, g, True)
        _wait(done, g, n_units, pf)
        src = xs
    else:
        src = xf
    g += 1
    ku, kstep, rstep = geometry(w, k, NB)  # K pairs (uint32/int32) or fp32 rows of K
    nblk = (n + NB - 1) // NB
    per = max(1, nblk // (nw * CHUNKS_PER_WORKER))  # blocks per chunk
    nch = (nblk + per - 1) // per  # <= nw * GEMM_UNITS
    c0 = me * nch // nw
    c1 = (me + 1) * nch // nw
    f0 = g * nw * GEMM_UNITS
    widened = False
    own = c1 - c0
    for i in range(nch):
        # own share forward, then the others' chunks from the end: [c1, nch), [0, c0)
        j = i - own
        if j < 0:
            c = c0 + i
        elif j < nch - c1:
            c = nch - 1 - j
        else:
            c = c0 - 1 - (j - (nch - c1))
        if fetch_add(flags, f0 + c, 1):
            continue
        if not (widened or shared or dp):  # activations widened by each worker that computes
            _widen_rows(x, k, xf, k, 0, m)
            widened = True
        b0, b1 = c * per, min(nblk, (c + 1) * per)
        geo = (ku, kstep, rstep)
        blocks(path, dp, out, n, src, x, k, w, geo, bias, has_bias, (m, n, k), b0, b1)
        fetch_add(done, g, 1)
    _wait(done, g, nch, pf)


def _quantised(quant):
    """Whether the variant holds numkern.quant's blocks: ``_Model.quant`` is a path
    witness of ``numkern.simd_int8.PATH_WITNESS``, not the bool one of no quantised weight."""
    return quant.dtype != types.boolean


def _linear(quant, out, x, w, qt, bias, has_bias, m, n, k, g, pf, ctx):
    """``_gemm`` on the packed weight ``w[0]`` (``qt`` 0), else ``qgemm._qgemm`` on the
    quantised ``w[1]`` of numkern.quant's code ``qt - 1``; ``w`` from :func:`_weight`.
    Only a variant whose ``quant`` witness is a path's holds ``_qgemm``: a model without a
    quantised weight compiles what it did before. A cold compile of a bf16 stack's kernel
    took 123 s of CPU with quantised weights (vnni512: qblocks' every type in one body)
    against 82-92 s without (AMD EPYC Zen 4 VM, 2 vCPUs, other jobs running)."""


@overload(_linear, inline="always")
def _linear_impl(quant, out, x, w, qt, bias, has_bias, m, n, k, g, pf, ctx):
    if _quantised(quant):

        def impl(quant, out, x, w, qt, bias, has_bias, m, n, k, g, pf, ctx):
            if qt != 0:
                _qgemm(out, x, w[1], qt - 1, bias, has_bias, m, n, k, g, pf, ctx)
            else:
                _gemm(out, x, w[0], bias, has_bias, m, n, k, g, pf, ctx)

        return impl

    def impl(quant, out, x, w, qt, bias, has_bias, m, n, k, g, pf, ctx):
        _gemm(out, x, w[0], bias, has_bias, m, n, k, g, pf, ctx)

    return impl


def _scratch(quant, m, k):
    """The activation scratch of a quantised GEMM of ``m`` rows of ``k`` (a variant
    without quantised weights: an empty array it never reads)."""


@overload(_scratch, inline="always")
def _scratch_impl(quant, m, k):
    if _quantised(quant):
        return lambda quant, m, k: _act(m, k, quant)
    return lambda quant, m, k: np.zeros(0, np.float32)


@jit
def _weight(addr, qt, n, k, model, wdiv):
    """The weight at ``addr`` (``n`` output columns of ``k``) as ``(packed, quantised,
    bytes)``: the packed view in the carrier (``qt`` 0) or numkern.quant's buffer, the
    other one empty; and all of its bytes (what a waiting worker prefetches)."""
    u8 = np.zeros(0, np.uint8)
    if addr == 0:
        return view(addr, 0, model.w_wit), u8, u8
    if qt == 0:
        nbytes = n * k // wdiv * model.w_wit.itemsize
        return view(addr, n * k // wdiv, model.w_wit), u8, view(addr, nbytes, u8)
    nbytes = weight_bytes(addr, qt - 1, n, k)
    wq = view(addr, nbytes, u8)
    return view(addr, 0, model.w_wit), wq, wq


# Bytes of the next layer's K/V a worker prefetches during this layer's MLP (_prefetch_kv):
# a decode step's attention reads its K/V at DRAM latency (a 32-key tile 1.1-1.5 us from
# DRAM against 0.57 us from L3, issue 30); the prefetches read it at the stream's rate
# while the MLP's weights stream. Capped so a long context does not evict what the MLP
# is reading (a worker's 2 MB L2 on the Zen 4 EPYC).
KV_PREFETCH = 1 << 20


@jit
def _prefetch_kv(a, step, cache, layout, hd, me, nw):
    """Prefetch worker ``me``'s share (by (block, kv head), round robin) of the K and V
    rows layer ``a`` will read in this step (each request's blocks up to its length; the
    whole block with the amx layout), at most KV_PREFETCH bytes. A hint: no result
    depends on it (prefetches never fault)."""
    if a.k_cache == 0:
        return
    kv = view(a.k_cache, cache.length, cache.w_wit)
    vv = view(a.v_cache, cache.length, cache.w_wit)
    b, d = layout.block_size, hd.head_dim
    line = 64 // cache.w_wit.itemsize
    budget = KV_PREFETCH // cache.w_wit.itemsize
    bt = step.block_table
    u = 0
    for r in range(step.seq_lens.shape[0]):
        n_keys = np.int64(step.seq_lens[r])
        for j in range((n_keys + b - 1) // b):
            blk = np.int64(bt[r, j])
            if blk < 0:  # freed behind a sliding window
                continue
            rows = b if layout.amx else min(b, n_keys - j * b)
            for hh in range(hd.num_kv_heads):
                u += 1
                if u % nw != me:
                    continue
                if budget <= 0:
                    return
                k0 = blk * layout.k_block + hh * layout.k_head
                v0 = blk * layout.v_block + hh * layout.v_head
                for i in range(0, rows * d, line):
                    prefetch(kv, k0 + i)
                    prefetch(vv, v0 + i)
                budget -= 2 * rows * d


@jit
def _act_mul_rows(gu, act, t0, t1, inter, kind):
    """``act = f(g) * u`` for rows ``[g | u]`` of ``gu``, in fp32, rounded once; ``f``
    is SiLU (``kind`` 0) or tanh-approximated GELU (2), as ``numkern.moe``'s."""
    one = vsplat(1.0)
    half = vsplat(0.5)
    nv = inter - inter % 16
    for t in range(t0, t1):
        o = t * 2 * inter
        for i in range(0, nv, 16):
            g = vload(gu, o + i)
            if kind == 0:
                f = vdiv(g, vadd(one, vexp(vmul(g, vsplat(-1.0)))))
            else:
                inner = vmul(g, vadd(one, vmul(vsplat(0.044715), vmul(g, g))))
                f = vmul(vmul(half, g), vadd(one, vtanh(vmul(vsplat(GELU_TANH_C), inner))))
            vstore(act, t * inter + i, vmul(f, vload(gu, o + inter + i)))
        for i in range(nv, inter):
            store_f32(
                act, t * inter + i, activate(to_f32(gu, o + i), to_f32(gu, o + inter + i), kind)
            )


@jit
def _gate_rows(qkv, att, t0, t1, nq, row):
    """``att *= sigmoid(gate)`` for rows t0..t1 of ``att [T, nq]``, the gate being the last
    ``nq`` columns of each ``qkv`` row (stride ``row``). As HF's ``attn_output *
    torch.sigmoid(gate)`` in the model dtype: the sigmoid is rounded (stored over the gate,
    which nothing reads after this), then the product."""
    one = vsplat(1.0)
    minus = vsplat(-1.0)
    nv = nq - nq % 16
    for t in range(t0, t1):
        go = t * row + row - nq
        ao = t * nq
        for i in range(0, nv, 16):
            vstore(qkv, go + i, vdiv(one, vadd(one, vexp(vmul(vload(qkv, go + i), minus)))))
            vstore(att, ao + i, vmul(vload(att, ao + i), vload(qkv, go + i)))
        for i in range(nv, nq):
            store_f32(qkv, go + i, 1.0 / (1.0 + math.exp(-to_f32(qkv, go + i))))
            store_f32(att, ao + i, to_f32(att, ao + i) * to_f32(qkv, go + i))


@jit
def _qkv_width(model, hd):
    """Columns of a qkv row: the q, k and v heads, then with the output gate Hq D more."""
    nq = hd.num_heads * hd.head_dim
    return nq + 2 * hd.num_kv_heads * hd.head_dim + (nq if model.attn_gate else 0)


@jit
def _qkv_rows(qkv, t0, t1, qn, kn, has_qk_norm, model, hd, tok, kw, vw, layout):
    """Rows t0..t1 of ``qkv [T, _qkv_width]``: q/k head norms (Qwen3), rotary of the q
    and k heads (adjacent), and the cache write of k and v straight from the rows."""
    d = hd.head_dim
    nq = hd.num_heads * d
    nqkv = _qkv_width(model, hd)
    if has_qk_norm:  # per-head RMS norm of q and k, in place
        for t in range(t0, t1):
            for hh in range(hd.num_heads):
                o = t * nqkv + hh * d
                norm._rows(qkv[o : o + d], qn, qkv[o : o + d], 0, 1, d, model.eps)
            for hh in range(hd.num_kv_heads):
                o = t * nqkv + nq + hh * d
                norm._rows(qkv[o : o + d], kn, qkv[o : o + d], 0, 1, d, model.eps)
    heads = hd.num_heads + hd.num_kv_heads
    rope._rows(qkv, tok.pos, tok.cos_sin, t0, t1, heads, d, model.rot, nqkv, model.is_neox)
    o = t0 * nqkv + nq
    key = qkv[o:]
    value = qkv[o + hd.num_kv_heads * d :]
    cache_write(key, value, nqkv, d, nqkv, d, kw, vw, tok.slots[t0:t1], t1 - t0, hd, layout)


@jit
def _add_phase(y, h, x, y_norm, ln, has_ln, rows, model, g, ph, pf):
    """Phase ``g``, by row units: ``y = norm(y)`` with the weights at address ``y_norm``
    (a sandwich norm; 0: none), ``h += y``, then ``x = ln(h)`` when ``has_ln``; waits for
    every unit, prefetching ``pf``."""
    ctr, done, _ = ph
    t_n, rows_per = rows
    n_rows = (t_n + rows_per - 1) // rows_per
    hid, eps = model.hidden, model.eps
    yn = view(y_norm, hid if y_norm != 0 else 0, np.zeros(0, np.float32))
    c = _next(ctr, done, g, False)
    while c < n_rows:
        r0, r1 = c * rows_per, min(t_n, (c + 1) * rows_per)
        if y_norm != 0:
            norm._rows(y, yn, y, r0, r1, hid, eps)
        norm._add_rows(y, h, ln, x, r0, r1, hid, eps, has_ln)
        c = _next(ctr, done, g, True)
    _wait(done, g, n_rows, pf)


@jit
def _attention_half(
    a, g, h, work, rows, model, hd, cache, layout, tok, step, scores, pf_gu, ctx, reduce
):
    """Layer ``a``'s attention half, phases ``g + P_QKV`` to ``g + P_ADD1``: qkv, the q/k
    norms, rotary and the cache write, attention and the merges, the output gate (when
    ``model.attn_gate``), o, then ``h += [post_attn_norm](o)`` and ``x = post_norm(h)``;
    with ``reduce`` (a partial stack) o is written to ``x`` and the half ends there.
    ``rows = (T, rows per unit)``; ``pf_gu``: what a waiting worker prefetches at the end
    (the MLP's weight)."""
    _, _, ph, me, nw, _, _, _, _ = ctx
    ctr, done, _ = ph
    x, qkv, att, tmp, _, _ = work
    t_n, rows_per = rows
    n_rows = (t_n + rows_per - 1) // rows_per
    f32 = np.zeros(0, np.float32)
    hid, w_wit = model.hidden, model.w_wit
    d = hd.head_dim
    nq = hd.num_heads * d
    nqkv = _qkv_width(model, hd)
    wdiv = 1 if w_wit.itemsize == h.itemsize else 2  # 16-bit weights travel as K pairs
    rdiv = cache.r_wit.itemsize // cache.w_wit.itemsize
    rows_qkv = RowStrides(nqkv, d, nq, d)
    n_it = step.items.shape[0]
    n_mg = step.merges.shape[0]
    w_qkv = _weight(a.qkv, a.qkv_q, nqkv, hid, model, wdiv)
    w_o = _weight(a.o, a.o_q, hid, nq, model, wdiv)
    pf_o = _share(w_o[2], hid, me, nw)
    has_b_qkv = a.qkv_bias != 0
    b_qkv = view(a.qkv_bias, nqkv if has_b_qkv else 0, f32)
    q = model.quant
    _linear(q, qkv, x, w_qkv, a.qkv_q, b_qkv, has_b_qkv, t_n, nqkv, hid, g + P_QKV, pf_o, ctx)
    has_qk_norm = a.q_norm != 0
    qn = view(a.q_norm, d if has_qk_norm else 0, f32)
    kn = view(a.k_norm, d if has_qk_norm else 0, f32)
    kw = view(a.k_cache, cache.length, cache.w_wit)
    vw = view(a.v_cache, cache.length, cache.w_wit)
    c = _next(ctr, done, g + P_ROPE, False)
    while c < n_rows:
        r0, r1 = c * rows_per, min(t_n, (c + 1) * rows_per)
        _qkv_rows(qkv, r0, r1, qn, kn, has_qk_norm, model, hd, tok, kw, vw, layout)
        c = _next(ctr, done, g + P_ROPE, True)
    _wait(done, g + P_ROPE, n_rows, pf_o)
    kr = view(a.k_cache, cache.length // rdiv, cache.r_wit)
    vr = view(a.v_cache, cache.length // rdiv, cache.r_wit)
    sc = scores
    if a.sinks != 0:  # this layer's sink logits
        sinks = view(a.sinks, hd.num_heads, f32)
        sc = Scores(
            scores.scale, scores.causal, scores.window, scores.softcap, f32, False, sinks, True,
            scores.tiles,
        )  # fmt: skip
    it = _next(ctr, done, g + P_ATTN, False)
    while it < n_it:
        item(it, step, qkv, att, rows_qkv, kr, vr, layout, hd, sc)
        it = _next(ctr, done, g + P_ATTN, True)
    _wait(done, g + P_ATTN, n_it, pf_o)
    mg = _next(ctr, done, g + P_MERGE, False)
    while mg < n_mg:
        merge(mg, step, att, rows_qkv, hd, sc)
        mg = _next(ctr, done, g + P_MERGE, True)
    _wait(done, g + P_MERGE, n_mg, pf_o)
    if model.attn_gate:
        c = _next(ctr, done, g + P_GATE, False)
        while c < n_rows:
            _gate_rows(qkv, att, c * rows_per, min(t_n, (c + 1) * rows_per), nq, nqkv)
            c = _next(ctr, done, g + P_GATE, True)
        _wait(done, g + P_GATE, n_rows, pf_o)
    has_b_o = a.o_bias != 0
    b_o = view(a.o_bias, hid if has_b_o else 0, f32)
    o_out = x if reduce else tmp
    _linear(q, o_out, att, w_o, a.o_q, b_o, has_b_o, t_n, hid, nq, g + P_O, pf_gu, ctx)
    if reduce:
        return
    ln2 = view(a.post_norm, hid, f32)
    _add_phase(tmp, h, x, a.post_attn_norm, ln2, True, rows, model, g + P_ADD1, ph, pf_gu)


@jit(parallel=True)
def _run(
    st, work, model, heads, table, l0, l1, cache, layout, tok, step, scores, head, schedule, qs
):
    """Layers ``l0..l1`` of one step on the residual stream ``st.h`` (module docstring):
    the phase counters and the shared widening buffer, then ``schedule.workers`` workers.

    Layers before ``l1 - 1`` have a dense MLP; when ``l1 - 1`` has none (its
    ``gate_up`` address is 0), the call ends with ``work.x = post_norm(h)``. With
    ``head.rows`` non-empty the call ends with the logits of those rows. ``qs``: the
    quantised GEMMs' shared activations (numkern.quant's ``QAct`` of T rows of the widest
    K, none below ``shared_from``; made by ``DecoderStack.prepare``, an argument: Numba's
    parallel body takes a named tuple only from the arguments, not made here nor nested),
    or an empty array without quantised weights.
    """
    nw = schedule.workers
    phases = 1 + (l1 - l0) * N_PHASE + N_HEAD
    ph = (
        np.zeros(phases, np.int64),
        np.zeros(phases, np.int64),
        np.zeros(phases * nw * GEMM_UNITS, np.int64),
    )
    nq = heads.num_heads * heads.head_dim
    n_x = st.t_n * max(model.hidden, max(nq, model.inter))  # the largest GEMM input
    xs = np.empty(n_x if n_x >= schedule.shared_from else 0, np.float32)
    # (no argument may be called ``sched``: Numba's parallel body has its own of that name)
    for me in prange(nw):
        args = (st, work, model, heads, table, l0, l1, cache, layout, tok, step, scores, head)
        # int64: Numba types a prange index as int64 outside the parallel body and uint64
        # inside it, and would compile the whole layer body twice (8.5 s a variant)
        _worker(np.int64(me), args, schedule, ph, (xs, qs))
    done, units = ph[1], schedule.units
    for g in range(phases):  # the done counts, for DecoderStep.phase_units (a plain loop:
        units[g] = done[g]  # an array expression here would be one more parallel region)


@jit
def _worker(me, args, schedule, ph, scratch):
    """Worker ``me`` of :func:`_run`: every phase in order, claiming units as it goes."""
    st, work, model, hd, table, l0, l1, cache, layout, tok, step, scores, head = args
    f32 = np.zeros(0, np.float32)
    hid, inter, d, eps = model.hidden, model.inter, hd.head_dim, model.eps
    nq = hd.num_heads * d
    nqkv = _qkv_width(model, hd)
    w_wit = model.w_wit
    wdiv = 1 if w_wit.itemsize == st.h.itemsize else 2  # 16-bit weights travel as K pairs
    t_n, nw, shared_from = st.t_n, schedule.workers, schedule.shared_from
    x, _, _, tmp, gu, act = work
    h = st.h
    rows_per = max(1, t_n // (nw * 4))  # row units of the element-wise phases
    n_rows = (t_n + rows_per - 1) // rows_per
    rows = (t_n, rows_per)
    phases = 1 + (l1 - l0) * N_PHASE + N_HEAD
    g_head = phases - N_HEAD
    r_n = head.rows.shape[0]
    vocab = head.vocab
    n_widen = (r_n * vocab + WIDEN_UNIT - 1) // WIDEN_UNIT
    ctr, done, _ = ph
    kmax = max(hid, max(nq, inter))
    xf = np.empty(min(t_n * kmax, shared_from), np.float32)  # this worker's input
    # its quantised activations: the rows of a GEMM below shared_from elements
    kmin = min(hid, min(nq, inter if inter else hid))
    qa = _scratch(model.quant, min(t_n, shared_from // kmin + 1), kmax)
    xs, qs = scratch
    no_pf = (np.zeros(0, np.uint8), np.int64(0), np.int64(0))  # nothing to prefetch
    ctx = (xf, xs, ph, me, nw, shared_from, model.gemm_path, qa, qs)
    q = model.quant
    # phase 0: h += add (an outside op's output), then x = the norm of the run's first
    # unit: input_norm(l0) (its attention; with no layer in the run, its outside mixer's
    # input), or post_norm(l0) when l0's mixer runs outside (the run starts at its MLP)
    # the head's weight (packed or quantised) as _weight gives a layer's
    w_head = (head.w, head.qw, head.qw if head.qt else head.w.view(np.uint8))
    n_l = table.shape[0]
    has_norm0 = l0 < n_l  # (l0 == n_l: the head's run, the add only)
    ln1 = f32
    skip0 = st.start_mlp  # the first layer's mixer ran before: start at its MLP half
    if has_norm0:
        ln1 = view(table[l0].post_norm if skip0 else table[l0].input_norm, hid, f32)
    n0 = n_rows if (has_norm0 or st.has_add) else 0
    add_n = view(st.add_norm, hid if st.add_norm != 0 else 0, f32)
    c = _next(ctr, done, 0, False)
    while c < n0:
        r0, r1 = c * rows_per, min(t_n, (c + 1) * rows_per)
        if st.has_add and st.add_norm != 0:  # the sandwich norm of a reduced o or down
            norm._rows(st.add, add_n, tmp, r0, r1, hid, eps)
            norm._add_rows(tmp, h, ln1, x, r0, r1, hid, eps, has_norm0)
        elif st.has_add:
            norm._add_rows(st.add, h, ln1, x, r0, r1, hid, eps, has_norm0)
        else:
            norm._rows(h, ln1, x, r0, r1, hid, eps)
        c = _next(ctr, done, 0, True)
    _wait(done, 0, n0, no_pf)
    for li in range(l1 - l0):
        a = table[l0 + li]
        g = 1 + li * N_PHASE
        last = l0 + li + 1 == l1
        dense = a.gate_up != 0
        w_gu = _weight(a.gate_up, a.gate_up_q, 2 * inter, hid, model, wdiv)
        w_down = _weight(a.down, a.down_q, hid, inter, model, wdiv)
        pf_gu = _share(w_gu[2], 2 * inter, me, nw) if dense else no_pf
        # x is the next run's outside mixer input after the last layer when it has one
        has_next = not last or (l1 < n_l and table[l1].qkv == 0)
        if not dense:
            pf_next = no_pf
        elif not last:
            nxt = table[l0 + li + 1]
            pf_next = _share(_weight(nxt.qkv, nxt.qkv_q, nqkv, hid, model, wdiv)[2], nqkv, me, nw)
        elif r_n:
            pf_next = _share(w_head[2], vocab, me, nw)
        else:
            pf_next = no_pf
        if not (li == 0 and skip0):
            _attention_half(
                a, g, h, work, rows, model, hd, cache, layout, tok, step, scores, pf_gu, ctx,
                st.reduce,
            )  # fmt: skip
            if st.reduce:  # (a partial stack's attention half ends with its o)
                continue
        if not dense:
            continue
        pf_down = _share(w_down[2], hid, me, nw)
        _linear(
            q, gu, x, w_gu, a.gate_up_q, f32, False, t_n, 2 * inter, hid, g + P_GU, pf_down, ctx
        )
        c = _next(ctr, done, g + P_ACT, False)
        while c < n_rows:
            _act_mul_rows(gu, act, c * rows_per, min(t_n, (c + 1) * rows_per), inter, model.act)
            c = _next(ctr, done, g + P_ACT, True)
        _wait(done, g + P_ACT, n_rows, pf_down)
        if not last:  # the next layer's K/V, read by its attention (KV_PREFETCH)
            _prefetch_kv(table[l0 + li + 1], step, cache, layout, hd, me, nw)
        down_out = x if st.reduce else tmp
        _linear(
            q, down_out, act, w_down, a.down_q, f32, False, t_n, hid, inter, g + P_DOWN, pf_next,
            ctx,
        )  # fmt: skip
        if st.reduce:  # (a partial stack's MLP half ends with its down)
            continue
        ln_next = view(table[l0 + li + 1].input_norm, hid, f32) if has_next else f32
        _add_phase(
            tmp, h, x, a.post_mlp_norm, ln_next, has_next, rows, model, g + P_ADD2, ph, pf_next
        )
    # the logits: final norm of the sampled rows, the head GEMM, widened to fp32
    pf_head = _share(w_head[2], vocab, me, nw) if r_n else no_pf
    c = _next(ctr, done, g_head, False)
    while c < r_n:
        o = head.rows[c] * hid
        norm._rows(h[o : o + hid], head.norm, head.y[c * hid : (c + 1) * hid], 0, 1, hid, eps)
        c = _next(ctr, done, g_head, True)
    _wait(done, g_head, r_n, pf_head)
    if r_n:
        lg, y = head.lg, head.y
        _linear(q, lg, y, w_head, head.qt, f32, False, r_n, vocab, hid, g_head + 1, no_pf, ctx)
    # (the scalar tails store through store_f32, not ``head.logits[i] = ...``: Numba's dead
    # code elimination, run after inlining an overload, took that setitem on a field of a
    # tuple-unpacked argument for dead and dropped it -- its alias analysis does not follow
    # tuple unpacking -- leaving the last (R * vocab) % 16 logits unwritten)
    c = _next(ctr, done, g_head + 3, False)
    while c < n_widen:
        i0 = c * WIDEN_UNIT
        i1 = min(r_n * vocab, i0 + WIDEN_UNIT)
        cap = model.logit_softcap
        if cap > 0.0:  # cap * tanh(logit / cap) (Gemma 2's final soft-cap), in fp32
            vcap, vinv = vsplat(cap), vsplat(1.0 / cap)
            for i in range(i0, i1 - (i1 - i0) % 16, 16):
                vstore(head.logits, i, vmul(vcap, vtanh(vmul(vload(head.lg, i), vinv))))
            for i in range(i1 - (i1 - i0) % 16, i1):
                store_f32(head.logits, i, cap * math.tanh(to_f32(head.lg, i) / cap))
        else:
            for i in range(i0, i1 - (i1 - i0) % 16, 16):
                vstore(head.logits, i, vload(head.lg, i))
            for i in range(i1 - (i1 - i0) % 16, i1):
                store_f32(head.logits, i, to_f32(head.lg, i))
        c = _next(ctr, done, g_head + 3, True)
