"""numkern.simd: each intrinsic against NumPy/torch, on every storage dtype."""

import math

import numba
import numpy as np
import pytest
import torch
from numba import prange

from numkern import isa
from numkern import simd as S
from numkern._check import as_numpy
from numkern._jit import jit
from numkern.testing.tolerances import tolerance

from .close import rtol_atol
from .conftest import run_child


@jit
def _load_store(src, dst, idx):
    v = S.vload(src, idx)
    S.vstore(dst, 0, v)


@jit
def _arith(a, b, c, out):
    x = S.vload(a, 0)
    y = S.vload(b, 0)
    z = S.vload(c, 0)
    S.vstore(out, 0, S.vadd(x, y))
    S.vstore(out, 16, S.vsub(x, y))
    S.vstore(out, 32, S.vmul(x, y))
    S.vstore(out, 48, S.vfma(x, y, z))
    S.vstore(out, 64, S.vmax(x, y))
    S.vstore(out, 80, S.vmin(x, y))
    S.vstore(out, 96, S.vsplat(2.5))
    S.vstore(out, 112, S.vzero())
    S.vstore(out, 128, S.vset(x, 3, 7.0))
    return S.vsum(x), S.vhmax(x), S.vget(x, 5)


@jit
def _pairs(src, dst):
    e, o = S.vload_pairs(src, 0)
    S.vstore(dst, 0, e)
    S.vstore(dst, 16, o)


@jit
def _scalars(src, dst, i):
    b = S.vbcast(src, i)
    S.vstore(dst, 0, b)
    S.store_f32(dst, 16, S.to_f32(src, i) * 2.0)


def _bits(t):
    return as_numpy(t.contiguous()).copy()


DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@pytest.mark.fallback
@pytest.mark.parametrize("dtype", DTYPES)
def test_load_widen_store_round(dtype):
    x = torch.randn(40) * 3
    src = x.to(dtype)
    # load 16 elements from offset 5 (unaligned) and store them back: widening is exact
    dst = torch.zeros(16, dtype=dtype)
    _load_store(_bits(src), as_numpy(dst), 5)
    assert torch.equal(dst, src[5:21])
    # fp32 -> dtype rounding is round-to-nearest-even, ties and specials included
    vals = torch.tensor(
        [1.0, 1.00390625, 1.01171875, -1.00390625, 3.0e38, -3.0e38, float("inf"), float("-inf"),
         float("nan"), 0.0, -0.0, 1e-40, 65504.0, 65520.0, 2.0**-25, 1 + 2.0**-11],
        dtype=torch.float32,
    )  # fmt: skip
    out = torch.zeros(16, dtype=dtype)
    _load_store(vals.numpy(), as_numpy(out), 0)
    want = vals.to(dtype)
    nan = torch.isnan(want)
    assert torch.equal(torch.isnan(out), nan)
    assert torch.equal(out[~nan].view(torch.uint8), want[~nan].view(torch.uint8))


def test_bf16_rne_exhaustive_high_bits():
    """Every bf16 rounding case of one exponent: the 16 dropped bits all over the range."""
    base = np.uint32(0x3F80_0000)
    lows = np.arange(0, 1 << 16, 37, dtype=np.uint32)
    vals = (base | lows).view(np.float32)
    vals = vals[: len(vals) // 16 * 16]
    out = torch.zeros(len(vals), dtype=torch.bfloat16)
    for i in range(0, len(vals), 16):
        tmp = torch.zeros(16, dtype=torch.bfloat16)
        _load_store(vals[i : i + 16].copy(), as_numpy(tmp), 0)
        out[i : i + 16] = tmp
    assert torch.equal(out, torch.from_numpy(vals).bfloat16())


@pytest.mark.fallback
def test_arithmetic_and_reductions():
    a, b, c = (np.random.randn(16).astype(np.float32) for _ in range(3))
    out = np.zeros(144, np.float32)
    s, mx, g = _arith(a, b, c, out)
    np.testing.assert_array_equal(out[:16], a + b)
    np.testing.assert_array_equal(out[16:32], a - b)
    np.testing.assert_array_equal(out[32:48], a * b)
    fma = (a.astype(np.float64) * b + c).astype(np.float32)  # exact product, one rounding
    np.testing.assert_array_equal(out[48:64], fma)
    np.testing.assert_array_equal(out[64:80], np.maximum(a, b))
    np.testing.assert_array_equal(out[80:96], np.minimum(a, b))
    np.testing.assert_array_equal(out[96:112], np.full(16, 2.5, np.float32))
    np.testing.assert_array_equal(out[112:128], np.zeros(16, np.float32))
    want = a.copy()
    want[3] = 7.0
    np.testing.assert_array_equal(out[128:144], want)
    assert s == pytest.approx(a.astype(np.float64).sum(), rel=1e-6, abs=1e-6)
    assert mx == a.max() and g == a[5]


@pytest.mark.fallback
@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float16))
def test_pairs_split_even_odd(dtype):
    src = torch.randn(32).to(dtype)
    dst = np.zeros(32, np.float32)
    _pairs(_bits(src), dst)
    np.testing.assert_array_equal(dst[:16], src[0::2].float().numpy())
    np.testing.assert_array_equal(dst[16:], src[1::2].float().numpy())


