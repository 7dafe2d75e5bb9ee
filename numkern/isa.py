"""CPU features and kernel variants ("ISAs"), read once per process.

The host's features come from LLVM (``llvmlite.binding.get_host_cpu_features``), the
same source Numba compiles for, so what numkern believes the CPU has and what the
compiled code may use never disagree.

``NUMKERN_CPU_FEATURES="-avx512f,-amx-tile"`` masks features at start-up: the mask
(with every feature that depends on a masked one) is removed from numkern's view *and*
from the feature string Numba's code generator targets, so a child process with the
mask runs the fallback code paths, compiled without the masked instructions, on a CPU
that has them all. The mask must be applied before Numba compiles its first function
in the process; a mask that arrives too late is an error, not a silent no-op.

``NUMKERN_ISA`` overrides the variant an engine would choose; it is validated against
:func:`supported_isas`, so asking for a variant this CPU cannot run is a ``ValueError``
and never a SIGILL. An override reaches :func:`attention_isa` and :func:`moe_isa` as a
name (checked there) or resolved once by :func:`resolve_override`, the one place a test
may pass ``layout_only=True``: the CPU is not asked, since numkern's kernels have no AMX
code (the ``amx`` variants are a layout the vector kernels read), so the engine's
``amx`` layouts run on any CPU; the reason logged is :data:`LAYOUT_OVERRIDE`.

The rules of the attention variants (block-size and head-dim multiples, dtypes, CPU
needs) and the selection rules of attention and MoE (docs/kernels.md §3) are one table
here, :data:`ATTENTION`: the kernels' checks and the engine's choice both read it.
"""

import ctypes
import functools
import logging
import math
import os
import platform
from typing import NamedTuple

import llvmlite.binding as llvm

from . import _check as C

ISAS = ("amx", "vec", "vec16", "neon")

# Features numkern reports (x86 then ARM names as LLVM spells them), one line per family
# (the one `fmt: skip` kept in numkern/: the formatter would put one name per line).
REPORTED = (
    "avx", "avx2", "fma", "f16c",
    "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512bf16", "avx512vnni", "avx512fp16",
    "avxvnni", "amx-tile", "amx-bf16", "amx-int8",
    "neon", "fp-armv8", "bf16", "dotprod", "fullfp16", "sve", "i8mm",
)  # fmt: skip


# LLVM's x86 features that imply AVX2 (so imply AVX), and those that imply AVX alone
# (X86.td's `Implies`): a mask must drop them too, since Numba's feature string is applied
# in name order and a later "+vaes" would switch AVX2 back on after "-avx2".
_NEEDS_AVX2 = ("avx512", "avx10", "avxvnni", "avxifma", "avxneconvert", "amx-", "vaes")
_NEEDS_AVX2 += ("sha512", "sm4")
_NEEDS_AVX = ("avx2", "fma", "f16c", "fma4", "xop", "vpclmulqdq", "sm3")


def _dependents(feature, names):
    """Features LLVM would also have to drop when ``feature`` is dropped."""
    if feature == "avx":
        return {n for n in names if n.startswith(_NEEDS_AVX2 + _NEEDS_AVX)}
    if feature == "avx2":
        return {n for n in names if n.startswith(_NEEDS_AVX2)}
    if feature == "avx512f":
        return {n for n in names if n.startswith(("avx512", "avx10", "amx-avx512"))}
    if feature == "amx-tile":
        return {n for n in names if n.startswith("amx-")}
    if feature == "neon":
        return {"bf16", "dotprod", "fullfp16", "sve", "sve2", "i8mm"} & set(names)
    return set()


def _parse_mask(text):
    masked = []
    for item in (t.strip() for t in text.split(",")):
        if not item:
            continue
        if not item.startswith("-"):
            raise ValueError(
                f"NUMKERN_CPU_FEATURES: expected comma-separated '-feature' items (features can "
                f"only be removed, never added), got {item!r}"
            )
        masked.append(item[1:].lower())
    return masked


def apply_mask(features, mask):
    """The features left of ``features`` (names, or ``{name: on}``) once ``mask`` (a
    ``NUMKERN_CPU_FEATURES`` value, ``"-avx512f,-amx-tile"``) removes its items and every
    feature LLVM makes depend on them; a frozenset. A pure function: the fallback run's
    features on any CPU class (:data:`CPU_CLASSES`) come from it as the host's do."""
    if isinstance(features, dict):
        features = [name for name, on in features.items() if on]
    names = frozenset(features)
    off = set()
    for f in _parse_mask(mask or ""):
        off |= {f} | _dependents(f, names)
    return names - off


@functools.cache
def _host():
    """(cpu name, {feature: bool} after masking, numba feature string or None)."""
    raw = dict(llvm.get_host_cpu_features())
    mask = os.environ.get("NUMKERN_CPU_FEATURES", "")
    for f in _parse_mask(mask):
        if f not in raw:
            raise ValueError(
                f"NUMKERN_CPU_FEATURES: unknown feature {f!r}; expected one of LLVM's "
                f"feature names for this host (e.g. avx512f, amx-tile, avx2)"
            )
    left = apply_mask(raw, mask)
    feats = {name: name in left for name in raw}
    numba_string = None
    if _parse_mask(mask):
        numba_string = ",".join(("+" if on else "-") + name for name, on in sorted(feats.items()))
        _apply_to_numba(numba_string)
    return llvm.get_host_cpu_name(), feats, numba_string


def _apply_to_numba(feature_string):
    from numba.core import config, registry

    if "_toplevel_target_context" in vars(registry.cpu_target) and (
        config.CPU_FEATURES != feature_string
    ):
        raise RuntimeError(
            "NUMKERN_CPU_FEATURES was set after Numba had already compiled code in this "
            "process; import numkern (or set NUMBA_CPU_FEATURES) before compiling anything"
        )
    config.CPU_FEATURES = feature_string


