"""The engine's sampling, through its public API, on one tiny random Llama: the
distribution of top_k / top_p / temperature (many seeds on fixed logits), logprobs
against log_softmax, stopping at EOS, max_num_seqs=1, and prompts the KV pool cannot
hold.

The model's lm_head is scaled by 3 (logits of std ~2 rather than ~0.6), so that
temperature, top_k and top_p each change the distribution by far more than the
sampling noise of the frequencies below: every test of a distribution also shows that
the distribution without the parameter fails it."""

import json
import math
import shutil

import pytest
import torch
import transformers

from engine.llm import SamplingParams

from . import hf_models as hm

TINY = hm.TINY
PROMPT = hm.prompt(5)
N = 2000  # samples per distribution (the distributions without a parameter are 9+ sigma off)
SIGMAS = 5.0  # a frequency this many standard deviations off its probability fails
# K+V x block of 32 x 1 kv head x head_dim 16 x fp32 x 2 layers
BLOCK_BYTES = 2 * 32 * 1 * 16 * 4 * 2


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(directory, HF model) of TINY with its lm_head scaled by 3."""
    path = tmp_path_factory.mktemp("sampling")
    model = hm.random_model(transformers.LlamaConfig(**TINY), 21)
    with torch.no_grad():
        model.lm_head.weight.mul_(3.0)
    model.save_pretrained(path)
    return str(path), model


@pytest.fixture(scope="module")
def llm(tiny):
    return hm.engine(tiny[0], max_num_seqs=512)


# -- the distribution ----------------------------------------------------------------------


def expected(logits, temperature, top_k, top_p):
    """vLLM's sampling distribution in float64: softmax of logits / T; top_k keeps the k
    largest; top_p then keeps, of the renormalised rest, the largest whose ascending
    cumulative sum exceeds 1 - top_p (vLLM's apply_top_k_top_p); renormalised."""
    p = torch.softmax(logits.double() / temperature, -1)
    if top_k > 0:
        p[p < torch.topk(p, top_k).values[-1]] = 0
        p /= p.sum()
    if top_p < 1:
        sp, si = torch.sort(p)  # ascending
        drop = torch.cumsum(sp, 0) <= 1 - top_p
        drop[-1] = False  # the largest always stays
        p[si[drop]] = 0
        p /= p.sum()
    return p


def sigmas_off(counts, p, n):
    """The largest |count - n p| in binomial standard deviations, over the ids with p > 0."""
    keep = p > 0
    sd = (n * p[keep] * (1 - p[keep])).sqrt().clamp(min=1e-9)
    return ((counts[keep] - n * p[keep]).abs() / sd).max().item()


def bucketed(counts, p):
    """``(counts, p)`` with the ids expected fewer than 40 times pooled in one last bucket
    (so that a rare id's count is not judged by a normal approximation)."""
    small = p * N < 40
    return (
        torch.cat([counts[~small], counts[small].sum()[None]]),
        torch.cat([p[~small], p[small].sum()[None]]),
    )


def sample(llm, temperature, top_k, top_p):
    """N one-token samples after PROMPT (seeds 0..N-1) and the logits they were drawn from."""
    llm.record_logits = True
    try:
        params = [
            SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, seed=s, max_tokens=1)
            for s in range(N)
        ]
        outs = llm.generate([PROMPT] * N, params)
    finally:
        llm.record_logits = False
    logits = torch.stack([o.logits[0] for o in outs])
    return torch.tensor([o.token_ids[0] for o in outs]), logits


# (temperature, top_k, top_p; what the same samples must not pass: the distribution
# without one of the three)
DISTRIBUTIONS = [
    (0.7, 5, 1.0, [(1.0, 5, 1.0), (0.7, 6, 1.0)]),
    (1.0, 0, 0.6, [(1.0, 0, 1.0), (1.0, 0, 0.8)]),
    (0.8, 8, 0.7, [(0.8, 8, 1.0), (0.8, 0, 0.7), (1.0, 8, 0.7)]),
    (1.5, 0, 1.0, [(1.0, 0, 1.0)]),
]


@pytest.mark.parametrize("temperature,top_k,top_p,others", DISTRIBUTIONS)
def test_sampling_distribution(llm, temperature, top_k, top_p, others):
    """Only the ids the parameters keep appear (each step's own recorded logits), and
    their frequencies lie within 5 sigma of the renormalised softmax; those of the
    distributions without one of the parameters do not. Without top_k and top_p (the
    last case) the ids of a small probability are pooled in one bucket."""
    ids, logits = sample(llm, temperature, top_k, top_p)
    assert (logits == logits[0]).all()  # one prompt: the same logits in every request
    p = expected(logits[0], temperature, top_k, top_p)
    assert (p[ids] > 0).all(), "an id outside the kept set was sampled"
    counts = torch.bincount(ids, minlength=p.numel()).double()
    assert sigmas_off(*bucketed(counts, p), N) <= SIGMAS
    if top_k or top_p < 1:
        assert (counts[p * N >= 40] > 0).all()  # every likely kept id shows up
    for t, k, tp in others:
        q = expected(logits[0], t, k, tp)
        assert sigmas_off(*bucketed(counts, q), N) > SIGMAS, (t, k, tp)


def test_greedy_is_the_argmax_and_ignores_top_k_top_p(llm):
    logits = llm.prompt_logits(PROMPT)[-1]
    plain = SamplingParams(temperature=0, max_tokens=1)
    truncated = SamplingParams(temperature=0, top_k=3, top_p=0.1, seed=4, max_tokens=1)
    for sp in (plain, truncated):
        assert llm.generate([PROMPT], sp)[0].token_ids == [int(logits.argmax())]


