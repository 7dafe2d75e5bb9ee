"""The OpenAI-compatible HTTP server: a FastAPI app over one :class:`~engine.llm.LLM`.

Endpoints: ``GET /v1/models``, ``POST /v1/completions``, ``POST /v1/chat/completions``
(OpenAI's schemas, ``engine.serve.protocol``; ``"stream": true`` answers with
server-sent events, one ``data: {chunk}`` per step that adds text, ending ``data:
[DONE]``), ``GET /health`` (200 while the engine thread runs, else 503) and ``GET
/metrics`` (``engine.serve.metrics``).

Every handler runs on the event loop and never steps the engine: requests go to the
engine thread (``engine.serve.worker``), outputs come back per step. A streamed chunk
carries what the request's text gained in that step (``LLM.step_outputs``: the text only
grows, a stop string and a character split across tokens held back until decided), so a
stream's chunks join to exactly the text of the same request unstreamed. A client that
disconnects, or a stream closed early, aborts its requests: their KV blocks and state
slots are freed at the next step.

Errors are OpenAI's error body ``{"error": {"message", "type", "param", "code"}}``:
malformed JSON or a bad field 400 (``param`` names the field), an unknown model 404, a
full queue 429, the engine thread down 503, an engine failure inside a request 500 (in a
stream: a ``data: {"error": ...}`` event before ``[DONE]``). One request's error never
touches another's.
"""

import asyncio
import contextlib
import json
import logging
import time
import uuid
from dataclasses import dataclass

import fastapi
import jinja2
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException

from . import protocol
from .metrics import Metrics
from .protocol import ApiError
from .worker import EngineDown, Overloaded, Worker

log = logging.getLogger("engine.serve")


@dataclass
class Sent:
    """What a choice's stream has sent so far."""

    chars: int = 0  # of the output text
    tokens: int = 0  # output tokens (echo: the prompt counts as one)
    offset: int = 0  # completions' logprobs text_offset
    started: bool = False  # chat: the role's chunk


class ClientGone(Exception):
    """The client disconnected before its answer was ready."""


def _sse(obj):
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


