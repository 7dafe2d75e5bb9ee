"""Every public op fuzzed with hypothesis, each case in a child process (issue 15).

Per op, hypothesis draws case specs (``tests/fuzz_cases.py``: random shapes including 0
and 1, dtypes, strides, padded and offset views, NumPy inputs, aliased and overlapping
views, out-of-range ids, slots and block numbers, NaN/inf inputs) and a pool of child
processes runs them. Every case must end in a result equal to the plain torch/NumPy
reference of the op's test module, or a ``ValueError``/``TypeError`` that left every
buffer as it was — never a signal, a hang (per-case timeout) or a wrong result. Most cases
are valid calls (checked against the reference); the rest change one thing of a valid
call; each mutation of an op must have been applied (not dropped for not fitting the
drawn sizes) at least once. The test prints, per op, the cases run, valid and refused,
and how often its mutations applied (``pytest -s`` shows the lines; the terminal summary
has one line for all ops). Half the cases run on two Numba threads; each case with a
torch custom op runs through it too and must match the direct call bit for bit (or
refuse likewise, nothing written); each valid case runs again from two Python threads at
once and must match its single-threaded bits (``tests/fuzz_cases.py``).
The decoder run's cases are in ``tests/fuzz_decoder.py``.

CI runs ``NUMKERN_FUZZ_EXAMPLES`` (default 300) cases per op, derandomized: the same cases
on every run. A longer run draws more (other) cases, e.g.::

    NUMKERN_FUZZ_EXAMPLES=5000 pytest tests/test_fuzz.py -s

``NUMKERN_FUZZ_TIMEOUT`` (seconds, default 300: a cold Numba cache compiles kernels
inside a case) bounds one case. A failure prints the spec; ``run_case(spec)`` from
``tests.fuzz_cases`` reruns it in the current process.

The heavy test runs sizes near 2^31 elements, one at a time in a child process, and
checks rows at their far end against the reference.
"""

import collections
import os
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from . import fuzz_cases as F
from .conftest import run_child

EXAMPLES = int(os.environ.get("NUMKERN_FUZZ_EXAMPLES", "300"))
TIMEOUT_S = float(os.environ.get("NUMKERN_FUZZ_TIMEOUT", "300"))
WORKERS = 2


@pytest.fixture(scope="module")
def pool():
    p = F.Pool(WORKERS, TIMEOUT_S)
    yield p
    p.close()


@pytest.fixture(scope="module")
def drawn():
    """Every op's specs, drawn in one background thread (hypothesis costs a few ms a
    case) while the pool runs the ops before it."""
    ex = ThreadPoolExecutor(1)
    futures = {op: ex.submit(F.draw_specs, op, EXAMPLES) for op in F.STRATEGIES}
    yield futures
    ex.shutdown(cancel_futures=True)


@pytest.fixture(scope="module")
def tally(request):
    """Per op (run, valid, refused, torch run/valid/refused, two-thread reruns), reported
    in the terminal summary."""
    rows = {}

    class Summary:
        @pytest.hookimpl
        def pytest_terminal_summary(self, terminalreporter):
            if rows:
                parts = [f"{op} {'/'.join(map(str, r))}" for op, r in rows.items()]
                terminalreporter.write_line(
                    "fuzz (cases run/valid/refused, torch op run/valid/refused, valid cases "
                    "rerun from two threads): " + ", ".join(parts)
                )

    name = "numkern-fuzz-summary"
    if not request.config.pluginmanager.has_plugin(name):
        request.config.pluginmanager.register(Summary(), name)
    return rows


