"""A run of decoder layers in one Numba call: the engine's hot loop without Python in it.

A decode step of a small model is ~20 kernels per layer (norms, GEMMs, rotary, cache
write, attention, activation, residual adds). Issued from Python each costs 10-30 us of
wrapper and tensor plumbing, and every torch op between two Numba kernels lets torch's
OpenMP pool spin on the cores Numba's pool needs. A fork-join region per kernel still
costs ~5-10 us each (~150 per SmolLM2 token). So :func:`layers` runs every layer of a
dense model in one parallel region: each thread is a worker that walks the same list of
phases (norm, qkv GEMM, q/k norms + rotary + cache write, attention items, split
merges, o GEMM, residual + norm, gate|up GEMM, SiLU·mul, down GEMM, residual + next
norm) and takes the phase's work units from shared counters.

Work units and waits (deadlock-free, whatever the thread count):

* A phase's units are claimed with atomic counters, and a unit counts as done once its
  outputs are written. A worker moves to the next phase when every unit of this one is
  done — it waits for claimed units, never for other workers to arrive. A worker that
  runs alone (one thread, or another stalled by the hypervisor: this VM shows up to
  50% steal) claims everything itself; a late worker finds the phases done and falls
  through. A barrier counting workers would hang if fewer threads ran than expected.
* GEMM units are chunks of 32-column blocks. Each worker first walks its own
  contiguous share (as a static ``prange`` would: the weight stream stays sequential
  per thread, which measured 5-15% faster than interleaved claims), then takes the
  chunks others have not started, from the end.

The kernels are numkern's own (``gemm._block``, ``attention._item``/``_merge``/
``_reshape_and_cache``) and this package's norms and rotary. Their inputs were
validated once per step (the attention plan and indices) or at load (weights, whose
addresses form the per-layer table ``addr``). Rounding points are those of the op-by-op
path (and HF): every op's output is rounded to the model dtype. Only SiLU's exp differs
(numkern's ``vexp`` vs torch's, ~2e-7 relative), so the two paths agree to 1e-5 in fp32
and to one bf16 unit in bf16.
"""

import numpy as np
from numba import prange

from numkern import attention as A
from numkern._jit import jit
from numkern._ptr import view
from numkern.gemm import NB, _block, _widen_rows
from numkern.simd import (
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
)

from .kernels import _norm_rows, _rope_rows

# columns of the per-layer address table ``addr [layers, N_ADDR]`` (0: absent)
LN1, LN2, W_QKV, B_QKV, W_O, B_O, Q_NORM, K_NORM, W_GU, W_DOWN, K_CACHE, V_CACHE = range(12)
N_ADDR = 12

# a layer's phases; each has its own claim counter and done counter
# (a GEMM takes two: the widening of its activations, its blocks)
P_QKV, P_ROPE, P_ATTN, P_MERGE, P_O = 0, 2, 3, 4, 5
P_ADD1, P_GU, P_ACT, P_DOWN, P_ADD2 = 7, 8, 10, 11, 13
N_PHASE = 14
N_HEAD = 4  # phases of the logits: final norm, head GEMM (two), widening
WIDEN_UNIT = 4096  # logits widened per unit
WAIT_PREFETCH = 256 << 10  # bytes of the next GEMM's share a waiting worker prefetches
CHUNKS_PER_WORKER = 4  # GEMM chunks per worker's share: the units the others may take
GEMM_UNITS = 2 * CHUNKS_PER_WORKER  # at most this many chunks per worker (see _gemm)


@jit
def _next(ctr, done, g, finished):
    """Mark one unit of phase ``g`` done (when ``finished``) and claim the next one."""
    if finished:
        fetch_add(done, g, 1)
    return fetch_add(ctr, g, 1)


@jit
def _wait(done, g, n, w, lo, hi):
    """Until all ``n`` units of phase ``g`` are done (each by a worker that claimed it).
    Meanwhile the worker prefetches ``w[lo:hi]``, its share of the next GEMM's weight:
    a decode step is a weight stream, and it should not pause while a worker waits."""
    step = 64 // w.itemsize  # a cache line
    i = lo
    while atomic_load(done, g) < n:
        if i < hi:
            prefetch(w, i)
            i += step


