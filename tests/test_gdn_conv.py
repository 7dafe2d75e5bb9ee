"""numkern.gdn.conv: the causal conv1d (prefill and decode, rolling state by slot) against
float64 references written from the math, the state rolled by prefill + updates against
one long prefill, errors raised before any kernel runs, and vLLM's own ops (the gates,
numkern.gdn.gating: tests/test_gdn_gating.py).

Compile budget: one conv kernel for fp32 and bf16 (layouts, packing, bias, SiLU and the
serial/parallel split are run-time flags)."""

import pytest
import torch

from numkern.gdn import _conv_kernel, conv, conv_update
from numkern.testing import reference as refs

from . import oracle
from .close import assert_within

BF, FP32 = torch.bfloat16, torch.float32
W = 4  # Qwen3-Next's conv width, the only one vLLM's CPU kernels take


# --- references ------------------------------------------------------------------------


def ref_fwd(x_td, w, bias, states, qsl, slots, init, silu):
    """Per request: history (slot columns 0..W-2, or zeros) then its tokens; the slot's
    columns 0..W-2 become the last W-1 of that sequence. -> (out [T, dim], mag, states)."""
    out, st, mag = refs.conv1d_varlen(x_td, w, bias, states, qsl, slots, init, silu, magnitude=True)
    return out, mag, st


def ref_spec_update(x, states, w, bias, silu, slots, accepted):
    """vLLM's torch fallback for speculative decoding (gdn_attention._spec_forward): history
    = columns n-1..n+W-3, then the slot keeps columns n..n+L-q-1 followed by the q tokens."""
    out, st, mag = refs.conv1d_spec(x, states, w, bias, silu, slots, accepted, magnitude=True)
    return out, mag, st


# --- inputs ----------------------------------------------------------------------------


def states_of(num_slots, dim, cols, dtype, dim_first=False):
    """Conv states [S, dim, cols]: vLLM's layout (a transposed view of [S, cols, dim]) or a
    contiguous dim-first buffer; random values."""
    if dim_first:
        return torch.randn(num_slots, dim, cols).to(dtype)
    return torch.randn(num_slots, cols, dim).to(dtype).transpose(1, 2)


def bits(t):
    """The raw bits of a float tensor: compares NaNs too."""
    return t.view(torch.int16 if t.element_size() == 2 else torch.int32)


def i32(values):
    return torch.tensor(values, dtype=torch.int32)


# lengths, slots (-1: padding), has_initial_state; 6 slots
BATCH = ([5, 0, 2, 9, 1, 3], [4, 1, -1, 0, 5, 2], [True, False, True, False, False, True])


@pytest.mark.parametrize(
    "dtype,dim,silu,has_bias,packed,dim_first,cols",
    [
        (FP32, 72, True, True, False, False, W - 1),  # 72: 4 vectors + an 8-channel tail
        (BF, 72, False, False, False, True, W - 1),
        (BF, 96, True, True, True, False, W + 2),  # packed weight; wide state buffer
        (FP32, 96, False, False, True, True, W - 1),
    ],
)
def test_fwd(dtype, dim, silu, has_bias, packed, dim_first, cols):
    lens, slots, init = BATCH
    qsl = [0]
    for n in lens:
        qsl.append(qsl[-1] + n)
    T = qsl[-1]
    x = torch.randn(T, dim).to(dtype).t()  # vLLM's x: [dim, T] over a [T, dim] buffer
    w = torch.randn(dim, W).to(dtype)
    bias = torch.randn(dim).to(dtype) if has_bias else None
    st = states_of(6, dim, cols, dtype, dim_first)
    for r, slot in enumerate(slots):
        if slot >= 0 and lens[r] and not init[r]:
            st[slot] = float("nan")  # never read
    before = st.clone()
    ref, mag, ref_st = ref_fwd(x.t(), w, bias, before, qsl, slots, init, silu)
    wk = conv.causal_conv1d_weight_pack(w) if packed else w[:, None, :]
    out = conv.causal_conv1d_fwd(
        x, wk, bias, st, i32(qsl), i32(slots), torch.tensor(init), silu, packed
    )
    assert out.shape == x.shape and out.stride() == x.stride() and out.dtype == dtype
    assert_within(out.t(), ref, mag, dtype, "gdn_conv")
    pad = slice(qsl[2], qsl[3])
    assert (out.t()[pad] == 0).all()
    assert torch.equal(bits(st[:, :, : W - 1]), bits(ref_st[:, :, : W - 1].to(dtype)))
    assert torch.equal(bits(st[:, :, W - 1 :]), bits(before[:, :, W - 1 :]))  # beyond W - 1
    assert torch.equal(bits(st[3]), bits(before[3]))  # a slot no request uses


