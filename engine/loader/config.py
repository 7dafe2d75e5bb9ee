"""The engine's model config: :class:`ModelConfig`, read from a config.json dict as
transformers reads it (:meth:`ModelConfig.from_hf_dict`), each family's differences
taken from its row of :data:`engine.loader.families.FAMILIES`."""

from dataclasses import dataclass, field

from ..args import is_int
from .families import (
    FAMILIES,
    MODEL_TYPE_TO_ARCHITECTURE,
    SUPPORTED_ARCHITECTURES,
    TEXT_OF_WRAPPER,
    family_of,
)
from .fields import check_sizes, finite, read_rope
from .rules import GDNConfig


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
    # Gemma 2/3 (rules.gemma_fields): the dense MLP's activation, (offset + w) norms,
    # sandwich norms, the embedding scale (applied rounded to the model dtype), soft-caps,
    # the attention scale and each layer's rope (None: rope_theta/rope_scaling for all)
    hidden_act: str = "silu"  # or "gelu_tanh"
    norm_offset: float = 0.0
    sandwich_norms: bool = False
    embed_scale: float = 1.0
    attn_softcap: float = 0.0
    logit_softcap: float = 0.0
    attn_scale: float | None = None  # None: head_dim ** -0.5
    layer_ropes: list | None = None  # per layer: (rope_theta, rope_scaling)
    text_of: str | None = None  # the multimodal wrapper this text model came from
    # Gated DeltaNet hybrids (rules.gdn_fields): each layer's token mixer ("attention" or
    # "linear_attention"; None: attention everywhere), the GDN layers' shapes, the
    # attention output gate and the rotary share of each head
    layer_mixers: list | None = None
    gdn: "GDNConfig | None" = None
    attn_output_gate: bool = False
    partial_rotary_factor: float = 1.0
    # the checkpoint's quantization_config method: None, or "mxfp4" (GPT-OSS's experts
    # stored as *_blocks / *_scales, engine.models.decoder loads them quantised)
    quant_method: str | None = None

    def __post_init__(self):
        family_of(self.architecture)
        check_sizes(vars(self))
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
        if not (finite(self.rope_theta) and self.rope_theta > 0):
            raise ValueError(f"rope_theta: expected a finite number > 0, got {self.rope_theta!r}")
        if not (finite(self.rms_norm_eps) and self.rms_norm_eps >= 0):
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
        if self.family.experts is not None and self.num_experts < 1:
            raise ValueError(
                f"num_experts: expected >= 1 for {self.architecture}, got {self.num_experts}"
            )
        if self.decoder_sparse_step < 1:
            raise ValueError(f"decoder_sparse_step: expected >= 1, got {self.decoder_sparse_step}")
        eos = self.eos_token_id
        eos = [] if eos is None else [eos] if isinstance(eos, int) else eos
        if not isinstance(eos, (list, tuple)) or not all(is_int(t) for t in eos):
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

    @property
    def family(self):
        """This architecture's row of :data:`engine.loader.families.FAMILIES`."""
        return FAMILIES[self.architecture]

    def is_moe_layer(self, i):
        """Whether decoder layer ``i`` has an MoE block (else a dense gated MLP)."""
        if not 0 <= i < self.num_hidden_layers:
            raise ValueError(f"i: expected 0 <= i < {self.num_hidden_layers}, got {i}")
        if self.num_experts == 0:
            return False
        if self.family.experts.every_layer:
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
        wrapper = named or MODEL_TYPE_TO_ARCHITECTURE.get(d.get("model_type"))
        if wrapper in TEXT_OF_WRAPPER:
            text_of, d = wrapper, _text_config(d, wrapper)
        arch = _architecture(d)
        family = FAMILIES[arch]
        d = {**family.defaults, **d}
        check_sizes(d)  # before any list or table is sized by them

        def need(key):
            if d.get(key) is None:
                raise ValueError(f"config: {arch} needs {key!r}, which is missing")
            return d[key]

        extra = family.fields(d, family, need("num_hidden_layers")) if family.fields else {}
        rope_theta, rope_scaling = extra.pop("rope", None) or read_rope(d, family)
        moe = _moe_fields(d, family, need)
        for key, value in family.fixed.items():
            if d.get(key, value) != value:
                raise ValueError(f"{key}: expected {value} ({arch}), got {d[key]!r}")
        quant_method = _quant_method(d.get("quantization_config"), family)
        windows = family.windows(d, need("num_hidden_layers"), family)
        if family.mlp_bias_refused and d.get("mlp_bias"):
            raise ValueError(
                f"mlp_bias: expected false ({arch}: MLP biases), got {d['mlp_bias']!r}"
            )
        if family.hidden_act == "silu":  # the MLP (and experts) gated with SiLU
            act = d.get("hidden_act", "silu")
            if act != "silu":
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
            # absent: the family's class default in its row (Gemma: tied), else untied
            # (PretrainedConfig's default, True, is no family's)
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            # read where the family switches biases by it: Qwen2 has q/k/v biases and
            # none on o (qkv_bias), Mistral and Mixtral none at all
            attention_bias=bool(d.get("attention_bias", False)) and family.attention_bias,
            qkv_bias=_qkv_bias(d, family),
            bos_token_id=d.get("bos_token_id"),
            eos_token_id=d.get("eos_token_id"),
            torch_dtype=d.get("torch_dtype") or d.get("dtype"),
            text_of=text_of,
            hidden_act=family.hidden_act,
            norm_offset=family.norm_offset,
            sandwich_norms=family.sandwich_norms,
            attn_output_gate=family.attn_output_gate,
            **extra,
            layer_windows=windows,
            quant_method=quant_method,
            **moe,
        )


