"""numkern.memory: storage of the tensors the kernels stream, in 2 MB-aligned mappings
advised for transparent huge pages (the advice is checked in /proc/self/smaps, where the
kernel records it as the mapping's ``hg`` flag)."""

import mmap
import sys

import pytest
import torch

import numkern
from numkern import memory

ADVISES = sys.platform == "linux" and hasattr(mmap, "MADV_HUGEPAGE")


def _vm_flags(addr):
    """The VmFlags of the mapping of /proc/self/smaps that holds ``addr``."""
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= addr < hi
            elif inside and head == "VmFlags:":
                return line.split()[1:]
    raise AssertionError(f"no mapping holds {addr:#x}")


@pytest.mark.parametrize(
    ("shape", "dtype"), [((3, 1000, 7), torch.bfloat16), ((5 << 20,), torch.float32)]
)
def test_huge_empty_is_aligned_advised_and_writable(shape, dtype):
    t = numkern.huge_empty(shape, dtype)
    assert t.shape == shape and t.dtype == dtype and t.is_contiguous()
    assert t.data_ptr() % memory.HUGE_PAGE == 0
    src = torch.randn(shape).to(dtype)
    t.copy_(src)
    assert torch.equal(t, src)
    if ADVISES:
        assert "hg" in _vm_flags(t.data_ptr())
        assert "hg" in _vm_flags(t.data_ptr() + t.numel() * t.element_size() - 1)


def test_huge_empty_outlives_its_names():
    """The mapping lives as long as any view of the tensor."""
    t = numkern.huge_empty((4 << 20,), torch.uint8)
    t.fill_(7)
    view = t[1:].view(torch.uint8)
    del t
    assert int(view[-1]) == 7 and int(view.sum()) == 7 * ((4 << 20) - 1)


def test_huge_empty_refuses_bad_arguments():
    with pytest.raises(TypeError, match=r"dtype: expected a torch\.dtype"):
        numkern.huge_empty((4,), "bfloat16")
    for shape in (None, (2, 2.5), 3):
        with pytest.raises(TypeError, match="shape: expected a sequence of ints"):
            numkern.huge_empty(shape, torch.float32)
    with pytest.raises(ValueError, match=r"shape: expected sizes >= 0, got \[2, -1\]"):
        numkern.huge_empty((2, -1), torch.float32)
    assert numkern.huge_empty((0, 3), torch.float32).shape == (0, 3)


def test_packed_weights_from_the_threshold_are_advised():
    """convert_weight_packed and prepack_moe_weight place results of HUGE_MIN_BYTES or
    more in advised memory (the packing itself is tested in test_gemm / test_moe)."""
    k = 1024
    n = memory.HUGE_MIN_BYTES // (2 * k)  # exactly the threshold, bf16
    big = numkern.convert_weight_packed(torch.zeros(n, k, dtype=torch.bfloat16))
    moe = numkern.moe.prepack_moe_weight(torch.zeros(2, n // 2, k, dtype=torch.bfloat16), "vec")
    small = numkern.convert_weight_packed(torch.zeros(64, k, dtype=torch.bfloat16))
    assert big.data_ptr() % memory.HUGE_PAGE == 0 and moe.data_ptr() % memory.HUGE_PAGE == 0
    if ADVISES:
        assert "hg" in _vm_flags(big.data_ptr()) and "hg" in _vm_flags(moe.data_ptr())
        assert small.numel() * 2 < memory.HUGE_MIN_BYTES
