"""numkern: CPU LLM-inference kernels in pure Python, compiled by Numba at run time.

Importing numkern compiles nothing and imports neither torch nor Numba: each public name
loads its module on first use (PEP 562), and kernels compile on their first call (and
are cached on disk); :func:`warmup` compiles the common variants ahead of time. The
start-up that must precede Numba's first compilation (the ``NUMKERN_CPU_FEATURES`` mask,
the threading layer) runs before any numkern kernel module loads (:mod:`numkern._boot`).
"""

import importlib
import importlib.util
import os
import sys
import types

# the public functions -> the module that defines each
_FUNCTIONS = {
    "convert_weight_packed": "gemm",
    "cpu_features": "isa",
    "huge_empty": "memory",
    "jit": "_jit",
    "supported_isas": "isa",
    "warmup": "warmup",
    "weight_packed_linear": "gemm",
    "weight_packed_linear_cpu": "gemm",
}
# the public submodules (any submodule loads on first access as an attribute)
_MODULES = (
    "attention",
    "decoder",
    "gdn",
    "isa",
    "memory",
    "moe",
    "norm",
    "quant",
    "rope",
    "simd",
    "testing",
)

__all__ = [
    "convert_weight_packed",
    "cpu_features",
    "huge_empty",
    "isa",
    "jit",
    "norm",
    "rope",
    "supported_isas",
    "warmup",
    "weight_packed_linear",
    "weight_packed_linear_cpu",
]
__version__ = "0.1.0"

if os.environ.get("NUMKERN_CPU_FEATURES") or "numba" in sys.modules:
    from . import _boot  # noqa: F401  (see its docstring: why now)


def __getattr__(name):
    if name in _FUNCTIONS:
        value = getattr(importlib.import_module(f"{__name__}.{_FUNCTIONS[name]}"), name)
    elif not name.startswith("__") and importlib.util.find_spec(f"{__name__}.{name}"):
        value = importlib.import_module(f"{__name__}.{name}")
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__():
    return sorted({*globals(), *_FUNCTIONS, *_MODULES})


class _Package(types.ModuleType):
    """numkern's module type. The import system binds a loaded submodule to the attribute
    of its name in the package, and ``numkern.warmup`` is both a submodule and the
    function it defines (``from numkern.warmup import prepare`` loads the module): the
    function keeps the name."""

    def __setattr__(self, name, value):
        if name in _FUNCTIONS and isinstance(value, types.ModuleType):
            value = getattr(value, name)
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package
