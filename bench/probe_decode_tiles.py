"""Decode attention's K/V read, taken apart: numkern's decode tiles (``qk4`` + ``pv4``, no
softmax) over every 32-key tile of 64 (request, kv head) items, with several software
prefetch strategies, beside the whole ``paged_attention`` call, interleaved in one process
on rotated cache copies past the L3 (issue 30's probe; not a timed suite).

    python bench/probe_decode_tiles.py       # ~1 min after compiling; ROUNDS=7 by default

Shape: 8 requests x 2048 keys, 8 kv heads (GQA 4: 32 q heads), head dim 128, block 128,
bf16, vec layout, shuffled block table. Strategies (``run``'s ``strat``, ``dist``):

* (0, 0): no software prefetch (the hardware prefetchers alone);
* (1, 0): the kernel's own: the next tile's lines (``tiles.prefetch_next``: K rows at a
  256-byte stride, then V), prefetcht0, spread over the Q·K loop;
* (4, n): address order: each tile prefetches (prefetcht0) its share of the item's K/V
  stream (each block's 32 KB of K, then its 32 KB of V) ``n`` tiles ahead.
* real: ``paged_attention`` (softmax, scheduling, everything).

Measured (AMD EPYC Zen 4, 2 threads, shared with other sessions; ms per call, stream in
the same rounds): none 7.87 / 7.91, address order n=2 3.18-3.24 (best; n=1 3.88, 3: 3.42,
4: 3.54, 6: 3.90), next-tile prefetcht1 4.55-4.79, real 8.30 against n=2's 6.10 in one
loaded run. The address-order prefetch in the real kernel did not follow (x vLLM vec
1.39 / 1.29 against 1.46 / 1.40 without it, separate processes): the gap between the
tiles alone and the whole call is the open question (docs/kernels.md §6.6).
"""

import os
import statistics
import time

import harness
import numpy as np
import torch
from numba import prange

from numkern import attention as A
from numkern._jit import jit
from numkern.attention import tiles as T
from numkern.simd import prefetch, vbcast, vfma, vsplat

D, B, HKV, R, L = 128, 128, 8, 8, 2048
NBLK = L // B
KB = HKV * B * 2 * D  # elements per block


@jit(inline="always")
def pf_lines(kc, base, n):
    for i in range(n):
        prefetch(kc, base + i * 32)


