"""numkern.testing's public helpers: ``assert_close`` (its unit is the output dtype's
last place: n ulps pass, n+1 fail and are named) and the input builders (valid inputs of
the ops, accepted by them)."""

import pytest
import torch

import numkern
from numkern import attention as A
from numkern.testing import assert_close, packed_weight, random_block_table, random_routing
from numkern.testing.compare import DEFAULT_ULPS, ulp


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_assert_close_counts_ulps(dtype):
    e = torch.tensor([1.5, -3.25, 1000.0, 0.0625], dtype=torch.float64)
    unit = ulp(e.to(dtype), dtype)
    n = DEFAULT_ULPS[dtype]
    assert_close((e + n * unit).to(dtype), e)  # n ulps: close
    assert_close((e - n * unit).to(dtype), e)
    bad = e + n * unit
    bad[2] = e[2] + (n + 1) * unit[2]  # one ulp too many, at index 2
    with pytest.raises(AssertionError) as info:
        assert_close(bad.to(dtype), e)
    msg = str(info.value)
    assert msg.startswith(f"1 of 4 elements differ by more than {n} ulp")
    assert "index (2,)" in msg and "index (0,)" not in msg
    assert_close(bad.to(dtype), e, ulps=n + 1)  # the bound moves with ulps


def test_assert_close_nan_inf_shape_and_atol():
    e = torch.tensor([[float("nan"), float("inf")], [1.0, 0.0]])
    assert_close(e.clone(), e)
    with pytest.raises(AssertionError, match=r"index \(0, 0\)"):
        assert_close(torch.tensor([[0.0, float("inf")], [1.0, 0.0]]), e)  # NaN expected
    with pytest.raises(AssertionError, match=r"index \(0, 1\)"):
        assert_close(torch.tensor([[float("nan"), -float("inf")], [1.0, 0.0]]), e)
    near_zero = torch.tensor([[float("nan"), float("inf")], [1.0, 1e-6]])
    with pytest.raises(AssertionError, match=r"index \(1, 1\)"):
        assert_close(near_zero, e)
    assert_close(near_zero, e, atol=1e-5)
    with pytest.raises(ValueError, match="expected: shape"):
        assert_close(e, e[0])
    with pytest.raises(TypeError, match="actual: expected a float dtype"):
        assert_close(e.int(), e)


def test_random_block_table_is_a_valid_step():
    bt = random_block_table([5, 37, 1], [5, 1, 1], block_size=16, num_blocks=8, seed=3)
    assert bt.block_table.dtype == torch.int32 and bt.block_table.shape == (3, 3)
    used = bt.block_table[bt.block_table >= 0]
    assert used.unique().numel() == used.numel() == 1 + 3 + 1  # distinct blocks
    assert bt.query_start_loc.tolist() == [0, 5, 6, 7]
    assert bt.slot_mapping.unique().numel() == 7
    # request 1's new key is position 36: block 36 // 16 = 2 of its row, offset 4
    assert bt.slot_mapping[5] == bt.block_table[1, 2] * 16 + 4
    A.plan_attention(
        bt.query_start_loc,
        bt.seq_lens,
        num_heads=4,
        num_kv_heads=2,
        head_dim=32,
        block_size=16,
        isa="vec16",
        block_table=bt.block_table,
        slot_mapping=bt.slot_mapping,
        num_blocks=8,
    )  # fmt: skip  (the op's own checks accept it)
    with pytest.raises(ValueError, match="num_blocks: the requests need 5 blocks"):
        random_block_table([5, 37, 1], [5, 1, 1], block_size=16, num_blocks=4)
    with pytest.raises(ValueError, match=r"query_lens\[0\]: expected <= seq_lens\[0\]"):
        random_block_table([5], [6], block_size=16, num_blocks=4)


def test_random_routing_and_packed_weight():
    w, ids = random_routing(9, 16, 4, seed=1)
    assert ids.dtype == torch.int32 and w.dtype == torch.float32 and ids.shape == (9, 4)
    assert all(len(set(r)) == 4 for r in ids.tolist()) and 0 <= ids.min() and ids.max() < 16
    torch.testing.assert_close(w.sum(1), torch.ones(9))
    with pytest.raises(ValueError, match="topk: expected <= num_experts"):
        random_routing(1, 2, 3)
    raw, packed = packed_weight(48, 64, torch.bfloat16, seed=2)
    x = torch.randn(3, 64).to(torch.bfloat16)
    out = torch.empty(3, 48, dtype=torch.bfloat16)
    numkern.weight_packed_linear(out, x, packed, None, True)
    assert_close(out, x.float() @ raw.float().T)
