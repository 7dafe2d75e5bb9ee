"""numkern.decoder's partial runs (``DecoderStack(partial=True)``, tensor parallelism)
against the unsplit stack.

A random fp32 stack of four layers -- attention with sinks, q/k norms, biases and sandwich
norms + a dense MLP; the same + an outside MLP (an MoE stand-in); an outside token mixer
(a Gated DeltaNet stand-in) + a dense MLP; attention + a dense MLP -- in two KV-cache
groups (one sliding), is split in two halves as Megatron/vLLM split it: q heads by rank,
KV heads split (or, with one KV head, replicated), q|k|v rows and their bias per part,
sinks per head, o by columns with o_bias on half 0 only, gate|up rows per part (I split),
down by columns; norms replicated. The two partial stacks run their runs in lockstep;
between runs their ``"reduce"`` outputs are summed in torch (the all-reduce), as are
the outside ops' outputs (each rank's stand-in takes half of the K columns). The logits
of both halves equal the unsplit stack's (itself checked against a torch forward in
test_decoder.py), the residual streams of the halves stay bit-equal, and each half's KV
cache holds its heads of the unsplit one's. fp32: the sums differ from the unsplit GEMMs
only in the order of additions; bf16 (the engine's dtype, the variant test_decoder.py
compiles) adds one rounding of each half's partial.
"""

import pytest
import torch

import numkern
from numkern import attention as A
from numkern.decoder import DecoderStack, LayerWeights, Run
from numkern.testing.tolerances import tolerance

H, HQ, D, INTER, VOCAB, B = 64, 4, 32, 72, 96, 32
EPS = 1e-5
W = 2  # ranks
GROUPS = (0, 1, None, 0)  # layer 2's token mixer runs outside
WINDOWS = (-1, 8)  # per KV-cache group
TABLE = [[3, 0, 5], [6, 1, 2]]  # shuffled blocks of the two requests
STEPS = [  # (qsl, seq_lens, rows of (request, first row, n), positions, sampled rows)
    ([0, 5, 75], [5, 70], [(0, 0, 5), (1, 5, 70)], [*range(5), *range(70)], [4, 74]),
    ([0, 1, 2], [6, 71], [(0, 0, 1), (1, 1, 1)], [5, 70], [0, 1]),
]


def _layers(hkv, dt=torch.float32, seed=0):
    """Four layers (module docstring) as plain tensors (projections in ``dt``, the rest
    fp32 values of ``dt``), and the outside ops' weights."""
    g = torch.Generator().manual_seed(seed)

    def w(*shape, scale=0.1):
        return (torch.randn(*shape, generator=g) * scale).to(dt)

    def normw(n):
        return (1 + 0.1 * torch.randn(n, generator=g)).to(dt).float()

    nqkv = (HQ + 2 * hkv) * D
    layers = []
    for i, grp in enumerate(GROUPS):
        dense, attn = i != 1, grp is not None
        layers.append(
            dict(
                input_norm=normw(H),
                qkv=w(nqkv, H) if attn else None,
                o=w(H, HQ * D) if attn else None,
                post_norm=normw(H),
                gate_up=w(2 * INTER, H) if dense else None,
                down=w(H, INTER) if dense else None,
                qkv_bias=w(nqkv).float() if attn else None,
                o_bias=w(H).float() if attn else None,
                q_norm=normw(D) if attn else None,
                k_norm=normw(D) if attn else None,
                sinks=torch.randn(HQ, generator=g) if attn else None,
                post_attn_norm=normw(H) if attn else None,
                post_mlp_norm=normw(H) if dense else None,
            )
        )
    outside = {"mlp": w(H, H).float(), "mixer": w(H, H).float()}  # y = x @ W.T stand-ins
    return layers, normw(H), w(VOCAB, H), outside


