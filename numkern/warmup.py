"""Compile the common kernel variants ahead of time, so no request pays for it.

Each variant is compiled once per process at first use (2-20 s cold, ~0.3 s from the
disk cache); ``warmup`` runs every common variant on tiny inputs so a server can do it
before the first request, or a caller's own cases (an engine's: the kernels of its
model, in its dtypes and variants), and says what it compiled.
"""

import inspect
import json
import math
import os
import subprocess
import sys
import threading
import time
import warnings

import numpy as np
import torch
from numba.core import event

from . import _boot  # noqa: F401  (before prepare() builds Numba's target context)
from . import isa as _isa

KINDS = ("gemm", "moe", "attention")


def _gemm_run(dtype, m):
    from .gemm import convert_weight_packed, weight_packed_linear

    w = convert_weight_packed(torch.zeros(32, 64, dtype=dtype))
    x = torch.zeros(m, 64, dtype=dtype)
    weight_packed_linear(torch.empty(m, 32, dtype=dtype), x, w, torch.zeros(32), True)


def _gemm_cases():
    dts = (torch.bfloat16, torch.float16, torch.float32)
    return [(f"gemm {dt}", lambda dt=dt: (_gemm_run(dt, 1), _gemm_run(dt, 9))) for dt in dts]


def _moe_cases():
    from . import moe

    def run(dtype, layout):
        w13 = moe.prepack_moe_weight(torch.zeros(2, 64, 32, dtype=dtype), layout)
        w2 = moe.prepack_moe_weight(torch.zeros(2, 32, 32, dtype=dtype), layout)
        # one token (decode) and 2 x MIN_ROWS tokens on 2 experts (prefill: the vdpbf16ps
        # tiles where the CPU has them, the fma256 tiles where it lacks AVX-512): the two
        # kernel variants where the path differs
        rows = max(moe.DP_MIN_ROWS_PER_EXPERT, moe.PANEL_MIN_ROWS_PER_EXPERT)
        for t_n in (1, max(2, 2 * rows)):
            x = torch.zeros(t_n, 32, dtype=dtype)
            tw, ti = moe.topk_softmax(torch.zeros(t_n, 2), 1, True)
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


# ---------------------------------------------------------------------------------------
# leaves: kernels described by plain values, which helper processes compile (cold start)


def _leaf_quant_blocks(dtype):
    """The quantised GEMMs' block kernel (``quant._kernels.qblocks``: one body for every
    type) with ``dtype`` activations on this CPU's int8 path, compiled by the signature
    ``quant_linear``, the decoder's quantised GEMMs and the quantised MoE call it with
    (compiled on its own it takes 8 s on an Emerald Rapids VM; reached through
    ``quant_linear``'s parallel kernel in a helper process, 20 s: not understood)."""
    from numba import typeof

    from . import _check as C
    from .quant._kernels import new_act, qblocks
    from .simd_int8 import path_witness

    dt = getattr(torch, dtype)
    path = "fp32" if dt == torch.float32 else _isa.quant_path()[0]
    act = new_act(1, 32, path_witness(path))
    i64, f32, u8 = typeof(0), typeof(np.zeros(0, np.float32)), typeof(np.zeros(0, np.uint8))
    ints = (i64,) * 6  # code, m, n, k, the row blocks
    qblocks.compile((typeof(C.WITNESS[dt]), i64, typeof(act), u8, *ints, f32, typeof(False)))


def _leaf_packed_linear(dtype):
    """``weight_packed_linear`` at one row and at nine (the M > 4 tiles)."""
    dt = getattr(torch, dtype)
    _gemm_run(dt, 1)
    _gemm_run(dt, 9)