@pytest.mark.parametrize("op", list(F.STRATEGIES))
def test_fuzz(op, pool, drawn, tally):
    t0 = time.monotonic()
    specs = drawn[op].result()
    waited = time.monotonic() - t0
    results = pool.map(specs)
    status = [r[0] for r in results]
    valid, refused = status.count("ok"), status.count("refused")
    stats = [r[2] for r in results]
    kinds = [st.get("torch") for st in stats]
    t_ok, t_dispatcher = kinds.count("ok"), kinds.count("dispatcher")
    t_refused = kinds.count("refused") + t_dispatcher
    t_run = t_ok + t_refused
    pair = sum(bool(st.get("threads")) for st in stats)
    two = sum(spec["numba_threads"] == 2 for spec in specs)
    applied = collections.Counter(st.get("mut") for st in stats)
    muts = F.STRATEGIES[op][1]
    tally[op] = (len(specs), valid, refused, t_run, t_ok, t_refused, pair)
    print(
        f"\nfuzz {op}: {len(specs)} cases run ({two} on two Numba threads), {valid} valid "
        f"(checked against the reference), {refused} refused; through the torch op: "
        f"{t_run} run, {t_ok} valid (bits of the direct call), {t_refused} refused "
        f"({t_dispatcher} by the dispatcher); {pair} valid cases rerun from two Python "
        f"threads at once; of its {len(muts)} mutations {sum(applied[m] > 0 for m in muts)} "
        f"applied ({min((applied[m] for m in muts), default=0)}-"
        f"{max((applied[m] for m in muts), default=0)} times each); "
        f"{time.monotonic() - t0 - waited:.1f} s (and {waited:.1f} s "
        f"waiting for hypothesis to draw them)"
    )
    bad = [(spec, res) for spec, res in zip(specs, results) if res[0] not in ("ok", "refused")]
    if bad:
        lines = [f"{len(bad)} of {len(specs)} cases failed; the first ones:"]
        for spec, (kind, detail, _) in bad[:5]:
            lines.append(f"  {kind}: {detail.strip()}\n    spec = {spec!r}")
        pytest.fail("\n".join(lines), pytrace=False)
    assert len(specs) >= min(EXAMPLES, 300)
    assert valid * 2 >= len(specs), f"only {valid} of {len(specs)} cases were valid calls"
    # every op has a torch op (docs §12): most cases run through it too (not those it
    # cannot express: an eps its schema fixes, a table only the direct plan takes)
    assert t_run * 2 >= len(specs), f"only {t_run} of {len(specs)} cases ran as torch ops"
    assert t_ok * 2 >= valid, f"only {t_ok} of {valid} valid cases were valid torch calls"
    assert pair * 2 >= valid, f"only {pair} of {valid} valid cases reran from two threads"
    assert 0 < two < len(specs)
    # every third case names a mutation, in turn (fuzz_cases.draw_specs), so from 3 cases
    # per mutation on each is named; at CI's 300 cases each must have been applied at
    # least once (a mutation whose builder finds every drawn case's sizes unfit tests
    # nothing). Measured at 300: every mutation of every op applied, the rarest once
    # (rms_norm, the conv ops, chunk_gated_delta_rule, decoder_run), most 2-13 times.
    # Fewer cases (NUMKERN_FUZZ_EXAMPLES) name a mutation once or not at all: not judged.
    if len(specs) >= max(300, 3 * len(muts)):
        never = [m for m in muts if not applied[m]]
        assert not never, f"mutations never applied (unfit for every drawn case): {never}"


def test_pool_reports_signals_hangs_and_wrong_results():
    """The harness itself: a worker killed by SIGSEGV and one past the timeout are
    reported with their case and replaced (the cases after them still run); a wrong result
    and a refusal that wrote its buffer are failures."""
    pool = F.Pool(1, timeout=3)
    try:
        muts = [None, "segv", None, "hang", "wrong", "write", None]
        res = pool.map([{"op": "_selftest", "seed": i, "mut": m} for i, m in enumerate(muts)])
    finally:
        pool.close()
    kinds = [r[0] for r in res]
    assert kinds == ["ok", "crash", "ok", "hang", "fail", "fail", "ok"], res
    assert "SIGSEGV" in res[1][1] and "wrong result" in res[4][1]
    assert "after writing" in res[5][1]
    # the mutation each finished case applied, as test_fuzz counts them
    assert [r[2].get("mut") for r in res] == [None, None, None, None, "wrong", "write", None]


# ---------------------------------------------------------------------------------------
# regressions: what the fuzzing found, fixed in the ops (each once, in this process)


def test_rms_norm_refuses_an_out_overlapping_input():
    """out one row ahead of input in one buffer gave rows normed from already-written
    rows; now a ValueError naming out, nothing written. In place stays allowed."""
    import torch

    from numkern import norm

    buf = torch.randn(6 * 16)
    before = buf.clone()
    for x, out in [
        (buf[:80].view(5, 16), buf[16:].view(5, 16)),
        (buf.view(6, 16)[:5, :8], buf.view(6, 16)[1:, 4:12]),
    ]:
        with pytest.raises(ValueError, match=r"^out: expected memory apart from input"):
            norm.rms_norm(out, x, None, 1e-6)
    assert torch.equal(buf, before)
    x = buf.view(6, 16)
    norm.rms_norm(x, x, None, 1e-6)
    assert torch.allclose(
        x, before.view(6, 16) / before.view(6, 16).pow(2).mean(1, True).add(1e-6).sqrt()
    )