@pytest.mark.fallback
@pytest.mark.parametrize("dtype", DTYPES)
def test_broadcast_and_scalar_roundtrip(dtype):
    src = torch.randn(9).to(dtype)
    dst = torch.zeros(17, dtype=dtype)
    _scalars(_bits(src), as_numpy(dst), 4)
    assert torch.equal(dst[:16], src[4].expand(16))
    assert torch.equal(dst[16], (src[4].float() * 2).to(dtype))


@jit
def _exp_tanh(x, e, t):
    for i in range(0, x.size, 16):
        v = S.vload(x, i)
        S.vstore(e, i, S.vexp(v))
        S.vstore(t, i, S.vtanh(v))


def _exp_tanh_of(x):
    """vexp and vtanh of float32 ``x`` (padded to whole vectors) and float64 references."""
    x = np.concatenate([x, np.zeros(-len(x) % 16)]).astype(np.float32)
    e, t = np.empty_like(x), np.empty_like(x)
    _exp_tanh(x, e, t)
    x64 = x.astype(np.float64)
    with np.errstate(over="ignore"):
        return x, e, t, np.exp(x64), np.tanh(x64)


F32_MAX = float(np.finfo(np.float32).max)
F32_TINY = float(np.finfo(np.float32).tiny)
# vexp's and vtanh's bounds against float64 (numkern.testing.tolerances, with why)
VEXP, VTANH = tolerance("vexp", torch.float32), tolerance("vtanh", torch.float32)


@pytest.mark.fallback
def test_vexp_vtanh_against_float64_over_their_range():
    """Relative error of vexp at most 2.5 units of fp32 (2^-23) from -87.3 to the largest
    argument whose exp is finite, absolute error of vtanh at most 2e-7, over 2^20 points,
    random [-1, 1] and tiny magnitudes (10^-30 .. 10)."""
    rng = np.random.default_rng(0)
    tiny = np.geomspace(1e-30, 10, 4096)
    wide = np.linspace(-87.3, S.EXP_MAX_ARG, 1 << 20)
    x = np.concatenate([wide, rng.uniform(-1, 1, 1 << 14), tiny, -tiny])
    x, e, t, e64, t64 = _exp_tanh_of(x)
    rel = np.abs(e - e64) / e64
    assert rel.max() <= VEXP.rel, (rel.max(), x[rel.argmax()])
    assert np.abs(t - t64).max() <= VTANH.abs, x[np.abs(t - t64).argmax()]
    assert (np.abs(t) <= 1).all()


@pytest.mark.fallback
def test_vexp_vtanh_edges():
    """±inf, NaN, ±0, fp32's extremes and both sides of the underflow (-87.3) and overflow
    (ln(FLT_MAX)) edges, lane by lane against float64 rounded to fp32."""
    edge = np.float32(S.EXP_MAX_ARG)
    specials = [np.inf, -np.inf, np.nan, -np.nan, 0.0, -0.0, 1e-45, 9.0, -9.0, 20.0, -20.0, 0.5]
    extremes = [F32_MAX, -F32_MAX, F32_TINY, -F32_TINY, 1e4, -1e4]
    overflow = [edge, np.nextafter(edge, np.float32(np.inf)), 88.8, 89.0, 100.0]
    underflow = [-87.3, np.nextafter(np.float32(-87.3), np.float32(0)), -87.31, -87.4, -103, -104]
    tanh_edge = [44.36, 44.37, -44.37]  # 2x crosses the overflow edge inside vtanh
    x = np.array(specials + extremes + overflow + underflow + tanh_edge, np.float32)
    x, e, t, e64, t64 = _exp_tanh_of(x)
    nan = np.isnan(x)
    assert np.isnan(e[nan]).all() and np.isnan(t[nan]).all()  # NaN stays NaN, both ops
    x, e, t, e64, t64 = x[~nan], e[~nan], t[~nan], e64[~nan], t64[~nan]
    over = e64 > F32_MAX  # fp32 overflow: exactly the lanes above EXP_MAX_ARG
    assert np.array_equal(over, x > edge) and over.sum() == 7
    assert (e[over] == np.inf).all()
    under = x < np.float32(-87.3)  # documented: 0 there (exp would be below 1.22e-38)
    assert (e[under] == 0).all() and (e64[under] < math.exp(-87.3)).all()
    mid = ~over & ~under
    assert np.isfinite(e[mid]).all() and e[x == edge][0] > 0.99 * F32_MAX
    np.testing.assert_allclose(e[mid], e64[mid], rtol=VEXP.rel, atol=0)
    np.testing.assert_allclose(t, t64, rtol=0, atol=VTANH.abs)
    assert (t[x >= 10] == 1).all() and (t[x <= -10] == -1).all()  # saturated, never past ±1
    assert e[x == 0].tolist() == [1.0, 1.0] and (t[x == 0] == 0).all()


