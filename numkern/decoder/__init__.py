"""A run of pre-norm decoder layers in one Numba call (Llama, Mistral, Qwen2/3, Qwen3-MoE,
Mixtral; with sinks GPT-OSS's attention, with sandwich norms and GELU Gemma 2/3's, with
the output gate Qwen3-Next's attention layers).

Public interface
----------------
:class:`LayerWeights` names one layer's tensors (norm weights fp32 ``[H]``, projections
packed by :func:`numkern.convert_weight_packed` in the model dtype or kept quantised as
:class:`numkern.quant.QuantWeight`, optional fp32 biases and q/k head norms).
:class:`DecoderStack` takes the layers, one
:func:`numkern.attention.cache_view` per layer (the layer's paged KV cache, in the ISA of
its KV-cache group), the final norm and the LM head, validates them once and keeps their
addresses. Per step, :meth:`DecoderStack.prepare` validates the step's attention plan
(:func:`numkern.attention.plan_attention` with ``block_table``, ``slot_mapping`` and
``num_blocks``: the indices it validated are the ones the kernels read), the token
positions and the rotary table once, into a :class:`DecoderStep`; then per run
``stack.run(step, hidden, layers=(l0, l1))`` runs layers ``l0..l1`` on the residual
stream ``hidden [T, H]`` (updated in place), checking only what changes per run. A run
that ends with a layer whose MLP runs outside (``gate_up=None``: an MoE layer) returns
that layer's ``post_norm(hidden)`` for the caller's experts, whose output is then
``residual_add`` of the next run; likewise a layer whose token mixer runs outside
(``qkv=None``: a Gated DeltaNet layer) gets its ``input_norm(hidden)`` from the run
before it and its output back as the next run's ``residual_add`` (``DecoderStack.runs``
lists the runs, each a :class:`Run` ``(l0, l1, outside, start)``). With ``logits_rows``
the run ends with the LM head: ``logits [R, vocab]`` fp32 of the rows' ``final_norm(hidden)``,
rounded to the model dtype first (as HF's lm_head output is).

A ``partial=True`` stack (tensor parallelism: each process holds some heads and some
neurons) ends a run at every row-parallel projection: its ``runs`` are half layers, and a
run whose ``outside`` is ``"reduce"`` returns its ``o`` or ``down`` output (a partial sum)
before the residual add; the caller all-reduces it and passes the sum as the next run's
``residual_add``, which that run normalises with the layer's sandwich norm (if any)
before adding.

Per layer ``x = norm1(h)``; ``qkv = x @ Wqkv.T (+ b)``; per-head RMS norm of q and k
(when given); rotary on q and k (``rotary_dim`` leading dims of each head, rotate-half
when ``is_neox``; the rotary table of the layer's KV-cache group); k and v written to
the cache at the plan's slots; paged attention (``causal``/window of the group's plan;
``scale``, ``softcap``, the layer's ``sinks``); with ``attn_output_gate`` (Qwen3-Next)
``att *= sigmoid(gate)``, the gate being the columns of ``qkv`` after v (one per q
column); ``h += [post_attn_norm](att @ Wo.T (+ b))``; ``x = norm2(h)``; ``h +=
[post_mlp_norm](down(f(gate(x)) * up(x)))`` with ``f`` SiLU or tanh-GELU
(``activation``); the logits optionally soft-capped. Every op's output is rounded to the
model dtype, as in HF and in numkern's op-by-op ops; all arithmetic is fp32.

Layout
------
The package is split by concern: :mod:`.stack` (the public :class:`DecoderStack`,
``prepare`` and ``run``, and :class:`DecoderStep`), :mod:`.runs` (which layers one call
takes, the KV-cache groups), :mod:`.layer` (the layer body: the Numba kernels and their
named inputs, kernel plumbing no caller builds), :mod:`.qgemm` (a quantised weight's GEMM
phases) and :mod:`.phases` (the phase scheduler the kernels' workers share). The
contract is docs/kernels.md, "The decoder run".
"""

from .layer import LayerWeights
from .runs import Run
from .stack import DENSE_ACTIVATIONS, DecoderStack, DecoderStep

__all__ = ["DENSE_ACTIVATIONS", "DecoderStack", "DecoderStep", "LayerWeights", "Run"]