def test_rms_norm_takes_empty_leading_dims_of_any_strides():
    """[0, 0, H] with strides [35, 35, 1] (no rows) was refused as not collapsible."""
    import torch

    from numkern import norm

    x = torch.empty(40).as_strided((0, 0, 32), (35, 35, 1))
    out = torch.empty(40).as_strided((0, 0, 32), (35, 35, 1))
    norm.rms_norm(out, x, None, 1e-6)
    norm.fused_add_rms_norm(x, out, None, 1e-6)


def _one_key_attention(q_val, sinks):
    """One request, one query, one key (k = 1 in dim 0, 0 elsewhere): the score of q[0, h]
    is q_val * scale for head 0 and 0 for head 1."""
    import torch

    from numkern import attention as A

    d, b = 32, 32
    kv = torch.zeros(A.kv_cache_shape(2, 1, b, d))
    kc, vc = A.split_kv_cache(kv)
    k, v = torch.zeros(1, 1, d), torch.ones(1, 1, d)
    k[0, 0, 0] = 1.0
    A.reshape_and_cache(k, v, kc, vc, torch.tensor([b]), "vec")
    q = torch.zeros(1, 2, d)
    q[0, 0, 0] = q_val
    out = torch.full_like(q, 7.0)
    i32 = torch.int32
    A.paged_attention(
        q,
        kc,
        vc,
        out,
        torch.tensor([0, 1], dtype=i32),
        torch.tensor([1], dtype=i32),
        torch.tensor([[1]], dtype=i32),
        scale=0.5,
        sinks=sinks,
        isa="vec",
    )
    return out


def test_attention_nan_and_inf_reach_a_row_with_one_visible_key():
    """A NaN score was dropped as a masked lane when it was the row's only visible one
    (output 0); a row whose only score is -inf was 0 too. Now NaN, as softmax gives, and
    0 with a sink (the sink takes all the weight); +inf is NaN either way."""
    import torch

    for val in (float("nan"), float("-inf"), float("inf")):
        out = _one_key_attention(val, None)
        assert out[0, 0].isnan().all(), val
        assert torch.equal(out[0, 1], torch.ones(32))  # the other head: its value row
    out = _one_key_attention(float("-inf"), torch.zeros(2))
    assert torch.equal(out[0, 0], torch.zeros(32))
    assert _one_key_attention(float("nan"), torch.zeros(2))[0, 0].isnan().all()


@pytest.mark.parametrize(
    "kw,exc",
    [
        ({"scale": "0.1"}, TypeError),
        ({"scale": True}, TypeError),
        ({"scale": float("nan")}, ValueError),
        ({"scale": 0.0}, ValueError),
        ({"softcap": -5.0}, ValueError),
        ({"softcap": float("inf")}, ValueError),
        ({"softcap": None}, TypeError),
    ],
)
def test_attention_checks_scale_and_softcap(kw, exc):
    """A str scale ("0.1") was converted silently, NaN or a negative soft-cap accepted."""
    import torch

    from numkern import attention as A

    d, b = 32, 32
    kc, vc = A.split_kv_cache(torch.zeros(A.kv_cache_shape(1, 1, b, d)))
    q = torch.zeros(1, 1, d)
    out = torch.full_like(q, 7.0)
    i32 = torch.int32
    args = dict(scale=0.5, isa="vec") | kw
    with pytest.raises(exc, match=f"^{next(iter(kw))}: "):
        A.paged_attention(
            q,
            kc,
            vc,
            out,
            torch.tensor([0, 1], dtype=i32),
            torch.tensor([1], dtype=i32),
            torch.tensor([[0]], dtype=i32),
            **args,
        )
    assert (out == 7.0).all()


