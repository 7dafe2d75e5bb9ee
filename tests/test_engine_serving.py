"""LLM's serving API (add_request / abort / step_outputs under serving(), what
``engine.serve``'s engine thread runs) against LLM.generate on the same prompts, and the
sampling fields the server needs (min_tokens, top_logprobs, prompt_logprobs) against the
model's own logits (``LLM.prompt_logits``)."""

import itertools
import shutil
import subprocess
import sys

import pytest
import torch
import transformers

from engine.llm import SamplingParams

from . import hf_models as hm

GREEDY = dict(temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    """TINY (fp32, random) with the word tokenizer and ChatML (``hf_models.add_words``)."""
    path = tmp_path_factory.mktemp("serving")
    hm.random_model(transformers.LlamaConfig(**hm.TINY), 31).save_pretrained(path)
    hm.add_words(str(path))
    return hm.engine(str(path), max_num_batched_tokens=16)


def _run(llm, adds, *, aborts=None):
    """Serve ``adds`` (``{step: [(id, prompt, params)]}``: added before that step) and
    ``aborts`` (``{step: [id]}``) to the end; the last output of each request, the steps'
    id sets, and whether each output's text extended the one before."""
    aborts = aborts or {}
    last, steps, grows = {}, [], True
    with llm.serving():
        k = 0
        while k <= max(adds) or llm.has_work():
            for rid, prompt, sp in adds.get(k, ()):
                llm.add_request(rid, prompt, sp)
            for rid in aborts.get(k, ()):
                llm.abort(rid)
            outs = llm.step_outputs() if llm.has_work() else []
            for o in outs:
                prev = last.get(o.request_id)
                grows &= prev is None or o.text.startswith(prev.text)
                last[o.request_id] = o
            steps.append({o.request_id for o in outs})
            k += 1
    return last, steps, grows


def test_requests_joining_a_running_batch_match_generate(llm):
    prompts = [hm.prompt(21, salt=s) for s in range(3)]
    sp = [SamplingParams(**GREEDY, max_tokens=n) for n in (12, 7, 9)]
    sp[2].stop = ("w1",)  # a stop string: the text held back until decided
    ref = llm.generate(prompts, sp)
    # "c" arrives while "a" and "b" decode: it joins their batch at the next step
    adds = {0: [("a", prompts[0], sp[0]), ("b", prompts[1], sp[1])], 4: [("c", prompts[2], sp[2])]}
    last, steps, grows = _run(llm, adds)
    for rid, r in zip("abc", ref):
        o = last[rid]
        assert (o.token_ids, o.text, o.finish_reason) == (r.token_ids, r.text, r.finish_reason)
        assert o.request_id == rid and o.prompt_token_ids == r.prompt_token_ids
    assert grows
    assert any({"a", "c"} <= s for s in steps)  # one step ran both
    assert llm.scheduler.idle()


def test_abort_frees_blocks_at_the_next_step(llm):
    long, other = hm.prompt(40, salt=5), hm.prompt(9, salt=6)
    solo = llm.generate([other], SamplingParams(**GREEDY, max_tokens=30))[0]
    pools = [g.pool for g in llm.scheduler.groups]
    with llm.serving():
        llm.add_request("long", long, SamplingParams(**GREEDY, max_tokens=400))
        llm.add_request("other", other, SamplingParams(**GREEDY, max_tokens=30))
        for _ in range(6):
            llm.step_outputs()
        held = sum(p.num_blocks - p.num_free for p in pools)
        assert held > 0
        llm.abort("long")
        llm.abort("never-added")  # ignored
        outs = {o.request_id: o for o in llm.step_outputs()}
        assert outs["long"].finish_reason == "abort"
        assert [r.rid for r in llm.scheduler.running] == ["other"]
        last = None
        while llm.has_work():
            last = {o.request_id: o for o in llm.step_outputs()}.get("other", last)
        assert all(p.num_free == p.num_blocks for p in pools)
    assert last.token_ids == solo.token_ids and last.text == solo.text


def test_abort_of_a_queued_request_and_the_end_of_serving(llm):
    with llm.serving():
        llm.add_request(1, hm.prompt(5), SamplingParams(**GREEDY, max_tokens=4))
        llm.abort(1)
        (out,) = llm.step_outputs()
        assert out.request_id == 1 and out.finish_reason == "abort" and not llm.has_work()
        llm.add_request(2, hm.prompt(5), SamplingParams(**GREEDY, max_tokens=100))
        llm.step_outputs()
    # leaving serving() dropped request 2 and freed its blocks: the engine runs as new
    assert llm.scheduler.idle() and not llm.has_work()
    assert llm.generate([hm.prompt(5)], SamplingParams(**GREEDY, max_tokens=2))[0].token_ids


def test_add_request_refuses_before_queueing(llm):
    cases = [
        (hm.prompt(5), SamplingParams(max_tokens=2, min_tokens=3), "min_tokens"),
        (hm.prompt(5), SamplingParams(top_logprobs=-1), "top_logprobs"),
        (hm.prompt(5), SamplingParams(prompt_logprobs=1.5), "prompt_logprobs"),
        (hm.prompt(600), SamplingParams(), "prompt: 600 tokens do not fit"),
        ([7, 999], SamplingParams(), "prompt: token ids must lie"),
    ]
    for prompt, sp, field in cases:
        with pytest.raises(ValueError, match=f"^{field}"):
            llm.add_request("x", prompt, sp)
        assert not llm.has_work()
    with pytest.raises(TypeError, match="params"):
        llm.add_request("x", hm.prompt(5), {"temperature": 0})


def test_logprobs_are_the_models(llm):
    """prompt_logprobs (over 3 prefill chunks of 16) and top_logprobs against
    log_softmax of one prefill of prompt + output (``prompt_logits``)."""
    ids, k = hm.prompt(37, salt=2), 3
    sp = SamplingParams(**GREEDY, max_tokens=6, logprobs=True, top_logprobs=k, prompt_logprobs=k)
    out = llm.generate([ids], sp)[0]
    ref = torch.log_softmax(llm.prompt_logits(ids + out.token_ids[:-1]), -1)  # [T, vocab]
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(ids)
    for pos in range(1, len(ids)):
        lp, top = out.prompt_logprobs[pos]
        assert lp == pytest.approx(float(ref[pos - 1, ids[pos]]), abs=1e-4)
        values, order = ref[pos - 1].topk(k)
        assert [t for t, _ in top] == order.tolist()
        assert [v for _, v in top] == pytest.approx(values.tolist(), abs=1e-4)
    for j, tok in enumerate(out.token_ids):
        row = ref[len(ids) - 1 + j]
        assert out.logprobs[j] == pytest.approx(float(row[tok]), abs=1e-4)
        assert out.top_logprobs[j][0][0] == tok == int(row.argmax())  # greedy: the top one
    plain = llm.generate([ids], SamplingParams(**GREEDY, max_tokens=6))[0]
    assert plain.token_ids == out.token_ids and plain.prompt_logprobs is None


def test_min_tokens(llm):
    ids = hm.prompt(11, salt=3)
    llm.record_logits = True
    try:
        free = llm.generate([ids], SamplingParams(**GREEDY, max_tokens=8))[0]
        first = free.token_ids[0]
        stopped = llm.generate([ids], SamplingParams(**GREEDY, stop_token_ids=(first,)))[0]
        assert stopped.token_ids == [first] and stopped.finish_reason == "stop"
        sp = SamplingParams(**GREEDY, max_tokens=8, stop_token_ids=(first,), min_tokens=3)
        held = llm.generate([ids], sp)[0]
    finally:
        llm.record_logits = False
    # the stop token masked in the first 3 tokens: each the argmax of the rest
    for j in range(3):
        masked = held.logits[j].clone()
        masked[first] = float("-inf")
        assert held.token_ids[j] == int(masked.argmax()) != first
    assert len(held.token_ids) >= 3
    # a stop string is looked for after the first min_tokens tokens' text
    word = free.text.split()[0]
    for m in (0, 1, 2):
        out = llm.generate([ids], SamplingParams(**GREEDY, max_tokens=8, stop=word, min_tokens=m))
        start = len(llm.tokenizer.decode(free.token_ids[:m])) if m else 0
        at = free.text.find(word, start)
        want = free.text[:at] if at >= 0 else free.text
        assert out[0].text == want


def test_import_engine_needs_no_server_packages():
    code = (
        "import sys, engine, engine.__main__, engine.llm; "
        "print(sorted(m for m in ('fastapi', 'uvicorn', 'starlette', 'openai') "
        "if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_streamed_text_never_takes_back_a_character_split_across_tokens(llm, tmp_path):
    """A byte-level tokenizer of one byte per id: sampled bytes split UTF-8 characters
    across tokens, whose prefix decodes to U+FFFD until the character's last byte comes.
    Each text a stream shows extends the one before and ends as generate's."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    path = tmp_path / "bytes"
    shutil.copytree(llm.source, path)
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())  # 256 characters, one per byte
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").unlink()
    bytewise = hm.engine(str(path))
    split = 0
    for seed in range(3):
        sp = SamplingParams(temperature=1.5, seed=seed, max_tokens=40, ignore_eos=True)
        final = bytewise.generate([hm.prompt(5)], sp)[0]
        shown = [t for _, _, t in bytewise.generate_stream([hm.prompt(5)], sp)]
        assert shown[-1] == final.text
        assert all(b.startswith(a) for a, b in itertools.pairwise(shown))
        raw = [bytewise.tokenizer.decode(final.token_ids[:k]) for k in range(1, 41)]
        split += sum(not b.startswith(a) for a, b in itertools.pairwise(raw))
    assert split > 0  # the raw decodes took characters back: the hold-back was needed
