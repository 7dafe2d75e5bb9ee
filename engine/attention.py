"""Attention glue: backend capabilities, one metadata builder per KV-cache group, layers.

The builder of a group takes the block size from the group's spec (never a global),
computes the ISA once and writes it to every layer of the group; its ``build()`` runs
once per step and produces the indices and the attention plan that every layer of the
group uses. Layers never derive an ISA: they write the cache and attend with the one
they were given.
"""

import math
from dataclasses import dataclass

import torch

from numkern import attention as A

from .platform import get_attn_isa


class CPUAttentionBackend:
    """Static capabilities of the numkern attention backend."""

    dtypes = (torch.bfloat16, torch.float16, torch.float32)

    @staticmethod
    def supports_block_size(block_size):
        return block_size > 0 and block_size % 32 == 0

    @staticmethod
    def supports_head_size(head_size):
        return 16 <= head_size <= 512 and head_size % 16 == 0

    get_kv_cache_shape = staticmethod(A.kv_cache_shape)


@dataclass
class AttentionMetadata:
    query_start_loc: torch.Tensor  # [R+1] int32
    seq_lens: torch.Tensor  # [R] int32
    block_table: torch.Tensor  # [R, max_blocks] int32
    slot_mapping: torch.Tensor  # [T] int64
    plan: A.AttentionPlan
    indices: A.StepIndices | None = None  # validated once for all layers (fast path)


class AttentionLayer:
    """One attention layer: cache write + paged attention with the group's ISA."""

    def __init__(self, name, num_heads, num_kv_heads, head_size, *, scale=None,
                 sliding_window=-1, softcap=0.0, sinks=None):  # fmt: skip
        self.name = name
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_size = head_size
        self.scale = 1.0 / math.sqrt(head_size) if scale is None else scale
        self.sliding_window = sliding_window
        self.softcap = softcap
        self.sinks = sinks
        self.isa = None  # written by the group's metadata builder
        self._cache = None  # PagedLayerCache of the kv_cache tensor last seen

    def layer_cache(self, kv_cache):
        """The :class:`numkern.attention.PagedLayerCache` of ``kv_cache`` for this layer's
        ISA (validated once per cache tensor)."""
        if self.isa is None:
            raise RuntimeError(f"{self.name}: no ISA; the group's metadata builder sets it")
        c = self._cache
        if c is None or c.key_cache.data_ptr() != kv_cache.data_ptr() or c.isa != self.isa:
            self._cache = A.PagedLayerCache(kv_cache, self.isa)
        return self._cache

    def forward(self, q, k, v, kv_cache, meta):
        """q [T, Hq, D], k/v [T, Hkv, D] -> [T, Hq, D]."""
        if self.isa is None:
            raise RuntimeError(f"{self.name}: no ISA; the group's metadata builder sets it")
        if meta.indices is not None:  # the step's indices were validated once
            self.layer_cache(kv_cache).write(k, v, meta.indices)
            out = torch.empty_like(q)
            self._cache.attend(q, out, meta.indices, scale=self.scale, softcap=self.softcap,
                               sinks=self.sinks)  # fmt: skip
            return out
        kc, vc = A.split_kv_cache(kv_cache)
        A.reshape_and_cache(k, v, kc, vc, meta.slot_mapping, self.isa)
        out = torch.empty_like(q)
        A.paged_attention(q, kc, vc, out, meta.query_start_loc, meta.seq_lens, meta.block_table,
                          scale=self.scale, sliding_window=self.sliding_window,
                          softcap=self.softcap, sinks=self.sinks, isa=self.isa,
                          plan=meta.plan)  # fmt: skip
        return out


class AttentionMetadataBuilder:
    """Per KV-cache group: the ISA (once) and each step's metadata and plan."""

    def __init__(self, spec, layers, *, isa_override=None):
        if not CPUAttentionBackend.supports_block_size(spec.block_size):
            raise ValueError(f"block_size: expected a multiple of 32, got {spec.block_size}")
        if not layers:
            raise ValueError("layers: a KV-cache group has at least one attention layer")
        self.spec = spec
        self.layers = list(layers)
        heads = {layer.num_heads for layer in self.layers}
        if len(heads) != 1:
            raise ValueError(f"layers: a group's layers share num_heads, got {sorted(heads)}")
        self.num_heads = heads.pop()
        self.isa = get_attn_isa(spec.dtype, spec.block_size, spec.head_size,
                                override=isa_override)  # fmt: skip
        for layer in self.layers:
            layer.isa = self.isa

    def build(self, query_start_loc, seq_lens, block_table, slot_mapping, num_blocks=None):
        """The step's metadata; with ``num_blocks`` the block table is validated here once."""
        # with num_blocks, step_indices validates the block table (once, not twice)
        plan = A.plan_attention(query_start_loc, seq_lens, num_heads=self.num_heads,
                                num_kv_heads=self.spec.num_kv_heads,
                                head_dim=self.spec.head_size, block_size=self.spec.block_size,
                                sliding_window=self.spec.sliding_window, isa=self.isa)  # fmt: skip
        indices = None
        if num_blocks:
            indices = A.step_indices(plan, query_start_loc, seq_lens, block_table, slot_mapping,
                                     num_blocks)  # fmt: skip
        return AttentionMetadata(query_start_loc, seq_lens, block_table, slot_mapping, plan,
                                 indices)  # fmt: skip
