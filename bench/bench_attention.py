"""Benchmark numkern's paged attention against torch SDPA and vLLM's CPU attention.

    python bench/bench_attention.py            # 4 cases, ~70 s on 2 cores
    python bench/bench_attention.py --quick    # prefill of 1024 tokens, few rounds (~1 min)
    python bench/bench_attention.py --prefill-only  # prefill of 1024 tokens, 9 rounds (~2 min)

Config (bf16): Hq=32, Hkv=8, D=128, block size 128. Cases: decode of 8 requests x 2048
context (q_len 1 each), one causal prefill of 2048 tokens (q_len = kv_len), and both with
``sliding_window=512``. Each cache is written by its library's ``reshape_and_cache``
through a shuffled block table; numkern's plan and vLLM's scheduler metadata are built once
per case outside the timed region, as an engine does once per step.

Columns per case: numkern ``paged_attention`` with isa vec and amx (numkern's amx cache
layout, a cache of its own); torch ``F.scaled_dot_product_attention`` in bf16 and fp32 on
contiguous K/V per request, repeated to Hq heads beforehand (``is_causal`` for the prefill,
an explicit boolean mask for the window, the 8 decode requests batched as one
``[8, Hq, 1, D]`` call); vLLM's ``cpu_attention_with_kv_cache`` for isa vec and amx, each
where its probe passes, from the build vLLM loads on a CPU with the features numkern sees
(:func:`harness.vllm_library`; the header's ``vllm_library``): under
``NUMKERN_CPU_FEATURES=-avx512f`` that is ``_C_AVX2``, the build of the AVX2 CPU the masked
run stands for. The mask reaches numkern alone: SDPA (oneDNN) still uses AVX-512 there.
Ratios are peer time / numkern vec time (> 1: numkern vec faster). numkern's outputs are
checked against SDPA fp32.

Decode streams the cache, so its K/V bytes per second (per request: the keys visible,
window-limited, x Hkv x D x 2 (K and V) x 2 bytes) are compared with the stream bandwidth
measured in the same run. That figure is timed on rotated cache copies (distinct kv tensors,
same block table) whose visited blocks together exceed the L3 bound. A prefill rereads each
K/V tile for every group of query rows: it is compute-bound, so it gets GFLOP/s instead.
"""

import gc
import math
import time
from dataclasses import dataclass

import harness
import torch
import torch.nn.functional as F

from numkern import attention as A

HQ, HKV, D, BLOCK = 32, 8, 128, 128
DTYPE = torch.bfloat16
SCALE = 1.0 / math.sqrt(D)
DECODE_REQUESTS, DECODE_CONTEXT = 8, 2048
PREFILL_TOKENS = 2048
# A 2048-token prefill takes 1-3 s per call on 2 cores; 1024 still spans two windows.
QUICK_PREFILL_TOKENS = 1024
WINDOWS = (-1, 512)
# Queries ~N(0, 4^2) make the logits ~N(0, 4^2): each row's softmax is dominated by a few
# keys, so outputs are O(1) and the error bound below tests something (with N(0, 1)
# queries a 2048-key average is ~0.02 and an all-zero output would pass).
QUERY_STD = 4.0
# Outputs reach |out| ~4.3 (a row dominated by one key returns its N(0, 1) value vector),
# where bf16 rounding alone is up to half an ulp = 2**-8 * 4 = 0.016; fp32 softmax order
# adds far less. numkern measured 0.015, vLLM 0.029 (one ulp).
MAX_ABS_ERR = 3e-2
# The rotated cases' working set (copies x K/V bytes of one call) must exceed the L3
# bound; the windowed decode reads a quarter of each copy, so the pool is sized for it,
# with this margin.
ROTATION_MARGIN = 1.1
# Rounds end once one case has spent this long: SDPA bf16 decode takes ~0.25 s a call
# (0.5 s a sample with its settling call), so 5 s gives ~10 samples of every case.
DECODE_MAX_SECONDS = 5.0
# Calls of a prefill take 0.1-3 s: the OpenMP spin the settling call absorbs (a few ms)
# is noise there, and skipping it halves the time of those rows.
SETTLE_MAX_Q_LEN = 1
PREFILL_ONLY_ROUNDS = 9  # --prefill-only: a ratio's median needs at least 9 rounds