def narrower_mask():
    """``(mask, reason)``: the ``NUMKERN_CPU_FEATURES`` value that takes this CPU (its own
    features, not a mask's) down to the next narrower vector code numkern compiles, the one
    CI's fallback run tests (:func:`decide`'s ``fallback_mask``): AVX-512 (and AMX) masked
    -> 256-bit AVX2 code; AVX masked (AVX2, FMA, F16C with it) -> 128-bit SSE code.
    ``(None, reason)`` where nothing narrower is left (no AVX, or not x86)."""
    raw = dict(llvm.get_host_cpu_features())
    d = decide(llvm.get_host_cpu_name(), raw)
    return d.fallback_mask, d.why("fallback_mask")


def cpu_features():
    """``{feature: bool}`` for the features numkern cares about, after any mask."""
    feats = _host()[1]
    return {name: bool(feats.get(name, False)) for name in REPORTED}


def has(feature):
    """Whether the (masked) host has one LLVM feature, e.g. ``has("avx512f")``."""
    return bool(_host()[1].get(feature, False))


def is_x86():
    return platform.machine().lower() in ("x86_64", "amd64", "i686", "x86")


def has_avx512():
    """AVX-512 F+BW+VL: the 512-bit vector path of the SIMD module is native."""
    return has("avx512f") and has("avx512bw") and has("avx512vl")


_ARCH_REQ_XCOMP_PERM = 0x1023
_XFEATURE_XTILEDATA = 18
_SYS_ARCH_PRCTL = 158  # x86-64 syscall number


@functools.cache
def amx_permitted():
    """Ask Linux for the AMX tile state (once); False when the CPU or the OS says no.

    Without this grant the first tile instruction is SIGILL. The grant is per process
    and covers threads that already exist (the Numba and torch pools included).
    """
    if not (is_x86() and has("amx-tile") and has("amx-bf16")):
        return False
    if platform.system() != "Linux":
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.syscall(_SYS_ARCH_PRCTL, _ARCH_REQ_XCOMP_PERM, _XFEATURE_XTILEDATA) == 0:
        return True
    err = ctypes.get_errno()
    logging.getLogger("numkern").warning(
        "numkern: Linux refused the AMX tile state (arch_prctl(ARCH_REQ_XCOMP_PERM): %s); "
        "the AVX-512 kernels run instead of the tile ones",
        os.strerror(err) if err else "refused",
    )
    return False


# Test-only: "1" lets the ``amx`` kernels be asked for where the CPU has no tiles (or the
# kernel refuses them), and runs them on emulated tiles (numkern.amx); read at each call.
AMX_EMULATE_ENV = "NUMKERN_AMX_EMULATE"


def amx_emulated():
    """Whether this process runs asked-for AMX kernels on emulated tiles (test-only)."""
    return os.environ.get(AMX_EMULATE_ENV, "") == "1"


def amx_usable():
    return has_avx512() and has("avx512bf16") and amx_permitted()


@functools.cache
def supported_isas():
    """The variants numkern's kernels can run on this CPU, best first.

    ``vec``/``vec16`` are Numba code compiled for the host's own features, so they run on
    any CPU (with 512-bit registers where AVX-512 is present); ``amx`` needs AMX tiles,
    AVX512-BF16 and the kernel's permission; ``neon`` is the ARM name of the vec layout.
    """
    return decision().isas


def check_isa(isa, *, name="isa"):
    """Validate an ISA name against this CPU; returns it."""
    if not isinstance(isa, str):
        raise TypeError(f"{name}: expected a str, one of {ISAS}, got {type(isa).__name__}")
    if isa not in ISAS:
        raise ValueError(f"{name}: expected one of {ISAS}, got {isa!r}")
    if isa not in supported_isas():
        raise ValueError(
            f"{name}: {isa!r} cannot run on this CPU (supported here: {supported_isas()}; "
            f"features: {', '.join(k for k, v in cpu_features().items() if v) or 'none'})"
        )
    return isa


def isa_override():
    """The validated ``NUMKERN_ISA`` override, or None when it is not set."""
    value = os.environ.get("NUMKERN_ISA", "").strip()
    return check_isa(value, name="NUMKERN_ISA") if value else None


def describe():
    """One line for logs and benchmark headers: the CPU, its features and every decision
    of :func:`decision` (:func:`describe_decision`)."""
    return describe_decision(decision(), masked=_host()[2] is not None)


# ---------------------------------------------------------------------------------------
# the rules of the kernel variants: one table


class AttentionRule(NamedTuple):
    """What one attention variant serves and what it needs (docs/kernels.md §3.2, §6)."""

    isa: str
    block_multiple: int  # block_size a multiple of this
    head_dim_multiple: int  # head_dim a multiple of this, from 16 up to MAX_HEAD_DIM
    dtypes: tuple  # dtype names (as torch spells them) of the cache and the query
    cpu: str  # "amx": AMX tiles + AVX512-BF16 + the kernel's permission; "any": Numba
    # code for the host (x86, or ARM where it runs generic); "arm": an ARM CPU
    layout: str  # the cache layout it reads and writes


