"""The engine across processes on ``torch.distributed``: the collectives a step needs
(:class:`Comm`: over shared memory when every rank is on this host, ``numkern.collective``,
else gloo; decided once by :func:`connect`), :data:`LOCAL` (the one process of an unsplit
engine: every collective the identity), and the process runtime of
``LLM(tensor_parallel_size=N)`` (:class:`Runtime`).

Launch. Two ways, decided by :func:`start` from the environment:

- spawn (no ``WORLD_SIZE`` in the environment, ``tensor_parallel_size > 1``): rank 0 is
  the caller's process; it starts ``N - 1`` workers with torch.multiprocessing's spawn
  context (daemonic processes), which join a gloo group on 127.0.0.1 through a TCP store
  that rank 0 hosts on a free port (bound to port 0). A worker that dies before it joins
  is named at once (rank 0 polls the store and the workers' exit codes). As with any
  spawn-mode multiprocessing, a script that makes the LLM guards its top level with
  ``if __name__ == "__main__":``.
- torchrun (``WORLD_SIZE``, ``RANK`` and ``MASTER_ADDR`` set, and ``WORLD_SIZE > 1`` or
  ``tensor_parallel_size > 1``): every process joins the launcher's group
  (``init_process_group("gloo", init_method="env://")``); ``tensor_parallel_size`` must
  equal ``WORLD_SIZE``. Across machines, torchrun's ``--nnodes`` / ``--rdzv-*`` flags.

Each rank builds the same LLM (its part of the model: ``shard``); rank 0 owns the
scheduler, tokenizer, sampling and output. On every other rank ``LLM(...)`` never
returns: it runs :meth:`Runtime.serve`, the worker loop, and ends the process with status
0 when rank 0 closes. Rank 0 sends each command with one :meth:`Comm.broadcast_object`
before running it itself (:meth:`Runtime.command`): ``("execute", chunks, rows)`` (a
step: ``engine.runner.ModelRunner.execute``), ``("warmup",)``, ``("noop",)`` and
``("close",)``.

Keep-alive. A worker waits for the next command in a collective, which times out after
``dist_timeout`` seconds; while rank 0 is idle (between calls, or while a stream's
consumer works), a daemon thread sends ``("noop",)`` every ``dist_timeout / 4`` seconds,
holding the lock that every command holds, so that it never lands inside a step.

Threads. Each rank runs Numba on ``cores // ranks on this host`` threads, or as many as
the fewest CPUs of the ranks' NUMA parts where they are bound (``engine.numa``:
``numa_bind``; a spawned worker binds itself first thing, rank 0 once its workers are
started, a torchrun process before it joins the group); ``threads_per_rank`` overrides.
A spawned worker gets ``NUMBA_NUM_THREADS`` in its environment before it imports Numba;
rank 0 and torchrun's processes call ``numba.set_num_threads`` in each of the engine's
calls (the count is per calling thread). torch stays at the engine's count
(``engine.platform.engine_torch_threads``).

Faults. Every collective times out after ``dist_timeout`` seconds (120 by default); a
shared-memory one also checks, while it waits, that every peer process is alive
(``numkern.collective.PeerLost`` names the rank and pid). A rank that dies makes the
others stop with one line naming it: rank 0 raises
:class:`DistError` (spawn mode: it reads its workers' exit codes, before each command
and when a collective fails; under torchrun, torchrun names the rank it lost), and the
engine is stopped (its workers ended); a worker that loses rank 0 (a failed collective,
or its parent process gone: a watchdog thread polls ``os.getppid()``) writes
``engine rank R: ...`` on stderr and exits with status 1. Ctrl-C: workers ignore SIGINT;
in rank 0 a Ctrl-C during a command (in the main thread) is held until the command ends,
so the ranks stay in step and the engine stays usable (a second Ctrl-C stops it at
once); :meth:`Runtime.close` ends the workers. ``LLM.close()``, ``with LLM(...)`` and
interpreter exit (``weakref.finalize``) close the runtime: ``("close",)`` to the workers,
a wait for them (then terminate, then kill), and the process group destroyed.
"""

import contextlib
import datetime
import os
import pickle
import signal
import sys
import threading
import time

import numba
import numpy as np
import torch

from .platform import log_once, spawn_threads
from .shard import Shard

