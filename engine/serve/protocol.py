"""The OpenAI API's request and response bodies: a request's JSON checked into the
engine's :class:`~engine.llm.SamplingParams`, and outputs written back in the schemas of
``/v1/completions`` and ``/v1/chat/completions`` (streamed chunks too).

Fields. Each field a request may carry is in one of four sets:

* implemented (``COMMON``, ``COMPLETION``, ``CHAT``): OpenAI's sampling fields and
  vLLM's extras that the engine implements (``top_k``, ``min_tokens``, ``ignore_eos``,
  ``stop_token_ids``, chat's ``add_generation_prompt``); a bad value is a 400 naming the
  field (``"temperature: expected a number >= 0, got 'hot'"``, ``param`` set to it);
* OpenAI's fields that the engine does not implement (``UNSUPPORTED``): accepted at the
  value that means "off" (``presence_penalty: 0``, ``n: 1``, ``suffix: null``, ...),
  anything else a 400 naming the field;
* fields that change nothing the engine returns (``NO_EFFECT``: ``user``, ``metadata``,
  ...): accepted;
* anything else: ignored with a logged warning naming it, as vLLM does.

Defaults are OpenAI's (temperature 1, top_p 1; completions' ``max_tokens`` 16; chat's:
up to the context, ``max_model_len`` minus the prompt), not a checkpoint's
``generation_config.json``.
"""

import logging
from dataclasses import dataclass
from typing import ClassVar

from ..args import is_int, is_number
from ..sampling import SamplingParams

log = logging.getLogger("engine.serve")

MAX_LOGPROBS = 20  # as OpenAI's chat top_logprobs and vLLM's default max_logprobs

COMMON = {
    "model",
    "stream",
    "stream_options",
    "temperature",
    "top_p",
    "top_k",
    "seed",
    "stop",
    "stop_token_ids",
    "ignore_eos",
    "min_tokens",
    "max_tokens",
}
COMPLETION = {"prompt", "echo", "logprobs"}
CHAT = {"messages", "max_completion_tokens", "logprobs", "top_logprobs", "add_generation_prompt"}
# field -> the values that mean "off" (accepted); others are refused
UNSUPPORTED = {
    "n": (None, 1),
    "best_of": (None, 1),
    "suffix": (None, ""),
    "presence_penalty": (None, 0),
    "frequency_penalty": (None, 0),
    "repetition_penalty": (None, 1),
    "logit_bias": (None, {}),
    "tools": (None, []),
    "tool_choice": (None, "none"),
    "functions": (None, []),
    "function_call": (None, "none"),
    "response_format": (None, {"type": "text"}),
    "prediction": (None,),
    "audio": (None,),
    "modalities": (None, ["text"]),
}
NO_EFFECT = {"user", "metadata", "store", "service_tier", "parallel_tool_calls"}