FLOAT_DTYPES = ("bfloat16", "float16", "float32")
MIN_HEAD_DIM = 16
MAX_HEAD_DIM = 512
# The variants as vLLM 0.32 defines them: amx loads K in 16-token groups of dim pairs and V
# in 16-dim groups of token pairs (bf16 pairs, so 32-dim and 32-key units); vec and neon
# take 32-key tiles of the plain layout; vec16 takes 16-key tiles (for head_dims that are
# multiples of 16 but not 32, and block sizes that are not multiples of 32).
ATTENTION = {
    "amx": AttentionRule("amx", 32, 32, ("bfloat16",), "amx", "amx"),
    "vec": AttentionRule("vec", 32, 16, FLOAT_DTYPES, "any", "vec"),
    "vec16": AttentionRule("vec16", 16, 16, FLOAT_DTYPES, "any", "vec"),
    "neon": AttentionRule("neon", 32, 16, FLOAT_DTYPES, "arm", "vec"),
}
# The MoE weight layouts: amx (bf16 pairs, tiles of 16 rows) and vec.
MOE_ISAS = ("amx", "vec")


class GemmRule(NamedTuple):
    """How the packed linear's tiles at M > 4 work on one kind of CPU.

    The per-CPU choices of ``numkern.gemm`` live here; each row names the CPU it was
    measured on (another CPU of the same path takes it untuned). With AVX-512 the register
    tile is 8 rows x 32 columns (16 zmm accumulators): on the Skylake-SP Xeon 4 rows were
    15-40% slower, and on the Zen 4 EPYC 8 rows of ``vdpbf16ps`` already run near its peak.
    Without it (16 ymm registers) the fma256 path widens weight panels to fp32 once and
    runs 6 x 16 tiles over them (``numkern._tiles.tile6``).
    """

    path: str  # "dpbf16": vdpbf16ps on the bf16 pairs; "widen": bf16 -> fp32, then FMA
    # (8x32 tiles on the packed weight); "fma256": fp32 panels, 6x16 FMA tiles
    k_slice: int  # K per cache slice: every row tile of a call passes over one slice of
    # the block's weight (32 columns x k_slice) while it stays in L1/L2
    moe_min_rows: int  # fused_moe takes this path from this many rows (tokens x k) per
    # expert on average (fewer: memory-bound, where the widening tiles were tuned)
    small_m: bool  # the packed linear at M <= 4 (decode, memory-bound) takes it too (a
    # bf16 x bf16 call; the "widen" row's value is unused)
    measured: str
    tile: str = "8x32"  # the register tile (rows x columns), for describe()
    min_m: int = 5  # the packed linear takes the path from this M (fma256; below it, and
    # at M <= 4 always, the widening tiles of the memory-bound case)


GEMM_PATHS = ("amx", "dpbf16", "fma256", "widen")
GEMM = {
    # Emerald Rapids Xeon (KVM, 2 vCPUs, 2 MB L2 per core): bf16 x bf16 from 5 rows on AMX
    # tiles, 2 x 2 tiles (32 rows x 32 columns) per K step of 32 (numkern.amx_gemm), the
    # block's weight panel in L2 across row groups. Decode (M <= 4) stays on dpbf16, as
    # vLLM, SGLang and llama.cpp keep it: memory-bound there. Figures: docs/kernels.md §4.4.
    "amx": GemmRule("amx", 32, 0, False, "Emerald Rapids Xeon", "32x32", 5),
    # AMD EPYC Zen 4 (32 KB L1d, 1 MB L2 per core), one thread, 4096x4096 and 11008x4096
    # at M = 16 and 128: ~220 GF/s, near vdpbf16ps's 64 flop/cycle; slices of 2048
    # (128 KB of bf16 weight, in L2) 3-5% faster than 512 and 256; the prefetch distance
    # (none to 64 K pairs ahead) within noise, so the widen tiles' distance is kept.
    # fused_moe (Qwen3-30B-A3B and GPT-OSS-20B shapes, one thread): 1.03-1.08x the
    # widening path at 0.5-2 rows per expert, 1.3-1.56x from 8. Decode (two threads,
    # quiet, weights past the L3), with the 1-row vdpbf16ps tile: fused_moe T = 1 1.14x
    # the widening tiles; the GEMV 11008x4096 at M = 1 0.72 of a 60 GB/s stream against
    # 0.61 widening (a core cannot widen at that rate), equal at a 35 GB/s stream. So
    # every M and every rows-per-expert takes the path here.
    "dpbf16": GemmRule("dpbf16", 2048, 0, True, "AMD EPYC (Zen 4 class)"),
    # Skylake-SP Xeon: 32 KB slices of bf16 weight (512 x 32 x 2 B).
    "widen": GemmRule("widen", 512, 0, True, "Skylake-SP Xeon"),
    # No AVX-512: AMD EPYC Zen 4 (2 vCPUs, shared) masked to AVX2 + FMA, a proxy for the
    # Zen 3 host (both: two 256-bit FMA pipes, 16 ymm). The 8x32 tile's 16 accumulators
    # are 32 ymm there and spill; fp32 panels (32 columns x 512 K, 64 KB, widened once per
    # block and slice) under 6x16 tiles (12 ymm accumulators, no spill: checked in the
    # asm). bench_gemm --quick, one thread (two-thread timings on the busy VM were
    # multiples of the scheduler's slice), bf16 4096x4096: M = 128 93 GFLOP/s, 0.79 of the
    # measured one-core FMA peak (118), 1.34x torch's fp32 linear, 1.58x the 8x32 tiles;
    # M = 16 1.57x torch fp32, 1.05-1.4x the 8x32 tiles; M = 5, 6, 12 1.2-1.4x them, M = 8
    # even: min_m 5. K slices of 128 to 1024 within the noise: 512. A 4x16 tile straight
    # on the packed weight (no panel) was not faster at M = 8-32.
    # fused_moe (Qwen3-30B-A3B, one thread): T = 32 (2 rows per expert: 4x16 register
    # tiles, panels from 6 rows) 1.24x the 8x32 tiles, 1.05x vLLM's _C_AVX2 vec op;
    # T = 512 (32 per expert) 1.66x the 8x32 tiles: from 2 rows per expert.
    "fma256": GemmRule("fma256", 512, 2, False, "AMD EPYC Zen 4, AVX-512 masked", "6x16", 5),
}