@jit
def qk4v(qf, qr, d, src, t, sbuf, strat, pa, pn):
    """tiles.qk4 with a prefetch strategy: 0 none, 4: prefetcht0 of ``pn`` lines from
    ``pa`` in address order, spread over the dim pairs."""
    q0, q1, q2, q3 = qr[0], qr[1], qr[2], qr[3]
    a0 = a1 = a2 = a3 = b0 = b1 = b2 = b3 = vsplat(0.0)
    per = pn // (d // 2) + 1
    for d2 in range(d // 2):
        xe, xo = T.k_pair(src.kc, t.ka, src.k_step, d2)
        ye, yo = T.k_pair(src.kc, t.kb, src.k_step, d2)
        if strat >= 3:
            j = d2 * per
            if j < pn:
                pf_lines(src.kc, pa + j * 32, min(per, pn - j))
        e = 2 * d2
        u = vbcast(qf, q0 + e)
        w = vbcast(qf, q0 + e + 1)
        a0 = vfma(w, xo, vfma(u, xe, a0))
        b0 = vfma(w, yo, vfma(u, ye, b0))
        u = vbcast(qf, q1 + e)
        w = vbcast(qf, q1 + e + 1)
        a1 = vfma(w, xo, vfma(u, xe, a1))
        b1 = vfma(w, yo, vfma(u, ye, b1))
        u = vbcast(qf, q2 + e)
        w = vbcast(qf, q2 + e + 1)
        a2 = vfma(w, xo, vfma(u, xe, a2))
        b2 = vfma(w, yo, vfma(u, ye, b2))
        u = vbcast(qf, q3 + e)
        w = vbcast(qf, q3 + e + 1)
        a3 = vfma(w, xo, vfma(u, xe, a3))
        b3 = vfma(w, yo, vfma(u, ye, b3))
    T._store8(sbuf, 0, 32, a0, b0, a1, b1, a2, b2, a3, b3)


@jit(parallel=True)
def run(kc, bt, qf, strat, dist):
    """The tiles of every item; strat 4 prefetches ``dist`` tiles ahead in address order
    (the (block, head)'s 64 KB: K then V), a quarter of a block per tile."""
    for it in prange(R * HKV):
        r = it // HKV
        h = it % HKV
        sbuf = np.full(4 * 32, 0.01, np.float32)
        acc = np.zeros(4 * D, np.float32)
        qr = np.arange(4).astype(np.int64) * D
        ar = np.arange(4).astype(np.int64) * D
        pr = np.arange(4).astype(np.int64) * 32
        al = np.ones(4, np.float32)
        src = T.Source(kc, kc, B, 16 * B)
        for j in range(NBLK * 4):
            blk = bt[r, j // 4]
            o = (j % 4) * 32
            base = blk * KB + h * (2 * B * D)
            t = T.Tile(
                base + o, base + o + 16, base + B * D + o * D, base + B * D + (o + 16) * D, 16, 16
            )
            if strat == 1 or strat == 2:
                if j + 1 < NBLK * 4:
                    blk2 = bt[r, (j + 1) // 4]
                    o2 = ((j + 1) % 4) * 32
                    b2 = blk2 * KB + h * (2 * B * D)
                    nt = T.Tile(
                        b2 + o2,
                        b2 + o2 + 16,
                        b2 + B * D + o2 * D,
                        b2 + B * D + (o2 + 16) * D,
                        16,
                        16,
                    )
                else:
                    nt = t
                T.qk4(qf, qr, D, src, t, sbuf, nt, True)
            elif strat >= 3:
                jj = j + dist
                pa = 0
                pn = 0
                if jj < NBLK * 4:
                    blk2 = bt[r, jj // 4]
                    pa = blk2 * KB + h * (2 * B * D) + (jj % 4) * (B * D // 2)  # quarter of 64 KB
                    pn = 256  # lines: 16 KB
                qk4v(qf, qr, D, src, t, sbuf, strat, pa, pn)
            else:
                qk4v(qf, qr, D, src, t, sbuf, 0, 0, 0)
            T.pv4(acc, ar, al, sbuf, pr, D, src, t, None)
        qf[0] += acc[0] * 0.0


nb = R * NBLK
rng = np.random.default_rng(0)
base_kc = rng.integers(0x3C00, 0x3F00, size=nb * KB, dtype=np.uint16)
copies = [base_kc] + [base_kc.copy() for _ in range(9)]
bt = rng.permutation(nb).reshape(R, NBLK).astype(np.int32)
qf = rng.standard_normal(4 * D).astype(np.float32)
read, nbytes = harness.stream_reader()
kvbytes = R * HKV * L * D * 4
variants = [(0, 0), (1, 0), (4, 1), (4, 2), (4, 4), "real"]
tcopies = [
    A.split_kv_cache(torch.from_numpy(c).view(torch.bfloat16).view(A.kv_cache_shape(nb, HKV, B, D)))
    for c in copies
]
q = (torch.randn(R, 32, D) * 4).bfloat16()
qsl = torch.arange(R + 1, dtype=torch.int32)
sl = torch.full((R,), L, dtype=torch.int32)
btt = torch.from_numpy(bt)
plan = A.plan_attention(
    qsl, sl, num_heads=32, num_kv_heads=HKV, head_dim=D, block_size=B, causal=True, isa="vec"
)
out = torch.empty_like(q)


def real(c):
    kc, vc = tcopies[c]
    A.paged_attention(q, kc, vc, out, qsl, sl, btt, scale=D**-0.5, isa="vec", plan=plan)


for v in variants:
    if v == "real":
        real(0)
    else:
        run(copies[0], bt, qf, *v)
ts = {v: [] for v in variants}
st = []
k = 0
for _ in range(int(os.environ.get("ROUNDS", 7))):
    t = time.perf_counter()
    read()
    st.append(time.perf_counter() - t)
    for v in variants:
        c = copies[k % len(copies)]
        k += 1
        if v == "real":
            t = time.perf_counter()
            real(k % len(copies))
            ts[v].append(time.perf_counter() - t)
        else:
            t = time.perf_counter()
            run(c, bt, qf, *v)
            ts[v].append(time.perf_counter() - t)
sg = nbytes / statistics.median(st) / 1e9
print(f"stream {sg:.1f} GB/s")
for v in variants:
    m = statistics.median(ts[v])
    print(
        f"strat {v}: {m * 1e3:.3f} ms  {kvbytes / m / 1e9:.1f} GB/s  "
        f"of_stream {kvbytes / m / 1e9 / sg:.2f}  "
        f"per-tile (2 threads) {m * 2 / (R * HKV * L / 32) * 1e6:.3f} us"
    )
