"""Layer 0 of a one-layer engine config, loaded whole or as one of two ranks' shards: what
the sharded-layer tests share (the MoE's in tests/test_moe_parallel.py, the Gated
DeltaNet's in tests/test_engine_gdn.py)."""

import torch

FP32 = torch.float32

LAYER = "model.layers.0."


def hf_config(cls, arch, wrapped=False, **fields):
    """An engine ModelConfig of transformers' ``cls`` with ``fields`` (one layer;
    ``wrapped``: as a multimodal wrapper's ``text_config``)."""
    import transformers

    from engine.loader import ModelConfig

    base = dict(vocab_size=256, hidden_size=64, num_hidden_layers=1, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16)  # fmt: skip
    fields = {**base, **fields}
    if wrapped:
        fields = dict(text_config=fields)
    d = getattr(transformers, cls)(**fields).to_dict()
    d["architectures"] = [arch]
    return ModelConfig.from_hf_dict(d)


def load_layer(cfg, tensors, shard, what="moe", quantization="auto"):
    """Layer 0's FusedMoE (or GatedDeltaNet) of ``shard`` from ``tensors`` (a fresh
    checkpoint: every tensor must be taken or dropped)."""
    from engine.gdn import load_gdn
    from engine.loader.checkpoint import Checkpoint
    from engine.models.experts import load_moe
    from engine.quant import QuantLoader

    ckpt = Checkpoint(cfg, dict(tensors), None, "test")

    def take(name, part=None):
        t = ckpt.take(name, part)
        return t.float() if t.is_floating_point() else t

    if what == "gdn":
        layer = load_gdn(cfg, take, "layer0", LAYER + "linear_attn.", shard)
    else:
        loader = QuantLoader(ckpt, quantization)
        layer = load_moe(cfg, take, LAYER, "vec", (quantization, FP32), loader, shard)
    ckpt.check_all_used()
    return layer


def shards(kind):
    from engine.shard import Shard

    return [Shard(r, 2, kind == "ep") for r in range(2)]
