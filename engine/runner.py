"""The model runner: a scheduled step's requests -> the step's arrays -> the model -> logits.

Per step it builds, in NumPy (a step is a few small arrays; a torch op on them costs
~5-10 us each, ~0.3 ms a decode step), from Python lists with one NumPy call per array
(a decode step's arrays: 8 us at batch 1, 14 us at batch 8, against 20 and 39 us with
per-request slices; more in a real step, where the kernels before it have evicted the
Python objects from the caches): the token ids and positions of each request's
chunk, ``query_start_loc`` and ``seq_lens``, and for each KV-cache group its block table
and slot mapping (slot ``s`` of position ``p``: block ``table[p // B]``, offset
``p % B``, with the group's own block size ``B``; a block freed as a sliding window
moved on is -1, as is the padding). Each group's metadata builder turns them into the
group's attention plan (validated once), and the model runs its one forward path on
the step's plans. A GDN model also gets the step's :class:`engine.gdn.GDNStep` (each
request's state slot, and whether it continues a state). Sampling, stop strings and text
stay with :class:`engine.LLM`.
"""

import itertools

import numpy as np
import torch

from .gdn import gdn_step


class ModelRunner:
    def __init__(self, model, groups, state_groups=()):
        """``groups``: ``(KVCacheGroup, AttentionMetadataBuilder)`` per KV-cache group;
        ``state_groups``: the GDN layers' ``engine.gdn.StateGroup`` (allocated)."""
        self.model = model
        self.groups = list(groups)
        self.has_states = bool(state_groups)
        model.bind(
            {name: t for g, _ in self.groups for name, t in g.caches.items()},
            {name: i for i, (g, _) in enumerate(self.groups) for name in g.layer_names},
            {n: (sg.conv[n], sg.ssm[n]) for sg in state_groups for n in sg.layer_names},
        )

    def execute(self, chunks, logits_rows):
        """Run one step. ``chunks``: per request ``(token ids [n], first position, blocks,
        state slot)``, its next ``n`` tokens at positions ``first..first+n-1``, per KV-cache
        group its block ids covering them (-1: freed), and its GDN state slot (-1: none);
        ``logits_rows``: the step's token rows to return logits of. Returns logits
        ``[len(logits_rows), vocab]`` fp32."""
        ids, pos, lens, plans = self._step(chunks)
        rows = torch.from_numpy(np.array(logits_rows, np.int64))  # (as_tensor: 20 us more)
        states = None
        if self.has_states:
            slots = [c[3] for c in chunks]
            if min(slots) < 0:
                raise ValueError(f"chunks: a GDN model needs a state slot per request, got {slots}")
            states = gdn_step(lens, slots, [c[1] > 0 for c in chunks])
        ids_t, pos_t = torch.from_numpy(ids), torch.from_numpy(pos)
        return self.model.forward(ids_t, pos_t, tuple(plans), rows, states)

    def _step(self, chunks):
        """The step's token ids, positions (int64 ``[T]``), tokens per request (a list)
        and the attention plan of each KV-cache group."""
        r_n = len(chunks)
        lens = [len(c[0]) for c in chunks]
        firsts = [c[1] for c in chunks]
        qsl = np.zeros(r_n + 1, np.int32)
        qsl[1:] = list(itertools.accumulate(lens))
        t_n = int(qsl[-1])
        sl = np.array([f + n for f, n in zip(firsts, lens)], np.int32)
        if lens.count(1) == r_n:  # a decode step: one token per request, slots in Python
            ids = np.array([c[0][0] for c in chunks], np.int64)
            pos = np.array(firsts, np.int64)
            req_of_token = None
        else:
            ids = np.fromiter(itertools.chain.from_iterable(c[0] for c in chunks), np.int64, t_n)
            req_of_token = np.repeat(np.arange(r_n), lens)
            # position of token t of request r: first_r + t - qsl[r]
            pos = (
                np.arange(t_n, dtype=np.int64)
                + (np.array(firsts, np.int64) - qsl[:-1])[req_of_token]
            )
        plans = []
        for g, (group, builder) in enumerate(self.groups):
            b = group.spec.block_size
            tables = [c[2][g] for c in chunks]
            width = max(map(len, tables))
            # unused entries: -1, no block (checked)
            rows = [t if len(t) == width else [*t, *[-1] * (width - len(t))] for t in tables]
            bt = np.array(rows, np.int32).reshape(r_n, width)
            if req_of_token is None:
                slots = np.array([t[p // b] * b + p % b for t, p in zip(tables, firsts)], np.int64)
            else:
                slots = bt[req_of_token, pos // b].astype(np.int64) * b + pos % b
            nb = group.pool.num_blocks
            plans.append(builder.build(qsl, sl, bt, slots, num_blocks=nb))
        return ids, pos, lens, plans

    def warmup_cases(self):
        """``numkern.warmup``'s cases for the kernels a step of this model runs: the
        attention plans (one case; a plan per KV-cache group), then the model's own
        (:meth:`DecoderModel.warmup_cases`), on one token at position 0 in block 0 of each
        group. For an idle engine: nothing a request reads is written."""
        made = []

        def plan():
            made[:] = self._step([([0], 0, [[0]] * len(self.groups), 0)])[3]

        isas = "/".join(sorted({b.isa for _, b in self.groups}))
        return [(f"attention plan ({isas})", plan), *self.model.warmup_cases(lambda: made)]