def test_fwd_parallel_and_3d():
    """Enough work for the prange path (>= PARALLEL_WORK pairs); the same chunk as
    x [R, dim, T] without query_start_loc gives the same outputs and states."""
    dim, R, T = 96, 3, 240
    assert R * T * dim >= conv.PARALLEL_WORK
    x = torch.randn(R, T, dim).to(BF).transpose(1, 2)  # [R, dim, T]
    w, bias = torch.randn(dim, W).to(BF), torch.randn(dim).to(BF)
    st = states_of(4, dim, W - 1, BF)
    st2 = st.clone()
    slots, init = i32([2, 0, 3]), torch.tensor([True, False, True])
    out3 = conv.causal_conv1d_fwd(x, w, bias, st, None, slots, init, True, False)
    flat = x.transpose(0, 1).reshape(dim, R * T)
    qsl = i32([0, T, 2 * T, 3 * T])
    ref, mag, ref_st = ref_fwd(flat.t(), w, bias, st2.clone(), qsl, slots, init, True)
    out = conv.causal_conv1d_fwd(flat, w, bias, st2, qsl, slots, init, True, False)
    assert_within(out.t(), ref, mag, BF, "gdn_conv")
    assert torch.equal(out3.transpose(0, 1).reshape(dim, R * T), out)
    assert torch.equal(st, st2) and torch.equal(st, ref_st.to(BF))


@pytest.mark.parametrize(
    "dtype,packed,indices", [(FP32, False, True), (BF, True, False), (FP32, True, True)]
)
def test_update(dtype, packed, indices):
    dim, B = 96, 4
    x = torch.randn(B, dim).to(dtype)
    w, bias = torch.randn(dim, W).to(dtype), torch.randn(dim).to(dtype)
    st = states_of(5, dim, W - 1, dtype)
    slots = [3, -1, 0, 4] if indices else list(range(B))
    before = st.clone()
    wk = conv.causal_conv1d_weight_pack(w) if packed else w
    out = conv.causal_conv1d_update(x, st, wk, bias, True, i32(slots) if indices else None, packed)
    ref, mag, ref_st = ref_fwd(x, w, bias, before, range(B + 1), slots, [True] * B, True)
    assert out.shape == x.shape and out.dtype == dtype
    assert_within(out, ref, mag, dtype, "gdn_conv")
    assert torch.equal(st, ref_st.to(dtype))
    if indices:
        assert (out[1] == 0).all() and torch.equal(st[1], before[1])


@pytest.mark.parametrize("dtype", [BF, FP32])
def test_prefill_then_updates_is_one_prefill(dtype):
    """Prefill 6 tokens, then 4 single-token updates: the same outputs (bit for bit) and
    final state as one 10-token prefill."""
    dim, n0, n1 = 80, 6, 4
    seq = torch.randn(n0 + n1, dim).to(dtype)
    w, bias = torch.randn(dim, W).to(dtype), torch.randn(dim).to(dtype)
    st_a = states_of(3, dim, W - 1, dtype)
    st_b = st_a.clone()
    slot, no_init = i32([2]), torch.tensor([False])
    full = conv.causal_conv1d_fwd(
        seq.t(), w, bias, st_a, i32([0, n0 + n1]), slot, no_init, True, False
    )
    parts = [
        conv.causal_conv1d_fwd(
            seq[:n0].t(), w, bias, st_b, i32([0, n0]), slot, no_init, True, False
        ).t()
    ]
    for t in range(n0, n0 + n1):
        parts.append(conv.causal_conv1d_update(seq[t : t + 1], st_b, w, bias, True, slot, False))
    assert torch.equal(torch.cat(parts), full.t())
    assert torch.equal(st_a, st_b)


