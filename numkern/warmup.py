"""Compile the common kernel variants ahead of time, so no request pays for it.

Each variant is compiled once per process at first use (2-20 s cold, ~0.3 s from the
disk cache); ``warmup`` runs every common variant on tiny inputs so a server can do it
before the first request.
"""

import math
import time

import torch

from . import isa as _isa

KINDS = ("gemm", "moe", "attention")


def _gemm_cases():
    from .gemm import convert_weight_packed, weight_packed_linear

    def run(dtype, m):
        w = convert_weight_packed(torch.zeros(32, 64, dtype=dtype))
        x = torch.zeros(m, 64, dtype=dtype)
        weight_packed_linear(torch.empty(m, 32, dtype=dtype), x, w, torch.zeros(32), True)

    dts = (torch.bfloat16, torch.float16, torch.float32)
    return [(f"gemm {dt}", lambda dt=dt: (run(dt, 1), run(dt, 9))) for dt in dts]


def _moe_cases():
    from . import moe

    def run(dtype, layout):
        x = torch.zeros(2, 32, dtype=dtype)
        w13 = moe.prepack_moe_weight(torch.zeros(2, 64, 32, dtype=dtype), layout)
        w2 = moe.prepack_moe_weight(torch.zeros(2, 32, 32, dtype=dtype), layout)
        tw, ti = moe.topk_softmax(torch.zeros(2, 2), 1, True)
        moe.fused_moe(torch.empty_like(x), x, w13, w2, None, None, tw, ti, isa=layout)

    cases = [("bfloat16", "vec"), ("bfloat16", "amx"), ("float32", "vec")]
    return [
        (f"moe {dt} {lay}", lambda dt=dt, lay=lay: run(getattr(torch, dt), lay))
        for dt, lay in cases
    ]


def _attention_cases():
    from . import attention as A

    def run(dtype, variant):
        kv = torch.zeros(A.kv_cache_shape(2, 1, 32, 64), dtype=dtype)
        kc, vc = A.split_kv_cache(kv)
        k = torch.zeros(3, 1, 64, dtype=dtype)
        A.reshape_and_cache(k, k, kc, vc, torch.arange(3), variant)
        q = torch.zeros(3, 2, 64, dtype=dtype)
        qsl = torch.tensor([0, 3], dtype=torch.int32)
        sl = torch.tensor([3], dtype=torch.int32)
        bt = torch.zeros(1, 1, dtype=torch.int32)
        A.paged_attention(
            q, kc, vc, torch.empty_like(q), qsl, sl, bt, scale=1 / math.sqrt(64), isa=variant
        )

    variants = ["vec"] + (["amx"] if "amx" in _isa.supported_isas() else [])
    return [(f"attention bfloat16 {v}", lambda v=v: run(torch.bfloat16, v)) for v in variants]


def warmup(kinds=KINDS, *, progress=True):
    """Compile (or load from the disk cache) the common variants of ``kinds``.

    Returns ``{variant: seconds}``. ``progress`` shows a tqdm bar on stderr.
    """
    unknown = set(kinds) - set(KINDS)
    if unknown:
        raise ValueError(f"kinds: expected a subset of {KINDS}, got {sorted(unknown)}")
    makers = {"gemm": _gemm_cases, "moe": _moe_cases, "attention": _attention_cases}
    cases = [case for kind in kinds for case in makers[kind]()]
    timings = {}
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=len(cases), desc="numkern warmup", unit="kernel")
    for name, fn in cases:
        t = time.perf_counter()
        fn()
        timings[name] = time.perf_counter() - t
        if bar is not None:
            bar.set_postfix_str(name)
            bar.update()
    if bar is not None:
        bar.close()
    return timings
