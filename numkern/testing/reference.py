"""Plain torch references of numkern's public ops (docs/kernels.md §4-§7, §11), written
from the formulas of that page and sharing no code with the kernels: check numkern's
ops, vLLM's CPU ops or your own kernel against them.

**The rule, for every op.** ``reference.<op>`` takes the op's own arguments (the names,
order and keywords of docs/kernels.md, NumPy inputs where the op takes them) and
*returns* the expected value of what the op writes or returns. It never writes an
argument. One tensor comes back bare, several as a tuple, in this order: what the op
returns, then the arguments it updates in place, in argument order. An argument the op
only writes (``out``, ``output``) is not read, so None will do.

=====================================  ==========================================
op                                      returns
=====================================  ==========================================
``convert_weight_packed(weight)``       the packed weight (exact, weight's dtype)
``weight_packed_linear(out, ...)``      ``out`` (fp32)
``weight_packed_linear_cpu(...)``       the output (fp32)
``topk_softmax``, ``grouped_topk``      ``(topk_weights fp32, topk_ids int32)``
``prepack_moe_weight(weight, isa)``     the packed weight (exact)
``fused_moe(output, ...)``              ``output`` (fp32)
``reshape_and_cache(...)``              ``(key_cache, value_cache)`` (exact, new tensors)
``paged_attention(...)``                ``output`` (fp32)
``rms_norm(out, ...)``                  ``out`` (float64)
``fused_add_rms_norm(input, ...)``      ``(input, residual)``: float64, exact
``rotary_embedding(...)``               ``(query, key)`` (float64; key None when None)
``causal_conv1d_fwd``, ``_update``      ``(out, conv_states)``: float64, exact
``causal_conv1d_weight_pack(weight)``   the packed weight (exact)
``fused_gdn_gating(...)``               ``(g, beta)`` (float64)
``fused_sigmoid_gating_delta_rule_..``  ``(out, initial_state_source)`` (float64)
``chunk_gated_delta_rule(...)``         ``(out, initial_state)`` (float64)
``rms_norm_gated(x, z, ...)``           ``out`` (x's dtype: transformers' roundings)
=====================================  ==========================================

**Precision.** Values an op computes come back in fp32 (the linear, MoE, routing and
attention: plain fp32 torch) or float64 (norms, rotary, the GDN ops: float64 loops), with
the roundings the op documents *inside* its computation applied (MoE's activation,
``fused_add_rms_norm``'s residual, the gated norm's three) and the last one, to the
output's dtype, left to the comparison: :func:`numkern.testing.assert_close` rounds the
reference to the output's dtype first. Values an op only moves (packed weights, cache
slots, the residual, routing ids, conv states) come back exact, in the op's dtype where
it has one: compare them with ``torch.equal``.

**Scope.** A reference assumes inputs the op accepts; it checks only the names it
branches on (``isa``, ``activation``, ``scoring_func``). Arguments that choose nothing
here (``is_vnni``, the plan's work split) are accepted and ignored; a ``plan`` given to
``paged_attention`` is read as the op reads it (its copies of the indices). The decoder
run (§8) has no reference here (tests/test_decoder.py has a forward of its own).

**Lower level.** The math underneath, on plain inputs (unpacked weights, K/V gathered
per request, tokens-first conv inputs), for tests that build those directly:
:func:`linear`, :func:`stable_topk`, :func:`moe_activation`, :func:`moe_experts`,
:func:`rotate`, :func:`attention`, :func:`conv1d_varlen`, :func:`conv1d_spec`,
:func:`gdn_gating`, :func:`delta_rule`, and the layouts' inverses
:func:`unpack_weight_packed`, :func:`unpack_moe_weight`, :func:`unpack_conv_weight`,
:func:`gather_kv`. Those with a ``magnitude`` keyword return with ``magnitude=True``,
last, also the sum of the magnitudes of the terms behind each element: the scale of fp32
summation error, for a tolerance (``atol=2**-20 * mag``).
"""

import functools
import math

import numpy as np
import torch
import torch.nn.functional as F

__all__ = [
    "attention",
    "causal_conv1d_fwd",
    "causal_conv1d_update",
    "causal_conv1d_weight_pack",
    "chunk_gated_delta_rule",
    "conv1d_spec",
    "conv1d_varlen",
    "convert_weight_packed",
    "delta_rule",
    "fused_add_rms_norm",
    "fused_gdn_gating",
    "fused_moe",
    "fused_sigmoid_gating_delta_rule_update",
    "gather_kv",
    "gdn_gating",
    "grouped_topk",
    "linear",
    "moe_activation",
    "moe_experts",
    "paged_attention",
    "prepack_moe_weight",
    "reshape_and_cache",
    "rms_norm",
    "rms_norm_gated",
    "rotary_embedding",
    "rotate",
    "stable_topk",
    "topk_softmax",
    "unpack_conv_weight",
    "unpack_moe_weight",
    "unpack_weight_packed",
    "weight_packed_linear",
    "weight_packed_linear_cpu",
]

