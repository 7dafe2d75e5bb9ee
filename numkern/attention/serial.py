"""An :class:`AttentionPlan` as one int64 tensor: the ``scheduler_metadata`` of the torch op
``get_scheduler_metadata`` (``docs/kernels.md`` §12.3), read back by
``cpu_attention_with_kv_cache``.

Layout (int64, 1-D): a header of :data:`HEADER` words, then ``qsl [R+1]``,
``seq_lens [R]``, ``items [n*9]`` and ``merges [m*8]``, row-major. Header words:
magic, version, total length, checksum, R, T, Hq, Hkv, D, causal, window, isa (index in
:data:`ISAS`), dtype (index in :data:`DTYPES`), n, m, partial slots, rows of a partial slot.
The checksum (a weighted sum of every other word, wrapping) tells a damaged tensor from
a plan; the block size is not stored (vLLM's metadata does not know it): the reader
takes the cache's and checks it against the isa. The plan keeps no block table or slot
mapping: the attention call validates its ``block_table`` itself.
"""

import numpy as np
import torch

from .. import _check as C
from .plan import AttentionPlan, check_config

MAGIC = 0x6E6B706C616E  # "nkplan"
VERSION = 1
HEADER = 17
ISAS = ("amx", "vec", "vec16", "neon")
DTYPES = (torch.bfloat16, torch.float16, torch.float32)
(H_MAGIC, H_VERSION, H_LEN, H_SUM, H_R, H_T, H_HQ, H_HKV, H_D) = range(9)
(H_CAUSAL, H_WINDOW, H_ISA, H_DTYPE, H_N, H_M, H_PARTS, H_ROWS) = range(9, HEADER)


def metadata_length(num_requests, num_items, num_merges):
    """Words of the tensor of a plan of this many requests, items and merges."""
    return HEADER + 2 * num_requests + 1 + 9 * num_items + 8 * num_merges


def _checksum(words):
    """Sum of ``words[i] * (2i+1)`` over every word but the checksum's, wrapping at 2^64."""
    w = words.copy()
    w[H_SUM] = 0
    odd = np.arange(1, 2 * w.shape[0], 2, dtype=np.int64)
    with np.errstate(over="ignore"):
        return int((w * odd).sum(dtype=np.int64))


def plan_to_tensor(plan, dtype):
    """``plan`` (built for query and cache ``dtype``) as a fresh int64 CPU tensor."""
    r_n, n, m = plan.num_requests, plan.items.shape[0], plan.merges.shape[0]
    words = np.empty(metadata_length(r_n, n, m), np.int64)
    head = (MAGIC, VERSION, words.shape[0], 0, r_n, plan.num_tokens, plan.num_heads)
    head += (plan.num_kv_heads, plan.head_dim, int(plan.causal), plan.sliding_window)
    head += (ISAS.index(plan.isa), DTYPES.index(dtype), n, m, plan.num_partials, plan.part_rows)
    words[:HEADER] = head
    at = HEADER
    for a in (plan.qsl, plan.seq_lens, plan.items, plan.merges):
        words[at : at + a.size] = a.reshape(-1)
        at += a.size
    words[H_SUM] = _checksum(words)
    return torch.from_numpy(words)


def _bad(why):
    raise ValueError(f"scheduler_metadata: {why}")


def plan_from_tensor(meta, *, block_size):
    """``(plan, dtype)`` read from ``meta`` (:func:`plan_to_tensor`'s) for a cache of
    ``block_size``: ValueError for a tensor that is not such a plan, or a block size the
    plan's isa does not take. The plan's arrays are copies: a later write to ``meta``
    does not reach them."""
    C.check_dtype("scheduler_metadata", meta, (torch.int64,))
    C.check_ndim("scheduler_metadata", meta, (1,))
    if meta.shape[0] < HEADER:
        _bad(f"expected a numkern plan of at least {HEADER} words, got {meta.shape[0]}")
    words = np.ascontiguousarray(C.as_numpy(meta))
    if words[H_MAGIC] != MAGIC or words[H_VERSION] != VERSION:
        _bad(
            f"expected a numkern plan (magic {MAGIC:#x}, version {VERSION}), got magic "
            f"{int(words[H_MAGIC]):#x}, version {int(words[H_VERSION])} (vLLM's metadata, "
            "or another tensor?)"
        )
    r_n, n, m = (int(words[i]) for i in (H_R, H_N, H_M))
    ok_sizes = min(r_n, n, m) >= 0 and max(r_n, n, m) < words.shape[0]
    if (
        not ok_sizes
        or words[H_LEN] != words.shape[0]
        or metadata_length(r_n, n, m) != words.shape[0]
    ):
        _bad(f"length {words.shape[0]} does not match its header (R={r_n}, items={n}, merges={m})")
    if words[H_SUM] != _checksum(words):
        _bad("checksum mismatch: the tensor was changed after get_scheduler_metadata")
    if not (0 <= words[H_ISA] < len(ISAS) and 0 <= words[H_DTYPE] < len(DTYPES)):
        _bad(f"unknown isa or dtype code ({int(words[H_ISA])}, {int(words[H_DTYPE])})")
    isa = ISAS[int(words[H_ISA])]
    hq, hkv, d, w = (int(words[i]) for i in (H_HQ, H_HKV, H_D, H_WINDOW))
    hq, hkv, d, b, w = check_config(hq, hkv, d, block_size, w, isa)
    at = HEADER
    qsl = words[at : at + r_n + 1].copy()
    at += r_n + 1
    sl = words[at : at + r_n].astype(np.int32)
    at += r_n
    items = words[at : at + 9 * n].reshape(n, 9).copy()
    at += 9 * n
    merges = words[at : at + 8 * m].reshape(m, 8).copy()
    for a in (qsl, sl):  # read-only as plan_attention's copies (one Numba compilation)
        a.flags.writeable = False
    plan = AttentionPlan(
        items=items,
        merges=merges,
        num_partials=int(words[H_PARTS]),
        part_rows=int(words[H_ROWS]),
        num_requests=r_n,
        num_tokens=int(words[H_T]),
        num_heads=hq,
        num_kv_heads=hkv,
        head_dim=d,
        block_size=b,
        causal=bool(words[H_CAUSAL]),
        sliding_window=w,
        isa=isa,
        qsl=qsl,
        seq_lens=sl,
    )
    return plan, DTYPES[int(words[H_DTYPE])]
