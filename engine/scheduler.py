"""Continuous batching over a paged KV cache of one or more KV-cache groups.

Each step spends a token budget on every running decode (one token each) and then on
chunks of waiting prefills, oldest first. KV blocks are allocated per step in every
group at once (a request's chunk needs its blocks in each group, each of the group's
block size); when a pool runs out, the newest running request is preempted: its blocks
in every group are freed and it is recomputed later from its prompt and the tokens it
already generated, so its output is unchanged (greedy, or seeded sampling whose
generator state is kept).

Windowed freeing: in a sliding-window group of window W and block size B, a request
whose next query is at position c reads no key before ``c - W + 1``, so its blocks
wholly before that (``j < (c - W + 1) // B``; B is a multiple of the attention tiles'
32 keys) go back to the pool before the step, and its table entry becomes -1 (a block
the attention plan does not read). A request then holds at most
``ceil((W + chunk) / B) + 1`` blocks of the group.

State slots (GDN models, ``engine.gdn``): a request takes one slot of the state groups
when it is admitted and gives it back with its blocks (finished, failed or preempted: a
preempted request recomputes its state from its tokens). There are ``max_num_seqs``
slots, as many as requests may run at once, so admission never waits for one.
"""

from dataclasses import dataclass, field


# eq=False: a request equals only itself, so the scheduler's ``in`` and remove() test
# identity, not every field (a dataclass __eq__ builds two tuples: ~1 us a comparison)
@dataclass(eq=False)
class Request:
    rid: int
    prompt: list
    params: object
    output: list = field(default_factory=list)
    logprobs: list = field(default_factory=list)
    top_logprobs: list = field(default_factory=list)  # per output token: [(id, logprob)]
    prompt_logprobs: list = field(default_factory=list)  # per prompt token after the first
    blocks: list = field(default_factory=list)  # per KV-cache group: block ids (-1: freed)
    slot: int = -1  # its state slot in every GDN state group (-1: none)
    computed: int = 0  # tokens whose K/V are in the cache
    finish_reason: str | None = None
    stop_reason: int | str | None = None  # the stop token id or string that ended it
    error: str | None = None
    generator: object = None
    arrival: int = 0
    logits: list | None = None
    detok: object = None  # engine.detokenize.Detokenizer of its text (None: no tokenizer)

    @property
    def num_tokens(self):  # prompt and output, without joining them (a copy each time)
        return len(self.prompt) + len(self.output)

    def token_ids(self, start, stop):
        """``(prompt + output)[start:stop]`` without copying the whole prompt."""
        p = len(self.prompt)
        return self.prompt[start:stop] + self.output[max(start - p, 0) : max(stop - p, 0)]

    @property
    def finished(self):
        return self.finish_reason is not None


@dataclass
class StepPlan:
    requests: list  # scheduled requests, in batch order
    chunks: list  # tokens computed this step per request
    preempted: list
    failed: list = field(default_factory=list)  # requests that can never fit the pools


