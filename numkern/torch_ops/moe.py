"""numkern's MoE ops as torch custom ops (see ``_lib`` and ``docs/kernels.md`` §12.2).

vLLM 0.32's CPU ops, under vLLM's names with vLLM's schema strings verbatim:

* ``prepack_moe_weight(weight [E, N, K], packed_weight! [E, N, K], isa)``: the packed
  copy of ``weight`` (same shape and dtype) written into ``packed_weight``;
* ``cpu_fused_moe(output! [T, H], input [T, H], w13 [E, 2I, H], w2 [E, H, I], w13_bias
  [E, 2I] | None, w2_bias [E, H] | None, topk_weights [T, k] fp32, topk_id [T, k] int32,
  skip_weighted, act, isa)``: ``numkern.moe.fused_moe`` with vLLM's ``act`` string as its
  ``activation``.

numkern's own: ``quant_fused_moe(output! [T, H], input [T, H], w13 uint8 [E, nbytes13],
w13_type, w2 uint8 [E, nbytes2], w2_type, intermediate_size, w13_bias, w2_bias,
topk_weights, topk_ids, skip_weighted, act)``: ``numkern.moe.fused_moe`` with quantised
experts, each ``QuantWeight`` given as its ``data`` and its type name (``"MXFP4"``).

numkern's routing, under its Python names: ``topk_softmax(logits [T, E], topk,
renormalize)`` and ``grouped_topk(...)`` return ``(topk_weights [T, k] fp32, topk_ids
[T, k] int32)``, new tensors.

Each fake runs the checks of the real op, in its order, with its messages, except the
one check that reads data (``topk_id`` within ``[0, E)`` or -1: docs/kernels.md §5.3).
Every op refuses inputs that require grad (``_lib.refuse_grad``): it has no backward.
"""

import torch

from .. import _check as C
from .. import moe
from ._lib import define, dtype_of, refuse_grad

# vLLM's ``act`` strings -> numkern's ``activation`` names. These four are what vLLM
# 0.32's cpu_fused_moe accepts (any other string is its "Invalid act type" RuntimeError).
ACT = {"silu": "silu", "gelu": "gelu", "gelu_tanh": "gelu_tanh", "swigluoai": "swigluoai"}


def _activation(act):
    if act not in ACT:
        raise ValueError(f"act: expected one of {tuple(ACT)}, got {act!r}")
    return ACT[act]


# ---------------------------------------------------------------------------------------
# prepack_moe_weight


def _check_packed(weight, packed_weight):
    C.check_same_dtype("packed_weight", packed_weight, weight.dtype, "weight")
    C.check_shape("packed_weight", packed_weight, tuple(weight.shape))
    C.check_contiguous("packed_weight", packed_weight)


def _prepack_moe_weight(weight, packed_weight, isa):
    packed = moe.prepack_moe_weight(weight, isa)
    _check_packed(weight, packed_weight)
    packed_weight.copy_(packed)


def _prepack_moe_weight_fake(weight, packed_weight, isa):
    # numkern's op is torch code (a permuted copy): on fake tensors it runs its own checks
    # and moves no data
    moe.prepack_moe_weight(weight, isa)
    _check_packed(weight, packed_weight)


prepack_moe_weight = define(
    "prepack_moe_weight(Tensor weight, Tensor(a1!) packed_weight, str isa) -> ()",
    impl=_prepack_moe_weight,
    fake=_prepack_moe_weight_fake,
)


# ---------------------------------------------------------------------------------------
# cpu_fused_moe


def _cpu_fused_moe(
    output, input, w13, w2, w13_bias, w2_bias, topk_weights, topk_id, skip_weighted, act, isa
):
    moe.fused_moe(
        output,
        input,
        w13,
        w2,
        w13_bias,
        w2_bias,
        topk_weights,
        topk_id,
        activation=_activation(act),
        skip_weighted=skip_weighted,
        isa=isa,
    )


def _cpu_fused_moe_fake(
    output, input, w13, w2, w13_bias, w2_bias, topk_weights, topk_id, skip_weighted, act, isa
):
    """``numkern.moe.fused_moe``'s checks (the same function), less the id range."""
    moe.check_fused_moe(
        output, input, w13, w2, w13_bias, w2_bias, topk_weights, topk_id,
        activation=_activation(act), skip_weighted=skip_weighted, isa=isa,
    )  # fmt: skip


cpu_fused_moe = define(
    "cpu_fused_moe(Tensor(a0!) output, Tensor input, Tensor w13, Tensor w2, "
    "Tensor? w13_bias, Tensor? w2_bias, Tensor topk_weights, Tensor topk_id, "
    "bool skip_weighted, str act, str isa) -> ()",
    impl=_cpu_fused_moe,
    fake=_cpu_fused_moe_fake,
)


# ---------------------------------------------------------------------------------------
# quant_fused_moe: fused_moe with quantised experts (no vLLM op: numkern's own schema)


