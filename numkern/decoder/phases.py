"""The decoder's phase scheduler: the phases of a run, and how workers share them.

A run (:func:`numkern.decoder.layer._run`) is one parallel region whose threads are
workers walking the same list of phases (docs/kernels.md, "Decoder layers (fused)"): per
layer the qkv GEMM, the q/k norms + rotary + cache write, attention items, split merges,
the output gate (Qwen3-Next), the o GEMM, residual + norm, the gate|up GEMM, SiLU·mul,
the down GEMM, residual + next norm; then the head. Each phase has a claim counter and a
done counter (``ph = (ctr, done, flags)``):

* A phase's units are claimed with atomic counters (:func:`_next`), and a unit counts as
  done once its outputs are written. A worker moves to the next phase when every unit of
  this one is done (:func:`_wait`): it waits for claimed units, never for other workers
  to arrive. A worker that runs alone (one thread, or a vCPU the hypervisor has taken
  away) claims everything itself; a late worker finds the phases done and falls through.
  A barrier counting workers would hang if fewer threads ran than expected. (STYLE
  prefers owner-computes loops without atomics; here a static share measured slower
  under vCPU steal.)
* GEMM units are chunks of 32-column blocks. Each worker first walks its own contiguous
  share (the weight stream stays sequential per thread: 5-15% faster than interleaved
  claims), then takes the chunks others have not started, from the end. While it waits
  it prefetches its share of the next GEMM's weight (:func:`_share`): a decode step is a
  weight stream.

:data:`PHASES` names each phase of a layer; :func:`phase_units` reads a run's done
counters back by name (``DecoderStep.phase_units``: a test's view of which phases handed
out work).
"""

from .._jit import jit
from ..gemm import NB
from ..simd import atomic_load, fetch_add, prefetch

# a layer's phases, each with its own claim and done counter (a GEMM takes two: the
# shared widening of its activations, then its blocks)
P_QKV, P_ROPE, P_ATTN, P_MERGE, P_GATE, P_O = 0, 2, 3, 4, 5, 6
P_ADD1, P_GU, P_ACT, P_DOWN, P_ADD2 = 8, 9, 11, 12, 14
N_PHASE = 15
N_HEAD = 4  # phases of the logits: final norm, head GEMM (two), widening
WIDEN_UNIT = 4096  # logits widened per unit
WAIT_PREFETCH = 256 << 10  # bytes of the next GEMM's share a waiting worker prefetches
# (768 KB measured no better)
CHUNKS_PER_WORKER = 4  # GEMM chunks per worker's share: the units the others may take
GEMM_UNITS = 2 * CHUNKS_PER_WORKER  # at most this many chunks per worker (see _gemm)


@jit
def _next(ctr, done, g, finished):
    """Mark one unit of phase ``g`` done (when ``finished``) and claim the next one."""
    if finished:
        fetch_add(done, g, 1)
    return fetch_add(ctr, g, 1)


@jit
def _wait(done, g, n, pf):
    """Until all ``n`` units of phase ``g`` are done (each by a worker that claimed it),
    prefetching ``pf = (w, lo, hi)``: ``w[lo:hi]``, the worker's share of the next GEMM."""
    w, lo, hi = pf
    step = 64 // w.itemsize  # a cache line
    i = lo
    while atomic_load(done, g) < n:
        if i < hi:
            prefetch(w, i)
            i += step


@jit
def _share(w, n, me, nw):
    """``(w, lo, hi)``: the first WAIT_PREFETCH bytes of worker ``me``'s own chunks of the
    packed weight ``w`` (``n`` output columns)."""
    nblk = (n + NB - 1) // NB
    per = max(1, nblk // (nw * CHUNKS_PER_WORKER))
    nch = (nblk + per - 1) // per
    per_blk = w.shape[0] // max(n, 1) * NB  # elements of a full block (K, or K pairs, x 32)
    lo = min(w.shape[0], me * nch // nw * per * per_blk)
    hi = min(w.shape[0], (me + 1) * nch // nw * per * per_blk)
    return w, lo, min(hi, lo + WAIT_PREFETCH // w.itemsize)


# the phases of one layer by offset (a GEMM's two: its shared widening, then its blocks),
# then those of the head (offsets from its first)
PHASES = {
    P_QKV: "qkv.widen",
    P_QKV + 1: "qkv",
    P_ROPE: "rope",
    P_ATTN: "attention",
    P_MERGE: "merge",
    P_GATE: "gate",
    P_O: "o.widen",
    P_O + 1: "o",
    P_ADD1: "add1",
    P_GU: "gate_up.widen",
    P_GU + 1: "gate_up",
    P_ACT: "act",
    P_DOWN: "down.widen",
    P_DOWN + 1: "down",
    P_ADD2: "add2",
}
HEAD_PHASES = ("head.norm", "head.widen", "head", "logits")


def phase_units(done, l0, l1):
    """``{phase name: units done}`` of a run of layers ``l0..l1`` from its done counters
    ``done`` (phase 0 is ``"input"``; a layer's phases summed over the run's layers, the
    widening phase of a GEMM under ``"<gemm>.widen"``)."""
    units = {"input": int(done[0])}
    for li in range(l1 - l0):
        for off, name in PHASES.items():
            units[name] = units.get(name, 0) + int(done[1 + li * N_PHASE + off])
    g_head = 1 + (l1 - l0) * N_PHASE
    for off, name in enumerate(HEAD_PHASES):
        units[name] = int(done[g_head + off])
    return units
