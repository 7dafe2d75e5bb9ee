"""Arrays from addresses inside Numba kernels.

The hottest wrappers (a decode step calls the packed linear hundreds of times) pass
tensors to kernels as addresses: ``Tensor.numpy()`` alone costs ~3-5 us here, an
address ~0.5 us. The kernel rebuilds a 1-D array over the same memory with
:func:`view`; the element type comes from a dtype witness (an empty array of the
carrier dtype, ``numkern._check.WITNESS``).
"""

import numba
from numba import types
from numba.extending import intrinsic

from ._jit import jit


@intrinsic
def _to_voidptr(typingctx, addr):
    if not isinstance(addr, types.Integer):
        return None

    def codegen(context, builder, sig, args):
        return builder.inttoptr(args[0], context.get_value_type(types.voidptr))

    return types.voidptr(addr), codegen


@jit(inline="always")
def view(addr, n, witness):
    """1-D C-contiguous array of ``n`` elements of ``witness.dtype`` at ``addr``."""
    return numba.carray(_to_voidptr(addr), (n,), witness.dtype)


@intrinsic
def keep_alive(typingctx, arr):
    """Nothing, but a use of ``arr``: call it after the last access through an address
    taken from a kernel's own array (``arr.ctypes.data``). Numba releases a local array
    after its last use *as an array*, so without it the memory would be freed (and
    reused by another thread's allocation) while the address is still written."""
    if not isinstance(arr, types.Array):
        return None

    def codegen(context, builder, sig, args):
        return context.get_dummy_value()

    return types.void(arr), codegen
