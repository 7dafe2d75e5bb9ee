"""Input checks and zero-copy interop shared by every public op.

Errors name the argument, what was expected and what was received: ``TypeError`` for a
wrong type, dtype or device, ``ValueError`` for a wrong shape, stride, range or value.

Interop: a CPU torch tensor reaches a kernel without a copy, either as a NumPy view
(:func:`as_numpy`) or, on the hottest paths, as its address (:func:`address`) from
which the kernel builds its own array (``numkern._ptr``). 16-bit floats travel as
integer bits, because Numba has no bf16 or fp16 arrays: bf16 as ``uint16`` and fp16 as
``int16`` — the two carriers are distinct types, so one kernel source compiles to one
specialisation per dtype (see ``numkern.simd``).
"""

import bisect
import itertools
import math

import numpy as np
import torch

FLOATS = (torch.bfloat16, torch.float16, torch.float32)

# torch dtype -> the NumPy dtype a kernel sees.
CARRIER = {
    torch.bfloat16: np.dtype(np.uint16),
    torch.float16: np.dtype(np.int16),
    torch.float32: np.dtype(np.float32),
    torch.int32: np.dtype(np.int32),
    torch.int64: np.dtype(np.int64),
}
# One empty array per carrier: passed to kernels that build arrays from addresses, so
# the element type is a compile-time type without a separate kernel per dtype.
WITNESS = {dt: np.empty(0, c) for dt, c in CARRIER.items()}

_NUMPY_TO_TORCH = {
    np.dtype(np.float16): torch.float16,
    np.dtype(np.float32): torch.float32,
    np.dtype(np.int32): torch.int32,
    np.dtype(np.int64): torch.int64,
}
# torch dtype -> the torch dtype of its carrier (the 16-bit floats as integer bits).
TORCH_CARRIER = {
    torch.bfloat16: torch.uint16,
    torch.float16: torch.int16,
    torch.float32: torch.float32,
}


def dtype_name(dt):
    return str(dt).replace("torch.", "")


def dtype_of(name, x):
    """The torch dtype of a tensor or (fp16/fp32/int) NumPy array; TypeError otherwise."""
    if isinstance(x, torch.Tensor):
        if not x.is_cpu:
            raise TypeError(f"{name}: expected a CPU tensor, got device {x.device}")
        return x.dtype
    if isinstance(x, np.ndarray):
        dt = _NUMPY_TO_TORCH.get(x.dtype)
        if dt is None:
            raise TypeError(
                f"{name}: NumPy dtype {x.dtype} is not accepted (fp16, fp32, int32, int64; "
                f"bf16 only as a torch tensor)"
            )
        return dt
    raise TypeError(f"{name}: expected a torch.Tensor or numpy.ndarray, got {type(x).__name__}")


def check_dtype(name, x, allowed):
    dt = dtype_of(name, x)
    if dt not in allowed:
        raise TypeError(
            f"{name}: expected dtype {' or '.join(dtype_name(a) for a in allowed)}, "
            f"got {dtype_name(dt)}"
        )
    return dt


def check_shape(name, x, shape):
    """``shape`` may hold None for a free dimension."""
    got = tuple(x.shape)
    if len(got) != len(shape) or any(s is not None and s != g for s, g in zip(shape, got)):
        want = "[" + ", ".join("*" if s is None else str(s) for s in shape) + "]"
        raise ValueError(f"{name}: expected shape {want}, got {list(got)}")


def check_ndim(name, x, ndims):
    if x.ndim not in ndims:
        raise ValueError(
            f"{name}: expected {' or '.join(f'{n}-D' for n in ndims)}, got {x.ndim}-D "
            f"shape {list(x.shape)}"
        )