KEEPALIVE_FRACTION = 0.25  # of dist_timeout: a noop this often while rank 0 is idle
POLL_S = 0.05  # rank 0's poll of the store and its workers while they start
# how long spawned workers may take to start (import torch and the engine), at least: not
# dist_timeout, a collective's limit (3 drivers' workers starting at once on a busy 2-vCPU
# VM took over 10 s); rank 0 names a worker that exits meanwhile at once
START_S = 300.0
WATCHDOG_S = 0.5  # a worker's poll of its parent process
CLOSE_WAIT_S = 10.0  # how long close() waits for a worker to exit before terminating it
DEATH_WAIT_S = 2.0  # after a failed collective, how long to wait for a worker's exit code
TORCHRUN_ENV = ("WORLD_SIZE", "RANK", "MASTER_ADDR")
# bytes of broadcast_object's one broadcast: gloo on loopback took the same time for 1, 4
# and 16 KB (250-270 us median, 2 ranks on a busy 2-vCPU AMD EPYC VM) and a second
# broadcast as much again; a decode step of 8 requests pickles to ~300 bytes, and its
# block table grows by ~3 bytes per block per request
OBJECT_BYTES = 16384


class Comm:
    """The collectives of one rank of a process group (``group``: a
    ``torch.distributed`` group with the gloo backend, or None: the default group), over
    ``shm`` (a ``numkern.collective.ShmGroup``: every rank on this host, see
    :func:`connect`) or else gloo.

    Partial sums are reduced in fp32 and rounded once to the tensor's dtype
    (:meth:`all_reduce`)."""

    def __init__(self, rank, world, group=None, shm=None):
        self.rank, self.world, self.group, self.shm = rank, world, group, shm
        self._buf = None  # broadcast_object's over gloo (made at its first call)

    @property
    def transport(self):
        """``"shm"``, ``"gloo"`` or ``"local"`` (one rank)."""
        return "local" if self.world == 1 else "shm" if self.shm is not None else "gloo"

    def all_reduce(self, t):
        """The sum over the ranks of ``t`` (each rank's partial), in fp32, rounded once to
        ``t``'s dtype, written into ``t`` (a contiguous copy of a strided one) and
        returned."""
        import torch.distributed as dist

        if self.world == 1:
            return t
        if not t.is_contiguous():
            t = t.contiguous()
        if self.shm is not None:
            return self.shm.all_reduce(t)
        f = t.float()  # a copy, whatever t's dtype
        dist.all_reduce(f, group=self.group)
        return t.copy_(f)

    def all_gather(self, t):
        """The ranks' ``t [..., n]`` concatenated along the last dimension, in rank order:
        ``[..., world * n]`` (every rank's ``t`` of one shape)."""
        import torch.distributed as dist

        if self.world == 1:
            return t
        t = t.contiguous()
        if self.shm is not None and t.shape[-1] * t.element_size() <= self.shm.slot:
            return self.shm.all_gather(t)
        parts = [torch.empty_like(t) for _ in range(self.world)]
        dist.all_gather(parts, t, group=self.group)
        return torch.cat(parts, -1)

    def broadcast_object(self, obj=None, src=0):
        """``obj`` of rank ``src`` on every rank (pickled; the others pass None). Over
        shared memory in one call when it fits a slot (an empty message says it did not);
        over gloo one broadcast of OBJECT_BYTES carries the length and an object that fits
        (a step's command), a second one the rest of a larger object."""
        if self.world == 1:
            return obj
        if self.shm is not None:
            data = pickle.dumps(obj) if self.rank == src else None
            fits = data is None or len(data) <= self.shm.slot - 8
            got = self.shm.broadcast(data if fits else b"", src)
            if got:
                return obj if self.rank == src else pickle.loads(got)
        return self._gloo_broadcast(obj, src)

    def _gloo_broadcast(self, obj, src):
        import torch.distributed as dist

        if self._buf is None:
            self._buf = torch.zeros(OBJECT_BYTES, dtype=torch.uint8)
        buf, room = self._buf.numpy(), OBJECT_BYTES - 8
        if self.rank == src:
            data = pickle.dumps(obj)
            buf[:8] = np.frombuffer(len(data).to_bytes(8, "little"), np.uint8)
            head = data[:room]
            buf[8 : 8 + len(head)] = np.frombuffer(head, np.uint8)
        dist.broadcast(self._buf, src, group=self.group)
        n = int.from_bytes(buf[:8].tobytes(), "little")
        if n > room:
            if self.rank == src:
                rest = torch.frombuffer(bytearray(data[room:]), dtype=torch.uint8)
            else:
                rest = torch.empty(n - room, dtype=torch.uint8)
            dist.broadcast(rest, src, group=self.group)
        if self.rank == src:
            return obj
        data = buf[8 : 8 + min(n, room)].tobytes()
        return pickle.loads(data + rest.numpy().tobytes() if n > room else data)


