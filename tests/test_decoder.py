"""numkern.decoder against a plain torch forward written from the module's definition.

Random layers (no HF): a dense layer, one whose MLP runs outside (an MoE stand-in), and
another dense one; q/k head norms and biases in one stack each; Qwen3-Next's gated
attention output with partial rotary, alone and among outside token mixers; odd
intermediate size (a SiLU·mul tail); two requests with shuffled blocks of a NaN-filled
cache, a prefill step then a decode step. The reference rounds to the model dtype where the op does
(after every op, as HF does), so fp32 agrees to float rounding and 16-bit dtypes to a
few units of the logits' magnitude.
"""

import json
import math

import numpy as np
import pytest
import torch

import numkern
from numkern import attention as A
from numkern import gemm
from numkern.decoder import DecoderStack, LayerWeights, Run
from numkern.decoder import layer as decoder_layer
from numkern.decoder import stack as decoder_stack
from numkern.testing.tolerances import tolerance

from .conftest import run_child

H, HQ, HKV, D, INTER, VOCAB, B = 64, 4, 2, 32, 72, 96, 32
EPS = 1e-5


def _weights(dtype, *, qk_norm, bias, seed=0, sinks=False, sandwich=False, gate=False, vocab=VOCAB):
    """Three layers: dense, MLP outside, dense; ``gate``: qkv with the output gate's rows."""
    g = torch.Generator().manual_seed(seed)
    nqkv = (HQ + 2 * HKV + (HQ if gate else 0)) * D

    def w(*shape, scale=0.1):
        return (torch.randn(*shape, generator=g) * scale).to(dtype)

    def normw(n):
        return (1 + 0.1 * torch.randn(n, generator=g)).to(dtype).float()

    layers = []
    for i in range(3):
        dense = i != 1
        layers.append(
            dict(
                input_norm=normw(H),
                qkv=w(nqkv, H),
                o=w(H, HQ * D),
                post_norm=normw(H),
                gate_up=w(2 * INTER, H) if dense else None,
                down=w(H, INTER) if dense else None,
                qkv_bias=w(nqkv).float() if bias else None,
                o_bias=w(H).float() if bias else None,
                q_norm=normw(D) if qk_norm else None,
                k_norm=normw(D) if qk_norm else None,
                sinks=torch.randn(HQ, generator=g) if sinks else None,
                post_attn_norm=normw(H) if sandwich else None,
                post_mlp_norm=normw(H) if sandwich and dense else None,
            )
        )
    outside = w(H, H)  # the "experts" of layer 1: y = x @ outside.T
    return layers, normw(H), w(vocab, H), outside


def _pack(t):
    return None if t is None else numkern.convert_weight_packed(t.contiguous())


def _layer_weights(layers):
    return [
        LayerWeights(**{**L, **{k: _pack(L[k]) for k in ("qkv", "o", "gate_up", "down")}})
        for L in layers
    ]


def _stack(layers, final_norm, head, caches, isa, **opts):
    lw = _layer_weights(layers)
    views = [None if kv is None else A.cache_view(kv, isa) for kv in caches]
    kw = dict(num_heads=HQ, num_kv_heads=HKV, head_dim=D, eps=EPS, **opts)
    return DecoderStack(lw, views, final_norm=final_norm, lm_head=_pack(head), **kw)


def _cos_sin(n, theta=10000.0, rot=D):
    inv = 1.0 / (theta ** (torch.arange(0, rot, 2, dtype=torch.float64) / rot))
    f = torch.outer(torch.arange(n, dtype=torch.float64), inv)
    return torch.cat([f.cos(), f.sin()], 1).float().numpy()


# -- the reference ---------------------------------------------------------------------------


def _norm(x, w, dt):
    x = x.float()
    return (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS) * w).to(dt)


def _lin(x, w, b, dt):
    y = x.float() @ w.float().T
    return (y if b is None else y + b).to(dt)


def _rope(x, pos, cs, dt):  # x [T, heads, D]; the leading cs.shape[1] dims rotate
    half = cs.shape[1] // 2
    c = torch.from_numpy(cs[pos.numpy(), :half])[:, None]
    s = torch.from_numpy(cs[pos.numpy(), half:])[:, None]
    a, b, rest = x.float()[..., :half], x.float()[..., half : 2 * half], x[..., 2 * half :]
    return torch.cat([a * c - b * s, b * c + a * s, rest.float()], -1).to(dt)


