"""numkern's RMS norm and rotary embedding as torch custom ops (``docs/kernels.md`` §7,
§12.1), with vLLM 0.32's schemas:

* ``rms_norm(Tensor! out, Tensor input, Tensor? weight, float epsilon) -> ()``: ``out``
  written; as ``numkern.norm.rms_norm`` (a None weight means all ones).
* ``fused_add_rms_norm(Tensor! input, Tensor! residual, Tensor? weight, float epsilon)
  -> ()``: both written; as ``numkern.norm.fused_add_rms_norm``.
* ``rotary_embedding(Tensor positions, Tensor! query, Tensor!? key, int head_size,
  Tensor cos_sin_cache, bool is_neox, int rope_dim_offset=0, bool inverse=False) -> ()``:
  ``query`` and ``key`` written; as ``numkern.rope.rotary_embedding``. numkern rotates
  from each head's first element, forward only: ``rope_dim_offset`` other than 0 and
  ``inverse=True`` are a ValueError naming the argument (vLLM's CPU op refuses them too).

``Tensor!`` is the source spelling of the ``Tensor($0! -> )`` torch prints for these
schemas (and cannot parse): the defined schemas print exactly as vLLM's.

The fakes run the real ops' checks, except those that read data: position values and
memory overlap (under ``torch.compile`` the written arguments are fresh buffers anyway).
"""

import torch

from .. import _check as C
from .. import norm, rope
from ._lib import define, refuse_grad


def _check_weight(weight, dt, n):
    """``numkern.norm``'s weight check without its NumPy view (fakes have no data)."""
    if weight is not None:
        C.check_dtype("weight", weight, (dt, torch.float32))
        C.check_shape("weight", weight, (n,))
        C.check_contiguous("weight", weight)


def _rms_norm_fake(out, input, weight, epsilon):
    norm._check_eps(epsilon)
    dt, _, _ = norm._check_rows("input", input)
    norm._check_rows("out", out, "input", input)
    _check_weight(weight, dt, input.shape[-1])


def _fused_add_rms_norm_fake(input, residual, weight, epsilon):
    norm._check_eps(epsilon)
    dt, _, _ = norm._check_rows("input", input)
    norm._check_rows("residual", residual, "input", input)
    _check_weight(weight, dt, input.shape[-1])


def _check_unsupported(rope_dim_offset, inverse):
    if rope_dim_offset != 0:
        raise ValueError(
            f"rope_dim_offset: expected 0 (numkern rotates from each head's first element), "
            f"got {rope_dim_offset}"
        )
    if inverse:
        raise ValueError(f"inverse: expected False (numkern rotates forward only), got {inverse}")


def _rotary_embedding(
    positions, query, key, head_size, cos_sin_cache, is_neox, rope_dim_offset=0, inverse=False
):
    _check_unsupported(rope_dim_offset, inverse)
    rope.rotary_embedding(positions, query, key, head_size, cos_sin_cache, is_neox)


def _rotary_embedding_fake(
    positions, query, key, head_size, cos_sin_cache, is_neox, rope_dim_offset=0, inverse=False
):
    """``numkern.rope.rotary_embedding``'s checks, in its order, up to the data."""
    _check_unsupported(rope_dim_offset, inverse)
    C.check_bool("is_neox", is_neox)
    head_size = C.check_int("head_size", head_size, low=1)
    C.check_dtype("positions", positions, (torch.int64,))
    C.check_ndim("positions", positions, (1,))
    C.check_contiguous("positions", positions)
    t_n = positions.shape[0]
    dt, _, _ = rope._check_heads("query", query, None, t_n, head_size)
    if key is not None:
        C.check_same_dtype("key", key, dt, "query")
        rope._check_heads("key", key, dt, t_n, head_size)
    C.check_dtype("cos_sin_cache", cos_sin_cache, (dt, torch.float32))
    C.check_ndim("cos_sin_cache", cos_sin_cache, (2,))
    C.check_contiguous("cos_sin_cache", cos_sin_cache)
    rot_dim = cos_sin_cache.shape[1]
    if rot_dim % 2 or not 2 <= rot_dim <= head_size:
        raise ValueError(
            f"cos_sin_cache: expected an even rot_dim (shape[1]) in [2, head_size "
            f"{head_size}], got shape {list(cos_sin_cache.shape)}"
        )


rms_norm = define(
    "rms_norm(Tensor! out, Tensor input, Tensor? weight, float epsilon) -> ()",
    impl=norm.rms_norm,
    fake=_rms_norm_fake,
)
fused_add_rms_norm = define(
    "fused_add_rms_norm(Tensor! input, Tensor! residual, Tensor? weight, float epsilon) -> ()",
    impl=norm.fused_add_rms_norm,
    fake=_fused_add_rms_norm_fake,
)
rotary_embedding = define(
    "rotary_embedding(Tensor positions, Tensor! query, Tensor!? key, int head_size, "
    "Tensor cos_sin_cache, bool is_neox, int rope_dim_offset=0, bool inverse=False) -> ()",
    impl=_rotary_embedding,
    fake=_rotary_embedding_fake,
)
# no backward: an input requiring grad is refused (see _lib.refuse_grad)
for _op in (rms_norm, fused_add_rms_norm, rotary_embedding):
    refuse_grad(_op.default)
