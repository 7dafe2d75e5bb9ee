"""The GGUF architectures the engine reads: one row per llama.cpp ``general.architecture``
(:data:`GGUF_ARCHS`), each with how its metadata becomes the HF config of an engine
family and how its tensors become that family's HF tensors.

What llama.cpp's ``convert_hf_to_gguf.py`` changed on the way in is undone here:

- llama: q/k rows (and biases) permuted for llama.cpp's rope layout (:func:`rope_row_order`
  undoes it); Llama 3's rope stored as a ``rope_freqs`` table (:func:`llama3_rope` solves
  its parameters); Mixtral's experts are llama's with ``ffn_*_exps``;
- every MoE family: experts stacked into ``ffn_{gate,up,down}_exps [E, N, K]`` (each
  expert's HF tensor is its rows);
- Gemma 2/3 and Qwen3-Next: ``1 +`` baked into every RMS norm weight (Qwen3-Next's GDN
  norm excepted), so the config's ``norm_offset`` becomes 0 and the weights run as
  stored;
- Qwen3-Next: ``in_proj_qkvz`` split into ``attn_qkv`` (all q heads, all k, all v) and
  ``attn_gate`` (z), regrouped here per k head as HF keeps it; ``A_log`` stored as
  ``ssm_a = -exp(A_log)``; ``dt_bias`` as ``ssm_dt.bias``; ``conv1d`` squeezed;
- GPT-OSS: ``gate_up_proj [E, H, 2I]`` (gate and up interleaved) split into
  ``ffn_gate_exps`` / ``ffn_up_exps [E, I, H]``, ``down_proj [E, I, H]`` transposed, the
  sinks as ``attn_sinks.weight``.

The metadata llama.cpp does not store is what its own loader assumes (Gemma's sliding
pattern, Gemma's attention scale, Qwen-MoE's every-layer experts and top-k rule); every
``{arch}.*`` key a row does not read is refused by name (:class:`Keys`), so no key that
changes the math is ignored.

Each HF tensor is a :class:`Recipe`: GGUF tensors whose rows are concatenated, taken in
an order, shaped, and (where the values change) passed through ``post``. A recipe
without ``post`` is the stored rows themselves: its raw quantized bytes are the HF
tensor's (``LazyTensors.raw``).
"""

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np
import torch

from ..args import is_int
from .config import ModelConfig
from .families import FAMILIES
from .fields import SIZE_LIMITS, check_size, finite

# tokenizer.ggml.* keys read for the config (the tokenizer reads its own)
_K_BOS = "tokenizer.ggml.bos_token_id"
_K_EOS = "tokenizer.ggml.eos_token_id"
# llama.cpp ends a generation on these too (llama_vocab_is_eog): Gemma's <end_of_turn>
_K_EOG = ("tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")
# GGML's expert gating functions (llama.cpp LLAMA_EXPERT_GATING_FUNC_TYPE_*)
_GATING_SOFTMAX = 1
_CONTEXT = "max_position_embeddings"  # the size limit of windows and context lengths


class Recipe(NamedTuple):
    """One HF tensor from GGUF tensors: the rows of ``parts`` concatenated, ``order``
    (indices of those rows, or None: all, as stored), viewed as ``shape``, then ``post``
    (None: the stored values)."""

    parts: tuple
    order: torch.Tensor | None
    shape: tuple
    post: Callable | None = None


