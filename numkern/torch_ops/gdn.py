"""numkern's Gated DeltaNet ops as torch custom ops (see ``_lib`` and docs/kernels.md
§12.4): vLLM 0.32's five GDN CPU ops under their names, and numkern's ``rms_norm_gated``.

Schemas are vLLM's strings (``torch.ops._C.<op>.default._schema``) except where vLLM's
hides a write: ``causal_conv1d_fwd_cpu`` rewrites ``conv_states`` and
``chunk_gated_delta_rule_cpu`` updates ``initial_state`` in place, so both are declared
``(a!)`` here. A custom op may not return an alias of an input, so the second output of
``chunk_gated_delta_rule_cpu`` (vLLM: the pool itself) is a new tensor, the requests'
final states ``[N, Hv, Dk, Dv]`` fp32 (row n: slot ``initial_state_indices[n]`` after the
call; zeros for a padded request). ``pad_slot_id`` must be numkern's ``PAD_SLOT_ID``
(-1).

Each op's kernel calls ``numkern.gdn``'s Python op (which checks every argument); its
fake checks what can be checked without the values (devices, dtypes, shapes, unit inner
strides) with the same messages, and returns outputs of the real op's shapes, dtypes and
strides. The ops have no backward: an Autograd kernel refuses inputs that require grad
while grad mode is on (a ``TypeError`` naming the argument) and otherwise runs the op
below autograd (so ``nn.Parameter`` weights work under ``torch.no_grad()``).
"""

import torch

from .. import _check as C
from .. import gdn
from ..gdn import conv, gating, norm, rule
from ._lib import define, refuse_grad

_F32 = torch.float32
_I32 = torch.int32


def _check_pad_slot_id(pad_slot_id):
    if pad_slot_id != gdn.PAD_SLOT_ID:
        raise ValueError(
            f"pad_slot_id: expected {gdn.PAD_SLOT_ID} (numkern's PAD_SLOT_ID, vLLM's), got "
            f"{pad_slot_id}"
        )


def _index_vector(name, x, n=None, dtype=_I32):
    """``x`` a 1-D ``dtype`` tensor (of ``n`` entries when given)."""
    C.check_dtype(name, x, (dtype,))
    if n is None:
        C.check_ndim(name, x, (1,))
    else:
        C.check_shape(name, x, (n,))
    return x.shape[0]


# --- causal conv1d ----------------------------------------------------------------------


def _conv_fwd(
    x,
    weight,
    bias,
    conv_states,
    query_start_loc,
    cache_indices,
    has_initial_state,
    silu_activation,
    pad_slot_id,
    is_weight_packed,
):
    _check_pad_slot_id(pad_slot_id)
    return gdn.causal_conv1d_fwd(
        x,
        weight,
        bias,
        conv_states,
        query_start_loc,
        cache_indices,
        has_initial_state,
        silu_activation,
        is_weight_packed,
    )


def _conv_fwd_fake(
    x,
    weight,
    bias,
    conv_states,
    query_start_loc,
    cache_indices,
    has_initial_state,
    silu_activation,
    pad_slot_id,
    is_weight_packed,
):
    _check_pad_slot_id(pad_slot_id)
    _, dim, _, _, _ = conv.check_conv_args(
        x, weight, bias, conv_states, silu_activation, is_weight_packed
    )
    if query_start_loc is None:  # x [R, dim, T]
        C.check_ndim("x", x, (3,))
        if x.shape[1] != dim:
            raise ValueError(
                f"x: expected shape [*, {dim}, *] (dim of weight), got {list(x.shape)}"
            )
        n_req = x.shape[0]
    else:  # x [dim, T], requests by query_start_loc [R+1]
        C.check_ndim("x", x, (2,))
        if x.shape[0] != dim:
            raise ValueError(f"x: expected shape [{dim}, *] (dim of weight), got {list(x.shape)}")
        n_req = _index_vector("query_start_loc", query_start_loc) - 1
        if n_req < 0:
            raise ValueError("query_start_loc: expected shape [R+1] with R >= 0, got [0]")
    if cache_indices is not None:
        _index_vector("cache_indices", cache_indices, n_req)
    if has_initial_state is not None:
        _index_vector("has_initial_state", has_initial_state, n_req, torch.bool)
    return torch.empty_like(x)


causal_conv1d_fwd_cpu = refuse_grad(
    define(
        "causal_conv1d_fwd_cpu(Tensor x, Tensor weight, Tensor? bias, Tensor(a!)? conv_states, "
        "Tensor? query_start_loc, Tensor? cache_indices, Tensor? has_initial_state, "
        "bool silu_activation, int pad_slot_id, bool is_weight_packed) -> Tensor",
        impl=_conv_fwd,
        fake=_conv_fwd_fake,
    )
)