LOCAL = Comm(0, 1)


def connect(rank, world, timeout, collectives="auto"):
    """This rank's :class:`Comm` of the default group, right after every rank joined it
    (each rank calls it at the same point): a shared-memory segment when every rank is on
    this host (``numkern.collective.host_identity``, exchanged over gloo) and
    ``collectives`` is not ``"gloo"``; ``"shm"`` where they are not is a ValueError. Rank
    0 creates the segment, the others map it, and rank 0 unlinks it once all have (or
    one failed: then every rank stays on gloo, logged)."""
    import torch.distributed as dist

    from numkern import collective

    me = (collective.host_identity(), os.getpid())
    everyone = [None] * world
    dist.all_gather_object(everyone, me)
    hosts = {host for host, _ in everyone}
    if collectives == "gloo" or len(hosts) != 1 or None in hosts:
        if collectives == "shm":
            raise ValueError(
                f"collectives: expected every rank on one host with /dev/shm for 'shm', got "
                f"{len(hosts)} host identities (auto falls back to gloo)"
            )
        return Comm(rank, world)
    pids = [pid for _, pid in everyone]
    shm, name, why = None, [None], None
    if rank == 0:
        try:
            shm = collective.ShmGroup.create(world, peers=pids, timeout=timeout)
            name = [shm.name]
        except (OSError, ValueError) as e:  # no room in /dev/shm, more ranks than flags
            why = f"rank 0 could not create it ({_one_line(e)})"
    dist.broadcast_object_list(name, 0)
    if rank != 0 and name[0] is not None:
        try:
            shm = collective.ShmGroup.attach(name[0], world, rank, peers=pids, timeout=timeout)
        except (OSError, ValueError) as e:
            why = f"rank {rank} could not map it ({_one_line(e)})"
    failures = [None] * world
    dist.all_gather_object(failures, why)
    if shm is not None and rank == 0:
        shm.unlink()  # every rank has it mapped (or gave up): no file outlives the group
    failed = [f for f in failures if f is not None] or ([] if name[0] else ["not created"])
    if failed:
        if shm is not None:
            shm.close()
        if collectives == "shm":
            raise ValueError(f"collectives: 'shm' failed: {failed[0]}")
        log_once(("shm", failed[0]), "shared-memory collectives off: %s; gloo", failed[0])
        return Comm(rank, world)
    return Comm(rank, world, shm=shm)


class DistError(RuntimeError):
    """A rank of a tensor-parallel engine failed or was lost; the message names it, and
    the engine is stopped (a new ``LLM`` is needed)."""


def _torchrun_world(tensor_parallel_size):
    """torchrun's world size when this process runs under it with a group to join (or a
    mismatch to refuse), else None."""
    if "WORLD_SIZE" not in os.environ:
        return None
    missing = [k for k in TORCHRUN_ENV if k not in os.environ]
    world = os.environ["WORLD_SIZE"]
    if not world.isdigit() or int(world) < 1:
        raise ValueError(f"WORLD_SIZE: expected an int >= 1 (torchrun's), got {world!r:.40}")
    world = int(world)
    if world == 1 and tensor_parallel_size == 1:
        return None
    if world != tensor_parallel_size:
        raise ValueError(
            f"tensor_parallel_size: expected WORLD_SIZE={world} (torchrun's process count), "
            f"got {tensor_parallel_size}"
        )
    if missing:
        raise ValueError(f"{missing[0]}: expected in the environment with WORLD_SIZE, got none")
    return world


