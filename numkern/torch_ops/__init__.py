"""numkern's ops as torch custom ops: ``torch.ops.numkern.<name>`` (``docs/kernels.md``
§12). Importing this package defines them all (``import numkern`` does not)."""

from . import attention, decoder, gdn, gemm, moe, norm_rope  # noqa: F401  (each defines its ops)
from ._lib import LIB, NAMESPACE, define
from .decoder import register_stack

__all__ = ["LIB", "NAMESPACE", "define", "register_stack"]
