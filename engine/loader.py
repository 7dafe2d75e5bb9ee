"""Reading a checkpoint for the engine: config, tensors (HF names) and tokenizer.

Two sources, each read with the library made for it:

- a Hugging Face directory: ``config.json``; ``model.safetensors`` or
  ``model.safetensors.index.json`` + shards, opened with safetensors' ``safe_open``
  (memory maps); ``tokenizer.json`` (optional) with ``tokenizers``; the chat template
  and the named special tokens from ``tokenizer_config.json`` (``chat_template.jinja``
  and ``special_tokens_map.json`` where present).
- a ``.gguf`` file (llama.cpp), read by :mod:`engine.gguf_file` (metadata in one pass,
  a memory map of the tensors): every tensor is renamed to its HF name and dequantized
  when the model takes it (:class:`LazyTensors`), Llama's q/k rows put back in HF order
  (llama.cpp's converter permutes them for its rope layout). The config comes from the
  metadata and the tokenizer, where the file describes a byte-level BPE, from the
  embedded vocabulary and merges; the chat template from ``tokenizer.chat_template``.

Tensors keep the HF layout: a projection is ``[out_features, in_features]``, a norm
``[hidden]``, experts one tensor each (``model.layers.N.mlp.experts.E.gate_proj.weight``)
or, for GPT-OSS, all in one (``mlp.experts.gate_up_proj [E, H, 2I]``). The model
takes each tensor exactly once (``Checkpoint.take``) and ends with
``Checkpoint.check_all_used``, so no tensor of a checkpoint is silently ignored.

safetensors and tokenizers are imported where they are used, so that the engine
imports (and a checkpoint of the other kind loads) without them; ``gguf`` only for a
GGUF tensor type :mod:`engine.gguf_file` does not dequantize itself (K-quants, IQ*).
"""

import contextlib
import difflib
import json
import logging
import math
import os
import warnings
from collections.abc import MutableMapping
from dataclasses import dataclass, field

import numpy as np
import torch
from tqdm import tqdm

from numkern.moe import SWIGLU_ALPHA, SWIGLU_LIMIT

log = logging.getLogger("engine")

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "Qwen3MoeForCausalLM",
    "Qwen2MoeForCausalLM",
    "MixtralForCausalLM",
    "GptOssForCausalLM",
    "Gemma2ForCausalLM",
    "Gemma3ForCausalLM",
    "Qwen3NextForCausalLM",
    "Qwen3_5ForCausalLM",
    "Qwen3_5MoeForCausalLM",
)
# the hybrids: Gated DeltaNet layers (linear attention, a state per request) beside
# gated full-attention layers, (1 + w) norms, partial rotary
GDN_ARCHITECTURES = ("Qwen3NextForCausalLM", "Qwen3_5ForCausalLM", "Qwen3_5MoeForCausalLM")
GEMMA_ARCHITECTURES = ("Gemma2ForCausalLM", "Gemma3ForCausalLM")
# a multimodal wrapper whose text model the engine runs: its config's text_config, its
# language model's tensors (vision tensors skipped by name, logged once)
TEXT_OF_WRAPPER = {
    "Gemma3ForConditionalGeneration": "Gemma3ForCausalLM",
    "Qwen3_5ForConditionalGeneration": "Qwen3_5ForCausalLM",
    "Qwen3_5MoeForConditionalGeneration": "Qwen3_5MoeForCausalLM",
}
MOE_ARCHITECTURES = (
    "Qwen3MoeForCausalLM",
    "Qwen3NextForCausalLM",
    "Qwen3_5MoeForCausalLM",
    "Qwen2MoeForCausalLM",
    "MixtralForCausalLM",
    "GptOssForCausalLM",
)
# the families whose every layer is MoE (the others: transformers' sparse-step rule)
_ALL_MOE_LAYERS = ("MixtralForCausalLM", "GptOssForCausalLM", "Qwen3_5MoeForCausalLM")
ROPE_TYPES = ("default", "linear", "llama3", "yarn")  # what engine.layers.rope_inv_freq implements

# config.json files saved from a bare config (no model) carry model_type, not architectures
_MODEL_TYPE_TO_ARCHITECTURE = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "gpt_oss": "GptOssForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
    "gemma3": "Gemma3ForConditionalGeneration",
    "qwen3_next": "Qwen3NextForCausalLM",
    "qwen3_5_text": "Qwen3_5ForCausalLM",
    "qwen3_5_moe_text": "Qwen3_5MoeForCausalLM",
    "qwen3_5": "Qwen3_5ForConditionalGeneration",
    "qwen3_5_moe": "Qwen3_5MoeForConditionalGeneration",
}
# the families whose attention_bias switches q/k/v/o biases (transformers' modeling files)
_ATTENTION_BIAS = (
    "LlamaForCausalLM",
    "Qwen3ForCausalLM",
    "Qwen3MoeForCausalLM",
    "GptOssForCausalLM",
    "Gemma2ForCausalLM",
    "Gemma3ForCausalLM",
    *GDN_ARCHITECTURES,
)

# The config.json fields each family's math reads (beyond vocab_size, hidden_size,
# intermediate_size, num_hidden_layers, num_attention_heads, num_key_value_heads,
# head_dim, rms_norm_eps, max_position_embeddings, tie_word_embeddings, bos/eos ids and
# rope_theta / rope_scaling / rope_parameters, read for all): each is honoured, or the
# checkpoint is refused with a ValueError naming it. Fields that only matter in
# training (dropouts, router aux losses, jitter noise, initializer ranges) are not read.
# A quantization_config is refused for every family (unquantized weights only).
_GDN_FIELDS = (
    "attention_bias",
    "attn_output_gate (true only)",
    "mamba_ssm_dtype (float32 only)",
    "layer_types",
    "full_attention_interval",
    "partial_rotary_factor",
    "linear_num_key_heads",
    "linear_num_value_heads",
    "linear_key_head_dim",
    "linear_value_head_dim",
    "linear_conv_kernel_dim",
    "hidden_act (silu)",
)
_QWEN3_NEXT_MOE = (
    "num_experts",
    "num_experts_per_tok",
    "moe_intermediate_size",
    "shared_expert_intermediate_size",
)
HONOURED_FIELDS = {
    "LlamaForCausalLM": ("attention_bias", "mlp_bias (false only)", "hidden_act (silu)"),
    "MistralForCausalLM": ("sliding_window", "hidden_act (silu)"),
    "Qwen2ForCausalLM": (
        "use_sliding_window",
        "sliding_window",
        "max_window_layers",
        "layer_types",
        "hidden_act (silu)",
    ),
    "Qwen3ForCausalLM": (
        "attention_bias",
        "use_sliding_window",
        "sliding_window",
        "max_window_layers",
        "layer_types",
        "hidden_act (silu)",
    ),
    "Qwen3MoeForCausalLM": (
        "attention_bias",
        "use_sliding_window",
        "sliding_window",
        "num_experts",
        "num_experts_per_tok",
        "moe_intermediate_size",
        "norm_topk_prob",
        "decoder_sparse_step",
        "mlp_only_layers",
        "hidden_act (silu)",
    ),
    "Qwen2MoeForCausalLM": (
        "qkv_bias",
        "use_sliding_window",
        "sliding_window",
        "max_window_layers",
        "layer_types",
        "num_experts",
        "num_experts_per_tok",
        "moe_intermediate_size",
        "shared_expert_intermediate_size",
        "norm_topk_prob",
        "decoder_sparse_step",
        "mlp_only_layers",
        "hidden_act (silu)",
    ),
    "Gemma2ForCausalLM": (
        "hidden_activation (gelu_pytorch_tanh)",
        "attention_bias",
        "query_pre_attn_scalar",
        "attn_logit_softcapping",
        "final_logit_softcapping",
        "sliding_window",
        "layer_types",
        "use_bidirectional_attention (false only)",
    ),
    "Gemma3ForCausalLM": (
        "hidden_activation (gelu_pytorch_tanh)",
        "attention_bias",
        "query_pre_attn_scalar",
        "attn_logit_softcapping",
        "final_logit_softcapping",
        "sliding_window",
        "layer_types",
        "sliding_window_pattern",
        "rope_local_base_freq",
        "rope_parameters per layer kind",
        "use_bidirectional_attention (false only)",
    ),
    "MixtralForCausalLM": (
        "sliding_window",
        "num_local_experts",
        "num_experts_per_tok",
        "hidden_act (silu)",
    ),
    "GptOssForCausalLM": (
        "attention_bias",
        "sliding_window",
        "layer_types",
        "num_local_experts",
        "num_experts_per_tok",
        "swiglu_alpha (1.702)",
        "swiglu_limit (7.0)",
    ),
    "Qwen3NextForCausalLM": (
        *_GDN_FIELDS,
        *_QWEN3_NEXT_MOE,
        "norm_topk_prob",
        "decoder_sparse_step",
        "mlp_only_layers",
    ),
    # mrope_section / mrope_interleaved: with text-only positions (all three axes equal)
    # the multimodal rope is plain rope
    "Qwen3_5ForCausalLM": (*_GDN_FIELDS, "mrope_section", "mrope_interleaved"),
    "Qwen3_5MoeForCausalLM": (*_GDN_FIELDS, *_QWEN3_NEXT_MOE, "mrope_section", "mrope_interleaved"),
}