def strides_of(x):
    """Strides in elements (torch and NumPy alike)."""
    if isinstance(x, torch.Tensor):
        return x.stride()
    return tuple(s // x.itemsize for s in x.strides)


def check_inner_contiguous(name, x):
    """Last dim unit-stride (rows may have any stride)."""
    if x.ndim and x.shape[-1] > 1 and strides_of(x)[-1] != 1:
        raise ValueError(f"{name}: expected stride(-1) == 1, got strides {list(strides_of(x))}")


def check_non_negative_strides(name, x):
    """No negative stride (a NumPy view may have one; kernels index forward)."""
    if any(s < 0 for s in strides_of(x)):
        raise ValueError(f"{name}: expected non-negative strides, got {list(strides_of(x))}")


def check_contiguous(name, x):
    ok = x.is_contiguous() if isinstance(x, torch.Tensor) else x.flags.c_contiguous
    if not ok:
        raise ValueError(
            f"{name}: expected a contiguous tensor, got shape {list(x.shape)} with strides "
            f"{list(strides_of(x))}"
        )


def check_same_dtype(name, x, dtype, other_name):
    dt = dtype_of(name, x)
    if dt != dtype:
        raise TypeError(
            f"{name}: expected dtype {dtype_name(dtype)} (that of {other_name}), "
            f"got {dtype_name(dt)}"
        )


def check_tensor(name, x, dtype, shape):
    """``x`` checked: a contiguous CPU torch tensor of ``dtype`` and ``shape`` (None: a
    free dimension); returns it."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(x).__name__}")
    check_dtype(name, x, (dtype,))
    check_shape(name, x, shape)
    check_contiguous(name, x)
    return x


def tensor_address(name, x, dtype, shape):
    """The address of ``x`` checked by :func:`check_tensor`; 0 for None (an optional
    tensor a kernel reads by address)."""
    return 0 if x is None else address(check_tensor(name, x, dtype, shape))


def check_int(name, value, *, low=None):
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name}: expected an int, got {type(value).__name__}")
    if low is not None and value < low:
        raise ValueError(f"{name}: expected an int >= {low}, got {value}")
    return int(value)


def check_float(name, value, *, positive=False, low=None):
    """``value`` (a Python or NumPy int or float, not a bool) as a finite float, ``> 0``
    with ``positive``, ``>= low`` with ``low``; TypeError / ValueError naming ``name``."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(
        value, (int, float, np.integer, np.floating)
    ):
        raise TypeError(f"{name}: expected a float, got {type(value).__name__}")
    x = float(value)
    if not math.isfinite(x) or (positive and x <= 0.0) or (low is not None and x < low):
        want = "> 0" if positive else f">= {low}" if low is not None else ""
        raise ValueError(f"{name}: expected a finite float {want}".rstrip() + f", got {x}")
    return x


def check_bool(name, value):
    """``value`` as a bool (a Python or NumPy bool only); TypeError naming ``name``."""
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name}: expected a bool, got {type(value).__name__}")
    return bool(value)


PAD_SLOT = -1  # vLLM's PAD_SLOT_ID: a padded request's state slot


def check_slots(name, slots, num_slots):
    """Per-request state slots (int64 NumPy): each in ``[0, num_slots)`` or ``PAD_SLOT``
    (padding), no slot twice (two requests would update one state); ValueError naming
    ``name`` otherwise."""
    bad = (slots != PAD_SLOT) & ((slots < 0) | (slots >= num_slots))
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        raise ValueError(
            f"{name}: expected slots >= 0 and < num_slots = {num_slots} (or {PAD_SLOT}: "
            f"padding), got {int(slots[i])} at {i}"
        )
    live = np.sort(slots[slots != PAD_SLOT])
    same = live[1:] == live[:-1]
    if same.any():
        raise ValueError(
            f"{name}: expected distinct slots (two requests would update one state), got "
            f"slot {int(live[1:][same][0])} twice"
        )
    return slots


def _byte_span(x):
    """[first, end) byte addresses of ``x``'s elements; None when a stride is negative."""
    if isinstance(x, torch.Tensor):
        shape, st, first, size = x.shape, x.stride(), x.data_ptr(), x.element_size()
    else:
        shape, st, first, size = x.shape, strides_of(x), address(x), x.itemsize
    last = 0
    for n, s in zip(shape, st):
        if n == 0:
            return (0, 0)
        if s < 0:
            return None
        last += (n - 1) * s
    return first, first + (last + 1) * size


def check_disjoint(name, x, other_name, other, why="both are written"):
    """ValueError when ``x`` and ``other`` (tensors or arrays) share an element: an exact
    test of their strided memory (``numpy.shares_memory``), so windows of one buffer that
    touch different elements (q and k columns of a qkv buffer) pass. Spans that do not
    meet (the common case: separate buffers) are told apart from addresses alone."""
    a, b = _byte_span(x), _byte_span(other)
    if a is not None and b is not None and (a[0] >= b[1] or b[0] >= a[1]):
        return
    if np.shares_memory(as_numpy(x), as_numpy(other)):
        raise ValueError(
            f"{name}: expected memory apart from {other_name}'s ({why}), got one "
            f"that shares elements with it"
        )


def contiguous_bytes(x):
    """[first, end) byte addresses of a contiguous tensor or array (its elements, from
    the first one's address and its size alone: what :func:`_byte_span` computes for any
    strides, at a fraction of the cost on a hot path)."""
    if isinstance(x, torch.Tensor):
        first = x.data_ptr()
        return first, first + x.numel() * x.element_size()
    first = address(x)
    return first, first + x.size * x.itemsize


def check_apart(name, x, other_name, other, why):
    """ValueError when the contiguous tensors or arrays ``x`` and ``other`` share bytes:
    :func:`check_disjoint` for contiguous memory, from the two byte ranges alone."""
    a0, a1 = contiguous_bytes(x)
    b0, b1 = contiguous_bytes(other)
    if a0 < b1 and b0 < a1:
        raise ValueError(
            f"{name}: expected memory apart from {other_name}'s ({why}), got one that "
            f"shares bytes with it"
        )


def disjoint_ranges(named, why):
    """``named``: ``(name, (first, end))`` byte ranges. Returns them sorted, as
    ``(starts, ends, names)`` (what :func:`check_outside` tests against); ValueError naming
    the later of two that share bytes (``why``: why they may not)."""
    spans = sorted((lo, hi, name) for name, (lo, hi) in named)
    for (_, end, name), (start, _, other) in itertools.pairwise(spans):
        if start < end:
            raise ValueError(
                f"{other}: expected memory apart from {name}'s ({why}), got one that "
                f"shares bytes with it"
            )
    return [s[0] for s in spans], [s[1] for s in spans], [s[2] for s in spans]


def check_outside(name, x, ranges, what):
    """ValueError when the contiguous tensor or array ``x`` shares bytes with one of
    ``ranges`` (:func:`disjoint_ranges`'s: the first whose end is past x's start decides); ``what``
    names them and says why, e.g. "the KV caches' (the run writes them)"."""
    lo, hi = contiguous_bytes(x)
    starts, ends, names = ranges
    i = bisect.bisect_right(ends, lo)
    if lo < hi and i < len(starts) and starts[i] < hi:
        raise ValueError(
            f"{name}: expected memory apart from {what}, got one that shares bytes with {names[i]}"
        )


def as_numpy(x):
    """Zero-copy NumPy view of a CPU tensor or array, 16-bit floats as their carriers."""
    if isinstance(x, np.ndarray):
        return x.view(np.int16) if x.dtype == np.float16 else x
    view = TORCH_CARRIER.get(x.dtype)
    if view is not None and view is not x.dtype:
        x = x.view(view)
    return x.detach().numpy()


def span(x, extent=None):
    """A 1-D carrier view (no copy) of ``x``'s memory from its first element, ``extent``
    elements long (default: up to its last element, from its shape and strides; 0 when it
    is empty): what a kernel indexes with ``x``'s own strides. Tensor or array."""
    if extent is None:
        shape, strides = x.shape, strides_of(x)
        extent = 0 if 0 in shape else 1 + sum((n - 1) * s for n, s in zip(shape, strides))
    if isinstance(x, torch.Tensor):
        return as_numpy(x.as_strided((extent,), (1,)))
    a = as_numpy(x)
    return np.lib.stride_tricks.as_strided(a, shape=(extent,), strides=(a.itemsize,))


def as_torch(x):
    """Zero-copy torch view of a NumPy array (fp16 stays fp16)."""
    return x if isinstance(x, torch.Tensor) else torch.from_numpy(x)


def address(x):
    """Address of the first element (tensor or array). A tensor's ``data_ptr`` first, with
    no isinstance test (~50 ns of the ~100 a call took: a wrapper asks for several)."""
    try:
        return x.data_ptr()
    except AttributeError:  # a NumPy array
        return x.__array_interface__["data"][0]
