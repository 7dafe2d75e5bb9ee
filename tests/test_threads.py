"""Python threads calling numkern's ops at once get exactly the single-threaded results.

numkern's kernels release the GIL, so calls from several threads run at the same time
(docs/kernels.md §2.7). Each family below runs in a child process, so a crash (two threads
sharing one MoE scratch died of SIGSEGV) fails its test instead of killing pytest. In the
child the main thread first runs every worker's cases alone (the reference); then the
workers start together (a barrier) and each runs its cases ROUNDS times, each round in
another order, comparing every output bitwise with the reference. Workers of a family run
different shapes at the same moment (MoE with T = 1 beside T = 513, attention plans of
decode beside prefill, one plan shared by two workers, the decoder on two sets of requests).
"""

import itertools
import json
import math
import os
import signal
import subprocess
import sys
import threading

import numba
import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ROUNDS = 6
BF = torch.bfloat16


# -- the harness (runs in the child) -------------------------------------------------------


def _same(a, b):
    """Bitwise equality of two tensors (NaN included)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    return torch.equal(
        a.contiguous().view(-1).view(torch.uint8), b.contiguous().view(-1).view(torch.uint8)
    )


def _hammer(workers, rounds=ROUNDS, probe=None):
    """``workers[w]``: worker w's cases, callables returning a tuple of fresh tensors.

    Returns the report the test reads: mismatches ``(worker, case, round)``, errors,
    calls made, and ``probe()`` of each worker after its first and last round."""
    want = [[case() for case in cases] for cases in workers]  # alone, in the main thread
    barrier = threading.Barrier(len(workers))
    mismatches, errors, calls = [], [], [0] * len(workers)
    probes = [[None, None] for _ in workers]

    def work(w):
        try:
            cases = workers[w]
            barrier.wait()
            for r in range(rounds):
                order = list(range(len(cases)))
                shift = (r + 3 * w) % len(order)
                order = order[shift:] + order[:shift]
                if (r + w) % 2:
                    order.reverse()
                for i in order:
                    got = cases[i]()
                    calls[w] += 1
                    if not all(_same(a, b) for a, b in zip(got, want[w][i], strict=True)):
                        mismatches.append((w, i, r))
                if probe is not None and r in (0, rounds - 1):
                    probes[w][r > 0] = probe()
        except BaseException as exc:  # reported, not lost in the thread
            errors.append(f"worker {w}: {type(exc).__name__}: {exc}")

    threads = [threading.Thread(target=work, args=(w,)) for w in range(len(workers))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return {
        "layer": numba.threading_layer(),
        "workers": len(workers),
        "expected_calls": [rounds * len(c) for c in workers],
        "calls": calls,
        "mismatches": mismatches[:20],
        "errors": errors,
        "probes": probes,
    }


# -- the families (run in the child) --------------------------------------------------------

MOE_TOKENS = (1, 513, 2, 64, 7, 300)
MOE_SHAPE = (8, 2, 128, 128)  # E, k, H, I


def _moe():
    """Three workers, each with every token count; bf16 and an fp32 case with biases."""
    from numkern import moe

    e_n, k, h, i_n = MOE_SHAPE
    g = torch.Generator().manual_seed(0)

    def weights(dt, bias):
        w13 = (torch.randn(e_n, 2 * i_n, h, generator=g) / math.sqrt(h)).to(dt)
        w2 = (torch.randn(e_n, h, i_n, generator=g) / math.sqrt(i_n)).to(dt)
        b13 = torch.randn(e_n, 2 * i_n, generator=g).to(dt) if bias else None
        b2 = torch.randn(e_n, h, generator=g).to(dt) if bias else None
        pack = moe.prepack_moe_weight
        return pack(w13, "vec"), pack(w2, "vec"), b13, b2

    packed = {BF: weights(BF, False), torch.float32: weights(torch.float32, True)}

    def case(t_n, dt):
        x = torch.randn(t_n, h, generator=g).to(dt)
        tw, ti = moe.topk_softmax(torch.randn(t_n, e_n, generator=g), k, True)
        w13, w2, b13, b2 = packed[dt]

        def run():
            out = torch.empty_like(x)
            moe.fused_moe(out, x, w13, w2, b13, b2, tw, ti, isa="vec")
            return (out,)

        return run

    cases = [case(t, BF) for t in MOE_TOKENS] + [case(33, torch.float32)]

    def probe():  # this thread's scratch (held until the ids are taken: ids stay unique)
        return moe.workspace.buffer

    report = _hammer([cases] * 3, probe=probe)
    report["probes"] = [[[id(buf), buf.nbytes] for buf in p] for p in report["probes"]]
    plan = moe.moe_workspace_plan(max(MOE_TOKENS), k, e_n, h, i_n, BF, numba.get_num_threads())
    report["largest_plan"] = plan.total_bytes
    report["main_buffer"] = id(moe.workspace.buffer)
    return report


def _attention():
    """Decode (long ranges split and merged) and prefill plans over one cache; workers 0
    and 2 share the decode plan; each worker also writes its own slots of a second cache."""
    from numkern import attention as A

    hq, hkv, d, b, isa = 4, 2, 64, 32, "vec"
    g = torch.Generator().manual_seed(1)
    lens = [1290, 33, 700, 600, 37]
    per = -(-max(lens) // b)  # blocks per request
    nb = len(lens) * per
    kv = torch.full(A.kv_cache_shape(nb, hkv, b, d), float("nan"), dtype=BF)
    kc, vc = A.split_kv_cache(kv)
    table = torch.randperm(nb, generator=g).reshape(len(lens), per).int()  # shuffled
    for r, n in enumerate(lens):  # every request's keys, through its own table
        pos = torch.arange(n)
        k = torch.randn(n, hkv, d, generator=g).to(BF)
        v = torch.randn(n, hkv, d, generator=g).to(BF)
        A.reshape_and_cache(k, v, kc, vc, table[r, pos // b].long() * b + pos % b, isa)
    heads = dict(num_heads=hq, num_kv_heads=hkv, head_dim=d, block_size=b, isa=isa)

    def step(reqs, planned):
        """reqs: (request, q_len) -> the step's indices and its plan (None: per call)."""
        rows = [r for r, _ in reqs]
        qsl = torch.tensor([0, *itertools.accumulate(q for _, q in reqs)], dtype=torch.int32)
        sl = torch.tensor([lens[r] for r in rows], dtype=torch.int32)
        plan = A.plan_attention(qsl, sl, **heads) if planned else None
        return qsl, sl, table[rows].contiguous(), plan

    def case(st):  # a call of step ``st`` with queries of its own
        qsl, sl, bt, plan = st
        q = torch.randn(int(qsl[-1]), hq, d, generator=g).to(BF)

        def run():
            out = torch.empty_like(q)
            A.paged_attention(q, kc, vc, out, qsl, sl, bt, scale=d**-0.5, isa=isa, plan=plan)
            return (out,)

        return run

    decode = step([(0, 1), (2, 1)], True)  # 1290 and 700 keys: split, then merged
    prefill = step([(4, 37), (3, 5)], True)
    unplanned = step([(2, 3), (0, 1)], False)
    written = torch.full(A.kv_cache_shape(12, hkv, b, d), float("nan"), dtype=BF)
    wk, wv = A.split_kv_cache(written)

    def write_case(w):  # worker w writes blocks 4w .. 4w+3 only
        n = 100
        k = torch.randn(n, hkv, d, generator=g).to(BF)
        v = torch.randn(n, hkv, d, generator=g).to(BF)
        slots = 4 * w * b + torch.randperm(4 * b, generator=g)[:n]

        def run():
            A.reshape_and_cache(k, v, wk, wv, slots, isa)
            return wk[4 * w : 4 * w + 4].clone(), wv[4 * w : 4 * w + 4].clone()

        return run

    da, db = case(decode), case(decode)  # one plan, two workers, other queries
    workers = [
        [da, da, da, case(prefill), write_case(0)],
        [case(prefill), case(unplanned), write_case(1)],
        [db, db, db, case(unplanned), write_case(2)],
    ]
    return _hammer(workers, rounds=2 * ROUNDS)  # (decode calls are short: more rounds)


