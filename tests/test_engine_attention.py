"""engine: a KV-cache group's geometry (ISA, block size, ...) resolved once and handed to
its caches' views and its plans."""

import logging

import pytest
import torch

import numkern.attention as A
from engine import platform as P
from engine.attention import AttentionLayer, AttentionMetadataBuilder
from engine.kv_cache import AttentionSpec, BlockPool, blocks_per_group, group_layers
from numkern import isa as nk_isa

from .test_attention import assert_close_attn, reference


def test_attn_isa_rule(monkeypatch):
    monkeypatch.delenv("NUMKERN_ISA", raising=False)
    amx = nk_isa.amx_usable()
    assert P.get_attn_isa(torch.bfloat16, 128, 80) == "vec16"  # 16 but not 32
    assert P.get_attn_isa(torch.bfloat16, 128, 128) == ("amx" if amx else "vec")
    assert P.get_attn_isa(torch.float32, 128, 128) == "vec"
    assert P.get_attn_isa(torch.bfloat16, 48, 128) == "vec16"  # kernel-level callers only
    assert P.get_moe_isa(torch.bfloat16) == ("amx" if amx else "vec")
    assert P.get_moe_isa(torch.float16) == "vec"
    assert P.isa_overrides() == (None, None)
    monkeypatch.setenv("NUMKERN_ISA", "vec16")
    attn, moe = P.isa_overrides()  # the engine's one read of NUMKERN_ISA
    assert P.get_attn_isa(torch.bfloat16, 128, 128, override=attn) == "vec16"
    assert moe is None
    if not amx:
        monkeypatch.setenv("NUMKERN_ISA", "amx")
        with pytest.raises(ValueError, match="cannot run on this CPU"):
            P.isa_overrides()
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        P.get_attn_isa(torch.bfloat16, 128, 128, "fp8")


def test_decisions_logged_once(caplog, monkeypatch):
    monkeypatch.delenv("NUMKERN_ISA", raising=False)
    caplog.set_level(logging.INFO, logger="engine")
    P._logged.clear()
    for _ in range(3):
        P.get_attn_isa(torch.float16, 64, 64)
    assert sum("attention ISA" in r.getMessage() for r in caplog.records) == 1


def test_block_pool_never_hands_out_twice():
    pool = BlockPool(5)
    a = pool.allocate(3)
    b = pool.allocate(2)
    assert sorted(a + b) == [0, 1, 2, 3, 4] and pool.num_free == 0
    assert pool.allocate(1) is None
    pool.free(a[:1])
    assert pool.allocate(1) == a[:1]
    with pytest.raises(ValueError, match="not allocated"):
        pool.free([b[0], b[0]])


def test_two_groups_each_with_their_own_block_size_and_isa(monkeypatch):
    monkeypatch.delenv("NUMKERN_ISA", raising=False)
    full = AttentionSpec(block_size=128, num_kv_heads=2, head_size=128, dtype=torch.bfloat16)
    swa = AttentionSpec(block_size=32, num_kv_heads=1, head_size=80, dtype=torch.bfloat16,
                        sliding_window=64)  # fmt: skip
    specs = {"l0": full, "l1": swa, "l2": full}
    groups = group_layers(specs)
    assert [g.layer_names for g in groups] == [["l0", "l2"], ["l1"]]
    counts = blocks_per_group(groups, 4 << 20, max_num_seqs=4, max_num_batched_tokens=64)
    # the sliding group: what 4 requests need at most, ceil((64 + 64) / 32) + 1 blocks each
    assert counts[1] == 4 * 5
    layers = {name: AttentionLayer(name, 8, specs[name].num_kv_heads, specs[name].head_size)
              for name in specs}  # fmt: skip
    builders = []
    for g, n in zip(groups, counts):
        g.allocate(n)
        builders.append(AttentionMetadataBuilder(g, [layers[n] for n in g.layer_names]))
    assert builders[0].isa == P.get_attn_isa(torch.bfloat16, 128, 128)
    assert builders[1].isa == "vec16"
    for g, bld, n in zip(groups, builders, counts):  # one geometry per group, no layer ISA
        assert bld.geometry is g.geometry
        want = (n, g.spec.num_kv_heads, g.spec.block_size, g.spec.head_size, bld.isa)
        geo = g.geometry
        assert (geo.num_blocks, geo.num_kv_heads, geo.block_size, geo.head_dim, geo.isa) == want
        assert all(t.shape == A.kv_cache_shape(geo) for t in g.caches.values())
        assert not any(hasattr(layers[n], "isa") for n in g.layer_names)

    reqs = [(5, 5), (1, 70)]
    for g, bld in zip(groups, builders):
        b = g.spec.block_size
        need = [(kl + b - 1) // b for _, kl in reqs]
        blocks = [g.pool.allocate(n) for n in need]
        bt = torch.zeros(len(reqs), max(need), dtype=torch.int32)
        for r, bl in enumerate(blocks):
            bt[r, : len(bl)] = torch.tensor(bl, dtype=torch.int32)
        qsl = torch.tensor([0, 5, 6], dtype=torch.int32)
        sl = torch.tensor([5, 70], dtype=torch.int32)
        hkv, d = g.spec.num_kv_heads, g.spec.head_size
        # the decode request's 69-token context first, then the step's 6 tokens
        ctx = torch.randn(69, hkv, d).bfloat16()
        pos = torch.arange(69)
        step_slots = [bt[0, torch.arange(5) // b].long() * b + torch.arange(5) % b,
                      bt[1, 69 // b].long()[None] * b + 69 % b]  # fmt: skip
        slots = torch.cat(step_slots)
        plan = bld.build(qsl, sl, bt, slots)
        assert (plan.block_size, plan.isa, plan.sliding_window) == (
            b,
            bld.isa,
            g.spec.sliding_window,
        )
        assert plan.geometry is g.geometry and plan.num_blocks == g.pool.num_blocks
        for name in g.layer_names:
            assert A.cache_view(g.caches[name], g.geometry).geometry is plan.geometry
            kc, vc = A.split_kv_cache(g.caches[name])
            A.reshape_and_cache(ctx, ctx, kc, vc, bt[1, pos // b].long() * b + pos % b, bld.isa)
            q = torch.randn(6, 8, d).bfloat16()
            k = torch.randn(6, hkv, d).bfloat16()
            A.reshape_and_cache(k, k, kc, vc, slots, bld.isa)
            out = torch.empty_like(q)
            A.paged_attention(q, kc, vc, out, qsl, sl, bt, scale=d**-0.5,
                              sliding_window=g.spec.sliding_window, isa=bld.isa,
                              plan=plan)  # fmt: skip
            ks = [k[:5], torch.cat([ctx, k[5:]])]
            ref = reference(q, qsl, sl, ks, ks, hkv, scale=d**-0.5,
                            window=g.spec.sliding_window)  # fmt: skip
            assert_close_attn(out, ref)


def test_resolver_rejects_block_size():
    """The group's geometry is where its block size is checked (once)."""
    spec = AttentionSpec(block_size=48, num_kv_heads=1, head_size=64, dtype=torch.float32)
    (group,) = group_layers({"l": spec})
    with pytest.raises(ValueError, match="multiple of 32"):
        group.allocate(4)
