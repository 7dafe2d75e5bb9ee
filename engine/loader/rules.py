"""The per-family rules that are logic rather than a value, each referenced from its
family's row in :data:`engine.loader.families.FAMILIES`:

- the sliding-window rules (``Family.windows``): each layer's window as transformers
  computes it from a config.json dict;
- the extra fields of Gemma 2/3 (:func:`gemma_fields`) and of the Gated DeltaNet hybrids
  (:func:`gdn_fields`) (``Family.fields``).

Each takes the config dict with its family's class defaults filled in and the family's
row; none tests an architecture name.
"""

from dataclasses import dataclass

from ..args import is_int
from .fields import checked_kinds, read_rope


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


# -- sliding windows: (d, n_layers, family) -> per layer its window, -1 for full attention


def _window(d):
    """``sliding_window``, checked: an int >= 1, or None (no window)."""
    window = d.get("sliding_window")
    if window is not None and not is_int(window):
        raise ValueError(f"sliding_window: expected an int or null, got {window!r}")
    if window is not None and window < 1:
        raise ValueError(f"sliding_window: expected >= 1 or null, got {window}")
    return window


def _max_window_layers(d):
    first = d.get("max_window_layers", 28)  # transformers' Qwen2/Qwen3/Qwen2-MoE default
    if not is_int(first):
        raise ValueError(f"max_window_layers: expected an int, got {first!r}")
    return first


def no_window(d, n_layers, family):
    """No window (the GDN hybrids: their modeling files read none)."""
    return [-1] * n_layers


def unread_window(d, n_layers, family):
    """No window (Llama: LlamaConfig has none); a ``sliding_window`` key is checked but
    not read."""
    _window(d)
    return [-1] * n_layers


def every_layer_window(d, n_layers, family):
    """``sliding_window`` (None: none) on every layer (Mistral, Mixtral; Mistral ignores
    ``layer_types``, as transformers' MistralConfig does)."""
    window = _window(d)
    return [-1] * n_layers if window is None else [window] * n_layers


def switched_window(d, n_layers, family):
    """Qwen3-MoE: ``sliding_window`` with ``use_sliding_window`` on every layer."""
    window = _window(d)
    if window is None or not d.get("use_sliding_window", False):
        return [-1] * n_layers
    return [window] * n_layers


def qwen_windows(d, n_layers, family):
    """Qwen2, Qwen3: ``sliding_window`` only with ``use_sliding_window`` (default False),
    on the layers ``layer_types`` marks ``"sliding_attention"``; without
    ``layer_types``, the layers from ``max_window_layers`` (default 28) on."""
    window = _window(d)
    if window is None or not d.get("use_sliding_window", False):
        return [-1] * n_layers
    kinds = d.get("layer_types")
    if kinds is None:
        first = _max_window_layers(d)
        return [window if i >= first else -1 for i in range(n_layers)]
    kinds = checked_kinds(kinds, n_layers, family.name)
    return [window if kind == "sliding_attention" else -1 for kind in kinds]


def qwen2_moe_windows(d, n_layers, family):
    """Qwen2-MoE's windows as transformers' Qwen2MoeConfig computes them: the window is
    ``sliding_window`` with ``use_sliding_window`` (default False), else 0 (and saved
    so); it applies on the layers ``layer_types`` marks ``"sliding_attention"``, by
    default the even layers below ``max_window_layers`` (default 28) when the window is
    used. Refused: a sliding layer without ``use_sliding_window`` (a window of 0 keys),
    and ``use_sliding_window`` without a window >= 1 (transformers' mask raises)."""
    use = bool(d.get("use_sliding_window", False))
    window = d.get("sliding_window")
    if use and (not is_int(window) or window < 1):
        raise ValueError(
            f"sliding_window: expected an int >= 1 with use_sliding_window (Qwen2-MoE), "
            f"got {window!r}"
        )
    kinds = d.get("layer_types")
    if kinds is None:
        first = _max_window_layers(d)
        sliding = [use and i % 2 == 0 and i < first for i in range(n_layers)]
        return [window if s else -1 for s in sliding]
    out = []
    for i, kind in enumerate(checked_kinds(kinds, n_layers, "Qwen2-MoE")):
        if kind == "sliding_attention" and not use:
            raise ValueError(
                f"layer_types[{i}]: 'sliding_attention' needs use_sliding_window (without "
                f"it transformers' Qwen2-MoE window is 0: the layer would see no key)"
            )
        out.append(window if kind == "sliding_attention" else -1)
    return out


def alternating_windows(d, n_layers, family):
    """GPT-OSS's windows as transformers' GptOssConfig computes them: ``sliding_window``
    (class default 128) on the layers ``layer_types`` marks ``"sliding_attention"``, by
    default the even ones (sliding and full layers alternate). Its model always builds
    the sliding mask, which raises without a window: a null window is refused."""
    window = d.get("sliding_window")
    if not is_int(window) or window < 1:
        raise ValueError(f"sliding_window: expected an int >= 1 (GPT-OSS), got {window!r}")
    kinds = d.get("layer_types")
    if kinds is None:
        return [window if i % 2 == 0 else -1 for i in range(n_layers)]
    kinds = checked_kinds(kinds, n_layers, "GPT-OSS")
    return [window if kind == "sliding_attention" else -1 for kind in kinds]


