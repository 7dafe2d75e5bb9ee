"""What the engine gives back for a request: :class:`RequestOutput` (vLLM's fields)."""

from dataclasses import dataclass, field


@dataclass
class RequestOutput:
    """``top_logprobs``: per generated token ``[(id, logprob)]``, most likely first;
    ``prompt_logprobs``: per prompt token, None for the first, then ``(logprob, [(id,
    logprob)])``; ``request_id``: :meth:`LLM.add_request`'s (:meth:`LLM.step_outputs`)."""

    prompt_token_ids: list
    token_ids: list = field(default_factory=list)
    text: str | None = None
    logprobs: list | None = None
    finish_reason: str | None = None  # "stop", "length" or "error"
    stop_reason: int | str | None = None  # stop token id or string; None for EOS
    error: str | None = None
    logits: list | None = None  # per generated token, when the engine records them
    top_logprobs: list | None = None
    prompt_logprobs: list | None = None
    request_id: object = None

    @classmethod
    def of(cls, req, text):
        """The output so far of ``req`` (an ``engine.scheduler.Request``) with its ``text``
        (``LLM._text``)."""
        return cls(
            prompt_token_ids=req.prompt,
            token_ids=list(req.output),
            text=text,
            finish_reason=req.finish_reason,
            stop_reason=req.stop_reason,
            error=req.error,
            logprobs=list(req.logprobs) if req.params.logprobs else None,
            logits=req.logits,
            top_logprobs=list(req.top_logprobs) if req.params.top_logprobs else None,
            prompt_logprobs=(
                [None, *req.prompt_logprobs] if req.params.prompt_logprobs is not None else None
            ),
            request_id=req.rid,
        )
