"""The engine's options, each in one place: a field of :class:`EngineArgs` (``LLM``'s),
:class:`ServeArgs` (the HTTP server's) or ``SamplingParams`` (``engine.sampling``) with
its default, its check and its help.

* ``LLM(model, **kw)`` builds ``EngineArgs(model=model, **kw)``: the checks run there,
  before anything is read or started (a ValueError naming the field, the expected and the
  got; an unknown keyword is the dataclass's TypeError).
* Tensor parallelism ships the same frozen object to every worker (:func:`worker_args`):
  a worker's engine is built from rank 0's fields, ``progress`` off.
* ``python -m engine``'s flags are generated from the fields (:func:`add_options`):
  ``--max-num-seqs`` for ``max_num_seqs``, the field's default, its ``help``; a field
  with ``cli=False`` in its metadata has no flag (``progress``, the test-only
  ``_layout_isa``), a bool field is a ``store_true`` flag.
  :func:`option_of` maps a ValueError's field back to its flag for the CLI's exit 2.

The one integer and number test of the engine is here (:func:`is_int`, :func:`is_number`):
a NumPy integer is an int, a bool is not.
"""

import dataclasses
import math
import numbers
import operator
from dataclasses import dataclass, field

import numba

from .numa import check_numa_bind
from .platform import DEFAULT_BLOCK_SIZE

__all__ = [
    "EngineArgs",
    "ServeArgs",
    "add_options",
    "from_options",
    "is_int",
    "is_number",
    "option",
]


def is_int(v):
    """Whether ``v`` is an integer (Python's or NumPy's; not a bool)."""
    return isinstance(v, numbers.Integral) and not isinstance(v, bool)


def is_number(v):
    """Whether ``v`` is a finite real number (not a bool)."""
    return isinstance(v, numbers.Real) and not isinstance(v, bool) and math.isfinite(v)


def option(default, help, type=None, cli=True):
    """A field: its default, the CLI flag's help and type (the default's when None)."""
    return field(default=default, metadata={"help": help, "type": type, "cli": cli})


def _fail(name, expected, got):
    raise ValueError(f"{name}: expected {expected}, got {got!r:.80}")


def _normalise_ints(obj, names):
    """NumPy integers stored as Python ints (a frozen dataclass: object.__setattr__)."""
    for name in names:
        v = getattr(obj, name)
        if is_int(v):
            object.__setattr__(obj, name, operator.index(v))


@dataclass(frozen=True)
class EngineArgs:
    """``LLM``'s options (module docstring). ``model``: a checkpoint directory (Hugging
    Face) or a ``.gguf`` file."""

    model: object = option(None, "checkpoint directory or .gguf file", cli=False)
    dtype: object = option("bfloat16", "bfloat16, float16 or float32 (a torch dtype too)", str)
    block_size: int = option(DEFAULT_BLOCK_SIZE, "KV-cache block size (tokens)")
    kv_cache_memory: int | None = option(
        None, "bytes of KV cache and GDN states (default: 0.3 of free RAM)", int
    )
    max_model_len: int | None = option(
        None, "context length (default: the checkpoint's max_position_embeddings)", int
    )
    max_num_seqs: int = option(64, "requests running at once")
    max_num_batched_tokens: int = option(2048, "tokens per step")
    isa: str | None = option(
        None,
        "the attention variant of every KV-cache group, validated against this CPU "
        "(default: NUMKERN_ISA, else numkern.isa's rule)",
        str,
    )
    quantization: str = option(
        "auto",
        "auto: a GGUF file's quantised weights run in their type (engine.quant); none: "
        "dequantised to --dtype at load",
    )
    torch_threads: int | None = option(
        None,
        "torch's intra-op threads inside the engine's calls (default: "
        "engine.platform.engine_torch_threads)",
        int,
    )
    tensor_parallel_size: int = option(
        1, "processes the model is split across (spawned here, or torchrun's; engine.dist)"
    )
    enable_expert_parallel: bool = option(
        False, "MoE experts partitioned whole across the ranks (else split along their width)"
    )
    threads_per_rank: int | None = option(
        None, "Numba threads of each rank (default: this host's cores shared among its ranks)", int
    )
    numa_bind: str = option(
        "auto",
        "each rank's threads and memory bound to its part of a NUMA node of this host "
        "(engine.numa): auto where the host has several nodes and its ranks spread evenly "
        "over them, on (refused where impossible), off",
    )
    dist_timeout: float = option(
        120.0, "seconds a collective may wait (a rank lost past it is named)"
    )
    collectives: str = option(
        "auto",
        "auto: shared memory when every rank is on this host, else gloo; shm (or an error); "
        "gloo (engine.dist.connect)",
    )
    progress: bool = option(True, "a bar on stderr while the checkpoint loads", cli=False)
    # test-only (no flag, no environment variable): "amx" or "vec", the layout of every
    # KV-cache group's attention and of the MoE weights on any CPU. numkern's amx variants
    # have no AMX code (their layouts are plain data the vector kernels read), so tests
    # compare an amx engine with a vec one bit for bit where AMX is absent; it goes through
    # numkern.isa's table with only the CPU check skipped (not with isa)
    _layout_isa: str | None = option(None, "", cli=False)

    def __post_init__(self):
        from .attention import CPUAttentionBackend
        from .quant import check_quantization

        _normalise_ints(self, [f.name for f in dataclasses.fields(self)])
        if self.torch_dtype not in CPUAttentionBackend.dtypes:
            _fail("dtype", "bfloat16, float16 or float32", self.dtype)
        for name, low in (("block_size", 1), ("max_num_seqs", 1), ("max_num_batched_tokens", 1)):
            if not (is_int(getattr(self, name)) and getattr(self, name) >= low):
                _fail(name, f"an int >= {low}", getattr(self, name))
        # max_model_len: a prompt token and one more
        for name, low in (("max_model_len", 2), ("kv_cache_memory", 1), ("torch_threads", 1)):
            v = getattr(self, name)
            if v is not None and not (is_int(v) and v >= low):
                _fail(name, f"an int >= {low}", v)
        if not isinstance(self.progress, bool):
            _fail("progress", "a bool", self.progress)
        check_quantization(self.quantization)
        CPUAttentionBackend.check_block_size(self.block_size)
        self._check_parallel()

    def _check_parallel(self):
        most = numba.config.NUMBA_NUM_THREADS
        if not (is_int(self.tensor_parallel_size) and self.tensor_parallel_size >= 1):
            _fail("tensor_parallel_size", "an int >= 1", self.tensor_parallel_size)
        if not isinstance(self.enable_expert_parallel, bool):
            _fail("enable_expert_parallel", "a bool", self.enable_expert_parallel)
        t = self.threads_per_rank
        if t is not None and not (is_int(t) and 1 <= t <= most):
            _fail("threads_per_rank", f"None or an int in [1, {most}] (NUMBA_NUM_THREADS)", t)
        check_numa_bind(self.numa_bind)
        if not (is_number(self.dist_timeout) and self.dist_timeout > 0):
            _fail("dist_timeout", "a number of seconds > 0", self.dist_timeout)
        if self.collectives not in ("auto", "shm", "gloo"):
            _fail("collectives", "auto, shm or gloo", self.collectives)

    @property
    def torch_dtype(self):
        """``dtype`` as a torch dtype (None for a name torch does not have)."""
        import torch

        return getattr(torch, self.dtype, None) if isinstance(self.dtype, str) else self.dtype


