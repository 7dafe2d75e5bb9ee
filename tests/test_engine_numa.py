"""engine.numa: ranks bound to NUMA nodes. The topology is read from fake sysfs trees in
tmp_path with the allowed CPUs passed in (nothing here depends on the host's nodes); the
plans are checked on a simulated two-node host (node 0: CPUs 0-1, node 1: 2-3) for
auto / on / off and 1-4 ranks, and on one-node and uneven hosts; applying a plan runs in
a child process on this host (it changes the process's CPUs and memory policy)."""

import json
import logging
import os
import subprocess
import sys

import pytest

from engine import numa, platform
from engine.numa import Plan

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TWO = [(0, (0, 1)), (1, (2, 3))]  # the simulated two-node host: (node id, cpus)
ANY = range(64)  # allowed CPUs that cut nothing from the trees below


def _tree(root, cpulists, online=None, siblings=()):
    """A fake ``/sys/devices/system/node`` under ``root``: ``nodeN/cpulist`` for each
    ``{N: text}``, ``online`` when given, and each ``(cpu, node, text)`` of ``siblings``
    as ``nodeN/cpuC/topology/thread_siblings_list``."""
    for node, text in cpulists.items():
        (root / f"node{node}").mkdir(parents=True)
        (root / f"node{node}" / "cpulist").write_text(text + "\n")
    if online is not None:
        (root / "online").write_text(online + "\n")
    for cpu, node, text in siblings:
        (root / f"node{node}" / f"cpu{cpu}" / "topology").mkdir(parents=True)
        (root / f"node{node}" / f"cpu{cpu}" / "topology" / "thread_siblings_list").write_text(
            text + "\n"
        )
    return root


def _pairs(nodes):
    return [(n.id, n.cpus) for n in nodes]


def _plans(topology, local_world, mode, threads_per_rank=None):
    return [numa.plan(topology, r, local_world, mode, threads_per_rank) for r in range(local_world)]


@pytest.fixture
def logged(caplog, monkeypatch):
    """The engine's log messages of this test (log_once's memory emptied first)."""
    monkeypatch.setattr(platform, "_logged", set())
    caplog.set_level(logging.INFO, logger="engine")
    return lambda: [r.getMessage() for r in caplog.records]


# -- topology ------------------------------------------------------------------------------


def test_cpulists_parsed(tmp_path):
    root = _tree(tmp_path, {0: "0-3,8-11,16", 1: "4-7,12-15", 2: ""}, online="0-2")
    nodes = numa.topology(root, ANY)
    # node 2 has memory and no CPU (an empty cpulist): left out
    assert _pairs(nodes) == [(0, (0, 1, 2, 3, 8, 9, 10, 11, 16)), (1, (4, 5, 6, 7, 12, 13, 14, 15))]
    # no sibling lists: each CPU a core of its own
    assert nodes[1].cores == tuple((c,) for c in nodes[1].cpus)


def test_online_nodes_only(tmp_path):
    """``online`` decides which nodes count; without it every ``nodeN`` directory does."""
    _tree(tmp_path / "a", {0: "0-1", 1: "2-3", 3: "6-7"}, online="0-1")
    assert _pairs(numa.topology(tmp_path / "a", ANY)) == TWO
    _tree(tmp_path / "b", {1: "2-3", 0: "0-1", 10: "9"})
    assert _pairs(numa.topology(tmp_path / "b", ANY)) == [*TWO, (10, (9,))]


@pytest.mark.parametrize("text", ["0-", "3-1", "a", "0,,2", "1-2-3"])
def test_bad_cpulist_named(tmp_path, text):
    _tree(tmp_path, {0: text}, online="0")
    with pytest.raises(ValueError, match=r"node0/cpulist: expected a list like '0-3,8-11,16'"):
        numa.topology(tmp_path, ANY)


def test_cut_to_the_allowed_cpus(tmp_path):
    root = _tree(tmp_path, {0: "0-3,8-11", 1: "4-7,12-15"}, online="0-1")
    assert _pairs(numa.topology(root, {1, 2, 9, 12})) == [(0, (1, 2, 9)), (1, (12,))]
    # a node without an allowed CPU is left out
    assert _pairs(numa.topology(root, {4, 5})) == [(1, (4, 5))]
    # allowed CPUs no node lists (a stale tree): one node holding them
    assert _pairs(numa.topology(root, {40, 41})) == [(0, (40, 41))]