def _threads(threads_per_rank, local_world, plans=()):
    """Numba threads of each rank: ``threads_per_rank``, else the fewest CPUs of the
    ranks' NUMA ``plans`` (``engine.numa``), else this host's cores (Numba's count,
    ``NUMBA_NUM_THREADS``) shared among its ranks; None: an unsplit engine keeps Numba's
    own count."""
    if threads_per_rank is not None:
        return threads_per_rank
    if local_world == 1:
        return None
    bound = [len(p.cpus) for p in plans if p is not None]
    if bound:
        return min(bound)
    return max(1, numba.config.NUMBA_NUM_THREADS // local_world)


def _plans(local_world, numa_bind, threads_per_rank):
    """The NUMA plan of every rank of this host (``engine.numa``: the same topology and
    rule on each)."""
    from . import numa

    topo = numa.topology()
    return [numa.plan(topo, r, local_world, numa_bind, threads_per_rank)
            for r in range(local_world)]  # fmt: skip


def _bind(local_rank, plan, numa_bind):
    """This rank bound by its plan (before its thread pools start and its weights are
    read), and logged."""
    from . import numa

    numa.apply(plan, numa_bind)
    log_once(("numa", local_rank), "local rank %d: %s", local_rank, numa.describe(plan))


def start(args, make):
    """The :class:`Runtime` of this process's rank for ``args`` (an ``engine.args.EngineArgs``,
    checked): one process (``tensor_parallel_size`` 1, no torchrun), torchrun's group
    joined, or rank 0 of a spawned group (workers started, each building ``make(args)``:
    ``engine.llm.LLM`` of ``engine.args.worker_args(args)``; rank 0 builds its own next).
    ValueError for a size that disagrees with torchrun's, before any process starts."""
    from .args import worker_args

    tp, ep, threads = args.tensor_parallel_size, args.enable_expert_parallel, args.threads_per_rank
    world = _torchrun_world(tp)
    if world is not None:
        return Runtime.torchrun(world, ep, args, threads, args.dist_timeout, args.collectives)
    if tp == 1:
        return Runtime(0, 1, Shard(0, 1, ep), _threads(threads, 1))
    return Runtime.spawn(tp, ep, threads, args.dist_timeout, (make, worker_args(args)),
                         _plans(tp, args.numa_bind, threads))  # fmt: skip


def _group_free():
    import torch.distributed as dist

    if dist.is_initialized():
        raise RuntimeError(
            "tensor_parallel_size: this process is already in a torch.distributed group (an "
            "open tensor-parallel LLM?); close() it first"
        )


def _exit_text(code):
    if code is not None and code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit status {code}"


def _is_comm_error(e):
    """Whether ``e`` is a collective's failure (gloo: a peer's connection closed, a
    timeout) rather than this rank's own error."""
    import torch.distributed as dist

    from numkern.collective import CollectiveError

    return isinstance(e, (dist.DistError, DistError, CollectiveError)) or (
        type(e) is RuntimeError and "gloo" in str(e).lower()
    )


def _one_line(e):
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[-1] if text else ''}"


