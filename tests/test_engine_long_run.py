"""The engine as a server runs it: 500 requests of random lengths, ten calls of 50,
through a KV pool so small that requests are preempted and recomputed all the time
(heavy: 15-36 s on 2 vCPUs of an AMD EPYC, shared with other jobs).

Every request gets the tokens it gets alone (greedy, and seeded sampling whose generator
survives preemption), and the process's memory stays flat from call to call: nothing
a finished request held (blocks, slots, token lists, logits) is kept."""

import random

import pytest

from engine.llm import SamplingParams

from . import hf_models as hm
from .test_engine_faults import BLOCK_BYTES, rss_bytes, tiny_checkpoint

REQUESTS = 500
CALLS = 10
DISTINCT = 60  # requests drawn (with repeats) from this many prompt/params pairs
# 8 blocks of 32 tokens: the longest request (96 + 24 tokens, 4 blocks) fits alone,
# four average ones do not fit together, and up to 16 are admitted at once
POOL_BLOCKS = 8
# RSS growth allowed from the end of call 2 to the end of call 10: measured 0.13 MB
# (about 1,950 steps, 307 preemptions); the logits of every token kept would add 6 MB
RSS_SLACK = 4 << 20


@pytest.mark.heavy
def test_500_requests_under_kv_pressure_keep_solo_tokens_and_flat_memory(tmp_path):
    tiny_checkpoint(tmp_path)
    rng = random.Random(15)
    distinct = []
    for k in range(DISTINCT):
        n, m = rng.randint(1, 96), rng.randint(1, 24)
        if k % 2:
            sp = SamplingParams(temperature=0, max_tokens=m, ignore_eos=True)
        else:
            sp = SamplingParams(temperature=0.8, top_p=0.95, seed=k, max_tokens=m,
                                ignore_eos=True)  # fmt: skip
        distinct.append((hm.prompt(n, k), sp))
    alone = hm.engine(str(tmp_path))
    solo = [alone.generate([p], sp)[0].token_ids for p, sp in distinct]

    llm = hm.engine(str(tmp_path), kv_cache_memory=POOL_BLOCKS * BLOCK_BYTES, max_num_seqs=16,
                    max_num_batched_tokens=64)  # fmt: skip
    assert [g.num_blocks for g in llm.kv_cache_groups] == [POOL_BLOCKS]
    picks = [rng.randrange(DISTINCT) for _ in range(REQUESTS)]
    per_call = REQUESTS // CALLS
    rss = []
    for c in range(CALLS):
        batch = picks[c * per_call : (c + 1) * per_call]
        outs = llm.generate([distinct[k][0] for k in batch], [distinct[k][1] for k in batch])
        assert [o.token_ids for o in outs] == [solo[k] for k in batch], c
        assert llm.scheduler.idle()
        rss.append(rss_bytes())
    assert llm.scheduler.num_preemptions >= REQUESTS // 10, llm.scheduler.num_preemptions
    assert max(rss[2:]) - rss[1] <= RSS_SLACK, [r >> 20 for r in rss]
