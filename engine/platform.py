"""The CPU platform: features read once, kernel variants decided once and logged once.

Attention ISA (docs/kernels.md §3.3, vLLM's rule, in order): head_dim a multiple of 16
but not 32 -> ``vec16``; AMX usable, bf16, block size a multiple of 32 -> ``amx``; block
size a multiple of 32 -> ``vec`` (``neon`` on ARM); else ``vec16``. MoE: ``amx`` (its
weight layout) when AMX is usable and the dtype is bf16, else ``vec``. The rules live in
one table, ``numkern.isa`` (``attention_isa``, ``check_attention``, ``moe_isa``); this
module decides once and logs.

Overrides (:func:`isa_overrides`, once per engine: the one read of ``NUMKERN_ISA``): the
engine's ``isa`` argument, else ``NUMKERN_ISA``, validated against the CPU at once; the
shape is checked when a KV-cache group's geometry is made
(``engine.attention.resolve_geometry``). A test's layout override (``LLM(_layout_isa=)``)
is resolved there too, by ``numkern.isa.resolve_override`` with the CPU check skipped:
what leaves :func:`isa_overrides` is a resolved ``numkern.isa.Override`` (name and the
reason it is logged with), so no flag travels further.
"""

import contextlib
import logging
import os

import torch

from numkern import isa as nk_isa

log = logging.getLogger("engine")

DEFAULT_BLOCK_SIZE = 128
_logged = set()


def log_once(key, msg, *args):
    """Log a decision at INFO once per process (not per layer or per step)."""
    if key not in _logged:
        _logged.add(key)
        log.info(msg, *args)


def isa_overrides(isa=None, layout_isa=None):
    """``(attention override, MoE override)`` of one engine, each a resolved
    ``numkern.isa.Override`` or None (the rule decides): ``isa`` (checked against the
    CPU), else ``NUMKERN_ISA`` (read here, once per engine), for attention; or the test-only
    ``layout_isa`` (``"amx"`` or ``"vec"``, not with ``isa``; the CPU not checked) for both
    attention and the MoE weights."""
    if layout_isa is not None:
        if isa is not None or layout_isa not in nk_isa.MOE_ISAS:
            raise ValueError(
                f"_layout_isa: expected one of {nk_isa.MOE_ISAS} without isa= (test-only), got "
                f"{layout_isa!r} with isa={isa!r}"
            )
        layout = nk_isa.resolve_override(layout_isa, layout_only=True)
        return layout, layout
    name = isa if isa is not None else nk_isa.isa_override()
    if name is None:
        return None, None
    named = "isa override" if isa is not None else "NUMKERN_ISA"
    return nk_isa.resolve_override(name, name=named), None


def get_attn_isa(dtype, block_size, head_dim, kv_cache_dtype="auto", *, override=None):
    """The attention variant of one KV-cache group (the rule: ``numkern.isa``'s table),
    logged once. ``override``: an ISA name (checked against the CPU) or a resolved
    ``numkern.isa.Override`` (:func:`isa_overrides`); None: the rule. The shape is
    checked against the variant where the group's ``CacheGeometry`` is made."""
    if kv_cache_dtype != "auto":
        raise ValueError(
            f"kv_cache_dtype: only 'auto' (the model dtype) is supported, got {kv_cache_dtype!r}"
        )
    isa, why = nk_isa.attention_isa(dtype, block_size, head_dim, override=override)
    log_once(
        ("attn", dtype, block_size, head_dim, isa),
        "attention ISA %s for dtype=%s block_size=%d head_dim=%d (%s)",
        isa,
        str(dtype).replace("torch.", ""),
        block_size,
        head_dim,
        why,
    )
    return isa


def get_moe_isa(dtype, *, override=None):
    """The MoE weight layout / kernel variant, decided once per model (``numkern.isa``).
    ``override``: a name, or a resolved ``numkern.isa.Override`` (:func:`isa_overrides`)."""
    isa, why = nk_isa.moe_isa(dtype, override=override)
    log_once(("moe", dtype, isa), "MoE ISA %s for dtype=%s (%s)", isa, dtype, why)
    return isa