# transformers' class defaults of a family that differ from what the engine assumes
# where a config.json leaves the field out (none: num_key_value_heads as
# num_attention_heads, head_dim hidden_size / num_attention_heads, no window, no bias)
_CLASS_DEFAULTS = {
    "MistralForCausalLM": {"num_key_value_heads": 8, "sliding_window": 4096},
    "MixtralForCausalLM": {"num_key_value_heads": 8},
    "Qwen2ForCausalLM": {"num_key_value_heads": 32, "sliding_window": 4096},
    "Qwen3ForCausalLM": {"num_key_value_heads": 32, "head_dim": 128, "sliding_window": 4096},
    "Qwen3MoeForCausalLM": {"num_key_value_heads": 4, "sliding_window": 4096},
    "Gemma2ForCausalLM": {"num_key_value_heads": 4, "head_dim": 256},
    "Qwen2MoeForCausalLM": {"num_key_value_heads": 16, "sliding_window": 4096},
    "GptOssForCausalLM": {
        "num_key_value_heads": 8,
        "head_dim": 64,
        "sliding_window": 128,
        "attention_bias": True,
    },
    # Gemma3TextConfig: google/gemma-3-4b-it's text_config names only hidden_size,
    # intermediate_size, num_hidden_layers, rope_scaling and sliding_window
    # Qwen3NextConfig, Qwen3_5TextConfig, Qwen3_5MoeTextConfig
    "Qwen3NextForCausalLM": {"num_key_value_heads": 2, "head_dim": 256, "norm_topk_prob": True},
    "Qwen3_5ForCausalLM": {"num_key_value_heads": 4, "head_dim": 256},
    "Qwen3_5MoeForCausalLM": {"num_key_value_heads": 2, "head_dim": 256},
    "Gemma3ForCausalLM": {
        "vocab_size": 262208,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "head_dim": 256,
        "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-6,
    },
}
# transformers' class defaults, for configs old enough to have no rope_theta at all
_DEFAULT_ROPE_THETA = {"MixtralForCausalLM": 1e6, "GptOssForCausalLM": 150000.0}
# transformers' class defaults where a config.json has neither rope_parameters nor
# rope_scaling (GptOssConfig: YaRN)
_DEFAULT_ROPE_SCALING = {
    "GptOssForCausalLM": {
        "rope_type": "yarn",
        "factor": 32.0,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "truncate": False,
        "original_max_position_embeddings": 4096,
    }
}
# the YaRN parameters engine.layers.rope_inv_freq reads (transformers' own list)
_YARN_KEYS = (
    "factor",
    "original_max_position_embeddings",
    "attention_factor",
    "beta_fast",
    "beta_slow",
    "mscale",
    "mscale_all_dim",
    "truncate",
)
# GPT-OSS's expert activation fields, fixed in numkern.moe's "swigluoai"
_SWIGLU_OAI = {"swiglu_alpha": SWIGLU_ALPHA, "swiglu_limit": SWIGLU_LIMIT}

# Below this many tensors a load takes well under a second and a bar is only noise; a
# bar appears only once a load has taken PROGRESS_DELAY seconds (SmolLM2's GGUF: ~0.3 s).
PROGRESS_MIN_TENSORS = 64
PROGRESS_DELAY = 1.0

# The range of each size a config may give, checked before anything is sized by it (a
# hostile config.json or GGUF header must not make the loader build a 2^40-entry list
# or the engine allocate terabytes). The upper bounds are far above the published
# checkpoints (largest seen: vocab 262,208 Gemma 3; hidden 16,384, intermediate 53,248,
# 126 layers, 128 heads Llama 3.1 405B; head_dim 256 Gemma; 512 experts Qwen3-Next;
# context 10M Llama 4 Scout) and keep every product of them within int64. A size of 0
# means "none" where a family may lack the part (Qwen3.5-MoE's dense MLP, experts).
SIZE_LIMITS = {
    "vocab_size": (1, 1 << 22),
    "hidden_size": (1, 1 << 16),
    "intermediate_size": (0, 1 << 20),
    "moe_intermediate_size": (0, 1 << 20),
    "shared_expert_intermediate_size": (0, 1 << 20),
    "num_hidden_layers": (1, 1 << 12),
    "num_attention_heads": (1, 1 << 12),
    "num_key_value_heads": (1, 1 << 12),
    "head_dim": (1, 1 << 12),
    "num_experts": (0, 1 << 14),
    "num_local_experts": (0, 1 << 14),
    "num_experts_per_tok": (0, 1 << 14),
    "max_position_embeddings": (1, 1 << 30),
    "linear_num_key_heads": (1, 1 << 12),
    "linear_num_value_heads": (1, 1 << 12),
    "linear_key_head_dim": (1, 1 << 12),
    "linear_value_head_dim": (1, 1 << 12),
    "linear_conv_kernel_dim": (1, 1 << 8),
}


def _check_size(name, value, low, high):
    """ValueError naming ``name`` unless ``value`` is an int (not a bool) in [low, high]."""
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ValueError(f"{name}: expected an int in [{low}, {high}], got {value!r:.80}")


def _check_sizes(fields):
    """:func:`_check_size` on each field of ``fields`` (a config dict) that
    :data:`SIZE_LIMITS` bounds; an absent or null field is left to the caller."""
    for key, (low, high) in SIZE_LIMITS.items():
        if fields.get(key) is not None:
            _check_size(key, fields[key], low, high)


def _finite(v):
    return not isinstance(v, bool) and isinstance(v, (int, float)) and math.isfinite(v)


@dataclass(frozen=True)
class GDNConfig:
    """The Gated DeltaNet layers' shapes (transformers' ``linear_*`` config fields)."""

    num_k_heads: int
    num_v_heads: int
    k_head_dim: int
    v_head_dim: int
    conv_kernel: int

    @property
    def conv_dim(self):  # q, k and v channels, convolved together
        return 2 * self.num_k_heads * self.k_head_dim + self.num_v_heads * self.v_head_dim


