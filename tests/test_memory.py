"""numkern.memory: storage of the tensors the kernels stream, in 2 MB-aligned mappings
advised for transparent huge pages (the advice is checked in /proc/self/smaps, where the
kernel records it as the mapping's ``hg`` flag)."""

import mmap
import sys

import pytest
import torch

import numkern
from numkern import memory
from numkern.testing.tolerances import tolerance

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


def test_packed_weights_from_the_threshold_are_advised_and_packed_alike(monkeypatch):
    """convert_weight_packed and prepack_moe_weight place results of HUGE_MIN_BYTES or
    more in advised memory, and pack random weights there bit for bit as in ordinary
    memory (the threshold raised past them; the packing itself is checked against a
    reference in test_gemm / test_moe). Random, not zero, weights: a packing into the
    mapping that dropped or misplaced bytes would leave zeros equal to zeros."""
    k = 1024
    n = memory.HUGE_MIN_BYTES // (2 * k)  # exactly the threshold, bf16
    g = torch.Generator().manual_seed(5)
    w = torch.randn(n, k, generator=g).to(torch.bfloat16)
    w_moe = torch.randn(2, n // 2, k, generator=g).to(torch.bfloat16)
    big = numkern.convert_weight_packed(w)
    moe = numkern.moe.prepack_moe_weight(w_moe, "vec")
    small = numkern.convert_weight_packed(w[:64])
    assert big.data_ptr() % memory.HUGE_PAGE == 0 and moe.data_ptr() % memory.HUGE_PAGE == 0
    if ADVISES:
        assert "hg" in _vm_flags(big.data_ptr()) and "hg" in _vm_flags(moe.data_ptr())
        assert small.numel() * 2 < memory.HUGE_MIN_BYTES
    monkeypatch.setattr(memory, "HUGE_MIN_BYTES", 1 << 62)  # every result in torch.empty
    plain = numkern.convert_weight_packed(w)
    plain_moe = numkern.moe.prepack_moe_weight(w_moe, "vec")
    assert torch.equal(big.view(torch.int16), plain.view(torch.int16))
    assert torch.equal(moe.view(torch.int16), plain_moe.view(torch.int16))
    # and the packed weight in the mapping multiplies as W: one row through the linear
    x = torch.randn(1, k, generator=g).to(torch.bfloat16)
    out = torch.empty(1, n, dtype=torch.bfloat16)
    numkern.weight_packed_linear(out, x, big, None, True)
    # fp32 sums of 1024 products of magnitude ~1, rounded once to bf16 (2^-9 relative)
    tol = tolerance("linear_torch", torch.bfloat16)
    torch.testing.assert_close(out.float(), x.float() @ w.float().T, atol=tol.abs, rtol=tol.rel)