def worker_args(args):
    """What a tensor-parallel worker's engine is built from: rank 0's options, no bar."""
    return dataclasses.replace(args, progress=False)


@dataclass(frozen=True)
class ServeArgs:
    """``python -m engine serve``'s own options (``engine.serve``)."""

    host: str = option("127.0.0.1", "address to listen on")
    port: int = option(8000, "port to listen on")
    served_model_name: str | None = option(
        None, "the model's name in the API (default: the MODEL argument as given)", str
    )
    max_waiting: int = option(
        256, "requests that may wait beyond --max-num-seqs running; more get 429"
    )
    shutdown_timeout: float = option(
        30.0, "seconds SIGTERM / Ctrl-C lets running requests finish before aborting them"
    )

    def __post_init__(self):
        _normalise_ints(self, ("port", "max_waiting"))
        if not isinstance(self.host, str):
            _fail("host", "a host name or address", self.host)
        if not (is_int(self.port) and 0 <= self.port <= 65535):
            _fail("port", "an int in [0, 65535]", self.port)
        if not (self.served_model_name is None or isinstance(self.served_model_name, str)):
            _fail("served_model_name", "None or a string", self.served_model_name)
        if not (is_int(self.max_waiting) and self.max_waiting >= 0):
            _fail("max_waiting", "an int >= 0", self.max_waiting)
        if not (is_number(self.shutdown_timeout) and self.shutdown_timeout >= 0):
            _fail("shutdown_timeout", "seconds >= 0", self.shutdown_timeout)


def flag(name):
    """The CLI flag of a field: ``max_num_seqs`` -> ``--max-num-seqs``."""
    return "--" + name.replace("_", "-")


def cli_fields(cls):
    """The fields of ``cls`` (a dataclass of options) that are CLI flags."""
    return [f for f in dataclasses.fields(cls) if f.metadata.get("cli", False)]


def add_options(parser, cls, defaults=None):
    """A flag for each CLI field of ``cls``: its name, type, default (``defaults`` may
    override one: the CLI's own, e.g. greedy sampling) and help."""
    defaults = defaults or {}
    for f in cli_fields(cls):
        default = defaults.get(f.name, f.default)
        if isinstance(f.default, bool):
            parser.add_argument(flag(f.name), action="store_true", help=f.metadata["help"])
            continue
        kind = f.metadata["type"] or type(f.default)
        parser.add_argument(flag(f.name), type=kind, default=default, help=f.metadata["help"])


def from_options(cls, namespace, **extra):
    """``cls`` built from a parsed namespace's values of its CLI fields (and ``extra``)."""
    return cls(**{f.name: getattr(namespace, f.name) for f in cli_fields(cls)}, **extra)


def option_of(field_name, classes):
    """The flag of a field of one of ``classes``, or None (a ValueError that names it is a
    bad option value: the CLI's exit 2)."""
    for cls in classes:
        if any(f.name == field_name for f in cli_fields(cls)):
            return flag(field_name)
    return None
