"""numkern.attention: cache layouts, paged attention against gathered fp32 attention."""

import itertools
import math

import numpy as np
import pytest
import torch

from numkern import attention as A
from numkern.attention.plan import check_slots
from numkern.testing import reference as refs
from numkern.testing.tolerances import tolerance

from . import oracle
from .conftest import run_child

BF, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32
DECODE = [(1, 213), (1, 1), (1, 312), (1, 7), (1, 7812)]
PREFILL = [(2345, 2345), (5, 5), (3, 16), (134, 5131)]
MIXED = [(992, 2456), (1, 1234), (98, 1145), (1, 4162), (2345, 2345)]


def build(reqs, hq, hkv, d, b, dtype, isa, seed=0):
    """A cache written with ``reshape_and_cache`` through shuffled, non-contiguous block
    tables (spare blocks in between), plus the per-request K/V it holds. Unwritten slots
    hold NaN, as memory never written may: the kernel must not read them."""
    g = torch.Generator().manual_seed(seed)
    t_n, r_n = sum(q for q, _ in reqs), len(reqs)
    need = [(kl + b - 1) // b for _, kl in reqs]
    nb = 2 * sum(need) + 3
    kv_cache = torch.full(A.kv_cache_shape(nb, hkv, b, d), float("nan"), dtype=dtype)
    kc, vc = A.split_kv_cache(kv_cache)
    perm = torch.randperm(nb, generator=g)
    bt = torch.full((r_n, max(need) + 2), -7, dtype=torch.int32)  # unused entries: garbage
    ks, vs = [], []
    for r, (_, kl) in enumerate(reqs):
        bt[r, : need[r]] = perm[2 * sum(need[:r]) : 2 * sum(need[:r]) + need[r]].int()
        k = torch.randn(kl, hkv, d, generator=g).to(dtype)
        v = torch.randn(kl, hkv, d, generator=g).to(dtype)
        pos = torch.arange(kl)
        A.reshape_and_cache(k, v, kc, vc, bt[r, pos // b].long() * b + pos % b, isa)
        ks.append(k)
        vs.append(v)
    q = torch.randn(t_n, hq, d, generator=g).to(dtype)
    qsl = torch.tensor([0, *np.cumsum([q_ for q_, _ in reqs])], dtype=torch.int32)
    sl = torch.tensor([kl for _, kl in reqs], dtype=torch.int32)
    return q, kc, vc, qsl, sl, bt, ks, vs


def reference(q, qsl, sl, ks, vs, hkv, *, scale, causal=True, window=-1, softcap=0.0,
              alibi=None, sinks=None):  # fmt: skip
    """Plain softmax attention with explicit masks over each request's gathered K/V."""
    return refs.attention(
        q,
        qsl,
        sl,
        ks,
        vs,
        hkv,
        scale=scale,
        causal=causal,
        sliding_window=window,
        softcap=softcap,
        alibi_slopes=alibi,
        sinks=sinks,
    )


def assert_close_attn(out, ref):
    """One rounding of the output (a unit of its dtype) plus fp32 accumulation: the
    table's attention bound (numkern.testing.tolerances)."""
    t = tolerance("attention", out.dtype)
    bound = t.rel * ref.abs() + t.abs
    ratio = ((out.float() - ref).abs() / bound).max().item()
    assert ratio <= 1.0, f"max err/bound {ratio:.3g}"


def assert_close_vllm(theirs, ref):
    """vLLM's attention against the reference: its kernels round P to the cache dtype
    before P @ V, a second rounding (the table's attention_vllm)."""
    t = tolerance("attention_vllm", theirs.dtype)
    assert ((theirs.float() - ref).abs() <= t.rel * ref.abs() + t.abs).all()


def run(q, kc, vc, qsl, sl, bt, isa, **kw):
    out = torch.full_like(q, float("nan"))
    A.paged_attention(q, kc, vc, out, qsl, sl, bt, isa=isa, **kw)
    return out


# the fallback run (tests/test_fallback.py): the bf16 and fp32 variants an AVX2 CPU runs
FALLBACK = pytest.mark.fallback

# (batch, (Hq, Hkv), D, B, dtype, isa, window, softcap, alibi, sinks): each value once
CASES = [
    pytest.param(DECODE, (8, 2), 128, 32, BF, "vec", -1, 0.0, False, False, marks=FALLBACK),
    (DECODE, (8, 1), 512, 128, FP16, "vec", 256, 50.0, True, True),
    (PREFILL, (4, 4), 80, 48, FP32, "vec16", 256, 0.0, True, False),
    (PREFILL, (9, 3), 96, 128, BF, "amx", -1, 50.0, False, True),
    (MIXED, (8, 2), 128, 128, BF, "vec", 256, 0.0, False, True),
    (MIXED, (8, 1), 96, 32, BF, "amx", 256, 0.0, True, False),
    pytest.param(DECODE, (9, 3), 80, 16, FP32, "vec16", -1, 50.0, False, False, marks=FALLBACK),
]


@pytest.mark.parametrize("reqs,heads,d,b,dtype,isa,window,softcap,alibi,sinks", CASES)
def test_paged_attention_matches_reference(reqs, heads, d, b, dtype, isa, window, softcap,
                                           alibi, sinks):  # fmt: skip
    hq, hkv = heads
    q, kc, vc, qsl, sl, bt, ks, vs = build(reqs, hq, hkv, d, b, dtype, isa)
    kw = dict(scale=1 / math.sqrt(d), sliding_window=window, softcap=softcap,
              alibi_slopes=torch.rand(hq) / 8 if alibi else None,
              sinks=torch.randn(hq) if sinks else None)  # fmt: skip
    out = run(q, kc, vc, qsl, sl, bt, isa, **kw)
    ref = reference(q, qsl, sl, ks, vs, hkv, scale=kw["scale"], window=window, softcap=softcap,
                    alibi=kw["alibi_slopes"], sinks=kw["sinks"])  # fmt: skip
    assert_close_attn(out, ref)


def _capped_case(isa, dtype, d, b, seed=0):
    """Queries scaled by 10 so that the scores reach about ±30: a soft-cap of 5 saturates
    there (5·tanh(30/5) = 5.0), where 50·tanh(s/50) on unit scores is nearly s."""
    reqs, hq, hkv = [(1, 213), (37, 150), (1, 70)], 8, 2
    q, kc, vc, qsl, sl, bt, ks, vs = build(reqs, hq, hkv, d, b, dtype, isa, seed)
    q = (q.float() * 10).to(dtype)
    scale = 1 / math.sqrt(d)
    top = (q[qsl[1] : qsl[2], 0].float() @ ks[1][:, 0].float().T).abs().max().item() * scale
    assert top >= 25, top  # request 1's scores of head 0 alone
    return reqs, hkv, scale, (q, kc, vc, qsl, sl, bt, ks, vs)


CAPPED = [
    pytest.param("vec", BF, 128, 32, marks=FALLBACK),
    pytest.param("vec16", FP32, 80, 16, marks=FALLBACK),
    ("amx", BF, 64, 32),
]


@pytest.mark.parametrize("isa,dtype,d,b", CAPPED)
def test_softcap_that_bites(isa, dtype, d, b):
    """A cap of 5 on scores up to ±30 against the reference; the reference without the cap
    (or with the cap of 50 the other cases use) is far outside the tolerance."""
    _, hkv, scale, (q, kc, vc, qsl, sl, bt, ks, vs) = _capped_case(isa, dtype, d, b)
    out = run(q, kc, vc, qsl, sl, bt, isa, scale=scale, softcap=5.0)
    assert_close_attn(out, reference(q, qsl, sl, ks, vs, hkv, scale=scale, softcap=5.0))
    for other in (0.0, 50.0):
        with pytest.raises(AssertionError):
            assert_close_attn(out, reference(q, qsl, sl, ks, vs, hkv, scale=scale, softcap=other))


# (isa, dtype, d, b, window, requests): a prefill of more rows than a register group
# (the staged super-tile path), a short one of fewer (the tile-by-tile path), windows
POISON_V = [
    pytest.param("vec", BF, 64, 32, -1, [(40, 40), (3, 3)], marks=FALLBACK),
    pytest.param("vec16", FP32, 48, 16, 5, [(2, 30), (37, 37)], marks=FALLBACK),
    ("amx", BF, 32, 32, 7, [(3, 3), (20, 50)]),
]


@pytest.mark.parametrize("isa,dtype,d,b,window,reqs", POISON_V)
def test_nonfinite_value_reaches_only_rows_that_see_it(isa, dtype, d, b, window, reqs):
    """A NaN (and an inf) in the value of a key reaches the rows that see the key, never
    a row that masks it, though rows of one register group share the key's V: causally
    earlier rows (the key is each request's last), rows past a window (its first)."""
    hq, hkv = 4, 2
    q, kc, vc, qsl, sl, bt, ks, vs = build(reqs, hq, hkv, d, b, dtype, isa)
    for r, (_, kl) in enumerate(reqs):
        vs[r][kl - 1, 0, 1] = float("nan")
        vs[r][0, 1, 2] = float("inf")
        pos = torch.arange(kl)
        A.reshape_and_cache(ks[r], vs[r], kc, vc, bt[r, pos // b].long() * b + pos % b, isa)
    out = run(q, kc, vc, qsl, sl, bt, isa, scale=1 / math.sqrt(d), sliding_window=window)
    ref = reference(q, qsl, sl, ks, vs, hkv, scale=1 / math.sqrt(d), window=window)
    bad = ~torch.isfinite(ref)
    assert bad.any() and not bad.all()  # some rows see a poisoned key, some do not
    assert torch.equal(~torch.isfinite(out), bad)
    assert_close_attn(out.masked_fill(bad, 0), ref.masked_fill(bad, 0))


@pytest.mark.parametrize("isa", [pytest.param("vec", marks=FALLBACK), "amx"])
def test_nan_query_reaches_only_its_row_across_super_tiles(isa):
    """A chunked prefill (20 queries after 300 keys of history: two super-tiles of 256
    keys) whose last query is NaN in one head: only that row's output is NaN. Its row
    group leaves NaN probabilities over the first super-tile in the item's score buffer;
    in the second, every row group computes only the first two tiles, and a group's key
    span of odd length must never read the weight one past it in a column it did not
    write (19b37df did, at the 4 rows sharing the NaN row's place in their groups)."""
    reqs, hq, hkv, d = [(3, 3), (20, 320), (37, 37)], 4, 2, 64
    q, kc, vc, qsl, sl, bt, ks, vs = build(reqs, hq, hkv, d, 32, BF, isa)
    q[int(qsl[2]) - 1, 0] = float("nan")
    out = run(q, kc, vc, qsl, sl, bt, isa, scale=1 / math.sqrt(d))
    ref = reference(q, qsl, sl, ks, vs, hkv, scale=1 / math.sqrt(d))
    bad = ~torch.isfinite(ref)
    want = bad.any(-1).nonzero().tolist()  # [token, head] of the NaN rows
    assert want == [[int(qsl[2]) - 1, 0]]
    assert (~torch.isfinite(out)).any(-1).nonzero().tolist() == want
    assert_close_attn(out.masked_fill(bad, 0), ref.masked_fill(bad, 0))


@pytest.mark.parametrize("window", [-1, 3])
def test_non_causal_encoder(window):
    reqs = [(17, 17), (40, 40)]
    q, kc, vc, qsl, sl, bt, ks, vs = build(reqs, 4, 2, 64, 32, FP32, "vec")
    out = run(q, kc, vc, qsl, sl, bt, "vec", scale=0.125, causal=False, sliding_window=window)
    ref = reference(q, qsl, sl, ks, vs, 2, scale=0.125, causal=False, window=window)
    assert_close_attn(out, ref)


@FALLBACK
def test_tolerance_bites():
    reqs = [(30, 300), (1, 200)]
    q, kc, vc, qsl, sl, bt, ks, vs = build(reqs, 4, 2, 64, 32, FP32, "vec")
    sinks = torch.randn(4)
    out = run(q, kc, vc, qsl, sl, bt, "vec", scale=0.125, sliding_window=64, sinks=sinks)
    assert_close_attn(out, reference(q, qsl, sl, ks, vs, 2, scale=0.125, window=64, sinks=sinks))
    with pytest.raises(AssertionError):  # window off by one
        assert_close_attn(out, reference(q, qsl, sl, ks, vs, 2, scale=0.125, window=65,
                                         sinks=sinks))  # fmt: skip
    with pytest.raises(AssertionError):  # sink dropped
        assert_close_attn(out, reference(q, qsl, sl, ks, vs, 2, scale=0.125, window=64))


_PREFILL_CODEGEN = """
import numpy as np
from numba import typeof, types
from numkern.attention import tiles
from numkern.attention.kernels import Source, Tile
f32, i64, i = types.Array(types.float32, 1, "C"), types.Array(types.int64, 1, "C"), types.int64
src = typeof(Source(np.zeros(1, np.float32), np.zeros(1, np.float32), 1, 0))
tile = typeof(Tile(0, 0, 0, 0, 0, 0))
print(tiles.PREFILL.vector)
for fn, sig in ((tiles.qk6, (f32, i64, i, src, i, f32, i, i)),
                (tiles.pv6, (f32, i64, f32, f32, i64, i, src, tile, types.none))):
    fn.compile(sig)
    asm = fn.inspect_asm(sig).splitlines()
    stack = sum("ymm" in ln and "(%rsp)" in ln for ln in asm)
    print(any("zmm" in ln for ln in asm), any("ymm" in ln for ln in asm), stack,
          sum("vfmadd" in ln for ln in asm))
"""


def test_prefill_tiles_fit_16_ymm_without_avx512(tmp_path):
    """Compiled with AVX-512 masked (a child; nothing runs): the prefill takes the avx2 row
    of isa.PREFILL_TILES, and its tiles are 256-bit code whose accumulators stay in
    registers: fewer ymm moves to or from the stack than FMAs (a tile that spills moves
    an accumulator around each FMA: qk8 and pv4 compiled so make 3x more than FMAs)."""
    env = {"NUMKERN_CPU_FEATURES": "-avx512f", "NUMBA_CACHE_DIR": str(tmp_path)}
    vector, *tiles = run_child(_PREFILL_CODEGEN, env).splitlines()
    assert vector == "avx2"
    for line in tiles:
        zmm, ymm, stack, fmas = line.split()
        assert (zmm, ymm) == ("False", "True") and fmas != "0", line
        assert int(stack) < int(fmas), line


# ---------------------------------------------------------------------------------------
# cache layout


@pytest.mark.parametrize("isa,dtype,d,b", [("vec", FP16, 80, 32), ("amx", BF, 64, 64),
                                           ("vec16", FP32, 48, 16)])  # fmt: skip
def test_reshape_and_cache_layout(isa, dtype, d, b):
    nb, hkv, t_n = 5, 3, 40
    kv_cache = torch.zeros(A.kv_cache_shape(nb, hkv, b, d), dtype=dtype)
    kc, vc = A.split_kv_cache(kv_cache)
    assert kc.shape == vc.shape == (nb, hkv, b, d) and not kc.is_contiguous()
    k = torch.randn(t_n, hkv, d).to(dtype)
    v = torch.randn(t_n, hkv, d).to(dtype)
    slots = torch.randperm(nb * b)[:t_n]
    slots[3] = -1  # skipped
    A.reshape_and_cache(k, v, kc, vc, slots, isa)
    flat = kv_cache.view(-1)
    for t in range(t_n):
        s = int(slots[t])
        if s < 0:
            continue
        blk, o = divmod(s, b)
        for h in range(hkv):
            base = (blk * hkv + h) * 2 * b * d
            dd = torch.arange(d)
            if isa == "amx":
                ki = (o // 16) * 16 * d + (dd // 2) * 32 + (o % 16) * 2 + dd % 2
                vi = (dd // 16) * b * 16 + (o // 2) * 32 + (dd % 16) * 2 + o % 2
            else:
                ki = dd * b + o
                vi = o * d + dd
            assert torch.equal(flat[base + ki], k[t, h])
            assert torch.equal(flat[base + b * d + vi], v[t, h])
    written = len([s for s in slots.tolist() if s >= 0]) * hkv * d * 2
    assert int((flat != 0).sum()) <= written  # nothing else touched (zeros stay zeros)


def test_amx_layout_computes_as_vec(monkeypatch):
    """The vector kernels read the amx layout (bf16 pairs) on any CPU and give vec's bits,
    in decode, prefill and a split long decode (the prefill's AMX tiles turned off here:
    they are tests/test_amx.py's); with this CPU's own choice (tiles where it has them)
    the amx layout matches the reference."""
    from numkern.attention import kernels as attn_kernels
    from numkern.attention import ops as attn_ops

    sinks = torch.randn(8)
    for reqs in ([(1, 213), (37, 150), (1, 70)], [(300, 300)], [(1, 3000)]):
        outs = []
        for isa in ("vec", "amx"):
            q, kc, vc, qsl, sl, bt, ks, vs = build(reqs, 8, 2, 64, 32, BF, isa)
            with monkeypatch.context() as m:
                m.setattr(attn_ops, "tile_witness", lambda: attn_kernels.NO_TILES)
                outs.append(
                    run(q, kc, vc, qsl, sl, bt, isa, scale=0.125, softcap=20.0, sinks=sinks)
                )
        assert torch.equal(outs[0], outs[1]), reqs
        ref = reference(q, qsl, sl, ks, vs, 2, scale=0.125, softcap=20.0, sinks=sinks)
        assert_close_attn(outs[1], ref)
        own = run(q, kc, vc, qsl, sl, bt, "amx", scale=0.125, softcap=20.0, sinks=sinks)
        assert_close_attn(own, ref)


# ---------------------------------------------------------------------------------------
# plan


def test_plan_splits_long_decode_and_merges_exactly():
    q, kc, vc, qsl, sl, bt, ks, vs = build([(1, 7812)], 8, 1, 64, 128, FP32, "vec")
    plan = A.plan_attention(qsl, sl, num_heads=8, num_kv_heads=1, head_dim=64, block_size=128,
                            isa="vec", num_threads=2)  # fmt: skip
    assert plan.items.shape[0] > 1 and plan.merges.shape[0] == 1
    out = run(q, kc, vc, qsl, sl, bt, "vec", scale=0.125, plan=plan)
    assert_close_attn(out, reference(q, qsl, sl, ks, vs, 1, scale=0.125))


def test_plan_splits_long_window_and_merges_exactly():
    """A window of 1500 keys: a decode's and a prefill's key ranges, which start at the
    window's first key (not on a tile of 32), are split into pieces; every piece after the
    first starts on a tile, so no tile is read by two pieces. The kernels also cut each
    row's keys to its item's [key_lo, key_hi) (a piece's tiles are read from key_lo
    rounded down): either alone keeps the keys at a split point from being counted twice
    (err/bound ~2e3 with neither)."""
    reqs = [(1, 3000), (20, 2600)]
    q, kc, vc, qsl, sl, bt, ks, vs = build(reqs, 8, 2, 64, 32, FP32, "vec")
    heads = dict(num_heads=8, num_kv_heads=2, head_dim=64, block_size=32, isa="vec")
    plan = A.plan_attention(qsl, sl, sliding_window=1500, num_threads=2, **heads)
    assert plan.merges.shape[0] == 4  # each request's items (2 kv heads) split
    it = plan.items.numpy() if isinstance(plan.items, torch.Tensor) else plan.items
    i_req, i_hk, i_lo, i_hi = 0, 1, 6, 7  # numkern.attention.kernels' item columns
    for key in {(r[i_req], r[i_hk]) for r in it}:
        rows = sorted((r[i_lo], r[i_hi]) for r in it if (r[i_req], r[i_hk]) == key)
        assert rows[0][0] % 32 != 0  # the window's first key
        assert all(lo % 32 == 0 for lo, _ in rows[1:])
        assert all(a[1] == b[0] for a, b in itertools.pairwise(rows))  # contiguous
    out = run(q, kc, vc, qsl, sl, bt, "vec", scale=0.125, sliding_window=1500, plan=plan)
    assert_close_attn(out, reference(q, qsl, sl, ks, vs, 2, scale=0.125, window=1500))


def test_plan_window_visits_only_window_blocks():
    b, w = 32, 256
    kw = dict(num_heads=4, num_kv_heads=1, head_dim=64, block_size=b, isa="vec", num_threads=2)
    qsl = torch.tensor([0, 1], dtype=torch.int32)
    sl = torch.tensor([7812], dtype=torch.int32)
    plan = A.plan_attention(qsl, sl, sliding_window=w, **kw)
    # keys 7556..7811 lie in blocks 236..244
    assert plan.blocks_visited() == 244 - 236 + 1 == 9
    full = A.plan_attention(qsl, sl, **kw)
    assert full.blocks_visited() == (7812 + b - 1) // b
    pre = torch.tensor([0, 2345], dtype=torch.int32)
    psl = torch.tensor([2345], dtype=torch.int32)
    windowed = A.plan_attention(pre, psl, sliding_window=w, **kw).blocks_visited()
    causal = A.plan_attention(pre, psl, **kw).blocks_visited()
    items = A.plan_attention(pre, psl, sliding_window=w, **kw).items.shape[0]
    assert windowed <= items * ((w + A.NRI) // b + 2) and windowed * 4 < causal


def test_plan_reuse_gives_same_output():
    reqs = [(1, 300), (20, 90)]
    q, kc, vc, qsl, sl, bt, _, _ = build(reqs, 8, 2, 64, 32, BF, "vec")
    plan = A.plan_attention(qsl, sl, num_heads=8, num_kv_heads=2, head_dim=64, block_size=32,
                            isa="vec")  # fmt: skip
    a = run(q, kc, vc, qsl, sl, bt, "vec", scale=0.125)
    b1 = run(q, kc, vc, qsl, sl, bt, "vec", scale=0.125, plan=plan)
    b2 = run(q, kc, vc, qsl, sl, bt, "vec", scale=0.125, plan=plan)
    assert torch.equal(a, b1) and torch.equal(b1, b2)
    with pytest.raises(ValueError, match="plan"):
        run(q, kc, vc, qsl, sl, bt, "vec", scale=0.125, plan=plan, sliding_window=16)
    with pytest.raises(ValueError, match="plan"):
        run(q[:, :4], kc[:, :1], vc[:, :1], qsl, sl, bt, "vec", scale=0.125, plan=plan)


def test_plan_holds_the_validated_indices():
    q, kc, vc, qsl, sl, bt, ks, vs = build([(1, 300), (20, 90)], 8, 2, 64, 32, FP32, "vec")
    nb = kc.shape[0]
    kw = dict(num_heads=8, num_kv_heads=2, head_dim=64, block_size=32, isa="vec")
    slots = torch.arange(21, dtype=torch.int64)
    plan = A.plan_attention(qsl, sl, block_table=bt, slot_mapping=slots, num_blocks=nb, **kw)
    assert plan.num_blocks == nb and plan.block_table.dtype == np.int32
    assert np.array_equal(plan.block_table, bt.numpy()) and plan.block_table.flags.c_contiguous
    assert plan.slot_mapping.dtype == np.int64 and np.array_equal(plan.slot_mapping, slots)
    step = plan.step_arrays()
    assert step.block_table is plan.block_table and step.qsl.dtype == np.int64
    assert step.part_acc is not plan.step_arrays().part_acc  # fresh buffers per call
    ref = reference(q, qsl, sl, ks, vs, 2, scale=0.125)
    assert_close_attn(run(q, kc, vc, qsl, sl, bt, "vec", scale=0.125, plan=plan), ref)
    assert_close_attn(run(q, kc, vc, qsl, sl, bt.clone(), "vec", scale=0.125, plan=plan), ref)
    good = bt.clone()
    bt[0, 0] = 10_000  # changed after the plan: the kernels read the plan's copy
    assert_close_attn(run(q, kc, vc, qsl, sl, bt, "vec", scale=0.125, plan=plan), ref)
    with pytest.raises(ValueError, match="block_table"):  # another table with the plan
        run(q, kc, vc, qsl, sl, bt.clone(), "vec", scale=0.125, plan=plan)
    with pytest.raises(ValueError, match="block_table"):
        run(q, kc, vc, qsl, sl, good[:, :-1], "vec", scale=0.125, plan=plan)
    with pytest.raises(ValueError, match="key_cache: expected"):  # another cache size
        run(q, kc[:-1], vc[:-1], qsl, sl, good, "vec", scale=0.125, plan=plan)
    with pytest.raises(ValueError, match="block_table"):
        A.plan_attention(qsl, sl, block_table=bt, num_blocks=nb, **kw)
    with pytest.raises(ValueError, match="slot_mapping"):  # out of range, at plan time
        too_far = torch.full((21,), nb * 32)
        A.plan_attention(qsl, sl, block_table=good, slot_mapping=too_far, num_blocks=nb, **kw)
    with pytest.raises(ValueError, match="slot_mapping"):  # not one per token
        A.plan_attention(qsl, sl, block_table=good, slot_mapping=slots[:5], num_blocks=nb, **kw)
    with pytest.raises(ValueError, match="num_blocks"):
        A.plan_attention(qsl, sl, num_blocks=nb, **kw)
    with pytest.raises(ValueError, match="num_blocks"):
        A.plan_attention(qsl, sl, block_table=good, slot_mapping=slots, **kw)
    with pytest.raises(ValueError, match="block_table"):
        A.plan_attention(qsl, sl, **kw).step_arrays()


def test_plan_copies_are_read_only():
    """The validated copies the kernels read cannot be written after planning; the
    caller's tensors keep their flags and stay writable."""
    _, kc, _, qsl, sl, bt, _, _ = build([(1, 300), (20, 90)], 8, 2, 64, 32, FP32, "vec")
    nb = kc.shape[0]
    kw = dict(num_heads=8, num_kv_heads=2, head_dim=64, block_size=32, isa="vec")
    slots = torch.arange(21, dtype=torch.int64)
    plan = A.plan_attention(qsl, sl, block_table=bt, slot_mapping=slots, num_blocks=nb, **kw)
    for name in ("qsl", "seq_lens", "block_table", "slot_mapping"):
        a = getattr(plan, name)
        assert not a.flags.writeable, name
        with pytest.raises(ValueError, match="read-only"):
            a[0] = 1
    bt[0, 0] = bt[0, 0]  # the caller's tensor is untouched
    assert qsl.numpy().flags.writeable and slots.numpy().flags.writeable
    step = plan.step_arrays()
    assert not (step.qsl.flags.writeable or step.seq_lens.flags.writeable)
    assert not step.block_table.flags.writeable


def test_step_arrays_with_a_table():
    """step_arrays(block_table, num_blocks): the table validated for the plan (the plan's
    copy when it holds one; else checked now, read-only like a plan's copy)."""
    _, kc, _, qsl, sl, bt, _, _ = build([(1, 300), (20, 90)], 8, 2, 64, 32, FP32, "vec")
    nb = kc.shape[0]
    kw = dict(num_heads=8, num_kv_heads=2, head_dim=64, block_size=32, isa="vec")
    held = A.plan_attention(qsl, sl, block_table=bt, num_blocks=nb, **kw)
    assert held.step_arrays(bt, nb).block_table is held.block_table
    bare = A.plan_attention(qsl, sl, **kw)
    step = bare.step_arrays(bt, nb)
    assert np.array_equal(step.block_table, bt.numpy()) and not step.block_table.flags.writeable
    assert bt.numpy().flags.writeable
    assert step.items is bare.items and step.qsl is bare.qsl
    with pytest.raises(ValueError, match="block_table: expected entries"):
        bare.step_arrays(bt, 2)
    with pytest.raises(TypeError, match="num_blocks: expected an int"):
        bare.step_arrays(bt)
    with pytest.raises(ValueError, match="key_cache: expected"):
        held.step_arrays(bt, nb - 1)
    slots = check_slots(torch.arange(21, dtype=torch.int64), 21, nb * 32)
    assert not slots.flags.writeable


@pytest.mark.parametrize("isa,dtype", [("amx", BF), ("vec16", FP32)])
def test_cache_view(isa, dtype):
    nb, hkv, b, d = 3, 2, 32, 64
    kv = torch.zeros(A.kv_cache_shape(nb, hkv, b, d), dtype=dtype)
    cv = A.cache_view(kv, isa)
    got = (cv.num_blocks, cv.num_kv_heads, cv.head_dim, cv.isa, cv.dtype)
    assert got == (nb, hkv, d, isa, dtype)
    lay = cv.layout
    got = (lay.block_size, lay.k_block, lay.k_head, lay.v_chunk, lay.amx)
    assert got == (b, hkv * 2 * b * d, 2 * b * d, 16 * b, isa == "amx")
    assert (lay.v_block, lay.v_head) == (lay.k_block, lay.k_head)
    size = kv.element_size()
    assert cv.kw.ctypes.data == kv.data_ptr() and cv.vw.ctypes.data == kv.data_ptr() + b * d * size
    assert cv.kw.size == cv.vw.size == (nb - 1) * lay.k_block + (hkv - 1) * lay.k_head + b * d
    assert cv.kr.dtype == (np.uint32 if isa == "amx" else cv.kw.dtype)
    assert cv.kr.ctypes.data == cv.kw.ctypes.data and cv.kr.nbytes == cv.kw.nbytes
    kc, _ = A.split_kv_cache(kv)
    cv.kw[lay.k_block + lay.k_head + 5] = 1  # block 1, kv head 1, element 5 of its K
    k11 = kc[1, 1].reshape(-1)
    assert (k11[5] == 1) if dtype == FP32 else (k11.view(torch.int16)[5] == 1)  # raw bits
    with pytest.raises(ValueError, match="isa"):
        A.cache_view(kv, "avx")
    with pytest.raises(TypeError, match="bfloat16"):
        A.cache_view(kv.half(), "amx")
    with pytest.raises(ValueError, match="block_size"):
        A.cache_view(torch.zeros(A.kv_cache_shape(2, 1, 48, 64), dtype=dtype), "vec")


def test_cache_geometry_is_checked_once_and_carried_by_view_and_plan():
    """A group's geometry: validated when made; the view and the plan made for it keep
    the very object, and a tensor or keywords that disagree with it are refused."""
    geo = A.CacheGeometry(5, 2, 32, 64, BF, "vec")
    assert A.kv_cache_shape(geo) == geo.shape == A.kv_cache_shape(5, 2, 32, 64)
    assert geo.layout == "vec" and A.CacheGeometry(5, 2, 32, 64, BF, "amx").layout == "amx"
    with pytest.raises(ValueError, match="block_size: expected a multiple of 32"):
        A.CacheGeometry(5, 2, 48, 64, BF, "vec")
    with pytest.raises(TypeError, match="bfloat16"):
        A.CacheGeometry(5, 2, 32, 64, FP32, "amx")
    with pytest.raises(ValueError, match="num_blocks"):
        A.CacheGeometry(0, 2, 32, 64, BF, "vec")
    kv = torch.zeros(geo.shape, dtype=BF)
    cv = A.cache_view(kv, geo)
    assert cv.geometry is geo and (cv.num_blocks, cv.isa) == (5, "vec")
    assert A.cache_view(kv, "vec").geometry == geo  # by name: the tensor's geometry
    with pytest.raises(ValueError, match="kv_cache: expected shape"):
        A.cache_view(torch.zeros(A.kv_cache_shape(4, 2, 32, 64), dtype=BF), geo)
    with pytest.raises(TypeError, match="kv_cache: expected dtype bfloat16"):
        A.cache_view(kv.half(), geo)
    qsl = torch.tensor([0, 3], dtype=torch.int32)
    sl = torch.tensor([40], dtype=torch.int32)
    bt = torch.tensor([[4, 1]], dtype=torch.int32)
    slots = torch.arange(37, 40, dtype=torch.int64)
    plan = A.plan_attention(qsl, sl, num_heads=4, block_table=bt, slot_mapping=slots, geometry=geo)
    assert plan.geometry is geo
    got = (plan.num_kv_heads, plan.head_dim, plan.block_size, plan.isa, plan.num_blocks)
    assert got == (2, 64, 32, "vec", 5)
    sized = A.plan_attention(qsl, sl, num_heads=4, num_kv_heads=2, head_dim=64, block_size=32,
                             isa="vec", block_table=bt, num_blocks=5)  # fmt: skip
    assert sized.geometry is None and np.array_equal(sized.items, plan.items)
    bare = A.plan_attention(qsl, sl, num_heads=4, geometry=geo)
    assert bare.block_table is None and A.with_tables(bare, bt, None).num_blocks == 5
    with pytest.raises(ValueError, match="num_blocks: expected None or the plan's geometry's 5"):
        A.with_tables(bare, bt, None, 4)
    with pytest.raises(TypeError, match="block_size: expected not with geometry"):
        A.plan_attention(qsl, sl, num_heads=4, block_size=32, geometry=geo)
    with pytest.raises(ValueError, match="block_table: expected entries in \\[0, 5\\)"):
        A.plan_attention(qsl, sl, num_heads=4, block_table=bt + 1, geometry=geo)
    with pytest.raises(ValueError, match="num_heads: expected a multiple of num_kv_heads=2"):
        A.plan_attention(qsl, sl, num_heads=3, geometry=geo)


# ---------------------------------------------------------------------------------------
# bad input


@pytest.mark.parametrize(
    "mutate,exc,match",
    [
        (lambda a: a.update(bt=a["bt"].clone().fill_(10_000)), ValueError, "block_table"),
        (lambda a: a.update(sl=torch.tensor([300, 9999], dtype=torch.int32)), ValueError,
         "seq_lens"),
        (lambda a: a.update(qsl=torch.tensor([0, 15, 10], dtype=torch.int32)), ValueError,
         "non-decreasing"),
        (lambda a: a.update(sl=torch.tensor([300, 5], dtype=torch.int32)), ValueError,
         "q_len"),
        (lambda a: a.update(q=a["q"][:, :7].contiguous(), out=a["out"][:, :7].contiguous()),
         ValueError, "num_heads"),
        (lambda a: a.update(qsl=a["qsl"].long()), TypeError, "query_start_loc"),
        (lambda a: a.update(isa="avx"), ValueError, "isa"),
        (lambda a: a.update(out=a["out"].float()), TypeError, "output"),
    ],
)  # fmt: skip
def test_paged_attention_bad_input(mutate, exc, match):
    q, kc, vc, qsl, sl, bt, _, _ = build([(1, 300), (20, 90)], 8, 2, 64, 32, BF, "vec")
    a = dict(q=q, kc=kc, vc=vc, qsl=qsl, sl=sl, bt=bt, out=torch.zeros_like(q), isa="vec")
    mutate(a)
    before = a["out"].clone()
    with pytest.raises(exc, match=match):
        A.paged_attention(a["q"], a["kc"], a["vc"], a["out"], a["qsl"], a["sl"], a["bt"],
                          scale=0.125, isa=a["isa"])  # fmt: skip
    assert torch.equal(a["out"], before)


def test_block_size_and_cache_errors():
    kv = torch.zeros(A.kv_cache_shape(4, 2, 48, 64), dtype=BF)
    kc, vc = A.split_kv_cache(kv)
    k = torch.randn(3, 2, 64).bfloat16()
    with pytest.raises(ValueError, match="block_size: expected a multiple of 32"):
        A.reshape_and_cache(k, k, kc, vc, torch.arange(3), "vec")
    A.reshape_and_cache(k, k, kc, vc, torch.arange(3), "vec16")  # 48 is fine for vec16
    with pytest.raises(ValueError, match="slot_mapping"):
        A.reshape_and_cache(k, k, kc, vc, torch.tensor([0, 1, 4 * 48]), "vec16")
    with pytest.raises(ValueError, match="slot_mapping"):
        A.reshape_and_cache(k, k, kc, vc, torch.arange(2), "vec16")  # T entries exactly
    with pytest.raises(TypeError, match="slot_mapping"):
        A.reshape_and_cache(k, k, kc, vc, torch.arange(3).int(), "vec16")
    with pytest.raises(TypeError, match="amx"):
        kv32 = torch.zeros(A.kv_cache_shape(4, 2, 32, 64))
        A.reshape_and_cache(k.float(), k.float(), *A.split_kv_cache(kv32), torch.arange(3), "amx")


# ---------------------------------------------------------------------------------------
# vLLM


def _all_slots(reqs, bt, b):
    """The slot of every key of every request, in order (vLLM writes them in one call)."""
    pos = [torch.arange(kl) for _, kl in reqs]
    return torch.cat([bt[r, p // b].long() * b + p % b for r, p in enumerate(pos)])


def _vllm_attention(q, kv_cache, qsl, sl, bt, isa, scale, window, softcap, sinks, k, v, slots):
    ops = oracle.ops()
    nb, hkv, b, d2 = kv_cache.shape
    kc, vc = kv_cache.view(nb, hkv, 2 * b, d2 // 2).chunk(2, dim=2)
    ops.cpu_attn_reshape_and_cache(k, v, kc, vc, slots, isa)
    meta = ops.get_scheduler_metadata(len(sl), q.shape[1], hkv, d2 // 2, sl, q.dtype, qsl, True,
                                      window, isa, True, None, "auto")  # fmt: skip
    out = torch.zeros_like(q)
    ops.cpu_attention_with_kv_cache(q, kc, vc, out, qsl, sl, scale, True, None, window, bt,
                                    softcap, meta, sinks, None)  # fmt: skip
    return out, kc, vc


_VLLM_PROBE = """
nb, hkv, b, d = 4, 1, {b}, {d}
kv = torch.zeros(nb, hkv, b, 2 * d, dtype=torch.{dt})
kc, vc = kv.view(nb, hkv, 2 * b, d).chunk(2, 2)
k = torch.randn(5, hkv, d).to(kv.dtype)
torch.ops._C.cpu_attn_reshape_and_cache(k, k, kc, vc, torch.arange(5), "{isa}")
qsl = torch.tensor([0, 1], dtype=torch.int32); sl = torch.tensor([5], dtype=torch.int32)
q = torch.randn(1, 2, d).to(kv.dtype); bt = torch.tensor([[0, 1]], dtype=torch.int32)
meta = torch.ops._C.get_scheduler_metadata(1, 2, hkv, d, sl, q.dtype, qsl, True, -1, "{isa}",
                                           True, None, "auto")
torch.ops._C.cpu_attention_with_kv_cache(q, kc, vc, torch.zeros_like(q), qsl, sl, 0.1, True,
                                         None, -1, bt, 0.0, meta, None, None)
"""


@pytest.mark.parametrize(
    "isa,dtype,d,b,window,softcap,sinks",
    [("vec", BF, 128, 32, -1, 0.0, False), ("vec16", FP32, 80, 16, 64, 0.0, True),
     ("amx", BF, 128, 128, -1, 50.0, False), ("vec", FP16, 256, 128, 64, 0.0, False)],
)  # fmt: skip
def test_vllm_cache_bytes_and_outputs(isa, dtype, d, b, window, softcap, sinks):
    probe = _VLLM_PROBE.format(dt=str(dtype).split(".")[1], isa=isa, b=b, d=d)
    oracle.require_op(f"cpu attention ({isa}, {dtype})", probe, needs=oracle.isa_needs(isa))
    reqs, hq, hkv = [(1, 213), (37, 150), (1, 70)], 8, 2
    q, kc, vc, qsl, sl, bt, ks, vs = build(reqs, hq, hkv, d, b, dtype, isa)
    nb = kc.shape[0]
    # vLLM's kernel reads the unwritten tail slots of a block (times P = 0): it needs the
    # zero-filled cache vLLM allocates (with NaN there, measured: most outputs NaN)
    theirs_cache = torch.zeros(A.kv_cache_shape(nb, hkv, b, d), dtype=dtype)
    k = torch.cat(ks)
    v = torch.cat(vs)
    slots = _all_slots(reqs, bt, b)
    # vLLM writes the cache for all keys at once (its slot_mapping is as long as key)
    sink_t = torch.randn(hq) if sinks else None
    scale = 1 / math.sqrt(d)
    theirs, tkc, tvc = _vllm_attention(q, theirs_cache, qsl, sl, bt, isa, scale, window, softcap,
                                       sink_t, k, v, slots)  # fmt: skip
    bits = torch.int32 if dtype == FP32 else torch.int16
    ours_k, ours_v = kc.nan_to_num(0.0), vc.nan_to_num(0.0)  # unwritten: NaN in ours, 0 there
    assert torch.equal(tkc.contiguous().view(bits), ours_k.contiguous().view(bits))
    assert torch.equal(tvc.contiguous().view(bits), ours_v.contiguous().view(bits))
    ours = run(q, kc, vc, qsl, sl, bt, isa, scale=scale, sliding_window=window, softcap=softcap,
               sinks=sink_t)  # fmt: skip
    ref = reference(q, qsl, sl, ks, vs, hkv, scale=scale, window=window, softcap=softcap,
                    sinks=sink_t)  # fmt: skip
    assert_close_attn(ours, ref)
    assert_close_vllm(theirs, ref)


def test_vllm_softcap_that_bites():
    """vLLM's attention with a cap of 5 on scores up to ±30 against the same reference as
    ours (the uncapped reference is far from both)."""
    isa, dtype, d, b = "vec", BF, 128, 32
    probe = _VLLM_PROBE.format(dt="bfloat16", isa=isa, b=b, d=d)
    oracle.require_op(f"cpu attention ({isa}, {dtype})", probe)
    reqs, hkv, scale, (q, kc, vc, qsl, sl, bt, ks, vs) = _capped_case(isa, dtype, d, b)
    slots = _all_slots(reqs, bt, b)
    cache = torch.zeros(A.kv_cache_shape(kc.shape[0], hkv, b, d), dtype=dtype)
    k, v = torch.cat(ks), torch.cat(vs)
    theirs, _, _ = _vllm_attention(q, cache, qsl, sl, bt, isa, scale, -1, 5.0, None, k, v, slots)
    ref = reference(q, qsl, sl, ks, vs, hkv, scale=scale, softcap=5.0)
    uncapped = reference(q, qsl, sl, ks, vs, hkv, scale=scale)
    assert_close_vllm(theirs, ref)
    with pytest.raises(AssertionError):
        assert_close_vllm(theirs, uncapped)
    ours = run(q, kc, vc, qsl, sl, bt, isa, scale=scale, softcap=5.0)
    t = tolerance("attention_vllm", dtype)
    assert ((ours.float() - theirs.float()).abs() <= t.rel * ref.abs() + t.abs).all()


_VLLM_CACHE_PROBE = """
kv = torch.zeros(4, 1, 32, 2 * 64, dtype=torch.bfloat16)
kc, vc = kv.view(4, 1, 64, 64).chunk(2, 2)
k = torch.randn(5, 1, 64).bfloat16()
torch.ops._C.cpu_attn_reshape_and_cache(k, k, kc, vc, torch.arange(5), "amx")
"""


def test_vllm_amx_cache_bytes():
    """vLLM's amx cache write is plain data (no AMX instruction; it runs wherever its build
    does): its bytes are ours, on any CPU (its amx attention needs AMX tiles and is
    compared by test_vllm_cache_bytes_and_outputs where it runs)."""
    oracle.require_op("cpu_attn_reshape_and_cache (amx)", _VLLM_CACHE_PROBE)
    ops = oracle.ops()
    reqs, hkv, d, b = [(1, 213), (37, 150), (1, 70)], 2, 128, 64
    _, kc, vc, _, _, bt, ks, vs = build(reqs, 8, hkv, d, b, BF, "amx")
    slots = _all_slots(reqs, bt, b)
    theirs = torch.zeros(A.kv_cache_shape(kc.shape[0], hkv, b, d), dtype=BF)
    tkc, tvc = theirs.view(kc.shape[0], hkv, 2 * b, d).chunk(2, dim=2)
    ops.cpu_attn_reshape_and_cache(torch.cat(ks), torch.cat(vs), tkc, tvc, slots, "amx")
    i16 = torch.int16
    assert torch.equal(tkc.contiguous().view(i16), kc.nan_to_num(0.0).contiguous().view(i16))
    assert torch.equal(tvc.contiguous().view(i16), vc.nan_to_num(0.0).contiguous().view(i16))
