"""``causal_conv1d_update``: the causal conv of a decode step, one token per request (or q
with ``num_accepted_tokens``) (``numkern.gdn.conv`` documents its arguments and layouts;
the kernel is ``_conv_kernel``'s, shared with the prefill).

A decode step calls it once per GDN layer with the same metadata each time: the checks
that read only dtypes, shapes and strides (:func:`check_update`) run once per metadata
and their plan is memoised (``numkern.gdn._common``); every call then checks that x
and conv_states share no element (from their addresses) and ``_plan`` checks the index
values (slots in range and distinct, accepted token counts), as on the first call.
"""

from typing import NamedTuple

import numpy as np
import torch

from .. import _check as C
from ._common import Memo, elements_spanned, tensor_meta
from ._conv_kernel import (
    CARRIERS,
    UPDATE,
    UPDATE_SPEC,
    Call,
    check_conv_args,
    check_index,
    conv_shape,
    empty_like,
    explain_slots,
    index_copy,
    run_call,
)


def _explain_update(conv_state_indices, num_accepted_tokens, counts):
    n_req, q, num_slots, cols, width = counts
    explain_slots("conv_state_indices", conv_state_indices, n_req, num_slots)
    if num_accepted_tokens is not None:
        na = np.asarray(C.as_numpy(num_accepted_tokens)).astype(np.int64)
        bad = (na < 1) | (na > q) | (na + width - 2 > cols)
        if bad.any():
            i = int(np.flatnonzero(bad)[0])
            raise ValueError(
                f"num_accepted_tokens: expected values in [1, {min(q, cols - width + 2)}] "
                f"(q = {q}, width {width}, {cols} state columns), got {int(na[i])} at {i}"
            )


class UpdatePlan(NamedTuple):
    """What :func:`check_update` derives from one call's metadata."""

    form: int  # UPDATE or UPDATE_SPEC
    counts: tuple  # _plan's (R, tokens per request, slots, state columns, width)
    flags: tuple  # _plan's (slots given, has_initial_state given: never)
    idx_contiguous: bool  # its address reaches _plan (else a contiguous copy's)
    acc_contiguous: bool  # num_accepted_tokens' (when given)
    x_bytes: int  # from x's first element to one past its last (0: empty)
    s_bytes: int  # conv_states' likewise: the per-call overlap test
    extents: tuple  # elements of x, out, conv_states
    shape: tuple  # ConvShape's fields
    strides: tuple  # ConvStrides' fields
    carriers: tuple
    tensors: bool  # no NumPy array among x, conv_states, weight, bias: data_ptr
    direct: bool  # tensors, one token each, slots None or a contiguous tensor


def check_update(x, conv_states, weight, bias, silu_activation, idx, packed, accepted):
    """Every check of :func:`causal_conv1d_update` that reads no values, each naming the
    argument (the index values are ``_plan``'s, the overlap of x and conv_states is
    checked per call): an :class:`UpdatePlan`."""
    dt, dim, width, packed, silu = check_conv_args(
        x, weight, bias, conv_states, silu_activation, packed
    )
    C.check_ndim("x", x, (2, 3))
    if x.shape[-1] != dim:
        raise ValueError(f"x: expected shape [..., {dim}] (dim of weight), got {list(x.shape)}")
    n_req = x.shape[0]
    num_slots, cols = conv_states.shape[0], conv_states.shape[2]
    idx_contiguous = acc_contiguous = False
    if idx is not None:
        idx_contiguous = check_index("conv_state_indices", idx, torch.int32, n_req)
    xt = C.as_torch(x)
    out = torch.empty_like(xt, device="meta")  # the strides of the call's torch.empty_like
    sx, so, ss = C.strides_of(x), out.stride(), C.strides_of(conv_states)
    if x.ndim == 2:
        if accepted is not None:
            raise ValueError(
                "num_accepted_tokens: expected None for a 2-D x (one token per request), got "
                "a tensor"
            )
        form, q, n_keep = UPDATE, 1, width - 1
        strides = (sx[0], sx[1], 0, so[0], so[1], 0, *ss)
    else:
        q = x.shape[1]
        if accepted is None:
            raise ValueError(
                "num_accepted_tokens: expected int32 [B] for a 3-D x (speculative decoding), "
                "got None"
            )
        if not 1 <= q <= cols:
            raise ValueError(
                f"x: expected 1 <= q <= {cols} (conv_states' columns) tokens per request, "
                f"got shape {list(x.shape)}"
            )
        acc_contiguous = check_index("num_accepted_tokens", accepted, torch.int32, n_req)
        form, n_keep = UPDATE_SPEC, cols
        strides = (sx[0], sx[2], sx[1], so[0], so[2], so[1], *ss)
    tensors = not any(isinstance(t, np.ndarray) for t in (x, conv_states, weight, bias))
    idx_direct = idx is None or (isinstance(idx, torch.Tensor) and idx_contiguous)
    x_n = elements_spanned(x.shape, sx)
    s_n = elements_spanned(conv_states.shape, ss)
    size = xt.element_size()
    return UpdatePlan(
        form,
        (n_req, q, num_slots, cols, width),
        (idx is not None, False),
        idx_contiguous,
        acc_contiguous,
        x_n * size,
        s_n * size,
        (x_n, elements_spanned(out.shape, so), s_n),
        conv_shape(dim, width, n_keep, bias is not None, silu, packed, dt),
        strides,
        CARRIERS[dt],
        tensors,
        tensors and form == UPDATE and idx_direct,
    )


