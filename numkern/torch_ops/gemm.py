"""numkern's gemm ops as torch custom ops (see ``_lib``)."""