@dataclass
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int | None = None  # None: num_attention_heads (no GQA)
    head_dim: int | None = None  # None: hidden_size // num_attention_heads
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None  # {"rope_type": "llama3"|"yarn"|"default", ...}
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # q, k, v and o projections
    qkv_bias: bool | None = None  # None: attention_bias (Qwen2: q/k/v only)
    num_experts: int = 0  # 0: dense
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    # Qwen2-MoE: a dense expert every token runs, weighted by sigmoid(x @ gate.T)
    shared_expert_intermediate_size: int = 0
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: list = field(default_factory=list)
    bos_token_id: int | None = None
    eos_token_id: list = field(default_factory=list)  # int or list in; always a list
    torch_dtype: str | None = None
    # per layer: its sliding window (as HF's: a query at p sees keys p-W+1..p), -1 for
    # full attention; None: full attention everywhere
    layer_windows: list | None = None
    # Gemma 2/3 (GEMMA_FIELDS): the dense MLP's activation, (offset + w) norms, sandwich
    # norms, the embedding scale (applied rounded to the model dtype), soft-caps, the
    # attention scale and each layer's rope (None: rope_theta/rope_scaling for all)
    hidden_act: str = "silu"  # or "gelu_tanh"
    norm_offset: float = 0.0
    sandwich_norms: bool = False
    embed_scale: float = 1.0
    attn_softcap: float = 0.0
    logit_softcap: float = 0.0
    attn_scale: float | None = None  # None: head_dim ** -0.5
    layer_ropes: list | None = None  # per layer: (rope_theta, rope_scaling)
    text_of: str | None = None  # the multimodal wrapper this text model came from
    # Gated DeltaNet hybrids (GDN_ARCHITECTURES, :func:`_gdn`): each layer's token mixer
    # ("attention" or "linear_attention"; None: attention everywhere), the GDN layers'
    # shapes, the attention output gate and the rotary share of each head
    layer_mixers: list | None = None
    gdn: "GDNConfig | None" = None
    attn_output_gate: bool = False
    partial_rotary_factor: float = 1.0

    def __post_init__(self):
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"architecture: expected one of {', '.join(SUPPORTED_ARCHITECTURES)}, "
                f"got {self.architecture!r}"
            )
        _check_sizes(vars(self))
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        if self.head_dim is None and self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"hidden_size: expected a multiple of num_attention_heads="
                f"{self.num_attention_heads} (no head_dim given), got {self.hidden_size}"
            )
        if self.num_experts_per_tok > self.num_experts:
            raise ValueError(
                f"num_experts_per_tok: expected at most num_experts={self.num_experts}, got "
                f"{self.num_experts_per_tok}"
            )
        if not (_finite(self.rope_theta) and self.rope_theta > 0):
            raise ValueError(f"rope_theta: expected a finite number > 0, got {self.rope_theta!r}")
        if not (_finite(self.rms_norm_eps) and self.rms_norm_eps >= 0):
            raise ValueError(
                f"rms_norm_eps: expected a finite number >= 0, got {self.rms_norm_eps!r}"
            )
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_key_value_heads: expected a divisor of num_attention_heads="
                f"{self.num_attention_heads}, got {self.num_key_value_heads}"
            )
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.architecture in MOE_ARCHITECTURES and self.num_experts < 1:
            raise ValueError(
                f"num_experts: expected >= 1 for {self.architecture}, got {self.num_experts}"
            )
        if self.decoder_sparse_step < 1:
            raise ValueError(f"decoder_sparse_step: expected >= 1, got {self.decoder_sparse_step}")
        eos = self.eos_token_id
        eos = [] if eos is None else [eos] if isinstance(eos, int) else eos
        if not isinstance(eos, (list, tuple)) or not all(
            isinstance(t, int) and not isinstance(t, bool) for t in eos
        ):
            raise ValueError(f"eos_token_id: expected an int or a list of ints, got {eos!r:.80}")
        self.eos_token_id = list(eos)
        self.mlp_only_layers = [int(i) for i in self.mlp_only_layers]
        self.rope_theta = float(self.rope_theta)
        if self.qkv_bias is None:
            self.qkv_bias = self.attention_bias
        if self.layer_windows is None:
            self.layer_windows = [-1] * self.num_hidden_layers
        if self.layer_mixers is None:
            self.layer_mixers = ["attention"] * self.num_hidden_layers
        if len(self.layer_windows) != self.num_hidden_layers:
            raise ValueError(
                f"layer_windows: expected {self.num_hidden_layers} (one per layer), got "
                f"{len(self.layer_windows)}"
            )

    def is_moe_layer(self, i):
        """Whether decoder layer ``i`` has an MoE block (else a dense gated MLP)."""
        if not 0 <= i < self.num_hidden_layers:
            raise ValueError(f"i: expected 0 <= i < {self.num_hidden_layers}, got {i}")
        if self.num_experts == 0:
            return False
        if self.architecture in _ALL_MOE_LAYERS:
            return True
        # Qwen3-MoE, Qwen2-MoE (transformers' Qwen3MoeDecoderLayer, Qwen2MoeDecoderLayer)
        return i not in self.mlp_only_layers and (i + 1) % self.decoder_sparse_step == 0

    @classmethod
    def from_hf_dict(cls, d):
        """From a ``config.json`` dict, in the spelling of transformers 4 or 5.

        transformers 5 writes ``rope_parameters`` (``rope_theta`` and ``rope_type``
        inside) where 4 wrote ``rope_theta`` and ``rope_scaling`` at top level, ``dtype``
        for ``torch_dtype``, and Qwen3-MoE's ``num_local_experts`` for ``num_experts``.
        """
        text_of = None
        named = (d.get("architectures") or [None])[0]
        wrapper = named or _MODEL_TYPE_TO_ARCHITECTURE.get(d.get("model_type"))
        if wrapper in TEXT_OF_WRAPPER:
            text_of, d = wrapper, _text_config(d, wrapper)
        arch = _architecture(d)
        d = {**_CLASS_DEFAULTS.get(arch, {}), **d}
        _check_sizes(d)  # before any list or table is sized by them

        def need(key):
            if d.get(key) is None:
                raise ValueError(f"config: {arch} needs {key!r}, which is missing")
            return d[key]

        gemma = _gemma(d, arch, need("num_hidden_layers")) if arch in GEMMA_ARCHITECTURES else {}
        if arch in GDN_ARCHITECTURES:
            gemma = _gdn(d, arch, need("num_hidden_layers"))
            if arch == "Qwen3_5MoeForCausalLM":  # no dense MLP: intermediate_size unused
                d = {"intermediate_size": 0, **d}
        rope_theta, rope_scaling = gemma.pop("rope", None) or _rope(d, arch)
        num_experts = d.get("num_experts")
        if num_experts is None:
            num_experts = d.get("num_local_experts") or 0
        moe = {}
        if arch in ("MixtralForCausalLM", "GptOssForCausalLM"):
            moe = {
                "num_experts_per_tok": need("num_experts_per_tok"),
                "moe_intermediate_size": need("intermediate_size"),
                # Mixtral renormalises its top-k softmax weights; GPT-OSS takes the
                # softmax of its top-k logits, which is the same
                "norm_topk_prob": True,
            }
        elif arch == "Qwen3_5MoeForCausalLM":  # every layer; top-k always renormalised
            moe = {
                "num_experts_per_tok": need("num_experts_per_tok"),
                "moe_intermediate_size": need("moe_intermediate_size"),
                "norm_topk_prob": True,
            }
        elif arch in ("Qwen3MoeForCausalLM", "Qwen2MoeForCausalLM", "Qwen3NextForCausalLM"):
            moe = {
                "num_experts_per_tok": need("num_experts_per_tok"),
                "moe_intermediate_size": need("moe_intermediate_size"),
                "norm_topk_prob": bool(d.get("norm_topk_prob", False)),
                "decoder_sparse_step": d.get("decoder_sparse_step") or 1,
                "mlp_only_layers": list(d.get("mlp_only_layers") or []),
            }
        if arch in ("Qwen2MoeForCausalLM", "Qwen3NextForCausalLM", "Qwen3_5MoeForCausalLM"):
            shared = need("shared_expert_intermediate_size")
            if isinstance(shared, bool) or not isinstance(shared, int) or shared < 1:
                raise ValueError(
                    f"shared_expert_intermediate_size: expected an int >= 1 ({arch}), "
                    f"got {shared!r}"
                )
            moe["shared_expert_intermediate_size"] = shared
        if arch == "GptOssForCausalLM":
            for key, value in _SWIGLU_OAI.items():
                if d.get(key, value) != value:
                    raise ValueError(f"{key}: expected {value} ({arch}), got {d[key]!r}")
        quant = d.get("quantization_config")
        if quant is not None:  # e.g. GPT-OSS's MXFP4 experts
            method = quant.get("quant_method", quant) if isinstance(quant, dict) else quant
            raise ValueError(
                f"quantization_config: expected none (the engine runs unquantized weights), "
                f"got quant_method {method!r}"
            )
        windows = layer_windows(d, arch, need("num_hidden_layers"))
        if arch == "LlamaForCausalLM" and d.get("mlp_bias"):
            raise ValueError(
                f"mlp_bias: expected false ({arch}: MLP biases), got {d['mlp_bias']!r}"
            )
        act = "silu" if arch in GEMMA_ARCHITECTURES else d.get("hidden_act", "silu")
        if act != "silu":  # every family here gates its MLP (and experts) with SiLU
            raise ValueError(f"hidden_act: expected 'silu' ({arch}), got {act!r}")
        return cls(
            architecture=arch,
            vocab_size=need("vocab_size"),
            hidden_size=need("hidden_size"),
            intermediate_size=need("intermediate_size"),
            num_hidden_layers=need("num_hidden_layers"),
            num_attention_heads=need("num_attention_heads"),
            num_key_value_heads=d.get("num_key_value_heads"),
            head_dim=d.get("head_dim"),
            rms_norm_eps=need("rms_norm_eps"),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=need("max_position_embeddings"),
            # absent: the class default of all four families (PretrainedConfig's is True)
            tie_word_embeddings=bool(d.get("tie_word_embeddings", arch in GEMMA_ARCHITECTURES)),
            # Qwen2 has q/k/v biases and none on o; Mistral and Mixtral none at all
            attention_bias=bool(d.get("attention_bias", False)) and arch in _ATTENTION_BIAS,
            qkv_bias=_qkv_bias(d, arch),
            num_experts=num_experts if arch in MOE_ARCHITECTURES else 0,
            bos_token_id=d.get("bos_token_id"),
            eos_token_id=d.get("eos_token_id"),
            torch_dtype=d.get("torch_dtype") or d.get("dtype"),
            text_of=text_of,
            **gemma,
            layer_windows=windows,
            **moe,
        )


def _architecture(d):
    """The supported architecture a config.json names (checked before any other key)."""
    archs = d.get("architectures") or []
    model_type = d.get("model_type")
    arch = archs[0] if archs else _MODEL_TYPE_TO_ARCHITECTURE.get(model_type)
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"architecture: expected one of {', '.join(SUPPORTED_ARCHITECTURES)}, "
            f"got architectures={d.get('architectures')!r}, model_type={model_type!r}"
        )
    return arch