def test_attention_refuses_outputs_over_its_inputs():
    """An output over the KV cache, or over the query shifted by a head, and a key read
    from the cache reshape_and_cache writes, gave garbage; now ValueErrors naming output
    and key, nothing written. An output that is the query itself stays allowed."""
    import torch

    from numkern import attention as A

    d, b = 32, 32
    kv = torch.randn(A.kv_cache_shape(2, 1, b, d))
    kc, vc = A.split_kv_cache(kv)
    before = kv.clone()
    i32 = torch.int32
    qsl, sl, bt = (torch.tensor(v, dtype=i32) for v in ([0, 2], [2], [[1]]))
    buf = torch.randn(2 * 3 * d + d)
    q = buf[: 2 * 3 * d].view(2, 3, d)[:, :2]  # [T=2, Hq=2, D] of a [2, 3, D] buffer
    for out in (kc[0, 0, :4].reshape(2, 2, d), buf[d:].view(2, 3, d)[:, :2]):
        with pytest.raises(ValueError, match=r"^output: expected memory apart from"):
            A.paged_attention(q, kc, vc, out, qsl, sl, bt, scale=0.5, isa="vec")
    key = kv.view(-1)[:d].view(1, 1, d)
    with pytest.raises(ValueError, match=r"^key: expected memory apart from key_cache"):
        A.reshape_and_cache(key, torch.zeros(1, 1, d), kc, vc, torch.tensor([0]), "vec")
    assert torch.equal(kv, before)
    A.paged_attention(q, kc, vc, q, qsl, sl, bt, scale=0.5, isa="vec")  # in place


def test_conv_refuses_x_sharing_the_states():
    """x read from a column of the conv_states it rewrites gave states rolled from the
    already-rolled column; now a ValueError naming x (the fast path and the checked one),
    nothing written."""
    import torch

    from numkern.gdn import conv

    dim, width = 32, 4
    st = torch.randn(3, width - 1, dim).transpose(1, 2)  # vLLM's layout [S, dim, W-1]
    before = st.clone()
    w = torch.randn(dim, width)
    for x in (st[:2, :, 1], st[1:, :, 0]):
        with pytest.raises(ValueError, match=r"^x: expected memory apart from conv_states"):
            conv.causal_conv1d_update(x, st, w, None, False, None, False)
    with pytest.raises(ValueError, match=r"^x: expected memory apart from conv_states"):
        qsl = torch.tensor([0, width - 1], dtype=torch.int32)
        conv.causal_conv1d_fwd(st[0], w, None, st, qsl, None, None, False, False)
    assert torch.equal(st, before)


def test_gdn_gating_softplus_of_minus_inf_is_zero():
    """The 16-lane softplus passed NaN through as x * 0, which made -inf NaN too
    (softplus(-inf) = 0, so g = -0); the scalar tail was right."""
    import torch

    from numkern.gdn import gating

    h = 17
    a = torch.zeros(2, h)
    a[0] = float("-inf")
    a[1, :] = float("nan")
    g, beta = gating.fused_gdn_gating(torch.zeros(h), a, torch.zeros(2, h), torch.zeros(h))
    assert torch.equal(g[0, 0], torch.zeros(h)) and g[0, 1].isnan().all()
    assert torch.equal(beta, torch.full((1, 2, h), 0.5))


def test_gdn_state_pool_with_one_head_of_any_stride():
    """A pool [S, 1, Dk, Dv] whose head dim (size 1) has another stride (torch gives 0 to
    an empty pool's, e.g. ``torch.randn(0, 1, 16, 16) * 0.1``) was refused."""
    import torch

    from numkern.gdn import rule

    dk = dv = 16
    pool = torch.randn(2 * dk * dv + 5).as_strided((2, 1, dk, dv), (dk * dv + 5, 3, dv, 1))
    q, k, v = (torch.randn(1, 2, 1, dk) for _ in range(3))
    a, b = torch.randn(2, 1), torch.randn(2, 1)
    ref_pool = pool.contiguous()
    i32 = torch.int32
    args = (torch.tensor([1, 0], dtype=i32), torch.tensor([0, 1, 2], dtype=i32), True)
    cst = torch.zeros(1)
    out = rule.fused_sigmoid_gating_delta_rule_update(cst, cst, q, k, v, a, b, pool, *args)
    ref = rule.fused_sigmoid_gating_delta_rule_update(cst, cst, q, k, v, a, b, ref_pool, *args)
    assert torch.equal(out, ref) and torch.equal(pool, ref_pool)
    empty = torch.randn(0, 1, dk, dv) * 0.1
    assert empty.stride()[1] == 0
    none = torch.zeros(0, dtype=i32)
    z = torch.zeros(1, 0, 1, dk)
    out = rule.fused_sigmoid_gating_delta_rule_update(
        cst,
        cst,
        z,
        z,
        z,
        torch.zeros(0, 1),
        torch.zeros(0, 1),
        empty,
        none,
        torch.zeros(1, dtype=i32),
        True,
    )
    assert out.shape == (0, 1, 1, dv)


