"""The engine across processes on ``torch.distributed`` (gloo): the collectives a step
needs (:class:`Comm`), and :data:`LOCAL`, the one process of an unsplit engine (every
collective the identity).

(issue 29: process management -- spawning workers, joining torchrun's group, the worker
loop, timeouts and faults -- is built on this module.)
"""

import pickle

import torch


class Comm:
    """The collectives of one rank of a process group (``group``: a
    ``torch.distributed`` group with the gloo backend, or None: the default group).

    Partial sums are reduced in fp32 and rounded once to the tensor's dtype
    (:meth:`all_reduce`)."""

    def __init__(self, rank, world, group=None):
        self.rank, self.world, self.group = rank, world, group

    def all_reduce(self, t):
        """The sum over the ranks of ``t`` (each rank's partial), in fp32, rounded once to
        ``t``'s dtype: a new tensor (fp32 input: reduced in place and returned)."""
        import torch.distributed as dist

        if self.world == 1:
            return t
        f = t if t.dtype == torch.float32 else t.float()
        dist.all_reduce(f, group=self.group)
        return f if f is t else f.to(t.dtype)

    def all_gather(self, t):
        """The ranks' ``t [..., n]`` concatenated along the last dimension, in rank order:
        ``[..., world * n]`` (every rank's ``t`` of one shape)."""
        import torch.distributed as dist

        if self.world == 1:
            return t
        parts = [torch.empty_like(t) for _ in range(self.world)]
        dist.all_gather(parts, t.contiguous(), group=self.group)
        return torch.cat(parts, -1)

    def broadcast_object(self, obj=None, src=0):
        """``obj`` of rank ``src`` on every rank (pickled; the others pass None)."""
        import torch.distributed as dist

        if self.world == 1:
            return obj
        if self.rank == src:
            data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
            size = torch.tensor([data.numel()], dtype=torch.int64)
        else:
            size = torch.zeros(1, dtype=torch.int64)
        dist.broadcast(size, src, group=self.group)
        if self.rank != src:
            data = torch.empty(int(size), dtype=torch.uint8)
        dist.broadcast(data, src, group=self.group)
        return obj if self.rank == src else pickle.loads(data.numpy().tobytes())


LOCAL = Comm(0, 1)
