"""Gated DeltaNet's short causal depthwise convolution, with vLLM 0.32's CPU op argument
lists (``causal_conv1d_fwd_cpu`` / ``causal_conv1d_update_cpu`` in ``vllm/_custom_ops.py``,
kernels in vLLM's ``csrc/cpu/sgl-kernels/conv.cpp``) and its per-request rolling state.

Each of the ``dim`` channels is convolved with its own ``width`` taps over time:
``out[t, c] = act(bias[c] + sum_k w[c, k] * s[t + k, c])`` where ``s`` is the request's
history (the last ``width - 1`` inputs of its earlier chunks, zeros for a new request)
followed by its new tokens; ``act`` is SiLU (``y / (1 + exp(-y))``) or the identity. fp32
math, one rounding to ``x``'s dtype. The history lives in ``conv_states`` by slot and is
rewritten in place.

Layouts (R requests, T tokens in the chunk, S state slots, L = conv_states.shape[2] >=
width - 1; every float tensor in one dtype, bf16/fp16/fp32; any non-negative strides
unless named):

* ``causal_conv1d_fwd(x, weight, bias, conv_states, query_start_loc, cache_indices,
  has_initial_state, silu_activation, is_weight_packed) -> out`` (prefill):
  - ``x [dim, T]``: a varlen chunk, request r owning columns ``query_start_loc[r]`` to
    ``query_start_loc[r+1]`` (vLLM passes ``mixed_qkv.transpose(0, 1)``, a view of a
    ``[T, dim]`` buffer); or ``x [R, dim, T]`` with ``query_start_loc`` None.
  - ``query_start_loc [R+1]`` int32, from 0 to T, non-decreasing.
  - ``cache_indices [R]`` int32: request r's slot, or -1 (``PAD_SLOT_ID``: the request is
    padding, its output is zero and no state is read or written); None: slot r.
  - ``has_initial_state [R]`` bool: whether the slot's history is read (else zeros); None:
    all False.
  - ``conv_states [S, dim, L]``: column j of a slot is input ``j`` of its last
    ``width - 1`` (oldest first) — vLLM's layout, whose memory is ``[S, L, dim]``
    (``stride(1) == 1``); a dim-first ``[S, dim, L]`` buffer works too (both without a
    copy). Only columns ``0 .. width-2`` are read and written.
  - returns ``out``, ``torch.empty_like(x)`` (so the strides of x).
* ``causal_conv1d_update(x, conv_states, weight, bias, silu_activation,
  conv_state_indices, is_weight_packed, num_accepted_tokens=None) -> out`` (decode):
  - ``x [B, dim]``: one token per request; history = columns ``0 .. width-2``, which
    shift left by one with the token appended.
  - ``x [B, q, dim]`` with ``num_accepted_tokens [B]`` int32 (speculative decoding over a
    wide buffer, ``q <= L``): history = columns ``n-1 .. n+width-3`` (n = accepted
    tokens, ``1 <= n <= q``, ``n + width - 2 <= L``); afterwards the slot holds columns
    ``n .. n+L-q-1`` of before, then the q new tokens (vLLM's rollback buffer).
  - ``conv_state_indices [B]`` int32 (or None: slot b), -1 as above.
  - returns ``out``, ``torch.empty_like(x)``.
* ``weight``: ``[dim, width]`` or ``[dim, 1, width]`` (nn.Conv1d's), contiguous.
  ``is_weight_packed=True``: the weight is ``causal_conv1d_weight_pack``'s output (vLLM's
  VNNI layout, below) and is read in that layout; False: plain.
* ``bias [dim]`` or None, contiguous.

``causal_conv1d_weight_pack(weight)``: vLLM's layout, a permutation of ``[dim, width]``
(dim a multiple of 32, width even): channels in blocks of 32, each block
``[width/2, 32, 2]`` — ``packed.flat[(c//32)*32*width + (k//2)*64 + (c%32)*2 + k%2] =
weight[c, k]``.

Files: ``conv_fwd`` (the prefill op), ``conv_update`` (the decode op, its checks memoised
on the call's metadata), ``_conv_kernel`` (the kernel both run, the weight pack and the
checks both share).
"""

from ._conv_kernel import (
    BLOCK_C,
    BLOCK_T,
    PACK_N,
    PAD_SLOT_ID,
    PARALLEL_WORK,
    ConvShape,
    ConvStrides,
    Requests,
    causal_conv1d_weight_pack,
    check_conv_args,
)
from .conv_fwd import causal_conv1d_fwd
from .conv_update import causal_conv1d_update

__all__ = [
    "BLOCK_C",
    "BLOCK_T",
    "PACK_N",
    "PAD_SLOT_ID",
    "PARALLEL_WORK",
    "ConvShape",
    "ConvStrides",
    "Requests",
    "causal_conv1d_fwd",
    "causal_conv1d_update",
    "causal_conv1d_weight_pack",
    "check_conv_args",
]
