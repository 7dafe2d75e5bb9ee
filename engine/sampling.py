"""Sampling: :class:`SamplingParams` (vLLM's, with vLLM's meaning) and :func:`sample`, a
request's next token from its row of a step's logits (temperature, top-k, top-p, the
``min_tokens`` mask, logprobs). The engine samples on rank 0, in fp32, with torch ops on
one row at a time: a step's rows are few (its requests), the vocabulary large.
"""

from dataclasses import dataclass

import numpy as np
import torch

from .args import is_int, is_number, option

SEED_RANGE = (-(1 << 63), (1 << 64) - 1)  # what torch.Generator.manual_seed takes
# top-p: the probability floors whose tokens are sorted before all of them are (_top_p)
TOP_P_FLOORS = (1e-3, 1e-5)
TOP_P_MARGIN = 1e-4  # the mass past top_p a floor's tokens must hold (>> fp32 cumsum error)


@dataclass
class SamplingParams:
    """vLLM's sampling parameters, with vLLM's meaning.

    ``stop`` (strings) and ``stop_token_ids`` end a request with finish_reason "stop"
    (``stop_reason`` says which); its text then ends before the stop string or leaves
    out the stop token's text, while ``token_ids`` keep every generated token.

    ``min_tokens``: no EOS or stop token is sampled (logits masked) and no stop ends a
    request before that many tokens; stop strings are looked for in the text after them.
    ``top_logprobs`` and ``prompt_logprobs`` (None: off): RequestOutput's fields, that
    many most likely tokens each, prompt ones from the prefill's logits. Logprobs are the
    model's, before temperature, top-k, top-p and the min_tokens mask.
    """

    temperature: float = option(1.0, "sampling temperature (0: greedy)")
    top_k: int = option(0, "the k most likely tokens only (0 or -1: off)")
    top_p: float = option(1.0, "the nucleus: the most likely tokens holding this mass")
    seed: int | None = option(None, "a request's own random stream (default: the engine's)", int)
    max_tokens: int = option(16, "tokens to generate at most")
    stop: tuple = ()  # as in vLLM, a single string is a one-string tuple, None is ()
    stop_token_ids: tuple = ()
    ignore_eos: bool = False
    logprobs: bool = False
    min_tokens: int = 0
    top_logprobs: int = 0
    prompt_logprobs: int | None = None

    def __post_init__(self):
        if self.stop is None or isinstance(self.stop, str):
            self.stop = () if self.stop is None else (self.stop,)
        if self.stop_token_ids is None:
            self.stop_token_ids = ()

    def problems(self):
        """Why these values are invalid, as the message of the ValueError a request with
        them fails with, naming the field ('' when they are fine)."""
        if not (is_number(self.temperature) and self.temperature >= 0):
            return f"temperature: expected a finite number >= 0, got {self.temperature!r:.80}"
        if not (is_int(self.top_k) and self.top_k >= -1):
            return f"top_k: expected an int >= 1, or 0 or -1 (off), got {self.top_k!r:.80}"
        if not (is_number(self.top_p) and 0 < self.top_p <= 1):
            return f"top_p: expected a number in (0, 1], got {self.top_p!r:.80}"
        if not (is_int(self.max_tokens) and self.max_tokens >= 1):
            return f"max_tokens: expected an int >= 1, got {self.max_tokens!r:.80}"
        if not (is_int(self.min_tokens) and 0 <= self.min_tokens <= self.max_tokens):
            return (
                f"min_tokens: expected an int in [0, max_tokens={self.max_tokens!r:.20}], got "
                f"{self.min_tokens!r:.80}"
            )
        if not (is_int(self.top_logprobs) and self.top_logprobs >= 0):
            return f"top_logprobs: expected an int >= 0, got {self.top_logprobs!r:.80}"
        k = self.prompt_logprobs
        if not (k is None or (is_int(k) and k >= 0)):
            return f"prompt_logprobs: expected None or an int >= 0, got {k!r:.80}"
        lo, hi = SEED_RANGE
        if self.seed is not None and not (is_int(self.seed) and lo <= self.seed <= hi):
            return f"seed: expected None or an int in [{lo}, {hi}], got {self.seed!r:.80}"
        stop = self.stop
        if not (isinstance(stop, (tuple, list)) and all(isinstance(t, str) and t for t in stop)):
            return f"stop: expected non-empty strings, got {stop!r:.80}"
        ids = self.stop_token_ids
        if not (isinstance(ids, (tuple, list)) and all(is_int(t) for t in ids)):
            return f"stop_token_ids: expected a list of ints, got {ids!r:.80}"
        return ""


