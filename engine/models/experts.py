"""A decoder layer's MoE experts from a checkpoint, whole or one rank's part (issue 29):
the tensors :class:`engine.models.decoder.DecoderModel` hands to
:class:`engine.layers.FusedMoE`.

Under tensor parallelism (``Shard(rank, world, expert_parallel=False)``) every expert is
split along its intermediate dimension, as Megatron / vLLM split a dense MLP: a rank
reads its neurons ``[i0, i1)`` of ``moe_intermediate_size`` -- gate rows and up rows
(GPT-OSS's interleaved ``gate_up``: rows ``[2 i0, 2 i1)``) and the same columns of down,
its slice of ``gate_up``'s bias; down's bias (a row-parallel bias) is added on rank 0
only. Under expert parallelism (``expert_parallel=True``) a rank holds the whole experts
``[e0, e1)`` of ``num_experts`` (with their biases) and never reads the others'. The
router is replicated. Qwen2-MoE's shared expert is split along its
``shared_expert_intermediate_size`` under both. A rank's share of neurons that is not
a multiple of 32 (``numkern.moe.fused_moe``'s I) is padded with zero neurons
(``engine.layers.pad_neurons``: exact, but such a model's experts keep their whole size
on every rank). Each rank's ``FusedMoE`` returns its
partial sum; the model all-reduces it (tokens are replicated on every rank after the
attention all-reduce, so expert parallelism needs no all-to-all).

Quantised experts (a GGUF's, ``engine.quant.QuantLoader.experts``; GPT-OSS's MXFP4,
:func:`mxfp4_experts`) keep their type where the rank's part of down's K is whole
quantisation blocks; otherwise the layer's experts (gate|up too: the quantised op takes
both quantised or neither) are dequantised for this shard and the tensors logged by
name -- a Qwen3-30B-A3B Q4_K file at TP=2 (K = 384 per rank, 256-value blocks) holds
its experts in the model dtype then: expert parallelism keeps them quantised.
"""

from typing import NamedTuple

import torch

from ..layers import FusedMoE, QuantSharedExpert, SharedExpert
from ..platform import log, log_once
from ..shard import SINGLE

MXFP4_BLOCK = 32  # K per MXFP4 block (OCP MX)


class ExpertSplit(NamedTuple):
    """One rank's part of a layer's experts: experts ``[e0, e1)`` of ``num_experts``,
    each one's neurons ``[i0, i1)`` of ``inter``; ``w2_bias``: whether this rank adds
    down's bias (a row-parallel bias under tensor parallelism: rank 0 only)."""

    e0: int
    e1: int
    i0: int
    i1: int
    num_experts: int
    inter: int
    w2_bias: bool

    def experts(self):
        """The rank's part of a stacked ``[E, ...]`` dimension: None (all) or a slice."""
        return None if (self.e0, self.e1) == (0, self.num_experts) else slice(self.e0, self.e1)

    def neurons(self, per=1):
        """The rank's part of an intermediate dimension of ``per`` rows a neuron
        (GPT-OSS's interleaved gate_up: 2): None (all) or a slice."""
        whole = (self.i0, self.i1) == (0, self.inter)
        return None if whole else slice(per * self.i0, per * self.i1)


def expert_split(num_experts, inter, shard=SINGLE):
    """The :class:`ExpertSplit` of ``shard`` (an ``engine.shard.Shard``) for
    ``num_experts`` experts of ``inter`` neurons (a ValueError naming ``num_experts`` /
    ``moe_intermediate_size`` where they do not split; ``engine.shard.check_split``
    refuses such configs before any weight is read)."""
    if shard.world > 1 and shard.expert_parallel:
        e0, e1 = shard.part(num_experts, "num_experts")
        return ExpertSplit(e0, e1, 0, inter, num_experts, inter, True)
    i0, i1 = (0, inter) if shard.world == 1 else shard.part(inter, "moe_intermediate_size")
    return ExpertSplit(0, num_experts, i0, i1, num_experts, inter, shard.rank == 0)


def _part(*dims):
    """A checkpoint part (``engine.loader.checkpoint.Part``), or None where every
    dimension is whole (the tensor read as the unsplit engine reads it)."""
    return None if all(d is None for d in dims) else dims


