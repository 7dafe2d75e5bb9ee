"""Benchmark numkern's fused MoE against a per-expert torch loop and vLLM's CPU op.

    python bench/bench_moe.py            # 2 shapes x T in {1, 32, 512}, 2-4 minutes
    python bench/bench_moe.py --quick    # Qwen3 shape, T in {1, 32}, a smoke run
    python bench/bench_moe.py --mxfp4    # only GPT-OSS-20B's experts, MXFP4 vs bf16, T=1
    python bench/bench_moe.py --t1       # T=1 vs vLLM's vec op: the issue-30 figures
    python bench/bench_moe.py --t1 --masked   # and again with AVX-512 masked (vs _C_AVX2)
    python bench/bench_moe.py --prefill  # Qwen3 shape, T in {256, 1024}, 9 rounds (issue 39)

``--t1`` (``bench_t1``): per shape, numkern's vec ``fused_moe`` and vLLM's ``cpu_fused_moe``
(vec) at T = 1 in interleaved rounds (21 quick, 41 full; ``--rounds``, at least 9) of one
pass each over all E/k disjoint routings (every expert once: the working set is all
experts, past the L3) and one stream pass. Per round: the pair's ratio (``x_vllm_vec`` =
vLLM time / numkern time) and each side's bytes per second over that round's stream pass;
the row has the medians (and ranges), ``per_pair`` in the JSON every round. Both sides'
packed weights are on the same page kind, transparent huge pages by default (numkern's
``huge_empty``; ``--small-pages``: 4 KB pages, torch's allocation) and the row reports the
fraction /proc/self/smaps finds in huge pages for each side and for the stream's array.

Shapes (bf16, weights ~N(0, 1/fan_in)): Qwen3-30B-A3B-like (E=128, k=8, H=2048, I=768,
silu, no biases) and GPT-OSS-20B-like (E=32, k=4, H=2880, I=2880, swigluoai, biases
``w13_bias [E, 2I]`` and ``w2_bias [E, H]`` in bf16). Routing: ``moe.topk_softmax`` of
fp32 logits, renormalized.

Cases per (shape, T): numkern ``fused_moe`` into a preallocated output, on weights packed
for ``isa="vec"`` and for ``isa="amx"`` (amx is only a weight layout in numkern today, its
compute is AVX-512); a per-expert torch loop on unpacked bf16 weights, as a plain PyTorch
MoE block runs; vLLM's ``cpu_fused_moe`` (``harness.vllm_library``: the build vLLM loads
on a CPU with the features numkern sees, ``_C_AVX2`` under an AVX-512 mask) for isa vec and amx,
each where its probe passes; where numkern's call takes the ``dpbf16`` path
(``vdpbf16ps``: AVX512-BF16) or ``fma256`` (no AVX-512: fp32 panels, 6x16 and 4x16
tiles), with enough rows per expert, its 8x32 widening path forced (``widen_vec``).
Ratios are peer time / numkern vec time (> 1: numkern faster); numkern's outputs are
checked against the torch loop. The header has the fp32 FMA peak of this run's cores
(``harness.fma_peak``, before and after the cases).

At T = 1 a call reads only the chosen experts' weights, so their bytes per second are
compared with the stream bandwidth, timed as one more case interleaved with those calls
(``harness.stream_reader``: the VM's bandwidth drifts too much for a figure measured
before or after). Each of those calls gets
another routing from a rotation whose expert sets are disjoint: one weight copy, but the
calls together read a working set past the L3 (at most all E experts, ~1.2 GB for the
Qwen3 shape, ~1.6 GB for GPT-OSS).

MXFP4 (a full run's last row, or ``--mxfp4`` alone): GPT-OSS-20B's experts as published,
MXFP4 (``numkern.quant.repack_mxfp4`` of random E2M1 codes with E8M0 scales 2^-9..2^-6)
against the same experts dequantised to bf16 (exact: every MXFP4 value is a bf16 one),
both through ``moe.fused_moe`` at T = 1 (the MXFP4 call on this CPU's int8 path) on the
disjoint routings above, with the stream pass interleaved. The bytes a call reads: k
experts' weights and biases (bf16 biases for bf16, fp32 for MXFP4, as the engine keeps
them): 3.76x fewer in MXFP4 (0.53 bytes a weight against 2).
"""

import gc
import math
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass

import harness
import torch
import torch.nn.functional as F

import numkern
from numkern import moe, quant


@dataclass(frozen=True)
class Shape:
    name: str
    experts: int  # E
    topk: int  # k
    hidden: int  # H
    inter: int  # I
    activation: str
    bias: bool


SHAPES = (
    Shape("qwen3-30b-a3b", 128, 8, 2048, 768, "silu", False),
    Shape("gpt-oss-20b", 32, 4, 2880, 2880, "swigluoai", True),
)
TS = (1, 32, 512)  # decode, small batch, prefill chunk
QUICK_TS = (1, 32)
PREFILL_TS = (256, 1024)  # --prefill: 16 and 64 rows an expert (Qwen3 shape), AMX tiles
PREFILL_ROUNDS = 9
DTYPE = torch.bfloat16
# The torch loop rounds gate_up, the activation and y to bf16 (2**-8 relative each);
# numkern keeps gate_up and y in fp32: 2e-2 of max |ref| holds both with margin.
MAX_REL_ERR = 2e-2
# Biases are small next to the O(1) pre-activations, as in trained models.
BIAS_SCALE = 0.1
# Logit lead given to the chosen experts of a rotated T = 1 routing: the other logits are
# N(0, 0.1^2), so 4 keeps every chosen expert in the top k with certainty.
ROTATION_LOGIT_LEAD = 4.0
# A T = 512 call takes 0.3-4 s: the OpenMP spin the settling call absorbs (a few ms) is
# noise there, and dropping it halves the run time of those rows.
SETTLE_MAX_T = 32

