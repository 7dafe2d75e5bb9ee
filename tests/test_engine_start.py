"""The engine's start: what ``LLM()`` allocates and touches, the GGUF reader and the
weight packing it loads with, the warmup of a model's kernels and the CLI's honest
timing line.

The caches are allocated by ``torch.empty`` (engine.kv_cache): a child process shows
that an engine whose KV pool is capped at 256 MB holds none of it in RAM until blocks
are used, and NaN-filled caches and GDN states give the tokens of fresh ones (the
kernels read only what a request wrote). The first-token latency of the default model is
a benchmark figure (``bench/bench_start.py``), not a timed test."""

import json
import math
import re

import gguf
import numba
import numpy as np
import pytest
import torch
import transformers

import numkern
from engine.__main__ import main
from engine.kv_cache import AttentionSpec, blocks_per_group, group_layers
from engine.llm import SamplingParams
from engine.loader.gguf_file import GGUFFile
from engine.memory import WeightArena

from . import hf_models as hm
from .conftest import run_child
from .test_engine_faults import BLOCK_BYTES, TINY, tiny_checkpoint
from .test_engine_gdn import FAMILIES as GDN_FAMILIES
from .test_engine_gdn import _randomize as gdn_randomize
from .test_engine_loader import _train_bpe, _write_gguf


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """test_engine_faults' TINY Llama (head_dim 16, 2 layers, fp32 blocks of 8 KB)."""
    path = tmp_path_factory.mktemp("tiny")
    tiny_checkpoint(path)
    return str(path)


@pytest.fixture(scope="module")
def qwen3_5(tmp_path_factory):
    """test_engine_gdn's tiny Qwen3.5 (3 GDN layers, 1 attention layer), saved."""
    cfg = GDN_FAMILIES["qwen3_5"]()
    hf = gdn_randomize(transformers.AutoModelForImageTextToText.from_config(cfg), 35)
    path = tmp_path_factory.mktemp("qwen3_5")
    hf.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    """TINY with a trained BPE, as a GGUF file (test_engine_loader's writer)."""
    tok = _train_bpe()
    cfg = transformers.LlamaConfig(**dict(TINY, vocab_size=tok.get_vocab_size()))
    sd = hm.random_model(cfg, 16).state_dict()
    sd.pop("lm_head.weight")
    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    _write_gguf(path, sd, cfg, tok)
    return str(path)


# -- the GGUF reader -----------------------------------------------------------------------

Q = gguf.GGMLQuantizationType
# odd row counts; widths of whole blocks (32, or 256 for the K-quants)
QUANTIZED = [("q4_0", Q.Q4_0, (13, 64)), ("q4_1", Q.Q4_1, (97, 96)), ("q8_0", Q.Q8_0, (5, 32))]


