"""Old commit against the working tree, alternated in one process: the "no speed lost"
check of a refactoring.

    python bench/ab.py OLD_COMMIT                 # kernels, GDN and engine decode, ~17 min
    python bench/ab.py OLD_COMMIT --only kernels  # fused_moe and packed GEMM, ~2 min
    python bench/ab.py OLD_COMMIT --only gdn      # the GDN ops (decode, chunked prefill), ~3 min
    python bench/ab.py OLD_COMMIT --reps 6        # fewer alternations

Same-run medians of separate processes swing by +-10% on the shared 2-core VMs (each
process lands on other memory, other huge pages, another neighbour's load), which hides a
5% change. Here the old commit's ``numkern`` and ``engine`` are exported (``git
archive``) into a temporary directory under the names ``numkern_old`` and
``engine_old`` (their absolute imports rewritten), and both trees run in this process:
each repetition calls old and new back to back, in alternating order, and the figure is
the median over repetitions of the per-repetition ratio new/old (> 1: new faster).
Both trees share Numba's thread pool, torch and the machine's state at that moment.

Cases:

* kernels: ``fused_moe`` (Qwen3-30B-A3B expert shape, bf16, isa vec) at T = 1 with
  rotating disjoint expert sets (a working set past the L3) and T = 32;
  ``weight_packed_linear`` at M = 1 and 16 on 12 rotated 2048 x 2048 bf16 weights;
  ``quant_linear`` (Q4_K, bf16 x) at M = 1 and 4 on 12 rotated 2048 x 2048 weights.
  ``paged_attention`` (bf16, isa vec) for a decode of 8 x 4,096 keys and a 512-token
  prefill. Outputs of old and new are compared (``rel_diff``: max |new - old| / max
  |old|; the run fails above one bf16 ulp).
* gdn: the decode-size Gated DeltaNet ops at Qwen3-Next-80B's shapes (16 k / 32 v heads of
  128, conv dim 8192, width 4, bf16, the conv weight packed, fp32 states), called as
  ``engine/gdn.py`` calls them on a decode step (q, k, v, a, b column windows of the
  in-projection's and the conv's outputs, vLLM's conv-state layout), at batch 1 and 8:
  ``causal_conv1d_update``, ``fused_gdn_gating`` (the gating op: on a decode step the
  engine fuses it into the recurrent rule, which takes the same A_log, a, b, dt_bias)
  and ``fused_sigmoid_gating_delta_rule_update``. Old and new each update their own
  states, the same calls in the same number: the last outputs are compared. Then the
  prefill's ``chunk_gated_delta_rule``: one request of 512 tokens, bf16 and fp32, called
  as ``engine/gdn.py`` calls it (q, k, v column windows of the conv's output, g and beta
  from ``fused_gdn_gating``, the state slot in a larger fp32 pool); its output compared
  from equal copies of the state.
* engine: decode tokens/s (greedy, 64 new tokens, EOS ignored; timed from the first
  step's tokens to the last, in one run) of SmolLM2-135M (the default GGUF) at batch 1
  (512-token prompt) and 8, and of bench_e2e's random Qwen3-MoE at batch 8 and 1; both
  engines must produce the same greedy tokens.

Results: ``bench/results/ab.{csv,json}`` and a table on stdout, headed by the CPU
(``harness.write_results``).
"""

import argparse
import io
import os
import re
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

import harness
import torch

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("numkern", "engine")
NEW_TOKENS = 64
# old and new kernels may round differently (another fp32 summation order): 1 bf16 ulp
MAX_REL_DIFF = 2**-7


def export_old(commit, dest):
    """``numkern`` and ``engine`` of ``commit`` under ``dest`` as ``numkern_old`` and
    ``engine_old``, their absolute imports of each other rewritten."""
    tar = subprocess.run(
        ["git", "-C", str(ROOT), "archive", "--format=tar", commit, *PACKAGES],
        check=True,
        capture_output=True,
    ).stdout
    with tarfile.open(fileobj=io.BytesIO(tar)) as t:
        t.extractall(dest, filter="data")
    names = "|".join(PACKAGES)
    bare = re.compile(rf"^(\s*)import ({names})$", re.M)  # code then says numkern.x
    other = re.compile(rf"\b(from|import) ({names})\b")
    quoted = re.compile(rf"\"({names})\"")

    def rename(text):
        text = bare.sub(r"\1import \2_old as \2", text)
        text = other.sub(r"\1 \2_old", text)
        return quoted.sub(r'"\1_old"', text)

    for pkg in PACKAGES:
        for path in Path(dest, pkg).rglob("*.py"):
            path.write_text(rename(path.read_text()))
        os.rename(Path(dest, pkg), Path(dest, pkg + "_old"))


