"""The model runner: a scheduled step's requests -> the step's arrays -> the model -> logits.

Per step it builds, in NumPy (a step is a few small arrays; a torch op on them costs
~5-10 us each, ~0.3 ms a decode step): the token ids and positions of each request's
chunk, ``query_start_loc`` and ``seq_lens``, and for the KV-cache group its block table
and slot mapping (slot ``s`` of position ``p``: block ``table[p // B]``, offset
``p % B``, with the group's own block size ``B``). The group's metadata builder turns
them into the step's attention plan (validated once), and the model runs its one
forward path on it. Sampling, stop strings and text stay with :class:`engine.LLM`.
"""

import numpy as np
import torch


class ModelRunner:
    def __init__(self, model, group, builder):
        self.model = model
        self.group = group  # the KV-cache group (its pool, caches and spec)
        self.builder = builder  # its AttentionMetadataBuilder
        self.block_size = group.spec.block_size
        model.bind(group.caches)

    def execute(self, chunks, logits_rows):
        """Run one step. ``chunks``: per request ``(token ids [n], first position, block
        ids)``, its next ``n`` tokens at positions ``first..first+n-1``, its blocks
        covering them; ``logits_rows``: the step's token rows to return logits of.
        Returns logits ``[len(logits_rows), vocab]`` fp32."""
        b = self.block_size
        r_n = len(chunks)
        lens = np.array([len(ids) for ids, _, _ in chunks], np.int64)
        qsl = np.zeros(r_n + 1, np.int32)
        np.cumsum(lens, out=qsl[1:])
        t_n = int(qsl[-1])
        width = max(len(blocks) for _, _, blocks in chunks)
        bt = np.full((r_n, width), -1, np.int32)  # unused entries: no block (checked)
        sl = np.empty(r_n, np.int32)
        ids = np.empty(t_n, np.int64)
        pos = np.empty(t_n, np.int64)
        for i, (tok, first, blocks) in enumerate(chunks):
            t0, n = int(qsl[i]), len(tok)
            bt[i, : len(blocks)] = blocks
            ids[t0 : t0 + n] = tok
            pos[t0 : t0 + n] = np.arange(first, first + n)
            sl[i] = first + n
        slots = bt[np.repeat(np.arange(r_n), lens), pos // b].astype(np.int64) * b + pos % b
        plan = self.builder.build(qsl, sl, bt, slots, num_blocks=self.group.pool.num_blocks)
        rows = torch.as_tensor(np.asarray(logits_rows, np.int64))
        return self.model.forward(torch.from_numpy(ids), torch.from_numpy(pos), plan, rows)
