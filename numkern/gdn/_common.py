"""What the Gated DeltaNet wrappers share: the extent of a strided tensor, and the memo
of the decode ops' checked calls.

A decode step calls ``causal_conv1d_update`` and ``fused_sigmoid_gating_delta_rule_update``
once per GDN layer with tensors of the same dtypes, shapes and strides every time. Their
checks (every one naming the argument) read only those attributes, so their verdict and
what they derive (the kernels' layout, extents, output shape) hold for every call with
the same metadata: :class:`Memo` keeps it, keyed on :func:`tensor_meta` of each tensor and
the type and value of each flag. What depends on the values (index ranges, slots,
cu_seqlens, the addresses of written tensors) is checked on every call, after the memo.
"""

import torch

_Tensor = torch.Tensor
# Plans kept per op: an engine has a handful of layer shapes times batch sizes; past this
# the memo starts again (a changing batch size must not grow it without bound).
MEMO_SIZE = 256


def elements_spanned(shape, strides):
    """Elements from a tensor's first to one past its last, by its shape and element
    strides (0 when it is empty): the length of the 1-D view a kernel indexes it by."""
    if 0 in shape:
        return 0
    return 1 + sum((n - 1) * s for n, s in zip(shape, strides))


def tensor_meta(x):
    """``(dtype, is_cpu, shape, strides)`` of a ``torch.Tensor`` — everything the checks
    read of it; ``()`` for None; None for anything else (a NumPy array, a subclass: such a
    call is checked afresh, never memoised)."""
    if type(x) is _Tensor:
        return (x.dtype, x.is_cpu, x.shape, x.stride())
    return () if x is None else None


class Memo:
    """A bounded dict from a call's metadata key to its checked plan (an immutable
    tuple). Threads may share it: a lookup and a store are single dict or attribute
    operations under the GIL, a plan is never changed once stored, and two threads that
    miss on one key both check the call and store equal plans."""

    def __init__(self, size=MEMO_SIZE):
        self.size = size
        self.plans = {}
        # (key, plan) of the last call: a decode step calls each op with one metadata in
        # every layer, and comparing with it skips hashing the key (~40 items)
        self.last = (None, None)

    def plan(self, key, check, args):
        """The plan of ``key`` (a call's metadata; None: not memoised), else ``check(*args)``
        (which raises, naming the argument, where the call is refused), kept."""
        if key is None:
            return check(*args)
        last = self.last  # one read: another thread may replace it meanwhile
        if last[0] == key:
            return last[1]
        plan = self.plans.get(key)
        if plan is None:
            plan = check(*args)
            if len(self.plans) >= self.size:
                self.plans.clear()
            self.plans[key] = plan
        self.last = (key, plan)
        return plan

    def clear(self):
        self.plans.clear()
        self.last = (None, None)
