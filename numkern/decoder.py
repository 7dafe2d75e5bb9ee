"""A run of pre-norm decoder layers in one Numba call (Llama, Mistral, Qwen2/3, Qwen3-MoE,
Mixtral; with sinks GPT-OSS's attention, with sandwich norms and GELU Gemma 2/3's, with
the output gate Qwen3-Next's attention layers).

Public interface
----------------
:class:`LayerWeights` names one layer's tensors (norm weights fp32 ``[H]``, projections
packed by :func:`numkern.convert_weight_packed` in the model dtype, optional fp32
biases and q/k head norms). :class:`DecoderStack` takes the layers, one
:func:`numkern.attention.cache_view` per layer (the layer's paged KV cache, in the ISA of
its KV-cache group), the final norm and the LM head, validates them once and keeps their
addresses. Per step, :meth:`DecoderStack.run` runs layers ``l0..l1`` on the residual
stream ``hidden [T, H]`` (updated in place) with the step's attention plan
(:func:`numkern.attention.plan_attention` with ``block_table``, ``slot_mapping`` and
``num_blocks``: the indices it validated are the ones the kernels read), the token
positions and the rotary table; a run that ends with a layer whose MLP runs outside
(``gate_up=None``: an MoE layer) returns that layer's ``post_norm(hidden)`` for the
caller's experts, whose output is then ``residual_add`` of the next run; likewise a
layer whose token mixer runs outside (``qkv=None``: a Gated DeltaNet layer) gets its
``input_norm(hidden)`` from the run before it and its output back as the next run's
``residual_add`` (``DecoderStack.runs`` lists the runs and what follows each). With
``logits_rows`` the run ends with the LM head: ``logits [R, vocab]`` fp32 of the rows'
``final_norm(hidden)``, rounded to the model dtype first (as HF's lm_head output is).

Per layer ``x = norm1(h)``; ``qkv = x @ Wqkv.T (+ b)``; per-head RMS norm of q and k
(when given); rotary on q and k (``rotary_dim`` leading dims of each head, rotate-half
when ``is_neox``; the rotary table of the layer's KV-cache group); k and v written to
the cache at the plan's slots; paged attention (``causal``/window of the group's plan;
``scale``, ``softcap``, the layer's ``sinks``); with ``attn_output_gate`` (Qwen3-Next)
``att *= sigmoid(gate)``, the gate being the columns of ``qkv`` after v (one per q
column); ``h += [post_attn_norm](att @ Wo.T (+ b))``; ``x = norm2(h)``; ``h +=
[post_mlp_norm](down(f(gate(x)) * up(x)))`` with ``f`` SiLU or tanh-GELU
(``activation``); the logits optionally soft-capped. Every op's output is rounded to the
model dtype, as in HF and in numkern's op-by-op ops; all arithmetic is fp32.

Kernel
------
A decode step of a small model is ~20 kernels per layer. Issued from Python each costs
10-30 us of wrapper and tensor plumbing, and a fork-join region per kernel ~5-10 us
(~150 per SmolLM2 token). So :func:`_run` runs the layers in one parallel region: each
thread is a worker that walks the same list of phases (norm, qkv GEMM, q/k norms +
rotary + cache write, attention items, split merges, the output gate (Qwen3-Next), o
GEMM, residual + norm, gate|up GEMM, SiLU·mul, down GEMM, residual + next norm, then the
head) and takes each phase's work units from shared counters.

* A phase's units are claimed with atomic counters, and a unit counts as done once its
  outputs are written. A worker moves to the next phase when every unit of this one is
  done: it waits for claimed units, never for other workers to arrive. A worker that
  runs alone (one thread, or a vCPU the hypervisor has taken away) claims everything
  itself; a late worker finds the phases done and falls through. A barrier counting
  workers would hang if fewer threads ran than expected. (STYLE prefers owner-computes
  loops without atomics; here a static share measured slower under vCPU steal.)
* GEMM units are chunks of 32-column blocks. Each worker first walks its own contiguous
  share (the weight stream stays sequential per thread: 5-15% faster than interleaved
  claims), then takes the chunks others have not started, from the end. While it waits
  it prefetches its share of the next GEMM's weight: a decode step is a weight stream.
* GEMM arithmetic is :mod:`numkern.gemm`'s, by block: the widening tiles, or for a bf16
  model where ``gemm.PATH`` is ``dpbf16`` and M >= ``gemm.DP_MIN_M`` (every M on a Zen 4
  EPYC, else a prefill) its ``vdpbf16ps`` blocks on the bf16 activations as they are
  (2x the widening tiles at M = 16-128 there). The path is a compile-time witness
  (``_blocks``).

Inputs reach the kernel as named tuples (``Stream``, ``Work``, ``Model``, ``Cache``,
``Tokens``, the plan's :class:`~numkern.attention.kernels.StepArrays`, ``Scores``,
``Head``, ``Schedule``) and one record array of per-layer addresses (``LAYER``): Numba
caches kernels taking module-level named tuples and records on disk, and a call costs
~1 us more than with flat arguments.
"""

import bisect
import itertools
import math
import threading
from typing import NamedTuple

import numba
import numpy as np
import torch
from numba import prange, types
from numba.extending import overload

