"""``engine.detokenize.Detokenizer`` against whole decoding (issue 42).

Each tokenizer kind the engine loads, built here in-process and offline: an HF
``tokenizer.json`` byte-level BPE (GPT-2 / Llama 3 / Qwen style: ``ByteLevel`` decoder), an
HF SentencePiece one as Llama 2's (``Replace``, ``ByteFallback``, ``Fuse``, ``Strip``) and
one with a ``Metaspace`` decoder, and the GGUF ``gpt2`` and ``llama`` vocabularies as
``engine.loader.gguf_tokenizer`` builds them (``add_space_prefix`` on and off). The
vocabularies hold CJK, accented letters and emoji whose UTF-8 bytes split across tokens
(byte-level pieces; ``<0xXX>`` byte-fallback tokens), special and user-defined tokens.

The property: for random token sequences (any ids, drawn towards byte tokens, split
characters and special tokens) and stop strings (cut from the sequence's own text, so
that they span token boundaries, or random), fed one token a step as the engine does,
the detokenizer's decoded text equals ``tokenizer.decode`` of the tokens so far at every
step, the visible text only grows and is a prefix of the final text, and the stop string,
the step it ends and the final text are those of the old whole-decode code
(``_old_engine`` below: ``LLM._finish_check`` and ``LLM._text`` as they were).
"""

import json
import os
import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

from engine.__main__ import default_model
from engine.detokenize import Detokenizer
from engine.loader.gguf_file import GGUFFile
from engine.loader.gguf_tokenizer import gguf_tokenizer

# cases per tokenizer kind (derandomized: the same ones every run); a longer run draws
# more, e.g. NUMKERN_DETOK_EXAMPLES=5000 pytest tests/test_detokenize.py
EXAMPLES = int(os.environ.get("NUMKERN_DETOK_EXAMPLES", "60"))
CORPUS = [
    "The quick brown fox jumps over the lazy dog. Hello world, hello there!",
    "café naïve déjà vu — 100€ or £5, ½ off.",
    "日本語のテキストと中文的文本\uff0c还有한국어 텍스트。",
    "emoji: 😀 🎉 👍🏽 🇫🇷 ❤️ and more 😀😀",
    "def f(x):\n    return x * 2  # tabs\tand\nnewlines",
]
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
USER = "<think>"  # an added token that decode keeps (not special)
# SentencePiece pieces: words with their space, CJK and accented characters whole; every
# other character (emoji) falls back to bytes
SPM_PIECES = [
    "▁", "▁the", "▁The", "▁quick", "▁hello", "▁world", "▁Hello", "▁", "e", "o", "l", "h",
    "t", "a", "r", "d", ",", ".", "!", "▁a", "▁of", "é", "ï", "€", "日", "本", "語", "中",
    "文", "▁日本", "。", "\uff0c", "▁▁", "\n", "ab", "▁x",
]  # fmt: skip


