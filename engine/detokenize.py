"""Incremental detokenisation: a request's output text, token by token, at a cost per
token that does not grow with the output.

Decoding the whole output after every token (for stop strings, and for each step's
streamed text) costs O(n) a step and O(n^2) a stream.
A :class:`Detokenizer` instead keeps two offsets into the output's tokens, as vLLM's
``detokenize_incrementally`` and transformers' ``TextStreamer`` do: ``prefix`` and
``read``. Each step decodes the window ``ids[prefix:]`` and the text it adds is what
follows the window's prefix ``ids[prefix:read]`` (decoded when the offsets last moved).
Decoding a few tokens of context before the new ones keeps the text each token has in
the whole output: a SentencePiece decoder drops the leading space of the first token it
is given (``Strip`` after ``Fuse``, or ``Metaspace``), which is then a prefix token's.

The text a window adds is committed (and the offsets move: ``prefix = read``, ``read =
len(ids)``) only where later tokens cannot change it:

- it is not empty (a window whose prefix decodes to nothing would lose the next token's
  leading space);
- it does not end in U+FFFD, which is what a character whose UTF-8 bytes are split
  across tokens decodes to until its last byte comes (byte-level BPE pieces, or
  ``<0xE2>``-style byte-fallback tokens);
- its last token is not a ``<0xXX>`` byte-fallback token:
  ``tokenizers``' ``ByteFallback`` decodes a run of byte tokens all or nothing, so that
  ``<0xE2><0x82><0xAC>`` is "€" but one more ``<0xE2>`` turns the run into four U+FFFD.

Until then the text stays pending (decoded again with the next token), so the committed
text is always a prefix of the whole output's decode, and committed + pending equals it
(``tokenizer.decode(ids, skip_special_tokens=...)``) after every token. Special tokens
that ``skip_special_tokens`` drops never enter the window (``decode`` drops them before
its decoder sees the tokens): they cost no decode, and a model that writes many of them
does not widen the window.

This holds for the decoders whose text of a token depends only on the token, its
neighbours' bytes and one leading space of the whole text: ``ByteLevel`` (GPT-2, Llama 3,
Qwen; GGUF "gpt2"), ``Replace``/``ByteFallback``/``Fuse``/``Strip`` of one leading space
(Llama 2, Mistral, Gemma; GGUF "llama"), ``Metaspace``, and none (tokens joined by
spaces). For another decoder (``WordPiece``'s clean-up, a ``Strip`` of two spaces,
``CTC``, ...) ``incremental`` is False and the window stays the whole output: each step
decodes it all, as before, and the text is still exact. Should a window's prefix ever not
decode to the start of the window's text, the detokenizer decodes from the output's
first token until the next commit (``resyncs`` counts those; none for the decoders above).

Stop strings (vLLM's semantics): after each
token beyond the first ``min_tokens``, every stop string is looked for in the new text
(committed or pending) and the ``len(longest stop) - 1`` characters of committed text
before it (any match further back would have ended an earlier step), from ``stop_from``
on (the length of the first ``min_tokens`` tokens' text). Of several matches the one
that ends first wins, then the first listed; the text then ends right before it. While a
request with stop strings runs, the last ``len(longest stop) - 1`` committed characters
are held back, since they may begin a stop string: text once shown is never taken back.

In the engine (``engine/llm.py``): a request that passed its checks gets a
Detokenizer (``skip_special_tokens=True``, as ``tokenizer.decode``'s default);
``LLM._finish_check`` gives it each token that is part of the text (an EOS or stop token
that ends the request never is) and ends the request on the stop string ``add`` reports;
``LLM._text`` is ``text``, after ``finish()`` once the request has ended. The server sends
``out.text[sent:]``, which only grows; only rank 0 builds text.

Text while running: ``text`` is the committed text less the hold-back, so a step may
show a few characters fewer than a whole decode would, but never one that later changes
(a whole decode shows the character of a byte-fallback run that one more byte token
turns into U+FFFD). The finished text is the whole decode, up to the stop string.
"""

import json
import operator
import weakref

_SPLIT = "\ufffd"  # what a character whose bytes are not all decoded yet decodes to

# what a tokenizer's requests share, read once per tokenizer, not per request (a Qwen
# vocabulary has hundreds of added tokens): (the special tokens' ids, the ones
# skip_special_tokens drops; whether its decoder can be followed window by window)
_FACTS = weakref.WeakKeyDictionary()


