"""numkern's attention ops as torch custom ops (``numkern.torch_ops.attention``,
docs/kernels.md §12.3): opcheck, equality with the direct calls and with vLLM's ops,
``torch.compile``/``export`` of "KV write -> paged attention", and the refusals."""

import math
import shutil

import pytest
import torch

import numkern.torch_ops  # noqa: F401  (defines torch.ops.numkern.*)
from numkern import attention as A
from numkern.attention import serial

from . import oracle
from .conftest import run_child
from .test_attention import _VLLM_PROBE, assert_close_attn, assert_close_vllm, build, reference

BF, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32
OPS = torch.ops.numkern
REQS = [(1, 45), (3, 70), (5, 5)]  # decode, chunked prefill, prefill

# (dtype, isa, (Hq, Hkv), D, B, causal, window, softcap, alibi, sinks): each value once,
# pairwise (every case is one more Numba compilation)
CASES = [
    (FP32, "vec", (4, 2), 32, 32, True, -1, 0.0, False, None),
    (BF, "vec16", (4, 1), 48, 16, True, 8, 0.0, False, BF),
    (FP16, "vec", (2, 2), 32, 32, False, 13, 30.0, True, FP32),
]


def step(dtype, isa, heads, d, b, reqs=REQS, seed=0):
    """Cache written by numkern, query and index tensors, the new K/V of one more token
    per request and their slots."""
    hq, hkv = heads
    q, kc, vc, qsl, sl, bt, ks, vs = build(reqs, hq, hkv, d, b, dtype, isa, seed)
    g = torch.Generator().manual_seed(seed + 1)
    k = torch.randn(len(reqs), hkv, d, generator=g).to(dtype)
    v = torch.randn(len(reqs), hkv, d, generator=g).to(dtype)
    # request 0's token padded (-1: skipped), the others overwrite key 1 of their
    # request (the tests that write compare the op with the direct call, not a reference)
    slots = torch.tensor([-1] + [int(bt[r, 0]) * b + 1 for r in range(1, len(reqs))])
    return q, kc, vc, qsl, sl, bt, ks, vs, k, v, slots


def metadata(q, qsl, sl, hkv, isa, *, causal=True, window=-1, split=True, ops=OPS):
    return ops.get_scheduler_metadata(
        len(sl), q.shape[1], hkv, q.shape[2], sl, q.dtype, qsl, causal, window, isa, split, None
    )


def attention_args(
    q, kc, vc, qsl, sl, bt, meta, *, causal=True, window=-1, softcap=0.0, alibi=None, sinks=None
):
    out = torch.full_like(q, float("nan"))
    scale = 1 / math.sqrt(q.shape[2])
    args = (q, kc, vc, out, qsl, sl, scale, causal, alibi, window, bt, softcap, meta, sinks)
    return (*args, None)


def extras(hq, alibi, sinks):
    g = torch.Generator().manual_seed(3)
    slopes = torch.rand(hq, generator=g) * -0.1 if alibi else None
    return slopes, (torch.randn(hq, generator=g).to(sinks) if sinks else None)


# ---------------------------------------------------------------------------------------
# opcheck and equality with the direct calls