def test_update_checked_path_agrees():
    """A memoised call (contiguous int32 slots) and the same call with its slots copied
    (a strided slot tensor) or checked afresh each time (NumPy slots): the same outputs
    and states, bit for bit."""
    dim, B = 48, 3
    x = torch.randn(B, dim).to(BF)
    w, bias = torch.randn(dim, W).to(BF), torch.randn(dim).to(BF)
    st = states_of(5, dim, W - 1, BF)
    sts = [st.clone() for _ in range(3)]
    slots = i32([4, 0, 2])
    spaced = i32([4, 9, 0, 9, 2, 9])[::2]
    outs = [
        conv.causal_conv1d_update(x, sts[0], w, bias, True, slots, False),
        conv.causal_conv1d_update(x, sts[1], w, bias, True, spaced, False),
        conv.causal_conv1d_update(x, sts[2], w, bias, True, slots.numpy(), False),
    ]
    for o, s in zip(outs[1:], sts[1:]):
        assert torch.equal(o, outs[0]) and torch.equal(s, sts[0])


def test_width_3():
    """A width other than 4 (the generic kernel: taps staged per channel block), prefill
    then one update, against the reference. An odd dim: state rows at odd offsets and of
    odd length (the roll's raw copies take 32 bf16 values a vector only at even ones)."""
    dim, width = 41, 3
    seq = torch.randn(6, dim).to(BF)
    w, bias = torch.randn(dim, width).to(BF), torch.randn(dim).to(BF)
    st = states_of(2, dim, width - 1, BF)
    before = st.clone()
    slot = i32([1])
    out = conv.causal_conv1d_fwd(
        seq[:5].t(), w, bias, st, i32([0, 5]), slot, torch.tensor([True]), True, False
    )
    ref, mag, ref_st = ref_fwd(seq[:5], w, bias, before, [0, 5], [1], [True], True)
    assert_within(out.t(), ref, mag, BF, "gdn_conv")
    assert torch.equal(st, ref_st.to(BF))
    out = conv.causal_conv1d_update(seq[5:], st, w, bias, True, slot, False)
    ref, mag, ref_st = ref_fwd(seq[5:], w, bias, ref_st.to(BF), [0, 1], [1], [True], True)
    assert_within(out, ref, mag, BF, "gdn_conv")
    assert torch.equal(st, ref_st.to(BF))


def test_spec_update():
    """3-D x with num_accepted_tokens over a wide buffer (L = W - 1 + 2 drafts)."""
    dim, B, q = 64, 3, 3
    L = W - 1 + q - 1
    x = torch.randn(B, q, dim).to(BF)
    w, bias = torch.randn(dim, W).to(BF), torch.randn(dim).to(BF)
    st = states_of(4, dim, L, BF)
    slots, accepted = [1, 3, 0], [1, 3, 2]
    before = st.clone()
    out = conv.causal_conv1d_update(x, st, w, bias, False, i32(slots), False, i32(accepted))
    ref, mag, ref_st = ref_spec_update(x, before, w, bias, False, slots, accepted)
    assert_within(out, ref, mag, BF, "gdn_conv")
    assert torch.equal(st, ref_st.to(BF))


