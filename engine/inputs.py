"""What a call to the engine gives, checked: the prompts (strings or token ids) and their
sampling parameters. The call's own mistakes raise (TypeError, ValueError naming
``prompts`` or ``sampling_params``); a prompt's own mistakes are returned as the message
its request fails with (``engine.llm``'s module docstring, Errors)."""

import operator

from .args import is_int
from .sampling import SamplingParams


def call_inputs(prompts, params):
    """``[(prompt, SamplingParams)]`` of a call: one prompt or a list of them (a NumPy array
    or tensor of token ids is one prompt), ``params`` None (the defaults), one for all or
    one per prompt."""
    if hasattr(prompts, "tolist"):  # a NumPy array or torch tensor of token ids
        prompts = prompts.tolist()
    if isinstance(prompts, (str, bytes)) or (
        isinstance(prompts, (list, tuple)) and prompts and is_int(prompts[0])
    ):
        prompts = [prompts]
    if not isinstance(prompts, (list, tuple)):
        raise TypeError(
            f"prompts: expected a prompt (a string or token ids) or a list of them, got "
            f"{type(prompts).__name__}"
        )
    if params is None:
        params = [SamplingParams()] * len(prompts)
    elif isinstance(params, SamplingParams):
        params = [params] * len(prompts)
    elif not isinstance(params, (list, tuple)):
        raise TypeError(
            f"sampling_params: expected a SamplingParams or a list of them, got "
            f"{type(params).__name__}"
        )
    elif len(params) != len(prompts):
        raise ValueError(
            f"sampling_params: expected one SamplingParams or {len(prompts)} (one per "
            f"prompt), got {len(params)}"
        )
    for p in params:
        if not isinstance(p, SamplingParams):
            raise TypeError(f"sampling_params: expected SamplingParams, got {p!r:.80}")
    return list(zip(prompts, params))


def prompt_ids(prompt, tokenizer, vocab):
    """``(token ids, "")`` of a prompt (a string, encoded by ``tokenizer``, or token ids in
    ``[0, vocab)``), or ``(None, why it is not one)``."""
    if isinstance(prompt, str):
        if tokenizer is None:
            return None, "prompt: a string needs a tokenizer; this checkpoint has none"
        return tokenizer.encode(prompt).ids, ""
    if hasattr(prompt, "tolist"):  # NumPy, torch
        prompt = prompt.tolist()
    if not isinstance(prompt, (list, tuple)):
        kind = type(prompt).__name__
        return None, f"prompt: expected a string or a list of token ids, got {kind}"
    ids = []
    for j, t in enumerate(prompt):
        if not is_int(t):
            return None, f"prompt: expected token ids (ints), got {t!r:.40} at {j}"
        ids.append(operator.index(t))  # an int or a NumPy integer
    if not ids:
        return None, "prompt: expected at least one token"
    bad = next((j for j, t in enumerate(ids) if not 0 <= t < vocab), None)
    if bad is not None:
        return None, f"prompt: token ids must lie in [0, {vocab}), got {ids[bad]} at {bad}"
    return ids, ""


def unfit(ids, params, llm):
    """Why a valid prompt cannot run with these (valid) params on ``llm`` (its tokenizer,
    context and KV-cache groups), or ''."""
    if params.stop and llm.tokenizer is None:
        return "stop: stop strings need a tokenizer; this checkpoint has none"
    if len(ids) >= llm.max_model_len:
        return f"prompt: {len(ids)} tokens do not fit the context of {llm.max_model_len}"
    for g in llm.kv_cache_groups:
        # a sliding group frees the blocks behind its window as a prefill goes on
        b = g.block_size
        if g.sliding_window <= 0 and -(-len(ids) // b) > g.num_blocks:
            return (
                f"prompt: {len(ids)} tokens need {-(-len(ids) // b)} KV blocks of {b} "
                f"tokens; the KV cache holds {g.num_blocks} (kv_cache_memory)"
            )
    return ""
