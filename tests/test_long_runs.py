"""Op-level long runs: 2,000 calls of each op, shapes varying from call to call, keep the
process's memory flat once warmed up (docs/kernels.md §2.7, §5.5).

A child process makes the calls, one op after another (pytest's own memory stays out of
the figures, and a crash fails the test). For each op, RSS after its call 2,000 must stay
within RSS after its call 200 plus 32 MB. Inputs of each shape
are made once; each call allocates its outputs (and plans) as a caller does. fused_moe's
per-thread scratch grows to the largest call's plan and stays.

Heavy: the 20,000 calls take 10-40 s on a 2-vCPU VM (each parallel call pays its thread
wake-ups, and more so while other processes share the cores).
"""

import itertools
import json
import os
import signal
import subprocess
import sys
from types import SimpleNamespace

import psutil
import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CALLS, WARM = 2000, 200
SLACK = 32 << 20  # bytes RSS may grow between call WARM and call CALLS
BF = torch.bfloat16

pytestmark = pytest.mark.heavy


def _long_run(call, shapes):
    """``call(shape)`` CALLS times over ``shapes`` in turn; RSS after WARM and after CALLS."""
    proc = psutil.Process()
    cycle = itertools.cycle(shapes)
    for _ in range(WARM):
        call(next(cycle))
    warm = proc.memory_info().rss
    for _ in range(CALLS - WARM):
        call(next(cycle))
    return {"rss_warm": warm, "rss_end": proc.memory_info().rss}


# -- the ops (run in the child) -------------------------------------------------------------

MOE_TOKENS = (1, 3, 17, 64, 513, 2, 5, 33)
MOE_SHAPE = (8, 2, 64, 64)  # E, k, H, I


def _moe(g):
    import numba

    from numkern import moe

    e_n, k, h, i_n = MOE_SHAPE
    w13 = moe.prepack_moe_weight((torch.randn(e_n, 2 * i_n, h, generator=g) / 8).to(BF), "vec")
    w2 = moe.prepack_moe_weight((torch.randn(e_n, h, i_n, generator=g) / 8).to(BF), "vec")
    inputs = {}
    for t_n in MOE_TOKENS:
        tw, ti = moe.topk_softmax(torch.randn(t_n, e_n, generator=g), k, True)
        inputs[t_n] = (torch.randn(t_n, h, generator=g).to(BF), tw, ti)
    seen = []

    def call(t_n):
        x, tw, ti = inputs[t_n]
        moe.fused_moe(torch.empty_like(x), x, w13, w2, None, None, tw, ti, isa="vec")
        buf = moe.workspace.buffer
        seen.append((id(buf), buf.nbytes))

    report = _long_run(call, MOE_TOKENS)
    plan = moe.moe_workspace_plan(max(MOE_TOKENS), k, e_n, h, i_n, BF, numba.get_num_threads())
    report["largest_plan"] = plan.total_bytes
    report["scratch_after_warm"] = len(set(seen[WARM - 1 :]))  # distinct buffers from call WARM
    report["scratch_bytes"] = seen[-1][1]
    return report