def _diff(a, b):
    """Max |a - b| over max |b|: 0 when old and new agree bit for bit."""
    return ((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-30)).item()


def alternate(new, old, reps, inner=1):
    """Median over ``reps`` of time(old) / time(new) (> 1: new faster), calls alternated."""
    for f in (new, old):
        f()
        f()
    ratios = []
    for i in range(reps):
        times = {}
        for name, f in (("new", new), ("old", old))[:: 1 if i % 2 == 0 else -1]:
            t = time.perf_counter()
            for _ in range(inner):
                f()
            times[name] = time.perf_counter() - t
        ratios.append(times["old"] / times["new"])
    return statistics.median(ratios), ratios


def _rotating(fn, items):
    """A call of ``fn`` on the next of ``items`` each time (a working set past the L3)."""
    state = [0]

    def call():
        fn(items[state[0] % len(items)])
        state[0] += 1

    return call


def _moe_call(mod, out, x, packed):
    return lambda route: mod.fused_moe(out, x, *packed, None, None, *route, isa="vec")


def _linear_call(mod, out, x):
    return lambda w: mod.weight_packed_linear(out, x, w, None, True)


def bench_kernels(reps):
    import numkern_old.gemm as og
    import numkern_old.moe as om

    import numkern.gemm as ng
    import numkern.moe as nm

    gen = torch.Generator().manual_seed(0)
    rows = []
    e_n, k, h, i_n = 128, 8, 2048, 768
    w13 = torch.randn(e_n, 2 * i_n, h, generator=gen).to(torch.bfloat16) / h**0.5
    w2 = torch.randn(e_n, h, i_n, generator=gen).to(torch.bfloat16) / i_n**0.5
    packed = {
        mod: (mod.prepack_moe_weight(w13, "vec"), mod.prepack_moe_weight(w2, "vec"))
        for mod in (nm, om)
    }
    for t_n in (1, 32):
        x = torch.randn(t_n, h, generator=gen).to(torch.bfloat16)
        routes = []
        for j in range(16):  # disjoint expert sets at T = 1: 16 x 8 = all 128 experts
            ids = (torch.arange(k)[None, :] + k * j + 3 * torch.arange(t_n)[:, None]) % e_n
            weights = torch.softmax(torch.randn(t_n, k, generator=gen), -1)
            routes.append((weights, ids.to(torch.int32)))
        outs = {mod: torch.empty(t_n, h, dtype=torch.bfloat16) for mod in (nm, om)}
        new, old = (_rotating(_moe_call(m, outs[m], x, packed[m]), routes) for m in (nm, om))
        ratio, _ = alternate(new, old, reps)
        diff = _diff(outs[nm], outs[om])
        rows.append({"case": f"fused_moe T={t_n}", "new_over_old": ratio, "rel_diff": diff})
    weights = [torch.randn(2048, 2048, generator=gen).to(torch.bfloat16) for _ in range(12)]
    packed = {mod: [mod.convert_weight_packed(w) for w in weights] for mod in (ng, og)}
    rows += _rotated_rows("weight_packed_linear", (ng, og), packed, (1, 16), _linear_call,
                          reps, gen)  # fmt: skip
    rows += _bench_quant(reps, gen)
    return rows


def _rotated_rows(label, mods, items, ms, call_of, reps, gen):
    """Rows ``label M=m``: new and old (``mods``) called on their rotated 2048-wide
    ``items``, 12 calls a sample, alternated; outputs compared."""
    rows = []
    for m in ms:
        x = torch.randn(m, 2048, generator=gen).to(torch.bfloat16)
        outs = {mod: torch.empty(m, 2048, dtype=torch.bfloat16) for mod in mods}
        new, old = (_rotating(call_of(d, outs[d], x), items[d]) for d in mods)
        ratio, _ = alternate(new, old, reps, inner=12)
        diff = _diff(outs[mods[0]], outs[mods[1]])
        rows.append({"case": f"{label} M={m}", "new_over_old": ratio, "rel_diff": diff})
    return rows


def _quant_call(mod, out, x):
    return lambda w: mod.quant_linear(out, x, w)


