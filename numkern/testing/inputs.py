"""Input builders for kernel tests: what the ops take, valid by construction.

* :func:`random_block_table` — a paged-attention block table (distinct blocks, shuffled)
  and the slot mapping of each request's newest tokens;
* :func:`random_routing` — MoE top-k weights and distinct expert ids per token;
* :func:`packed_weight` — a random weight and its packed copy for the packed linear.

Each takes a ``seed`` (or a ``torch.Generator``) so a failing case can be rebuilt.
"""

from typing import NamedTuple

import torch


def _generator(seed):
    if isinstance(seed, torch.Generator):
        return seed
    if not isinstance(seed, int) or isinstance(seed, bool):
        raise TypeError(f"seed: expected an int or a torch.Generator, got {seed!r}")
    return torch.Generator().manual_seed(seed)


def _count(name, value, low):
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise ValueError(f"{name}: expected an int >= {low}, got {value!r}")
    return value


class BlockTable(NamedTuple):
    block_table: torch.Tensor  # int32 [R, max_blocks]; unused entries -1
    slot_mapping: torch.Tensor  # int64 [T]: the slots of each request's newest q_len keys
    query_start_loc: torch.Tensor  # int32 [R+1]
    seq_lens: torch.Tensor  # int32 [R]


def random_block_table(seq_lens, query_lens, block_size, num_blocks, *, seed=0):
    """A step of ``R = len(seq_lens)`` requests on a cache of ``num_blocks`` blocks of
    ``block_size``: request ``r`` has ``seq_lens[r]`` keys, the last ``query_lens[r]`` of
    them new this step. Every block a request uses is its own (drawn without
    replacement, shuffled); ValueError when the cache is too small."""
    b = _count("block_size", block_size, 1)
    nb = _count("num_blocks", num_blocks, 1)
    sl = [_count(f"seq_lens[{r}]", s, 0) for r, s in enumerate(seq_lens)]
    ql = [_count(f"query_lens[{r}]", q, 0) for r, q in enumerate(query_lens)]
    if len(ql) != len(sl):
        raise ValueError(f"query_lens: expected {len(sl)} entries, got {len(ql)}")
    for r, (s, q) in enumerate(zip(sl, ql)):
        if q > s:
            raise ValueError(f"query_lens[{r}]: expected <= seq_lens[{r}] = {s}, got {q}")
    need = [(s + b - 1) // b for s in sl]
    if sum(need) > nb:
        raise ValueError(f"num_blocks: the requests need {sum(need)} blocks, got {nb}")
    perm = torch.randperm(nb, generator=_generator(seed))
    table = torch.full((len(sl), max(need, default=0)), -1, dtype=torch.int32)
    slots, at = [], 0
    for r, (s, q, n) in enumerate(zip(sl, ql, need)):
        table[r, :n] = perm[at : at + n].to(torch.int32)
        at += n
        pos = torch.arange(s - q, s)
        slots.append(table[r, pos // b].long() * b + pos % b)
    qsl = torch.tensor([0, *torch.tensor(ql).cumsum(0).tolist()], dtype=torch.int32)
    slot_mapping = torch.cat(slots) if slots else torch.empty(0, dtype=torch.int64)
    return BlockTable(table, slot_mapping, qsl, torch.tensor(sl, dtype=torch.int32))


def random_routing(num_tokens, num_experts, topk, *, renormalize=True, seed=0):
    """``(topk_weights [T, k] fp32, topk_ids [T, k] int32)``: ``k`` distinct experts per
    token with softmax weights (summing to 1 per token with ``renormalize``)."""
    t_n = _count("num_tokens", num_tokens, 0)
    e_n = _count("num_experts", num_experts, 1)
    k = _count("topk", topk, 1)
    if k > e_n:
        raise ValueError(f"topk: expected <= num_experts = {e_n}, got {k}")
    g = _generator(seed)
    ids = torch.rand(t_n, e_n, generator=g).argsort(dim=1)[:, :k].to(torch.int32)
    w = torch.randn(t_n, k, generator=g).softmax(dim=1)
    if not renormalize:
        w = w * torch.rand(t_n, 1, generator=g)
    return w.float(), ids


def packed_weight(n, k, dtype=torch.bfloat16, *, scale=None, seed=0):
    """``(weight [n, k], packed)``: a random weight of ``dtype`` (standard deviation
    ``scale``, default ``k ** -0.5``) and ``numkern.convert_weight_packed`` of it."""
    from .. import convert_weight_packed

    n = _count("n", n, 1)
    k = _count("k", k, 1)
    s = k**-0.5 if scale is None else scale
    w = (torch.randn(n, k, generator=_generator(seed)) * s).to(dtype)
    return w, convert_weight_packed(w)