async def _watch(request, queue):
    """Put None on ``queue`` once the client has gone (the ASGI ``http.disconnect``)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
    queue.put_nowait(None)


class Server:
    """The app's state: the engine, its thread, the metrics and the served name."""

    def __init__(self, llm, *, model_name, max_waiting):
        self.llm = llm
        self.model_name = model_name
        self.metrics = Metrics(model_name)
        self.worker = Worker(llm, max_waiting=max_waiting, metrics=self.metrics)
        self.tok = protocol.Tokens(llm.tokenizer) if llm.tokenizer is not None else None
        self.created = int(time.time())

    # -- requests ------------------------------------------------------------------------

    @staticmethod
    async def body(request):
        raw = await request.body()
        try:
            body = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ApiError(400, f"malformed JSON: {e}") from None
        if not isinstance(body, dict):
            raise ApiError(400, f"expected a JSON object, got {type(body).__name__}")
        return body

    def check_model(self, job):
        if job.model != self.model_name:
            raise ApiError(
                404,
                f"The model `{job.model}` does not exist (this server serves `{self.model_name}`)",
                param="model",
                code="model_not_found",
            )

    def submit(self, job, prompts, *, prompt_field):
        """Queue ``prompts`` (one request each); their queue and handles. A refusal of
        any aborts those queued before it."""
        queue, handles = asyncio.Queue(), []
        try:
            for i, p in enumerate(prompts):
                n = len(p) if isinstance(p, list) else 0
                params = job.sampling_params(n, self.llm.max_model_len)
                handles.append(
                    self.worker.submit(p, params, queue=queue, index=i, stream=job.stream)
                )
        except BaseException as e:
            for h in handles:
                self.worker.abort(h)
            if isinstance(e, ValueError):
                raise protocol.from_value_error(e, prompt_field=prompt_field) from None
            if isinstance(e, Overloaded):
                raise ApiError(429, str(e)) from None
            if isinstance(e, EngineDown):
                raise ApiError(503, f"the engine is not running: {e}") from None
            raise
        return queue, handles

    async def events(self, queue, handles, request):
        """``(index, RequestOutput)`` as they come until every request has finished.
        On leaving early (the client gone: ClientGone; a cancelled task) the unfinished
        requests are aborted."""
        # one watcher a request, not a task and a wait per item: a stream's items come
        # once a step per request
        watch = asyncio.ensure_future(_watch(request, queue))
        left = len(handles)
        try:
            while left:
                item = await queue.get()
                if item is None:
                    raise ClientGone
                i, out = item
                left -= out.finish_reason is not None
                yield i, out
        finally:
            watch.cancel()
            for h in handles:
                self.worker.abort(h)  # (nothing for a finished one)

    async def finals(self, queue, handles, request):
        """Each request's last output, in order; ApiError 500 for one the engine failed."""
        outs = [None] * len(handles)
        async with contextlib.aclosing(self.events(queue, handles, request)) as ev:
            async for i, out in ev:
                outs[i] = out
        for out in outs:
            if out.finish_reason == "error":
                raise ApiError(500, out.error)
        return outs

    # -- completions ---------------------------------------------------------------------

    def prompt_text(self, prompt, out):
        if isinstance(prompt, str):
            return prompt
        return self.llm.tokenizer.decode(out.prompt_token_ids) if self.llm.tokenizer else ""

    def completion_piece(self, job, prompt, out, sent):
        """A completion choice's text and logprobs since ``sent`` (a :class:`Sent`,
        updated)."""
        text, entries = "", []
        if job.echo and not sent.started:
            text = self.prompt_text(prompt, out)
            entries = protocol.prompt_entries(out)
        sent.started = True
        if not job.echo_only:
            now = out.text or ""
            text += now[sent.chars :]
            sent.chars = len(now)
            entries += protocol.generated(out, sent.tokens)
            sent.tokens = len(out.token_ids)
        logprobs = None
        if job.logprobs is not None:
            logprobs, sent.offset = protocol.completion_logprobs(self.tok, entries, sent.offset)
        return text, logprobs

    def finish(self, job, out):
        return "length" if job.echo_only and out.finish_reason else out.finish_reason

    def completion_tokens(self, job, outs):
        return sum(0 if job.echo_only else len(o.token_ids) for o in outs)

    async def completion(self, request):
        job = protocol.completion(await self.body(request))
        self.check_model(job)
        for field, used in (("echo", job.echo), ("logprobs", job.logprobs is not None)):
            if used and self.tok is None:
                raise ApiError(400, f"{field}: needs a tokenizer; this model has none", param=field)
        queue, handles = self.submit(job, job.prompts, prompt_field="prompt")
        rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        head = {
            "id": rid,
            "object": "text_completion",
            "created": created,
            "model": self.model_name,
        }
        if job.stream:
            return self.stream(job, queue, handles, request, head, self.completion_chunks)
        outs = await self.finals(queue, handles, request)
        choices = []
        for i, (p, out) in enumerate(zip(job.prompts, outs)):
            text, logprobs = self.completion_piece(job, p, out, Sent())
            choices.append(
                {
                    "index": i,
                    "text": text,
                    "logprobs": logprobs,
                    "finish_reason": self.finish(job, out),
                    "stop_reason": out.stop_reason,
                }
            )
        n_prompt = sum(len(o.prompt_token_ids) for o in outs)
        return {
            **head,
            "choices": choices,
            "usage": protocol.usage(n_prompt, self.completion_tokens(job, outs)),
        }

    def completion_chunks(self, job, i, out, sent, head):
        text, logprobs = self.completion_piece(job, job.prompts[i], out, sent)
        if text or (logprobs and logprobs["tokens"]) or out.finish_reason:
            choice = {
                "index": i,
                "text": text,
                "logprobs": logprobs,
                "finish_reason": self.finish(job, out),
                "stop_reason": out.stop_reason,
            }
            yield {**head, "choices": [choice]}

    # -- chat ----------------------------------------------------------------------------

    async def chat(self, request):
        job = protocol.chat(await self.body(request))
        self.check_model(job)
        try:
            ids = self.llm.apply_chat_template(
                job.messages, add_generation_prompt=job.add_generation_prompt, tokenize=True
            )
        except (ValueError, jinja2.TemplateError) as e:
            raise ApiError(400, f"messages: {e}", param="messages") from None
        job.prompts = [ids]
        queue, handles = self.submit(job, job.prompts, prompt_field="messages")
        rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        head = {
            "id": rid,
            "object": "chat.completion",
            "created": created,
            "model": self.model_name,
        }
        if job.stream:
            head = {**head, "object": "chat.completion.chunk"}
            return self.stream(job, queue, handles, request, head, self.chat_chunks)
        (out,) = await self.finals(queue, handles, request)
        logprobs = None
        if job.logprobs is not None:
            logprobs = protocol.chat_logprobs(self.tok, protocol.generated(out, 0))
        choice = {
            "index": 0,
            "message": {"role": "assistant", "content": out.text or ""},
            "logprobs": logprobs,
            "finish_reason": out.finish_reason,
            "stop_reason": out.stop_reason,
        }
        usage = protocol.usage(len(out.prompt_token_ids), len(out.token_ids))
        return {**head, "choices": [choice], "usage": usage}

    def chat_chunks(self, job, i, out, sent, head):
        if not sent.started:  # the role first, as OpenAI
            sent.started = True
            yield {
                **head,
                "choices": [
                    {
                        "index": i,
                        "delta": {"role": "assistant", "content": ""},
                        "logprobs": None,
                        "finish_reason": None,
                    }
                ],
            }
        now = out.text or ""
        text = now[sent.chars :]
        sent.chars = len(now)
        entries = protocol.generated(out, sent.tokens)
        sent.tokens = len(out.token_ids)
        logprobs = None
        if job.logprobs is not None and entries:
            logprobs = protocol.chat_logprobs(self.tok, entries)
        if text or logprobs or out.finish_reason:
            delta = {"content": text} if text else {}
            yield {
                **head,
                "choices": [
                    {
                        "index": i,
                        "delta": delta,
                        "logprobs": logprobs,
                        "finish_reason": out.finish_reason,
                        "stop_reason": out.stop_reason,
                    }
                ],
            }

    # -- streams -------------------------------------------------------------------------

    def stream(self, job, queue, handles, request, head, chunks):
        async def body():
            sent = [Sent() for _ in handles]
            outs = [None] * len(handles)
            async with contextlib.aclosing(self.events(queue, handles, request)) as ev:
                async for i, out in ev:
                    outs[i] = out
                    if out.finish_reason == "error":
                        yield _sse(ApiError(500, out.error).body())
                        continue
                    for chunk in chunks(job, i, out, sent[i], head):
                        yield _sse(chunk)
            if job.include_usage:
                n_prompt = sum(len(o.prompt_token_ids) for o in outs)
                n_out = self.completion_tokens(job, outs)
                yield _sse({**head, "choices": [], "usage": protocol.usage(n_prompt, n_out)})
            yield "data: [DONE]\n\n"

        return StreamingResponse(body(), media_type="text/event-stream")

    # -- the rest ------------------------------------------------------------------------

    def models(self):
        card = {
            "id": self.model_name,
            "object": "model",
            "created": self.created,
            "owned_by": "numkern",
            "root": str(self.llm.source),
            "max_model_len": self.llm.max_model_len,
        }
        return {"object": "list", "data": [card]}