# Run in a child after loading vLLM's native build: both benchmarked configurations.
VLLM_PROBE = """
T, E, k, H, I = 3, 8, 2, 128, 128
dt = torch.bfloat16
x = torch.randn(T, H).to(dt)
w13 = torch.randn(E, 2 * I, H).to(dt) / H**0.5; w2 = torch.randn(E, H, I).to(dt) / I**0.5
b13 = torch.randn(E, 2 * I).to(dt); b2 = torch.randn(E, H).to(dt)
p13 = torch.empty_like(w13); p2 = torch.empty_like(w2)
torch.ops._C.prepack_moe_weight(w13, p13, "{isa}"); torch.ops._C.prepack_moe_weight(w2, p2, "{isa}")
ti = torch.randint(0, E, (T, k), dtype=torch.int32); tw = torch.rand(T, k)
for act, bias in (("silu", False), ("swigluoai", True)):
    out = torch.empty(T, H, dtype=dt)
    torch.ops._C.cpu_fused_moe(out, x, p13, p2, b13 if bias else None, b2 if bias else None,
                               tw, ti, False, act, "{isa}")
    if not torch.isfinite(out.float()).all():
        raise SystemExit(f"non-finite output for {{act}}")
"""
VLLM_ISAS = ("vec", "amx")

COLUMNS = [
    "case", "nk_vec_first_s", "nk_amx_first_s", "numkern_vec_ms", "numkern_amx_ms",
    "torch_loop_ms", "vllm_vec_ms", "vllm_amx_ms", "x_numkern_amx", "x_torch_loop",
    "x_vllm_vec", "x_vllm_amx", "widen_vec_ms", "x_widen_vec", "max_rel_err_vec",
    "max_rel_err_amx", "weight_GBps",
    "of_stream", "stream_GBps", "amx_GBps", "vllm_vec_GBps", "vllm_vec_of_stream", "vllm_amx_GBps",
    "bandwidth_note", "touched_GBps", "touched_of_stream", "vllm_touched_of_stream",
    "others_cores",
]  # fmt: skip


# ---------------------------------------------------------------------------------------
# inputs


def _weights(shape, gen):
    """``w13 [E, 2I, H]``, ``w2 [E, H, I]`` bf16 ~N(0, 1/fan_in) and biases (or None),
    drawn one expert at a time so no fp32 copy of a whole weight is ever held."""
    e_n, h, i_n = shape.experts, shape.hidden, shape.inter
    w13 = torch.empty(e_n, 2 * i_n, h, dtype=DTYPE)
    w2 = torch.empty(e_n, h, i_n, dtype=DTYPE)
    for e in range(e_n):
        w13[e] = torch.randn(2 * i_n, h, generator=gen) / math.sqrt(h)
        w2[e] = torch.randn(h, i_n, generator=gen) / math.sqrt(i_n)
    b13 = b2 = None
    if shape.bias:
        b13 = (torch.randn(e_n, 2 * i_n, generator=gen) * BIAS_SCALE).to(DTYPE)
        b2 = (torch.randn(e_n, h, generator=gen) * BIAS_SCALE).to(DTYPE)
    return w13, w2, b13, b2


def _vllm_prepack(weight, isa):
    packed = torch.empty_like(weight)
    torch.ops._C.prepack_moe_weight(weight, packed, isa)
    return packed


def _expert_bytes(shape):
    """Bytes one expert's weights and biases occupy (all that a T = 1 call reads of it)."""
    h, i_n = shape.hidden, shape.inter
    n = 3 * i_n * h + (2 * i_n + h if shape.bias else 0)
    return n * torch.finfo(DTYPE).bits // 8


class _DisjointRoutings:
    """Each call returns a T = 1 routing ``(tw, ti, tw_vllm, ti_vllm)`` whose k experts
    no earlier call chose (the vLLM pair: its own tensors, equal to the first)."""

    def __init__(self, shape, gen):
        self.shape = shape
        self.gen = gen
        self.order = torch.randperm(shape.experts, generator=gen)
        self.used = 0

    def __call__(self):
        e_n, k = self.shape.experts, self.shape.topk
        if self.used + k > e_n:
            raise ValueError(f"rotation: only {e_n // k} disjoint routings of k={k} in E={e_n}")
        logits = torch.randn(1, e_n, generator=self.gen) * 0.1
        logits[0, self.order[self.used : self.used + k]] += ROTATION_LOGIT_LEAD
        self.used += k
        tw, ti = moe.topk_softmax(logits, k, True)
        return tw, ti, tw.clone(), ti.clone()


# ---------------------------------------------------------------------------------------
# the torch peer


def torch_moe(x, w13, w2, b13, b2, tw, ti, activation):
    """A per-expert MoE block in plain PyTorch (bf16 weights as loaded, no packing)."""
    t_n, k = ti.shape
    flat = ti.reshape(-1).long()  # [T*k]
    order = torch.argsort(flat, stable=True)  # slots grouped by expert, tokens in order
    tokens = order // k
    weights = tw.reshape(-1)[order]
    counts = torch.bincount(flat, minlength=w13.shape[0]).tolist()
    acc = torch.zeros(t_n, x.shape[1], dtype=torch.float32)  # [T, H]
    start = 0
    for e, n in enumerate(counts):
        if n == 0:
            continue
        idx = tokens[start : start + n]
        wgt = weights[start : start + n]
        start += n
        gu = F.linear(x[idx], w13[e], None if b13 is None else b13[e])  # [n, 2I]
        if activation == "silu":
            g, u = gu.chunk(2, dim=-1)
            act = F.silu(g) * u
        else:  # swigluoai: gate and up rows interleave
            g = gu[:, 0::2].clamp(max=7.0)
            u = gu[:, 1::2].clamp(-7.0, 7.0)
            act = (u + 1) * g * torch.sigmoid(1.702 * g)
        y = F.linear(act, w2[e], None if b2 is None else b2[e])  # [n, H]
        acc.index_add_(0, idx, y.float() * wgt[:, None])
    return acc.to(x.dtype)