def _conv_update(
    x,
    conv_states,
    weight,
    bias,
    silu_activation,
    num_accepted_tokens,
    conv_state_indices,
    pad_slot_id,
    is_weight_packed,
):
    _check_pad_slot_id(pad_slot_id)
    return gdn.causal_conv1d_update(
        x,
        conv_states,
        weight,
        bias,
        silu_activation,
        conv_state_indices,
        is_weight_packed,
        num_accepted_tokens,
    )


def _conv_update_fake(
    x,
    conv_states,
    weight,
    bias,
    silu_activation,
    num_accepted_tokens,
    conv_state_indices,
    pad_slot_id,
    is_weight_packed,
):
    _check_pad_slot_id(pad_slot_id)
    _, dim, _, _, _ = conv.check_conv_args(
        x, weight, bias, conv_states, silu_activation, is_weight_packed
    )
    C.check_ndim("x", x, (2, 3))
    if x.shape[-1] != dim:
        raise ValueError(f"x: expected shape [..., {dim}] (dim of weight), got {list(x.shape)}")
    n_req = x.shape[0]
    if conv_state_indices is not None:
        _index_vector("conv_state_indices", conv_state_indices, n_req)
    if x.ndim == 2:
        if num_accepted_tokens is not None:
            raise ValueError(
                "num_accepted_tokens: expected None for a 2-D x (one token per request), got "
                "a tensor"
            )
    else:
        if num_accepted_tokens is None:
            raise ValueError(
                "num_accepted_tokens: expected int32 [B] for a 3-D x (speculative decoding), "
                "got None"
            )
        cols = conv_states.shape[2]
        if not 1 <= x.shape[1] <= cols:
            raise ValueError(
                f"x: expected 1 <= q <= {cols} (conv_states' columns) tokens per request, "
                f"got shape {list(x.shape)}"
            )
        _index_vector("num_accepted_tokens", num_accepted_tokens, n_req)
    return torch.empty_like(x)


causal_conv1d_update_cpu = refuse_grad(
    define(
        "causal_conv1d_update_cpu(Tensor x, Tensor(a!) conv_states, Tensor weight, "
        "Tensor? bias, bool silu_activation, Tensor? num_accepted_tokens, "
        "Tensor? conv_state_indices, int pad_slot_id, bool is_weight_packed) -> Tensor",
        impl=_conv_update,
        fake=_conv_update_fake,
    )
)


# --- gating -----------------------------------------------------------------------------


def _gating_fake(A_log, a, b, dt_bias):
    p = gating.check_gating(A_log, a, b, dt_bias)
    return a.new_empty((1, p.t_n, p.h), dtype=_F32), a.new_empty((1, p.t_n, p.h))


fused_gdn_gating_cpu = refuse_grad(
    define(
        "fused_gdn_gating_cpu(Tensor A_log, Tensor a, Tensor b, Tensor dt_bias) "
        "-> (Tensor, Tensor)",
        impl=gdn.fused_gdn_gating,
        fake=_gating_fake,
    )
)


# --- the gated delta rule ---------------------------------------------------------------


def _check_requests(initial_state_indices, cu_seqlens):
    n = _index_vector("initial_state_indices", initial_state_indices)
    if _index_vector("cu_seqlens", cu_seqlens) != n + 1:
        raise ValueError(
            f"cu_seqlens: expected {n + 1} entries (N+1, N = len(initial_state_indices)), "
            f"got {cu_seqlens.shape[0]}"
        )
    return n


def _final_states(pool, initial_state_indices):
    """The requests' slots of ``pool`` as a new ``[N, Hv, Dk, Dv]`` tensor (zeros for a
    padded request)."""
    idx = initial_state_indices.long()
    final = pool.new_zeros((idx.shape[0], *pool.shape[1:]))
    live = idx != gdn.PAD_SLOT_ID
    final[live] = pool[idx[live]]
    return final


def _chunked(
    query,
    key,
    value,
    g,
    beta,
    initial_state,
    output_final_state,
    cu_seqlens,
    head_first,
    use_qk_l2norm_in_kernel,
    initial_state_indices,
    eps=1e-5,
):
    out, pool = gdn.chunk_gated_delta_rule(
        query,
        key,
        value,
        g,
        beta,
        initial_state,
        output_final_state,
        cu_seqlens,
        head_first,
        use_qk_l2norm_in_kernel,
        initial_state_indices,
        eps,
    )
    return out, _final_states(pool, initial_state_indices)


