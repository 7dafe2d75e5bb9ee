"""A step's work split (:func:`plan_attention`), built and validated once per step.

The plan validates the step's request layout and, when given them, its block table and
slot mapping, and keeps validated read-only NumPy copies: every layer's call of the step
reads those copies, so a table changed after planning cannot reach the kernels unchecked
(and nothing writes the copies: NumPy refuses, and Numba refuses to compile a write).
"""

from dataclasses import dataclass, field, replace

import numba
import numpy as np
import torch

from .. import _check as C
from .. import isa as nk_isa
from .._jit import jit
from .kernels import (
    I_G0,
    I_HI,
    I_HK,
    I_LO,
    I_NG,
    I_NPOS,
    I_PART,
    I_POS,
    I_REQ,
    M_COUNT,
    M_FIRST,
    M_G0,
    M_HK,
    M_NG,
    M_NPOS,
    M_POS,
    M_REQ,
    NR,
    StepArrays,
)
from .layout import CacheGeometry
from .tiles import KT

NRI = 256  # query rows per work item (GQA group x positions) at head_dim <= 128: each
# K/V super-tile is widened once for all of them (scaled down by 128/head_dim above that)
SPLIT_KEYS = 512  # a split of a long key range covers at least this many keys
ITEMS_PER_THREAD = 4  # split long ranges until a step has this many items per thread


@dataclass(frozen=True, eq=False)
class AttentionPlan:
    """The work split of one step, built and validated once, reused by every layer.

    ``items [n, 9]`` int64: request, kv head, first query position, positions, first q
    head of the group, heads, key range [lo, hi), partial slot (-1: writes the output).
    ``merges [m, 8]``: first partial slot, count, and the rows they merge into.
    ``qsl [R+1]`` int64 and ``seq_lens [R]`` int32: validated copies of the step's
    ``query_start_loc`` and ``seq_lens``. With a block table at planning time,
    ``block_table [R, max_blocks]`` int32 (contiguous copy, entries in use checked against
    ``num_blocks``); with a slot mapping, ``slot_mapping [T]`` int64 (copy, slots below
    ``num_blocks * block_size``); else None. The four copies are read-only.
    ``geometry``: the :class:`~numkern.attention.layout.CacheGeometry` the plan was built
    for (its kv heads, head dim, block size, isa and blocks are the plan's), or None for a
    plan built from sizes.
    """

    items: np.ndarray
    merges: np.ndarray
    num_partials: int
    part_rows: int  # rows of a partial slot: the most rows of a split item
    num_requests: int
    num_tokens: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    causal: bool
    sliding_window: int
    isa: str
    qsl: np.ndarray
    seq_lens: np.ndarray
    block_table: np.ndarray | None = None
    slot_mapping: np.ndarray | None = None
    num_blocks: int | None = None
    table_source: object = field(default=None, repr=False)  # the block_table given
    geometry: CacheGeometry | None = None

    def blocks_visited(self):
        """Cache blocks read per kv head (an item's key range, in blocks)."""
        lo = self.items[:, I_LO] // self.block_size
        hi = (self.items[:, I_HI] + self.block_size - 1) // self.block_size
        return int(np.maximum(hi - lo, 0).sum())

    def partial_buffers(self):
        """Fresh workspaces of the splits' partial results: (max, sum) ``[partials, rows]``
        and accumulators ``[partials * rows * head_dim]`` fp32."""
        shape = (max(self.num_partials, 1), self.part_rows)
        n = shape[0] * shape[1] * self.head_dim
        return np.empty(shape, np.float32), np.empty(shape, np.float32), np.empty(n, np.float32)

    def step_arrays(self, block_table=None, num_blocks=None):
        """The plan's :class:`StepArrays` for the kernels, with fresh partial buffers (one
        call's: two threads may run layers with one plan). Without arguments the plan's
        validated block table (ValueError when it holds none); with a ``block_table`` and
        the cache's ``num_blocks``, the table :meth:`table_for` validates for them."""
        if block_table is None and num_blocks is None:
            bt = self.block_table
            if bt is None:
                raise ValueError(
                    "plan: holds no validated block_table; build it with block_table= and "
                    "num_blocks=, or pass them here"
                )
        else:
            bt = self.table_for(block_table, C.check_int("num_blocks", num_blocks, low=1))
        arrays = (self.items, self.merges, self.qsl, self.seq_lens, bt)
        return StepArrays(*arrays, *self.partial_buffers())

    def table_for(self, block_table, num_blocks):
        """The validated table for a call with ``block_table`` on a cache of ``num_blocks``:
        the plan's copy when it holds one (``block_table`` must be the tensor it was built
        with, or equal to it), else ``block_table`` checked now."""
        if self.block_table is None:
            return check_block_table(
                block_table,
                self.qsl,
                self.seq_lens,
                self.block_size,
                num_blocks,
                self.sliding_window,
            )
        if num_blocks != self.num_blocks:
            raise ValueError(
                f"key_cache: expected {self.num_blocks} blocks (the plan's block_table was "
                f"checked against them), got {num_blocks}"
            )
        if block_table is not self.table_source:
            C.check_dtype("block_table", block_table, (torch.int32,))
            same = tuple(block_table.shape) == self.block_table.shape and np.array_equal(
                C.as_numpy(C.as_torch(block_table)), self.block_table
            )
            if not same:
                raise ValueError(
                    f"block_table: expected the table the plan was built with (shape "
                    f"{list(self.block_table.shape)}), got a different one of shape "
                    f"{list(block_table.shape)}"
                )
        return self.block_table


