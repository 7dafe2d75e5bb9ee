"""``causal_conv1d_fwd``: the causal conv over a prefill chunk (``numkern.gdn.conv``
documents its arguments and layouts; the kernel is ``_conv_kernel``'s, shared with the
decode update)."""

import numpy as np
import torch

from .. import _check as C
from ._conv_kernel import (
    CARRIERS,
    FWD_BATCH,
    FWD_VARLEN,
    Call,
    check_conv_args,
    conv_shape,
    empty_like,
    explain_slots,
    index_arg,
    kernel_extents,
    run_call,
)


def _explain_fwd(query_start_loc, cache_indices, counts):
    n_req, t_n, num_slots, _, _ = counts
    if query_start_loc is not None:
        qsl = np.asarray(C.as_numpy(query_start_loc)).astype(np.int64)
        if qsl[0] != 0 or qsl[-1] != t_n or (np.diff(qsl) < 0).any():
            raise ValueError(
                f"query_start_loc: expected non-decreasing offsets from 0 to {t_n} (the "
                f"tokens of x), got {qsl.tolist()}"
            )
    explain_slots("cache_indices", cache_indices, n_req, num_slots)


def _addresses(x, out, weight, bias, conv_states, extents, shape, strides, dt):
    """The kernel's tensor arguments: addresses, then the layout."""
    bias_at = 0 if bias is None else C.address(bias)
    at = (C.address(x), out.data_ptr(), C.address(weight), bias_at, C.address(conv_states))
    return (*at, extents, shape, strides, CARRIERS[dt])


def causal_conv1d_fwd(
    x,
    weight,
    bias,
    conv_states,
    query_start_loc,
    cache_indices,
    has_initial_state,
    silu_activation,
    is_weight_packed,
):
    """Prefill over a varlen chunk; rewrites ``conv_states`` of the requests' slots in
    place. Returns ``out`` shaped like ``x``. See the module docstring."""
    dt, dim, width, packed, silu = check_conv_args(
        x, weight, bias, conv_states, silu_activation, is_weight_packed
    )
    sx = C.strides_of(x)
    keep = []
    if query_start_loc is None:
        C.check_ndim("x", x, (3,))
        n_req, xd, t_n = x.shape
        if xd != dim:
            raise ValueError(
                f"x: expected shape [*, {dim}, *] (dim of weight), got {list(x.shape)}"
            )
        form, qsl_a = FWD_BATCH, 0
    else:
        C.check_ndim("x", x, (2,))
        if x.shape[0] != dim:
            raise ValueError(f"x: expected shape [{dim}, *] (dim of weight), got {list(x.shape)}")
        t_n = x.shape[1]
        C.check_ndim("query_start_loc", query_start_loc, (1,))
        n_req = query_start_loc.shape[0] - 1
        if n_req < 0:
            raise ValueError("query_start_loc: expected shape [R+1] with R >= 0, got [0]")
        form = FWD_VARLEN
        qsl_a, a = index_arg("query_start_loc", query_start_loc, torch.int32, n_req + 1)
        keep.append(a)
    C.check_disjoint("x", x, "conv_states", conv_states, "conv_states is written")
    idx_a = 0
    if cache_indices is not None:
        idx_a, a = index_arg("cache_indices", cache_indices, torch.int32, n_req)
        keep.append(a)
    init_a = 0
    if has_initial_state is not None:
        init_a, a = index_arg("has_initial_state", has_initial_state, torch.bool, n_req)
        keep.append(a)
    out = empty_like(C.as_torch(x))
    so, ss = C.strides_of(out), C.strides_of(conv_states)
    if form == FWD_BATCH:
        strides = (sx[0], sx[1], sx[2], so[0], so[1], so[2], *ss)
    else:
        strides = (0, sx[0], sx[1], 0, so[0], so[1], *ss)
    num_slots, cols = conv_states.shape[0], conv_states.shape[2]
    shape = conv_shape(dim, width, width - 1, bias is not None, silu, packed, dt)
    extents = kernel_extents(x, out, conv_states)
    call = Call(
        out,
        (
            form,
            (n_req, t_n, num_slots, cols, width),
            idx_a,
            qsl_a,
            init_a,
            (cache_indices is not None, has_initial_state is not None),
        ),
        _addresses(x, out, weight, bias, conv_states, extents, shape, strides, dt),
        tuple(keep),
    )
    return run_call(call, lambda counts: _explain_fwd(query_start_loc, cache_indices, counts))
