"""The model runner: a scheduled step's requests -> the step's arrays -> the model -> logits.

Per step it builds, in NumPy (a step is a few small arrays; a torch op on them costs
~5-10 us each, ~0.3 ms a decode step): the token ids and positions of each request's
chunk, ``query_start_loc`` and ``seq_lens``, and for each KV-cache group its block table
and slot mapping (slot ``s`` of position ``p``: block ``table[p // B]``, offset
``p % B``, with the group's own block size ``B``; a block freed as a sliding window
moved on is -1, as is the padding). Each group's metadata builder turns them into the
group's attention plan (validated once), and the model runs its one forward path on
the step's plans. Sampling, stop strings and text stay with :class:`engine.LLM`.
"""

import numpy as np
import torch


class ModelRunner:
    def __init__(self, model, groups):
        """``groups``: ``(KVCacheGroup, AttentionMetadataBuilder)`` per KV-cache group."""
        self.model = model
        self.groups = list(groups)
        model.bind(
            {name: t for g, _ in self.groups for name, t in g.caches.items()},
            {name: i for i, (g, _) in enumerate(self.groups) for name in g.layer_names},
        )

    def execute(self, chunks, logits_rows):
        """Run one step. ``chunks``: per request ``(token ids [n], first position, blocks)``,
        its next ``n`` tokens at positions ``first..first+n-1`` and, per KV-cache group,
        its block ids covering them (-1: freed); ``logits_rows``: the step's token rows to
        return logits of. Returns logits ``[len(logits_rows), vocab]`` fp32."""
        r_n = len(chunks)
        lens = np.array([len(ids) for ids, _, _ in chunks], np.int64)
        qsl = np.zeros(r_n + 1, np.int32)
        np.cumsum(lens, out=qsl[1:])
        t_n = int(qsl[-1])
        sl = np.empty(r_n, np.int32)
        ids = np.empty(t_n, np.int64)
        pos = np.empty(t_n, np.int64)
        for i, (tok, first, _) in enumerate(chunks):
            t0, n = int(qsl[i]), len(tok)
            ids[t0 : t0 + n] = tok
            pos[t0 : t0 + n] = np.arange(first, first + n)
            sl[i] = first + n
        req_of_token = np.repeat(np.arange(r_n), lens)
        plans = []
        for g, (group, builder) in enumerate(self.groups):
            b = group.spec.block_size
            width = max(len(blocks[g]) for _, _, blocks in chunks)
            bt = np.full((r_n, width), -1, np.int32)  # unused entries: no block (checked)
            for i, (_, _, blocks) in enumerate(chunks):
                bt[i, : len(blocks[g])] = blocks[g]
            slots = bt[req_of_token, pos // b].astype(np.int64) * b + pos % b
            nb = group.pool.num_blocks
            plans.append(builder.build(qsl, sl, bt, slots, num_blocks=nb))
        rows = torch.as_tensor(np.asarray(logits_rows, np.int64))
        return self.model.forward(torch.from_numpy(ids), torch.from_numpy(pos), tuple(plans), rows)