def _byte_level_hf():
    """A GPT-2-style byte-level BPE trained on CORPUS, with special and user tokens."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=420,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=SPECIAL,
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS * 3, trainer)
    tok.add_tokens([AddedToken(USER, special=False, normalized=False)])
    return tok


def _spm_vocab():
    tokens = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256))]
    tokens += [p for p in dict.fromkeys(SPM_PIECES) if p not in tokens]
    return tokens


def _spm_hf(decoder):
    """A Llama-2-style SentencePiece BPE with byte fallback and ``decoder``."""
    vocab = {t: i for i, t in enumerate(_spm_vocab())}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True))
    tok.decoder = decoder
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in ("<s>", "</s>")])
    tok.add_tokens([AddedToken(USER, special=False, normalized=False)])
    return tok


def _gguf_gpt2(pre):
    """The byte-level BPE above as a GGUF ``gpt2`` vocabulary (control and user tokens
    typed as llama.cpp types them)."""
    hf = json.loads(_byte_level_hf().to_str())
    vocab = hf["model"]["vocab"]
    tokens = [*sorted(vocab, key=vocab.get), USER]
    merges = [m if isinstance(m, str) else " ".join(m) for m in hf["model"]["merges"]]
    types = [3 if t in SPECIAL else 4 if t == USER else 1 for t in tokens]
    meta = {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": pre,
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.merges": merges,
        "tokenizer.ggml.bos_token_id": 0,
        "tokenizer.ggml.eos_token_id": 0,
    }
    return gguf_tokenizer(meta, "test.gguf")


def _gguf_llama(add_space_prefix):
    """A GGUF ``llama`` (SentencePiece) vocabulary: byte tokens typed 6, <s> and </s>
    control, <think> user-defined."""
    tokens = [*_spm_vocab(), USER]
    types = [3 if t in ("<s>", "</s>") else 6 if t.startswith("<0x") else 1 for t in tokens]
    types[0], types[-1] = 2, 4
    meta = {
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.scores": [-float(len(t)) for t in tokens],
        "tokenizer.ggml.add_space_prefix": add_space_prefix,
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
        "tokenizer.ggml.unknown_token_id": 0,
    }
    return gguf_tokenizer(meta, "test.gguf")


def _word_level():
    """Words and no decoder (decode joins tokens with spaces), as the engine tests'
    ``hf_models.add_words`` tokenizer."""
    words = ["<unk>", "<s>", "</s>", "hello", "world", "the", "日本", "é", "😀", "a", "b", ","]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens(["<s>", "</s>"])
    tok.add_tokens([AddedToken(USER, special=False, normalized=False)])
    return tok


_LLAMA2_DECODER = decoders.Sequence(
    [
        decoders.Replace("▁", " "),
        decoders.ByteFallback(),
        decoders.Fuse(),
        decoders.Strip(" ", 1, 0),
    ]
)
KINDS = {
    "hf-byte-level": _byte_level_hf,
    "hf-spm-llama2": lambda: _spm_hf(_LLAMA2_DECODER),
    "hf-spm-metaspace": lambda: _spm_hf(decoders.Metaspace()),
    "gguf-gpt2": lambda: _gguf_gpt2("default"),
    "gguf-gpt2-llama3": lambda: _gguf_gpt2("llama-bpe"),
    "gguf-llama": lambda: _gguf_llama(True),
    "gguf-llama-no-prefix": lambda: _gguf_llama(False),
    "hf-word-level": _word_level,
}
_BUILT = {}


def tokenizer(kind):
    if kind not in _BUILT:
        _BUILT[kind] = KINDS[kind]()
    return _BUILT[kind]


def _pools(tok):
    """Ids to draw from: all, byte tokens (byte-level single bytes of multi-byte
    characters, or <0xXX>), pieces of non-ASCII text, special and user tokens."""
    n = tok.get_vocab_size()
    vocab = tok.get_vocab()
    added = tok.get_added_tokens_decoder()
    marked = sorted(added)
    bytes_ = sorted(
        i for t, i in vocab.items() if t.startswith("<0x") or (len(t) == 1 and ord(t) > 160)
    )
    wide = sorted(i for t, i in vocab.items() if any(ord(c) > 127 for c in tok.decode([i])))
    plain = sorted(
        i for t, i in vocab.items() if tok.decode([i]).strip().isalpha() and i not in added
    )
    return n, marked, bytes_ or wide, wide or bytes_, plain


def _old_engine(tok, ids, stop, min_tokens, skip):
    """What ``LLM._finish_check`` and ``LLM._text`` did, whole-decoding each step:
    ``(steps fed, stop string or None, final text)``."""

    def decode(x):
        return tok.decode(x, skip_special_tokens=skip)

    stop_from = 0
    for k in range(1, len(ids) + 1):
        out = ids[:k]
        if k <= min_tokens:
            if k == min_tokens and stop:
                stop_from = len(decode(out))
            continue
        if stop:
            text = decode(out)
            found = [
                (text.find(s, stop_from) + len(s), i)
                for i, s in enumerate(stop)
                if s in text[stop_from:]
            ]
            if found:
                s = stop[min(found)[1]]
                return k, s, text[: text.find(s, stop_from)]
    return len(ids), None, decode(ids)


def run(tok, ids, stop=(), min_tokens=0, skip=True):
    """Feed ``ids`` one a step, checking the invariants; returns ``(steps fed, stop,
    final text, [visible text after each step])``."""
    d = Detokenizer(tok, skip_special_tokens=skip, stop=stop, min_tokens=min_tokens)
    seen, shown = [], ""
    k = 0
    for k, t in enumerate(ids, 1):
        delta, hit = d.add([t])
        assert d.text == shown + delta
        shown = d.text
        seen.append(shown)
        if hit is not None:
            break
        assert d.decoded == tok.decode(ids[:k], skip_special_tokens=skip), (ids[:k], k)
    d.finish()
    assert d.text.startswith(shown) and d.resyncs == 0
    if d.stop is None:
        assert d.text == tok.decode(ids[:k], skip_special_tokens=skip)
    return k, d.stop, d.text, seen


def _gpt2_byte_chars():
    """GPT-2's byte -> character map (ByteLevel's alphabet)."""
    keep = [*range(33, 127), *range(161, 173), *range(174, 256)]
    extra = [b for b in range(256) if b not in keep]
    return {b: chr(b if b in keep else 256 + extra.index(b)) for b in range(256)}


def _byte_ids(tok):
    """The id of each byte's own token: ``<0xXX>``, or the byte-level character."""
    if tok.token_to_id("<0x41>") is not None:
        return [tok.token_to_id(f"<0x{b:02X}>") for b in range(256)]
    return [tok.token_to_id(c) for c in _gpt2_byte_chars().values()]


