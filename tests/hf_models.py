"""Tiny random HF models and the engine beside them: what the engine-vs-transformers
tests share (random weights whose norms and biases a loader cannot drop unnoticed, the
prompts, HF's greedy tokens and per-layer windows, an engine with small defaults)."""

import torch
import transformers

from engine.llm import LLM

# (mean, std) of parameters drawn at other scales: GPT-OSS's sinks as large as the
# attention scores (so that dropping one shows), its gate/up projections large enough
# that swigluoai's clamps at 7 bite (about 1 value in 10), its down projections small
# the smallest model the engine runs (the attention kernels' smallest head): 2 heads of 16
# (one KV head), 2 layers
TINY = dict(
    vocab_size=256,
    hidden_size=32,
    intermediate_size=40,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    max_position_embeddings=512,
)

EXPERT_SCALES = {"sinks": (1.0, 1.0), "gate_up_proj": (0.0, 0.5), "down_proj": (0.0, 0.03)}


def randomize(model, seed, *, norm=(1.0, 0.2), scales=EXPERT_SCALES):
    """Fill ``model``'s weights in place: ``mean + std * N(0, 1)`` with (mean, std) =
    ``norm`` for norms (Gemma's scale by 1 + w: pass (0.0, 0.3)), (0, 0.2) for biases,
    ``scales[name]`` by parameter name, else (0, 0.1), after seeding torch with ``seed``
    (None: the generator as it is). Returns it in eval mode."""
    if seed is not None:
        torch.manual_seed(seed)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            mean, std = scales.get(pname.rsplit(".", 1)[-1], (0.0, 0.1))
            if "norm" in pname:
                mean, std = norm
            elif pname.endswith("bias"):
                std = 0.2
            p.copy_(mean + std * torch.randn_like(p))
    return model.eval()


def random_model(cfg, seed, **kw):
    """transformers' model of ``cfg`` with eager attention (its soft-caps and sinks),
    randomized (:func:`randomize`); torch is seeded with ``seed`` before the model is
    built."""
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager")
    return randomize(model, None, **kw)


def prompt(n, salt=0):
    return [(37 * i + 11 * salt) % 250 + 3 for i in range(n)]


def hf_greedy(hf, ids, n):
    """HF's ``n`` greedy tokens after ``ids`` (EOS ignored)."""
    with torch.no_grad():
        out = hf.generate(torch.tensor([ids]), max_new_tokens=n, min_new_tokens=n,
                          do_sample=False, eos_token_id=None, pad_token_id=0)  # fmt: skip
    return out[0, len(ids) :].tolist()


def hf_windows(hf):
    """The window HF's attention applies on each layer (-1: none): the attention
    module's own, or (Mistral, Mixtral, whose modules keep none) the config's on every
    layer."""
    layers = hf.model.layers
    if not any(hasattr(layer.self_attn, "sliding_window") for layer in layers):
        return [hf.config.sliding_window or -1] * len(layers)
    return [getattr(layer.self_attn, "sliding_window", None) or -1 for layer in layers]


def engine(path, **kw):
    """The engine on ``path`` in fp32, blocks of 32, an 8 MB KV pool (``kw`` overrides)."""
    kw = {"dtype": "float32", "block_size": 32, "kv_cache_memory": 8 << 20, **kw}
    return LLM(path, progress=False, **kw)
