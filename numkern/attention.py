"""Block-tiled paged attention over a paged KV cache (DESIGN §4).

Layouts
-------
``kv_cache [num_blocks, Hkv, B, 2*D]`` (vLLM 0.32's allocation), viewed as
``[num_blocks, Hkv, 2*B, D]`` and cut at B: in each (block b, kv head h) slab the first
``B*D`` elements are K and the next ``B*D`` are V (:func:`split_kv_cache`). Inside a
half-slab:

* ``vec`` / ``vec16`` / ``neon``: K transposed (``K[d*B + t]``), V row-major (``V[t*D + d]``);
* ``amx`` (bf16): K in groups of 16 tokens ``[D/2][16][2]``
  (``K[(t//16)*16*D + (d//2)*32 + (t%16)*2 + d%2]``), V in groups of 16 dims
  ``[B/2][16][2]`` (``V[(d//16)*B*16 + (t//2)*32 + (d%16)*2 + t%2]``).

``paged_attention(query [T, Hq, D], key_cache, value_cache, output [T, Hq, D],
query_start_loc [R+1] int32, seq_lens [R] int32, block_table [R, max_blocks] int32, *,
scale, causal, sliding_window, softcap, alibi_slopes [Hq] fp32, sinks [Hq], isa, plan)``.
Request r owns query rows ``query_start_loc[r]:query_start_loc[r+1]``; its keys are
positions ``0..seq_lens[r]-1``; query row i sits at position ``seq_lens[r] - q_len + i``.

Kernel
------
A plan (:func:`plan_attention`, once per step) cuts the batch into work items: one
request, one kv head, up to ``NRI = 64`` query rows — (position, q head) pairs of that kv
head's group, so every K/V tile is read once for the whole group — and a key range.
When a step has few items (decode of few requests), long key ranges are split across
items and the partial (max, sum, acc) are merged exactly afterwards. Each item walks its
key range in tiles of 16 keys (a tile never crosses a cache block): scores for all rows
in 512-bit registers, scale / soft-cap / ALiBi / mask, online softmax in fp32 with the
rescale of the accumulator deferred into the P·V pass, which runs over 16-dim columns
with the rows' accumulators in registers.
"""

import math
from dataclasses import dataclass

import numba
import numpy as np
import torch
from numba import prange, types
from numba.extending import overload

from . import _check as C
from ._jit import jit
from .simd import (
    store_f32,
    to_f32,
    vadd,
    vbcast,
    vexp,
    vfma,
    vhmax,
    viota,
    vload,
    vload_pairs,
    vmul,
    vselect_lt,
    vsplat,
    vstore,
    vsub,
    vsum,
    vtanh,
)

KT = 16  # keys per tile: one 16-lane score vector per row
NR = 8  # query rows per register group: 8 score accumulators
NRI = 64  # query rows per work item (GQA group x positions): each K/V tile serves them all
SPLIT_KEYS = 512  # a split of a long key range covers at least this many keys
ITEMS_PER_THREAD = 4  # split long ranges until a step has this many items per thread
ATTN_ISAS = ("amx", "vec", "vec16", "neon")
BLOCK_MULTIPLE = {"amx": 32, "vec": 32, "vec16": 16, "neon": 32}
# item columns
I_REQ, I_HK, I_POS, I_NPOS, I_G0, I_NG, I_LO, I_HI, I_PART = range(9)
# merge columns: first partial slot, number of partials, then the item's row description
M_FIRST, M_COUNT, M_REQ, M_HK, M_POS, M_NPOS, M_G0, M_NG = range(8)


# ---------------------------------------------------------------------------------------
# cache layout


def kv_cache_shape(num_blocks, num_kv_heads, block_size, head_dim):
    """``(num_blocks, num_kv_heads, block_size, 2 * head_dim)``, as vLLM 0.32 allocates."""
    for name, v in (("num_blocks", num_blocks), ("num_kv_heads", num_kv_heads),
                    ("block_size", block_size), ("head_dim", head_dim)):  # fmt: skip
        C.check_int(name, v, low=1)
    return (num_blocks, num_kv_heads, block_size, 2 * head_dim)


