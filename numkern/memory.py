"""Tensors the kernels stream: placed in transparent huge pages where the OS allows.

A bandwidth-bound kernel (a decode GEMV, fused MoE at a few tokens per expert) reads its
weight once per call, and on 4 KB pages every 4 KB of it is a TLB miss. Linux kernels
configured with ``/sys/kernel/mm/transparent_hugepage/enabled`` = ``madvise`` (a common
default) give huge pages only to memory that asks for them, and torch's allocator does
not ask. Measured on an AMD EPYC (Zen 4) VM, 2 threads, DRAM-resident data:

* a parallel fp32 sum over 1 GB: 56.6-56.9 GB/s on huge pages, 47.6-48.4 GB/s on 4 KB;
* ``weight_packed_linear`` M=1 over four 11008 x 4096 bf16 weights: 0.86-1.05 of that
  sum's bandwidth on huge pages, 0.83-0.91 on 4 KB pages.

:func:`huge_empty` maps 2 MB-aligned anonymous memory and advises it for huge pages
before it is written, so the first write faults in 2 MB pages (writing 256 MB took
0.04-0.05 s advised against 0.13-0.17 s on 4 KB pages there; with fragmented free memory
a fault may wait for the kernel to compact a 2 MB page). Where huge pages are
unavailable (another OS, THP ``never``) the advice is ignored and the memory is
ordinary. :func:`numkern.convert_weight_packed` and :func:`numkern.moe.prepack_moe_weight`
place results of :data:`HUGE_MIN_BYTES` or more here (:func:`weight_empty`); the engine's
weight arena takes its chunks from here.
"""

import math
import mmap
import operator

import numpy as np
import torch

HUGE_PAGE = 2 << 20  # bytes: the x86-64 transparent huge page
HUGE_MIN_BYTES = 8 << 20  # packed weights from this size on (weight_empty)


def huge_empty(shape, dtype):
    """An uninitialised, contiguous CPU tensor of ``shape`` and ``dtype`` (a
    ``torch.dtype``) in its own 2 MB-aligned anonymous mapping, advised for transparent
    huge pages before anything is written (module docstring). The mapping lives as
    long as the tensor (or any view of it). Zero elements: an ordinary empty tensor.
    """
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"dtype: expected a torch.dtype, got {type(dtype).__name__}")
    try:
        shape = tuple(operator.index(s) for s in shape)
    except TypeError:
        raise TypeError(f"shape: expected a sequence of ints, got {shape!r:.60}") from None
    if any(s < 0 for s in shape):
        raise ValueError(f"shape: expected sizes >= 0, got {list(shape)}")
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes == 0 or not hasattr(mmap, "MAP_ANONYMOUS"):  # (Windows: ordinary memory)
        return torch.empty(shape, dtype=dtype)
    size = -(-nbytes // HUGE_PAGE) * HUGE_PAGE
    m = mmap.mmap(-1, size + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    raw = np.frombuffer(m, dtype=np.uint8)
    off = (-raw.ctypes.data) % HUGE_PAGE  # a multiple of 4 KB: mmap is page-aligned
    if hasattr(mmap, "MADV_HUGEPAGE"):
        try:
            m.madvise(mmap.MADV_HUGEPAGE, off, size)
        except OSError:  # a kernel without THP: ordinary pages
            pass
    buf = torch.frombuffer(raw[off : off + nbytes], dtype=torch.uint8)  # holds the mapping
    return buf.view(dtype).view(shape)


def weight_empty(shape, dtype):
    """Storage for a packed weight: :func:`huge_empty` from :data:`HUGE_MIN_BYTES`, below
    that ``torch.empty`` (a small weight stays in the caches; a mapping per small tensor
    would cost more than it saves)."""
    if math.prod(shape) * dtype.itemsize >= HUGE_MIN_BYTES:
        return huge_empty(shape, dtype)
    return torch.empty(shape, dtype=dtype)
