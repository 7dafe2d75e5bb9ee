"""A checkpoint as the model reads it: its config, its tensors by HF name (each taken
exactly once) and its tokenizer; the progress bar both readers show."""

import difflib
from dataclasses import dataclass, field

from tqdm import tqdm

from .config import ModelConfig

# Below this many tensors a load takes well under a second and a bar is only noise; a
# bar appears only once a load has taken PROGRESS_DELAY seconds (SmolLM2's GGUF: ~0.3 s).
PROGRESS_MIN_TENSORS = 64
PROGRESS_DELAY = 1.0


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

    def take(self, name):
        """The tensor ``name``, removed from the checkpoint (each is taken exactly once)."""
        t = self.require(name)
        del self.tensors[name]
        self._taken.add(name)
        return t

    def take_raw(self, name):
        """The stored bytes of tensor ``name`` (a GGUF checkpoint's
        :class:`engine.loader.gguf.RawTensor`), taken as :meth:`take` takes a tensor; or
        None, the tensor left in place for :meth:`take`, where the checkpoint keeps no
        bytes for it (an HF directory; a GGUF tensor whose values the loader changes)."""
        self.require_name(name)
        raw = getattr(self.tensors, "raw", None)
        out = raw(name) if raw is not None else None
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