def shared_expert(take, m, size, shard):
    """Qwen2-MoE's shared expert of layer prefix ``m`` (its ``shared_expert.`` tensors and
    ``shared_expert_gate``), the rank's part of its ``size`` neurons (the gate, one row,
    replicated)."""
    s = m + "shared_expert."
    rows = None
    if shard.world > 1:
        rows = slice(*shard.part(size, "shared_expert_intermediate_size"))
    return SharedExpert(
        gate_proj=take(s + "gate_proj.weight", _part(rows)),
        up_proj=take(s + "up_proj.weight", _part(rows)),
        down_proj=take(s + "down_proj.weight", _part(None, rows)),
        expert_gate=take(m + "shared_expert_gate.weight"),
    )


def load_moe(cfg, take, p, isa, quant, loader, shard=SINGLE):
    """Layer ``p``'s experts as a :class:`engine.layers.FusedMoE`, the rank's part
    (module docstring). ``take(name, part=None)``: the model's tensor reader;
    ``quant``: the engine's ``(quantization, dtype)``; ``loader``: the model's
    ``engine.quant.QuantLoader`` (a GGUF's experts of one kept type stay quantised,
    without a shared expert)."""
    experts = cfg.family.experts  # the tensors' names (Mixtral: block_sparse_moe w1/w3/w2)
    if experts.fused:  # GPT-OSS
        return load_gpt_oss_moe(cfg, take, p + experts.prefix, isa, quant, shard, loader)
    m, names = p + experts.prefix, experts.names
    ex = m + "experts.{}.{}.weight"
    sp = expert_split(cfg.num_experts, cfg.moe_intermediate_size, shard)
    mine = range(sp.e0, sp.e1)
    # another rank's experts (expert parallel): marked used, never read
    loader.drop([ex.format(e, n) for e in range(cfg.num_experts) if e not in mine for n in names])
    rows13 = [[ex.format(e, n) for n in names[:2]] for e in mine]
    rows2 = [[ex.format(e, names[2])] for e in mine]
    kept = None
    shexp = cfg.shared_expert_intermediate_size
    s_names = [f"{m}shared_expert.{n}_proj.weight" for n in ("gate", "up", "down")]
    # with a shared expert, the experts stay quantised only where it does too (one rank)
    if not shexp or (shard.world == 1 and loader.keeps(s_names[:2], s_names[2:])):
        kept = loader.experts(rows13, rows2, neurons=sp.neurons())
    if kept is not None:
        w13, w2 = kept
    else:
        rows, cols = _part(sp.neurons()), _part(None, sp.neurons())
        w13 = torch.stack([torch.cat([take(n, rows) for n in r]) for r in rows13])
        w2 = torch.stack([take(r[0], cols) for r in rows2])
    router = take(m + "gate.weight")
    shared = None
    if shexp and kept is not None:  # Qwen2-MoE, kept in its types beside the experts
        gate_up = loader.linear([(s_names[0], None), (s_names[1], None)])
        down = loader.linear([(s_names[2], None)])
        shared = QuantSharedExpert(gate_up, down, take(m + "shared_expert_gate.weight"))
    elif shexp:  # Qwen2-MoE
        shared = shared_expert(take, m, shexp, shard)
    k, renormalize = cfg.num_experts_per_tok, cfg.norm_topk_prob
    return FusedMoE(router, w13, w2, k, renormalize, isa=isa, shared=shared, experts=(sp.e0, sp.e1))