def _qkv_bias(d, arch):
    """Whether q/k/v have biases (o none), or None (as attention_bias): Qwen2 always,
    Qwen2-MoE with ``qkv_bias`` (transformers' default true)."""
    if arch == "Qwen2ForCausalLM":
        return True
    if arch == "Qwen2MoeForCausalLM":
        return bool(d.get("qkv_bias", True))
    return None


def layer_windows(d, arch, n_layers):
    """Each layer's sliding window (-1: full attention) as transformers computes it for
    ``arch`` from a config.json dict ``d``:

    - Llama: none (LlamaConfig has no window; a ``sliding_window`` key is not read).
    - Mistral, Mixtral: ``sliding_window`` (None: none) on every layer (Mistral ignores
      ``layer_types``, as transformers' MistralConfig does).
    - Qwen2, Qwen3: ``sliding_window`` only with ``use_sliding_window`` (default False),
      on the layers ``layer_types`` marks ``"sliding_attention"``; without
      ``layer_types``, the layers from ``max_window_layers`` (default 28) on.
    - Qwen3-MoE: ``sliding_window`` with ``use_sliding_window`` on every layer.
    - Qwen2-MoE: see :func:`_qwen2_moe_windows`; GPT-OSS: see :func:`_gpt_oss_windows`.
    - Gemma 2/3: ``sliding_window`` (default 4096) on the sliding layers of
      :func:`gemma_layer_types`.
    - Qwen3-Next, Qwen3.5, Qwen3.5-MoE: none (a ``sliding_window`` key is not read).
    """
    if arch in GDN_ARCHITECTURES:  # no window (their modeling files read none)
        return [-1] * n_layers
    if arch in GEMMA_ARCHITECTURES and "sliding_window" not in d:
        d = dict(d, sliding_window=4096)  # the class default
    if arch == "Qwen2MoeForCausalLM":
        return _qwen2_moe_windows(d, n_layers)
    if arch == "GptOssForCausalLM":
        return _gpt_oss_windows(d, n_layers)
    window = d.get("sliding_window")
    if window is not None and (isinstance(window, bool) or not isinstance(window, int)):
        raise ValueError(f"sliding_window: expected an int or null, got {window!r}")
    if window is not None and window < 1:
        raise ValueError(f"sliding_window: expected >= 1 or null, got {window}")
    qwen_family = arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM")
    if arch == "LlamaForCausalLM" or (qwen_family and not d.get("use_sliding_window", False)):
        window = None
    if window is None:
        return [-1] * n_layers
    if arch in GEMMA_ARCHITECTURES:
        kinds = gemma_layer_types(d, arch, n_layers)
        return [window if k == "sliding_attention" else -1 for k in kinds]
    if arch not in ("Qwen2ForCausalLM", "Qwen3ForCausalLM"):
        return [window] * n_layers
    kinds = d.get("layer_types")
    if kinds is None:
        first = d.get("max_window_layers", 28)  # transformers' Qwen2/Qwen3 default
        if isinstance(first, bool) or not isinstance(first, int):
            raise ValueError(f"max_window_layers: expected an int, got {first!r}")
        return [window if i >= first else -1 for i in range(n_layers)]
    kinds = _checked_kinds(kinds, n_layers, arch)
    return [window if kind == "sliding_attention" else -1 for kind in kinds]


def _qwen2_moe_windows(d, n_layers):
    """Qwen2-MoE's windows as transformers' Qwen2MoeConfig computes them: the window is
    ``sliding_window`` with ``use_sliding_window`` (default False), else 0 (and saved
    so); it applies on the layers ``layer_types`` marks ``"sliding_attention"``, by
    default the even layers below ``max_window_layers`` (default 28) when the window is
    used. Refused: a sliding layer without ``use_sliding_window`` (a window of 0 keys),
    and ``use_sliding_window`` without a window >= 1 (transformers' mask raises)."""
    use = bool(d.get("use_sliding_window", False))
    window = d.get("sliding_window")
    if use and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
        raise ValueError(
            f"sliding_window: expected an int >= 1 with use_sliding_window (Qwen2-MoE), "
            f"got {window!r}"
        )
    kinds = d.get("layer_types")
    if kinds is None:
        first = d.get("max_window_layers", 28)  # transformers' Qwen2-MoE default
        if isinstance(first, bool) or not isinstance(first, int):
            raise ValueError(f"max_window_layers: expected an int, got {first!r}")
        sliding = [use and i % 2 == 0 and i < first for i in range(n_layers)]
        return [window if s else -1 for s in sliding]
    out = []
    for i, kind in enumerate(_checked_kinds(kinds, n_layers, "Qwen2-MoE")):
        if kind == "sliding_attention" and not use:
            raise ValueError(
                f"layer_types[{i}]: 'sliding_attention' needs use_sliding_window (without "
                f"it transformers' Qwen2-MoE window is 0: the layer would see no key)"
            )
        out.append(window if kind == "sliding_attention" else -1)
    return out


def _gpt_oss_windows(d, n_layers):
    """GPT-OSS's windows as transformers' GptOssConfig computes them: ``sliding_window``
    (default 128) on the layers ``layer_types`` marks ``"sliding_attention"``, by default
    the even ones (sliding and full layers alternate). Its model always builds the
    sliding mask, which raises without a window: a null window is refused."""
    window = d.get("sliding_window", _CLASS_DEFAULTS["GptOssForCausalLM"]["sliding_window"])
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise ValueError(f"sliding_window: expected an int >= 1 (GPT-OSS), got {window!r}")
    kinds = d.get("layer_types")
    if kinds is None:
        return [window if i % 2 == 0 else -1 for i in range(n_layers)]
    kinds = _checked_kinds(kinds, n_layers, "GPT-OSS")
    return [window if kind == "sliding_attention" else -1 for kind in kinds]


def _checked_kinds(kinds, n_layers, family):
    """``layer_types``, checked: a list of ``n_layers`` full or sliding layer kinds."""
    if not isinstance(kinds, list) or len(kinds) != n_layers:
        raise ValueError(f"layer_types: expected a list of {n_layers} layer kinds, got {kinds!r}")
    for i, kind in enumerate(kinds):
        if kind not in ("full_attention", "sliding_attention"):
            raise ValueError(
                f"layer_types[{i}]: expected 'full_attention' or 'sliding_attention' "
                f"({family}), got {kind!r}"
            )
    return kinds


def _text_config(d, wrapper):
    """The text model's config dict of a multimodal wrapper's config ``d``
    (Gemma3ForConditionalGeneration: ``text_config``; token ids and dtype from the top
    level where the text config lacks them)."""
    text = d.get("text_config")
    if not isinstance(text, dict):
        raise ValueError(f"text_config: {wrapper} needs its text model's config, got {text!r}")
    text = dict(text, architectures=[TEXT_OF_WRAPPER[wrapper]])
    keys = ("bos_token_id", "eos_token_id", "torch_dtype", "dtype", "tie_word_embeddings")
    for key in (*keys, "quantization_config"):
        if text.get(key) is None and d.get(key) is not None:
            text[key] = d[key]
    return text