def _call(p, x, conv_states, weight, bias, idx, accepted):
    """A planned call's :class:`Call`: its output, the addresses, and the per-call check
    that x and conv_states share no element (``C.check_disjoint`` where their spans
    meet)."""
    if p.direct:  # the common decode call
        x_a, s_a, w_a = x.data_ptr(), conv_states.data_ptr(), weight.data_ptr()
        out = empty_like(x)
        if p.x_bytes and p.s_bytes and x_a < s_a + p.s_bytes and s_a < x_a + p.x_bytes:
            C.check_disjoint("x", x, "conv_states", conv_states, "conv_states is written")
        return Call(
            out,
            (UPDATE, p.counts, 0 if idx is None else idx.data_ptr(), 0, 0, p.flags),
            (
                x_a,
                out.data_ptr(),
                w_a,
                0 if bias is None else bias.data_ptr(),
                s_a,
                p.extents,
                p.shape,
                p.strides,
                p.carriers,
            ),
        )
    if p.tensors:
        x_a, s_a, w_a = x.data_ptr(), conv_states.data_ptr(), weight.data_ptr()
        b_a = 0 if bias is None else bias.data_ptr()
        out = empty_like(x)
    else:
        x_a, s_a, w_a = C.address(x), C.address(conv_states), C.address(weight)
        b_a = 0 if bias is None else C.address(bias)
        out = empty_like(C.as_torch(x))
    if p.x_bytes and p.s_bytes and x_a < s_a + p.s_bytes and s_a < x_a + p.x_bytes:
        C.check_disjoint("x", x, "conv_states", conv_states, "conv_states is written")
    keep = ()
    idx_a = acc_a = 0
    if idx is not None:
        if p.idx_contiguous:
            idx_a = C.address(idx)
        else:
            idx_a, a = index_copy(idx)
            keep = (a,)
    if p.form == UPDATE_SPEC:
        if p.acc_contiguous:
            acc_a = C.address(accepted)
        else:
            acc_a, a = index_copy(accepted)
            keep = (*keep, a)
    return Call(
        out,
        (p.form, p.counts, idx_a, acc_a, 0, p.flags),
        (x_a, out.data_ptr(), w_a, b_a, s_a, p.extents, p.shape, p.strides, p.carriers),
        keep,
    )


_PLANS = Memo()


def _key(x, conv_states, weight, bias, silu, idx, packed, accepted):
    """The memo's key of a call: the metadata of each tensor and the flags; None (no
    memo) unless the tensors are torch.Tensors and the flags bools."""
    mx, ms, mw = tensor_meta(x), tensor_meta(conv_states), tensor_meta(weight)
    mb, mi, ma = tensor_meta(bias), tensor_meta(idx), tensor_meta(accepted)
    if (
        mx is None
        or ms is None
        or mw is None
        or mb is None
        or mi is None
        or ma is None
        or type(silu) is not bool
        or type(packed) is not bool
    ):
        return None
    return (mx, ms, mw, mb, mi, ma, silu, packed)


def causal_conv1d_update(
    x,
    conv_states,
    weight,
    bias,
    silu_activation,
    conv_state_indices,
    is_weight_packed,
    num_accepted_tokens=None,
):
    """Decode: one token per request (or q with ``num_accepted_tokens``); rewrites
    ``conv_states`` of the requests' slots in place. Returns ``out`` shaped like ``x``.
    See ``numkern.gdn.conv``'s docstring."""
    args = (x, conv_states, weight, bias, silu_activation, conv_state_indices,
            is_weight_packed, num_accepted_tokens)  # fmt: skip
    plan = _PLANS.plan(_key(*args), check_update, args)
    call = _call(plan, x, conv_states, weight, bias, conv_state_indices, num_accepted_tokens)
    return run_call(
        call, lambda counts: _explain_update(conv_state_indices, num_accepted_tokens, counts)
    )
