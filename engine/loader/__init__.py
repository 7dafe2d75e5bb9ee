"""Reading a checkpoint for the engine: config, tensors (HF names) and tokenizer.

:func:`load_checkpoint` reads one of two sources, each with the library made for it:

- a Hugging Face directory (:mod:`.hf`): ``config.json``; ``model.safetensors`` or
  ``model.safetensors.index.json`` + shards, opened with safetensors' ``safe_open``
  (memory maps, :mod:`.safetensors_file`); ``tokenizer.json`` (optional) with
  ``tokenizers``; the chat template and the named special tokens.
- a ``.gguf`` file (llama.cpp, :mod:`.gguf`) of one of the architectures of
  :data:`GGUF_ARCHS` (:mod:`.gguf_arch`: llama, qwen2, qwen3, qwen2moe, qwen3moe, gemma2,
  gemma3, gpt-oss, qwen3next): tensors renamed to their HF names (what llama.cpp's
  converter changed undone) and dequantized when the model takes them, or their stored
  bytes taken as they are (``Checkpoint.take_raw``: a :class:`RawTensor`); config,
  tokenizer and chat template from the metadata.

The rooms, by concern:

- :mod:`.families`: one row per architecture (:data:`FAMILIES`): defaults, MoE fields,
  windows, norms, expert names, sinks, the hybrids' GDN layers; every architecture test
  reads it (``ModelConfig.family``). :mod:`.rules`: the rows' per-family logic (window
  rules, Gemma's and the hybrids' extra fields).
- :mod:`.config`: :class:`ModelConfig` and its reading of config.json; :mod:`.fields`:
  the checks every field goes through (:data:`SIZE_LIMITS`, rope).
- :mod:`.checkpoint`: :class:`Checkpoint`, :class:`MissingTensorError`.

Tensors keep the HF layout: a projection is ``[out_features, in_features]``, a norm
``[hidden]``, experts one tensor each (``model.layers.N.mlp.experts.E.gate_proj.weight``)
or, for GPT-OSS, all in one (``mlp.experts.gate_up_proj [E, H, 2I]``). The model
takes each tensor exactly once (``Checkpoint.take``) and ends with
``Checkpoint.check_all_used``, so no tensor of a checkpoint is silently ignored.

safetensors and tokenizers are imported where they are used, so that the engine
imports (and a checkpoint of the other kind loads) without them; ``gguf`` only for a
GGUF tensor type :mod:`engine.loader.gguf_file` does not dequantize itself (K-quants, IQ*).
"""

import os

import torch

from ..shard import SINGLE, Shard, check_split
from .checkpoint import Checkpoint, MissingTensorError
from .config import ModelConfig, layer_windows
from .families import FAMILIES, HONOURED_FIELDS, SUPPORTED_ARCHITECTURES, Experts, Family
from .fields import ROPE_TYPES, SIZE_LIMITS
from .gguf import LazyTensors, RawTensor, load_gguf
from .gguf_arch import GGUF_ARCHS
from .hf import load_hf_dir
from .rules import GDNConfig

__all__ = [
    "FAMILIES",
    "GGUF_ARCHS",
    "HONOURED_FIELDS",
    "ROPE_TYPES",
    "SIZE_LIMITS",
    "SUPPORTED_ARCHITECTURES",
    "Checkpoint",
    "Experts",
    "Family",
    "GDNConfig",
    "LazyTensors",
    "MissingTensorError",
    "ModelConfig",
    "RawTensor",
    "layer_windows",
    "load_checkpoint",
]


def load_checkpoint(path, *, dtype=None, progress=True, shard=SINGLE):
    """A :class:`Checkpoint` from an HF directory or a ``.gguf`` file.

    ``dtype`` (a ``torch.dtype``) converts every floating-point tensor; None keeps the
    stored dtype (fp32 for dequantized GGUF tensors). No tensor is read here: each is
    read when the model takes it, whole or only a rank's part (``Checkpoint.take``'s
    ``part``: a safetensors slice of the memory map, a GGUF tensor's rows and whole
    quantisation blocks). ``shard`` (``engine.shard.Shard``): the rank the checkpoint is
    read for; a config it cannot split is a ValueError naming the field
    (``engine.shard.check_split``), raised here, before any weight is read.
    """
    if dtype is not None and not isinstance(dtype, torch.dtype):
        raise ValueError(f"dtype: expected a torch.dtype or None, got {dtype!r}")
    if not isinstance(shard, Shard):
        raise TypeError(f"shard: expected an engine.shard.Shard, got {type(shard).__name__}")
    path = os.fspath(path)
    if os.path.isdir(path):
        ckpt = load_hf_dir(path, dtype, progress, lambda cfg: check_split(cfg, shard))
    elif os.path.isfile(path) and path.endswith(".gguf"):
        ckpt = load_gguf(path, dtype, progress)
    else:
        ckpt = None
    if ckpt is not None:
        check_split(ckpt.config, shard)
        ckpt.shard = shard
        return ckpt
    raise ValueError(
        f"path: expected an HF checkpoint directory or a .gguf file, got {path!r}"
        + ("" if os.path.exists(path) else " (does not exist)")
    )
