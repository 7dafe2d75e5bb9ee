"""The engine thread: the only caller of ``LLM.step`` while the server runs.

Clients' requests reach the engine through :meth:`Worker.submit` (on the event loop: the
request is checked and queued with ``LLM.add_request``, which raises ValueError naming
the field for one that cannot run); each step's outputs go back to the loop in one
``call_soon_threadsafe`` call, where :meth:`Worker._dispatch` hands each to its
request's queue and records the metrics. A request added while a step runs joins the
next step's batch (continuous batching across clients). :meth:`Worker.abort` (a client
gone, a stream closed) ends a request at the next step, its KV blocks and state slot
freed there (``LLM.abort``).

Back-pressure: at most ``max_num_seqs + max_waiting`` unfinished requests; one more is
refused with :class:`Overloaded` (the server's 429), so a burst cannot grow memory
without bound.
"""

import itertools
import logging
import threading
import time
from dataclasses import dataclass

from ..llm import RequestOutput

log = logging.getLogger("engine.serve")


@dataclass(frozen=True)
class Snapshot:
    """The engine's occupancy after a step (for ``/metrics``)."""

    running: int
    waiting: int
    kv_usage: float  # the fullest KV-cache group's share of blocks in use
    groups: tuple  # per KV-cache group: (blocks used, blocks)
    slots_used: int  # GDN state slots in use
    preemptions: int
    steps: int


class Overloaded(Exception):
    """The queue is full (``max_waiting`` requests wait already)."""


class EngineDown(Exception):
    """The engine thread ended (a failed step, or shutdown)."""


@dataclass(eq=False)
class Handle:
    """One engine request of a client's: ``(index, RequestOutput)`` items arrive on
    ``queue`` (an asyncio.Queue), every step's when ``stream``, else only the last."""

    rid: int
    index: int
    queue: object
    stream: bool
    arrival: float
    first: float | None = None
    last: float = 0.0
    tokens: int = 0


class Worker:
    def __init__(self, llm, *, max_waiting, metrics):
        self.llm = llm
        self.max_waiting = max_waiting
        self.metrics = metrics
        self.error = None  # why the engine thread ended early (EngineDown's message)
        self._live = {}  # request id -> Handle; the loop's alone
        self._ids = itertools.count()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._steps = 0
        self._loop = None
        self._thread = None

    # -- the event loop's side -----------------------------------------------------------

    def start(self, loop):
        """Start the engine thread; its outputs go to ``loop``."""
        self._loop = loop
        self._thread = threading.Thread(target=self._run, name="engine", daemon=True)
        self._thread.start()

    def stop(self, timeout=None):
        """End the engine thread after its step under way; unfinished requests are dropped
        and their blocks freed (``LLM.serving``)."""
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)

    def submit(self, prompt, params, *, queue, index=0, stream=False):
        """Queue one request; its :class:`Handle`. Raises Overloaded, EngineDown, or the
        ValueError (naming the field) of a request that cannot run."""
        if self.error is not None or self._stop.is_set():
            raise EngineDown(self.error or "the server is shutting down")
        if len(self._live) >= self.llm.scheduler.max_num_seqs + self.max_waiting:
            self.metrics.rejected += 1
            raise Overloaded(
                f"{len(self._live)} requests are running or waiting (max_num_seqs + "
                f"--max-waiting); retry later"
            )
        rid = next(self._ids)
        self.llm.add_request(rid, prompt, params)
        h = Handle(rid, index, queue, stream, time.perf_counter())
        self._live[rid] = h
        self._wake.set()
        return h

    def abort(self, handle):
        """End ``handle``'s request at the next step (nothing if it has finished)."""
        if handle.rid in self._live:
            self.llm.abort(handle.rid)
            self._wake.set()

    def _dispatch(self, outs, snapshot, now):
        m = self.metrics
        if snapshot is not None:
            m.snapshot = snapshot
        for out in outs:
            h = self._live.get(out.request_id)
            if h is None:
                continue
            new = len(out.token_ids) - h.tokens
            if new > 0:
                if h.first is None:
                    h.first = now
                    m.ttft.observe(now - h.arrival)
                    m.prompt_tokens += len(out.prompt_token_ids)
                else:
                    for _ in range(new):
                        m.itl.observe((now - h.last) / new)
                h.last = now
                h.tokens += new
                m.generation_tokens += new
            done = out.finish_reason is not None
            if done:
                del self._live[out.request_id]
                m.finished[out.finish_reason] = m.finished.get(out.finish_reason, 0) + 1
                m.e2e.observe(now - h.arrival)
            if h.stream or done:
                h.queue.put_nowait((h.index, out))

    def _fail_all(self, message):
        """The engine thread died: every unfinished request ends with ``message``."""
        self.error = message
        outs = [
            RequestOutput([], finish_reason="error", error=message, request_id=rid)
            for rid in list(self._live)
        ]
        self._dispatch(outs, None, time.perf_counter())

    # -- the engine thread ---------------------------------------------------------------

    def _snapshot(self):
        s = self.llm.scheduler
        groups = tuple((g.pool.num_blocks - g.pool.num_free, g.pool.num_blocks) for g in s.groups)
        return Snapshot(
            running=len(s.running),
            waiting=len(s.waiting),
            kv_usage=max((u / t for u, t in groups if t), default=0.0),
            groups=groups,
            slots_used=(s.slots.num_blocks - s.slots.num_free) if s.slots is not None else 0,
            preemptions=s.num_preemptions,
            steps=self._steps,
        )

    def _post(self, outs, snapshot):
        try:
            self._loop.call_soon_threadsafe(self._dispatch, outs, snapshot, time.perf_counter())
        except RuntimeError:  # the loop closed (shutdown): nobody is waiting
            pass

    def _run(self):
        try:
            with self.llm.serving():
                self._post([], self._snapshot())
                while not self._stop.is_set():
                    if not self.llm.has_work():
                        self._wake.wait()
                        self._wake.clear()
                        continue
                    outs = self.llm.step_outputs()
                    self._steps += 1
                    self._post(outs, self._snapshot())
            self._post([], self._snapshot())
        except BaseException as e:  # a step failed: no request can go on
            log.exception("engine thread: a step failed; failing every request")
            try:
                self._loop.call_soon_threadsafe(self._fail_all, f"engine failed: {e}")
            except RuntimeError:
                pass