def _attention(g):
    """Per call: a new plan, reshape_and_cache of the step's new tokens, paged_attention."""
    from numkern import attention as A

    hq, hkv, d, b, isa = 4, 2, 64, 32, "vec"
    lens = [400, 33, 150, 64, 129]
    per = -(-max(lens) // b)
    kv = torch.zeros(A.kv_cache_shape(len(lens) * per, hkv, b, d), dtype=BF)
    kc, vc = A.split_kv_cache(kv)
    table = torch.randperm(len(lens) * per, generator=g).reshape(len(lens), per).int()
    heads = dict(num_heads=hq, num_kv_heads=hkv, head_dim=d, block_size=b, isa=isa)
    steps = [  # (request, q_len): decode batches and prefill chunks
        [(0, 1), (1, 1), (2, 1)],
        [(3, 40)],
        [(4, 29), (0, 1)],
        [(2, 1)],
        [(1, 33), (3, 1), (4, 1)],
    ]
    inputs = []
    for reqs in steps:
        rows = [r for r, _ in reqs]
        qsl = torch.tensor([0, *itertools.accumulate(q for _, q in reqs)], dtype=torch.int32)
        sl = torch.tensor([lens[r] for r in rows], dtype=torch.int32)
        pos = torch.cat([torch.arange(lens[r] - q, lens[r]) for r, q in reqs])
        req = torch.cat([torch.full((q,), r) for r, q in reqs])
        slots = table[req, pos // b].long() * b + pos % b
        t_n = int(qsl[-1])
        new_kv = [torch.randn(t_n, hkv, d, generator=g).to(BF) for _ in range(2)]
        q = torch.randn(t_n, hq, d, generator=g).to(BF)
        inputs.append((qsl, sl, table[rows].contiguous(), slots, new_kv, q))

    def call(i):
        qsl, sl, bt, slots, (k, v), q = inputs[i]
        plan = A.plan_attention(qsl, sl, **heads)
        A.reshape_and_cache(k, v, kc, vc, slots, isa)
        out = torch.empty_like(q)
        A.paged_attention(q, kc, vc, out, qsl, sl, bt, scale=d**-0.5, isa=isa, plan=plan)

    return _long_run(call, range(len(steps)))


def _linear(g):
    import numkern

    n, k = 100, 256  # a short last block of columns
    w = numkern.convert_weight_packed(torch.randn(n, k, generator=g).to(BF))
    bias = torch.randn(n, generator=g)
    xs = {m: torch.randn(m, k, generator=g).to(BF) for m in (1, 2, 5, 9, 33, 100)}

    def call(m):
        numkern.weight_packed_linear(torch.empty(m, n, dtype=BF), xs[m], w, bias, True)

    return _long_run(call, list(xs))


def _norm_rope(g):
    from numkern import norm, rope

    h, heads, d = 256, 4, 64
    weight = torch.randn(h, generator=g).to(BF)
    cs = torch.randn(512, d, generator=g)
    inputs = {}
    for t_n in (1, 7, 64, 130):
        x, r = (torch.randn(t_n, h, generator=g).to(BF) for _ in range(2))
        qk = torch.randn(t_n, 2 * heads, d, generator=g).to(BF)
        inputs[t_n] = (x, r, qk, torch.randint(0, 512, (t_n,), generator=g))

    def call(t_n):
        x, r, qk, pos = inputs[t_n]
        norm.rms_norm(torch.empty_like(x), x, weight, 1e-6)
        norm.fused_add_rms_norm(x, r, weight, 1e-6)  # in place, values stay bounded
        rope.rotary_embedding(pos, qk[:, :heads], qk[:, heads:], d, cs, True)

    return _long_run(call, list(inputs))


GDN_HEADS = (1, 2, 16, 32)  # Hk, Hv, Dk, Dv (conv dim 96)


def _gdn(g):
    """Each GDN op on its own: conv prefill and update, gating, the chunked and the
    recurrent delta rule, the gated norm."""
    from numkern import gdn

    hk, hv, dk, dv = GDN_HEADS
    width, n_slots = 4, 8
    dim = 2 * hk * dk + hv * dv
    i32 = torch.int32
    w = gdn.causal_conv1d_weight_pack(torch.randn(dim, width, generator=g).to(BF))
    bias = torch.randn(dim, generator=g).to(BF)
    conv_states = torch.randn(n_slots, width - 1, dim, generator=g).to(BF).transpose(1, 2)
    pool = torch.zeros(n_slots, hv, dk, dv)
    A_log, dt_bias = torch.randn(hv, generator=g), torch.randn(hv, generator=g).to(BF)
    norm_w = torch.randn(dv, generator=g).to(BF)
    batches = [(5,), (40, 3), (1, 1, 1, 1), (70,), (17, 0, 9)]  # request lengths
    inputs = []
    for lens in batches:
        t_n, r_n = sum(lens), len(lens)
        mixed = torch.randn(1, t_n, dim, generator=g).to(BF)  # the fused q|k|v projection
        a, bb = (torch.randn(t_n, hv, generator=g).to(BF) for _ in range(2))
        inputs.append(
            SimpleNamespace(
                x=mixed[0],
                q=mixed[..., : hk * dk].view(1, t_n, hk, dk),
                k=mixed[..., hk * dk : 2 * hk * dk].view(1, t_n, hk, dk),
                v=mixed[..., 2 * hk * dk :].view(1, t_n, hv, dv),
                a=a,
                b=bb,
                z=torch.randn(t_n, hv, dv, generator=g).to(BF),
                cu=torch.tensor([0, *itertools.accumulate(lens)], dtype=i32),
                slots=torch.randperm(n_slots, generator=g)[:r_n].to(i32),
                init=torch.ones(r_n, dtype=torch.bool),
            )
        )

    def conv_fwd(i):
        c = inputs[i]
        gdn.causal_conv1d_fwd(c.x.t(), w, bias, conv_states, c.cu, c.slots, c.init, True, True)

    def conv_update(i):
        c = inputs[i]
        x = c.x[: len(c.slots)]  # one token per request
        gdn.causal_conv1d_update(x, conv_states, w, bias, True, c.slots, True)

    def gating(i):
        c = inputs[i]
        gdn.fused_gdn_gating(A_log, c.a, c.b, dt_bias)

    def chunked(i):
        c = inputs[i]
        g_, beta = gdn.fused_gdn_gating(A_log, c.a, c.b, dt_bias)
        gdn.chunk_gated_delta_rule(c.q, c.k, c.v, g_, beta, pool, True, c.cu, False, True, c.slots)

    def recurrent(i):
        c = inputs[i]
        gdn.fused_sigmoid_gating_delta_rule_update(
            A_log, dt_bias, c.q, c.k, c.v, c.a, c.b, pool, c.slots, c.cu, True
        )

    def norm_gated(i):
        c = inputs[i]
        gdn.rms_norm_gated(c.v[0], c.z, norm_w, 1e-6)

    ops = {
        "gdn.causal_conv1d_fwd": conv_fwd,
        "gdn.causal_conv1d_update": conv_update,
        "gdn.fused_gdn_gating": gating,
        "gdn.chunk_gated_delta_rule": chunked,
        "gdn.fused_sigmoid_gating_delta_rule_update": recurrent,
        "gdn.rms_norm_gated": norm_gated,
    }
    return {name: _long_run(op, range(len(batches))) for name, op in ops.items()}


def child():
    """Entry of the child process: one JSON line of {op: report}."""
    g = torch.Generator().manual_seed(0)
    reports = {
        "fused_moe": _moe(g),
        "paged_attention+reshape_and_cache": _attention(g),
        "weight_packed_linear": _linear(g),
        "rms_norm+rotary_embedding": _norm_rope(g),
        **_gdn(g),
    }
    print(json.dumps(reports), flush=True)


# -- the tests (the parent) ----------------------------------------------------------------

OPS = [
    "fused_moe",
    "paged_attention+reshape_and_cache",
    "weight_packed_linear",
    "rms_norm+rotary_embedding",
    "gdn.causal_conv1d_fwd",
    "gdn.causal_conv1d_update",
    "gdn.fused_gdn_gating",
    "gdn.chunk_gated_delta_rule",
    "gdn.fused_sigmoid_gating_delta_rule_update",
    "gdn.rms_norm_gated",
]


@pytest.fixture(scope="module")
def reports():
    cmd = [sys.executable, "-c", "from tests.test_long_runs import child; child()"]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=900)
    if proc.returncode < 0:
        name = signal.Signals(-proc.returncode).name
        pytest.fail(f"the child process died of {name}:\n{proc.stderr[-3000:]}")
    if proc.returncode:
        pytest.fail(f"the child process failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("op", OPS)
def test_rss_stays_flat_over_2000_calls(reports, op):
    r = reports[op]
    grown = (r["rss_end"] - r["rss_warm"]) / 2**20
    assert r["rss_end"] <= r["rss_warm"] + SLACK, f"{op}: RSS grew {grown:.1f} MB after call {WARM}"


def test_moe_scratch_grows_to_the_largest_call_and_stays(reports):
    r = reports["fused_moe"]
    assert r["scratch_after_warm"] == 1  # one buffer from call WARM on: no regrowth
    assert r["scratch_bytes"] == r["largest_plan"]
