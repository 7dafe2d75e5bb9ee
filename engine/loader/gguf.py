"""Reading a ``.gguf`` file (llama.cpp) with :mod:`engine.loader.gguf_file` (metadata in one
pass, a memory map of the tensors): the config from the metadata and every tensor under
its HF name, as the architecture's row of :data:`engine.loader.gguf_arch.GGUF_ARCHS`
says (llama, qwen2, qwen3, qwen2moe, qwen3moe, gemma2, gemma3, gpt-oss, qwen3next), each
dequantized when the model takes it (:class:`LazyTensors`) or read as its stored bytes
(:meth:`LazyTensors.raw`, :class:`RawTensor`). The tokenizer, where the file describes a
byte-level BPE, from the embedded vocabulary and merges (``tokenizers``, imported where
it is used), BOS and EOS added as llama.cpp adds them; the chat template from
``tokenizer.chat_template``. ``gguf`` is imported only for a tensor type
:mod:`engine.loader.gguf_file` does not dequantize itself (K-quants, IQ*)."""

import math
import os
from typing import NamedTuple

import torch

from .checkpoint import Checkpoint, TensorMap, progress_bar, select_part
from .gguf_arch import gguf_config, gguf_recipes
from .gguf_file import type_block, type_name
from .gguf_tokenizer import gguf_tokenizer, special_tokens

_K_CHAT = "tokenizer.chat_template"


class RawTensor(NamedTuple):
    """An HF tensor's stored GGUF bytes: ``data`` uint8 ``[*shape[:-1], bytes per row]``
    in HF row order (a view of the file's map, or a gathered copy where rows were
    reordered or joined), each row ``shape[-1]`` values of GGML type ``ggml_type``
    (``type_name``: "Q4_K", "F16", ...)."""

    ggml_type: int
    type_name: str
    shape: tuple
    data: torch.Tensor


class LazyTensors(TensorMap):
    """HF name -> tensor, each made by its loader when first read: a GGUF checkpoint's
    tensors are dequantized as the model takes them, so the float copies of the whole
    model never live at once (the model packs each and lets it go). A loader's errors
    are the loader's (a ValueError naming the file and tensor)."""

    def __init__(self, loaders, bar=None, raws=None, file=None, recipes=None, dtype=None):
        super().__init__(loaders, bar)  # name -> () -> tensor
        self._dtype = dtype  # load_checkpoint's (None: fp32), for parts made here
        self._raws = dict(raws or {})  # name -> () -> RawTensor or None
        self._file = file  # the GGUFFile (GGUF checkpoints)
        self.recipes = dict(recipes or {})  # name -> gguf_arch.Recipe: its GGUF sources

    def raw_type(self, name):
        """:meth:`raw`'s ``type_name`` ("Q4_K"), or None where :meth:`raw` gives None,
        without reading or gathering any bytes."""
        if name not in self._sources:
            raise KeyError(name)
        r = self.recipes.get(name)
        if r is None or r.post is not None or name in self._made or name not in self._raws:
            return None
        types = {self._file.tensors[p].ggml_type for p in r.parts}
        return type_name(types.pop()) if len(types) == 1 else None

    def stored(self, gguf_name):
        """A GGUF tensor as the file stores it (a :class:`RawTensor`, shape slowest dim
        first), by its GGUF name: for a consumer that undoes a recipe's ``post`` itself
        (GPT-OSS's experts, stored [E, N, K] where HF transposes them)."""
        t = self._file.tensors[gguf_name]
        rows = self._file.raw_rows(gguf_name)
        data = rows.view(*t.shape[:-1], -1) if len(t.shape) > 1 else rows.view(-1)
        return RawTensor(t.ggml_type, type_name(t.ggml_type), tuple(t.shape), data)

    def raw(self, name, part=None):
        """The stored bytes of ``name`` (a :class:`RawTensor`; with ``part``,
        ``engine.loader.checkpoint.Part``, those of its selected rows and last-dimension
        range), or None where its values are not the stored rows (Qwen3-Next's A_log
        stored as -exp(A_log), GPT-OSS's transposed experts, a tensor set by hand), where
        its parts' types differ, once it was dequantized, or where the range splits a
        quantisation block. The tensor stays in the map."""
        if name not in self._sources:
            raise KeyError(name)
        make = self._raws.get(name)
        if make is None or name in self._made:
            return None
        return make() if part is None else _raw(self._file, self.recipes[name], part)

    def shape(self, name):
        """The HF shape of tensor ``name``, without making it (its recipe's, where the
        stored values are its values)."""
        r = self.recipes.get(name)
        if name in self._made or r is None or r.post is not None:
            return tuple(self[name].shape)
        return tuple(r.shape)

    def part(self, name, part):
        """``part`` (``engine.loader.checkpoint.Part``) of tensor ``name``: only its
        selected rows dequantized where the tensor is its stored rows (else the whole
        tensor, then the part)."""
        r = self.recipes.get(name)
        if name in self._made or r is None or r.post is not None or len(r.parts) != 1:
            return select_part(self[name], part)
        try:
            t = _make(self._file, r, self._dtype, part)
        except (ValueError, NotImplementedError) as e:
            raise ValueError(f"{self._file.path}: tensor {name!r} ({r.parts[0]}): {e}") from None
        self._tick()
        return t

    def _read(self, name):
        return self._sources[name]()

    def _forget(self, name):
        self._raws.pop(name, None)