class ApiError(Exception):
    """An OpenAI error response: ``status`` and the body ``{"error": {"message", "type",
    "param", "code"}}``."""

    TYPES: ClassVar[dict] = {
        400: "invalid_request_error",
        404: "invalid_request_error",
        429: "rate_limit_error",
        500: "server_error",
        503: "service_unavailable",
    }

    def __init__(self, status, message, *, param=None, code=None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def body(self):
        kind = self.TYPES.get(self.status, "server_error")
        return {
            "error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}
        }


def bad(field, message):
    """The 400 of a field's bad value."""
    return ApiError(400, f"{field}: {message}", param=field)


def from_value_error(e, *, prompt_field="prompt"):
    """The 400 of an engine ValueError, whose message starts with the field's name (the
    engine's ``prompt`` is chat's ``messages``)."""
    msg = str(e)
    field, sep, rest = msg.partition(": ")
    if not sep or " " in field:
        return ApiError(400, msg)
    if field == "prompt":
        field = prompt_field
        msg = f"{field}: {rest}"
    return ApiError(400, msg, param=field)


def _get(body, field, check, expected, default):
    """``body[field]`` (``default`` when absent or null) if ``check`` accepts it, else the
    400 naming it."""
    v = body.get(field)
    if v is None:
        return default
    if not check(v):
        raise bad(field, f"expected {expected}, got {v!r:.80}")
    return v


@dataclass
class Job:
    """A checked request: its prompts (strings or token ids; chat: the template's ids),
    their SamplingParams (chat without a max: ``max_tokens`` None, set per prompt), and
    how to answer."""

    kind: str  # "completion" or "chat"
    model: str
    prompts: list
    params: dict  # SamplingParams' fields
    stream: bool
    include_usage: bool
    echo: bool = False  # completions: the prompt's text (and logprobs) before the output
    echo_only: bool = False  # echo with max_tokens 0: the prompt alone (one token is made)
    logprobs: int | None = None  # top logprobs per token; None: no logprobs
    messages: list | None = None  # chat: the messages, contents as strings
    add_generation_prompt: bool = True

    def sampling_params(self, prompt_len, max_model_len):
        """The engine's SamplingParams of one prompt of ``prompt_len`` tokens."""
        p = dict(self.params)
        if p["max_tokens"] is None:  # chat without a max: up to the context
            p["max_tokens"] = max(max_model_len - prompt_len, 1)
        return SamplingParams(**p)


def _check_fields(body, allowed):
    for field, off in UNSUPPORTED.items():
        if field in body and body[field] not in off:
            shown = " or ".join("null" if v is None else repr(v) for v in off)
            raise bad(
                field, f"not supported by this server; expected {shown}, got {body[field]!r:.80}"
            )
    unknown = sorted(set(body) - allowed - set(UNSUPPORTED) - NO_EFFECT)
    if unknown:
        log.warning("ignoring request fields this server does not know: %s", ", ".join(unknown))


def _sampling(body, max_tokens):
    """The SamplingParams fields common to both endpoints."""
    stop = body.get("stop")
    if isinstance(stop, str):
        stop = [stop]
    if stop is not None and not (
        isinstance(stop, list) and all(isinstance(s, str) and s for s in stop)
    ):
        raise bad("stop", f"expected a non-empty string or a list of them, got {stop!r:.80}")
    ints = lambda v: isinstance(v, list) and all(is_int(t) for t in v)  # noqa: E731
    params = dict(
        temperature=_get(
            body, "temperature", lambda v: is_number(v) and v >= 0, "a number >= 0", 1.0
        ),
        top_p=_get(body, "top_p", lambda v: is_number(v) and 0 < v <= 1, "a number in (0, 1]", 1.0),
        top_k=_get(
            body, "top_k", lambda v: is_int(v) and v >= -1, "an int >= 1, or 0 or -1 (off)", 0
        ),
        seed=_get(body, "seed", is_int, "an int", None),
        stop=tuple(stop or ()),
        stop_token_ids=tuple(_get(body, "stop_token_ids", ints, "a list of ints", [])),
        ignore_eos=_get(body, "ignore_eos", lambda v: isinstance(v, bool), "a bool", False),
        min_tokens=_get(body, "min_tokens", lambda v: is_int(v) and v >= 0, "an int >= 0", 0),
        max_tokens=max_tokens,
    )
    if max_tokens is not None and params["min_tokens"] > max_tokens:
        raise bad(
            "min_tokens", f"expected at most max_tokens ({max_tokens}), got {params['min_tokens']}"
        )
    # the engine's own check (the seed's range), with a stand-in for chat's open max
    problem = SamplingParams(
        **{**params, "max_tokens": max_tokens or max(params["min_tokens"], 1)}
    ).problems()
    if problem:  # (the seed's range)
        field = problem.partition(":")[0]
        raise ApiError(400, problem, param=field)
    return params


def _stream(body):
    stream = _get(body, "stream", lambda v: isinstance(v, bool), "a bool", False)
    opts = body.get("stream_options")
    if opts is None:
        return stream, False
    if not stream:
        raise bad("stream_options", "only allowed when stream is true")
    if not isinstance(opts, dict):
        raise bad("stream_options", f'expected {{"include_usage": bool}}, got {opts!r:.80}')
    usage = opts.get("include_usage", False)
    if not isinstance(usage, bool):
        raise bad("stream_options.include_usage", f"expected a bool, got {usage!r:.80}")
    unknown = sorted(set(opts) - {"include_usage"})
    if unknown:
        log.warning("ignoring stream_options fields: %s", ", ".join(unknown))
    return stream, usage


def _prompts(prompt):
    """A completion's prompts: a string, token ids, or a non-empty list of either."""
    if isinstance(prompt, str) or (isinstance(prompt, list) and prompt and is_int(prompt[0])):
        prompt = [prompt]
    ok = isinstance(prompt, list) and prompt
    ok = ok and all(
        isinstance(p, str) or (isinstance(p, list) and p and all(is_int(t) for t in p))
        for p in prompt
    )
    if not ok:
        raise bad(
            "prompt",
            f"expected a string, a list of token ids, or a non-empty list of "
            f"either, got {prompt!r:.80}",
        )
    return prompt


def _model(body):
    model = body.get("model")
    if not isinstance(model, str):
        raise bad("model", f"expected the name of a served model (a string), got {model!r:.80}")
    return model


def completion(body):
    """The :class:`Job` of a ``/v1/completions`` body (a dict); ApiError otherwise."""
    model = _model(body)
    _check_fields(body, COMMON | COMPLETION)
    if "prompt" not in body:
        raise bad("prompt", "required")
    prompts = _prompts(body["prompt"])
    echo = _get(body, "echo", lambda v: isinstance(v, bool), "a bool", False)
    max_tokens = _get(
        body,
        "max_tokens",
        lambda v: is_int(v) and v >= (0 if echo else 1),
        "an int >= 0 with echo, else >= 1",
        16,
    )
    logprobs = _get(
        body,
        "logprobs",
        lambda v: is_int(v) and 0 <= v <= MAX_LOGPROBS,
        f"an int in [0, {MAX_LOGPROBS}]",
        None,
    )
    stream, usage = _stream(body)
    echo_only = echo and max_tokens == 0
    params = _sampling(body, 1 if echo_only else max_tokens)
    if logprobs is not None:
        params.update(logprobs=True, top_logprobs=logprobs)
        if echo:
            params["prompt_logprobs"] = logprobs
    return Job("completion", model, prompts, params, stream, usage, echo, echo_only, logprobs)


def _content(i, m):
    """Message ``i``'s content as a string (text parts joined by newlines, as vLLM)."""
    c = m.get("content")
    if c is None or isinstance(c, str):
        return c or ""
    if isinstance(c, list) and all(isinstance(p, dict) for p in c):
        kinds = {p.get("type") for p in c}
        if kinds <= {"text"} and all(isinstance(p.get("text"), str) for p in c):
            return "\n".join(p["text"] for p in c)
    raise bad(
        f"messages[{i}].content",
        f'expected a string or text parts ([{{"type": "text", "text": ...}}]), got {c!r:.80}',
    )


def chat(body):
    """The :class:`Job` of a ``/v1/chat/completions`` body (a dict); ApiError otherwise."""
    model = _model(body)
    _check_fields(body, COMMON | CHAT)
    messages = body.get("messages")
    if not (isinstance(messages, list) and messages):
        raise bad("messages", f"expected a non-empty list of messages, got {messages!r:.80}")
    out = []
    for i, m in enumerate(messages):
        if not (isinstance(m, dict) and isinstance(m.get("role"), str)):
            raise bad(f"messages[{i}]", f'expected {{"role": ..., "content": ...}}, got {m!r:.80}')
        out.append({**m, "content": _content(i, m)})
    limit = lambda v: is_int(v) and v >= 1  # noqa: E731
    max_tokens = _get(body, "max_completion_tokens", limit, "an int >= 1", None)
    if max_tokens is None:
        max_tokens = _get(body, "max_tokens", limit, "an int >= 1", None)
    logprobs = _get(body, "logprobs", lambda v: isinstance(v, bool), "a bool", False)
    top = _get(
        body,
        "top_logprobs",
        lambda v: is_int(v) and 0 <= v <= MAX_LOGPROBS,
        f"an int in [0, {MAX_LOGPROBS}]",
        None,
    )
    if top is not None and not logprobs:
        raise bad("top_logprobs", "needs logprobs: true")
    add_gen = _get(body, "add_generation_prompt", lambda v: isinstance(v, bool), "a bool", True)
    stream, usage = _stream(body)
    params = _sampling(body, max_tokens)
    if logprobs:
        params.update(logprobs=True, top_logprobs=top or 0)
    job = Job("chat", model, [], params, stream, usage, logprobs=(top or 0) if logprobs else None)
    job.messages, job.add_generation_prompt = out, add_gen
    return job


# -- responses ---------------------------------------------------------------------------


class Tokens:
    """Token ids as text for logprobs: each token alone, special tokens kept."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._cache = {}

    def __call__(self, tid):
        s = self._cache.get(tid)
        if s is None:
            s = self.tokenizer.decode([tid], skip_special_tokens=False)
            self._cache[tid] = s
        return s


def completion_logprobs(tok, entries, offset):
    """OpenAI's completions ``logprobs`` of ``entries`` ``[(token id, logprob or None,
    [(id, logprob)] or None)]``, text offsets from ``offset``; and the offset after."""
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for tid, lp, top in entries:
        s = tok(tid)
        out["tokens"].append(s)
        out["token_logprobs"].append(lp)
        if lp is None:
            out["top_logprobs"].append(None)
        else:  # the chosen token's too, as vLLM gives it
            d = {tok(i): v for i, v in top or ()}
            d.setdefault(s, lp)
            out["top_logprobs"].append(d)
        out["text_offset"].append(offset)
        offset += len(s)
    return out, offset


def chat_logprobs(tok, entries):
    """OpenAI's chat ``logprobs`` of ``entries`` ``[(token id, logprob, [(id, logprob)])]``."""

    def one(tid, lp):
        s = tok(tid)
        return {"token": s, "logprob": lp, "bytes": list(s.encode())}

    return {
        "content": [
            {**one(tid, lp), "top_logprobs": [one(i, v) for i, v in top or ()]}
            for tid, lp, top in entries
        ]
    }


def generated(out, start, stop=None):
    """``[(id, logprob, top)]`` of ``out``'s generated tokens ``start:stop``."""
    ids = out.token_ids[start:stop]
    lps = out.logprobs[start : start + len(ids)] if out.logprobs else [None] * len(ids)
    tops = out.top_logprobs[start : start + len(ids)] if out.top_logprobs else [None] * len(ids)
    return list(zip(ids, lps, tops))


def prompt_entries(out):
    """``[(id, logprob or None, top)]`` of ``out``'s prompt tokens (echo)."""
    pl = out.prompt_logprobs or [None] * len(out.prompt_token_ids)
    return [
        (tid, None, None) if p is None else (tid, p[0], p[1])
        for tid, p in zip(out.prompt_token_ids, pl)
    ]


def usage(prompt_tokens, completion_tokens):
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }
