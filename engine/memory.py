"""Weight memory: the packed weights in transparent huge pages.

A decode step streams every weight once: ~270 MB per token for SmolLM2-135M, and on 4 KB
pages every 4 KB of it is a TLB miss. The arena takes 64 MB chunks from
:func:`numkern.huge_empty` (2 MB-aligned, advised for huge pages before they are written:
the measurements are in :mod:`numkern.memory`'s docstring) and bump-allocates the
weights into them.

Before this, the advice came after the weights were written and ``khugepaged`` collapsed
them in the background at 16 MB per 10 s: a fresh engine decoded on 4 KB pages for its
first minutes (SmolLM2's decode GEMVs at 0.83-0.91 of the stream bandwidth instead of
0.86-1.05, and the engine's batch-1 decode 0.47-0.74 of its bound). Advised first,
writing 256 MB took 0.04-0.05 s against 0.13-0.17 s on 4 KB pages (AMD EPYC VM, quiet);
an earlier measurement on that VM with other jobs running found placing SmolLM2's
weights 0.6-0.9 s slower advised first, when the kernel had to compact memory for its
2 MB pages (``defrag`` = ``madvise``).
"""

import math

import torch

from numkern import convert_weight_packed, huge_empty
from numkern.gemm import NB

CHUNK = 64 << 20  # bytes per mapping: weights are bump-allocated into chunks
ALIGN = 64  # every tensor starts on a cache line
PACK_ELEMENTS = 1 << 20  # elements packed per slice: a 2-4 MB temporary, reused


class WeightArena:
    """Bump allocator of tensor storage in chunks of :func:`numkern.huge_empty` (module
    docstring).

    Tensors placed here keep their chunk alive (a view of it); the arena itself holds
    only the chunk being filled.
    """

    def __init__(self, chunk=CHUNK):
        self.chunk = chunk
        self._buf = None
        self._used = 0
        self.placed_bytes = 0

    def empty(self, shape, dtype):
        """An uninitialised contiguous tensor in the arena."""
        shape = tuple(shape)
        nbytes = math.prod(shape) * dtype.itemsize
        if nbytes == 0:
            return torch.empty(shape, dtype=dtype)
        start = -(-self._used // ALIGN) * ALIGN
        if self._buf is None or start + nbytes > self._buf.shape[0]:
            self._buf = huge_empty((max(self.chunk, nbytes),), torch.uint8)
            start = 0
        self._used = start + nbytes
        self.placed_bytes += nbytes
        return self._buf[start : start + nbytes].view(dtype).view(shape)

    def place(self, t):
        """A copy of the tensor ``t`` in the arena (same shape, dtype; contiguous)."""
        if not isinstance(t, torch.Tensor) or not t.is_cpu:
            raise TypeError(f"t: expected a CPU torch.Tensor, got {type(t).__name__}")
        out = self.empty(t.shape, t.dtype)
        out.copy_(t)
        return out

    def pack(self, *parts):
        """``numkern.convert_weight_packed`` of the row-wise concatenation of the 2-D
        ``parts`` (one dtype and width: q|k|v, gate|up), in the arena.

        The layout packs each block of ``NB`` rows on its own, so the packing of whole
        blocks laid end to end is the whole one's: a part of whole blocks is packed
        straight into its rows (no concatenated copy), and a large one in slices (no
        full-size temporary: a 49K-row LM head's is 56 MB). A 16-bit weight is packed
        viewed as fp32: its layout (``[K/2, nb, 2]`` per block) is the fp32 layout
        (``[K, nb]``) of its element pairs, and torch moves 4-byte units 3-4x faster than
        2-byte pairs (0.33 vs 1.24 ms for a 1536 x 576 bf16 weight, one thread).
        ``tests/test_engine_start.py`` checks the bytes against the plain call.
        """
        for p in parts:
            if not isinstance(p, torch.Tensor) or p.ndim != 2:
                raise TypeError(f"parts: expected 2-D torch.Tensors, got {p!r:.60}")
        if len({(p.dtype, p.shape[1]) for p in parts}) != 1:
            got = [(str(p.dtype), list(p.shape)) for p in parts]
            raise ValueError(f"parts: expected one dtype and width, got {got}")
        if any(p.shape[0] % NB for p in parts[:-1]):  # a block would straddle two parts
            parts = (torch.cat(parts),)
        dtype, k = parts[0].dtype, parts[0].shape[1]
        out = self.empty((sum(p.shape[0] for p in parts), k), dtype)
        rows = max(NB, PACK_ELEMENTS // max(k, 1) // NB * NB)
        r = 0
        for p in parts:
            p = p.contiguous()
            pairs = dtype.itemsize == 2 and k % 2 == 0 and p.storage_offset() % 2 == 0
            for r0 in range(0, p.shape[0], rows):
                src = p[r0 : r0 + rows]
                if pairs:
                    packed = convert_weight_packed(src.view(torch.float32)).view(dtype)
                else:
                    packed = convert_weight_packed(src)
                out[r + r0 : r + r0 + src.shape[0]] = packed
            r += p.shape[0]
        return out


_ARENA = WeightArena()


def place(t):
    """``t`` copied into the process's weight arena (huge pages where the kernel allows)."""
    return _ARENA.place(t)


def weight_empty(shape, dtype):
    """An uninitialised tensor in the process's weight arena (numkern.quant.repack's
    ``empty``: quantised weights are placed as the packed ones are)."""
    return _ARENA.empty(shape, dtype)


def pack(*parts):
    """``numkern.convert_weight_packed`` of the rows of ``parts`` (2-D, concatenated) in
    the process's weight arena (:meth:`WeightArena.pack`)."""
    return _ARENA.pack(*parts)
