"""A small CPU inference engine on numkern's kernels."""

import os as _os

import numkern as _numkern
from numkern._jit import cache_tree as _cache_tree

# engine's kernels call numkern's: their cache entries follow both packages' sources
_cache_tree(_os.path.dirname(__file__), _os.path.dirname(_numkern.__file__))

from .layers import Linear, dispatch_unquantized_gemm  # noqa: E402 (after the cache tree)
from .llm import LLM, RequestOutput, SamplingParams  # noqa: E402

__all__ = ["LLM", "Linear", "RequestOutput", "SamplingParams", "dispatch_unquantized_gemm"]