def engine_torch_threads(override=None):
    """torch's intra-op thread count inside the engine's own work (``LLM``'s load and
    warm-up, ``generate``, each step of ``generate_stream``, ``prompt_logits``), decided
    once per engine and logged once.

    ``override`` (``LLM(torch_threads=)``): an int >= 1, taken as is. Else 1: numkern runs
    every GEMM on Numba's pool (``engine.layers.Linear``), so what torch runs in a step is
    small (the embedding rows, an MoE layer's routing conversions, a sampled row's softmax,
    sort and multinomial), and on more threads each op is a fork-join that waits for a
    worker thread: one that is spinning or working for Numba, or, where the cores are
    shared, waiting for a vCPU. (With torch imported first, Numba's ``omp`` layer binds to
    torch's libgomp: one OpenMP pool, each calling thread with its own count; with
    ``tbb``, torch's idle OpenMP workers spin beside Numba's.) Measured on an AMD EPYC
    (Zen 4, 2 vCPUs, other jobs running), torch at 1 thread against 2: the 8 embedding
    rows of a batch-8 step 10 vs 307 us, a 49,152-logit softmax 65 vs 259 us, its stable
    sort 5.8 vs 29 ms, multinomial 2.2 vs 22 ms; in ``bench/bench_e2e.py``'s step
    breakdown, SmolLM2's batch-8 decode step outside the kernels 0.15 vs 7.4 ms, and the
    random Qwen3-MoE's decode steps the same within noise (0.93-1.03x).
    """
    if override is not None:
        n, why = override, "LLM(torch_threads=)"
    else:
        n = 1
        why = (
            "numkern's kernels run every GEMM on Numba's pool; torch's ops in a step are "
            "small, and more threads would only add fork-joins beside Numba's"
        )
    log_once(
        ("torch_threads", n),
        "torch threads inside the engine's calls: %s (%s); the caller's count is restored "
        "after each call and around each token a stream yields",
        n,
        why,
    )
    return n


@contextlib.contextmanager
def torch_threads(n):
    """torch's intra-op thread count is ``n`` inside the block, and what it was after
    (``n`` None: untouched). Under torch's OpenMP backend the count is the calling
    thread's (``omp_set_num_threads``): a thread whose torch has run keeps its own; one
    whose first torch op comes later starts from the count last set in the process. A set
    and a restore cost ~0.2 us together.

    Loading a checkpoint is thousands of small torch ops (dequantizing, packing: 0.1-4 MB
    each). On several threads each op is a fork-join that waits for every thread, and on
    a shared VM a thread waits for its vCPU: packing a 1536 x 576 bf16 weight measured
    0.33 ms on one thread and 32 ms on two (AMD EPYC VM, 2 vCPUs, other jobs running).
    """
    old = torch.get_num_threads()
    if n is None or n == old:
        yield
        return
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(old)


@contextlib.contextmanager
def numba_threads(n):
    """Numba's thread count is ``n`` inside the block for the calling thread (Numba keeps
    it per thread), and what it was after (``n`` None: untouched). A tensor-parallel
    rank's share of the cores (``engine.dist``)."""
    if n is None:
        yield
        return
    import numba

    old = numba.get_num_threads()
    if n == old:
        yield
        return
    numba.set_num_threads(n)
    try:
        yield
    finally:
        numba.set_num_threads(old)


@contextlib.contextmanager
def spawn_threads(n):
    """Processes started inside the block read ``NUMBA_NUM_THREADS=n`` at their Numba
    import (a spawned rank's pool); this process's environment is restored after."""
    old = os.environ.get("NUMBA_NUM_THREADS")
    os.environ["NUMBA_NUM_THREADS"] = str(n)
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("NUMBA_NUM_THREADS")
        else:
            os.environ["NUMBA_NUM_THREADS"] = old


def available_memory():
    """Bytes of RAM free now (8 GiB where the OS does not say)."""
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        return 8 << 30
