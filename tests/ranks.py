"""Run a function on ``world`` processes joined in a gloo group on loopback (tests of
the engine's tensor / expert parallelism): :func:`run_ranks`."""

import datetime
import multiprocessing
import pickle
import socket
import traceback

from engine.platform import spawn_threads


def free_port():
    """A free TCP port on loopback (bound to port 0, then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(fn, rank, world, port, timeout, args, queue):
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
        try:
            # pickled here: a tensor put as is travels as a shared-memory handle that the
            # parent opens after this process may have exited (FileNotFoundError)
            comm = connect(rank, world, timeout)  # shared memory: the ranks share this host
            queue.put((rank, "ok", pickle.dumps(fn(comm, *args))))
        finally:
            dist.destroy_process_group()
    except BaseException:  # reported to the parent, which raises it
        queue.put((rank, "error", traceback.format_exc()))


def run_ranks(fn, *args, world=2, timeout=10.0, wait=600.0):
    """``[fn(comm, *args) for each rank]``, each on its own spawned process (``fn`` a
    module-level function; its result picklable); an exception on a rank is raised here
    naming the rank, and no process is left behind."""
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_rank_main, args=(fn, r, world, port, timeout, args, queue))
        for r in range(world)
    ]
    with spawn_threads(1):
        for p in procs:
            p.start()
    try:
        got = {}
        for _ in range(world):
            rank, status, value = queue.get(timeout=wait)
            if status == "error":
                raise AssertionError(f"rank {rank} failed:\n{value}")
            got[rank] = pickle.loads(value)
        return [got[r] for r in range(world)]
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join()