def check_config(num_heads, num_kv_heads, head_dim, block_size, sliding_window, isa):
    """Validated ``(Hq, Hkv, D, B, window)``; the isa's rules come from ``numkern.isa``."""
    hkv = C.check_int("num_kv_heads", num_kv_heads, low=1)
    hq = _check_heads(num_heads, hkv)
    nk_isa.attention_rule(isa)
    d = C.check_int("head_dim", head_dim, low=nk_isa.MIN_HEAD_DIM)
    b = C.check_int("block_size", block_size, low=1)
    nk_isa.check_attention(isa, block_size=b, head_dim=d)
    return hq, hkv, d, b, _check_window(sliding_window)


def _check_heads(num_heads, hkv):
    hq = C.check_int("num_heads", num_heads, low=1)
    if hq % hkv:
        raise ValueError(f"num_heads: expected a multiple of num_kv_heads={hkv}, got {hq}")
    return hq


def _check_window(sliding_window):
    w = C.check_int("sliding_window", sliding_window)
    if w == 0 or w < -1:
        raise ValueError(f"sliding_window: expected -1 (none) or >= 1, got {w}")
    return w


def _of_geometry(geometry, num_heads, sliding_window, given):
    """``(Hq, Hkv, D, B, window)`` of a plan for ``geometry`` (validated when made: its
    sizes are not checked again); ``given``: the size keywords passed besides it."""
    if not isinstance(geometry, CacheGeometry):
        raise TypeError(f"geometry: expected a CacheGeometry, got {type(geometry).__name__}")
    extra = [k for k, v in given.items() if v is not None]
    if extra:
        raise TypeError(f"{extra[0]}: expected not with geometry= (the geometry holds it)")
    g = geometry
    hq = _check_heads(num_heads, g.num_kv_heads)
    return hq, g.num_kv_heads, g.head_dim, g.block_size, _check_window(sliding_window)