class PrefillTiles(NamedTuple):
    """The register tiles of the prefill attention kernel (``numkern.attention``) on one
    vector register file. A tile's accumulators plus the operands it keeps live must fit
    the registers: a 16-lane ``f32x16`` value is one zmm with AVX-512 and two ymm without
    it (4 q registers on ARM), and a tile that does not fit spills every FMA's accumulator
    to the stack. The tiles' results are bit-identical on every row (same FMA order)."""

    vector: str  # the register file the tiles are sized for
    group_rows: int  # query rows per softmax group; rows of the Q·K tile
    qk_keys: int  # keys per Q·K tile (16 per f32x16 value)
    pv_rows: int  # rows of the P·V tile
    pv_dims: int  # dims of the P·V tile (the rest of head_dim: 16 at a time)
    measured: str


PREFILL_TILES = {
    # Zen 4 EPYC and Emerald Rapids Xeon (32 zmm): Q·K 8 rows x 32 keys and P·V 4 rows x
    # 64 dims, 16 accumulators each (the GEMM's measured best tile, docs/kernels.md §4.2).
    "avx512": PrefillTiles("avx512", 8, 32, 4, 64, "AMD EPYC (Zen 4 class), Xeon"),
    # 16 ymm: 6 rows x 16 keys (Q·K) and 6 rows x 16 dims (P·V) are 12 ymm of
    # accumulators, with one key's (dim's) two ymm and a broadcast live. Measured on the
    # Zen 4 EPYC masked to AVX2 (NUMKERN_CPU_FEATURES=-avx512f: two 256-bit FMA pipes,
    # as Zen 3 has), prefill 1024 tokens, 32/8 heads, D 128, bf16: see docs/kernels.md
    # §6.6. Every CPU without AVX-512 takes it (ARM's 32 q registers hold it too).
    "avx2": PrefillTiles("avx2", 6, 16, 6, 16, "AMD EPYC (Zen 4 class) masked to AVX2"),
}


def prefill_tiles():
    """``(PrefillTiles, reason)`` of the (masked) host (:func:`decision`): ``avx512``
    where AVX-512 F+BW+VL is present, else ``avx2``."""
    d = decision()
    return PREFILL_TILES[d.prefill_tiles], d.why("prefill_tiles")


class StreamRule(NamedTuple):
    """How the memory-bound weight streams (decode GEMV, fused_moe at few tokens per
    expert, the 4-row tiles) read on one kind of CPU, keyed by LLVM's CPU name."""

    prefetch_k2: int  # K pairs ahead the tiles prefetch their weights; 0: no software
    # prefetch (the hardware prefetchers alone)
    measured: str
    # bytes of codes ahead the quantised GEMV (M = 1) prefetches its weight; 0: none.
    # Emerald Rapids Xeon VM, 2 threads, 4096x4096 past the L3, share of stream with none /
    # 1 / 2 / 4 KB ahead: Q4_K 0.67 / 0.70 / 0.75 / 0.64, Q8_0 0.68 / 0.68 / 0.69 / 0.73,
    # MXFP4 0.56 / 0.66 / 0.68 / 0.57
    quant_ahead: int = 2048


# Keyed by ``llvm.get_host_cpu_name()``; any other CPU takes STREAM_DEFAULT (untuned).
STREAM = {
    # AMD EPYC Zen 4 (KVM guest, 2 vCPUs, quiet, 1 GB of weight copies): the GEMV
    # 11008x4096 at M = 1, 1-row vdpbf16ps tile: 43.2 GB/s without software prefetch,
    # 25.7 / 31.1 / 35.6 GB/s prefetching 16 / 64 / 256 K pairs ahead (widening tile:
    # 36.3 without, 34.5 at 16); 4096x4096 the same order, closer together
    "znver4": StreamRule(0, "AMD EPYC (Zen 4 class)"),
}
# Skylake-SP Xeon: 16 K pairs ahead (2 KB of bf16 weight): the hardware streamer stops
# at every 4 KB page, and the GEMV reached 0.94-0.96 of stream with the prefetch.
STREAM_DEFAULT = StreamRule(16, "Skylake-SP Xeon")


def stream_rule():
    """The :class:`StreamRule` of the CPU Numba compiles for: LLVM's name of the host, or
    ``NUMBA_CPU_NAME`` where set (``NUMKERN_CPU_FEATURES`` leaves it as it is)."""
    return STREAM.get(decision().cpu, STREAM_DEFAULT)


def gemm_path():
    """``(path, reason)``: how the packed linear multiplies at M > 4 (and fused_moe at
    its ``moe_min_rows``), chosen from the (masked) CPU features: ``dpbf16`` (bf16 x bf16
    only; other dtypes widen) where AVX-512 with AVX512-BF16 is present, ``fma256`` (every
    dtype) where AVX-512 is absent, else ``widen``. Below ``numkern.gemm.DP_MIN_M`` rows
    the packed linear widens (docs/kernels.md §4.2); that is 1 where the row's
    ``small_m`` says decode takes the path too (``dpbf16``: every M), else 5."""
    d = decision()
    return d.gemm, d.why("gemm")