def _dense():
    """weight_packed_linear (M = 1 .. 33, a short last block, an fp32 router weight),
    rms_norm, fused_add_rms_norm and rotary_embedding."""
    import numkern
    from numkern import norm, rope

    g = torch.Generator().manual_seed(2)
    n, k = 100, 128
    w = numkern.convert_weight_packed(torch.randn(n, k, generator=g).to(BF))
    bias = torch.randn(n, generator=g)
    router = numkern.convert_weight_packed(torch.randn(8, k, generator=g))

    def linear(m, weight, b, out_dt):
        x = torch.randn(m, k, generator=g).to(BF)

        def run():
            out = torch.empty(m, weight.shape[0], dtype=out_dt)
            numkern.weight_packed_linear(out, x, weight, b, True)
            return (out,)

        return run

    def norms(m):
        x = torch.randn(m, k, generator=g).to(BF)
        r = torch.randn(m, k, generator=g).to(BF)
        nw = torch.randn(k, generator=g).to(BF)

        def run():
            out = torch.empty_like(x)
            norm.rms_norm(out, x, nw, 1e-6)
            xi, ri = x.clone(), r.clone()
            norm.fused_add_rms_norm(xi, ri, nw, 1e-6)
            return out, xi, ri

        return run

    def rotary(t_n, neox):
        pos = torch.randint(0, 64, (t_n,), generator=g)
        q = torch.randn(t_n, 4, 64, generator=g).to(BF)
        kk = torch.randn(t_n, 2, 64, generator=g).to(BF)
        cs = torch.randn(64, 64, generator=g)

        def run():
            qi, ki = q.clone(), kk.clone()
            rope.rotary_embedding(pos, qi, ki, 64, cs, neox)
            return qi, ki

        return run

    cases = [linear(m, w, bias, BF) for m in (1, 3, 9, 33)]
    cases += [linear(5, router, None, torch.float32), norms(1), norms(70)]
    cases += [rotary(1, True), rotary(40, False)]
    return _hammer([cases] * 3)