def plan_attention(
    query_start_loc,
    seq_lens,
    *,
    num_heads,
    num_kv_heads=None,
    head_dim=None,
    block_size=None,
    causal=True,
    sliding_window=-1,
    isa=None,
    num_threads=None,
    block_table=None,
    slot_mapping=None,
    num_blocks=None,
    geometry=None,
):
    """Validate a step's request layout and split its attention into work items.

    The cache: ``geometry``, a KV-cache group's :class:`CacheGeometry` (validated when
    made; the plan keeps it as ``plan.geometry`` and takes ``num_blocks`` from it), or the
    sizes ``num_kv_heads``, ``head_dim``, ``block_size``, ``isa`` (and ``num_blocks`` with
    a block table), checked here.

    ``query_start_loc [R+1]`` int32 (non-decreasing, from 0), ``seq_lens [R]`` int32
    (each >= its q_len). The plan is reused by every layer's call of the step;
    ``num_threads`` (default: Numba's) decides how far long ranges are split.

    ``block_table [R, max_blocks]`` int32 with ``num_blocks`` (the cache's): the table is
    validated here, once, and the plan keeps a copy that every call with the plan uses.
    With a ``sliding_window`` the entries of blocks wholly before a request's first
    visible key (rounded down to a tile of 32 keys) are not read and not checked: a
    cache that frees them as the window moves on marks them -1.
    ``slot_mapping [T]`` int64 (needs ``num_blocks``): checked (T entries, slots below
    ``num_blocks * block_size``; negative: skipped) and kept as a copy.
    """
    if geometry is None:
        hq, hkv, d, b, w = check_config(
            num_heads, num_kv_heads, head_dim, block_size, sliding_window, isa
        )
    else:
        sizes = dict(num_kv_heads=num_kv_heads, head_dim=head_dim, block_size=block_size)
        sizes.update(isa=isa, num_blocks=num_blocks)
        hq, hkv, d, b, w = _of_geometry(geometry, num_heads, sliding_window, sizes)
        isa = geometry.isa
        if slot_mapping is not None and block_table is None:
            raise ValueError("slot_mapping: expected with block_table (the plan keeps both)")
        num_blocks = geometry.num_blocks if block_table is not None else None
    qsl = index_vector("query_start_loc", query_start_loc)
    sl = index_vector("seq_lens", seq_lens)
    r_n = sl.shape[0]
    if qsl.shape[0] != r_n + 1:
        raise ValueError(f"query_start_loc: expected {r_n + 1} entries (R+1), got {qsl.shape[0]}")
    if num_blocks is not None and block_table is None:
        raise ValueError("num_blocks: given without block_table (it bounds the table's entries)")
    if slot_mapping is not None and num_blocks is None:
        raise ValueError("num_blocks: expected with slot_mapping (it bounds the slots), got None")
    grp = hq // hkv
    cap = max(NR, NRI * 128 // max(d, 128))  # rows per item: acc and q stay L2-sized
    ng = min(grp, cap)
    npos_max = max(1, cap // ng)
    threads = numba.get_num_threads() if num_threads is None else int(num_threads)
    target = ITEMS_PER_THREAD * threads
    items, merges, n_part, part_rows, fault = _plan(
        qsl, sl, hkv, grp, ng, npos_max, w, bool(causal), target, SPLIT_KEYS
    )
    if fault:
        _raise_lengths(qsl, sl)
    t_n = int(qsl[-1]) if r_n else 0
    sl32 = sl.astype(np.int32)
    for a in (qsl, sl32):  # the plan's validated copies: nothing writes them
        a.flags.writeable = False
    plan = AttentionPlan(
        items=items,
        merges=merges,
        num_partials=n_part,
        part_rows=part_rows,
        num_requests=r_n,
        num_tokens=t_n,
        num_heads=hq,
        num_kv_heads=hkv,
        head_dim=d,
        block_size=b,
        causal=bool(causal),
        sliding_window=w,
        isa=isa,
        qsl=qsl,
        seq_lens=sl32,
        geometry=geometry,
    )
    if block_table is None:
        return plan
    return with_tables(plan, block_table, slot_mapping, num_blocks)


def with_tables(plan, block_table, slot_mapping, num_blocks=None):
    """``plan`` (one without tables, e.g. read back from a ``scheduler_metadata`` tensor)
    with validated read-only copies of ``block_table [R, max_blocks]`` int32 for a cache
    of ``num_blocks`` blocks (None: the plan's geometry's) and of ``slot_mapping [T]``
    int64 (or None): the checks and copies :func:`plan_attention` makes when it is given
    them."""
    if not isinstance(plan, AttentionPlan):
        raise TypeError(f"plan: expected an AttentionPlan, got {type(plan).__name__}")
    if plan.block_table is not None:
        raise ValueError("plan: already holds a block_table")
    if plan.geometry is not None:
        if num_blocks not in (None, plan.geometry.num_blocks):
            raise ValueError(
                f"num_blocks: expected None or the plan's geometry's "
                f"{plan.geometry.num_blocks}, got {num_blocks!r}"
            )
        num_blocks = plan.geometry.num_blocks
    nb = C.check_int("num_blocks", num_blocks, low=1)
    b, w = plan.block_size, plan.sliding_window
    bt = check_block_table(block_table, plan.qsl, plan.seq_lens, b, nb, w).copy()
    slots = None
    if slot_mapping is not None:
        slots = check_slots(slot_mapping, plan.num_tokens, nb * b).copy()
    for a in (bt, slots):  # the plan's validated copies: nothing writes them
        if a is not None:
            a.flags.writeable = False
    tables = {"block_table": bt, "slot_mapping": slots, "num_blocks": nb}
    return replace(plan, **tables, table_source=block_table)


def index_vector(name, x):
    """An int32 vector (tensor or array) as a contiguous int64 NumPy copy."""
    C.check_dtype(name, x, (torch.int32,))
    C.check_ndim(name, x, (1,))
    return C.as_numpy(x).astype(np.int64)


def check_slots(slot_mapping, t_n, capacity):
    """``slot_mapping [T]`` int64, each slot below ``capacity``, as a read-only NumPy array
    (the type of a plan's copy, so the kernels compile once for both)."""
    C.check_dtype("slot_mapping", slot_mapping, (torch.int64,))
    C.check_shape("slot_mapping", slot_mapping, (t_n,))
    slots = np.ascontiguousarray(C.as_numpy(slot_mapping))
    if t_n and int(slots.max()) >= capacity:
        raise ValueError(
            f"slot_mapping: expected slots < num_blocks * block_size = {capacity}, "
            f"got {int(slots.max())}"
        )
    slots = slots.view()  # a view of its own: the caller's array keeps its flags
    slots.flags.writeable = False
    return slots


def _raise_lengths(qsl, sl):
    """The ValueError for query_start_loc/seq_lens that ``_plan`` found inconsistent."""
    if qsl[0] != 0:
        raise ValueError(f"query_start_loc: expected to start at 0, got {qsl[0]}")
    q_len = np.diff(qsl)
    if (q_len < 0).any():
        r = int(np.argmax(q_len < 0))
        raise ValueError(
            f"query_start_loc: expected non-decreasing, got {qsl[r]} then {qsl[r + 1]}"
        )
    r = int(np.argmax(q_len > sl))
    raise ValueError(f"seq_lens: request {r} has q_len {q_len[r]} > seq_len {sl[r]}")


@jit
def _first_block(qsl, sl, r, b, w):
    """The first block of request ``r`` the kernels read: with a sliding window ``w`` the
    block of its first visible key, rounded down to a tile of KT keys (a tile is read
    whole and masked); else 0."""
    if w <= 0:
        return 0
    lo = max(0, sl[r] - (qsl[r + 1] - qsl[r]) - w + 1)
    return (lo - lo % KT) // b


@jit
def _table_ok(bt, qsl, sl, b, nb, w):
    """Whether each request's blocks in use (``ceil(seq_len / b)`` of its row, from the
    window's first block on) are in the table and in [0, nb). One Numba call (as NumPy
    ops: ~50 us of a decode step)."""
    for r in range(bt.shape[0]):
        need = (sl[r] + b - 1) // b
        if need > bt.shape[1]:
            return False
        for j in range(_first_block(qsl, sl, r, b, w), need):
            if bt[r, j] < 0 or bt[r, j] >= nb:
                return False
    return True


def check_block_table(block_table, qsl, sl, b, nb, w):
    """``block_table [R, max_blocks]`` int32 for the validated ``query_start_loc``
    ``qsl`` and ``seq_lens`` ``sl`` (NumPy, [R+1] and [R]) on a cache of ``nb`` blocks of
    ``b`` with sliding window ``w`` (-1: none): a contiguous read-only NumPy int32 array
    (no copy when it already is one; read-only like a plan's copy, so the kernels compile
    once for both). The entries of blocks wholly before a request's window are not read
    and may be anything (-1: a block freed as the window moved on)."""
    r_n = sl.shape[0]
    C.check_dtype("block_table", block_table, (torch.int32,))
    C.check_ndim("block_table", block_table, (2,))
    bt = C.as_numpy(C.as_torch(block_table).contiguous())
    if bt.shape[0] != r_n:
        raise ValueError(f"block_table: expected {r_n} rows (one per request), got {bt.shape[0]}")
    if _table_ok(bt, qsl, sl, b, nb, w):
        bt = bt.view()  # a view of its own: the caller's array keeps its flags
        bt.flags.writeable = False
        return bt
    # the fault, named (NumPy: a step's tables are small, each torch op costs ~10-20 us)
    need = (sl.astype(np.int64) + b - 1) // b
    if r_n and int(need.max()) > bt.shape[1]:
        r = int(np.argmax(need))
        raise ValueError(
            f"seq_lens: request {r} needs {int(need[r])} blocks of {b}, but block_table holds "
            f"{bt.shape[1]} per request"
        )
    first = np.array([_first_block(qsl, sl, r, b, w) for r in range(r_n)], np.int64)
    cols = np.arange(bt.shape[1])[None, :]
    used = (cols < need[:, None]) & (cols >= first[:, None])
    vals = bt[used]
    window = f" (from the first block of each request's window of {w})" if w > 0 else ""
    raise ValueError(
        f"block_table: expected entries in [0, {nb}) for the blocks in use{window}, got "
        f"range [{int(vals.min())}, {int(vals.max())}]"
    )


@jit
def _plan(qsl, sl, hkv, grp, ng, npos_max, w, causal, target, split_keys):
    """A step's items, split to ``target``: (items, merges, partial slots, rows of a
    partial slot, fault). One Numba call: as NumPy and torch ops (~5-15 us each here)
    the plan cost 0.3-0.45 ms of a decode step. ``fault``: query_start_loc does not
    start at 0, decreases, or gives a request more queries than keys (nothing planned).
    """
    r_n = sl.shape[0]
    q_len = np.empty(r_n, np.int64)
    fault = qsl[0] != 0
    for r in range(r_n):
        q_len[r] = qsl[r + 1] - qsl[r]
        fault = fault or q_len[r] < 0 or q_len[r] > sl[r]
    if fault:
        empty = np.zeros((0, 9), np.int64)
        return empty, np.zeros((0, 8), np.int64), 0, 1, True
    whole = _plan_items(q_len, sl, hkv, grp, ng, npos_max, w, causal)
    items, merges, n_part = _split(whole, target, split_keys)
    part_rows = 1
    for i in range(items.shape[0]):
        if items[i, I_PART] >= 0:
            part_rows = max(part_rows, items[i, I_NPOS] * items[i, I_NG])
    return items, merges, n_part, part_rows, False


@jit
def _plan_items(q_len, kv_len, hkv, grp, ng, npos_max, w, causal):
    """Items ``[n, 9]`` of requests with these query and key lengths: per request, kv
    head and group of ``ng`` q heads, runs of ``npos_max`` query positions with their
    key range. A step's plan in Numba: the NumPy version cost ~0.2 ms a decode step."""
    n = 0
    for r in range(q_len.shape[0]):
        n += (q_len[r] + npos_max - 1) // npos_max * hkv * ((grp + ng - 1) // ng)
    items = np.empty((n, 9), np.int64)
    i = 0
    for r in range(q_len.shape[0]):
        ql = q_len[r]
        kl = kv_len[r]
        for hk in range(hkv):
            for g0 in range(0, grp, ng):
                for pos0 in range(0, ql, npos_max):
                    npos = min(npos_max, ql - pos0)
                    first = kl - ql + pos0
                    last = first + npos - 1
                    lo = max(0, first - w + 1) if w > 0 else 0
                    if causal:
                        hi = last + 1
                    elif w > 0:
                        hi = min(kl, last + w)
                    else:
                        hi = kl
                    it = items[i]
                    it[I_REQ], it[I_HK], it[I_POS], it[I_NPOS] = r, hk, pos0, npos
                    it[I_G0], it[I_NG], it[I_LO], it[I_HI] = g0, min(ng, grp - g0), lo, hi
                    it[I_PART] = -1
                    i += 1
    return items


@jit
def _split(items, target, split_keys):
    """Split long key ranges until there are ``target`` items (or ranges get short):
    (items, merges ``[m, 8]``, partial slots)."""
    n = items.shape[0]
    if n == 0 or n >= target:
        return items, np.zeros((0, 8), np.int64), 0
    want = (target + n - 1) // n
    steps = np.zeros(n, np.int64)  # keys per piece of a split item (0: kept whole)
    count = 0
    n_merge = 0
    for i in range(n):
        span = items[i, I_HI] - items[i, I_LO]
        pieces = min(want, span // split_keys)
        if pieces <= 1:
            count += 1
            continue
        step = (span + pieces - 1) // pieces
        steps[i] = step + (KT - step % KT) % KT  # split points on tile boundaries
        base = items[i, I_LO] - items[i, I_LO] % KT  # a window's range starts inside a tile
        count += (items[i, I_HI] - base + steps[i] - 1) // steps[i]
        n_merge += 1
    out = np.empty((count, 9), np.int64)
    merges = np.empty((n_merge, 8), np.int64)
    j = 0
    m = 0
    n_part = 0
    for i in range(n):
        if steps[i] == 0:
            out[j] = items[i]
            j += 1
            continue
        first = n_part
        lo0 = items[i, I_LO]
        for lo in range(lo0 - lo0 % KT, items[i, I_HI], steps[i]):
            out[j] = items[i]
            out[j, I_LO] = max(lo, lo0)
            out[j, I_HI] = min(lo + steps[i], items[i, I_HI])
            out[j, I_PART] = n_part
            n_part += 1
            j += 1
        it = items[i]
        mg = merges[m]
        mg[M_FIRST], mg[M_COUNT], mg[M_REQ], mg[M_HK] = first, n_part - first, it[I_REQ], it[I_HK]
        mg[M_POS], mg[M_NPOS], mg[M_G0], mg[M_NG] = it[I_POS], it[I_NPOS], it[I_G0], it[I_NG]
        m += 1
    return out, merges, n_part
