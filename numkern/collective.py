"""Collectives of the processes of one host over a shared-memory segment: an all-reduce
(fp32 sums), an all-gather and a broadcast of bytes, each a Numba kernel over the
segment with one flag per rank (no Python per element), for tensor-parallel ranks on one
machine (``engine.dist``; vLLM's and SGLang's CPU backends do the same).

Segment. A file in ``/dev/shm`` named ``numkern-<creator pid>-<random>`` (created with
``O_EXCL``: two groups never share one), mapped by every rank of the group and unlinked
by the creator as soon as every rank has mapped it (:meth:`ShmGroup.unlink`): after
that no file outlives the processes, however they end. A creator also unlinks the
entries of dead creators it finds (a process killed between creating and unlinking).
Layout: a 4096-byte header (rank r's flag: the int64 at byte ``64 (r + 1)``, a cache
line of its own), then 2 x ``world`` slots of ``slot`` bytes: call ``seq`` uses rank r's
slot ``(seq & 1) world + r``.

Protocol. Every rank makes the same calls in the same order, numbered 1, 2, ... (the
group counts them). Rank r's flag = k says: its part of call k is in its slot, and it
has read everything of call k - 1. A rank writes its slot of call k once every flag is
>= k - 1 (nobody still reads call k - 2, the last call on those slots), writes its size
of the call beside its flag, then sets its flag to k (a release store; flags are read
with acquire loads); ranks whose sizes differ all raise a ValueError (nothing summed).
All-reduce: once every flag is >= k, each rank sums the slots in rank order (fp32;
every rank gets the same bits) and rounds once to the tensor's dtype, in place.
All-gather: each rank copies the slots in rank order. Broadcast: the source writes its
bytes; each other rank reads them once the source's flag is k, then sets its own flag to
k.

Waiting. A wait polls the flags with ``pause`` for :data:`SPINS` polls, then with
``sched_yield`` for :data:`YIELDS` (ranks may share cores with other processes), then
returns to Python, which checks that every peer process is alive (:class:`PeerLost`
names a dead one) and the deadline (``timeout`` seconds: :class:`CollectiveError`),
sleeps 50 us (doubling up to 1 ms, and 10 ms once the wait has lasted a second: an idle
rank costs next to no CPU) and polls again.

Sizes: a call moves at most ``slot`` bytes a rank (fp32 for the all-reduce); larger
tensors go in several calls. ``ShmGroup(world, slot_bytes=...)`` sizes the slots.
"""

import contextlib
import mmap
import os
import platform
import secrets
import socket
import time

import numpy as np
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from . import _check
from ._jit import jit
from ._ptr import view
from .simd import atomic_load, atomic_store, store_f32, to_f32, vadd, vload, vstore

SHM_DIR = "/dev/shm"
PREFIX = "numkern-"
HEADER = 4096
LINE = 64  # bytes between two ranks' flags
MAX_WORLD = HEADER // LINE - 1
SLOT_BYTES = 4 << 20  # a rank's part of one call (fp32 for the all-reduce)
# pause-polls before yielding (23 us on the Emerald Rapids VM), then sched_yield-polls
# before Python checks the peers (2.4 ms there with nothing else runnable): a rank's wait
# for its peer in a step, and a worker's wait for the next step's command, end in them
SPINS = 2000
YIELDS = 16000
# Python's sleep between later polls: from NAP_S doubling to NAP_MAX_S, and IDLE_NAP_S
# once a wait has lasted IDLE_AFTER_S (an idle worker waiting for the next command: 3.5%
# of a core at 1 ms naps on the Emerald Rapids VM; the first command after an idle
# second then waits up to 10 ms)
NAP_S, NAP_MAX_S, IDLE_AFTER_S, IDLE_NAP_S = 5e-5, 1e-3, 1.0, 1e-2
_I64 = np.empty(0, np.int64)
_F32 = np.empty(0, np.float32)
_U8 = np.empty(0, np.uint8)
DONE = 2  # the phase a kernel returns when its call is complete
MISMATCH = -1  # ... when the ranks' sizes of the call differ (nothing written)
# rank r's size of call k: the int64 at 1 + (k & 1) after its flag (a word per phase: a
# rank that moved on to call k + 1 must not overwrite what a slower one still compares)
SIZE = 1


class CollectiveError(RuntimeError):
    """A collective did not complete: a peer is gone or the deadline passed."""


class PeerLost(CollectiveError):
    """A peer process of the group has exited (the message names its rank and pid)."""


# -- waiting ---------------------------------------------------------------------------


_X86 = platform.machine().lower() in ("x86_64", "amd64", "i386", "i686")