@jit
def _share(w, n, k, me, nw):
    """The element range of ``w`` (packed ``[n, k]``) in worker ``me``'s own GEMM chunks."""
    nblk = (n + NB - 1) // NB
    per = max(1, nblk // (nw * CHUNKS_PER_WORKER))
    nch = (nblk + per - 1) // per
    per_blk = w.shape[0] // n * NB  # elements of a full block (K, or K pairs, x 32)
    lo = min(w.shape[0], me * nch // nw * per * per_blk)
    hi = min(w.shape[0], (me + 1) * nch // nw * per * per_blk)
    return w, lo, min(hi, lo + WAIT_PREFETCH // w.itemsize)


@jit
def _gemm(out, x, xf, xs, w, bias, has_bias, m, n, k, ctr, flags, done, g, me, nw, pw, plo,
          phi, shared_from):  # fmt: skip
    """Phases ``g``, ``g + 1``: ``out[m, n] = x[m, k] @ W.T (+ bias)``; ``pw[plo:phi]``
    prefetched while waiting for the others' chunks (see ``_wait``).

    Activations are widened to fp32 once: small ones (decode) by each worker that
    computes, into its ``xf``, without a wait; from ``shared_from`` elements (a prefill
    chunk: widening 2 x T x K per GEMM cost 2-3% of a 512-token prefill) by all workers
    into the shared ``xs`` in phase ``g``. ``flags[(g + 1) * nw * GEMM_UNITS + c]`` claims
    chunk c (a run of 32-column blocks) of phase ``g + 1``.
    """
    shared = m * k >= shared_from
    if shared:
        rows_per = max(1, m // (nw * 4))
        n_units = (m + rows_per - 1) // rows_per
        c = _next(ctr, done, g, False)
        while c < n_units:
            _widen_rows(x, k, xs, k, c * rows_per, min(m, (c + 1) * rows_per))
            c = _next(ctr, done, g, True)
        _wait(done, g, n_units, pw, plo, phi)
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
        if not (widened or shared):  # activations widened by each worker that computes
            _widen_rows(x, k, xf, k, 0, m)
            widened = True
        for blk in range(c * per, min(nblk, (c + 1) * per)):
            _block(out, n, src, w, ku, kstep, rstep, bias, has_bias, m, n, k, blk)
        fetch_add(done, g, 1)
    _wait(done, g, nch, pw, plo, phi)


@jit
def _add_norm(h, y, ln, x, t0, t1, n, eps, has_norm):
    """Rows t0..t1: ``h += y`` (rounded to h's dtype), then ``x = norm(h) * ln``."""
    nv = n - n % 16
    for t in range(t0, t1):
        o = t * n
        for i in range(o, o + nv, 16):
            vstore(h, i, vadd(vload(h, i), vload(y, i)))
        for i in range(o + nv, o + n):
            store_f32(h, i, to_f32(h, i) + to_f32(y, i))
    if has_norm:
        _norm_rows(h, ln, x, t0, t1, n, eps)


@jit
def _silu_mul_rows(gu, act, t0, t1, inter):
    """act = silu(g) * u for gu rows [g | u], each op rounded as torch does in fp32."""
    one = vsplat(1.0)
    for t in range(t0, t1):
        for i in range(0, inter, 16):
            g = vload(gu, t * 2 * inter + i)
            u = vload(gu, t * 2 * inter + inter + i)
            s = vdiv(g, vadd(one, vexp(vmul(g, vsplat(-1.0)))))
            vstore(act, t * inter + i, vmul(s, u))


@jit
def _qkv_rows(qkv, t0, t1, qn, kn, has_qk_norm, eps, hq, hkv, d, pos, cos, sin, kw, vw, slots,
              b, c_bs, c_hs, amx):  # fmt: skip
    """Rows t0..t1 of ``qkv [T, (hq + 2 hkv) d]``: q/k head norms (Qwen3), rotary of the q
    and k heads (adjacent), and the cache write of k and v straight from the rows."""
    nq = hq * d
    nqkv = (hq + 2 * hkv) * d
    if has_qk_norm:  # per-head RMS norm of q and k, in place
        for t in range(t0, t1):
            for hh in range(hq):
                o = t * nqkv + hh * d
                _norm_rows(qkv[o : o + d], qn, qkv[o : o + d], 0, 1, d, eps)
            for hh in range(hkv):
                o = t * nqkv + nq + hh * d
                _norm_rows(qkv[o : o + d], kn, qkv[o : o + d], 0, 1, d, eps)
    _rope_rows(qkv, pos, cos, sin, t0, t1, hq + hkv, d, nqkv)
    o = t0 * nqkv + nq
    A._reshape_and_cache(qkv[o:], qkv[o + hkv * d :], kw, vw, slots[t0:t1], t1 - t0, hkv, d, b,
                         nqkv, d, nqkv, d, c_bs, c_hs, c_bs, c_hs, amx)  # fmt: skip


@jit(parallel=True)
def layers(h, x, qkv, att, tmp, gu, act, t_n, l0, l1, has_mlp, addr, hid, hq, hkv, d, inter,
           eps, has_b_qkv, has_b_o, has_qk_norm, w_wit, pos, cos, sin, slots, qsl, seq_lens, bt,
           items, merges, part_m, part_l, part_acc, causal, window, scale, softcap, sinks,
           has_sinks, c_wit, r_wit, c_len, b, c_bs, c_hs, amx, head, rows, ln_f, w_head, y,
           lg, logits, nw, shared_from):  # fmt: skip
    """Decoder layers ``l0..l1`` of one step on the residual stream ``h [T, hid]``.

    Per layer: ``h += o(attention(rope(norm1(h) @ Wqkv)))``; with ``has_mlp``
    ``h += down(silu(gate(x)) * up(x))`` for ``x = norm2(h)``; then ``x`` is the next
    layer's ``norm1(h)`` (none after ``l1 - 1``). Without ``has_mlp`` (an MoE layer,
    run by the caller) the call ends with ``x = norm2(h)``.

    ``x``/``qkv``/``att``/``tmp``/``gu``/``act`` are the step's workspaces (model dtype;
    ``gu [T, 2 inter]``); ``addr`` the layers' weight and cache addresses (columns
    ``LN1``..``V_CACHE``; norms, biases fp32; weights packed, carrier ``w_wit``;
    caches ``c_len`` elements of carrier ``c_wit``, read as ``r_wit``: bf16 pairs for
    ``amx``); the rest as ``paged_attention``. ``nw`` workers (the thread count); GEMMs
    with ``shared_from`` activations or more widen them in a shared phase (``_gemm``).

    With ``head``, the call ends with the logits of the token rows ``rows [R]`` (int64):
    ``y = norm(h[rows]) * ln_f`` ``[R, hid]``, ``lg = y @ W_head.T`` ``[R, vocab]`` in the
    model dtype (as HF rounds them), widened into ``logits [R, vocab]`` fp32.
    """
    f32 = np.zeros(0, np.float32)
    no_alibi = np.zeros(0, np.float32)
    nq = hq * d
    nqkv = (hq + 2 * hkv) * d
    wdiv = 1 if w_wit.itemsize == h.itemsize else 2  # 16-bit weights travel as K pairs
    rdiv = r_wit.itemsize // c_wit.itemsize
    n_it = items.shape[0]
    n_mg = merges.shape[0]
    rows_per = max(1, t_n // (nw * 4))  # row units of the element-wise phases
    n_rows = (t_n + rows_per - 1) // rows_per
    phases = 1 + (l1 - l0) * N_PHASE + N_HEAD
    g_head = phases - N_HEAD
    r_n = rows.shape[0] if head else 0
    vocab = logits.shape[0] // max(r_n, 1)
    n_widen = (r_n * vocab + WIDEN_UNIT - 1) // WIDEN_UNIT
    ctr = np.zeros(phases, np.int64)
    done = np.zeros(phases, np.int64)
    flags = np.zeros(phases * nw * GEMM_UNITS, np.int64)
    kmax = max(hid, max(nq, inter))
    xs = np.empty(t_n * kmax if t_n * kmax >= shared_from else 0, np.float32)  # shared
    for me in prange(nw):
        xf = np.empty(min(t_n * kmax, shared_from), np.float32)  # this worker's input
        # each wait prefetches this worker's share of the next GEMM's weight (none: w_wit)
        pf = (w_wit, np.int64(0), np.int64(0))
        # phase 0: x = norm1(h) of the first layer
        n0 = n_rows if l1 > l0 else 0
        c = _next(ctr, done, 0, False)
        while c < n0:
            ln1 = view(addr[l0, LN1], hid, f32)
            _norm_rows(h, ln1, x, c * rows_per, min(t_n, (c + 1) * rows_per), hid, eps)
            c = _next(ctr, done, 0, True)
        _wait(done, 0, n0, *pf)
        for li in range(l1 - l0):
            a = addr[l0 + li]
            g = 1 + li * N_PHASE
            last = l0 + li + 1 == l1
            w_qkv = view(a[W_QKV], nqkv * hid // wdiv, w_wit)
            w_o = view(a[W_O], hid * nq // wdiv, w_wit)
            w_gu = view(a[W_GU], 2 * inter * hid // wdiv if has_mlp else 0, w_wit)
            w_down = view(a[W_DOWN], hid * inter // wdiv if has_mlp else 0, w_wit)
            pf_o = _share(w_o, hid, nq, me, nw)
            if not has_mlp:
                pf_next = pf
            elif not last:
                pf_next = _share(view(addr[l0 + li + 1, W_QKV], nqkv * hid // wdiv, w_wit), nqkv,
                                 hid, me, nw)  # fmt: skip
            elif r_n:
                pf_next = _share(w_head, vocab, hid, me, nw)
            else:
                pf_next = pf
            b_qkv = view(a[B_QKV], nqkv if has_b_qkv else 0, f32)
            _gemm(qkv, x, xf, xs, w_qkv, b_qkv, has_b_qkv, t_n, nqkv, hid, ctr, flags, done,
                  g + P_QKV, me, nw, *pf_o, shared_from)  # fmt: skip
            qn = view(a[Q_NORM], d if has_qk_norm else 0, f32)
            kn = view(a[K_NORM], d if has_qk_norm else 0, f32)
            kw = view(a[K_CACHE], c_len, c_wit)
            vw = view(a[V_CACHE], c_len, c_wit)
            c = _next(ctr, done, g + P_ROPE, False)
            while c < n_rows:
                _qkv_rows(qkv, c * rows_per, min(t_n, (c + 1) * rows_per), qn, kn, has_qk_norm,
                          eps, hq, hkv, d, pos, cos, sin, kw, vw, slots, b, c_bs, c_hs,
                          amx)  # fmt: skip
                c = _next(ctr, done, g + P_ROPE, True)
            _wait(done, g + P_ROPE, n_rows, *pf_o)
            kr = view(a[K_CACHE], c_len // rdiv, r_wit)
            vr = view(a[V_CACHE], c_len // rdiv, r_wit)
            it = _next(ctr, done, g + P_ATTN, False)
            while it < n_it:
                A._item(it, items, qkv, kr, vr, att, qsl, seq_lens, bt, part_m, part_l,
                        part_acc, scale, causal, window, softcap, no_alibi, False, sinks,
                        has_sinks, hq, hkv, d, b, nqkv, d, nq, d, c_bs, c_hs, c_bs, c_hs,
                        b * 16, amx)  # fmt: skip
                it = _next(ctr, done, g + P_ATTN, True)
            _wait(done, g + P_ATTN, n_it, *pf_o)
            mg = _next(ctr, done, g + P_MERGE, False)
            while mg < n_mg:
                A._merge(mg, merges, att, qsl, part_m, part_l, part_acc, sinks, has_sinks, hq,
                         hkv, d, nq, d)  # fmt: skip
                mg = _next(ctr, done, g + P_MERGE, True)
            _wait(done, g + P_MERGE, n_mg, *pf_o)
            pf_gu = _share(w_gu, 2 * inter, hid, me, nw) if has_mlp else pf
            b_o = view(a[B_O], hid if has_b_o else 0, f32)
            _gemm(tmp, att, xf, xs, w_o, b_o, has_b_o, t_n, hid, nq, ctr, flags, done, g + P_O, me,
                  nw, *pf_gu, shared_from)  # fmt: skip
            ln2 = view(a[LN2], hid, f32)
            c = _next(ctr, done, g + P_ADD1, False)
            while c < n_rows:
                _add_norm(h, tmp, ln2, x, c * rows_per, min(t_n, (c + 1) * rows_per), hid, eps,
                          True)  # fmt: skip
                c = _next(ctr, done, g + P_ADD1, True)
            _wait(done, g + P_ADD1, n_rows, *pf_gu)
            if not has_mlp:
                continue
            pf_down = _share(w_down, hid, inter, me, nw)
            _gemm(gu, x, xf, xs, w_gu, f32, False, t_n, 2 * inter, hid, ctr, flags, done, g + P_GU,
                  me, nw, *pf_down, shared_from)  # fmt: skip
            c = _next(ctr, done, g + P_ACT, False)
            while c < n_rows:
                _silu_mul_rows(gu, act, c * rows_per, min(t_n, (c + 1) * rows_per), inter)
                c = _next(ctr, done, g + P_ACT, True)
            _wait(done, g + P_ACT, n_rows, *pf_down)
            _gemm(tmp, act, xf, xs, w_down, f32, False, t_n, hid, inter, ctr, flags, done,
                  g + P_DOWN, me, nw, *pf_next, shared_from)  # fmt: skip
            ln_next = view(addr[l0 + li + 1, LN1], hid, f32) if not last else f32
            c = _next(ctr, done, g + P_ADD2, False)
            while c < n_rows:
                _add_norm(h, tmp, ln_next, x, c * rows_per, min(t_n, (c + 1) * rows_per), hid,
                          eps, not last)  # fmt: skip
                c = _next(ctr, done, g + P_ADD2, True)
            _wait(done, g + P_ADD2, n_rows, *pf_next)
        # the logits: final norm of the sampled rows, the head GEMM, widened to fp32
        pf_head = _share(w_head, vocab, hid, me, nw) if r_n else pf
        c = _next(ctr, done, g_head, False)
        while c < r_n:
            o = rows[c] * hid
            _norm_rows(h[o : o + hid], ln_f, y[c * hid : (c + 1) * hid], 0, 1, hid, eps)
            c = _next(ctr, done, g_head, True)
        _wait(done, g_head, r_n, *pf_head)
        if r_n:
            _gemm(lg, y, xf, xs, w_head, f32, False, r_n, vocab, hid, ctr, flags, done, g_head + 1,
                  me, nw, *pf, shared_from)  # fmt: skip
        c = _next(ctr, done, g_head + 3, False)
        while c < n_widen:
            i0 = c * WIDEN_UNIT
            i1 = min(r_n * vocab, i0 + WIDEN_UNIT)
            for i in range(i0, i1 - (i1 - i0) % 16, 16):
                vstore(logits, i, vload(lg, i))
            for i in range(i1 - (i1 - i0) % 16, i1):
                logits[i] = to_f32(lg, i)
            c = _next(ctr, done, g_head + 3, True)


@jit
def add(h, y, rows, n):
    """h += y (rounded to h's dtype), ``rows`` rows of width ``n``: an MoE layer's output."""
    _add_norm(h, y, np.zeros(0, np.float32), h, 0, rows, n, 0.0, False)
