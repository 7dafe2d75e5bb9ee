"""Benchmark numkern's Gated DeltaNet ops (the gated delta rule, the causal conv, the
gating, the gated RMS norm) against plain torch and vLLM.

    python bench/bench_gdn.py            # decode B in {1, 8, 32}, prefill T in {512, 2048}
    python bench/bench_gdn.py --quick    # decode B in {1, 8}, prefill T = 512
    python bench/bench_gdn.py --conv-only  # only the conv and gating rows

Shapes: Qwen3.5 / Qwen3-Next's GDN heads (Hk = 16 key heads, Hv = 32 value heads, Dk =
Dv = 128, bf16 activations, fp32 state, q/k L2-normed in the kernel).

* Decode: ``gdn.rule.fused_sigmoid_gating_delta_rule_update`` (one token per request,
  gating fused), vLLM's ``fused_sigmoid_gating_delta_rule_update_cpu`` and a torch loop
  over requests and heads (what a plain PyTorch fallback runs). Every call reads and
  writes each request's fp32 state (Hv x Dk x Dv x 4 bytes = 2 MB): the state bytes per
  second (read + written) are compared with the stream bandwidth. The states come from a
  pool of slots rotated between calls (a working set past the L3), and the share is shown
  only where claimable.
* Prefill: ``gdn.rule.chunk_gated_delta_rule`` (chunks of 64), vLLM's
  ``chunk_gated_delta_rule_cpu`` and transformers' ``torch_chunk_gated_delta_rule`` (the
  torch fallback of Qwen3-Next's modeling file), one request of T tokens.

* The small per-layer ops, each once per GDN layer per step (their fixed per-call cost
  is what a decode step pays): ``gdn.conv.causal_conv1d_update`` (B requests, one token
  each) and ``causal_conv1d_fwd`` (one request of T tokens with a history) over Qwen3-Next's
  conv dim (2 Hk Dk + Hv Dv = 8192, width 4), the weight packed (vLLM's layout, as vLLM's
  ops take it; one case with the plain weight, numkern only), vLLM's conv-state layout;
  ``gdn.gating.fused_gdn_gating`` (T tokens, Hv gates each); ``gdn.norm.rms_norm_gated``
  (T tokens x Hv heads of Dv, z a column window of a wider buffer; vLLM has no CPU op).
  The torch peers: the same math in plain torch ops (transformers' module for the norm).
  The conv rows' ``conv_GBps`` counts the bytes a call must move (x read, out written,
  the weight read, each request's width - 1 state columns read and written) over its
  time, and ``of_stream`` that over the run's stream bandwidth where the working set is
  past the L3 (conv fwd at 512 tokens rotates copies of x for it); the other conv rows
  are L3-resident (``l3_resident``) and show no share.

Ratios are peer time / numkern time (> 1: numkern faster). numkern's outputs are checked
against the torch references. The header names the CPU model (``harness.cpu_model``).
"""

import harness
import torch
import torch.nn.functional as F

from numkern.gdn import conv as CV
from numkern.gdn import gating as GT
from numkern.gdn import norm as NM
from numkern.gdn import rule as R

HK, HV, D = 16, 32, 128
BF = torch.bfloat16
DECODE_B = (1, 8, 32)
QUICK_DECODE_B = (1, 8)
PREFILL_T = (512, 2048)
QUICK_PREFILL_T = (512,)
CONV_DIM, WIDTH = 2 * HK * D + HV * D, 4  # Qwen3-Next's q | k | v channels, its conv width
CONV_B = (1, 8)  # conv update: requests
CONV_T = (16, 512)  # conv fwd: tokens of one request
SMALL_T = (1, 512)  # gating and rms_norm_gated: tokens
NORM_EPS = 1e-6
STATE_BYTES = HV * D * D * 4  # one request's fp32 state
# FLOPs of the delta rule per token (the roofline's count): per value head the state's decay
# (Dk Dv), k.S, the rank-1 update and q.S (2 Dk Dv each)
RULE_FLOP_PER_TOKEN = 7 * HV * D * D
MAX_REL_ERR = 2e-2