# -- logprobs ------------------------------------------------------------------------------


def test_logprobs_are_log_softmax_of_the_raw_logits(llm, tiny):
    """Each generated token's logprob is log_softmax of the model's logits at that step
    (vLLM's raw logprobs: before temperature, top_k, top_p), the first step's also against
    HF's logits of the prompt."""
    _, hf = tiny
    sp = SamplingParams(
        temperature=0.8, top_k=20, top_p=0.9, seed=3, max_tokens=8, ignore_eos=True, logprobs=True
    )
    llm.record_logits = True
    try:
        out = llm.generate([PROMPT], sp)[0]
    finally:
        llm.record_logits = False
    assert len(out.logprobs) == len(out.token_ids) == 8
    for lp, tok, logits in zip(out.logprobs, out.token_ids, out.logits):
        want = torch.log_softmax(logits.double(), -1)[tok].item()
        assert lp == pytest.approx(want, abs=1e-5)
        scaled = torch.log_softmax(logits.double() / 0.8, -1)[tok].item()
        assert abs(scaled - want) > 1e-3  # the temperature's would differ
    with torch.no_grad():
        hf_logits = hf(torch.tensor([PROMPT])).logits[0, -1].double()
    assert out.logprobs[0] == pytest.approx(
        torch.log_softmax(hf_logits, -1)[out.token_ids[0]].item(), abs=1e-4
    )
    plain = llm.generate([PROMPT], SamplingParams(temperature=0.8, seed=3, max_tokens=2))[0]
    assert plain.logprobs is None


# -- stopping at EOS -----------------------------------------------------------------------


def test_stops_at_eos(tiny, tmp_path):
    """The checkpoint's eos_token_id (a list; the second id is one the model makes greedily
    after PROMPT, first at step 3 or later) ends the request there: finish_reason "stop",
    stop_reason None, the EOS token the last of token_ids; ignore_eos runs past it."""
    path, _ = tiny
    sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    greedy = hm.engine(path).generate([PROMPT], sp)[0].token_ids
    j = next(j for j in range(2, len(greedy)) if greedy[j] not in greedy[:j])
    unused = next(t for t in range(TINY["vocab_size"]) if t not in greedy)
    shutil.copytree(path, tmp_path / "m")
    cfg = json.loads((tmp_path / "m" / "config.json").read_text())
    cfg["eos_token_id"] = [unused, greedy[j]]
    (tmp_path / "m" / "config.json").write_text(json.dumps(cfg))
    llm = hm.engine(str(tmp_path / "m"))
    out = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=24))[0]
    assert out.token_ids == greedy[: j + 1]
    assert (out.finish_reason, out.stop_reason) == ("stop", None)
    assert llm.generate([PROMPT], sp)[0].token_ids == greedy  # ignore_eos
    assert llm.scheduler.idle()


# -- one sequence at a time ----------------------------------------------------------------


def test_max_num_seqs_1_runs_one_request_a_step(tiny):
    """With max_num_seqs=1 every step runs one request, and each request gets the tokens
    it gets alone (greedy and seeded sampling)."""
    path, _ = tiny
    prompts = [PROMPT, hm.prompt(40, 1), hm.prompt(3, 2)]
    params = [
        SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),
        SamplingParams(temperature=0.9, top_k=20, seed=11, max_tokens=6, ignore_eos=True),
        SamplingParams(temperature=1.2, top_p=0.8, seed=5, max_tokens=6, ignore_eos=True),
    ]
    alone = [hm.engine(path).generate([p], sp)[0].token_ids for p, sp in zip(prompts, params)]
    llm = hm.engine(path, max_num_seqs=1)
    outs = llm.generate(prompts, params)
    assert [o.token_ids for o in outs] == alone
    assert all(o.finish_reason == "length" for o in outs)
    assert set(llm.steps) == {1} and len(llm.steps) == 3 * 6


# -- prompts the KV pool cannot hold -------------------------------------------------------


def test_prompt_larger_than_the_kv_pool(tiny):
    """A pool of 4 blocks of 32 tokens: a 129-token prompt fails on arrival; a 100-token
    one that decodes past 128 tokens fails when it outgrows the pool (alone, every block
    free), keeping the 29 tokens it made (its solo tokens); a short one beside them
    completes with its solo tokens; prompt_logits of a prompt past the pool raises."""
    path, _ = tiny
    sp = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    long, grows, short = hm.prompt(129), hm.prompt(100, 1), hm.prompt(7, 2)
    big = hm.engine(path)
    want_grows = big.generate([grows], sp)[0].token_ids
    want_short = big.generate([short], sp)[0].token_ids
    llm = hm.engine(path, kv_cache_memory=4 * BLOCK_BYTES)
    assert [g.num_blocks for g in llm.kv_cache_groups] == [4]
    a, b, c = llm.generate([long, grows, short], sp)
    assert a.finish_reason == "error" and a.token_ids == [] and "KV blocks" in a.error
    assert b.finish_reason == "error" and "KV blocks" in b.error
    assert b.token_ids == want_grows[: 4 * 32 - 100 + 1]
    assert c.finish_reason == "length" and c.token_ids == want_short
    assert llm.scheduler.idle()
    with pytest.raises(ValueError, match="KV blocks"):
        llm.prompt_logits(long)
    assert math.isfinite(llm.prompt_logits(short).sum().item())  # the engine still works