@intrinsic
def _pause(typingctx):
    """x86 ``pause``: a spin-wait hint (SSE2, every x86-64 CPU); elsewhere nothing (the
    poll itself)."""

    def codegen(context, builder, sig, args):
        if _X86:
            fn = cgutils.get_or_insert_function(
                builder.module, ir.FunctionType(ir.VoidType(), []), "llvm.x86.sse2.pause"
            )
            builder.call(fn, [])
        return context.get_dummy_value()

    return types.void(), codegen


@intrinsic
def _sched_yield(typingctx):
    """libc's ``sched_yield()``: the core to another runnable thread, if any."""

    def codegen(context, builder, sig, args):
        fn = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(ir.IntType(32), []), "sched_yield"
        )
        builder.call(fn, [])
        return context.get_dummy_value()

    return types.void(), codegen


@jit(inline="always")
def _ready(flags, lo, hi, target):
    for q in range(lo, hi):
        if atomic_load(flags, (q + 1) * (LINE // 8)) < target:
            return False
    return True


@jit
def _await(flags, lo, hi, target, spins, yields):
    """Whether the flags of ranks lo..hi-1 reached ``target`` within the polls."""
    for _ in range(spins):
        if _ready(flags, lo, hi, target):
            return True
        _pause()
    for _ in range(yields):
        if _ready(flags, lo, hi, target):
            return True
        _sched_yield()
    return _ready(flags, lo, hi, target)


@jit
def _wait(base, lo, hi, target, phase, spins, yields):
    """DONE once the flags of ranks lo..hi-1 reach ``target``, else ``phase``."""
    if _await(view(base, HEADER // 8, _I64), lo, hi, target, spins, yields):
        return DONE
    return phase


@jit
def _post(base, rank, seq):
    atomic_store(view(base, HEADER // 8, _I64), (rank + 1) * (LINE // 8), seq)


# -- the kernels -----------------------------------------------------------------------


@jit
def _all_reduce(base, world, rank, seq, slot, x, n, witness, phase, spins, yields):
    """Call ``seq``'s all-reduce of ``n`` elements at address ``x`` (``witness``'s carrier),
    in place, from ``phase`` (0: nothing done, 1: posted); the phase reached (DONE)."""
    flags = view(base, HEADER // 8, _I64)
    data = view(base + HEADER, 2 * world * slot // 4, _F32)
    t = view(x, n, witness)
    p = (seq & 1) * world * (slot // 4)
    n16 = n - n % 16
    if phase == 0:
        if not _await(flags, 0, world, seq - 1, spins, yields):
            return 0
        mine = p + rank * (slot // 4)
        for i in range(0, n16, 16):
            vstore(data, mine + i, vload(t, i))
        for i in range(n16, n):
            data[mine + i] = to_f32(t, i)
        flags[(rank + 1) * (LINE // 8) + SIZE + (seq & 1)] = n  # published by the store next
        atomic_store(flags, (rank + 1) * (LINE // 8), seq)
    if not _await(flags, 0, world, seq, spins, yields):
        return 1
    for q in range(world):
        if flags[(q + 1) * (LINE // 8) + SIZE + (seq & 1)] != n:
            return MISMATCH
    for i in range(0, n16, 16):
        s = vload(data, p + i)
        for q in range(1, world):
            s = vadd(s, vload(data, p + q * (slot // 4) + i))
        vstore(t, i, s)
    for i in range(n16, n):
        s = data[p + i]
        for q in range(1, world):
            s += data[p + q * (slot // 4) + i]
        store_f32(t, i, s)
    return DONE


# -- the segment and the group ---------------------------------------------------------


def host_identity():
    """A string equal on two processes only when they can share a segment: the host
    (name and boot id), the PID namespace (peers' pids are checked for liveness) and the
    ``/dev/shm`` file system; None where there is no ``/dev/shm``."""
    try:
        shm, ns = os.stat(SHM_DIR), os.stat("/proc/self/ns/pid")
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        return None
    return f"{socket.gethostname()}|{boot}|{ns.st_dev}:{ns.st_ino}|{shm.st_dev}:{shm.st_ino}"


def _alive(pid):
    """Whether process ``pid`` runs (a zombie, exited but not yet reaped, does not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's: it exists
        pass
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except (OSError, IndexError):
        return False


def stale_segments(directory=SHM_DIR):
    """Paths of numkern segments in ``directory`` whose creator has exited."""
    out = []
    with contextlib.suppress(OSError):
        for name in os.listdir(directory):
            pid = name[len(PREFIX) :].split("-")[0]
            if name.startswith(PREFIX) and pid.isdigit() and not _alive(int(pid)):
                out.append(os.path.join(directory, name))
    return out


def _segment_bytes(world, slot):
    return HEADER + 2 * world * slot


class ShmGroup:
    """One rank's view of a shared segment of ``world`` ranks (module docstring).

    Rank 0 makes it with :meth:`create`, the others with :meth:`attach` of its ``name``;
    once every rank has attached, the creator calls :meth:`unlink`. ``peers``: each
    rank's pid (checked while a wait lasts); ``timeout``: seconds a call may wait."""

    def __init__(self, path, world, rank, slot_bytes, *, create, peers=(), timeout=120.0):
        if not 2 <= world <= MAX_WORLD:
            raise ValueError(f"world: expected 2..{MAX_WORLD}, got {world}")
        if not 0 <= rank < world:
            raise ValueError(f"rank: expected 0..{world - 1}, got {rank}")
        if slot_bytes < LINE or slot_bytes % LINE:
            raise ValueError(f"slot_bytes: expected a multiple of {LINE} > 0, got {slot_bytes}")
        if not (isinstance(timeout, (int, float)) and timeout > 0):
            raise ValueError(f"timeout: expected seconds > 0, got {timeout!r}")
        self.path, self.world, self.rank, self.slot = path, world, rank, slot_bytes
        self.peers, self.timeout = tuple(peers), timeout
        size = _segment_bytes(world, slot_bytes)
        flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
        fd = os.open(path, flags, 0o600)
        try:
            if create:
                os.ftruncate(fd, size)
            elif os.fstat(fd).st_size != size:
                raise ValueError(
                    f"{path}: expected a segment of {size} bytes, got {os.fstat(fd).st_size}"
                )
            self._map = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        self._bytes = np.frombuffer(self._map, np.uint8)
        self.base = self._bytes.ctypes.data
        self.seq = 0  # calls made
        self.closed = False

    @property
    def name(self):
        return os.path.basename(self.path)

    @classmethod
    def create(cls, world, slot_bytes=SLOT_BYTES, *, directory=SHM_DIR, **kw):
        """A new segment (a fresh name, never an existing file); dead creators' entries
        in ``directory`` are unlinked first."""
        for path in stale_segments(directory):
            with contextlib.suppress(OSError):
                os.unlink(path)
        path = os.path.join(directory, f"{PREFIX}{os.getpid()}-{secrets.token_hex(8)}")
        return cls(path, world, 0, slot_bytes, create=True, **kw)

    @classmethod
    def attach(cls, name, world, rank, slot_bytes=SLOT_BYTES, *, directory=SHM_DIR, **kw):
        if os.path.basename(name) != name or not name.startswith(PREFIX):
            raise ValueError(f"name: expected a {PREFIX}* segment name, got {name!r}")
        return cls(os.path.join(directory, name), world, rank, slot_bytes, create=False, **kw)

    def unlink(self):
        """Remove the segment's file (the mappings stay): every rank has attached."""
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)

    def close(self):
        """Unmap (idempotent). No call may run meanwhile."""
        if self.closed:
            return
        self.closed = True
        self._bytes = None
        with contextlib.suppress(BufferError):  # a view still held: unmapped at exit
            self._map.close()

    # -- driving a call ------------------------------------------------------------------

    def _next(self):
        if self.closed:
            raise CollectiveError(f"rank {self.rank}: the shared-memory group is closed")
        self.seq += 1
        return self.seq

    def _sizes(self):
        """Each rank's size of the current call (:data:`SIZE`)."""
        words = self._bytes[:HEADER].view(np.int64)
        at = SIZE + (self.seq & 1)
        return [int(words[(q + 1) * (LINE // 8) + at]) for q in range(self.world)]

    def _mismatch(self, what):
        raise ValueError(
            f"t: expected the same size on every rank for {what} (call {self.seq}), got "
            f"{self._sizes()} (by rank)"
        )

    def _check_peers(self):
        for q, pid in enumerate(self.peers):
            if q != self.rank and not _alive(pid):
                raise PeerLost(f"rank {q} (pid {pid}) has exited")

    def _drive(self, kernel, args, what):
        """Run ``kernel(*args, phase, spins, yields) -> phase`` until DONE, checking the
        peers and the deadline between polls (module docstring)."""
        phase = kernel(*args, 0, SPINS, YIELDS)
        if phase == DONE:
            return
        if phase == MISMATCH:
            self._mismatch(what)
        start, nap = time.monotonic(), NAP_S
        deadline, idle = start + self.timeout, start + IDLE_AFTER_S
        while True:
            self._check_peers()
            now = time.monotonic()
            if now > deadline:
                raise CollectiveError(
                    f"rank {self.rank}: {what} (call {self.seq}) timed out after "
                    f"{self.timeout} s waiting for its peers"
                )
            time.sleep(nap)
            nap = IDLE_NAP_S if now > idle else min(2 * nap, NAP_MAX_S)
            phase = kernel(*args, phase, 1, 0)
            if phase == DONE:
                return
            if phase == MISMATCH:
                self._mismatch(what)

    # -- the collectives -----------------------------------------------------------------

    def all_reduce(self, t):
        """``t`` (contiguous bf16, fp16 or fp32) replaced by the sum over the ranks, in
        fp32 rounded once to its dtype; returns ``t``."""
        dt = _check.check_dtype("t", t, _check.FLOATS)
        if not t.is_contiguous():
            raise ValueError("t: expected a contiguous tensor")
        witness, size = _check.WITNESS[dt], t.element_size()
        per = self.slot // 4
        total, at = t.numel(), _check.address(t)
        for lo in range(0, total, per):
            n, seq, x = min(per, total - lo), self._next(), at + lo * size
            args = (self.base, self.world, self.rank, seq, self.slot, x, n, witness)
            self._drive(_all_reduce, args, "all_reduce")
        return t

    def all_gather(self, t, out=None):
        """The ranks' ``t [..., n]`` (contiguous; any dtype) side by side along the last
        dimension, rank order: ``out [..., world * n]`` (made when None). The bytes move
        by NumPy copies (memcpy; a Numba byte loop over the mapped segment ran at a tenth
        of that), the waits are the kernels'."""
        import torch

        if not t.is_contiguous():
            raise ValueError("t: expected a contiguous tensor")
        shape = (*t.shape[:-1], self.world * t.shape[-1])
        if out is None:
            out = torch.empty(shape, dtype=t.dtype)
        elif tuple(out.shape) != shape or out.dtype != t.dtype or not out.is_contiguous():
            raise ValueError(f"out: expected a contiguous {t.dtype} tensor of {shape}")
        width = t.shape[-1] * t.element_size()
        rows = t.numel() // t.shape[-1] if t.shape[-1] else 0
        if width > self.slot:
            raise ValueError(f"t: a row of {width} bytes exceeds the slot of {self.slot}")
        src = t.reshape(rows, -1).view(torch.uint8).numpy()
        dst = out.reshape(rows, -1).view(torch.uint8).numpy().reshape(rows, self.world, width)
        per = self.slot // width if width else max(rows, 1)
        for r0 in range(0, rows, per):
            n, seq = min(per, rows - r0), self._next()
            self._gate(seq - 1, "all_gather")
            self._slot(seq, self.rank, n * width).reshape(n, width)[:] = src[r0 : r0 + n]
            at = (self.rank + 1) * (LINE // 8) + SIZE + (seq & 1)
            self._bytes[:HEADER].view(np.int64)[at] = n * width
            _post(self.base, self.rank, seq)
            self._gate(seq, "all_gather")
            if any(size != n * width for size in self._sizes()):
                self._mismatch("all_gather")
            for q in range(self.world):
                dst[r0 : r0 + n, q] = self._slot(seq, q, n * width).reshape(n, width)
        return out

    def _slot(self, seq, rank, nbytes):
        """The first ``nbytes`` of ``rank``'s slot of call ``seq`` (a NumPy view)."""
        p = HEADER + ((seq & 1) * self.world + rank) * self.slot
        return self._bytes[p : p + nbytes]

    def _gate(self, target, what, lo=0, hi=None):
        """Until the flags of ranks lo..hi-1 (all) reach ``target``."""
        hi = self.world if hi is None else hi
        self._drive(_wait, (self.base, lo, hi, target), what)

    def broadcast(self, data=None, src=0):
        """``data`` (bytes) of rank ``src`` on every rank (the others pass None); at most
        ``slot - 8`` bytes."""
        seq, me = self._next(), self.rank
        if me == src:
            if len(data) > self.slot - 8:
                raise ValueError(f"data: at most {self.slot - 8} bytes, got {len(data)}")
            self._gate(seq - 1, "broadcast")
            slot = self._slot(seq, src, 8 + len(data))
            slot[:8] = np.frombuffer(len(data).to_bytes(8, "little"), np.uint8)
            slot[8:] = np.frombuffer(data, np.uint8)
            _post(self.base, me, seq)
            return data
        self._gate(seq, "broadcast", src, src + 1)
        n = int.from_bytes(self._slot(seq, src, 8).tobytes(), "little")
        out = self._slot(seq, src, 8 + n)[8:].tobytes()
        _post(self.base, me, seq)
        return out
