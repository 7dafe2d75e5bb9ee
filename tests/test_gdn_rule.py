"""numkern.gdn.rule: the gated delta rule (recurrent and chunked forms) against a float64
loop over tokens, against each other, argument errors, and vLLM's CPU ops."""

import math

import numpy as np
import pytest
import torch

from numkern.gdn import rule as R
from numkern.gdn import rule_recurrent
from numkern.testing import reference as refs
from numkern.testing.tolerances import tolerance

from . import oracle

BF, FP32 = torch.bfloat16, torch.float32
# The bounds (numkern.testing.tolerances, with why): gdn_rule (one rounding of the output
# plus fp32 slack of the largest entry) and gdn_rule_dp (the chunked form's bf16 path)
DP_BOUND = tolerance("gdn_rule_dp", BF).peak

# Chunk boundaries inside and across requests: 1, C-1, C, C+1 and 2C+2 tokens.
LENS = (1, 63, 64, 65, 130)


def reference(q, k, v, g, beta, state, slots, cu, l2norm, eps):
    """float64 loop over tokens: outputs [T, Hv, Dv] and the updated pool (a copy);
    ``q, k [T, Hk, Dk]``, ``v [T, Hv, Dv]``, ``g``/``beta [T, Hv]``, state ``[S, Hv, Dk,
    Dv]`` (S[k, v]); a negative slot leaves its tokens' outputs at zero."""
    return refs.delta_rule(q, k, v, g, beta, state, slots, cu, l2norm, eps)


def gating(A_log, dt_bias, a, b, sp_beta=1.0, sp_thr=20.0):
    """float64 g and beta [T, Hv] of the fused gating (torch's softplus)."""
    return refs.gdn_gating(A_log, dt_bias, a, b, sp_beta, sp_thr)


def assert_close(out, ref, dtype, what="output"):
    """Within one rounding unit of ``dtype`` of the float64 result plus fp32 slack (the
    table's gdn_rule)."""
    out, ref = out.double(), ref.double()
    t = tolerance("gdn_rule", dtype)
    tol = t.rel * ref.abs() + t.peak * ref.abs().max()
    worst = ((out - ref).abs() / tol).max().item()
    assert worst <= 1.0, f"{what}: worst error {worst:.3g} x tolerance"


def assert_chunked(out, ref, dtype, what="output"):
    """The chunked op's accuracy: :func:`assert_close`, or :data:`DP_BOUND` of the
    largest entry on the bf16 path."""
    if dtype == BF and R.DP_BF16:
        err = (out.double() - ref.double()).abs().max() / ref.double().abs().max()
        assert err <= DP_BOUND, f"{what}: {err:.3g} of the largest entry (bf16 path)"
    else:
        assert_close(out, ref, dtype if what == "output" else FP32, what)


def case(lens, hk, hv, dk, dv, dtype, l2norm, slots, num_slots):
    """q, k, v as column windows of one fused [1, T, W] buffer (vLLM's split of mixed
    qkv: strided tokens), a pool with random states, cu_seqlens and slots."""
    t_n = sum(lens)
    qk, vw = hk * dk, hv * dv
    mixed = torch.randn(1, t_n, 2 * qk + vw)
    if not l2norm:  # keep |k| near 1: the delta rule is unstable for beta |k|^2 > 2
        mixed[..., qk : 2 * qk] *= dk**-0.5
    mixed = mixed.to(dtype)
    q = mixed[..., :qk].view(1, t_n, hk, dk)
    k = mixed[..., qk : 2 * qk].view(1, t_n, hk, dk)
    v = mixed[..., 2 * qk :].view(1, t_n, hv, dv)
    pool = torch.randn(num_slots, hv, dk, dv) * 0.1
    cu = torch.tensor(np.cumsum((0, *lens)), dtype=torch.int32)
    return q, k, v, pool, cu, torch.tensor(slots, dtype=torch.int32)


# ---------------------------------------------------------------------------------------
# against the float64 loop


