"""The engine under bad input: requests that fail alone, the CLI's errors, truncated and
corrupt checkpoint files, hostile configs, KeyboardInterrupt mid-call, two threads.

Everything runs on one tiny random Llama (the smallest the attention kernels take:
head_dim 16), saved once per module by transformers; HF's greedy tokens are the
reference where a test needs the model's own output."""

import json
import math
import os
import pathlib
import shutil
import struct
import subprocess
import sys
import time
import tracemalloc
from types import SimpleNamespace

import gguf
import numpy as np
import pytest
import torch
import transformers

from engine.__main__ import main
from engine.llm import LLM, SamplingParams
from engine.loader import load_checkpoint

from . import hf_models as hm
from .conftest import ROOT, run_child
from .test_engine_loader import _train_bpe, _write_gguf

TINY = hm.TINY
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
# K+V x block of 32 x 1 kv head x head_dim 16 x fp32 x 2 layers
BLOCK_BYTES = 2 * 32 * 1 * 16 * 4 * 2


def tiny_checkpoint(path):
    """TINY, random (hf_models.random_model), saved to ``path``; returns the HF model."""
    model = hm.random_model(transformers.LlamaConfig(**TINY), 15)
    model.save_pretrained(path)
    return model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(directory, HF model) of TINY."""
    path = tmp_path_factory.mktemp("tiny")
    return str(path), tiny_checkpoint(path)


# -- requests that fail alone ------------------------------------------------------------

# (what is wrong, the field the error names, the params)
BAD_REQUESTS = [
    ("negative temperature", "temperature", SamplingParams(temperature=-1.0)),
    ("nan temperature", "temperature", SamplingParams(temperature=math.nan)),
    ("inf temperature", "temperature", SamplingParams(temperature=math.inf)),
    ("string temperature", "temperature", SamplingParams(temperature="0.5")),
    ("top_p 0", "top_p", SamplingParams(top_p=0.0)),
    ("top_p above 1", "top_p", SamplingParams(top_p=1.5)),
    ("top_p nan", "top_p", SamplingParams(top_p=math.nan)),
    ("top_k below -1", "top_k", SamplingParams(top_k=-2)),
    ("top_k a float", "top_k", SamplingParams(top_k=2.0)),
    ("top_k a bool", "top_k", SamplingParams(top_k=True)),
    ("max_tokens 0", "max_tokens", SamplingParams(max_tokens=0)),
    ("max_tokens negative", "max_tokens", SamplingParams(max_tokens=-3)),
    ("max_tokens a float", "max_tokens", SamplingParams(max_tokens=2.5)),
    ("seed a string", "seed", SamplingParams(seed="7")),
    ("seed past 64 bits", "seed", SamplingParams(seed=1 << 64)),
    ("empty stop string", "stop", SamplingParams(stop=("",))),
    ("stop not strings", "stop", SamplingParams(stop=(3,))),
    ("stop_token_ids an int", "stop_token_ids", SamplingParams(stop_token_ids=5)),
    ("stop_token_ids strings", "stop_token_ids", SamplingParams(stop_token_ids=("a",))),
]
GOOD = [hm.prompt(5), hm.prompt(9, 1), hm.prompt(3, 2)]


def test_bad_sampling_values_fail_alone(tiny):
    """Each bad value in a batch of good requests: that request fails with a ValueError
    message naming the field; the good ones get their tokens alone (HF's); in one call."""
    path, hf = tiny
    llm = hm.engine(path)
    want = [hm.hf_greedy(hf, p, GREEDY.max_tokens) for p in GOOD]
    prompts = [*GOOD, *(hm.prompt(4, 3) for _ in BAD_REQUESTS)]
    params = [GREEDY] * len(GOOD) + [sp for _, _, sp in BAD_REQUESTS]
    outs = llm.generate(prompts, params)
    assert [o.token_ids for o in outs[: len(GOOD)]] == want
    assert all(o.finish_reason == "length" and o.error is None for o in outs[: len(GOOD)])
    for (what, name, _), out in zip(BAD_REQUESTS, outs[len(GOOD) :]):
        assert out.finish_reason == "error" and out.token_ids == [], what
        assert out.error.startswith(f"{name}: expected"), (what, out.error)
    assert llm.scheduler.idle()


# (what is wrong, prompt, a word the error has)
BAD_PROMPTS = [
    ("empty", [], "at least one token"),
    ("id past the vocabulary", [1, 2, 256], "[0, 256), got 256 at 2"),
    ("negative id", [-1, 5], "got -1 at 0"),
    ("float id", [1, 2.0], "got 2.0 at 1"),
    ("bool id", [True, 4], "got True at 0"),
    ("string id", [4, "5"], "got '5' at 1"),
    ("nested list", [[1, 2]], "got [1, 2] at 0"),
    ("None", None, "got NoneType"),
    ("bytes", b"\x01\x02", "got bytes"),
    ("string, no tokenizer", "hello", "needs a tokenizer"),
    ("as long as max_model_len", hm.prompt(64), "do not fit the context of 64"),
]


def test_bad_prompts_fail_alone_and_the_stream_says_so(tiny):
    """Malformed, out-of-vocabulary and over-long prompts fail alone (the field named is
    ``prompt``); NumPy and torch ids are prompts; generate_stream yields ``(i, None,
    ValueError)`` for a failed request and the good ones' tokens as generate gives them."""
    path, hf = tiny
    llm = hm.engine(path, max_model_len=64)
    prompts = [GOOD[0], *(p for _, p, _ in BAD_PROMPTS), np.array(GOOD[1]), torch.tensor(GOOD[2])]
    outs = llm.generate(prompts, GREEDY)
    want = [hm.hf_greedy(hf, p, GREEDY.max_tokens) for p in GOOD]
    assert [outs[0].token_ids, outs[-2].token_ids, outs[-1].token_ids] == want
    for (what, _, words), out in zip(BAD_PROMPTS, outs[1:-2]):
        assert out.finish_reason == "error" and out.error.startswith("prompt: "), what
        assert words in out.error, (what, out.error)
    events = list(llm.generate_stream(prompts, GREEDY))
    failed = {i: e for i, t, e in events if t is None}
    assert sorted(failed) == list(range(1, len(BAD_PROMPTS) + 1))
    assert all(isinstance(e, ValueError) and str(e) == outs[i].error for i, e in failed.items())
    tokens = {i: [t for j, t, _ in events if j == i] for i in (0, len(prompts) - 1)}
    assert tokens == {0: want[0], len(prompts) - 1: want[2]}
    # one prompt of ids is a prompt (not a batch of one-token prompts)
    assert [o.token_ids for o in llm.generate(GOOD[0], GREEDY)] == want[:1]


def test_a_prompt_the_kv_pool_can_never_hold_fails_alone(tiny):
    """4 blocks of 32 tokens: a 129-token prompt fails on arrival (it never waits for a
    pool that cannot hold it); a 100-token one beside it runs."""
    path, hf = tiny
    llm = hm.engine(path, kv_cache_memory=4 * BLOCK_BYTES)
    assert [g.num_blocks for g in llm.kv_cache_groups] == [4]
    long, fits = llm.generate([hm.prompt(129), hm.prompt(100, 1)], GREEDY)
    assert long.finish_reason == "error" and long.error == (
        "prompt: 129 tokens need 5 KV blocks of 32 tokens; the KV cache holds 4 (kv_cache_memory)"
    )
    assert fits.token_ids == hm.hf_greedy(hf, hm.prompt(100, 1), GREEDY.max_tokens)
    assert llm.scheduler.num_preemptions == 0 and llm.scheduler.idle()


def test_the_call_s_own_mistakes_raise_before_anything_runs(tiny):
    path, _ = tiny
    llm = hm.engine(path)
    with pytest.raises(ValueError, match=r"sampling_params: expected one SamplingParams or 2"):
        llm.generate(GOOD[:2], [GREEDY])
    with pytest.raises(TypeError, match="sampling_params: expected SamplingParams, got None"):
        llm.generate(GOOD[:2], [GREEDY, None])
    with pytest.raises(TypeError, match="sampling_params: expected a SamplingParams"):
        llm.generate(GOOD[:1], {"temperature": 0})
    with pytest.raises(TypeError, match="prompts: expected a prompt"):
        llm.generate(7, GREEDY)
    with pytest.raises(ValueError, match=r"ids: token ids must lie in \[0, 256\)"):
        llm.prompt_logits([1, 999])
    assert llm.steps.maxlen and not llm.steps  # nothing ran
    assert llm.generate([], GREEDY) == []


@pytest.mark.parametrize(
    "kw, field_name",
    [
        (dict(max_num_seqs=0), "max_num_seqs"),
        (dict(max_num_batched_tokens=-1), "max_num_batched_tokens"),
        (dict(max_model_len=1), "max_model_len"),
        (dict(kv_cache_memory=0), "kv_cache_memory"),
        (dict(block_size=32.0), "block_size"),
        (dict(dtype="float8"), "dtype"),
    ],
)
def test_engine_arguments_are_checked_before_the_checkpoint_is_read(kw, field_name, tmp_path):
    # tmp_path holds no checkpoint: an argument error comes first
    with pytest.raises(ValueError, match=f"^{field_name}: expected"):
        LLM(str(tmp_path), progress=False, **kw)


# -- the CLI -----------------------------------------------------------------------------


def _cli(args, capsys):
    """(exit status, stdout, stderr) of ``python -m engine generate ARGS`` run here."""
    with pytest.raises(SystemExit) as e:
        main(["generate", *args])
    out, err = capsys.readouterr()
    code = e.value.code
    if isinstance(code, str):  # SystemExit("message"): printed, exit status 1
        return 1, out, err + code + "\n"
    return code, out, err


@pytest.mark.parametrize(
    "args, option",
    [
        (["--temperature", "-1"], "--temperature: expected a finite number >= 0, got -1.0"),
        (["--max-tokens", "0"], "--max-tokens: expected an int >= 1, got 0"),
        (["--top-p", "0"], "--top-p: expected a number in (0, 1], got 0.0"),
        (["--top-k", "-2"], "--top-k: expected an int >= 1, or 0 or -1 (off), got -2"),
        (["--max-num-seqs", "0"], "--max-num-seqs: expected an int >= 1, got 0"),
        (["--block-size", "48"], "--block-size: expected a multiple of 32, got 48"),
        (["--dtype", "int8"], "--dtype: expected bfloat16, float16 or float32, got 'int8'"),
    ],
)
def test_cli_bad_option_values_exit_2_with_one_line(tiny, capsys, args, option):
    code, out, err = _cli([*args, "--model", tiny[0], "hi"], capsys)
    assert code == 2 and out == ""
    assert err == f"python -m engine generate: error: {option}\n"


def test_cli_missing_or_broken_model_and_failed_prompt_exit_1(tiny, tmp_path, capsys):
    code, out, err = _cli(["--model", str(tmp_path / "nope"), "hi"], capsys)
    assert code == 1 and out == "" and err.count("\n") == 1
    assert err.startswith("python -m engine generate: error: path: ") and "does not exist" in err
    st = _copy(tiny[0], tmp_path / "broken")
    data = st.read_bytes()
    st.write_bytes(data[:-10])
    code, out, err = _cli(["--model", str(st.parent), "hi"], capsys)
    assert code == 1 and err.count("\n") == 1, err
    assert f"{st}: tensor {_last_tensor(data)!r}: its bytes" in err
    # a prompt that fails (this model has no tokenizer): its error, exit status 1
    small = ["--dtype", "float32", "--block-size", "32", "--kv-cache-memory", str(8 << 20)]
    code, out, err = _cli(["--model", tiny[0], *small, "hi"], capsys)
    assert (code, out) == (1, "")
    assert err == (
        "python -m engine generate: error: prompt: a string needs a tokenizer; this "
        "checkpoint has none\n"
    )
    code, out, err = _cli(["--model", tiny[0], *small, "hi", "ho"], capsys)
    assert (code, out) == (1, "")
    lines = err.splitlines()
    assert len(lines) == 2 and all(
        line.startswith(f"python -m engine generate: error: [{i}] prompt: ")
        for i, line in enumerate(lines)
    )


def test_cli_in_a_fresh_process_prints_no_traceback(tmp_path):
    """As a user runs it: one line on stderr, exit status 2 (bad value) or 1 (no model)."""
    for args, code in (
        (["--temperature", "-1", "hi"], 2),
        (["--model", str(tmp_path / "nope"), "hi"], 1),
    ):
        proc = subprocess.run(
            [sys.executable, "-m", "engine", "generate", *args],
            capture_output=True,
            text=True,
            cwd=ROOT,
            timeout=300,
        )
        assert proc.returncode == code, (args, proc.stderr)
        assert proc.stdout == "" and proc.stderr.count("\n") == 1, (args, proc.stderr)
        assert proc.stderr.startswith("python -m engine generate: error: "), proc.stderr


# -- truncated and corrupt files ---------------------------------------------------------


def _copy(src, dst):
    shutil.copytree(src, dst)
    return dst / "model.safetensors"


def _header(data):
    """(the header without __metadata__, the data) of a safetensors file's bytes."""
    n = struct.unpack("<Q", data[:8])[0]
    header = json.loads(data[8 : 8 + n])
    header.pop("__metadata__", None)
    return header, data[8 + n :]


def _last_tensor(data):
    header, _ = _header(data)
    return max(header, key=lambda k: header[k]["data_offsets"])


def _with_header(header, body):
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text + body


def test_truncated_or_corrupt_safetensors_name_the_file_and_tensor(tiny, tmp_path):
    src = tiny[0]
    data = pathlib.Path(src, "model.safetensors").read_bytes()
    header, body = _header(data)
    last = _last_tensor(data)
    first = min(header, key=lambda k: header[k]["data_offsets"])
    bad_shape = dict(header, **{first: dict(header[first], shape=[7, 7])})
    bad_dtype = dict(header, **{first: dict(header[first], dtype="Q9")})
    cases = [
        ("cut by one byte", data[:-1], f"tensor {last!r}: its bytes"),
        ("cut in the middle", data[: len(data) // 2], "(truncated?)"),
        ("cut in the header", data[:100], "does not fit in the file's 100 bytes"),
        ("four bytes", data[:4], "too short for a safetensors header"),
        ("empty", b"", "0 bytes, too short"),
        ("header not JSON", data[:8] + b"{" * (len(data) - 8), "the header is not valid JSON"),
        ("a shape its bytes do not hold", _with_header(bad_shape, body), f"{first!r}: F32 [7, 7]"),
        ("an unknown dtype", _with_header(bad_dtype, body), f"{first!r}: unknown dtype 'Q9'"),
        ("bytes past the last tensor", data + b"\0" * 64, "64 bytes after the last tensor"),
    ]
    for i, (what, blob, words) in enumerate(cases):
        st = _copy(src, tmp_path / str(i))
        st.write_bytes(blob)
        with pytest.raises(ValueError) as e:
            load_checkpoint(st.parent, progress=False)
        assert str(e.value).startswith(f"{st}: ") and words in str(e.value), (what, e.value)
    # the other files: config.json, tokenizer.json, the shard index
    d = tmp_path / "json"
    _copy(src, d)
    (d / "config.json").write_text('{"architectures": ["LlamaForCausalLM"],')
    with pytest.raises(ValueError, match=f"^{d / 'config.json'}: not valid JSON"):
        load_checkpoint(d, progress=False)
    (d / "config.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match="expected a JSON object, got list"):
        load_checkpoint(d, progress=False)
    shutil.copy(os.path.join(src, "config.json"), d / "config.json")
    (d / "tokenizer.json").write_text("{not json")
    with pytest.raises(ValueError, match=f"^{d / 'tokenizer.json'}: not a readable tokenizer"):
        load_checkpoint(d, progress=False)


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory, tiny):
    """TINY's weights and a trained BPE as a GGUF file (test_engine_loader's writer)."""
    tok = _train_bpe()
    cfg = transformers.LlamaConfig(**dict(TINY, vocab_size=tok.get_vocab_size()))
    hf = hm.random_model(cfg, 16)
    sd = {k: v for k, v in hf.state_dict().items() if k != "lm_head.weight"}
    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    _write_gguf(path, sd, cfg, tok)
    return path, tok, sd


def test_truncated_or_corrupt_gguf_names_the_file_and_tensor(tiny_gguf, tmp_path):
    path, _, _ = tiny_gguf
    data = path.read_bytes()
    reader = gguf.GGUFReader(path)
    last = max(reader.tensors, key=lambda t: t.data_offset)
    middle = sorted(reader.tensors, key=lambda t: t.data_offset)[len(reader.tensors) // 2]
    cut = middle.data_offset + middle.n_bytes // 2
    load_checkpoint(path, progress=False)  # the whole file loads
    cases = [
        ("cut by one byte", data[:-1], f"tensor {last.name!r}: a read of"),
        ("cut inside a tensor", data[:cut], f"tensor {middle.name!r}: a read of"),
        ("cut in the metadata", data[:3000], "runs past the end of the file (3000 bytes"),
        ("cut in the magic", data[:3], "runs past the end of the file (3 bytes"),
        ("empty", b"", "cannot mmap an empty file"),
        ("a huge version", data[:4] + b"\xff" * 4 + data[8:], "version 4294967295"),
        ("a huge tensor count", data[:8] + b"\xff" * 8 + data[16:], "runs past the end"),
        ("a huge string length", data[:24] + b"\xff\xff\xff\x7f" + data[28:], "runs past"),
    ]
    for i, (what, blob, words) in enumerate(cases):
        bad = tmp_path / f"{i}.gguf"
        bad.write_bytes(blob)
        t0 = time.perf_counter()
        with pytest.raises(ValueError) as e:
            load_checkpoint(bad, progress=False)
        assert time.perf_counter() - t0 < 5, what  # a corrupt count does not loop on
        assert str(e.value).startswith(f"{bad}: not a readable GGUF file: "), (what, e.value)
        assert words in str(e.value), (what, e.value)


# -- hostile checkpoints -----------------------------------------------------------------

HOSTILE_CONFIGS = [
    ("num_attention_heads", -1),
    ("num_attention_heads", 0),
    ("num_attention_heads", 1 << 40),
    ("num_attention_heads", 2.5),
    ("num_attention_heads", "8"),
    ("num_attention_heads", True),
    ("num_key_value_heads", 0),
    ("num_key_value_heads", 1 << 40),
    ("hidden_size", -64),
    ("hidden_size", 0),
    ("hidden_size", 1 << 40),
    ("vocab_size", 1 << 40),
    ("vocab_size", 0),
    ("num_hidden_layers", 10**6),
    ("num_hidden_layers", -1),
    ("num_hidden_layers", 0),
    ("intermediate_size", 1 << 40),
    ("intermediate_size", -1),
    ("head_dim", 1 << 40),
    ("head_dim", 0),
    ("max_position_embeddings", 1 << 40),
    ("max_position_embeddings", 0),
    ("num_experts", 1 << 40),
    ("num_local_experts", -4),
    ("linear_num_value_heads", 1 << 40),
    ("rms_norm_eps", -1.0),
    ("rms_norm_eps", math.nan),
    ("eos_token_id", "</s>"),
]


def rss_bytes():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _refused_quickly(load, match):
    """``load()`` raises ValueError matching ``match`` within 0.5 s, with under 1 MB of
    Python/NumPy memory at its peak and RSS no more than 16 MB higher after."""
    rss = rss_bytes()
    tracemalloc.start()
    t0 = time.perf_counter()
    try:
        with pytest.raises(ValueError, match=match):
            load()
        took = time.perf_counter() - t0
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert took < 0.5 and peak < 1 << 20, (match, took, peak)
    assert rss_bytes() - rss < 16 << 20, match


def test_hostile_config_sizes_are_refused_before_any_allocation(tiny, tmp_path):
    path, _ = tiny
    base = json.loads(pathlib.Path(path, "config.json").read_text())
    for i, (key, value) in enumerate(HOSTILE_CONFIGS):
        d = tmp_path / str(i)
        shutil.copytree(path, d)
        (d / "config.json").write_text(json.dumps({**base, key: value}))
        _refused_quickly(lambda d=d: hm.engine(str(d)), f"^{key}: expected")
    # sizes that are each fine but do not fit together
    mismatched = [
        ({"hidden_size": 33, "head_dim": None}, "hidden_size: expected a multiple of"),
        ({"num_key_value_heads": 4, "num_attention_heads": 6}, "num_key_value_heads"),
        ({"vocab_size": 300}, r"vocab_size: the config's \[vocab_size, hidden_size\] is"),
        ({"hidden_size": 64}, "hidden_size: the config's"),
        ({"rope_parameters": {"rope_type": "default", "rope_theta": -1.0}}, "rope_theta"),
    ]
    for i, (fields, match) in enumerate(mismatched):
        d = tmp_path / f"m{i}"
        shutil.copytree(path, d)
        (d / "config.json").write_text(json.dumps({**base, **fields}))
        with pytest.raises(ValueError, match=match):
            hm.engine(str(d))


def test_hostile_gguf_metadata_is_refused_before_any_allocation(tiny_gguf, tmp_path):
    """GGUF size keys (uint32 in the file) that are zero, absurd or missing: refused under
    the key's own name before the tensors are dequantized."""
    _, tok, sd = tiny_gguf
    good = dict(TINY, vocab_size=tok.get_vocab_size(), rms_norm_eps=1e-5,
                rope_parameters={"rope_theta": 1e4})  # fmt: skip
    embed = {"model.embed_tokens.weight": sd["model.embed_tokens.weight"]}
    cases = [
        ("num_attention_heads", 0, "llama.attention.head_count: expected"),
        ("num_attention_heads", (1 << 32) - 1, "llama.attention.head_count: expected"),
        ("num_key_value_heads", 0, "llama.attention.head_count_kv: expected"),
        ("hidden_size", 0, "llama.embedding_length: expected"),
        ("num_hidden_layers", 10**6, "llama.block_count: expected"),
        ("max_position_embeddings", 0, "llama.context_length: expected"),
        ("intermediate_size", 1 << 31, "llama.feed_forward_length: expected"),
    ]
    for i, (key, value, match) in enumerate(cases):
        p = tmp_path / f"{i}.gguf"
        _write_gguf(p, embed, SimpleNamespace(**{**good, key: value}), tok)
        _refused_quickly(lambda p=p: load_checkpoint(p, progress=False), f"^{match}")


# -- KeyboardInterrupt -------------------------------------------------------------------

MIXED = [hm.prompt(40, 1), hm.prompt(7, 2), hm.prompt(70, 3), hm.prompt(3, 4)]
MIXED_PARAMS = [
    GREEDY,
    SamplingParams(temperature=0.9, top_k=50, top_p=0.9, seed=3, max_tokens=9, ignore_eos=True),
    SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
    SamplingParams(temperature=1.0, seed=11, max_tokens=5, ignore_eos=True),
]


def _interrupt_after(n, fn):
    """``fn``, raising KeyboardInterrupt after its ``n``-th call has returned."""
    calls = [0]

    def wrapped(*args, **kw):
        out = fn(*args, **kw)
        calls[0] += 1
        if calls[0] == n:
            raise KeyboardInterrupt
        return out

    return wrapped


def test_keyboard_interrupt_leaves_the_engine_as_new(tiny, monkeypatch):
    """A KeyboardInterrupt mid-call (from a step, from inside a block allocation, from a
    stream's consumer, a stream dropped half-way): the next call gives a fresh engine's
    tokens, with preemption under a pool of 5 blocks, and every block comes back."""
    path, _ = tiny
    kw = dict(kv_cache_memory=5 * BLOCK_BYTES, max_num_batched_tokens=32)
    fresh = hm.engine(path, **kw)
    want = [o.token_ids for o in fresh.generate(MIXED, MIXED_PARAMS)]
    assert fresh.scheduler.num_preemptions > 0
    llm = hm.engine(path, **kw)

    def again():
        assert llm.scheduler.idle()
        assert [o.token_ids for o in llm.generate(MIXED, MIXED_PARAMS)] == want

    for n in (1, 4, 9):  # in the first prefill, mid-prefills, among decodes
        with monkeypatch.context() as m:
            m.setattr(llm.runner, "execute", _interrupt_after(n, llm.runner.execute))
            with pytest.raises(KeyboardInterrupt):
                llm.generate(MIXED, MIXED_PARAMS)
        again()
    pool = llm.scheduler.groups[0].pool
    with monkeypatch.context() as m:  # blocks taken but not yet given to the request
        m.setattr(pool, "allocate", _interrupt_after(3, pool.allocate))
        with pytest.raises(KeyboardInterrupt):
            llm.generate(MIXED, MIXED_PARAMS)
    again()
    with pytest.raises(KeyboardInterrupt):  # the consumer of a stream
        for k, _ in enumerate(llm.generate_stream(MIXED, MIXED_PARAMS)):
            if k == 6:
                raise KeyboardInterrupt
    again()
    stream = llm.generate_stream(MIXED, MIXED_PARAMS)
    next(stream)
    with pytest.raises(RuntimeError, match="exhaust or close"):  # same thread, stream open
        llm.generate(MIXED, MIXED_PARAMS)
    stream.close()
    again()


# -- threads -----------------------------------------------------------------------------

THREADS_CHILD = """
import threading
from engine.llm import SamplingParams
from tests import hf_models as hm

llm = hm.engine({path!r})
sets = [
    ([hm.prompt(n, s) for s, n in enumerate((5, 30, 11))],
     SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)),
    ([hm.prompt(n, s) for s, n in enumerate((60, 2), 7)],
     SamplingParams(temperature=0.8, seed=5, max_tokens=12, ignore_eos=True)),
]
alone = [[o.token_ids for o in llm.generate(p, sp)] for p, sp in sets]
ran = []  # the thread of each step
execute = llm.runner.execute
def traced(*a):
    ran.append(threading.get_ident())
    return execute(*a)
llm.runner.execute = traced
got, errors = {{0: [], 1: []}}, []
CALLS = 4
def work(k):
    try:
        p, sp = sets[k]
        for j in range(CALLS):
            if j % 2:
                toks = {{}}
                for i, t, _ in llm.generate_stream(p, sp):
                    toks.setdefault(i, []).append(t)
                got[k].append([toks[i] for i in range(len(p))])
            else:
                got[k].append([o.token_ids for o in llm.generate(p, sp)])
    except BaseException as e:
        errors.append(repr(e))
threads = [threading.Thread(target=work, args=(k,)) for k in (0, 1)]
for t in threads:
    t.start()
for t in threads:
    t.join()
assert not errors, errors
for k in (0, 1):
    assert got[k] == [alone[k]] * CALLS, (k, got[k], alone[k])
runs = 1 + sum(a != b for a, b in zip(ran, ran[1:]))
assert len(set(ran)) == 2 and runs <= 2 * CALLS, runs  # each call's steps back to back
print("ok", runs)
"""


def test_two_threads_get_their_solo_results(tiny):
    """Two threads, each alternating generate and generate_stream on one LLM: every call
    returns what it returns alone, and the steps of one call are never interleaved with
    another's (the engine's lock). In a child process, so that a crash is a failure."""
    out = run_child(THREADS_CHILD.format(path=tiny[0]), timeout=600)
    assert out.startswith("ok")