def _architecture(d):
    """The supported architecture a config.json names (checked before any other key)."""
    archs = d.get("architectures") or []
    model_type = d.get("model_type")
    arch = archs[0] if archs else MODEL_TYPE_TO_ARCHITECTURE.get(model_type)
    if arch in FAMILIES:
        return arch
    known = ", ".join(SUPPORTED_ARCHITECTURES)
    got = f"architectures={d.get('architectures')!r}, model_type={model_type!r}"
    raise ValueError(f"architecture: expected one of {known}, got {got}")


def _quant_method(quant, family):
    """The checkpoint's ``quantization_config`` method: None, or ``"mxfp4"`` where the
    family stores its experts all in one (GPT-OSS's ``*_blocks``/``*_scales``, run
    quantised by ``numkern.moe``); any other is refused by name."""
    if quant is None:
        return None
    method = quant.get("quant_method", quant) if isinstance(quant, dict) else quant
    if method == "mxfp4" and family.experts is not None and family.experts.fused:
        return method
    raise ValueError(
        f"quantization_config: expected none, or quant_method 'mxfp4' (GPT-OSS's experts), "
        f"got quant_method {method!r}"
    )


def _moe_fields(d, family, need):
    """The MoE fields of ModelConfig (none for a dense family), as the row's
    :class:`~engine.loader.families.Experts` says to read them."""
    experts = family.experts
    if experts is None:
        return {}
    num_experts = d.get("num_experts")
    if num_experts is None:
        num_experts = d.get("num_local_experts") or 0
    moe = {
        "num_experts": num_experts,
        "num_experts_per_tok": need("num_experts_per_tok"),
        "moe_intermediate_size": need(experts.intermediate_key),
    }
    if experts.every_layer:
        moe["norm_topk_prob"] = True
    else:
        moe["norm_topk_prob"] = bool(d.get("norm_topk_prob", False))
        moe["decoder_sparse_step"] = d.get("decoder_sparse_step") or 1
        moe["mlp_only_layers"] = list(d.get("mlp_only_layers") or [])
    if experts.shared_expert:
        shared = need("shared_expert_intermediate_size")
        if not is_int(shared) or shared < 1:
            raise ValueError(
                f"shared_expert_intermediate_size: expected an int >= 1 ({family.name}), "
                f"got {shared!r}"
            )
        moe["shared_expert_intermediate_size"] = shared
    return moe


def _qkv_bias(d, family):
    """Whether q/k/v have biases (o none), or None (as attention_bias): Qwen2 always,
    Qwen2-MoE with ``qkv_bias`` (transformers' default true)."""
    if family.qkv_bias_key is not None:
        return bool(d.get(family.qkv_bias_key, family.qkv_bias))
    return family.qkv_bias


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


def layer_windows(d, arch, n_layers):
    """Each layer's sliding window (-1: full attention) as transformers computes it for
    ``arch`` from a config.json dict ``d``: the family's window rule
    (``Family.windows``, :mod:`engine.loader.rules`) on ``d`` with the family's class
    defaults filled in."""
    family = family_of(arch)
    return family.windows({**family.defaults, **d}, n_layers, family)
