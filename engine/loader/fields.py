"""The checks every config field goes through: sizes within :data:`SIZE_LIMITS`, finite
numbers, layer-kind lists, and the rope in either of transformers' spellings.

Nothing here knows a family by name: a family's defaults reach :func:`read_rope` as its
row of :data:`engine.loader.families.FAMILIES` (``rope_theta``, ``rope_scaling``).
"""

import math

ROPE_TYPES = ("default", "linear", "llama3", "yarn")  # what engine.layers.rope_inv_freq implements

# the YaRN parameters engine.layers.rope_inv_freq reads (transformers' own list)
YARN_KEYS = (
    "factor",
    "original_max_position_embeddings",
    "attention_factor",
    "beta_fast",
    "beta_slow",
    "mscale",
    "mscale_all_dim",
    "truncate",
)

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


def check_size(name, value, low, high):
    """ValueError naming ``name`` unless ``value`` is an int (not a bool) in [low, high]."""
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ValueError(f"{name}: expected an int in [{low}, {high}], got {value!r:.80}")


def check_sizes(fields):
    """:func:`check_size` on each field of ``fields`` (a config dict) that
    :data:`SIZE_LIMITS` bounds; an absent or null field is left to the caller."""
    for key, (low, high) in SIZE_LIMITS.items():
        if fields.get(key) is not None:
            check_size(key, fields[key], low, high)


def finite(v):
    """Whether ``v`` is a finite int or float (not a bool)."""
    return not isinstance(v, bool) and isinstance(v, (int, float)) and math.isfinite(v)


def checked_kinds(kinds, n_layers, family, allowed=("full_attention", "sliding_attention")):
    """``layer_types``, checked: a list of ``n_layers`` layer kinds, each one of
    ``allowed`` (``family`` names the family in the error)."""
    if not isinstance(kinds, list) or len(kinds) != n_layers:
        raise ValueError(f"layer_types: expected a list of {n_layers} layer kinds, got {kinds!r}")
    for i, kind in enumerate(kinds):
        if kind not in allowed:
            raise ValueError(
                f"layer_types[{i}]: expected {' or '.join(map(repr, allowed))} "
                f"({family}), got {kind!r}"
            )
    return kinds


def read_rope(d, family):
    """(rope_theta, rope_scaling) from either spelling of config dict ``d``; scaling is
    None for plain rope. ``family`` (a row of the families table) gives the class
    defaults where ``d`` has neither ``rope_parameters`` nor ``rope_scaling`` (GPT-OSS:
    YaRN) and no ``rope_theta`` at all (Mixtral, GPT-OSS)."""
    params = d.get("rope_parameters")
    if params is not None:  # transformers >= 5
        params = dict(params)
        theta = params.pop("rope_theta", None)
    else:
        params = dict(d.get("rope_scaling") or family.rope_scaling or {})
        theta = None
    if theta is None:
        theta = d.get("rope_theta")
    if theta is None:
        theta = family.rope_theta
    partial = params.pop("partial_rotary_factor", d.get("partial_rotary_factor", 1.0))
    if partial != 1.0:
        raise ValueError(
            f"partial_rotary_factor: expected 1.0 (rotary on whole heads), got {partial}"
        )
    legacy_type = params.pop("type", None)  # transformers < 4.45 spelled rope_type "type"
    rope_type = params.pop("rope_type", None) or legacy_type or "default"
    if rope_type not in ROPE_TYPES:
        raise ValueError(f"rope_type: expected one of {', '.join(ROPE_TYPES)}, got {rope_type!r}")
    unread = [k for k in params if k not in YARN_KEYS] if rope_type == "yarn" else []
    if unread:
        k = unread[0]
        known = ", ".join(YARN_KEYS)
        raise ValueError(f"{k}: expected only the YaRN parameters {known}, got {k}={params[k]!r}")
    if rope_type == "default" and not params:
        return float(theta), None
    return float(theta), {"rope_type": rope_type, **params}
