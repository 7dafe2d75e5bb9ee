"""The decoder run (``numkern.decoder.DecoderStack.prepare`` and ``run``, docs/kernels.md
§8) for ``tests/test_fuzz.py``: a hypothesis strategy of case specs and the builder the
pool runs (harness, arenas and mutations as in ``tests/fuzz_cases.py``).

A case builds a tiny stack with ``tests/test_decoder.py``'s sizes (three layers, H 64,
4 query and 2 KV heads of 32, I 72, vocab 96) in fp32 or bf16, with one KV-cache group
(``vec``, blocks of 32) or two (the second ``vec16``, blocks of 16), each layer's MLP
dense or outside (an MoE stand-in) and its token mixer attention or outside (a Gated
DeltaNet stand-in), and the options a stack takes (q/k norms, biases, sinks, sandwich
norms, the attention output gate, tanh-GELU, both soft-caps, partial rotary, a window on
the first group). None of these is another compilation: the kernel is compiled once per
dtype (the two groups' ISAs share it), the signatures ``tests/test_decoder.py`` compiles.

Step 1 prefills each request's history (0 to 33 tokens, shuffled blocks of a NaN-filled
cache, unused table entries garbage). The case is step 2: 0, 1 or a few new tokens per
request, the stack's ``runs`` in order with the outside ops between them and the head on
the last, judged against ``tests/test_decoder.py``'s ``Reference`` (which runs both
steps): the logits of the rows asked, the residual stream ``hidden`` and the K/V the step
wrote (the only cache elements it may write). A mutation changes one run's arguments;
the runs before it belong to the build (the snapshot is taken after them), so a refusal
must leave hidden, logits and caches as they were. The torch op ``decoder_run`` (§12.5)
runs the same runs from the same state; its results must be the direct call's bits.
"""

import itertools
import math

import numpy as np
import torch
from hypothesis import strategies as st

from numkern.testing.tolerances import tolerance

from .fuzz_cases import (
    BF,
    FP16,
    FP32,
    I32,
    I64,
    Case,
    Refuse,
    TorchForm,
    check_nonfinite_rows,
    numpy_of,
    poison,
    spec_of,
    torch_ops,
)

NB = 12  # blocks per cache: three requests of up to 38 tokens in blocks of 16
GROUPS = (("vec", 32), ("vec16", 16))  # (isa, block size) of KV-cache groups 0 and 1
GARBAGE = (-1, NB, 2**31 - 1)  # table entries a step does not use

# mutations of one run's arguments, each with the runs it applies to: "any" run, the
# "head" run (the last), a run with a residual_add ("add"), or run 0 with the plans made
# in the call ("plan")
DECODER_MUTS = {
    "hidden_noncontig": "any",
    "hidden_dtype": "any",
    "hidden_shape": "any",
    "hidden_numpy": "any",
    "hidden_over_cache": "any",
    "pos_oob": "any",
    "pos_inplace": "any",
    "pos_int32": "any",
    "pos_shape": "any",
    "cs_torch": "any",
    "cs_f64": "any",
    "cs_rot": "any",
    "cs_short": "any",
    "cs_noncontig": "any",
    "cs_groups": "any",
    "plan_single": "any",
    "plan_untabled": "any",
    "plan_nb": "any",
    "plan_heads": "any",
    "plan_tokens": "any",
    "workers_bad": "any",
    "workers_ok": "any",
    "shared_bad": "any",
    "caches_len": "any",
    "caches_other": "any",
    "layers_type": "any",
    "layers_range": "any",
    "layers_span": "any",
    "add_shape": "add",
    "add_dtype": "add",
    "add_over_hidden": "add",
    "rows_oob": "head",
    "rows_int32": "head",
    "rows_2d": "head",
    "rows_numpy": "head",
    "logits_shape": "head",
    "logits_dtype": "head",
    "logits_noncontig": "head",
    "logits_over_hidden": "head",
    "logits_over_cache": "head",
    "logits_without_rows": "head",
    "rows_not_last": "any",
    "bt_oob": "plan",
    "bt_int64": "plan",
    "slot_oob": "plan",
}
# accepted or refused (if accepted: the reference result); every other mutation must be
# refused: "pos_inplace" changes validated positions in place between runs (docs/kernels.md
# §8: no effect, the step holds a copy), "workers_ok" another schedule
EITHER = ("pos_inplace", "workers_ok")
# mutations the torch op cannot express: what its schema lacks (workers and
# shared_widen_from; a plan object: it takes metadata and tables, the stack's num_blocks),
# what it takes as it is (rotary tables are tensors there), and positions changed between
# runs (it rebuilds the plan each call, so validates them again); also a layers list,
# which l0 and l1 cannot carry (build_decoder_run)
NO_TORCH = (
    "cs_torch",
    "plan_single",
    "plan_untabled",
    "plan_nb",
    "workers_bad",
    "workers_ok",
    "shared_bad",
    "pos_inplace",
)