class Reference:
    """The forward, request by request, with a dense K/V history per layer."""

    def __init__(self, layers, final_norm, head, outside, dt, windows=None, **opts):
        self.layers, self.final_norm, self.head, self.outside, self.dt = (
            layers,
            final_norm,
            head,
            outside,
            dt,
        )
        self.windows = windows or [-1] * len(layers)  # per layer (-1: none)
        # softcap, logit_softcap, activation ("silu"/"gelu_tanh"), cos_sin per layer,
        # gate (Qwen3-Next's attention output gate: qkv's columns after v)
        self.opts = opts
        self.kv = {}  # (layer, request) -> (k [n, HKV, D], v)

    def _mlp(self, h, x, L):
        """h + the layer's MLP of x (dense, or the outside stand-in)."""
        dt = self.dt
        if L["gate_up"] is None:
            y = _lin(x, self.outside, None, dt)
        else:
            gu = _lin(x, L["gate_up"], None, dt).float()
            g, u = gu[:, :INTER], gu[:, INTER:]
            if self.opts.get("activation", "silu") == "silu":
                f = g * torch.sigmoid(g)
            else:  # tanh-approximated GELU
                f = 0.5 * g * (1 + torch.tanh(math.sqrt(2 / math.pi) * (g + 0.044715 * g**3)))
            y = _lin((f * u).to(dt), L["down"], None, dt)
            if L.get("post_mlp_norm") is not None:
                y = _norm(y, L["post_mlp_norm"], dt)
        h = (h.float() + y.float()).to(dt)
        return h

    def step(self, h, reqs, pos, cs, rows):
        """h [T, H]; reqs: (request id, first row, n rows)."""
        dt = self.dt
        for li, L in enumerate(self.layers):
            x = _norm(h, L["input_norm"], dt)
            if L["qkv"] is None:  # the token mixer runs outside: its linear stand-in
                h = (h.float() + _lin(x, self.opts["mixers"][li], None, dt).float()).to(dt)
                x = _norm(h, L["post_norm"], dt)
                h = self._mlp(h, x, L)
                continue
            qkv = _lin(x, L["qkv"], L["qkv_bias"], dt)
            t_n = h.shape[0]
            q = qkv[:, : HQ * D].reshape(t_n, HQ, D)
            k = qkv[:, HQ * D : (HQ + HKV) * D].reshape(t_n, HKV, D)
            v = qkv[:, (HQ + HKV) * D : (HQ + 2 * HKV) * D].reshape(t_n, HKV, D)
            if L["q_norm"] is not None:
                q, k = _norm(q, L["q_norm"], dt), _norm(k, L["k_norm"], dt)
            cs_l = self.opts.get("cos_sin", {}).get(li, cs)
            q, k = _rope(q, pos, cs_l, dt), _rope(k, pos, cs_l, dt)
            att = torch.empty(t_n, HQ, D, dtype=dt)
            for r, t0, n in reqs:
                k0, v0 = self.kv.get((li, r), (k[:0], v[:0]))
                ks, vs = torch.cat([k0, k[t0 : t0 + n]]), torch.cat([v0, v[t0 : t0 + n]])
                self.kv[(li, r)] = (ks, vs)
                kl = ks.shape[0]
                w = self.windows[li]
                for i in range(n):
                    p = kl - n + i
                    lo = max(0, p - w + 1) if w > 0 else 0
                    for hh in range(HQ):
                        kv_h = hh // (HQ // HKV)
                        kh, vh = ks[lo : p + 1, kv_h].float(), vs[lo : p + 1, kv_h].float()
                        sc = (kh @ q[t0 + i, hh].float()) / math.sqrt(D)
                        cap = self.opts.get("softcap", 0.0)
                        if cap:
                            sc = cap * torch.tanh(sc / cap)
                        if L.get("sinks") is not None:  # an extra logit, no value
                            pr = torch.softmax(torch.cat([sc, L["sinks"][hh : hh + 1]]), 0)[:-1]
                        else:
                            pr = torch.softmax(sc, 0)
                        att[t0 + i, hh] = (pr @ vh).to(dt)
            att = att.reshape(t_n, -1)
            if self.opts.get("gate"):  # HF: attn_output * torch.sigmoid(gate), model dtype
                sig = torch.sigmoid(qkv[:, (HQ + 2 * HKV) * D :].float()).to(dt)
                att = (att.float() * sig.float()).to(dt)
            o = _lin(att, L["o"], L["o_bias"], dt)
            if L.get("post_attn_norm") is not None:
                o = _norm(o, L["post_attn_norm"], dt)
            h = (h.float() + o.float()).to(dt)
            x = _norm(h, L["post_norm"], dt)
            h = self._mlp(h, x, L)
        y = _norm(h[rows], self.final_norm, dt)
        logits = _lin(y, self.head, None, dt).float()
        cap = self.opts.get("logit_softcap", 0.0)
        return cap * torch.tanh(logits / cap) if cap else logits


# -- running the op -------------------------------------------------------------------------


def _caches(dt, n_blocks=8):
    shape = A.kv_cache_shape(n_blocks, HKV, B, D)
    return [torch.full(shape, float("nan"), dtype=dt) for _ in range(3)]


def _plan(qsl, sl, bt, slots, isa, n_blocks=8):
    """The step's plan with its indices (bt None: a plan without them)."""
    indices = {}
    if bt is not None:
        indices = {
            "block_table": torch.tensor(bt, dtype=torch.int32),
            "slot_mapping": torch.tensor(slots, dtype=torch.int64),
            "num_blocks": n_blocks,
        }
    heads = {"num_heads": HQ, "num_kv_heads": HKV, "head_dim": D, "block_size": B}
    qsl, sl = torch.tensor(qsl, dtype=torch.int32), torch.tensor(sl, dtype=torch.int32)
    return A.plan_attention(qsl, sl, **heads, isa=isa, **indices)


_PREPARE = ("workers", "shared_widen_from")  # DecoderStack.prepare's options


def run_once(stack, hidden, plan, positions, cos_sin_cache, **kw):
    """One run of a step prepared for it alone: ``kw`` holds ``prepare``'s options
    (``workers``, ``shared_widen_from``) and ``run``'s."""
    opts = {k: kw.pop(k) for k in _PREPARE if k in kw}
    return stack.run(stack.prepare(plan, positions, cos_sin_cache, **opts), hidden, **kw)