class Keys:
    """A GGUF file's ``{arch}.*`` keys, each read through here (``key`` without the
    ``{arch}.`` prefix), checked, and remembered: :meth:`refuse_unread` names any the
    row never read."""

    def __init__(self, meta, arch):
        self.meta, self.arch, self.read = meta, arch, set()
        self.tensor = None  # name -> the file's tensor in fp32 (gguf_config's read)

    def name(self, key):
        return f"{self.arch}.{key}"

    def get(self, key, default=None):
        self.read.add(key)
        return self.meta.get(self.name(key), default)

    def has(self, key):
        return self.name(key) in self.meta

    def size(self, key, field_name, default=None, *, required=False):
        """An int key checked against ``SIZE_LIMITS[field_name]`` under its own name."""
        v = self.get(key)
        if v is None:
            if required:
                raise ValueError(f"{self.name(key)}: expected in the GGUF metadata, missing")
            return default
        check_size(self.name(key), v, *SIZE_LIMITS[field_name])
        return v

    def number(self, key, default=None, *, required=False):
        """A float key as the decimal the HF config had: GGUF stores float32 (1e-5 comes
        back as 9.999999747e-06), and the shortest decimal that rounds to the same
        float32 is the value written."""
        v = self.get(key)
        if v is None:
            if required:
                raise ValueError(f"{self.name(key)}: expected in the GGUF metadata, missing")
            return default
        if not finite(v):
            raise ValueError(f"{self.name(key)}: expected a finite number, got {v!r:.80}")
        return float(str(np.float32(v)))

    def refuse_unread(self):
        prefix = f"{self.arch}."
        for k, v in self.meta.items():
            if k.startswith(prefix) and k[len(prefix) :] not in self.read:
                raise ValueError(
                    f"{k}: a GGUF key the engine does not implement for {self.arch} "
                    f"(value {v!r:.60})"
                )


@dataclass(frozen=True)
class GGUFArch:
    """One llama.cpp architecture's row (see the module docstring)."""

    name: str  # general.architecture
    family: str  # the engine family (HF architecture); MoE llama: moe_family
    # GGUF tensor name within a block (or at top level) -> HF name within
    # "model.layers.{i}." (or at top level); a name without its .weight/.bias suffix
    # keeps the suffix, one with it is renamed whole
    tensors: dict
    # (keys, hf dict so far, tensor names) -> the family's own config.json fields
    config: Callable
    norms_baked: bool = False  # the converter's 1 + w in every RMS norm weight
    qk_permute: bool = False  # llama.cpp's rope row permutation of q/k (llama)
    # "qwen" (mlp.experts.{e}.{gate,up,down}_proj), "mixtral" (block_sparse_moe
    # w1/w3/w2), "gpt-oss" (fused, transposed, biased) or None
    experts: str | None = None
    moe_family: str | None = None  # llama with experts: Mixtral
    special: dict = field(default_factory=dict)  # block tensor -> its recipes' rule


