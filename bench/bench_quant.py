"""Benchmark numkern's quantised linear (numkern.quant.quant_linear) per type.

    python bench/bench_quant.py            # 9 types: GEMV 4096x4096; M = 16 / 128: 3 types
    python bench/bench_quant.py --quick    # 3 types (Q4_K, Q8_0, MXFP4)

GEMV (M = 1, bf16 x, this CPU's int8 path; decode never takes the AMX tiles): each
type's weight is timed on rotated copies (a working set past the L3), its quantised
bytes per second compared with the stream bandwidth timed in the same rounds (a stream
pass is a case of every round; ``of_stream``: the share of the quantised-bytes bound),
beside the bf16 packed linear (``numkern.weight_packed_linear``) on its own rotated
copies (``x_bf16``: bf16 time / quantised time). M = 16 and 128: the quantised linear
against the bf16 packed linear of the same shape, interleaved, one weight each (compute-
bound); on an AMX-INT8 CPU (quant path ``amx``) also the VNNI-512 code forced on the
same call and the amx call again (its A/A spread). Weights: a NumPy quantiser's GGUF
blocks (``numkern.testing.quantize``) repacked by ``numkern.quant.repack``.
"""

import dataclasses

import harness
import numpy as np
import torch

import numkern
from numkern.memory import weight_empty
from numkern.quant import dequantize, quant_linear, repack
from numkern.testing.quantize import quantize

SHAPE = (4096, 4096)  # (N, K): an attention projection; K a multiple of 256
TYPES = ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K", "MXFP4")
QUICK_TYPES = ("Q4_K", "Q8_0", "MXFP4")
BIG_MS = (16, 128)
BIG_TYPES = ("Q4_K", "Q8_0", "MXFP4")  # the M = 16 / 128 rows (one per scale kind)
DT = torch.bfloat16
# A GEMV sample lasts at least this long (~40 calls, ~400 MB of copies): with 2 ms samples
# (~4 calls after a 1 GB stream pass) Q8_0's median ranged 0.40-0.64 of stream in one
# session (Emerald Rapids VM), with 20 ms 0.64-0.69.
GEMV_SAMPLE_S = 0.02
# The int8 path's error against the dequantised product is ~5e-3 of the output's RMS
# (docs/kernels.md §13.7); a broken kernel is off by O(1).
MAX_REL_RMS_ERR = 3e-2

COLUMNS = [
    "case", "path", "first_s", "quant_ms", "bf16_ms", "x_bf16", "vnni_ms", "x_vnni", "aa_spread",
    "quant_MB", "quant_GBps", "stream_GBps",
    "of_stream", "GFLOPs", "rel_rms_err", "bandwidth_note", "others_cores",
]  # fmt: skip


def _copy(qw):
    """A copy of ``qw`` placed as ``repack`` places its own (``numkern.memory.weight_empty``:
    huge pages from 8 MB; a ``clone`` on 4 KB pages read the same 4096^2 Q4_K weight at
    0.47 of stream against 0.64 on huge pages, Emerald Rapids VM)."""
    data = weight_empty(tuple(qw.data.shape), qw.data.dtype)
    data.copy_(qw.data)
    return dataclasses.replace(qw, data=data)


def _check(out, x, w, what):
    ref = x.double() @ w.double().T
    err = float((out.double() - ref).pow(2).mean().sqrt() / ref.pow(2).mean().sqrt())
    if not err < MAX_REL_RMS_ERR:
        raise RuntimeError(f"{what}: relative RMS error {err:.3g}")
    return err


def bench_gemv(qtype, w32, packed_rot, stream, timer_args):
    """M = 1 on rotated copies, a stream pass (``stream``: ``harness.stream_reader()``)
    timed in every round beside it: the share of the bound is taken against the stream
    bandwidth of the same rounds (issue 41)."""
    n, k = SHAPE
    qw = repack(quantize(w32, qtype), qtype, SHAPE)
    rot = harness.rotating(lambda: _copy(qw), per_copy_bytes=qw.nbytes)
    x = torch.randn(1, k, dtype=DT)
    out, out_b = torch.empty(1, n, dtype=DT), torch.empty(1, n, dtype=DT)
    read, read_bytes = stream
    t = harness.time_interleaved(
        {
            "quant": lambda: quant_linear(out, x, rot()),
            "bf16": lambda: numkern.weight_packed_linear(out_b, x, packed_rot(), None, True),
            "stream": read,
        },
        **{"min_sample_s": GEMV_SAMPLE_S, **timer_args},
    )
    stream_gbs = read_bytes / t["stream"].median_s / 1e9
    err = _check(out, x, dequantize(qw), f"{qtype} M=1")
    q = t["quant"].median_s
    row = {
        "case": f"{qtype} {n}x{k} M=1",
        "path": numkern.isa.quant_path()[0],
        "first_s": t["quant"].first_s,
        "quant_ms": q * 1e3,
        "bf16_ms": t["bf16"].median_s * 1e3,
        "x_bf16": t["bf16"].median_s / q,
        "quant_MB": qw.nbytes / 1e6,
        "GFLOPs": 2 * n * k / q / 1e9,
        "rel_rms_err": err,
        "others_cores": t["quant"].other_cores,
        "stream_GBps": stream_gbs,
        "bandwidth_note": f"{len(rot)} copies, {rot.working_set_bytes / 1e6:.0f} MB",
    }
    if rot.claimable and packed_rot.claimable:
        row["quant_GBps"] = harness.check_bound(f"{qtype} GEMV", qw.nbytes / q / 1e9, stream_gbs)
        row["of_stream"] = row["quant_GBps"] / stream_gbs
    else:
        row["bandwidth_note"] = "not claimable: working set within the L3"
    print(f"  {row['case']}: {q * 1e3:.3f} ms, x{row['x_bf16']:.2f} bf16", flush=True)
    return row