def _leaf_attention(dtype, isa, head_dim, num_heads, num_kv_heads, block_size):
    """``paged_attention`` of one 3-token prefill and one decode step over a 2-block
    cache of this geometry."""
    from . import attention as A

    dt = getattr(torch, dtype)
    kv = torch.zeros(A.kv_cache_shape(2, num_kv_heads, block_size, head_dim), dtype=dt)
    kc, vc = A.split_kv_cache(kv)
    k = torch.zeros(3, num_kv_heads, head_dim, dtype=dt)
    A.reshape_and_cache(k, k, kc, vc, torch.arange(3), isa)
    bt = torch.zeros(1, 1, dtype=torch.int32)
    for t_n, seq in ((3, 3), (1, 4)):
        q = torch.zeros(t_n, num_heads, head_dim, dtype=dt)
        qsl = torch.tensor([0, t_n], dtype=torch.int32)
        sl = torch.tensor([seq], dtype=torch.int32)
        A.paged_attention(
            q, kc, vc, torch.empty_like(q), qsl, sl, bt, scale=head_dim**-0.5, isa=isa
        )


WORKERS_ENV = "NUMKERN_COMPILE_WORKERS"  # warmup's default workers (1: no helpers)

LEAVES = {
    "quant_blocks": _leaf_quant_blocks,
    "packed_linear": _leaf_packed_linear,
    "attention": _leaf_attention,
}


def _check_leaves(leaves):
    leaves = [tuple(leaf) for leaf in leaves]
    for leaf in leaves:
        if len(leaf) != 2 or leaf[0] not in LEAVES or not isinstance(leaf[1], dict):
            raise ValueError(
                f"leaves: expected (name, {{argument: value}}) pairs with a name of "
                f"{sorted(LEAVES)}, got {leaf!r:.80}"
            )
        try:  # the arguments, here: a helper's failure would be only a warning
            inspect.signature(LEAVES[leaf[0]]).bind(**leaf[1])
        except TypeError as e:
            raise TypeError(f"leaves: {leaf[0]}: {e}") from None
    return leaves


def run_leaves(leaves):
    """Run each ``(name, kwargs)`` of :data:`LEAVES` (a helper process's work)."""
    for name, kw in _check_leaves(leaves):
        LEAVES[name](**kw)


def _helper_main():
    """``python -c 'from numkern.warmup import _helper_main; _helper_main()' JSON``."""
    run_leaves(json.loads(sys.argv[1]))


