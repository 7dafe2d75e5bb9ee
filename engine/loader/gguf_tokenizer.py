"""The tokenizer of a GGUF file, built with ``tokenizers`` (imported where it is used)
from the embedded vocabulary as llama.cpp tokenizes with it (llama-vocab.cpp):

- ``tokenizer.ggml.model = "gpt2"``: a byte-level BPE with its merges, split as the
  ``tokenizer.ggml.pre`` names (those reproduced exactly: GPT-2's, the digit-splitting
  StarCoder family's, Llama 3's);
- ``"llama"``: SentencePiece's BPE, llama.cpp's SPM tokenizer: the adjacent pair whose
  joined text is the highest-scoring token merges first (here: a BPE whose merges are
  every split of every token, ranked by the token's score), characters outside the
  vocabulary fall back to their ``<0xXX>`` byte tokens, spaces are ``▁`` and, with
  ``tokenizer.ggml.add_space_prefix`` (default true), the text starts with one.

Control and user-defined tokens are matched whole in the text; BOS and EOS are added as
llama.cpp adds them (``tokenizer.ggml.add_bos_token`` / ``add_eos_token``, else its
default: BOS for SPM and the Llama 3 pre-tokenizers, EOS never). Another vocabulary
gives no tokenizer (a warning: pass token ids)."""

import warnings

import numpy as np

# the tokenizer keys read (gguf's Keys, spelled out: importing gguf for its constants is
# ~40 ms of an engine's start)
_K_TOKENS = "tokenizer.ggml.tokens"
_K_TOKEN_TYPE = "tokenizer.ggml.token_type"
_K_MERGES = "tokenizer.ggml.merges"
_K_SCORES = "tokenizer.ggml.scores"
_K_ADD_SPACE_PREFIX = "tokenizer.ggml.add_space_prefix"
_K_TOKENIZER = "tokenizer.ggml.model"
_K_PRE = "tokenizer.ggml.pre"
_K_BOS = "tokenizer.ggml.bos_token_id"
_K_EOS = "tokenizer.ggml.eos_token_id"
_K_UNK = "tokenizer.ggml.unknown_token_id"
_K_PAD = "tokenizer.ggml.padding_token_id"
_K_ADD_BOS = "tokenizer.ggml.add_bos_token"
_K_ADD_EOS = "tokenizer.ggml.add_eos_token"
# llama.cpp's token types (gguf.TokenType)
_TOKEN_CONTROL, _TOKEN_USER_DEFINED, _TOKEN_BYTE = 3, 4, 6

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


def special_tokens(meta):
    """The special tokens transformers reads from a GGUF file (the four it maps)."""
    tokens = meta.get(_K_TOKENS) or []
    ids = {"bos_token": _K_BOS, "eos_token": _K_EOS, "unk_token": _K_UNK, "pad_token": _K_PAD}
    return {
        name: tokens[meta[key]]
        for name, key in ids.items()
        if meta.get(key) is not None and 0 <= meta[key] < len(tokens)
    }


def gguf_tokenizer(meta, path):
    """The ``tokenizers.Tokenizer`` of the GGUF vocabulary (module docstring), or None."""
    from tokenizers import AddedToken, processors

    kind, pre = meta.get(_K_TOKENIZER), meta.get(_K_PRE, "default")
    tokens = meta.get(_K_TOKENS)

    def give_up(why):
        warnings.warn(f"{path}: no tokenizer built ({why}); pass token ids", stacklevel=5)
        return None

    if tokens is None:
        return give_up("no tokenizer.ggml.tokens")
    vocab = {tok: i for i, tok in enumerate(tokens)}
    if len(vocab) != len(tokens):
        return give_up("the vocabulary repeats tokens")
    types = meta.get(_K_TOKEN_TYPE)
    types = np.ones(len(tokens), np.int32) if types is None else np.asarray(types)[: len(tokens)]
    if kind == "gpt2":
        if meta.get(_K_MERGES) is None:
            return give_up("a byte-level BPE without tokenizer.ggml.merges")
        if pre not in _PRE_GPT2 + _PRE_DIGITS_GPT2 + _PRE_LLAMA3:
            return give_up(f"pre-tokenizer {pre!r} is not one this loader reproduces")
        tok = _byte_level_bpe(vocab, meta.get(_K_MERGES), pre)
        default_bos = pre in _PRE_LLAMA3
    elif kind == "llama":
        if meta.get(_K_SCORES) is None:
            return give_up("a SentencePiece vocabulary without tokenizer.ggml.scores")
        tok = _sentencepiece_bpe(meta, tokens, vocab, types)
        default_bos = True
    else:
        return give_up(f"tokenizer.ggml.model {kind!r} is not 'gpt2' or 'llama'")
    # control tokens (<|im_start|>) and user-defined ones (<think>) are matched whole in
    # the text, as llama.cpp does; only control tokens are dropped by decode
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
    # llama.cpp (llama-vocab.cpp): SPM adds BOS by default, a BPE vocabulary only with the
    # Llama 3 pre-tokenizers; EOS never; tokenizer.ggml.add_bos_token / add_eos_token
    # override either
    add_bos = meta.get(_K_ADD_BOS)
    add_bos = default_bos if add_bos is None else add_bos
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


def _byte_level_bpe(vocab, merges, pre):
    """GPT-2's byte-level BPE, split as the pre-tokenizer ``pre`` splits."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

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
    return tok


def _sentencepiece_bpe(meta, tokens, vocab, types):
    """llama.cpp's SPM tokenizer as a ``tokenizers`` BPE: merges are every split (a, b)
    of every token into two tokens, ranked by the joined token's score, highest first
    (llama.cpp merges the adjacent pair whose joined text scores highest); byte
    fallback to ``<0xXX>``; spaces as ``▁``, one prepended with add_space_prefix."""
    from tokenizers import Tokenizer, decoders, models, normalizers

    scores = np.asarray(meta[_K_SCORES], np.float64)
    merges = []
    for i in np.argsort(-scores[: len(tokens)], kind="stable"):
        t = tokens[i]
        if types[i] in (_TOKEN_CONTROL, _TOKEN_BYTE) or len(t) < 2:
            continue
        merges += [(t[:j], t[j:]) for j in range(1, len(t)) if t[:j] in vocab and t[j:] in vocab]
    unk = meta.get(_K_UNK)
    unk = tokens[unk] if unk is not None and 0 <= unk < len(tokens) else None
    bpe = models.BPE(vocab=vocab, merges=merges, unk_token=unk, byte_fallback=True, fuse_unk=True)
    tok = Tokenizer(bpe)
    prefix = bool(meta.get(_K_ADD_SPACE_PREFIX, True))
    steps = [normalizers.Prepend("\u2581")] if prefix else []
    tok.normalizer = normalizers.Sequence([*steps, normalizers.Replace(" ", "\u2581")])
    dec = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    if prefix:
        dec.append(decoders.Strip(" ", 1, 0))
    tok.decoder = decoders.Sequence(dec)
    return tok