VLLM_PROBE = """
T, H, Hv, D = 2, 1, 2, 64
q = torch.randn(1, T, H, D).bfloat16(); v = torch.randn(1, T, Hv, D).bfloat16()
pool = torch.zeros(4, Hv, D, D); cu = torch.tensor([0, 1, 2], dtype=torch.int32)
torch.ops._C.fused_sigmoid_gating_delta_rule_update_cpu(
    torch.zeros(Hv), torch.zeros(Hv).bfloat16(), q, q, v, torch.zeros(T, Hv).bfloat16(),
    torch.zeros(T, Hv).bfloat16(), pool, torch.tensor([1, 0], dtype=torch.int32), cu,
    True, 1.0, 20.0)
torch.ops._C.chunk_gated_delta_rule_cpu(
    q, q, v, -torch.ones(1, T, Hv), torch.ones(1, T, Hv).bfloat16(), pool, True,
    torch.tensor([0, T], dtype=torch.int32), False, True, torch.tensor([1], dtype=torch.int32),
    1e-5)
ops = torch.ops._C
w = ops.causal_conv1d_weight_pack(torch.randn(64, 4).bfloat16())
x = torch.randn(5, 64).bfloat16()
st = torch.zeros(2, 3, 64).bfloat16().transpose(1, 2)
i = torch.tensor([1], dtype=torch.int32)
ops.causal_conv1d_fwd_cpu(x.t(), w, None, st, torch.tensor([0, 5], dtype=torch.int32), i,
                          torch.tensor([True]), True, -1, True)
ops.causal_conv1d_update_cpu(x[:1], st, w, None, True, None, i, -1, True)
ops.fused_gdn_gating_cpu(torch.randn(4), torch.randn(3, 4).bfloat16(),
                         torch.randn(3, 4).bfloat16(), torch.randn(4).bfloat16())
"""


def _l2(x):
    return x / torch.sqrt((x * x).sum(-1, keepdim=True) + 1e-5)


def torch_decode(A_log, dt_bias, q, k, v, a, b, pool, slots):
    """The plain torch decode step: per request, all heads at once (fp32)."""
    g = -A_log.exp() * F.softplus(a.float() + dt_bias.float())  # [B, Hv]
    beta = torch.sigmoid(b.float())
    rep = HV // HK
    qf = _l2(q[0].float()).repeat_interleave(rep, 1) * D**-0.5  # [B, Hv, D]
    kf = _l2(k[0].float()).repeat_interleave(rep, 1)
    vf = v[0].float()
    out = torch.empty(q.shape[1], HV, D)
    for i, s in enumerate(slots.tolist()):
        S = pool[s] * g[i].exp()[:, None, None]  # [Hv, Dk, Dv]
        delta = (vf[i] - torch.einsum("hk,hkv->hv", kf[i], S)) * beta[i][:, None]
        S = S + kf[i][:, :, None] * delta[:, None, :]
        pool[s] = S
        out[i] = torch.einsum("hk,hkv->hv", qf[i], S)
    return out


def _decode_inputs(b_n, gen):
    q = torch.randn(1, b_n, HK, D, generator=gen).to(BF)
    k = torch.randn(1, b_n, HK, D, generator=gen).to(BF)
    v = torch.randn(1, b_n, HV, D, generator=gen).to(BF)
    a = torch.randn(b_n, HV, generator=gen).to(BF)
    b = torch.randn(b_n, HV, generator=gen).to(BF)
    A_log = torch.randn(HV, generator=gen) * 0.5
    dt_bias = torch.randn(HV, generator=gen).to(BF)
    cu = torch.arange(b_n + 1, dtype=torch.int32)
    return q, k, v, a, b, A_log, dt_bias, cu