# Run in a child after loading vLLM's native build: reshape_and_cache, the metadata and
# the attention op for a decode and a prefill request, without and with a window.
VLLM_PROBE = """
hq, hkv, d, b, dt = 32, 8, 128, 128, torch.bfloat16
reqs = ((1, 300), (200, 200))  # (q_len, kv_len): one decode, one prefill
kv = torch.zeros(5, hkv, b, 2 * d, dtype=dt)
kc, vc = kv.view(5, hkv, 2 * b, d).chunk(2, dim=2)
bt = torch.tensor([[4, 0, 2], [3, 1, 0]], dtype=torch.int32)  # shuffled blocks
for r, (_, kl) in enumerate(reqs):
    pos = torch.arange(kl)
    k = torch.randn(kl, hkv, d).to(dt); v = torch.randn(kl, hkv, d).to(dt)
    torch.ops._C.cpu_attn_reshape_and_cache(k, v, kc, vc, bt[r, pos // b].long() * b + pos % b,
                                            "{isa}")
qsl = torch.tensor([0, 1, 201], dtype=torch.int32); sl = torch.tensor([300, 200], dtype=torch.int32)
q = torch.randn(201, hq, d).to(dt)
for w in (-1, 64):
    out = torch.full_like(q, float("nan"))
    meta = torch.ops._C.get_scheduler_metadata(
        num_req=2, num_heads_q=hq, num_heads_kv=hkv, head_dim=d, seq_lens=sl, dtype=dt,
        query_start_loc=qsl, casual=True, window_size=w, isa_hint="{isa}", enable_kv_split=True,
        dynamic_causal=None, kv_cache_dtype="auto")
    torch.ops._C.cpu_attention_with_kv_cache(
        query=q, key_cache=kc, value_cache=vc, output=out, query_start_loc=qsl, seq_lens=sl,
        scale=d**-0.5, causal=True, alibi_slopes=None, sliding_window_size=w, block_table=bt,
        softcap=0.0, scheduler_metadata=meta, s_aux=None, dynamic_causal=None)
    if not torch.isfinite(out.float()).all():
        raise SystemExit(f"non-finite output, window {{w}}")
"""
VLLM_ISAS = ("vec", "amx")
NUMKERN_ISAS = ("vec", "amx")
PEERS = ("numkern_amx", "sdpa_bf16", "sdpa_fp32", "vllm_vec", "vllm_amx")

COLUMNS = [
    "case", "nk_vec_first_s", "nk_amx_first_s", "plan_ms", "numkern_vec_ms", "numkern_amx_ms",
    "sdpa_bf16_ms", "sdpa_fp32_ms", "vllm_vec_ms", "vllm_amx_ms", "x_numkern_amx",
    "x_sdpa_bf16", "x_sdpa_fp32", "x_vllm_vec", "x_vllm_amx", "max_abs_err_vec",
    "max_abs_err_amx", "GFLOPs", "kv_MB", "kv_GBps", "of_stream", "amx_GBps",
    "amx_of_stream", "bandwidth_note", "others_cores",
]  # fmt: skip


@dataclass(frozen=True)
class Scenario:
    name: str
    kind: str  # "decode" or "prefill"
    requests: int  # R, all alike
    q_len: int
    kv_len: int

    @property
    def tokens(self):
        return self.requests * self.q_len


# ---------------------------------------------------------------------------------------
# inputs


def _visible(sc, window):
    """(key-query pairs summed over one request's rows, keys any row of it sees)."""
    p = torch.arange(sc.kv_len - sc.q_len, sc.kv_len)  # each row's position
    lo = (p - (window - 1)).clamp(min=0) if window > 0 else torch.zeros_like(p)
    hi = p + 1  # causal
    return int((hi - lo).sum()), int(hi.max() - lo.min())