# characters whose UTF-8 bytes the cases split across tokens
WIDE = st.one_of(st.sampled_from("é€日本😀👍🏽🇫🇷한"), st.characters(min_codepoint=0x80))


@st.composite
def cases(draw, kind):
    tok = tokenizer(kind)
    n, marked, bytes_, wide, plain = _pools(tok)
    byte_ids = _byte_ids(tok)
    ways = [
        st.integers(0, n - 1).map(lambda i: [i]),
        st.sampled_from(bytes_).map(lambda i: [i]),
        st.sampled_from(wide).map(lambda i: [i]),
        st.sampled_from(plain).map(lambda i: [i]),
        st.sampled_from(marked).map(lambda i: [i]),
        WIDE.map(lambda c: tok.encode(c, add_special_tokens=False).ids),
    ]
    if None not in byte_ids:  # a vocabulary with a token per byte
        ways.append(WIDE.map(lambda c: [byte_ids[b] for b in c.encode()]))
    one = st.one_of(ways)
    ids = [i for chunk in draw(st.lists(one, max_size=24)) for i in chunk]
    text = tok.decode(ids)
    stop = []
    for _ in range(draw(st.integers(0, 3))):
        if text and draw(st.integers(0, 3)):
            a = draw(st.integers(0, len(text) - 1))
            stop.append(text[a : a + draw(st.integers(1, 5))])
        else:
            stop.append(draw(st.text("ab é日😀\n", min_size=1, max_size=3)))
    return ids, tuple(stop), draw(st.integers(0, 4)), draw(st.booleans())


@pytest.mark.parametrize("kind", list(KINDS))
def test_matches_whole_decoding(kind):
    """The property (module docstring), on every tokenizer kind."""
    tok = tokenizer(kind)

    @settings(
        max_examples=EXAMPLES,
        derandomize=True,
        deadline=None,
        database=None,
        suppress_health_check=[HealthCheck.too_slow],
    )
    @given(cases(kind))
    def check(case):
        ids, stop, min_tokens, skip = case
        k, hit, text, seen = run(tok, ids, stop, min_tokens, skip)
        assert (k, hit, text) == _old_engine(tok, ids, stop, min_tokens, skip)
        assert all(s == text[: len(s)] for s in seen)

    check()


@pytest.mark.parametrize("kind", list(KINDS))
def test_real_text_round_trips(kind):
    """Encoded text (the sequences a model writes) streams back exactly, stop strings
    that span tokens cut where the old code cut."""
    tok = tokenizer(kind)
    for text in CORPUS:
        ids = tok.encode(text, add_special_tokens=False).ids
        full = tok.decode(ids)
        assert run(tok, ids)[2] == full
        for a in range(0, len(full) - 3, 7):
            stop = (full[a : a + 3], "never")
            assert run(tok, ids, stop)[:3] == _old_engine(tok, ids, stop, 0, True)