def check_gemm_path(path, *, name="path"):
    """``path`` validated: one of :data:`GEMM_PATHS` this CPU can run (``dpbf16`` needs
    AVX512-BF16); a TypeError or ValueError naming ``name`` otherwise."""
    if not isinstance(path, str):
        raise TypeError(f"{name}: expected None or a str, one of {GEMM_PATHS}, got {path!r}")
    if path not in GEMM_PATHS:
        raise ValueError(f"{name}: expected None or one of {GEMM_PATHS}, got {path!r}")
    if path == "dpbf16" and not decision().dp:
        raise ValueError(f"{name}: 'dpbf16' cannot run on this CPU ({gemm_path()[1]})")
    if path == "amx" and gemm_path()[0] != "amx" and not amx_emulated():
        raise ValueError(
            f"{name}: 'amx' cannot run on this CPU ({gemm_path()[1]}; {AMX_EMULATE_ENV}=1 "
            f"runs its tiles emulated, for tests)"
        )
    return path


def attention_rule(isa):
    """The :class:`AttentionRule` of ``isa``; ValueError for a name not in :data:`ISAS`."""
    if isa not in ATTENTION:
        raise ValueError(f"isa: expected one of {ISAS}, got {isa!r}")
    return ATTENTION[isa]


def _check_sizes(block_size, head_dim):
    """The validated ``(block_size, head_dim)``: ints >= 1 (TypeError / ValueError)."""
    return C.check_int("block_size", block_size, low=1), C.check_int("head_dim", head_dim, low=1)


def check_attention(isa, *, block_size, head_dim, dtype=None):
    """ValueError (naming the argument) when ``isa`` cannot serve this block size or head
    dim; TypeError when the sizes are not ints or ``isa`` does not take ``dtype`` (as
    :func:`numkern.attention.layout.check_cache` raises for a cache of that dtype)."""
    rule = attention_rule(isa)
    block_size, head_dim = _check_sizes(block_size, head_dim)
    m = rule.head_dim_multiple
    if head_dim % m or not MIN_HEAD_DIM <= head_dim <= MAX_HEAD_DIM:
        raise ValueError(
            f"head_dim: expected a multiple of {m} up to {MAX_HEAD_DIM} for {isa}, got {head_dim}"
        )
    if block_size % rule.block_multiple:
        raise ValueError(
            f"block_size: expected a multiple of {rule.block_multiple} for isa {isa!r}, "
            f"got {block_size}"
        )
    if dtype is not None and not serves_dtype(isa, dtype):
        raise TypeError(f"isa {isa!r} needs {' or '.join(rule.dtypes)}, got {dtype}")


def serves_dtype(isa, dtype):
    """Whether ``isa`` takes a cache and query of ``dtype`` (torch or NumPy dtype)."""
    return C.dtype_name(dtype) in attention_rule(isa).dtypes


# The reason a test's ``layout_only`` override is logged with (the engine's decision log).
LAYOUT_OVERRIDE = "test-only layout override, the CPU not checked"


class Override(NamedTuple):
    """A resolved ISA override: the name, and the reason the decision is logged with
    (``"override"``, or :data:`LAYOUT_OVERRIDE`)."""

    isa: str
    reason: str


def resolve_override(override, *, layout_only=False, name="isa override"):
    """The :class:`Override` of an ISA name: checked against this CPU (ValueError or
    TypeError naming ``name``), or with ``layout_only`` (tests only: module docstring)
    only by name. The one place ``layout_only`` is taken."""
    if not layout_only:
        return Override(check_isa(override, name=name), "override")
    if not isinstance(override, str) or override not in ISAS:
        raise ValueError(f"{name}: expected one of {ISAS}, got {override!r}")
    return Override(override, LAYOUT_OVERRIDE)


def attention_isa(dtype, block_size, head_dim, *, override=None, cpu=None):
    """``(isa, reason)``: the attention variant of a KV-cache group (docs/kernels.md §3.3,
    vLLM's rule in order): head_dim a multiple of 16 but not 32 -> vec16; AMX usable, bf16
    and block size a multiple of 32 -> amx; block size a multiple of 32 -> vec (neon on
    ARM); else vec16. ``override``: a name (checked against this CPU, not against the
    shape: call :func:`check_attention` on the result) or an :class:`Override` (resolved
    already: taken as it is). The sizes must be ints >= 1 and ``dtype`` one of
    :data:`FLOAT_DTYPES` (ValueError / TypeError naming them). ``cpu``: the
    :class:`Decision` to choose for (the host's by default: :func:`decision`)."""
    block_size, head_dim = _check_sizes(block_size, head_dim)
    if C.dtype_name(dtype) not in FLOAT_DTYPES:
        raise TypeError(f"dtype: expected {' or '.join(FLOAT_DTYPES)}, got {C.dtype_name(dtype)}")
    if override is not None:
        return tuple(override if isinstance(override, Override) else resolve_override(override))
    d = decision() if cpu is None else cpu
    vec, amx = ATTENTION["vec"], ATTENTION["amx"]
    if head_dim % ATTENTION["vec16"].head_dim_multiple == 0 and head_dim % amx.head_dim_multiple:
        return "vec16", f"head_dim {head_dim} is a multiple of 16 but not of 32"
    if (
        "amx" in d.isas
        and C.dtype_name(dtype) in amx.dtypes
        and block_size % amx.block_multiple == 0
    ):
        return "amx", "AMX usable, bf16, block size a multiple of 32"
    if block_size % vec.block_multiple == 0:
        why = f"block size {block_size} a multiple of 32"
        if "amx" not in d.isas:
            why += ", no usable AMX"
        return ("neon" if "neon" in d.isas else "vec"), why
    return "vec16", f"block size {block_size} not a multiple of 32"


