"""Quantised GEMM at M = 128 three ways, interleaved in one process (issue 40's probe; not a
timed suite): the weight dequantised once per 32-column block to bf16 in the packed
``[K/2][32][2]`` layout and multiplied on AMX-BF16 tiles (``amx_gemm.block``, the
proposal), against ``quant_linear`` on AMX-INT8 tiles (the amx path) and on VNNI-512.

    python bench/probe_quant_bf16_tiles.py   # Q4_K and Q8_0, 4096 x 4096, 9 rounds

Needs an AMX host (real tiles). Measured (Emerald Rapids Xeon VM, 2 vCPUs, 2026-12-05;
medians of 9 rounds, three runs): Q4_K dequantised + bf16 tiles 2.90-3.04 ms, int8
tiles 4.63-5.91, VNNI-512 9.25-10.10 (3.19-3.32x it); Q8_0 2.55-3.18, 3.74-4.56,
6.73-7.85 (2.47-2.72x); relative RMS error against the fp64 product of the dequantised weight 2.3e-3
(bf16 weights) against 5.6e-3 (int8 activations).
The dequantisation is unoptimised (every K of the block, then the product).
"""

import statistics
import time

import numpy as np
import torch
from numba import prange

from numkern import amx, amx_gemm, isa
from numkern._jit import jit
from numkern.quant import dequantize, quant_linear, repack
from numkern.quant._kernels import _nibbles, _scales, _sections, params
from numkern.simd import vfma, vstore_pairs
from numkern.simd_int8 import bload, ibyte_f
from numkern.testing.quantize import quantize

ROUNDS = 9


@jit(inline="always")
def _pairs(w16, j, col, a, b, d, mv, i, off):
    """bf16 pairs of K ``2j, 2j+1`` of 16 columns: bytes ``i, i+1`` of ``a`` (and ``b``)."""
    vstore_pairs(w16, j * 64 + col, vfma(ibyte_f(a, i, off), d, mv),
                 vfma(ibyte_f(b, i + 1, off), d, mv))  # fmt: skip


@jit(inline="always")
def _dequantize_block(w16, wa, p, s, blk, k):
    """Row blocks ``2 blk``, ``2 blk + 1`` dequantised to ``w16`` ``[k/2][32][2]`` bf16."""
    for rbi in range(2):
        rb = 2 * blk + rbi
        for g in range(k // p.group):
            d, mv = _scales(wa, p, s, rb, g, k)
            k0 = g * p.group
            if p.bits == 8:
                for q in range(p.group // 4):
                    v = bload(wa, s.codes + (rb * (k // 4) + k0 // 4 + q) * 64)
                    j = (k0 + 4 * q) // 2
                    _pairs(w16, j, rbi * 32, v, v, d, mv, 0, p.offset)
                    _pairs(w16, j + 1, rbi * 32, v, v, d, mv, 2, p.offset)
            else:
                for c in range(p.group // 8):
                    lo, hi = _nibbles(wa, p, s, rb, k, k0 // 8 + c)
                    j = (k0 + 8 * c) // 2
                    _pairs(w16, j, rbi * 32, lo, lo, d, mv, 0, p.offset)
                    _pairs(w16, j + 1, rbi * 32, lo, lo, d, mv, 2, p.offset)
                    _pairs(w16, j + 2, rbi * 32, hi, hi, d, mv, 0, p.offset)
                    _pairs(w16, j + 3, rbi * 32, hi, hi, d, mv, 2, p.offset)


@jit(parallel=True)
def dequantized_gemm(out, x, w, code, m, n, k, tiles, bias):
    """``out = x @ W.T``: bf16 (uint16) ``x [m, k]``, ``out [m, n]``, ``n % 32 == 0``."""
    p = params(code)
    s = _sections(code, n, k)
    for b in prange(n // 32):
        blk = np.int64(b)
        w16 = np.empty(k * 32, np.uint16)
        _dequantize_block(w16, w.ctypes.data, p, s, blk, k)
        amx_gemm.block(tiles, out[blk * 32 :], n, x, k, w16, bias, False, m, 32, k, np.int64(0))


def probe(qt, rng, n=4096, k=4096, m=128):
    """Print the three ways' median times and errors for one type."""
    qw = repack(quantize(rng.standard_normal((n, k)).astype(np.float32) * 0.05, qt), qt, (n, k))
    x = torch.randn(m, k).bfloat16()
    outs = [torch.empty(m, n, dtype=torch.bfloat16) for _ in range(3)]
    xv, ov = x.view(torch.uint16).numpy().ravel(), outs[0].view(torch.uint16).numpy().ravel()
    args = (xv, qw.data.numpy(), qw.code, m, n, k, amx.witness(False), np.zeros(n, np.float32))
    calls = {
        "dequantised + bf16 tiles": lambda: dequantized_gemm(ov, *args),
        "int8 tiles": lambda: quant_linear(outs[1], x, qw),
        "vnni512": lambda: quant_linear(outs[2], x, qw, path="vnni512"),
    }
    times = {name: [] for name in calls}
    for f in calls.values():
        f()
    for _ in range(ROUNDS):
        for name, f in calls.items():
            t = time.perf_counter()
            f()
            times[name].append(time.perf_counter() - t)
    ref = x.double() @ dequantize(qw).double().T
    for (name, ts), out in zip(times.items(), outs, strict=True):
        err = float((out.double() - ref).pow(2).mean().sqrt() / ref.pow(2).mean().sqrt())
        print(f"{qt} {name}: {statistics.median(ts) * 1e3:.2f} ms, rel RMS err {err:.2e}")


def main():
    if isa.decision().quant != "amx":
        raise SystemExit(f"needs AMX-INT8 tiles (quant path here: {isa.decision().quant})")
    rng = np.random.default_rng(0)
    for qt in ("Q4_K", "Q8_0"):
        probe(qt, rng)


if __name__ == "__main__":
    main()
