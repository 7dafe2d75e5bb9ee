"""A small CPU inference engine on numkern's kernels."""

from .layers import Linear, dispatch_unquantized_gemm
from .llm import LLM, RequestOutput, SamplingParams

__all__ = ["LLM", "Linear", "RequestOutput", "SamplingParams", "dispatch_unquantized_gemm"]