@pytest.mark.parametrize("dtype", [FP32, BF])
@pytest.mark.parametrize("l2norm", [True, False])
def test_chunked_matches_loop(dtype, l2norm):
    """Varlen, chunk boundaries inside and across requests, GQA (Hv = 2 Hk), Dk != Dv,
    a padded request (-1), one request starting from a zero state, untouched slots."""
    hk, hv, dk, dv = 2, 4, 32, 48
    q, k, v, pool, cu, slots = case(LENS, hk, hv, dk, dv, dtype, l2norm, [3, 0, -1, 5, 1], 7)
    pool[0] = 0.0  # request 1 has no initial state
    t_n = q.shape[1]
    g = -torch.rand(1, t_n, hv) * 0.2
    beta = torch.rand(1, t_n, hv).to(dtype)
    ref_o, ref_s = reference(q[0], k[0], v[0], g[0], beta[0], pool, slots, cu, l2norm, 1e-5)
    before = pool.clone()
    out, final = R.chunk_gated_delta_rule(q, k, v, g, beta, pool, True, cu, False, l2norm, slots)
    assert final is pool and out.shape == (1, t_n, hv, dv) and out.dtype == dtype
    assert_chunked(out[0], ref_o, dtype)
    assert_chunked(pool, ref_s, dtype, "state")
    assert torch.equal(pool[[2, 4, 6]], before[[2, 4, 6]])  # slots no request names
    assert not out[0, cu[2] : cu[3]].any()  # the padded request's rows


@pytest.mark.parametrize("dtype", [FP32, BF])
@pytest.mark.parametrize(
    "l2norm,sp_beta,sp_thr", [(True, 1.0, 20.0), (False, 0.5, 1.0)]
)  # the second: softplus' linear branch on about half the inputs
def test_recurrent_matches_loop(dtype, l2norm, sp_beta, sp_thr):
    """The recurrent form over multi-token requests (decode is the one-token case)."""
    hk, hv, dk, dv = 1, 3, 16, 32
    lens = (1, 2, 17, 0, 5)
    q, k, v, pool, cu, slots = case(lens, hk, hv, dk, dv, dtype, l2norm, [4, -1, 0, 2, 1], 5)
    t_n = q.shape[1]
    A_log, dt_bias = torch.randn(hv) * 0.5, torch.randn(hv).to(dtype)
    a, b = torch.randn(t_n, hv).to(dtype), torch.randn(t_n, hv).to(dtype)
    g, beta = gating(A_log, dt_bias, a, b, sp_beta, sp_thr)
    ref_o, ref_s = reference(q[0], k[0], v[0], g, beta, pool, slots, cu, l2norm, 1e-5)
    before = pool.clone()
    out = R.fused_sigmoid_gating_delta_rule_update(
        A_log, dt_bias, q, k, v, a, b, pool, slots, cu, l2norm, sp_beta, sp_thr
    )
    assert out.shape == (t_n, 1, hv, dv) and out.dtype == dtype
    assert_close(out[:, 0], ref_o, dtype)
    assert_close(pool, ref_s, FP32, "state")
    assert torch.equal(pool[3], before[3]) and not out[cu[1] : cu[2]].any()


def test_recurrent_checked_path_agrees():
    """A memoised call and the same call checked afresh (NumPy index vectors, an int
    softplus_beta, fp32 A_log as a NumPy array: never memoised): bit for bit."""
    hk, hv, dk, dv = 1, 2, 16, 16
    q, k, v, pool, cu, slots = case((1, 1, 1), hk, hv, dk, dv, BF, True, [2, -1, 0], 3)
    A_log, dt_bias = torch.randn(hv) * 0.5, torch.randn(hv).to(BF)
    a, b = torch.randn(3, hv).to(BF), torch.randn(3, hv).to(BF)
    pools = [pool.clone(), pool.clone()]
    fast = R.fused_sigmoid_gating_delta_rule_update(
        A_log, dt_bias, q, k, v, a, b, pools[0], slots, cu, True, 1.0, 20.0
    )
    checked = R.fused_sigmoid_gating_delta_rule_update(
        A_log.numpy(), dt_bias, q, k, v, a, b, pools[1], slots.numpy(), cu.numpy(), True, 1, 20
    )
    assert torch.equal(fast, checked) and torch.equal(pools[0], pools[1])