@st.composite
def decoder_run_spec(draw):
    s = spec_of(draw, "decoder_run")
    s["dt"] = draw(st.sampled_from([FP32, BF]))
    attn = draw(st.lists(st.sampled_from([True, True, True, False]), min_size=3, max_size=3))
    dense = draw(st.lists(st.sampled_from([True, True, False]), min_size=3, max_size=3))
    if not any(attn):
        attn[draw(st.integers(0, 2))] = True
    s["attn"], s["dense"] = attn, dense
    two = sum(attn) >= 2 and draw(st.integers(0, 2)) == 0
    groups = [draw(st.integers(0, 1)) if a else None for a in attn] if two else None
    if groups is not None and len({g for g in groups if g is not None}) < 2:
        first = next(i for i, a in enumerate(attn) if a)
        groups = [None if g is None else int(i != first) for i, g in enumerate(groups)]
    s["groups"] = groups
    for key in ("qk_norm", "bias", "sinks", "sandwich", "gate", "tables"):
        s[key] = draw(st.booleans())
    s["act"] = draw(st.sampled_from(["silu", "gelu_tanh"]))
    s["softcap"] = draw(st.sampled_from([0.0, 0.0, 20.0]))
    s["logit_softcap"] = draw(st.sampled_from([0.0, 0.0, 5.0]))
    s["rot"] = draw(st.sampled_from([32, 32, 16]))
    s["window"] = draw(st.sampled_from([-1, -1, 8, 17]))
    r_n = draw(st.integers(1, 3))
    s["hist"] = draw(st.lists(st.sampled_from([0, 0, 1, 3, 9, 33]), min_size=r_n, max_size=r_n))
    s["new"] = draw(st.lists(st.sampled_from([0, 1, 1, 2, 3, 5]), min_size=r_n, max_size=r_n))
    s["rows"] = draw(st.sampled_from(["all", "all", "some"]))
    s["extra_pos"] = draw(st.integers(0, 3))
    s["at"] = draw(st.integers(0, 99))  # which run a mutation changes
    s["poison"] = draw(st.booleans())
    return s


_REF = []


def _reference_class():
    """test_decoder's Reference, keeping the residual stream it ends a step with."""
    if not _REF:
        from .test_decoder import Reference

        class Ref(Reference):
            def _mlp(self, h, x, L):  # every layer ends with it: the stream after it
                self.h = super()._mlp(h, x, L)
                return self.h

        _REF.append(Ref)
    return _REF[0]


def _layers(s, cx):
    """The layers (test_decoder's weights reshaped by the spec), final norm, head, the
    MoE stand-in and the outside mixers' stand-ins."""
    from .test_decoder import H, _weights

    base, fnorm, head, outside = _weights(
        s["dt"],
        qk_norm=s["qk_norm"],
        bias=s["bias"],
        seed=s["seed"] % 1000,
        sinks=s["sinks"],
        sandwich=s["sandwich"],
        gate=s["gate"],
    )
    layers, mixers = [], {}
    for i, (attn, dense) in enumerate(zip(s["attn"], s["dense"])):
        L = dict(base[i])
        if dense and L["gate_up"] is None:  # _weights' layer 1 has none: layer 0's
            L.update({k: base[0][k] for k in ("gate_up", "down", "post_mlp_norm")})
        elif not dense:
            L.update(gate_up=None, down=None, post_mlp_norm=None)
        if not attn:
            for k in ("qkv", "o", "qkv_bias", "o_bias", "q_norm", "k_norm", "sinks"):
                L[k] = None
            L["post_attn_norm"] = None
            mixers[i] = cx.rand((H, H), FP32, 0.1)
        layers.append(L)
    return layers, fnorm, head, outside, mixers


