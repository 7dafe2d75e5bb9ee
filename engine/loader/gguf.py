"""Reading a ``.gguf`` file (llama.cpp) with :mod:`engine.gguf_file` (metadata in one
pass, a memory map of the tensors): every tensor is renamed to its HF name and
dequantized when the model takes it (:class:`LazyTensors`), Llama's q/k rows put back in
HF order (llama.cpp's converter permutes them for its rope layout). The config comes
from the metadata and the tokenizer, where the file describes a byte-level BPE, from
the embedded vocabulary and merges (``tokenizers``, imported where it is used); the chat
template from ``tokenizer.chat_template``. ``gguf`` is imported only for a tensor type
:mod:`engine.gguf_file` does not dequantize itself (K-quants, IQ*)."""

import os
import warnings
from collections.abc import MutableMapping

import numpy as np
import torch

from .checkpoint import Checkpoint, progress_bar
from .config import ModelConfig
from .families import GGUF_ARCHITECTURES
from .fields import SIZE_LIMITS, check_size, finite

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
    family = GGUF_ARCHITECTURES.get(arch) if isinstance(arch, str) else None
    if family is None:
        known = " or ".join(map(repr, GGUF_ARCHITECTURES))
        raise ValueError(f"general.architecture: expected {known} (GGUF), got {arch!r}")
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
            check_size(name, meta[name], *SIZE_LIMITS[field_name])
        elif k in required:
            raise ValueError(f"{name}: expected in the GGUF metadata, missing")

    def key(k, default=None):
        return meta.get(k.format(arch=arch), default)

    def decimal(k, default=None):
        # GGUF stores float32: 1e-5 comes back as 9.999999747e-06; the shortest decimal
        # that rounds to the same float32 is the value the HF config had
        v = key(k, default)
        if not finite(v):
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
        "architectures": [family.name],
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


def load_gguf(path, dtype, progress):
    """A :class:`Checkpoint` of the GGUF file ``path``, its tensors dequantized as the
    model takes them (``dtype``: as :func:`engine.loader.load_checkpoint`'s)."""
    from ..gguf_file import GGUFFile

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
    bar = progress_bar(None, len(loaders), desc, progress)
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