def _decoder():
    """One DecoderStack run by two workers, each on its own requests, plans, prepared steps
    (their workspaces) and blocks of the stack's caches (worker w: blocks 8w .. 8w+7), a
    prefill step then a decode step (the layer between runs outside, as an MoE)."""
    from numkern import attention as A

    from . import test_decoder as T

    dt, isa, nb = BF, "vec", 16
    layers, fnorm, head, outside = T._weights(dt, qk_norm=True, bias=True)
    caches = [torch.full(A.kv_cache_shape(nb, T.HKV, T.B, T.D), float("nan"), dtype=dt)]
    caches += [torch.full_like(caches[0], float("nan")) for _ in range(2)]
    stack = T._stack(layers, fnorm, head, caches, isa)
    cs = T._cos_sin(128)
    g = torch.Generator().manual_seed(3)

    def steps_of(w, lens):
        table = [[8 * w + 3, 8 * w + 0, 8 * w + 5], [8 * w + 6, 8 * w + 1, 8 * w + 7]]
        heads = dict(num_heads=T.HQ, num_kv_heads=T.HKV, head_dim=T.D, block_size=T.B)
        bt = torch.tensor(table, dtype=torch.int32)
        steps = []
        for q_lens, starts in ((lens, (0, 0)), ((1, 1), lens)):  # prefill, then decode
            spans = [
                (r, p) for r, (q, s) in enumerate(zip(q_lens, starts)) for p in range(s, s + q)
            ]
            positions = [p for _, p in spans]
            slots = torch.tensor([table[r][p // T.B] * T.B + p % T.B for r, p in spans])
            qsl = torch.tensor([0, q_lens[0], sum(q_lens)], dtype=torch.int32)
            sl = torch.tensor([s + q for q, s in zip(q_lens, starts)], dtype=torch.int32)
            tables = dict(block_table=bt, slot_mapping=slots, num_blocks=nb)
            plan = A.plan_attention(qsl, sl, **heads, isa=isa, **tables)
            h = (torch.randn(len(positions), T.H, generator=g) * 0.5).to(dt)
            rows = torch.tensor([q_lens[0] - 1, sum(q_lens) - 1])
            steps.append((plan, torch.tensor(positions), h, rows))

        def run():
            return tuple(
                T._forward(stack, outside, h, plan, pos, cs, rows) for plan, pos, h, rows in steps
            )

        return run

    return _hammer([[steps_of(0, (5, 70))], [steps_of(1, (41, 9))]], rounds=2 * ROUNDS)


FAMILIES = {"moe": _moe, "attention": _attention, "dense": _dense, "decoder": _decoder}


def child(family):
    """Entry of the child process: print the family's report as one JSON line."""
    print(json.dumps(FAMILIES[family]()), flush=True)


# -- the tests (the parent) ----------------------------------------------------------------


def _run(code, env=None, timeout=600):
    """Run ``code`` in a fresh interpreter; a death by signal fails the test."""
    env = {**os.environ, **(env or {})}
    cmd = [sys.executable, "-c", code]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env, timeout=timeout)
    if proc.returncode < 0:
        name = signal.Signals(-proc.returncode).name
        pytest.fail(f"the child process died of {name}:\n{proc.stderr[-3000:]}")
    return proc


def _report(family):
    proc = _run(f"from tests.test_threads import child; child({family!r})")
    if proc.returncode:
        pytest.fail(f"the child process failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _check(report):
    assert report["layer"] in ("tbb", "omp")
    assert not report["errors"], report["errors"]
    assert not report["mismatches"], f"(worker, case, round) off the reference: {report}"
    assert report["calls"] == report["expected_calls"]


@pytest.mark.parametrize("family", ["attention", "dense", "decoder"])
def test_concurrent_calls_equal_the_single_threaded_results(family):
    _check(_report(family))


def test_fused_moe_from_three_threads_uses_one_scratch_per_thread():
    """T = 1 beside T = 513 (this crashed with one process-wide scratch); each thread's
    scratch grows to its largest call in the first round and then stays."""
    report = _report("moe")
    _check(report)
    first = [p[0] for p in report["probes"]]
    last = [p[1] for p in report["probes"]]
    assert first == last  # same buffer after the first round: grown once, kept
    ids = {buf for buf, _ in first} | {report["main_buffer"]}
    assert len(ids) == report["workers"] + 1  # one per thread, the main thread's too
    assert all(size >= report["largest_plan"] for _, size in first)


_LAYER = """
import numba
try:
    import numkern
except RuntimeError as e:
    print("refused:", e)
@numba.njit(parallel=True)
def f(n):
    s = 0
    for i in numba.prange(n):
        s += i
    return s
f(10)
print("running:", numba.threading_layer())
numba.config.THREADING_LAYER = "threadsafe"  # too late: workqueue already runs
try:
    import numkern
except RuntimeError as e:
    print("refused:", e)
"""


def test_threading_layer_refuses_workqueue():
    """workqueue aborts on concurrent launches: numkern refuses it when asked for in
    NUMBA_THREADING_LAYER and when it already runs; by default it narrows Numba's choice
    to tbb or omp (checked by every family above)."""
    out = _run(_LAYER, env={"NUMBA_THREADING_LAYER": "workqueue"}).stdout.splitlines()
    assert out[0].startswith("refused: NUMBA_THREADING_LAYER: expected one of")
    assert out[1] == "running: workqueue"
    assert out[2].startswith("refused: numba.threading_layer(): expected tbb or omp")