def test_smollm2_vocabulary():
    """The real 49,152-token byte-level vocabulary of the CLI's default model (GGUF
    ``gpt2``, SmolLM2's pre-tokenizer): encoded text and random ids, with stop strings."""
    path = default_model()
    tok = gguf_tokenizer(GGUFFile(path).meta, path)
    rng = random.Random(42)
    byte_ids = [tok.token_to_id(c) for c in _gpt2_byte_chars().values()]
    for text in CORPUS:
        ids = tok.encode(text, add_special_tokens=False).ids
        full = tok.decode(ids)
        for a in range(0, len(full) - 4, 5):
            stop = (full[a : a + rng.randint(1, 6)], full[a + 2 : a + 4])
            assert run(tok, ids, stop)[:3] == _old_engine(tok, ids, stop, 0, True)
    for _ in range(40):
        ids = [rng.randrange(tok.get_vocab_size()) for _ in range(rng.randint(1, 30))]
        ids += [byte_ids[b] for b in "日😀".encode()] + ids[: rng.randint(0, 5)]
        rng.shuffle(ids)
        full = tok.decode(ids)
        stop = (full[len(full) // 2 :][:3],) if full else ()
        for m in (0, 3):
            assert run(tok, ids, stop, m)[:3] == _old_engine(tok, ids, stop, m, True)


@pytest.mark.parametrize(
    "decoder",
    [
        decoders.WordPiece(cleanup=True),
        decoders.Sequence([decoders.Replace("▁", " "), decoders.Fuse(), decoders.Strip(" ", 2, 0)]),
        decoders.BPEDecoder(),
        decoders.CTC(),
        decoders.Sequence([decoders.Fuse(), decoders.Replace("ab", "X")]),
    ],
)
def test_other_decoders_decode_the_whole_output(decoder):
    """A decoder the window cannot follow (a clean-up that joins "do n't", two leading
    spaces stripped, a replacement across tokens, ...): each step decodes the whole
    output, and the text is exact."""
    tok = _spm_hf(decoder)
    assert not Detokenizer(tok).incremental
    rng = random.Random(7)
    plain = [tok.token_to_id(p) for p in SPM_PIECES]
    for _ in range(30):
        ids = [rng.choice(plain) for _ in range(rng.randint(1, 20))]
        stop = (tok.decode(ids)[-3:],) if rng.random() < 0.5 else ()
        assert run(tok, ids, stop)[:3] == _old_engine(tok, ids, stop, 0, True)


def test_engine_kinds_are_incremental():
    for kind in KINDS:
        assert Detokenizer(tokenizer(kind)).incremental, kind


def _ids(tok, *pieces):
    return [tok.token_to_id(p) for p in pieces]


def test_byte_fallback_run_is_never_shown_then_taken_back():
    """Two emoji as eight byte tokens: after the first four the whole decode is "😀",
    after the fifth it is five U+FFFD (ByteFallback decodes a run all or nothing); the
    text waits for the run's end, and a word after it is shown with its space."""
    tok = tokenizer("hf-spm-llama2")
    ids = _ids(tok, *(f"<0x{b:02X}>" for b in "😀😀".encode()), "▁hello")
    assert tok.decode(ids[:4]) == "😀" and tok.decode(ids[:5]) == "\ufffd" * 5
    _, _, text, seen = run(tok, ids)
    assert seen[:-1] == [""] * 8 and seen[-1] == text == "😀😀 hello"


@pytest.mark.parametrize("kind", ["hf-spm-llama2", "hf-spm-metaspace", "gguf-llama"])
def test_sentencepiece_spaces(kind):
    """The first token's leading space is dropped (as decoding the output alone does),
    every later one kept, also after a skipped special token and a lone "▁"."""
    tok = tokenizer(kind)
    ids = _ids(tok, "▁hello", "▁world", "</s>", "▁the", "▁", "▁quick", "日", "▁日本")
    _, _, text, seen = run(tok, ids)
    assert text == tok.decode(ids) == "hello world the  quick日 日本"
    assert seen[0] == "hello" and seen[1] == "hello world"


def test_stop_semantics():
    """The stop that ends first wins, then the first listed; the text ends before it;
    none is looked for in the first min_tokens tokens' text; while running, the last
    len(longest stop) - 1 characters are held back."""
    tok = tokenizer("hf-spm-llama2")
    ids = _ids(tok, "▁the", "▁quick", "▁hello", "▁world", "▁the", "▁quick")
    assert run(tok, ids, ("quick", "uic"))[:3] == (2, "uic", "the q")
    assert run(tok, ids, ("hello world", "lo w"))[:3] == (4, "lo w", "the quick hel")
    assert run(tok, ids, ("ck", "ick"))[:3] == (2, "ck", "the qui")
    assert run(tok, ids, ("ick", "ck"))[:3] == (2, "ick", "the qu")
    assert run(tok, ids, ("quick",), min_tokens=2)[:3] == (6, "quick", "the quick hello world the ")
    seen = run(tok, ids, ("zzzz",))[3]
    assert seen[:3] == ["", "the qu", "the quick he"]


def test_window_stays_small():
    """The cost of a step does not grow with the output: no decode call sees more than
    a few tokens, over a 2,000-token stream with stop strings and a run of 300 special
    tokens in it (never decoded)."""
    tok = tokenizer("hf-byte-level")
    sizes = []

    class Counting:
        def __getattr__(self, name):
            return getattr(tok, name)

        def decode(self, ids, skip_special_tokens=True):
            sizes.append(len(ids))
            return tok.decode(ids, skip_special_tokens=skip_special_tokens)

    ids = tok.encode(" ".join(CORPUS) * 25).ids[:1700]
    ids[900:900] = [tok.token_to_id("<|im_end|>")] * 300
    d = Detokenizer(Counting(), stop=("never here", "nor this"))
    for t in ids:
        d.add(t)
    d.finish()
    assert len(ids) == d.num_tokens == 2000 and d.text == tok.decode(ids)
    assert max(sizes) <= 12 and len(sizes) <= 2 * 1700


def test_errors():
    tok = tokenizer("hf-byte-level")
    with pytest.raises(TypeError, match="tokenizer"):
        Detokenizer(object())
    with pytest.raises(ValueError, match="stop"):
        Detokenizer(tok, stop=("",))
    with pytest.raises(ValueError, match="min_tokens"):
        Detokenizer(tok, min_tokens=-1)
    d = Detokenizer(tok, stop="a")
    with pytest.raises(TypeError, match="token_ids"):
        d.add(["x"])
    d.finish()
    assert d.finish() == ""
    with pytest.raises(ValueError, match="token_ids"):
        d.add([1])
