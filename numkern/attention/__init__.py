"""Block-tiled paged attention over a paged KV cache (docs/kernels.md §6).

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
request, one kv head, up to ``NRI = 256`` query rows — (position, q head) pairs of that kv
head's group, so every K/V tile is read once for the whole group — and a key range.
When a step has few items (decode of few requests), long key ranges are split across
items and the partial (max, sum, acc) are merged exactly afterwards.

An item of at most 8 rows (a decode with a GQA group of 8 or fewer) walks its keys in
tiles of 32 (two 16-key halves with their own cache offsets, so a ``vec16`` tile may
straddle two blocks) straight from the cache, prefetching the next tile: scores in
512-bit registers (rows x 2 key vectors), soft-cap / ALiBi / mask (only on tiles a row
does not fully see), online softmax in fp32 with 16-lane running sums and the rescale of
the accumulator deferred into the P·V pass, which runs token-major (each key's V row is
contiguous) with 4 rows x 64 dims of accumulators in registers. A prefill item (several
row groups) walks its keys in super-tiles of ``KS = 256`` keys, widened to fp32 once for
all its groups; per row group, the scores of the whole super-tile, one softmax pass (one
max and one rescale per row) and one P·V pass whose accumulators stay in registers
across the super-tile; its register tiles fit the CPU's vector registers
(``isa.PREFILL_TILES``: rows x keys 8 x 32 and rows x dims 4 x 64 in 32 zmm, 6 x 16 and
6 x 16 in 16 ymm, the same bits). P·V reads only keys that exist: an unwritten slot of a tail block
is never touched (it may hold NaN). Threads take items from a shared atomic counter
(dynamic schedule), as vLLM's kernel does.

Modules
-------
``layout`` (a KV-cache group's :class:`CacheGeometry`, validated once; cache shape,
K/V views and their checks, :func:`cache_view`), ``plan`` (the
step's work split, :func:`plan_attention`, validated once), ``tiles`` (register tiles:
one body per tile, the layout's loads chosen by the carrier dtype), ``kernels`` (the
kernels and their named inputs: ``CacheLayout``, ``Heads``, ``RowStrides``, ``Scores``,
``StepArrays``), ``ops`` (the public ops). Which variant serves which block size, head
dim and dtype is ``numkern.isa``'s table.
"""

from .kernels import CacheLayout, Heads, RowStrides, Scores, StepArrays
from .layout import CacheGeometry, CacheView, cache_view, kv_cache_shape, split_kv_cache
from .ops import paged_attention, reshape_and_cache
from .plan import NRI, AttentionPlan, plan_attention, with_tables

__all__ = [
    "NRI",
    "AttentionPlan",
    "CacheGeometry",
    "CacheLayout",
    "CacheView",
    "Heads",
    "RowStrides",
    "Scores",
    "StepArrays",
    "cache_view",
    "kv_cache_shape",
    "paged_attention",
    "plan_attention",
    "reshape_and_cache",
    "split_kv_cache",
    "with_tables",
]
