"""engine.Linear: the dispatch packs once, owns an fp32 bias, and logs its choice once."""

import logging

import torch

from engine import Linear, dispatch_unquantized_gemm
from engine import platform as P

from .test_gemm import assert_close_linear


def test_dispatch_nn_linear_matches_reference(caplog):
    caplog.set_level(logging.INFO, logger="engine")
    P._logged.clear()
    lin = torch.nn.Linear(96, 80, bias=True).to(torch.bfloat16)
    layer = dispatch_unquantized_gemm(lin)
    assert layer.bias.dtype == torch.float32
    assert layer.bias.data_ptr() != lin.bias.data_ptr()  # its own copy
    x = torch.randn(2, 3, 96).bfloat16()
    y = layer(x)
    assert y.shape == (2, 3, 80) and y.dtype == torch.bfloat16
    assert_close_linear(y.reshape(-1, 80), x.reshape(-1, 96), lin.weight, lin.bias.float())
    # converting again is not needed: changing the module's bias does not reach the layer
    with torch.no_grad():
        lin.bias.add_(100)
    assert torch.equal(layer(x), y)
    # a second layer of the same dtype logs nothing new
    Linear(torch.randn(32, 64).bfloat16())
    msgs = [r.getMessage() for r in caplog.records if "GEMM path" in r.getMessage()]
    assert len(msgs) == 1 and "numkern packed kernel" in msgs[0]


def test_router_without_bias_and_out_buffer():
    w = torch.randn(64, 128)  # an fp32 router gate: E=64 experts, H=128
    gate = Linear(w)
    x = torch.randn(5, 128)
    out = torch.empty(5, 64)
    y = gate(x, out=out)
    assert y.data_ptr() == out.data_ptr()
    assert_close_linear(y, x, w, None)


def test_weight_arena_copies_exactly_and_outlives_the_arena():
    """engine.memory: copies land 64-byte aligned, byte-identical, across chunk
    boundaries, and stay valid after the arena that made them is gone."""
    from engine.memory import WeightArena

    arena = WeightArena(chunk=1 << 20)
    src = [torch.randn(300, 700).to(torch.bfloat16), torch.randn(600, 600), torch.arange(7)]
    out = [arena.place(t) for t in src]  # the 1.44 MB fp32 tensor needs a chunk of its own
    del arena
    for s, o in zip(src, out):
        assert o.data_ptr() % 64 == 0 and o.dtype == s.dtype and torch.equal(o, s)