def moe_isa(dtype, *, override=None, cpu=None):
    """``(isa, reason)``: the MoE weight layout and kernel variant: amx when AMX is usable
    and the dtype is bf16, else vec. ``override`` (a name, or an :class:`Override` whose
    reason is kept) must name one of :data:`MOE_ISAS` that takes ``dtype`` (amx: bf16
    only, a TypeError otherwise); a name is not checked against the CPU (the layouts run
    anywhere). ``cpu``: the :class:`Decision` to choose for (default: the host's)."""
    if override is not None:
        why = "override"
        if isinstance(override, Override):
            override, why = override
        if override not in MOE_ISAS:
            raise ValueError(f"moe isa override: expected one of {MOE_ISAS}, got {override!r}")
        if override == "amx" and C.dtype_name(dtype) != "bfloat16":
            raise TypeError(f"moe isa override: 'amx' needs bfloat16, got {C.dtype_name(dtype)}")
        return override, why
    d = decision() if cpu is None else cpu
    if d.moe_layout == "amx" and C.dtype_name(dtype) == "bfloat16":
        return "amx", "AMX usable and bf16"
    return "vec", "no usable AMX" if C.dtype_name(dtype) == "bfloat16" else f"dtype {dtype}"


def engine_block_multiple():
    """The block sizes an engine allows are multiples of this: the lcm of the x86 variants'
    multiples (32), so every x86 variant can serve any allowed block size, as vLLM's CPU
    backend requires since its seed fix."""
    return math.lcm(*(r.block_multiple for r in ATTENTION.values() if r.cpu != "arm"))


def engine_head_dims():
    """``(multiple, low, high)``: the head dims some variant serves (multiples of 16)."""
    return (
        math.gcd(*(r.head_dim_multiple for r in ATTENTION.values())),
        MIN_HEAD_DIM,
        MAX_HEAD_DIM,
    )


class QuantRule(NamedTuple):
    """How the quantised linear (``numkern.quant``) multiplies 16-bit activations on one
    kind of CPU (docs/kernels.md §13.7). fp32 activations always take the
    fp32 path (dequantised in registers, never quantised)."""

    path: str  # "vnni512" | "vnni256" | "maddubs": int8 activations; "fp32": dequantise
    needs: tuple  # LLVM features the path's instructions need
    measured: str


QUANT_PATHS = ("amx", "vnni512", "vnni256", "maddubs", "fp32")
# In order of preference; the first whose features the (masked) host has is taken.
QUANT = {
    # Emerald Rapids Xeon: AMX-INT8 tdpbssd tiles from 5 rows (numkern.quant._kernels
    # .qtiles), VNNI-512 below (decode: memory-bound); AMX only where Linux grants it
    "amx": QuantRule(
        "amx", ("amx-int8", "amx-tile", "avx512vnni", "avx512bw"), "Emerald Rapids Xeon"
    ),
    # AMD EPYC Zen 4: vpdpbusd on zmm, 16 u8 x s8 products of 4 per instruction
    "vnni512": QuantRule("vnni512", ("avx512vnni", "avx512bw"), "AMD EPYC (Zen 4 class)"),
    # AVX-VNNI (no AVX-512): the same instruction on two ymm halves (untuned: no such
    # host measured; its code runs on the Zen 4 through AVX512-VNNI + VL)
    "vnni256": QuantRule("vnni256", ("avxvnni",), "untuned (no AVX-VNNI host)"),
    # AVX2 (Zen 3), AVX-512 without VNNI (Skylake-SP): vpmaddubsw + vpmaddwd
    "maddubs": QuantRule("maddubs", ("avx2",), "AMD EPYC Zen 4 masked to AVX2"),
    # no AVX2: dequantise to fp32 in registers, then FMA
    "fp32": QuantRule("fp32", (), "no int8 dot product"),
}


def quant_path():
    """``(path, reason)``: the int8 path of the quantised linear for 16-bit activations on
    the (masked) host (:func:`decision`): the first row of :data:`QUANT` whose features
    it has."""
    d = decision()
    return d.quant, d.why("quant")


def check_quant_path(path, *, name="path"):
    """``path`` validated: one of :data:`QUANT_PATHS` this CPU can run (a TypeError or
    ValueError naming ``name`` otherwise). ``vnni256`` also runs where AVX512-VNNI + VL
    give its 256-bit instruction."""
    if not isinstance(path, str):
        raise TypeError(f"{name}: expected None or a str, one of {QUANT_PATHS}, got {path!r}")
    if path not in QUANT_PATHS:
        raise ValueError(f"{name}: expected None or one of {QUANT_PATHS}, got {path!r}")
    ok = all(has(f) for f in QUANT[path].needs) and (is_x86() or path == "fp32")
    if path == "vnni256":
        ok = ok or (has("avx512vnni") and has("avx512vl"))
    if path == "amx":  # AMX granted (decision), or emulated tiles over an int8 path
        ok = quant_path()[0] == "amx" or (amx_emulated() and quant_path()[0] != "fp32")
    if not ok:
        raise ValueError(
            f"{name}: {path!r} cannot run on this CPU (it needs {', '.join(QUANT[path].needs)}; "
            f"this CPU's path: {quant_path()[0]})"
        )
    return path


# ---------------------------------------------------------------------------------------
# every path decision: one pure function of (CPU name, features)


