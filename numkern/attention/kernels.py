"""The attention kernels: cache write, work items, merges and the parallel step.

Inputs travel in the named tuples below (module level, so Numba's disk cache keys on
them; a call costs ~1 us more than with flat arguments). Entry points, also used by
``numkern.decoder``: :func:`cache_write`, :func:`item`, :func:`merge`; the public ops
(``numkern.attention.ops``) validate everything before calling them.
"""

import math
from typing import NamedTuple

import numpy as np
from numba import prange, types
from numba.extending import overload

from .. import amx
from .. import amx_gemm as tiles
from .._jit import jit
from ..simd import (
    fetch_add,
    to_f32,
    vadd,
    vexp,
    vfma,
    vhmax,
    viota,
    vload,
    vmul,
    vselect_lt,
    vsplat,
    vstore,
    vsub,
    vsum,
    vtanh,
)
from .tiles import KT, PREFILL, Source, Tile, pv4, pv_group, qk4, qk8, qk_group, stage, stage_v

KS = 256  # keys per super-tile of a prefill item at head_dim <= 128 (scaled by 128/head_dim
# above): widened once, one softmax pass per row group
NR = 8  # query rows per register group of a decode item: 16 score accumulators
PR = PREFILL.group_rows  # query rows per group of a prefill item, and rows of its P·V
PV = PREFILL.pv_rows  # tiles (isa.PREFILL_TILES: 8 and 4 with AVX-512, 6 and 6 without)
WORKERS = 256  # item loops of the dynamic schedule (at least the thread count)
# item columns
I_REQ, I_HK, I_POS, I_NPOS, I_G0, I_NG, I_LO, I_HI, I_PART = range(9)
# merge columns: first partial slot, number of partials, then the item's row description
M_FIRST, M_COUNT, M_REQ, M_HK, M_POS, M_NPOS, M_G0, M_NG = range(8)


class CacheLayout(NamedTuple):  # one layer's K/V cache as the kernels address it
    block_size: int
    k_block: int  # strides of key_cache between blocks and between kv heads, in 16-bit
    k_head: int  # (or fp32) elements
    v_block: int
    v_head: int
    v_chunk: int  # amx: elements between 16-dim groups of V (16 * block_size); vec: unused
    amx: bool


class Heads(NamedTuple):
    num_heads: int
    num_kv_heads: int
    head_dim: int


class RowStrides(NamedTuple):  # strides (elements) of the query/output rows
    q_token: int
    q_head: int
    o_token: int
    o_head: int


class Scores(NamedTuple):
    scale: float
    causal: bool
    window: int  # -1: none
    softcap: float
    alibi: np.ndarray  # fp32 [Hq] or empty
    has_alibi: bool
    sinks: np.ndarray  # fp32 [Hq] or empty
    has_sinks: bool
    # empty: the prefill's AMX tiles on an amx cache (:func:`tile_witness`): uint8 real,
    # uint16 emulated (numkern.amx); float32 none (the vector tiles)
    tiles: np.ndarray


NO_TILES = np.empty(0, np.float32)
_REAL_TILES = amx.witness(emulate=False)
_EMULATED_TILES = amx.witness(emulate=True)


def tile_witness():
    """The :class:`Scores` ``tiles`` witness of this process: AMX tiles where the host's
    decision runs bf16 GEMMs on them (``isa.decision().gemm == "amx"``), emulated ones
    where the test-only switch asks (``isa.amx_emulated``), else none. Read per call (a
    step's: the switch is an environment variable tests set), allocating nothing."""
    from .. import isa

    if isa.amx_emulated():
        return _EMULATED_TILES
    return _REAL_TILES if isa.decision().gemm == "amx" else NO_TILES


class StepArrays(NamedTuple):  # a plan's arrays for the kernels
    items: np.ndarray
    merges: np.ndarray
    qsl: np.ndarray  # int64 [R+1]
    seq_lens: np.ndarray  # int32 [R]
    block_table: np.ndarray  # int32 [R, max_blocks], validated
    part_m: np.ndarray  # partial results of split items: fresh per call (never shared
    part_l: np.ndarray  # between calls: two threads may use one plan)
    part_acc: np.ndarray


class _Rows(NamedTuple):  # an item's rows: scaled queries, softmax state, accumulators
    qf: np.ndarray  # [rows * d] fp32
    acc: np.ndarray  # [rows * d] fp32
    m: np.ndarray  # [rows] running max
    lv: np.ndarray  # [rows * 16] running sums, 16 lanes each
    info: np.ndarray  # [rows, 4] int64: position, q head, first visible key, end of them
    slopes: np.ndarray  # [rows] ALiBi slope (0: none)


# ---------------------------------------------------------------------------------------
# cache write


