"""The scratch of a :func:`numkern.moe.fused_moe` call (docs/kernels.md §5.5): its
layout, computed without running the op (every size and offset a Python int, so 64-bit
safe), and the calling thread's buffer that holds it.
"""

import functools
import threading
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np
import torch

from .. import _check as C
from .._jit import jit

TILE = 16  # rows per packed tile (vLLM's prepack_moe_weight)
NT = 32  # output columns per register tile (two 16-lane groups)
MR = 8  # rows per large register tile (16 accumulators)
ALIGN = 64  # workspace buffers start on cache lines
# output rows of a quantised call's work item: 4 row blocks of 16 (numkern.moe.quant)
QROWS = 64


def _aligned(nbytes):
    return (int(nbytes) + ALIGN - 1) // ALIGN * ALIGN


class Layout(NamedTuple):
    """Each buffer of a bf16/fp16/fp32 call as ``(offset, size)`` in bytes, by name: what
    the kernel reads (``numkern.moe.fused._parts``), in the plan's order."""

    input_f32: tuple
    expert_offsets: tuple
    sorted_slots: tuple
    slot_rows: tuple
    work_items: tuple
    activation: tuple
    w2_output: tuple
    tile_scratch: tuple
    gathered_input: tuple


# :class:`Layout` of a call with quantised experts (``numkern.moe.quant``): its buffers,
# then the quantised call's own
QUANT_BUFFERS = ("sorted_input", "gate_up", "act_codes", "act_scales", "act_sums", "act_fsums")
QuantLayout = NamedTuple("QuantLayout", [(f, tuple) for f in Layout._fields + QUANT_BUFFERS])


@dataclass(frozen=True)
class MoEWorkspacePlan:
    """Scratch layout of one :func:`fused_moe` call; every number is a Python int (64-bit+).

    ``buffers`` maps a name to ``(offset, size)`` in bytes (sizes padded to 64 bytes);
    ``total_bytes`` is the sum of the sizes.
    """

    buffers: dict = field(default_factory=dict)
    total_bytes: int = 0

    @functools.cached_property
    def layout(self):
        """Every buffer's ``(offset, size)`` by name: a :class:`Layout` (or, with the
        quantised buffers, a :class:`QuantLayout`), what the kernels take."""
        cls = QuantLayout if "sorted_input" in self.buffers else Layout
        return cls(**self.buffers)


def moe_workspace_plan(
    num_tokens, topk, num_experts, hidden_size, intermediate_size, dtype, num_threads, *,
    quantized=False,
):  # fmt: skip
    """The scratch :func:`fused_moe` needs, computed without running it (int64-safe);
    ``quantized``: a call with quantised experts (docs/kernels.md §5.7), whose buffers
    follow the bf16 call's (``input_f32`` empty: it widens into ``sorted_input``)."""
    t_n = C.check_int("num_tokens", num_tokens, low=0)
    k = C.check_int("topk", topk, low=1)
    e_n = C.check_int("num_experts", num_experts, low=1)
    h = C.check_int("hidden_size", hidden_size, low=1)
    i = C.check_int("intermediate_size", intermediate_size, low=1)
    threads = C.check_int("num_threads", num_threads, low=1)
    if dtype not in C.FLOATS:
        raise TypeError(f"dtype: expected bfloat16, float16 or float32, got {dtype}")
    rows = t_n * k
    sizes = {
        "input_f32": t_n * h * 4,  # input rows widened once
        "expert_offsets": (e_n + 1) * 8,  # exclusive prefix sum of tokens per expert
        "sorted_slots": rows * 8,  # token * k + slot, grouped by expert, token order kept
        "slot_rows": rows * 8,  # inverse: sorted row of each (token, slot)
        "work_items": (e_n * (i // TILE) + e_n * (h // NT)) * 8,  # (expert, tile) items
        "activation": rows * i * 4,  # act(gate, up) rounded to the input dtype, fp32
        "w2_output": rows * h * 4,  # fp32 result of the w2 GEMM per sorted row
        "tile_scratch": threads * MR * NT * 4,  # one register-tile spill area per thread
        # bf16 rows of the AMX tiles: each sorted row's token, gathered (contiguous per expert)
        "gathered_input": rows * h * 2 if dtype == torch.bfloat16 else 0,
    }
    if quantized:
        wide = max(h, i)  # the int8 rows hold the input (H) and then the activation (I)
        sizes["input_f32"] = 0
        sizes["tile_scratch"] = 0
        sizes["gathered_input"] = 0
        sizes["work_items"] = e_n * (-(-2 * i // QROWS) + -(-h // QROWS)) * 8
        sizes.update({
            "sorted_input": rows * h * 4,  # fp32 inputs: each sorted row's token, widened
            "gate_up": rows * 2 * i * 4,  # fp32 w13 output (+ bias) per sorted row
            "act_codes": rows * wide,  # int8 activations (16-bit inputs), per sorted row
            "act_scales": rows * (wide // 32) * 4,  # fp32 scale per 32 K
            "act_sums": rows * (wide // 16) * 4,  # int32 sum of codes per 16 K
            "act_fsums": rows * (wide // 32) * 4,  # fp32 path: fp32 sum per 32 K
        })  # fmt: skip
    buffers = {}
    offset = 0
    for name, size in sizes.items():
        size = _aligned(size)
        buffers[name] = (offset, size)
        offset += size
    return MoEWorkspacePlan(buffers=buffers, total_bytes=offset)


class _Workspace(threading.local):
    """The scratch of the calling thread's fused_moe calls: allocated by its first call,
    grown (never shrunk) when a call needs more, freed with the thread.

    One per thread, not one per process: the kernels release the GIL, so calls from two
    threads run at once, and neither may write, regrow or free a buffer the other is
    using. A process-wide buffer behind a lock costs the same at T=1 but serialises the
    threads (docs/kernels.md §5.5 has the figures).
    """

    def __init__(self):
        self.buffer = np.empty(0, np.uint8)

    def take(self, plan):
        """This thread's buffer, grown to ``plan``, and the plan's layout: the buffers'
        ``(offset, size)`` in bytes, flat, in the order of ``plan.buffers`` (the kernel
        views its parts itself: a named tuple of ints crosses into a kernel for nothing,
        eight array views cost ~4 us)."""
        if self.buffer.nbytes < plan.total_bytes:
            self.buffer = np.empty(plan.total_bytes, np.uint8)
        return self.buffer, plan.layout


workspace = _Workspace()  # .buffer and .take() are the calling thread's


@jit(inline="always")
def part_of(buf, span, witness):
    """The workspace buffer at ``span = (offset, size)`` (bytes, a :class:`Layout` field)
    of ``buf`` as ``witness``'s dtype."""
    return buf[span[0] : span[0] + span[1]].view(witness.dtype)
