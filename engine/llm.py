"""The engine's Python API: ``LLM(model).generate(prompts, SamplingParams(...))``.

Errors. A call's own mistakes raise before anything is scheduled (``engine.inputs``). A
request's mistakes fail that request alone while the others of the batch complete: bad
sampling values (``SamplingParams.problems``), a prompt that is not a string or token ids,
empty, out-of-vocabulary ids, as long as ``max_model_len`` or longer than the KV pool can
ever hold. Its :class:`RequestOutput` has ``finish_reason="error"`` and ``error``, the
ValueError's message naming the field (``"temperature: expected a finite number >= 0, got
-1.0"``); :meth:`LLM.generate_stream` yields ``(i, None, ValueError)`` for it. A request
that outgrows the KV pool while decoding (alone, every block free) fails the same way,
keeping the tokens it made.

Interrupts. A call that ends early (an exception, ``KeyboardInterrupt``, a stream closed
before its end) drops its unfinished requests and gives back every KV block and state
slot: the next call runs as on a fresh engine.

Threads. One call runs on an engine at a time: calls from other threads wait for it (a
lock), so each thread gets exactly what it would get alone. A stream holds the engine
from its first item until it is exhausted or closed; a second call from the thread that
holds an open stream raises RuntimeError instead of waiting for itself. A serving loop
(``engine.serve``) holds it with :meth:`LLM.serving` and calls :meth:`LLM.step_outputs`
while :meth:`LLM.add_request` and :meth:`LLM.abort` come from any thread.

torch's threads. The engine's own work runs with torch at ``LLM.torch_threads`` intra-op
threads (``engine.platform.engine_torch_threads``: 1 while numkern's kernels run on
Numba's pool; ``LLM(torch_threads=)`` overrides), and the caller's count is restored
when a call returns or raises, and before each item a stream yields: the caller's code
between a stream's tokens runs with its own settings.

Tensor parallelism. ``LLM(..., tensor_parallel_size=N)`` runs the model split across N
processes (``engine.dist``: spawned here, or torchrun's); this object is rank 0, which
schedules, samples and detokenises, and sends each step to the others. :meth:`close` (or
``with``) ends them; a rank lost mid-call raises ``engine.dist.DistError`` naming it.
"""

import contextlib
import threading
import weakref
from collections import deque

import numba
import torch

import numkern
from numkern.warmup import prepare as prepare_numba

from . import dist
from .args import EngineArgs
from .detokenize import Detokenizer
from .inputs import call_inputs, prompt_ids, unfit
from .models import DecoderModel
from .outputs import RequestOutput
from .platform import available_memory, engine_torch_threads, get_moe_isa, isa_overrides, log
from .platform import numba_threads as with_numba_threads
from .platform import torch_threads as with_torch_threads
from .runner import ModelRunner
from .sampling import SamplingParams, sample, top
from .scheduler import Request, Scheduler

KV_MEMORY_FRACTION = 0.3  # of available RAM when kv_cache_memory is not given
STEPS_KEPT = 10_000  # LLM.steps keeps the last this many (a long-running engine stays flat)


