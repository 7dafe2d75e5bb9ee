"""Continuous batching over a paged KV cache.

Each step spends a token budget on every running decode (one token each) and then on
chunks of waiting prefills, oldest first. KV blocks are allocated per step; when the
pool runs out, the newest running request is preempted: its blocks are freed and it is
recomputed later from its prompt and the tokens it already generated, so its output is
unchanged (greedy, or seeded sampling whose generator state is kept).
"""

from dataclasses import dataclass, field


@dataclass
class Request:
    rid: int
    prompt: list
    params: object
    output: list = field(default_factory=list)
    logprobs: list = field(default_factory=list)
    blocks: list = field(default_factory=list)
    computed: int = 0  # tokens whose K/V are in the cache
    finish_reason: str | None = None
    stop_reason: int | str | None = None  # the stop token id or string that ended it
    error: str | None = None
    generator: object = None
    arrival: int = 0
    logits: list | None = None

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


class Scheduler:
    def __init__(self, pool, block_size, *, max_num_seqs, max_num_batched_tokens):
        self.pool = pool
        self.block_size = block_size
        self.max_num_seqs = max_num_seqs
        self.budget = max_num_batched_tokens
        self.waiting = []
        self.running = []
        self.num_preemptions = 0
        self._arrivals = 0

    def add(self, req):
        req.arrival = self._arrivals
        self._arrivals += 1
        self.waiting.append(req)

    def has_work(self):
        return bool(self.waiting or self.running)

    def _blocks_needed(self, req, upto):
        return max(0, -(-upto // self.block_size) - len(req.blocks))

    def _grow(self, req, upto):
        n = self._blocks_needed(req, upto)
        if n == 0:
            return True
        got = self.pool.allocate(n)
        if got is None:
            return False
        req.blocks += got
        return True

    def _preempt(self, req):
        self.pool.free(req.blocks)
        req.blocks = []
        req.computed = 0
        self.running.remove(req)
        self.waiting.insert(0, req)
        self.num_preemptions += 1

    def free(self, req):
        self.pool.free(req.blocks)
        req.blocks = []
        if req in self.running:
            self.running.remove(req)

    def schedule(self):
        budget = self.budget
        scheduled, chunks, preempted = [], [], []
        # running requests: decodes (and unfinished chunked prefills), oldest first
        for req in sorted(self.running, key=lambda r: r.arrival):
            if req not in self.running or budget == 0:
                continue
            n = min(req.num_tokens - req.computed, budget)
            while not self._grow(req, req.computed + n):
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
            self.waiting.pop(0)
            self.running.append(req)
            scheduled.append(req)
            chunks.append(n)
            budget -= n
        return StepPlan(scheduled, chunks, preempted)
