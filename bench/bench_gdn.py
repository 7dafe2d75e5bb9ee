"""Benchmark numkern's gated delta rule (Gated DeltaNet) against a torch loop and vLLM.

    python bench/bench_gdn.py            # decode B in {1, 8, 32}, prefill T in {512, 2048}
    python bench/bench_gdn.py --quick    # decode B in {1, 8}, prefill T = 512

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

Ratios are peer time / numkern time (> 1: numkern faster). numkern's outputs are checked
against the torch references.
"""

import harness
import torch
import torch.nn.functional as F

from numkern.gdn import rule as R

HK, HV, D = 16, 32, 128
BF = torch.bfloat16
DECODE_B = (1, 8, 32)
QUICK_DECODE_B = (1, 8)
PREFILL_T = (512, 2048)
QUICK_PREFILL_T = (512,)
STATE_BYTES = HV * D * D * 4  # one request's fp32 state
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
    }


def bench_prefill(t_n, *, vllm, timer_args, gen):
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
    return {
        "case": f"prefill T={t_n}",
        "numkern_ms": nk * 1e3,
        "torch_ms": t["torch_chunked"].median_s * 1e3,
        "vllm_ms": t["vllm"].median_s * 1e3 if "vllm" in t else vllm.na(),
        "x_torch": t["torch_chunked"].median_s / nk,
        "x_vllm": t["vllm"].median_s / nk if "vllm" in t else vllm.na(),
        "tokens_per_s": t_n / nk,
        "max_rel_err": err,
        "others_cores": t["numkern"].other_cores,
    }


def main(argv=None):
    bench = harness.start(
        "bench_gdn", argv, description=__doc__.splitlines()[0], quick_help="fewer cases"
    )
    timer_args = bench.timer(rounds=(5, 15), max_seconds=(1.0, 3.0))
    vllm = bench.vllm_peer("GDN delta rule ops (native build)", VLLM_PROBE)
    gen = torch.Generator().manual_seed(0)
    rows = []
    for b_n in QUICK_DECODE_B if bench.quick else DECODE_B:
        rows.append(
            bench_decode(
                b_n, vllm=vllm, stream_gbs=bench.stream_before, timer_args=timer_args, gen=gen
            )
        )
        print(f"  {rows[-1]['case']}: numkern {rows[-1]['numkern_ms']:.3f} ms", flush=True)
    for t_n in QUICK_PREFILL_T if bench.quick else PREFILL_T:
        rows.append(bench_prefill(t_n, vllm=vllm, timer_args=timer_args, gen=gen))
        print(f"  {rows[-1]['case']}: numkern {rows[-1]['numkern_ms']:.3f} ms", flush=True)
    cols = ["case", "numkern_ms", "torch_ms", "vllm_ms", "x_torch", "x_vllm"]
    cols += ["state_GBps", "of_stream", "tokens_per_s", "others_cores"]
    bench.finish(rows, columns=cols)


if __name__ == "__main__":
    main()