def test_host_without_nodes_is_one_node(tmp_path):
    assert _pairs(numa.topology(tmp_path / "absent", {0, 5})) == [(0, (0, 5))]
    allowed = tuple(sorted(os.sched_getaffinity(0)))
    assert _pairs(numa.topology(tmp_path / "absent")) == [(0, allowed)]


def test_cores_from_sibling_lists(tmp_path):
    """Hyperthreads numbered apart (8 the sibling of 0): two ranks on the node get two
    cores each with their siblings, not 0-3 against their siblings 8-11."""
    pairs = [(c, 0, f"{c % 8},{c % 8 + 8}") for c in (*range(4), *range(8, 12))]
    root = _tree(tmp_path, {0: "0-3,8-11"}, online="0", siblings=pairs)
    (node,) = numa.topology(root, ANY)
    assert node.cores == ((0, 8), (1, 9), (2, 10), (3, 11))
    assert _plans([node], 2, "on") == [Plan(0, (0, 1, 8, 9), False), Plan(0, (2, 3, 10, 11), False)]
    # three ranks: near-equal parts of whole cores, the first one core more
    assert [p.cpus for p in _plans([node], 3, "on")] == [(0, 1, 8, 9), (2, 10), (3, 11)]
    # fewer cores than ranks: cut by CPUs in core order
    assert [p.cpus for p in _plans([node], 6, "on")] == [(0, 8), (1, 9), (2,), (10,), (3,), (11,)]
    # a sibling not allowed is not in the core
    (cut,) = numa.topology(root, {0, 1, 9})
    assert cut.cores == ((0,), (1, 9))
    # without sibling lists: contiguous parts of the CPUs
    bare = numa.topology(_tree(tmp_path / "bare", {0: "0-3,8-11"}, online="0"), ANY)
    assert [p.cpus for p in _plans(bare, 2, "on")] == [(0, 1, 2, 3), (8, 9, 10, 11)]


# -- plans ---------------------------------------------------------------------------------

SPREAD = "cannot be spread evenly over 2 NUMA nodes"
REFUSED = "^numa_bind: expected 'auto' or 'off' here, got 'on': "
PER_CPU = [Plan(0, (0,), True), Plan(0, (1,), True), Plan(1, (2,), True), Plan(1, (3,), True)]


@pytest.mark.parametrize(
    "mode, local_world, want",
    [
        ("auto", 1, [None]),  # one rank on two nodes: not bound
        ("auto", 2, [Plan(0, (0, 1), True), Plan(1, (2, 3), True)]),
        ("auto", 3, [None] * 3),
        ("auto", 4, PER_CPU),
        ("on", 1, REFUSED + "1 rank on this host " + SPREAD),
        ("on", 2, [Plan(0, (0, 1), True), Plan(1, (2, 3), True)]),
        ("on", 3, REFUSED + "3 ranks on this host " + SPREAD),
        ("on", 4, PER_CPU),
        ("off", 2, [None, None]),
        ("off", 3, [None] * 3),
    ],
)
def test_two_node_host(mode, local_world, want):
    if isinstance(want, str):
        for r in range(local_world):
            with pytest.raises(ValueError, match=want):
                numa.plan(TWO, r, local_world, mode)
    else:
        assert _plans(TWO, local_world, mode) == want


def test_auto_says_why_it_does_not_bind(logged):
    assert _plans(TWO, 3, "auto") == [None] * 3
    assert _plans(TWO, 8, "auto") == [None] * 8  # 4 ranks a node, 2 CPUs each
    msgs = logged()
    assert msgs == [  # once each, not once per rank
        f"NUMA binding: none (numa_bind='auto': 3 ranks on this host {SPREAD} (each node "
        "takes the same number of ranks: a multiple of 2))",
        "NUMA binding: none (numa_bind='auto': NUMA node 0 has 2 CPUs this process may use "
        "for its 4 ranks (fewer CPUs than ranks))",
    ]
    assert numa.plan(TWO, 0, 2, "off") is None and len(logged()) == 2  # off: nothing said