def _write_all_types(path):
    """A GGUF with a metadata value of every type and tensors of every type the reader
    dequantizes itself (and Q6_K, which it leaves to gguf)."""
    rng = np.random.default_rng(7)
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_uint8("t.u8", 250)
    w.add_int8("t.i8", -7)
    w.add_uint16("t.u16", 65000)
    w.add_int16("t.i16", -30000)
    w.add_uint32("t.u32", 4_000_000_000)
    w.add_int32("t.i32", -2_000_000_000)
    w.add_float32("t.f32", 1e-5)
    w.add_uint64("t.u64", 1 << 60)
    w.add_int64("t.i64", -(1 << 60))
    w.add_float64("t.f64", math.pi)
    w.add_bool("t.bool", True)
    w.add_string("t.str", "héllo <|im_end|>\n")
    w.add_array("t.strs", ["", "a b", "ü", "<0x0A>", "x" * 300])
    w.add_array("t.ints", [3, -1, 7])
    w.add_array("t.floats", [0.5, -2.25])
    w.add_array("t.bools", [True, False, True])
    tensors = {}
    for name, qtype, shape in QUANTIZED:
        a = rng.standard_normal(shape, dtype=np.float32)
        w.add_tensor(name, gguf.quants.quantize(a, qtype), raw_dtype=qtype)
        tensors[name] = qtype
    for name, dt in (("f32", np.float32), ("f16", np.float16)):
        w.add_tensor(name, rng.standard_normal((7, 33)).astype(dt))
        tensors[name] = name
    bf16 = gguf.quants.quantize(rng.standard_normal((3, 16), dtype=np.float32), Q.BF16)
    w.add_tensor("bf16", bf16, raw_dtype=Q.BF16)
    # Q6_K: random bytes with a small fp16 scale at the end of each 210-byte block
    q6 = rng.integers(0, 256, (4, 210), dtype=np.uint8)
    q6[:, -2:] = np.array([0.01], np.float16).view(np.uint8)
    w.add_tensor("q6_k", q6, raw_dtype=Q.Q6_K)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_gguf_file_reads_what_gguf_reads(tmp_path):
    """Every metadata value as gguf.GGUFReader reads it, every tensor as
    gguf.quants.dequantize gives it (bit for bit), in fp32 and rounded once to bf16."""
    path = tmp_path / "all.gguf"
    _write_all_types(path)
    ref = gguf.GGUFReader(path)
    f = GGUFFile(path)
    assert list(f.meta) == [k for k in ref.fields if not k.startswith("GGUF.")]
    for key, value in f.meta.items():
        want = ref.fields[key].contents()
        assert np.asarray(value).tolist() == np.asarray(want).tolist(), key
    assert isinstance(f.meta["t.u64"], int) and isinstance(f.meta["t.strs"], list)
    assert [t.name for t in ref.tensors] == list(f.tensors)
    for t in ref.tensors:
        want = torch.from_numpy(np.array(gguf.quants.dequantize(t.data, t.tensor_type)))
        got = f.tensor(t.name)
        shape = tuple(int(n) for n in reversed(t.shape))
        assert got.shape == shape and got.dtype == torch.float32, t.name
        torch.testing.assert_close(got, want.reshape(shape), rtol=0, atol=0, equal_nan=True)
        want_bf16 = want.reshape(shape).bfloat16()
        bf16 = f.tensor(t.name, torch.bfloat16)
        torch.testing.assert_close(bf16, want_bf16, rtol=0, atol=0, equal_nan=True)
    order = torch.tensor([4, 0, 3, 1, 2])
    assert torch.equal(f.tensor("q8_0", row_order=order), f.tensor("q8_0")[order])


# -- packing -------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_pack_is_convert_weight_packed(dtype):
    """WeightArena.pack of row parts (whole 32-row blocks packed in place; a part that
    ends mid-block concatenated first; a large part in slices) is, byte for byte,
    numkern.convert_weight_packed of their concatenation."""
    arena = WeightArena(chunk=1 << 20)
    cases = [
        [torch.randn(96, 48), torch.randn(40, 48)],  # aligned parts, a short last block
        [torch.randn(45, 48), torch.randn(32, 48), torch.randn(13, 48)],  # straddling
        [torch.randn(3001, 1024)],  # slices of 1024 rows (PACK_ELEMENTS / K, whole blocks)
    ]
    if dtype == torch.float32:
        cases.append([torch.randn(37, 13)])  # fp32 takes an odd K
    for parts in cases:
        parts = [p.to(dtype) for p in parts]
        got = arena.pack(*parts)
        want = numkern.convert_weight_packed(torch.cat(parts))
        assert got.shape == want.shape and got.dtype == dtype
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
    odd = torch.randn(64 * 48 + 1).to(dtype)[1:].view(64, 48)  # at an odd element offset
    assert odd.is_contiguous() and odd.storage_offset() == 1
    assert torch.equal(arena.pack(odd), numkern.convert_weight_packed(odd.clone()))


# -- KV sizing -----------------------------------------------------------------------------


