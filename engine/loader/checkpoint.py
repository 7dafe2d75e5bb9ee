"""A checkpoint as the model reads it: its config, its tensors by HF name (each taken
exactly once, whole or a rank's part: :data:`Part`) and its tokenizer; the progress bar
both readers show."""

import difflib
from collections.abc import MutableMapping
from dataclasses import dataclass, field

import torch
from tqdm import tqdm

from .config import ModelConfig

# Below this many tensors a load takes well under a second and a bar is only noise; a
# bar appears only once a load has taken PROGRESS_DELAY seconds (SmolLM2's GGUF: ~0.3 s).
PROGRESS_MIN_TENSORS = 64
PROGRESS_DELAY = 1.0


class TensorMap(MutableMapping):
    """HF name -> tensor, each read (:meth:`_read`, a subclass's) when first taken and
    kept; a progress bar ticks once per tensor read and closes with the last. The one
    mapping behind a safetensors (``engine.loader.hf``) and a GGUF checkpoint
    (``engine.loader.gguf``): ``_sources`` holds what each name is read from (None: a
    tensor set by hand)."""

    def __init__(self, sources, bar=None):
        self._sources = dict(sources)
        self._made = {}
        self._bar = bar

    def _tick(self):
        if self._bar is not None:
            self._bar.update()
            if self._bar.n >= self._bar.total:
                self._bar.close()

    def _forget(self, name):
        """A subclass's own state of ``name``, dropped when it is set or deleted."""

    def __getitem__(self, name):
        t = self._made.get(name)
        if t is None:
            t = self._made[name] = self._read(name)
            self._tick()
        return t

    def __setitem__(self, name, t):
        self._sources[name] = None
        self._forget(name)
        self._made[name] = t

    def __delitem__(self, name):
        del self._sources[name]
        self._forget(name)
        self._made.pop(name, None)

    def __contains__(self, name):  # without reading it
        return name in self._sources

    def __iter__(self):
        return iter(self._sources)

    def __len__(self):
        return len(self._sources)


class MissingTensorError(KeyError):
    # KeyError's str() is the repr of its argument; this one reads as the sentence it is
    def __str__(self):
        return str(self.args[0])


@dataclass
class Checkpoint:
    config: ModelConfig
    tensors: dict = field(repr=False)  # HF name -> torch.Tensor
    tokenizer: object = field(repr=False)  # tokenizers.Tokenizer or None
    source: str
    chat_template: str | None = field(default=None, repr=False)  # Jinja2 source
    # transformers' special_tokens_map: {"bos_token": "<s>", "eos_token": ...}, the
    # variables a chat template sees
    special_tokens: dict = field(default_factory=dict, repr=False)
    shard: object = None  # the engine.shard.Shard it was read for (load_checkpoint's)
    _taken: set = field(default_factory=set, init=False, repr=False)

    def require(self, name):
        """The tensor ``name`` (left in place); MissingTensorError naming it if absent."""
        if name not in self.tensors:
            hint = ""
            if name in self._taken:
                hint = " (already taken)"
            else:
                close = difflib.get_close_matches(name, self.tensors, n=3)
                if close:
                    hint = f"; closest: {', '.join(close)}"
            raise MissingTensorError(f"{self.source}: no tensor {name!r}{hint}")
        return self.tensors[name]

    def shape(self, name):
        """The shape of tensor ``name``, read from the file's header where it has one
        (without reading the tensor)."""
        self.require_name(name)
        of = getattr(self.tensors, "shape", None)
        return tuple(of(name) if of is not None else self.tensors[name].shape)

    def take(self, name, part=None):
        """The tensor ``name``, removed from the checkpoint (each is taken exactly once);
        with ``part`` (:data:`Part`) only that part of it, read without the rest where
        the file allows (a safetensors slice of the memory map; a GGUF tensor's selected
        rows dequantised alone)."""
        if part is None:
            t = self.require(name)
        else:
            self.require_name(name)
            read = getattr(self.tensors, "part", None)
            t = read(name, part) if read is not None else select_part(self.tensors[name], part)
        del self.tensors[name]
        self._taken.add(name)
        return t

    def take_raw(self, name, part=None):
        """The stored bytes of tensor ``name`` (a GGUF checkpoint's
        :class:`engine.loader.gguf.RawTensor`; with ``part``, :data:`Part`, those of that
        part: whole rows, and a last-dimension range of whole quantisation blocks), taken
        as :meth:`take` takes a tensor; or None, the tensor left in place for
        :meth:`take`, where the checkpoint keeps no bytes for it (an HF directory; a GGUF
        tensor whose values the loader changes; a range that splits a block)."""
        self.require_name(name)
        raw = getattr(self.tensors, "raw", None)
        out = (raw(name) if part is None else raw(name, part)) if raw is not None else None
        if out is not None:
            del self.tensors[name]
            self._taken.add(name)
        return out

    def require_name(self, name):
        """MissingTensorError (as :meth:`require`) unless ``name`` is here, without
        reading the tensor."""
        if name not in self.tensors:
            self.require(name)

    def check_all_used(self):
        """ValueError listing every tensor that was never taken."""
        if self.tensors:
            names = sorted(self.tensors)
            more = f", ... ({len(names) - 20} more)" if len(names) > 20 else ""
            shown = ", ".join(names[:20]) + more
            raise ValueError(f"{self.source}: {len(names)} tensor(s) never used: {shown}")


Part = tuple
"""A part of a tensor (:meth:`Checkpoint.take`): one entry per leading dimension (the
dimensions after the last entry whole), each None (whole), a ``slice(lo, hi)`` or a 1-D
int64 tensor of indices (a rank's heads of a fused projection); ``t[part]`` as torch
indexes it one dimension at a time."""


def select_part(t, part):
    """``t``'s :data:`Part` ``part``: a new contiguous tensor."""
    for d, s in enumerate(part):
        if isinstance(s, torch.Tensor):
            t = t.index_select(d, s)
        elif s is not None:
            t = t[(slice(None),) * d + (s,)]
    return t.contiguous()


def read_part(shape, read_box, part):
    """``part`` (:data:`Part`) of a tensor of ``shape`` read through ``read_box(box)``
    (``box``: a tuple of one slice per dimension, the tensor's values in that box):
    one box, spanning each index tensor's range, then the indices picked from it."""
    box, local = [], []
    for d, n in enumerate(shape):
        s = part[d] if d < len(part) else None
        if isinstance(s, torch.Tensor):
            lo = int(s.min()) if len(s) else 0
            hi = int(s.max()) + 1 if len(s) else 0
            if lo < 0 or hi > n:
                raise IndexError(f"part: indices of dim {d} outside [0, {n})")
            box.append(slice(lo, hi))
            local.append(s - lo)
        else:
            box.append(slice(None) if s is None else s)
            local.append(None)
    return select_part(read_box(tuple(box)), local)


def convert(t, dtype):
    return t.to(dtype) if dtype is not None and t.is_floating_point() else t


def progress_bar(items, total, desc, progress):
    return tqdm(
        items,
        total=total,
        desc=desc,
        unit="tensor",
        disable=not progress or total < PROGRESS_MIN_TENSORS,
        delay=PROGRESS_DELAY,
    )
