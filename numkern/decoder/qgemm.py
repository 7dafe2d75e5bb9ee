"""The decoder's GEMM phases on a quantised weight (a :class:`numkern.quant.QuantWeight`
in a layer's record or the head): :func:`_qgemm`, the twin of ``layer._gemm`` built from
numkern.quant's building blocks (docs/kernels.md, the quantised linear).

Activations are quantised once per GEMM input, as ``_gemm`` widens them: a decode step's
few rows by each worker that computes, into its own scratch, without a wait; from
``shared_from`` elements (a prefill chunk) by all workers into the shared scratch in the
GEMM's first phase (``quantize_rows``, rows of a unit at a time). The second phase hands
out chunks of row blocks (``qblocks``: 16 output columns a row block, every type of
numkern.quant in one body, switched on the weight's ``code`` at run time), each worker's
own share first, as ``_gemm``'s. A unit is two row blocks: 32 columns, ``gemm.NB``, so
the phase scheduler's chunking and prefetch shares (``phases._share``) are those of a
packed weight of the same shape.
"""

from .._jit import jit
from ..gemm import NB
from ..quant._kernels import new_act, qblocks, quantize_rows
from ..quant.formats import ROWS
from ..simd import fetch_add
from .phases import CHUNKS_PER_WORKER, GEMM_UNITS, _next, _wait

_RB = NB // ROWS  # row blocks per unit: the column blocks of the packed GEMM


@jit
def _act(m, k, path):
    """Activation scratch of ``m`` rows of ``k`` for numkern.quant's ``path`` (its
    witness: int8 codes and scales, or fp32 rows for fp32 activations)."""
    return new_act(m, k, path)


@jit
def _qgemm(out, x, wq, code, bias, has_bias, m, n, k, g, pf, ctx):
    """Phases ``g``, ``g + 1``: ``out[m, n] = x[m, k] @ W.T (+ bias)`` with ``W`` the
    quantised weight ``wq`` (its buffer, uint8) of type ``code``; ``ctx`` as ``_gemm``'s,
    its ``qa`` (this worker's) and ``qs`` (shared) the activation scratches."""
    _, _, ph, me, nw, shared_from, _, qa, qs = ctx
    ctr, done, flags = ph
    shared = m * k >= shared_from
    if shared:
        rows_per = max(1, m // (nw * 4))
        n_units = (m + rows_per - 1) // rows_per
        c = _next(ctr, done, g, False)
        while c < n_units:
            quantize_rows(x, k, k, c * rows_per, min(m, (c + 1) * rows_per), qs)
            c = _next(ctr, done, g, True)
        _wait(done, g, n_units, pf)
        act = qs
    else:
        act = qa
    g += 1
    nrb = (n + ROWS - 1) // ROWS
    nblk = (nrb + _RB - 1) // _RB
    per = max(1, nblk // (nw * CHUNKS_PER_WORKER))  # units per chunk
    nch = (nblk + per - 1) // per  # <= nw * GEMM_UNITS
    c0 = me * nch // nw
    c1 = (me + 1) * nch // nw
    f0 = g * nw * GEMM_UNITS
    quantised = False
    own = c1 - c0
    for i in range(nch):
        j = i - own  # own share forward, then the others' from the end (as _gemm)
        if j < 0:
            c = c0 + i
        elif j < nch - c1:
            c = nch - 1 - j
        else:
            c = c0 - 1 - (j - (nch - c1))
        if fetch_add(flags, f0 + c, 1):
            continue
        if not (quantised or shared):  # quantised by each worker that computes
            quantize_rows(x, k, k, 0, m, qa)
            quantised = True
        rb0, rb1 = c * per * _RB, min(nrb, (c + 1) * per * _RB)
        qblocks(out, n, act, wq, code, m, n, k, rb0, rb1, bias, has_bias)
        fetch_add(done, g, 1)
    _wait(done, g, nch, pf)
