"""A test-side HF -> GGUF converter: what llama.cpp's ``convert_hf_to_gguf.py`` writes
for the families the engine reads from GGUF (its ``conversion/{llama,qwen,gemma,
gpt_oss}.py`` and ``TextModel.set_gguf_parameters``), with ``gguf.GGUFWriter`` and
gguf's own tensor-name map (``gguf.get_tensor_name_map``), for tiny models saved by the
tests (a directory with ``config.json`` and ``model.safetensors``).

Per family, as the converter does it: Llama's q/k rows (and biases) permuted for
llama.cpp's rope (and Llama 3's ``rope_freqs`` table generated); experts stacked into
``ffn_{gate,up,down}_exps``; Gemma's and Qwen3-Next's ``1 +`` baked into the RMS norm
weights; Qwen3-Next's ``in_proj_qkvz`` split into ``attn_qkv`` and ``attn_gate``,
``A_log`` stored as ``-exp(A_log)``, ``conv1d`` squeezed; GPT-OSS's fused experts split
and transposed. Norms, 1-D tensors, routers and convolutions are F32 (the converter's
rule); every other weight ``dtype`` ("F32", "F16", "BF16"), or the type ``types(name,
shape)`` names, written by ``quantize(w, qtype) -> GGUF bytes`` (default: gguf's own
quantizer, which has the legacy types; ``numkern.testing.quantize.quantize`` has them
all).

Where a config holds something the GGUF form cannot (a window llama.cpp's loader does
not read, a dense layer in a Qwen-MoE, Gemma's attention scale other than llama.cpp's,
...), the converter would write a file that runs differently; this writer raises a
ValueError naming the field instead, so that a test never compares two different models.
"""

import json
import os

import gguf
import numpy as np
import torch
from safetensors import safe_open

_ARCH = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "llama",
    "MixtralForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Qwen2MoeForCausalLM": "qwen2moe",
    "Qwen3MoeForCausalLM": "qwen3moe",
    "Gemma2ForCausalLM": "gemma2",
    "Gemma3ForCausalLM": "gemma3",
    "GptOssForCausalLM": "gpt-oss",
    "Qwen3NextForCausalLM": "qwen3next",
}
_MODEL_ARCH = {v: k for k, v in gguf.MODEL_ARCH_NAMES.items()}
FLOAT_TYPES = ("F32", "F16", "BF16")
# always F32 (convert_hf_to_gguf's prepare_tensors)
_F32_TENSORS = ("ffn_gate_inp.weight", "ffn_gate_inp_shexp.weight", "ssm_conv1d.weight")


def _refuse(cond, field, why):
    if cond:
        raise ValueError(f"{field}: {why} (the GGUF form cannot hold it)")


def _read(hf_dir):
    with open(os.path.join(hf_dir, "config.json")) as f:
        cfg = json.load(f)
    tensors = {}
    with safe_open(os.path.join(hf_dir, "model.safetensors"), "pt") as f:
        for name in f.keys():
            t = f.get_tensor(name)
            tensors[name] = t.float() if t.dtype != torch.float16 else t
    return cfg, tensors


def _permute(w, n_head):  # convert_hf_to_gguf LlamaModel.permute
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def _rope(cfg):
    """(full-attention rope params, sliding-attention rope params or None)."""
    p = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    if "full_attention" in p or "sliding_attention" in p:
        return dict(p.get("full_attention") or {}), p.get("sliding_attention")
    p.setdefault("rope_theta", cfg.get("rope_theta", 10000.0))
    return p, None


def _stack(tensors, layer, n_experts, names, prefix):
    """Each expert's ``{prefix}experts.{e}.{name}.weight`` of a layer, stacked [E, N, K]."""
    out = {}
    for name in names:
        key = f"model.layers.{layer}.{prefix}experts.{{}}.{name}.weight"
        out[name] = torch.stack([tensors.pop(key.format(e)) for e in range(n_experts)])
    return out


# -- per family: (config dict, tensors) -> [(gguf name or HF name to map, tensor)] ------------