class Scheduler:
    def __init__(self, groups, *, max_num_seqs, max_num_batched_tokens, slots=None):
        """``groups``: the KV-cache groups (``engine.kv_cache.KVCacheGroup``, allocated);
        ``slots``: the GDN state groups' ``engine.gdn.SlotPool`` of ``max_num_seqs``
        slots, or None (no GDN layers)."""
        self.groups = list(groups)
        self.slots = slots
        self.max_num_seqs = max_num_seqs
        self.budget = max_num_batched_tokens
        self.waiting = []
        self.running = []
        self.num_preemptions = 0
        self._arrivals = 0

    def add(self, req):
        req.arrival = self._arrivals
        self._arrivals += 1
        req.blocks = [[] for _ in self.groups]
        self.waiting.append(req)

    def has_work(self):
        return bool(self.waiting or self.running)

    def idle(self):
        """No request and every block and slot free: the state between engine calls."""
        pools = [g.pool for g in self.groups] + ([self.slots] if self.slots is not None else [])
        return not self.has_work() and all(p.num_free == p.num_blocks for p in pools)

    def reset(self):
        """Drop every request and free every block and slot, whatever state a call that
        ended early (an exception or KeyboardInterrupt mid-step) left them in."""
        self.waiting, self.running = [], []
        for g in self.groups:
            g.pool.reset()
        if self.slots is not None:
            self.slots.reset()

    def _slide(self, req):
        """Free the sliding groups' blocks that lie wholly before the request's window."""
        c = req.computed
        for g, blocks in zip(self.groups, req.blocks):
            w, b = g.spec.sliding_window, g.spec.block_size
            if w <= 0:
                continue
            stale = [j for j in range(min(max(0, c - w + 1) // b, len(blocks))) if blocks[j] >= 0]
            if stale:
                g.pool.free([blocks[j] for j in stale])
                for j in stale:
                    blocks[j] = -1

    def _grow(self, req, upto):
        """Blocks for positions ``< upto`` in every group, or False (nothing taken)."""
        needs = [
            max(0, -(-upto // g.spec.block_size) - len(blocks))
            for g, blocks in zip(self.groups, req.blocks)
        ]
        if any(n > g.pool.num_free for g, n in zip(self.groups, needs)):
            return False
        for g, n, blocks in zip(self.groups, needs, req.blocks):
            if n:
                blocks += g.pool.allocate(n)
        return True

    def _release(self, req):
        for g, blocks in zip(self.groups, req.blocks):
            g.pool.free([b for b in blocks if b >= 0])
        req.blocks = [[] for _ in self.groups]
        if req.slot >= 0:
            self.slots.free([req.slot])
            req.slot = -1

    def _preempt(self, req):
        self._release(req)
        req.computed = 0
        self.running.remove(req)
        self.waiting.insert(0, req)
        self.num_preemptions += 1

    def pools(self):
        """The pools as text: blocks x tokens per KV-cache group."""
        return ", ".join(f"{g.pool.num_blocks} x {g.spec.block_size}" for g in self.groups)

    def fail(self, req):
        """End ``req`` with an error: it needs more KV blocks than the pools hold."""
        req.finish_reason = "error"
        req.error = (
            f"request needs more KV blocks than the pools hold (blocks x tokens per KV-cache "
            f"group: {self.pools()})"
        )
        self.drop(req)

    def drop(self, req):
        """Take ``req`` out, waiting or running, and give back its blocks and slot."""
        self.free(req)
        if req in self.waiting:
            self.waiting.remove(req)

    def free(self, req):
        self._release(req)
        if req in self.running:
            self.running.remove(req)

    def schedule(self):
        budget = self.budget
        scheduled, chunks, preempted, failed = [], [], [], []
        # running requests: decodes (and unfinished chunked prefills), oldest first
        for req in sorted(self.running, key=lambda r: r.arrival):
            if req not in self.running or budget == 0:
                continue
            n = min(req.num_tokens - req.computed, budget)
            self._slide(req)
            while not self._grow(req, req.computed + n):
                if self.running == [req]:  # alone, with every pool free: it never fits
                    self.fail(req)
                    failed.append(req)
                    break
                victim = max(self.running, key=lambda r: r.arrival)
                self._preempt(victim)
                preempted.append(victim)
                if victim is req:
                    break
            if req not in self.running:
                continue
            scheduled.append(req)
            chunks.append(n)
            budget -= n
        # waiting requests: prefill chunks while budget, sequence slots and blocks last
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            req = self.waiting[0]
            n = min(req.num_tokens - req.computed, budget)
            if not self._grow(req, req.computed + n):
                break
            if self.slots is not None:  # (never short: as many slots as running requests)
                req.slot = self.slots.allocate(1)[0]
            self.waiting.pop(0)
            self.running.append(req)
            scheduled.append(req)
            chunks.append(n)
            budget -= n
        return StepPlan(scheduled, chunks, preempted, failed)