from . import _check as C
from . import norm, rope
from ._jit import jit
from ._ptr import view
from .attention import AttentionPlan, CacheView
from .attention.kernels import Heads, RowStrides, Scores, cache_write, item, merge
from .gemm import _WITNESS as _PAIR_WITNESS
from .gemm import DP_MIN_M, NB, PATH, TILES, WIDEN_PARALLEL, _block, _block_dp, _widen_rows
from .moe import ACTIVATIONS, GELU_TANH_C
from .moe import _activate as activate
from .simd import (
    atomic_load,
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

DENSE_ACTIVATIONS = ("silu", "gelu_tanh")  # f of the dense MLP's f(gate) * up

# a layer's phases, each with its own claim and done counter (a GEMM takes two: the
# shared widening of its activations, then its blocks)
P_QKV, P_ROPE, P_ATTN, P_MERGE, P_GATE, P_O = 0, 2, 3, 4, 5, 6
P_ADD1, P_GU, P_ACT, P_DOWN, P_ADD2 = 8, 9, 11, 12, 14
N_PHASE = 15
N_HEAD = 4  # phases of the logits: final norm, head GEMM (two), widening
WIDEN_UNIT = 4096  # logits widened per unit
WAIT_PREFETCH = 256 << 10  # bytes of the next GEMM's share a waiting worker prefetches
# (768 KB measured no better)
CHUNKS_PER_WORKER = 4  # GEMM chunks per worker's share: the units the others may take
GEMM_UNITS = 2 * CHUNKS_PER_WORKER  # at most this many chunks per worker (see _gemm)


class LayerWeights(NamedTuple):
    """One decoder layer's tensors (contiguous CPU tensors; ``H`` hidden size, ``D`` head
    dim, ``I`` the MLP's intermediate size)."""

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


# the kernel's table of a layer's addresses (0: absent): its tensors, then its KV cache
LAYER = np.dtype([(name, np.int64) for name in (*LayerWeights._fields, "k_cache", "v_cache")])


# -- the kernel's inputs ------------------------------------------------------------------


class Stream(NamedTuple):
    h: np.ndarray  # the residual stream [T * H], updated in place
    add: np.ndarray  # [T * H] added to h before the first layer (an MoE's output) or empty
    has_add: bool
    t_n: int


class Work(NamedTuple):  # the step's workspaces in the model dtype
    x: np.ndarray  # [T, H] normed rows: the GEMMs' input; the MoE's input at the end
    qkv: np.ndarray  # [T, (Hq + 2 Hkv) D] (+ Hq D gate columns: _qkv_width)
    att: np.ndarray  # [T, Hq D]
    tmp: np.ndarray  # [T, H] o and down outputs
    gu: np.ndarray  # [T, 2 I]
    act: np.ndarray  # [T, I]


class Model(NamedTuple):
    hidden: int
    inter: int
    eps: float
    rot: int  # rotary dims of each head
    is_neox: bool
    w_wit: np.ndarray  # the packed weights' carrier (16-bit as K pairs), empty
    act: int  # the dense MLP's activation (ACTIVATIONS)
    logit_softcap: float  # 0: none
    attn_gate: bool  # att *= sigmoid(gate) before o (Qwen3-Next's attn_output_gate)
    gemm_path: np.ndarray  # the GEMMs' path, empty (_blocks): uint16 dpbf16, float32 widen


class Cache(NamedTuple):
    w_wit: np.ndarray  # the carrier the cache is written in (16-bit elements), empty
    r_wit: np.ndarray  # the carrier attention reads (bf16 pairs for amx), empty
    length: int  # elements of one layer's key (or value) span


class Tokens(NamedTuple):
    pos: np.ndarray  # int64 [T]
    cos_sin: np.ndarray  # fp32 [P, rot]: cos, then sin
    slots: np.ndarray  # int64 [T], from the plan


class Head(NamedTuple):
    rows: np.ndarray  # int64 [R]: the token rows whose logits are wanted (empty: no head)
    norm: np.ndarray  # fp32 [H]
    w: np.ndarray  # packed [vocab, H] in the carrier (or empty)
    y: np.ndarray  # [R, H] workspace
    lg: np.ndarray  # [R, vocab] in the model dtype
    logits: np.ndarray  # fp32 [R * vocab]
    vocab: int


class Schedule(NamedTuple):
    workers: int
    shared_from: int  # GEMM inputs of this many elements or more are widened together


# -- kernels --------------------------------------------------------------------------------


@jit
def _next(ctr, done, g, finished):
    """Mark one unit of phase ``g`` done (when ``finished``) and claim the next one."""
    if finished:
        fetch_add(done, g, 1)
    return fetch_add(ctr, g, 1)


@jit
def _wait(done, g, n, pf):
    """Until all ``n`` units of phase ``g`` are done (each by a worker that claimed it),
    prefetching ``pf = (w, lo, hi)``: ``w[lo:hi]``, the worker's share of the next GEMM."""
    w, lo, hi = pf
    step = 64 // w.itemsize  # a cache line
    i = lo
    while atomic_load(done, g) < n:
        if i < hi:
            prefetch(w, i)
            i += step


@jit
def _share(w, n, me, nw):
    """``(w, lo, hi)``: the first WAIT_PREFETCH bytes of worker ``me``'s own chunks of the
    packed weight ``w`` (``n`` output columns)."""
    nblk = (n + NB - 1) // NB
    per = max(1, nblk // (nw * CHUNKS_PER_WORKER))
    nch = (nblk + per - 1) // per
    per_blk = w.shape[0] // max(n, 1) * NB  # elements of a full block (K, or K pairs, x 32)
    lo = min(w.shape[0], me * nch // nw * per * per_blk)
    hi = min(w.shape[0], (me + 1) * nch // nw * per * per_blk)
    return w, lo, min(hi, lo + WAIT_PREFETCH // w.itemsize)


# The path of the GEMMs' blocks, chosen once per stack in Python and passed down as the
# witness ``Model.gemm_path`` (as numkern.moe's): uint16 (a bf16 model where
# ``gemm.PATH`` is dpbf16) runs gemm's vdpbf16ps blocks on the bf16 activations as they
# are at M >= gemm.DP_MIN_M (every M where isa.GEMM says decode takes the path too),
# float32 widens them. Only the dpbf16 variant of _run holds _block_dp, so a process
# whose CPU lacks AVX512-BF16 (or masks it) never compiles it.


def _dp_types(path, x, w):
    """Whether a witness and the (activations, packed weight) types name the dpbf16 path."""
    return path.dtype == types.uint16 and x.dtype == types.uint16 and w.dtype == types.uint32


def _takes_dp(path, x, w):
    """Whether the blocks of ``x @ W.T`` may take vdpbf16ps (a constant of the variant)."""


@overload(_takes_dp, inline="always")
def _takes_dp_impl(path, x, w):
    dp = _dp_types(path, x, w)
    return lambda path, x, w: dp


def _blocks(path, dp, out, src, x, w, ku, kstep, rstep, bias, has_bias, m, n, k, b0, b1):
    """Blocks ``b0 .. b1-1`` of ``out[m, n] = x[m, k] @ W.T (+ bias)``: gemm's dpbf16
    blocks on ``x`` as it is (bf16) where ``dp`` (``_gemm``'s choice), else its widening
    blocks on ``src`` (``x`` widened to fp32). Only a variant whose witness and types name
    the dpbf16 path (``_dp_types``) holds ``_block_dp``."""


@overload(_blocks, inline="always")
def _blocks_impl(path, dp, out, src, x, w, ku, kstep, rstep, bias, has_bias, m, n, k, b0, b1):
    if _dp_types(path, x, w):

        def impl(path, dp, out, src, x, w, ku, kstep, rstep, bias, has_bias, m, n, k, b0, b1):
            if dp:
                for blk in range(b0, b1):
                    _block_dp(out, n, x, k, w, bias, has_bias, m, n, k, blk)
            else:
                for blk in range(b0, b1):
                    _block(out, n, src, w, ku, kstep, rstep, bias, has_bias, m, n, k, blk, TILES)

        return impl

    def impl(path, dp, out, src, x, w, ku, kstep, rstep, bias, has_bias, m, n, k, b0, b1):
        for blk in range(b0, b1):
            _block(out, n, src, w, ku, kstep, rstep, bias, has_bias, m, n, k, blk, TILES)

    return impl


@jit
def _gemm(out, x, w, bias, has_bias, m, n, k, g, pf, ctx):
    """Phases ``g``, ``g + 1``: ``out[m, n] = x[m, k] @ W.T (+ bias)``, prefetching ``pf``
    while waiting for the others' chunks (see ``_wait``).

    ``ctx = (xf, xs, (ctr, done, flags), me, nw, shared_from, path)``: the worker's
    context. Activations are widened to fp32 once: small ones (decode) by each worker
    that computes, into its ``xf``, without a wait; from ``shared_from`` elements (a
    prefill chunk: widening 2 x T x K per GEMM cost 2-3% of a 512-token prefill) by all
    workers into the shared ``xs`` in phase ``g``. Blocks that take vdpbf16ps (``path``,
    see ``_blocks``) read the bf16 activations as they are: nothing is widened, and phase
    ``g`` has no units (every worker still passes it). ``flags[(g + 1) * nw * GEMM_UNITS +
    c]`` claims chunk c of phase ``g + 1``.
    """
    xf, xs, ph, me, nw, shared_from, path = ctx
    ctr, done, flags = ph
    dp = _takes_dp(path, x, w) and m >= DP_MIN_M
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
    if w.itemsize == x.itemsize:  # fp32 rows of K
        ku, kstep, rstep = k, 2 * NB, NB
    else:  # 16-bit as K pairs
        ku, kstep, rstep = k // 2, NB, 0
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
        _blocks(path, dp, out, src, x, w, ku, kstep, rstep, bias, has_bias, m, n, k, b0, b1)
        fetch_add(done, g, 1)
    _wait(done, g, nch, pf)


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
def _attention_half(a, g, h, work, rows, model, hd, cache, layout, tok, step, scores, pf_gu, ctx):
    """Layer ``a``'s attention half, phases ``g + P_QKV`` to ``g + P_ADD1``: qkv, the q/k
    norms, rotary and the cache write, attention and the merges, the output gate (when
    ``model.attn_gate``), o, then ``h += [post_attn_norm](o)`` and ``x = post_norm(h)``.
    ``rows = (T, rows per unit)``; ``pf_gu``: what a waiting worker prefetches at the end
    (the MLP's weight)."""
    _, _, ph, me, nw, _, _ = ctx
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
    w_qkv = view(a.qkv, nqkv * hid // wdiv, w_wit)
    w_o = view(a.o, hid * nq // wdiv, w_wit)
    pf_o = _share(w_o, hid, me, nw)
    has_b_qkv = a.qkv_bias != 0
    b_qkv = view(a.qkv_bias, nqkv if has_b_qkv else 0, f32)
    _gemm(qkv, x, w_qkv, b_qkv, has_b_qkv, t_n, nqkv, hid, g + P_QKV, pf_o, ctx)
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
            scores.scale, scores.causal, scores.window, scores.softcap, f32, False, sinks, True
        )
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
    _gemm(tmp, att, w_o, b_o, has_b_o, t_n, hid, nq, g + P_O, pf_gu, ctx)
    ln2 = view(a.post_norm, hid, f32)
    _add_phase(tmp, h, x, a.post_attn_norm, ln2, True, rows, model, g + P_ADD1, ph, pf_gu)


@jit(parallel=True)
def _run(st, work, model, heads, table, l0, l1, cache, layout, tok, step, scores, head, schedule):
    """Layers ``l0..l1`` of one step on the residual stream ``st.h`` (module docstring):
    the phase counters and the shared widening buffer, then ``schedule.workers`` workers.

    Layers before ``l1 - 1`` have a dense MLP; when ``l1 - 1`` has none (its
    ``gate_up`` address is 0), the call ends with ``work.x = post_norm(h)``. With
    ``head.rows`` non-empty the call ends with the logits of those rows.
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
        _worker(np.int64(me), args, schedule, ph, xs)


@jit
def _worker(me, args, schedule, ph, xs):
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
    no_pf = (w_wit, np.int64(0), np.int64(0))  # nothing to prefetch while waiting
    ctx = (xf, xs, ph, me, nw, shared_from, model.gemm_path)
    # phase 0: h += add (an outside op's output), then x = the norm of the run's first
    # unit: input_norm(l0) (its attention; with no layer in the run, its outside mixer's
    # input), or post_norm(l0) when l0's mixer runs outside (the run starts at its MLP)
    n_l = table.shape[0]
    has_norm0 = l0 < n_l  # (l0 == n_l: the head's run, the add only)
    ln1 = f32
    skip0 = False  # the first layer's mixer ran outside: start at its MLP half
    if has_norm0:
        if table[l0].qkv != 0 or l1 == l0:
            ln1 = view(table[l0].input_norm, hid, f32)
        else:
            ln1 = view(table[l0].post_norm, hid, f32)
            skip0 = True
    n0 = n_rows if (has_norm0 or st.has_add) else 0
    c = _next(ctr, done, 0, False)
    while c < n0:
        r0, r1 = c * rows_per, min(t_n, (c + 1) * rows_per)
        if st.has_add:
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
        w_gu = view(a.gate_up, 2 * inter * hid // wdiv if dense else 0, w_wit)
        w_down = view(a.down, hid * inter // wdiv if dense else 0, w_wit)
        pf_gu = _share(w_gu, 2 * inter, me, nw) if dense else no_pf
        # x is the next run's outside mixer input after the last layer when it has one
        has_next = not last or (l1 < n_l and table[l1].qkv == 0)
        if not dense:
            pf_next = no_pf
        elif not last:
            w_next = view(table[l0 + li + 1].qkv, nqkv * hid // wdiv, w_wit)
            pf_next = _share(w_next, nqkv, me, nw)
        elif r_n:
            pf_next = _share(head.w, vocab, me, nw)
        else:
            pf_next = no_pf
        if not (li == 0 and skip0):
            _attention_half(
                a, g, h, work, rows, model, hd, cache, layout, tok, step, scores, pf_gu, ctx
            )
        if not dense:
            continue
        pf_down = _share(w_down, hid, me, nw)
        _gemm(gu, x, w_gu, f32, False, t_n, 2 * inter, hid, g + P_GU, pf_down, ctx)
        c = _next(ctr, done, g + P_ACT, False)
        while c < n_rows:
            _act_mul_rows(gu, act, c * rows_per, min(t_n, (c + 1) * rows_per), inter, model.act)
            c = _next(ctr, done, g + P_ACT, True)
        _wait(done, g + P_ACT, n_rows, pf_down)
        _gemm(tmp, act, w_down, f32, False, t_n, hid, inter, g + P_DOWN, pf_next, ctx)
        ln_next = view(table[l0 + li + 1].input_norm, hid, f32) if has_next else f32
        _add_phase(
            tmp, h, x, a.post_mlp_norm, ln_next, has_next, rows, model, g + P_ADD2, ph, pf_next
        )
    # the logits: final norm of the sampled rows, the head GEMM, widened to fp32
    pf_head = _share(head.w, vocab, me, nw) if r_n else no_pf
    c = _next(ctr, done, g_head, False)
    while c < r_n:
        o = head.rows[c] * hid
        norm._rows(h[o : o + hid], head.norm, head.y[c * hid : (c + 1) * hid], 0, 1, hid, eps)
        c = _next(ctr, done, g_head, True)
    _wait(done, g_head, r_n, pf_head)
    if r_n:
        _gemm(head.lg, head.y, head.w, f32, False, r_n, vocab, hid, g_head + 1, no_pf, ctx)
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
                head.logits[i] = cap * math.tanh(to_f32(head.lg, i) / cap)
        else:
            for i in range(i0, i1 - (i1 - i0) % 16, 16):
                vstore(head.logits, i, vload(head.lg, i))
            for i in range(i1 - (i1 - i0) % 16, i1):
                head.logits[i] = to_f32(head.lg, i)
        c = _next(ctr, done, g_head + 3, True)


# -- the public op ----------------------------------------------------------------------------

_F32 = C.WITNESS[torch.float32]  # (also the widening path's witness: _blocks)
_ROWS = C.WITNESS[torch.int64]
_DP_WITNESS = np.empty(0, np.uint16)  # the dpbf16 path's witness (_blocks)


def _pairs(dt):
    """The packed weights' carrier of model dtype ``dt`` (16-bit weights as K pairs)."""
    return _PAIR_WITNESS[dt][1]


def _tensor(name, x, dtype, shape):
    """``x`` checked: a contiguous CPU tensor of ``dtype`` and ``shape``; returns it."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(x).__name__}")
    C.check_dtype(name, x, (dtype,))
    C.check_shape(name, x, shape)
    C.check_contiguous(name, x)
    return x


def _address(name, x, dtype, shape):
    """The address of a checked tensor, 0 for None."""
    return 0 if x is None else C.address(_tensor(name, x, dtype, shape))


def _number(name, value, *, positive):
    """A finite float, > 0 (``positive``) or >= 0."""
    if isinstance(value, bool) or not isinstance(value, (int, float, np.floating, np.integer)):
        raise TypeError(f"{name}: expected a number, got {type(value).__name__}")
    v = float(value)
    if not math.isfinite(v) or v < 0 or (positive and v == 0):
        raise ValueError(f"{name}: expected a finite number {'>' if positive else '>='} 0, got {v}")
    return v


def _extent(x):
    """[first, end) bytes of a contiguous tensor."""
    first = x.data_ptr()
    return first, first + x.numel() * x.element_size()


def _cache_spans(caches):
    """The byte ranges of the layers' KV caches (each a contiguous ``kv_cache_shape``
    tensor: its K and V halves), sorted, with each layer's name: ValueError when two layers
    share memory (each would overwrite the other's K and V)."""
    spans = []
    for i, cv in enumerate(caches):
        if cv is not None:
            (k0, k1), (v0, v1) = _extent_of(cv.kw), _extent_of(cv.vw)
            spans.append((min(k0, v0), max(k1, v1), f"caches[{i}]"))
    spans.sort()
    for (_, end, name), (start, _, other) in itertools.pairwise(spans):
        if start < end:
            raise ValueError(
                f"{other}: expected memory apart from {name}'s (each layer writes its own "
                f"cache), got one that shares bytes with it"
            )
    return [s[0] for s in spans], [s[1] for s in spans], [s[2] for s in spans]


def _extent_of(a):
    """[first, end) bytes of a 1-D NumPy view."""
    first = C.address(a)
    return first, first + a.size * a.itemsize


def _check_pair(name, x, other_name, other):
    """ValueError when the contiguous tensors ``x`` and ``other`` (written) share bytes:
    ``C.check_disjoint`` for contiguous memory, from the two byte ranges alone (a run's
    hot path: a quarter of the general strided test's cost)."""
    a0, a1 = _extent(x)
    b0, b1 = _extent(other)
    if a0 < b1 and b0 < a1:
        raise ValueError(
            f"{name}: expected memory apart from {other_name}'s ({other_name} is written), "
            f"got one that shares bytes with it"
        )


def _check_apart(name, x, spans):
    """ValueError when the contiguous tensor ``x`` (a run's output) shares bytes with a KV
    cache of ``spans`` (sorted, apart: the first whose end is past x's start decides)."""
    lo, hi = _extent(x)
    starts, ends, names = spans
    i = bisect.bisect_right(ends, lo)
    if lo < hi and i < len(starts) and starts[i] < hi:
        raise ValueError(
            f"{name}: expected memory apart from the KV caches' (the run writes them), got "
            f"one that shares bytes with {names[i]}"
        )


class _Step(NamedTuple):
    """A step's inputs, validated once for all the runs that use its plan (per thread)."""

    key: tuple  # (plan, positions, cos_sin_cache, workers, shared_widen_from)
    t_n: int
    tokens: Tokens
    arrays: object  # the plan's StepArrays (partial buffers of this thread's calls)
    scores: object  # Scores
    schedule: Schedule
    scratch: tuple  # qkv, att, tmp, gu, act workspaces


class DecoderStack:
    """The layers of a decoder, their KV caches and its head, validated once.

    ``layers``: :class:`LayerWeights` per layer; ``caches``: the
    :class:`numkern.attention.CacheView` of each layer's KV cache; ``kv_groups``: each
    layer's KV-cache group, ints ``0..G-1`` (default: all 0, one group). The caches of
    one group share an ISA, a layout and a size (one block table and slot mapping per
    step address them); groups may differ in block size, window, ISA and size, and each
    step has one attention plan per group. ``final_norm`` fp32 ``[H]``; ``lm_head`` packed
    ``[vocab, H]`` in the model dtype (that of every packed weight and of the caches).
    ``eps`` >= 0; ``scale`` > 0 defaults to ``head_dim ** -0.5``; ``softcap`` >= 0 (0:
    none); ``rotary_dim`` (even, at most head_dim) defaults to head_dim; ``is_neox`` a
    bool; ``attn_output_gate`` a bool: every attention layer's ``qkv`` then has ``Hq D``
    gate rows after its v rows (``[(2 Hq + 2 Hkv) D, H]``, its bias likewise), and its
    attention output is multiplied by their sigmoid before ``o`` (Qwen3-Next). Every
    dense layer has the same intermediate size. Raises ``TypeError``/``ValueError``
    naming the argument (``layers[3].qkv``) and what was expected. The tensors must stay
    unchanged in place while the stack is used: the stack keeps references and addresses,
    not copies.
    """

    def __init__(
        self,
        layers,
        caches,
        *,
        num_heads,
        num_kv_heads,
        head_dim,
        eps,
        final_norm,
        lm_head,
        scale=None,
        softcap=0.0,
        rotary_dim=None,
        is_neox=True,
        kv_groups=None,
        activation="silu",
        logit_softcap=0.0,
        attn_output_gate=False,
    ):
        hq = C.check_int("num_heads", num_heads, low=1)
        hkv = C.check_int("num_kv_heads", num_kv_heads, low=1)
        d = C.check_int("head_dim", head_dim, low=1)
        if hq % hkv:
            raise ValueError(f"num_heads: expected a multiple of num_kv_heads={hkv}, got {hq}")
        rot = d if rotary_dim is None else C.check_int("rotary_dim", rotary_dim, low=2)
        if rot % 2 or rot > d:
            raise ValueError(f"rotary_dim: expected an even number <= head_dim={d}, got {rot}")
        if not isinstance(is_neox, bool):
            raise TypeError(f"is_neox: expected a bool, got {type(is_neox).__name__}")
        eps = _number("eps", eps, positive=False)
        scale = _number("scale", d**-0.5 if scale is None else scale, positive=True)
        softcap = _number("softcap", softcap, positive=False)
        logit_softcap = _number("logit_softcap", logit_softcap, positive=False)
        gated = C.check_bool("attn_output_gate", attn_output_gate)
        if activation not in DENSE_ACTIVATIONS:
            raise ValueError(
                f"activation: expected one of {DENSE_ACTIVATIONS} (the dense MLP's), got "
                f"{activation!r}"
            )
        layers = list(layers)
        caches = list(caches)
        if not layers:
            raise ValueError("layers: expected at least one LayerWeights")
        for i, lw in enumerate(layers):
            if not isinstance(lw, LayerWeights):
                raise TypeError(f"layers[{i}]: expected LayerWeights, got {type(lw).__name__}")
        if len(caches) != len(layers):
            raise ValueError(f"caches: expected {len(layers)} (one per layer), got {len(caches)}")
        if not isinstance(lm_head, torch.Tensor) or lm_head.ndim != 2:
            raise TypeError(f"lm_head: expected a 2-D packed torch.Tensor, got {lm_head!r:.60}")
        dt = lm_head.dtype
        C.check_dtype("lm_head", lm_head, C.FLOATS)
        vocab, hid = lm_head.shape
        _tensor("lm_head", lm_head, dt, (vocab, hid))
        _tensor("final_norm", final_norm, torch.float32, (hid,))
        nq = hq * d
        nqkv = (hq + 2 * hkv) * d + (nq if gated else 0)  # q, k, v (, gate) rows
        dense = [lw.gate_up is not None for lw in layers]
        inter = {lw.gate_up.shape[0] // 2 for lw in layers if lw.gate_up is not None}
        if len(inter) > 1:
            raise ValueError(f"layers: dense MLPs of one intermediate size, got {sorted(inter)}")
        inter = inter.pop() if inter else 0
        mixer = [lw.qkv is not None for lw in layers]  # attention inside (else outside)
        if not any(mixer):
            raise ValueError("layers: expected at least one attention layer (qkv given)")
        groups = self._check_groups(kv_groups, mixer)
        first = {}  # group -> its first layer's cache
        for i, (cv, g) in enumerate(zip(caches, groups)):
            if g is None:  # a layer whose token mixer runs outside has no KV cache
                if cv is not None:
                    raise ValueError(f"caches[{i}]: expected None (layers[{i}].qkv is None)")
                continue
            self._check_cache(f"caches[{i}]", cv, first.setdefault(g, cv), hkv, d, dt)
        table = np.zeros(len(layers), LAYER)
        for i, (lw, cv) in enumerate(zip(layers, caches)):
            p = f"layers[{i}]."
            row = table[i]
            row["input_norm"] = _address(p + "input_norm", lw.input_norm, torch.float32, (hid,))
            row["post_norm"] = _address(p + "post_norm", lw.post_norm, torch.float32, (hid,))
            row["qkv"] = _address(p + "qkv", lw.qkv, dt, (nqkv, hid))
            row["o"] = _address(p + "o", lw.o, dt, (hid, nq))
            row["qkv_bias"] = _address(p + "qkv_bias", lw.qkv_bias, torch.float32, (nqkv,))
            row["o_bias"] = _address(p + "o_bias", lw.o_bias, torch.float32, (hid,))
            if (lw.q_norm is None) != (lw.k_norm is None):
                raise ValueError(f"{p}q_norm/k_norm: expected both or neither")
            row["q_norm"] = _address(p + "q_norm", lw.q_norm, torch.float32, (d,))
            row["k_norm"] = _address(p + "k_norm", lw.k_norm, torch.float32, (d,))
            row["sinks"] = _address(p + "sinks", lw.sinks, torch.float32, (hq,))
            row["post_attn_norm"] = _address(
                p + "post_attn_norm", lw.post_attn_norm, torch.float32, (hid,)
            )
            row["post_mlp_norm"] = _address(
                p + "post_mlp_norm", lw.post_mlp_norm, torch.float32, (hid,)
            )
            if not mixer[i]:  # the token mixer runs outside (a Gated DeltaNet layer)
                attention = ("o", "qkv_bias", "o_bias", "q_norm", "sinks", "post_attn_norm")
                given = [f for f in attention if getattr(lw, f) is not None]
                if given:
                    raise ValueError(
                        f"{p}{given[0]}: expected None with qkv=None (the layer's token mixer "
                        f"runs outside the stack)"
                    )
            elif lw.o is None:
                raise ValueError(f"{p}o: expected a packed [H, Hq*D] tensor with qkv")
            if lw.post_mlp_norm is not None and lw.gate_up is None:
                raise ValueError(f"{p}post_mlp_norm: expected only with a dense MLP (gate_up/down)")
            if (lw.gate_up is None) != (lw.down is None):
                raise ValueError(f"{p}gate_up/down: expected both (a dense MLP) or neither")
            row["gate_up"] = _address(p + "gate_up", lw.gate_up, dt, (2 * inter, hid))
            row["down"] = _address(p + "down", lw.down, dt, (hid, inter))
            row["k_cache"] = C.address(cv.kw) if mixer[i] else 0
            row["v_cache"] = C.address(cv.vw) if mixer[i] else 0
        self.layers, self.caches, self.table = layers, caches, table  # (kept alive)
        self.final_norm, self.lm_head = final_norm, lm_head
        self.dtype = dt
        self.num_layers, self.hidden_size, self.vocab_size = len(layers), hid, vocab
        self.num_heads, self.num_kv_heads, self.head_dim = hq, hkv, d
        self.intermediate_size = inter
        self.dense = tuple(dense)
        self.mixer = tuple(mixer)
        self.kv_groups = groups
        n_g = len(first)
        self.isas = tuple(first[g].isa for g in range(n_g))  # per group
        self.num_blocks = tuple(first[g].num_blocks for g in range(n_g))
        self.runs = self._plan_runs(dense, mixer, groups)
        self.segments = tuple((l0, l1) for l0, l1, _ in self.runs)
        act = ACTIVATIONS[activation]
        # bf16 GEMMs from gemm.DP_MIN_M rows on vdpbf16ps where this process's path is
        # dpbf16; where it is fma256 (no AVX-512) every dtype widens onto gemm's panel
        # tiles (gemm.TILES, passed to _block), else onto its 8x32 tiles
        if dt == torch.bfloat16 and PATH == "dpbf16":
            self.gemm_path = "dpbf16"
        else:
            self.gemm_path = "fma256" if PATH == "fma256" else "widen"
        path = _DP_WITNESS if self.gemm_path == "dpbf16" else _F32
        model = (hid, inter, eps, rot, is_neox, _pairs(dt), act, logit_softcap, gated, path)
        self._model = Model(*model)
        self.activation, self.logit_softcap = activation, logit_softcap
        self.attn_output_gate = gated
        self._heads = Heads(hq, hkv, d)
        self._caches = tuple(
            Cache(first[g].kw[:0], first[g].kr[:0], first[g].kw.size) for g in range(n_g)
        )
        self._layouts = tuple(first[g].layout for g in range(n_g))
        self._scale, self._softcap = scale, softcap
        # per token: the workspaces besides x (qkv, att, tmp, gu, act)
        self._widths = (nqkv, nq, hid, 2 * inter, inter)
        self._head_w = C.as_numpy(lm_head).reshape(-1).view(_pairs(dt).dtype)
        self._head_norm = final_norm.numpy()
        self._carrier = C.WITNESS[dt]
        self._local = threading.local()  # each thread's last _Step per group
        self._spans = _cache_spans(caches)  # the caches' memory, checked apart once

    @staticmethod
    def _check_groups(kv_groups, mixer):
        """Each layer's group: ints ``0..G-1`` (every group used) for attention layers,
        None for the layers whose token mixer runs outside (default: all in group 0)."""
        n = len(mixer)
        if kv_groups is None:
            return tuple(0 if m else None for m in mixer)
        if isinstance(kv_groups, (str, bytes)) or not hasattr(kv_groups, "__len__"):
            raise TypeError(f"kv_groups: expected a sequence of ints, got {kv_groups!r:.60}")
        if len(kv_groups) != n:
            raise ValueError(
                f"kv_groups: expected {n} entries (one per layer), got {len(kv_groups)}"
            )
        groups = []
        for i, (g, m) in enumerate(zip(kv_groups, mixer)):
            if not m:
                if g is not None:
                    raise ValueError(f"kv_groups[{i}]: expected None (layers[{i}].qkv is None)")
                groups.append(None)
            else:
                groups.append(C.check_int(f"kv_groups[{i}]", g, low=0))
        used = {g for g in groups if g is not None}
        if used != set(range(max(used) + 1)):
            raise ValueError(
                f"kv_groups: expected the groups 0..G-1, each used, got {sorted(used)}"
            )
        return tuple(groups)

    @staticmethod
    def _plan_runs(dense, mixer, groups):
        """The runs one call each takes, ``(l0, l1, outside)``: a layer is two units, its
        mixer (attention inside, or outside) and its MLP (dense inside, or outside); a
        run is the units between two outside ones, and breaks where the KV-cache group
        changes. It starts at layer l0's attention, or at its MLP when l0's mixer ran
        outside; ``outside`` is what follows it: ``"mlp"`` (layer l1-1's MLP; the run
        returns its ``post_norm(h)``), ``"mixer"`` (layer l1's; the run returns its
        ``input_norm(h)``) or None (the head, or only a group change)."""
        n = len(dense)
        runs = []
        l0 = 0
        i = 0  # the layer whose units the scan is at
        mlp_half = False  # the run starts at layer l0's MLP (its mixer ran outside)
        while True:
            if i == n:
                runs.append((l0, n, None))
                return tuple(runs)
            if not mixer[i] and not (mlp_half and i == l0):
                runs.append((l0, i, "mixer"))  # up to the outside mixer of layer i
                l0, mlp_half = i, True
                continue
            if not dense[i]:
                runs.append((l0, i + 1, "mlp"))
                l0, i, mlp_half = i + 1, i + 1, False
                continue
            nxt = i + 1
            if (
                nxt < n
                and mixer[nxt]
                and groups[nxt]
                != next((groups[j] for j in range(l0, nxt) if mixer[j]), groups[nxt])
            ):
                runs.append((l0, nxt, None))  # another KV-cache group from here
                l0, mlp_half = nxt, False
            i = nxt

    @staticmethod
    def _check_cache(name, cv, first, hkv, d, dt):
        if not isinstance(cv, CacheView):
            raise TypeError(f"{name}: expected a numkern.attention.CacheView (cache_view())")
        got = (cv.num_kv_heads, cv.head_dim, cv.dtype)
        if got != (hkv, d, dt):
            raise ValueError(
                f"{name}: expected (kv heads, head_dim, dtype) = {(hkv, d, dt)}, got {got}"
            )
        lay = cv.layout
        # the extent the kernels address (a CacheView is a plain tuple: check, not trust)
        span = (cv.num_blocks - 1) * lay.k_block + (hkv - 1) * lay.k_head + lay.block_size * d
        if cv.kw.dtype != C.WITNESS[dt].dtype or min(cv.kw.size, cv.vw.size) < span:
            raise ValueError(f"{name}: expected the views of cache_view() ({span} elements)")
        same = (cv.isa, lay, cv.num_blocks, cv.kw.size, cv.vw.size)
        want = (first.isa, first.layout, first.num_blocks, first.kw.size, first.kw.size)
        if same != want:
            raise ValueError(
                f"{name}: expected the isa, layout and size of its KV-cache group's first "
                f"cache, got {same[:3]} against {want[:3]}"
            )

    def _plan_of(self, plan, g):
        """Group ``g``'s plan of the step's ``plan`` (one plan, or one per group)."""
        n_g = len(self.isas)
        if isinstance(plan, AttentionPlan) and n_g == 1:
            return plan
        if not (isinstance(plan, (tuple, list)) and len(plan) == n_g):
            raise TypeError(
                f"plan: expected {'an AttentionPlan or ' if n_g == 1 else ''}a tuple of "
                f"{n_g} AttentionPlans (one per KV-cache group), got {plan!r:.60}"
            )
        return plan[g]

    def _step(self, g, plan, positions, cos_sin_cache, workers, shared_widen_from):
        """Group ``g``'s validated step inputs: checked on the first run with this plan,
        positions and table in this thread, then reused by the step's other runs of the
        group (an MoE model runs once per MoE layer)."""
        steps = getattr(self._local, "steps", None)
        if steps is None:
            steps = self._local.steps = {}
        last = steps.get(g)
        if last is not None:
            k = last.key
            if k[0] is plan and k[1] is positions and k[2] is cos_sin_cache:
                if k[3:] == (workers, shared_widen_from):
                    return last
        name = "plan" if len(self.isas) == 1 else f"plan[{g}]"
        if not isinstance(plan, AttentionPlan):
            raise TypeError(f"{name}: expected an AttentionPlan, got {type(plan).__name__}")
        if plan.slot_mapping is None or plan.block_table is None:
            raise ValueError(
                f"{name}: expected a plan built with block_table, slot_mapping and num_blocks "
                "(the run writes the cache and reads the table the plan validated)"
            )
        hd = self._heads
        want = (*hd, self._layouts[g].block_size, self.isas[g], self.num_blocks[g])
        got = (plan.num_heads, plan.num_kv_heads, plan.head_dim, plan.block_size, plan.isa)
        got = (*got, plan.num_blocks)
        if got != want:
            group = f" of KV-cache group {g}" if len(self.isas) > 1 else ""
            raise ValueError(
                f"{name}: built for (heads, kv heads, head_dim, block_size, isa, num_blocks) = "
                f"{got}; the caches{group} have {want}"
            )
        t_n = plan.num_tokens
        _tensor("positions", positions, torch.int64, (t_n,))
        if not isinstance(cos_sin_cache, np.ndarray) or cos_sin_cache.dtype != np.float32:
            raise TypeError("cos_sin_cache: expected a float32 NumPy array [max_position, rot]")
        rot = self._model.rot
        if cos_sin_cache.ndim != 2 or cos_sin_cache.shape[1] != rot:
            raise ValueError(
                f"cos_sin_cache: expected shape [max_position, {rot}], got "
                f"{list(cos_sin_cache.shape)}"
            )
        if not cos_sin_cache.flags.c_contiguous:
            raise ValueError("cos_sin_cache: expected a C-contiguous array")
        pos = positions.numpy().copy()  # the kernels read this validated copy
        pos.flags.writeable = False
        if t_n and (int(pos.min()) < 0 or int(pos.max()) >= cos_sin_cache.shape[0]):
            raise ValueError(
                f"positions: expected values in [0, {cos_sin_cache.shape[0]}) (rows of "
                f"cos_sin_cache), got [{int(pos.min())}, {int(pos.max())}]"
            )
        nw = numba.get_num_threads() if workers is None else C.check_int("workers", workers, low=1)
        shared = C.check_int("shared_widen_from", shared_widen_from, low=0)
        flat = C.as_numpy(torch.empty(t_n * sum(self._widths), dtype=self.dtype))
        cuts = np.cumsum([0, *(t_n * w for w in self._widths)])
        scratch = tuple(flat[a:b] for a, b in itertools.pairwise(cuts))
        scores = (self._scale, plan.causal, plan.sliding_window, self._softcap)
        step = _Step(
            key=(plan, positions, cos_sin_cache, workers, shared_widen_from),
            t_n=t_n,
            tokens=Tokens(pos, cos_sin_cache, plan.slot_mapping),
            arrays=plan.step_arrays(),
            scores=Scores(*scores, _F32, False, _F32, False),
            schedule=Schedule(nw, shared),
            scratch=scratch,
        )
        steps[g] = step
        return step

    def _layers(self, layers):
        if not (isinstance(layers, tuple) and len(layers) == 2):
            raise TypeError(f"layers: expected a tuple (l0, l1), got {layers!r:.60}")
        l0 = C.check_int("layers[0]", layers[0], low=0)
        l1 = C.check_int("layers[1]", layers[1], low=l0)
        n = self.num_layers
        if l1 > n:
            raise ValueError(f"layers: expected 0 <= l0 <= l1 <= {n}, got {layers}")
        one_group = len({g for g in self.kv_groups[l0:l1] if g is not None}) <= 1
        mixers_inside = all(self.mixer[l0 + 1 : l1])  # (l0's may have run outside)
        if not (all(self.dense[l0 : max(l0, l1 - 1)]) and one_group and mixers_inside):
            raise ValueError(
                f"layers: every layer but the last of a run needs a dense MLP, every layer but "
                f"the first its attention inside, and a run's attention layers share one "
                f"KV-cache group; runs: {self.segments}"
            )
        return l0, l1

    def run(
        self,
        hidden,
        plan,
        positions,
        cos_sin_cache,
        *,
        layers,
        residual_add=None,
        logits_rows=None,
        logits=None,
        workers=None,
        shared_widen_from=WIDEN_PARALLEL,
        caches=None,
    ):
        """Layers ``layers = (l0, l1)`` of one step on ``hidden [T, H]`` (model dtype,
        updated in place: the residual stream); see the module docstring.

        ``plan``: the step's :func:`numkern.attention.plan_attention` with ``block_table``,
        ``slot_mapping`` and ``num_blocks`` (for this stack's heads and its group's block
        size, ISA and cache; its window is the layers'), or with several KV-cache groups a
        tuple of one such plan per group: a run uses its group's; ``positions`` int64
        ``[T]``, rows of ``cos_sin_cache`` (fp32 NumPy ``[P, rotary_dim]``: cos, then sin;
        or a tuple of one per KV-cache group, when the groups' layers rotate differently:
        Gemma 3's local and global rope). These are validated on the first run of a step (in
        each thread) and the kernels read the validated copies: the step's later runs with
        the same ``plan``, ``positions`` and ``cos_sin_cache`` objects reuse them.
        ``residual_add [T, H]`` (model dtype) is added to ``hidden`` first: the output of
        the previous run's MoE. With ``logits_rows`` (int64 ``[R]``, rows of ``hidden``) the
        logits of those rows are written to ``logits`` (fp32 ``[R, vocab]``); then ``l1``
        must be the last layer, with a dense MLP.

        A run starts at layer ``l0``'s attention, or at its MLP when ``l0``'s token mixer
        runs outside (``qkv=None``: ``residual_add`` is then the mixer's output). Returns
        ``post_norm(hidden)`` ``[T, H]`` of layer ``l1 - 1`` (a new tensor) when that
        layer's MLP runs outside (``gate_up=None``); else ``input_norm(hidden)`` of layer
        ``l1`` when that layer's token mixer runs outside; else None. ``runs`` lists the
        runs a step takes and what follows each. ``workers`` (default: Numba's thread
        count) and ``shared_widen_from`` change the schedule, never the result.
        ``caches``: this call's KV caches instead of the stack's, one ``CacheView`` per layer
        (None for an outside mixer), each of the isa, layout and size of the stack's cache
        of its layer's group (a torch op whose cache writes are functionalised runs on the
        tensors it is handed); checked on every call.
        """
        l0, l1 = self._layers(layers)
        table = self.table if caches is None else self._table_for(caches)
        # the run's KV-cache group (a run without attention layers reads none: group 0)
        g = next((g for g in self.kv_groups[l0:l1] if g is not None), 0)
        if isinstance(cos_sin_cache, (tuple, list)):  # one table per KV-cache group
            if len(cos_sin_cache) != len(self.isas):
                raise ValueError(
                    f"cos_sin_cache: expected one array, or one per KV-cache group "
                    f"({len(self.isas)}), got {len(cos_sin_cache)}"
                )
            cos_sin_cache = cos_sin_cache[g]
        step = self._step(
            g, self._plan_of(plan, g), positions, cos_sin_cache, workers, shared_widen_from
        )
        t_n, hid, dt = step.t_n, self.hidden_size, self.dtype
        shape = (t_n, hid)
        fast = type(hidden) is torch.Tensor and hidden.dtype == dt and hidden.shape == shape
        if not (fast and hidden.is_contiguous()):
            _tensor("hidden", hidden, dt, shape)
        add = self._carrier
        if residual_add is not None:
            add = C.as_numpy(_tensor("residual_add", residual_add, dt, shape)).reshape(-1)
        head = self._head(logits_rows, logits, t_n, l0, l1)
        # the run writes hidden, the caches and logits, and reads residual_add while it
        # writes hidden: memory shared among them would give garbage
        spans = self._spans if caches is None else _cache_spans(caches)
        _check_apart("hidden", hidden, spans)
        if residual_add is not None:
            _check_pair("residual_add", residual_add, "hidden", hidden)
        if logits_rows is not None:
            _check_apart("logits", logits, spans)
            _check_pair("logits", logits, "hidden", hidden)
        x = torch.empty(shape, dtype=dt)  # the normed rows: what this call may return
        if t_n == 0:  # no rows: nothing to compute (the GEMM blocks take at least one row)
            return x if self.hands_off(l0, l1) else None
        work = Work(C.as_numpy(x).reshape(-1), *step.scratch)
        stream = Stream(C.as_numpy(hidden).reshape(-1), add, residual_add is not None, t_n)
        model = (self._model, self._heads, table)
        cache = (self._caches[g], self._layouts[g])
        tail = (step.arrays, step.scores, head, step.schedule)
        _run(stream, work, *model, l0, l1, *cache, step.tokens, *tail)
        return x if self.hands_off(l0, l1) else None

    def hands_off(self, l0, l1):
        """Whether the run of layers ``(l0, l1)`` returns rows for an op outside: layer
        ``l1 - 1``'s MLP or layer ``l1``'s token mixer runs outside."""
        if l1 > l0 and not self.dense[l1 - 1]:
            return True  # post_norm(h) of layer l1 - 1, for its MLP outside
        return l1 < self.num_layers and not self.mixer[l1]  # input_norm(h) of layer l1

    def _table_for(self, caches):
        """The layer table with the K/V addresses of ``caches`` (one CacheView per layer,
        None for an outside mixer), each checked against the stack's cache of its group."""
        if isinstance(caches, (str, bytes)) or not hasattr(caches, "__len__"):
            raise TypeError(f"caches: expected a sequence of CacheViews, got {caches!r:.60}")
        if len(caches) != self.num_layers:
            raise ValueError(
                f"caches: expected {self.num_layers} (one per layer), got {len(caches)}"
            )
        table = self.table.copy()
        hkv, d, dt = self.num_kv_heads, self.head_dim, self.dtype
        for i, (cv, g) in enumerate(zip(caches, self.kv_groups)):
            if g is None:
                if cv is not None:
                    raise ValueError(f"caches[{i}]: expected None (layers[{i}].qkv is None)")
                continue
            first = self.caches[self.kv_groups.index(g)]
            self._check_cache(f"caches[{i}]", cv, first, hkv, d, dt)
            table[i]["k_cache"], table[i]["v_cache"] = C.address(cv.kw), C.address(cv.vw)
        return table

    def _head(self, rows, logits, t_n, l0, l1):
        carrier = self._carrier
        if rows is None:
            if logits is not None:
                raise ValueError("logits: given without logits_rows")
            return Head(_ROWS, _F32, self._head_w[:0], carrier, carrier, _F32, 0)
        if l1 != self.num_layers or (l1 > l0 and not self.dense[l1 - 1]):
            raise ValueError(
                f"logits_rows: the head runs after the last layer, once its MLP has run; "
                f"this run ends at layer {l1} of {self.num_layers}"
            )
        if not isinstance(rows, torch.Tensor):
            raise TypeError(f"logits_rows: expected a torch.Tensor, got {type(rows).__name__}")
        C.check_ndim("logits_rows", rows, (1,))
        _tensor("logits_rows", rows, torch.int64, (rows.shape[0],))
        r = rows.numpy().copy()
        if r.size and (int(r.min()) < 0 or int(r.max()) >= t_n):
            raise ValueError(
                f"logits_rows: expected rows in [0, {t_n}), got [{int(r.min())}, {int(r.max())}]"
            )
        r_n, vocab, hid = r.shape[0], self.vocab_size, self.hidden_size
        _tensor("logits", logits, torch.float32, (r_n, vocab))
        ws = C.as_numpy(torch.empty(r_n * (hid + vocab), dtype=self.dtype))
        y, lg = ws[: r_n * hid], ws[r_n * hid :]
        return Head(r, self._head_norm, self._head_w, y, lg, logits.numpy().reshape(-1), vocab)