class LLM:
    def __init__(self, model, *, _runtime=None, **kw):
        """``LLM(model, **kw)``: the engine of ``EngineArgs(model=model, **kw)`` (every
        option, its default and its check: ``engine.args``), or of an :class:`EngineArgs`
        given as ``model``. Bad options raise ValueError naming the field before the
        checkpoint is read or any process starts.

        ``isa`` is validated against the CPU before the checkpoint is read and against
        each KV-cache group's shape when its geometry is made.

        Which tensors run in which type (``quantization``): ``self.weight_types`` (``{type:
        [HF names]}``), logged once. Under tensor parallelism (module docstring) rank 0 is
        this process; on every other rank (torchrun's) this constructor serves rank 0 and
        ends the process. :meth:`close` (or ``with LLM(...) as llm:``) ends the workers.
        ``_runtime`` is internal: a spawned worker's rank (``engine.dist``).
        """
        if isinstance(model, EngineArgs):
            if kw:
                raise TypeError(
                    f"LLM: options come in the EngineArgs or as keywords, not both: {sorted(kw)}"
                )
            args = model
        else:
            args = EngineArgs(model=model, **kw)
        self.args = args  # the options, the one place each is read from
        self.dtype = args.torch_dtype
        # the ISA overrides, resolved once (the one read of NUMKERN_ISA): an override this
        # CPU cannot run is an error before the checkpoint is read
        overrides = isa_overrides(args.isa, args._layout_isa)
        self.torch_threads = engine_torch_threads(args.torch_threads)
        self._closed = False
        # the ranks: joined (torchrun), spawned (their LLM built from these options), or
        # this process alone
        self.runtime = rt = _runtime or dist.start(args, LLM)
        if rt.world > 1:  # interpreter exit ends the workers and the group
            weakref.finalize(self, rt.close)
        try:
            self._build(args, overrides)
        except BaseException as e:  # the workers ended; a lost rank named
            rt.fail(e)
        if rt.world > 1:
            if rt.rank != 0:
                rt.serve(self)  # never returns: exits the process when rank 0 closes
            self.runner.driver = rt
            rt.begin_serving()

    def _build(self, args, overrides):
        """This rank's engine: its part of the checkpoint, the model, the KV cache and the
        scheduler (``args`` checked; ``overrides``: the attention's and the MoE's ISA)."""
        from .loader import load_checkpoint

        rt = self.runtime
        dtype = str(self.dtype).replace("torch.", "")
        attn_override, moe_override = overrides
        moe_isa = get_moe_isa(self.dtype, override=moe_override)
        # small torch ops only (platform.torch_threads); Numba at this rank's count
        with with_torch_threads(1), with_numba_threads(rt.numba_threads):
            # this rank's part only (check_split refuses a config that cannot split, by
            # field, before any weight is read)
            ckpt = load_checkpoint(
                args.model, dtype=self.dtype, progress=args.progress, shard=rt.shard
            )
            # Numba's fixed first-load cost (~0.3 s of Python, holding the GIL) beside the
            # weights' dequantizing and packing (torch ops, mostly without it): the first
            # token 1.73 -> 1.50 s (medians of 8 interleaved pairs) with a vCPU to spare,
            # no change with both busy (2-vCPU AMD EPYC VM)
            prepare_numba()
            # Numba's first call launches its pool, which sets the calling thread's OpenMP
            # thread count to Numba's: torch's too where the runtimes share it (omp). Here
            # that is undone with the load's count, not left inside the first request
            numba.get_num_threads()
            self.model = DecoderModel(
                ckpt,
                dtype=self.dtype,
                moe_isa=moe_isa,
                quantization=args.quantization,
                shard=rt.shard,
                comm=rt.comm,
            )
        self.config = ckpt.config
        self.weight_types = dict(self.model.quant.types)
        self.weight_summary = self.model.quant.summary()
        summary = "; ".join(self.weight_summary) or f"all dequantised to {dtype}"
        log.info("weights (quantization=%s): %s", args.quantization, summary)
        self.tokenizer = ckpt.tokenizer
        self.source = ckpt.source
        self.chat_template = ckpt.chat_template
        self.special_tokens = ckpt.special_tokens
        self.max_model_len = int(args.max_model_len or self.config.max_position_embeddings)
        # the KV-cache groups (one per distinct attention spec: window -> block size),
        # their geometries, caches and builders, and the GDN state slots: the runner's
        self.runner = ModelRunner(self.model)
        # each rank's budget: its share of the host's (the ranks on a host split it); rank
        # 0's figure on every rank, so that their pools agree (checked below)
        budget = args.kv_cache_memory or int(
            KV_MEMORY_FRACTION * available_memory() / rt.local_world
        )
        self.runner.initialize_kv_cache(
            rt.comm.broadcast_object(budget),
            dtype=self.dtype,
            max_model_len=self.max_model_len,
            block_size=args.block_size,
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            override=attn_override,
        )
        self.kv_cache_groups = tuple(g.info() for g in self.runner.kv_groups)
        self.state_groups = tuple(sg.info() for sg in self.runner.state_groups)
        rt.agree(
            "KV blocks per group and GDN state slots",
            [g.num_blocks for g in self.kv_cache_groups] + [g.num_slots for g in self.state_groups],
        )
        self.scheduler = Scheduler(
            self.runner.kv_groups,
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            slots=self.runner.slots,
        )
        self.eos = set(self.config.eos_token_id or [])
        # number of requests per executed step, the last STEPS_KEPT (for tests and stats)
        self.steps = deque(maxlen=STEPS_KEPT)
        self.record_logits = False  # keep each sampled step's logits (parity tests)
        self._lock = threading.Lock()  # one call at a time (module docstring, Threads)
        self._owner = None  # the thread ident of the call that holds it
        # add_request's and abort's, from any thread, for the next step (module docstring)
        self._inbox_lock = threading.Lock()
        self._inbox, self._aborted = [], set()
        # once per engine (a registry keyed by id() would miss a recycled id)
        arch = self.config.architecture
        log.info("engine: %s, KV-cache groups: %s", arch, self.runner.describe())

    def warmup(self, *, progress=True):
        """Compile, or load from Numba's disk cache, every kernel a step of this model
        runs, on one token of its own dtype and variants (``ModelRunner.warmup_cases``),
        so that no request pays for it and a request's timing is its own. With
        ``progress``, once a kernel compiles, a bar on stderr over the model's kernels
        naming each Numba function as it compiles (loaded from the disk cache: nothing
        shown). Returns ``numkern.warmup``'s timings: ``{kernel: seconds}``, and
        ``compiled``, the Numba functions compiled (0: all from the disk cache)."""
        with self._exclusive(), self._torch(), self.runtime.command("warmup"):
            return numkern.warmup(
                cases=self.runner.warmup_cases(),
                progress="compiling" if progress else False,
                desc=f"numkern kernels for {self.config.architecture}",
                leaves=self.runner.warmup_leaves(),
                # a rank compiles on its own share of the cores (all of them alone)
                workers=self.runtime.numba_threads,
            )

    @contextlib.contextmanager
    def _torch(self):
        """torch's thread count of the engine's own work inside the block, the caller's
        after (module docstring, torch's threads); Numba's too, at this rank's count, under
        tensor parallelism or ``threads_per_rank`` (``engine.dist``)."""
        with with_torch_threads(self.torch_threads), with_numba_threads(self.runtime.numba_threads):
            yield

    def close(self):
        """End the engine: under tensor parallelism its worker processes exit and the
        process group is destroyed (``engine.dist``). Idempotent; a later call on the
        engine raises RuntimeError. ``with LLM(...) as llm:`` closes on leaving."""
        self._closed = True
        self.runtime.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # -- requests ------------------------------------------------------------------------

    def _requests(self, prompts, params):
        """The call's requests; TypeError or ValueError for the call's own mistakes."""
        return [self._make(i, p, s) for i, (p, s) in enumerate(call_inputs(prompts, params))]

    def _make(self, i, prompt, params):
        ids, err = prompt_ids(prompt, self.tokenizer, self.config.vocab_size)
        req = Request(i, ids or [], params)
        err = err or params.problems() or unfit(ids, params, self)
        if err:
            req.finish_reason, req.error = "error", err
            return req
        if params.seed is not None:
            req.generator = torch.Generator().manual_seed(params.seed)
        if self.tokenizer is not None:  # (stop strings need one: unfit)
            req.detok = Detokenizer(self.tokenizer, stop=params.stop, min_tokens=params.min_tokens)
        return req

    def _finish_check(self, req):
        """Whether ``req``'s last token ends it, and why; a token that is part of the text
        (not an EOS or stop token that ends it) goes to its detokenizer, which looks for
        the stop strings in the text it adds (``engine.detokenize``)."""
        p, d = req.params, req.detok
        tok = req.output[-1]
        if len(req.output) <= p.min_tokens:
            if d is not None:
                d.add((tok,))
        elif tok in self.eos and not p.ignore_eos:
            req.finish_reason = "stop"
        elif tok in p.stop_token_ids:
            req.finish_reason, req.stop_reason = "stop", tok
        elif d is not None:
            hit = d.add((tok,))[1]
            if hit is not None:
                req.finish_reason, req.stop_reason = "stop", hit
        if req.finish_reason is None and (
            len(req.output) >= p.max_tokens or req.num_tokens >= self.max_model_len
        ):
            req.finish_reason = "length"

    # -- one step ------------------------------------------------------------------------

    def _admit(self):
        """The requests added and aborted since the last step: the new ones join the
        scheduler's queue; returns the aborted ones, taken out with their blocks and slot
        freed (finish_reason "abort")."""
        with self._inbox_lock:
            new, self._inbox = self._inbox, []
            aborted, self._aborted = self._aborted, set()
        for req in new:
            self.scheduler.add(req)
        if not aborted:
            return []
        gone = [r for r in self.scheduler.waiting + self.scheduler.running if r.rid in aborted]
        for req in gone:
            self.scheduler.drop(req)
            req.finish_reason = "abort"
        return gone

    def step(self):
        """Run one scheduler step; returns the requests that produced a token, failed or
        were aborted (:meth:`abort`)."""
        aborted = self._admit()
        plan = self.scheduler.schedule()
        if not plan.requests:
            if not plan.failed and self.scheduler.waiting:  # the oldest cannot be admitted
                stuck = self.scheduler.waiting[0]
                self.scheduler.fail(stuck)
                return [*aborted, stuck]
            return aborted + plan.failed
        chunks, rows, samplers, scored = [], [], [], []
        t0 = 0
        for req, n in zip(plan.requests, plan.chunks):
            c = req.computed
            chunks.append((req.token_ids(c, c + n), c, req.blocks, req.slot))
            if req.params.prompt_logprobs is not None:
                # the positions whose logits score a prompt token not scored yet (a
                # preempted request recomputes its prompt: those are kept)
                for pos in range(max(c, len(req.prompt_logprobs)), min(c + n, len(req.prompt) - 1)):
                    scored.append((req, t0 + pos - c, req.prompt[pos + 1]))
            t0 += n
            if c + n == req.num_tokens:
                rows.append(t0 - 1)
                samplers.append(req)
        logits = self.runner.execute(chunks, rows + [row for _, row, _ in scored])
        self.steps.append(len(plan.requests))
        for req, n in zip(plan.requests, plan.chunks):
            req.computed += n
        if scored:
            lps = torch.log_softmax(logits[len(samplers) :], -1)
            for (req, _, tok), lp in zip(scored, lps):
                req.prompt_logprobs.append((float(lp[tok]), top(lp, req.params.prompt_logprobs)))
        for j, req in enumerate(samplers):
            if self.record_logits:
                req.logits = [*(req.logits or []), logits[j].clone()]
            req.output.append(sample(req, logits, j, self.eos))
            self._finish_check(req)
            if req.finished:
                self.scheduler.free(req)
        return aborted + plan.failed + samplers

    # -- API -----------------------------------------------------------------------------

    @contextlib.contextmanager
    def _exclusive(self):
        """Hold the engine for one call (module docstring, Threads)."""
        if self._closed:
            raise RuntimeError("LLM: closed (close() was called); make a new LLM")
        me = threading.get_ident()
        if self._owner == me:
            raise RuntimeError(
                "LLM: this thread is already running a call on this engine (an unfinished "
                "generate_stream?); exhaust or close() it first"
            )
        with self._lock:
            self._owner = me
            try:
                yield
            finally:
                self._owner = None

    @contextlib.contextmanager
    def _held(self):
        """Hold the engine (:meth:`_exclusive`); on leaving, drop whatever requests are
        left: ended early (an exception, KeyboardInterrupt, a stream closed), a step may
        have stopped half-way, so the pools are rebuilt rather than unwound."""
        with self._exclusive():
            try:
                yield
            finally:
                with self._inbox_lock:
                    self._inbox, self._aborted = [], set()
                if not self.scheduler.idle():
                    self.scheduler.reset()

    def _serve(self, reqs):
        """Run ``reqs`` to their end, holding the engine; yield each request as it fails
        or makes a token."""
        with self._held():
            if self.has_work():
                raise RuntimeError("LLM: requests added by add_request wait for step()")
            for r in reqs:
                if r.finished:  # failed on arrival
                    yield r
                else:
                    self.scheduler.add(r)
            while self.scheduler.has_work():
                yield from self.step()

    # -- serving: requests from any thread, steps on one ---------------------------------

    @contextlib.contextmanager
    def serving(self):
        """Hold the engine for a serving loop on this thread (``engine.serve.worker``):
        inside, this thread calls :meth:`step_outputs` (or :meth:`step`) while any thread
        calls :meth:`add_request` and :meth:`abort`; other calls wait for the block's end
        (module docstring, Threads), and requests left unfinished then are dropped, every
        KV block and state slot freed. The engine's torch and Numba threads throughout."""
        with self._held(), self._torch():
            yield self

    def add_request(self, request_id, prompt, params):
        """Queue a request (a string or token ids) for the next step; thread-safe. Raises
        ValueError naming the field for one that cannot run (module docstring, Errors),
        before anything is queued. ``request_id``: any hashable, unique among the
        unfinished requests; it is the ``request_id`` of the request's outputs."""
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params: expected SamplingParams, got {params!r:.80}")
        req = self._make(request_id, prompt, params)  # (no torch thread count: global)
        if req.error:
            raise ValueError(req.error)
        with self._inbox_lock:
            self._inbox.append(req)

    def abort(self, request_id):
        """End an added request at the next step, its KV blocks and state slot freed; its
        last output has finish_reason "abort". Thread-safe; an id that is unknown or has
        finished is ignored."""
        with self._inbox_lock:
            self._aborted.add(request_id)

    def has_work(self):
        """Whether requests are queued or running (a step would do something)."""
        return bool(self._inbox) or self.scheduler.has_work()

    def step_outputs(self):
        """One :meth:`step`; a :class:`RequestOutput` so far of each request that made a
        token, failed or was aborted. Its ``text`` only grows from one output to the next
        (``_text``): what it adds is the stream's next piece."""
        return [RequestOutput.of(r, self._text(r)) for r in self.step()]

    def _text(self, req):
        """The output text as vLLM gives it (None without a tokenizer); while the request
        runs, what a stop string or a character's later bytes may change is held back
        (``engine.detokenize``): text once shown is never taken back."""
        if self.tokenizer is None or req.error:
            return None
        if req.finished:
            req.detok.finish()
        return req.detok.text

    def apply_chat_template(self, messages, *, add_generation_prompt=True, tokenize=False):
        """The checkpoint's chat template applied to ``messages``, a list of
        ``{"role": ..., "content": ...}`` dicts, as transformers' ``apply_chat_template``
        renders it (here the generation prompt is added by default, as in vLLM's chat).

        Returns the text, or with ``tokenize=True`` its token ids: special tokens in the
        text (``<|im_start|>``) become their ids and the tokenizer adds nothing, since a
        BOS the model wants is written by the template. Pass those ids to
        :meth:`generate`; a string prompt gets the tokenizer's BOS again.
        """
        from .chat import chat_prompt  # Jinja2 is imported on the first chat (~30 ms)

        return chat_prompt(self, messages, add_generation_prompt, tokenize)

    def prompt_logits(self, ids):
        """Logits [len(ids), vocab] fp32 of every position of one prompt (one prefill)."""
        checked, err = prompt_ids(ids, self.tokenizer, self.config.vocab_size)
        if err:
            raise ValueError(err.replace("prompt:", "ids:", 1))
        n = len(checked)
        with self._exclusive(), self._torch(), self.runner.reserve(n, name="ids") as taken:
            blocks, slot = taken
            return self.runner.execute([(checked, 0, blocks, slot)], range(n))

    def generate(self, prompts, sampling_params=None):
        """One :class:`RequestOutput` per prompt (a string or a list of token ids), in
        order. ``sampling_params``: one for all, or a list of one per prompt. A request
        that cannot run fails alone (module docstring, Errors)."""
        with self._torch():
            reqs = self._requests(prompts, sampling_params)
            for _ in self._serve(reqs):
                pass
            return [RequestOutput.of(r, self._text(r)) for r in reqs]

    def generate_stream(self, prompts, sampling_params=None):
        """Yield ``(prompt index, token id, text so far)`` as tokens are produced, and
        ``(prompt index, None, ValueError)`` for a request that fails.

        The text is what :meth:`generate` would return at that point (see ``_text``): no
        character shown is later taken back by a stop string, and a request's last text
        is its final one. The stream holds the engine until it is exhausted or closed.
        """
        with self._torch():
            reqs = self._requests(prompts, sampling_params)
        served = self._serve(reqs)
        try:
            while True:
                # the engine's threads for its step, the caller's for the caller's code
                with self._torch():
                    req = next(served, None)
                    if req is None:
                        return
                    if req.error:
                        item = req.rid, None, ValueError(req.error)
                    elif req.output:
                        item = req.rid, req.output[-1], self._text(req)
                    else:
                        continue
                yield item
        finally:
            with self._torch():
                served.close()
