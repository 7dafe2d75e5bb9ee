"""The model families the engine runs: one row per HF architecture.

A row holds everything that differs between families: the ``model_type`` a bare
config.json names it by, transformers' class defaults, the config fields its math reads
(:data:`HONOURED_FIELDS`), the rope defaults, biases, norms, MoE fields and expert tensor
names, attention sinks, the Gated DeltaNet layers, and -- where the difference is logic
rather than a value -- the rule that computes it (:mod:`engine.loader.rules`: each
layer's sliding window, Gemma's and the hybrids' extra fields). Every other module asks
the row (``ModelConfig.family``), never the architecture's name: adding a family is
adding a row.
"""

from collections.abc import Callable
from dataclasses import dataclass, field

from numkern.moe import SWIGLU_ALPHA, SWIGLU_LIMIT

from . import rules


@dataclass(frozen=True)
class Experts:
    """How a family's MoE layers read config.json and name their tensors."""

    # the config key of each expert's MLP width (Mixtral, GPT-OSS: intermediate_size)
    intermediate_key: str = "moe_intermediate_size"
    # True: every layer is MoE and its top-k weights are renormalised (Mixtral
    # renormalises its top-k softmax; GPT-OSS takes the softmax of its top-k logits,
    # which is the same); False: transformers' sparse-step rule (decoder_sparse_step,
    # mlp_only_layers) and norm_topk_prob as the config says
    every_layer: bool = False
    # a dense expert every token runs, weighted by sigmoid(x @ gate.T)
    # (shared_expert_intermediate_size, needed)
    shared_expert: bool = False
    # the tensors: "{prefix}experts.{e}.{name}.weight" for gate, up and down, and the
    # router "{prefix}gate.weight"; fused: GPT-OSS's all in one, transposed, biased
    # ("mlp.experts.gate_up_proj [E, H, 2I]")
    prefix: str = "mlp."
    names: tuple = ("gate_proj", "up_proj", "down_proj")
    fused: bool = False


@dataclass(frozen=True)
class Family:
    """One architecture's row (see the module docstring)."""

    name: str  # the HF ``architectures`` name
    model_type: str  # what a config.json saved from a bare config names it by
    # the config.json fields its math reads beyond the common ones (HONOURED_FIELDS)
    honoured: tuple
    # (d, n_layers, family) -> each layer's sliding window, -1 for full attention
    windows: Callable
    # transformers' class defaults that differ from what the engine assumes where a
    # config.json leaves the field out (none: num_key_value_heads as
    # num_attention_heads, head_dim hidden_size / num_attention_heads, no window, no
    # bias, untied embeddings)
    defaults: dict = field(default_factory=dict)
    rope_theta: float = 10000.0  # for configs old enough to have no rope_theta at all
    rope_scaling: dict | None = None  # where a config has no rope_parameters/rope_scaling
    attention_bias: bool = False  # attention_bias switches q/k/v/o biases
    qkv_bias: bool | None = None  # True: q/k/v always biased (o not); None: attention_bias
    qkv_bias_key: str | None = None  # the config key that switches qkv_bias (Qwen2-MoE)
    qk_norm: bool = False  # RMS norms on each head's q and k
    mlp_bias_refused: bool = False  # reads mlp_bias, which it refuses (Llama)
    hidden_act: str = "silu"  # the MLP's; SiLU is checked in hidden_act, Gemma's by its rule
    norm_offset: float = 0.0  # RMS norms scale by (offset + w): Gemma, the hybrids 1
    sandwich_norms: bool = False  # the attention and MLP outputs normed before their adds
    attention_sinks: bool = False  # a learned sink logit per head (self_attn.sinks)
    experts: Experts | None = None  # None: dense
    fixed: dict = field(default_factory=dict)  # fields the engine takes at one value only
    # (d, family, n_layers) -> extra ModelConfig fields (a "rope" entry: the model's rope)
    fields: Callable | None = None
    # Gemma: (the config key setting every how-many-th layer is full, or None; default)
    layer_pattern: tuple | None = None
    layer_ropes: bool = False  # Gemma 3: a rope per layer kind
    # the Gated DeltaNet hybrids: gated attention output (q_proj holds the gate), a
    # multi-token-prediction head (mtp.*, skipped), the layout of the GDN input
    # projection ("qkvz_ba": Qwen3-Next's in_proj_qkvz and in_proj_ba grouped per k head;
    # "apart": Qwen3.5's in_proj_qkv, _z, _b, _a) and whether mrope fields are read
    gdn_in_proj: str | None = None
    attn_output_gate: bool = False
    mtp_head: bool = False
    mrope: bool = False