def _forward(stack, outside, embed_rows, plan, pos, cs, rows, mixers=None, units=None, **kw):
    """The engine's loop: the step prepared once (``kw``: ``prepare``'s options), the
    stack's runs, the outside ops between them (the MLP stand-in ``outside``;
    ``mixers[l]``, a linear stand-in for layer l's outside token mixer), the head with the
    last run. ``units``: a list that gets each run's ``phase_units``."""
    step = stack.prepare(plan, pos, cs, **kw)
    h = embed_rows.clone()
    logits = torch.full((len(rows), stack.vocab_size), float("nan"))  # every logit written
    add = None
    for run in stack.runs:
        _, l1, after, _ = run
        head = (
            {"logits_rows": rows, "logits": logits}
            if after is None and l1 == stack.num_layers
            else {}
        )
        x = stack.run(step, h, layers=run, residual_add=add, **head)
        if units is not None:
            units.append(step.phase_units(run))
        assert (x is None) == (after is None)
        add = None
        if after == "mlp":
            add = _lin(x, outside, None, stack.dtype)
        elif after == "mixer":
            add = _lin(x, mixers[l1], None, stack.dtype)
    return logits


# two requests: A (5-token prompt), B (37 tokens: two blocks); then one decode token each
TABLE = [[3, 0], [6, 1]]  # shuffled blocks


