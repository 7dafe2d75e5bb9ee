"""Fused MoE: routing, prepacked expert GEMMs, activations, 64-bit workspace
(docs/kernels.md §5).

Layouts
-------
Routing: ``logits [T, E]`` any float dtype, computed in fp32; results ``topk_weights``
fp32 and ``topk_ids`` int32, both contiguous ``[T, k]``; ties go to the lowest expert id.

``prepack_moe_weight(weight [E, N, K], isa)`` (vLLM's layouts, N and K multiples of 32):
rows in tiles of 16; ``vec`` stores each tile ``[K][16]`` (bf16/fp16/fp32), ``amx``
stores it ``[K/2][16][2]`` (K pairs interleaved; bf16 only).

``fused_moe(output [T, H], input [T, H], w13 [E, 2I, H], w2 [E, H, I], w13_bias [E, 2I]
| None, w2_bias [E, H] | None, topk_weights [T, k] fp32, topk_ids [T, k] int32, *,
activation, skip_weighted, isa)``: weights packed for ``isa``, biases in the weight
dtype, output in the input dtype. w13 rows are gate ``0..I-1`` then up ``I..2I-1``; for
``swigluoai`` they interleave (row ``2i`` gate i, row ``2i+1`` up i).

Kernel
------
1. Sort (serial; T*k entries): tokens per expert, exclusive prefix sum, (token, slot)
   pairs scattered in token order; the inverse map slot -> sorted row.
2. Widen the input rows to fp32 once.
3. w13 + activation, parallel over (expert, 16 columns of I) work items: gate and up
   columns of one tile are the two column groups of one register tile
   (``numkern._tiles``), so gate/up never leave registers before the activation, which
   is applied in fp32 and rounded to the input dtype (kept in an fp32 buffer).
4. w2, parallel over (expert, 32 columns of H) items, into the fp32 ``w2_output``.
5. Combine, parallel over tokens: ``out[t] = round(sum_j w[t, j] * y[slot(t, j)])`` in
   slot order, one rounding.
Only experts that received tokens have work items, so decode streams only the chosen
experts' weights. Every size and offset is int64 (``moe_workspace_plan``). The scratch
is the calling thread's own (``workspace``), so threads may call at once.

bf16 calls with many rows per expert take the ``dpbf16`` path where the CPU has
AVX512-BF16 (``isa.gemm_path()``, ``DP_MIN_ROWS_PER_EXPERT`` from ``isa.GEMM``): steps 3
and 4 run ``vdpbf16ps`` tiles on the bf16 input and a bf16 activation buffer (step 2 is
skipped), 1.3-1.56x the widening tiles from 8 rows per expert on a Zen 4 EPYC.

Modules: :mod:`.routing` (``topk_softmax``, ``grouped_topk``, ``check_grouping``),
:mod:`.scratch` (``moe_workspace_plan`` and the per-thread buffer), :mod:`.fused`
(``prepack_moe_weight``, ``check_fused_moe``, ``fused_moe`` and its kernel), :mod:`.quant`
(``fused_moe`` with quantised experts: ``check_fused_moe_quant``, ``is_quantized``, its
kernel), :mod:`.steps` (the sort, activations and rounding both kernels share).
"""

import numba  # noqa: F401  (numkern.moe.numba: the thread count a workspace plan is for)

from .. import _boot  # noqa: F401  (numkern's Numba settings: see numkern/_boot.py)
from .fused import (  # noqa: F401  (the decoder's; tests read its signatures)
    ACTIVATIONS,
    DP_MIN_ROWS_PER_EXPERT,
    GELU_TANH_C,
    KB_PANEL,
    PANEL_MIN_ROWS,
    PANEL_MIN_ROWS_PER_EXPERT,
    SWIGLU_ALPHA,
    SWIGLU_LIMIT,
    _activate,
    _fused_moe,
    check_fused_moe,
    fused_moe,
    prepack_moe_weight,
)
from .quant import check_fused_moe_quant, is_quantized
from .routing import check_grouping, check_routing, grouped_topk, topk_softmax
from .scratch import ALIGN, MR, NT, TILE, MoEWorkspacePlan, moe_workspace_plan, workspace

__all__ = [
    "ACTIVATIONS",
    "ALIGN",
    "DP_MIN_ROWS_PER_EXPERT",
    "GELU_TANH_C",
    "KB_PANEL",
    "MR",
    "NT",
    "PANEL_MIN_ROWS",
    "PANEL_MIN_ROWS_PER_EXPERT",
    "SWIGLU_ALPHA",
    "SWIGLU_LIMIT",
    "TILE",
    "MoEWorkspacePlan",
    "check_fused_moe",
    "check_fused_moe_quant",
    "check_grouping",
    "check_routing",
    "fused_moe",
    "grouped_topk",
    "is_quantized",
    "moe_workspace_plan",
    "prepack_moe_weight",
    "topk_softmax",
    "workspace",
]