def _facts(tokenizer):
    facts = _FACTS.get(tokenizer)
    if facts is None:
        added = tokenizer.get_added_tokens_decoder()
        special = frozenset(i for i, t in added.items() if t.special)
        decoder = getattr(tokenizer, "decoder", None)
        try:
            local = decoder is None or _local(json.loads(decoder.__getstate__()), [False])
        except (AttributeError, TypeError, ValueError):  # not a tokenizers decoder
            local = False
        facts = _FACTS[tokenizer] = (special, local)
    return facts


def _local(spec, fused):
    """Whether the decoder ``spec`` (its JSON, as ``tokenizer.json`` holds it) gives each
    token's text from the token itself, its neighbours' bytes (UTF-8, byte-fallback runs)
    and at most one leading space stripped from the whole text: the decoders of the
    byte-level BPEs (GPT-2, Llama 3, Qwen) and of SentencePiece (Llama 2, Mistral, Gemma,
    GGUF "llama"). ``fused``: whether a ``Fuse`` came before (a one-item list)."""
    kind = spec.get("type")
    if kind == "Sequence":
        return all(_local(d, fused) for d in spec.get("decoders", ()))
    if kind == "Fuse":
        fused[0] = True
        return True
    if kind == "Replace":
        # before Fuse it rewrites each token alone; after it, a pattern of two or more
        # characters could span tokens
        pattern = spec.get("pattern", {})
        return not fused[0] or len(pattern.get("String", "..")) == 1
    if kind == "Strip":
        return spec.get("start", 0) <= 1 and spec.get("stop", 0) == 0
    return kind in ("ByteLevel", "ByteFallback", "Metaspace")


def _is_byte_token(piece):
    """Whether ``tokenizers``' ByteFallback decoder reads ``piece`` as one byte
    (``<0xXX>``: six characters, two hex digits)."""
    if piece is None or len(piece) != 6 or not piece.startswith("<0x") or piece[5] != ">":
        return False
    try:
        int(piece[3:5], 16)
    except ValueError:
        return False
    return True