def _bench_quant(reps, gen):
    """``quant_linear`` at M = 1 and 4 (decode sizes: the vector int8 code on every path)
    on 12 rotated Q4_K 2048 x 2048 weights (quantised once, repacked by each tree)."""
    import numkern_old.quant as oq

    import numkern.quant as nq
    from numkern.testing.quantize import quantize

    raws = [quantize(torch.randn(2048, 2048, generator=gen).numpy() * 0.02, "Q4_K")
            for _ in range(12)]  # fmt: skip
    weights = {mod: [mod.repack(r, "Q4_K", (2048, 2048)) for r in raws] for mod in (nq, oq)}
    return _rotated_rows("quant_linear Q4_K", (nq, oq), weights, (1, 4), _quant_call, reps, gen)


def _attention_call(mod, q, kc, vc, out, qsl, sl, bt, plan):
    def call():
        mod.paged_attention(q, kc, vc, out, qsl, sl, bt, scale=0.088, isa="vec", plan=plan)

    return call


def bench_attention(reps):
    """paged_attention (bf16, 32 q / 8 kv heads of 128, blocks of 32, isa vec): a decode
    of 8 requests of 4,096 keys (a 128 MB cache: past the L3) and a 512-token prefill."""
    import numkern_old.attention as oa

    import numkern.attention as na

    gen = torch.Generator().manual_seed(0)
    hq, hkv, d, b = 32, 8, 128, 32
    rows = []
    for name, q_lens, kv_len in (("decode 8 x 4096", [1] * 8, 4096), ("prefill 512", [512], 512)):
        r_n = len(q_lens)
        per = -(-kv_len // b)
        shape = na.kv_cache_shape(r_n * per, hkv, b, d)
        kv = (torch.randn(shape, generator=gen) * 0.5).to(torch.bfloat16)
        kc, vc = na.split_kv_cache(kv)
        bt = torch.randperm(r_n * per, generator=gen).to(torch.int32).reshape(r_n, per)
        qsl = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
        sl = torch.full((r_n,), kv_len, dtype=torch.int32)
        q = torch.randn(sum(q_lens), hq, d, generator=gen).to(torch.bfloat16)
        calls, outs = [], []
        for mod in (na, oa):
            plan = mod.plan_attention(
                qsl, sl, num_heads=hq, num_kv_heads=hkv, head_dim=d, block_size=b, isa="vec"
            )
            outs.append(torch.empty_like(q))
            calls.append(_attention_call(mod, q, kc, vc, outs[-1], qsl, sl, bt, plan))
        ratio, _ = alternate(*calls, reps, inner=3)
        diff = _diff(*outs)
        rows.append({"case": f"paged_attention {name}", "new_over_old": ratio, "rel_diff": diff})
    return rows


# Qwen3-Next-80B-A3B's GDN layer: k heads, v heads, head dim, conv width
GDN_HK, GDN_HV, GDN_D, GDN_WIDTH = 16, 32, 128, 4


def _gdn_inputs(b_n, gen):
    """The decode-size GDN ops' inputs at batch ``b_n`` (engine-style: q, k, v, a and b
    are strided slices of the projections, the states pools larger than the batch)."""
    hk, hv, d = GDN_HK, GDN_HV, GDN_D
    kd, cd, vd = hk * d, 2 * hk * d + hv * d, hv * d
    bf = torch.bfloat16
    proj = torch.randn(b_n, cd + vd + 2 * hv, generator=gen).to(bf)  # in_proj's output
    slots_n = 2 * b_n  # a pool larger than the batch, every other slot used
    conv_state = (torch.randn(slots_n, GDN_WIDTH - 1, cd, generator=gen) * 0.5).to(bf)
    conv = torch.randn(b_n, cd, generator=gen).to(bf)  # the conv's output
    return {
        "mixed": proj[:, :cd],
        "b": proj[:, cd + vd : cd + vd + hv],
        "a": proj[:, cd + vd + hv :],
        "conv_state": conv_state.transpose(1, 2),  # vLLM's layout, as the engine's
        "weight": (torch.randn(cd, GDN_WIDTH, generator=gen) * 0.5).to(bf),
        "slots": torch.arange(0, slots_n, 2, dtype=torch.int32),
        "qsl": torch.arange(b_n + 1, dtype=torch.int32),
        "q": conv[:, :kd].unflatten(1, (hk, d))[None],
        "k": conv[:, kd : 2 * kd].unflatten(1, (hk, d))[None],
        "v": conv[:, 2 * kd :].unflatten(1, (hv, d))[None],
        "ssm": torch.randn(slots_n, hv, d, d, generator=gen) * 0.05,
        "A_log": torch.randn(hv, generator=gen).to(bf),  # model dtype, as the engine keeps
        "dt_bias": torch.randn(hv, generator=gen).to(bf),
    }


def _with_own_states(x):
    """``x`` with copies of the states the ops update in place (strides kept)."""
    return {**x, "conv_state": x["conv_state"].clone(), "ssm": x["ssm"].clone()}


def _gdn_calls(mod, x):
    """The three decode-size GDN ops of ``mod`` (numkern.gdn or numkern_old.gdn) on the
    inputs ``x`` (:func:`_gdn_inputs`), each a call returning its output."""
    weight = mod.causal_conv1d_weight_pack(x["weight"])

    def conv_update():
        return mod.causal_conv1d_update(
            x["mixed"], x["conv_state"], weight, None, True, x["slots"], True
        )

    def gating():
        return mod.fused_gdn_gating(x["A_log"], x["a"], x["b"], x["dt_bias"])[0]

    def recurrent():
        return mod.fused_sigmoid_gating_delta_rule_update(
            x["A_log"], x["dt_bias"], x["q"], x["k"], x["v"], x["a"], x["b"], x["ssm"],
            x["slots"], x["qsl"], True, eps=1e-6,
        )  # fmt: skip

    return {"causal_conv1d_update": conv_update, "fused_gdn_gating": gating,
            "fused_sigmoid_gating_delta_rule_update": recurrent}  # fmt: skip


# calls per timed repetition: ~5-20 ms each on the 2-core VMs
GDN_INNER = {
    "causal_conv1d_update": 200,
    "fused_gdn_gating": 1000,
    "fused_sigmoid_gating_delta_rule_update": 8,
}


def _recording(f, outs, who):
    """``f`` as a call that keeps its last output in ``outs[who]``."""

    def call():
        outs[who] = f()

    return call


# the chunked rule's case: a prefill of this many tokens (eight chunks of 64)
GDN_PREFILL = 512


def _chunked_call(mod, dt, gen):
    """``mod``'s ``chunk_gated_delta_rule`` on one prefill of GDN_PREFILL tokens in ``dt``,
    engine-style (see the module docstring); inputs from ``gen``, so equal seeds give old
    and new equal inputs, each its own state pool."""
    hk, hv, d, t_n = GDN_HK, GDN_HV, GDN_D, GDN_PREFILL
    kd, cd = hk * d, 2 * hk * d + hv * d
    conv = torch.randn(t_n, cd, generator=gen).to(dt)  # the conv's output
    ba = torch.randn(t_n, 2 * hv, generator=gen).to(dt)  # in_proj_ba's: b, then a
    A_log = torch.randn(hv, generator=gen).to(dt)
    dt_bias = torch.randn(hv, generator=gen).to(dt)
    g, beta = mod.fused_gdn_gating(A_log, ba[:, hv:], ba[:, :hv], dt_bias)
    q = conv[:, :kd].unflatten(1, (hk, d))[None]
    k = conv[:, kd : 2 * kd].unflatten(1, (hk, d))[None]
    v = conv[:, 2 * kd :].unflatten(1, (hv, d))[None]
    ssm = torch.randn(2, hv, d, d, generator=gen) * 0.05  # slot 1 of a pool of 2
    slots = torch.tensor([1], dtype=torch.int32)
    qsl = torch.tensor([0, t_n], dtype=torch.int32)
    return lambda: mod.chunk_gated_delta_rule(
        q, k, v, g, beta, ssm, True, qsl, False, True, slots, eps=1e-6
    )[0]


def bench_gdn(reps):
    """The decode-size GDN ops (see the module docstring), old and new alternated."""
    import numkern_old.gdn as og

    import numkern.gdn as ng

    rows = []
    for b_n in (1, 8):
        x = _gdn_inputs(b_n, torch.Generator().manual_seed(b_n))
        # timed on the very same tensors: with a state pool of its own each (32 MB at
        # B=8) the recurrent rule's new/old swung 0.80-1.47 between runs while the new
        # code on the old's own inputs measured 0.996 (AMD EPYC Zen 4): where each pool
        # landed, not the code. Both update the shared states in place, so the outputs
        # are compared on one call each from equal copies of the initial states.
        timed = [_gdn_calls(mod, x) for mod in (ng, og)]
        checked = [_gdn_calls(mod, _with_own_states(x)) for mod in (ng, og)]
        for name, inner in GDN_INNER.items():
            diff = _diff(checked[0][name](), checked[1][name]())
            ratio, _ = alternate(timed[0][name], timed[1][name], reps, inner=inner)
            rows.append({"case": f"{name} B={b_n}", "new_over_old": ratio, "rel_diff": diff})
    for dt in (torch.bfloat16, torch.float32):
        calls = [_chunked_call(mod, dt, torch.Generator().manual_seed(7)) for mod in (ng, og)]
        diff = _diff(calls[0](), calls[1]())  # the first call of each: equal states
        ratio, _ = alternate(calls[0], calls[1], reps)
        case = f"chunk_gated_delta_rule T={GDN_PREFILL} {str(dt).replace('torch.', '')}"
        rows.append({"case": case, "new_over_old": ratio, "rel_diff": diff})
    return rows


def _generate(mod, llm, prompts, n):
    sp = mod.SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
    t = time.perf_counter()
    out = llm.generate(prompts, sp)
    return time.perf_counter() - t, [o.token_ids for o in out]


def _decode_rate(mod, llm, prompts):
    """Decode tokens/s of one ``generate_stream`` run, from its first step's tokens to its
    last (harness.token_rates: never the difference t(64) - t(1) of two runs, which the
    prefill's noise can make impossible or negative)."""
    sp = mod.SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    b = len(prompts)
    t0 = time.perf_counter()
    stamps = [time.perf_counter() for _ in llm.generate_stream(prompts, sp)]
    return harness.token_rates(t0, stamps[b - 1 :: b], b, len(prompts[0]))[1]


def bench_engine(reps, moe_dir):
    import engine_old.llm as old_mod
    from bench_e2e import random_qwen3_moe

    import engine.llm as new_mod
    from engine.__main__ import default_model

    random_qwen3_moe(moe_dir)
    rows = []
    cases = (
        ("SmolLM2-135M", default_model(), ((1, 512), (8, 32))),
        ("random Qwen3-MoE", moe_dir, ((8, 32), (1, 64))),
    )
    for name, path, shapes in cases:
        llms = [
            (mod, mod.LLM(path, dtype="bfloat16", kv_cache_memory=1 << 30, progress=False))
            for mod in (new_mod, old_mod)
        ]
        for batch, prompt_len in shapes:
            prompts = [[(7 * i + j) % 1000 + 10 for j in range(prompt_len)] for i in range(batch)]
            tokens = [_generate(mod, llm, prompts, 8)[1] for mod, llm in llms]
            rates = ([], [])
            for i in range(reps):
                for j in (0, 1) if i % 2 == 0 else (1, 0):
                    rates[j].append(_decode_rate(*llms[j], prompts))
            ratios = [n / o for n, o in zip(*rates)]
            rows.append(
                {
                    "case": f"{name} decode batch {batch}",
                    "new_over_old": statistics.median(ratios),
                    "new_tok_s": statistics.median(rates[0]),
                    "old_tok_s": statistics.median(rates[1]),
                    "same_tokens": tokens[0] == tokens[1],
                }
            )
        llms.clear()
    return rows


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("old", help="the commit to compare the working tree with")
    p.add_argument("--only", choices=("kernels", "gdn", "engine"))
    p.add_argument("--reps", type=int, default=12, help="alternations per case (default 12)")
    args = p.parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        export_old(args.old, tmp)
        sys.path.insert(0, tmp)
        if args.only in (None, "kernels"):
            rows += bench_kernels(args.reps)
            rows += bench_attention(args.reps)
        if args.only in (None, "gdn"):
            rows += bench_gdn(args.reps)
        if args.only in (None, "engine"):
            rows += bench_engine(args.reps, os.path.join(tmp, "moe"))
    harness.write_results(
        "ab",
        rows,
        columns=["case", "new_over_old", "new_tok_s", "old_tok_s", "rel_diff", "same_tokens"],
        extra={"old_commit": args.old, "reps": args.reps},
        notes=["new_over_old: median of the per-alternation ratios (> 1: new faster)"],
    )
    ok = all(r.get("same_tokens", True) and r.get("rel_diff", 0) <= MAX_REL_DIFF for r in rows)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