@contextlib.contextmanager
def _sigint_held():
    """In the main thread: a Ctrl-C inside the block is raised when it ends (a second one
    at once). Elsewhere (no signal handler can be set): nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    hits = []

    def hold(signum, frame):
        hits.append(signum)
        if len(hits) > 1:
            raise KeyboardInterrupt

    old = signal.signal(signal.SIGINT, hold)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, old if old is not None else signal.default_int_handler)
    if hits:
        raise KeyboardInterrupt


class Runtime:
    """This process's place among the engine's ranks: ``rank`` of ``world``, its
    :class:`~engine.shard.Shard` and :class:`Comm`, its Numba thread count
    (``numba_threads``; None: Numba's own), and on rank 0 of several the workers and the
    keep-alive (module docstring)."""

    def __init__(
        self, rank, world, shard, numba_threads, *, mode=None, timeout=None, local_world=None
    ):
        self.rank, self.world, self.shard = rank, world, shard
        self.local_world = local_world or world  # the ranks on this host
        # several ranks: gloo until connect() gives the group's transport (start-up only)
        self.comm = LOCAL if world == 1 else Comm(rank, world)
        self.numba_threads = numba_threads
        self.mode = mode  # None (one process), "spawn" or "torchrun"
        self.timeout = timeout
        self.procs = []  # spawn mode, rank 0: the workers (rank r at r - 1)
        self.store = None  # spawn mode, rank 0: the TCP store it hosts
        self.owns_group = False  # the process group is ours to destroy
        self.serving = False  # rank 0: the workers are in their loop
        self.broken = None  # rank 0: why the engine is stopped (a DistError's message)
        self.closed = False
        self.noops = 0  # keep-alives sent
        self._lock = threading.Lock()  # one command on the group at a time
        self._last = time.monotonic()  # the last command sent
        self._stop = threading.Event()
        self._keepalive = None
        if numba_threads is not None:  # set in each of the engine's calls (LLM._torch)
            log_once(
                ("numba_threads", rank, world, numba_threads),
                "rank %d of %d: %d Numba threads (threads_per_rank, or the host's cores "
                "shared among its ranks)",
                rank,
                world,
                numba_threads,
            )

    @property
    def pids(self):
        """The spawned workers' process ids, rank 1 first (empty unless spawn mode)."""
        return tuple(p.pid for p in self.procs)

    # -- launching -----------------------------------------------------------------------

    @classmethod
    def torchrun(cls, world, expert_parallel, args, threads_per_rank, timeout, collectives="auto"):
        import torch.distributed as dist

        rank = int(os.environ["RANK"])
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
        local_rank = int(os.environ.get("LOCAL_RANK", rank % local_world))
        plans = _plans(local_world, args.numa_bind, threads_per_rank)
        _bind(local_rank, plans[local_rank], args.numa_bind)
        rt = cls(rank, world, Shard(rank, world, expert_parallel),
                 _threads(threads_per_rank, local_world, plans), mode="torchrun",
                 timeout=timeout, local_world=local_world)  # fmt: skip
        if not dist.is_initialized():  # a script that joined the group itself keeps it
            dist.init_process_group(
                "gloo", init_method="env://", timeout=datetime.timedelta(seconds=timeout)
            )
            rt.owns_group = True
        if dist.get_world_size() != world or dist.get_rank() != rank:
            raise ValueError(
                f"WORLD_SIZE: expected the process group's size and rank ({dist.get_world_size()}"
                f", {dist.get_rank()}), got ({world}, {rank})"
            )
        rt.comm = connect(rank, world, timeout, collectives)
        return rt

    @classmethod
    def spawn(cls, world, expert_parallel, threads_per_rank, timeout, worker_args, plans):
        import torch.distributed as dist

        _group_free()
        threads = _threads(threads_per_rank, world, plans)
        rt = cls(0, world, Shard(0, world, expert_parallel), threads, mode="spawn", timeout=timeout)
        td = datetime.timedelta(seconds=timeout)
        rt.store = dist.TCPStore("127.0.0.1", 0, world, is_master=True, timeout=td,
                                 wait_for_workers=False)  # fmt: skip
        ctx = torch.multiprocessing.get_context("spawn")
        collectives = worker_args[1].collectives
        settings = (world, rt.store.port, timeout, threads, expert_parallel, os.getpid(),
                    collectives, plans, worker_args[1].numa_bind)  # fmt: skip
        try:
            with spawn_threads(threads):  # read by each worker's Numba import
                for r in range(1, world):
                    p = ctx.Process(target=_worker_main, args=(r, settings, worker_args),
                                    name=f"engine rank {r}", daemon=True)  # fmt: skip
                    p.start()
                    rt.procs.append(p)
            _bind(0, plans[0], worker_args[1].numa_bind)  # the workers bind themselves
        except BaseException:
            rt.close()
            raise
        try:
            rt._wait_joined(time.monotonic() + max(timeout, START_S))
            dist.init_process_group("gloo", store=rt.store, rank=0, world_size=world, timeout=td)
            rt.owns_group = True
            rt.comm = connect(0, world, timeout, collectives)
        except BaseException as e:
            rt.fail(e, "while starting")
        return rt

    def _wait_joined(self, deadline):
        """Until every worker has said it joins (a store key), naming one that exits."""
        keys = [f"joined/{r}" for r in range(1, self.world)]
        while not self.store.check(keys):
            self._check_workers("while starting")
            if time.monotonic() > deadline:
                raise DistError(
                    f"rank 0: the workers did not start within {max(self.timeout, START_S)} s"
                )
            time.sleep(POLL_S)

    # -- rank 0 of several: commands -----------------------------------------------------

    def _check_workers(self, when, wait=0.0):
        """DistError naming the first worker that has exited (spawn mode), waiting up to
        ``wait`` seconds for one to."""
        deadline = time.monotonic() + wait
        while True:
            for r, p in enumerate(self.procs, 1):
                if p.exitcode is not None:
                    raise DistError(
                        f"rank {r} (pid {p.pid}) died {when}: {_exit_text(p.exitcode)}; the "
                        f"tensor-parallel engine is stopped"
                    )
            if time.monotonic() >= deadline:
                return
            time.sleep(POLL_S)

    def fail(self, e, when="during a step"):
        """Raise ``e``, which broke this rank's engine; on rank 0 of several, first stop
        the engine (end the workers), and for a failed collective raise the DistError that
        names the rank lost (or says a collective timed out) instead."""
        if self.world == 1 or self.rank != 0 or self.closed:
            raise e
        err = e if isinstance(e, DistError) else None
        if err is None and _is_comm_error(e):
            from numkern.collective import PeerLost

            try:
                self._check_workers(when, wait=DEATH_WAIT_S if self.procs else 0)
                if isinstance(e, PeerLost):  # it names the rank and its pid
                    raise DistError(f"{e} {when}; the tensor-parallel engine is stopped")
                # under torchrun rank 0 sees no process: of two ranks, the peer is rank 1;
                # of more, torchrun's summary names the one that exited
                peer = "rank 1" if self.world == 2 else "a peer rank"
                err = DistError(
                    f"{peer} was lost {when}: it died, or did not answer within dist_timeout="
                    f"{self.timeout} s (rank 0's collective failed: {_one_line(e)}); the "
                    f"tensor-parallel engine is stopped"
                )
            except DistError as found:
                err = found
        self.broken = str(err) if err is not None else f"stopped by {_one_line(e)}"
        self.close()
        if err is None or err is e:
            raise e
        raise err from e

    def agree(self, what, values):
        """RuntimeError unless every rank has the same ``values`` (ints), e.g. its KV
        blocks: the scheduler is rank 0's."""
        if self.world == 1:
            return
        got = self.comm.all_gather(torch.tensor([values], dtype=torch.int64))
        got = got.reshape(self.world, len(values))
        if not bool((got == got[0]).all()):
            raise RuntimeError(f"the ranks' {what} differ (rank by rank): {got.tolist()}")

    def begin_serving(self):
        """Rank 0, once its LLM is built: the workers are in their loop; the keep-alive
        starts."""
        self.serving = True
        self._last = time.monotonic()
        self._keepalive = threading.Thread(
            target=self._keep_alive, name="engine keep-alive", daemon=True
        )
        self._keepalive.start()

    @contextlib.contextmanager
    def command(self, *msg):
        """Rank 0 of several: ``msg`` sent to every worker, then the block, which runs the
        same command here (the lock held, Ctrl-C held: module docstring). A failure stops
        the engine and raises :class:`DistError` naming the rank. Elsewhere: the block."""
        if self.world == 1 or self.rank != 0:
            yield
            return
        with self._lock, _sigint_held():  # a held Ctrl-C is raised after the command
            if self.broken or self.closed:
                self.close()
                raise DistError(self.broken or "LLM: closed (its worker processes have ended)")
            try:
                self._check_workers("before a step")
                self.comm.broadcast_object(msg)
                yield
                self._last = time.monotonic()
            except BaseException as e:
                self.fail(e)

    def _keep_alive(self):
        interval = KEEPALIVE_FRACTION * self.timeout
        while not self._stop.wait(interval / 4):
            if time.monotonic() - self._last < interval or not self._lock.acquire(blocking=False):
                continue
            try:
                if self.broken or self.closed:
                    return
                self._check_workers("while idle")
                self.comm.broadcast_object(("noop",))
                self._last = time.monotonic()
                self.noops += 1
            except BaseException as e:  # the next command raises it
                self.broken = str(e) if isinstance(e, DistError) else (
                    f"rank 0: a keep-alive failed ({_one_line(e)}); the tensor-parallel "
                    f"engine is stopped")  # fmt: skip
            finally:
                self._lock.release()
            if self.broken:
                self.close()  # the other workers end now, not at exit
                return

    def close(self):
        """End the workers (``("close",)``, a wait, then terminate and kill) and destroy the
        process group. Idempotent; also what interpreter exit runs."""
        import torch.distributed as dist

        if self.closed:
            return
        self.closed = True
        self._stop.set()
        if self._keepalive is not None and self._keepalive is not threading.current_thread():
            self._keepalive.join(timeout=self.timeout)
        clean = False
        if self.serving and not self.broken and self._lock.acquire(timeout=self.timeout):
            try:
                self.comm.broadcast_object(("close",))
                clean = True
            except BaseException:  # a worker already gone: ended below
                pass
            finally:
                self._lock.release()
        for p in self.procs:
            p.join(timeout=CLOSE_WAIT_S if clean else 0.5)
            if p.is_alive():
                p.terminate()
                p.join(timeout=2)
            if p.is_alive():
                p.kill()
                p.join()
        if self.comm.shm is not None:
            self.comm.shm.close()
        if self.owns_group and dist.is_initialized():
            dist.destroy_process_group()
        self.owns_group = False
        self.store = None

    # -- the other ranks -----------------------------------------------------------------

    def serve(self, llm):
        """The worker loop of a rank other than 0: rank 0's commands run on ``llm`` until
        ``("close",)``, then the process exits with status 0 (SystemExit). A failure is
        one line on stderr and exit status 1."""
        import torch.distributed as dist

        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGINT, signal.SIG_IGN)  # rank 0's Ctrl-C ends us
        _watch_parent(self.rank)
        while True:
            try:
                msg = self.comm.broadcast_object(None)
            except BaseException as e:
                who = "rank 0" if self.world == 2 else "rank 0 or a peer rank"
                _die(self.rank, f"lost {who} ({_one_line(e)})")
            try:
                if msg[0] == "execute":
                    with llm._torch():
                        llm.runner.execute(*msg[1:])
                elif msg[0] == "warmup":
                    llm.warmup(progress=False)
                elif msg[0] == "close":
                    break
            except BaseException as e:
                _die(self.rank, f"{msg[0]} failed: {_one_line(e)}")
        if self.comm.shm is not None:
            self.comm.shm.close()
        if self.owns_group:
            dist.destroy_process_group()
        raise SystemExit(0)