class Detokenizer:
    """One request's output text, fed token by token (module docstring).

    ``tokenizer``: a ``tokenizers.Tokenizer`` (what ``engine.loader`` gives, HF and
    GGUF). ``skip_special_tokens``: as ``tokenizer.decode``'s. ``stop``: stop strings
    (non-empty). ``min_tokens``: stop strings are looked for only in the text after the
    first ``min_tokens`` tokens' text.

    :meth:`add` feeds tokens and returns ``(the text newly visible, the stop string hit
    or None)``; :meth:`finish` releases the held-back text at the end. ``text``: the text
    visible so far; ``stop``: the stop string that ended it (None); ``finished``;
    ``stop_from``: where in the text stop strings are looked for (``min_tokens``);
    ``incremental``: whether the tokenizer's decoder is followed window by window.
    """

    def __init__(self, tokenizer, *, skip_special_tokens=True, stop=(), min_tokens=0):
        needs = ("decode", "id_to_token", "get_added_tokens_decoder")
        if not all(hasattr(tokenizer, name) for name in needs):
            raise TypeError(
                f"tokenizer: expected a tokenizers.Tokenizer, got {type(tokenizer).__name__}"
            )
        if isinstance(stop, str):
            stop = (stop,)
        stop = tuple(stop or ())
        if not all(isinstance(s, str) and s for s in stop):
            raise ValueError(f"stop: expected non-empty strings, got {stop!r:.80}")
        if not (isinstance(min_tokens, int) and min_tokens >= 0):
            raise ValueError(f"min_tokens: expected an int >= 0, got {min_tokens!r:.80}")
        self._tok = tokenizer
        self._skip = bool(skip_special_tokens)
        special, self.incremental = _facts(tokenizer)
        self._special = special if self._skip else frozenset()
        self._stops = stop
        self._hold = max(map(len, stop), default=1) - 1
        self._min_tokens = min_tokens
        self._ids = []  # the tokens that reach the decoder (skipped special ones left out)
        self._count = 0  # every token added
        self._prefix = self._read = 0
        self._prefix_text = ""  # decode(ids[prefix:read])
        self._pending = ""  # the text of ids[read:] in the whole decode, not committed
        self._held = ""  # the last committed characters, held back (at most _hold)
        self._committed = 0  # characters committed
        self._parts = []  # the visible text, joined when read (text)
        self.stop_from = 0
        self.stop = None
        self.finished = False
        self.resyncs = 0

    @property
    def text(self):
        """The text visible so far: a prefix of every later value."""
        if len(self._parts) > 1:
            self._parts[:] = ["".join(self._parts)]
        return self._parts[0] if self._parts else ""

    @property
    def decoded(self):
        """``tokenizer.decode`` of the tokens added so far (held-back and pending text
        included); after a stop string, the text before it."""
        return self.text + self._held + self._pending

    @property
    def num_tokens(self):
        """The tokens added (special ones included)."""
        return self._count

    def add(self, token_ids):
        """Feed the next tokens (an int or ints); returns ``(text, stop)``: the text that
        became visible, and the stop string that ended the text, else None. The tokens
        after the one that completes a stop string are ignored (the text has ended)."""
        if self.finished:
            raise ValueError("token_ids: this detokenizer has finished (a stop string or finish())")
        if isinstance(token_ids, int):
            token_ids = (token_ids,)
        shown = len(self._parts)
        for tok in token_ids:
            try:
                tok = operator.index(tok)
            except TypeError:
                raise TypeError(f"token_ids: expected ints, got {tok!r:.80}") from None
            self._count += 1
            if tok in self._special:
                # decode drops it before its decoder sees the tokens: the text is as it
                # was (a model that writes many would otherwise widen the window)
                self._check(self._pending)
            else:
                self._ids.append(tok)
                self._step()
            if self.finished:
                break
        return "".join(self._parts[shown:]), self.stop

    def finish(self):
        """End the text: the held-back and pending text become visible (the whole
        decode). Returns that piece; a no-op ("") once finished."""
        if self.finished:
            return ""
        self.finished = True
        rest = self._held + self._pending
        self._held = self._pending = ""
        if rest:
            self._parts.append(rest)
        return rest

    def _decode(self, ids):
        return self._tok.decode(ids, skip_special_tokens=self._skip)

    def _step(self):
        """Decode the window with the last token added; look for stop strings; commit."""
        ids = self._ids
        window = self._decode(ids[self._prefix :])
        if not window.startswith(self._prefix_text):
            # a decoder this window cannot follow: decode from the first token until the
            # next commit moves the prefix on
            self.resyncs += 1
            self._prefix = 0
            self._prefix_text = self._decode(ids[: self._read])
            window = self._decode(ids)
        new = window[len(self._prefix_text) :]
        if self._check(new):
            return
        n = len(ids)
        if new and not new.endswith(_SPLIT) and not _is_byte_token(self._tok.id_to_token(ids[-1])):
            self._commit(new)
            if self.incremental:
                self._prefix, self._read = self._read, n
                self._prefix_text = self._decode(ids[self._prefix : n])
            else:  # the window stays the whole output, as decoding was before
                self._read, self._prefix_text = n, window
            self._pending = ""
        else:
            self._pending = new

    def _check(self, new):
        """After the ``_count``-th token, whose window adds ``new``: record ``stop_from``
        at the ``min_tokens``-th, look for the stop strings after it (True: one ended the
        text)."""
        if self._count == self._min_tokens:
            self.stop_from = self._committed + len(new)
            return False
        return self._count > self._min_tokens and bool(self._stops) and self._find_stop(new)

    def _find_stop(self, new):
        """Look for the stop strings in the held-back text and ``new``; on a match end
        the text right before it (True)."""
        region = self._held + new
        lo = max(self.stop_from - (self._committed - len(self._held)), 0)
        best = None
        for s in self._stops:
            at = region.find(s, lo)
            if at >= 0 and (best is None or at + len(s) < best[0]):
                best = (at + len(s), at, s)
        if best is None:
            return False
        _, at, self.stop = best
        if at:
            self._parts.append(region[:at])
        self._held = self._pending = ""
        self.finished = True
        return True

    def _commit(self, new):
        self._committed += len(new)
        held = self._held + new
        cut = len(held) - self._hold
        if cut > 0:
            self._parts.append(held[:cut])
            held = held[cut:]
        self._held = held
