"""numkern: CPU LLM-inference kernels in pure Python, compiled by Numba at run time.

Importing numkern compiles nothing: kernels compile on first use (and are cached on
disk); :func:`warmup` compiles the common variants ahead of time.
"""

from . import isa

# NUMKERN_CPU_FEATURES must reach Numba's code generator before anything creates it
# (registering the SIMD types does), so the mask is applied before the other imports.
isa._host()

# isort: split
from . import _threads  # noqa: E402

# Numba's threading layer must take launches from several Python threads (not workqueue)
_threads.require_threadsafe_layer()

# isort: split
from . import norm, rope  # noqa: E402  (modules: import compiles nothing)
from ._jit import jit  # noqa: E402  (the decorator numkern's kernels use)
from .gemm import convert_weight_packed, weight_packed_linear, weight_packed_linear_cpu  # noqa: E402
from .isa import cpu_features, supported_isas  # noqa: E402
from .warmup import warmup  # noqa: E402

__all__ = [
    "convert_weight_packed",
    "cpu_features",
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
