"""Reading a Hugging Face checkpoint directory: ``config.json``; ``model.safetensors``
or ``model.safetensors.index.json`` + shards (:mod:`engine.loader.safetensors_file`);
``tokenizer.json`` (optional) with ``tokenizers``, imported where it is used; the chat
template and the named special tokens from ``tokenizer_config.json``
(``chat_template.jinja`` and ``special_tokens_map.json`` where present). A multimodal
wrapper's vision tower and a hybrid's multi-token-prediction head are skipped by name."""

import json
import logging
import os

from .checkpoint import Checkpoint, TensorMap, convert, progress_bar, read_part, select_part
from .config import ModelConfig
from .safetensors_file import open_safetensors, open_safetensors_file

log = logging.getLogger("engine")


def load_hf_dir(path, dtype, progress, check=None):
    """A :class:`Checkpoint` of the HF directory ``path`` (``dtype``: as
    :func:`engine.loader.load_checkpoint`'s); ``check(config)`` runs on the config before
    any safetensors file is opened."""
    config_path = os.path.join(path, "config.json")
    if not os.path.isfile(config_path):
        raise ValueError(f"path: {path!r} has no config.json")
    config = ModelConfig.from_hf_dict(_read_json(config_path))
    if check is not None:
        check(config)

    index_path = os.path.join(path, "model.safetensors.index.json")
    single_path = os.path.join(path, "model.safetensors")
    if os.path.isfile(index_path):
        weight_map = _read_json(index_path).get("weight_map")
        if not isinstance(weight_map, dict) or not all(
            isinstance(v, str) for v in weight_map.values()
        ):
            raise ValueError(f"{index_path}: expected a 'weight_map' of tensor -> file names")
        shards = {}
        for name, shard in weight_map.items():
            shards.setdefault(shard, []).append(name)
    elif os.path.isfile(single_path):
        shards = None
    else:
        raise ValueError(
            f"path: {path!r} has neither model.safetensors nor model.safetensors.index.json "
            f"(found: {', '.join(sorted(os.listdir(path)))})"
        )
    if shards is None:
        with open_safetensors(single_path) as f:
            shards = {"model.safetensors": list(f.keys())}

    rename = _skipped_names(config, path)
    sources = {}  # HF name -> (SafetensorsFile, stored name)
    for shard, names in shards.items():
        f = open_safetensors_file(os.path.join(path, shard))
        missing = set(names) - set(f.keys())
        if missing:
            lacking = ", ".join(sorted(missing))
            raise ValueError(f"{shard}: the index lists tensors it lacks: {lacking}")
        for name in names:
            hf_name = rename(name)
            if hf_name is not None:  # None: skipped (vision, mtp)
                sources[hf_name] = (f, name)
    bar = progress_bar(None, len(sources), f"loading {os.path.basename(path)}", progress)
    tensors = SafetensorsTensors(sources, dtype, None if bar.disable else bar)

    tokenizer = None
    tokenizer_path = os.path.join(path, "tokenizer.json")
    if os.path.isfile(tokenizer_path):
        from tokenizers import Tokenizer

        try:
            tokenizer = Tokenizer.from_file(tokenizer_path)
        except Exception as e:  # tokenizers raises a bare Exception for a malformed file
            raise ValueError(f"{tokenizer_path}: not a readable tokenizer ({e})") from None
    return Checkpoint(config, tensors, tokenizer, path, *_hf_chat(path))


class SafetensorsTensors(TensorMap):
    """HF name -> tensor, read from its file's memory map when first read (in ``dtype``:
    :func:`engine.loader.load_checkpoint`'s), or only a part of it (:meth:`part`: a
    rank's rows or columns, ``safe_open(...).get_slice``), so that a rank never reads
    the others' shares. The files stay open (mapped) while the mapping lives."""

    def __init__(self, sources, dtype, bar=None):
        super().__init__(sources, bar)  # name -> (SafetensorsFile, stored name) or None
        self._dtype = dtype

    def shape(self, name):
        """The shape of tensor ``name`` from its file's header."""
        if name in self._made:
            return tuple(self._made[name].shape)
        f, stored = self._sources[name]
        return f.box(stored)[0]

    def part(self, name, part):
        """``part`` (``engine.loader.checkpoint.Part``) of tensor ``name``, read alone."""
        if name in self._made:
            return select_part(self._made[name], part)
        f, stored = self._sources[name]
        t = convert(read_part(*f.box(stored), part), self._dtype)
        self._tick()
        return t

    def _read(self, name):
        f, stored = self._sources[name]
        return convert(f.tensor(stored), self._dtype)


