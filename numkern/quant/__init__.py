"""Block-quantised weights: GGUF's Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K and
MXFP4 (GGUF's and GPT-OSS's safetensors form) kept quantised, repacked at load into
numkern's layout (docs/kernels.md §13).

Modules: :mod:`.formats` (the type table indexed by a type's ``code`` and the jit-able
``sections(code, n, k)``: the layout's one definition, shared with the kernels),
:mod:`.repack` (``QuantWeight``, ``repack``, ``repack_mxfp4``, ``dequantize``),
:mod:`.linear` (``quant_linear``) on the building blocks of :mod:`._kernels`.
"""

from .formats import QUANT_TYPES, code_of, sections
from .linear import quant_linear
from .repack import QuantWeight, dequantize, join_rows, repack, repack_mxfp4

__all__ = [
    "QUANT_TYPES",
    "QuantWeight",
    "code_of",
    "dequantize",
    "join_rows",
    "quant_linear",
    "repack",
    "repack_mxfp4",
    "sections",
]