class _Helpers:
    """Processes that compile ``leaves`` into the disk cache beside the caller's warmup,
    started at its first compilation (a warm start starts none). Each runs every leaf,
    the first from the list's start (put first what the cases reach first), the others
    from their own offsets; the cache's compile locks (``numkern._jit``) make
    one process compile an entry and the others load it, and the caller's cases load
    what a helper compiled first."""

    def __init__(self, leaves, n):
        self.leaves, self.n, self.procs = leaves, n, []

    def start(self):
        if self.procs or not self.leaves or self.n < 1:
            return
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(
            p for p in (root, os.environ.get("PYTHONPATH", "")) if p
        )
        code = "from numkern.warmup import _helper_main; _helper_main()"
        for i in range(self.n):
            j = i * len(self.leaves) // self.n
            order = self.leaves[j:] + self.leaves[:j]
            cmd = [sys.executable, "-c", code, json.dumps(order)]
            out = dict(stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
            self.procs.append(subprocess.Popen(cmd, env=env, **out))

    def finish(self):
        """Wait for the helpers; a failed one is a warning with its stderr's end."""
        for p in self.procs:
            _, err = p.communicate()
            if p.returncode != 0:
                warnings.warn(
                    f"numkern.warmup: a compile helper exited with {p.returncode}:\n{err[-2000:]}",
                    RuntimeWarning,
                    stacklevel=3,
                )
        return len(self.procs)


class Timings(dict):
    """``{case: seconds}``, ``compiled``: how many Numba functions this process compiled
    (0 when every kernel came from the disk cache), ``helpers``: the compile helper
    processes started beside it."""

    compiled = 0
    helpers = 0


class _Compiles(event.Listener):
    """Counts Numba's compilations (a kernel loaded from the disk cache is none) and
    names the caller's function being compiled: a kernel's callees compile inside it,
    and once they are done the kernel's own code generation (most of its time) shows
    under its name again. Numba's own overloads of NumPy and builtins are not named."""

    def __init__(self, show):
        super().__init__()
        self.count = 0
        self._show = show
        self._stack = []

    def _name(self, ev):
        fn = getattr(ev.data.get("dispatcher"), "py_func", None)
        if fn is None or (getattr(fn, "__module__", None) or "numba.").startswith("numba."):
            return None
        return getattr(fn, "__qualname__", fn.__name__).replace("<locals>.", "")

    first = staticmethod(lambda: None)  # called at the first compilation

    def on_start(self, ev):
        if self.count == 0:
            self.first()
        self.count += 1
        name = self._name(ev)
        if name is not None:
            self._stack.append(name)
            self._show(name)

    def on_end(self, ev):
        if self._name(ev) is not None and self._stack:
            self._stack.pop()
            if self._stack:
                self._show(self._stack[-1])


def prepare():
    """Start building Numba's typing and target contexts in a daemon thread; returns it.

    The first kernel a process loads, even from the disk cache, first builds them: ~0.3 s
    of imports and registrations (cProfile, AMD EPYC VM). A caller with other work to do
    first (an engine loading its weights: torch ops, which release the GIL) hides most
    of it. Numba's compiler lock is held meanwhile; a kernel called before it is done
    waits for it. A failure here is left to happen again, with its traceback, where the
    first kernel loads.
    """
    from numba.core.compiler_lock import global_compiler_lock
    from numba.core.registry import cpu_target

    def build():
        try:
            with global_compiler_lock:
                cpu_target.target_context.refresh()  # the typing context's too
        except Exception:  # shown where the first kernel loads (see the docstring)
            pass

    thread = threading.Thread(target=build, name="numkern.warmup.prepare", daemon=True)
    thread.start()
    return thread


REFRESH_S = 1.0  # the bar's clock ticks this often while a case compiles (minutes cold)


class _Progress:
    """The tqdm bar of a warmup on stderr, over its cases, naming the function being
    compiled; its clock ticks while one compiles. Opened at once (``always``) or at the
    first compilation: a warmup that loads everything from the disk cache prints
    nothing."""

    def __init__(self, total, desc, *, always):
        self.total, self.desc = total, desc
        self.bar = None
        self.case, self.done = "", 0
        self._stop = threading.Event()
        self._ticker = None
        if always:
            self._open()

    def _open(self):
        from tqdm import tqdm

        self.bar = tqdm(total=self.total, initial=self.done, desc=self.desc, unit="kernel")
        self._ticker = threading.Thread(target=self._tick, daemon=True)
        self._ticker.start()

    def _tick(self):
        while not self._stop.wait(REFRESH_S):
            self.bar.refresh()

    def start(self, case):
        self.case = case
        if self.bar is not None:
            self.bar.set_postfix_str(case)

    def compiling(self, fn_name):
        if self.bar is None:
            self._open()
        self.bar.set_postfix_str(f"{self.case}: compiling {fn_name}")

    def finish_case(self, seconds, compiled):
        self.done += 1
        if self.bar is not None:
            self.bar.update()

    def close(self, compiled):
        self._stop.set()
        if self.bar is not None:
            self._ticker.join()
            self.bar.set_postfix_str(f"{compiled} compiled" if compiled else "cached")
            self.bar.close()


class _Lines:
    """The warmup's progress where stderr is not a terminal (a log, a pipe): one line per
    case, with its seconds and what it compiled, instead of a bar's ``\\r`` updates; with
    ``always`` False only the cases that compiled something."""

    def __init__(self, total, desc, *, always):
        self.total, self.desc, self.always = total, desc, always
        self.case, self.done, self._before = "", 0, 0

    def start(self, case):
        self.case = case

    def compiling(self, fn_name):
        pass

    def finish_case(self, seconds, compiled):
        self.done += 1
        n, self._before = compiled - self._before, compiled
        if n or self.always:
            what = f"compiled {n} functions" if n else "nothing compiled"
            sys.stderr.write(
                f"{self.desc}: [{self.done}/{self.total}] {self.case}: {seconds:.1f} s ({what})\n"
            )
            sys.stderr.flush()

    def close(self, compiled):
        pass


def _progress(total, desc, progress):
    """The bar on a terminal, else one line per case."""
    kind = _Progress if sys.stderr.isatty() else _Lines
    return kind(total, desc, always=progress is True)


def warmup(
    kinds=KINDS, *, cases=None, progress=True, desc="numkern warmup", leaves=(), workers=None
):
    """Compile (or load from the disk cache) the common variants of ``kinds``, or the
    caller's ``cases``.

    ``cases``: ``(name, fn)`` pairs run in order, ``fn()`` calling the kernels ``name``
    stands for on small inputs of the caller's shapes and dtypes. Returns
    :class:`Timings` (``{name: seconds}``, ``compiled``). ``progress``: a tqdm bar on
    stderr (titled ``desc``) over the cases, naming the Numba function being compiled
    (where stderr is not a terminal: one line per case, its seconds and compilations);
    ``"compiling"``: the same bar, shown only once something compiles (nothing printed
    when every kernel comes from the disk cache); False: none.

    ``leaves``: ``(name, {argument: value})`` pairs of :data:`LEAVES`, kernels the cases
    call inside their own (an engine's decoder calls the quantised linear and the
    attention kernels), which ``workers - 1`` helper processes compile into the disk
    cache beside the cases, started at the first compilation (none on a warm start);
    ``workers``: the processes compiling at once, default ``NUMKERN_COMPILE_WORKERS`` or
    else this process's CPUs. A helper
    that fails is a ``RuntimeWarning`` (the cases compile what they need themselves).
    ``Timings.helpers``: how many were started.
    """
    if cases is None:
        unknown = set(kinds) - set(KINDS)
        if unknown:
            raise ValueError(f"kinds: expected a subset of {KINDS}, got {sorted(unknown)}")
        makers = {"gemm": _gemm_cases, "moe": _moe_cases, "attention": _attention_cases}
        cases = [case for kind in kinds for case in makers[kind]()]
    cases = list(cases)
    for case in cases:
        if not (isinstance(case, tuple) and len(case) == 2 and callable(case[1])):
            raise TypeError(f"cases: expected (name, function) pairs, got {case!r:.80}")
    if progress not in (True, False, "compiling"):
        raise ValueError(f"progress: expected True, False or 'compiling', got {progress!r}")
    name = "workers"
    if workers is None and os.environ.get(WORKERS_ENV):
        name, workers = WORKERS_ENV, os.environ[WORKERS_ENV]
        workers = int(workers) if workers.strip().isdigit() else workers
    if workers is None:
        workers = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 1
    if not isinstance(workers, int) or isinstance(workers, bool) or workers < 1:
        raise ValueError(f"{name}: expected an int >= 1, got {workers!r}")
    helpers = _Helpers(_check_leaves(leaves), min(workers - 1, len(leaves)))
    timings = Timings()
    bar = _progress(len(cases), desc, progress) if progress else None
    listener = _Compiles(bar.compiling if bar is not None else lambda fn_name: None)
    listener.first = helpers.start
    try:
        with event.install_listener("numba:compile", listener):
            for name, fn in cases:
                if bar is not None:
                    bar.start(name)
                t = time.perf_counter()
                fn()
                timings[name] = time.perf_counter() - t
                if bar is not None:
                    bar.finish_case(timings[name], listener.count)
    finally:
        timings.helpers = helpers.finish()
        if bar is not None:
            bar.close(listener.count)
    timings.compiled = listener.count
    return timings
