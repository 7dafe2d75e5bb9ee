"""Attention glue: backend capabilities, one metadata builder per KV-cache group, layers.

The builder of a group takes the block size from the group's spec (never a global),
computes the ISA once and writes it to every layer of the group; its ``build()`` runs
once per step and produces the attention plan (``numkern.attention.plan_attention``
with the step's block table and slot mapping, validated once) that every layer of the
group runs with. Layers never derive an ISA: their caches are viewed, written and read
in the one they were given (``DecoderModel.bind``).
"""

import math

import torch

from numkern import attention as A
from numkern import isa as nk_isa

from .platform import get_attn_isa


class CPUAttentionBackend:
    """Static capabilities of the numkern attention backend."""

    dtypes = (torch.bfloat16, torch.float16, torch.float32)

    @staticmethod
    def supports_block_size(block_size):
        """Multiples of what every x86 variant serves (``numkern.isa``'s table: 32)."""
        return block_size > 0 and block_size % nk_isa.engine_block_multiple() == 0

    @staticmethod
    def supports_head_size(head_size):
        multiple, low, high = nk_isa.engine_head_dims()
        return low <= head_size <= high and head_size % multiple == 0

    get_kv_cache_shape = staticmethod(A.kv_cache_shape)


class AttentionLayer:
    """One attention layer: its name, heads, scale and sliding window (-1: full
    attention), and the ISA of its KV-cache group (written by the group's builder). The
    engine gives it a KV-cache spec (:func:`engine.kv_cache.layer_spec`: the block size
    follows the window); ``numkern.decoder`` computes it."""

    def __init__(self, name, num_heads, num_kv_heads, head_size, *, scale=None, sliding_window=-1):
        self.name = name
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_size = head_size
        self.scale = 1.0 / math.sqrt(head_size) if scale is None else scale
        self.sliding_window = sliding_window
        self.isa = None  # written by the group's metadata builder


class AttentionMetadataBuilder:
    """Per KV-cache group: the ISA (once) and each step's metadata and plan."""

    def __init__(self, spec, layers, *, isa_override=None, layout_only=False):
        if not CPUAttentionBackend.supports_block_size(spec.block_size):
            m = nk_isa.engine_block_multiple()
            raise ValueError(f"block_size: expected a multiple of {m}, got {spec.block_size}")
        if not layers:
            raise ValueError("layers: a KV-cache group has at least one attention layer")
        self.spec = spec
        self.layers = list(layers)
        heads = {layer.num_heads for layer in self.layers}
        if len(heads) != 1:
            raise ValueError(f"layers: a group's layers share num_heads, got {sorted(heads)}")
        self.num_heads = heads.pop()
        self.isa = get_attn_isa(
            spec.dtype,
            spec.block_size,
            spec.head_size,
            override=isa_override,
            layout_only=layout_only,  # tests only (LLM's _layout_isa)
        )
        for layer in self.layers:
            layer.isa = self.isa

    def build(self, query_start_loc, seq_lens, block_table, slot_mapping, num_blocks):
        """The step's attention plan for this group: the work split and the step's
        indices (block table, slot mapping), validated once for every layer of the group."""
        return A.plan_attention(
            query_start_loc,
            seq_lens,
            num_heads=self.num_heads,
            num_kv_heads=self.spec.num_kv_heads,
            head_dim=self.spec.head_size,
            block_size=self.spec.block_size,
            sliding_window=self.spec.sliding_window,
            isa=self.isa,
            block_table=block_table,
            slot_mapping=slot_mapping,
            num_blocks=num_blocks,
        )
