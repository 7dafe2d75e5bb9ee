"""numkern.gdn.gating: the GDN gates (``fused_gdn_gating``: g in fp32, beta in the input's
dtype) against the float64 reference written from the math, serial and parallel, errors
raised before the kernel runs, and vLLM's own op.

Compile budget: one gating kernel, for fp32 and bf16 (the serial/parallel split is a
run-time flag)."""

import pytest
import torch

from numkern.gdn import gating
from numkern.testing import reference as refs
from numkern.testing.tolerances import tolerance

from . import oracle
from .close import assert_within

BF, FP32 = torch.bfloat16, torch.float32


def ref_gating(A_log, a, b, dt_bias):
    g, beta = refs.fused_gdn_gating(A_log, a, b, dt_bias)
    return g[0], beta[0]


@pytest.mark.parametrize("dtype,a_log_dtype", [(FP32, FP32), (BF, FP32)])
def test_gating(dtype, a_log_dtype):
    T, H = 7, 24
    A_log = torch.randn(H).to(a_log_dtype)
    buf = (torch.randn(T, 2 * H + 3) * 8).to(dtype)  # large enough to cross 20
    a, b = buf[:, :H], buf[:, H + 3 :]  # strided rows
    dt_bias = (torch.randn(H) * 8).to(dtype)
    a[0, :4] = torch.tensor([19.5, 20.0, 20.5, -30.0]).to(dtype)
    g, beta = gating.fused_gdn_gating(A_log, a, b, dt_bias)
    assert g.shape == (1, T, H) and g.dtype == FP32 and g.is_contiguous()
    assert beta.shape == (1, T, H) and beta.dtype == dtype
    g_ref, beta_ref = ref_gating(A_log, a, b, dt_bias)
    assert_within(g[0], g_ref, g_ref.abs(), FP32, "gdn_gating")  # exp, log1p: a few fp32 units
    assert_within(beta[0], beta_ref, beta_ref.abs(), dtype, "gdn_gating")


def test_gating_parallel():
    T, H = 300, 16  # >= PARALLEL_GATES
    assert T * H >= gating.PARALLEL_GATES
    A_log, a, b, dt_bias = torch.randn(H), torch.randn(T, H), torch.randn(T, H), torch.randn(H)
    g, beta = gating.fused_gdn_gating(A_log, a, b, dt_bias)
    g_ref, beta_ref = ref_gating(A_log, a, b, dt_bias)
    assert_within(g[0], g_ref, g_ref.abs(), FP32, "gdn_gating")
    assert_within(beta[0], beta_ref, beta_ref.abs(), FP32, "gdn_gating")


# --- errors ----------------------------------------------------------------------------


def _gate(A_log=None, a=None, b=None, dt_bias=None):
    return lambda: gating.fused_gdn_gating(
        torch.zeros(8) if A_log is None else A_log,
        torch.zeros(3, 8).to(BF) if a is None else a,
        torch.zeros(3, 8).to(BF) if b is None else b,
        torch.zeros(8).to(BF) if dt_bias is None else dt_bias,
    )


ERRORS = [
    ("a", TypeError, _gate(a=torch.zeros(3, 8, dtype=torch.int32))),
    ("a", ValueError, _gate(a=torch.zeros(8, 3).to(BF).t())),
    ("A_log", ValueError, _gate(A_log=torch.zeros(9))),
    ("A_log", TypeError, _gate(A_log=torch.zeros(8).half())),
    ("dt_bias", TypeError, _gate(dt_bias=torch.zeros(8))),
    ("b", ValueError, _gate(b=torch.zeros(4, 8).to(BF))),
    ("b", TypeError, _gate(b=torch.zeros(3, 8))),
]


@pytest.mark.parametrize("name,exc,call", ERRORS, ids=[f"{e[0]}-{i}" for i, e in enumerate(ERRORS)])
def test_errors(name, exc, call, monkeypatch):
    """Each bad argument is named, and the kernel does not run (it is replaced by a
    recorder here)."""
    ran = []
    monkeypatch.setattr(gating, "_gating", lambda *a: ran.append("gating"))
    with pytest.raises(exc, match=rf"^{name}: "):
        call()
    assert not ran


# --- vLLM ------------------------------------------------------------------------------


def test_vllm_gating():
    oracle.require_op("causal_conv1d / fused_gdn_gating", oracle.GDN_PROBE)
    vllm_ops = oracle.ops()
    T, H = 9, 32
    A_log = torch.randn(H)
    a, b = (torch.randn(T, H) * 8).to(BF), (torch.randn(T, H) * 4).to(BF)
    dt_bias = torch.randn(H).to(BF)
    g, beta = gating.fused_gdn_gating(A_log, a, b, dt_bias)
    g2, beta2 = vllm_ops.fused_gdn_gating_cpu(A_log, a, b, dt_bias)
    assert g2.shape == g.shape and g2.dtype == g.dtype and beta2.dtype == beta.dtype
    # vLLM's vector exp/log are approximations (exp_u20): the table's gdn_gating_vllm
    t = tolerance("gdn_gating_vllm", FP32)
    assert torch.allclose(g, g2, rtol=t.rel, atol=t.abs)
    assert_within(beta, beta2.double(), beta2.double().abs(), BF, "gdn_gating")
