"""numkern: CPU LLM-inference kernels in pure Python, compiled by Numba at run time.

Importing numkern compiles nothing: kernels compile on first use (and are cached on
disk); :func:`warmup` compiles the common variants ahead of time.
"""

from . import isa
from .gemm import convert_weight_packed, weight_packed_linear, weight_packed_linear_cpu
from .isa import cpu_features, supported_isas
from .warmup import warmup

# Apply NUMKERN_CPU_FEATURES before anything can be compiled in this process.
isa._host()

__all__ = [
    "convert_weight_packed",
    "cpu_features",
    "isa",
    "supported_isas",
    "warmup",
    "weight_packed_linear",
    "weight_packed_linear_cpu",
]
__version__ = "0.1.0"
