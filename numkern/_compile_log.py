"""Where compile time goes: one line per Numba compilation, written where a caller asks.

With ``NUMKERN_COMPILE_LOG=<directory>`` in the environment, every process that imports
numkern (the test run's workers, the masked fallback run, child processes, TP ranks)
appends one JSON line per Numba compilation (a cache miss: a kernel loaded from the disk
cache writes nothing) to ``<directory>/<pid>.jsonl``:

``{"fn": module.qualname, "sig": "(array(float32, 1d, C), int64)", "features": ...,
"cpu_s": ..., "wall_s": ..., "tag": ...}``

``cpu_s`` is the compiling thread's CPU time *exclusive* of the functions compiled inside
it (a kernel's callees are compiled in its compilation and get their own lines), so the
lines add up to the process's compile time. ``features`` is the feature string Numba's
code generator targets (``"host"`` unmasked). ``tag`` is ``NUMKERN_COMPILE_TAG`` at the
time (the test suite sets it to the running test's id, and a child process inherits it).

Without the variable nothing is installed: the listener is not a cost of a normal run.
``tests/compile_report.py`` reads the directory and prints the report CI shows.
"""

import json
import os
import threading
import time

ENV = "NUMKERN_COMPILE_LOG"
TAG_ENV = "NUMKERN_COMPILE_TAG"


def _name(dispatcher):
    fn = getattr(dispatcher, "py_func", None)
    if fn is None:
        return repr(dispatcher)
    qual = getattr(fn, "__qualname__", fn.__name__).replace("<locals>.", "")
    return f"{getattr(fn, '__module__', None) or '?'}.{qual}"


def install(directory):
    """Register the listener for this process (idempotent), writing into ``directory``."""
    from numba.core import config, event

    global _installed
    if _installed:
        return
    _installed = True
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, f"{os.getpid()}.jsonl")
    lock = threading.Lock()
    local = threading.local()

    class _Listener(event.Listener):
        def on_start(self, ev):
            stack = local.__dict__.setdefault("stack", [])
            stack.append([time.thread_time(), time.perf_counter(), 0.0, 0.0])

        def on_end(self, ev):
            stack = local.__dict__.get("stack")
            if not stack:
                return
            cpu0, wall0, child_cpu, child_wall = stack.pop()
            cpu = time.thread_time() - cpu0
            wall = time.perf_counter() - wall0
            if stack:  # the caller's time excludes this one
                stack[-1][2] += cpu
                stack[-1][3] += wall
            data = ev.data or {}
            line = {
                "fn": _name(data.get("dispatcher")),
                "sig": "(" + ", ".join(str(a) for a in data.get("args", ())) + ")",
                "features": config.CPU_FEATURES or "host",
                "cpu_s": round(cpu - child_cpu, 4),
                "wall_s": round(wall - child_wall, 4),
                "tag": os.environ.get(TAG_ENV, ""),
            }
            with lock, open(path, "a", encoding="utf-8") as f:
                f.write(json.dumps(line) + "\n")

    event.register("numba:compile", _Listener())


_installed = False


def install_from_env():
    """:func:`install` where ``NUMKERN_COMPILE_LOG`` is set; nothing otherwise."""
    directory = os.environ.get(ENV)
    if directory:
        install(directory)