def _tables(s, cx, n_g):
    """Per group: each request's block row (shuffled blocks, garbage after those it
    uses) and its block size."""
    tables = []
    for g in range(n_g):
        bs = GROUPS[g][1]
        need = [(h + n + bs - 1) // bs for h, n in zip(s["hist"], s["new"])]
        free = torch.randperm(NB, generator=cx.g).tolist()
        width = max(max(need), 1) + int(cx.rng.integers(0, 2))
        rows = []
        for k in need:
            row = [free.pop() for _ in range(k)]
            row += [GARBAGE[int(cx.rng.integers(0, 3))] for _ in range(width - k)]
            rows.append(row)
        tables.append((rows, bs))
    return tables


def _slot_views(kv, isa, bs, slot):
    """The element views of ``slot``'s K and V rows, per KV head, in the cache tensor
    ``kv`` (a contiguous ``kv_cache_shape``): the elements a step may write there."""
    from .fuzz_cases import _cache_index

    _, hkv, _, d2 = kv.shape
    d = d2 // 2
    flat = kv.view(-1)
    blk, o = divmod(slot, bs)
    ki, vi = _cache_index(isa, bs, d, o)
    views = []
    for h in range(hkv):
        at = (blk * hkv + h) * 2 * bs * d
        k = torch.as_strided(flat, (d,), (int(ki[1] - ki[0]),), at + int(ki[0]))
        v = torch.as_strided(flat, (d,), (1,), at + bs * d + int(vi[0]))
        views.append((k, v))
    return views


def _plan_args(reqs, positions, table, bs, isa, window):
    """plan_attention's arguments for requests ``reqs`` [(request, history, new)] of one
    group: lengths, the rows of its table, the slots of ``positions``."""
    from .test_decoder import HKV, HQ, D

    qsl = [0, *itertools.accumulate(n for _, _, n in reqs)]
    rows = [table[r] for r, _, _ in reqs]
    slots = [rows[i][p // bs] * bs + p % bs for i, p in positions]
    return dict(
        query_start_loc=torch.tensor(qsl, dtype=I32),
        seq_lens=torch.tensor([h + n for _, h, n in reqs], dtype=I32),
        num_heads=HQ,
        num_kv_heads=HKV,
        head_dim=D,
        block_size=bs,
        sliding_window=window,
        isa=isa,
        block_table=torch.tensor(rows, dtype=I32).reshape(len(rows), -1),
        slot_mapping=torch.tensor(slots, dtype=I64),
        num_blocks=NB,
    )


def _cos_sin_tables(s, n_g, n_pos):
    from .test_decoder import _cos_sin

    rot = s["rot"]
    if n_g == 1 or not s["tables"]:
        return _cos_sin(n_pos, rot=rot)
    return tuple(_cos_sin(n_pos, theta=t, rot=rot) for t in (1e4, 1e6)[:n_g])


class _Planned:
    """The torch path's stand-in for a plan made in the call: the plans' arguments."""

    def __init__(self, args):
        self.args = args


def build_decoder_run(s, cx):
    from numkern import attention as A
    from numkern.decoder import DecoderStack

    from .test_decoder import EPS, HKV, HQ, VOCAB, D, H, _layer_weights, _lin, _pack

    dt, mut = s["dt"], s["mut"]
    if mut == "layers_span" and all(s["dense"][:2]):
        # the mutation needs an MLP outside before a span's last layer: layer 1's (drawn
        # dense, it fit neither of the 2 of CI's 300 cases that named it, and test_fuzz
        # asserts that each mutation applied at least once)
        s["dense"] = [s["dense"][0], False, s["dense"][2]]
    layers, fnorm, head_w, outside, mixers = _layers(s, cx)
    groups = s["groups"]
    kv_groups = groups or [0 if attn else None for attn in s["attn"]]
    n_g = len({g for g in kv_groups if g is not None})
    windows = [s["window"], -1][:n_g]
    caches = []
    for g in kv_groups:
        shape = None if g is None else A.kv_cache_shape(NB, HKV, GROUPS[g][1], D)
        caches.append(None if g is None else cx.base(math.prod(shape), dt).view(shape))
    views = [
        None if g is None else A.cache_view(kv, GROUPS[g][0]) for kv, g in zip(caches, kv_groups)
    ]
    packed = [
        type(w)(*(None if t is None else cx.adopt(t) for t in w)) for w in _layer_weights(layers)
    ]
    stack = DecoderStack(
        packed,
        views,
        num_heads=HQ,
        num_kv_heads=HKV,
        head_dim=D,
        eps=EPS,
        final_norm=cx.adopt(fnorm),
        lm_head=cx.adopt(_pack(head_w)),
        rotary_dim=s["rot"],
        softcap=s["softcap"],
        logit_softcap=s["logit_softcap"],
        activation=s["act"],
        attn_output_gate=s["gate"],
        kv_groups=groups,
    )
    runs = stack.runs
    last = len(runs) - 1
    tables = _tables(s, cx, n_g)
    hist, new = s["hist"], s["new"]
    n_pos = max(h + n for h, n in zip(hist, new)) + s["extra_pos"] + 1
    cs = _cos_sin_tables(s, n_g, n_pos)
    made = {}  # id(plan) -> (plan, its plan_attention arguments per group)

    def step_inputs(which):
        """(reqs [(request, history, new)], rows [(request index, position)], positions)"""
        if which == 1:
            reqs = [(r, 0, h) for r, h in enumerate(hist) if h]
        else:
            reqs = [(r, h, n) for r, (h, n) in enumerate(zip(hist, new))]
        rows = [(i, p) for i, (_, h, n) in enumerate(reqs) for p in range(h, h + n)]
        return reqs, rows, [p for _, p in rows]

    def plan_args(which):
        reqs, rows, _ = step_inputs(which)
        out = []
        for g, ((table, bs), w) in enumerate(zip(tables, windows)):
            pa = _plan_args(reqs, rows, table, bs, GROUPS[g][0], w)
            if which == 2 and w > 0:  # blocks before the window's first tile: -1 allowed
                bt = pa["block_table"]
                for i, (_, h, _) in enumerate(reqs):
                    lo = max(0, h - w + 1)
                    for k in range((lo - lo % 32) // bs):
                        if cx.rng.integers(0, 2):
                            bt[i, k] = -1
            out.append(pa)
        return out

    def plans_of(args):
        plans = tuple(A.plan_attention(**pa) for pa in args)
        plan = plans[0] if n_g == 1 else plans
        made[id(plan)] = (plan, args)
        return plan

    run_opts = {}  # workers, shared_widen_from, caches of the case's runs
    prepared = {}  # the steps prepared, by their inputs' identities (kept alive with them)

    def prepared_run(kw):
        """``stack.run`` of the arguments of one run (``kw``: the step's hidden, plan,
        positions and cos_sin_cache, ``prepare``'s options and ``run``'s), its step
        prepared once per plan, positions, table and options, as the engine prepares once
        per step: a step's later runs reuse it."""
        kw = dict(kw)
        ins = [kw.pop(k) for k in ("plan", "positions", "cos_sin_cache")]
        opts = {k: kw.pop(k) for k in ("workers", "shared_widen_from") if k in kw}
        key = (*map(id, ins), repr(sorted(opts.items())))
        if key not in prepared:
            prepared[key] = (stack.prepare(*ins, **opts), ins)
        return stack.run(prepared[key][0], kw.pop("hidden"), **kw)

    def direct_run(kw):
        return prepared_run({**kw, **run_opts})

    def forward(run, step, j, first=None, head=None, stop=None):
        """Runs j.. of a step (up to ``stop``) by ``run(kwargs)``, the outside ops between
        them, the head on the last; ``step``: the step's hidden, plan, positions and
        cos_sin_cache; ``first``: run j's own arguments (the mutated ones). Returns the
        residual_add of the run after the last one run."""
        add = None
        for k in range(j, len(runs) if stop is None else stop):
            l0, l1, after, _ = runs[k]
            kw = dict(step, layers=(l0, l1), residual_add=add)
            if k == last and head is not None:
                kw.update(head)
            if k == j and first:
                kw.update(first)
            x = run(kw)
            add = None
            if after == "mlp":
                add = _lin(x, outside, None, dt)
            elif after == "mixer":
                add = _lin(x, mixers[l1], None, dt)
        return add

    # step 1: the histories, written by the op (the reference runs it again in check)
    reqs1, _, pos1 = step_inputs(1)
    h1 = cx.rand((len(pos1), H), dt, 0.5)
    if reqs1:
        step1 = dict(hidden=h1.clone(), plan=plans_of(plan_args(1)), cos_sin_cache=cs)
        forward(direct_run, step1 | {"positions": torch.tensor(pos1, dtype=I64)}, 0)
    # step 2: the case
    reqs2, _, pos2 = step_inputs(2)
    t_n = len(pos2)
    hidden = cx.out(cx.view((t_n, H), dt, scale=0.5))
    if s["poison"]:
        poison(cx, hidden)
    positions = cx.view((t_n,), I64, data=torch.tensor(pos2, dtype=I64))
    if s["rows"] == "all" or not t_n:
        rows = list(range(t_n))
    else:
        rows = [int(r) for r in cx.rng.integers(0, t_n, int(cx.rng.integers(0, t_n + 2)))]
    r_n = len(rows)
    logits_rows = cx.view((r_n,), I64, data=torch.tensor(rows, dtype=I64))
    logits = cx.out(cx.view((r_n, VOCAB), FP32, data=torch.full((r_n, VOCAB), 7.0)))
    head = dict(logits_rows=logits_rows, logits=logits)
    pargs = plan_args(2)
    step = dict(hidden=hidden, plan=plans_of(pargs), positions=positions, cos_sin_cache=cs)
    with_add = [k for k in range(1, len(runs)) if runs[k - 1][2] is not None]
    scope = DECODER_MUTS.get(mut)
    j = 0  # the run the mutation changes: the runs before it belong to the build
    if scope == "head":
        j = last
    elif scope == "add":
        if not with_add:
            raise Refuse
        j = with_add[s["at"] % len(with_add)]
    elif scope == "any":
        j = s["at"] % len(runs)
        if mut == "pos_inplace" and len(runs) > 1:
            # a later run: the positions it changes in place were validated by the runs
            # before (at run 0 it fit none of CI's 300 cases, and test_fuzz asserts that
            # each mutation applied at least once)
            j = 1 + s["at"] % (len(runs) - 1)
    refuse = mut is not None and mut not in EITHER
    # run j's KV-cache group: the plan and rotary table it validates (group 0 without one)
    g_j = next((g for g in kv_groups[runs[j][0] : runs[j][1]] if g is not None), 0)
    in_call = scope == "plan"  # the plans made in the call (their tables are refused)
    first = {}  # run j's own arguments, mutated
    kv_list = [kv for kv in caches if kv is not None]  # the torch op's kv_caches
    tabs = cs if isinstance(cs, tuple) else (cs,)
    if mut == "hidden_noncontig":
        if t_n < 2:
            raise Refuse
        first["hidden"] = cx.view((t_n, H), dt, pads=[1], data=hidden)
    elif mut == "hidden_dtype":
        first["hidden"] = cx.view((t_n, H), {FP32: BF, BF: FP32}[dt], data=hidden)
    elif mut == "hidden_shape":
        first["hidden"] = cx.view([(t_n + 1, H), (t_n, H + 1)][s["at"] % 2], dt)
    elif mut == "hidden_numpy":  # (bf16 as float64: refused as a non-tensor all the same)
        first["hidden"] = numpy_of(hidden)
    elif mut == "hidden_over_cache":  # the whole step's hidden inside a cache
        if t_n == 0:
            raise Refuse
        j = 0
        flat = kv_list[int(cx.rng.integers(0, len(kv_list)))].view(-1)
        at = int(cx.rng.integers(0, flat.numel() - t_n * H + 1))
        step["hidden"] = cx.out(flat[at : at + t_n * H].view(t_n, H))
        step["hidden"].copy_(hidden)
    elif mut == "pos_oob":
        if t_n == 0:
            raise Refuse
        bad = positions.clone()
        bad[int(cx.rng.integers(0, t_n))] = [n_pos, -1, 2**40][int(cx.rng.integers(0, 3))]
        first["positions"] = cx.view((t_n,), I64, data=bad)
    elif mut == "pos_inplace":
        if t_n == 0 or n_g > 1 or j == 0:
            raise Refuse
    elif mut == "pos_int32":
        first["positions"] = cx.view((t_n,), I32, data=positions)
    elif mut == "pos_shape":
        first["positions"] = cx.view((t_n + 1,), I64)
    elif mut in ("cs_torch", "cs_f64", "cs_rot", "cs_short", "cs_noncontig"):
        g = g_j if len(tabs) > 1 else 0
        t = tabs[g]
        if mut == "cs_torch":
            t = torch.from_numpy(t.copy())
        elif mut == "cs_f64":
            t = t.astype(np.float64)
        elif mut == "cs_rot":
            t = np.concatenate([t, t[:, :2]], 1)
        elif mut == "cs_short":  # the last position has no row
            if t_n == 0:
                raise Refuse
            t = t[: max(pos2)].copy()
        else:  # rows of twice the width
            t = np.concatenate([t, t], 1)[:, : t.shape[1]]
        bad = tuple(t if i == g else x for i, x in enumerate(tabs))
        first["cos_sin_cache"] = bad if isinstance(cs, tuple) else bad[0]
    elif mut == "cs_groups":
        first["cos_sin_cache"] = tabs * 3
    elif mut == "plan_single":
        plan = step["plan"]
        first["plan"] = plan[0] if n_g > 1 else (plan, plan)
    elif mut in ("plan_untabled", "plan_nb", "plan_heads", "plan_tokens"):
        g = g_j
        bad = dict(pargs[g])
        if mut == "plan_untabled":
            for k in ("block_table", "slot_mapping", "num_blocks"):
                del bad[k]
        elif mut == "plan_nb":
            bad["num_blocks"] = NB + 1
        elif mut == "plan_heads":
            bad["num_heads"] = 2 * HQ
        else:  # one more token on the last request: T + 1 rows
            table, bs = tables[g]
            p = int(bad["seq_lens"][-1])
            if p >= sum(0 <= e < NB for e in table[-1]) * bs:
                raise Refuse
            qsl, sl = bad["query_start_loc"].clone(), bad["seq_lens"].clone()
            qsl[-1] += 1
            sl[-1] += 1
            slot = torch.tensor([table[-1][p // bs] * bs + p % bs])
            slots = torch.cat([bad["slot_mapping"], slot])
            bad.update(query_start_loc=qsl, seq_lens=sl, slot_mapping=slots)
        first["plan"] = plans_of([bad if i == g else pa for i, pa in enumerate(pargs)])
    elif mut == "workers_bad":
        run_opts["workers"] = [0, -1, True, 1.5][int(cx.rng.integers(0, 4))]
    elif mut == "workers_ok":
        run_opts["workers"] = int(cx.rng.integers(1, 6))
        run_opts["shared_widen_from"] = int(cx.rng.integers(0, 2))
    elif mut == "shared_bad":
        run_opts["shared_widen_from"] = [-1, None, "0"][int(cx.rng.integers(0, 3))]
    elif mut == "caches_len":
        run_opts["caches"] = views[:-1]
        kv_list = kv_list[:-1]
    elif mut == "caches_other":  # one layer's cache of twice the blocks
        i = next(i for i, v in enumerate(views) if v is not None)
        shape = (2 * NB, *caches[i].shape[1:])
        other = cx.base(math.prod(shape), dt).view(shape)
        run_opts["caches"] = list(views)
        run_opts["caches"][i] = A.cache_view(other, GROUPS[kv_groups[i]][0])
        kv_list = [other if kv is caches[i] else kv for kv in kv_list]
    elif mut == "layers_type":
        l0, l1 = runs[j][:2]
        first["layers"] = [[l0, l1], (float(l0), l1), (l0, l1, 0)][int(cx.rng.integers(0, 3))]
    elif mut == "layers_range":
        l0, l1 = runs[j][:2]
        first["layers"] = [(l0, stack.num_layers + 1), (l0, -1)][int(cx.rng.integers(0, 2))]
    elif mut == "layers_span":  # a layer before l1 - 1 whose MLP runs outside (docs/kernels.md §8)
        n = stack.num_layers
        spans = [
            (l0, l1)
            for l0 in range(n)
            for l1 in range(l0 + 2, n + 1)
            if not all(s["dense"][l0 : l1 - 1])
        ]
        if not spans:
            raise Refuse
        first["layers"] = spans[int(cx.rng.integers(0, len(spans)))]
    elif mut == "add_shape":
        first["residual_add"] = cx.view([(t_n + 1, H), (t_n, H + 1)][s["at"] % 2], dt)
    elif mut == "add_dtype":
        first["residual_add"] = cx.view((t_n, H), {FP32: BF, BF: FP16}[dt])
    elif mut == "add_over_hidden":  # a residual_add one row off hidden, in one buffer
        if t_n < 2:
            raise Refuse
        buf = cx.base((t_n + 1) * H + 8, dt)
        shift = [H, -H][int(cx.rng.integers(0, 2))]
        first["residual_add"] = cx.view((t_n, H), dt, base=buf, at=max(0, shift))
        step["hidden"] = cx.out(cx.view((t_n, H), dt, base=buf, at=max(0, -shift), data=hidden))
    elif mut == "rows_oob":
        bad_row = [t_n, -1, 2**40][int(cx.rng.integers(0, 3))]
        first["logits_rows"] = cx.view((r_n + 1,), I64, data=torch.tensor([*rows, bad_row]))
        first["logits"] = cx.out(cx.view((r_n + 1, VOCAB), FP32))
    elif mut == "rows_int32":
        first["logits_rows"] = cx.view((r_n,), I32, data=logits_rows)
    elif mut == "rows_2d":
        first["logits_rows"] = logits_rows[:, None]
    elif mut == "rows_numpy":
        first["logits_rows"] = logits_rows.numpy()
    elif mut == "logits_shape":
        first["logits"] = cx.out(cx.view((r_n, VOCAB + 1), FP32))
    elif mut == "logits_dtype":
        first["logits"] = cx.out(cx.view((r_n, VOCAB), [BF, torch.float64][s["at"] % 2]))
    elif mut == "logits_noncontig":
        if r_n < 2:
            raise Refuse
        first["logits"] = cx.out(cx.view((r_n, VOCAB), FP32, pads=[1]))
    elif mut == "logits_over_hidden":  # fp32 logits over hidden's tail (an fp32 model)
        if dt != FP32 or not r_n or not t_n:
            raise Refuse
        buf = cx.base(t_n * H + r_n * VOCAB, dt)
        step["hidden"] = cx.out(cx.view((t_n, H), dt, base=buf, at=0, data=hidden))
        at = t_n * H - int(cx.rng.integers(1, min(t_n * H, r_n * VOCAB) + 1))
        first["logits"] = cx.out(buf[at : at + r_n * VOCAB].view(r_n, VOCAB))
    elif mut == "logits_over_cache":
        if dt != FP32 or not r_n:
            raise Refuse
        flat = kv_list[0].view(-1)
        at = int(cx.rng.integers(0, flat.numel() - r_n * VOCAB + 1))
        first["logits"] = cx.out(flat[at : at + r_n * VOCAB].view(r_n, VOCAB))
    elif mut == "logits_without_rows":
        first["logits_rows"] = None
    elif mut == "rows_not_last":
        if last == 0:
            raise Refuse
        j = min(j, last - 1)
        first.update(head)
    elif mut in ("bt_oob", "bt_int64", "slot_oob"):
        g = int(cx.rng.integers(0, n_g))
        bs, w = tables[g][1], windows[g]
        if mut == "bt_int64":
            pargs[g]["block_table"] = pargs[g]["block_table"].long()
        elif mut == "slot_oob":
            if t_n == 0:
                raise Refuse
            bad_slot = NB * bs + int(cx.rng.integers(0, 9))
            pargs[g]["slot_mapping"][int(cx.rng.integers(0, t_n))] = bad_slot
        else:  # an entry the step reads (blocks before a window's first tile are not)
            used = [
                (i, k)
                for i, (_, h, n) in enumerate(reqs2)
                for k in range((h + n + bs - 1) // bs)
                if w <= 0 or (k + 1) * bs > max(0, h - w + 1) - max(0, h - w + 1) % 32
            ]
            if not used:
                raise Refuse
            i, k = used[int(cx.rng.integers(0, len(used)))]
            pargs[g]["block_table"][i, k] = [NB, -2, 2**31 - 1][int(cx.rng.integers(0, 3))]
    # the runs before the mutated one belong to the build (without the case's options)
    h0 = step["hidden"].clone()  # the step's input, for the reference
    if j > 0:
        first.setdefault("residual_add", forward(prepared_run, step, 0, stop=j))
    if mut == "pos_inplace":  # validated by the runs before: changing it has no effect
        positions[int(cx.rng.integers(0, t_n))] = n_pos + 5

    def run_case_runs(run, plans):
        if in_call:
            step["plan"] = plans(pargs)
        forward(run, step, j, first, head)

    # what the step may write besides hidden and logits: each cache's K and V at its slots
    slots_of = []
    for pa in pargs:
        sm = pa["slot_mapping"]
        slots_of.append([int(x) for x in sm] if sm.dtype == I64 else [])
    for kv, g in zip(caches, kv_groups):
        if kv is not None:
            for slot in slots_of[g]:
                if 0 <= slot < NB * GROUPS[g][1]:
                    for k, v in _slot_views(kv, *GROUPS[g], slot):
                        cx.out(k)
                        cx.out(v)

    def check(_):
        if t_n == 0:  # nothing to compute (the arenas show nothing else was written)
            return
        Ref = _reference_class()
        opts = dict(
            softcap=s["softcap"],
            logit_softcap=s["logit_softcap"],
            activation=s["act"],
            mixers=mixers,
            gate=s["gate"],
        )
        all_tabs = tabs if len(tabs) == n_g else tabs * n_g
        opts["cos_sin"] = {i: all_tabs[g] for i, g in enumerate(kv_groups) if g is not None}
        layer_windows = [-1 if g is None else windows[g] for g in kv_groups]
        ref = Ref(layers, fnorm, head_w, outside, dt, windows=layer_windows, **opts)
        if reqs1:
            t0s = itertools.accumulate([0, *(n for _, _, n in reqs1)])
            r1 = [(r, t0, n) for (r, _, n), t0 in zip(reqs1, t0s)]
            ref.step(
                h1.clone(), r1, torch.tensor(pos1, dtype=I64), tabs[0], torch.zeros(0, dtype=I64)
            )
        t0s = list(itertools.accumulate([0, *(n for _, _, n in reqs2)]))
        r2 = [(r, t0, n) for (r, _, n), t0 in zip(reqs2, t0s)]
        want = ref.step(
            h0.clone(), r2, torch.tensor(pos2, dtype=I64), tabs[0], torch.tensor(rows, dtype=I64)
        )
        _close(first.get("logits", logits) if j == last else logits, want, dt, "logits")
        _close(step["hidden"], ref.h if t_n else h0, dt, "hidden")
        for li, (kv, g) in enumerate(zip(caches, kv_groups)):
            if kv is None:
                continue
            got, ref_kv = [], []
            for (r, h, n), t0 in zip(reqs2, t0s):
                ks, vs = ref.kv[(li, r)]
                ref_kv += [torch.stack([ks[h + t], vs[h + t]]) for t in range(n)]
                for slot in slots_of[g][t0 : t0 + n]:
                    kvs = _slot_views(kv, *GROUPS[g], slot)
                    got.append(
                        torch.stack(
                            [torch.stack([k for k, _ in kvs]), torch.stack([v for _, v in kvs])]
                        )
                    )
            if got:  # [tokens, K|V, heads, D]
                _close(torch.stack(got), torch.stack(ref_kv), dt, f"layer {li}'s cached K/V", 3)

    form = None
    layers_list = mut == "layers_type" and not isinstance(first["layers"][0], float)
    if mut not in NO_TORCH and not layers_list:  # (l0 and l1 are ints of the schema)
        form = _torch_form(stack, kv_list, made, dt, run_case_runs)
    return Case(lambda: run_case_runs(direct_run, plans_of), check, refuse, torch=form)


def _close(got, want, dt, what, dims=1):
    """``got`` (the op) within test_decoder's tolerance of ``want`` (the reference) on
    the rows (first ``dims`` dims) whose reference is finite; the others non-finite too."""
    ok = check_nonfinite_rows(got.float(), want.float(), dims)
    if not ok.any():
        return
    g, w = got[ok].double(), want[ok].double()
    tol = tolerance("decoder", dt).peak * w.abs().max().item() + 1e-30
    worst = (g - w).abs().max().item()
    assert worst <= tol, f"{what}: worst error {worst:.3g}, tolerance {tol:.3g}"


_NAMES = itertools.count()  # a registered name per stack (two builds live at once)


def _torch_form(stack, kv_list, made, dt, run_case_runs):
    """The case's runs through ``torch.ops.numkern.decoder_run`` (docs/kernels.md §12.5): the stack
    registered by name, the caches as ``kv_caches``, and per KV-cache group the scheduler
    metadata of ``plan_attention``'s op with the plan's block table and slot mapping (as a
    graph calls it: each run hands the tables over, the op validates them)."""
    from numkern.torch_ops import register_stack

    T = torch_ops()
    name = register_stack(f"fuzz-{next(_NAMES)}", stack)
    dtype = str(dt).split(".")[1]

    def run(kw):
        plan = kw["plan"]
        args = plan.args if isinstance(plan, _Planned) else made[id(plan)][1]
        md = []
        for pa in args:
            p = {k: v for k, v in pa.items() if k not in ("block_table", "slot_mapping")}
            p.pop("num_blocks")
            qsl, sl = p.pop("query_start_loc"), p.pop("seq_lens")
            md.append(T.plan_attention(qsl, sl, **p, dtype=dtype))
        tabs = kw["cos_sin_cache"]
        tabs = tabs if isinstance(tabs, tuple) else (tabs,)
        x = T.decoder_run(
            name,
            kw["hidden"],
            kv_list,
            md,
            [pa["block_table"] for pa in args],
            [pa["slot_mapping"] for pa in args],
            kw["positions"],
            [t if isinstance(t, torch.Tensor) else torch.from_numpy(t) for t in tabs],
            *kw["layers"],
            kw.get("residual_add"),
            kw.get("logits_rows"),
            kw.get("logits"),
        )
        return x

    form = TorchForm(T.decoder_run, {}, {}, same_message=False)
    form.call = lambda: run_case_runs(run, _Planned)
    form.stack = stack  # the registry holds a weak reference
    return form