def _gdn(d, arch, n_layers):
    """The Gated DeltaNet hybrids' fields of ModelConfig from a config.json dict
    (transformers' Qwen3NextConfig, Qwen3_5TextConfig, Qwen3_5MoeTextConfig and their
    modeling files): the ``linear_*`` shapes, each layer's mixer (``layer_types``, by
    default every ``full_attention_interval``-th layer (4) full attention, the others
    linear), the gated attention output, (1 + w) norms and partial rotary
    (``partial_rotary_factor``, default 0.25, in ``rope_parameters`` or at top level).
    Qwen3.5's multimodal rope (``mrope_section``, ``mrope_interleaved``) is plain rope
    for text-only positions (its three position axes are equal); a section that does not
    cover the rotary dims is refused."""

    def count(key, default):
        v = d.get(key, default)
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{key}: expected an int >= 1 ({arch}), got {v!r}")
        return v

    gdn = GDNConfig(
        num_k_heads=count("linear_num_key_heads", 16),
        num_v_heads=count("linear_num_value_heads", 32),
        k_head_dim=count("linear_key_head_dim", 128),
        v_head_dim=count("linear_value_head_dim", 128),
        conv_kernel=count("linear_conv_kernel_dim", 4),
    )
    if gdn.num_v_heads % gdn.num_k_heads:
        raise ValueError(
            f"linear_num_value_heads: expected a multiple of linear_num_key_heads="
            f"{gdn.num_k_heads}, got {gdn.num_v_heads}"
        )
    kinds = d.get("layer_types")
    if kinds is None:
        every = count("full_attention_interval", 4)
        kinds = [
            "linear_attention" if (i + 1) % every else "full_attention" for i in range(n_layers)
        ]
    if not isinstance(kinds, list) or len(kinds) != n_layers:
        raise ValueError(f"layer_types: expected a list of {n_layers} layer kinds, got {kinds!r}")
    for i, kind in enumerate(kinds):
        if kind not in ("full_attention", "linear_attention"):
            raise ValueError(
                f"layer_types[{i}]: expected 'full_attention' or 'linear_attention' ({arch}), "
                f"got {kind!r}"
            )
    # published files name what transformers' modeling code fixes: the gated attention
    # output (q_proj holds the gate) and the fp32 recurrent state
    if d.get("attn_output_gate", True) is not True:
        raise ValueError(
            f"attn_output_gate: expected true ({arch}: transformers gates every attention "
            f"output), got {d['attn_output_gate']!r}"
        )
    if d.get("mamba_ssm_dtype", "float32") not in ("float32", None):
        raise ValueError(
            f"mamba_ssm_dtype: expected 'float32' (the engine keeps the recurrent state in "
            f"fp32), got {d['mamba_ssm_dtype']!r}"
        )
    params = dict(d.get("rope_parameters") or {})
    partial = params.pop("partial_rotary_factor", d.get("partial_rotary_factor", 0.25))
    head_dim = d.get("head_dim") or d["hidden_size"] // d["num_attention_heads"]
    rot = int(head_dim * partial) if isinstance(partial, (int, float)) else 0
    if isinstance(partial, bool) or not 0 < rot <= head_dim or rot % 2:
        raise ValueError(
            f"partial_rotary_factor: expected a share of head_dim={head_dim} giving an even "
            f"rotary dim >= 2, got {partial!r}"
        )
    section = params.pop("mrope_section", None)
    interleaved = params.pop("mrope_interleaved", None)
    if arch == "Qwen3NextForCausalLM" and (section is not None or interleaved is not None):
        raise ValueError(f"mrope_section: expected none ({arch} has no multimodal rope)")
    if section is not None:
        ok = isinstance(section, list) and all(
            isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in section
        )
        if not ok or len(section) != 3 or 2 * sum(section) != rot:
            raise ValueError(
                f"mrope_section: expected 3 ints summing to half the rotary dim ({rot // 2}), "
                f"got {section!r}"
            )
    rope_d = {k: v for k, v in d.items() if k not in ("rope_parameters", "partial_rotary_factor")}
    if d.get("rope_parameters") is not None:
        rope_d["rope_parameters"] = params
    return {
        "layer_mixers": ["attention" if k == "full_attention" else k for k in kinds],
        "gdn": gdn,
        "attn_output_gate": True,
        "norm_offset": 1.0,
        "partial_rotary_factor": float(partial),
        "rope": _rope(rope_d, arch),
    }


# transformers' class defaults where a config.json may leave a field out
_GEMMA_DEFAULTS = {
    "Gemma2ForCausalLM": {"attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0},
    "Gemma3ForCausalLM": {"attn_logit_softcapping": None, "final_logit_softcapping": None},
}


def _gemma(d, arch, n_layers):
    """The Gemma 2/3 fields of ModelConfig from a config.json dict (transformers'
    Gemma2Config / Gemma3TextConfig and their modeling files): tanh-GELU MLP, (1 + w)
    norms, sandwich norms, the embedding scaled by sqrt(hidden), the soft-caps, the
    attention scale ``query_pre_attn_scalar ** -0.5`` and, for Gemma 3, a rope per layer
    kind (full: ``rope_parameters["full_attention"]``, or ``rope_theta`` with
    ``rope_scaling``; sliding: ``rope_parameters["sliding_attention"]``, or
    ``rope_local_base_freq``)."""
    act = d.get("hidden_activation") or d.get("hidden_act") or "gelu_pytorch_tanh"
    if act != "gelu_pytorch_tanh":
        raise ValueError(f"hidden_activation: expected 'gelu_pytorch_tanh' ({arch}), got {act!r}")
    if d.get("use_bidirectional_attention"):
        raise ValueError(
            f"use_bidirectional_attention: expected false ({arch}: causal decoding), got "
            f"{d['use_bidirectional_attention']!r}"
        )
    defaults = _GEMMA_DEFAULTS[arch]

    def cap(key):
        v = d.get(key, defaults[key])
        if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or v <= 0):
            raise ValueError(f"{key}: expected a number > 0 or null, got {v!r}")
        return float(v or 0.0)

    scalar = d.get("query_pre_attn_scalar", 256)
    if isinstance(scalar, bool) or not isinstance(scalar, (int, float)) or scalar <= 0:
        raise ValueError(f"query_pre_attn_scalar: expected a number > 0, got {scalar!r}")
    out = {
        "hidden_act": "gelu_tanh",
        "norm_offset": 1.0,
        "sandwich_norms": True,
        "embed_scale": float(d["hidden_size"]) ** 0.5,
        "attn_softcap": cap("attn_logit_softcapping"),
        "logit_softcap": cap("final_logit_softcapping"),
        "attn_scale": float(scalar) ** -0.5,
    }
    if arch == "Gemma2ForCausalLM":
        return out
    params = d.get("rope_parameters")
    if isinstance(params, dict) and ("full_attention" in params or "sliding_attention" in params):
        full_params = {"rope_theta": 1e6, **(params.get("full_attention") or {})}
        local_params = {"rope_theta": 1e4, **(params.get("sliding_attention") or {})}
        full = _rope({"rope_parameters": full_params}, arch)
        sliding = _rope({"rope_parameters": local_params}, arch)
    else:  # transformers 4: rope_theta, rope_scaling (full layers), rope_local_base_freq
        theta = d.get("rope_theta", 1e6)
        full = _rope({"rope_theta": theta, "rope_scaling": d.get("rope_scaling")}, arch)
        sliding = _rope({"rope_theta": d.get("rope_local_base_freq", 1e4)}, arch)
    kinds = gemma_layer_types(d, arch, n_layers)
    out["rope"] = full
    out["layer_ropes"] = [sliding if k == "sliding_attention" else full for k in kinds]
    return out


def gemma_layer_types(d, arch, n_layers):
    """Gemma's layer kinds: ``layer_types``, else every ``sliding_window_pattern``-th
    layer full (Gemma 2: 2, Gemma 3: 6 by default), the others sliding."""
    kinds = d.get("layer_types")
    if kinds is None:
        pattern = 2 if arch == "Gemma2ForCausalLM" else d.get("sliding_window_pattern", 6)
        if isinstance(pattern, bool) or not isinstance(pattern, int) or pattern < 1:
            raise ValueError(f"sliding_window_pattern: expected an int >= 1, got {pattern!r}")
        kinds = [
            "sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(n_layers)
        ]
    return _checked_kinds(kinds, n_layers, arch)


def _rope(d, arch):
    """(rope_theta, rope_scaling) from either spelling; scaling is None for plain rope."""
    params = d.get("rope_parameters")
    if params is not None:  # transformers >= 5
        params = dict(params)
        theta = params.pop("rope_theta", None)
    else:
        params = dict(d.get("rope_scaling") or _DEFAULT_ROPE_SCALING.get(arch, {}))
        theta = None
    if theta is None:
        theta = d.get("rope_theta")
    if theta is None:
        theta = _DEFAULT_ROPE_THETA.get(arch, 10000.0)
    partial = params.pop("partial_rotary_factor", d.get("partial_rotary_factor", 1.0))
    if partial != 1.0:
        raise ValueError(
            f"partial_rotary_factor: expected 1.0 (rotary on whole heads), got {partial}"
        )
    legacy_type = params.pop("type", None)  # transformers < 4.45 spelled rope_type "type"
    rope_type = params.pop("rope_type", None) or legacy_type or "default"
    if rope_type not in ROPE_TYPES:
        raise ValueError(f"rope_type: expected one of {', '.join(ROPE_TYPES)}, got {rope_type!r}")
    unread = [k for k in params if k not in _YARN_KEYS] if rope_type == "yarn" else []
    if unread:
        k = unread[0]
        known = ", ".join(_YARN_KEYS)
        raise ValueError(f"{k}: expected only the YaRN parameters {known}, got {k}={params[k]!r}")
    if rope_type == "default" and not params:
        return float(theta), None
    return float(theta), {"rope_type": rope_type, **params}


class MissingTensorError(KeyError):
    # KeyError's str() is the repr of its argument; this one reads as the sentence it is
    def __str__(self):
        return str(self.args[0])