@pytest.mark.parametrize("dtype,isa,heads,d,b,causal,window,softcap,alibi,sinks", CASES)
def test_opcheck_and_direct(dtype, isa, heads, d, b, causal, window, softcap, alibi, sinks):
    q, kc, vc, qsl, sl, bt, _ks, _vs, k, v, slots = step(dtype, isa, heads, d, b)
    hkv = heads[1]
    cache_args = (k, v, kc, vc, slots, isa)
    torch.library.opcheck(OPS.cpu_attn_reshape_and_cache.default, cache_args)
    meta_args = (len(sl), heads[0], hkv, d, sl, dtype, qsl, causal, window, isa, True, None)
    torch.library.opcheck(OPS.get_scheduler_metadata.default, meta_args)
    # the op's write equals the direct call's, byte for byte
    kc2, vc2 = kc.clone(), vc.clone()
    A.reshape_and_cache(k, v, kc2, vc2, slots, isa)
    OPS.cpu_attn_reshape_and_cache(*cache_args)
    assert torch.equal(kc.nan_to_num(), kc2.nan_to_num())
    assert torch.equal(vc.nan_to_num(), vc2.nan_to_num())
    meta = metadata(q, qsl, sl, hkv, isa, causal=causal, window=window)
    slopes, sink_t = extras(heads[0], alibi, sinks)
    kw = dict(causal=causal, window=window, softcap=softcap, alibi=slopes, sinks=sink_t)
    args = attention_args(q, kc, vc, qsl, sl, bt, meta, **kw)
    torch.library.opcheck(OPS.cpu_attention_with_kv_cache.default, args)
    OPS.cpu_attention_with_kv_cache(*args)
    # the direct call with the same plan: bitwise equal
    plan = A.plan_attention(
        qsl,
        sl,
        num_heads=heads[0],
        num_kv_heads=hkv,
        head_dim=d,
        block_size=b,
        causal=causal,
        sliding_window=window,
        isa=isa,
    )
    direct = torch.full_like(q, float("nan"))
    A.paged_attention(
        q,
        kc,
        vc,
        direct,
        qsl,
        sl,
        bt,
        scale=args[6],
        causal=causal,
        sliding_window=window,
        softcap=softcap,
        alibi_slopes=slopes,
        sinks=sink_t,
        isa=isa,
        plan=plan,
    )
    assert torch.equal(args[3], direct)


def test_metadata_round_trip_and_no_split():
    q, _kc, _vc, qsl, sl, _bt, *_ = step(FP32, "vec", (4, 2), 32, 32, reqs=[(1, 2000), (1, 3)])
    kw = dict(num_heads=4, num_kv_heads=2, head_dim=32, block_size=32, isa="vec")
    for split, threads in ((True, None), (False, 0)):
        meta = metadata(q, qsl, sl, 2, "vec", split=split)
        plan, dtype = serial.plan_from_tensor(meta, block_size=32)
        want = A.plan_attention(qsl, sl, num_threads=threads, **kw)
        assert dtype == FP32 and meta.shape[0] == serial.metadata_length(
            2, want.items.shape[0], want.merges.shape[0]
        )
        assert (plan.items == want.items).all() and (plan.merges == want.merges).all()
        assert (plan.num_partials, plan.part_rows) == (want.num_partials, want.part_rows)
        assert (plan.merges.shape[0] > 0) == split  # the 2000-key decode is split


def test_plan_attention_op():
    """numkern's planning function under its name: the plan of ``A.plan_attention``
    serialised (the metadata ``get_scheduler_metadata`` gives for the same step), which
    the attention op runs with; opcheck; its refusals."""
    q, kc, vc, qsl, sl, bt, *_ = step(BF, "vec", (4, 2), 32, 32)
    kw = dict(num_heads=4, num_kv_heads=2, head_dim=32, block_size=32, isa="vec")
    for window, threads in ((-1, None), (8, 0), (-1, 1)):
        got = OPS.plan_attention(
            qsl, sl, **kw, sliding_window=window, dtype="bfloat16", num_threads=threads
        )
        plan = A.plan_attention(qsl, sl, **kw, sliding_window=window, num_threads=threads)
        assert torch.equal(got, serial.plan_to_tensor(plan, BF))
    meta = OPS.plan_attention(qsl, sl, **kw, dtype="bfloat16")
    assert torch.equal(meta, metadata(q, qsl, sl, 2, "vec"))
    args = attention_args(q, kc, vc, qsl, sl, bt, meta)
    OPS.cpu_attention_with_kv_cache(*args)
    want = torch.empty_like(q)
    A.paged_attention(q, kc, vc, want, qsl, sl, bt, scale=args[6], isa="vec")
    assert torch.equal(args[3], want)
    torch.library.opcheck(
        OPS.plan_attention.default, (qsl, sl), dict(**kw, dtype="float32", num_threads=2)
    )
    with pytest.raises(TypeError, match="dtype: expected one of"):
        OPS.plan_attention(qsl, sl, **kw, dtype="int8")
    with pytest.raises(ValueError, match="block_size"):
        OPS.plan_attention(qsl, sl, **{**kw, "block_size": 24}, dtype="float32")
    with pytest.raises(ValueError, match="query_start_loc: expected shape"):
        OPS.plan_attention(qsl[:-1], sl, **kw, dtype="bfloat16")