def _quant_experts(w13, w13_type, w2, w2_type, input, intermediate_size):
    """The two ``numkern.quant.QuantWeight`` experts of the op's buffers ``w13 [E,
    nbytes13]`` / ``w2 [E, nbytes2]`` (uint8; H from ``input``): QuantWeight checks the
    type names and the buffers' sizes (torch code only: fakes too)."""
    from ..quant import QuantWeight, code_of

    C.check_dtype("w13", w13, (torch.uint8,))
    C.check_dtype("w2", w2, (torch.uint8,))
    C.check_ndim("w13", w13, (2,))
    C.check_ndim("w2", w2, (2,))
    C.check_ndim("input", input, (2,))
    e_n, h = w13.shape[0], input.shape[1]
    i_n = C.check_int("intermediate_size", intermediate_size, low=1)
    q13 = QuantWeight(w13_type, code_of(w13_type), (e_n, 2 * i_n, h), w13)
    q2 = QuantWeight(w2_type, code_of(w2_type), (w2.shape[0], h, i_n), w2)
    return q13, q2


def _quant_fused_moe(
    output, input, w13, w13_type, w2, w2_type, intermediate_size, w13_bias, w2_bias,
    topk_weights, topk_ids, skip_weighted, act,
):  # fmt: skip
    q13, q2 = _quant_experts(w13, w13_type, w2, w2_type, input, intermediate_size)
    moe.fused_moe(
        output, input, q13, q2, w13_bias, w2_bias, topk_weights, topk_ids,
        activation=_activation(act), skip_weighted=skip_weighted,
    )  # fmt: skip


def _quant_fused_moe_fake(
    output, input, w13, w13_type, w2, w2_type, intermediate_size, w13_bias, w2_bias,
    topk_weights, topk_ids, skip_weighted, act,
):  # fmt: skip
    """The real op's checks (the same functions), less the id range."""
    q13, q2 = _quant_experts(w13, w13_type, w2, w2_type, input, intermediate_size)
    moe.check_fused_moe_quant(
        output, input, q13, q2, w13_bias, w2_bias, topk_weights, topk_ids,
        activation=_activation(act), skip_weighted=skip_weighted,
    )  # fmt: skip


quant_fused_moe = define(
    "quant_fused_moe(Tensor(a0!) output, Tensor input, Tensor w13, str w13_type, "
    "Tensor w2, str w2_type, int intermediate_size, Tensor? w13_bias, Tensor? w2_bias, "
    "Tensor topk_weights, Tensor topk_ids, bool skip_weighted, str act) -> ()",
    impl=_quant_fused_moe,
    fake=_quant_fused_moe_fake,
)


# ---------------------------------------------------------------------------------------
# routing


def _routing_fake(logits, topk):
    """``numkern.moe``'s routing checks on ``logits`` and ``topk``; the empty results."""
    t_n, _, topk = moe.check_routing(logits, topk)
    weights = logits.new_empty((t_n, topk), dtype=torch.float32)
    return weights, logits.new_empty((t_n, topk), dtype=torch.int32)


def _topk_softmax_fake(logits, topk, renormalize):
    return _routing_fake(logits, topk)


topk_softmax = define(
    "topk_softmax(Tensor logits, int topk, bool renormalize) -> (Tensor, Tensor)",
    impl=moe.topk_softmax,
    fake=_topk_softmax_fake,
)


def _grouped_topk_fake(logits, topk, renormalize, num_expert_group, topk_group, **kw):
    """``numkern.moe.grouped_topk``'s checks (the same functions)."""
    weights, ids = _routing_fake(logits, topk)
    moe.check_grouping(
        logits.shape[1], topk, num_expert_group, topk_group,
        kw.get("scoring_func", "softmax"), kw.get("e_score_correction_bias"),
        kw.get("routed_scaling_factor", 1.0),
    )  # fmt: skip
    return weights, ids


grouped_topk = define(
    "grouped_topk(Tensor logits, int topk, bool renormalize, int num_expert_group, "
    "int topk_group, *, str scoring_func='softmax', float routed_scaling_factor=1.0, "
    "Tensor? e_score_correction_bias=None) -> (Tensor, Tensor)",
    impl=moe.grouped_topk,  # the dispatcher passes its arguments as the schema names them
    fake=_grouped_topk_fake,
)

# ---------------------------------------------------------------------------------------
# moe_workspace_plan: ints in, ints out (no tensor: one kernel for eager and tracing)


def _moe_workspace_plan(
    num_tokens, topk, num_experts, hidden_size, intermediate_size, dtype, num_threads
):
    plan = moe.moe_workspace_plan(
        num_tokens, topk, num_experts, hidden_size, intermediate_size,
        dtype_of("dtype", dtype), num_threads,
    )  # fmt: skip
    return [plan.total_bytes, *(n for span in plan.buffers.values() for n in span)]


moe_workspace_plan = define(
    "moe_workspace_plan(int num_tokens, int topk, int num_experts, int hidden_size, "
    "int intermediate_size, str dtype, int num_threads) -> int[]",
    impl=_moe_workspace_plan,
    fake=None,
)
# the buffers of moe_workspace_plan's list, in order: [total, offset_0, bytes_0, ...]
WORKSPACE_BUFFERS = tuple(moe.moe_workspace_plan(1, 1, 1, 1, 1, torch.float32, 1).buffers)

for _op in (prepack_moe_weight, cpu_fused_moe, quant_fused_moe, topk_softmax, grouped_topk):
    refuse_grad(_op.default)