def test_prefill_then_decode_agrees_with_recurrent():
    """Chunked prefill of all but each request's last token (one request has none), then
    one recurrent decode step: the outputs and states of one recurrent pass over all."""
    hk, hv, dk, dv = 2, 4, 32, 32
    q, k, v, pool, cu, slots = case(LENS, hk, hv, dk, dv, FP32, True, [2, 0, 4, 1, 3], 5)
    t_n = q.shape[1]
    A_log, dt_bias = torch.randn(hv) * 0.5, torch.randn(hv)
    a, b = torch.randn(t_n, hv), torch.randn(t_n, hv)
    whole = pool.clone()
    ref = R.fused_sigmoid_gating_delta_rule_update(
        A_log, dt_bias, q, k, v, a, b, whole, slots, cu, True
    )
    last = (cu[1:] - 1).long()
    keep = torch.ones(t_n, dtype=torch.bool)
    keep[last] = False
    g, beta = gating(A_log, dt_bias, a, b)
    pre_cu = (cu - torch.arange(len(cu))).int()
    pre, _ = R.chunk_gated_delta_rule(
        q[:, keep],
        k[:, keep],
        v[:, keep],
        g[None, keep].float(),
        beta[None, keep].float(),
        pool,
        True,
        pre_cu,
        False,
        True,
        slots,
    )
    dec = R.fused_sigmoid_gating_delta_rule_update(
        A_log,
        dt_bias,
        q[:, last],
        k[:, last],
        v[:, last],
        a[last],
        b[last],
        pool,
        slots,
        torch.arange(len(cu), dtype=torch.int32),
        True,
    )
    assert_close(pre[0], ref[keep, 0], FP32, "prefill")
    assert_close(dec[:, 0], ref[last, 0], FP32, "decode")
    assert_close(pool, whole, FP32, "state")


# ---------------------------------------------------------------------------------------
# errors: raised before any kernel runs (the pool is unchanged)


def _valid(dtype=BF):
    t_n, hk, hv, d = 3, 2, 4, 16
    q, k, v, pool, cu, slots = case((1, 2), hk, hv, d, d, dtype, True, [1, 0], 2)
    args = dict(
        A_log=torch.zeros(hv),
        dt_bias=torch.zeros(hv, dtype=dtype),
        q=q,
        k=k,
        v=v,
        a=torch.zeros(t_n, hv, dtype=dtype),
        b=torch.zeros(t_n, hv, dtype=dtype),
        initial_state_source=pool,
        initial_state_indices=slots,
        cu_seqlens=cu,
        use_qk_l2norm_in_kernel=True,
    )
    chunk = dict(
        query=q,
        key=k,
        value=v,
        g=torch.zeros(1, t_n, hv),
        beta=torch.zeros(1, t_n, hv),
        initial_state=pool,
        output_final_state=True,
        cu_seqlens=cu,
        head_first=False,
        use_qk_l2norm_in_kernel=True,
        initial_state_indices=slots,
    )
    return args, chunk


I32 = torch.int32
BAD_RECURRENT = [
    ("initial_state_indices", torch.tensor([2, 0], dtype=I32), ValueError, "< num_slots = 2"),
    ("initial_state_indices", torch.tensor([1, 1], dtype=I32), ValueError, "distinct"),
    ("initial_state_indices", torch.tensor([1, 0]), TypeError, "int32"),
    ("cu_seqlens", torch.tensor([0, 1, 2], dtype=I32), ValueError, "end at T = 3"),
    ("cu_seqlens", torch.tensor([0, 3, 2], dtype=I32), ValueError, "non-decreasing"),
    ("cu_seqlens", torch.tensor([0, 3], dtype=I32), ValueError, "3 entries"),
    ("q", torch.zeros(1, 3, 2, 16, dtype=torch.float64), TypeError, "bfloat16"),
    ("q", torch.zeros(2, 3, 2, 16, dtype=BF), ValueError, r"\[1, T, Hk, Dk\]"),
    ("q", torch.zeros(1, 3, 2, 8, dtype=BF), ValueError, "multiple of 16"),
    ("k", torch.zeros(1, 3, 2, 16), TypeError, "that of q"),
    ("v", torch.zeros(1, 3, 3, 16, dtype=BF), ValueError, "multiple of Hk"),
    ("v", torch.zeros(1, 3, 4, 32, dtype=BF)[..., ::2], ValueError, "stride"),
    ("a", torch.zeros(3, 3, dtype=BF), ValueError, r"\[3, 4\]"),
    ("A_log", torch.zeros(4, dtype=torch.float16), TypeError, "float32 or bfloat16"),
    ("initial_state_source", torch.zeros(2, 4, 16, 16, dtype=BF), TypeError, "float32"),
    ("initial_state_source", torch.zeros(2, 4, 16, 32), ValueError, r"\[\*, 4, 16, 16\]"),
    ("initial_state_source", torch.zeros(2, 4, 16, 16).transpose(2, 3), ValueError, "slot"),
    ("use_qk_l2norm_in_kernel", 1, TypeError, "bool"),
    ("softplus_beta", 0.0, ValueError, "> 0"),
]


