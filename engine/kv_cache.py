"""KV-cache specs, groups and block pools.

Every attention layer has a spec (full attention, or a sliding window with its size),
carrying its own block size, kv heads, head size and dtype; layers with equal specs form
a KV-cache group. A group owns, once allocated (by the runner,
``engine.runner.ModelRunner.initialize_kv_cache``), its geometry
(:class:`numkern.attention.CacheGeometry`: blocks, kv heads, block size, head dim,
dtype, ISA; resolved once by ``engine.attention.resolve_geometry``), one block pool (a
free list that never hands out a block twice) and one cache tensor per layer, of the
geometry's shape.

Block size per group (:func:`layer_spec`): the engine's ``block_size`` for full
attention; for a window W, ``min(block_size, 32 * ceil(W / 32))``, so a small window
does not hold a large block. Memory (:func:`blocks_per_group`): no group gets more than
``max_num_seqs`` requests of ``max_model_len`` tokens can hold at once; a sliding group
at most ``ceil((W + max_num_batched_tokens) / B) + 1`` blocks per request (its blocks
wholly before ``position - W`` are freed as a request grows: the scheduler's windowed
freeing), and the full-attention groups share the rest of the budget by bytes per token.

The cache tensors are allocated, never written, here (``torch.empty``): the kernels
read only the slots a request has written (the attention tests fill caches with NaN to
prove it), so a page of the cache is first touched when a block on it is used, and an
engine sized for 64 requests of 8K tokens starts in the memory of the one it runs.
"""

import math
from dataclasses import dataclass, field

import torch

from numkern import attention as A

from .attention import resolve_geometry


@dataclass(frozen=True)
class AttentionSpec:
    block_size: int
    num_kv_heads: int
    head_size: int
    dtype: torch.dtype
    sliding_window: int = -1  # -1: full attention

    def bytes_per_block(self):
        return 2 * self.block_size * self.num_kv_heads * self.head_size * self.dtype.itemsize