def sample(req, logits, j, eos):
    """``req``'s next token from row ``j`` of the step's logits (fp32 ``[R, vocab]``);
    ``eos``: the model's EOS ids (masked with the stop tokens before ``min_tokens``). Its
    logprobs (the model's, before temperature and masks) are appended to the request's."""
    p = req.params
    row = logits[j]
    if len(req.output) < p.min_tokens:  # no EOS nor stop token yet (a masked copy)
        banned = [*p.stop_token_ids, *(() if p.ignore_eos else eos)]
        row = row.index_fill(0, torch.tensor(banned, dtype=torch.int64), float("-inf"))
    if p.temperature == 0:
        # NumPy's argmax: 10x torch's here on a 49K vocab; both take the first maximum
        # (and a NumPy row view: no torch op at all)
        tok = int(np.argmax(row.numpy()))
    else:
        x = row / p.temperature
        if p.top_k > 0:
            kth = torch.topk(x, min(p.top_k, x.numel())).values[-1]
            x = x.masked_fill(x < kth, float("-inf"))
        probs = torch.softmax(x, -1)
        if p.top_p < 1:
            probs = _top_p(probs, p.top_p)
            probs = probs / probs.sum()
        tok = int(torch.multinomial(probs, 1, generator=req.generator))
    if p.logprobs or p.top_logprobs:
        lp = torch.log_softmax(logits[j], -1)
        req.logprobs.append(float(lp[tok]))
        if p.top_logprobs:
            req.top_logprobs.append(top(lp, p.top_logprobs))
    return tok


def _top_p(probs, top_p):
    """``probs`` (fp32 ``[vocab]``) with the tokens outside the nucleus zeroed: in a stable
    descending sort of all of them, a token stays while the mass before it (``cumsum -
    p``) is at most ``top_p``, and the same values as that sort gives.

    A sort of a 49,152-token vocabulary is 3-6 ms (one thread), as long as a decode step
    of a small model. So the tokens of probability >= a floor are sorted alone when they
    hold more than ``top_p + TOP_P_MARGIN``: they come first in the full sort and in the
    same order (ties by id), torch's CPU cumsum is a sequential scan (its prefix is the
    prefix of the full one: tests/test_engine_threads.py checks the two bit for bit), and
    every token below the floor has more than ``top_p`` before it.
    Else the next floor, and at last (or once a floor holds half the vocabulary) the full
    sort. Random logits of std 3 at T=0.7 and top_p=0.9 (57 tokens kept): 0.16-0.37 ms
    against 7-10 ms with the full sort (AMD EPYC, one torch thread, other jobs running).
    """
    si = None
    for floor in TOP_P_FLOORS:
        ids = torch.nonzero(probs >= floor).squeeze(1)  # ascending, as a stable sort's ties
        if 2 * len(ids) > len(probs):
            break
        head = probs[ids]
        if float(head.sum()) > top_p + TOP_P_MARGIN:
            sp, order = torch.sort(head, descending=True, stable=True)
            si = ids[order]
            break
    if si is None:
        sp, si = torch.sort(probs, descending=True, stable=True)
    keep = si[~(torch.cumsum(sp, 0) - sp > top_p)]
    out = torch.zeros_like(probs)
    out[keep] = probs[keep]
    return out


def top(lp, k):
    """The ``k`` most likely ``(id, logprob)`` of a logprob row (fp32 ``[vocab]``)."""
    v, i = torch.topk(lp, min(k, lp.numel()))
    return list(zip(i.tolist(), v.tolist()))
