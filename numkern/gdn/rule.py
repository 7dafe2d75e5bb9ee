"""The gated delta rule of Gated DeltaNet, with vLLM 0.32's CPU op argument lists.

Per v head h and token t (all fp32), with ``q_t``, ``k_t`` of k head ``h // (Hv // Hk)``
(L2-normalised when asked, ``q_t`` then scaled by ``Dk ** -0.5``), a state ``S [Dk, Dv]``,
a log decay ``g_t <= 0`` and a write strength ``beta_t``::

    S   = S * exp(g_t)
    S  += k_t^T ((v_t - k_t S) * beta_t)          # the delta rule: replace k_t's value
    o_t = q_t S

Layouts (T tokens of N requests packed along one axis, request n owning tokens
``cu_seqlens[n]:cu_seqlens[n+1]`` and state slot ``initial_state_indices[n]``):

* ``q``/``query``, ``k``/``key`` ``[1, T, Hk, Dk]``; ``v``/``value`` ``[1, T, Hv, Dv]``:
  bf16/fp16/fp32, one dtype, ``stride(-1) == 1`` (tokens and heads may be strided: the
  q/k/v column windows of one fused buffer). ``Hv`` a multiple of ``Hk`` (v head h reads
  k head ``h // (Hv // Hk)``); ``Dk`` and ``Dv`` multiples of 16.
* state ``[num_slots, Hv, Dk, Dv]`` fp32: ``S[k, v]`` of slot s, head h at
  ``[s, h, k, v]`` — the order vLLM's CPU kernels use (vLLM allocates the cache as
  ``[num_slots, Hv, Dv, Dk]`` and hands the CPU ops a ``.view`` of it with the last two
  sizes swapped, not a transpose; its Triton kernels use the transpose ``[.., Dv, Dk]``).
  Each slot contiguous; the slot stride may be larger (a pooled cache). Updated in place.
* ``initial_state_indices [N]`` int32: a slot per request, below ``num_slots``, no slot
  twice; slot -1 (vLLM's PAD_SLOT_ID) marks padding: its tokens' outputs are
  zero and no state is read or written. ``cu_seqlens [N+1]`` int32: 0, non-decreasing,
  ending at T.

Ops:

* ``fused_sigmoid_gating_delta_rule_update(A_log, dt_bias, q, k, v, a, b,
  initial_state_source, initial_state_indices, cu_seqlens, use_qk_l2norm_in_kernel,
  softplus_beta=1.0, softplus_threshold=20.0) -> out [T, 1, Hv, Dv]`` (vLLM's
  ``[batch_size, seq_len, ..]`` for ``q [seq_len=1, batch_size=T, ..]``; the memory of
  ``[1, T, Hv, Dv]``): the recurrent form, token by token, for decode. The gating is fused:
  ``g = -exp(A_log) * softplus(a + dt_bias)``, ``beta = sigmoid(b)`` with ``a, b [T, Hv]``
  in q's dtype and ``A_log``, ``dt_bias [Hv]`` in fp32 or q's dtype; torch's softplus
  (``x`` where ``softplus_beta * x > softplus_threshold``, else
  ``log1p(exp(softplus_beta * x)) / softplus_beta``). L2 norm: ``x / sqrt(sum(x^2) + eps)``,
  ``eps`` a keyword after vLLM's arguments (default 1e-5, vLLM's fixed value).
* ``chunk_gated_delta_rule(query, key, value, g, beta, initial_state, output_final_state,
  cu_seqlens, head_first, use_qk_l2norm_in_kernel, initial_state_indices, eps=1e-5) ->
  (out [1, T, Hv, Dv], initial_state)``: the chunked (WY / UT-transform) form of
  flash-linear-attention for prefill. ``g [1, T, Hv]`` fp32 (log decay, gating already
  applied), ``beta [1, T, Hv]`` in query's dtype or fp32. L2 norm with ``eps``.

The recurrent form's products are fp32 and each output element is rounded once; so are
the chunked form's on its fp32 path, and the two forms agree to fp32 rounding. On bf16
inputs where the CPU has AVX512-BF16 (``DP_BF16``) the chunked form takes its bf16 path
(its one kernel body with bf16 operands): its products on ``vdpbf16ps``, their operands
rounded to bf16 first, as vLLM's chunked op rounds q, k, W, U and V' (docs/kernels.md
§11.5: the error measured).

Files: ``rule_recurrent`` (the recurrent op, its checks memoised on the call's
metadata), ``rule_chunked`` (the chunked op, its math and both paths in its docstring),
``_rule_common`` (the kernels' named inputs, the q/k row loader, the chunked form's
vector-block helpers and the checks both run).
"""

from ._rule_common import Gating, Layout, check_qkv, check_rows, check_state
from .rule_chunked import CHUNK, DP_BF16, chunk_gated_delta_rule
from .rule_recurrent import RECURRENT_EPS, fused_sigmoid_gating_delta_rule_update

__all__ = [
    "CHUNK",
    "DP_BF16",
    "RECURRENT_EPS",
    "Gating",
    "Layout",
    "check_qkv",
    "check_rows",
    "check_state",
    "chunk_gated_delta_rule",
    "fused_sigmoid_gating_delta_rule_update",
]