def _chunked_fake(
    query,
    key,
    value,
    g,
    beta,
    initial_state,
    output_final_state,
    cu_seqlens,
    head_first,
    use_qk_l2norm_in_kernel,
    initial_state_indices,
    eps=1e-5,
):
    C.check_bool("output_final_state", output_final_state)
    if C.check_bool("head_first", head_first):
        raise ValueError("head_first: expected False ([1, T, H, D] inputs), got True")
    C.check_bool("use_qk_l2norm_in_kernel", use_qk_l2norm_in_kernel)
    C.check_float("eps", eps, low=0.0)
    dt, t_n, _, dk, hv, dv = rule.check_qkv(("query", "key", "value"), query, key, value)
    rule.check_rows("g", g, (_F32,), t_n, hv, lead=(1,))
    rule.check_rows("beta", beta, (dt, _F32), t_n, hv, lead=(1,))
    rule.check_state("initial_state", initial_state, hv, dk, dv)
    n = _check_requests(initial_state_indices, cu_seqlens)
    out = query.new_empty((1, t_n, hv, dv))
    return out, initial_state.new_empty((n, hv, dk, dv))


chunk_gated_delta_rule_cpu = refuse_grad(
    define(
        "chunk_gated_delta_rule_cpu(Tensor query, Tensor key, Tensor value, Tensor g, "
        "Tensor beta, Tensor(a!) initial_state, bool output_final_state, Tensor cu_seqlens, "
        "bool head_first, bool use_qk_l2norm_in_kernel, Tensor initial_state_indices, "
        "float eps=1.0000000000000001e-05) -> (Tensor, Tensor)",
        impl=_chunked,
        fake=_chunked_fake,
    )
)


def _recurrent(
    A_log,
    dt_bias,
    q,
    k,
    v,
    a,
    b,
    initial_state_source,
    initial_state_indices,
    cu_seqlens,
    use_qk_l2norm_in_kernel,
    softplus_beta=1.0,
    softplus_threshold=20.0,
):
    return gdn.fused_sigmoid_gating_delta_rule_update(
        A_log,
        dt_bias,
        q,
        k,
        v,
        a,
        b,
        initial_state_source,
        initial_state_indices,
        cu_seqlens,
        use_qk_l2norm_in_kernel,
        softplus_beta,
        softplus_threshold,
    )


def _recurrent_fake(
    A_log,
    dt_bias,
    q,
    k,
    v,
    a,
    b,
    initial_state_source,
    initial_state_indices,
    cu_seqlens,
    use_qk_l2norm_in_kernel,
    softplus_beta=1.0,
    softplus_threshold=20.0,
):
    C.check_bool("use_qk_l2norm_in_kernel", use_qk_l2norm_in_kernel)
    C.check_float("softplus_beta", softplus_beta, positive=True)
    C.check_float("softplus_threshold", softplus_threshold)
    dt, t_n, _, dk, hv, dv = rule.check_qkv(("q", "k", "v"), q, k, v)
    gating.check_gating(A_log, a, b, dt_bias, dt, t_n, hv)
    rule.check_state("initial_state_source", initial_state_source, hv, dk, dv)
    _check_requests(initial_state_indices, cu_seqlens)
    return q.new_empty((t_n, 1, hv, dv))


fused_sigmoid_gating_delta_rule_update_cpu = refuse_grad(
    define(
        "fused_sigmoid_gating_delta_rule_update_cpu(Tensor A_log, Tensor dt_bias, Tensor q, "
        "Tensor k, Tensor v, Tensor a, Tensor b, Tensor(a!) initial_state_source, "
        "Tensor initial_state_indices, Tensor cu_seqlens, bool use_qk_l2norm_in_kernel, "
        "float softplus_beta=1., float softplus_threshold=20.) -> Tensor",
        impl=_recurrent,
        fake=_recurrent_fake,
    )
)


# --- gated RMS norm (numkern's own) -----------------------------------------------------


def _norm_fake(x, z, weight, eps):
    norm.check_norm_args(x, z, weight, eps)
    return x.new_empty(tuple(x.shape))


rms_norm_gated = refuse_grad(
    define(
        "rms_norm_gated(Tensor x, Tensor z, Tensor weight, float eps) -> Tensor",
        impl=gdn.rms_norm_gated,  # (its out=None keyword is not in the schema)
        fake=_norm_fake,
    )
)

# numkern's own: vLLM's packed conv weight layout (§11.3), torch code: its fake is itself
causal_conv1d_weight_pack = refuse_grad(
    define(
        "causal_conv1d_weight_pack(Tensor weight) -> Tensor",
        impl=conv.causal_conv1d_weight_pack,
        fake=conv.causal_conv1d_weight_pack,
    )
)

__all__ = [
    "causal_conv1d_fwd_cpu",
    "causal_conv1d_update_cpu",
    "causal_conv1d_weight_pack",
    "chunk_gated_delta_rule_cpu",
    "fused_gdn_gating_cpu",
    "fused_sigmoid_gating_delta_rule_update_cpu",
    "rms_norm_gated",
]