_TOP = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_ATTN = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
}
_QK_NORM = {"attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}
_MLP = {
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GEMMA_NORMS = {
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
_ROUTER = {"ffn_norm": "post_attention_layernorm", "ffn_gate_inp": "mlp.gate"}
_SHARED = {
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
}
_EXPERT_NAMES = {
    "qwen": ("mlp.experts.{}.gate_proj", "mlp.experts.{}.up_proj", "mlp.experts.{}.down_proj"),
    "mixtral": (
        "block_sparse_moe.experts.{}.w1",
        "block_sparse_moe.experts.{}.w3",
        "block_sparse_moe.experts.{}.w2",
    ),
}
_EXPS = ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")


def rope_row_order(rows, n_head):
    """The rows of a q/k projection in HF order, as indices of llama.cpp's rows: the
    inverse of ``convert_hf_to_gguf.LlamaModel.permute``, which stores each head's rows
    as pairs (0, D/2), (1, D/2+1), ... where HF keeps the rotate-half order (first
    halves, then second halves)."""
    if rows % (2 * n_head):
        raise ValueError(f"{rows} rows are not {n_head} heads of pairs")
    return torch.arange(rows).reshape(n_head, rows // n_head // 2, 2).transpose(1, 2).reshape(-1)


# -- metadata ----------------------------------------------------------------------------


def _rope_scaling(k, family):
    """rope_scaling (None: plain rope) from ``{arch}.rope.scaling.*``, as
    convert_hf_to_gguf writes HF's linear and YaRN ropes; YaRN's ``truncate`` (not
    stored) is the family's class default."""
    kind = k.get("rope.scaling.type", "none")
    k.get("rope.scaling.finetuned")  # descriptive only
    if kind == "none":
        return None
    if kind == "linear":
        return {"rope_type": "linear", "factor": k.number("rope.scaling.factor", required=True)}
    if kind != "yarn":
        raise ValueError(
            f"{k.name('rope.scaling.type')}: expected 'none', 'linear' or 'yarn', got {kind!r}"
        )
    out = {"rope_type": "yarn", "factor": k.number("rope.scaling.factor", required=True)}
    orig = k.size("rope.scaling.original_context_length", "max_position_embeddings")
    if orig is None:
        raise ValueError(f"{k.name('rope.scaling.original_context_length')}: YaRN needs it")
    out["original_max_position_embeddings"] = orig
    for key, hf in (
        ("rope.scaling.yarn_beta_fast", "beta_fast"),
        ("rope.scaling.yarn_beta_slow", "beta_slow"),
        ("rope.scaling.yarn_attn_factor", "attention_factor"),
    ):
        v = k.number(key)
        if v is not None:
            out[hf] = v
    default = FAMILIES[family].rope_scaling or {}
    if "truncate" in default:
        out["truncate"] = default["truncate"]
    return out


def _common(k, names, embed_rows, meta):
    """The config.json fields every architecture stores the same way."""
    hidden = k.size("embedding_length", "hidden_size", required=True)
    layers = k.size("block_count", "num_hidden_layers", required=True)
    heads = k.size("attention.head_count", "num_attention_heads", required=True)
    head_dim = k.size("attention.key_length", "head_dim", hidden // heads)
    value_dim = k.size("attention.value_length", "head_dim", head_dim)
    if value_dim != head_dim:
        name = k.name("attention.value_length")
        raise ValueError(f"{name}: expected {head_dim}, got {value_dim}")
    eos = [meta[key] for key in (_K_EOS, *_K_EOG) if meta.get(key) is not None]
    k.size("vocab_size", "vocab_size")  # the embedding's rows are what the model computes
    return {
        "vocab_size": embed_rows,
        "hidden_size": hidden,
        "intermediate_size": k.size("feed_forward_length", "intermediate_size", 0),
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": k.size("attention.head_count_kv", "num_key_value_heads", heads),
        "head_dim": head_dim,
        "rms_norm_eps": k.number("attention.layer_norm_rms_epsilon", required=True),
        "rope_theta": k.number("rope.freq_base", 10000.0),  # llama.cpp's default
        "max_position_embeddings": k.size("context_length", _CONTEXT, required=True),
        "tie_word_embeddings": "output.weight" not in names,
        "bos_token_id": meta.get(_K_BOS),
        "eos_token_id": list(dict.fromkeys(eos)),
    }


def _rope_dims(k, d, partial=False):
    """``rope.dimension_count``: the whole head (or, ``partial``, its rotary share)."""
    rot = k.size("rope.dimension_count", "head_dim", d["head_dim"])
    if partial:
        return {"partial_rotary_factor": rot / d["head_dim"]}
    if rot != d["head_dim"]:
        raise ValueError(f"{k.name('rope.dimension_count')}: expected {d['head_dim']}, got {rot}")
    return {}


def _moe(k, *, norm, shared=False, width="expert_feed_forward_length"):
    """The MoE fields: experts, top-k (its weights renormalised: ``norm``, the rule
    llama.cpp's graph for the architecture applies; ``expert_weights_norm`` where a file
    states it must agree), the experts' width (``width``), the shared expert's."""
    out = {
        "num_experts": k.size("expert_count", "num_experts", required=True),
        "num_experts_per_tok": k.size("expert_used_count", "num_experts_per_tok", required=True),
        "norm_topk_prob": norm,
    }
    key = "moe_intermediate_size" if width == "expert_feed_forward_length" else "intermediate_size"
    out[key] = k.size(width, "moe_intermediate_size", required=True)
    if shared:
        out["shared_expert_intermediate_size"] = k.size(
            "expert_shared_feed_forward_length", "shared_expert_intermediate_size", required=True
        )
    stated = k.get("expert_weights_norm")
    if stated is not None and bool(stated) != norm:
        name = k.name("expert_weights_norm")
        raise ValueError(f"{name}: expected {norm} ({k.arch}), got {stated!r}")
    scale = k.number("expert_weights_scale", 1.0)
    if scale != 1.0:
        raise ValueError(f"{k.name('expert_weights_scale')}: expected 1.0, got {scale}")
    gating = k.get("expert_gating_func", _GATING_SOFTMAX)
    if gating != _GATING_SOFTMAX:
        name = k.name("expert_gating_func")
        raise ValueError(f"{name}: expected {_GATING_SOFTMAX} (softmax), got {gating!r}")
    return out


def _swa_kinds(k, n_layers, pattern):
    """Each layer's kind: llama.cpp's ``set_swa_pattern(n)`` (layer i slides when
    ``i % n < n - 1``) with the architecture's ``pattern``, or the file's
    ``attention.sliding_window_pattern`` (an int n, or a bool per layer)."""
    stated = k.get("attention.sliding_window_pattern")
    if is_int(stated) and stated >= 1:
        pattern = stated
    elif stated is not None:
        sliding = list(stated) if not isinstance(stated, (str, int)) else None
        if sliding is None or len(sliding) != n_layers:
            name = k.name("attention.sliding_window_pattern")
            raise ValueError(
                f"{name}: expected an int >= 1 or {n_layers} bools, got {stated!r:.80}"
            )
        return ["sliding_attention" if s else "full_attention" for s in sliding]
    kinds = ("full_attention", "sliding_attention")
    return [kinds[i % pattern < pattern - 1] for i in range(n_layers)]


def _attn_scale_gemma(d, big_layers):
    """llama.cpp's Gemma attention scale: ``hidden / heads`` on the 27B models (told by
    their layer count), else ``head_dim`` (HF's query_pre_attn_scalar)."""
    if d["num_hidden_layers"] == big_layers:
        return d["hidden_size"] // d["num_attention_heads"]
    return d["head_dim"]


def _has(names, block_tensor):
    """Whether any block has the tensor ``block_tensor`` ("attn_q.bias")."""
    return any(n.startswith("blk.") and n.endswith("." + block_tensor) for n in names)


def llama3_rope(factors, theta, head_dim):
    """The ``llama3`` rope_scaling whose per-frequency divisors are ``factors`` (the
    converter's ``rope_freqs`` table, one per rotary pair): 1 for the high frequencies,
    ``factor`` for the low ones, ``1 / ((1 - s) / factor + s)`` between, s linear in
    ``1 / wavelength``. Only that line's slope and offset are in the table, so
    ``low_freq_factor`` is taken as 1 (Llama 3.x's) and ``high_freq_factor`` and
    ``original_max_position_embeddings`` solved from two of the smooth entries; the
    table recomputed from them must match, else ValueError."""
    f = factors.double()
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    factor = f.max().item()
    mid = (f > 1 + 1e-6) & (f < factor * (1 - 1e-6))
    fail = "rope_freqs.weight: not a table of Llama 3's 'llama3' rope the loader can recover"
    if len(f) != len(inv) or factor <= 1 or int(mid.sum()) < 2:
        raise ValueError(fail)
    s = (1 / f[mid] - 1 / factor) / (1 - 1 / factor)
    x = inv[mid] / (2 * torch.pi)  # 1 / wavelength
    a = ((s[-1] - s[0]) / (x[-1] - x[0])).item()
    b = (s[0] - a * x[0]).item()
    if b >= 0:
        raise ValueError(fail)
    high = float(str(np.float32(1 - 1 / b)))
    old = -a / b
    old = round(old) if abs(old - round(old)) < 1e-3 * old else old
    out = {
        "rope_type": "llama3",
        "factor": factor,
        "low_freq_factor": 1.0,
        "high_freq_factor": high,
        "original_max_position_embeddings": old,
    }
    wavelen = 2 * torch.pi / inv
    smooth = (old / wavelen - 1.0) / (high - 1.0)
    want = torch.where(
        wavelen < old / high,
        1.0,
        torch.where(wavelen > old, factor, 1 / ((1 - smooth) / factor + smooth)),
    )
    if not torch.allclose(want, f, rtol=1e-5, atol=0):
        raise ValueError(fail)
    return out


def _llama(k, d, names):
    out = _rope_dims(k, d)
    if "rope_freqs.weight" in names:  # Llama 3's rope, as the converter stores it
        if d["rope_scaling"] is not None:
            raise ValueError(f"{k.name('rope.scaling.type')}: expected none beside rope_freqs")
        out["rope_scaling"] = llama3_rope(
            k.tensor("rope_freqs.weight"), d["rope_theta"], d["head_dim"]
        )
    out["attention_bias"] = _has(names, "attn_q.bias")
    if k.get("expert_count", 0):  # Mixtral: softmax, top-k renormalised
        out.update(_moe(k, norm=True, width="feed_forward_length"))
    return out


def _qwen2(k, d, names):
    return _rope_dims(k, d)


def _qwen3(k, d, names):
    return {**_rope_dims(k, d), "attention_bias": _has(names, "attn_q.bias")}


def _qwen2moe(k, d, names):
    # llama.cpp's qwen2moe graph never renormalises the top-k weights and runs experts on
    # every layer (the converter maps no dense MLP for it)
    moe = _moe(k, norm=False, shared=True)
    return {**_rope_dims(k, d), **moe, "qkv_bias": _has(names, "attn_q.bias")}


def _qwen3moe(k, d, names):
    # llama.cpp's qwen3moe graph renormalises the top-k weights, experts on every layer
    moe = _moe(k, norm=True)
    return {**_rope_dims(k, d), **moe, "attention_bias": _has(names, "attn_q.bias")}


def _gemma2(k, d, names):
    out = _rope_dims(k, d)
    out["sliding_window"] = k.size("attention.sliding_window", _CONTEXT, required=True)
    out["layer_types"] = _swa_kinds(k, d["num_hidden_layers"], 2)
    out["query_pre_attn_scalar"] = _attn_scale_gemma(d, 46)
    # absent: llama.cpp's defaults, Gemma 2's own (50 and 30: the row's class defaults)
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        v = k.number(key)
        if v is not None:
            out[key] = v
    return out


def _gemma3(k, d, names):
    out = _rope_dims(k, d)
    n = d["num_hidden_layers"]
    out["sliding_window"] = k.size("attention.sliding_window", _CONTEXT, required=True)
    out["layer_types"] = _swa_kinds(k, n, 6)
    out["query_pre_attn_scalar"] = _attn_scale_gemma(d, 62)
    cap = k.number("final_logit_softcapping")
    if cap:
        out["final_logit_softcapping"] = cap
    full = {"rope_type": "default", "rope_theta": d.pop("rope_theta")}
    full.update(d.pop("rope_scaling") or {})
    # llama.cpp: the sliding layers rotate at freq_base_swa (default 10000), unscaled
    local = {"rope_type": "default", "rope_theta": k.number("rope.freq_base_swa", 10000.0)}
    out["rope_parameters"] = {"full_attention": full, "sliding_attention": local}
    return out


def _gpt_oss(k, d, names):
    out = _rope_dims(k, d)
    out["sliding_window"] = k.size("attention.sliding_window", _CONTEXT, required=True)
    out["layer_types"] = _swa_kinds(k, d["num_hidden_layers"], 2)
    out["attention_bias"] = _has(names, "attn_q.bias")
    # the router's softmax over its top-k logits (llama.cpp: SOFTMAX_WEIGHT)
    out.update(_moe(k, norm=True))
    out["intermediate_size"] = out.pop("moe_intermediate_size")
    return out


def _qwen3next(k, d, names):
    out = _rope_dims(k, d, partial=True)
    out.update(_moe(k, norm=True, shared=True))
    key_heads = k.size("ssm.group_count", "linear_num_key_heads", required=True)
    value_heads = k.size("ssm.time_step_rank", "linear_num_value_heads", required=True)
    inner = k.size("ssm.inner_size", "intermediate_size", required=True)
    if inner % value_heads:
        raise ValueError(
            f"{k.name('ssm.inner_size')}: expected a multiple of ssm.time_step_rank="
            f"{value_heads}, got {inner}"
        )
    out.update(
        linear_num_key_heads=key_heads,
        linear_num_value_heads=value_heads,
        linear_key_head_dim=k.size("ssm.state_size", "linear_key_head_dim", required=True),
        linear_value_head_dim=inner // value_heads,
        linear_conv_kernel_dim=k.size("ssm.conv_kernel", "linear_conv_kernel_dim", required=True),
        full_attention_interval=k.size("full_attention_interval", "num_hidden_layers", 4),
        attention_bias=_has(names, "attn_q.bias"),
    )
    return out


# -- tensors with a rule of their own ------------------------------------------------------


def _qwen3next_qkvz(f, cfg, bid):
    """``attn_qkv`` [q heads | k heads | v heads] and ``attn_gate`` (z) -> HF's
    ``in_proj_qkvz``, grouped per k head: [q_g, k_g, v_g, z_g] for each head g."""
    g = cfg.gdn
    nk, dk, vg = g.num_k_heads, g.k_head_dim, g.num_v_heads // g.num_k_heads * g.v_head_dim
    qkv, gate = f"blk.{bid}.attn_qkv.weight", f"blk.{bid}.attn_gate.weight"
    z0 = 2 * nk * dk + nk * vg  # z's first row in the concatenation
    groups = [
        torch.cat(
            [
                h * dk + torch.arange(dk),
                nk * dk + h * dk + torch.arange(dk),
                2 * nk * dk + h * vg + torch.arange(vg),
                z0 + h * vg + torch.arange(vg),
            ]
        )
        for h in range(nk)
    ]
    order = torch.cat(groups)
    hidden = f.tensors[qkv].shape[-1]
    return {"linear_attn.in_proj_qkvz.weight": Recipe((qkv, gate), order, (len(order), hidden))}


def _ssm_a(f, cfg, bid):
    """``ssm_a = -exp(A_log)`` -> A_log."""
    name = f"blk.{bid}.ssm_a"
    post = lambda a: torch.log(-a)  # noqa: E731
    return {"linear_attn.A_log": Recipe((name,), None, f.tensors[name].shape, post)}


def _ssm_conv(f, cfg, bid):
    """``ssm_conv1d [C, K]`` (squeezed) -> HF's ``conv1d.weight [C, 1, K]``."""
    name = f"blk.{bid}.ssm_conv1d.weight"
    c, kernel = f.tensors[name].shape
    return {"linear_attn.conv1d.weight": Recipe((name,), None, (c, 1, kernel))}


def _interleave(x):  # [2, E, N] (gate rows, then up rows) -> [E, 2N], gate/up alternating
    _, e, n = x.shape
    return x.permute(1, 2, 0).reshape(e, 2 * n)


def _gpt_oss_experts(f, cfg, bid):
    """``ffn_{gate,up}_exps [E, I, H]`` -> ``gate_up_proj [E, H, 2I]`` (gate and up
    interleaved), ``ffn_down_exps [E, H, I]`` -> ``down_proj [E, I, H]``, and their
    biases."""
    b = f"blk.{bid}."
    gate, up, down = (b + n + ".weight" for n in _EXPS)
    e, i, h = f.tensors[gate].shape
    rows = torch.arange(e * i)
    order = torch.stack([rows, rows + e * i], 1).reshape(-1)
    transpose = lambda x: x.transpose(1, 2)  # noqa: E731
    out = {
        "mlp.experts.gate_up_proj": Recipe((gate, up), order, (e, 2 * i, h), transpose),
        "mlp.experts.down_proj": Recipe((down,), None, f.tensors[down].shape, transpose),
    }
    gb, ub, db = (b + n + ".bias" for n in _EXPS)
    if gb in f.tensors:
        out["mlp.experts.gate_up_proj_bias"] = Recipe(
            (gb, ub), None, (2, e, i), lambda x: _interleave(x)
        )
    if db in f.tensors:
        out["mlp.experts.down_proj_bias"] = Recipe((db,), None, f.tensors[db].shape)
    return out


def _split_experts(f, name, hf):
    """``ffn_{gate,up,down}_exps [E, N, K]`` -> each expert's ``[N, K]`` (its rows),
    named by ``hf`` ("mlp.experts.{}.gate_proj")."""
    e, n, kdim = f.tensors[name].shape
    return {
        hf.format(x) + ".weight": Recipe((name,), torch.arange(x * n, (x + 1) * n), (n, kdim))
        for x in range(e)
    }


_QWEN3NEXT_SPECIAL = {
    "attn_qkv.weight": _qwen3next_qkvz,
    "attn_gate.weight": _qwen3next_qkvz,
    "ssm_a": _ssm_a,
    "ssm_conv1d.weight": _ssm_conv,
}

GGUF_ARCHS = {
    row.name: row
    for row in (
        GGUFArch(
            "llama",
            "LlamaForCausalLM",
            {**_ATTN, **_MLP, "ffn_gate_inp": "block_sparse_moe.gate"},
            _llama,
            qk_permute=True,
            experts="mixtral",
            moe_family="MixtralForCausalLM",
        ),
        GGUFArch("qwen2", "Qwen2ForCausalLM", {**_ATTN, **_MLP}, _qwen2),
        GGUFArch("qwen3", "Qwen3ForCausalLM", {**_ATTN, **_QK_NORM, **_MLP}, _qwen3),
        GGUFArch(
            "qwen2moe",
            "Qwen2MoeForCausalLM",
            {**_ATTN, **_ROUTER, **_SHARED},
            _qwen2moe,
            experts="qwen",
        ),
        GGUFArch(
            "qwen3moe",
            "Qwen3MoeForCausalLM",
            {**_ATTN, **_QK_NORM, **_ROUTER},
            _qwen3moe,
            experts="qwen",
        ),
        GGUFArch(
            "gemma2",
            "Gemma2ForCausalLM",
            {**_ATTN, **_MLP, **_GEMMA_NORMS},
            _gemma2,
            norms_baked=True,
        ),
        GGUFArch(
            "gemma3",
            "Gemma3ForCausalLM",
            {**_ATTN, **_QK_NORM, **_MLP, **_GEMMA_NORMS},
            _gemma3,
            norms_baked=True,
        ),
        GGUFArch(
            "gpt-oss",
            "GptOssForCausalLM",
            {
                **_ATTN,
                "post_attention_norm": "post_attention_layernorm",
                "attn_sinks.weight": "self_attn.sinks",
                "ffn_gate_inp": "mlp.router",
            },
            _gpt_oss,
            experts="gpt-oss",
        ),
        GGUFArch(
            "qwen3next",
            "Qwen3NextForCausalLM",
            {
                **_ATTN,
                **_QK_NORM,
                "post_attention_norm": "post_attention_layernorm",
                "ffn_gate_inp": "mlp.gate",
                **_SHARED,
                "ssm_ba": "linear_attn.in_proj_ba",
                "ssm_norm": "linear_attn.norm",
                "ssm_out": "linear_attn.out_proj",
                "ssm_dt.bias": "linear_attn.dt_bias",
            },
            _qwen3next,
            norms_baked=True,
            experts="qwen",
            special=_QWEN3NEXT_SPECIAL,
        ),
    )
}


def gguf_config(meta, names, embed_rows, read=None):
    """(ModelConfig, its GGUFArch row) of a GGUF file's metadata ``meta`` and tensor
    ``names``; ValueError naming the architecture or key the engine does not
    implement. ``read(name)``: a tensor of the file in fp32 (Llama 3's rope table)."""
    arch = meta.get("general.architecture")
    row = GGUF_ARCHS.get(arch) if isinstance(arch, str) else None
    if row is None:
        known = ", ".join(map(repr, GGUF_ARCHS))
        raise ValueError(f"general.architecture: expected one of {known} (GGUF), got {arch!r}")
    k = Keys(meta, arch)
    k.tensor = read
    if "rope_freqs.weight" in names and row.name != "llama":
        raise ValueError(f"rope_freqs.weight: a rope frequency table, which {arch} has not")
    if embed_rows is None:
        raise ValueError("token_embd.weight: expected a 2-D tensor in the GGUF file, missing")
    d = _common(k, names, embed_rows, meta)
    family = row.moe_family if row.moe_family and k.meta.get(k.name("expert_count")) else row.family
    d["rope_scaling"] = _rope_scaling(k, family)
    d.update(row.config(k, d, names))
    k.refuse_unread()
    cfg = ModelConfig.from_hf_dict({"architectures": [family], **d})
    if row.norms_baked:  # the weights hold 1 + w already: run them as stored
        cfg.norm_offset = 0.0
    return cfg, row


def gguf_recipes(row, cfg, f):
    """HF name -> :class:`Recipe` for every tensor of the GGUF file ``f`` (an
    :class:`engine.loader.gguf_file.GGUFFile`); ValueError naming the tensors no rule takes."""
    recipes, unknown = {}, []
    experts = _EXPERT_NAMES.get(row.experts)
    special = dict(row.special)
    if row.experts == "gpt-oss":
        special.update(dict.fromkeys((n + s for n in _EXPS for s in (".weight", ".bias")), None))
    for name, info in f.tensors.items():
        if name == "rope_freqs.weight" and row.name == "llama":  # read into the config
            continue
        bid, rel = None, name
        if name.startswith("blk."):
            b, _, rel = name[4:].partition(".")
            bid = int(b) if b.isdecimal() and int(b) < cfg.num_hidden_layers else None
            if bid is None:
                unknown.append(name)
                continue
        prefix = "" if bid is None else f"model.layers.{bid}."
        if bid is not None and rel in special:
            rule = special[rel] or _gpt_oss_experts
            got = rule(f, cfg, bid)
        elif bid is not None and experts and rel.removesuffix(".weight") in _EXPS:
            got = _split_experts(f, name, experts[_EXPS.index(rel.removesuffix(".weight"))])
        else:
            suffixed = rel.endswith((".weight", ".bias"))
            base, dot, suffix = rel.rpartition(".") if suffixed else (rel, "", "")
            table = row.tensors if bid is not None else _TOP
            hf = table.get(rel) or (table[base] + dot + suffix if base in table else None)
            if hf is None:
                unknown.append(name)
                continue
            order = None
            if row.qk_permute and base in ("attn_q", "attn_k"):
                heads = cfg.num_attention_heads if base == "attn_q" else cfg.num_key_value_heads
                order = rope_row_order(info.shape[0], heads)
            got = {hf: Recipe((name,), order, info.shape)}
        for hf, r in got.items():
            recipes[prefix + hf] = r
    if unknown:
        raise ValueError(f"GGUF tensors with no HF counterpart here: {', '.join(sorted(unknown))}")
    return recipes