PAD_SLOT_ID = -1  # vLLM's pad slot (numkern.gdn.conv.PAD_SLOT_ID): the request is padding
_F64 = torch.float64


def _takes_numpy(fn):
    """The op takes NumPy arrays where it takes tensors (docs/kernels.md §2.3): copies
    (the reference never writes, and a read-only array would make torch warn)."""

    @functools.wraps(fn)
    def op(*args, **kwargs):
        args = [torch.tensor(a) if isinstance(a, np.ndarray) else a for a in args]
        kwargs = {k: torch.tensor(v) if isinstance(v, np.ndarray) else v for k, v in kwargs.items()}
        return fn(*args, **kwargs)

    return op


def _ints(x):
    """An index tensor, sequence or (read-only) NumPy array as a list of Python ints."""
    if isinstance(x, torch.Tensor):
        return x.tolist()
    return np.asarray(x).astype(np.int64).tolist()


# ---------------------------------------------------------------------------------------
# §4 packed linear


def _packed_blocks(n, k, pair):
    """``(dst, src)`` flat indices of each 32-row block of an ``[n, k]`` weight (§4.1):
    ``packed.flat[dst] = weight.flat[src]``, 16-bit blocks ``[K/2, nb, 2]``, fp32
    ``[K, nb]``."""
    for n0 in range(0, n, 32):
        nb = min(32, n - n0)
        k2, j, d = np.meshgrid(np.arange(k // pair), np.arange(nb), np.arange(pair), indexing="ij")
        dst = n0 * k + k2 * nb * pair + j * pair + d
        src = (n0 + j) * k + pair * k2 + d
        yield torch.from_numpy(dst.ravel()), torch.from_numpy(src.ravel())


def _pair(dtype):
    return 1 if dtype == torch.float32 else 2


@_takes_numpy
def convert_weight_packed(weight):
    """§4.1, element by element: ``[N, K]`` or ``[E, N, K]`` -> the packed weight."""
    w = weight.reshape(-1, *weight.shape[-2:])
    e_, n, k = w.shape
    src = w.reshape(e_, -1)
    out = torch.empty_like(src)
    for dst, srci in _packed_blocks(n, k, _pair(weight.dtype)):
        out[:, dst] = src[:, srci]
    return out.reshape(weight.shape)


def unpack_weight_packed(packed):
    """The inverse of :func:`convert_weight_packed`: the plain ``[N, K]`` / ``[E, N, K]``
    weight."""
    p = packed.reshape(-1, *packed.shape[-2:])
    e_, n, k = p.shape
    src = p.reshape(e_, -1)
    out = torch.empty_like(src)
    for dst, srci in _packed_blocks(n, k, _pair(packed.dtype)):
        out[:, srci] = src[:, dst]
    return out.reshape(packed.shape)


def linear(x, weight, bias=None):
    """fp32 ``x @ weight.T + bias``: ``x [M, K]``, a plain ``weight [N, K]``, ``bias [N]``
    or None."""
    y = x.float() @ weight.float().T
    return y if bias is None else y + bias.float()


@_takes_numpy
def weight_packed_linear(out, mat1, mat2, bias, is_vnni, *, path=None):
    """§4.2: ``out [M, N]`` in fp32 (``is_vnni`` is ignored; ``out`` is not read). ``path``
    (``dpbf16`` or ``widen``) is ignored: both paths compute this value, exact bf16
    products summed in fp32, and differ only in the summation order."""
    return linear(mat1, unpack_weight_packed(mat2), bias)


@_takes_numpy
def weight_packed_linear_cpu(x, packed_weight, n, bias=None):
    """§4.3: ``(*x.shape[:-1], n)`` in fp32."""
    y = linear(x.reshape(-1, x.shape[-1]), unpack_weight_packed(packed_weight), bias)
    return y.reshape(*x.shape[:-1], n)


# ---------------------------------------------------------------------------------------
# §5 MoE


def stable_topk(scores, k):
    """``(values, ids int32)``: the ``k`` largest of each row in descending order, ties to
    the lowest index (a stable sort: ``torch.topk`` does not promise that)."""
    vals, ids = torch.sort(scores, dim=1, descending=True, stable=True)
    return vals[:, :k], ids[:, :k].int()


@_takes_numpy
def topk_softmax(logits, topk, renormalize):
    """§5.1: softmax in fp32, the top ``topk`` (ties to the lowest id), renormalised."""
    vals, ids = stable_topk(torch.softmax(logits.float(), dim=1), topk)
    return (vals / vals.sum(1, keepdim=True) if renormalize else vals), ids


@_takes_numpy
def grouped_topk(
    logits,
    topk,
    renormalize,
    num_expert_group,
    topk_group,
    *,
    scoring_func="softmax",
    routed_scaling_factor=1.0,
    e_score_correction_bias=None,
):
    """§5.1: groups scored by their best (biased: top-2 summed) scores, the best
    ``topk_group`` kept, the top ``topk`` experts of those by biased score; weights from
    the unbiased scores, renormalised if asked, then scaled."""
    if scoring_func not in ("softmax", "sigmoid"):
        raise ValueError(f"scoring_func: expected 'softmax' or 'sigmoid', got {scoring_func!r}")
    lf = logits.float().double()
    if scoring_func == "softmax":  # float64 exp and sum, each exp stored as fp32 first
        ex = torch.exp(lf - lf.max(1, keepdim=True).values)
        scores = (ex.float().double() / ex.sum(1, keepdim=True)).float()
    else:  # float64 sigmoid, stored as fp32 (an fp32 one saturates to 1 sooner)
        scores = torch.sigmoid(lf).float()
    t_n, e_n = scores.shape
    bias = e_score_correction_bias
    choice = scores + bias if bias is not None else scores
    grouped = choice.view(t_n, num_expert_group, -1)
    if bias is not None:
        gscore = torch.sort(grouped, dim=2, descending=True, stable=True).values[:, :, :2].sum(2)
    else:
        gscore = scores.view(t_n, num_expert_group, -1).max(2).values
    gids = torch.sort(gscore, dim=1, descending=True, stable=True).indices[:, :topk_group]
    mask = torch.zeros(t_n, num_expert_group, dtype=torch.bool).scatter_(1, gids, True)
    mask = mask[:, :, None].expand(-1, -1, e_n // num_expert_group).reshape(t_n, e_n)
    masked = choice.masked_fill(~mask, float("-inf"))
    ids = torch.sort(masked, dim=1, descending=True, stable=True).indices[:, :topk]
    w = scores.gather(1, ids)
    if renormalize:
        w = w / w.sum(1, keepdim=True)
    return w * routed_scaling_factor, ids.int()


def _moe_index(n, k, isa):
    """Flat position in an expert's packed ``[n, k]`` weight of each element (§5.2)."""
    nn_, kk = torch.meshgrid(torch.arange(n), torch.arange(k), indexing="ij")
    tile = (nn_ // 16) * 16 * k
    if isa == "vec":
        return tile + kk * 16 + nn_ % 16
    if isa == "amx":
        return tile + (kk // 2) * 32 + (nn_ % 16) * 2 + kk % 2
    raise ValueError(f"isa: expected 'amx' or 'vec', got {isa!r}")


@_takes_numpy
def prepack_moe_weight(weight, isa):
    """§5.2: ``[E, N, K]`` -> the packed weight of ``isa``'s layout."""
    e_, n, k = weight.shape
    idx = _moe_index(n, k, isa).reshape(-1)
    out = torch.empty(e_, n * k, dtype=weight.dtype)
    out[:, idx] = weight.reshape(e_, -1)
    return out.reshape(weight.shape)


def unpack_moe_weight(packed, isa):
    """The inverse of :func:`prepack_moe_weight`: the plain ``[E, N, K]`` weight."""
    e_, n, k = packed.shape
    idx = _moe_index(n, k, isa).reshape(-1)
    return packed.reshape(e_, -1)[:, idx].reshape(packed.shape)


def moe_activation(gate_up, activation, dtype):
    """The activation of ``gate_up [rows, 2I]`` (fp32; gate rows then up rows, interleaved
    for ``swigluoai``), rounded to ``dtype`` as the op does (§5.3), returned as fp32."""
    if activation == "swigluoai":
        g, u = gate_up[:, 0::2].clamp(max=7.0), gate_up[:, 1::2].clamp(-7.0, 7.0)
        return ((u + 1) * g * torch.sigmoid(1.702 * g)).to(dtype).float()
    g, u = gate_up.chunk(2, dim=1)
    if activation == "silu":
        a = F.silu(g) * u
    elif activation == "gelu":
        a = F.gelu(g) * u
    elif activation == "gelu_tanh":
        a = F.gelu(g, approximate="tanh") * u
    else:
        raise ValueError(
            f"activation: expected 'silu', 'gelu', 'gelu_tanh' or 'swigluoai', got {activation!r}"
        )
    return a.to(dtype).float()


def moe_experts(
    x,
    w13,
    w2,
    w13_bias,
    w2_bias,
    topk_weights,
    topk_ids,
    activation,
    skip_weighted=False,
    *,
    magnitude=False,
):
    """A loop over experts in fp32, with plain ``w13 [E, 2I, H]`` and ``w2 [E, H, I]``:
    ``out [T, H]`` (and with ``magnitude`` the sum of |terms| of each output)."""
    t_n, h = x.shape
    out = torch.zeros(t_n, h)
    mag = torch.zeros(t_n, h)
    xf = x.float()
    for e in topk_ids.unique().tolist():
        if e < 0:  # -1: no expert on this rank (expert parallelism), skipped
            continue
        tok, slot = (topk_ids == e).nonzero(as_tuple=True)
        gu = xf[tok] @ w13[e].float().T + (0 if w13_bias is None else w13_bias[e].float())
        a = moe_activation(gu, activation, x.dtype)
        b2 = None if w2_bias is None else w2_bias[e].float()
        y = a @ w2[e].float().T + (0 if b2 is None else b2)
        wgt = torch.ones(len(tok)) if skip_weighted else topk_weights[tok, slot]
        out.index_add_(0, tok, wgt[:, None] * y)
        if magnitude:
            m = a.abs() @ w2[e].float().abs().T + (0 if b2 is None else b2.abs())
            mag.index_add_(0, tok, wgt.abs()[:, None] * m)
    return (out, mag) if magnitude else out


@_takes_numpy
def fused_moe(
    output,
    input,
    w13,
    w2,
    w13_bias,
    w2_bias,
    topk_weights,
    topk_ids,
    *,
    activation="silu",
    skip_weighted=False,
    isa=None,
    path=None,
):
    """§5.3: ``output [T, H]`` in fp32, from the weights packed for ``isa``, or from
    quantised experts (§5.7: :class:`numkern.quant.QuantWeight`, ``isa`` unused)
    dequantised exactly. ``path`` is ignored, as in :func:`weight_packed_linear`."""
    from ..quant import QuantWeight, dequantize

    if isinstance(w13, QuantWeight) or isinstance(w2, QuantWeight):
        w13, w2 = dequantize(w13), dequantize(w2)
    else:
        w13, w2 = unpack_moe_weight(w13, isa), unpack_moe_weight(w2, isa)
    return moe_experts(
        input, w13, w2, w13_bias, w2_bias, topk_weights, topk_ids, activation, skip_weighted
    )


# ---------------------------------------------------------------------------------------
# §6 paged attention


def _amx(isa):
    if isa == "amx":
        return True
    if isa in ("vec", "vec16", "neon"):
        return False
    raise ValueError(f"isa: expected one of ('amx', 'vec', 'vec16', 'neon'), got {isa!r}")


def _k_offset(t, d, b, dim, amx):
    """Offset of key element (token t of the block, dim d) in its half-slab (§6.1)."""
    if amx:
        return (t // 16) * 16 * dim + (d // 2) * 32 + (t % 16) * 2 + d % 2
    return d * b + t


def _v_offset(t, d, b, dim, amx):
    if amx:
        return (d // 16) * b * 16 + (t // 2) * 32 + (d % 16) * 2 + t % 2
    return t * dim + d


@_takes_numpy
def reshape_and_cache(key, value, key_cache, value_cache, slot_mapping, isa):
    """§6.3: new ``(key_cache, value_cache)`` (``[num_blocks, Hkv, B, D]``, contiguous)
    holding the given caches with each token's K and V at its slot, in ``isa``'s layout
    (a negative slot skipped; slots distinct, as two tokens of one slot race in the op)."""
    amx = _amx(isa)
    kc = key_cache.clone(memory_format=torch.contiguous_format)
    vc = value_cache.clone(memory_format=torch.contiguous_format)
    nb, hkv, b, dim = kc.shape
    kf, vf = kc.view(nb, hkv, b * dim), vc.view(nb, hkv, b * dim)
    slots = torch.tensor(_ints(slot_mapping), dtype=torch.long)
    rows = (slots >= 0).nonzero()[:, 0]
    blk, t = (slots[rows] // b)[:, None, None], (slots[rows] % b)[:, None, None]
    heads, d = torch.arange(hkv)[None, :, None], torch.arange(dim)[None, None, :]
    kf[blk, heads, _k_offset(t, d, b, dim, amx)] = key[rows].to(kc.dtype)
    vf[blk, heads, _v_offset(t, d, b, dim, amx)] = value[rows].to(vc.dtype)
    return kc, vc


def gather_kv(key_cache, value_cache, block_table, seq_lens, isa):
    """``(keys, values)``: per request ``r``, its ``seq_lens[r]`` keys and values
    ``[L, Hkv, D]`` read from the caches through ``block_table[r]`` in ``isa``'s layout."""
    amx = _amx(isa)
    nb, hkv, b, dim = key_cache.shape
    kf = key_cache.reshape(nb, hkv, b * dim)
    vf = value_cache.reshape(nb, hkv, b * dim)
    table = torch.tensor(np.asarray(block_table), dtype=torch.long)
    heads, d = torch.arange(hkv)[None, :, None], torch.arange(dim)[None, None, :]
    keys, values = [], []
    for r, n in enumerate(_ints(seq_lens)):
        pos = torch.arange(n)
        blk, t = table[r, pos // b][:, None, None], (pos % b)[:, None, None]
        keys.append(kf[blk, heads, _k_offset(t, d, b, dim, amx)])
        values.append(vf[blk, heads, _v_offset(t, d, b, dim, amx)])
    return keys, values


def attention(
    query,
    query_start_loc,
    seq_lens,
    keys,
    values,
    num_kv_heads,
    *,
    scale,
    causal=True,
    sliding_window=-1,
    softcap=0.0,
    alibi_slopes=None,
    sinks=None,
):
    """Plain fp32 softmax attention with explicit masks (§6.5) over each request's
    gathered ``keys[r]``, ``values[r]`` ``[seq_lens[r], Hkv, D]``: ``[T, Hq, D]``. A row
    sums over the keys it sees only: a NaN or inf in the value of a key it masks does not
    reach it (a visible key's does, whatever its weight)."""
    qsl, sl = _ints(query_start_loc), _ints(seq_lens)
    hq = query.shape[1]
    grp = hq // num_kv_heads
    out = torch.zeros(query.shape)
    for r in range(len(keys)):
        q0, q1 = qsl[r], qsl[r + 1]
        ql, kl = q1 - q0, sl[r]
        p = (kl - ql + torch.arange(ql))[:, None]
        j = torch.arange(kl)[None, :]
        mask = torch.ones(ql, kl, dtype=torch.bool)
        if causal:
            mask &= j <= p
        if sliding_window > 0:
            mask &= j >= p - (sliding_window - 1)
            if not causal:
                mask &= j <= p + (sliding_window - 1)
        for h in range(hq):
            s = (query[q0:q1, h].float() @ keys[r][:, h // grp].float().T) * scale
            if softcap:
                s = softcap * torch.tanh(s / softcap)
            if alibi_slopes is not None:
                s = s + alibi_slopes[h] * (j - p)
            s = s.masked_fill(~mask, float("-inf"))
            if sinks is not None:
                s = torch.cat([s, torch.full((ql, 1), float(sinks[h]))], 1)
            prob = torch.softmax(s, 1)[:, :kl]
            v = values[r][:, h // grp].float()
            bad = ~torch.isfinite(v).all(1)  # keys with a non-finite value
            if not bad.any():
                out[q0:q1, h] = prob @ v
                continue
            o = prob @ v.masked_fill(bad[:, None], 0.0)
            for i in mask[:, bad].any(1).nonzero().flatten().tolist():  # rows seeing one
                o[i] = prob[i, mask[i]] @ v[mask[i]]
            out[q0:q1, h] = o
    return out


@_takes_numpy
def paged_attention(
    query,
    key_cache,
    value_cache,
    output,
    query_start_loc,
    seq_lens,
    block_table,
    *,
    scale,
    causal=True,
    sliding_window=-1,
    softcap=0.0,
    alibi_slopes=None,
    sinks=None,
    isa,
    plan=None,
):
    """§6.5: ``output [T, Hq, D]`` in fp32. With a ``plan``, its copies of the indices
    are read, as the op reads them."""
    if plan is not None:
        query_start_loc, seq_lens = plan.qsl, plan.seq_lens
        if plan.block_table is not None:
            block_table = plan.block_table
    keys, values = gather_kv(key_cache, value_cache, block_table, seq_lens, isa)
    return attention(
        query,
        query_start_loc,
        seq_lens,
        keys,
        values,
        key_cache.shape[1],
        scale=scale,
        causal=causal,
        sliding_window=sliding_window,
        softcap=softcap,
        alibi_slopes=alibi_slopes,
        sinks=sinks,
    )


# ---------------------------------------------------------------------------------------
# §7 RMS norm and rotary


@_takes_numpy
def rms_norm(out, input, weight, epsilon):
    """§7.1 in float64: ``x / sqrt(mean(x^2) + epsilon) * weight`` per row (``out`` is not
    read)."""
    rows = input.double().reshape(-1, input.shape[-1])
    w = torch.ones(input.shape[-1], dtype=_F64) if weight is None else weight.double()
    y = rows / torch.sqrt((rows * rows).sum(1, keepdim=True) / rows.shape[1] + epsilon) * w
    return y.reshape(input.shape)


@_takes_numpy
def fused_add_rms_norm(input, residual, weight, epsilon):
    """§7.2: ``(input, residual)``: the residual ``round(input + residual)`` (exact, its
    dtype), then the norm of that rounded residual (float64)."""
    summed = (input.float() + residual.float()).to(residual.dtype)  # one rounding
    return rms_norm(None, summed, weight, epsilon), summed


def _pairs(rot_dim, is_neox):
    """Index pairs (a, b) of one head that rotate together, pair j using column j."""
    half = rot_dim // 2
    if is_neox:
        return [(j, j + half) for j in range(half)]
    return [(2 * j, 2 * j + 1) for j in range(half)]


def rotate(x, positions, cos_sin_cache, head_size, is_neox, *, magnitude=False):
    """A float64 loop over pairs of each ``head_size`` head of ``x [T, ...]``:
    ``(a, b) -> (a c - b s, b c + a s)``, the first ``rot = cos_sin_cache.shape[1]``
    elements of each head (the rest as they are); magnitude ``|a c| + |b s|``."""
    h = x.double().reshape(x.shape[0], math.prod(x.shape[1:]) // head_size, head_size)
    out, mag = h.clone(), h.abs()
    rot = cos_sin_cache.shape[1]
    c = cos_sin_cache.double()[positions][:, None, :]  # [T, 1, rot]
    for j, (a, b) in enumerate(_pairs(rot, is_neox)):
        cos, sin = c[..., j], c[..., rot // 2 + j]
        xa, xb = h[..., a], h[..., b]
        out[..., a] = xa * cos - xb * sin
        out[..., b] = xb * cos + xa * sin
        mag[..., a] = (xa * cos).abs() + (xb * sin).abs()
        mag[..., b] = (xb * cos).abs() + (xa * sin).abs()
    out = out.reshape(x.shape)
    return (out, mag.reshape(x.shape)) if magnitude else out


@_takes_numpy
def rotary_embedding(positions, query, key, head_size, cos_sin_cache, is_neox):
    """§7.3: ``(query, key)`` rotated, float64 (key None when None)."""
    q = rotate(query, positions, cos_sin_cache, head_size, is_neox)
    k = None if key is None else rotate(key, positions, cos_sin_cache, head_size, is_neox)
    return q, k


# ---------------------------------------------------------------------------------------
# §11 Gated DeltaNet


def _conv_taps(seq, w, bias, silu):
    """seq [dim, H + q] float64 -> (out [q, dim], magnitude [q, dim])."""
    b = None if bias is None else bias.double()
    y = F.conv1d(seq[None], w.double()[:, None], b, groups=seq.shape[0])[0]
    bm = None if b is None else b.abs()
    mag = F.conv1d(seq.abs()[None], w.double().abs()[:, None], bm, groups=seq.shape[0])[0]
    if silu:
        y = y * torch.sigmoid(y)
    return y.t(), mag.t()


def conv1d_varlen(
    x,
    weight,
    bias,
    conv_states,
    query_start_loc,
    slots,
    has_initial_state,
    silu,
    *,
    magnitude=False,
):
    """The causal depthwise conv over a varlen chunk, tokens first (``x [T, dim]``, plain
    ``weight [dim, W]``): per request, history (slot columns ``0..W-2``, or zeros) then its
    tokens; the slot's columns ``0..W-2`` become the last ``W-1`` of that sequence. A slot
    of -1 is padding (zeros out). -> float64 ``(out [T, dim], conv_states)``."""
    xd = x.double()
    st = conv_states.double().clone()
    out, mag = torch.zeros_like(xd), torch.zeros_like(xd)
    width = weight.shape[-1]
    qsl, slot_of, init = _ints(query_start_loc), _ints(slots), _ints(has_initial_state)
    for r in range(len(qsl) - 1):
        s, e, slot = qsl[r], qsl[r + 1], slot_of[r]
        if slot == PAD_SLOT_ID or e == s:
            continue
        hist = st[slot, :, : width - 1] if init[r] else torch.zeros(xd.shape[1], width - 1)
        seq = torch.cat([hist.double(), xd[s:e].t()], 1)
        out[s:e], mag[s:e] = _conv_taps(seq, weight, bias, silu)
        st[slot, :, : width - 1] = seq[:, -(width - 1) :]
    return (out, st, mag) if magnitude else (out, st)


def conv1d_spec(x, conv_states, weight, bias, silu, slots, num_accepted_tokens, *, magnitude=False):
    """vLLM's torch fallback of speculative decoding (``x [B, q, dim]``, plain weight):
    history = slot columns ``n-1..n+W-3``, then the slot keeps columns ``n..n+L-q-1``
    followed by the q tokens; a slot of -1 is padding. -> float64 ``(out, conv_states)``."""
    st = conv_states.double().clone()
    n_req, q, dim = x.shape
    cols = st.shape[2]
    width = weight.shape[-1]
    out, mag = torch.zeros(n_req, q, dim, dtype=_F64), torch.zeros(n_req, q, dim, dtype=_F64)
    for i, (slot, n) in enumerate(zip(_ints(slots), _ints(num_accepted_tokens))):
        if slot == PAD_SLOT_ID:
            continue
        xs = x[i].double().t()
        seq = torch.cat([st[slot, :, n - 1 : n + width - 2], xs], 1)
        out[i], mag[i] = _conv_taps(seq, weight, bias, silu)
        st[slot] = torch.cat([st[slot, :, n : n + cols - q], xs], 1)
    return (out, st, mag) if magnitude else (out, st)


def _conv_index(dim, width):
    c, k = torch.meshgrid(torch.arange(dim), torch.arange(width), indexing="ij")
    return (c // 32) * 32 * width + (k // 2) * 64 + (c % 32) * 2 + k % 2


@_takes_numpy
def causal_conv1d_weight_pack(weight):
    """§11.3: vLLM's layout, ``packed.flat[(c//32)*32*W + (k//2)*64 + (c%32)*2 + k%2] =
    weight[c, k]``; the shape of ``weight``."""
    w = weight.reshape(weight.shape[0], -1)
    out = torch.empty(w.numel(), dtype=w.dtype)
    out[_conv_index(*w.shape).reshape(-1)] = w.reshape(-1)
    return out.reshape(weight.shape)


def unpack_conv_weight(packed):
    """The inverse of :func:`causal_conv1d_weight_pack`: the plain ``[dim, W]`` weight."""
    dim, width = packed.shape[0], packed.shape[-1]
    return packed.reshape(-1)[_conv_index(dim, width)]


def _plain_conv_weight(weight, is_weight_packed):
    return unpack_conv_weight(weight) if is_weight_packed else weight.reshape(weight.shape[0], -1)


@_takes_numpy
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
    """§11.1: ``(out, conv_states)``: out float64 shaped like ``x``, the state pool in
    its dtype (its new columns are inputs: exact)."""
    w = _plain_conv_weight(weight, is_weight_packed)
    if query_start_loc is None:  # x [R, dim, T]
        n_req, dim, t_n = x.shape
        x_td = x.transpose(1, 2).reshape(n_req * t_n, dim)
        query_start_loc = range(0, n_req * t_n + 1, t_n) if t_n else [0] * (n_req + 1)
    else:  # x [dim, T]
        n_req, x_td = len(query_start_loc) - 1, x.t()
    slots = range(n_req) if cache_indices is None else cache_indices
    init = [False] * n_req if has_initial_state is None else has_initial_state
    out, st = conv1d_varlen(
        x_td, w, bias, conv_states, query_start_loc, slots, init, silu_activation
    )
    out = out.reshape(n_req, x.shape[2], x.shape[1]).transpose(1, 2) if x.ndim == 3 else out.t()
    return out, st.to(conv_states.dtype)


@_takes_numpy
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
    """§11.2: ``(out, conv_states)``: out float64 shaped like ``x``, the state pool in its
    dtype (exact)."""
    w = _plain_conv_weight(weight, is_weight_packed)
    n_req = x.shape[0]
    slots = range(n_req) if conv_state_indices is None else conv_state_indices
    if num_accepted_tokens is None:  # x [B, dim]: one token each, on its history
        out, st = conv1d_varlen(
            x, w, bias, conv_states, range(n_req + 1), slots, [True] * n_req, silu_activation
        )
    else:
        out, st = conv1d_spec(x, conv_states, w, bias, silu_activation, slots, num_accepted_tokens)
    return out, st.to(conv_states.dtype)


def gdn_gating(A_log, dt_bias, a, b, softplus_beta=1.0, softplus_threshold=20.0):
    """float64 ``(g, beta)`` ``[T, H]``: ``g = -exp(A_log) * softplus(a + dt_bias)`` with
    torch's softplus (``x`` where ``beta x > threshold``, else ``log1p(exp(beta x)) /
    beta``), ``beta = sigmoid(b)``."""
    x = a.double() + dt_bias.double()
    bx = softplus_beta * x
    sp = torch.where(bx > softplus_threshold, x, torch.log1p(torch.exp(bx)) / softplus_beta)
    return -torch.exp(A_log.double()) * sp, torch.sigmoid(b.double())


@_takes_numpy
def fused_gdn_gating(A_log, a, b, dt_bias):
    """§11.4: float64 ``(g, beta)``, both ``[1, T, H]``."""
    g, beta = gdn_gating(A_log, dt_bias, a, b)
    return g[None], beta[None]


def delta_rule(q, k, v, g, beta, state, slots, cu_seqlens, use_qk_l2norm, eps):
    """The gated delta rule as a float64 loop over tokens (§11.5): ``q, k [T, Hk, Dk]``,
    ``v [T, Hv, Dv]``, ``g``/``beta [T, Hv]``, ``state [S, Hv, Dk, Dv]`` (``S[k, v]``),
    request n owning tokens ``cu_seqlens[n]:cu_seqlens[n+1]`` and slot ``slots[n]`` (-1:
    padding, zero outputs). -> ``(out [T, Hv, Dv], state)``, a new pool."""
    q, k, v, g, beta = (t.double() for t in (q, k, v, g, beta))
    state = state.double().clone()
    t_n, hk, dk = q.shape
    hv, dv = v.shape[1:]
    cu = _ints(cu_seqlens)
    out = torch.zeros(t_n, hv, dv, dtype=_F64)
    for n, s in enumerate(_ints(slots)):
        if s < 0:
            continue
        for h in range(hv):
            S = state[s, h].clone()
            for t in range(cu[n], cu[n + 1]):
                qt, kt = q[t, h // (hv // hk)], k[t, h // (hv // hk)]
                if use_qk_l2norm:
                    qt = qt / torch.sqrt((qt * qt).sum() + eps)
                    kt = kt / torch.sqrt((kt * kt).sum() + eps)
                S = S * torch.exp(g[t, h])
                S = S + torch.outer(kt, (v[t, h] - kt @ S) * beta[t, h])
                out[t, h] = (qt * dk**-0.5) @ S
            state[s, h] = S
    return out, state


@_takes_numpy
def fused_sigmoid_gating_delta_rule_update(
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
    eps=1e-5,
):
    """§11.5, the recurrent form: ``(out [T, 1, Hv, Dv], initial_state_source)`` in
    float64 (the updated pool a new tensor)."""
    g, beta = gdn_gating(A_log, dt_bias, a, b, softplus_beta, softplus_threshold)
    out, pool = delta_rule(
        q[0],
        k[0],
        v[0],
        g,
        beta,
        initial_state_source,
        initial_state_indices,
        cu_seqlens,
        use_qk_l2norm_in_kernel,
        eps,
    )
    return out[:, None], pool


@_takes_numpy
def chunk_gated_delta_rule(
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
    """§11.5, the chunked form (the same math): ``(out [1, T, Hv, Dv], initial_state)``
    in float64 (the updated pool a new tensor)."""
    out, pool = delta_rule(
        query[0],
        key[0],
        value[0],
        g[0],
        beta[0],
        initial_state,
        initial_state_indices,
        cu_seqlens,
        use_qk_l2norm_in_kernel,
        eps,
    )
    return out[None], pool


@_takes_numpy
def rms_norm_gated(x, z, weight, eps, out=None):
    """§11.6: transformers' ``Qwen3NextRMSNormGated.forward`` as written there, in x's
    dtype: fp32 norm, rounded; times the weight (rounded unless the weight is fp32:
    torch's promotion); times silu(z) in fp32; rounded (``out`` is not read)."""
    dt = x.dtype
    h = x.to(torch.float32)
    variance = h.pow(2).mean(-1, keepdim=True)
    h = h * torch.rsqrt(variance + eps)
    h = weight * h.to(dt)
    h = h * F.silu(z.to(torch.float32))
    return h.to(dt)