def _decoder_step():
    """test_decoder's fp32 stack (dense, MLP outside, dense) and a decode step of its two
    requests: (stack, caches, plan, positions, cos_sin_cache)."""
    import torch

    from . import test_decoder as T

    layers, fnorm, head, _ = T._weights(torch.float32, qk_norm=False, bias=False)
    caches = T._caches(torch.float32)
    stack = T._stack(layers, fnorm, head, caches, "vec")
    qsl, sl, reqs, positions, _ = T.STEPS[1]
    slots = [s for r, _, n in reqs for s in T._slots(r, positions[qsl[r] : qsl[r] + n])]
    plan = T._plan(qsl, sl, T.TABLE, slots, "vec")
    return stack, caches, plan, torch.tensor(positions), T._cos_sin(64)


def test_decoder_run_of_no_tokens():
    """A step of no tokens corrupted the heap (malloc(): invalid size): the fused run's
    GEMM blocks took at least one row. Now every run of it validates and computes
    nothing: the hand-off rows are [0, H], the head writes no logits, nothing else is
    written. In a child process: a regression would kill it, not pytest."""
    out = run_child(
        """
import torch
from numkern import attention as A
from tests import test_decoder as T
from tests.test_fuzz import _decoder_step
stack, caches, _, _, cs = _decoder_step()
before = [c.clone() for c in caches]
i32, i64 = torch.int32, torch.int64
plan = A.plan_attention(torch.tensor([0, 0, 0], dtype=i32), torch.tensor([5, 37], dtype=i32),
    num_heads=T.HQ, num_kv_heads=T.HKV, head_dim=T.D, block_size=T.B, isa="vec",
    block_table=torch.tensor(T.TABLE, dtype=i32), slot_mapping=torch.zeros(0, dtype=i64),
    num_blocks=8)
h, pos, none = torch.empty(0, T.H), torch.zeros(0, dtype=i64), torch.zeros(0, dtype=i64)
for workers in (1, 2):
    x = T.run_once(stack, h, plan, pos, cs, layers=(0, 2), workers=workers)
    assert x.shape == (0, T.H)
    y = T.run_once(stack, h, plan, pos, cs, layers=(2, 3), residual_add=x, logits_rows=none,
                   logits=torch.empty(0, T.VOCAB), workers=workers)
    assert y is None
assert all(torch.equal(a.isnan(), b.isnan()) for a, b in zip(caches, before))
print("ok")
"""
    )
    assert out.strip().endswith("ok")


def test_decoder_refuses_outputs_sharing_memory():
    """hidden inside a KV cache, logits over hidden or over a cache, a residual_add one row
    off hidden, and two layers sharing one cache were accepted (garbage in hidden, the
    logits or the caches); now ValueErrors naming them, nothing written."""
    import torch

    from numkern import attention as A
    from numkern.decoder import DecoderStack

    from . import test_decoder as T

    stack, caches, plan, pos, cs = _decoder_step()
    h = torch.randn(2, T.H)
    rows = torch.tensor([0, 1])
    before = [c.clone() for c in caches]
    flat = caches[1].view(-1)
    buf = torch.randn(3 * T.H + 2 * T.VOCAB)
    in_cache = flat[: 2 * T.H].view(2, T.H)
    over_hidden = buf[T.H :][: 2 * T.VOCAB].view(2, -1), buf[: 2 * T.H].view(2, -1)
    over_cache = flat[5 : 5 + 2 * T.VOCAB].view(2, -1)
    cases = [
        (in_cache, torch.empty(2, T.VOCAB), "hidden: expected memory apart from the KV caches'"),
        (over_hidden[1], over_hidden[0], "logits: expected memory apart from hidden's"),
        (h, over_cache, "logits: expected memory apart from the KV caches' .* with caches"),
    ]
    for hidden, logits, match in cases:
        with pytest.raises(ValueError, match="^" + match):
            T.run_once(stack, hidden, plan, pos, cs, layers=(2, 3), logits_rows=rows, logits=logits)
    for shift in (T.H, -T.H):  # the add a row ahead of hidden, or a row behind
        hid, add = buf[max(0, -shift) :][: 2 * T.H], buf[max(0, shift) :][: 2 * T.H]
        with pytest.raises(ValueError, match=r"^residual_add: expected memory apart from"):
            T.run_once(
                stack, hid.view(2, -1), plan, pos, cs, layers=(2, 3), residual_add=add.view(2, -1)
            )
    assert all(torch.equal(a.isnan(), b.isnan()) for a, b in zip(caches, before))
    views = [A.cache_view(caches[0], "vec")] * 2 + [A.cache_view(caches[2], "vec")]
    layers = T._layer_weights(T._weights(torch.float32, qk_norm=False, bias=False)[0])
    kw = dict(num_heads=T.HQ, num_kv_heads=T.HKV, head_dim=T.D, eps=T.EPS)
    with pytest.raises(ValueError, match=r"^caches\[1\]: expected memory apart from caches\[0"):
        DecoderStack(layers, views, final_norm=stack.final_norm, lm_head=stack.lm_head, **kw)


