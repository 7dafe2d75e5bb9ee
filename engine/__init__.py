"""A small CPU inference engine on numkern's kernels."""

from .layers import Linear, dispatch_unquantized_gemm

__all__ = ["Linear", "dispatch_unquantized_gemm"]