class BlockPool:
    """Free list of block ids ``0..num_blocks-1``."""

    def __init__(self, num_blocks):
        if num_blocks < 1:
            raise ValueError(f"num_blocks: expected >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.reset()

    def reset(self):
        """Every block free again (handed out in the order of a new pool)."""
        self._free = list(range(self.num_blocks - 1, -1, -1))
        self._used = set()

    @property
    def num_free(self):
        return len(self._free)

    def allocate(self, n):
        """``n`` distinct free blocks, or None (and nothing taken) when too few are free."""
        if n > len(self._free):
            return None
        blocks = [self._free.pop() for _ in range(n)]
        self._used.update(blocks)
        return blocks

    def free(self, blocks):
        for b in blocks:
            if b not in self._used:
                raise ValueError(f"blocks: block {b} is not allocated (double free?)")
            self._used.remove(b)
            self._free.append(b)


@dataclass
class KVCacheGroup:
    spec: AttentionSpec
    layer_names: list
    pool: BlockPool | None = None
    caches: dict = field(default_factory=dict)  # layer name -> kv_cache tensor
    geometry: A.CacheGeometry | None = None  # resolved once, by allocate()

    def allocate(self, num_blocks, *, override=None):
        """The group's geometry (``override``: the engine's resolved ISA override, or
        None), pool and caches for ``num_blocks`` blocks."""
        self.pool = BlockPool(num_blocks)
        self.geometry = resolve_geometry(self.spec, num_blocks, override=override)
        shape = A.kv_cache_shape(self.geometry)
        self.caches = {n: torch.empty(shape, dtype=self.geometry.dtype) for n in self.layer_names}

    def info(self):
        """What ``LLM.kv_cache_groups`` shows of the group (allocated)."""
        g = self.geometry
        return KVCacheGroupInfo(
            layer_names=tuple(self.layer_names),
            block_size=g.block_size,
            sliding_window=self.spec.sliding_window,
            isa=g.isa,
            num_blocks=g.num_blocks,
        )


@dataclass(frozen=True)
class KVCacheGroupInfo:
    """What ``LLM.kv_cache_groups`` shows of one KV-cache group."""

    layer_names: tuple
    block_size: int
    sliding_window: int  # -1: full attention, else the config's window
    isa: str
    num_blocks: int


WINDOW_BLOCK_MULTIPLE = 32  # a sliding group's block size: the window rounded up to this


def layer_spec(layer, block_size, dtype):
    """The KV-cache spec of an attention layer (``engine.attention.AttentionLayer``) in
    an engine of ``block_size``: its window decides its block size."""
    w = layer.sliding_window
    b = block_size
    if w > 0:
        b = min(block_size, WINDOW_BLOCK_MULTIPLE * -(-w // WINDOW_BLOCK_MULTIPLE))
    return AttentionSpec(b, layer.num_kv_heads, layer.head_size, dtype, w)


def group_layers(specs):
    """``{layer name: AttentionSpec}`` -> KV-cache groups of layers with equal specs, in
    the order of their first layer."""
    groups = {}
    for name, spec in specs.items():
        groups.setdefault(spec, []).append(name)
    return [KVCacheGroup(spec, names) for spec, names in groups.items()]


def blocks_needed(group, *, max_num_seqs, max_num_batched_tokens, max_model_len=None):
    """The most blocks of ``group`` the engine can use at once: ``max_num_seqs`` requests
    of ``max_model_len`` tokens (None: unbounded), a sliding group's requests each at
    most ``ceil((W + max_num_batched_tokens) / B) + 1`` blocks. None: no bound."""
    w, b = group.spec.sliding_window, group.spec.block_size
    per_request = None if max_model_len is None else math.ceil(max_model_len / b)
    if w > 0:
        window = math.ceil((w + max_num_batched_tokens) / b) + 1
        per_request = window if per_request is None else min(per_request, window)
    return None if per_request is None else max_num_seqs * per_request


def blocks_per_group(
    groups, budget_bytes, *, max_num_seqs, max_num_batched_tokens, max_model_len=None
):
    """Blocks of each group for a budget of ``budget_bytes`` (module docstring).

    A group never gets more than :func:`blocks_needed`. A sliding group gets that, but
    never more than its share of the budget by bytes per token (what it would get as a
    full-attention group); the full-attention groups share the rest so that each holds
    the same number of tokens. ValueError naming ``kv_cache_memory`` when a group would
    get no block."""

    def token_bytes(g):  # bytes one token takes in all of the group's layers
        return g.spec.bytes_per_block() * len(g.layer_names) // g.spec.block_size

    budget = int(budget_bytes)
    all_tokens = budget // sum(token_bytes(g) for g in groups)
    need = [
        blocks_needed(
            g,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            max_model_len=max_model_len,
        )
        for g in groups
    ]
    counts = {}
    for i, g in enumerate(groups):
        if g.spec.sliding_window > 0:
            counts[i] = min(need[i], all_tokens // g.spec.block_size)
    full = [i for i, g in enumerate(groups) if g.spec.sliding_window <= 0]
    if full:
        rest = budget - sum(
            counts[i] * groups[i].spec.bytes_per_block() * len(groups[i].layer_names)
            for i in counts
        )
        tokens = rest // sum(token_bytes(groups[i]) for i in full)
        for i in full:
            share = tokens // groups[i].spec.block_size
            counts[i] = share if need[i] is None else min(share, need[i])
    for i, g in enumerate(groups):
        if counts[i] < 1:
            per_block = g.spec.bytes_per_block() * len(g.layer_names)
            raise ValueError(
                f"kv_cache_memory: {budget} bytes hold no block of KV-cache group {i} "
                f"({per_block} bytes per block across its {len(g.layer_names)} layers)"
            )
    return [counts[i] for i in range(len(groups))]
