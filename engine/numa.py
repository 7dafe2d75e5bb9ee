"""Tensor-parallel ranks of one host bound to its NUMA nodes (``numa_bind``): the CPUs a
rank's threads may run on, and the node its memory is taken from.

Each rank calls, before it starts a thread pool or reads a weight:

- :func:`topology` -> ``[Node(id, cpus, cores)]``: the host's nodes from sysfs, each
  with the CPUs this process may use (``os.sched_getaffinity``); a node with none is
  left out, and a host without ``/sys/devices/system/node`` is one node.
- :func:`plan` -> a :class:`Plan` ``(node, cpus, prefer_memory)`` or None (not bound):
  the rule below, a pure function of the topology, the rank's place on the host and the
  option.
- :func:`apply`: the plan's CPUs for every thread of the process, and its node as the
  preferred memory node.
- :func:`describe`: the plan as text for the rank's log line.

The rule, with N nodes (those holding CPUs this process may use) and L ranks on this
host. Binding needs L a multiple of N: each node takes ``k = L / N`` ranks in order
(local rank ``r`` on the ``r // k``-th node by id) and its CPUs are cut into ``k``
contiguous parts, one a rank (``r % k``-th). A part is whole physical cores, so that a
core's hyperthreads stay in one rank (Linux numbers them apart: node 0 of a two-socket
server is often ``0-15,32-47``, 32 the sibling of 0); the parts are near-equal, the first
``cores % k`` one core more. A node with fewer cores than its ranks is cut by CPUs in
core order instead. Binding is impossible where L is not a multiple of N (a rank is never
spread over nodes: its memory is preferred from one), where a node has fewer CPUs than
its ranks, or where ``threads_per_rank`` is more than a part's CPUs. The decision is the
same on every rank of the host (every part is checked, not only the rank's own).

- ``"auto"`` (the default): bound on a host of two nodes or more; one node: not bound;
  binding impossible: not bound, and a log line says why.
- ``"on"``: bound, on one node too (each rank pinned to its part of the node; the
  memory policy left alone); impossible: a ValueError naming ``numa_bind`` (or
  ``threads_per_rank``), and where the OS refuses the binding a RuntimeError naming
  ``numa_bind``.
- ``"off"``: never bound.

:func:`apply` pins every existing thread of the process (``/proc/self/task``), so that
pools started later (Numba's, torch's OpenMP workers) inherit the CPUs from whichever
thread starts them, and sets the calling thread's memory policy to ``MPOL_PREFERRED``
for the node (``set_mempolicy``; threads it starts later inherit it): the weights the
rank reads afterwards are first touched, so placed, on its node; threads already running
keep the default policy, which allocates on the node of the CPU they run on (now the
plan's). Where the host has one node the memory policy is left alone.
"""

import ctypes
import errno
import os
from pathlib import Path
from typing import NamedTuple

from .platform import log_once

# the API (``engine.dist`` calls them); ``Node`` and ``Plan`` are what they return and take,
# ``MODES`` and ``check_numa_bind`` the option's values and check (``engine.args``)
__all__ = ["apply", "describe", "plan", "topology"]

MODES = ("auto", "on", "off")
NODE_ROOT = "/sys/devices/system/node"
MPOL_PREFERRED = 1  # include/uapi/linux/mempolicy.h
# set_mempolicy's number: arch/x86/entry/syscalls/syscall_64.tbl (238) and the generic
# table of arm64, include/uapi/asm-generic/unistd.h (237); another machine: ENOSYS
SET_MEMPOLICY = {"x86_64": 238, "aarch64": 237}
# how many times apply lists /proc/self/task: a thread that another thread starts while
# the list is pinned inherits the old CPUs, so apply lists again until no thread is new
PIN_PASSES = 8


class Node(NamedTuple):
    """A NUMA node: its ``id``, the ``cpus`` this process may use on it (sorted), and
    those CPUs grouped by physical core (``cores``, each core's CPUs sorted, ordered by
    their first; empty: unknown, each CPU a core of its own)."""

    id: int
    cpus: tuple
    cores: tuple = ()


class Plan(NamedTuple):
    """A rank's binding: the NUMA ``node``, the ``cpus`` its threads may run on (sorted),
    and whether :func:`apply` prefers the node's memory (``prefer_memory``: a host of
    several nodes)."""

    node: int
    cpus: tuple
    prefer_memory: bool


def check_numa_bind(numa_bind):
    """ValueError naming ``numa_bind`` unless it is one of :data:`MODES`."""
    if not (isinstance(numa_bind, str) and numa_bind in MODES):
        raise ValueError(f"numa_bind: expected one of {MODES}, got {numa_bind!r:.80}")


# -- topology ------------------------------------------------------------------------------