class Decision(NamedTuple):
    """What numkern runs on one CPU: every path a kernel or the engine chooses by the CPU,
    decided once by :func:`decide` from the CPU's LLVM name and features (docs/kernels.md
    §3.4 shows it for each class of :data:`CPU_CLASSES`)."""

    cpu: str  # LLVM's CPU name (only the stream rule reads it)
    features: frozenset  # the features decided on (AMX only where the kernel grants it)
    isas: tuple  # the attention variants that run, best first (:data:`ATTENTION`)
    attention: str  # the variant of a bf16 cache, blocks of 32, head_dim 128
    prefill_tiles: str  # the prefill attention's register tiles (:data:`PREFILL_TILES`)
    gemm: str  # the packed linear's path at M > 4, the decoder's too (:data:`GEMM`)
    moe_layout: str  # bf16 experts' weight layout (:data:`MOE_ISAS`)
    moe: str  # the experts' tiles from the path's moe_min_rows rows per expert
    quant: str  # the quantised linear's int8 path for 16-bit activations (:data:`QUANT`)
    gdn_bf16: bool  # GDN's chunked rule on vdpbf16ps for bf16 inputs (else fp32 FMA)
    prefetch_k2: int  # the weight streams' software prefetch distance (:data:`STREAM`)
    fallback_mask: object  # str | None: the mask of CI's fallback run (narrower code)
    reasons: tuple  # ((field, reason), ...) for the log

    @property
    def dp(self):
        """Whether bf16 GEMMs take ``vdpbf16ps`` (the dpbf16 path, and the amx path's rows
        below its ``min_m``)."""
        return self.gemm in ("amx", "dpbf16")

    def why(self, field):
        return dict(self.reasons)[field]


def _names(features):
    """``features`` (names, or ``{name: on}``) as a frozenset of names; a TypeError naming
    the argument for anything else."""
    if isinstance(features, dict):
        names = [name for name, on in features.items() if on]
    elif isinstance(features, (str, bytes)) or not hasattr(features, "__iter__"):
        names = None
    else:
        names = list(features)
    if names is None or not all(isinstance(n, str) for n in names):
        raise TypeError(
            f"features: expected LLVM feature names (an iterable of str, or {{name: on}}), "
            f"got {features!r:.80}"
        )
    return frozenset(names)


def _granted(features):
    """``features`` without AMX where Linux refuses the tile state (:func:`amx_permitted`)."""
    if amx_permitted():
        return features
    return frozenset(x for x in features if not x.startswith("amx-"))


def decide(cpu, features):
    """The :class:`Decision` of a CPU named ``cpu`` (LLVM's name) with ``features`` (LLVM's
    names, or ``{name: on}``): a pure function, evaluated for the host by :func:`decision`
    and for every class of :data:`CPU_CLASSES` by the tests. AMX counts only where
    ``amx-tile`` and ``amx-bf16`` are among ``features``: the host's lose them where Linux
    refuses the tile state (:func:`amx_permitted`). A TypeError names a ``cpu`` that is not
    a str or ``features`` that are not names."""
    if not isinstance(cpu, str):
        raise TypeError(f"cpu: expected LLVM's CPU name (a str), got {cpu!r:.80}")
    f = _names(features)
    x86 = "neon" not in f
    avx512 = {"avx512f", "avx512bw", "avx512vl"} <= f
    dp = x86 and avx512 and "avx512bf16" in f
    amx = x86 and dp and {"amx-tile", "amx-bf16"} <= f
    why = {}

    order = ISAS if x86 else ("neon", "vec", "vec16")
    runs = {"amx": amx, "arm": not x86, "any": True}
    isas = tuple(isa for isa in order if runs[ATTENTION[isa].cpu])
    if amx:
        attention, why["attention"] = "amx", "AMX usable, bf16, block size a multiple of 32"
    else:
        attention = "vec" if x86 else "neon"
        why["attention"] = "block size a multiple of 32, no usable AMX"

    prefill = "avx512" if avx512 else "avx2"
    why["prefill_tiles"] = (
        "AVX-512: 32 zmm registers"
        if avx512
        else "no AVX-512: 16 ymm registers (or 32 of 128 bits)"
    )

    if amx:
        gemm, why["gemm"] = "amx", "AMX usable: bf16 tiles from 5 rows, vdpbf16ps below"
    elif dp:
        gemm, why["gemm"] = "dpbf16", "AVX512-BF16: vdpbf16ps on the packed bf16 pairs"
    elif not avx512:
        gemm, why["gemm"] = "fma256", "no AVX-512: fp32 weight panels, 6x16 FMA tiles in 16 ymm"
    else:
        gemm, why["gemm"] = "widen", "AVX-512 without AVX512-BF16: bf16 widened to fp32, then FMA"
    moe_layout = "amx" if amx else "vec"
    why["moe_layout"] = "AMX usable and bf16" if amx else "no usable AMX"
    moe = gemm  # the bf16 experts: tiles need the amx layout (vdpbf16ps on the vec one)
    why["moe"] = why["gemm"]

    for rule in QUANT.values():
        if set(rule.needs) <= f and (x86 or rule.path == "fp32"):
            quant = rule.path
            why["quant"] = "+".join(rule.needs) or "no AVX2: no int8 dot product here"
            break
    why["gdn_bf16"] = "AVX512-BF16: vdpbf16ps on bf16 pairs" if dp else "no AVX512-BF16: fp32 FMA"
    stream = STREAM.get(cpu, STREAM_DEFAULT)
    why["prefetch_k2"] = f"measured on {stream.measured}"

    if not x86:
        mask, why["fallback_mask"] = None, "not an x86 CPU: no narrower vector path to mask"
    elif "avx512f" in f:
        mask = "-avx512f,-amx-tile"
        why["fallback_mask"] = "AVX-512 and AMX masked: the 256-bit AVX2 code"
    elif "avx" in f:
        mask, why["fallback_mask"] = "-avx", "AVX, AVX2, FMA and F16C masked: the 128-bit SSE code"
    else:
        mask = None
        why["fallback_mask"] = "no AVX on this CPU: the 128-bit SSE code is the main run's already"
    return Decision(
        cpu, f, isas, attention, prefill, gemm, moe_layout, moe, quant, dp,
        stream.prefetch_k2, mask, tuple(why.items()),
    )  # fmt: skip