def _rel_err(got, ref):
    ref = ref.float()
    return float((got.float() - ref).abs().max() / ref.abs().max())


# ---------------------------------------------------------------------------------------
# one shape


@dataclass
class _Setup:
    """One shape's weights: unpacked for the torch loop, packed per isa for each kernel."""

    shape: Shape
    w13: torch.Tensor  # [E, 2I, H] bf16
    w2: torch.Tensor  # [E, H, I] bf16
    b13: torch.Tensor | None  # [E, 2I] bf16
    b2: torch.Tensor | None  # [E, H] bf16
    numkern: dict  # isa -> (w13, w2) packed by numkern
    vllm: dict  # isa -> (w13, w2) packed by vLLM, for the isas whose probe passed


def _cases(s, x, tw, ti, outs, ref, rotation, stream):
    """The timed callables of one (shape, T). ``outs``: an output per kernel case;
    ``ref``: receives the torch loop's output; ``rotation``: T = 1 routings or None;
    ``stream``: a stream pass (T = 1) or None."""
    act = s.shape.activation
    tw_v, ti_v = tw.clone(), ti.clone()  # vLLM gets routing tensors of its own

    def numkern(isa, tw=tw, ti=ti):
        moe.fused_moe(outs[f"numkern_{isa}"], x, *s.numkern[isa], s.b13, s.b2, tw, ti,
                      activation=act, isa=isa)  # fmt: skip

    def vllm(isa, tw=tw_v, ti=ti_v):
        torch.ops._C.cpu_fused_moe(outs[f"vllm_{isa}"], x, *s.vllm[isa], s.b13, s.b2, tw, ti,
                                   False, act, isa)  # fmt: skip

    def widen():  # numkern's widening path (8x32 tiles) where the call's own differs
        moe.fused_moe(outs["widen_vec"], x, *s.numkern["vec"], s.b13, s.b2, tw, ti,
                      activation=act, isa="vec", path="widen")  # fmt: skip

    def torch_loop():
        ref["out"] = torch_moe(x, s.w13, s.w2, s.b13, s.b2, tw, ti, act)

    def rotated_numkern(isa):
        r_tw, r_ti, _, _ = rotation()
        numkern(isa, r_tw, r_ti)

    def rotated_vllm(isa):
        _, _, r_tw, r_ti = rotation()
        vllm(isa, r_tw, r_ti)

    cases = {
        "numkern_vec": lambda: numkern("vec"),
        "numkern_amx": lambda: numkern("amx"),
        "torch_loop": torch_loop,
    }
    for isa in s.vllm:
        cases[f"vllm_{isa}"] = lambda isa=isa: vllm(isa)
    if "widen_vec" in outs:
        cases["widen_vec"] = widen
    if stream is not None:
        cases["stream"] = stream
    if rotation is not None:
        for isa in s.numkern:
            cases[f"rot_numkern_{isa}"] = lambda isa=isa: rotated_numkern(isa)
        for isa in s.vllm:
            cases[f"rot_vllm_{isa}"] = lambda isa=isa: rotated_vllm(isa)
    # the fixed routing's outputs, for the check (rotated cases overwrite them)
    fixed = [cases[name] for name in outs]
    return cases, fixed


def _bandwidth(row, t, rotation, per_call, stream_bytes):
    """T = 1 bytes per second of the rotated cases, and their fraction of the interleaved
    stream pass's, into ``row`` (where claimable)."""
    stream_gbs = stream_bytes / t["stream"].median_s / 1e9
    row["stream_GBps"] = stream_gbs
    row["bytes_per_call_MB"] = per_call / 1e6
    row["working_set_MB"] = rotation.working_set_bytes / 1e6
    row["routings"] = len(rotation)
    if not rotation.claimable:
        row["bandwidth_note"] = (
            f"not claimable: working set {rotation.working_set_bytes / 1e6:.0f} MB "
            f"<= {harness.L3_BYTES / 1e6:.0f} MB"
        )
        return
    columns = {"rot_numkern_vec": "weight", "rot_numkern_amx": "amx",
               "rot_vllm_vec": "vllm_vec", "rot_vllm_amx": "vllm_amx"}  # fmt: skip
    for name, col in columns.items():
        if name in t:
            gbs = per_call / t[name].median_s / 1e9
            row[f"{col}_GBps"] = gbs
            row[f"{col}_of_stream"] = gbs / stream_gbs
    row["of_stream"] = row.pop("weight_of_stream")
    row["bandwidth_note"] = (
        f"{len(rotation)} disjoint routings, {rotation.working_set_bytes / 1e6:.0f} MB"
    )