def _kv_bytes(sc, keys):
    """K/V bytes a call reads when each request's rows see ``keys`` keys."""
    return sc.requests * keys * HKV * D * 2 * DTYPE.itemsize  # K and V


def _cache(ks, vs, bt, num_blocks, write):
    """A new kv tensor ``[num_blocks, Hkv, B, 2D]`` holding request r's ``ks[r]``/``vs[r]``
    (``[kv_len, Hkv, D]``) at the blocks of ``bt[r]``, written by ``write(k, v, kc, vc,
    slots)``."""
    kv = torch.zeros(A.kv_cache_shape(num_blocks, HKV, BLOCK, D), dtype=DTYPE)
    kc, vc = A.split_kv_cache(kv)
    for r, (k, v) in enumerate(zip(ks, vs)):
        pos = torch.arange(k.shape[0])
        write(k, v, kc, vc, bt[r, pos // BLOCK].long() * BLOCK + pos % BLOCK)
    return kv


def _numkern_writer(isa):
    return lambda k, v, kc, vc, slots: A.reshape_and_cache(k, v, kc, vc, slots, isa)


def _vllm_writer(isa):
    return lambda k, v, kc, vc, slots: torch.ops._C.cpu_attn_reshape_and_cache(
        k, v, kc, vc, slots, isa
    )


def _sdpa_mask(sc, window):
    """(boolean attn_mask ``[q_len, kv_len]`` or None, is_causal) for SDPA."""
    if window < 0:
        # torch's is_causal aligns the mask top-left: right only when q_len == kv_len; a
        # decode row sees every key
        return None, sc.q_len > 1
    p = torch.arange(sc.kv_len - sc.q_len, sc.kv_len)[:, None]
    j = torch.arange(sc.kv_len)[None, :]
    return (j <= p) & (j >= p - (window - 1)), False


@dataclass
class _Setup:
    """One scenario's inputs: the query, index tensors, each kernel's caches, SDPA's K/V."""

    sc: Scenario
    q: torch.Tensor  # [T, Hq, D] bf16
    qsl: torch.Tensor  # [R+1] int32
    seq_lens: torch.Tensor  # [R] int32
    bt: torch.Tensor  # [R, max_blocks] int32
    caches: dict  # numkern isa -> [(kc, vc), ...]: copy 0 for the fixed cases, all rotated
    vllm: dict  # vLLM isa -> (kc, vc), for the isas whose probe passed
    sdpa: dict  # "bf16"/"fp32" -> (q, k, v) [R, Hq, q_len | kv_len, D]


def _setup(sc, gen, *, vllm, min_read_bytes):
    """``min_read_bytes``: K/V bytes of the rotated case that reads least per call; its
    copies together must pass the L3 bound (0: no rotation, one cache per isa)."""
    r_n, need = sc.requests, -(-sc.kv_len // BLOCK)
    num_blocks = r_n * need
    bt = torch.randperm(num_blocks, generator=gen).view(r_n, need).to(torch.int32)
    ks = [torch.randn(sc.kv_len, HKV, D, generator=gen).to(DTYPE) for _ in range(r_n)]
    vs = [torch.randn(sc.kv_len, HKV, D, generator=gen).to(DTYPE) for _ in range(r_n)]
    q = (torch.randn(sc.tokens, HQ, D, generator=gen) * QUERY_STD).to(DTYPE)
    qsl = torch.arange(0, sc.tokens + 1, sc.q_len, dtype=torch.int32)
    seq_lens = torch.full((r_n,), sc.kv_len, dtype=torch.int32)

    caches = {}
    for isa in NUMKERN_ISAS:
        kv = _cache(ks, vs, bt, num_blocks, _numkern_writer(isa))
        if min_read_bytes:  # clones: distinct memory, same contents and block table
            alloc = kv.numel() * kv.element_size()
            want = ROTATION_MARGIN * harness.L3_BYTES / min_read_bytes * alloc
            rotation = harness.rotating(lambda kv=kv: A.split_kv_cache(kv.clone()), want, alloc)
            caches[isa] = rotation.copies  # capped at harness.MAX_ROTATION_BYTES
        else:
            caches[isa] = [A.split_kv_cache(kv)]
    vllm_caches = {
        isa: A.split_kv_cache(_cache(ks, vs, bt, num_blocks, _vllm_writer(isa)))
        for isa, avail in vllm.items()
        if avail.ok
    }

    # SDPA: [R, heads, len, D], K/V repeated to Hq heads (GQA: q head h reads kv head
    # h // (Hq // Hkv), as repeat_interleave lays them out)
    q4 = q.view(r_n, sc.q_len, HQ, D).transpose(1, 2)
    k4 = torch.stack(ks).transpose(1, 2).repeat_interleave(HQ // HKV, dim=1)
    v4 = torch.stack(vs).transpose(1, 2).repeat_interleave(HQ // HKV, dim=1)
    sdpa = {
        name: tuple(x.to(dt).contiguous() for x in (q4, k4, v4))
        for name, dt in (("bf16", DTYPE), ("fp32", torch.float32))
    }
    return _Setup(sc, q, qsl, seq_lens, bt, caches, vllm_caches, sdpa)


# ---------------------------------------------------------------------------------------
# one case


def _median_ms(fn, repeats=5):
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return sorted(times)[len(times) // 2] * 1e3


def _cases(s, window, plans, metas, outs, sdpa_out, rotations):
    """The timed callables of one (scenario, window); ``rotations``: numkern isa ->
    Rotation of its cache copies (empty: no rotated cases)."""
    q, qsl, sl, bt = s.q, s.qsl, s.seq_lens, s.bt
    mask, is_causal = _sdpa_mask(s.sc, window)

    def numkern(isa, kc, vc):
        A.paged_attention(q, kc, vc, outs[f"numkern_{isa}"], qsl, sl, bt, scale=SCALE,
                          causal=True, sliding_window=window, isa=isa, plan=plans[isa])  # fmt: skip

    def sdpa(name):
        sdpa_out[name] = F.scaled_dot_product_attention(
            *s.sdpa[name], attn_mask=mask, is_causal=is_causal, scale=SCALE
        )

    def vllm(isa):
        kc, vc = s.vllm[isa]
        torch.ops._C.cpu_attention_with_kv_cache(
            query=q, key_cache=kc, value_cache=vc, output=outs[f"vllm_{isa}"],
            query_start_loc=qsl, seq_lens=sl, scale=SCALE, causal=True, alibi_slopes=None,
            sliding_window_size=window, block_table=bt, softcap=0.0,
            scheduler_metadata=metas[isa], s_aux=None, dynamic_causal=None,
        )  # fmt: skip

    cases = {}
    for isa in NUMKERN_ISAS:
        kc, vc = s.caches[isa][0]
        cases[f"numkern_{isa}"] = lambda isa=isa, kc=kc, vc=vc: numkern(isa, kc, vc)
    cases["sdpa_bf16"] = lambda: sdpa("bf16")
    cases["sdpa_fp32"] = lambda: sdpa("fp32")
    for isa in s.vllm:
        cases[f"vllm_{isa}"] = lambda isa=isa: vllm(isa)
    for isa, rotation in rotations.items():
        cases[f"rot_numkern_{isa}"] = lambda isa=isa, rot=rotation: numkern(isa, *rot())
    return cases


def _to_tokens(out4):
    """SDPA's ``[R, Hq, q_len, D]`` as ``[T, Hq, D]`` fp32."""
    return out4.transpose(1, 2).reshape(-1, HQ, D).float()


def _bench_case(s, window, *, na, timer_args):
    """The row of one (scenario, window). ``na``: cells of the vLLM cases that cannot run."""
    sc = s.sc
    case = sc.name + (f" W={window}" if window > 0 else "")
    plan_args = dict(num_heads=HQ, num_kv_heads=HKV, head_dim=D, block_size=BLOCK,
                     causal=True, sliding_window=window)  # fmt: skip
    plans = {isa: A.plan_attention(s.qsl, s.seq_lens, isa=isa, **plan_args) for isa in NUMKERN_ISAS}
    plan_ms = _median_ms(lambda: A.plan_attention(s.qsl, s.seq_lens, isa="vec", **plan_args))

    def meta(isa):
        return torch.ops._C.get_scheduler_metadata(
            num_req=sc.requests, num_heads_q=HQ, num_heads_kv=HKV, head_dim=D,
            seq_lens=s.seq_lens, dtype=DTYPE, query_start_loc=s.qsl, casual=True,
            window_size=window, isa_hint=isa, enable_kv_split=True, dynamic_causal=None,
            kv_cache_dtype="auto",
        )  # fmt: skip

    metas = {isa: meta(isa) for isa in s.vllm}
    meta_ms = _median_ms(lambda: meta("vec")) if "vec" in s.vllm else None
    names = [f"numkern_{isa}" for isa in NUMKERN_ISAS] + [f"vllm_{isa}" for isa in s.vllm]
    outs = {name: torch.empty_like(s.q) for name in names}
    sdpa_out = {}

    pairs, keys = _visible(sc, window)
    kv_bytes = _kv_bytes(sc, keys)
    rotations = {  # every case of the scenario rotates the same copies, reading kv_bytes
        isa: harness.Rotation(copies, kv_bytes)
        for isa, copies in s.caches.items()
        if len(copies) > 1
    }
    cases = _cases(s, window, plans, metas, outs, sdpa_out, rotations)
    t = harness.time_interleaved(cases, settle=sc.q_len <= SETTLE_MAX_Q_LEN, **timer_args)

    if rotations:  # the fixed caches' outputs (the rotated calls overwrote them)
        for name in outs:
            cases[name]()
    ref = _to_tokens(sdpa_out["fp32"])  # [T, Hq, D]
    got = {name: out.float() for name, out in outs.items()} | {
        "sdpa_bf16": _to_tokens(sdpa_out["bf16"])
    }
    errors = {name: float((x - ref).abs().max()) for name, x in got.items()}
    for isa in NUMKERN_ISAS:
        err = errors[f"numkern_{isa}"]
        if not err < MAX_ABS_ERR:
            raise RuntimeError(
                f"numkern {isa} {case}: max abs err {err:.3g} vs SDPA fp32 (bound {MAX_ABS_ERR})"
            )

    vec_s = t["numkern_vec"].median_s
    row = {
        "case": case,
        "kind": sc.kind,
        "requests": sc.requests,
        "q_len": sc.q_len,
        "kv_len": sc.kv_len,
        "window": window,
        "nk_vec_first_s": t["numkern_vec"].first_s,
        "nk_amx_first_s": t["numkern_amx"].first_s,
        "plan_ms": plan_ms,
        "vllm_meta_ms": meta_ms,
    }
    for name in ("numkern_vec", *PEERS):
        row[f"{name}_ms"] = t[name].median_s * 1e3 if name in t else na[name]
    for name in PEERS:
        row[f"x_{name}"] = t[name].median_s / vec_s if name in t else na[name]
    row["max_abs_err_vec"] = errors["numkern_vec"]
    row["max_abs_err_amx"] = errors["numkern_amx"]
    row["max_abs_err_vllm_vec"] = errors.get("vllm_vec")
    row["max_abs_err_vllm_amx"] = errors.get("vllm_amx")
    row["max_abs_err_sdpa_bf16"] = errors["sdpa_bf16"]
    row["max_abs_ref"] = float(ref.abs().max())
    row["GFLOPs"] = 4 * sc.requests * pairs * HQ * D / vec_s / 1e9  # q.k and p.v
    row["kv_MB"] = kv_bytes / 1e6
    row |= {"kv_GBps": None, "of_stream": None, "amx_GBps": None, "amx_of_stream": None}
    rot = rotations.get("vec")
    if rot is None:
        row["bandwidth_note"] = "compute-bound: not rotated"
    elif not rot.claimable:
        row["bandwidth_note"] = (
            f"not claimable: working set {rot.working_set_bytes / 1e6:.0f} MB "
            f"<= {harness.L3_BYTES / 1e6:.0f} MB"
        )
    else:
        row["kv_GBps"] = kv_bytes / t["rot_numkern_vec"].median_s / 1e9
        row["amx_GBps"] = kv_bytes / t["rot_numkern_amx"].median_s / 1e9
        row["bandwidth_note"] = f"{len(rot)} copies, {rot.working_set_bytes / 1e6:.0f} MB"
    if rot is not None:
        row["working_set_MB"] = rot.working_set_bytes / 1e6
        row["copies"] = len(rot)
    row["others_cores"] = t["numkern_vec"].other_cores
    # the roofline point: q read and out written (bf16) besides K/V; the rotated time
    # where claimable (K/V then comes from DRAM)
    claimed = rot is not None and rot.claimable
    series = f"attention {sc.kind}" + (f" {sc.requests} req" if sc.kind == "decode" else "")
    row |= harness.roofline(
        series + (f" W={window}" if window > 0 else ""),
        ("context", sc.kv_len) if sc.kind == "decode" else ("tokens", sc.q_len),
        flop=4 * sc.requests * pairs * HQ * D,
        nbytes=kv_bytes + 2 * 2 * sc.requests * sc.q_len * HQ * D,
        seconds=t["rot_numkern_vec"].median_s if claimed else vec_s,
    )
    for name, timing in t.items():
        row[f"{name}_first_s"] = timing.first_s
        row[f"{name}_min_ms"] = timing.min_s * 1e3
        row[f"{name}_samples"] = timing.samples
        row[f"{name}_calls_per_sample"] = timing.calls_per_sample
    print(f"  {case}: " + ", ".join(
        f"{name} {t[name].median_s * 1e3:.2f} ms" for name in t), flush=True)  # fmt: skip
    return row


def bench_scenario(sc, *, vllm, timer_args):
    """Rows for one scenario, one per window; its caches are garbage once this returns.
    vLLM cases that cannot run read "n/a" (the reason is in the notes)."""
    gen = torch.Generator().manual_seed(0)
    # decode reads the cache once per call: rotate it so the bandwidth can be claimed
    min_read = min(_kv_bytes(sc, _visible(sc, w)[1]) for w in WINDOWS)
    s = _setup(sc, gen, vllm=vllm, min_read_bytes=min_read if sc.kind == "decode" else 0)
    na = {f"vllm_{isa}": "n/a" for isa, avail in vllm.items() if not avail.ok}
    return [_bench_case(s, w, na=na, timer_args=timer_args[sc.kind]) for w in WINDOWS]


# ---------------------------------------------------------------------------------------


def main(argv=None):
    bench = harness.start(
        "bench_attention",
        argv,
        description=__doc__.splitlines()[0],
        quick_help="1024-token prefill, few rounds",
        flags=[("--prefill-only", "only the 1024-token prefill, 9 rounds (issue 39's target)")],
    )
    prefill = QUICK_PREFILL_TOKENS if bench.quick or bench.args.prefill_only else PREFILL_TOKENS
    scenarios = (
        Scenario(f"decode {DECODE_REQUESTS}x{DECODE_CONTEXT}", "decode", DECODE_REQUESTS, 1,
                 DECODE_CONTEXT),
        Scenario(f"prefill {prefill}", "prefill", 1, prefill, prefill),
    )  # fmt: skip
    if bench.args.prefill_only:
        scenarios = scenarios[1:]
    max_seconds = (0.3, DECODE_MAX_SECONDS)
    # prefill calls take seconds: few rounds, all of them timed (--prefill-only: 9)
    prefill_min_rounds = 1 if bench.quick else min(3, bench.args.rounds or 3)
    if bench.args.prefill_only:
        prefill_min_rounds = bench.args.rounds or PREFILL_ONLY_ROUNDS
    timer_args = {
        "decode": bench.timer(rounds=(3, 15), max_seconds=max_seconds),
        "prefill": bench.timer(
            rounds=(3, max(3, prefill_min_rounds)),
            max_seconds=max_seconds,
            min_rounds=prefill_min_rounds,
        ),
    }
    bench.timer_args = timer_args  # both, for the header
    library = harness.vllm_library()
    vllm = {  # isa -> Availability
        isa: bench.vllm_peer(
            f"cpu_attention_with_kv_cache {isa} ({library})", VLLM_PROBE.format(isa=isa), library
        )
        for isa in VLLM_ISAS
    }

    rows = []
    for sc in scenarios:
        print(f"{sc.name}: Hq={HQ} Hkv={HKV} D={D} B={BLOCK} bf16", flush=True)
        rows += bench_scenario(sc, vllm=vllm, timer_args=timer_args)
        gc.collect()
    # Interference only slows a stream pass, never speeds it up: fractions are taken of
    # the larger of the two measurements, so they err low.
    stream = max(bench.stream_before, bench.end_stream())
    for row in rows:
        for gbps, frac in (("kv_GBps", "of_stream"), ("amx_GBps", "amx_of_stream")):
            if row[gbps] is not None:
                row[frac] = row[gbps] / stream
    notes = [f"vllm_{isa}: {avail.na()}" for isa, avail in vllm.items() if not avail.ok]
    notes += [
        f"WARNING: {name.removeprefix('max_abs_err_')} {row['case']}: max abs err "
        f"{row[name]:.3g} vs SDPA fp32 (numkern's bound {MAX_ABS_ERR})"
        for row in rows
        for name in ("max_abs_err_vllm_vec", "max_abs_err_vllm_amx")
        if row.get(name) is not None and not row[name] < MAX_ABS_ERR
    ]
    bench.finish(
        rows,
        columns=COLUMNS,
        extra={"stream_GBps": stream, "vllm_library": library},
        notes=[
            *notes,
            "times are medians of interleaved rounds; x_* = time / numkern vec time "
            "(> 1: numkern vec faster)",
            "nk_*_first_s: numkern's first call (compile, or load from Numba's disk cache); "
            "plan_ms: plan_attention, once per step, not in the timed calls",
            "numkern amx = the amx cache layout; its compute is AVX-512 like vec",
            f"max_abs_err_*: max |out - SDPA fp32| (bound {MAX_ABS_ERR}; queries "
            f"~N(0, {QUERY_STD:g}^2) so outputs are O(1), see max_abs_ref in the CSV)",
            "GFLOPs: 4 x visible (query, key) pairs x Hq x D / numkern vec time",
            "kv_MB: K/V bytes one call reads (keys visible per request, window-limited); "
            "kv_GBps (vec), amx_GBps: / time on rotated copies; *of_stream: / stream_GBps "
            "(the larger of before and after)",
            "others_cores: CPU used by other processes while the case was timed",
        ],
        plots=[
            {
                "x": "case",
                "y": ["x_numkern_amx", "x_sdpa_bf16", "x_sdpa_fp32", "x_vllm_vec", "x_vllm_amx"],
                "ylabel": "time / numkern vec time",
                "title": "numkern vec speedup (> 1: numkern vec faster)",
                "hline": (1.0, "parity"),
                "logy": True,
            },
            {
                "x": "case",
                "y": ["kv_GBps", "amx_GBps"],
                "where": lambda r: r["kind"] == "decode",
                "ylabel": "GB/s",
                "title": "decode K/V bytes read per second (rotated cache copies)",
                "hline": (stream, f"stream read {stream:.1f} GB/s"),
            },
        ],
    )


if __name__ == "__main__":
    main()