def host_cpu():
    """``(name, features)`` :func:`decision` decides on: the CPU Numba compiles for
    (``NUMBA_CPU_NAME`` where set), the (masked) host's features, AMX only where
    :func:`amx_permitted`."""
    from numba.core import config

    name, feats, _ = _host()
    return config.CPU_NAME or name, _granted(_names(feats))


@functools.cache
def decision():
    """The host's :class:`Decision` (after ``NUMKERN_CPU_FEATURES``), read once."""
    return decide(*host_cpu())


class CpuClass(NamedTuple):
    """A class of CPU this project meets: LLVM's name of it and the features of that
    name in LLVM's CPU definitions (X86.td's ``ProcessorFeatures``; LLVM 22, llvmlite
    0.50), limited to those numkern reads (:data:`CLASS_FEATURES`). The x86 lists are
    checked against LLVM's code generator for each name (tests/test_isa_classes.py)."""

    llvm_name: str
    features: tuple
    seen: str  # where this project has run on one ("" if not yet)


# The features a decision or a kernel's code generation reads.
CLASS_FEATURES = (
    "sse2", "ssse3", "sse4.2", "avx", "avx2", "fma", "f16c", "avxvnni",
    "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512bf16", "avx512vnni", "avx512fp16",
    "amx-tile", "amx-bf16", "amx-int8", "neon", "fp-armv8", "dotprod", "fullfp16", "bf16",
)  # fmt: skip
_SSE = ("sse2", "ssse3", "sse4.2")
_AVX2 = (*_SSE, "avx", "avx2", "fma", "f16c")
_AVX512 = (*_AVX2, "avx512f", "avx512bw", "avx512vl", "avx512dq")
_SPR = (*_AVX512, "avx512vnni", "avx512bf16", "avx512fp16", "avxvnni")
_SPR += ("amx-tile", "amx-bf16", "amx-int8")
CPU_CLASSES = {
    "SSE-only x86 (x86-64-v2)": CpuClass("x86-64-v2", _SSE, ""),
    "Zen 3": CpuClass("znver3", _AVX2, "AMD EPYC family 25 model 1, KVM, 2 vCPUs"),
    "Alder Lake (AVX-VNNI, no AVX-512)": CpuClass("alderlake", (*_AVX2, "avxvnni"), ""),
    "Skylake-SP": CpuClass("skylake-avx512", _AVX512, "Xeon, KVM, 2 vCPUs"),
    "Ice Lake-SP": CpuClass("icelake-server", (*_AVX512, "avx512vnni"), ""),
    "Zen 4": CpuClass(
        "znver4", (*_AVX512, "avx512vnni", "avx512bf16"), "AMD EPYC family 25 model 17, KVM"
    ),
    "Zen 5": CpuClass("znver5", (*_AVX512, "avx512vnni", "avx512bf16", "avxvnni"), ""),
    "Sapphire Rapids": CpuClass("sapphirerapids", _SPR, ""),
    # Emerald Rapids: LLVM names the KVM guest seen here by its reported model (167:
    # "rocketlake") while its features are Emerald Rapids': decisions read features
    "Emerald Rapids": CpuClass("emeraldrapids", _SPR, "Xeon, KVM, 2 vCPUs (LLVM: rocketlake)"),
    "Granite Rapids": CpuClass("graniterapids", _SPR, ""),
    "ARM Neoverse N1": CpuClass("neoverse-n1", ("neon", "fp-armv8", "dotprod", "fullfp16"), ""),
}


def decide_class(name, mask=None):
    """:func:`decide` for a class of :data:`CPU_CLASSES`, with ``mask`` applied as
    ``NUMKERN_CPU_FEATURES`` would (:func:`apply_mask`); AMX taken as granted."""
    if name not in CPU_CLASSES:
        raise ValueError(f"name: expected one of {sorted(CPU_CLASSES)}, got {name!r}")
    c = CPU_CLASSES[name]
    return decide(c.llvm_name, apply_mask(c.features, mask))


def decision_under(mask):
    """:func:`decide` for this CPU with ``mask`` (a ``NUMKERN_CPU_FEATURES`` value) in place
    of any mask of this process: what a child process with that mask decides (tests ask
    it rather than name a path)."""
    raw = dict(llvm.get_host_cpu_features())
    return decide(llvm.get_host_cpu_name(), _granted(apply_mask(raw, mask)))


def describe_decision(d, *, masked=False):
    """:func:`describe`'s line for a :class:`Decision`."""
    feats = [k for k in REPORTED if k in d.features]
    rule, mrule = GEMM[d.gemm], GEMM[d.moe]
    moe = "widen" if d.moe == "widen" else f"{d.moe}(rows/expert>={mrule.moe_min_rows})"
    m_from = f",from_m={rule.min_m}" if rule.path in ("amx", "fma256") else ""
    pf = PREFILL_TILES[d.prefill_tiles]
    return (
        f"cpu={d.cpu} features=[{' '.join(feats)}] isas={list(d.isas)} "
        f"gemm={rule.path}(tile={rule.tile},k_slice={rule.k_slice}{m_from}) moe={moe} "
        f"prefetch={d.prefetch_k2 or 'none'} "
        f"attn_prefill=qk{pf.group_rows}x{pf.qk_keys},pv{pf.pv_rows}x{pf.pv_dims} "
        f"attn_bf16={d.attention} moe_bf16_layout={d.moe_layout} quant={d.quant} "
        f"gdn_bf16={'dpbf16' if d.gdn_bf16 else 'fp32'} fallback={d.fallback_mask or 'none'}"
    ) + (" (features masked by NUMKERN_CPU_FEATURES)" if masked else "")
