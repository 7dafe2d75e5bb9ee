"""numkern.rope: rotary embedding against a float64 loop over pairs, partial rotary, both
pair layouts, strided rows, the row kernel, errors, vLLM."""

import math

import pytest
import torch

from numkern import _check as C
from numkern import rope as R
from numkern.testing import reference as refs

from . import oracle
from .close import assert_within, within

BF, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32


def heads_of(x, head_size):
    """``x``'s shape as [T, heads, head_size]."""
    return x.shape[0], math.prod(x.shape[1:]) // head_size, head_size


def reference(x, positions, cache, head_size, is_neox):
    """float64 loop over pairs: ``(a, b) -> (a c - b s, b c + a s)``; returns the result
    and the magnitude |a c| + |b s| of each element's terms (|x| where nothing rotates)."""
    return refs.rotate(x, positions, cache, head_size, is_neox, magnitude=True)


def cos_sin(n_pos, rot_dim, dtype):
    """A real rotary table (theta 10000): cos and sin of position x frequency."""
    inv = 1.0 / 10000 ** (torch.arange(0, rot_dim, 2, dtype=torch.float64) / rot_dim)
    ang = torch.arange(n_pos, dtype=torch.float64)[:, None] * inv
    return torch.cat([ang.cos(), ang.sin()], dim=1).to(dtype)


def check(x, x0, positions, cache, head_size, is_neox, dtype):
    ref, mag = reference(x0, positions, cache, head_size, is_neox)
    assert_within(x, ref, mag, dtype, "rope")
    rot = cache.shape[1]
    h, h0 = x.reshape(heads_of(x, head_size)), x0.reshape(heads_of(x, head_size))
    assert torch.equal(h[..., rot:], h0[..., rot:])  # partial rotary: the rest untouched


@pytest.mark.parametrize(
    "dtype,cdtype,t_n,hq,hk,head_size,rot_dim,is_neox,ndim",
    [
        (FP32, FP32, 5, 3, 1, 40, 40, True, 2),  # 16 pairs a vector, 4 in the tail
        (BF, FP32, 70, 4, 2, 64, 64, True, 3),  # >= PARALLEL_ROWS: the prange path
        (FP16, FP16, 3, 2, 2, 64, 24, True, 2),  # partial rotary
        (BF, BF, 4, 2, 1, 32, 16, False, 2),  # GPT-J pairs, partial
        (FP32, FP32, 1, 1, 0, 13, 10, False, 3),  # key None, odd head size
        (BF, FP32, 0, 2, 2, 16, 16, True, 2),  # no tokens
    ],
)
def test_rotary_embedding(dtype, cdtype, t_n, hq, hk, head_size, rot_dim, is_neox, ndim):
    cache = cos_sin(300, rot_dim, cdtype)
    positions = torch.randint(0, 300, (t_n,))
    shape = (lambda h: (t_n, h, head_size)) if ndim == 3 else (lambda h: (t_n, h * head_size))
    q = torch.randn(shape(hq)).to(dtype)
    k = torch.randn(shape(hk)).to(dtype) if hk else None
    q0 = q.clone()
    k0 = k.clone() if hk else None
    assert R.rotary_embedding(positions, q, k, head_size, cache, is_neox) is None
    check(q, q0, positions, cache, head_size, is_neox, dtype)
    if hk:
        check(k, k0, positions, cache, head_size, is_neox, dtype)


@pytest.mark.parametrize("is_neox", [True, False])
def test_rotary_embedding_fused_qkv_columns(is_neox):
    """q and k are column windows of one qkv buffer (row stride (hq + 2 hk) d); the v
    columns stay as they were. NumPy positions and cache."""
    t_n, hq, hk, d = 6, 4, 2, 48
    qkv = torch.randn(t_n, (hq + 2 * hk) * d).to(FP16)
    q, k, v = qkv.split([hq * d, hk * d, hk * d], dim=1)
    q0, k0, v0 = q.clone(), k.clone(), v.clone()
    cache = cos_sin(50, 32, FP32)
    positions = torch.arange(40, 40 + t_n)
    R.rotary_embedding(positions.numpy(), q, k, d, cache.numpy(), is_neox)
    check(q, q0, positions, cache, d, is_neox, FP16)
    check(k, k0, positions, cache, d, is_neox, FP16)
    assert torch.equal(v, v0)