def test_weight_pack_layout():
    dim, width = 64, 4
    w = torch.arange(dim * width, dtype=torch.float32).reshape(dim, width).to(BF)
    p = conv.causal_conv1d_weight_pack(w).reshape(-1)
    for c, k in [(0, 0), (5, 3), (31, 1), (32, 0), (47, 2), (63, 3)]:
        assert p[(c // 32) * 32 * width + (k // 2) * 64 + (c % 32) * 2 + k % 2] == w[c, k]


def test_tolerance_bites():
    """A history column off by one, or a result two units off, fails assert_within."""
    dim = 32
    x = torch.randn(5, dim).to(BF)
    w, st = torch.randn(dim, W).to(BF), states_of(1, dim, W - 1, BF)
    ref, mag, _ = ref_fwd(x, w, None, st, [0, 5], [0], [True], False)
    wrong = st.clone()
    wrong[0, :, :2] = st[0, :, 1:]
    bad, _, _ = ref_fwd(x, w, None, wrong, [0, 5], [0], [True], False)
    with pytest.raises(AssertionError):
        assert_within(bad.to(BF), ref, mag, BF, "gdn_conv")
    off = ref.to(BF).view(torch.int16).clone()
    off[0, 3] += 2
    with pytest.raises(AssertionError):
        assert_within(off.view(BF), ref, mag, BF, "gdn_conv")


# --- errors ----------------------------------------------------------------------------

D = 32


def _fwd(x=None, w=None, bias=None, st=None, qsl=None, ci=None, hi=None, **kw):
    args = dict(
        x=torch.zeros(4, D).t() if x is None else x,
        weight=torch.zeros(D, W) if w is None else w,
        bias=bias,
        conv_states=torch.zeros(3, D, W - 1) if st is None else st,
        query_start_loc=i32([0, 1, 4]) if qsl is None else qsl,
        cache_indices=i32([2, 0]) if ci is None else ci,
        has_initial_state=torch.tensor([True, False]) if hi is None else hi,
        silu_activation=True,
        is_weight_packed=False,
    )
    args.update(kw)
    return lambda: conv.causal_conv1d_fwd(**args)


def _upd(x=None, st=None, ci=None, **kw):
    args = dict(
        x=torch.zeros(2, D) if x is None else x,
        conv_states=torch.zeros(3, D, W - 1) if st is None else st,
        weight=torch.zeros(D, W),
        bias=None,
        silu_activation=False,
        conv_state_indices=i32([1, 2]) if ci is None else ci,
        is_weight_packed=False,
    )
    args.update(kw)
    return lambda: conv.causal_conv1d_update(**args)


ERRORS = [
    ("x", TypeError, _fwd(x=torch.zeros(D, 4, dtype=torch.int32))),
    ("x", ValueError, _fwd(x=torch.zeros(D + 1, 4))),
    ("weight", TypeError, _fwd(w=torch.zeros(D, W).to(BF))),
    ("weight", ValueError, _fwd(w=torch.zeros(D, 2, W))),
    ("weight", ValueError, _fwd(w=torch.zeros(W, D).t())),
    ("bias", TypeError, _fwd(bias=torch.zeros(D).to(BF))),
    ("bias", ValueError, _fwd(bias=torch.zeros(D + 1))),
    ("conv_states", TypeError, _fwd(conv_states=None)),
    ("conv_states", TypeError, _fwd(st=torch.zeros(3, D, W - 1).to(BF))),
    ("conv_states", ValueError, _fwd(st=torch.zeros(3, D + 1, W - 1))),
    ("conv_states", ValueError, _fwd(st=torch.zeros(3, D, W - 2))),
    ("query_start_loc", TypeError, _fwd(qsl=torch.tensor([0, 1, 4]))),  # int64
    ("query_start_loc", ValueError, _fwd(qsl=i32([0, 1, 3]))),  # not ending at T
    ("query_start_loc", ValueError, _fwd(qsl=i32([0, 5, 4]))),
    ("cache_indices", ValueError, _fwd(ci=i32([3, 0]))),  # == num_slots
    ("cache_indices", ValueError, _fwd(ci=i32([-2, 0]))),  # negative, not the pad id
    ("cache_indices", ValueError, _fwd(ci=i32([1, 1]))),  # one slot twice
    ("cache_indices", ValueError, _fwd(ci=i32([1]))),
    ("cache_indices", TypeError, _fwd(ci=torch.tensor([1, 0]))),
    ("has_initial_state", TypeError, _fwd(hi=i32([1, 0]))),
    ("silu_activation", TypeError, _fwd(silu_activation="silu")),
    (
        "is_weight_packed",
        ValueError,
        _fwd(
            w=torch.zeros(24, W),
            x=torch.zeros(4, 24).t(),
            st=torch.zeros(3, 24, W - 1),
            is_weight_packed=True,
        ),
    ),
    ("x", ValueError, _upd(x=torch.zeros(1, 2, 2, D))),
    ("x", ValueError, _upd(x=torch.zeros(2, W, D), num_accepted_tokens=i32([1, 1]))),  # q > L
    ("conv_state_indices", ValueError, _upd(ci=i32([1, 5]))),
    (
        "conv_state_indices",
        ValueError,
        _upd(x=torch.zeros(4, D), conv_state_indices=None),
    ),  # 4 > 3 slots
    ("num_accepted_tokens", ValueError, _upd(num_accepted_tokens=i32([1, 1]))),  # 2-D x
    ("num_accepted_tokens", ValueError, _upd(x=torch.zeros(2, 2, D))),
    (
        "num_accepted_tokens",
        ValueError,
        _upd(x=torch.zeros(2, 2, D), num_accepted_tokens=i32([1, 0])),
    ),
    (
        "num_accepted_tokens",
        TypeError,
        _upd(x=torch.zeros(2, 2, D), num_accepted_tokens=torch.ones(2)),
    ),
]


@pytest.mark.parametrize("name,exc,call", ERRORS, ids=[f"{e[0]}-{i}" for i, e in enumerate(ERRORS)])
def test_errors(name, exc, call, monkeypatch):
    """Each bad argument is named, and no kernel writes (the kernels are replaced by a
    recorder here; the conv's by one that runs its index plan, which comes first in the
    kernel and stops it)."""
    ran = []

    def conv_plan_only(plan_args, conv_args):
        verdict = _conv_kernel._plan(*plan_args)[0]
        if verdict == _conv_kernel.PLAN_OK:
            ran.append("conv")
        return verdict

    monkeypatch.setattr(_conv_kernel, "_conv", conv_plan_only)
    with pytest.raises(exc, match=rf"^{name}: "):
        call()
    assert not ran


UPDATE_ERRORS = [e for e in ERRORS if e[2].__qualname__.startswith("_upd")]


@pytest.mark.parametrize("name,exc,call", UPDATE_ERRORS)
def test_update_memo_refuses_as_fresh(name, exc, call):
    """causal_conv1d_update's memo (checks once per metadata): with the memo holding the
    valid call's plan and with it empty, a bad call is refused with the same error; a
    valid call after it runs. Index values of the valid call's metadata (slots out of
    range, one slot twice) and x overlapping conv_states are checked on every call."""
    messages = []
    for clear in (False, True):
        _upd()()  # the valid call: its plan memoised
        if clear:
            conv_update._PLANS.clear()
        with pytest.raises(exc, match=rf"^{name}: ") as e:
            call()
        messages.append(str(e.value))
    assert messages[0] == messages[1]
    st = torch.zeros(3, D, W - 1)
    for idx in (i32([1, 3]), i32([2, 2])):  # the valid call's metadata, bad values
        with pytest.raises(ValueError, match=r"^conv_state_indices: "):
            _upd(st=st, ci=idx)()
    buf = torch.zeros(3 * D * (W - 1) + 2 * D)
    st, x = buf[: 3 * D * (W - 1)].view(3, D, W - 1), buf[3 * D * (W - 1) :].view(2, D)
    _upd(x=x, st=st)()
    with pytest.raises(ValueError, match=r"^x: .*apart from conv_states"):
        _upd(x=buf[: 2 * D].view(2, D), st=st)()


def test_update_threads():
    """Two threads calling causal_conv1d_update (memo shared, kernels without the GIL),
    each with its own batch size and states: the results of the calls run one by one."""
    from concurrent.futures import ThreadPoolExecutor

    dim = 64
    w, bias = torch.randn(dim, W).to(BF), torch.randn(dim).to(BF)
    xs = [torch.randn(20, b, dim).to(BF) for b in (1, 3)]
    starts = [states_of(4, dim, W - 1, BF) for _ in xs]

    def run(x, st):
        slots = i32(list(range(x.shape[1])))
        return [conv.causal_conv1d_update(x[t], st, w, bias, True, slots, False) for t in range(20)]

    sts = [s.clone() for s in starts]
    serial = [run(x, s) for x, s in zip(xs, sts)]
    conv_update._PLANS.clear()
    par_sts = [s.clone() for s in starts]
    with ThreadPoolExecutor(2) as pool:
        parallel = list(pool.map(run, xs, par_sts))
    for a, b in zip(serial, parallel):
        assert all(torch.equal(p, q) for p, q in zip(a, b))
    assert all(torch.equal(a, b) for a, b in zip(sts, par_sts))


# --- vLLM ------------------------------------------------------------------------------

# vLLM's conv and gating ops, probed once in a child: oracle.GDN_PROBE (shared with
# tests/test_gdn_gating.py, so one probe serves both in a process).


@pytest.fixture(scope="module")
def vllm_ops():
    oracle.require_op("causal_conv1d / fused_gdn_gating", oracle.GDN_PROBE)
    return oracle.ops()


@pytest.fixture
def conv_ops(vllm_ops):
    oracle.require_in_build("causal_conv1d_weight_pack", "causal_conv1d_fwd_cpu")
    oracle.require_in_build("causal_conv1d_update_cpu")
    return vllm_ops


def test_vllm_weight_pack(conv_ops):
    vllm_ops = conv_ops
    w = torch.randn(96, W).to(BF)
    assert torch.equal(conv.causal_conv1d_weight_pack(w), vllm_ops.causal_conv1d_weight_pack(w))


def test_vllm_fwd(conv_ops):
    """A varlen chunk (a request longer than vLLM's 32-token blocks, one shorter than the
    history, one without state) in vLLM's layouts; states bit-exact, outputs within a
    unit (vLLM's vdpbf16ps sums pairs of taps in another order)."""
    dim = 96
    qsl = i32([0, 40, 42, 49])
    x = torch.randn(49, dim).to(BF).t()
    w, bias = torch.randn(dim, W).to(BF), torch.randn(dim).to(BF)
    pw = conv.causal_conv1d_weight_pack(w)
    ours_st = states_of(5, dim, W - 1, BF)
    theirs_st = ours_st.clone()  # same strides: a transposed view
    slots, init = i32([4, 0, 2]), torch.tensor([True, True, False])
    ours = conv.causal_conv1d_fwd(x, pw, bias, ours_st, qsl, slots, init, True, True)
    theirs = conv_ops.causal_conv1d_fwd_cpu(
        x, pw, bias, theirs_st, qsl, slots, init, True, -1, True
    )
    assert torch.equal(ours_st, theirs_st)
    assert_within(ours, theirs.double(), theirs.double().abs(), BF, "gdn_conv")


@pytest.mark.parametrize("spec", [False, True])
def test_vllm_update(conv_ops, spec):
    dim, B = 64, 3
    x = torch.randn(B, 3, dim).to(BF) if spec else torch.randn(B, dim).to(BF)
    L = W - 1 + (2 if spec else 0)
    w, bias = torch.randn(dim, W).to(BF), torch.randn(dim).to(BF)
    pw = conv.causal_conv1d_weight_pack(w)
    ours_st = states_of(4, dim, L, BF)
    theirs_st = ours_st.clone()
    slots = i32([2, 0, 3])
    acc = i32([1, 3, 2]) if spec else None
    ours = conv.causal_conv1d_update(x, ours_st, pw, bias, True, slots, True, acc)
    theirs = conv_ops.causal_conv1d_update_cpu(x, theirs_st, pw, bias, True, acc, slots, -1, True)
    assert torch.equal(ours_st, theirs_st)
    assert_within(ours, theirs.double(), theirs.double().abs(), BF, "gdn_conv")