_DPBF16_SRC = """
from numkern import simd as S
from numkern._jit import jit

@jit
def dp(acc, w, x, out):
    r = S.dpbf16(S.vload(acc, 0), S.vload_raw_pairs(w, 0), S.vbcast_raw_pair(x, 0))
    S.vstore(out, 0, r)

@jit
def dp_rows(acc, w, x, out):
    # w: a K row of 16 bf16 values at 3, the next K row right after it (MoE's vec layout)
    r = S.dpbf16(S.vload(acc, 0), S.vinterleave_raw(w, 3), S.vbcast_raw_pair(x, 0))
    S.vstore(out, 0, r)
"""


def test_dpbf16_on_host(tmp_path, monkeypatch):
    if not isa.has("avx512bf16"):
        pytest.skip(
            "AVX512-BF16 is absent (or masked by NUMKERN_CPU_FEATURES): vdpbf16ps cannot run "
            "here (its code generation is checked by test_dpbf16_codegen)"
        )
    (tmp_path / "dpmod_host.py").write_text(_DPBF16_SRC)
    monkeypatch.syspath_prepend(str(tmp_path))
    import dpmod_host

    acc = np.random.randn(16).astype(np.float32)
    w = torch.randn(32).bfloat16()
    x = torch.randn(2).bfloat16()
    out = np.zeros(16, np.float32)
    dpmod_host.dp(acc, _bits(w), _bits(x), out)
    want = acc + w[0::2].float().numpy() * x[0].item() + w[1::2].float().numpy() * x[1].item()
    np.testing.assert_allclose(out, want, **rtol_atol("dpbf16"))
    # the same pairs as uint32 (a pair carrier: the packed linear's weights)
    out[:] = 0
    dpmod_host.dp(acc, _bits(w).view(np.uint32), _bits(x), out)
    np.testing.assert_allclose(out, want, **rtol_atol("dpbf16"))
    # two K rows interleaved into pairs: lane j = (rows[3 + j], rows[19 + j])
    rows = torch.randn(40).bfloat16()
    out[:] = 0
    dpmod_host.dp_rows(acc, _bits(rows), _bits(x), out)
    even, odd = rows[3:19].float().numpy(), rows[19:35].float().numpy()
    want = acc + even * x[0].item() + odd * x[1].item()
    np.testing.assert_allclose(out, want, **rtol_atol("dpbf16"))


def test_dpbf16_codegen(tmp_path):
    """Compiled for a CPU with AVX512-BF16 (without running), dpbf16 is one vdpbf16ps."""
    mod = tmp_path / "dpmod.py"
    mod.write_text(_DPBF16_SRC)
    code = (
        f"import sys; sys.path.insert(0, {str(tmp_path)!r})\n"
        "import numba, numkern\nfrom numba import types\nimport dpmod\n"
        "u16 = types.Array(types.uint16, 1, 'C'); f32 = types.Array(types.float32, 1, 'C')\n"
        "sig = (f32, u16, u16, f32)\ndpmod.dp.compile(sig)\n"
        "print(dpmod.dp.inspect_asm(sig))\n"
    )
    # the child compiles for the CPU it names, whatever this process runs with: a mask
    # inherited from NUMKERN_CPU_FEATURES would replace that target (and LLVM cannot lower
    # vdpbf16ps without AVX-512)
    env = {
        "NUMBA_CPU_NAME": "sapphirerapids",
        "NUMBA_CPU_FEATURES": "",
        "NUMKERN_CPU_FEATURES": "",
        "NUMBA_CACHE_DIR": str(tmp_path / "cache"),
    }
    asm = run_child(code, env)
    assert "vdpbf16ps" in asm


@jit(parallel=True)
def _take_all(n, workers, counter, taken, order):
    for w in prange(workers):
        it = S.fetch_add(counter, 0, 1)
        while it < n:
            taken[it] += 1
            order[it] = w
            it = S.fetch_add(counter, 0, 1)