@dataclass
class Checkpoint:
    config: ModelConfig
    tensors: dict = field(repr=False)  # HF name -> torch.Tensor
    tokenizer: object = field(repr=False)  # tokenizers.Tokenizer or None
    source: str
    chat_template: str | None = field(default=None, repr=False)  # Jinja2 source
    # transformers' special_tokens_map: {"bos_token": "<s>", "eos_token": ...}, the
    # variables a chat template sees
    special_tokens: dict = field(default_factory=dict, repr=False)
    _taken: set = field(default_factory=set, init=False, repr=False)

    def require(self, name):
        """The tensor ``name`` (left in place); MissingTensorError naming it if absent."""
        if name not in self.tensors:
            hint = ""
            if name in self._taken:
                hint = " (already taken)"
            else:
                close = difflib.get_close_matches(name, self.tensors, n=3)
                if close:
                    hint = f"; closest: {', '.join(close)}"
            raise MissingTensorError(f"{self.source}: no tensor {name!r}{hint}")
        return self.tensors[name]

    def take(self, name):
        """The tensor ``name``, removed from the checkpoint (each is taken exactly once)."""
        t = self.require(name)
        del self.tensors[name]
        self._taken.add(name)
        return t

    def check_all_used(self):
        """ValueError listing every tensor that was never taken."""
        if self.tensors:
            names = sorted(self.tensors)
            more = f", ... ({len(names) - 20} more)" if len(names) > 20 else ""
            shown = ", ".join(names[:20]) + more
            raise ValueError(f"{self.source}: {len(names)} tensor(s) never used: {shown}")


def load_checkpoint(path, *, dtype=None, progress=True):
    """A :class:`Checkpoint` from an HF directory or a ``.gguf`` file.

    ``dtype`` (a ``torch.dtype``) converts every floating-point tensor; None keeps the
    stored dtype (fp32 for dequantized GGUF tensors).
    """
    if dtype is not None and not isinstance(dtype, torch.dtype):
        raise ValueError(f"dtype: expected a torch.dtype or None, got {dtype!r}")
    path = os.fspath(path)
    if os.path.isdir(path):
        return _load_hf_dir(path, dtype, progress)
    if os.path.isfile(path) and path.endswith(".gguf"):
        return _load_gguf(path, dtype, progress)
    raise ValueError(
        f"path: expected an HF checkpoint directory or a .gguf file, got {path!r}"
        + ("" if os.path.exists(path) else " (does not exist)")
    )


def _convert(t, dtype):
    return t.to(dtype) if dtype is not None and t.is_floating_point() else t


def _bar(items, total, desc, progress):
    return tqdm(
        items,
        total=total,
        desc=desc,
        unit="tensor",
        disable=not progress or total < PROGRESS_MIN_TENSORS,
        delay=PROGRESS_DELAY,
    )


# -- Hugging Face directory -------------------------------------------------------------


def _load_hf_dir(path, dtype, progress):
    config_path = os.path.join(path, "config.json")
    if not os.path.isfile(config_path):
        raise ValueError(f"path: {path!r} has no config.json")
    config = ModelConfig.from_hf_dict(_read_json(config_path))

    index_path = os.path.join(path, "model.safetensors.index.json")
    single_path = os.path.join(path, "model.safetensors")
    if os.path.isfile(index_path):
        weight_map = _read_json(index_path).get("weight_map")
        if not isinstance(weight_map, dict) or not all(
            isinstance(v, str) for v in weight_map.values()
        ):
            raise ValueError(f"{index_path}: expected a 'weight_map' of tensor -> file names")
        shards = {}
        for name, shard in weight_map.items():
            shards.setdefault(shard, []).append(name)
    elif os.path.isfile(single_path):
        shards = None
    else:
        raise ValueError(
            f"path: {path!r} has neither model.safetensors nor model.safetensors.index.json "
            f"(found: {', '.join(sorted(os.listdir(path)))})"
        )
    if shards is None:
        with _safetensors(single_path) as f:
            shards = {"model.safetensors": list(f.keys())}

    rename = _skipped_names(config, path)
    tensors = {}
    total = sum(len(names) for names in shards.values())
    with _bar(None, total, f"loading {os.path.basename(path)}", progress) as bar:
        for shard, names in shards.items():
            shard_path = os.path.join(path, shard)
            with _safetensors(shard_path) as f:
                missing = set(names) - set(f.keys())
                if missing:
                    lacking = ", ".join(sorted(missing))
                    raise ValueError(f"{shard}: the index lists tensors it lacks: {lacking}")
                for name in names:
                    hf_name = rename(name)
                    if hf_name is not None:  # None: skipped (vision, mtp)
                        tensors[hf_name] = _convert(f.tensor(name), dtype)
                    bar.update()

    tokenizer = None
    tokenizer_path = os.path.join(path, "tokenizer.json")
    if os.path.isfile(tokenizer_path):
        from tokenizers import Tokenizer

        try:
            tokenizer = Tokenizer.from_file(tokenizer_path)
        except Exception as e:  # tokenizers raises a bare Exception for a malformed file
            raise ValueError(f"{tokenizer_path}: not a readable tokenizer ({e})") from None
    return Checkpoint(config, tensors, tokenizer, path, *_hf_chat(path))


def _read_json(path):
    """The JSON object in the file ``path``; ValueError naming the file if it holds none."""
    try:
        with open(path, encoding="utf-8") as f:
            out = json.load(f)
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError
        raise ValueError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(out, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(out).__name__}")
    return out


class _SafetensorsFile:
    """An open safetensors file whose failures are ValueErrors naming it (and the tensor)."""

    def __init__(self, path, f):
        self.path, self._f = path, f

    def keys(self):
        return self._f.keys()

    def tensor(self, name):
        from safetensors import SafetensorError

        try:
            return self._f.get_tensor(name)
        except (SafetensorError, TypeError, RuntimeError) as e:
            raise ValueError(f"{self.path}: tensor {name!r}: {e}") from None


@contextlib.contextmanager
def _safetensors(path):
    """``safe_open(path)`` as a :class:`_SafetensorsFile`; a file safetensors refuses
    (truncated, a corrupt header) is a ValueError naming the file and, where one is at
    fault, the tensor (:func:`_safetensors_fault`)."""
    from safetensors import SafetensorError, safe_open

    try:
        f = safe_open(path, framework="pt")
    except SafetensorError as e:
        raise ValueError(f"{path}: {_safetensors_fault(path) or e}") from None
    with f:
        yield _SafetensorsFile(path, f)


# bytes per element of the safetensors dtypes (the format's list)
_SAFETENSORS_ITEMSIZE = {
    **dict.fromkeys(("BOOL", "U8", "I8", "F8_E5M2", "F8_E4M3", "F8_E8M0", "F8_E4M3FNUZ"), 1),
    **dict.fromkeys(("U16", "I16", "F16", "BF16"), 2),
    **dict.fromkeys(("U32", "I32", "F32"), 4),
    **dict.fromkeys(("U64", "I64", "F64"), 8),
}
_SAFETENSORS_SUBBYTE = ("F4", "F6_E2M3", "F6_E3M2")  # packed: no whole bytes per element