def _parse_cpulist(text, where):
    """The sorted ids of a sysfs list (``"0-3,8-11,16"``; empty: none)."""
    ids = set()
    for item in text.strip().split(",") if text.strip() else ():
        low, dash, high = item.partition("-")
        high = high if dash else low
        if not (low.isdigit() and high.isdigit() and int(low) <= int(high)):
            raise ValueError(f"{where}: expected a list like '0-3,8-11,16', got {text!r:.80}")
        ids.update(range(int(low), int(high) + 1))
    return sorted(ids)


def _allowed():
    """The CPUs this process may run on."""
    if hasattr(os, "sched_getaffinity"):
        return os.sched_getaffinity(0)
    return set(range(os.cpu_count() or 1))


def _cores(node_dir, cpus):
    """``cpus`` grouped by physical core: each CPU with its allowed siblings on the node
    (``cpuN/topology/thread_siblings_list``; a CPU without it: a core of its own)."""
    mine, seen, cores = set(cpus), set(), []
    for cpu in cpus:
        if cpu in seen:
            continue
        path = node_dir / f"cpu{cpu}" / "topology" / "thread_siblings_list"
        siblings = set(_parse_cpulist(path.read_text(), path)) if path.exists() else set()
        core = sorted(((siblings & mine) | {cpu}) - seen)
        seen.update(core)
        cores.append(tuple(core))
    return tuple(cores)


def topology(root=NODE_ROOT, allowed=None):
    """The host's NUMA nodes, a list of :class:`Node` by id: the nodes that ``root``
    (sysfs' node directory) lists as online (``online``; else every ``nodeN``), each
    with its ``cpulist`` cut to ``allowed`` (default: ``os.sched_getaffinity(0)``), and
    its CPUs grouped by core. A node with no allowed CPU is left out; a host without
    ``root``, or whose nodes hold none of the allowed CPUs, is one node (0) holding them
    all."""
    allowed = set(_allowed() if allowed is None else allowed)
    root = Path(root)
    whole = [Node(0, tuple(sorted(allowed)))]
    if not root.is_dir():
        return whole
    online = root / "online"
    if online.exists():
        ids = _parse_cpulist(online.read_text(), online)
    else:
        ids = sorted(int(p.name[4:]) for p in root.glob("node*") if p.name[4:].isdigit())
    nodes = []
    for i in ids:
        path = root / f"node{i}" / "cpulist"
        if not path.exists():
            continue
        cpus = [c for c in _parse_cpulist(path.read_text(), path) if c in allowed]
        if cpus:
            nodes.append(Node(i, tuple(cpus), _cores(root / f"node{i}", cpus)))
    return nodes or whole


# -- the plan ------------------------------------------------------------------------------


def _ranks(n):
    return f"{n} rank" if n == 1 else f"{n} ranks"


def _part(node, j, k):
    """The ``j``-th of ``k`` contiguous, near-equal parts of ``node``'s CPUs: whole cores
    where the node has at least ``k``, else single CPUs in core order."""
    units = node.cores or tuple((c,) for c in node.cpus)
    if len(units) < k:
        units = tuple((c,) for core in units for c in core)
    q, extra = divmod(len(units), k)
    start = j * q + min(j, extra)
    return tuple(sorted(c for core in units[start : start + q + (j < extra)] for c in core))


def _not_bound(numa_bind, why, error=None):
    """Under ``"on"``: ValueError (``error``, else one naming ``numa_bind`` with ``why``).
    Under ``"auto"``: None, and ``why`` logged once."""
    if numa_bind == "on":
        raise ValueError(error or f"numa_bind: expected 'auto' or 'off' here, got 'on': {why}")
    log_once(("numa_bind", why), "NUMA binding: none (numa_bind='auto': %s)", why)
    return None