def test_rotary_embedding_refuses_shared_key():
    """A key that shares elements with the query (the same tensor, overlapping columns of
    one buffer, the same memory as NumPy) is a ValueError naming key; the values stay."""
    qkv = torch.randn(3, 96).to(BF)
    q0 = qkv.clone()
    cache = cos_sin(8, 16, FP32)
    positions = torch.tensor([0, 3, 7])
    for q, k in [
        (qkv[:, :32], qkv[:, :32]),
        (qkv[:, :64], qkv[:, 48:80]),
        (qkv.view(3, 6, 16)[:, :2], qkv.view(3, 6, 16)[:, 1:3]),
        (qkv.float()[:, :32], None),
    ]:
        if k is None:
            k = q.numpy()
        with pytest.raises(ValueError, match=r"^key: expected memory apart from query"):
            R.rotary_embedding(positions, q, k, 16, cache, True)
    assert torch.equal(qkv, q0)
    R.rotary_embedding(positions, qkv[:, :32], qkv[:, 32:48], 16, cache, True)  # adjacent


@pytest.mark.parametrize("dtype", [BF, FP16, FP32])
def test_row_kernel(dtype):
    """The decoder's contract: 1-D carrier, row stride ``row``, heads from the row start,
    only rows t0..t1 and their first ``heads`` heads rotated; fp32 2-D cos_sin."""
    t_n, heads, all_heads, d, rot, t0, t1 = 5, 2, 3, 24, 16, 1, 4
    x = torch.randn(t_n, all_heads * d).to(dtype)
    x0 = x.clone()
    cache = cos_sin(20, rot, FP32)
    positions = torch.tensor([3, 0, 19, 7, 11])
    flat, row = C.as_numpy(x).reshape(-1), all_heads * d
    R._rows(flat, positions.numpy(), cache.numpy(), t0, t1, heads, d, rot, row, True)
    part = slice(0, heads * d)
    check(x[t0:t1, part], x0[t0:t1, part], positions[t0:t1], cache, d, True, dtype)
    assert torch.equal(x[:t0], x0[:t0]) and torch.equal(x[t1:], x0[t1:])
    assert torch.equal(x[:, heads * d :], x0[:, heads * d :])


def test_tolerance_bites():
    """Rotating by the neighbouring position, or a result two units off, fails."""
    cache = cos_sin(100, 64, FP32)
    positions = torch.tensor([5, 50, 98])
    q = torch.randn(3, 2 * 64).to(BF)
    ref, mag = reference(q, positions, cache, 64, True)
    wrong = q.clone()
    R.rotary_embedding(positions + 1, wrong, None, 64, cache, True)
    assert not within(wrong, ref, mag, BF, "rope")[0]
    R.rotary_embedding(positions, q, None, 64, cache, True)
    assert within(q, ref, mag, BF, "rope")[0]
    bits = q.view(torch.int16).clone()
    bits[2, 7] += 2
    assert not within(bits.view(BF), ref, mag, BF, "rope")[0]


def _call(positions=None, query=None, key=None, head_size=16, cache=None, is_neox=True):
    positions = torch.zeros(3, dtype=torch.int64) if positions is None else positions
    query = torch.zeros(3, 32, dtype=BF) if query is None else query
    cache = torch.zeros(8, 16) if cache is None else cache
    R.rotary_embedding(positions, query, key, head_size, cache, is_neox)


