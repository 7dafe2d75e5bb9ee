"""Attention glue: backend capabilities, a KV-cache group's geometry, one metadata builder
per group, layers.

A group's :class:`numkern.attention.CacheGeometry` (blocks, kv heads, block size, head
dim, dtype, ISA) is resolved once, by :func:`resolve_geometry`, when the runner allocates
the group (``engine.kv_cache.KVCacheGroup.allocate``): the ISA is decided there (the rule
of ``numkern.isa``, or the engine's override), and the geometry's construction is the one
check of the group's block size and head dim. The group owns it and hands the same object
down both routes to the kernels: its caches' views (``numkern.attention.cache_view``, by
the runner) and its builder's plans (``build()``, once per step: the attention plan of
``numkern.attention.plan_attention`` with the step's block table and slot mapping,
validated once, that every layer of the group runs with). Layers hold no ISA.
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
    def check_block_size(block_size, name="block_size"):
        """ValueError naming ``name`` for a block size the engine does not allow."""
        if not CPUAttentionBackend.supports_block_size(block_size):
            m = nk_isa.engine_block_multiple()
            raise ValueError(f"{name}: expected a multiple of {m}, got {block_size}")

    @staticmethod
    def supports_head_size(head_size):
        multiple, low, high = nk_isa.engine_head_dims()
        return low <= head_size <= high and head_size % multiple == 0

    get_kv_cache_shape = staticmethod(A.kv_cache_shape)


def resolve_geometry(spec, num_blocks, *, override=None):
    """The :class:`numkern.attention.CacheGeometry` of a KV-cache group of ``spec``
    (``engine.kv_cache.AttentionSpec``) with ``num_blocks`` blocks: the engine's block-size
    rule (:meth:`CPUAttentionBackend.check_block_size`), the group's ISA
    (:func:`engine.platform.get_attn_isa`; ``override``: a resolved
    ``numkern.isa.Override`` from ``engine.platform.isa_overrides``, or None), and the
    sizes that ISA serves, checked once here."""
    CPUAttentionBackend.check_block_size(spec.block_size)
    b, d = spec.block_size, spec.head_size
    isa = get_attn_isa(spec.dtype, b, d, override=override)
    try:
        return A.CacheGeometry(num_blocks, spec.num_kv_heads, b, d, spec.dtype, isa)
    except ValueError as e:  # a size it cannot serve (a dtype it does not take: TypeError)
        raise ValueError(f"isa {isa!r} cannot serve block size {b} and head_dim {d}") from e


class AttentionLayer:
    """One attention layer: its name, heads, scale and sliding window (-1: full
    attention). The engine gives it a KV-cache spec (:func:`engine.kv_cache.layer_spec`:
    the block size follows the window); ``numkern.decoder`` computes it."""

    def __init__(self, name, num_heads, num_kv_heads, head_size, *, scale=None, sliding_window=-1):
        self.name = name
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_size = head_size
        self.scale = 1.0 / math.sqrt(head_size) if scale is None else scale
        self.sliding_window = sliding_window


class AttentionMetadataBuilder:
    """Per KV-cache group (allocated: it holds its geometry): each step's plan."""

    def __init__(self, group, layers):
        if not layers:
            raise ValueError("layers: a KV-cache group has at least one attention layer")
        if group.geometry is None:
            raise ValueError("group: expected an allocated KV-cache group (it owns the geometry)")
        heads = {layer.num_heads for layer in layers}
        if len(heads) != 1:
            raise ValueError(f"layers: a group's layers share num_heads, got {sorted(heads)}")
        self.num_heads = heads.pop()
        self.geometry = group.geometry
        self.sliding_window = group.spec.sliding_window

    @property
    def isa(self):
        return self.geometry.isa

    def build(self, query_start_loc, seq_lens, block_table, slot_mapping):
        """The step's attention plan for this group: the work split and the step's
        indices (block table, slot mapping, for the group's cache), validated once for
        every layer of the group; it records the group's geometry."""
        return A.plan_attention(
            query_start_loc,
            seq_lens,
            num_heads=self.num_heads,
            sliding_window=self.sliding_window,
            block_table=block_table,
            slot_mapping=slot_mapping,
            geometry=self.geometry,
        )