@jit
def cache_write(key, value, k_token, k_head, v_token, v_head, kc, vc, slots, t_n, heads, layout):
    """Write ``t_n`` tokens of ``key``/``value`` (1-D carriers, token and head strides
    given) at ``slots`` (int64; negative: skipped) into the element views ``kc``/``vc``
    in the layout's order (docs/kernels.md §6.1)."""
    b, d = layout.block_size, heads.head_dim
    for t in range(t_n):
        s = slots[t]
        if s < 0:
            continue
        blk = s // b
        o = s % b
        for h in range(heads.num_kv_heads):
            kbase = blk * layout.k_block + h * layout.k_head
            vbase = blk * layout.v_block + h * layout.v_head
            for e in range(d):
                kv = key[t * k_token + h * k_head + e]
                vv = value[t * v_token + h * v_head + e]
                if layout.amx:
                    kc[kbase + (o // 16) * 16 * d + (e // 2) * 32 + (o % 16) * 2 + e % 2] = kv
                    vc[vbase + (e // 16) * b * 16 + (o // 2) * 32 + (e % 16) * 2 + o % 2] = vv
                else:
                    kc[kbase + e * b + o] = kv
                    vc[vbase + o * d + e] = vv


# ---------------------------------------------------------------------------------------
# rows, tiles, softmax


@jit
def _row_info(r, ng, hk, pos0, g0, grp, ctx, kv_len, scores):
    """(query position, q head, first visible key, end of visible keys) of an item row."""
    window = scores.window
    pi = r // ng
    h = hk * grp + g0 + r % ng
    p = ctx + pos0 + pi
    lo = max(0, p - window + 1) if window > 0 else 0
    if scores.causal:
        hi = p + 1
    elif window > 0:
        hi = p + window
    else:
        hi = kv_len
    return p, h, lo, min(hi, kv_len)


@jit
def _tile(j0, bt_row, hk, kv_len, layout, d):
    """The :class:`Tile` at key j0 of a request (its block table row) and kv head."""
    b = layout.block_size
    n_keys = min(KT, kv_len - j0)
    pb = np.int64(bt_row[j0 // b])
    off = j0 % b
    ka = pb * layout.k_block + hk * layout.k_head
    va = pb * layout.v_block + hk * layout.v_head
    kb = ka
    vb = va
    off_b = off + 16
    if n_keys > 16 and off_b >= b:  # vec16: half B starts the next block
        pb = np.int64(bt_row[(j0 + 16) // b])
        kb = pb * layout.k_block + hk * layout.k_head
        vb = pb * layout.v_block + hk * layout.v_head
        off_b = 0
    elif off_b >= b:  # no half B: point it at half A (read by QK, masked)
        off_b = off
    if layout.amx:  # 16-token groups of K, token pairs of V
        ka += (off // 16) * 16 * d
        kb += (off_b // 16) * 16 * d
        va += (off // 2) * 32
        vb += (off_b // 2) * 32
    else:
        ka += off
        kb += off_b
        va += off * d
        vb += off_b * d
    return Tile(ka, kb, va, vb, min(n_keys, 16), max(n_keys - 16, 0))


@jit
def _softmax_rows(sbuf, rs, rg, gr, j0, softcap, alpha):
    """Scores of rows rg..rg+gr-1 in ``sbuf`` -> probabilities, online softmax state.

    Transform (soft-cap, ALiBi), mask only tiles a row does not fully see, and fold into
    (max ``rs.m``, 16-lane running sum ``rs.lv``); ``alpha[r]`` is the rescale of the row's
    accumulator, applied in the P·V pass. A fully masked row gets P = 0, alpha = 1.
    """
    info, m, lv = rs.info, rs.m, rs.lv
    ninf = vsplat(-np.inf)
    ja = vfma(vsplat(1.0), viota(), vsplat(float(j0)))
    jb = vadd(ja, vsplat(16.0))
    for i in range(gr):
        r = rg + i
        so = i * KT
        sa = vload(sbuf, so)
        sb = vload(sbuf, so + 16)
        if softcap != 0.0:
            c = vsplat(softcap)
            ic = vsplat(1.0 / softcap)
            sa = vmul(vtanh(vmul(sa, ic)), c)
            sb = vmul(vtanh(vmul(sb, ic)), c)
        slope = rs.slopes[r]
        if slope != 0.0:
            sl = vsplat(slope)
            p = vsplat(float(info[r, 0]))
            sa = vfma(sl, vsub(ja, p), sa)
            sb = vfma(sl, vsub(jb, p), sb)
        lo = info[r, 2]
        hi = info[r, 3]
        if j0 < lo or j0 + KT > hi:
            vlo = vsplat(float(lo))
            vhi = vsplat(float(hi))
            sa = vselect_lt(ja, vhi, vselect_lt(ja, vlo, ninf, sa), ninf)
            sb = vselect_lt(jb, vhi, vselect_lt(jb, vlo, ninf, sb), ninf)
        mt = vhmax(vselect_lt(sa, sb, sb, sa))
        if not mt > -np.inf:  # every lane -inf or NaN (vhmax skips NaN lanes)
            t_sum = vsum(vadd(sa, sb))
            if t_sum == t_sum:  # all -inf: masked, nothing to add
                alpha[r] = 1.0
                vstore(sbuf, so, vsplat(0.0))
                vstore(sbuf, so + 16, vsplat(0.0))
                continue
            m[r] = np.nan  # a NaN score (NaN input): the row's result is NaN
        m_old = m[r]
        a = np.float32(1.0)
        if mt > m_old:
            if m_old > -np.inf:
                a = np.float32(math.exp(m_old - mt))
            else:
                a = np.float32(0.0)
            m[r] = mt
            m_old = mt
        mv = vsplat(m_old)
        pa = vexp(vsub(sa, mv))
        pb = vexp(vsub(sb, mv))
        alpha[r] = a
        vstore(lv, r * 16, vadd(vfma(vload(lv, r * 16), vsplat(a), pa), pb))
        vstore(sbuf, so, pa)
        vstore(sbuf, so + 16, pb)


def _prescale(v, scale, split):
    """A score vector times ``scale`` where ``split`` (the tiles' P terms) is a tuple: the
    tiles' scores are unscaled (a constant choice: the vector path's are scaled)."""


@overload(_prescale, inline="always")
def _prescale_impl(v, scale, split):
    if split is types.none:
        return lambda v, scale, split: v
    return lambda v, scale, split: vmul(v, vsplat(scale))


def _split_store(split, o, p):
    """The probabilities ``p`` as two bf16 terms at ``o`` of ``split = (hi, lo)``: hi =
    bf16(p), lo = bf16(p - hi) (nothing where ``split`` is None)."""


@overload(_split_store, inline="always")
def _split_store_impl(split, o, p):
    if split is types.none:
        return lambda split, o, p: None

    def impl(split, o, p):
        hi, lo = split
        vstore(hi, o, p)
        vstore(lo, o, vsub(p, vload(hi, o)))

    return impl


@jit
def _softmax_wide(sbuf, ss, rs, rg, gr, j0, s_lo, s_hi, softcap, alpha, scale, split):
    """:func:`_softmax_rows` over the 32-key tiles ``s_lo..s_hi-1`` of a super-tile at key
    ``j0`` (row stride ``ss`` in ``sbuf``): one max, one rescale per row for all of them.
    ``split``: None, or the tiles' (hi, lo) bf16 buffers (row stride ``ss``), then the
    scores are multiplied by ``scale`` first and the probabilities also written there
    split in two bf16 terms."""
    info, m, lv = rs.info, rs.m, rs.lv
    ninf = vsplat(-np.inf)
    for i in range(gr):
        r = rg + i
        slope = rs.slopes[r]
        lo = info[r, 2]
        hi = info[r, 3]
        mx = ninf
        for t in range(s_lo, s_hi):
            so = i * ss + t * KT
            jt = j0 + t * KT
            sa = _prescale(vload(sbuf, so), scale, split)
            sb = _prescale(vload(sbuf, so + 16), scale, split)
            edit = split is not None
            if softcap != 0.0:
                c = vsplat(softcap)
                ic = vsplat(1.0 / softcap)
                sa = vmul(vtanh(vmul(sa, ic)), c)
                sb = vmul(vtanh(vmul(sb, ic)), c)
                edit = True
            if slope != 0.0:
                ja = vfma(vsplat(1.0), viota(), vsplat(float(jt)))
                sl = vsplat(slope)
                p = vsplat(float(info[r, 0]))
                sa = vfma(sl, vsub(ja, p), sa)
                sb = vfma(sl, vsub(vadd(ja, vsplat(16.0)), p), sb)
                edit = True
            if jt < lo or jt + KT > hi:
                ja = vfma(vsplat(1.0), viota(), vsplat(float(jt)))
                jb = vadd(ja, vsplat(16.0))
                vlo = vsplat(float(lo))
                vhi = vsplat(float(hi))
                sa = vselect_lt(ja, vhi, vselect_lt(ja, vlo, ninf, sa), ninf)
                sb = vselect_lt(jb, vhi, vselect_lt(jb, vlo, ninf, sb), ninf)
                edit = True
            if edit:
                vstore(sbuf, so, sa)
                vstore(sbuf, so + 16, sb)
            mx = vselect_lt(mx, sa, sa, mx)
            mx = vselect_lt(mx, sb, sb, mx)
        mt = vhmax(mx)
        if not mt > -np.inf:  # every lane -inf or NaN (the max skips NaN lanes)
            t_sum = ninf
            for t in range(s_lo, s_hi):
                so = i * ss + t * KT
                t_sum = vadd(t_sum, vadd(vload(sbuf, so), vload(sbuf, so + 16)))
            if vsum(t_sum) == vsum(t_sum):  # all -inf: masked, nothing to add
                alpha[r] = 1.0
                for t in range(s_lo, s_hi):
                    vstore(sbuf, i * ss + t * KT, vsplat(0.0))
                    vstore(sbuf, i * ss + t * KT + 16, vsplat(0.0))
                    _split_store(split, i * ss + t * KT, vsplat(0.0))
                    _split_store(split, i * ss + t * KT + 16, vsplat(0.0))
                continue
            m[r] = np.nan  # a NaN score (NaN input): the row's result is NaN
        m_old = m[r]
        a = np.float32(1.0)
        if mt > m_old:
            if m_old > -np.inf:
                a = np.float32(math.exp(m_old - mt))
            else:
                a = np.float32(0.0)
            m[r] = mt
            m_old = mt
        mv = vsplat(m_old)
        acc_l = vmul(vload(lv, r * 16), vsplat(a))
        for t in range(s_lo, s_hi):
            so = i * ss + t * KT
            pa = vexp(vsub(vload(sbuf, so), mv))
            pb = vexp(vsub(vload(sbuf, so + 16), mv))
            acc_l = vadd(acc_l, vadd(pa, pb))
            vstore(sbuf, so, pa)
            vstore(sbuf, so + 16, pb)
            _split_store(split, so, pa)
            _split_store(split, so + 16, pb)
        alpha[r] = a
        vstore(lv, r * 16, acc_l)


# ---------------------------------------------------------------------------------------
# an item's key range: decode (one row group) and prefill (several)


@jit
def _decode(rs, rows, src, layout, d, bt_row, hk, kv_len, key_lo, key_hi, softcap):
    """The keys [key_lo, key_hi) of one row group (at most NR rows) tile by tile, straight
    from the cache, prefetching the next tile while this one is computed."""
    sbuf = np.empty(NR * KT, np.float32)  # the group's scores, then probabilities
    alpha = np.ones(rows, np.float32)
    qr = np.empty(NR, np.int64)
    ar = np.empty(4, np.int64)
    pr = np.empty(4, np.int64)
    al = np.empty(4, np.float32)
    gr = rows
    for i in range(NR):
        qr[i] = min(i, gr - 1) * d
    j0 = key_lo - key_lo % KT
    while j0 < key_hi:
        t = _tile(j0, bt_row, hk, kv_len, layout, d)
        nxt = t
        if j0 + KT < key_hi:
            nxt = _tile(j0 + KT, bt_row, hk, kv_len, layout, d)
        seen = False
        for i in range(gr):
            seen = seen or (rs.info[i, 2] < j0 + KT and rs.info[i, 3] > j0)
        if seen:
            if gr <= 4:
                qk4(rs.qf, qr, d, src, t, sbuf, nxt, True)
            else:
                qk8(rs.qf, qr, d, src, t, sbuf, 0, KT, nxt, True)
            _softmax_rows(sbuf, rs, 0, gr, j0, softcap, alpha)
            k_end = min(j0 + KT, kv_len)  # the tile's keys that exist: [j0, k_end)
            for h4 in range(0, gr, 4):
                last = min(gr - h4, 4) - 1
                masked = False
                for i in range(4):
                    r = h4 + min(i, last)
                    ar[i] = r * d
                    pr[i] = r * KT
                    al[i] = alpha[r]
                    masked = masked or rs.info[r, 2] > j0 or rs.info[r, 3] < k_end
                if masked:  # a row masks some of the tile's keys: drop their products
                    pv4(rs.acc, ar, al, sbuf, pr, d, src, t, True)
                else:
                    pv4(rs.acc, ar, al, sbuf, pr, d, src, t, None)
        j0 += KT


@jit
def _pv_span(acc, ar, al, sbuf, pr, ps, d, staged, s0, s1, masked):
    """The P·V tile over the staged keys ``[s0, s1)`` (nothing when empty): the rows' probabilities
    at ``pr[i] + s0``. The first span of a row group applies ``al``, which is then 1 (a
    row's accumulators are rescaled once). An odd-length span reads the weight at
    ``pr[i] + s1`` (and V row ``s1``): both must lie in what the group wrote and staged."""
    if s1 <= s0:
        return
    for i in range(PV):
        ps[i] = pr[i] + s0
    pv_group(acc, ar, al, sbuf, ps, d, staged, Tile(0, 0, s0 * d, 0, s1 - s0, 0), masked)
    for i in range(PV):
        al[i] = 1.0


@jit
def _prefill(rs, rows, src, layout, d, bt_row, hk, kv_len, key_lo, key_hi, softcap):
    """The keys [key_lo, key_hi) of an item's row groups in super-tiles of KS keys (fewer
    above head_dim 128): each is widened to fp32 once; per row group (PR rows), QK of its
    tiles, one softmax pass and one P·V pass (tiles of PV rows) with the accumulators in
    registers across the whole super-tile. The tiles are this CPU's (isa.PREFILL_TILES)."""
    info = rs.info
    kst = max(KT, KS * 128 // max(d, 128) // KT * KT)  # keys per super-tile: ~256 KB staged
    ks = np.empty(d * kst, np.float32)  # K^T: dim e at ks[e*kst:], tile t at column t*KT
    vs = np.empty(kst * d, np.float32)  # V rows
    staged = Source(ks, vs, kst, 0)
    sbuf = np.empty(PR * kst, np.float32)  # a group's scores, then probabilities
    alpha = np.ones(rows, np.float32)
    qr = np.empty(PR, np.int64)
    ar = np.empty(PV, np.int64)
    pr = np.empty(PV, np.int64)
    ps = np.empty(PV, np.int64)
    al = np.empty(PV, np.float32)
    j0 = key_lo - key_lo % KT
    while j0 < key_hi:
        j1 = min(j0 + kst, key_hi)
        nsub = (j1 - j0 + KT - 1) // KT
        for t in range(nsub):
            tile = _tile(j0 + t * KT, bt_row, hk, kv_len, layout, d)
            stage(src, tile, d, ks, t * KT, kst, vs, t * KT * d)
        for rg in range(0, rows, PR):
            gr = min(PR, rows - rg)
            lo = info[rg, 2]
            hi = info[rg, 3]
            for i in range(1, gr):
                lo = min(lo, info[rg + i, 2])
                hi = max(hi, info[rg + i, 3])
            t_lo = max(0, (lo - j0) // KT)
            t_hi = min(nsub, (hi - j0 + KT - 1) // KT)
            if t_lo >= t_hi:  # every row of the group masks this whole super-tile
                continue
            for i in range(PR):
                qr[i] = (rg + min(i, gr - 1)) * d
            for t in range(t_lo, t_hi):
                qk_group(rs.qf, qr, d, staged, t * KT, sbuf, t * KT, kst)
            _softmax_wide(sbuf, kst, rs, rg, gr, j0, t_lo, t_hi, softcap, alpha, 1.0, None)
            k0 = t_lo * KT
            # keys that exist (unwritten slots: never read) and some row of the group sees:
            # past hi (the causal diagonal's tile) every row's weight is 0
            n = min(t_hi * KT, j1 - j0, hi - j0) - k0
            for hv in range(0, gr, PV):
                last = min(gr - hv, PV) - 1
                lov = info[rg + hv, 2]
                hiv = info[rg + hv, 3]
                for i in range(PV):
                    r = rg + hv + min(i, last)
                    ar[i] = r * d
                    pr[i] = (hv + min(i, last)) * kst
                    al[i] = alpha[r]
                    lov = max(lov, info[r, 2])
                    hiv = min(hiv, info[r, 3])
                # staged keys [k0, k0 + n): [u0, u1) every row of the P·V tile sees; before
                # and after it (the causal diagonal, a window's start) some row masks keys
                # and their products are dropped (the tile's masked variant, a little slower).
                # [u0, u1) is whole key pairs: the tile reads the weight after a span of odd
                # length (times a zeroed V), and after u1 that may be a column this group's
                # softmax never wrote (t_hi * KT: stale, or garbage from np.empty), where a
                # NaN or an inf gave NaN rows. The masked spans then end at even u0, or at
                # k0 + n as before the split (odd only inside the last written tile).
                u0 = min(max(k0, lov - j0), k0 + n)
                u1 = max(min(k0 + n, hiv - j0), u0)
                u0 += u0 % 2
                u1 -= u1 % 2
                if u1 - u0 == n:
                    _pv_span(rs.acc, ar, al, sbuf, pr, ps, d, staged, k0, k0 + n, None)
                elif u1 <= u0:  # no whole pair every row sees
                    _pv_span(rs.acc, ar, al, sbuf, pr, ps, d, staged, k0, k0 + n, True)
                else:
                    _pv_span(rs.acc, ar, al, sbuf, pr, ps, d, staged, k0, u0, True)
                    _pv_span(rs.acc, ar, al, sbuf, pr, ps, d, staged, u0, u1, None)
                    _pv_span(rs.acc, ar, al, sbuf, pr, ps, d, staged, u1, k0 + n, True)
        j0 = j1


def _prefill_any(
    tw, rs, n, src, layout, d, bt_row, hk, kv_len, key_lo, key_hi, scores, q, t0, ng, rows
):
    """:func:`_prefill_tiles` where the witness ``tw`` names tiles and the cache is amx,
    else :func:`_prefill` (a variant without tiles compiles no tile code)."""


# (not inline="always": inlined into item, its impl read item's ``rs.info`` as garbage:
# Numba 0.68's IR inliner mixed up the names the two share, ``rows`` among them)
@overload(_prefill_any)
def _prefill_any_impl(
    tw, rs, n, src, layout, d, bt_row, hk, kv_len, key_lo, key_hi, scores, q, t0, ng, rows
):
    if tw.dtype == types.float32 or src.types[0].dtype != types.uint32:  # no tiles, or no amx

        def impl(
            tw, rs, n, src, layout, d, bt_row, hk, kv_len, key_lo, key_hi, scores, q, t0, ng, rows
        ):
            _prefill(rs, n, src, layout, d, bt_row, hk, kv_len, key_lo, key_hi, scores.softcap)

        return impl

    def impl(
        tw, rs, n, src, layout, d, bt_row, hk, kv_len, key_lo, key_hi, scores, q, t0, ng, rows
    ):
        if layout.amx:
            qb = np.empty(n * d, np.uint16)  # the rows' queries as they are (bf16)
            for r in range(n):
                qo = (t0 + r // ng) * rows.q_token + rs.info[r, 1] * rows.q_head
                qb[r * d : (r + 1) * d] = q[qo : qo + d]
            _prefill_tiles(
                rs, n, src, layout, d, bt_row, hk, kv_len, key_lo, key_hi, scores, qb, tw
            )
        else:
            _prefill(rs, n, src, layout, d, bt_row, hk, kv_len, key_lo, key_hi, scores.softcap)

    return impl


TR = 32  # rows per row group of the tile prefill: two 16-row tiles


@jit(inline="always")
def _finite_tile(fin, t, vc, va, d, chunk):
    """:func:`_finite_v` of tile ``t``, remembered in ``fin`` for the super-tile."""
    if fin[t] < 0:
        fin[t] = 1 if _finite_v(vc, va[t], d, chunk) else 0
    return fin[t] == 1


@jit
def _finite_v(vc, va, d, chunk):
    """Whether the V of a 32-key tile of an amx cache (uint32 pairs from ``va``; 16-dim
    groups ``chunk`` pairs apart) is finite in every slot, written or not: a bf16 is
    finite where its exponent bits are not all ones."""
    bad = np.uint32(0)
    for g in range(d // 16):
        o = va + g * chunk
        for j in range(256):  # 16 key pairs x 16 dims, two bf16 each
            u = vc[o + j]
            bad |= np.uint32(((u & 0x7F80) == 0x7F80) | ((u & 0x7F800000) == 0x7F800000))
    return bad == 0


@jit
def _prefill_tiles(rs, rows, src, layout, d, bt_row, hk, kv_len, key_lo, key_hi, scores, qb, tw):
    """:func:`_prefill` on AMX tiles (an amx cache, bf16): per super-tile of keys and row
    group of 32 rows, Q·Kᵀ on tiles straight from the cache (K's 16-key groups of dim pairs
    are B tiles, the group's queries ``qb`` (bf16, unscaled) A tiles) into fp32 scores,
    scaled, the online softmax on vectors (:func:`_softmax_wide`), the probabilities split
    into two bf16 terms (hi = bf16(P), lo = bf16(P - hi): P to about 2^-17, where one bf16
    P would cost a unit of bf16 on outputs near zero), and P·V on tiles straight from the
    cache (V's key pairs of 16 dims are B tiles, lo's product first) for every 32-key tile
    each row of the group sees whole; the tiles some
    row masks in part (the causal diagonal, a window's start, the last keys) take the
    vector P·V on fp32 V staged for them, which drops a masked key's product even where
    its V is not finite."""
    info = rs.info
    kst = max(KT, KS * 128 // max(d, 128) // KT * KT)
    sbuf = np.empty(TR * kst, np.float32)  # a group's scores, then probabilities
    # its probabilities as two bf16 terms (the P·V tiles' A): hi = bf16(P), lo = bf16(P - hi)
    pb = np.empty(TR * kst, np.uint16)
    pl = np.empty(TR * kst, np.uint16)
    vs = np.empty(kst * d, np.float32)  # V of the partly masked tiles, staged in fp32
    staged = Source(vs, vs, kst, 0)
    alpha = np.ones(rows, np.float32)
    va = np.empty(kst // KT, np.int64)  # each tile's V (uint32 pairs of the cache)
    ka = np.empty(kst // KT, np.int64)  # each tile's K halves
    kb = np.empty(kst // KT, np.int64)
    ar = np.empty(PV, np.int64)
    pr = np.empty(PV, np.int64)
    ps = np.empty(PV, np.int64)
    al = np.ones(PV, np.float32)
    fin = np.empty(kst // KT, np.int64)  # per tile: V finite (1), not (0), unknown (-1)
    ctx = amx.context(tw)
    shape = -1
    j0 = key_lo - key_lo % KT
    while j0 < key_hi:
        j1 = min(j0 + kst, key_hi)
        nsub = (j1 - j0 + KT - 1) // KT
        for t in range(nsub):
            tile = _tile(j0 + t * KT, bt_row, hk, kv_len, layout, d)
            ka[t] = tile.ka >> 1
            kb[t] = tile.kb >> 1
            va[t] = tile.va >> 1
            fin[t] = -1
        for rg in range(0, rows, TR):
            gr = min(TR, rows - rg)
            lo = info[rg, 2]
            hi = info[rg, 3]
            lov = lo
            hiv = hi
            for i in range(1, gr):
                lo = min(lo, info[rg + i, 2])
                hi = max(hi, info[rg + i, 3])
                lov = max(lov, info[rg + i, 2])
                hiv = min(hiv, info[rg + i, 3])
            t_lo = max(0, (lo - j0) // KT)
            t_hi = min(nsub, (hi - j0 + KT - 1) // KT)
            if t_lo >= t_hi:  # every row of the group masks this whole super-tile
                continue
            for t in range(t_lo, t_hi):  # Q·Kᵀ: 32 rows x 32 keys per tile, K 32 at a time
                shape = tiles.group(ctx, shape, gr)
                tiles.products(ctx, gr, qb, rg * d, d, src.kc, ka[t], kb[t], 64, 256, d // 32)
                tiles.store_c(ctx, gr, sbuf, t * KT, kst)
            sm = (scores.softcap, alpha, scores.scale, (pb, pl))
            _softmax_wide(sbuf, kst, rs, rg, gr, j0, t_lo, t_hi, *sm)
            for i in range(gr):  # the accumulators rescaled once
                r = rg + i
                if alpha[r] != 1.0:
                    a = vsplat(alpha[r])
                    for e in range(0, d, 16):
                        vstore(rs.acc, r * d + e, vmul(vload(rs.acc, r * d + e), a))
            # the tiles every row sees whole: [f0, f1) (their keys exist: hiv <= kv_len);
            # a partly masked tile joins them where its V is finite (a masked key's weight
            # is 0, and 0 x a finite V adds nothing), else it takes the vector P·V below
            f0 = min(max(t_lo, (lov - j0 + KT - 1) // KT), t_hi)
            f1 = max(min(t_hi, (hiv - j0) // KT), f0)
            while f0 > t_lo and _finite_tile(fin, f0 - 1, src.vc, va, d, layout.v_chunk >> 1):
                f0 -= 1
            while f1 < t_hi and _finite_tile(fin, f1, src.vc, va, d, layout.v_chunk >> 1):
                f1 += 1
            for g in range(0, d, 32):  # P·V: 32 rows x 32 dims, over the whole tiles
                if f1 <= f0:
                    break
                shape = tiles.group(ctx, shape, gr)
                tiles.load_c(ctx, gr, rs.acc, rg * d + g, d)
                for t in range(f0, f1):
                    b0 = va[t] + (g // 16) * (layout.v_chunk >> 1)
                    b1 = b0 + (layout.v_chunk >> 1)
                    tiles.products(ctx, gr, pl, t * KT, kst, src.vc, b0, b1, 64, 0, 1)
                    tiles.products(ctx, gr, pb, t * KT, kst, src.vc, b0, b1, 64, 0, 1)
                tiles.store_c(ctx, gr, rs.acc, rg * d + g, d)
            # the partly masked tiles on vectors: [t_lo, f0) and [f1, t_hi)
            end = min(t_hi * KT, j1 - j0, hi - j0)  # keys that exist and some row sees
            for t in range(t_lo, f0):
                stage_v(src, _tile(j0 + t * KT, bt_row, hk, kv_len, layout, d), d, vs, t * KT * d)
            for t in range(f1, t_hi):
                stage_v(src, _tile(j0 + t * KT, bt_row, hk, kv_len, layout, d), d, vs, t * KT * d)
            for hv in range(0, gr, PV):
                last = min(gr - hv, PV) - 1
                for i in range(PV):
                    ar[i] = (rg + hv + min(i, last)) * d
                    pr[i] = (hv + min(i, last)) * kst
                _pv_span(
                    rs.acc, ar, al, sbuf, pr, ps, d, staged, t_lo * KT, min(f0 * KT, end), True
                )
                _pv_span(rs.acc, ar, al, sbuf, pr, ps, d, staged, max(f1, f0) * KT, end, True)
        j0 = j1
    amx.tile_end(ctx)


# ---------------------------------------------------------------------------------------
# items, merges, the step


@jit
def item(it, step, q, out, rows, kc, vc, layout, heads, scores):
    """Work item ``it`` of ``step.items``: its rows' attention over its key range, into
    ``out`` or (a split) into the step's partial buffers. ``kc``/``vc``: the cache's read
    carriers (uint32 bf16 pairs for amx)."""
    items = step.items
    req = items[it, I_REQ]
    hk = items[it, I_HK]
    pos0 = items[it, I_POS]
    npos = items[it, I_NPOS]
    g0 = items[it, I_G0]
    ng = items[it, I_NG]
    part = items[it, I_PART]
    d = heads.head_dim
    grp = heads.num_heads // heads.num_kv_heads
    q0 = step.qsl[req]
    kv_len = np.int64(step.seq_lens[req])
    ctx = kv_len - (step.qsl[req + 1] - q0)
    n = npos * ng
    rs = _Rows(
        np.empty(n * d, np.float32),
        np.zeros(n * d, np.float32),
        np.full(n, -np.inf, np.float32),
        np.zeros(n * 16, np.float32),
        np.empty((n, 4), np.int64),
        np.zeros(n, np.float32),
    )
    sc = vsplat(scores.scale)
    key_lo, key_hi = items[it, I_LO], items[it, I_HI]
    for r in range(n):
        p, h, lo, hi = _row_info(r, ng, hk, pos0, g0, grp, ctx, kv_len, scores)
        rs.info[r, 0] = p
        rs.info[r, 1] = h
        # a piece of a split item: its keys only (the tiles are read from key_lo rounded
        # down to KT, and a window's pieces need not start on a tile: the keys before
        # key_lo are the previous piece's)
        rs.info[r, 2] = max(lo, key_lo)
        rs.info[r, 3] = min(hi, key_hi)
        if scores.has_alibi:
            rs.slopes[r] = scores.alibi[h]
        qo = (q0 + pos0 + r // ng) * rows.q_token + h * rows.q_head
        for e in range(0, d, 16):
            vstore(rs.qf, r * d + e, vmul(vload(q, qo + e), sc))
    src = Source(kc, vc, layout.block_size, layout.v_chunk)
    bt_row = step.block_table[req]
    if n > NR:  # several row groups share each K/V super-tile
        _prefill_any(scores.tiles, rs, n, src, layout, d, bt_row, hk, kv_len, key_lo, key_hi,
                     scores, q, q0 + pos0, ng, rows)  # fmt: skip
    else:
        _decode(rs, n, src, layout, d, bt_row, hk, kv_len, key_lo, key_hi, scores.softcap)
    for r in range(n):
        h = rs.info[r, 1]
        l = vsum(vload(rs.lv, r * 16))
        if part >= 0:  # a split: leave the unnormalised partial for the merge
            slot = part * step.part_m.shape[1] + r  # part_m/part_l [partials, rows of a slot]
            step.part_m[part, r] = rs.m[r]
            step.part_l[part, r] = l
            for e in range(0, d, 16):
                vstore(step.part_acc, slot * d + e, vload(rs.acc, r * d + e))
            continue
        o = (q0 + pos0 + r // ng) * rows.o_token + h * rows.o_head
        _finish(out, o, rs.acc, r * d, rs.m[r], l, scores, h, d)


@jit
def _finish(out, o, acc, a0, m, l, scores, h, d):
    """out = acc / l (with the sink's extra logit), rounded to the output dtype."""
    scale_acc = 1.0
    if scores.has_sinks:
        sink = to_f32(scores.sinks, h)
        m_new = max(m, sink)
        scale_acc = math.exp(m - m_new) if m > -np.inf else 0.0
        l = l * scale_acc + math.exp(sink - m_new)
    # l == 0: every visible score was -inf (an inf input), 0/0 as in softmax; NaN l: NaN
    inv = vsplat(scale_acc / l if l > 0.0 else np.float32(np.nan))
    for e in range(0, d, 16):
        vstore(out, o + e, vmul(vload(acc, a0 + e), inv))


@jit
def merge(mg, step, out, rows, heads, scores):
    """Merge ``step.merges[mg]``'s partial results of a split item into ``out``."""
    merges, part_m, part_l, part_acc = step.merges, step.part_m, step.part_l, step.part_acc
    first = merges[mg, M_FIRST]
    count = merges[mg, M_COUNT]
    hk = merges[mg, M_HK]
    pos0 = merges[mg, M_POS]
    ng = merges[mg, M_NG]
    n = merges[mg, M_NPOS] * ng
    d = heads.head_dim
    grp = heads.num_heads // heads.num_kv_heads
    q0 = step.qsl[merges[mg, M_REQ]]
    prn = part_m.shape[1]
    acc = np.zeros(d, np.float32)
    for r in range(n):
        mx = -np.inf
        for i in range(count):
            mx = max(mx, part_m[first + i, r])
        lsum = 0.0
        acc[:] = 0.0
        for i in range(count):
            slot = (first + i) * prn + r
            if part_m[first + i, r] == -np.inf:
                continue
            w = math.exp(part_m[first + i, r] - mx)
            lsum += part_l[first + i, r] * w
            wv = vsplat(w)
            for e in range(0, d, 16):
                vstore(acc, e, vfma(vload(part_acc, slot * d + e), wv, vload(acc, e)))
        h = hk * grp + merges[mg, M_G0] + r % ng
        o = (q0 + pos0 + r // ng) * rows.o_token + h * rows.o_head
        _finish(out, o, acc, 0, mx, lsum, scores, h, d)


@jit(parallel=True)
def attention(step, q, out, rows, kc, vc, layout, heads, scores):
    """A whole step: every item of ``step`` (dynamic schedule), then every merge."""
    # dynamic schedule: each thread takes the next item until none are left, so a thread
    # that is slowed (a costlier item, or a vCPU the hypervisor takes away) holds no work
    # the others could do; prange alone would fix each thread's share up front
    n = step.items.shape[0]
    nxt = np.zeros(1, np.int64)
    for _ in prange(min(n, WORKERS)):  # (more workers than threads: the extra ones find none)
        it = fetch_add(nxt, 0, 1)
        while it < n:
            item(it, step, q, out, rows, kc, vc, layout, heads, scores)
            it = fetch_add(nxt, 0, 1)
    if step.merges.shape[0] == 0:  # no splits: skip the second parallel region (~5 us)
        return
    for mg in prange(step.merges.shape[0]):
        merge(np.int64(mg), step, out, rows, heads, scores)