def bench_big(qtype, w32, packed, m, timer_args):
    """M = 16 / 128: the quantised linear on this CPU's path, the bf16 packed linear, and
    where the path is amx the VNNI-512 code forced on the same call (``x_vnni``) and the
    amx call timed twice (``aa_spread``: the identical-code spread of the medians)."""
    n, k = SHAPE
    qw = repack(quantize(w32, qtype), qtype, SHAPE)
    x = torch.randn(m, k, dtype=DT)
    out, out_b = torch.empty(m, n, dtype=DT), torch.empty(m, n, dtype=DT)
    out_v = torch.empty(m, n, dtype=DT)
    cases = {
        "quant": lambda: quant_linear(out, x, qw),
        "bf16": lambda: numkern.weight_packed_linear(out_b, x, packed, None, True),
    }
    tiles = numkern.isa.quant_path()[0] == "amx"
    if tiles:
        cases["vnni512"] = lambda: quant_linear(out_v, x, qw, path="vnni512")
        cases["quant_again"] = lambda: quant_linear(out, x, qw)
    t = harness.time_interleaved(cases, **timer_args)
    err = _check(out, x, dequantize(qw), f"{qtype} M={m}")
    q = t["quant"].median_s
    row = {
        "case": f"{qtype} {n}x{k} M={m}",
        "path": numkern.isa.quant_path()[0],
        "first_s": t["quant"].first_s,
        "quant_ms": q * 1e3,
        "bf16_ms": t["bf16"].median_s * 1e3,
        "x_bf16": t["bf16"].median_s / q,
        "quant_MB": qw.nbytes / 1e6,
        "GFLOPs": 2 * m * n * k / q / 1e9,
        "rel_rms_err": err,
        "others_cores": t["quant"].other_cores,
    }
    if tiles:
        _check(out_v, x, dequantize(qw), f"{qtype} M={m} vnni512")
        row["vnni_ms"] = t["vnni512"].median_s * 1e3
        row["x_vnni"] = t["vnni512"].median_s / q
        row["aa_spread"] = abs(t["quant_again"].median_s / q - 1)
    print(f"  {qtype} M={m}: {q * 1e3:.3f} ms, x{row['x_bf16']:.2f} bf16"
          + (f", x{row['x_vnni']:.2f} VNNI-512 (A/A {row['aa_spread']:.3f})" if tiles else ""),
          flush=True)  # fmt: skip
    return row


def main(argv=None):
    bench = harness.start(
        "bench_quant", argv, description=__doc__.splitlines()[0], quick_help="three types"
    )
    timer_args = bench.timer(rounds=(5, 15), max_seconds=(0.5, 1.5))
    n, k = SHAPE
    rng = np.random.default_rng(0)
    w32 = rng.standard_normal((n, k)).astype(np.float32) * 0.02
    wb = torch.from_numpy(w32).to(DT)
    packed = numkern.convert_weight_packed(wb)
    packed_rot = harness.rotating(
        lambda: numkern.convert_weight_packed(wb), per_copy_bytes=packed.numel() * 2
    )
    rows = []
    stream = harness.stream_reader()
    for qtype in QUICK_TYPES if bench.quick else TYPES:
        rows.append(bench_gemv(qtype, w32, packed_rot, stream, timer_args))
    del stream
    del packed_rot
    for qtype in BIG_TYPES[:1] if bench.quick else BIG_TYPES:
        for m in BIG_MS:
            rows.append(bench_big(qtype, w32, packed, m, timer_args))
    bench.finish(
        rows,
        columns=COLUMNS,
        notes=[
            "times are medians of interleaved rounds (quantised, bf16 packed linear)",
            f"path: numkern.isa.quant_path() = {numkern.isa.quant_path()}",
            "M=1: rotated copies past the L3; quant_GBps = quantised bytes / time, "
            "stream_GBps = a stream pass timed in the same rounds, of_stream = quant_GBps / "
            "stream_GBps (the quantised-bytes bound)",
            "x_bf16 = bf16 packed linear time / quantised time (> 1: quantised faster)",
            "amx path (M = 16, 128): x_vnni = the VNNI-512 code forced on the same call / the "
            "amx time; aa_spread = |median of the amx call timed again / median - 1|",
            "first_s: the first call (compile, or load from Numba's disk cache)",
            "others_cores: CPU used by other processes while the case was timed",
        ],
    )


if __name__ == "__main__":
    main()