def plan(topology, local_rank, local_world, numa_bind, threads_per_rank=None):
    """The binding of local rank ``local_rank`` of the ``local_world`` ranks on this host,
    or None (not bound), by the module's rule. ``topology``: :func:`topology`'s list (or
    ``(node id, cpus)`` pairs: each CPU a core); ``numa_bind``: one of :data:`MODES`;
    ``threads_per_rank``: each rank's thread count, None where the ranks share the cores
    (with a plan, a rank's natural count is ``len(plan.cpus)``). A pure function but for
    the log line of ``"auto"``'s refusals; ``"on"``'s are ValueErrors."""
    check_numa_bind(numa_bind)
    if not (local_world >= 1 and 0 <= local_rank < local_world):
        raise ValueError(
            f"local_rank: expected an int in [0, local_world={local_world}) with local_world "
            f">= 1, got {local_rank!r:.40}"
        )
    nodes = [Node(*n) for n in topology]
    if not nodes:
        raise ValueError("topology: expected at least one NUMA node, got none")
    if numa_bind == "off":
        return None
    if numa_bind == "auto" and len(nodes) == 1:
        return _not_bound(numa_bind, "this host has one NUMA node with CPUs this process may use")
    n = len(nodes)
    if local_world % n:
        return _not_bound(
            numa_bind,
            f"{_ranks(local_world)} on this host cannot be spread evenly over {n} NUMA nodes "
            f"(each node takes the same number of ranks: a multiple of {n})",
        )
    k = local_world // n
    for node in nodes:
        if len(node.cpus) < k:
            return _not_bound(
                numa_bind,
                f"NUMA node {node.id} has {len(node.cpus)} CPUs this process may use for its "
                f"{_ranks(k)} (fewer CPUs than ranks)",
            )
    parts = [(node, _part(node, j, k)) for node in nodes for j in range(k)]
    if threads_per_rank is not None:
        node, least = min(parts, key=lambda p: len(p[1]))
        if threads_per_rank > len(least):
            where = f"NUMA node {node.id}: {len(node.cpus)} CPUs for {_ranks(k)}"
            return _not_bound(
                numa_bind,
                f"threads_per_rank={threads_per_rank} is more than the {len(least)} CPUs of "
                f"a rank's part ({where})",
                f"threads_per_rank: expected at most {len(least)} with numa_bind='on' (the "
                f"CPUs of a rank's part; {where}), got {threads_per_rank}",
            )
    node, cpus = parts[local_rank]
    return Plan(node.id, cpus, n > 1)


# -- applying it ---------------------------------------------------------------------------


def _pin(cpus):
    """Every thread of this process on ``cpus``: the calling one first (threads it starts
    inherit them), then each listed in ``/proc/self/task`` until a listing finds no new
    one (a thread started meanwhile by another inherits that one's old CPUs)."""
    if not hasattr(os, "sched_setaffinity"):
        raise OSError(errno.ENOSYS, "not available on this platform")
    os.sched_setaffinity(0, cpus)
    task, done = Path("/proc/self/task"), set()
    for _ in range(PIN_PASSES if task.is_dir() else 0):
        new = {int(t) for t in os.listdir(task)} - done
        if not new:
            break
        for tid in new:
            try:
                os.sched_setaffinity(tid, cpus)
            except ProcessLookupError:  # the thread ended since the listing
                pass
        done |= new


def _prefer(node):
    """``set_mempolicy(MPOL_PREFERRED, {node})`` for the calling thread (and the threads it
    starts later); OSError with the errno where it fails."""
    machine = os.uname().machine
    number = SET_MEMPOLICY.get(machine)
    if number is None:
        raise OSError(errno.ENOSYS, f"no syscall number known for {machine}")
    bits = 8 * ctypes.sizeof(ctypes.c_ulong)
    mask = (ctypes.c_ulong * (node // bits + 1))()
    mask[node // bits] = 1 << (node % bits)
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    # maxnode: the kernel reads maxnode - 1 bits of the mask (libnuma passes its size + 1)
    args = (ctypes.c_long(number), ctypes.c_long(MPOL_PREFERRED), mask)
    if libc.syscall(*args, ctypes.c_ulong(len(mask) * bits + 1)) != 0:
        code = ctypes.get_errno()
        raise OSError(code, os.strerror(code))


def apply(plan, numa_bind):
    """Bind this process to ``plan`` (:func:`plan`'s; None: nothing): every thread on
    ``plan.cpus``, and where ``plan.prefer_memory`` the calling thread's memory preferred
    from ``plan.node`` (module docstring). Where the OS refuses: under ``numa_bind="on"``
    a RuntimeError naming ``numa_bind``; else a log line, and the rest applied. Under
    ``"off"``: nothing."""
    check_numa_bind(numa_bind)
    if plan is None or numa_bind == "off":
        return
    steps = [("sched_setaffinity", _pin, plan.cpus)]
    if plan.prefer_memory:
        steps.append(("set_mempolicy", _prefer, plan.node))
    for name, step, arg in steps:
        try:
            step(arg)
        except OSError as e:
            why = f"{name} for NUMA node {plan.node} failed: {e.strerror or e}"
            if numa_bind == "on":
                raise RuntimeError(f"numa_bind: 'on' could not bind this rank: {why}") from e
            log_once(("numa_bind", why), "NUMA binding: %s (ignored: numa_bind='auto')", why)


def _cpulist(cpus):
    """``cpus`` in sysfs' list syntax: ``(0, 1, 2, 3, 8)`` -> ``"0-3,8"``."""
    runs = []
    for c in sorted(cpus):
        if runs and c == runs[-1][1] + 1:
            runs[-1][1] = c
        else:
            runs.append([c, c])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def describe(plan):
    """``plan`` as text for the rank's log line."""
    if plan is None:
        return "not bound to a NUMA node"
    memory = (
        f"memory preferred from node {plan.node}"
        if plan.prefer_memory
        else "memory policy unchanged (one NUMA node)"
    )
    return f"bound to CPUs {_cpulist(plan.cpus)} of NUMA node {plan.node}, {memory}"