def _safetensors_fault(path):
    """What is wrong with the safetensors file ``path``, read as the format defines it (an
    8-byte little-endian header length, a JSON header of ``name: {dtype, shape,
    data_offsets}``, then the tensors' bytes back to back): the first tensor, in data
    order, whose entry is malformed, whose size disagrees with its shape, or whose bytes
    run past the end of the file; '' when none is found."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            return f"{size} bytes, too short for a safetensors header (truncated?)"
        n = int.from_bytes(head, "little")
        if n > size - 8:
            return f"a header of {n} bytes does not fit in the file's {size} bytes (truncated?)"
        try:
            header = json.loads(f.read(n))
        except ValueError as e:
            return f"the header is not valid JSON ({e})"
    if not isinstance(header, dict):
        return "the header is not a JSON object"
    data = size - 8 - n
    entries = []
    for name, e in header.items():
        if name == "__metadata__":
            continue
        ok = isinstance(e, dict) and isinstance(e.get("shape"), list)
        offsets = e.get("data_offsets") if ok else None
        ok = ok and isinstance(offsets, list) and len(offsets) == 2
        ok = ok and all(isinstance(v, int) and v >= 0 for v in [*offsets, *e["shape"]])
        if not ok:
            return f"tensor {name!r}: a malformed header entry {e!r:.200}"
        entries.append((offsets, name, e))
    end = 0
    for (start, stop), name, e in sorted(entries):
        if start != end or stop < start:
            return f"tensor {name!r}: data_offsets {[start, stop]} do not follow on byte {end}"
        end = stop
        if e.get("dtype") not in (*_SAFETENSORS_ITEMSIZE, *_SAFETENSORS_SUBBYTE):
            return f"tensor {name!r}: unknown dtype {e.get('dtype')!r:.40}"
        item = _SAFETENSORS_ITEMSIZE.get(e["dtype"])
        if item is not None and math.prod(e["shape"]) * item != stop - start:
            return (
                f"tensor {name!r}: {e['dtype']} {e['shape']} takes "
                f"{math.prod(e['shape']) * item} bytes, its data_offsets hold {stop - start}"
            )
        if stop > data:
            return (
                f"tensor {name!r}: its bytes {start}-{stop} of the data run past the file's "
                f"{data} data bytes (truncated?)"
            )
    if end < data:
        return f"{data - end} bytes after the last tensor's data"
    return ""


# a multimodal wrapper's language-model tensors, as stored by transformers 5
# (model.language_model.*) and as published (language_model.model.*): -> the text
# model's names; its vision tower and projector are skipped
_TEXT_PREFIXES = (("model.language_model.", "model."), ("language_model.model.", "model."))
_TEXT_RENAMED = {"language_model.lm_head.weight": "lm_head.weight"}
_VISION_PREFIXES = (
    "model.vision_tower.",
    "vision_tower.",
    "model.multi_modal_projector.",
    "multi_modal_projector.",
    "model.visual.",  # Qwen3.5
    "visual.",
)
# Qwen3-Next / Qwen3.5's multi-token-prediction head (speculative decoding; not run)
_MTP_PREFIXES = ("mtp.", "model.mtp.", "model.language_model.mtp.")


def _skipped_names(config, path):
    """The stored name -> engine name map (None: skipped) of a checkpoint with tensors
    the engine does not run: a multimodal wrapper's vision tower (its language model
    renamed to the text model's names), the GDN families' ``mtp.*`` head. Logs once per
    kind what it skips."""
    skip = _MTP_PREFIXES if config.architecture in GDN_ARCHITECTURES else ()
    if config.text_of:
        skip += _VISION_PREFIXES
    logged = set()

    def rename(name):
        if name.startswith(skip):
            kind = "mtp" if name.startswith(_MTP_PREFIXES) else "vision"
            if kind not in logged:
                logged.add(kind)
                what = "multi-token-prediction" if kind == "mtp" else "vision"
                log.info(
                    "%s: %s, running its text model; %s tensors (%s...) are skipped",
                    path,
                    config.text_of or config.architecture,
                    what,
                    name,
                )
            return None
        if not config.text_of:
            return name
        for old, new in _TEXT_PREFIXES:
            if name.startswith(old):
                return new + name[len(old) :]
        return _TEXT_RENAMED.get(name, name)

    return rename


# the named special tokens of transformers' tokenizers (SPECIAL_TOKENS_ATTRIBUTES)
_SPECIAL_TOKEN_NAMES = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)


def _hf_chat(path):
    """(chat template or None, special tokens) of an HF directory, as transformers 5
    reads them: ``chat_template.jinja`` before ``tokenizer_config.json``'s
    ``chat_template`` (of a list of named templates, the one named "default"); the
    special tokens from ``tokenizer_config.json``, where one that predates
    ``added_tokens_decoder`` has them overridden by ``special_tokens_map.json``."""

    def read_json(name):
        p = os.path.join(path, name)
        return _read_json(p) if os.path.isfile(p) else {}

    config = read_json("tokenizer_config.json")
    template = config.get("chat_template")
    if isinstance(template, list):
        template = {t["name"]: t["template"] for t in template}.get("default")
    jinja_path = os.path.join(path, "chat_template.jinja")
    if os.path.isfile(jinja_path):
        with open(jinja_path) as f:
            template = f.read()
    named = dict(config)
    if "added_tokens_decoder" not in config:
        named.update(read_json("special_tokens_map.json"))
    special = {}
    for name in _SPECIAL_TOKEN_NAMES:
        tok = named.get(name)
        if isinstance(tok, dict):  # a serialized AddedToken
            tok = tok.get("content")
        if tok:
            special[name] = tok
    return template, special


# -- GGUF (llama.cpp) -------------------------------------------------------------------

# HF name of each llama.cpp tensor (gguf's TENSOR_NAMES), per block where the name has
# {bid}; a name carries a ".weight" or ".bias" suffix, which is kept
_GGUF_TO_HF = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
    "blk.{bid}.attn_norm": "model.layers.{bid}.input_layernorm",
    "blk.{bid}.attn_q": "model.layers.{bid}.self_attn.q_proj",
    "blk.{bid}.attn_k": "model.layers.{bid}.self_attn.k_proj",
    "blk.{bid}.attn_v": "model.layers.{bid}.self_attn.v_proj",
    "blk.{bid}.attn_output": "model.layers.{bid}.self_attn.o_proj",
    "blk.{bid}.ffn_norm": "model.layers.{bid}.post_attention_layernorm",
    "blk.{bid}.ffn_gate": "model.layers.{bid}.mlp.gate_proj",
    "blk.{bid}.ffn_up": "model.layers.{bid}.mlp.up_proj",
    "blk.{bid}.ffn_down": "model.layers.{bid}.mlp.down_proj",
}

# the metadata keys read (gguf's Keys, spelled out: importing gguf for its constants is
# ~40 ms of an engine's start), {arch} the file's general.architecture
_K_ARCH = "general.architecture"
_K_HIDDEN = "{arch}.embedding_length"
_K_FFN = "{arch}.feed_forward_length"
_K_LAYERS = "{arch}.block_count"
_K_CONTEXT = "{arch}.context_length"
_K_HEADS = "{arch}.attention.head_count"
_K_KV_HEADS = "{arch}.attention.head_count_kv"
_K_HEAD_DIM = "{arch}.attention.key_length"
_K_ROPE_DIM = "{arch}.rope.dimension_count"
_K_VOCAB = "{arch}.vocab_size"
_K_EXPERTS = "{arch}.expert_count"
_K_ROPE_SCALING = "{arch}.rope.scaling.type"
_K_RMS_EPS = "{arch}.attention.layer_norm_rms_epsilon"
_K_ROPE_BASE = "{arch}.rope.freq_base"
_K_TOKENS = "tokenizer.ggml.tokens"
_K_TOKEN_TYPE = "tokenizer.ggml.token_type"
_K_MERGES = "tokenizer.ggml.merges"
_K_TOKENIZER = "tokenizer.ggml.model"
_K_PRE = "tokenizer.ggml.pre"
_K_BOS = "tokenizer.ggml.bos_token_id"
_K_EOS = "tokenizer.ggml.eos_token_id"
_K_UNK = "tokenizer.ggml.unknown_token_id"
_K_PAD = "tokenizer.ggml.padding_token_id"
_K_ADD_BOS = "tokenizer.ggml.add_bos_token"
_K_CHAT = "tokenizer.chat_template"
# llama.cpp's token types (gguf.TokenType)
_TOKEN_CONTROL, _TOKEN_USER_DEFINED = 3, 4

# tokenizer.ggml.pre values whose splitting tokenizers reproduces exactly (llama.cpp
# llama-vocab.cpp): GPT-2's regex is ByteLevel's own; the StarCoder family splits every
# digit apart first; Llama 3 uses the regex of its tokenizer.json
_PRE_GPT2 = ("default", "gpt2")
_PRE_DIGITS_GPT2 = ("smollm", "starcoder", "refact", "codeshell")
_PRE_LLAMA3 = ("llama-bpe", "llama3", "llama-v3")
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def _gguf_name_map(n_blocks):
    out = {}
    for src, hf in _GGUF_TO_HF.items():
        for b in range(n_blocks) if "{bid}" in src else [None]:
            out[src.format(bid=b)] = hf.format(bid=b)
    return out


def _rope_row_order(rows, n_head):
    """The rows of a q/k projection in HF order, as indices of llama.cpp's rows: the
    inverse of ``convert_hf_to_gguf.LlamaModel.permute``, which stores each head's rows
    as pairs (0, D/2), (1, D/2+1), ... where HF keeps the rotate-half order (first
    halves, then second halves)."""
    if rows % (2 * n_head):
        raise ValueError(f"{rows} rows are not {n_head} heads of pairs")
    return torch.arange(rows).reshape(n_head, rows // n_head // 2, 2).transpose(1, 2).reshape(-1)


def _gguf_config(meta, names, embed_rows):
    arch = meta.get(_K_ARCH)
    if arch != "llama":
        raise ValueError(f"general.architecture: expected 'llama' (GGUF), got {arch!r}")
    # each size key and the config field it becomes, checked (under the key's own name)
    # before any of them is divided or used to size something
    sizes = {
        _K_HIDDEN: "hidden_size",
        _K_FFN: "intermediate_size",
        _K_LAYERS: "num_hidden_layers",
        _K_CONTEXT: "max_position_embeddings",
        _K_HEADS: "num_attention_heads",
        _K_KV_HEADS: "num_key_value_heads",
        _K_HEAD_DIM: "head_dim",
        _K_ROPE_DIM: "head_dim",
        _K_VOCAB: "vocab_size",
    }
    required = (_K_HIDDEN, _K_FFN, _K_LAYERS, _K_CONTEXT, _K_HEADS)
    for k, field_name in sizes.items():
        name = k.format(arch=arch)
        if meta.get(name) is not None:
            _check_size(name, meta[name], *SIZE_LIMITS[field_name])
        elif k in required:
            raise ValueError(f"{name}: expected in the GGUF metadata, missing")

    def key(k, default=None):
        return meta.get(k.format(arch=arch), default)

    def decimal(k, default=None):
        # GGUF stores float32: 1e-5 comes back as 9.999999747e-06; the shortest decimal
        # that rounds to the same float32 is the value the HF config had
        v = key(k, default)
        if not _finite(v):
            raise ValueError(f"{k.format(arch=arch)}: expected a finite number, got {v!r:.80}")
        return float(str(np.float32(v)))

    if key(_K_EXPERTS, 0):
        raise ValueError(
            f"{arch}.expert_count: expected 0 (MoE GGUFs are not supported), got {key(_K_EXPERTS)}"
        )
    scaling = key(_K_ROPE_SCALING, "none")
    if scaling != "none":
        raise ValueError(f"{arch}.rope.scaling.type: expected 'none' (GGUF), got {scaling!r}")
    heads = key(_K_HEADS)
    hidden = key(_K_HIDDEN)
    head_dim = key(_K_HEAD_DIM, hidden // heads)
    rope_dim = key(_K_ROPE_DIM, head_dim)
    if rope_dim != head_dim:
        raise ValueError(f"{arch}.rope.dimension_count: expected {head_dim}, got {rope_dim}")
    # the embedding's rows: what the model computes logits of (a token list may be
    # shorter, padded embeddings longer)
    tokens = meta.get(_K_TOKENS)
    vocab = embed_rows or key(_K_VOCAB) or (len(tokens) if tokens else None)
    hf = {
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": key(_K_FFN),
        "num_hidden_layers": key(_K_LAYERS),
        "num_attention_heads": heads,
        "num_key_value_heads": key(_K_KV_HEADS, heads),
        "head_dim": head_dim,
        "rms_norm_eps": decimal(_K_RMS_EPS),
        "rope_theta": decimal(_K_ROPE_BASE, 10000.0),
        "max_position_embeddings": key(_K_CONTEXT),
        "tie_word_embeddings": "output.weight" not in names,
        "attention_bias": "blk.0.attn_q.bias" in names,
        "bos_token_id": meta.get(_K_BOS),
        "eos_token_id": meta.get(_K_EOS),
    }
    return ModelConfig.from_hf_dict(hf)


class LazyTensors(MutableMapping):
    """HF name -> tensor, each made by its loader when first read: a GGUF checkpoint's
    tensors are dequantized as the model takes them, so the float copies of the whole
    model never live at once (the model packs each and lets it go). A loader's errors
    are the loader's (a ValueError naming the file and tensor)."""

    def __init__(self, loaders, bar=None):
        self._loaders = dict(loaders)
        self._made = {}
        self._bar = bar  # ticks once per tensor made; closed with the last

    def __getitem__(self, name):
        t = self._made.get(name)
        if t is None:
            t = self._made[name] = self._loaders[name]()
            if self._bar is not None:
                self._bar.update()
                if self._bar.n >= self._bar.total:
                    self._bar.close()
        return t

    def __setitem__(self, name, t):
        self._loaders[name] = None
        self._made[name] = t

    def __delitem__(self, name):
        del self._loaders[name]
        self._made.pop(name, None)

    def __contains__(self, name):  # without making it
        return name in self._loaders

    def __iter__(self):
        return iter(self._loaders)

    def __len__(self):
        return len(self._loaders)