@pytest.mark.parametrize("name,value,exc,match", BAD_RECURRENT)
def test_recurrent_rejects(name, value, exc, match):
    args, _ = _valid()
    pool = args["initial_state_source"]
    before = pool.clone()
    args[name] = value
    with pytest.raises(exc, match=f"^{name}: .*{match}"):
        R.fused_sigmoid_gating_delta_rule_update(**args)
    assert torch.equal(pool, before)


@pytest.mark.parametrize("name,value,exc,match", BAD_RECURRENT)
def test_recurrent_memo_refuses_as_fresh(name, value, exc, match):
    """The recurrent op's memo (checks once per metadata): with the memo holding the
    valid call's plan and with it empty, a bad call is refused with the same error (index
    values of the valid call's metadata are checked on every call)."""
    messages = []
    for clear in (False, True):
        args, _ = _valid()
        R.fused_sigmoid_gating_delta_rule_update(**args)  # its plan memoised
        if clear:
            rule_recurrent._PLANS.clear()
        args[name] = value
        with pytest.raises(exc, match=f"^{name}: .*{match}") as e:
            R.fused_sigmoid_gating_delta_rule_update(**args)
        messages.append(str(e.value))
    assert messages[0] == messages[1]


def test_recurrent_threads():
    """Two threads calling the recurrent op (memo shared, kernels without the GIL), each
    with its own batch size and pool: the results of the calls run one by one."""
    from concurrent.futures import ThreadPoolExecutor

    hk, hv, d = 1, 2, 16
    cases = [case((1,) * n, hk, hv, d, d, BF, True, list(range(n)), n) for n in (1, 3)]
    A_log, dt_bias = torch.randn(hv) * 0.5, torch.randn(hv).to(BF)
    gates = [(torch.randn(n, hv).to(BF), torch.randn(n, hv).to(BF)) for n in (1, 3)]

    def run(c, g, pool):
        q, k, v, _, cu, slots = c
        return [
            R.fused_sigmoid_gating_delta_rule_update(
                A_log, dt_bias, q, k, v, *g, pool, slots, cu, True
            )
            for _ in range(10)
        ]

    pools = [c[3].clone() for c in cases]
    serial = [run(c, g, p) for c, g, p in zip(cases, gates, pools)]
    rule_recurrent._PLANS.clear()
    par_pools = [c[3].clone() for c in cases]
    with ThreadPoolExecutor(2) as ex:
        parallel = list(ex.map(run, cases, gates, par_pools))
    for a, b in zip(serial, parallel):
        assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert all(torch.equal(a, b) for a, b in zip(pools, par_pools))


BAD_CHUNK = [
    ("head_first", True, ValueError, "expected False"),
    ("output_final_state", None, TypeError, "bool"),
    ("g", torch.zeros(1, 3, 4, dtype=BF), TypeError, "float32"),
    ("beta", torch.zeros(1, 3, 4, dtype=torch.float16), TypeError, "bfloat16 or float32"),
    ("initial_state_indices", torch.tensor([-1, 5], dtype=I32), ValueError, "num_slots"),
    ("eps", -1.0, ValueError, ">= 0"),
]


@pytest.mark.parametrize("name,value,exc,match", BAD_CHUNK)
def test_chunked_rejects(name, value, exc, match):
    _, args = _valid()
    pool = args["initial_state"]
    before = pool.clone()
    args[name] = value
    with pytest.raises(exc, match=f"^{name}: .*{match}"):
        R.chunk_gated_delta_rule(**args)
    assert torch.equal(pool, before)


# ---------------------------------------------------------------------------------------
# vLLM

_VLLM_PROBE = """
T, H, Hv, D = 3, 1, 2, 64
q = torch.randn(1, T, H, D).bfloat16(); v = torch.randn(1, T, Hv, D).bfloat16()
pool = torch.zeros(4, Hv, D, D); cu = torch.tensor([0, 1, 2, 3], dtype=torch.int32)
torch.ops._C.fused_sigmoid_gating_delta_rule_update_cpu(
    torch.zeros(Hv), torch.zeros(Hv).bfloat16(), q, q, v, torch.zeros(T, Hv).bfloat16(),
    torch.zeros(T, Hv).bfloat16(), pool, torch.tensor([1, 0, 3], dtype=torch.int32), cu,
    True, 1.0, 20.0)
torch.ops._C.chunk_gated_delta_rule_cpu(
    q, q, v, -torch.ones(1, T, Hv), torch.ones(1, T, Hv).bfloat16(), pool, True,
    torch.tensor([0, T], dtype=torch.int32), False, True, torch.tensor([1], dtype=torch.int32),
    1e-5)
"""