def bench_decode(b_n, *, vllm, stream_gbs, timer_args, gen):
    q, k, v, a, b, A_log, dt_bias, cu = _decode_inputs(b_n, gen)
    # a pool past the L3: calls rotate through disjoint sets of b_n slots
    sets = max(2, harness.WORKING_SET_BYTES // (b_n * STATE_BYTES))
    pool = torch.randn(sets * b_n, HV, D, D, generator=gen) * 0.05
    rot = [torch.arange(i * b_n, (i + 1) * b_n, dtype=torch.int32) for i in range(sets)]
    state = {"i": 0}

    def slots():
        state["i"] = (state["i"] + 1) % sets
        return rot[state["i"]]

    args = (A_log, dt_bias, q, k, v, a, b)
    # correctness first, on copies
    check = pool[:b_n].clone()
    first = torch.arange(b_n, dtype=torch.int32)
    ours = R.fused_sigmoid_gating_delta_rule_update(*args, check, first, cu, True)
    ref = torch_decode(A_log, dt_bias, q, k, v, a, b, pool[:b_n].clone(), first)
    err = float((ours[:, 0].float() - ref).abs().max() / ref.abs().max())
    if not err < MAX_REL_ERR:
        raise RuntimeError(f"decode B={b_n}: max rel err {err:.3g} against the torch loop")
    cases = {
        "numkern": lambda: R.fused_sigmoid_gating_delta_rule_update(*args, pool, slots(), cu, True),
        "torch_loop": lambda: torch_decode(*args[:2], q, k, v, a, b, pool, slots()),
    }
    if vllm.ok:
        op = torch.ops._C.fused_sigmoid_gating_delta_rule_update_cpu
        cases["vllm"] = lambda: op(*args, pool, slots(), cu, True, 1.0, 20.0)
    t = harness.time_interleaved(cases, **timer_args)
    nk = t["numkern"].median_s
    moved = 2 * b_n * STATE_BYTES  # read and written
    claim = harness.bandwidth_claimable(sets * b_n * STATE_BYTES)
    # the roofline point: the state moved, q, k, v read and out written (bf16)
    roof = harness.roofline(
        "gdn decode",
        ("B", b_n),
        flop=b_n * RULE_FLOP_PER_TOKEN,
        nbytes=moved + 2 * b_n * (2 * HK + 2 * HV) * D,
        seconds=nk,
    )
    return {
        "case": f"decode B={b_n}",
        "numkern_ms": nk * 1e3,
        "torch_ms": t["torch_loop"].median_s * 1e3,
        "vllm_ms": t["vllm"].median_s * 1e3 if "vllm" in t else vllm.na(),
        "x_torch": t["torch_loop"].median_s / nk,
        "x_vllm": t["vllm"].median_s / nk if "vllm" in t else vllm.na(),
        "state_GBps": moved / nk / 1e9 if claim else None,
        "of_stream": moved / nk / 1e9 / stream_gbs if claim else None,
        "max_rel_err": err,
        "others_cores": t["numkern"].other_cores,
    } | roof


def bench_prefill(t_n, *, vllm, timer_args, gen, fma_peak=None):
    from transformers.models.qwen3_next.modeling_qwen3_next import torch_chunk_gated_delta_rule

    q = torch.randn(1, t_n, HK, D, generator=gen).to(BF)
    k = torch.randn(1, t_n, HK, D, generator=gen).to(BF)
    v = torch.randn(1, t_n, HV, D, generator=gen).to(BF)
    g = -torch.rand(1, t_n, HV, generator=gen) * 0.2
    beta = torch.rand(1, t_n, HV, generator=gen).to(BF)
    cu = torch.tensor([0, t_n], dtype=torch.int32)
    slot = torch.tensor([0], dtype=torch.int32)
    pool = torch.zeros(1, HV, D, D)
    rep = HV // HK
    qr, kr = (x.repeat_interleave(rep, 2) for x in (q, k))  # transformers' GQA expansion

    def hf():
        return torch_chunk_gated_delta_rule(
            qr, kr, v, g, beta, initial_state=None, output_final_state=True,
            use_qk_l2norm_in_kernel=True,
        )  # fmt: skip

    def ours():
        pool.zero_()
        return R.chunk_gated_delta_rule(q, k, v, g, beta, pool, True, cu, False, True, slot)

    out, _ = ours()
    ref, _ = hf()
    err = float((out.float() - ref.float()).abs().max() / ref.float().abs().max())
    if not err < MAX_REL_ERR:
        raise RuntimeError(f"prefill T={t_n}: max rel err {err:.3g} against transformers")
    cases = {"numkern": ours, "torch_chunked": hf}
    if vllm.ok:
        op = torch.ops._C.chunk_gated_delta_rule_cpu
        vpool = torch.zeros(1, HV, D, D)
        cases["vllm"] = lambda: op(q, k, v, g, beta, vpool, True, cu, False, True, slot, 1e-5)
    t = harness.time_interleaved(cases, **timer_args)
    nk = t["numkern"].median_s
    # the roofline point at the recurrence's FLOPs (the chunked form does more); q, k, v
    # and beta (bf16), g (fp32) read, out (bf16) and the final state (fp32) written
    roof = harness.roofline(
        "gdn prefill",
        ("T", t_n),
        flop=t_n * RULE_FLOP_PER_TOKEN,
        nbytes=2 * t_n * (2 * HK + 2 * HV) * D + 6 * t_n * HV + STATE_BYTES,
        seconds=nk,
    )
    return {
        "case": f"prefill T={t_n}",
        "numkern_ms": nk * 1e3,
        "torch_ms": t["torch_chunked"].median_s * 1e3,
        "vllm_ms": t["vllm"].median_s * 1e3 if "vllm" in t else vllm.na(),
        "x_torch": t["torch_chunked"].median_s / nk,
        "x_vllm": t["vllm"].median_s / nk if "vllm" in t else vllm.na(),
        "tokens_per_s": t_n / nk,
        # the fp32 path's share of the FMA peak (at the recurrence's FLOPs: the chunked
        # form does ~1.25x more); none on the bf16 path (vdpbf16ps: twice the FMA rate)
        "of_fma_peak": harness.of_fma_peak(roof["roof_GFLOPs"], fma_peak, f"prefill T={t_n}")
        if fma_peak
        else None,
        "path": "bf16 (vdpbf16ps)" if R.DP_BF16 else "fp32",
        "max_rel_err": err,
        "others_cores": t["numkern"].other_cores,
    } | roof


def _small_row(case, t, err, vllm, torch_name="torch"):
    """A row of one of the small ops from its timings (ms columns like the others)."""
    nk = t["numkern"].median_s
    return {
        "case": case,
        "numkern_ms": nk * 1e3,
        "torch_ms": t[torch_name].median_s * 1e3,
        "vllm_ms": t["vllm"].median_s * 1e3 if "vllm" in t else vllm.na(),
        "x_torch": t[torch_name].median_s / nk,
        "x_vllm": t["vllm"].median_s / nk if "vllm" in t else vllm.na(),
        "max_rel_err": err,
        "others_cores": t["numkern"].other_cores,
    }


def _rel_err(out, ref):
    out, ref = out.float(), ref.float()
    return float((out - ref).abs().max() / ref.abs().max())


def _check(case, err):
    if not err < MAX_REL_ERR:
        raise RuntimeError(f"{case}: max rel err {err:.3g} against the torch reference")


def torch_conv_update(x, states, w, slots):
    """One token per request in plain torch: history then token, times the taps, SiLU;
    the history shifts left by one. ``states [S, dim, W-1]``, ``w [dim, W]``."""
    seq = torch.cat([states[slots].float(), x.float()[:, :, None]], 2)  # [B, dim, W]
    states[slots] = seq[:, :, 1:].to(states.dtype)
    return F.silu((seq * w.float()).sum(-1)).to(x.dtype)


def torch_conv_fwd(x, states, w, slot):
    """One request of T tokens in plain torch: F.conv1d over its history then its tokens,
    SiLU; the slot keeps the last W-1 inputs. ``x [dim, T]``."""
    seq = torch.cat([states[slot].float(), x.float()], 1)  # [dim, W-1+T]
    states[slot] = seq[:, -(WIDTH - 1) :].to(states.dtype)
    y = F.conv1d(seq[None], w.float()[:, None], groups=seq.shape[0])[0]
    return F.silu(y).to(x.dtype)


def _conv_bytes(tokens, requests, elem=2):
    """Bytes a conv call must move at CONV_DIM x WIDTH: x read and out written (tokens
    rows), the weight read, each request's WIDTH - 1 state columns read and written."""
    return elem * CONV_DIM * (2 * tokens + WIDTH + 2 * (WIDTH - 1) * requests)


def _conv_rate(row, moved, working_set, stream_gbs):
    """The conv row's bandwidth columns (see the module docstring)."""
    gbps = moved / (row["numkern_ms"] * 1e-3) / 1e9
    claim = harness.bandwidth_claimable(working_set)
    if claim:
        harness.check_bound(row["case"] + " GB/s", gbps, stream_gbs)
    return row | {
        "conv_GBps": gbps,
        "of_stream": gbps / stream_gbs if claim else None,
        "l3_resident": not claim,
    }


def bench_conv_update(b_n, *, vllm, timer_args, gen, packed=True, stream_gbs=None):
    x = torch.randn(b_n, CONV_DIM, generator=gen).to(BF)
    w = (torch.randn(CONV_DIM, WIDTH, generator=gen) * 0.5).to(BF)
    wk = CV.causal_conv1d_weight_pack(w) if packed else w
    states = torch.randn(4 * b_n, WIDTH - 1, CONV_DIM, generator=gen).to(BF).transpose(1, 2)
    slots = torch.arange(0, 4 * b_n, 4, dtype=torch.int32)
    ref_states = states.clone()
    out = CV.causal_conv1d_update(x, states, wk, None, True, slots, packed)
    ref = torch_conv_update(x, ref_states, w, slots.long())
    case = f"conv update B={b_n}" + ("" if packed else " plain weight")
    err = max(_rel_err(out, ref), _rel_err(states, ref_states))
    _check(case, err)
    cases = {
        "numkern": lambda: CV.causal_conv1d_update(x, states, wk, None, True, slots, packed),
        "torch": lambda: torch_conv_update(x, ref_states, w, slots.long()),
    }
    if vllm.ok and packed:
        op, vstates = torch.ops._C.causal_conv1d_update_cpu, states.clone()
        cases["vllm"] = lambda: op(x, vstates, wk, None, True, None, slots, -1, True)
    row = _small_row(case, harness.time_interleaved(cases, **timer_args), err, vllm)
    moved = _conv_bytes(b_n, b_n)
    return _conv_rate(row, moved, moved + states.numel() * 2, stream_gbs)


def bench_conv_fwd(t_n, *, vllm, timer_args, gen, stream_gbs=None):
    x = torch.randn(t_n, CONV_DIM, generator=gen).to(BF).t()  # vLLM's [dim, T] view
    w = (torch.randn(CONV_DIM, WIDTH, generator=gen) * 0.5).to(BF)
    wk = CV.causal_conv1d_weight_pack(w)
    states = torch.randn(2, WIDTH - 1, CONV_DIM, generator=gen).to(BF).transpose(1, 2)
    qsl, slot = torch.tensor([0, t_n], dtype=torch.int32), torch.tensor([1], dtype=torch.int32)
    init = torch.tensor([True])
    ref_states = states.clone()
    out = CV.causal_conv1d_fwd(x, wk, None, states, qsl, slot, init, True, True)
    ref = torch_conv_fwd(x, ref_states, w, 1)
    err = max(_rel_err(out, ref), _rel_err(states, ref_states))
    case = f"conv fwd T={t_n}"
    _check(case, err)
    # copies of x past the L3 where one chunk is big enough for a claimable share
    x_bytes = x.numel() * 2
    n_copies = 1 + harness.L3_BYTES // x_bytes if x_bytes >= (1 << 22) else 1
    xs = harness.Rotation([x] + [x.t().clone().t() for _ in range(n_copies - 1)], x_bytes)
    fwd = CV.causal_conv1d_fwd
    cases = {
        "numkern": lambda: fwd(xs(), wk, None, states, qsl, slot, init, True, True),
        "torch": lambda: torch_conv_fwd(xs(), ref_states, w, 1),
    }
    if vllm.ok:
        op, vstates = torch.ops._C.causal_conv1d_fwd_cpu, states.clone()
        cases["vllm"] = lambda: op(xs(), wk, None, vstates, qsl, slot, init, True, -1, True)
    row = _small_row(case, harness.time_interleaved(cases, **timer_args), err, vllm)
    moved = _conv_bytes(t_n, 1)
    return _conv_rate(row, moved, n_copies * x_bytes + moved, stream_gbs)


def torch_gating(A_log, a, b, dt_bias):
    g = -A_log.float().exp() * F.softplus(a.float() + dt_bias.float())
    return g[None], torch.sigmoid(b.float()).to(b.dtype)[None]


def bench_gating(t_n, *, vllm, timer_args, gen):
    A_log = torch.randn(HV, generator=gen) * 0.5
    dt_bias = torch.randn(HV, generator=gen).to(BF)
    ab = (torch.randn(t_n, 2 * HV, generator=gen) * 4).to(BF)  # a and b: column windows
    a, b = ab[:, :HV], ab[:, HV:]
    g, beta = GT.fused_gdn_gating(A_log, a, b, dt_bias)
    g_ref, beta_ref = torch_gating(A_log, a, b, dt_bias)
    err = max(_rel_err(g, g_ref), _rel_err(beta, beta_ref))
    case = f"gating T={t_n}"
    _check(case, err)
    cases = {
        "numkern": lambda: GT.fused_gdn_gating(A_log, a, b, dt_bias),
        "torch": lambda: torch_gating(A_log, a, b, dt_bias),
    }
    if vllm.ok:
        op, ac, bc = torch.ops._C.fused_gdn_gating_cpu, a.contiguous(), b.contiguous()
        cases["vllm"] = lambda: op(A_log, ac, bc, dt_bias)  # vLLM's takes contiguous a, b
    return _small_row(case, harness.time_interleaved(cases, **timer_args), err, vllm)


def torch_rms_norm_gated(x, z, weight):
    """transformers' Qwen3NextRMSNormGated.forward."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + NORM_EPS)
    h = weight * h.to(x.dtype)
    return (h * F.silu(z.float())).to(x.dtype)


def bench_norm(t_n, *, vllm, timer_args, gen):
    x = torch.randn(t_n, HV, D, generator=gen).to(BF)
    proj = torch.randn(t_n, 2 * HV * D + 2 * HV, generator=gen).to(BF)
    z = proj[:, HV * D : 2 * HV * D].unflatten(1, (HV, D))  # a column window, as the engine's
    weight = (torch.randn(D, generator=gen) * 0.5 + 1).to(BF)
    out = NM.rms_norm_gated(x, z, weight, NORM_EPS)
    err = _rel_err(out, torch_rms_norm_gated(x, z, weight))
    case = f"rms_norm_gated T={t_n}"
    _check(case, err)
    cases = {
        "numkern": lambda: NM.rms_norm_gated(x, z, weight, NORM_EPS),
        "torch": lambda: torch_rms_norm_gated(x, z, weight),
    }
    return _small_row(case, harness.time_interleaved(cases, **timer_args), err, vllm)


def main(argv=None):
    bench = harness.start(
        "bench_gdn",
        argv,
        description=__doc__.splitlines()[0],
        quick_help="fewer cases",
        flags=(("--conv-only", "only the conv and gating rows"),),
    )
    timer_args = bench.timer(rounds=(5, 15), max_seconds=(1.0, 3.0))
    vllm = bench.vllm_peer("GDN ops (native build)", VLLM_PROBE)
    gen = torch.Generator().manual_seed(0)
    rows = []
    conv_only = bench.args.conv_only
    for b_n in () if conv_only else QUICK_DECODE_B if bench.quick else DECODE_B:
        rows.append(
            bench_decode(
                b_n, vllm=vllm, stream_gbs=bench.stream_before, timer_args=timer_args, gen=gen
            )
        )
        print(f"  {rows[-1]['case']}: numkern {rows[-1]['numkern_ms']:.3f} ms", flush=True)
    prefill_t = () if conv_only else QUICK_PREFILL_T if bench.quick else PREFILL_T
    # the fp32 path's ceiling (measured only where a prefill row runs on it)
    peak = None if R.DP_BF16 or not prefill_t else harness.fma_peak()
    for t_n in prefill_t:
        rows.append(bench_prefill(t_n, vllm=vllm, timer_args=timer_args, gen=gen, fma_peak=peak))
        print(f"  {rows[-1]['case']}: numkern {rows[-1]['numkern_ms']:.3f} ms", flush=True)
    small = timer_args | {"min_sample_s": 5e-3}  # many calls a sample: a few us each
    bw = {"stream_gbs": bench.stream_before}
    small_cases = [(bench_conv_update, b_n, bw) for b_n in CONV_B]
    small_cases += [(bench_conv_update, 1, bw | {"packed": False})]
    small_cases += [(bench_conv_fwd, t_n, bw) for t_n in CONV_T]
    small_ops = (bench_gating,) if conv_only else (bench_gating, bench_norm)
    small_cases += [(f, t_n, {}) for f in small_ops for t_n in SMALL_T]
    for fn, n, kw in small_cases:
        rows.append(fn(n, vllm=vllm, timer_args=small, gen=gen, **kw))
        print(f"  {rows[-1]['case']}: numkern {rows[-1]['numkern_ms'] * 1e3:.1f} us", flush=True)
    cols = ["case", "numkern_ms", "torch_ms", "vllm_ms", "x_torch", "x_vllm"]
    cols += ["state_GBps", "conv_GBps", "of_stream", "l3_resident", "tokens_per_s"]
    cols += ["of_fma_peak", "path", "others_cores"]
    bench.finish(rows, columns=cols, extra={"cpu_model": harness.cpu_model()})


if __name__ == "__main__":
    main()