# The config.json fields each family's math reads (beyond vocab_size, hidden_size,
# intermediate_size, num_hidden_layers, num_attention_heads, num_key_value_heads,
# head_dim, rms_norm_eps, max_position_embeddings, tie_word_embeddings, bos/eos ids and
# rope_theta / rope_scaling / rope_parameters, read for all): each is honoured, or the
# checkpoint is refused with a ValueError naming it. Fields that only matter in
# training (dropouts, router aux losses, jitter noise, initializer ranges) are not read.
# A quantization_config is refused for every family (unquantized weights only).
_SWITCHED_WINDOW = ("use_sliding_window", "sliding_window")
_QWEN_WINDOW = (*_SWITCHED_WINDOW, "max_window_layers", "layer_types")
_SPARSE_MOE = ("num_experts", "num_experts_per_tok", "moe_intermediate_size")
_SPARSE_STEP = ("norm_topk_prob", "decoder_sparse_step", "mlp_only_layers")
_GEMMA = (
    "hidden_activation (gelu_pytorch_tanh)",
    "attention_bias",
    "query_pre_attn_scalar",
    "attn_logit_softcapping",
    "final_logit_softcapping",
    "sliding_window",
    "layer_types",
)
_GDN = (
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
_SHARED_MOE = (*_SPARSE_MOE, "shared_expert_intermediate_size")
_MROPE = ("mrope_section", "mrope_interleaved")
# Gemma 2/3: tanh-GELU MLP, (1 + w) norms, sandwich norms, the embedding scaled by
# sqrt(hidden), soft-caps, an attention scale of their own (rules.gemma_fields)
_GEMMA_ROW = dict(
    windows=rules.gemma_windows,
    attention_bias=True,
    hidden_act="gelu_tanh",
    norm_offset=1.0,
    sandwich_norms=True,
    fields=rules.gemma_fields,
)
# the hybrids: Gated DeltaNet layers (linear attention, a state per request) beside
# gated full-attention layers, (1 + w) norms, partial rotary (rules.gdn_fields)
_GDN_ROW = dict(
    windows=rules.no_window,
    attention_bias=True,
    qk_norm=True,
    norm_offset=1.0,
    fields=rules.gdn_fields,
    attn_output_gate=True,
    mtp_head=True,
)

_ROWS = (
    Family(
        "LlamaForCausalLM",
        "llama",
        ("attention_bias", "mlp_bias (false only)", "hidden_act (silu)"),
        windows=rules.unread_window,
        attention_bias=True,
        mlp_bias_refused=True,
    ),
    Family(
        "MistralForCausalLM",
        "mistral",
        ("sliding_window", "hidden_act (silu)"),
        windows=rules.every_layer_window,
        defaults={"num_key_value_heads": 8, "sliding_window": 4096},
    ),
    Family(
        "Qwen2ForCausalLM",
        "qwen2",
        (*_QWEN_WINDOW, "hidden_act (silu)"),
        windows=rules.qwen_windows,
        defaults={"num_key_value_heads": 32, "sliding_window": 4096},
        qkv_bias=True,
    ),
    Family(
        "Qwen3ForCausalLM",
        "qwen3",
        ("attention_bias", *_QWEN_WINDOW, "hidden_act (silu)"),
        windows=rules.qwen_windows,
        defaults={"num_key_value_heads": 32, "head_dim": 128, "sliding_window": 4096},
        attention_bias=True,
        qk_norm=True,
    ),
    Family(
        "Qwen3MoeForCausalLM",
        "qwen3_moe",
        ("attention_bias", *_SWITCHED_WINDOW, *_SPARSE_MOE, *_SPARSE_STEP, "hidden_act (silu)"),
        windows=rules.switched_window,
        defaults={"num_key_value_heads": 4, "sliding_window": 4096},
        attention_bias=True,
        qk_norm=True,
        experts=Experts(),
    ),
    Family(
        "Qwen2MoeForCausalLM",
        "qwen2_moe",
        (
            "qkv_bias",
            *_QWEN_WINDOW,
            *_SHARED_MOE,
            *_SPARSE_STEP,
            "hidden_act (silu)",
        ),
        windows=rules.qwen2_moe_windows,
        defaults={"num_key_value_heads": 16, "sliding_window": 4096},
        qkv_bias=True,  # transformers' default of qkv_bias
        qkv_bias_key="qkv_bias",
        experts=Experts(shared_expert=True),
    ),
    Family(
        "MixtralForCausalLM",
        "mixtral",
        ("sliding_window", "num_local_experts", "num_experts_per_tok", "hidden_act (silu)"),
        windows=rules.every_layer_window,
        defaults={"num_key_value_heads": 8},
        rope_theta=1e6,
        experts=Experts(
            intermediate_key="intermediate_size",
            every_layer=True,
            prefix="block_sparse_moe.",
            names=("w1", "w3", "w2"),
        ),
    ),
    Family(
        "GptOssForCausalLM",
        "gpt_oss",
        (
            "attention_bias",
            "sliding_window",
            "layer_types",
            "num_local_experts",
            "num_experts_per_tok",
            "swiglu_alpha (1.702)",
            "swiglu_limit (7.0)",
        ),
        windows=rules.alternating_windows,
        defaults={
            "num_key_value_heads": 8,
            "head_dim": 64,
            "sliding_window": 128,
            "attention_bias": True,
        },
        rope_theta=150000.0,
        rope_scaling={  # GptOssConfig: YaRN
            "rope_type": "yarn",
            "factor": 32.0,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "truncate": False,
            "original_max_position_embeddings": 4096,
        },
        attention_bias=True,
        attention_sinks=True,
        experts=Experts(intermediate_key="intermediate_size", every_layer=True, fused=True),
        # its experts' activation, fixed in numkern.moe's "swigluoai"
        fixed={"swiglu_alpha": SWIGLU_ALPHA, "swiglu_limit": SWIGLU_LIMIT},
    ),
    Family(
        "Gemma2ForCausalLM",
        "gemma2",
        (*_GEMMA, "use_bidirectional_attention (false only)"),
        defaults={
            "num_key_value_heads": 4,
            "head_dim": 256,
            "sliding_window": 4096,
            "tie_word_embeddings": True,
            "attn_logit_softcapping": 50.0,
            "final_logit_softcapping": 30.0,
        },
        layer_pattern=(None, 2),
        **_GEMMA_ROW,
    ),
    Family(
        "Gemma3ForCausalLM",
        "gemma3_text",
        (
            *_GEMMA,
            "sliding_window_pattern",
            "rope_local_base_freq",
            "rope_parameters per layer kind",
            "use_bidirectional_attention (false only)",
        ),
        # Gemma3TextConfig: google/gemma-3-4b-it's text_config names only hidden_size,
        # intermediate_size, num_hidden_layers, rope_scaling and sliding_window
        defaults={
            "vocab_size": 262208,
            "num_attention_heads": 8,
            "num_key_value_heads": 4,
            "head_dim": 256,
            "max_position_embeddings": 131072,
            "rms_norm_eps": 1e-6,
            "sliding_window": 4096,
            "tie_word_embeddings": True,
        },
        qk_norm=True,
        layer_pattern=("sliding_window_pattern", 6),
        layer_ropes=True,
        **_GEMMA_ROW,
    ),
    Family(
        "Qwen3NextForCausalLM",
        "qwen3_next",
        (*_GDN, *_SHARED_MOE, *_SPARSE_STEP),
        defaults={"num_key_value_heads": 2, "head_dim": 256, "norm_topk_prob": True},
        experts=Experts(shared_expert=True),
        gdn_in_proj="qkvz_ba",
        **_GDN_ROW,
    ),
    # mrope_section / mrope_interleaved: with text-only positions (all three axes equal)
    # the multimodal rope is plain rope
    Family(
        "Qwen3_5ForCausalLM",
        "qwen3_5_text",
        (*_GDN, *_MROPE),
        defaults={"num_key_value_heads": 4, "head_dim": 256},
        gdn_in_proj="apart",
        mrope=True,
        **_GDN_ROW,
    ),
    Family(
        "Qwen3_5MoeForCausalLM",
        "qwen3_5_moe_text",
        (*_GDN, *_SHARED_MOE, *_MROPE),
        # no dense MLP: intermediate_size unused
        defaults={"num_key_value_heads": 2, "head_dim": 256, "intermediate_size": 0},
        experts=Experts(every_layer=True, shared_expert=True),
        gdn_in_proj="apart",
        mrope=True,
        **_GDN_ROW,
    ),
)
FAMILIES = {f.name: f for f in _ROWS}
SUPPORTED_ARCHITECTURES = tuple(FAMILIES)
HONOURED_FIELDS = {f.name: f.honoured for f in _ROWS}

# a multimodal wrapper whose text model the engine runs: its config's text_config, its
# language model's tensors (vision tensors skipped by name, logged once); the wrapper's
# model_type and its text model's architecture
WRAPPERS = {
    "Gemma3ForConditionalGeneration": ("gemma3", "Gemma3ForCausalLM"),
    "Qwen3_5ForConditionalGeneration": ("qwen3_5", "Qwen3_5ForCausalLM"),
    "Qwen3_5MoeForConditionalGeneration": ("qwen3_5_moe", "Qwen3_5MoeForCausalLM"),
}
TEXT_OF_WRAPPER = {wrapper: text for wrapper, (_, text) in WRAPPERS.items()}
# config.json files saved from a bare config (no model) carry model_type, not architectures
MODEL_TYPE_TO_ARCHITECTURE = {
    **{f.model_type: f.name for f in _ROWS},
    **{model_type: wrapper for wrapper, (model_type, _) in WRAPPERS.items()},
}


def family_of(arch):
    """The row of ``arch``; ValueError naming it if the engine runs no such family."""
    row = FAMILIES.get(arch)
    if row is None:
        raise ValueError(
            f"architecture: expected one of {', '.join(SUPPORTED_ARCHITECTURES)}, got {arch!r}"
        )
    return row
