"""torch's thread count around the engine's calls (engine.llm, torch's threads): the
engine's own work runs at ``LLM.torch_threads`` and the caller's count comes back after
``generate``, ``prompt_logits`` and ``warmup``, after a call that raises, and around
every item of ``generate_stream`` (also one closed early or whose consumer raises); the
rule and its decision log line (``engine.platform.engine_torch_threads``). And the
step's fixed costs cut without changing an output: top-p's nucleus from a few sorted
tokens, bit for bit the full sort's.

One tiny random Llama (head_dim 16, fp32), saved once per module. The count inside a
step is read by a wrapper of ``runner.execute`` (what a step runs the model with)."""

import logging
import math

import pytest
import torch
import transformers

from engine import platform
from engine.llm import SamplingParams
from engine.sampling import _top_p

from . import hf_models as hm

GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
SAMPLED = SamplingParams(
    temperature=0.9, top_k=20, top_p=0.8, seed=3, max_tokens=4, ignore_eos=True
)
CALLER = 3  # the caller's count in these tests: neither the engine's 1 nor a default


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_threads")
    hm.random_model(transformers.LlamaConfig(**hm.TINY), 21).save_pretrained(path)
    return str(path)


@pytest.fixture
def caller_threads():
    """torch at CALLER threads in this test, the process's count again after it."""
    saved = torch.get_num_threads()
    torch.set_num_threads(CALLER)
    try:
        yield CALLER
    finally:
        torch.set_num_threads(saved)


def _record(llm, monkeypatch, fail_at=None):
    """The torch thread count each step ran with (``execute`` wrapped); the step numbered
    ``fail_at`` raises instead."""
    seen = []
    execute = llm.runner.execute

    def traced(*args):
        seen.append(torch.get_num_threads())
        if len(seen) == fail_at:
            raise ValueError("a step that fails")
        return execute(*args)

    monkeypatch.setattr(llm.runner, "execute", traced)
    return seen


def test_the_engine_runs_at_its_count_and_gives_the_caller_s_back(
    tiny, caller_threads, monkeypatch
):
    llm = hm.engine(tiny)
    assert llm.torch_threads == 1  # the rule: numkern's kernels on Numba's pool
    assert torch.get_num_threads() == CALLER  # the load restored it too
    seen = _record(llm, monkeypatch)
    prompts = [hm.prompt(5), hm.prompt(9, 1)]
    want = [o.token_ids for o in llm.generate(prompts, [GREEDY, SAMPLED])]
    assert len(seen) == 4 and set(seen) == {1}  # a prefill step, three decode steps
    assert torch.get_num_threads() == CALLER

    # a stream: the engine's count in each step, the caller's at each item it yields
    seen.clear()
    tokens, between = {}, []
    for i, tok, _ in llm.generate_stream(prompts, [GREEDY, SAMPLED]):
        between.append(torch.get_num_threads())
        tokens.setdefault(i, []).append(tok)
    assert [tokens[0], tokens[1]] == want  # the same tokens as generate
    assert set(seen) == {1} and between == [CALLER] * 8
    assert torch.get_num_threads() == CALLER

    logits = llm.prompt_logits(hm.prompt(7))
    assert logits.shape == (7, hm.TINY["vocab_size"]) and seen[-1] == 1
    llm.warmup(progress=False)
    assert torch.get_num_threads() == CALLER


def test_the_caller_s_count_comes_back_after_errors_and_early_ends(
    tiny, caller_threads, monkeypatch
):
    llm = hm.engine(tiny)
    prompts = [hm.prompt(6), hm.prompt(4, 2)]
    seen = _record(llm, monkeypatch, fail_at=2)  # the first decode step raises
    with pytest.raises(ValueError, match="a step that fails"):
        llm.generate(prompts, GREEDY)
    assert seen == [1, 1] and torch.get_num_threads() == CALLER
    seen.clear()
    with pytest.raises(ValueError, match="a step that fails"):
        list(llm.generate_stream(prompts, GREEDY))
    assert seen == [1, 1] and torch.get_num_threads() == CALLER
    monkeypatch.undo()

    # a stream closed after its first item, one whose consumer raises, one never started
    stream = llm.generate_stream(prompts, GREEDY)
    next(stream)
    assert torch.get_num_threads() == CALLER
    stream.close()
    assert torch.get_num_threads() == CALLER and llm.scheduler.idle()
    with pytest.raises(KeyError):
        for _ in llm.generate_stream(prompts, GREEDY):
            raise KeyError("the caller's own error")
    assert torch.get_num_threads() == CALLER and llm.scheduler.idle()
    llm.generate_stream(prompts, GREEDY).close()
    # a call's own mistake raises before anything runs
    with pytest.raises(TypeError, match="prompts: expected"):
        list(llm.generate_stream(7, GREEDY))
    assert torch.get_num_threads() == CALLER
    # a stream still gives the tokens of a fresh engine
    assert [t for _, t, _ in llm.generate_stream(prompts[:1], GREEDY)] == (
        llm.generate(prompts[:1], GREEDY)[0].token_ids
    )


