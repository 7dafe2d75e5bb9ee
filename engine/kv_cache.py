"""KV-cache specs, groups and block pools.

Every attention layer has a spec (full attention, or a sliding window with its size),
carrying its own block size, kv heads, head size and dtype; layers with equal specs form
a KV-cache group. A group owns one block pool (a free list that never hands out a block
twice) and one cache tensor per layer, shaped by the attention backend.
"""

from dataclasses import dataclass, field

import torch

from numkern import attention as A


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
        self._free = list(range(num_blocks - 1, -1, -1))
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

    def allocate(self, num_blocks):
        self.pool = BlockPool(num_blocks)
        shape = A.kv_cache_shape(
            num_blocks, self.spec.num_kv_heads, self.spec.block_size, self.spec.head_size
        )
        self.caches = {n: torch.zeros(shape, dtype=self.spec.dtype) for n in self.layer_names}


def group_layers(specs):
    """``{layer name: AttentionSpec}`` -> KV-cache groups of layers with equal specs."""
    groups = {}
    for name, spec in specs.items():
        groups.setdefault(spec, []).append(name)
    return [KVCacheGroup(spec, names) for spec, names in groups.items()]


def blocks_for_budget(groups, budget_bytes):
    """Blocks per group when ``budget_bytes`` is shared evenly per block across groups."""
    per_block = sum(g.spec.bytes_per_block() * len(g.layer_names) for g in groups)
    n = int(budget_bytes) // per_block
    if n < 1:
        raise ValueError(
            f"kv_cache_memory: {budget_bytes} bytes hold no block ({per_block} bytes per block "
            f"across all layers)"
        )
    return n
