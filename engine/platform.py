"""The CPU platform: features read once, kernel variants decided once and logged once.

Attention ISA (DESIGN §5, vLLM's rule, in order): head_dim a multiple of 16 but not 32
-> ``vec16``; AMX usable, bf16, block size a multiple of 32 -> ``amx``; block size a
multiple of 32 -> ``vec`` (``neon`` on ARM); else ``vec16``. MoE: ``amx`` (its weight
layout) when AMX is usable and the dtype is bf16, else ``vec``. An override (argument
or ``NUMKERN_ISA``) is validated against the CPU and the shape.
"""

import logging

import torch

from numkern import isa as nk_isa

log = logging.getLogger("engine")

DEFAULT_BLOCK_SIZE = 128
_logged = set()


def log_once(key, msg, *args):
    """Log a decision at INFO once per process (not per layer or per step)."""
    if key not in _logged:
        _logged.add(key)
        log.info(msg, *args)


def get_attn_isa(dtype, block_size, head_dim, kv_cache_dtype="auto", *, override=None):
    """The attention variant of one KV-cache group (see the module docstring)."""
    if kv_cache_dtype != "auto":
        raise ValueError(f"kv_cache_dtype: only 'auto' (the model dtype) is supported, got "
                         f"{kv_cache_dtype!r}")  # fmt: skip
    override = override or nk_isa.isa_override()
    if override is not None:
        nk_isa.check_isa(override, name="isa override")
        isa, why = override, "override"
    elif head_dim % 16 == 0 and head_dim % 32 != 0:
        isa, why = "vec16", f"head_dim {head_dim} is a multiple of 16 but not of 32"
    elif nk_isa.amx_usable() and dtype == torch.bfloat16 and block_size % 32 == 0:
        isa, why = "amx", "AMX usable, bf16, block size a multiple of 32"
    elif block_size % 32 == 0:
        isa = "vec" if nk_isa.is_x86() else "neon"
        why = f"block size {block_size} a multiple of 32" + ("" if nk_isa.amx_usable() else
                                                             ", no usable AMX")  # fmt: skip
    else:
        isa, why = "vec16", f"block size {block_size} not a multiple of 32"
    need = {"amx": 32, "vec": 32, "neon": 32, "vec16": 16}[isa]
    if block_size % need or head_dim % (32 if isa == "amx" else 16):
        raise ValueError(f"isa {isa!r} cannot serve block size {block_size} and head_dim "
                         f"{head_dim}")  # fmt: skip
    if isa == "amx" and dtype != torch.bfloat16:
        raise ValueError(f"isa 'amx' needs bfloat16, got {dtype}")
    log_once(("attn", dtype, block_size, head_dim, isa),
             "attention ISA %s for dtype=%s block_size=%d head_dim=%d (%s)", isa,
             str(dtype).replace("torch.", ""), block_size, head_dim, why)  # fmt: skip
    return isa


def get_moe_isa(dtype, *, override=None):
    """The MoE weight layout / kernel variant, decided once per model."""
    if override is not None:
        if override not in ("amx", "vec"):
            raise ValueError(f"moe isa override: expected 'amx' or 'vec', got {override!r}")
        isa, why = override, "override"
    elif nk_isa.amx_usable() and dtype == torch.bfloat16:
        isa, why = "amx", "AMX usable and bf16"
    else:
        isa, why = "vec", "no usable AMX" if dtype == torch.bfloat16 else f"dtype {dtype}"
    log_once(("moe", dtype, isa), "MoE ISA %s for dtype=%s (%s)", isa, dtype, why)
    return isa
