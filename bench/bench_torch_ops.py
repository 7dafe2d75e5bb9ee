"""numkern's ops through torch: a compiled block against the same block run eagerly.

    python bench/bench_torch_ops.py            # T in (1, 32)
    python bench/bench_torch_ops.py --quick    # T = 1, fewer rounds

The block is an MoE layer's routed half as a module would write it with
``torch.ops.numkern``: router GEMM (``weight_packed_linear``) -> ``topk_softmax`` ->
``cpu_fused_moe`` (64 experts, top 8, H 1024, I 256, bf16, biases none). Per token count:
the direct Python calls (``numkern.weight_packed_linear``, ``numkern.moe.topk_softmax``,
``numkern.moe.fused_moe``: the engine's path), the module eager (three dispatcher calls
each through the ops' Autograd kernel), the module under ``torch.inference_mode()``, and
``torch.compile(fullgraph=True)`` with ``aot_eager`` and, where a C++ compiler exists,
``inductor``; the ratio of each to the direct calls. The weights (~100 MB) stay in the
L3-or-memory regime the engine sees at decode (no rotation: a repeated call re-reads
them).
"""

import shutil

import harness
import torch

import numkern
import numkern.torch_ops  # defines torch.ops.numkern
from numkern import moe

E, K, H, I = 64, 8, 1024, 256
DT = torch.bfloat16
ops = torch.ops.numkern


class MoEBlock(torch.nn.Module):
    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        w13 = (torch.randn(E, 2 * I, H, generator=g) / H**0.5).to(DT)
        w2 = (torch.randn(E, H, I, generator=g) / I**0.5).to(DT)
        router = (torch.randn(E, H, generator=g) / H**0.5).to(DT)
        self.register_buffer("w13", moe.prepack_moe_weight(w13, "vec"))
        self.register_buffer("w2", moe.prepack_moe_weight(w2, "vec"))
        self.register_buffer("router", numkern.convert_weight_packed(router))

    def forward(self, x):
        logits = x.new_empty(x.shape[0], E)
        ops.weight_packed_linear(logits, x, self.router, None, True)
        tw, ti = ops.topk_softmax(logits, K, True)
        out = torch.empty_like(x)
        ops.cpu_fused_moe(out, x, self.w13, self.w2, None, None, tw, ti, False, "silu", "vec")
        return out

    def direct(self, x):
        logits = x.new_empty(x.shape[0], E)
        numkern.weight_packed_linear(logits, x, self.router, None, True)
        tw, ti = moe.topk_softmax(logits, K, True)
        out = torch.empty_like(x)
        moe.fused_moe(out, x, self.w13, self.w2, None, None, tw, ti, isa="vec")
        return out


def bench_tokens(block, t_n, timer_args, backends):
    x = torch.randn(t_n, H).to(DT)
    want = block.direct(x)
    cases = {"direct": lambda: block.direct(x), "torch.ops eager": lambda: block(x)}

    def inference():
        with torch.inference_mode():
            return block(x)

    cases["torch.ops inference_mode"] = inference
    for backend in backends:
        torch._dynamo.reset()
        compiled = torch.compile(block, backend=backend, fullgraph=True)
        if not torch.equal(compiled(x), want):
            raise AssertionError(f"compiled ({backend}) differs from the direct calls")
        cases[f"compile {backend}"] = lambda c=compiled: c(x)
    for name in ("torch.ops eager", "torch.ops inference_mode"):
        if not torch.equal(cases[name](), want):
            raise AssertionError(f"{name} differs from the direct calls")
    times = harness.time_interleaved(cases, **timer_args)
    base = times["direct"].median_s
    return [
        {
            "T": t_n,
            "path": name,
            "us": t.median_s * 1e6,
            "over_direct": t.median_s / base,
            "others_cores": t.other_cores,
        }
        for name, t in times.items()
    ]


def main(argv=None):
    bench = harness.start(
        "bench_torch_ops", argv, description=__doc__.splitlines()[0], quick_help="T = 1 only"
    )
    timer_args = bench.timer(rounds=(5, 15), max_seconds=(1.0, 3.0), min_sample_s=5e-3)
    backends = ["aot_eager"] + (["inductor"] if shutil.which("g++") else [])
    block = MoEBlock()
    rows = []
    for t_n in (1,) if bench.quick else (1, 32):
        rows += bench_tokens(block, t_n, timer_args, backends)
        for r in rows[-len(backends) - 3 :]:
            print(f"  T={t_n} {r['path']}: {r['us']:.1f} us ({r['over_direct']:.3f}x)", flush=True)
    bench.finish(rows, columns=["T", "path", "us", "over_direct", "others_cores"])


if __name__ == "__main__":
    main()