def split_kv_cache(kv_cache):
    """``(key_cache, value_cache)``: two non-contiguous views ``[num_blocks, Hkv, B, D]``."""
    C.check_dtype("kv_cache", kv_cache, C.FLOATS)
    C.check_ndim("kv_cache", kv_cache, (4,))
    C.check_contiguous("kv_cache", kv_cache)
    nb, hkv, b, d2 = kv_cache.shape
    if d2 % 2:
        raise ValueError(f"kv_cache: expected a last dim of 2*head_dim, got {d2}")
    v = C.as_torch(kv_cache).view(nb, hkv, 2 * b, d2 // 2)
    return v[:, :, :b], v[:, :, b:]


def _k_load(kc, base, d2, toff, b):
    """(K[tile, d=2*d2], K[tile, d=2*d2+1]) for the 16 keys of a tile at block offset toff."""


@overload(_k_load, inline="always")
def _k_load_impl(kc, base, d2, toff, b):
    if kc.dtype == types.uint32:  # amx: [D/2][16][2] per 16 tokens; D = 16 * b_unused
        return lambda kc, base, d2, toff, b: vload_pairs(kc, base + d2 * 16)
    return lambda kc, base, d2, toff, b: (
        vload(kc, base + 2 * d2 * b + toff),
        vload(kc, base + (2 * d2 + 1) * b + toff),
    )


def _v_load(vc, base, c, tpair, d):
    """(V[t=2*tpair, dims c*16:+16], V[t=2*tpair+1, same dims])."""


@overload(_v_load, inline="always")
def _v_load_impl(vc, base, c, tpair, d):
    if vc.dtype == types.uint32:  # amx: base already points at the 16-dim group c
        return lambda vc, base, c, tpair, d: vload_pairs(vc, base + tpair * 16)
    return lambda vc, base, c, tpair, d: (
        vload(vc, base + 2 * tpair * d + c * 16),
        vload(vc, base + (2 * tpair + 1) * d + c * 16),
    )


# ---------------------------------------------------------------------------------------
# kernels


@jit
def _reshape_and_cache(key, value, kc, vc, slots, t_n, hkv, d, b, k_ts, k_hs, v_ts, v_hs,
                       kb_s, kh_s, vb_s, vh_s, amx):  # fmt: skip
    for t in range(t_n):
        s = slots[t]
        if s < 0:
            continue
        blk = s // b
        o = s % b
        for h in range(hkv):
            kbase = blk * kb_s + h * kh_s
            vbase = blk * vb_s + h * vh_s
            for e in range(d):
                kv = key[t * k_ts + h * k_hs + e]
                vv = value[t * v_ts + h * v_hs + e]
                if amx:
                    kc[kbase + (o // 16) * 16 * d + (e // 2) * 32 + (o % 16) * 2 + e % 2] = kv
                    vc[vbase + (e // 16) * b * 16 + (o // 2) * 32 + (e % 16) * 2 + o % 2] = vv
                else:
                    kc[kbase + e * b + o] = kv
                    vc[vbase + o * d + e] = vv


@jit
def _scores(qf, d, r0, r1, r2, r3, r4, r5, r6, r7, kc, kbase, toff, b):
    """Scores of 8 (possibly repeated) rows against the 16 keys of one tile."""
    s0 = vsplat(0.0)
    s1 = vsplat(0.0)
    s2 = vsplat(0.0)
    s3 = vsplat(0.0)
    s4 = vsplat(0.0)
    s5 = vsplat(0.0)
    s6 = vsplat(0.0)
    s7 = vsplat(0.0)
    for d2 in range(d // 2):
        ke, ko = _k_load(kc, kbase, d2, toff, b)
        i = 2 * d2
        s0 = vfma(vbcast(qf, r0 + i + 1), ko, vfma(vbcast(qf, r0 + i), ke, s0))
        s1 = vfma(vbcast(qf, r1 + i + 1), ko, vfma(vbcast(qf, r1 + i), ke, s1))
        s2 = vfma(vbcast(qf, r2 + i + 1), ko, vfma(vbcast(qf, r2 + i), ke, s2))
        s3 = vfma(vbcast(qf, r3 + i + 1), ko, vfma(vbcast(qf, r3 + i), ke, s3))
        s4 = vfma(vbcast(qf, r4 + i + 1), ko, vfma(vbcast(qf, r4 + i), ke, s4))
        s5 = vfma(vbcast(qf, r5 + i + 1), ko, vfma(vbcast(qf, r5 + i), ke, s5))
        s6 = vfma(vbcast(qf, r6 + i + 1), ko, vfma(vbcast(qf, r6 + i), ke, s6))
        s7 = vfma(vbcast(qf, r7 + i + 1), ko, vfma(vbcast(qf, r7 + i), ke, s7))
    return s0, s1, s2, s3, s4, s5, s6, s7


@jit
def _scores4(qf, r0, r1, r2, r3, d, kc, kbase, toff, b):
    """Scores of 4 (possibly repeated) rows: decode with small groups."""
    s0 = vsplat(0.0)
    s1 = vsplat(0.0)
    s2 = vsplat(0.0)
    s3 = vsplat(0.0)
    for d2 in range(d // 2):
        ke, ko = _k_load(kc, kbase, d2, toff, b)
        i = 2 * d2
        s0 = vfma(vbcast(qf, r0 + i + 1), ko, vfma(vbcast(qf, r0 + i), ke, s0))
        s1 = vfma(vbcast(qf, r1 + i + 1), ko, vfma(vbcast(qf, r1 + i), ke, s1))
        s2 = vfma(vbcast(qf, r2 + i + 1), ko, vfma(vbcast(qf, r2 + i), ke, s2))
        s3 = vfma(vbcast(qf, r3 + i + 1), ko, vfma(vbcast(qf, r3 + i), ke, s3))
    return s0, s1, s2, s3


@jit
def _pv(acc, pw, alpha, d, n, vc, vbase, c_stride, b, rows):
    """acc[r] = acc[r] * alpha[r] + P[r] @ V_tile for all rows, 16 dims at a time.

    Even and odd keys accumulate separately (16 accumulators): one chain of dependent
    FMAs per accumulator and key pair would otherwise bound the loop by FMA latency.
    """
    last = rows - 1
    r1 = min(1, last) * KT
    r2 = min(2, last) * KT
    r3 = min(3, last) * KT
    r4 = min(4, last) * KT
    r5 = min(5, last) * KT
    r6 = min(6, last) * KT
    r7 = min(7, last) * KT
    for c in range(d // 16):
        cb = vbase + c * c_stride
        a0 = vsplat(0.0)
        a1 = vsplat(0.0)
        a2 = vsplat(0.0)
        a3 = vsplat(0.0)
        a4 = vsplat(0.0)
        a5 = vsplat(0.0)
        a6 = vsplat(0.0)
        a7 = vsplat(0.0)
        b0 = vsplat(0.0)
        b1 = vsplat(0.0)
        b2 = vsplat(0.0)
        b3 = vsplat(0.0)
        b4 = vsplat(0.0)
        b5 = vsplat(0.0)
        b6 = vsplat(0.0)
        b7 = vsplat(0.0)
        for tp in range(n // 2):
            ve, vo = _v_load(vc, cb, c, tp, d)
            i = 2 * tp
            a0 = vfma(vbcast(pw, i), ve, a0)
            b0 = vfma(vbcast(pw, i + 1), vo, b0)
            a1 = vfma(vbcast(pw, r1 + i), ve, a1)
            b1 = vfma(vbcast(pw, r1 + i + 1), vo, b1)
            a2 = vfma(vbcast(pw, r2 + i), ve, a2)
            b2 = vfma(vbcast(pw, r2 + i + 1), vo, b2)
            a3 = vfma(vbcast(pw, r3 + i), ve, a3)
            b3 = vfma(vbcast(pw, r3 + i + 1), vo, b3)
            a4 = vfma(vbcast(pw, r4 + i), ve, a4)
            b4 = vfma(vbcast(pw, r4 + i + 1), vo, b4)
            a5 = vfma(vbcast(pw, r5 + i), ve, a5)
            b5 = vfma(vbcast(pw, r5 + i + 1), vo, b5)
            a6 = vfma(vbcast(pw, r6 + i), ve, a6)
            b6 = vfma(vbcast(pw, r6 + i + 1), vo, b6)
            a7 = vfma(vbcast(pw, r7 + i), ve, a7)
            b7 = vfma(vbcast(pw, r7 + i + 1), vo, b7)
        o = c * 16  # repeated rows (past ``last``) are not written: their sums are copies
        _acc_update(acc, o, alpha[0], vadd(a0, b0))
        if last >= 1:
            _acc_update(acc, d + o, alpha[1], vadd(a1, b1))
        if last >= 2:
            _acc_update(acc, 2 * d + o, alpha[2], vadd(a2, b2))
        if last >= 3:
            _acc_update(acc, 3 * d + o, alpha[3], vadd(a3, b3))
        if last >= 4:
            _acc_update(acc, 4 * d + o, alpha[4], vadd(a4, b4))
        if last >= 5:
            _acc_update(acc, 5 * d + o, alpha[5], vadd(a5, b5))
        if last >= 6:
            _acc_update(acc, 6 * d + o, alpha[6], vadd(a6, b6))
        if last >= 7:
            _acc_update(acc, 7 * d + o, alpha[7], vadd(a7, b7))


@jit(inline="always")
def _acc_update(acc, o, a, v):
    vstore(acc, o, vfma(vload(acc, o), vsplat(a), v))


@jit
def _pv4(acc, pw, alpha, d, n, vc, vbase, c_stride, b, rows):
    """``_pv`` for up to 4 rows (decode with small groups)."""
    last = rows - 1
    r1 = min(1, last)
    r2 = min(2, last)
    r3 = min(3, last)
    for c in range(d // 16):
        o = c * 16
        a0 = vmul(vload(acc, o), vsplat(alpha[0]))
        a1 = vmul(vload(acc, r1 * d + o), vsplat(alpha[r1]))
        a2 = vmul(vload(acc, r2 * d + o), vsplat(alpha[r2]))
        a3 = vmul(vload(acc, r3 * d + o), vsplat(alpha[r3]))
        cb = vbase + c * c_stride
        for tp in range(n // 2):
            ve, vo = _v_load(vc, cb, c, tp, d)
            i = 2 * tp
            a0 = vfma(vbcast(pw, i + 1), vo, vfma(vbcast(pw, i), ve, a0))
            a1 = vfma(vbcast(pw, r1 * KT + i + 1), vo, vfma(vbcast(pw, r1 * KT + i), ve, a1))
            a2 = vfma(vbcast(pw, r2 * KT + i + 1), vo, vfma(vbcast(pw, r2 * KT + i), ve, a2))
            a3 = vfma(vbcast(pw, r3 * KT + i + 1), vo, vfma(vbcast(pw, r3 * KT + i), ve, a3))
        vstore(acc, r3 * d + o, a3)
        vstore(acc, r2 * d + o, a2)
        vstore(acc, r1 * d + o, a1)
        vstore(acc, o, a0)


@jit(inline="always")
def _softmax_tile(s, r, j0, lo, hi, pos, slope, softcap, m, l, alpha, pw):
    """Transform, mask and fold one row's 16 scores into its online softmax state."""
    if softcap != 0.0:
        s = vmul(vtanh(vmul(s, vsplat(1.0 / softcap))), vsplat(softcap))
    jv = vfma(vsplat(1.0), viota(), vsplat(float(j0)))
    if slope != 0.0:
        s = vfma(vsplat(slope), vsub(jv, vsplat(float(pos))), s)
    ninf = vsplat(-np.inf)
    s = vselect_lt(jv, vsplat(float(lo)), ninf, s)
    s = vselect_lt(jv, vsplat(float(hi)), s, ninf)
    mt = vhmax(s)
    if mt == -np.inf:
        alpha[r] = 1.0
        vstore(pw, r * KT, vsplat(0.0))
        return
    m_old = m[r]
    m_new = max(m_old, mt)
    # the rescale factor only changes when the running max does (most tiles of a row)
    a = 1.0 if m_new == m_old else (math.exp(m_old - m_new) if m_old > -np.inf else 0.0)
    p = vexp(vsub(s, vsplat(m_new)))
    alpha[r] = a
    l[r] = l[r] * a + vsum(p)
    m[r] = m_new
    vstore(pw, r * KT, p)


@jit
def _row_info(r, ng, req, hk, pos0, g0, grp, ctx, kv_len, causal, window):
    """(query position, q head, first visible key, end of visible keys) of an item row."""
    pi = r // ng
    h = hk * grp + g0 + r % ng
    p = ctx + pos0 + pi
    lo = max(0, p - window + 1) if window > 0 else 0
    if causal:
        hi = p + 1
    elif window > 0:
        hi = p + window
    else:
        hi = kv_len
    return p, h, lo, min(hi, kv_len)


@jit
def _item(it, items, q, kc, vc, out, qsl, seq_lens, bt, part_m, part_l, part_acc, scale,
          causal, window, softcap, alibi, has_alibi, sinks, has_sinks, hq, hkv, d, b,
          q_ts, q_hs, o_ts, o_hs, kb_s, kh_s, vb_s, vh_s, v_cs, amx):  # fmt: skip
    req = items[it, I_REQ]
    hk = items[it, I_HK]
    pos0 = items[it, I_POS]
    npos = items[it, I_NPOS]
    g0 = items[it, I_G0]
    ng = items[it, I_NG]
    key_lo = items[it, I_LO]
    key_hi = items[it, I_HI]
    part = items[it, I_PART]
    grp = hq // hkv
    q_len = qsl[req + 1] - qsl[req]
    kv_len = np.int64(seq_lens[req])
    ctx = kv_len - q_len
    rows = npos * ng
    qf = np.empty(NRI * d, np.float32)
    acc = np.zeros(NRI * d, np.float32)
    pw = np.zeros(NRI * KT, np.float32)
    m = np.full(NRI, -np.inf, np.float32)
    l = np.zeros(NRI, np.float32)
    alpha = np.ones(NRI, np.float32)
    info = np.empty((NRI, 4), np.int64)
    slopes = np.zeros(NRI, np.float32)
    for r in range(rows):
        p, h, lo, hi = _row_info(r, ng, req, hk, pos0, g0, grp, ctx, kv_len, causal, window)
        info[r, 0] = p
        info[r, 1] = h
        info[r, 2] = lo
        info[r, 3] = hi
        if has_alibi:
            slopes[r] = alibi[h]
        t = qsl[req] + pos0 + r // ng
        for e in range(d):
            qf[r * d + e] = to_f32(q, t * q_ts + h * q_hs + e) * scale
    ro = np.empty(NR, np.int64)
    j0 = key_lo - key_lo % KT
    while j0 < key_hi:
        blk = j0 // b
        toff = j0 % b
        pb = np.int64(bt[req, blk])
        kbase = pb * kb_s + hk * kh_s
        vbase = pb * vb_s + hk * vh_s
        if amx:  # the tile's 16-token group of K, its token pairs of V
            kbase += (toff // 16) * 8 * d
            vbase += (toff // 2) * 16
        vb = vbase if amx else vbase + toff * d
        cs = v_cs if amx else 0
        # row groups of NR rows share each K/V tile while it is in L1
        for rg in range(0, rows, NR):
            gr = min(NR, rows - rg)
            seen = False
            for i in range(gr):
                seen = seen or (info[rg + i, 2] < j0 + KT and info[rg + i, 3] > j0)
            if not seen:  # every row of the group masks this whole tile
                continue
            for i in range(NR):
                ro[i] = (rg + min(i, gr - 1)) * d
            if gr <= 4:
                s0, s1, s2, s3 = _scores4(qf, ro[0], ro[1], ro[2], ro[3], d, kc, kbase, toff, b)
                s4, s5, s6, s7 = s0, s1, s2, s3
            else:
                s0, s1, s2, s3, s4, s5, s6, s7 = _scores(
                    qf, d, ro[0], ro[1], ro[2], ro[3], ro[4], ro[5], ro[6], ro[7], kc, kbase,
                    toff, b,
                )  # fmt: skip
            for i in range(gr):
                s = s0
                if i == 1:
                    s = s1
                elif i == 2:
                    s = s2
                elif i == 3:
                    s = s3
                elif i == 4:
                    s = s4
                elif i == 5:
                    s = s5
                elif i == 6:
                    s = s6
                elif i == 7:
                    s = s7
                r = rg + i
                _softmax_tile(s, r, j0, info[r, 2], info[r, 3], info[r, 0], slopes[r], softcap,
                              m, l, alpha, pw)  # fmt: skip
            acc_g = acc[rg * d :]
            pw_g = pw[rg * KT :]
            al_g = alpha[rg:]
            if gr <= 4:
                _pv4(acc_g, pw_g, al_g, d, KT, vc, vb, cs, b, gr)
            else:
                _pv(acc_g, pw_g, al_g, d, KT, vc, vb, cs, b, gr)
        j0 += KT
    for r in range(rows):
        h = info[r, 1]
        if part >= 0:  # a split: leave the unnormalised partial for the merge
            slot = part * NRI + r
            part_m[slot] = m[r]
            part_l[slot] = l[r]
            for e in range(d):
                part_acc[slot * d + e] = acc[r * d + e]
            continue
        _finish(out, (qsl[req] + pos0 + r // ng) * o_ts + h * o_hs, acc, r * d, m[r], l[r],
                sinks, has_sinks, h, d)  # fmt: skip


@jit
def _finish(out, o, acc, a0, m, l, sinks, has_sinks, h, d):
    """out = acc / l (with the sink's extra logit), rounded to the output dtype."""
    scale_acc = 1.0
    if has_sinks:
        sink = to_f32(sinks, h)
        m_new = max(m, sink)
        scale_acc = math.exp(m - m_new) if m > -np.inf else 0.0
        l = l * scale_acc + math.exp(sink - m_new)
    inv = scale_acc / l if l > 0.0 else 0.0
    for e in range(d):
        store_f32(out, o + e, acc[a0 + e] * inv)


@jit
def _merge(mg, merges, out, qsl, part_m, part_l, part_acc, sinks, has_sinks, hq, hkv, d,
           o_ts, o_hs):  # fmt: skip
    first = merges[mg, M_FIRST]
    count = merges[mg, M_COUNT]
    req = merges[mg, M_REQ]
    hk = merges[mg, M_HK]
    pos0 = merges[mg, M_POS]
    ng = merges[mg, M_NG]
    rows = merges[mg, M_NPOS] * ng
    grp = hq // hkv
    acc = np.zeros(d, np.float32)
    for r in range(rows):
        mx = -np.inf
        for i in range(count):
            mx = max(mx, part_m[(first + i) * NRI + r])
        lsum = 0.0
        for e in range(d):
            acc[e] = 0.0
        for i in range(count):
            slot = (first + i) * NRI + r
            if part_m[slot] == -np.inf:
                continue
            w = math.exp(part_m[slot] - mx)
            lsum += part_l[slot] * w
            for e in range(d):
                acc[e] += part_acc[slot * d + e] * w
        h = hk * grp + merges[mg, M_G0] + r % ng
        _finish(out, (qsl[req] + pos0 + r // ng) * o_ts + h * o_hs, acc, 0, mx, lsum, sinks,
                has_sinks, h, d)  # fmt: skip


@jit(parallel=True)
def _attention(q, kc, vc, out, qsl, seq_lens, bt, items, merges, part_m, part_l, part_acc,
               scale, causal, window, softcap, alibi, has_alibi, sinks, has_sinks, hq, hkv,
               d, b, q_ts, q_hs, o_ts, o_hs, kb_s, kh_s, vb_s, vh_s, v_cs, amx):  # fmt: skip
    for it in prange(items.shape[0]):
        _item(it, items, q, kc, vc, out, qsl, seq_lens, bt, part_m, part_l, part_acc, scale,
              causal, window, softcap, alibi, has_alibi, sinks, has_sinks, hq, hkv, d, b,
              q_ts, q_hs, o_ts, o_hs, kb_s, kh_s, vb_s, vh_s, v_cs, amx)  # fmt: skip
    for mg in prange(merges.shape[0]):
        _merge(mg, merges, out, qsl, part_m, part_l, part_acc, sinks, has_sinks, hq, hkv, d,
               o_ts, o_hs)  # fmt: skip


# ---------------------------------------------------------------------------------------
# plan


@dataclass(frozen=True, eq=False)
class AttentionPlan:
    """The work split of one step, built and validated once, reused by every layer.

    ``items [n, 9]`` int64: request, kv head, first query position, positions, first q
    head of the group, heads, key range [lo, hi), partial slot (-1: writes the output).
    ``merges [m, 8]``: first partial slot, count, and the rows they merge into.
    """

    items: np.ndarray
    merges: np.ndarray
    num_partials: int
    num_requests: int
    num_tokens: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    causal: bool
    sliding_window: int
    isa: str
    # (tensor, its version counter, num_blocks) of a block table validated with the plan
    block_table_checked: tuple | None = None

    def blocks_visited(self):
        """Cache blocks read per kv head (an item's key range, in blocks)."""
        lo = self.items[:, I_LO] // self.block_size
        hi = (self.items[:, I_HI] + self.block_size - 1) // self.block_size
        return int(np.maximum(hi - lo, 0).sum())


def _check_config(num_heads, num_kv_heads, head_dim, block_size, sliding_window, isa):
    hq = C.check_int("num_heads", num_heads, low=1)
    hkv = C.check_int("num_kv_heads", num_kv_heads, low=1)
    if hq % hkv:
        raise ValueError(f"num_heads: expected a multiple of num_kv_heads={hkv}, got {hq}")
    if isa not in ATTN_ISAS:
        raise ValueError(f"isa: expected one of {ATTN_ISAS}, got {isa!r}")
    d = C.check_int("head_dim", head_dim, low=16)
    dmul = 32 if isa == "amx" else 16
    if d % dmul or d > 512:
        raise ValueError(f"head_dim: expected a multiple of {dmul} up to 512 for {isa}, got {d}")
    b = C.check_int("block_size", block_size, low=1)
    if b % BLOCK_MULTIPLE[isa]:
        raise ValueError(
            f"block_size: expected a multiple of {BLOCK_MULTIPLE[isa]} for isa {isa!r}, got {b}"
        )
    w = C.check_int("sliding_window", sliding_window)
    if w == 0 or w < -1:
        raise ValueError(f"sliding_window: expected -1 (none) or >= 1, got {w}")
    return hq, hkv, d, b, w


def _index_array(name, x, dtype, ndim):
    C.check_dtype(name, x, (dtype,))
    C.check_ndim(name, x, (ndim,))
    return C.as_torch(x).contiguous()


def plan_attention(query_start_loc, seq_lens, *, num_heads, num_kv_heads, head_dim,
                   block_size, causal=True, sliding_window=-1, isa, num_threads=None,
                   block_table=None, num_blocks=None):  # fmt: skip
    """Validate a step's request layout and split its attention into work items.

    ``query_start_loc [R+1]`` int32 (non-decreasing, from 0), ``seq_lens [R]`` int32
    (each >= its q_len). The plan is reused by every layer's :func:`paged_attention` of
    the step; ``num_threads`` (default: Numba's) decides how far long ranges are split.
    With ``block_table`` and ``num_blocks`` the table is validated here, once, and the
    layers' calls with this plan and this (unmodified) table skip that check.
    """
    hq, hkv, d, b, w = _check_config(num_heads, num_kv_heads, head_dim, block_size,
                                     sliding_window, isa)  # fmt: skip
    qsl = _index_array("query_start_loc", query_start_loc, torch.int32, 1).long().numpy()
    sl = _index_array("seq_lens", seq_lens, torch.int32, 1).long().numpy()
    r_n = sl.shape[0]
    if qsl.shape[0] != r_n + 1:
        raise ValueError(f"query_start_loc: expected {r_n + 1} entries (R+1), got {qsl.shape[0]}")
    if qsl.shape[0] and qsl[0] != 0:
        raise ValueError(f"query_start_loc: expected to start at 0, got {qsl[0]}")
    q_len = np.diff(qsl)
    if (q_len < 0).any():
        r = int(np.argmax(q_len < 0))
        raise ValueError(
            f"query_start_loc: expected non-decreasing, got {qsl[r]} then {qsl[r + 1]}"
        )
    if (q_len > sl).any():
        r = int(np.argmax(q_len > sl))
        raise ValueError(f"seq_lens: request {r} has q_len {q_len[r]} > seq_len {sl[r]}")
    grp = hq // hkv
    ng = min(grp, NRI)
    npos_max = max(1, NRI // ng)
    rows = []
    for r in range(r_n):
        ql, kl = int(q_len[r]), int(sl[r])
        if ql == 0:
            continue
        ctx = kl - ql
        pos0 = np.arange(0, ql, npos_max)
        npos = np.minimum(npos_max, ql - pos0)
        first = ctx + pos0
        last = first + npos - 1
        lo = np.maximum(0, first - w + 1) if w > 0 else np.zeros_like(first)
        if causal:
            hi = last + 1
        elif w > 0:
            hi = np.minimum(kl, last + w)
        else:
            hi = np.full_like(first, kl)
        for hk in range(hkv):
            for g0 in range(0, grp, ng):
                blk = np.empty((len(pos0), 9), np.int64)
                blk[:, I_REQ] = r
                blk[:, I_HK] = hk
                blk[:, I_POS] = pos0
                blk[:, I_NPOS] = npos
                blk[:, I_G0] = g0
                blk[:, I_NG] = min(ng, grp - g0)
                blk[:, I_LO] = lo
                blk[:, I_HI] = hi
                blk[:, I_PART] = -1
                rows.append(blk)
    items = np.concatenate(rows) if rows else np.zeros((0, 9), np.int64)
    threads = numba.get_num_threads() if num_threads is None else int(num_threads)
    items, merges, n_part = _split(items, ITEMS_PER_THREAD * threads)
    checked = None
    if block_table is not None:
        nb = C.check_int("num_blocks", num_blocks, low=1)
        bt = _check_block_table(block_table, seq_lens, b, nb, r_n)
        if bt is block_table:  # already an int32 contiguous tensor: remember it
            checked = (block_table, block_table._version, nb)
    return AttentionPlan(items=items, merges=merges, num_partials=n_part, num_requests=r_n,
                         num_tokens=int(qsl[-1]) if r_n else 0, num_heads=hq,
                         num_kv_heads=hkv, head_dim=d, block_size=b, causal=bool(causal),
                         sliding_window=w, isa=isa, block_table_checked=checked)  # fmt: skip


def _split(items, target):
    """Split long key ranges until there are ``target`` items (or ranges get short)."""
    n = items.shape[0]
    if n == 0 or n >= target:
        return items, np.zeros((0, 8), np.int64), 0
    want = -(-target // n)
    out, merges = [], []
    n_part = 0
    for row in items:
        span = row[I_HI] - row[I_LO]
        pieces = int(min(want, span // SPLIT_KEYS))
        if pieces <= 1:
            out.append(row[None])
            continue
        step = -(-span // pieces)
        step += (-step) % KT  # split points on tile boundaries
        starts = np.arange(row[I_LO], row[I_HI], step)
        parts = np.repeat(row[None], len(starts), axis=0)
        parts[:, I_LO] = starts
        parts[:, I_HI] = np.minimum(starts + step, row[I_HI])
        parts[:, I_PART] = np.arange(n_part, n_part + len(starts))
        out.append(parts)
        merges.append([n_part, len(starts), row[I_REQ], row[I_HK], row[I_POS], row[I_NPOS],
                       row[I_G0], row[I_NG]])  # fmt: skip
        n_part += len(starts)
    merges = np.array(merges, np.int64).reshape(-1, 8)
    return np.concatenate(out), merges, n_part


# ---------------------------------------------------------------------------------------
# public ops


def _flat(name, x, carrier_pairs):
    """The cache view's memory as one 1-D array from its first element, and its strides."""
    st = C.strides_of(x)
    span = (x.shape[0] - 1) * st[0] + (x.shape[1] - 1) * st[1] + x.shape[2] * x.shape[3]
    flat = C.as_numpy(x.as_strided((span,), (1,)))
    if carrier_pairs:
        return flat.view(np.uint32), st[0] // 2, st[1] // 2
    return flat, st[0], st[1]


def _check_cache(name, cache, dtype, shape, isa):
    C.check_dtype(name, cache, C.FLOATS)
    if not isinstance(cache, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor view of the KV cache")
    if dtype is not None and cache.dtype != dtype:
        raise TypeError(
            f"{name}: expected dtype {C.dtype_name(dtype)}, got {C.dtype_name(cache.dtype)}"
        )
    C.check_ndim(name, cache, (4,))
    if shape is not None:
        C.check_shape(name, cache, shape)
    nb, hkv, b, d = cache.shape
    st = cache.stride()
    if st[3] != 1 or st[2] != d:
        raise ValueError(
            f"{name}: expected each (block, head) half-slab contiguous (strides [*, *, {d}, 1]), "
            f"got strides {list(st)}"
        )
    if isa == "amx" and cache.dtype != torch.bfloat16:
        raise TypeError(
            f"{name}: isa 'amx' needs a bfloat16 cache, got {C.dtype_name(cache.dtype)}"
        )
    return nb, hkv, b, d


def reshape_and_cache(key, value, key_cache, value_cache, slot_mapping, isa):
    """Write ``key``/``value [T, Hkv, D]`` into the cache at ``slot_mapping [T]`` (int64;
    slot s -> block s // B, offset s % B; negative slots are skipped) in ``isa``'s layout.
    """
    if isa not in ATTN_ISAS:
        raise ValueError(f"isa: expected one of {ATTN_ISAS}, got {isa!r}")
    nb, hkv, b, d = _check_cache("key_cache", key_cache, None, None, isa)
    _check_cache("value_cache", value_cache, key_cache.dtype, (nb, hkv, b, d), isa)
    _check_config(hkv, hkv, d, b, -1, isa)
    for name, x in (("key", key), ("value", value)):
        C.check_same_dtype(name, x, key_cache.dtype, "the cache")
        C.check_ndim(name, x, (3,))
        C.check_inner_contiguous(name, x)
    t_n = key.shape[0]
    C.check_shape("key", key, (t_n, hkv, d))
    C.check_shape("value", value, (t_n, hkv, d))
    C.check_dtype("slot_mapping", slot_mapping, (torch.int64,))
    C.check_shape("slot_mapping", slot_mapping, (t_n,))
    slots = C.as_torch(slot_mapping).contiguous()
    if t_n and int(slots.max()) >= nb * b:
        raise ValueError(
            f"slot_mapping: expected slots < num_blocks * block_size = {nb * b}, "
            f"got {int(slots.max())}"
        )
    if t_n == 0:
        return
    amx = isa == "amx"
    kc, kb_s, kh_s = _flat("key_cache", key_cache, False)
    vc, vb_s, vh_s = _flat("value_cache", value_cache, False)
    ks, vs = C.strides_of(key), C.strides_of(value)
    kspan = C.as_torch(key).as_strided(((t_n - 1) * ks[0] + (hkv - 1) * ks[1] + d,), (1,))
    vspan = C.as_torch(value).as_strided(((t_n - 1) * vs[0] + (hkv - 1) * vs[1] + d,), (1,))
    _reshape_and_cache(C.as_numpy(kspan), C.as_numpy(vspan), kc, vc, slots.numpy(), t_n, hkv,
                       d, b, ks[0], ks[1], vs[0], vs[1], kb_s, kh_s, vb_s, vh_s, amx)  # fmt: skip


def _check_block_table(block_table, seq_lens, b, nb, r_n):
    bt = _index_array("block_table", block_table, torch.int32, 2)
    if bt.shape[0] != r_n:
        raise ValueError(f"block_table: expected {r_n} rows (one per request), got {bt.shape[0]}")
    sl = C.as_torch(seq_lens).long()
    need = (sl + b - 1) // b
    if r_n and int(need.max()) > bt.shape[1]:
        r = int(torch.argmax(need))
        raise ValueError(
            f"seq_lens: request {r} needs {int(need[r])} blocks of {b}, but block_table holds "
            f"{bt.shape[1]} per request"
        )
    used = torch.arange(bt.shape[1])[None, :] < need[:, None]
    vals = bt[used]
    if vals.numel() and (int(vals.min()) < 0 or int(vals.max()) >= nb):
        raise ValueError(
            f"block_table: expected entries in [0, {nb}) for the blocks in use, got range "
            f"[{int(vals.min())}, {int(vals.max())}]"
        )
    return bt


def paged_attention(query, key_cache, value_cache, output, query_start_loc, seq_lens,
                    block_table, *, scale, causal=True, sliding_window=-1, softcap=0.0,
                    alibi_slopes=None, sinks=None, isa, plan=None):  # fmt: skip
    """Attention of a varlen batch over the paged cache, into ``output`` (module docstring)."""
    C.check_dtype("query", query, C.FLOATS)
    C.check_ndim("query", query, (3,))
    C.check_inner_contiguous("query", query)
    t_n, hq, d = query.shape
    nb, hkv, b, dk = _check_cache("key_cache", key_cache, query.dtype, None, isa)
    _check_cache("value_cache", value_cache, query.dtype, (nb, hkv, b, dk), isa)
    if dk != d:
        raise ValueError(f"key_cache: expected head_dim {d} (that of query), got {dk}")
    C.check_same_dtype("output", output, query.dtype, "query")
    C.check_shape("output", output, (t_n, hq, d))
    C.check_inner_contiguous("output", output)
    if plan is None:
        plan = plan_attention(query_start_loc, seq_lens, num_heads=hq, num_kv_heads=hkv,
                              head_dim=d, block_size=b, causal=causal,
                              sliding_window=sliding_window, isa=isa)  # fmt: skip
    else:
        want = (plan.num_heads, plan.num_kv_heads, plan.head_dim, plan.block_size,
                plan.causal, plan.sliding_window, plan.isa)  # fmt: skip
        got = (hq, hkv, d, b, bool(causal), sliding_window, isa)
        if want != got:
            raise ValueError(
                f"plan: built for (heads, kv heads, head_dim, block_size, causal, window, isa)"
                f" = {want}, used with {got}"
            )
        shapes = (tuple(query_start_loc.shape), tuple(seq_lens.shape), t_n)
        if shapes != ((plan.num_requests + 1,), (plan.num_requests,), plan.num_tokens):
            raise ValueError(
                f"plan: built for {plan.num_requests} requests and {plan.num_tokens} tokens, "
                f"used with query_start_loc {list(query_start_loc.shape)}, seq_lens "
                f"{list(seq_lens.shape)} and {t_n} tokens"
            )
    if plan.num_tokens != t_n:
        raise ValueError(
            f"query: expected {plan.num_tokens} tokens (query_start_loc[-1]), got {t_n}"
        )
    ck = plan.block_table_checked
    if ck is not None and ck[0] is block_table and ck[1] == block_table._version and ck[2] == nb:
        bt = block_table  # validated with the plan, unmodified since
    else:
        bt = _check_block_table(block_table, seq_lens, b, nb, plan.num_requests)
    extras = _extras(alibi_slopes, sinks, hq)
    if t_n == 0 or plan.items.shape[0] == 0:
        return
    amx = isa == "amx"
    kc, kb_s, kh_s = _flat("key_cache", key_cache, amx)
    vc, vb_s, vh_s = _flat("value_cache", value_cache, amx)
    qs, os_ = C.strides_of(query), C.strides_of(output)
    qspan = C.as_torch(query).as_strided(((t_n - 1) * qs[0] + (hq - 1) * qs[1] + d,), (1,))
    ospan = C.as_torch(output).as_strided(((t_n - 1) * os_[0] + (hq - 1) * os_[1] + d,), (1,))
    _launch(plan, C.as_numpy(qspan), (qs[0], qs[1]), C.as_numpy(ospan), (os_[0], os_[1]),
            (kc, kb_s, kh_s), (vc, vb_s, vh_s), C.as_torch(query_start_loc).long().numpy(),
            C.as_numpy(C.as_torch(seq_lens)), C.as_numpy(bt), scale, softcap, extras,
            bool(causal), int(sliding_window), hkv, b, amx)  # fmt: skip


def _extras(alibi_slopes, sinks, hq):
    """Validated ALiBi slopes and sinks as fp32 arrays (empty when absent) and their flags."""
    empty = np.zeros(0, np.float32)
    alibi = sink_a = empty
    if alibi_slopes is not None:
        C.check_dtype("alibi_slopes", alibi_slopes, (torch.float32,))
        C.check_shape("alibi_slopes", alibi_slopes, (hq,))
        alibi = C.as_numpy(C.as_torch(alibi_slopes).contiguous())
    if sinks is not None:
        C.check_dtype("sinks", sinks, (torch.float32, torch.bfloat16))
        C.check_shape("sinks", sinks, (hq,))
        sink_a = C.as_numpy(C.as_torch(sinks).float().contiguous())
    return alibi, alibi_slopes is not None, sink_a, sinks is not None


def _launch(plan, q, q_st, out, o_st, kcache, vcache, qsl, sl, bt, scale, softcap, extras,
            causal, window, hkv, b, amx):  # fmt: skip
    """Run the kernel for a validated call: partial buffers for the plan's splits."""
    d = plan.head_dim
    n_part = max(plan.num_partials, 1) * NRI
    part_m = np.empty(n_part, np.float32)
    part_l = np.empty(n_part, np.float32)
    part_acc = np.empty(n_part * d, np.float32)
    kc, kb_s, kh_s = kcache
    vc, vb_s, vh_s = vcache
    _attention(q, kc, vc, out, qsl, sl, bt, plan.items, plan.merges, part_m, part_l, part_acc,
               float(scale), causal, window, float(softcap), *extras, plan.num_heads, hkv, d,
               b, q_st[0], q_st[1], o_st[0], o_st[1], kb_s, kh_s, vb_s, vh_s, b * 8,
               amx)  # fmt: skip


# ---------------------------------------------------------------------------------------
# the engine's fast path: a layer's cache and a step's indices, each validated once


@dataclass(frozen=True, eq=False)
class StepIndices:
    """A step's indices as validated NumPy arrays, shared by every layer of the step.

    Built by :func:`step_indices`; ``query_start_loc``/``seq_lens``/``block_table``/
    ``slot_mapping`` as in :func:`paged_attention` and :func:`reshape_and_cache`.
    """

    plan: AttentionPlan
    qsl: np.ndarray  # [R+1] int64
    seq_lens: np.ndarray  # [R] int32
    block_table: np.ndarray  # [R, max_blocks] int32
    slots: np.ndarray  # [T] int64
    num_blocks: int


def step_indices(plan, query_start_loc, seq_lens, block_table, slot_mapping, num_blocks):
    """Validate a step's indices once (block table entries and slots against
    ``num_blocks``) for :class:`PagedLayerCache` calls with ``plan``."""
    nb = C.check_int("num_blocks", num_blocks, low=1)
    bt = _check_block_table(block_table, seq_lens, plan.block_size, nb, plan.num_requests)
    C.check_dtype("slot_mapping", slot_mapping, (torch.int64,))
    C.check_shape("slot_mapping", slot_mapping, (plan.num_tokens,))
    slots = C.as_torch(slot_mapping).contiguous()
    if plan.num_tokens and int(slots.max()) >= nb * plan.block_size:
        raise ValueError(
            f"slot_mapping: expected slots < num_blocks * block_size = "
            f"{nb * plan.block_size}, got {int(slots.max())}"
        )
    qsl = _index_array("query_start_loc", query_start_loc, torch.int32, 1)
    sl = _index_array("seq_lens", seq_lens, torch.int32, 1)
    if tuple(qsl.shape) != (plan.num_requests + 1,) or tuple(sl.shape) != (plan.num_requests,):
        raise ValueError(
            f"plan: built for {plan.num_requests} requests, used with query_start_loc "
            f"{list(qsl.shape)}, seq_lens {list(sl.shape)}"
        )
    return StepIndices(plan, qsl.long().numpy(), sl.numpy(), C.as_numpy(bt), slots.numpy(), nb)


class PagedLayerCache:
    """One layer's KV cache (a ``kv_cache_shape`` tensor) validated once for ``isa``.

    ``write`` and ``attend`` check only the tensors that change per call (dtype, shape,
    contiguity of key/value/query/output); the indices come from :func:`step_indices`.
    A decode step calls them once per layer, where :func:`reshape_and_cache` and
    :func:`paged_attention`, re-deriving views and re-checking everything, cost
    ~0.3 ms each in Python on a 2-core machine.
    """

    def __init__(self, kv_cache, isa):
        if isa not in ATTN_ISAS:
            raise ValueError(f"isa: expected one of {ATTN_ISAS}, got {isa!r}")
        self.key_cache, self.value_cache = split_kv_cache(kv_cache)
        nb, hkv, b, d = _check_cache("kv_cache", self.key_cache, None, None, isa)
        _check_config(hkv, hkv, d, b, -1, isa)
        self.num_blocks, self.hkv, self.b, self.d, self.isa = nb, hkv, b, d, isa
        self.dtype = kv_cache.dtype
        self.amx = isa == "amx"
        # element views (writes) and the kernel's carrier views (reads: pairs for amx)
        self._kw, self._kwb, self._kwh = _flat("key_cache", self.key_cache, False)
        self._vw, self._vwb, self._vwh = _flat("value_cache", self.value_cache, False)
        self._kr, self._krb, self._krh = _flat("key_cache", self.key_cache, self.amx)
        self._vr, self._vrb, self._vrh = _flat("value_cache", self.value_cache, self.amx)

    def _check(self, name, x, shape):
        if not (isinstance(x, torch.Tensor) and x.dtype == self.dtype and x.is_cpu
                and tuple(x.shape) == shape and x.is_contiguous()):  # fmt: skip
            C.check_same_dtype(name, x, self.dtype, "the cache")
            C.check_shape(name, x, shape)
            C.check_contiguous(name, x)

    def _check_plan(self, plan, idx):
        if (plan.num_kv_heads, plan.head_dim, plan.block_size, plan.isa) != (
            self.hkv,
            self.d,
            self.b,
            self.isa,
        ) or idx.num_blocks != self.num_blocks:
            raise ValueError(
                f"plan: built for kv heads {plan.num_kv_heads}, head_dim {plan.head_dim}, "
                f"block {plan.block_size}, isa {plan.isa!r} and {idx.num_blocks} blocks; this "
                f"cache has {self.hkv}, {self.d}, {self.b}, {self.isa!r}, {self.num_blocks}"
            )

    def write(self, key, value, idx):
        """Write ``key``/``value [T, Hkv, D]`` (contiguous) at the step's slots."""
        self._check_plan(idx.plan, idx)
        t_n = idx.plan.num_tokens
        self._check("key", key, (t_n, self.hkv, self.d))
        self._check("value", value, (t_n, self.hkv, self.d))
        if t_n == 0:
            return
        hd = self.hkv * self.d
        _reshape_and_cache(C.as_numpy(key).reshape(-1), C.as_numpy(value).reshape(-1),
                           self._kw, self._vw, idx.slots, t_n, self.hkv, self.d, self.b, hd,
                           self.d, hd, self.d, self._kwb, self._kwh, self._vwb, self._vwh,
                           self.amx)  # fmt: skip

    def attend(self, query, output, idx, *, scale, softcap=0.0, alibi_slopes=None,
               sinks=None):  # fmt: skip
        """``paged_attention`` of ``query [T, Hq, D]`` into ``output`` with the step's plan."""
        plan = idx.plan
        self._check_plan(plan, idx)
        t_n, hq, d = plan.num_tokens, plan.num_heads, self.d
        self._check("query", query, (t_n, hq, d))
        self._check("output", output, (t_n, hq, d))
        extras = _extras(alibi_slopes, sinks, hq)
        if t_n == 0 or plan.items.shape[0] == 0:
            return
        _launch(plan, C.as_numpy(query).reshape(-1), (hq * d, d), C.as_numpy(output).reshape(-1),
                (hq * d, d), (self._kr, self._krb, self._krh), (self._vr, self._vrb, self._vrh),
                idx.qsl, idx.seq_lens, idx.block_table, scale, softcap, extras, plan.causal,
                plan.sliding_window, self.hkv, self.b, self.amx)  # fmt: skip
