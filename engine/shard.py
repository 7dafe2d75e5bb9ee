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


def check_split(config, shard):
    """ValueError naming the first field of ``config`` (an ``engine.loader.ModelConfig``)
    that ``shard`` cannot split, before any weight is read: attention heads
    (``num_attention_heads`` a multiple of the world; ``num_key_value_heads`` a multiple
    or a divisor of it: fewer KV heads than ranks are replicated, as vLLM does), the dense
    MLP's ``intermediate_size``, the experts' ``moe_intermediate_size`` (tensor parallel)
    or ``num_experts`` (expert parallel: whole experts per rank), Qwen2-MoE's
    ``shared_expert_intermediate_size`` (split under both), the Gated DeltaNet heads
    (``linear_num_key_heads`` / ``linear_num_value_heads``); expert parallelism on a
    model without experts is refused (``enable_expert_parallel``). The vocabulary needs
    no check: it is padded to whole parts (``engine.models.decoder``)."""
    world = shard.world
    layers = range(config.num_hidden_layers)
    moe = config.num_experts > 0 and any(config.is_moe_layer(i) for i in layers)
    if shard.expert_parallel and not moe:
        raise ValueError(
            f"enable_expert_parallel: expected a model with experts, got "
            f"{config.architecture} without (num_experts={config.num_experts})"
        )
    if world == 1:
        return
    mixers = config.layer_mixers or ["attention"] * config.num_hidden_layers
    if "attention" in mixers:
        shard.part(config.num_attention_heads, "num_attention_heads")
        hkv = config.num_key_value_heads
        if hkv % world and world % hkv:
            raise ValueError(
                f"num_key_value_heads: expected a multiple or a divisor of "
                f"tensor_parallel_size={world}, got {hkv}"
            )
    if any(not config.is_moe_layer(i) for i in layers):
        shard.part(config.intermediate_size, "intermediate_size")
    if moe:
        if shard.expert_parallel:
            if config.num_experts < world:
                raise ValueError(
                    f"num_experts: expected at least tensor_parallel_size={world} experts "
                    f"under enable_expert_parallel (whole experts per rank), got "
                    f"{config.num_experts}"
                )
            shard.part(config.num_experts, "num_experts")
        else:
            shard.part(config.moe_intermediate_size, "moe_intermediate_size")
        if config.shared_expert_intermediate_size:
            shard.part(config.shared_expert_intermediate_size, "shared_expert_intermediate_size")
    if "linear_attention" in mixers:
        shard.part(config.gdn.num_k_heads, "linear_num_key_heads")
        shard.part(config.gdn.num_v_heads, "linear_num_value_heads")
