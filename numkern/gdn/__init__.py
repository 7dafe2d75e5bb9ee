"""Gated DeltaNet (Qwen3-Next, Qwen3.5): the short causal depthwise convolution, the
gating and the gated delta rule, with vLLM 0.32's CPU ops' arguments and state layouts
(docs/kernels.md §11).

Modules: ``conv`` (causal conv1d, prefill over a varlen chunk and one-token update, with
per-request rolling state by slot), ``gating`` (``g = -exp(A_log) * softplus(a +
dt_bias)``, ``beta = sigmoid(b)``), ``rule`` (the gated delta rule: a recurrent form for
decode and a chunked form for prefill, fp32 state per slot, updated in place), ``norm``
(the gated RMS norm of each head's output with the ``z`` gate).

``conv`` and ``rule`` document their ops; each op's wrapper and kernel are in a file of
its own — ``conv_fwd``, ``conv_update`` (with the kernel both share in ``_conv_kernel``),
``rule_recurrent``, ``rule_chunked`` (what both share in ``_rule_common``) — and
``_common`` holds the memo of the decode ops' checks (``conv_update``,
``rule_recurrent``).
"""

from .conv import PAD_SLOT_ID, causal_conv1d_fwd, causal_conv1d_update, causal_conv1d_weight_pack
from .gating import fused_gdn_gating
from .norm import rms_norm_gated
from .rule import chunk_gated_delta_rule, fused_sigmoid_gating_delta_rule_update

__all__ = [
    "PAD_SLOT_ID",
    "causal_conv1d_fwd",
    "causal_conv1d_update",
    "causal_conv1d_weight_pack",
    "chunk_gated_delta_rule",
    "fused_gdn_gating",
    "fused_sigmoid_gating_delta_rule_update",
    "rms_norm_gated",
]
