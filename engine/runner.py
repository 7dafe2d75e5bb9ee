"""The model runner: the KV cache and state slots, and a scheduled step's requests -> the
step's arrays -> the model -> logits.

Once, :meth:`ModelRunner.initialize_kv_cache` (as vLLM's CPU/GPU model runner does):
the attention layers' KV-cache groups (one per distinct spec, in layer order), the GDN
layers' state groups, the memory budget split between them, each group's geometry
(``numkern.attention.CacheGeometry``, resolved once), block pool, caches and metadata
builder, and the model bound to the caches' views (each made for its group's geometry).

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

import contextlib
import itertools

import numpy as np
import torch

from numkern import attention as A

from .attention import AttentionMetadataBuilder
from .gdn import SlotPool, gdn_step, group_states
from .kv_cache import blocks_per_group, group_layers, layer_spec


class ModelRunner:
    def __init__(self, model):
        """``model``: an ``engine.models.DecoderModel``; :meth:`initialize_kv_cache` next."""
        self.model = model
        self.groups = []  # (KVCacheGroup, AttentionMetadataBuilder) per KV-cache group
        self.state_groups = []  # the GDN layers' engine.gdn.StateGroup (allocated)
        self.slots = None  # the state groups' SlotPool (None: no GDN layers)
        self.has_states = False
        # rank 0 of a tensor-parallel engine: its engine.dist.Runtime, which sends each
        # step to the other ranks before it runs here (None: one process, or a worker)
        self.driver = None

    @property
    def kv_groups(self):
        """The KV-cache groups (``engine.kv_cache.KVCacheGroup``, allocated), in order."""
        return [g for g, _ in self.groups]

    def describe(self):
        """The KV-cache groups and GDN state groups, allocated, in one line (the log's)."""
        kv = "; ".join(
            f"{len(g.layer_names)} layers, window {g.sliding_window}, {g.num_blocks} "
            f"blocks of {g.block_size}, isa {g.isa}"
            for g in (g.info() for g in self.kv_groups)
        )
        return kv + "".join(
            f"; GDN state group: {len(g.layer_names)} layers, {g.num_slots} slots of conv "
            f"{g.conv_state_shape} {g.conv_state_dtype} + recurrent {g.ssm_state_shape} fp32"
            for g in (sg.info() for sg in self.state_groups)
        )

    def initialize_kv_cache(
        self,
        budget,
        *,
        block_size,
        dtype,
        max_num_seqs,
        max_num_batched_tokens,
        max_model_len,
        override=None,
    ):
        """Make and allocate the KV-cache groups and GDN state groups in ``budget`` bytes,
        and bind the model to them. ``block_size``: the engine's (a sliding group's follows
        its window: ``engine.kv_cache.layer_spec``); ``override``: the engine's resolved
        attention ISA override (``engine.platform.isa_overrides``) or None. The GDN states,
        a slot per running request, are taken from the budget first (ValueError naming
        ``kv_cache_memory`` when they leave no room); the KV blocks share the rest
        (``engine.kv_cache.blocks_per_group``)."""
        layers = {a.name: a for a in self.model.attention_layers()}
        specs = {n: layer_spec(a, block_size, dtype) for n, a in layers.items()}
        groups = group_layers(specs)
        states = group_states({m.name: m.spec() for m in self.model.gdn_layers()})
        state_bytes = max_num_seqs * sum(sg.bytes_per_slot() for sg in states)
        if state_bytes >= budget:
            raise ValueError(
                f"kv_cache_memory: {budget} bytes do not hold the GDN states of max_num_seqs="
                f"{max_num_seqs} requests ({state_bytes} bytes) and any KV block"
            )
        for sg in states:
            sg.allocate(max_num_seqs)
        counts = blocks_per_group(
            groups,
            budget - state_bytes,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            max_model_len=max_model_len,
        )
        for g, n in zip(groups, counts):
            g.allocate(n, override=override)
        builders = [AttentionMetadataBuilder(g, [layers[n] for n in g.layer_names]) for g in groups]
        self.groups = list(zip(groups, builders))
        self.state_groups = states
        self.slots = SlotPool(max_num_seqs) if states else None
        self.has_states = bool(states)
        self.model.bind(
            {n: A.cache_view(t, g.geometry) for g in groups for n, t in g.caches.items()},
            {name: i for i, g in enumerate(groups) for name in g.layer_names},
            {n: (sg.conv[n], sg.ssm[n]) for sg in states for n in sg.layer_names},
        )

    @contextlib.contextmanager
    def reserve(self, num_tokens, *, name="ids"):
        """Blocks of every KV-cache group for positions ``0..num_tokens-1`` and a GDN state
        slot (-1: no GDN layers), as ``(blocks per group, slot)``, given back when the block
        exits. ValueError naming ``name`` when the free blocks or slots do not hold them
        (nothing taken)."""
        taken, slot = [], None
        try:
            for g, _ in self.groups:
                blocks = g.pool.allocate(-(-num_tokens // g.geometry.block_size))
                if blocks is None:
                    raise ValueError(f"{name}: {num_tokens} tokens do not fit the free KV blocks")
                taken.append((g, blocks))
            if self.slots is not None:
                slot = self.slots.allocate(1)
                if slot is None:
                    raise ValueError(f"{name}: no free GDN state slot (every one runs a request)")
            yield [b for _, b in taken], (slot[0] if slot else -1)
        finally:
            for g, blocks in taken:
                g.pool.free(blocks)
            if slot:
                self.slots.free(slot)

    def execute(self, chunks, logits_rows):
        """Run one step. ``chunks``: per request ``(token ids [n], first position, blocks,
        state slot)``, its next ``n`` tokens at positions ``first..first+n-1``, per KV-cache
        group its block ids covering them (-1: freed), and its GDN state slot (-1: none);
        ``logits_rows``: the step's token rows to return logits of. Returns logits
        ``[len(logits_rows), vocab]`` fp32. On rank 0 of a tensor-parallel engine every
        rank runs the same step (``engine.dist.Runtime.command``)."""
        if self.driver is not None:
            with self.driver.command("execute", chunks, logits_rows):
                return self._execute(chunks, logits_rows)
        return self._execute(chunks, logits_rows)

    def _execute(self, chunks, logits_rows):
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
            b = group.geometry.block_size
            tables = [c[2][g] for c in chunks]
            width = max(map(len, tables))
            # unused entries: -1, no block (checked)
            rows = [t if len(t) == width else [*t, *[-1] * (width - len(t))] for t in tables]
            bt = np.array(rows, np.int32).reshape(r_n, width)
            if req_of_token is None:
                slots = np.array([t[p // b] * b + p % b for t, p in zip(tables, firsts)], np.int64)
            else:
                slots = bt[req_of_token, pos // b].astype(np.int64) * b + pos % b
            plans.append(builder.build(qsl, sl, bt, slots))
        return ids, pos, lens, plans

    def warmup_leaves(self):
        """``numkern.warmup``'s leaves: kernels the decoder's run calls inside it, which
        compile helper processes build beside it on a cold start (the decoder then loads
        them): the attention of each KV-cache group's geometry, the packed linear, and
        the quantised GEMMs' block kernel where the model keeps quantised weights."""
        dt = str(self.model.dtype).removeprefix("torch.")
        leaves = []
        for g, _ in self.groups:
            geo = g.geometry
            leaves.append(
                (
                    "attention",
                    {
                        "dtype": str(geo.dtype).removeprefix("torch."),
                        "isa": geo.isa,
                        "head_dim": geo.head_dim,
                        "num_heads": self.model.hq,
                        "num_kv_heads": geo.num_kv_heads,
                        "block_size": geo.block_size,
                    },
                )
            )
        leaves.append(("packed_linear", {"dtype": dt}))
        if self.model.quant.nbytes:  # first: the decoder reaches it early
            leaves.insert(0, ("quant_blocks", {"dtype": dt}))
        return _unique(leaves)

    def warmup_cases(self):
        """``numkern.warmup``'s cases for the kernels a step of this model runs: the
        attention plans (one case; a plan per KV-cache group), then the model's own
        (:meth:`DecoderModel.warmup_cases`), on one token at position 0 in block 0 of each
        group. For an idle engine: nothing a request reads is written."""
        made = []

        def plan():
            made[:] = self._step([([0], 0, [[0]] * len(self.groups), 0)])[3]

        isas = "/".join(sorted({g.geometry.isa for g, _ in self.groups}))
        return [(f"attention plan ({isas})", plan), *self.model.warmup_cases(lambda: made)]


def _unique(leaves):
    """``leaves`` without repeats (groups of one geometry), in order."""
    out = []
    for leaf in leaves:
        if leaf not in out:
            out.append(leaf)
    return out
