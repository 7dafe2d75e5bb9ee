"""Compile the common kernel variants ahead of time, so no request pays for it."""

import time

import torch


def _gemm_cases():
    from .gemm import convert_weight_packed, weight_packed_linear

    def run(dtype):
        w = convert_weight_packed(torch.zeros(32, 64, dtype=dtype))
        x = torch.zeros(2, 64, dtype=dtype)
        weight_packed_linear(torch.empty(2, 32, dtype=dtype), x, w, torch.zeros(32), True)

    return [
        (f"gemm {dt}", lambda dt=dt: run(dt))
        for dt in (torch.bfloat16, torch.float16, torch.float32)
    ]


def warmup(*, progress=True):
    """Compile (or load from the disk cache) every common kernel variant.

    Returns ``{variant: seconds}``. ``progress`` shows a tqdm bar on stderr.
    """
    cases = _gemm_cases()
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