def _llama(cfg, t):
    _refuse(cfg.get("sliding_window") is not None, "sliding_window", "llama.cpp's llama has none")
    heads, kv = (
        cfg["num_attention_heads"],
        cfg.get("num_key_value_heads") or cfg["num_attention_heads"],
    )
    out = []
    n_exp = cfg.get("num_local_experts") or 0
    for layer in range(cfg["num_hidden_layers"]):
        if n_exp:
            s = _stack(t, layer, n_exp, ("w1", "w2", "w3"), "block_sparse_moe.")
            for w, g in (("w1", "ffn_gate_exps"), ("w2", "ffn_down_exps"), ("w3", "ffn_up_exps")):
                out.append((f"blk.{layer}.{g}.weight", s[w]))
    for name, w in t.items():
        if name.endswith(("q_proj.weight", "q_proj.bias")):
            w = _permute(w, heads)
        elif name.endswith(("k_proj.weight", "k_proj.bias")):
            w = _permute(w, kv)
        out.append((name, w))
    full, _ = _rope(cfg)
    if full.get("rope_type") == "llama3":  # LlamaModel.generate_extra_tensors
        base, dim = full["rope_theta"], cfg.get("head_dim") or cfg["hidden_size"] // heads
        freqs = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
        factor, lo, hi = (
            full.get("factor", 8.0),
            full.get("low_freq_factor", 1.0),
            full.get("high_freq_factor", 4.0),
        )
        old = cfg.get("original_max_position_embeddings", 8192)  # the top level only, as there
        factors = []
        for f in freqs.tolist():
            wavelen = 2 * np.pi / f
            if wavelen < old / hi:
                factors.append(1.0)
            elif wavelen > old / lo:
                factors.append(factor)
            else:
                smooth = (old / wavelen - lo) / (hi - lo)
                factors.append(1 / ((1 - smooth) / factor + smooth))
        out.append(("rope_freqs.weight", torch.tensor(factors)))
    return out


def _qwen_dense(cfg, t):
    _refuse(
        cfg.get("use_sliding_window"),
        "use_sliding_window",
        "llama.cpp's qwen2/qwen3 read no window",
    )
    return list(t.items())


def _qwen_moe(cfg, t, *, norm):
    n_exp = cfg.get("num_experts") or cfg["num_local_experts"]
    arch = cfg["architectures"][0]
    _refuse((cfg.get("decoder_sparse_step") or 1) != 1 or cfg.get("mlp_only_layers"),
            "decoder_sparse_step", "llama.cpp's Qwen MoE runs experts on every layer")  # fmt: skip
    _refuse(bool(cfg.get("norm_topk_prob", False)) != norm, "norm_topk_prob",
            f"llama.cpp's {arch} graph renormalises the top-k weights: {norm}")  # fmt: skip
    out = []
    for layer in range(cfg["num_hidden_layers"]):
        s = _stack(t, layer, n_exp, ("down_proj", "gate_proj", "up_proj"), "mlp.")
        for name, w in s.items():
            out.append((f"model.layers.{layer}.mlp.experts.{name}.weight", w))
    return out + list(t.items())


def _gemma(cfg, t, *, big_layers):
    arch = cfg["architectures"][0]
    t.pop("lm_head.weight", None)
    hd = cfg.get("head_dim")
    want = (
        cfg["hidden_size"] // cfg["num_attention_heads"]
        if cfg["num_hidden_layers"] == big_layers
        else hd
    )
    _refuse(cfg.get("query_pre_attn_scalar", 256) != want, "query_pre_attn_scalar",
            f"llama.cpp's {arch} scales by {want} ** -0.5")  # fmt: skip
    n, pattern = cfg["num_hidden_layers"], 2 if arch == "Gemma2ForCausalLM" else 6
    kinds = [
        "sliding_attention" if i % pattern < pattern - 1 else "full_attention" for i in range(n)
    ]
    _refuse(cfg.get("layer_types", kinds) != kinds, "layer_types",
            f"llama.cpp's {arch} slides on every layer but each {pattern}-th")  # fmt: skip
    return [(name, w + 1 if name.endswith("norm.weight") else w) for name, w in t.items()]


def _gpt_oss(cfg, t):
    out = []
    for name, w in t.items():
        if "sinks" in name:
            out.append((name + ".weight", w))
        elif name.endswith("experts.gate_up_proj_bias"):
            b = name.removesuffix("gate_up_proj_bias")
            out += [(b + "gate_proj.bias", w[..., ::2]), (b + "up_proj.bias", w[..., 1::2])]
        elif name.endswith("experts.gate_up_proj"):
            w = w.transpose(-1, -2)
            out += [(name.replace("gate_up_proj", "gate_proj.weight"), w[:, ::2, :]),
                    (name.replace("gate_up_proj", "up_proj.weight"), w[:, 1::2, :])]  # fmt: skip
        elif name.endswith("experts.down_proj_bias"):
            out.append((name.replace("down_proj_bias", "down_proj.bias"), w))
        elif name.endswith("experts.down_proj"):
            out.append((name.replace("down_proj", "down_proj.weight"), w.transpose(-1, -2)))
        else:
            out.append((name, w))
    return out