def test_kv_blocks_are_what_the_engine_can_use():
    """No group gets more blocks than max_num_seqs requests of max_model_len hold (a
    sliding group: its window's worth per request), whatever the budget."""
    full = AttentionSpec(block_size=128, num_kv_heads=2, head_size=64, dtype=torch.bfloat16)
    swa = AttentionSpec(32, num_kv_heads=2, head_size=64, dtype=torch.bfloat16, sliding_window=64)
    groups = group_layers({"l0": full, "l1": swa, "l2": full})
    kw = dict(max_num_seqs=4, max_num_batched_tokens=64)
    huge = 1 << 40
    # 4 requests of 1000 tokens: 8 blocks of 128 each; the window: ceil(128/32) + 1 = 5
    assert blocks_per_group(groups, huge, **kw, max_model_len=1000) == [4 * 8, 4 * 5]
    # a context shorter than the window's reach: 2 blocks of 32 per request
    assert blocks_per_group(groups, huge, **kw, max_model_len=40) == [4 * 1, 4 * 2]
    # a small budget caps it as before: the window's 20 blocks of 32 tokens (512 B per
    # token in its one layer), the rest to the full group's 2 layers (1 KB per token)
    rest = (1 << 20) - 20 * 32 * 512
    assert blocks_per_group(groups, 1 << 20, **kw, max_model_len=10**6) == [
        rest // 1024 // 128,
        20,
    ]


START = r"""
import ctypes, json, mmap, os, sys
path, budget, seqs = ARGS
import torch
from engine.llm import LLM, SamplingParams

def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

libc = ctypes.CDLL(None, use_errno=True)
libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]

def resident(t):
    # the pages of t's memory that are in RAM (mincore)
    page = mmap.PAGESIZE
    start = t.data_ptr() // page * page
    n = -(-(t.data_ptr() + t.numel() * t.element_size() - start) // page)
    vec = (ctypes.c_ubyte * n)()
    if libc.mincore(start, n * page, vec) != 0:
        raise OSError(ctypes.get_errno(), "mincore")
    return sum(v & 1 for v in bytes(vec))

before = rss()
llm = LLM(path, dtype="float32", block_size=32, kv_cache_memory=budget, max_num_seqs=seqs,
          progress=False)
after = rss()
caches = [t for g in llm.scheduler.groups for t in g.caches.values()]
out = {
    "rss_growth": after - before,
    "num_blocks": [g.num_blocks for g in llm.kv_cache_groups],
    "max_model_len": llm.max_model_len,
    "cache_bytes": sum(t.numel() * t.element_size() for t in caches),
    "resident_pages": sum(resident(t) for t in caches),
    "caches": len(caches),
}
ids = llm.generate([list(range(3, 40))], SamplingParams(temperature=0, max_tokens=4))
out["resident_pages_after"] = sum(resident(t) for t in caches)
out["rss_growth_after"] = rss() - before
print(json.dumps(out))
"""


def _start(path, budget, seqs):
    return json.loads(run_child(START.replace("ARGS", repr((path, budget, seqs)))))