ERRORS = [
    ("positions", TypeError, lambda: _call(positions=torch.zeros(3, dtype=torch.int32))),
    ("positions", ValueError, lambda: _call(positions=torch.zeros(3, 1, dtype=torch.int64))),
    ("positions", ValueError, lambda: _call(positions=torch.zeros(6, dtype=torch.int64)[::2])),
    ("positions", ValueError, lambda: _call(positions=torch.tensor([0, 8, 1]))),
    ("positions", ValueError, lambda: _call(positions=torch.tensor([0, -1, 1]))),
    ("query", TypeError, lambda: _call(query=torch.zeros(3, 32, dtype=torch.int32))),
    ("query", ValueError, lambda: _call(query=torch.zeros(3, 30, dtype=BF))),
    ("query", ValueError, lambda: _call(query=torch.zeros(4, 32, dtype=BF))),
    ("query", ValueError, lambda: _call(query=torch.zeros(32, 3, dtype=BF).t())),
    ("query", ValueError, lambda: _call(query=torch.zeros(3, 2, 8, dtype=BF))),
    ("query", ValueError, lambda: _call(query=torch.zeros(3, 2, 32, dtype=BF)[..., :16])),
    ("query", ValueError, lambda: _call(query=torch.zeros(3, 32, dtype=BF)[:, None, :])),
    ("key", TypeError, lambda: _call(key=torch.zeros(3, 16, dtype=FP16))),
    ("key", ValueError, lambda: _call(key=torch.zeros(2, 16, dtype=BF))),
    ("key", ValueError, lambda: _call(key=torch.zeros(3, 24, dtype=BF))),
    ("head_size", TypeError, lambda: _call(head_size=16.0)),
    ("head_size", ValueError, lambda: _call(head_size=0)),
    ("cos_sin_cache", TypeError, lambda: _call(cache=torch.zeros(8, 16, dtype=FP16))),
    ("cos_sin_cache", ValueError, lambda: _call(cache=torch.zeros(8, 16, 1))),
    ("cos_sin_cache", ValueError, lambda: _call(cache=torch.zeros(16, 8).t())),
    ("cos_sin_cache", ValueError, lambda: _call(cache=torch.zeros(8, 18))),
    ("cos_sin_cache", ValueError, lambda: _call(cache=torch.zeros(8, 7))),
    ("is_neox", TypeError, lambda: _call(is_neox=1)),
]


@pytest.mark.parametrize("name,exc,call", ERRORS, ids=[f"{e[0]}-{i}" for i, e in enumerate(ERRORS)])
def test_errors(name, exc, call):
    with pytest.raises(exc, match=rf"^{name}: "):
        call()


# vLLM's CPU op takes the cache in the query's dtype and 2-D [T, H * head_size] rows
# (its 3-D handling treats the heads as tokens): compared on that subset.
@pytest.mark.parametrize(
    "dtype,rot_dim,is_neox", [(BF, 64, True), (FP32, 32, True), (BF, 64, False), (FP16, 40, False)]
)
def test_vllm_rotary_embedding(dtype, rot_dim, is_neox):
    ops = oracle.ops()
    t_n, hq, hk, d = 7, 4, 2, 64
    cache = cos_sin(128, rot_dim, dtype)
    positions = torch.randint(0, 128, (t_n,))
    q, k = torch.randn(t_n, hq * d).to(dtype), torch.randn(t_n, hk * d).to(dtype)
    q2, k2 = q.clone(), k.clone()
    ref_q, mag_q = reference(q, positions, cache, d, is_neox)
    mag_k = reference(k, positions, cache, d, is_neox)[1]
    R.rotary_embedding(positions, q, k, d, cache, is_neox)
    ops.rotary_embedding(positions, q2, k2, d, cache, is_neox)
    assert_within(q, q2.double(), mag_q, dtype, "rope")
    assert_within(k, k2.double(), mag_k, dtype, "rope")
    assert_within(q2, ref_q, mag_q, dtype, "rope")  # and vLLM itself within the reference's bound