def _qwen3next(cfg, t):
    n = cfg["num_hidden_layers"]
    every = cfg.get("full_attention_interval", 4)
    kinds = ["linear_attention" if (i + 1) % every else "full_attention" for i in range(n)]
    _refuse(cfg.get("layer_types", kinds) != kinds, "layer_types", "llama.cpp's interval rule")
    t = {k: v for k, v in t.items() if not k.startswith("mtp")}
    moe = _qwen_moe(cfg, t, norm=True)
    nk, nv = cfg["linear_num_key_heads"], cfg["linear_num_value_heads"]
    dk, dv, hidden = cfg["linear_key_head_dim"], cfg["linear_value_head_dim"], cfg["hidden_size"]
    out = []
    for name, w in moe:
        bid = name.split(".")[2] if name.startswith("model.layers.") else None
        if name.endswith(".A_log"):
            w = -torch.exp(w)
        elif name.endswith(".dt_bias"):
            name = name.removesuffix(".dt_bias") + ".dt_proj.bias"
        elif "conv1d" in name:
            w = w.squeeze()
        elif name.endswith("norm.weight") and not name.endswith("linear_attn.norm.weight"):
            w = w + 1
        if "in_proj_qkvz.weight" in name:
            split = [dk, dk, nv // nk * dv, nv // nk * dv]
            x = w.permute(1, 0).contiguous().view(-1, nk, sum(split))
            q, k, v, z = (p.contiguous().view(hidden, -1) for p in torch.split(x, split, dim=-1))
            out.append((f"blk.{bid}.attn_qkv.weight", torch.cat([q, k, v], -1).permute(1, 0)))
            out.append((f"blk.{bid}.attn_gate.weight", z.permute(1, 0)))
        else:
            out.append((name, w))
    return out


_FAMILY_TENSORS = {
    "llama": _llama,
    "qwen2": _qwen_dense,
    "qwen3": _qwen_dense,
    "qwen2moe": lambda c, t: _qwen_moe(c, t, norm=False),
    "qwen3moe": lambda c, t: _qwen_moe(c, t, norm=True),
    "gemma2": lambda c, t: _gemma(c, t, big_layers=46),
    "gemma3": lambda c, t: _gemma(c, t, big_layers=62),
    "gpt-oss": _gpt_oss,
    "qwen3next": _qwen3next,
}


# -- metadata ------------------------------------------------------------------------------


def _generic(w, cfg, arch):
    """TextModel.set_gguf_parameters."""
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    if cfg.get("intermediate_size") is not None:
        w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    if cfg.get("num_key_value_heads") is not None:
        w.add_head_count_kv(cfg["num_key_value_heads"])
    full, sliding = _rope(cfg)
    kind, factor = full.get("rope_type", full.get("type")), full.get("factor")
    if kind == "linear" and factor is not None:
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(factor)
    elif kind == "yarn" and factor is not None:
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(factor)
        w.add_rope_scaling_orig_ctx_len(full["original_max_position_embeddings"])
        if full.get("attention_factor") is not None:
            w.add_rope_scaling_yarn_attn_factor(full["attention_factor"])
        if full.get("beta_fast") is not None:
            w.add_rope_scaling_yarn_beta_fast(full["beta_fast"])
        if full.get("beta_slow") is not None:
            w.add_rope_scaling_yarn_beta_slow(full["beta_slow"])
    if full.get("rope_theta") is not None:
        w.add_rope_freq_base(full["rope_theta"])
    if sliding and sliding.get("rope_theta") is not None:
        w.add_rope_freq_base_swa(sliding["rope_theta"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    n_exp = cfg.get("num_local_experts", cfg.get("num_experts"))
    if n_exp is not None:
        w.add_expert_count(n_exp)
    if cfg.get("num_experts_per_tok") is not None:
        w.add_expert_used_count(cfg["num_experts_per_tok"])
    if cfg.get("head_dim") is not None:
        w.add_key_length(cfg["head_dim"])
        w.add_value_length(cfg["head_dim"])


def _metadata(w, cfg, arch):
    if arch == "gemma2":  # Gemma2Model.set_gguf_parameters: no generic keys
        _refuse(_rope(cfg)[0].get("rope_theta", 10000.0) != 10000.0, "rope_theta",
                "llama.cpp's gemma2 rotates at 10000")  # fmt: skip
        w.add_context_length(cfg["max_position_embeddings"])
        w.add_embedding_length(cfg["hidden_size"])
        w.add_block_count(cfg["num_hidden_layers"])
        w.add_feed_forward_length(cfg["intermediate_size"])
        w.add_head_count(cfg["num_attention_heads"])
        w.add_head_count_kv(cfg.get("num_key_value_heads", cfg["num_attention_heads"]))
        w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
        w.add_key_length(cfg["head_dim"])
        w.add_value_length(cfg["head_dim"])
        w.add_attn_logit_softcapping(cfg["attn_logit_softcapping"])
        w.add_final_logit_softcapping(cfg["final_logit_softcapping"])
        w.add_sliding_window(cfg["sliding_window"])
        return
    _generic(w, cfg, arch)
    if arch == "llama":
        w.add_vocab_size(cfg["vocab_size"])
        w.add_rope_dimension_count(
            cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
        )
    elif arch in ("qwen2moe", "qwen3moe", "qwen3next"):
        if cfg.get("moe_intermediate_size") is not None:
            w.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
        if cfg.get("shared_expert_intermediate_size") is not None:
            w.add_expert_shared_feed_forward_length(cfg["shared_expert_intermediate_size"])
    if arch == "gemma3":
        full, sliding = _rope(cfg)
        _refuse(sliding and sliding.get("rope_type", "default") != "default", "rope_parameters",
                "llama.cpp's gemma3 does not scale its sliding layers' rope")  # fmt: skip
        w.add_rope_freq_base(full.get("rope_theta", 1_000_000.0))
        if cfg.get("final_logit_softcapping"):
            w.add_final_logit_softcapping(cfg["final_logit_softcapping"])
        w.add_sliding_window(cfg["sliding_window"])
    elif arch == "gpt-oss":
        w.add_sliding_window(cfg["sliding_window"])
        w.add_expert_feed_forward_length(cfg["intermediate_size"])
    elif arch == "qwen3next":
        w.add_ssm_conv_kernel(cfg["linear_conv_kernel_dim"])
        w.add_ssm_state_size(cfg["linear_key_head_dim"])
        w.add_ssm_group_count(cfg["linear_num_key_heads"])
        w.add_ssm_time_step_rank(cfg["linear_num_value_heads"])
        w.add_ssm_inner_size(cfg["linear_value_head_dim"] * cfg["linear_num_value_heads"])
        w.add_full_attention_interval(cfg.get("full_attention_interval", 4))
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
        partial = (cfg.get("rope_parameters") or {}).get(
            "partial_rotary_factor", cfg.get("partial_rotary_factor", 0.25)
        )
        w.add_rope_dimension_count(int(head_dim * partial))


BYTE_MERGES = ("h e", "l l")


def byte_vocab(n):
    """(tokens, merges) of a byte-level BPE of ``n`` >= 2 tokens: the ByteLevel byte
    symbols (the last two dropped when ``n`` is 256 or less), the merges "he" and "ll"
    (llama.cpp needs merges), then ``[PAD{i}]`` as the converter pads."""
    from tokenizers import pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())[: min(254, n - 2)]
    tokens = alphabet + [m.replace(" ", "") for m in BYTE_MERGES]
    return tokens + [f"[PAD{i}]" for i in range(len(tokens), n)], list(BYTE_MERGES)


def _tokenizer(w, cfg, tokens, merges, special, add_bos, add_eos, pre, scores):
    """A byte-level BPE ("gpt2": ``merges``), or with ``scores`` a SentencePiece one
    ("llama": ``<0xXX>`` tokens typed BYTE), as SpecialVocab and the converter's vocab
    writers write them."""
    spm = scores is not None
    w.add_tokenizer_model("llama" if spm else "gpt2")
    if not spm:
        w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    if spm:
        w.add_token_scores(list(scores))
    types = []
    for t in tokens:
        if t in special:
            types.append(gguf.TokenType.CONTROL)
        elif t.startswith("[PAD"):
            types.append(gguf.TokenType.UNUSED)
        elif spm and len(t) == 6 and t.startswith("<0x") and t.endswith(">"):
            types.append(gguf.TokenType.BYTE)
        else:
            types.append(gguf.TokenType.NORMAL)
    w.add_token_types(types)
    if not spm:
        w.add_token_merges(merges)
    for key, add in (("bos_token_id", w.add_bos_token_id), ("eos_token_id", w.add_eos_token_id)):
        v = cfg.get(key)
        v = v[0] if isinstance(v, list) else v
        if v is not None and 0 <= v < len(tokens):
            add(v)
    if add_bos is not None:
        w.add_add_bos_token(add_bos)
    if add_eos is not None:
        w.add_add_eos_token(add_eos)


def convert(hf_dir, path, *, dtype="F32", types=None, quantize=None, tokens=None, merges=(),
            special=(), add_bos=None, add_eos=None, pre="default", scores=None,
            add_space_prefix=None, chat_template=None):  # fmt: skip
    """Write the HF model in ``hf_dir`` to the GGUF file ``path`` as convert_hf_to_gguf.py
    does (module docstring). ``types(gguf_name, shape)``: the GGML type name of a weight
    the converter does not keep in F32 (None: ``dtype``); ``quantize(w, qtype)`` writes
    the quantized ones (w: float32 ``[rows, K]``; the GGUF bytes ``[rows, bytes]``).
    ``tokens``: the vocabulary (default :func:`byte_vocab` of the model's vocab_size),
    ``merges``, ``special`` (tokens marked CONTROL), ``add_bos``/``add_eos`` (None: the
    key left out), ``pre`` (tokenizer.ggml.pre); with ``scores`` a SentencePiece
    vocabulary instead (``add_space_prefix``: None, the key left out). Returns {GGUF
    name: type name} of the tensors written."""
    cfg, tensors = _read(hf_dir)
    if "text_config" in cfg:
        raise ValueError("text_config: save the text model alone")
    arch = _ARCH.get((cfg.get("architectures") or [None])[0])
    if arch is None:
        raise ValueError(f"architectures: no GGUF converter here for {cfg.get('architectures')}")
    quantize = quantize or (lambda w, q: gguf.quants.quantize(w, gguf.GGMLQuantizationType[q]))
    named = _FAMILY_TENSORS[arch](cfg, dict(tensors))
    tmap = gguf.get_tensor_name_map(_MODEL_ARCH[arch], cfg["num_hidden_layers"])
    w = gguf.GGUFWriter(os.fspath(path), arch)
    _metadata(w, cfg, arch)
    if tokens is None:
        tokens, merges = byte_vocab(cfg["vocab_size"])
    _tokenizer(w, cfg, list(tokens), list(merges), set(special),
               add_bos, add_eos, pre, scores)  # fmt: skip
    if add_space_prefix is not None:
        w.add_add_space_prefix(add_space_prefix)
    if chat_template is not None:
        w.add_chat_template(chat_template)
    written = {}
    for name, t in named:
        new = (
            name
            if name.startswith(("blk.", "rope_freqs"))
            else tmap.get_name(name, try_suffixes=(".weight", ".bias"))
        )
        if new is None:
            raise ValueError(f"{name}: gguf maps no {arch} tensor to it")
        a = t.float().numpy() if t.dtype != torch.float16 else t.numpy()
        qtype = dtype
        forced = a.ndim <= 1 or new.endswith(("_norm.weight", *_F32_TENSORS))
        if forced or not new.endswith(".weight"):
            qtype = "F32"
        elif types is not None:
            qtype = types(new, a.shape) or dtype
        if qtype == "F32":
            w.add_tensor(new, np.ascontiguousarray(a, dtype=np.float32))
        elif qtype == "F16":
            w.add_tensor(new, np.ascontiguousarray(a, dtype=np.float16))
        elif qtype == "BF16":
            bf16 = gguf.GGMLQuantizationType.BF16
            w.add_tensor(new, gguf.quants.quantize(np.float32(a), bf16), raw_dtype=bf16)
        else:
            rows = np.ascontiguousarray(a.reshape(-1, a.shape[-1]), dtype=np.float32)
            data = np.asarray(quantize(rows, qtype), dtype=np.uint8)
            data = data.reshape(*a.shape[:-1], -1)
            w.add_tensor(new, data, raw_dtype=gguf.GGMLQuantizationType[qtype])
        written[new] = qtype
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return written