def gemma_windows(d, n_layers, family):
    """Gemma 2/3: ``sliding_window`` (class default 4096) on the sliding layers of
    :func:`gemma_layer_types`."""
    window = _window(d)
    if window is None:
        return [-1] * n_layers
    kinds = gemma_layer_types(d, family, n_layers)
    return [window if k == "sliding_attention" else -1 for k in kinds]


def gemma_layer_types(d, family, n_layers):
    """Gemma's layer kinds: ``layer_types``, else every n-th layer full, the others
    sliding; n is ``family.layer_pattern``: (the config key that sets it or None, its
    default) (Gemma 2: always 2; Gemma 3: ``sliding_window_pattern``, default 6)."""
    kinds = d.get("layer_types")
    if kinds is None:
        key, pattern = family.layer_pattern
        if key is not None:
            pattern = d.get(key, pattern)
        if not is_int(pattern) or pattern < 1:
            raise ValueError(f"sliding_window_pattern: expected an int >= 1, got {pattern!r}")
        kinds = [
            "sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(n_layers)
        ]
    return checked_kinds(kinds, n_layers, family.name)


# -- a family's extra ModelConfig fields: (d, family, n_layers) -> dict; a "rope" entry
# -- is the model's (rope_theta, rope_scaling), read by its own rule


def gemma_fields(d, family, n_layers):
    """The Gemma 2/3 fields of ModelConfig from a config.json dict (transformers'
    Gemma2Config / Gemma3TextConfig and their modeling files): the tanh-GELU MLP checked,
    the embedding scaled by sqrt(hidden), the soft-caps, the attention scale
    ``query_pre_attn_scalar ** -0.5`` and, with ``family.layer_ropes`` (Gemma 3), a rope
    per layer kind (full: ``rope_parameters["full_attention"]``, or ``rope_theta`` with
    ``rope_scaling``; sliding: ``rope_parameters["sliding_attention"]``, or
    ``rope_local_base_freq``). The (1 + w) and sandwich norms are the row's."""
    arch = family.name
    act = d.get("hidden_activation") or d.get("hidden_act") or "gelu_pytorch_tanh"
    if act != "gelu_pytorch_tanh":
        raise ValueError(f"hidden_activation: expected 'gelu_pytorch_tanh' ({arch}), got {act!r}")
    if d.get("use_bidirectional_attention"):
        raise ValueError(
            f"use_bidirectional_attention: expected false ({arch}: causal decoding), got "
            f"{d['use_bidirectional_attention']!r}"
        )

    def cap(key):  # the class default is in d (Gemma 2: 50 and 30; Gemma 3: none)
        v = d.get(key)
        if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or v <= 0):
            raise ValueError(f"{key}: expected a number > 0 or null, got {v!r}")
        return float(v or 0.0)

    scalar = d.get("query_pre_attn_scalar", 256)
    if isinstance(scalar, bool) or not isinstance(scalar, (int, float)) or scalar <= 0:
        raise ValueError(f"query_pre_attn_scalar: expected a number > 0, got {scalar!r}")
    out = {
        "embed_scale": float(d["hidden_size"]) ** 0.5,
        "attn_softcap": cap("attn_logit_softcapping"),
        "logit_softcap": cap("final_logit_softcapping"),
        "attn_scale": float(scalar) ** -0.5,
    }
    if not family.layer_ropes:
        return out
    params = d.get("rope_parameters")
    if isinstance(params, dict) and ("full_attention" in params or "sliding_attention" in params):
        full_params = {"rope_theta": 1e6, **(params.get("full_attention") or {})}
        local_params = {"rope_theta": 1e4, **(params.get("sliding_attention") or {})}
        full = read_rope({"rope_parameters": full_params}, family)
        sliding = read_rope({"rope_parameters": local_params}, family)
    else:  # transformers 4: rope_theta, rope_scaling (full layers), rope_local_base_freq
        theta = d.get("rope_theta", 1e6)
        full = read_rope({"rope_theta": theta, "rope_scaling": d.get("rope_scaling")}, family)
        sliding = read_rope({"rope_theta": d.get("rope_local_base_freq", 1e4)}, family)
    kinds = gemma_layer_types(d, family, n_layers)
    out["rope"] = full
    out["layer_ropes"] = [sliding if k == "sliding_attention" else full for k in kinds]
    return out


def gdn_fields(d, family, n_layers):
    """The Gated DeltaNet hybrids' fields of ModelConfig from a config.json dict
    (transformers' Qwen3NextConfig, Qwen3_5TextConfig, Qwen3_5MoeTextConfig and their
    modeling files): the ``linear_*`` shapes, each layer's mixer (``layer_types``, by
    default every ``full_attention_interval``-th layer (4) full attention, the others
    linear), the gated attention output checked, and partial rotary
    (``partial_rotary_factor``, default 0.25, in ``rope_parameters`` or at top level).
    With ``family.mrope`` (Qwen3.5), the multimodal rope (``mrope_section``,
    ``mrope_interleaved``) is plain rope for text-only positions (its three position
    axes are equal); a section that does not cover the rotary dims is refused."""
    arch = family.name

    def count(key, default):
        v = d.get(key, default)
        if not is_int(v) or v < 1:
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
    checked_kinds(kinds, n_layers, arch, allowed=("full_attention", "linear_attention"))
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
    if not family.mrope and (section is not None or interleaved is not None):
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
        "partial_rotary_factor": float(partial),
        "rope": read_rope(rope_d, family),
    }
