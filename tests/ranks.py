"""Run a function on ``world`` processes joined in a gloo group on loopback, with the
engine's shared-memory collectives where they share this host (tests of the engine's
tensor / expert parallelism): :func:`run_ranks`, whose processes serve every call of
the test process."""

import atexit
import datetime
import multiprocessing
import os
import pickle
import queue
import socket
import traceback

from engine.platform import spawn_threads


def free_port():
    """A free TCP port on loopback (bound to port 0, then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank, world, port, timeout, jobs, results):
    """A rank of the pair: join the group (shared memory: the ranks share this host), then
    run each job ``(fn, args)`` from ``jobs`` until None."""
    import torch.distributed as dist

    from engine.dist import connect

    try:
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world,
            timeout=datetime.timedelta(seconds=timeout),
        )
        comm = connect(rank, world, timeout)
    except BaseException:  # reported to the parent, which raises it
        results.put((rank, "error", traceback.format_exc()))
        return
    parent = os.getppid()
    try:
        while True:
            try:
                job = jobs.get(timeout=1.0)
            except queue.Empty:
                if os.getppid() != parent:  # the test process is gone: so are its jobs
                    return
                continue
            if job is None:
                return
            fn, args = job
            try:
                # pickled here: a tensor put as is travels as a shared-memory handle that
                # the parent opens after this process may have exited (FileNotFoundError)
                results.put((rank, "ok", pickle.dumps(fn(comm, *args))))
            except BaseException:  # reported to the parent, which raises it
                results.put((rank, "error", traceback.format_exc()))
    finally:
        if comm.shm is not None:
            comm.shm.close()
        dist.destroy_process_group()


class _Ranks:
    """``world`` spawned processes in one gloo group (and shared-memory segment), running
    the jobs :func:`run_ranks` hands them, until :meth:`close`."""

    def __init__(self, world, timeout):
        ctx = multiprocessing.get_context("spawn")
        self.results = ctx.Queue()
        self.jobs = [ctx.Queue() for _ in range(world)]
        port = free_port()
        self.procs = [ctx.Process(target=_rank_main,
                                  args=(r, world, port, timeout, self.jobs[r], self.results))
                      for r in range(world)]  # fmt: skip
        with spawn_threads(1):
            for p in self.procs:
                p.start()

    def alive(self):
        return all(p.is_alive() for p in self.procs)

    def run(self, fn, args, wait):
        for q in self.jobs:
            q.put((fn, args))
        got = {}
        for _ in self.procs:
            rank, status, value = self.results.get(timeout=wait)
            if status == "error":
                raise AssertionError(f"rank {rank} failed:\n{value}")
            got[rank] = pickle.loads(value)
        return [got[r] for r in range(len(self.procs))]

    def close(self):
        for q in self.jobs:
            q.put(None)
        for p in self.procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join()


_pairs = {}  # (world, timeout) -> the _Ranks this process keeps for the next call


def run_ranks(fn, *args, world=2, timeout=10.0, wait=600.0):
    """``[fn(comm, *args) for each rank]``, each on its own spawned process (``fn`` a
    module-level function; its result picklable), over the engine's transport between
    them (``engine.dist.connect``). The processes stay for the next call of this process
    with the same ``world`` and ``timeout`` (one pair serves every TP test of a test
    process: started, and their modules imported, once); an exception on a rank is
    raised here naming the rank, and that pair is ended (its ranks may be out of step).
    No process is left behind at exit."""
    key = (world, timeout)
    ranks = _pairs.pop(key, None)
    if ranks is None or not ranks.alive():
        if ranks is not None:
            ranks.close()
        ranks = _Ranks(world, timeout)
    try:
        out = ranks.run(fn, args, wait)
    except BaseException:
        ranks.close()
        raise
    _pairs[key] = ranks
    return out


@atexit.register
def _close_all():
    while _pairs:
        _pairs.popitem()[1].close()