def _bench_t(s, t_n, gen, *, na, timer_args, stream_gbs):
    """The row of one (shape, T). ``na``: table cells of the vLLM cases that cannot run."""
    shape = s.shape
    e_n, k, h = shape.experts, shape.topk, shape.hidden
    x = torch.randn(t_n, h, generator=gen).to(DTYPE)  # [T, H]
    tw, ti = moe.topk_softmax(torch.randn(t_n, e_n, generator=gen), k, True)  # [T, k]
    names = [f"numkern_{isa}" for isa in s.numkern] + [f"vllm_{isa}" for isa in s.vllm]
    path = numkern.isa.gemm_path()[0]  # the call takes dpbf16 or fma256: time widen too
    if path != "widen" and t_n * k >= numkern.isa.GEMM[path].moe_min_rows * e_n:
        names.append("widen_vec")
    outs = {name: torch.empty(t_n, h, dtype=DTYPE) for name in names}
    ref = {}
    per_call = k * _expert_bytes(shape)  # at T = 1: the top-k experts are distinct
    rotation = stream = None
    if t_n == 1:
        # half the harness default: still 16x this machine's 33 MB L3 and past the 300 MB
        # bound, and it keeps the GPT-OSS peak (five weight copies, 8 GB) under 9 GiB
        stream, stream_bytes = harness.stream_reader(harness.WORKING_SET_BYTES // 2)
        rotation = harness.rotating(
            _DisjointRoutings(shape, gen),
            min(harness.WORKING_SET_BYTES, (e_n // k) * per_call),
            per_call,
        )
    cases, fixed = _cases(s, x, tw, ti, outs, ref, rotation, stream)
    t = harness.time_interleaved(cases, settle=t_n <= SETTLE_MAX_T, **timer_args)

    for call in fixed:
        call()
    errors = {name: _rel_err(out, ref["out"]) for name, out in outs.items()}
    for name in outs:
        if name.startswith(("numkern", "widen")) and not errors[name] < MAX_REL_ERR:
            raise RuntimeError(
                f"{name} {shape.name} T={t_n}: max rel err {errors[name]:.3g} vs the torch "
                f"loop (bound {MAX_REL_ERR})"
            )

    vec_s = t["numkern_vec"].median_s
    row = {
        "case": f"{shape.name} T={t_n}",
        "shape": shape.name,
        "T": t_n,
        "E": e_n,
        "k": k,
        "H": h,
        "I": shape.inter,
        "activation": shape.activation,
        "bias": shape.bias,
        "nk_vec_first_s": t["numkern_vec"].first_s,
        "nk_amx_first_s": t["numkern_amx"].first_s,
    }
    for name in ("numkern_vec", "numkern_amx", "torch_loop", "vllm_vec", "vllm_amx"):
        row[f"{name}_ms"] = t[name].median_s * 1e3 if name in t else na[name]
    for name in ("numkern_amx", "torch_loop", "vllm_vec", "vllm_amx"):
        row[f"x_{name}"] = t[name].median_s / vec_s if name in t else na[name]
    if "widen_vec" in t:
        row["widen_vec_ms"] = t["widen_vec"].median_s * 1e3
        row["x_widen_vec"] = t["widen_vec"].median_s / vec_s
    for name, err in errors.items():
        row[f"max_rel_err_{name.removeprefix('numkern_')}"] = err
    row |= {"weight_GBps": None, "of_stream": None, "vllm_vec_GBps": None,
            "vllm_amx_GBps": None, "bandwidth_note": ""}  # fmt: skip
    row["others_cores"] = t["numkern_vec"].other_cores
    if rotation is not None:
        _bandwidth(row, t, rotation, per_call, stream_bytes)
    else:  # the same routing each call: the touched experts' bytes, past the L3 or not
        touched = len(torch.unique(ti)) * _expert_bytes(shape)
        row["touched_MB"] = touched / 1e6
        if harness.bandwidth_claimable(touched):
            row["touched_GBps"] = touched / vec_s / 1e9
            row["touched_of_stream"] = row["touched_GBps"] / stream_gbs
            if "vllm_vec" in t:
                row["vllm_touched_of_stream"] = touched / t["vllm_vec"].median_s / 1e9 / stream_gbs
    # the roofline point: the experts the routing chose (each read once), x read and the
    # output written; at T=1 the rotated time where claimable (the experts from DRAM)
    claimed = rotation is not None and rotation.claimable
    row |= harness.roofline(
        f"fused_moe {shape.name}",
        ("T", t_n),
        flop=2 * t_n * k * 3 * h * shape.inter,  # gate_up [2I, H] and down [H, I] per slot
        nbytes=len(torch.unique(ti)) * _expert_bytes(shape) + 2 * 2 * t_n * h,
        seconds=t["rot_numkern_vec"].median_s if claimed else vec_s,
    )
    for name, timing in t.items():
        row[f"{name}_first_s"] = timing.first_s
        row[f"{name}_min_ms"] = timing.min_s * 1e3
        row[f"{name}_samples"] = timing.samples
        row[f"{name}_calls_per_sample"] = timing.calls_per_sample
    print(f"  {row['case']}: " + ", ".join(
        f"{name} {t[name].median_s * 1e3:.2f} ms" for name in t), flush=True)  # fmt: skip
    return row


def bench_shape(shape, ts, *, vllm, timer_args, stream_gbs):
    """Rows for one shape, one per T; its weight copies are garbage once this returns.

    ``vllm``: isa -> :class:`numkern.testing.vllm.Availability` of vLLM's op for that isa.
    """
    gen = torch.Generator().manual_seed(0)
    w13, w2, b13, b2 = _weights(shape, gen)
    s = _Setup(
        shape, w13, w2, b13, b2,
        numkern={isa: (moe.prepack_moe_weight(w13, isa), moe.prepack_moe_weight(w2, isa))
                 for isa in ("vec", "amx")},
        vllm={isa: (_vllm_prepack(w13, isa), _vllm_prepack(w2, isa))
              for isa, avail in vllm.items() if avail.ok},
    )  # fmt: skip
    na = {f"vllm_{isa}": avail.na() for isa, avail in vllm.items() if not avail.ok}
    return [
        _bench_t(s, t_n, gen, na=na, timer_args=timer_args, stream_gbs=stream_gbs) for t_n in ts
    ]


# ---------------------------------------------------------------------------------------
# MXFP4 experts (GPT-OSS as published) against bf16 experts at T = 1

MXFP4_SCALES = (118, 122)  # E8M0 scales drawn in [118, 122): 2^-9 .. 2^-6 times E2M1


def _mxfp4_experts(e_n, n, k, gen):
    """Random MXFP4 experts ``[E, N, K]`` in the safetensors form, repacked, and the same
    values in bf16 (dequantised one expert at a time: no fp32 copy of the whole)."""
    blocks = torch.randint(0, 256, (e_n, n, k // 32, 16), dtype=torch.uint8, generator=gen)
    scales = torch.randint(*MXFP4_SCALES, (e_n, n, k // 32), dtype=torch.uint8, generator=gen)
    dense = torch.empty(e_n, n, k, dtype=DTYPE)
    for e in range(e_n):
        dense[e] = quant.dequantize(quant.repack_mxfp4(blocks[e], scales[e]), dtype=DTYPE)
    return quant.repack_mxfp4(blocks, scales), dense


def bench_mxfp4(timer_args):
    """One row: GPT-OSS-20B's experts at T = 1, MXFP4 against bf16 (module docstring)."""
    shape = SHAPES[1]
    e_n, k, h, i_n = shape.experts, shape.topk, shape.hidden, shape.inter
    gen = torch.Generator().manual_seed(1)
    q13, w13 = _mxfp4_experts(e_n, 2 * i_n, h, gen)
    p13 = moe.prepack_moe_weight(w13, "vec")
    del w13
    q2, w2 = _mxfp4_experts(e_n, h, i_n, gen)
    p2 = moe.prepack_moe_weight(w2, "vec")
    del w2
    b13 = (torch.randn(e_n, 2 * i_n, generator=gen) * BIAS_SCALE).to(DTYPE)
    b2 = (torch.randn(e_n, h, generator=gen) * BIAS_SCALE).to(DTYPE)
    f13, f2 = b13.float(), b2.float()  # the engine's MXFP4 layer keeps fp32 biases
    bf16_bytes = k * _expert_bytes(shape)
    mx_bytes = k * (q13.nbytes + q2.nbytes + 4 * (2 * i_n + h))
    x = torch.randn(1, h, generator=gen).to(DTYPE)
    out_bf16, out_mx = torch.empty_like(x), torch.empty_like(x)
    stream, stream_bytes = harness.stream_reader(harness.WORKING_SET_BYTES // 2)
    routes = _DisjointRoutings(shape, gen)
    rotation = [routes()[:2] for _ in range(e_n // k)]  # every expert, each once
    nxt = {"bf16": 0, "mxfp4": 0}

    def call(which):
        tw, ti = rotation[nxt[which] % len(rotation)]
        nxt[which] += 1
        if which == "bf16":
            moe.fused_moe(out_bf16, x, p13, p2, b13, b2, tw, ti, activation="swigluoai",
                          isa="vec")  # fmt: skip
        else:
            moe.fused_moe(out_mx, x, q13, q2, f13, f2, tw, ti, activation="swigluoai")

    cases = {"bf16": lambda: call("bf16"), "mxfp4": lambda: call("mxfp4"), "stream": stream}
    t = harness.time_interleaved(cases, **timer_args)
    tw, ti = rotation[0]  # the same routing for both: the check
    moe.fused_moe(out_bf16, x, p13, p2, b13, b2, tw, ti, activation="swigluoai", isa="vec")
    moe.fused_moe(out_mx, x, q13, q2, f13, f2, tw, ti, activation="swigluoai")
    err = _rel_err(out_mx, out_bf16)
    if not err < MAX_REL_ERR:
        raise RuntimeError(f"MXFP4 vs bf16 experts: max rel err {err:.3g} (bound {MAX_REL_ERR})")
    stream_gbs = stream_bytes / t["stream"].median_s / 1e9
    bf16_s, mx_s = t["bf16"].median_s, t["mxfp4"].median_s
    row = {
        "case": f"{shape.name} T=1 MXFP4 vs bf16 experts",
        "shape": shape.name,
        "T": 1,
        "bf16_ms": bf16_s * 1e3,
        "mxfp4_ms": mx_s * 1e3,
        "x_mxfp4": bf16_s / mx_s,
        "bytes_ratio": bf16_bytes / mx_bytes,
        "bf16_GBps": bf16_bytes / bf16_s / 1e9,
        "mxfp4_GBps": mx_bytes / mx_s / 1e9,
        "stream_GBps": stream_gbs,
        "bf16_of_stream": bf16_bytes / bf16_s / 1e9 / stream_gbs,
        "mxfp4_of_stream": mx_bytes / mx_s / 1e9 / stream_gbs,
        "mxfp4_path": numkern.isa.quant_path()[0],
        "mxfp4_first_s": t["mxfp4"].first_s,
        "max_rel_err_mxfp4": err,
        "working_set_MB": e_n * (q13.nbytes + q2.nbytes) / 1e6,
        "others_cores": t["mxfp4"].other_cores,
    }
    print(f"  {row['case']}: bf16 {row['bf16_ms']:.2f} ms, MXFP4 {row['mxfp4_ms']:.2f} ms "
          f"({row['x_mxfp4']:.2f}x, bytes {row['bytes_ratio']:.2f}x; of stream: bf16 "
          f"{row['bf16_of_stream']:.2f}, MXFP4 {row['mxfp4_of_stream']:.2f})",
          flush=True)  # fmt: skip
    return row


MXFP4_COLUMNS = [
    "case", "bf16_ms", "mxfp4_ms", "x_mxfp4", "bytes_ratio", "bf16_GBps", "mxfp4_GBps",
    "stream_GBps", "bf16_of_stream", "mxfp4_of_stream", "mxfp4_path", "max_rel_err_mxfp4",
]  # fmt: skip


# ---------------------------------------------------------------------------------------
# T = 1 against vLLM's vec op: interleaved pairs past the L3, the issue-30 figures

T1_ROUNDS = (21, 41)  # (quick, full): rounds of (numkern, vLLM, stream) samples; >= 9
T1_COLUMNS = [
    "case", "pages", "pairs", "x_vllm_vec", "x_vllm_min", "x_vllm_max", "nk_of_stream",
    "vllm_of_stream", "nk_of_stream_min", "vllm_of_stream_min", "numkern_vec_ms",
    "vllm_vec_ms", "stream_GBps", "nk_huge", "vllm_huge", "stream_huge", "max_rel_err",
    "vllm_library",
]  # fmt: skip


def _huge_fraction(t):
    """The fraction of ``t``'s bytes that /proc/self/smaps puts in transparent huge pages
    (each mapping it overlaps counted by its AnonHugePages share), or None off Linux."""
    lo = t.data_ptr() if isinstance(t, torch.Tensor) else t.ctypes.data
    hi = lo + t.nbytes
    huge = 0.0
    try:
        with open("/proc/self/smaps") as f:
            start = end = 0
            for line in f:
                head = line.split(None, 1)[0]
                if "-" in head and not head.endswith(":"):
                    start, end = (int(v, 16) for v in head.split("-"))
                elif head == "AnonHugePages:" and start < hi and end > lo:
                    overlap = min(hi, end) - max(lo, start)
                    huge += int(line.split()[1]) * 1024 * overlap / (end - start)
    except OSError:
        return None
    return huge / t.nbytes


def _placed(t, pages):
    """``t`` in memory of the benchmark's page kind: numkern.memory's huge pages, or
    ``torch.empty``'s (glibc's own mapping: 4 KB pages where THP is ``madvise``)."""
    out = numkern.memory.huge_empty(t.shape, t.dtype) if pages == "huge" else torch.empty_like(t)
    out.copy_(t)
    return out


def bench_t1(shape, *, pages, rounds, library):
    """One row: numkern's vec ``fused_moe`` against vLLM's ``cpu_fused_moe`` (isa vec) at
    T = 1, in ``rounds`` rounds of one sample each of numkern, vLLM and a stream pass (the
    order of the first two alternating per round). A sample is one call per disjoint
    routing (all E/k of them, every expert once: the working set is all experts' weights,
    past the L3), so both sides read the same bytes from DRAM; each round gives the pair's
    ratio and each side's fraction of that round's stream bandwidth. Both sides' packed
    weights on the same page kind (``pages``), checked in /proc/self/smaps."""
    e_n, k, h = shape.experts, shape.topk, shape.hidden
    gen = torch.Generator().manual_seed(2)
    w13, w2, b13, b2 = _weights(shape, gen)
    nk13 = _placed(moe.prepack_moe_weight(w13, "vec"), pages)
    nk2 = _placed(moe.prepack_moe_weight(w2, "vec"), pages)
    v13 = _placed(_vllm_prepack(w13, "vec"), pages)
    v2 = _placed(_vllm_prepack(w2, "vec"), pages)
    x = torch.randn(1, h, generator=gen).to(DTYPE)
    routes = _DisjointRoutings(shape, gen)
    routings = [routes() for _ in range(e_n // k)]
    out_nk, out_v = torch.empty_like(x), torch.empty_like(x)
    act = shape.activation

    # the check: both sides and the torch loop on one routing
    tw, ti, tw_v, ti_v = routings[0]
    ref = torch_moe(x, w13, w2, b13, b2, tw, ti, act)
    del w13, w2
    moe.fused_moe(out_nk, x, nk13, nk2, b13, b2, tw, ti, activation=act, isa="vec")
    torch.ops._C.cpu_fused_moe(out_v, x, v13, v2, b13, b2, tw_v, ti_v, False, act, "vec")
    err = _rel_err(out_nk, ref)
    if not err < MAX_REL_ERR:
        raise RuntimeError(f"numkern {shape.name} T=1: max rel err {err:.3g} (bound {MAX_REL_ERR})")

    def numkern_call(r):
        tw, ti = routings[r][:2]
        moe.fused_moe(out_nk, x, nk13, nk2, b13, b2, tw, ti, activation=act, isa="vec")

    def vllm_call(r):
        tw, ti = routings[r][2:]
        torch.ops._C.cpu_fused_moe(out_v, x, v13, v2, b13, b2, tw, ti, False, act, "vec")

    def numkern_pass():
        for r in range(len(routings)):
            numkern_call(r)

    def vllm_pass():
        for r in range(len(routings)):
            vllm_call(r)

    stream, stream_bytes = harness.stream_reader(harness.WORKING_SET_BYTES // 2)
    stream_array_huge = None
    for cell in stream.__closure__ or ():  # the reader's array: its page kind, for the row
        if hasattr(cell.cell_contents, "ctypes"):
            stream_array_huge = _huge_fraction(cell.cell_contents)
    per_pass = len(routings) * k * _expert_bytes(shape)
    times = {"nk": [], "vllm": [], "stream": []}
    # (name, timed pass, untimed settling call): the settling call (the last routing, so
    # the pass starts on experts it did not just read) lets the other library's OpenMP
    # threads stop spinning on the cores (harness.time_interleaved's ``settle``)
    order = [
        ("nk", numkern_pass, lambda: numkern_call(-1)),
        ("vllm", vllm_pass, lambda: vllm_call(-1)),
        ("stream", stream, stream),
    ]
    for _, fn, _ in order:  # compile, load, fault everything in
        fn()
    gc_was = gc.isenabled()
    gc.disable()
    try:
        for r in range(rounds):
            first, second = order[:2] if r % 2 == 0 else order[1::-1]
            for name, fn, settle in (first, second, order[2]):
                settle()
                t0 = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - t0)
    finally:
        if gc_was:
            gc.enable()
    stream_rates = [stream_bytes / s for s in times["stream"]]
    ratios = [v / n for n, v in zip(times["nk"], times["vllm"])]
    # a pass's rate against its own round's stream pass (a round whose stream pass another
    # process disturbed gives one outlier: the medians hold); a rate past the run's fastest
    # stream pass is a timing error (harness.check_bound)
    for side in ("nk", "vllm"):
        for sec in times[side]:
            harness.check_bound(f"{side} {shape.name} T=1 (B/s)", per_pass / sec, max(stream_rates))
    of_stream = {
        side: [per_pass / sec / rate for sec, rate in zip(times[side], stream_rates)]
        for side in ("nk", "vllm")
    }
    med = statistics.median
    row = {
        "case": f"{shape.name} T=1",
        "pages": pages,
        "pairs": rounds,
        "x_vllm_vec": med(ratios),
        "x_vllm_min": min(ratios),
        "x_vllm_max": max(ratios),
        "nk_of_stream": med(of_stream["nk"]),
        "vllm_of_stream": med(of_stream["vllm"]),
        "nk_of_stream_min": min(of_stream["nk"]),
        "vllm_of_stream_min": min(of_stream["vllm"]),
        "numkern_vec_ms": med(times["nk"]) / len(routings) * 1e3,
        "vllm_vec_ms": med(times["vllm"]) / len(routings) * 1e3,
        "stream_GBps": med(stream_rates) / 1e9,
        "nk_huge": min(_huge_fraction(nk13), _huge_fraction(nk2)),
        "vllm_huge": min(_huge_fraction(v13), _huge_fraction(v2)),
        "stream_huge": stream_array_huge,
        "max_rel_err": err,
        "vllm_max_rel_err": _rel_err(out_v, ref),
        "vllm_library": library,
        "bytes_per_call_MB": k * _expert_bytes(shape) / 1e6,
        "working_set_MB": per_pass / 1e6,
        "per_pair": [
            {"x_vllm": q, "nk_of_stream": a, "vllm_of_stream": b, "stream_GBps": g / 1e9}
            for q, a, b, g in zip(ratios, of_stream["nk"], of_stream["vllm"], stream_rates)
        ],
        "others_cores": harness.other_cpu_load(),
    }
    print(f"  {row['case']} ({pages} pages: numkern {row['nk_huge']:.2f}, vLLM "
          f"{row['vllm_huge']:.2f} huge): x_vllm {row['x_vllm_vec']:.3f} "
          f"[{row['x_vllm_min']:.3f}, {row['x_vllm_max']:.3f}], of stream numkern "
          f"{row['nk_of_stream']:.3f} vLLM {row['vllm_of_stream']:.3f}, stream "
          f"{row['stream_GBps']:.1f} GB/s", flush=True)  # fmt: skip
    return row


def main_t1(bench):
    """``--t1``: :func:`bench_t1` per shape (quick: the Qwen3 shape), in this process; with
    ``--masked`` the same again in a child with AVX-512 masked (``isa.narrower_mask``),
    against the vLLM build that CPU loads (``_C_AVX2``)."""
    pages = "4k" if bench.args.small_pages else "huge"
    rounds = bench.args.rounds or T1_ROUNDS[0 if bench.quick else 1]
    if rounds < 9:
        raise ValueError(f"--rounds: expected >= 9 pairs for the T=1 figures, got {rounds}")
    library = harness.vllm_library()
    avail = bench.vllm_peer(f"cpu_fused_moe vec ({library})", VLLM_PROBE.format(isa="vec"),
                            library)  # fmt: skip
    masked = bool(os.environ.get("NUMKERN_CPU_FEATURES"))
    bench.name = ("bench_moe_t1_masked" if masked else "bench_moe_t1") + (
        "_quick" if bench.quick else "")  # fmt: skip
    rows = []
    if avail.ok:
        for shape in SHAPES[:1] if bench.quick else SHAPES:
            rows.append(bench_t1(shape, pages=pages, rounds=rounds, library=library))
            gc.collect()
    bench.finish(rows, columns=T1_COLUMNS, extra={
        "vllm_library": library, "vllm": "ok" if avail.ok else avail.na(),
        "cpu_features_masked": os.environ.get("NUMKERN_CPU_FEATURES", ""),
        "thp": _thp_setting()}, notes=[
        "x_vllm_vec: median over pairs of vLLM vec time / numkern vec time (target >= 0.97);"
        " _min/_max: the pairs' range",
        "*_of_stream: a pass's bytes per second (E/k calls, every expert once, past the L3)"
        " / the same round's stream pass (target >= 0.9); median (and min) over rounds",
        "*_huge: fraction of the packed weights in transparent huge pages (smaps)",
        "per_pair (JSON): every round's figures"])  # fmt: skip
    if bench.args.masked and not masked:
        mask, why = numkern.isa.narrower_mask()
        if mask is None:
            print(f"--masked: {why}", flush=True)
            return
        argv = [sys.executable, __file__, "--t1"] + [
            a for a in sys.argv[1:] if a not in ("--t1", "--masked")]  # fmt: skip
        print(f"masked child: NUMKERN_CPU_FEATURES={mask} ({why})", flush=True)
        subprocess.run(argv, env={**os.environ, "NUMKERN_CPU_FEATURES": mask}, check=True)


def _thp_setting():
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            return f.read().strip()
    except OSError:
        return None


# ---------------------------------------------------------------------------------------


def main(argv=None):
    bench = harness.start(
        "bench_moe",
        argv,
        description=__doc__.splitlines()[0],
        quick_help="one shape, T in {1, 32}",
        flags=[
            ("--mxfp4", "only GPT-OSS-20B's experts at T=1, MXFP4 against bf16"),
            ("--t1", "only T=1 against vLLM's vec op: interleaved pairs past the L3"),
            ("--masked", "with --t1: also in a child with AVX-512 masked (vs _C_AVX2)"),
            ("--small-pages", "with --t1: both sides' weights on 4 KB pages, not huge"),
            ("--prefill", "only the Qwen3 shape at T in {256, 1024}, 9 rounds (issue 39)"),
        ],
    )
    if bench.args.t1:
        main_t1(bench)
        return
    if bench.args.mxfp4:
        timer_args = bench.timer(rounds=(3, 15), max_seconds=(0.5, 2.0))
        row = bench_mxfp4(timer_args)
        bench.name = "bench_moe_mxfp4"
        bench.finish([row], columns=MXFP4_COLUMNS, notes=[
            "x_mxfp4 = bf16 experts' time / MXFP4 experts' time (target >= 3.0; bytes_ratio"
            " the bound); *_of_stream: each call's bytes per second / the interleaved stream"
            " pass's"])  # fmt: skip
        return
    shapes = SHAPES[:1] if bench.quick or bench.args.prefill else SHAPES
    ts = QUICK_TS if bench.quick else TS
    timer_args = bench.timer(rounds=(3, 15), max_seconds=(0.5, 2.0))
    if bench.args.prefill:
        ts = PREFILL_TS
        rounds = bench.args.rounds or PREFILL_ROUNDS
        timer_args = bench.timer(
            rounds=(rounds, rounds), max_seconds=(60.0, 60.0), min_rounds=rounds
        )
        bench.name = "bench_moe_prefill"
    library = harness.vllm_library()
    vllm = {
        isa: bench.vllm_peer(
            f"cpu_fused_moe {isa} ({library})", VLLM_PROBE.format(isa=isa), library
        )
        for isa in VLLM_ISAS
    }
    bench.fma_peak()  # for the header: the fp32 FMA ceiling of this run's cores

    rows = []
    for shape in shapes:
        print(f"{shape.name}: E={shape.experts} k={shape.topk} H={shape.hidden} "
              f"I={shape.inter} {shape.activation}", flush=True)  # fmt: skip
        rows += bench_shape(
            shape, ts, vllm=vllm, timer_args=timer_args, stream_gbs=bench.stream_before
        )
        gc.collect()
    if not bench.quick:
        rows.append(bench_mxfp4(timer_args))
        gc.collect()
    notes = [
        f"WARNING: vLLM {name[len('max_rel_err_') :]} {row['case']}: max rel err "
        f"{row[name]:.3g} vs the torch loop (numkern's bound {MAX_REL_ERR})"
        for row in rows
        for name in ("max_rel_err_vllm_vec", "max_rel_err_vllm_amx")
        if row.get(name) is not None and not row[name] < MAX_REL_ERR
    ]
    bench.fma_peak()
    bench.finish(
        rows,
        columns=COLUMNS,
        extra={"vllm_library": library},
        notes=[
            *notes,
            "times are medians of interleaved rounds; x_* = time / numkern vec time "
            "(> 1: numkern vec faster)",
            "nk_*_first_s: numkern's first call (compile, or load from Numba's disk cache)",
            "numkern amx = the amx weight layout; its compute is AVX-512 like vec",
            f"max_rel_err_*: max |out - torch loop| / max |torch loop| (numkern bound "
            f"{MAX_REL_ERR})",
            "weight_GBps (numkern vec), vllm_*_GBps: chosen experts' weight+bias bytes / "
            "time at T=1, a new disjoint routing each call; *of_stream: / stream_GBps, a "
            "stream pass timed interleaved with them (stream_GBps_before/after: context)",
            "touched_GBps (T > 1, the same routing each call): the touched experts' bytes / "
            "numkern vec time, where they pass the L3 bound; *touched_of_stream: / "
            "stream_GBps_before",
            "widen_vec: numkern's 8x32 widening tiles forced (path='widen'), where the "
            "call's own path (dpbf16 or fma256) differs",
            "others_cores: CPU used by other processes while the case was timed",
        ],
        plots=[
            {
                "x": "case",
                "y": ["x_numkern_amx", "x_torch_loop", "x_vllm_vec", "x_vllm_amx"],
                "ylabel": "time / numkern vec time",
                "title": "numkern vec speedup (> 1: numkern vec faster)",
                "hline": (1.0, "parity"),
                "logy": True,
            },
            {
                "x": "case",
                "where": lambda r: r["T"] == 1,
                "ylabel": "GB/s",
                "title": "T=1 chosen experts' bytes read per second (disjoint routings)",
                "y": ["stream_GBps", "weight_GBps", "amx_GBps", "vllm_vec_GBps", "vllm_amx_GBps"],
            },
        ],
    )


if __name__ == "__main__":
    main()