def _die(rank, why):
    """A worker's end after a failure: one line on stderr, exit status 1 (no Python
    teardown: a collective of the lost group could hang in it)."""
    sys.stderr.write(f"engine rank {rank}: {why}\n")
    sys.stderr.flush()
    os._exit(1)


def _watch_parent(rank):
    """A daemon thread that ends this worker when its parent process (rank 0 in spawn
    mode, torchrun's agent) is gone."""
    parent = os.getppid()

    def watch():
        while True:
            time.sleep(WATCHDOG_S)
            if os.getppid() != parent:
                _die(rank, f"its parent process (pid {parent}) is gone")

    threading.Thread(target=watch, name="engine parent watchdog", daemon=True).start()


def _worker_main(rank, settings, worker_args):
    """A spawned worker: join rank 0's group, build the same LLM (which serves)."""
    import torch.distributed as dist

    world, port, timeout, threads, expert_parallel, parent, collectives, plans, numa_bind = settings
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if os.getppid() != parent:  # rank 0 died before we started
        _die(rank, f"its parent process (pid {parent}) is gone")
    _watch_parent(rank)
    try:
        _bind(rank, plans[rank], numa_bind)
        td = datetime.timedelta(seconds=timeout)
        store = dist.TCPStore("127.0.0.1", port, world, is_master=False, timeout=td)
        store.set(f"joined/{rank}", str(os.getpid()))
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=td)
        rt = Runtime(rank, world, Shard(rank, world, expert_parallel), threads,
                     mode="spawn", timeout=timeout)  # fmt: skip
        rt.owns_group = True
        rt.comm = connect(rank, world, timeout, collectives)
        make, args = worker_args  # engine.llm.LLM (pickled by name: no import circle)
        make(args, _runtime=rt)  # serves rank 0's commands, then SystemExit(0)
    except SystemExit:
        raise
    except BaseException as e:
        _die(rank, _one_line(e))
