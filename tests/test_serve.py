"""``python -m engine serve`` against the real ``openai`` client: a server subprocess on
127.0.0.1 over a tiny fp32 model (one per module, shared by the tests), its answers
against ``LLM.generate`` on the same prompts in this process, and its errors against
the OpenAI error schema."""

import asyncio
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time

import httpx
import openai
import pytest
import torch
import transformers

from engine.llm import SamplingParams

from . import hf_models as hm

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MAX_LEN = 4096  # long enough for a stream that a test can cut mid-way
ENGINE = [
    "--dtype",
    "float32",
    "--block-size",
    "32",
    "--kv-cache-memory",
    str(8 << 20),
    "--max-model-len",
    str(MAX_LEN),
]
START_TIMEOUT = 240  # s: a cold Numba cache compiles the model's kernels first


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """``python -m engine serve`` in a subprocess; its output in ``log``."""

    def __init__(self, path, log, *args):
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log
        self._client = None
        cmd = [
            sys.executable,
            "-m",
            "engine",
            "serve",
            path,
            "--served-model-name",
            "tiny",
            "--port",
            str(self.port),
            *ENGINE,
            *args,
        ]
        with open(log, "w") as f:
            self.proc = subprocess.Popen(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + START_TIMEOUT
        while True:
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.close()
                pytest.fail(f"the server did not start:\n{self.output()}")
            time.sleep(0.2)

    def output(self):
        with open(self.log) as f:
            return f.read()

    def client(self, cls=openai.OpenAI):
        """An OpenAI client of this server (the sync one shared, closed by close())."""
        kw = dict(base_url=f"{self.url}/v1", api_key="none", max_retries=0, timeout=120)
        if cls is not openai.OpenAI:
            return cls(**kw)
        if self._client is None:
            self._client = cls(**kw)
        return self._client

    def metrics(self):
        """``{name{labels}: value}`` of ``GET /metrics``."""
        text = httpx.get(f"{self.url}/metrics").text
        return {
            k: float(v)
            for k, v in (line.rsplit(" ", 1) for line in text.splitlines() if line[:1] != "#")
        }

    def close(self):
        if self._client is not None:
            self._client.close()
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(30)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """TINY (fp32, random) with the word tokenizer and ChatML, positions up to MAX_LEN."""
    path = tmp_path_factory.mktemp("serve")
    cfg = transformers.LlamaConfig(**{**hm.TINY, "max_position_embeddings": MAX_LEN})
    hm.random_model(cfg, 31).save_pretrained(path)
    hm.add_words(str(path))
    return str(path)


@pytest.fixture(scope="module")
def ref(model):
    """The reference: the engine in this process on the same model."""
    return hm.engine(model, max_model_len=MAX_LEN)


@pytest.fixture(scope="module")
def server(model, tmp_path_factory):
    s = Server(model, str(tmp_path_factory.mktemp("log") / "server.log"))
    try:
        yield s
    finally:
        s.close()


def _greedy(ref, prompt, n, **kw):
    return ref.generate([prompt], SamplingParams(temperature=0, max_tokens=n, **kw))[0]


def _words(i, n=6):
    return " ".join(f"w{(37 * i + 11 * j) % 240 + 10}" for j in range(n))


def test_models_and_health(server):
    assert httpx.get(f"{server.url}/health").status_code == 200
    (card,) = server.client().models.list().data
    assert card.id == "tiny" and card.object == "model"


def test_completion_equals_generate_streamed_or_not(server, ref):
    c = server.client()
    prompt = _words(1)
    want = _greedy(ref, prompt, 12)
    out = c.completions.create(model="tiny", prompt=prompt, max_tokens=12, temperature=0)
    (choice,) = out.choices
    assert choice.text == want.text and choice.finish_reason == want.finish_reason
    assert out.usage.prompt_tokens == len(want.prompt_token_ids)
    assert out.usage.completion_tokens == len(want.token_ids)
    assert out.usage.total_tokens == out.usage.prompt_tokens + out.usage.completion_tokens
    chunks = list(
        c.completions.create(
            model="tiny",
            prompt=prompt,
            max_tokens=12,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    *pieces, last = chunks
    assert "".join(ch.choices[0].text for ch in pieces) == want.text
    assert len(pieces) > 1 and pieces[-1].choices[0].finish_reason == "length"
    assert last.choices == [] and last.usage.completion_tokens == len(want.token_ids)
    # token ids as the prompt, several prompts in one request
    ids = [want.prompt_token_ids, hm.prompt(7)]
    out = c.completions.create(model="tiny", prompt=ids, max_tokens=5, temperature=0)
    for choice, p in zip(out.choices, ids, strict=True):
        assert choice.text == _greedy(ref, p, 5).text


def test_chat_equals_generate_streamed_or_not(server, ref):
    c = server.client()
    messages = [{"role": "user", "content": _words(2)}]
    ids = ref.apply_chat_template(messages, tokenize=True)
    want = _greedy(ref, ids, 10)
    out = c.chat.completions.create(
        model="tiny", messages=messages, max_completion_tokens=10, temperature=0
    )
    assert out.choices[0].message.content == want.text
    assert out.choices[0].message.role == "assistant"
    assert out.usage.prompt_tokens == len(ids)
    stream = c.chat.completions.create(
        model="tiny", messages=messages, max_tokens=10, temperature=0, stream=True
    )
    deltas = [ch.choices[0].delta for ch in stream]
    assert deltas[0].role == "assistant"
    assert "".join(d.content or "" for d in deltas) == want.text


def test_stop_string_never_streamed(server, ref):
    c = server.client()
    prompt = _words(3)
    free = _greedy(ref, prompt, 12, ignore_eos=True).text
    words = free.split()
    stop = f"{words[3][1:]} {words[4][:2]}"  # inside two tokens' text
    want = _greedy(ref, prompt, 12, ignore_eos=True, stop=stop)
    assert want.finish_reason == "stop"
    kw = dict(
        model="tiny",
        prompt=prompt,
        max_tokens=12,
        temperature=0,
        stop=[stop],
        extra_body={"ignore_eos": True},
    )
    out = c.completions.create(**kw)
    assert out.choices[0].text == want.text and out.choices[0].finish_reason == "stop"
    pieces = [ch.choices[0].text for ch in c.completions.create(**kw, stream=True)]
    assert "".join(pieces) == want.text
    shown = ""
    for p in pieces:
        shown += p
        assert stop not in shown


def test_echo_prompt_logprobs_as_lm_eval_sends(server, ref):
    """lm-evaluation-harness's loglikelihood request: the prompt's tokens echoed with
    their logprobs and no generation."""
    ids = hm.prompt(23, salt=4)
    out = server.client().completions.create(
        model="tiny", prompt=ids, max_tokens=0, echo=True, logprobs=1, temperature=0
    )
    lp = out.choices[0].logprobs
    want = torch.log_softmax(ref.prompt_logits(ids), -1)
    assert lp.token_logprobs[0] is None and len(lp.token_logprobs) == len(ids)
    for pos in range(1, len(ids)):
        assert lp.token_logprobs[pos] == pytest.approx(float(want[pos - 1, ids[pos]]), abs=1e-4)
        best = ref.tokenizer.decode([int(want[pos - 1].argmax())], skip_special_tokens=False)
        assert max(lp.top_logprobs[pos], key=lp.top_logprobs[pos].get) == best
    assert out.choices[0].text == ref.tokenizer.decode(ids)
    assert out.usage.completion_tokens == 0 and out.usage.prompt_tokens == len(ids)
    # with generation: the prompt's entries, then the generated tokens'
    gen = server.client().completions.create(
        model="tiny", prompt=ids, max_tokens=3, echo=True, logprobs=0, temperature=0
    )
    want_out = _greedy(ref, ids, 3)
    assert gen.choices[0].text == ref.tokenizer.decode(ids) + want_out.text
    assert len(gen.choices[0].logprobs.tokens) == len(ids) + 3


def test_16_concurrent_clients_each_equal_their_solo_run(server, ref):
    """Completions and chats, streamed and not, of other lengths, at once: each equals
    its own LLM.generate, and the engine ran them in shared steps."""
    cases = []
    for i in range(16):
        n = 6 + 3 * i % 17
        if i % 2:
            messages = [{"role": "user", "content": _words(10 + i, 3 + i % 5)}]
            want = _greedy(ref, ref.apply_chat_template(messages, tokenize=True), n)
            cases.append(("chat", messages, n, i % 4 == 1, want.text))
        else:
            prompt = _words(10 + i, 3 + i % 7)
            cases.append(("completion", prompt, n, i % 4 == 0, _greedy(ref, prompt, n).text))
    client = server.client(openai.AsyncOpenAI)

    async def one(kind, prompt, n, stream):
        if kind == "chat":
            r = await client.chat.completions.create(
                model="tiny", messages=prompt, max_tokens=n, temperature=0, stream=stream
            )
            if not stream:
                return r.choices[0].message.content
            return "".join([ch.choices[0].delta.content or "" async for ch in r])
        r = await client.completions.create(
            model="tiny", prompt=prompt, max_tokens=n, temperature=0, stream=stream
        )
        if not stream:
            return r.choices[0].text
        return "".join([ch.choices[0].text async for ch in r])

    async def everyone():
        try:
            return await asyncio.gather(*(one(*c[:4]) for c in cases))
        finally:
            await client.close()

    before = server.metrics()
    got = asyncio.run(everyone())
    after = server.metrics()
    assert got == [c[4] for c in cases]
    key = 'numkern:engine_steps_total{model_name="tiny"}'
    steps = after[key] - before[key]
    tokens = sum(c[2] for c in cases)
    assert steps < tokens / 2  # requests shared steps (16 alone would take one each)


def _blocks(server):
    m = server.metrics()
    return m['numkern:kv_cache_blocks_used{model_name="tiny",group="0"}'], m


def test_a_client_gone_mid_stream_is_aborted_and_its_blocks_return(server, ref):
    prompt = _words(4)
    body = {
        "model": "tiny",
        "prompt": prompt,
        "max_tokens": MAX_LEN - 20,
        "temperature": 0,
        "stream": True,
        "ignore_eos": True,
    }
    aborted = server.metrics().get(
        'vllm:request_success_total{model_name="tiny",finished_reason="abort"}', 0
    )
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60) as r:
        lines = r.iter_lines()
        got = [next(lines) for _ in range(6)]
        assert got[0].startswith("data: {") and _blocks(server)[0] > 0
        # meanwhile another client is served as if alone
        other = server.client().completions.create(
            model="tiny", prompt=_words(5), max_tokens=7, temperature=0
        )
        assert other.choices[0].text == _greedy(ref, _words(5), 7).text
    deadline = time.monotonic() + 30
    while True:
        used, m = _blocks(server)
        done = m['vllm:num_requests_running{model_name="tiny"}'] == 0
        if used == 0 and done:
            break
        assert time.monotonic() < deadline, f"blocks still used after the client left: {used}"
        time.sleep(0.1)
    key = 'vllm:request_success_total{model_name="tiny",finished_reason="abort"}'
    assert m[key] == aborted + 1
    assert (
        server.client()
        .completions.create(model="tiny", prompt=prompt, max_tokens=3, temperature=0)
        .choices[0]
        .text
    )


BAD = [  # (field, its bad value, chat or completion)
    ("temperature", -1, "completion"),
    ("temperature", "hot", "chat"),
    ("top_p", 0, "completion"),
    ("top_k", -2, "completion"),
    ("max_tokens", 0, "completion"),
    ("max_completion_tokens", 0, "chat"),
    ("n", 2, "completion"),
    ("n", 3, "chat"),
    ("logprobs", 99, "completion"),
    ("top_logprobs", 5, "chat"),  # without logprobs: true
    ("stop", [""], "completion"),
    ("stop", 7, "chat"),
    ("seed", "x", "completion"),
    ("seed", 1 << 70, "completion"),
    ("stop_token_ids", "a", "completion"),
    ("ignore_eos", "yes", "completion"),
    ("min_tokens", 99, "completion"),
    ("presence_penalty", 0.5, "completion"),
    ("logit_bias", {"5": 1}, "chat"),
    ("suffix", "w9", "completion"),
    ("stream", "yes", "completion"),
    ("stream_options", {"include_usage": True}, "completion"),  # without stream
    ("echo", 1, "completion"),
    ("prompt", [], "completion"),
    ("prompt", [[1, 2], 3], "completion"),
    ("messages", [], "chat"),
    ("messages[0]", "w9", "chat"),
]


def test_bad_requests_get_400_naming_the_field_and_the_server_goes_on(server, ref):
    c = server.client()
    for field, value, kind in BAD:
        body = {"max_tokens": 3}
        body[field.split("[")[0]] = [value] if field == "messages[0]" else value
        # the client's required arguments, whatever their value; the rest as sent
        if kind == "chat":
            main = {"messages": body.pop("messages", [{"role": "user", "content": "w9"}])}
            call = c.chat.completions.create
        else:
            main = {"prompt": body.pop("prompt", "w9 w10")}
            call = c.completions.create
        with pytest.raises(openai.BadRequestError) as e:
            call(model="tiny", **main, extra_body=body)
        err = e.value.body
        assert e.value.status_code == 400 and err["type"] == "invalid_request_error", field
        assert err["param"] == field and err["message"].startswith(f"{field}: "), err
    # malformed JSON, not an object
    for raw in (b"{not json", b"[1, 2]"):
        r = httpx.post(f"{server.url}/v1/completions", content=raw)
        assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    # a prompt longer than max_model_len; out-of-vocabulary ids; chat's template refusing
    with pytest.raises(openai.BadRequestError, match="do not fit the context") as e:
        c.completions.create(model="tiny", prompt=hm.prompt(MAX_LEN + 4), max_tokens=2)
    assert e.value.body["param"] == "prompt"
    with pytest.raises(openai.BadRequestError, match="token ids must lie") as e:
        c.completions.create(model="tiny", prompt=[5, 300], max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="got system") as e:
        c.chat.completions.create(model="tiny", messages=[{"role": "system", "content": "w9"}])
    assert e.value.body["param"] == "messages"
    # an unknown model: 404
    with pytest.raises(openai.NotFoundError) as e:
        c.completions.create(model="gpt-4", prompt="w9", max_tokens=2)
    assert e.value.body["code"] == "model_not_found" and e.value.body["param"] == "model"
    # an unknown field is ignored, with a warning naming it in the server's log
    out = c.completions.create(
        model="tiny", prompt=_words(6), max_tokens=4, temperature=0, extra_body={"frobnicate": 1}
    )
    assert out.choices[0].text == _greedy(ref, _words(6), 4).text
    assert re.search(r"ignoring request fields .*frobnicate", server.output())
    assert httpx.get(f"{server.url}/health").status_code == 200


def test_full_queue_429_and_sigterm_mid_stream_exits_0(model, tmp_path):
    """One running and one waiting fill a --max-num-seqs 1 --max-waiting 1 server; the
    next request gets 429. SIGTERM while a stream runs: exit 0 within the timeout."""
    timeout = 2
    s = Server(
        model,
        str(tmp_path / "server.log"),
        "--max-num-seqs",
        "1",
        "--max-waiting",
        "1",
        "--shutdown-timeout",
        str(timeout),
    )
    try:
        body = {
            "model": "tiny",
            "prompt": _words(7),
            "max_tokens": MAX_LEN - 20,
            "temperature": 0,
            "stream": True,
            "ignore_eos": True,
        }
        with (
            httpx.stream("POST", f"{s.url}/v1/completions", json=body, timeout=60) as a,
            httpx.stream("POST", f"{s.url}/v1/completions", json=body, timeout=60) as b,
        ):
            lines = a.iter_lines()  # (one iterator: a dropped one closes the stream)
            assert next(lines).startswith("data: {") and b.status_code == 200
            with pytest.raises(openai.RateLimitError) as e:
                s.client().completions.create(model="tiny", prompt="w9", max_tokens=2)
            assert e.value.status_code == 429 and "max-waiting" in e.value.body["message"]
            t0 = time.monotonic()
            s.proc.send_signal(signal.SIGTERM)
            try:  # the stream ends: finished, or cut at the timeout
                rest = list(lines)
            except httpx.HTTPError:
                rest = []
            assert s.proc.wait(timeout + 30) == 0
            assert time.monotonic() - t0 < timeout + 30
            events = [json.loads(x[6:]) for x in rest if x.startswith("data: {")]
            assert all("error" not in ev for ev in events)
    finally:
        s.close()


@pytest.mark.parametrize(
    "args, option",
    [
        (["--port", "70000"], "--port"),
        (["--max-waiting", "-1"], "--max-waiting"),
        (["--shutdown-timeout", "-1"], "--shutdown-timeout"),
        (["--max-num-seqs", "0"], "--max-num-seqs"),
    ],
)
def test_cli_bad_server_options_exit_2_before_loading(model, capsys, args, option):
    from engine.__main__ import main

    with pytest.raises(SystemExit) as e:
        main(["serve", model, *args])
    assert e.value.code == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith(f"python -m engine serve: error: {option}: expected")