@pytest.mark.fallback
def test_fetch_add_hands_out_each_index_once():
    # the dynamic schedule of paged attention: workers (more than threads) take indices
    # from a shared counter; every index is taken exactly once, the counter ends past n
    n, workers = 10_000, 64
    counter = np.zeros(1, np.int64)
    taken = np.zeros(n, np.int64)
    order = np.full(n, -1, np.int64)
    _take_all(n, workers, counter, taken, order)
    np.testing.assert_array_equal(taken, np.ones(n, np.int64))
    assert (order >= 0).all() and (order < workers).all()
    # each worker's last fetch_add returned >= n: n + (workers that ran) increments
    assert n < counter[0] <= n + workers


@jit(parallel=True)
def _hand_over(rounds, box, seen):
    # two workers alternate: worker w waits (atomic_load) until box[0] is w's turn, so
    # a load hoisted out of the wait loop would hang and a stale one would repeat a turn
    for w in prange(2):
        for r in range(rounds):
            turn = 2 * r + w
            while S.atomic_load(box, 0) != turn:
                pass
            seen[turn] = box[1]
            box[1] += 1
            S.fetch_add(box, 0, 1)


def test_atomic_load_sees_the_other_threads_updates():
    if numba.get_num_threads() < 2:  # one thread would run both workers in turn: a hang
        pytest.skip("needs two Numba threads")
    rounds = 2000
    box = np.zeros(2, np.int64)
    seen = np.full(2 * rounds, -1, np.int64)
    _hand_over(rounds, box, seen)
    np.testing.assert_array_equal(seen, np.arange(2 * rounds))
    assert box[0] == 2 * rounds


_FP16_SOFT = """
import numpy as np, torch
from numkern import isa, simd as S
from numkern._jit import jit
assert not S._F16C and not isa.has("f16c")

@jit
def widen(h, out):  # fp16 bits -> fp32: 16 lanes at a time, and the scalar load
    for i in range(0, h.size, 16):
        S.vstore(out, i, S.vload(h, i))
    out[0] = S.to_f32(h, 0)

@jit
def narrow(x, out):  # fp32 -> fp16 bits: 16 lanes at a time, and the scalar store
    for i in range(0, x.size - 16 + 1, 16):
        S.vstore(out, i, S.vload(x, i))
    S.store_f32(out, x.size - 1, x[x.size - 1])

h = np.arange(1 << 16, dtype=np.int64).astype(np.uint16).view(np.int16)
got = np.empty(h.size, np.float32)
widen(h, got)
want = torch.from_numpy(h.copy()).view(torch.float16).float().numpy()
nan = np.isnan(want)
same = got[~nan].view(np.int32) == want[~nan].view(np.int32)
assert (np.isnan(got) == nan).all() and same.all()
# fp32 values at, around and between every fp16 rounding boundary (midpoints: ties to even),
# past the range, subnormals, zeros, infinities and NaNs of both signs
f = want[~nan].astype(np.float64)
f = np.sort(np.unique(f[np.isfinite(f)]))
mid = (f[1:] + f[:-1]) / 2
x = np.concatenate([f, mid, np.nextafter(mid.astype(np.float32), np.inf),
                    np.nextafter(mid.astype(np.float32), -np.inf), [65520.0, -65520.0, 1e9, -1e-30,
                    np.inf, -np.inf, np.nan, -np.nan, 1e-45, 3e-8, 2.98e-8]]).astype(np.float32)
x = np.concatenate([x, np.zeros((-x.size) % 16 + 16, np.float32)])
out = np.empty(x.size, np.int16)
narrow(x, out)
ref = torch.from_numpy(x).half().view(torch.int16).numpy()
isnan = np.isnan(x)
gotf = torch.from_numpy(out.copy()).view(torch.float16).float().numpy()
assert np.isnan(gotf[isnan]).all()
bad = np.nonzero(out[~isnan] != ref[~isnan])[0]
assert bad.size == 0, (x[~isnan][bad[:5]], out[~isnan][bad[:5]], ref[~isnan][bad[:5]])
print("ok", h.size, x.size)
"""


@pytest.mark.skipif(not isa.is_x86(), reason="F16C is an x86 feature")
def test_fp16_conversions_without_f16c():
    """Without F16C (the SSE code; CI's fallback run on an AVX2-only CPU masks AVX and F16C
    with it), fp16 loads and stores take numkern.simd's integer forms, not LLVM's
    compiler-rt calls, which Numba's JIT cannot resolve (an abort): every fp16 value widens
    to torch's fp32 bits, and fp32 values around every fp16 rounding boundary narrow to
    torch's bits (round to nearest even), in a child with F16C masked."""
    out = run_child(_FP16_SOFT, {"NUMKERN_CPU_FEATURES": "-f16c"})
    assert out.split()[0] == "ok", out