def mxfp4_experts(take, name, quantization, dtype, part=None, k_range=None):
    """GPT-OSS's MXFP4 experts ``name`` (``{name}_blocks`` uint8 ``[E, N, K/32, 16]``,
    ``{name}_scales`` uint8 ``[E, N, K/32]``: already ``[E, N, K]`` as numkern's w13 /
    w2, the transpose of the bf16 checkpoint's ``[E, K, N]``; gate_up's N interleaves
    gate and up as swigluoai wants) as a ``numkern.quant.QuantWeight``, or with
    ``quantization="none"`` dequantized to ``dtype`` (``[E, N, K]``). A rank's part:
    ``part`` (``(experts, rows)`` slices or None) and ``k_range`` (``(k0, k1)`` of K, or
    None: all); a ``k_range`` that is not whole blocks needs ``quantization="none"``
    (its blocks are read, dequantised, then cut)."""
    from numkern import quant

    e_part, rows = part or (None, None)
    kb = None
    if k_range is not None:
        k0, k1 = k_range
        kb = slice(k0 // MXFP4_BLOCK, -(-k1 // MXFP4_BLOCK))
        if quantization != "none" and (k0 % MXFP4_BLOCK or k1 % MXFP4_BLOCK):
            raise ValueError(f"k_range: expected whole {MXFP4_BLOCK}-value blocks, got {k_range}")
    part = _part(e_part, rows, kb)
    args = () if part is None else (part,)  # (a whole tensor: take(name), as before)
    blocks = take(name + "_blocks", *args)
    w = quant.repack_mxfp4(blocks, take(name + "_scales", *args), name=name + "_blocks")
    if quantization == "none":
        log_once(("mxfp4", "none"), "GPT-OSS MXFP4 experts: dequantized at load")
        w = quant.dequantize(w, dtype=dtype)
        if k_range is not None:
            c0 = kb.start * MXFP4_BLOCK
            w = w[..., k_range[0] - c0 : k_range[1] - c0].contiguous()
        return w
    log_once(("mxfp4", "auto"), "GPT-OSS MXFP4 experts: run in MXFP4 (numkern.moe)")
    return w


def load_gpt_oss_moe(cfg, take, m, isa, quant, shard=SINGLE, loader=None):
    """GPT-OSS's experts, stored all in one and transposed, each with a bias:
    ``gate_up_proj [E, H, 2I]`` (gate and up interleaved along 2I: numkern's swigluoai
    wants its w13 rows so, row 2i gate i, row 2i+1 up i) and ``down_proj [E, I, H]``;
    the router is a linear with a bias, its weights the softmax of the top-k logits (the
    renormalised top-k of the softmax). A published checkpoint stores them in MXFP4
    (:func:`mxfp4_experts`; ``quant``: the engine's ``(quantization, dtype)``). The
    rank's part as the module docstring says. A GGUF file's experts stay in their stored
    type (``loader``: the model's ``engine.quant.QuantLoader``) where the rank holds
    whole experts (its neurons not split)."""
    e = m + "experts."
    sp = expert_split(cfg.num_experts, cfg.moe_intermediate_size, shard)
    ep, pairs, neurons = sp.experts(), sp.neurons(2), sp.neurons()
    kept = None
    if loader is not None and neurons is None and cfg.quant_method is None:
        kept = loader.interleaved_experts(e + "gate_up_proj", e + "down_proj", (sp.e0, sp.e1))
    if kept is not None:
        w13, w2 = kept
    elif cfg.quant_method == "mxfp4":
        quantization, dtype = quant
        k_range = None if neurons is None else (neurons.start, neurons.stop)
        if quantization != "none" and (sp.i0 % MXFP4_BLOCK or sp.i1 % MXFP4_BLOCK):
            log.info(
                "dequantised for this shard (MXFP4: a rank's K of %d not whole %d-value "
                "blocks): %s, %s", sp.i1 - sp.i0, MXFP4_BLOCK, e + "gate_up_proj",
                e + "down_proj",
            )  # fmt: skip
            quantization = "none"
        w13 = mxfp4_experts(take, e + "gate_up_proj", quantization, dtype, (ep, pairs))
        w2 = mxfp4_experts(take, e + "down_proj", quantization, dtype, (ep, None), k_range)
    else:
        w13 = take(e + "gate_up_proj", _part(ep, None, pairs)).transpose(1, 2)  # [E, 2I, H]
        w2 = take(e + "down_proj", _part(ep, neurons)).transpose(1, 2)  # [E, H, I]
    w2_bias = take(e + "down_proj_bias", _part(ep))
    return FusedMoE(
        take(m + "router.weight"),
        w13,
        w2,
        cfg.num_experts_per_tok,
        cfg.norm_topk_prob,
        isa=isa,
        activation="swigluoai",
        router_bias=take(m + "router.bias"),
        w13_bias=take(e + "gate_up_proj_bias", _part(ep, pairs)),
        w2_bias=w2_bias if sp.w2_bias else None,
        experts=(sp.e0, sp.e1),
    )