def _vllm_ops():
    oracle.require_op("GDN delta rule ops", _VLLM_PROBE)
    return oracle.ops()


def test_vllm_recurrent():
    """Decode (one token per request; vLLM reads q [1, T, ..] as [seq_len=1, batch=T]) on
    Dk != Dv, which pins the state layout [slot, Hv, Dk, Dv]. vLLM's bf16 kernel computes
    sigmoid(b) in bf16 arithmetic (three roundings, measured: it is off the fp32 beta by
    up to a unit): with that beta the float64 loop gives vLLM's outputs within one unit
    and its states to fp32 rounding; numkern is held to the loop with the exact beta."""
    ops = _vllm_ops()
    hk, hv, dk, dv, n = 2, 4, 32, 64, 5
    q, k, v, pool, cu, slots = case((1,) * n, hk, hv, dk, dv, BF, True, [3, 0, 7, 5, 1], 8)
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    A_log, dt_bias = torch.randn(hv) * 0.5, torch.randn(hv).to(BF)
    a, b = torch.randn(n, hv).to(BF), torch.randn(n, hv).to(BF)
    g, beta = gating(A_log, dt_bias, a, b)
    bf = lambda x: x.to(BF).double()  # noqa: E731
    their_beta = bf(1.0 / bf(1.0 + bf(torch.exp(-b.double()))))
    ref_o, ref_s = reference(q[0], k[0], v[0], g, beta, pool, slots, cu, True, 1e-5)
    their_o, their_s = reference(q[0], k[0], v[0], g, their_beta, pool, slots, cu, True, 1e-5)
    theirs_pool = pool.clone()
    ours = R.fused_sigmoid_gating_delta_rule_update(
        A_log, dt_bias, q, k, v, a, b, pool, slots, cu, True
    )
    theirs = ops.fused_sigmoid_gating_delta_rule_update_cpu(
        A_log, dt_bias, q, k, v, a, b, theirs_pool, slots, cu, True, 1.0, 20.0
    )
    assert theirs.shape == ours.shape
    assert_close(ours[:, 0], ref_o, BF)
    assert_close(pool, ref_s, FP32, "state")
    assert_close(theirs[:, 0], their_o, BF, "vLLM's output")
    assert_close(theirs_pool, their_s, FP32, "vLLM's state")


def test_vllm_chunked():
    """Prefill (bf16, D = 64, vLLM's subset): vLLM rounds q, k, W, U and V' to bf16 on
    the way, and so does numkern's bf16 path (``R.DP_BF16``); without it numkern is held
    to the float64 loop (one unit). The two are compared at vLLM's accuracy (measured:
    0.5-0.55% of the largest output or state entry; bound 1.5%)."""
    ops = _vllm_ops()
    hk, hv, d = 2, 4, 64
    lens = (1, 65, 130)
    q, k, v, pool, cu, slots = case(lens, hk, hv, d, d, BF, True, [2, 0, 3], 4)
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    t_n = q.shape[1]
    g = -torch.rand(1, t_n, hv) * 0.2
    beta = torch.rand(1, t_n, hv).to(BF)
    ref_o, ref_s = reference(q[0], k[0], v[0], g[0], beta[0], pool, slots, cu, True, 1e-5)
    theirs_pool = pool.clone()
    ours, _ = R.chunk_gated_delta_rule(q, k, v, g, beta, pool, True, cu, False, True, slots)
    theirs, theirs_final = ops.chunk_gated_delta_rule_cpu(
        q, k, v, g, beta, theirs_pool, True, cu, False, True, slots, 1e-5
    )
    assert theirs_final is theirs_pool and theirs.shape == ours.shape
    assert_chunked(ours[0], ref_o, BF)
    assert_chunked(pool, ref_s, BF, "state")
    scale = ref_o.abs().max()
    assert (theirs[0].double() - ref_o).abs().max() <= 0.015 * scale
    assert (theirs_pool.double() - ref_s).abs().max() <= 0.015 * ref_s.abs().max()
    assert (ours.double() - theirs.double()).abs().max() <= 0.015 * scale
    assert not math.isnan(scale)