def load_gguf(path, dtype, progress):
    """A :class:`Checkpoint` of the GGUF file ``path``, its tensors dequantized as the
    model takes them (``dtype``: as :func:`engine.loader.load_checkpoint`'s)."""
    from .gguf_file import GGUFFile

    try:
        f = GGUFFile(path)
    except Exception as e:  # a corrupt header fails as whatever numpy or struct raises
        kind = "" if isinstance(e, ValueError) else f"{type(e).__name__}: "
        raise ValueError(f"{path}: not a readable GGUF file: {kind}{e}") from None
    meta = f.meta
    embed = f.tensors.get("token_embd.weight")
    embed_rows = int(embed.shape[0]) if embed is not None and len(embed.shape) == 2 else None
    config, row = gguf_config(meta, f.tensors, embed_rows, read=f.tensor)
    try:
        recipes = gguf_recipes(row, config, f)
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from None

    def loader(name, r):
        def load():
            try:
                return _make(f, r, dtype)
            except (ValueError, NotImplementedError) as e:  # a size or type the header garbled
                raise ValueError(f"{path}: tensor {name!r} ({', '.join(r.parts)}): {e}") from None

        return load

    loaders = {name: loader(name, r) for name, r in recipes.items()}
    raws = {name: (lambda r=r: _raw(f, r)) for name, r in recipes.items() if r.post is None}
    desc = f"dequantizing {os.path.basename(path)}"
    bar = progress_bar(None, len(loaders), desc, progress)
    tensors = LazyTensors(
        loaders,
        bar=None if bar.disable else bar,
        raws=raws,
        file=f,
        recipes=recipes,
        dtype=dtype,
    )
    tokenizer = gguf_tokenizer(meta, path)
    return Checkpoint(config, tensors, tokenizer, path, meta.get(_K_CHAT), special_tokens(meta))


def _rows_of(shape, part):
    """``(rows, lead, cols)`` of ``part`` (``engine.loader.checkpoint.Part``) of a tensor
    of ``shape`` (2-D or more) viewed as rows (its leading dims flattened): the selected
    rows' indices (None: all), their leading shape, the last-dimension slice (None:
    whole)."""
    lead = shape[:-1]
    cols = part[len(shape) - 1] if len(part) >= len(shape) else None
    if isinstance(cols, torch.Tensor):
        raise ValueError("part: the last dimension is selected by a range, not indices")
    head = part[: len(lead)]
    if all(s is None for s in head):
        return None, tuple(lead), cols
    rows = select_part(torch.arange(math.prod(lead)).view(lead), head)
    return rows.reshape(-1), tuple(rows.shape), cols


def _make(f, r, dtype, part=None):
    """The HF tensor of recipe ``r`` (engine.loader.gguf_arch.Recipe) in ``dtype`` (None:
    fp32, the dequantized values as stored); with ``part`` (a one-part recipe of the
    stored values, 2-D or more) only its selected rows dequantized, then its columns."""
    out_dtype = dtype or torch.float32
    if part is not None and len(r.shape) > 1:
        rows, lead, cols = _rows_of(r.shape, part)
        if rows is not None and r.order is not None:
            rows = r.order[rows]
        order = r.order if rows is None else rows
        t = f.tensor(r.parts[0], out_dtype, row_order=order).view(*lead, r.shape[-1])
        return t if cols is None else t[..., cols].contiguous()
    if part is not None:
        return select_part(_make(f, r, dtype), part)
    # one part: its rows gathered before dequantizing (an expert's rows of a stacked
    # [E, N, K]); several: dequantized whole, joined, then ordered
    direct = r.post is None and len(r.parts) == 1
    work = out_dtype if direct else torch.float32
    if len(r.parts) == 1:
        t = f.tensor(r.parts[0], work, row_order=r.order)
    else:
        t = torch.cat([f.tensor(p, work).reshape(f.rows(p), -1) for p in r.parts])
        if r.order is not None:
            t = t[r.order]
    t = t.reshape(r.shape)
    if r.post is not None:
        t = r.post(t)
    return t.to(out_dtype)


def _raw(f, r, part=None):
    """The stored bytes of recipe ``r`` as a :class:`RawTensor` (with ``part``: its
    selected rows and its whole blocks of the last-dimension range), or None when its
    parts' types differ or the range splits a block."""
    types = {f.tensors[p].ggml_type for p in r.parts}
    if len(types) != 1:
        return None
    (ggml_type,) = types
    rows, lead, cols = (None, tuple(r.shape[:-1]), None)
    if part is not None:
        if len(r.shape) < 2:
            return None
        rows, lead, cols = _rows_of(r.shape, part)
    k = r.shape[-1]
    k0, k1 = (0, k) if cols is None else cols.indices(k)[:2]
    block, block_bytes = type_block(ggml_type)
    if k0 % block or k1 % block:
        return None
    if len(r.parts) == 1:
        order = r.order if rows is None else (rows if r.order is None else r.order[rows])
        data = f.raw_rows(r.parts[0], order)
    else:
        data = torch.cat([f.raw_rows(p) for p in r.parts])
        if r.order is not None:
            data = data[r.order]
        if rows is not None:
            data = data[rows]
    if (k0, k1) != (0, k):
        data = data[:, k0 // block * block_bytes : k1 // block * block_bytes].contiguous()
    shape = (*lead, k1 - k0)
    data = data.view(*lead, -1) if len(r.shape) > 1 else data.view(-1)
    return RawTensor(ggml_type, type_name(ggml_type), shape, data)