def _kv_heads(r, hkv):
    """The KV heads of rank r: split when there are as many as ranks, else the one
    rank r's q heads read (replicated: vLLM's r // (W / hkv))."""
    if hkv >= W:
        n = hkv // W
        return list(range(r * n, (r + 1) * n))
    return [r // (W // hkv)]


def _shard(L, r, hkv):
    """Rank r's part of layer ``L`` (module docstring)."""
    hq = HQ // W
    q = list(range(r * hq * D, (r + 1) * hq * D))
    kv = [h * D + j for h in _kv_heads(r, hkv) for j in range(D)]
    rows = q + [HQ * D + i for i in kv] + [(HQ + hkv) * D + i for i in kv]
    i0, i1 = r * INTER // W, (r + 1) * INTER // W
    out = dict(L)
    if L["qkv"] is not None:
        out.update(
            qkv=L["qkv"][rows],
            qkv_bias=L["qkv_bias"][rows],
            o=L["o"][:, q[0] : q[-1] + 1],
            o_bias=L["o_bias"] if r == 0 else None,
            sinks=L["sinks"][r * hq : (r + 1) * hq],
        )
    if L["gate_up"] is not None:
        gu = L["gate_up"]
        out.update(
            gate_up=torch.cat([gu[i0:i1], gu[INTER + i0 : INTER + i1]]),
            down=L["down"][:, i0:i1],
        )
    return out


def _stack(layers, fnorm, head, hq, hkv, *, partial):
    dt = head.dtype
    packed = ("qkv", "o", "gate_up", "down")

    def pack(k, v):
        return numkern.convert_weight_packed(v.contiguous()) if k in packed and v is not None else v

    lw = [LayerWeights(**{k: pack(k, v) for k, v in L.items()}) for L in layers]
    caches = [
        None if g is None else torch.full(A.kv_cache_shape(8, hkv, B, D), float("nan"), dtype=dt)
        for g in GROUPS
    ]
    views = [None if c is None else A.cache_view(c, "vec") for c in caches]
    groups = list(GROUPS)
    kw = dict(num_heads=hq, num_kv_heads=hkv, head_dim=D, eps=EPS, kv_groups=groups)
    return DecoderStack(
        lw, views, final_norm=fnorm, lm_head=numkern.convert_weight_packed(head), partial=partial,
        **kw,
    )  # fmt: skip


def _plans(step, hq, hkv):
    qsl, sl, reqs, positions, _ = step
    plans = []
    for g in (0, 1):
        slots = [TABLE[r][p // B] * B + p % B for r, t0, n in reqs for p in positions[t0 : t0 + n]]
        plans.append(
            A.plan_attention(
                torch.tensor(qsl, dtype=torch.int32), torch.tensor(sl, dtype=torch.int32),
                num_heads=hq, num_kv_heads=hkv, head_dim=D, block_size=B,
                sliding_window=WINDOWS[g], isa="vec",
                block_table=torch.tensor(TABLE, dtype=torch.int32),
                slot_mapping=torch.tensor(slots, dtype=torch.int64), num_blocks=8,
            )
        )  # fmt: skip
    return tuple(plans)


def _cos_sin(n):
    inv = 1.0 / (10000.0 ** (torch.arange(0, D, 2, dtype=torch.float64) / D))
    f = torch.outer(torch.arange(n, dtype=torch.float64), inv)
    return torch.cat([f.cos(), f.sin()], 1).float().numpy()


def _outside(x, w, r):
    """Rank r's part of an outside op ``x @ w.T`` (r None: the whole): K columns split."""
    if r is None:
        return (x.float() @ w.T).to(x.dtype)
    c0, c1 = r * H // W, (r + 1) * H // W
    return (x[:, c0:c1].float() @ w[:, c0:c1].T).to(x.dtype)


def _reduce(parts):
    """The all-reduce: the sum in fp32, rounded once to the model dtype."""
    return torch.stack([p.float() for p in parts]).sum(0).to(parts[0].dtype)


def _unsplit(stack, outside, h, plans, pos, cs, rows):
    step = stack.prepare(plans, pos, cs)
    logits = torch.empty(len(rows), VOCAB)
    add = None
    for run in stack.runs:
        head = {}
        if run.outside is None and run.l1 == stack.num_layers:
            head = {"logits_rows": rows, "logits": logits}
        x = stack.run(step, h, layers=run, residual_add=add, **head)
        add = None if run.outside is None else _outside(x, outside[run.outside], None)
    return logits


def _partial(stacks, outside, hs, plans, pos, cs, rows):
    """The ranks' loops in lockstep: each run on every rank, then the sums."""
    steps = [s.prepare(p, pos, cs) for s, p in zip(stacks, plans)]
    logits = [torch.empty(len(rows), VOCAB) for _ in stacks]
    add = None
    for run in stacks[0].runs:
        outs = []
        for r, (s, step, h) in enumerate(zip(stacks, steps, hs)):
            head = {}
            if run.outside is None and run.l1 == s.num_layers:
                head = {"logits_rows": rows, "logits": logits[r]}
            before = None if add is None else add.clone()
            x = s.run(step, h, layers=run, residual_add=add, **head)
            if add is not None:  # the sandwich norm is not applied in place
                assert torch.equal(add, before)
            if run.outside == "reduce":
                assert x.shape == (h.shape[0], H) and x.dtype == h.dtype
                outs.append(x)
            elif run.outside is not None:
                outs.append(_outside(x, outside[run.outside], r))
            else:
                assert x is None
        add = _reduce(outs) if outs else None
    return logits


@pytest.mark.parametrize(
    "hkv, dt",
    [(2, torch.float32), (1, torch.float32), (2, torch.bfloat16)],
    ids=["kv-split", "kv-replicated", "bf16"],
)
def test_partial_stacks_sum_to_the_unsplit_stack(hkv, dt):
    """The logits of both halves against the unsplit fp32 stack on the same weights: fp32
    within float rounding; bf16 (each half's partial rounded to bf16 by its GEMM, the sum
    rounded once more) within the bf16 tolerance test_decoder.py holds the unsplit bf16
    stack to against its torch reference (2**-6 of the largest logit; measured 0.010 and
    0.012 here, the unsplit bf16 stack's own 0.010 and 0.009: seeds 0-2 gave at most 0.014
    against the unsplit's 0.012)."""
    tol = tolerance("decoder", dt).peak  # the table's, as test_decoder.py's
    layers, fnorm, head, outside = _layers(hkv, dt)
    fp32 = [{k: None if v is None else v.float() for k, v in L.items()} for L in layers]
    whole = _stack(fp32, fnorm, head.float(), HQ, hkv, partial=False)
    hq_r, hkv_r = HQ // W, len(_kv_heads(0, hkv))
    parts = [
        _stack([_shard(L, r, hkv) for L in layers], fnorm, head, hq_r, hkv_r, partial=True)
        for r in range(W)
    ]
    assert parts[0].runs == (
        Run(0, 1, "reduce", "attention"),
        Run(0, 1, "reduce", "mlp"),
        Run(1, 2, "reduce", "attention"),
        Run(1, 2, "mlp", "mlp"),
        Run(2, 2, "mixer", "attention"),
        Run(2, 3, "reduce", "mlp"),
        Run(3, 4, "reduce", "attention"),
        Run(3, 4, "reduce", "mlp"),
        Run(4, 4, None, "attention"),
    )
    assert whole.runs == (
        Run(0, 1, None, "attention"),  # a KV-cache group change
        Run(1, 2, "mlp", "attention"),
        Run(2, 2, "mixer", "attention"),
        Run(2, 4, None, "mlp"),
    )
    cs = _cos_sin(128)
    gen = torch.Generator().manual_seed(1)
    for step in STEPS:
        pos = torch.tensor(step[3], dtype=torch.int64)
        rows = torch.tensor(step[4], dtype=torch.int64)
        h = (torch.randn(len(step[3]), H, generator=gen) * 0.5).to(dt)
        want = _unsplit(whole, outside, h.float().clone(), _plans(step, HQ, hkv), pos, cs, rows)
        hs = [h.clone() for _ in range(W)]
        plans = [_plans(step, hq_r, hkv_r)] * W
        got = _partial(parts, outside, hs, plans, pos, cs, rows)
        assert torch.equal(hs[0], hs[1])  # the residual stream stays replicated
        for g in got:
            assert torch.isfinite(g).all()
            assert (g - want).abs().max() <= tol * want.abs().max(), (g - want).abs().max()
    for r, s in enumerate(parts):  # each half's cache: its KV heads of the whole's
        for li, cv in enumerate(s.caches):
            if cv is None or dt != torch.float32:
                continue
            full, heads = whole.caches[li], _kv_heads(r, hkv)
            pairs = ((cv.key_cache, full.key_cache), (cv.value_cache, full.value_cache))
            for mine, every in pairs:
                torch.testing.assert_close(
                    mine, every[:, heads], rtol=tol, atol=tol, equal_nan=True
                )


def test_partial_runs_are_refused_elsewhere():
    """A partial stack takes only its own Runs; the head only on its last run; a stack
    that is not partial refuses a "reduce" Run and a Run whose labels are not its layers'."""
    layers, fnorm, head, _ = _layers(2)
    part = _stack([_shard(L, 0, 2) for L in layers], fnorm, head, HQ // W, 1, partial=True)
    whole = _stack(layers, fnorm, head, HQ, 2, partial=False)
    step = STEPS[1]
    pos = torch.tensor(step[3], dtype=torch.int64)
    cs = _cos_sin(128)
    h = torch.zeros(2, H)
    ps = part.prepare(_plans(step, HQ // W, 1), pos, cs)
    with pytest.raises(TypeError, match=r"layers: expected a numkern\.decoder\.Run"):
        part.run(ps, h, layers=(0, 1))
    with pytest.raises(ValueError, match=r"layers: expected a numkern\.decoder\.Run"):
        part.run(ps, h, layers=Run(0, 2, "reduce", "attention"))
    rows, logits = torch.tensor([0]), torch.empty(1, VOCAB)
    with pytest.raises(ValueError, match="logits_rows: the head runs after the last layer"):
        part.run(ps, h, layers=Run(3, 4, "reduce", "mlp"), logits_rows=rows, logits=logits)
    ws = whole.prepare(_plans(step, HQ, 2), pos, cs)
    with pytest.raises(ValueError, match=r"layers: expected Run\(l0=1, l1=2, outside='mlp'"):
        whole.run(ws, h, layers=Run(1, 2, "reduce", "attention"))
    with pytest.raises(ValueError, match="layers: expected Run"):
        whole.run(ws, h, layers=Run(2, 4, None, "attention"))
    with pytest.raises(TypeError, match="partial"):
        _stack(layers, fnorm, head, HQ, 2, partial=1)
    assert torch.equal(h, torch.zeros(2, H))  # nothing ran