def test_one_node_host(logged):
    one = [(0, (0, 1, 2, 3))]
    assert _plans(one, 2, "auto") == [None, None]
    assert logged() == [
        "NUMA binding: none (numa_bind='auto': this host has one NUMA node with CPUs this "
        "process may use)"
    ]
    # on: each rank pinned to its part; no memory policy on one node
    assert _plans(one, 2, "on") == [Plan(0, (0, 1), False), Plan(0, (2, 3), False)]
    assert _plans(one, 1, "on") == [Plan(0, (0, 1, 2, 3), False)]
    assert [p.cpus for p in _plans(one, 3, "on")] == [(0, 1), (2,), (3,)]
    with pytest.raises(ValueError, match=REFUSED + r"NUMA node 0 has 4 CPUs .* for its 5 ranks"):
        numa.plan(one, 0, 5, "on")


def test_threads_per_rank_within_a_part(logged):
    assert _plans(TWO, 2, "on", threads_per_rank=2) == _plans(TWO, 2, "on")
    want = (
        r"^threads_per_rank: expected at most 2 with numa_bind='on' \(the CPUs of a rank's "
        r"part; NUMA node 0: 2 CPUs for 1 rank\), got 3$"
    )
    with pytest.raises(ValueError, match=want):
        numa.plan(TWO, 1, 2, "on", threads_per_rank=3)
    assert _plans(TWO, 2, "auto", threads_per_rank=3) == [None, None]
    assert logged() == [
        "NUMA binding: none (numa_bind='auto': threads_per_rank=3 is more than the 2 CPUs "
        "of a rank's part (NUMA node 0: 2 CPUs for 1 rank))"
    ]
    assert numa.plan(TWO, 0, 2, "off", threads_per_rank=3) is None


def test_uneven_nodes_decide_alike_on_every_rank():
    """Node 0 holds 3 CPUs, node 1 five (a cpuset): 2 ranks a node, the parts near-equal;
    threads_per_rank is checked against the smallest part, so every rank decides alike."""
    uneven = [(0, (0, 1, 2)), (1, (3, 4, 5, 6, 7))]
    parts = [p.cpus for p in _plans(uneven, 4, "on", threads_per_rank=1)]
    assert parts == [(0, 1), (2,), (3, 4, 5), (6, 7)]
    for r in range(4):
        with pytest.raises(ValueError, match=r"^threads_per_rank: expected at most 1 "):
            numa.plan(uneven, r, 4, "on", threads_per_rank=2)


def test_arguments_checked():
    with pytest.raises(ValueError, match=r"^numa_bind: expected one of \('auto', 'on', 'off'\)"):
        numa.plan(TWO, 0, 2, "yes")
    with pytest.raises(ValueError, match=r"^local_rank: expected an int in \[0, local_world=2\)"):
        numa.plan(TWO, 2, 2, "on")
    with pytest.raises(ValueError, match=r"^topology: expected at least one NUMA node"):
        numa.plan([], 0, 1, "on")
    with pytest.raises(ValueError, match=r"^numa_bind: expected one of"):
        numa.apply(None, "ON")
    numa.apply(None, "on")  # no plan: nothing to do


def test_describe():
    assert numa.describe(None) == "not bound to a NUMA node"
    assert numa.describe(Plan(1, (2, 3, 4, 8, 10, 11), True)) == (
        "bound to CPUs 2-4,8,10-11 of NUMA node 1, memory preferred from node 1"
    )
    assert numa.describe(Plan(0, (1,), False)) == (
        "bound to CPUs 1 of NUMA node 0, memory policy unchanged (one NUMA node)"
    )


# -- applying a plan (child processes: they change the process's CPUs and memory policy) --