def test_group_metadata_without_window_replans_per_layer():
    """vLLM's group metadata has window -1 when the group's layers differ; a layer with
    a window gets its window's result."""
    q, kc, vc, qsl, sl, bt, ks, vs, *_ = step(BF, "vec", (4, 2), 32, 32)
    meta = metadata(q, qsl, sl, 2, "vec")
    args = attention_args(q, kc, vc, qsl, sl, bt, meta, window=7)
    OPS.cpu_attention_with_kv_cache(*args)
    ref = reference(q, qsl, sl, ks, vs, 2, scale=args[6], window=7)
    assert_close_attn(args[3], ref)


# ---------------------------------------------------------------------------------------
# vLLM's ops on the same inputs


@pytest.mark.parametrize(
    "dtype,isa,window,softcap,sinks", [(BF, "vec", -1, 0.0, False), (FP32, "vec16", 9, 20.0, True)]
)
def test_matches_vllm(dtype, isa, window, softcap, sinks):
    d, b = 32, (32 if isa == "vec" else 16)
    probe = _VLLM_PROBE.format(dt=str(dtype).split(".")[1], isa=isa, b=b, d=d)
    oracle.require_op(f"cpu attention ({isa}, {dtype})", probe)
    vllm = oracle.ops()
    q, kc, _vc, qsl, sl, bt, ks, vs, _k, _v, _slots = step(dtype, isa, (4, 2), d, b)
    nb = kc.shape[0]
    # vLLM needs the zero-filled cache it allocates (it reads the tail of a block)
    theirs_kv = torch.zeros(A.kv_cache_shape(nb, 2, b, d), dtype=dtype)
    tkc, tvc = A.split_kv_cache(theirs_kv)
    all_slots = torch.cat(
        [
            bt[r, torch.arange(kl) // b].long() * b + torch.arange(kl) % b
            for r, (_, kl) in enumerate(REQS)
        ]
    )
    vllm.cpu_attn_reshape_and_cache(torch.cat(ks), torch.cat(vs), tkc, tvc, all_slots, isa)
    ours_kv = torch.full_like(theirs_kv, float("nan"))
    okc, ovc = A.split_kv_cache(ours_kv)
    OPS.cpu_attn_reshape_and_cache(torch.cat(ks), torch.cat(vs), okc, ovc, all_slots, isa)
    assert torch.equal(ours_kv.nan_to_num(), theirs_kv)
    sink_t = torch.randn(4) if sinks else None
    kw = dict(window=window, softcap=softcap, sinks=sink_t)
    theirs = attention_args(
        q, tkc, tvc, qsl, sl, bt, metadata(q, qsl, sl, 2, isa, window=window, ops=vllm), **kw
    )
    vllm.cpu_attention_with_kv_cache(*theirs)
    ours = attention_args(
        q, okc, ovc, qsl, sl, bt, metadata(q, qsl, sl, 2, isa, window=window), **kw
    )
    OPS.cpu_attention_with_kv_cache(*ours)
    ref = reference(
        q, qsl, sl, ks, vs, 2, scale=ours[6], window=window, softcap=softcap, sinks=sink_t
    )
    assert_close_vllm(theirs[3], ref)  # vLLM rounds P to the cache dtype before P @ V
    assert_close_attn(ours[3], ref)


# ---------------------------------------------------------------------------------------
# torch.compile and torch.export of "KV write -> paged attention"


def kv_write_then_attention(q, k, v, kv_cache, slots, qsl, sl, bt):
    """One layer's step, the metadata computed inside (a data-dependent size)."""
    nb, hkv, b, d2 = kv_cache.shape
    kc, vc = kv_cache.view(nb, hkv, 2 * b, d2 // 2).chunk(2, dim=2)
    OPS.cpu_attn_reshape_and_cache(k, v, kc, vc, slots, "vec")
    meta = metadata(q, qsl, sl, hkv, "vec")
    out = torch.empty_like(q)
    scale = 1 / math.sqrt(q.shape[2])
    OPS.cpu_attention_with_kv_cache(
        q, kc, vc, out, qsl, sl, scale, True, None, -1, bt, 0.0, meta, None, None
    )
    return out


def kv_write_then_attention_outside(q, k, v, kv_cache, slots, qsl, sl, bt, meta):
    """The same with the metadata computed outside (once per step, as vLLM does)."""
    nb, hkv, b, d2 = kv_cache.shape
    kc, vc = kv_cache.view(nb, hkv, 2 * b, d2 // 2).chunk(2, dim=2)
    OPS.cpu_attn_reshape_and_cache(k, v, kc, vc, slots, "vec")
    out = torch.empty_like(q)
    scale = 1 / math.sqrt(q.shape[2])
    OPS.cpu_attention_with_kv_cache(
        q, kc, vc, out, qsl, sl, scale, True, None, -1, bt, 0.0, meta, None, None
    )
    return out


def compile_inputs():
    q, kc, _vc, qsl, sl, bt, ks, vs, k, v, slots = step(BF, "vec", (4, 2), 32, 32)
    kv = torch.zeros(A.kv_cache_shape(kc.shape[0], 2, 32, 32), dtype=BF)
    okc, ovc = A.split_kv_cache(kv)
    for r, (_, kl) in enumerate(REQS):
        pos = torch.arange(kl)
        A.reshape_and_cache(ks[r], vs[r], okc, ovc, bt[r, pos // 32].long() * 32 + pos % 32, "vec")
    return q, k, v, kv, slots, qsl, sl, bt


def has_cxx():
    return any(shutil.which(c) for c in ("g++", "c++", "clang++"))


# importing inductor imports torch.utils.mkldnn, which warns (filterwarnings = error)
@pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")
@pytest.mark.parametrize("inside", [True, False], ids=["meta_inside", "meta_outside"])
@pytest.mark.parametrize("backend", ["eager", "aot_eager", "inductor"])
def test_compile_fullgraph(backend, inside):
    if backend == "inductor" and not has_cxx():
        pytest.skip("inductor needs a C++ compiler (none on PATH)")
    inputs = compile_inputs()
    fn = kv_write_then_attention if inside else kv_write_then_attention_outside
    extra = () if inside else (metadata(inputs[0], inputs[5], inputs[6], 2, "vec"),)
    kv_eager = inputs[3].clone()
    want = fn(*inputs[:3], kv_eager, *inputs[4:], *extra)
    torch._dynamo.reset()
    compiled = torch.compile(fn, fullgraph=True, backend=backend)
    got = compiled(*inputs, *extra)
    assert torch.equal(got, want)
    assert torch.equal(inputs[3], kv_eager)  # the compiled write reached the graph input


class _Step(torch.nn.Module):
    def forward(self, q, k, v, kv_cache, slots, qsl, sl, bt):
        return kv_write_then_attention(q, k, v, kv_cache, slots, qsl, sl, bt)


def test_export_runs_from_the_exported_program():
    inputs = compile_inputs()
    ep = torch.export.export(_Step(), tuple(x.clone() for x in inputs))
    kv_eager = inputs[3].clone()
    want = kv_write_then_attention(*inputs[:3], kv_eager, *inputs[4:])
    got = ep.module()(*inputs)
    assert torch.equal(got, want) and torch.equal(inputs[3], kv_eager)


def test_compile_cold_in_a_child():
    out = run_child(
        "import torch\n"
        "from tests.test_torch_ops_attention import compile_inputs, kv_write_then_attention\n"
        "inputs = compile_inputs()\n"
        "kv = inputs[3].clone()\n"
        "want = kv_write_then_attention(*inputs[:3], kv, *inputs[4:])\n"
        "f = torch.compile(kv_write_then_attention, fullgraph=True, backend='aot_eager')\n"
        "print(torch.equal(f(*inputs), want) and torch.equal(inputs[3], kv))\n"
    )
    assert out.strip().endswith("True")


# ---------------------------------------------------------------------------------------
# refusals


@pytest.fixture(scope="module")
def small():
    q, kc, vc, qsl, sl, bt, _ks, _vs, k, v, slots = step(FP32, "vec", (4, 2), 32, 32)
    return dict(q=q, kc=kc, vc=vc, qsl=qsl, sl=sl, bt=bt, k=k, v=v, slots=slots)


def _run_attention(s, meta, **kw):
    args = attention_args(s["q"], s["kc"], s["vc"], s["qsl"], s["sl"], s["bt"], meta, **kw)
    OPS.cpu_attention_with_kv_cache(*args)


def test_mismatched_metadata(small):
    s = small
    q, qsl, sl = s["q"], s["qsl"], s["sl"]
    other_sl = sl.clone()
    other_sl[0] += 1
    cases = [
        (metadata(q, qsl, other_sl, 2, "vec"), {}, "other query_start_loc/seq_lens"),
        (metadata(q, qsl, sl, 2, "vec", causal=False), {}, "plan: built for"),
        (metadata(q, qsl, sl, 2, "vec", window=5), {"window": 6}, "plan: built for"),
        (
            OPS.get_scheduler_metadata(3, 8, 2, 32, sl, FP32, qsl, True, -1, "vec", True, None),
            {},
            "plan: built for",
        ),
        (
            OPS.get_scheduler_metadata(3, 4, 2, 32, sl, BF, qsl, True, -1, "vec", True, None),
            {},
            "built for dtype bfloat16",
        ),
        (torch.zeros(40, dtype=torch.int64), {}, "expected a numkern plan"),
        (torch.zeros(3, dtype=torch.int64), {}, "at least"),
    ]
    good = metadata(q, qsl, sl, 2, "vec")
    damaged = good.clone()
    damaged[-1] += 1
    cases += [(damaged, {}, "checksum"), (good[:-8], {}, "length")]
    for meta, kw, match in cases:
        with pytest.raises(ValueError, match=match):
            _run_attention(s, meta, **kw)
    with pytest.raises(TypeError, match="scheduler_metadata: expected dtype int64"):
        _run_attention(s, good.int())
    if oracle.vllm.load().ok:  # vLLM's own metadata: a byte buffer
        with pytest.raises(TypeError, match="scheduler_metadata: expected dtype int64"):
            _run_attention(s, metadata(q, qsl, sl, 2, "vec", ops=torch.ops._C))
    _run_attention(s, good)  # the good one runs


def test_unsupported_quantisation(small):
    s = small
    base = (s["k"], s["v"], s["kc"], s["vc"], s["slots"], "vec")
    for kw, match in [
        ({"k_scale": 0.5}, "k_scale: expected 1.0"),
        ({"v_scale": 2.0}, "v_scale: expected 1.0"),
        ({"kv_cache_dtype": "fp8"}, "kv_cache_dtype: expected 'auto'"),
    ]:
        with pytest.raises(ValueError, match=match):
            OPS.cpu_attn_reshape_and_cache(*base, **kw)
        with pytest.raises(ValueError, match=match):
            args = attention_args(
                s["q"],
                s["kc"],
                s["vc"],
                s["qsl"],
                s["sl"],
                s["bt"],
                metadata(s["q"], s["qsl"], s["sl"], 2, "vec"),
            )
            OPS.cpu_attention_with_kv_cache(*args, **kw)
    meta_args = (3, 4, 2, 32, s["sl"], FP32, s["qsl"], True, -1, "vec", True)
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        OPS.get_scheduler_metadata(*meta_args, None, "fp8_e4m3")
    with pytest.raises(ValueError, match="dynamic_causal"):
        OPS.get_scheduler_metadata(*meta_args, torch.ones(3, dtype=torch.bool))
    with pytest.raises(TypeError, match="needs bfloat16"):
        OPS.get_scheduler_metadata(
            3, 4, 2, 32, s["sl"], FP32, s["qsl"], True, -1, "amx", True, None
        )


def test_requires_grad_and_device_refused(small):
    s = small
    k = s["k"].clone().requires_grad_()
    with pytest.raises(TypeError, match="key: expected a tensor that does not require grad"):
        OPS.cpu_attn_reshape_and_cache(k, s["v"], s["kc"], s["vc"], s["slots"], "vec")
    q = s["q"].clone().requires_grad_()
    args = attention_args(
        q,
        s["kc"],
        s["vc"],
        s["qsl"],
        s["sl"],
        s["bt"],
        metadata(s["q"], s["qsl"], s["sl"], 2, "vec"),
    )
    with pytest.raises(TypeError, match="query: expected a tensor that does not require grad"):
        OPS.cpu_attention_with_kv_cache(*args)
    # opcheck's autograd registration check accepts the refusing Autograd kernel
    torch.library.opcheck(
        OPS.cpu_attention_with_kv_cache.default, args, test_utils="test_autograd_registration"
    )
    meta_k = s["k"].to("meta")
    with pytest.raises(TypeError, match="key: expected a CPU tensor"):
        OPS.cpu_attn_reshape_and_cache(meta_k, s["v"], s["kc"], s["vc"], s["slots"], "vec")
