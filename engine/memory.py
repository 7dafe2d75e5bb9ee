"""Weight memory, collapsed into transparent huge pages once written.

A decode step streams every weight once: ~270 MB per token for SmolLM2-135M, each 4 KB
page a TLB miss. Kernels configured with ``/sys/kernel/mm/transparent_hugepage/enabled``
= ``madvise`` give huge pages only to memory that asks for them, so packed weights are
placed in 2 MB-aligned anonymous mappings advised with ``MADV_HUGEPAGE``. Measured on
the decode GEMV of a 3072 x 576 bf16 weight, read from DRAM: 13.9-14.3 GB/s on 4 KB
pages, 15.3-15.4 GB/s on huge pages (2 threads).

The advice comes after the weights are written (:func:`seal`), not before: with
``defrag`` = ``madvise`` a fault on advised memory waits for the kernel to compact a
free 2 MB page, and placing SmolLM2's 256 MB of packed weights took 0.6-0.9 s longer
that way than on 4 KB pages (median of 5 starts each, AMD EPYC VM with other jobs
running). Written first and advised after, the pages are collapsed into huge pages by
``khugepaged`` in the background (16 MB per 10 s at its default pace): a long-running
engine gets the bandwidth, a short run its start. Where huge pages are unavailable the
advice is ignored.
"""

import math
import mmap

import numpy as np
import torch

from numkern import convert_weight_packed
from numkern.gemm import NB

HUGE = 2 << 20  # bytes per huge page
CHUNK = 64 << 20  # bytes per mapping: weights are bump-allocated into chunks
ALIGN = 64  # every tensor starts on a cache line
PACK_ELEMENTS = 1 << 20  # elements packed per slice: a 2-4 MB temporary, reused


class WeightArena:
    """Bump allocator of tensor storage in 2 MB-aligned anonymous mappings, each advised
    for huge pages once filled (module docstring).

    Tensors placed here keep their mapping alive (``torch.frombuffer`` holds it); the
    arena itself holds only the chunk being filled.
    """

    def __init__(self, chunk=CHUNK):
        self.chunk = chunk
        self._map = self._buf = None
        self._used = 0
        self.placed_bytes = 0

    def _new_chunk(self, nbytes):
        self.seal()
        size = max(self.chunk, -(-nbytes // HUGE) * HUGE)
        self._map = mmap.mmap(-1, size + HUGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        raw = np.frombuffer(self._map, dtype=np.uint8)
        off = (-raw.ctypes.data) % HUGE
        self._buf = raw[off : off + size]
        self._used = 0

    def seal(self):
        """Advise the chunk being filled for huge pages; later tensors go to a new one
        (the rest of this one is never touched, so it takes no memory)."""
        if self._map is not None and hasattr(mmap, "MADV_HUGEPAGE"):
            try:
                self._map.madvise(mmap.MADV_HUGEPAGE)
            except OSError:  # kernel without THP: ordinary pages
                pass
        self._map = self._buf = None

    def empty(self, shape, dtype):
        """An uninitialised contiguous tensor in the arena."""
        shape = tuple(shape)
        nbytes = math.prod(shape) * dtype.itemsize
        if nbytes == 0:
            return torch.empty(shape, dtype=dtype)
        start = -(-self._used // ALIGN) * ALIGN
        if self._buf is None or start + nbytes > self._buf.shape[0]:
            self._new_chunk(nbytes)
            start = 0
        self._used = start + nbytes
        self.placed_bytes += nbytes
        dst = torch.frombuffer(self._buf[start : start + nbytes], dtype=torch.uint8)
        return dst.view(dtype).view(shape)

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
    """``t`` copied into the process's weight arena (huge pages where the kernel allows,
    once sealed)."""
    return _ARENA.place(t)


def pack(*parts):
    """``numkern.convert_weight_packed`` of the rows of ``parts`` (2-D, concatenated) in
    the process's weight arena (:meth:`WeightArena.pack`)."""
    return _ARENA.pack(*parts)


def seal():
    """Advise the weights placed so far for huge pages (:meth:`WeightArena.seal`): once a
    model's weights are all placed."""
    _ARENA.seal()