def build_app(llm, *, model_name, max_waiting=256):
    """The FastAPI app serving ``llm`` as ``model_name``; its engine thread starts and
    stops with the app (ASGI lifespan). ``max_waiting``: requests that may wait beyond
    the running batch's ``max_num_seqs`` before a new one gets 429."""
    server = Server(llm, model_name=model_name, max_waiting=max_waiting)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        server.worker.start(asyncio.get_running_loop())
        try:
            yield
        finally:
            server.worker.stop()

    app = fastapi.FastAPI(title="numkern engine", lifespan=lifespan)
    app.state.server = server

    @app.exception_handler(ApiError)
    async def api_error(request, e):
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(ClientGone)
    async def client_gone(request, e):
        return Response(status_code=499)  # nobody reads it (nginx's "client closed")

    @app.exception_handler(HTTPException)
    async def http_error(request, e):
        return JSONResponse(ApiError(e.status_code, str(e.detail)).body(), e.status_code)

    @app.get("/health")
    async def health():
        if server.worker.error is not None:
            return JSONResponse(ApiError(503, server.worker.error).body(), 503)
        return Response(status_code=200)

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(
            server.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8"
        )

    @app.get("/v1/models")
    async def models():
        return server.models()

    @app.post("/v1/completions")
    async def completions(request: fastapi.Request):
        return await server.completion(request)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: fastapi.Request):
        return await server.chat(request)

    return app