def test_warm_start_allocates_what_it_can_use_and_touches_none(tiny):
    """In a fresh process: LLM() allocates the KV blocks its sizing rule gives and no
    more (4 requests of 512 tokens: 64 blocks; 4096 requests: capped by a 256 MB
    budget), and a 256 MB cache takes no RAM until blocks are used (mincore: none of its
    pages resident but the allocator's header, and RSS grows by far less than it); a
    37-token request then makes resident only the pages of its two blocks."""
    budget = 256 << 20
    small = _start(tiny, budget, 4)
    assert small["max_model_len"] == TINY["max_position_embeddings"] == 512
    assert small["num_blocks"] == [4 * 512 // 32]
    assert small["cache_bytes"] == 64 * BLOCK_BYTES
    big = _start(tiny, budget, 4096)
    assert big["num_blocks"] == [budget // BLOCK_BYTES]  # 4096 * 16 blocks would not fit
    assert big["cache_bytes"] == budget
    # per cache tensor (one per layer, 128 MB), at most the huge page at either end
    # where the kernel backs all anonymous memory with them (THP "always")
    allowance = big["caches"] * 2 * (2 << 20)
    page = 4096
    assert big["resident_pages"] * page <= allowance, big
    assert big["rss_growth"] < 64 << 20, big
    assert 0 < big["resident_pages_after"] * page <= allowance, big
    assert big["rss_growth_after"] < budget // 2, big  # the kernels loaded, not the cache


# -- NaN-filled caches ---------------------------------------------------------------------

PROMPTS = [hm.prompt(60, 1), hm.prompt(5, 2), hm.prompt(30, 3)]
BATCH = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


def _nan_fill(llm):
    for g in llm.scheduler.groups:
        for t in g.caches.values():
            t.fill_(math.nan)
    for layer in llm.model.gdn_layers():
        layer.conv_state.fill_(math.nan)
        layer.ssm_state.fill_(math.nan)


@pytest.mark.parametrize(
    "model,pool",
    [("llama", None), ("llama", 4 * BLOCK_BYTES), ("qwen3_5", None)],
    ids=["llama", "llama-preempted", "qwen3_5"],
)
def test_nan_filled_caches_give_the_same_tokens(model, pool, tiny, qwen3_5):
    """Caches are never read before they are written: KV caches and GDN states full of
    NaN give the tokens and logits of an engine whose caches are as allocated, for a
    batch of chunked prefills (16-token chunks) and decodes, and in a pool of 4 blocks
    where requests are preempted and recomputed."""
    path = tiny if model == "llama" else qwen3_5
    runs = []
    for fill in (False, True):
        llm = hm.engine(path, max_num_batched_tokens=16, kv_cache_memory=pool, max_num_seqs=4)
        if fill:
            _nan_fill(llm)
        llm.record_logits = True
        outs = llm.generate(PROMPTS, BATCH)
        runs.append(([o.token_ids for o in outs], [torch.stack(o.logits) for o in outs]))
        if pool is not None:
            assert llm.scheduler.num_preemptions > 0
    (tokens, logits), (nan_tokens, nan_logits) = runs
    assert nan_tokens == tokens
    for a, b in zip(logits, nan_logits):
        assert torch.equal(a, b)


# -- the warmup and the CLI ----------------------------------------------------------------


WARMED = r"""
import json, sys
from numba.core.dispatcher import Dispatcher
from engine.llm import SamplingParams
from tests import hf_models as hm

def overloads():  # how many signatures each of numkern's kernels has compiled or loaded
    return {
        f"{m.__name__}.{name}": len(d.overloads)
        for m in list(sys.modules.values())
        if m is not None and m.__name__.startswith("numkern")
        for name, d in vars(m).items()
        if isinstance(d, Dispatcher)
    }

path, prompts, kw = ARGS
llm = hm.engine(path, max_num_batched_tokens=16, **kw)
timings = llm.warmup(progress=False)
before = overloads()
llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
after = overloads()
new = {k: after[k] - before.get(k, 0) for k in after if after[k] != before.get(k, 0)}
print(json.dumps({"cases": list(timings), "loaded": sum(before.values()), "new": new}))
"""


@pytest.fixture(scope="module")
def moe_bf16(tmp_path_factory):
    """test_engine_amx_layout's tiny bf16 Qwen3-MoE (4 experts, top 2), saved."""
    from .test_engine_amx_layout import CONFIG

    path = tmp_path_factory.mktemp("qwen3_moe_bf16")
    model = hm.random_model(transformers.Qwen3MoeConfig(**CONFIG), 36)
    model.to(torch.bfloat16).save_pretrained(path)
    return str(path)


@pytest.mark.parametrize("model", ["llama", "qwen3_5", "moe_bf16"])
def test_warmup_loads_every_kernel_a_step_runs(model, request):
    """In a fresh process, after LLM.warmup() a batch of prefills and decodes compiles
    and loads no kernel: the warmup's cases are the model's kernels with the types a
    step gives them (bf16 MoE: the decode tiles and a prefill's, vdpbf16ps where the CPU
    has AVX512-BF16, for the experts and the router)."""
    path = request.getfixturevalue("tiny" if model == "llama" else model)
    kw = {"dtype": "bfloat16"} if model == "moe_bf16" else {}
    got = json.loads(run_child(WARMED.replace("ARGS", repr((path, PROMPTS, kw)))))
    names = got["cases"]
    dt = "bfloat16" if model == "moe_bf16" else "float32"
    assert names[0].startswith("attention plan (") and names[1] == f"decoder layers {dt}"
    if model == "qwen3_5":
        assert names[2:] == ["GDN chunked float32", "GDN decode float32"]
    if model == "moe_bf16":
        lay = numkern.isa.moe_isa(torch.bfloat16)[0]  # numkern's decision for this CPU
        assert names[2:] == [
            f"MoE experts bfloat16 ({lay})",
            f"MoE experts bfloat16 ({lay}, 8 rows)",
        ]
    assert got["loaded"] > 0 and got["new"] == {}, got


def test_cli_reports_compile_apart(tiny_gguf, capsys):
    """The CLI warms the model's kernels up first, and its last line gives the compile
    time apart from the prefill and decode rates."""
    args = ["--model", tiny_gguf, "--max-tokens", "3", "--dtype", "float32", "--block-size", "32"]
    main(["generate", "hello world", *args])
    stats = capsys.readouterr().out.strip().splitlines()[-1]
    assert re.fullmatch(
        r"compile: \d+ kernels, [\d.]+ s \((disk cache|compiled \d+ functions"
        r"(, \d+ helper process(es)?)?)\); "
        r"prefill: \d+ tokens, [\d.]+ tokens/s; decode: \d+ tokens, [\d.]+ tokens/s",
        stats,
    ), stats


def test_cli_warmup_compiles_and_says_so(tiny_gguf, capsys):
    """``python -m engine warmup MODEL``: the model's kernels (compiled or from the disk
    cache), then the compile line and nothing else on stdout."""
    main(["warmup", tiny_gguf, "--dtype", "float32", "--block-size", "32"])
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 1 and re.fullmatch(
        r"compile: \d+ kernels, [\d.]+ s \((disk cache|compiled \d+ functions"
        r"(, \d+ helper process(es)?)?)\)",
        out[0],
    ), out


@pytest.mark.parametrize("tty", [True, False])
def test_warmup_progress_names_what_compiles_and_only_then(capsys, monkeypatch, tty):
    """numkern.warmup(progress="compiling"): on a terminal, a bar on stderr once a function
    compiles, naming the case and the function; elsewhere one line per case that compiled
    (no carriage returns); nothing when every kernel is already there."""
    import sys

    monkeypatch.setattr(sys.stderr, "isatty", lambda: tty)

    @numba.njit
    def add_one(x):
        return x + 1

    cases = [("loaded", lambda: None), ("fresh", lambda: add_one(1))]
    timings = numkern.warmup(cases=cases, progress="compiling", desc="kernels here")
    err = capsys.readouterr().err
    assert timings.compiled >= 1 and list(timings) == ["loaded", "fresh"]
    if tty:
        assert "kernels here" in err and "fresh: compiling " in err and "add_one" in err, err
    else:
        n = timings.compiled
        assert re.fullmatch(
            rf"kernels here: \[2/2\] fresh: [\d.]+ s \(compiled {n} functions\)\n", err
        )
    again = numkern.warmup(cases=[("again", lambda: add_one(2))], progress="compiling")
    assert capsys.readouterr().err == "" and again.compiled == 0
    lines = numkern.warmup(cases=[("again", lambda: add_one(2))], progress=True, desc="d")
    if not tty:
        assert (
            capsys.readouterr().err
            == "d: [1/1] again: " + f"{lines['again']:.1f}" + " s (nothing compiled)\n"
        )
    with pytest.raises(ValueError, match="progress"):
        numkern.warmup(cases=cases, progress="yes")
