"""numkern.collective: the shared-memory all-reduce, all-gather and broadcast against
plain torch, with the ranks as threads of this process (the kernels release the GIL, so
they wait for each other as processes do); a dead peer and a timeout named; segments
never shared, unlinked, and a dead creator's segment removed."""

import os
import subprocess
import sys
import threading

import pytest
import torch

from numkern import collective
from numkern.collective import CollectiveError, PeerLost, ShmGroup

pytestmark = pytest.mark.skipif(
    collective.host_identity() is None, reason="no /dev/shm on this host"
)


def _groups(world, slot_bytes=collective.SLOT_BYTES, timeout=20.0):
    first = ShmGroup.create(world, slot_bytes, timeout=timeout)
    rest = [ShmGroup.attach(first.name, world, r, slot_bytes, timeout=timeout)
            for r in range(1, world)]  # fmt: skip
    first.unlink()
    return [first, *rest]


def _on_ranks(groups, fn):
    """``[fn(group) for each rank]``, the ranks on threads at once; a rank's exception
    raised here."""
    out, errors = [None] * len(groups), []

    def run(r):
        try:
            out[r] = fn(groups[r])
        except BaseException as e:  # raised below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(r,)) for r in range(len(groups))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    if errors:
        raise errors[0]
    return out


@pytest.mark.parametrize(
    "world, dtype, shape, slot",
    [
        (2, torch.float32, (1, 2048), collective.SLOT_BYTES),
        (2, torch.bfloat16, (32, 2048), collective.SLOT_BYTES),
        (3, torch.float16, (5, 37), 256),  # chunks of 64 elements, a tail of 17
        (3, torch.float32, (7, 100), 1024),  # 700 elements in chunks of 256
    ],
)
def test_all_reduce_is_the_fp32_sum_rounded_once(world, dtype, shape, slot):
    gen = torch.Generator().manual_seed(world * 100 + len(shape))
    parts = [torch.randn(shape, generator=gen).to(dtype) for _ in range(world)]
    want = sum(p.float() for p in parts).to(dtype)  # rank order, as every rank sums
    groups = _groups(world, slot)
    for _ in range(3):  # the slots' two phases, reused
        got = _on_ranks(groups, lambda g: g.all_reduce(parts[g.rank].clone()))
        for r in range(world):
            assert torch.equal(got[r], want), r


def test_all_gather_and_broadcast():
    world = 3
    parts = [torch.arange(r * 1000, r * 1000 + 12, dtype=torch.int64).reshape(4, 3)
             for r in range(world)]  # fmt: skip
    groups = _groups(world, slot_bytes=64)  # 64 bytes: 2 rows of 24 a call
    got = _on_ranks(groups, lambda g: g.all_gather(parts[g.rank]))
    for r in range(world):
        assert torch.equal(got[r], torch.cat(parts, -1)), r
    message = os.urandom(56)
    got = _on_ranks(groups, lambda g: [g.broadcast(message if g.rank == 1 else None, src=1),
                                       g.broadcast(b"" if g.rank == 0 else None)])  # fmt: skip
    assert got == [[message, b""]] * world
    with pytest.raises(ValueError, match="data: at most 56 bytes, got 57"):
        groups[0].broadcast(b"x" * 57)


def test_a_dead_peer_is_named_and_a_silent_one_times_out():
    done = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)  # fmt: skip
    dead = int(done.stdout)
    g = ShmGroup.create(2, peers=[os.getpid(), dead], timeout=30.0)
    g.unlink()
    with pytest.raises(PeerLost, match=f"^rank 1 \\(pid {dead}\\) has exited"):
        g.all_reduce(torch.ones(4))
    g = ShmGroup.create(2, peers=[os.getpid(), os.getpid()], timeout=0.2)
    g.unlink()
    with pytest.raises(CollectiveError, match=r"all_reduce \(call 1\) timed out after 0.2 s"):
        g.all_reduce(torch.ones(4))
    g.close()
    with pytest.raises(CollectiveError, match="closed"):
        g.all_reduce(torch.ones(4))


def test_segments_are_never_shared_and_dead_creators_are_cleaned(tmp_path):
    a, b = (ShmGroup.create(2, 64, directory=str(tmp_path)) for _ in range(2))
    assert a.name != b.name and a.name.startswith(f"numkern-{os.getpid()}-")
    with pytest.raises(FileExistsError):  # O_EXCL: never an existing file
        ShmGroup(a.path, 2, 0, 64, create=True)
    with pytest.raises(ValueError, match="expected a segment of"):
        ShmGroup.attach(a.name, 3, 1, 64, directory=str(tmp_path))
    with pytest.raises(ValueError, match="name: expected a numkern-"):
        ShmGroup.attach("../etc", 2, 1, directory=str(tmp_path))
    a.unlink()
    assert sorted(os.listdir(tmp_path)) == [b.name]
    stale = tmp_path / "numkern-999999999-0"  # no such pid
    stale.write_bytes(b"")
    assert collective.stale_segments(str(tmp_path)) == [str(stale)]
    c = ShmGroup.create(2, 64, directory=str(tmp_path))
    assert sorted(os.listdir(tmp_path)) == sorted([b.name, c.name])
    for bad, msg in [
        (dict(world=1), "world"),
        (dict(rank=2), "rank"),
        (dict(slot_bytes=65), "slot"),
    ]:
        kw = dict(world=2, rank=0, slot_bytes=64) | bad
        with pytest.raises(ValueError, match=f"^{msg}"):
            ShmGroup(str(tmp_path / "numkern-x"), create=True, **kw)


def test_ranks_whose_sizes_differ_all_refuse_and_stay_in_step():
    groups = _groups(2)
    for op, unit in (("all_reduce", 1), ("all_gather", 4)):  # elements, and bytes of fp32

        def call(g, op=op):
            try:
                getattr(g, op)(torch.ones(1, 8 + g.rank))
            except ValueError as e:
                return str(e)

        got = _on_ranks(groups, call)
        want = f"t: expected the same size on every rank for {op} (call {groups[0].seq}), got "
        assert got == [f"{want}{[8 * unit, 9 * unit]} (by rank)"] * 2, op
    # still in step: a call of one size on both works
    got = _on_ranks(groups, lambda g: g.all_reduce(torch.full((3,), g.rank + 1.0)))
    assert [t.tolist() for t in got] == [[3.0] * 3] * 2
    with pytest.raises(ValueError, match=r"^timeout: expected seconds > 0"):
        ShmGroup.create(2, 64, timeout=0)