def _load_gguf(path, dtype, progress):
    from .gguf_file import GGUFFile

    try:
        f = GGUFFile(path)
    except Exception as e:  # a corrupt header fails as whatever numpy or struct raises
        kind = "" if isinstance(e, ValueError) else f"{type(e).__name__}: "
        raise ValueError(f"{path}: not a readable GGUF file: {kind}{e}") from None
    meta = f.meta
    shapes = {name: t.shape for name, t in f.tensors.items()}
    embed = shapes.get("token_embd.weight")
    embed_rows = int(embed[0]) if embed is not None and len(embed) == 2 else None
    config = _gguf_config(meta, shapes, embed_rows)
    name_map = _gguf_name_map(config.num_hidden_layers)
    unknown = sorted(n for n in shapes if n.rsplit(".", 1)[0] not in name_map)
    if unknown:
        raise ValueError(f"{path}: GGUF tensors with no HF counterpart here: {', '.join(unknown)}")

    def loader(name):
        base = name.rsplit(".", 1)[0]
        heads = None
        if base.endswith(".attn_q"):
            heads = config.num_attention_heads
        elif base.endswith(".attn_k"):
            heads = config.num_key_value_heads

        def load():
            try:
                order = _rope_row_order(shapes[name][0], heads) if heads else None
                # no dtype: fp32, the dequantized values as stored
                return f.tensor(name, dtype or torch.float32, row_order=order)
            except (ValueError, NotImplementedError) as e:  # a size or type the header garbled
                raise ValueError(f"{path}: tensor {name!r}: {e}") from None

        return load

    loaders = {}
    for name in f.tensors:
        base, suffix = name.rsplit(".", 1)
        loaders[f"{name_map[base]}.{suffix}"] = loader(name)
    desc = f"dequantizing {os.path.basename(path)}"
    bar = _bar(None, len(loaders), desc, progress)
    tensors = LazyTensors(loaders, bar=None if bar.disable else bar)
    tokenizer = _gguf_tokenizer(meta, path)
    return Checkpoint(
        config, tensors, tokenizer, path, meta.get(_K_CHAT), _gguf_special_tokens(meta)
    )


def _gguf_special_tokens(meta):
    """The special tokens transformers reads from a GGUF file (the four it maps)."""
    tokens = meta.get(_K_TOKENS) or []
    ids = {"bos_token": _K_BOS, "eos_token": _K_EOS, "unk_token": _K_UNK, "pad_token": _K_PAD}
    return {
        name: tokens[meta[key]]
        for name, key in ids.items()
        if meta.get(key) is not None and 0 <= meta[key] < len(tokens)
    }


def _gguf_tokenizer(meta, path):
    """A byte-level BPE ``tokenizers.Tokenizer`` from the GGUF vocabulary, or None."""
    from tokenizers import (
        AddedToken,
        Regex,
        Tokenizer,
        decoders,
        models,
        pre_tokenizers,
        processors,
    )

    kind, pre = meta.get(_K_TOKENIZER), meta.get(_K_PRE, "default")
    tokens, merges = meta.get(_K_TOKENS), meta.get(_K_MERGES)

    def give_up(why):
        warnings.warn(f"{path}: no tokenizer built ({why}); pass token ids", stacklevel=5)
        return None

    if kind != "gpt2" or tokens is None or merges is None:
        return give_up(f"tokenizer.ggml.model {kind!r} is not a byte-level BPE with merges")
    if pre not in _PRE_GPT2 + _PRE_DIGITS_GPT2 + _PRE_LLAMA3:
        return give_up(f"pre-tokenizer {pre!r} is not one this loader reproduces")
    vocab = {tok: i for i, tok in enumerate(tokens)}
    if len(vocab) != len(tokens):
        return give_up("the vocabulary repeats tokens")

    bpe = models.BPE(vocab=vocab, merges=[tuple(m.split(" ", 1)) for m in merges])
    tok = Tokenizer(bpe)
    if pre in _PRE_LLAMA3:
        steps = [
            pre_tokenizers.Split(Regex(_LLAMA3_SPLIT), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    else:
        steps = [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)]
        if pre in _PRE_DIGITS_GPT2:
            steps.insert(0, pre_tokenizers.Digits(individual_digits=True))
    tok.pre_tokenizer = pre_tokenizers.Sequence(steps)
    tok.decoder = decoders.ByteLevel()
    # control tokens (<|im_start|>) and user-defined ones (<think>) are matched whole in
    # the text, as llama.cpp does; only control tokens are dropped by decode
    types = meta.get(_K_TOKEN_TYPE)
    types = np.zeros(0, np.int32) if types is None else np.asarray(types)[: len(tokens)]
    special = [
        AddedToken(tokens[i], special=True, normalized=False)
        for i in np.flatnonzero(types == _TOKEN_CONTROL)
    ]
    user = [
        AddedToken(tokens[i], special=False, normalized=False)
        for i in np.flatnonzero(types == _TOKEN_USER_DEFINED)
    ]
    tok.add_special_tokens(special)
    tok.add_tokens(user)
    bos = meta.get(_K_BOS)
    if meta.get(_K_ADD_BOS) and bos is not None:
        b = tokens[bos]
        tok.post_processor = processors.TemplateProcessing(
            single=f"{b} $A", pair=f"{b} $A {b} $B", special_tokens=[(b, bos)]
        )
    return tok