def _read_json(path):
    """The JSON object in the file ``path``; ValueError naming the file if it holds none."""
    try:
        with open(path, encoding="utf-8") as f:
            out = json.load(f)
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError
        raise ValueError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(out, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(out).__name__}")
    return out


# (model.language_model.*) and as published (language_model.model.*): -> the text
# model's names; its vision tower and projector are skipped
_TEXT_PREFIXES = (("model.language_model.", "model."), ("language_model.model.", "model."))
_TEXT_RENAMED = {"language_model.lm_head.weight": "lm_head.weight"}
_VISION_PREFIXES = (
    "model.vision_tower.",
    "vision_tower.",
    "model.multi_modal_projector.",
    "multi_modal_projector.",
    "model.visual.",  # Qwen3.5
    "visual.",
)
# Qwen3-Next / Qwen3.5's multi-token-prediction head (speculative decoding; not run)
_MTP_PREFIXES = ("mtp.", "model.mtp.", "model.language_model.mtp.")


def _skipped_names(config, path):
    """The stored name -> engine name map (None: skipped) of a checkpoint with tensors
    the engine does not run: a multimodal wrapper's vision tower (its language model
    renamed to the text model's names), the GDN families' ``mtp.*`` head. Logs once per
    kind what it skips."""
    skip = _MTP_PREFIXES if config.family.mtp_head else ()
    if config.text_of:
        skip += _VISION_PREFIXES
    logged = set()

    def rename(name):
        if name.startswith(skip):
            kind = "mtp" if name.startswith(_MTP_PREFIXES) else "vision"
            if kind not in logged:
                logged.add(kind)
                what = "multi-token-prediction" if kind == "mtp" else "vision"
                log.info(
                    "%s: %s, running its text model; %s tensors (%s...) are skipped",
                    path,
                    config.text_of or config.architecture,
                    what,
                    name,
                )
            return None
        if not config.text_of:
            return name
        for old, new in _TEXT_PREFIXES:
            if name.startswith(old):
                return new + name[len(old) :]
        return _TEXT_RENAMED.get(name, name)

    return rename


# the named special tokens of transformers' tokenizers (SPECIAL_TOKENS_ATTRIBUTES)
_SPECIAL_TOKEN_NAMES = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)


def _hf_chat(path):
    """(chat template or None, special tokens) of an HF directory, as transformers 5
    reads them: ``chat_template.jinja`` before ``tokenizer_config.json``'s
    ``chat_template`` (of a list of named templates, the one named "default"); the
    special tokens from ``tokenizer_config.json``, where one that predates
    ``added_tokens_decoder`` has them overridden by ``special_tokens_map.json``."""

    def read_json(name):
        p = os.path.join(path, name)
        return _read_json(p) if os.path.isfile(p) else {}

    config = read_json("tokenizer_config.json")
    template = config.get("chat_template")
    if isinstance(template, list):
        template = {t["name"]: t["template"] for t in template}.get("default")
    jinja_path = os.path.join(path, "chat_template.jinja")
    if os.path.isfile(jinja_path):
        with open(jinja_path) as f:
            template = f.read()
    named = dict(config)
    if "added_tokens_decoder" not in config:
        named.update(read_json("special_tokens_map.json"))
    special = {}
    for name in _SPECIAL_TOKEN_NAMES:
        tok = named.get(name)
        if isinstance(tok, dict):  # a serialized AddedToken
            tok = tok.get("content")
        if tok:
            special[name] = tok
    return template, special