def test_an_override_is_the_count_inside_and_is_checked(tiny, caller_threads, monkeypatch):
    llm = hm.engine(tiny, torch_threads=2)
    assert llm.torch_threads == 2
    seen = _record(llm, monkeypatch)
    llm.generate([hm.prompt(5)], GREEDY)
    assert set(seen) == {2} and torch.get_num_threads() == CALLER
    for bad in (0, -1, 1.5, True, "2"):
        with pytest.raises(ValueError, match=r"^torch_threads: expected an int >= 1, got"):
            hm.engine(tiny, torch_threads=bad)


def test_the_rule_is_logged_once_and_follows_the_gemm_path(caller_threads, monkeypatch, caplog):
    """1 (every GEMM runs on Numba's pool), or the override; one decision log line per
    distinct decision."""
    monkeypatch.setattr(platform, "_logged", set())
    with caplog.at_level(logging.INFO, logger="engine"):
        assert platform.engine_torch_threads() == 1
        assert platform.engine_torch_threads() == 1
        assert platform.engine_torch_threads(4) == 4
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2, lines
    assert lines[0].startswith("torch threads inside the engine's calls: 1 (numkern's")
    assert lines[1].startswith("torch threads inside the engine's calls: 4 (LLM(torch_th")
    assert all("the caller's count is restored" in line for line in lines)
    with platform.torch_threads(None):  # None: untouched
        assert torch.get_num_threads() == CALLER
    with pytest.raises(KeyError), platform.torch_threads(2):
        assert torch.get_num_threads() == 2
        raise KeyError
    assert torch.get_num_threads() == CALLER


# -- the step's fixed costs, outputs unchanged -------------------------------------------


def _top_p_by_full_sort(probs, top_p):
    """The nucleus as the engine computed it before: a stable descending sort of every
    token, a token dropped once the mass before it passes top_p, renormalised."""
    sp, si = torch.sort(probs, descending=True, stable=True)
    drop = torch.cumsum(sp, 0) - sp > top_p
    probs = probs.clone()
    probs[si[drop]] = 0
    return probs / probs.sum()


@pytest.mark.parametrize("vocab", [1000, 49152])
def test_top_p_sorts_few_tokens_and_gives_the_full_sort_s_values(vocab):
    """engine.llm._top_p against the full sort, bit for bit: peaked and flat distributions
    (the floors, and the full sort once no floor holds the nucleus), ties (logits on a
    grid: equal probabilities at the nucleus' edge), a top-k mask, top_p near 1; and the
    token multinomial draws from it with one seed."""
    gen = torch.Generator().manual_seed(vocab)
    checked = 0
    for trial in range(8):
        logits = torch.randn(vocab, generator=gen) * (0.5 + trial)
        if trial % 2:
            logits = (logits * 2).round() / 2  # ties
        if trial == 3:
            logits = logits.masked_fill(logits < torch.topk(logits, 40).values[-1], -math.inf)
        probs = torch.softmax(logits / 0.8, -1)
        for top_p in (0.3, 0.9, 0.95, 0.99995):
            want = _top_p_by_full_sort(probs, top_p)
            got = _top_p(probs, top_p)
            got = got / got.sum()
            assert torch.equal(got, want), (trial, top_p)
            draws = [
                int(torch.multinomial(p, 1, generator=torch.Generator().manual_seed(trial)))
                for p in (got, want)
            ]
            assert draws[0] == draws[1]
            checked += int((want > 0).sum()) < vocab // 2  # a nucleus the floors can hold
    assert checked >= 8  # the floors' path ran, not only the full sort
    nan = torch.full((vocab,), math.nan)  # (a NaN logit): as the full sort leaves it
    assert _top_p(nan, 0.9).isnan().all() and _top_p_by_full_sort(nan, 0.9).isnan().all()