# a thread started before apply, one after, a Numba parallel region and a torch pool run
# after: every thread of the process ends up on the plan's CPU
PIN = """
import json, os, sys, threading
from engine import numa
import numba, torch

cpu = int(sys.argv[1])
node = next(n.id for n in numa.topology() if cpu in n.cpus)
go, seen = threading.Event(), {}

def wait():
    go.wait()
    seen.update(before=sorted(os.sched_getaffinity(0)))

before = threading.Thread(target=wait)
before.start()
tasks = len(os.listdir("/proc/self/task"))
numa.apply(numa.Plan(node, (cpu,), False), "on")
go.set(); before.join()
after = threading.Thread(target=lambda: seen.update(after=sorted(os.sched_getaffinity(0))))
after.start(); after.join()

@numba.njit(parallel=True)
def total(n):
    s = 0.0
    for i in numba.prange(n):
        s += i
    return s

numba.set_num_threads(numba.config.NUMBA_NUM_THREADS)
total(100000)
torch.set_num_threads(2)
torch.ones(256, 256) @ torch.ones(256, 256)
every = {t: sorted(os.sched_getaffinity(int(t))) for t in os.listdir("/proc/self/task")}
print(json.dumps(dict(main=sorted(os.sched_getaffinity(0)), tasks=tasks, every=every, **seen)))
"""

# the memory policy read back (get_mempolicy), and the OS refusing a plan: a node that is
# not there, a CPU that is not there
MEMORY = """
import ctypes, json, logging, os, sys
from engine import numa

logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(message)s")
cpu = int(sys.argv[1])
node = next(n.id for n in numa.topology() if cpu in n.cpus)
out = {}
try:
    numa.apply(numa.Plan(node, (cpu,), True), "on")
    libc = ctypes.CDLL(None, use_errno=True)
    mode, mask = ctypes.c_int(-1), (ctypes.c_ulong * 16)()
    number = {"x86_64": 239, "aarch64": 236}[os.uname().machine]  # get_mempolicy
    libc.syscall(ctypes.c_long(number), ctypes.byref(mode), mask, ctypes.c_ulong(1025),
                 None, ctypes.c_ulong(0))
    out["policy"] = [mode.value, [i for i in range(1024) if mask[i // 64] >> (i % 64) & 1]]
except RuntimeError as e:
    out["policy"] = str(e)
for name, plan, mode in [("node_on", numa.Plan(1000, (cpu,), True), "on"),
                         ("cpu_on", numa.Plan(node, (4095,), False), "on"),
                         ("node_auto", numa.Plan(1000, (cpu,), True), "auto")]:
    try:
        numa.apply(plan, mode)
        out[name] = sorted(os.sched_getaffinity(0))
    except RuntimeError as e:
        out[name] = str(e)
print(json.dumps(out))
"""


def _child(code, cpu):
    env = dict(os.environ, PYTHONPATH=ROOT)
    run = subprocess.run(
        [sys.executable, "-c", code, str(cpu)], cwd=ROOT, env=env, capture_output=True,
        text=True, timeout=600,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.splitlines()[-1]), run.stderr


def test_apply_pins_every_thread():
    cpu = max(os.sched_getaffinity(0))
    got, _ = _child(PIN, cpu)
    assert got["main"] == got["before"] == got["after"] == [cpu]
    assert len(got["every"]) > got["tasks"]  # Numba's and torch's pools started after
    assert all(cpus == [cpu] for cpus in got["every"].values()), got["every"]


@pytest.mark.skipif(os.uname().machine not in numa.SET_MEMPOLICY, reason="no syscall number")
def test_apply_prefers_the_node_and_names_refusals():
    cpu = max(os.sched_getaffinity(0))
    got, stderr = _child(MEMORY, cpu)
    if "Operation not permitted" in str(got["policy"]):
        pytest.skip(f"set_mempolicy refused here (a seccomp filter?): {got['policy']}")
    node = next(n.id for n in numa.topology() if cpu in n.cpus)
    assert got["policy"] == [numa.MPOL_PREFERRED, [node]]
    assert got["node_on"] == (
        "numa_bind: 'on' could not bind this rank: set_mempolicy for NUMA node 1000 failed: "
        "Invalid argument"
    )
    assert got["cpu_on"] == (
        f"numa_bind: 'on' could not bind this rank: sched_setaffinity for NUMA node {node} "
        "failed: Invalid argument"
    )
    # auto: the refusal logged, the CPUs applied
    assert got["node_auto"] == [cpu]
    assert "NUMA binding: set_mempolicy for NUMA node 1000 failed" in stderr
