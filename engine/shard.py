"""Which part of the model one rank holds under tensor / expert parallelism (issue 29).

:class:`Shard` is the rank's place: ``rank`` of ``world`` ranks, and whether the MoE
experts are partitioned whole across the ranks (``expert_parallel``) instead of split
along their intermediate dimension. ``Shard(0, 1, False)`` (:data:`SINGLE`) is the one
process of an unsplit engine: every slice is the whole tensor.
"""

from typing import NamedTuple


class Shard(NamedTuple):
    rank: int = 0
    world: int = 1
    expert_parallel: bool = False

    def part(self, n, field_name):
        """``(lo, hi)``: this rank's equal part of ``n`` (heads, neurons, experts, ...);
        ValueError naming ``field_name`` when ``n`` does not split evenly."""
        if n % self.world:
            raise ValueError(
                f"{field_name}: expected a multiple of tensor_parallel_size={self.world}, got {n}"
            )
        step = n // self.world
        return self.rank * step, (self.rank + 1) * step


SINGLE = Shard()
