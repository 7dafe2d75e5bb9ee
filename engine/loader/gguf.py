"""Reading a ``.gguf`` file (llama.cpp) with :mod:`engine.gguf_file` (metadata in one
pass, a memory map of the tensors): the config from the metadata and every tensor under
its HF name, as the architecture's row of :data:`engine.loader.gguf_arch.GGUF_ARCHS`
says (llama, qwen2, qwen3, qwen2moe, qwen3moe, gemma2, gemma3, gpt-oss, qwen3next), each
dequantized when the model takes it (:class:`LazyTensors`) or read as its stored bytes
(:meth:`LazyTensors.raw`, :class:`RawTensor`). The tokenizer, where the file describes a
byte-level BPE, from the embedded vocabulary and merges (``tokenizers``, imported where
it is used), BOS and EOS added as llama.cpp adds them; the chat template from
``tokenizer.chat_template``. ``gguf`` is imported only for a tensor type
:mod:`engine.gguf_file` does not dequantize itself (K-quants, IQ*)."""

import os
import warnings
from collections.abc import MutableMapping
from typing import NamedTuple

import numpy as np
import torch

from ..gguf_file import type_name
from .checkpoint import Checkpoint, progress_bar
from .gguf_arch import gguf_config, gguf_recipes

# the tokenizer keys read (gguf's Keys, spelled out: importing gguf for its constants is
# ~40 ms of an engine's start)
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
_K_ADD_EOS = "tokenizer.ggml.add_eos_token"
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


class RawTensor(NamedTuple):
    """An HF tensor's stored GGUF bytes: ``data`` uint8 ``[*shape[:-1], bytes per row]``
    in HF row order (a view of the file's map, or a gathered copy where rows were
    reordered or joined), each row ``shape[-1]`` values of GGML type ``ggml_type``
    (``type_name``: "Q4_K", "F16", ...)."""

    ggml_type: int
    type_name: str
    shape: tuple
    data: torch.Tensor


class LazyTensors(MutableMapping):
    """HF name -> tensor, each made by its loader when first read: a GGUF checkpoint's
    tensors are dequantized as the model takes them, so the float copies of the whole
    model never live at once (the model packs each and lets it go). A loader's errors
    are the loader's (a ValueError naming the file and tensor)."""

    def __init__(self, loaders, bar=None, raws=None):
        self._loaders = dict(loaders)
        self._raws = dict(raws or {})  # name -> () -> RawTensor or None
        self._made = {}
        self._bar = bar  # ticks once per tensor made; closed with the last

    def raw(self, name):
        """The stored bytes of ``name`` (a :class:`RawTensor`), or None where its values
        are not the stored rows (a Gemma norm's 1 + w, a transposed GPT-OSS expert, a
        tensor set by hand) or its parts' types differ. The tensor stays in the map."""
        if name not in self._loaders:
            raise KeyError(name)
        make = self._raws.get(name)
        return None if make is None or name in self._made else make()

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
        self._raws.pop(name, None)
        self._made[name] = t

    def __delitem__(self, name):
        del self._loaders[name]
        self._raws.pop(name, None)
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
    embed = f.tensors.get("token_embd.weight")
    embed_rows = int(embed.shape[0]) if embed is not None and len(embed.shape) == 2 else None
    config, row = gguf_config(meta, f.tensors, embed_rows)
    try:
        recipes = gguf_recipes(row, config, f)
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from None

    def loader(name, r):
        def load():
            try:
                return _make(f, r, dtype)
            except (ValueError, NotImplementedError) as e:  # a size or type the header garbled
                raise ValueError(f"{path}: tensor {name!r} ({', '.join(r.parts)}): {e}") from None

        return load

    loaders = {name: loader(name, r) for name, r in recipes.items()}
    raws = {name: (lambda r=r: _raw(f, r)) for name, r in recipes.items() if r.post is None}
    desc = f"dequantizing {os.path.basename(path)}"
    bar = progress_bar(None, len(loaders), desc, progress)
    tensors = LazyTensors(loaders, bar=None if bar.disable else bar, raws=raws)
    tokenizer = _gguf_tokenizer(meta, path)
    return Checkpoint(
        config, tensors, tokenizer, path, meta.get(_K_CHAT), _gguf_special_tokens(meta)
    )


def _make(f, r, dtype):
    """The HF tensor of recipe ``r`` (engine.loader.gguf_arch.Recipe) in ``dtype`` (None:
    fp32, the dequantized values as stored)."""
    out_dtype = dtype or torch.float32
    # one part: its rows gathered before dequantizing (an expert's rows of a stacked
    # [E, N, K]); several: dequantized whole, joined, then ordered
    direct = r.post is None and len(r.parts) == 1
    work = out_dtype if direct else torch.float32
    if len(r.parts) == 1:
        t = f.tensor(r.parts[0], work, row_order=r.order)
    else:
        t = torch.cat([f.tensor(p, work).reshape(f.rows(p), -1) for p in r.parts])
        if r.order is not None:
            t = t[r.order]
    t = t.reshape(r.shape)
    if r.post is not None:
        t = r.post(t)
    return t.to(out_dtype)


def _raw(f, r):
    """The stored bytes of recipe ``r`` as a :class:`RawTensor`, or None when its parts'
    types differ."""
    types = {f.tensors[p].ggml_type for p in r.parts}
    if len(types) != 1:
        return None
    if len(r.parts) == 1:
        data = f.raw_rows(r.parts[0], r.order)
    else:
        data = torch.cat([f.raw_rows(p) for p in r.parts])
        if r.order is not None:
            data = data[r.order]
    (ggml_type,) = types
    rows = data.view(*r.shape[:-1], -1) if len(r.shape) > 1 else data.view(-1)
    return RawTensor(ggml_type, type_name(ggml_type), tuple(r.shape), rows)


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
    # llama.cpp (llama-vocab.cpp): a BPE vocabulary adds BOS by default only with the
    # Llama 3 pre-tokenizers, EOS never; tokenizer.ggml.add_bos_token / add_eos_token
    # override either
    add_bos = meta.get(_K_ADD_BOS)
    if add_bos is None:
        add_bos = pre in _PRE_LLAMA3
    add_eos = bool(meta.get(_K_ADD_EOS, False))
    ends = []  # (name, token, id) of each token added
    for name, key, add in (("bos", _K_BOS, add_bos), ("eos", _K_EOS, add_eos)):
        i = meta.get(key)
        if add and i is not None and 0 <= i < len(tokens):
            ends.append((name, tokens[i], i))
    if ends:
        pre_t = [t for n, t, _ in ends if n == "bos"]
        post_t = [t for n, t, _ in ends if n == "eos"]
        single = " ".join([*pre_t, "$A", *post_t])
        pair = " ".join([*pre_t, "$A", *post_t, *pre_t, "$B:1", *post_t])
        tok.post_processor = processors.TemplateProcessing(
            single=single, pair=pair, special_tokens=sorted({(t, i) for _, t, i in ends})
        )
    return tok