def _slots(req, positions):
    return [TABLE[req][p // B] * B + p % B for p in positions]


STEPS = [
    # (qsl, seq_lens, rows of (request, first row, n), positions, sampled rows)
    ([0, 5, 42], [5, 37], [(0, 0, 5), (1, 5, 37)], [*range(5), *range(37)], [4, 41]),
    ([0, 1, 2], [6, 38], [(0, 0, 1), (1, 1, 1)], [5, 37], [0, 1]),
]


def _run_steps(dt, isa, *, qk_norm, bias, **kw):
    layers, fnorm, head, outside = _weights(dt, qk_norm=qk_norm, bias=bias)
    stack = _stack(layers, fnorm, head, _caches(dt), isa)
    ref = Reference(layers, fnorm, head, outside, dt)
    cs = _cos_sin(64)
    g = torch.Generator().manual_seed(1)
    got, want = [], []
    for qsl, sl, reqs, positions, rows in STEPS:
        slots = [s for r, _, n in reqs for s in _slots(r, positions[qsl[r] : qsl[r] + n])]
        plan = _plan(qsl, sl, TABLE, slots, isa)
        pos = torch.tensor(positions, dtype=torch.int64)
        h = (torch.randn(len(positions), H, generator=g) * 0.5).to(dt)
        r = torch.tensor(rows, dtype=torch.int64)
        got.append(_forward(stack, outside, h, plan, pos, cs, r, **kw))
        want.append(ref.step(h.clone(), reqs, pos, cs, r))
    return got, want


def logits_tolerance(dtype):
    """The logits' tolerance, of the reference's largest magnitude (the table's decoder
    entry): fp32's is float rounding; a 16-bit dtype's two units of its rounding (``eps``:
    2**-7 bf16, 2**-10 fp16), as rounding flips at the same points propagate through the
    layers."""
    return tolerance("decoder", dtype).peak


@pytest.mark.parametrize(
    "dtype, qk_norm, bias",
    [(torch.float32, True, False), (torch.bfloat16, False, True), (torch.float16, True, True)],
)
def test_decoder_equals_the_reference_forward(dtype, qk_norm, bias):
    got, want = _run_steps(dtype, "vec", qk_norm=qk_norm, bias=bias)
    for a, b in zip(got, want):
        assert torch.isfinite(a).all()
        tol = logits_tolerance(dtype) * b.abs().max()
        assert (a - b).abs().max() <= tol, (a - b).abs().max().item()


@pytest.mark.parametrize(
    "dtype, vocab, cap",
    [(torch.float32, 255, 0.0), (torch.float32, 250, 5.0), (torch.bfloat16, 255, 0.0)],
    ids=["fp32-255", "fp32-250-softcap", "bf16-255"],
)
def test_logits_of_a_vocab_not_a_multiple_of_16(dtype, vocab, cap):
    """1, 2 and 3 sampled rows of a vocabulary that leaves a scalar tail after the head's
    16-wide widening loop ((R * vocab) % 16 logits; with 2 rows of 255, row 1's columns
    241..254). Those logits once stayed unwritten: Numba's dead code elimination dropped
    the tail's ``head.logits[i] = ...`` (a setitem on a field of a tuple-unpacked
    argument). The logits start NaN; the fp32 and bf16 kernel variants of the tests above."""
    layers, fnorm, head, outside = _weights(dtype, qk_norm=True, bias=False, vocab=vocab)
    stack = _stack(layers, fnorm, head, _caches(dtype), "vec", logit_softcap=cap)
    qsl, sl, reqs, positions, _ = STEPS[0]
    slots = [s for r, _, n in reqs for s in _slots(r, positions[qsl[r] : qsl[r] + n])]
    plan = _plan(qsl, sl, TABLE, slots, "vec")
    pos, cs = torch.tensor(positions, dtype=torch.int64), _cos_sin(64)
    h = (torch.randn(len(positions), H, generator=torch.Generator().manual_seed(1)) * 0.5).to(dtype)
    for rows in ([41], [4, 41], [4, 17, 41]):
        r = torch.tensor(rows, dtype=torch.int64)
        ref = Reference(layers, fnorm, head, outside, dtype, logit_softcap=cap)
        want = ref.step(h.clone(), reqs, pos, cs, r)
        got = _forward(stack, outside, h, plan, pos, cs, r)
        assert got.shape == (len(rows), vocab) and torch.isfinite(got).all(), rows
        assert (got - want).abs().max() <= logits_tolerance(dtype) * want.abs().max(), rows


def test_fp16_tolerance_bites():
    """fp16's tolerance is fp16's, not bf16's: a forward that rounds through bf16 (every
    op of the reference rounded to bf16 on the same fp16 weights and inputs, or the fp16
    op's logits rounded to bf16) fails it, while the fp16 op meets it (above)."""
    dt = torch.float16
    layers, fnorm, head, outside = _weights(dt, qk_norm=True, bias=True)
    qsl, sl, reqs, positions, rows = STEPS[0]
    slots = [s for r, _, n in reqs for s in _slots(r, positions[qsl[r] : qsl[r] + n])]
    plan = _plan(qsl, sl, TABLE, slots, "vec")
    pos, cs = torch.tensor(positions, dtype=torch.int64), _cos_sin(64)
    h = (torch.randn(len(positions), H, generator=torch.Generator().manual_seed(1)) * 0.5).to(dt)
    r = torch.tensor(rows, dtype=torch.int64)
    want = Reference(layers, fnorm, head, outside, dt).step(h.clone(), reqs, pos, cs, r)
    tol = logits_tolerance(dt) * want.abs().max()
    bf16 = Reference(layers, fnorm, head, outside, torch.bfloat16)
    through_bf16 = bf16.step(h.clone().bfloat16(), reqs, pos, cs, r)
    assert (through_bf16 - want).abs().max() > tol
    stack = _stack(layers, fnorm, head, _caches(dt), "vec")
    got = _forward(stack, outside, h, plan, pos, cs, r)
    assert (got - want).abs().max() <= tol
    assert (got.bfloat16().float() - want).abs().max() > tol


def test_reference_tolerance_bites():
    """A stack whose final norm is off by 2% must fail the fp32 comparison above."""
    layers, fnorm, head, outside = _weights(torch.float32, qk_norm=True, bias=False)
    stack = _stack(layers, fnorm * 1.02, head, _caches(torch.float32), "vec")
    ref = Reference(layers, fnorm, head, outside, torch.float32)
    qsl, sl, reqs, positions, rows = STEPS[0]
    slots = [s for r, _, n in reqs for s in _slots(r, positions[qsl[r] : qsl[r] + n])]
    plan = _plan(qsl, sl, TABLE, slots, "vec")
    pos = torch.tensor(positions, dtype=torch.int64)
    h = torch.randn(len(positions), H) * 0.5
    r = torch.tensor(rows, dtype=torch.int64)
    a = _forward(stack, outside, h, plan, pos, _cos_sin(64), r)
    b = ref.step(h.clone(), reqs, pos, _cos_sin(64), r)
    assert (a - b).abs().max() > logits_tolerance(torch.float32) * b.abs().max()


def test_decoder_does_not_depend_on_how_many_workers_run():
    """Work units come from shared counters and workers wait for units, not for workers:
    with more workers than threads, a single one, or every GEMM widening its input in a
    phase of all workers, each unit is computed by the same code on the same inputs, so
    the logits are bitwise equal. A barrier that counted workers would hang here."""
    base, _ = _run_steps(torch.bfloat16, "vec", qk_norm=True, bias=True)
    for kw in ({"workers": 1}, {"workers": 7}, {"shared_widen_from": 0}):
        got, _ = _run_steps(torch.bfloat16, "vec", qk_norm=True, bias=True, **kw)
        for a, b in zip(got, base):
            assert torch.equal(a, b), kw


def bf16_steps_report():
    """The bf16 steps of ``_run_steps`` (a 42-row prefill, then a decode step): their
    errors against the reference and the GEMM paths this process compiled into the fused
    run (the dtype of each ``_run`` variant's ``Model.gemm_path`` witness)."""
    got, want = _run_steps(torch.bfloat16, "vec", qk_norm=False, bias=True)
    model = (sig[2] for sig in decoder_layer._run.signatures)  # Model, a Numba NamedTuple type
    witnesses = {str(dict(zip(t.fields, t.types))["gemm_path"].dtype) for t in model}
    return {
        "path": gemm.PATH,
        "witnesses": sorted(witnesses),
        "dp_compiled": len(gemm._block_dp.signatures),
        "finite": all(bool(torch.isfinite(a).all()) for a in got),
        "err": [float((a - b).abs().max()) for a, b in zip(got, want)],
        "scale": [float(b.abs().max()) for b in want],
    }


def test_bf16_prefill_takes_the_cpus_gemm_path(monkeypatch):
    """A bf16 prefill (42 rows: M > 4) runs its GEMMs on AMX tiles where gemm.PATH is amx,
    on vdpbf16ps where it is dpbf16 (each its variant of the fused run) and matches the
    reference at the bf16 tolerance (the paths differ in the order of fp32 additions and
    in denormals only).
    A stack built where the path is widen (a CPU without AVX512-BF16, or masked) carries
    the widening witness, so it never compiles the dpbf16 blocks; that variant is the
    fused run every stack took before (its tiles: test_gemm's widen path; the variant
    itself, with its shared widening phase: test_bf16_widening_decoder_and_its_shared_phase,
    in a child where the CPU has AVX512-BF16)."""
    here = bf16_steps_report()
    fast = gemm.PATH in ("amx", "dpbf16")  # bf16 GEMMs on the bf16 activations as they are
    want = gemm.GEMM_WITNESS[gemm.PATH if fast else "widen"]
    assert str(want.dtype) in here["witnesses"]
    assert here["finite"]
    for err, scale in zip(here["err"], here["scale"]):
        assert err <= logits_tolerance(torch.bfloat16) * scale, (err, scale)
    layers, fnorm, head, _ = _weights(torch.bfloat16, qk_norm=False, bias=False)
    stack = _stack(layers, fnorm, head, _caches(torch.bfloat16), "vec")
    assert stack.gemm_path == (gemm.PATH if fast else "widen")
    assert stack._model.gemm_path.dtype == want.dtype
    monkeypatch.setattr(decoder_stack, "PATH", "widen")
    widen = _stack(layers, fnorm, head, _caches(torch.bfloat16), "vec")
    assert widen.gemm_path == "widen" and widen._model.gemm_path.dtype == np.float32


def bf16_widening_report():
    """The bf16 steps of ``_run_steps`` (a 42-row prefill, then a decode step) with every
    GEMM's activations widened in a phase of all workers (``shared_widen_from=0``): this
    process's GEMM path, whether it compiled the dpbf16 blocks, the errors against the
    reference and the units each widening phase handed out over the steps' runs."""
    units = []
    got, want = _run_steps(
        torch.bfloat16, "vec", qk_norm=False, bias=True, units=units, shared_widen_from=0
    )
    widen = {}
    for u in units:
        for name, n in u.items():
            if name.endswith(".widen"):
                widen[name] = widen.get(name, 0) + n
    return {
        "path": gemm.PATH,
        "dp_compiled": len(gemm._block_dp.signatures),
        "finite": all(bool(torch.isfinite(a).all()) for a in got),
        "err": [float((a - b).abs().max()) for a, b in zip(got, want)],
        "scale": [float(b.abs().max()) for b in want],
        "widen": widen,
    }


_WIDENING_CHILD = """
import json
from tests.test_decoder import bf16_widening_report
print(json.dumps(bf16_widening_report()))
"""


def test_bf16_widening_decoder_and_its_shared_phase():
    """The bf16 stack on the widening path runs on every host: where the CPU has
    AVX512-BF16 (its bf16 GEMMs take vdpbf16ps) in a child process with
    ``NUMKERN_CPU_FEATURES=-avx512bf16``, else here. Every GEMM widens its activations in
    a phase shared by all workers (``shared_widen_from=0``): the logits match the
    reference at the bf16 tolerance, and each GEMM's widening phase handed out units (a
    schedule that skipped the shared widening would leave the GEMMs reading an unwritten
    buffer, or never test the phase at all)."""
    if gemm.PATH in ("amx", "dpbf16"):  # both need AVX512-BF16
        env = {"NUMKERN_CPU_FEATURES": "-avx512bf16", "NUMBA_CPU_FEATURES": ""}
        r = json.loads(run_child(_WIDENING_CHILD, env).splitlines()[-1])
    else:
        r = bf16_widening_report()
    assert r["path"] in ("widen", "fma256") and r["dp_compiled"] == 0 and r["finite"], r
    for err, scale in zip(r["err"], r["scale"]):
        assert err <= logits_tolerance(torch.bfloat16) * scale, (err, scale)
    for gemm_name in ("qkv", "o", "gate_up", "down", "head"):
        assert r["widen"][f"{gemm_name}.widen"] > 0, r["widen"]


def test_decoder_errors():
    dt = torch.float32
    layers, fnorm, head, _ = _weights(dt, qk_norm=False, bias=False)
    caches = _caches(dt)
    stack = _stack(layers, fnorm, head, caches, "vec")
    bad = [dict(L) for L in layers]
    bad[2]["qkv"] = bad[2]["qkv"][:-1]
    with pytest.raises(ValueError, match=r"layers\[2\]\.qkv"):
        _stack(bad, fnorm, head, caches, "vec")
    with pytest.raises(ValueError, match="caches"):
        _stack(layers, fnorm, head, caches[:2], "vec")
    with pytest.raises(TypeError, match="final_norm"):
        _stack(layers, fnorm.bfloat16(), head, caches, "vec")
    views = [A.cache_view(kv, "vec") for kv in caches]
    lw = _layer_weights(layers)
    kw = dict(num_heads=HQ, num_kv_heads=HKV, head_dim=D, final_norm=fnorm, lm_head=_pack(head))
    for bad, match, exc in (
        ({"eps": float("nan")}, "eps", ValueError),
        ({"eps": "1e-5"}, "eps", TypeError),
        ({"eps": EPS, "scale": 0.0}, "scale", ValueError),
        ({"eps": EPS, "softcap": -1.0}, "softcap", ValueError),
        ({"eps": EPS, "is_neox": 1}, "is_neox", TypeError),
    ):
        with pytest.raises(exc, match=match):
            DecoderStack(lw, views, **kw, **bad)
    with pytest.raises(TypeError, match=r"layers\[1\]"):
        DecoderStack([lw[0], dict(layers[1]), lw[2]], views, eps=EPS, **kw)
    small = views[1]._replace(num_blocks=views[1].num_blocks * 2)  # not what cache_view says
    with pytest.raises(ValueError, match=r"caches\[1\]"):
        DecoderStack(lw, [views[0], small, views[2]], eps=EPS, **kw)
    bare = views[1]._replace(geometry=None)  # a CacheView made by hand, without its geometry
    with pytest.raises(TypeError, match=r"caches\[1\]: expected a view with its CacheGeometry"):
        DecoderStack(lw, [views[0], bare, views[2]], eps=EPS, **kw)
    qsl, sl, reqs, positions, rows = STEPS[1]
    slots = [s for r, _, n in reqs for s in _slots(r, positions[qsl[r] : qsl[r] + n])]
    plan = _plan(qsl, sl, TABLE, slots, "vec")
    pos = torch.tensor(positions, dtype=torch.int64)
    h = torch.zeros(2, H)
    cs = _cos_sin(64)
    with pytest.raises(ValueError, match="positions"):
        run_once(stack, h, plan, pos, cs[:10], layers=(0, 1))
    with pytest.raises(ValueError, match="layers"):
        run_once(stack, h, plan, pos, cs, layers=(0, 3))  # layer 1's MLP runs outside
    with pytest.raises(ValueError, match="hidden"):
        run_once(stack, h[:1], plan, pos, cs, layers=(0, 1))
    unindexed = _plan(qsl, sl, None, None, "vec")
    with pytest.raises(ValueError, match="plan"):
        run_once(stack, h, unindexed, pos, cs, layers=(0, 1))
    other = _plan(qsl, sl, TABLE, slots, "vec", n_blocks=9)
    with pytest.raises(ValueError, match="plan"):
        run_once(stack, h, other, pos, cs, layers=(0, 1))
    # a plan for another group's geometry: same sizes, another dtype (only the geometry
    # tells them apart), refused by name
    g = stack.geometries[0]
    fp16 = A.CacheGeometry(
        g.num_blocks, g.num_kv_heads, g.block_size, g.head_dim, torch.float16, g.isa
    )
    table = torch.tensor(TABLE, dtype=torch.int32)
    stray = A.plan_attention(
        torch.tensor(qsl, dtype=torch.int32),
        torch.tensor(sl, dtype=torch.int32),
        num_heads=HQ,
        geometry=fp16,
        block_table=table,
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
    )
    with pytest.raises(ValueError, match="plan: built for CacheGeometry"):
        run_once(stack, h, stray, pos, cs, layers=(0, 1))
    for kw in ({"workers": 0}, {"shared_widen_from": -1}):
        with pytest.raises(ValueError, match=next(iter(kw))):
            run_once(stack, h, plan, pos, cs, layers=(0, 1), **kw)
    with pytest.raises(TypeError, match="layers"):
        run_once(stack, h, plan, pos, cs, layers=(0.0, 1))
    with pytest.raises(TypeError, match="layers"):
        run_once(stack, h, plan, pos, cs, layers=[0, 1])
    with pytest.raises(TypeError, match="logits_rows"):
        run_once(
            stack, h, plan, pos, cs, layers=(2, 3), logits_rows=[0], logits=torch.empty(1, VOCAB)
        )
    rows = torch.tensor([0, 2], dtype=torch.int64)
    with pytest.raises(ValueError, match="logits_rows"):
        run_once(
            stack, h, plan, pos, cs, layers=(2, 3), logits_rows=rows, logits=torch.empty(2, VOCAB)
        )
    step = stack.prepare(plan, pos, cs)
    with pytest.raises(TypeError, match="step"):
        stack.run(plan, h, layers=(0, 1))
    with pytest.raises(TypeError, match="step"):  # a step of another stack
        _stack(layers, fnorm, head, _caches(dt), "vec").run(step, h, layers=(0, 1))
    gated, *_ = _weights(dt, qk_norm=False, bias=True, gate=True)
    with pytest.raises(ValueError, match=r"layers\[0\]\.qkv"):  # no gate rows
        _stack(layers, fnorm, head, caches, "vec", attn_output_gate=True)
    gated[0]["qkv_bias"] = gated[0]["qkv_bias"][: (HQ + 2 * HKV) * D]
    with pytest.raises(ValueError, match=r"layers\[0\]\.qkv_bias"):
        _stack(gated, fnorm, head, caches, "vec", attn_output_gate=True)
    with pytest.raises(TypeError, match="attn_output_gate"):
        _stack(layers, fnorm, head, caches, "vec", attn_output_gate=1)
    assert np.isnan(caches[2].float().numpy()).all()  # nothing ran


@pytest.mark.parametrize("extras", [False, True], ids=["plain", "sinks-sandwich-gelu-softcaps"])
def test_two_kv_cache_groups_with_their_own_block_size_window_and_isa(extras):
    """Layers 0 and 2 slide (window 8, blocks of 32, isa vec), layer 1 attends to all
    (blocks of 16, isa vec16): the stack runs each group's layers with its own plan,
    cache and table, and a sliding block the window has left is -1 in the table.

    ``extras``: what GPT-OSS and Gemma 2/3 add: sink logits per layer, sandwich norms
    (attention and MLP outputs normed before their adds), a tanh-GELU MLP, attention
    and final-logit soft-caps, and a rotary table per group (local and global rope)."""
    dt = torch.bfloat16
    layers, fnorm, head, outside = _weights(
        dt, qk_norm=True, bias=True, seed=3, sinks=extras, sandwich=extras
    )
    groups, isas, sizes, windows = [0, 1, 0], ("vec", "vec16"), (32, 16), (8, -1)
    cs = _cos_sin(128)
    opts, run_opts = {}, {}
    if extras:
        tables = (_cos_sin(128), _cos_sin(128, theta=1e6))
        opts = dict(softcap=20.0, logit_softcap=5.0, activation="gelu_tanh")
        run_opts = dict(opts)
        opts["cos_sin"] = {li: tables[g] for li, g in enumerate(groups)}
        cs = tables
    caches = [
        torch.full(A.kv_cache_shape(8, HKV, sizes[g], D), float("nan"), dtype=dt) for g in groups
    ]
    views = [A.cache_view(kv, isas[g]) for kv, g in zip(caches, groups)]
    kw = dict(num_heads=HQ, num_kv_heads=HKV, head_dim=D, eps=EPS, kv_groups=groups, **run_opts)
    stack = DecoderStack(_layer_weights(layers), views, final_norm=fnorm, lm_head=_pack(head), **kw)
    assert stack.segments == ((0, 1), (1, 2), (2, 3))
    assert stack.isas == isas and stack.kv_groups == tuple(groups)
    layer_windows = [windows[g] for g in groups]
    ref = Reference(layers, fnorm, head, outside, dt, windows=layer_windows, **opts)
    tables = ([[3, 0, 5], [6, 1, 2]], [[7, 0, 1, 2, 3], [4, 5, 6, 3, 2]])
    gen = torch.Generator().manual_seed(4)
    steps = [  # a 5- and a 70-token prompt, then a decode token each
        ([0, 5, 75], [5, 70], [(0, 0, 5), (1, 5, 70)], [*range(5), *range(70)], [4, 74]),
        ([0, 1, 2], [6, 71], [(0, 0, 1), (1, 1, 1)], [5, 70], [0, 1]),
    ]
    for si, (qsl, sl, reqs, positions, rows) in enumerate(steps):
        plans = []
        for g in (0, 1):
            b = sizes[g]
            bt = [list(row) for row in tables[g]]
            slots = [bt[r][p // b] * b + p % b for r, t0, n in reqs for p in positions[t0 : t0 + n]]
            if si == 1 and g == 0:
                bt[1][0] = -1  # keys 0..31 of request 1: before its window (70 - 8 + 1)
            plans.append(
                A.plan_attention(
                    torch.tensor(qsl, dtype=torch.int32),
                    torch.tensor(sl, dtype=torch.int32),
                    num_heads=HQ,
                    num_kv_heads=HKV,
                    head_dim=D,
                    block_size=b,
                    sliding_window=windows[g],
                    isa=isas[g],
                    block_table=torch.tensor(bt, dtype=torch.int32),
                    slot_mapping=torch.tensor(slots, dtype=torch.int64),
                    num_blocks=8,
                )
            )
        pos = torch.tensor(positions, dtype=torch.int64)
        h = (torch.randn(len(positions), H, generator=gen) * 0.5).to(dt)
        r = torch.tensor(rows, dtype=torch.int64)
        got = _forward(stack, outside, h, tuple(plans), pos, cs, r)
        want = ref.step(h.clone(), reqs, pos, cs, r)
        assert torch.isfinite(got).all()
        assert (got - want).abs().max() <= logits_tolerance(dt) * want.abs().max()
        with pytest.raises(TypeError, match="tuple of 2 AttentionPlans"):
            run_once(stack, h, plans[0], pos, cs, layers=(0, 1))
        with pytest.raises(ValueError, match="KV-cache group 1"):
            run_once(stack, h, (plans[0], plans[0]), pos, cs, layers=(1, 2))
        with pytest.raises(ValueError, match="share one KV-cache group"):
            run_once(stack, h, tuple(plans), pos, cs, layers=(0, 2))


def test_window_table_check():
    """With a window, blocks before the first visible key's tile are not checked (-1
    allowed); a -1 inside the window is a ValueError naming the window."""
    qsl, sl = torch.tensor([0, 1], dtype=torch.int32), torch.tensor([71], dtype=torch.int32)
    kw = dict(num_heads=HQ, num_kv_heads=HKV, head_dim=D, block_size=16, isa="vec16")
    for window, table, ok in (
        (8, [-1, -1, 0, 1, 2], True),  # keys 63..70: their tiles 32..63, 64..95: blocks 2..4
        (8, [-1, -1, 1, -1, 2], False),  # block 3 holds keys 48..63 of the first tile
        (-1, [-1, 0, 1, 3, 2], False),  # no window: every block is read
        (39, [-1, -1, 0, 1, 2], True),  # first key 32: tile 32..63
        (40, [-1, -1, 0, 1, 2], False),  # first key 31: tile 0..31 starts in block 0
    ):
        args = dict(kw, sliding_window=window, num_blocks=4)
        bt = torch.tensor([table], dtype=torch.int32)
        if ok:
            A.plan_attention(qsl, sl, block_table=bt, **args)
        else:
            with pytest.raises(ValueError, match="block_table"):
                A.plan_attention(qsl, sl, block_table=bt, **args)


def test_layers_whose_token_mixer_runs_outside():
    """A hybrid stack (Gated DeltaNet layers run their token mixer outside: qkv=None, no
    cache): attention + dense, outside mixer + dense, attention + outside MLP, outside
    mixer + outside MLP, attention + dense. The runs stop at every outside unit, a run may
    start at a layer's MLP, and the logits equal the reference's with linear stand-ins
    for the outside mixers."""
    dt = torch.float32
    g = torch.Generator().manual_seed(5)
    base, fnorm, head, outside = _weights(dt, qk_norm=True, bias=True, seed=5)
    dense, moe = base[0], base[1]
    layers = [dict(dense), dict(dense), dict(moe), dict(moe), dict(base[2])]
    for i in (1, 3):  # outside mixers: no attention tensors
        layers[i].update(qkv=None, o=None, qkv_bias=None, o_bias=None, q_norm=None, k_norm=None)
    mixers = {i: (torch.randn(H, H, generator=g) * 0.1) for i in (1, 3)}
    caches = [None if L["qkv"] is None else c for L, c in zip(layers, _caches(dt, n_blocks=8) * 2)]
    views = [None if c is None else A.cache_view(c, "vec") for c in caches]
    kw = dict(num_heads=HQ, num_kv_heads=HKV, head_dim=D, eps=EPS)
    stack = DecoderStack(_layer_weights(layers), views, final_norm=fnorm, lm_head=_pack(head), **kw)
    assert stack.runs == (
        Run(0, 1, "mixer", "attention"),
        Run(1, 3, "mlp", "mlp"),
        Run(3, 3, "mixer", "attention"),
        Run(3, 4, "mlp", "mlp"),
        Run(4, 5, None, "attention"),
    )
    assert stack.kv_groups == (0, None, 0, None, 0) and stack.mixer == (
        True,
        False,
        True,
        False,
        True,
    )
    ref = Reference(layers, fnorm, head, outside, dt, mixers=mixers)
    cs = _cos_sin(64)
    for qsl, sl, reqs, positions, rows in STEPS:
        slots = [s for r, _, n in reqs for s in _slots(r, positions[qsl[r] : qsl[r] + n])]
        plan = _plan(qsl, sl, TABLE, slots, "vec")
        pos = torch.tensor(positions, dtype=torch.int64)
        h = (torch.randn(len(positions), H, generator=g) * 0.5).to(dt)
        r = torch.tensor(rows, dtype=torch.int64)
        got = _forward(stack, outside, h, plan, pos, cs, r, mixers=mixers)
        want = ref.step(h.clone(), reqs, pos, cs, r)
        assert (got - want).abs().max() <= logits_tolerance(dt) * want.abs().max()
    with pytest.raises(ValueError, match="every layer but the first its attention inside"):
        run_once(stack, h, plan, pos, cs, layers=(0, 2))
    kw.update(final_norm=fnorm, lm_head=_pack(head))
    with pytest.raises(ValueError, match=r"caches\[1\]: expected None"):
        DecoderStack(_layer_weights(layers), [views[0]] * 5, **kw)
    bad = [layers[0], dict(layers[1], sinks=torch.zeros(HQ)), *layers[2:]]
    with pytest.raises(ValueError, match=r"layers\[1\]\.sinks: expected None"):
        DecoderStack(_layer_weights(bad), views, **kw)


@pytest.mark.parametrize(
    "dtype, bias, hybrid",
    [
        (torch.float32, False, False),
        (torch.float32, True, True),
        (torch.bfloat16, True, False),
        (torch.bfloat16, False, True),
    ],
    ids=["fp32", "fp32-bias-hybrid", "bf16-bias", "bf16-hybrid"],
)
def test_gated_attention_output(dtype, bias, hybrid):
    """Qwen3-Next's attention (attn_output_gate): qkv has gate rows after v, and the
    attention output is multiplied by their sigmoid before o; with q/k head norms and
    partial rotary (half of each head, rotate-half). ``hybrid``: Qwen3-Next's pattern,
    three layers whose token mixer runs outside (one with its MLP outside), then a gated
    attention layer. A prefill step, then a decode step over the paged cache; the logits
    equal the reference's, and are far from those of the same weights without the gate."""
    layers, fnorm, head, outside = _weights(dtype, qk_norm=True, bias=bias, seed=6, gate=True)
    caches = _caches(dtype)
    mixers = {}
    if hybrid:
        g = torch.Generator().manual_seed(7)
        layers = [dict(layers[0]), dict(layers[1]), dict(layers[0]), dict(layers[2])]
        for i in range(3):
            layers[i].update(qkv=None, o=None, qkv_bias=None, o_bias=None, q_norm=None, k_norm=None)
            mixers[i] = torch.randn(H, H, generator=g) * 0.1
        caches = [None, None, None, caches[0]]
    rot = D // 2
    stack = _stack(layers, fnorm, head, caches, "vec", rotary_dim=rot, attn_output_gate=True)
    if hybrid:
        runs = ((0, 0, "mixer", "attention"), (0, 1, "mixer", "mlp"), (1, 2, "mlp", "mlp"),
                (2, 2, "mixer", "attention"), (2, 4, None, "mlp"))  # fmt: skip
        assert stack.runs == tuple(Run(*r) for r in runs)
    ref = Reference(layers, fnorm, head, outside, dtype, mixers=mixers, gate=True)
    ungated = Reference(layers, fnorm, head, outside, dtype, mixers=mixers)
    cs = _cos_sin(64, rot=rot)
    gen = torch.Generator().manual_seed(8)
    for qsl, sl, reqs, positions, rows in STEPS:
        slots = [s for r, _, n in reqs for s in _slots(r, positions[qsl[r] : qsl[r] + n])]
        plan = _plan(qsl, sl, TABLE, slots, "vec")
        pos = torch.tensor(positions, dtype=torch.int64)
        h = (torch.randn(len(positions), H, generator=gen) * 0.5).to(dtype)
        r = torch.tensor(rows, dtype=torch.int64)
        got = _forward(stack, outside, h, plan, pos, cs, r, mixers=mixers)
        want = ref.step(h.clone(), reqs, pos, cs, r)
        assert torch.isfinite(got).all()
        tol = logits_tolerance(dtype) * want.abs().max()
        assert (got - want).abs().max() <= tol, (got - want).abs().max().item()
        # without the gate: 6-60000 tolerances off (the fewest: bf16, one gated layer)
        assert (got - ungated.step(h.clone(), reqs, pos, cs, r)).abs().max() > 4 * tol