# ---------------------------------------------------------------------------------------
# sizes near 2^31 elements: one case a child process, rows at the far end checked

HEAVY = {
    # a GEMM output of more than 2^31 elements (4.3 GB bf16): the last rows and the rows
    # around element 2^31
    "linear_output": """
import torch, numkern
from tests.test_gemm import assert_close_linear
M, N, K = 2**16 + 1, 2**15, 16
assert M * N > 2**31
x, w = torch.randn(M, K).bfloat16(), torch.randn(N, K).bfloat16()
out = torch.empty(M, N, dtype=torch.bfloat16)
numkern.weight_packed_linear(out, x, numkern.convert_weight_packed(w), None, True)
for rows in (slice(M - 3, M), slice(2**31 // N - 2, 2**31 // N + 1)):
    assert_close_linear(out[rows], x[rows], w, None)
print("ok")
""",
    # a KV cache of more than 2^31 elements (4.3 GB bf16): one request in its last blocks,
    # written and read in both layouts
    "kv_cache": """
import torch
from numkern import attention as A
from tests.test_attention import assert_close_attn, reference
D, B, HKV, HQ = 128, 32, 1, 4
nb = 2**31 // (HKV * B * 2 * D) + 4
kv = torch.empty(A.kv_cache_shape(nb, HKV, B, D), dtype=torch.bfloat16)
assert kv.numel() > 2**31
kc, vc = A.split_kv_cache(kv)
kl = 3 * B - 5
blocks = torch.tensor([nb - 1, nb - 4, nb - 2], dtype=torch.int32)
k, v = torch.randn(kl, HKV, D).bfloat16(), torch.randn(kl, HKV, D).bfloat16()
pos = torch.arange(kl)
slots = blocks[pos // B].long() * B + pos % B
q = torch.randn(5, HQ, D).bfloat16()
qsl, sl = torch.tensor([0, 5], dtype=torch.int32), torch.tensor([kl], dtype=torch.int32)
ref = reference(q, qsl, sl, [k], [v], HKV, scale=D**-0.5)
for isa in ("vec", "amx"):
    A.reshape_and_cache(k, v, kc, vc, slots, isa)
    out = torch.full_like(q, float("nan"))
    A.paged_attention(q, kc, vc, out, qsl, sl, blocks[None], scale=D**-0.5, isa=isa)
    assert_close_attn(out, ref)
print("ok")
""",
    # an RMS norm in place over more than 2^31 elements (4.3 GB bf16): the last rows
    "rms_norm": """
import torch
from numkern import norm
from tests.close import assert_within
from tests.test_norm import reference
H = 4096
R = 2**31 // H + 3
# zeros, not empty: the in-place norm reads each page of never-touched memory and then
# writes it, two page faults a page (the zero page mapped, then replaced): 7-8.5 s for
# the norm on a 2-vCPU VM, against 1.1-1.2 s for zeros and the norm
x = torch.zeros(R, H, dtype=torch.bfloat16)
assert x.numel() > 2**31
x[-4:] = torch.randn(4, H).bfloat16()
w = torch.randn(H)
ref = reference(x[-4:].clone(), w, 1e-6)
norm.rms_norm(x, x, w, 1e-6)
assert_within(x[-4:], ref, ref.abs(), torch.bfloat16, "norm")
print("ok")
""",
}


@pytest.mark.heavy
@pytest.mark.parametrize("name", list(HEAVY))
def test_near_2_31_elements(name):
    """Each case allocates about 4.3 GB; a child process each, one at a time."""
    assert run_child(HEAVY[name], timeout=600).strip().endswith("ok")
