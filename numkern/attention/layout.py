"""The KV cache's layout: its shape, the K/V views, their checks and the kernels' view.

A layer's cache is ``kv_cache [num_blocks, Hkv, B, 2*D]`` (vLLM 0.32's allocation); see
the package docstring for the order inside each half-slab, which depends on the ISA.
"""

from typing import NamedTuple

import numpy as np
import torch

from .. import _check as C
from .. import isa as nk_isa
from .kernels import CacheLayout


def kv_cache_shape(num_blocks, num_kv_heads, block_size, head_dim):
    """``(num_blocks, num_kv_heads, block_size, 2 * head_dim)``, as vLLM 0.32 allocates."""
    sizes = {
        "num_blocks": num_blocks,
        "num_kv_heads": num_kv_heads,
        "block_size": block_size,
        "head_dim": head_dim,
    }
    for name, v in sizes.items():
        C.check_int(name, v, low=1)
    return (num_blocks, num_kv_heads, block_size, 2 * head_dim)


def split_kv_cache(kv_cache):
    """``(key_cache, value_cache)``: two non-contiguous views ``[num_blocks, Hkv, B, D]``."""
    C.check_dtype("kv_cache", kv_cache, C.FLOATS)
    C.check_ndim("kv_cache", kv_cache, (4,))
    C.check_contiguous("kv_cache", kv_cache)
    nb, hkv, b, d2 = kv_cache.shape
    if d2 % 2:
        raise ValueError(f"kv_cache: expected a last dim of 2*head_dim, got {d2}")
    v = C.as_torch(kv_cache).view(nb, hkv, 2 * b, d2 // 2)
    return v[:, :, :b], v[:, :, b:]


def check_cache(name, cache, dtype, shape, isa):
    """A ``[num_blocks, Hkv, B, D]`` cache view with contiguous half-slabs, of ``dtype``
    (None: any float) and ``shape`` (None: any), whose dtype ``isa`` serves: its sizes."""
    C.check_dtype(name, cache, C.FLOATS)
    if not isinstance(cache, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor view of the KV cache")
    if dtype is not None and cache.dtype != dtype:
        raise TypeError(
            f"{name}: expected dtype {C.dtype_name(dtype)}, got {C.dtype_name(cache.dtype)}"
        )
    C.check_ndim(name, cache, (4,))
    if shape is not None:
        C.check_shape(name, cache, shape)
    nb, hkv, b, d = cache.shape
    st = cache.stride()
    if st[3] != 1 or st[2] != d:
        raise ValueError(
            f"{name}: expected each (block, head) half-slab contiguous (strides [*, *, {d}, 1]), "
            f"got strides {list(st)}"
        )
    if not nk_isa.serves_dtype(isa, cache.dtype):
        need = " or ".join(nk_isa.attention_rule(isa).dtypes)
        raise TypeError(
            f"{name}: isa {isa!r} needs a {need} cache, got {C.dtype_name(cache.dtype)}"
        )
    return nb, hkv, b, d


def flat(cache, carrier_pairs):
    """A cache view's memory as one 1-D array from its first element, and its block and
    head strides in elements (``carrier_pairs``: viewed as uint32 bf16 pairs; strides
    still count 16-bit elements)."""
    st = C.strides_of(cache)
    a = C.span(cache)
    return (a.view(np.uint32) if carrier_pairs else a), st[0], st[1]


def cache_layout(key_cache, value_cache, isa, carrier_pairs):
    """(K carrier, V carrier, :class:`CacheLayout`) of two checked cache views."""
    amx = nk_isa.attention_rule(isa).layout == "amx"
    kc, kb_s, kh_s = flat(key_cache, carrier_pairs and amx)
    vc, vb_s, vh_s = flat(value_cache, carrier_pairs and amx)
    b = key_cache.shape[2]
    return kc, vc, CacheLayout(b, kb_s, kh_s, vb_s, vh_s, 16 * b, amx)


class CacheView(NamedTuple):
    """One layer's KV cache as the kernels address it, validated once (:func:`cache_view`).

    ``kw``/``vw`` are the K and V write views: 1-D arrays of the cache's elements (uint16
    for bf16, float16, float32) from the first element of K (of V), ``kw.size`` elements
    long; element ``i`` of K's slab (b, h) is ``kw[b*layout.k_block + h*layout.k_head +
    i]``. ``kr``/``vr`` are the read carriers: the same memory, as uint32 bf16 pairs for
    ``amx`` (offsets halved), else ``kw``/``vw`` themselves.
    """

    kw: np.ndarray
    vw: np.ndarray
    kr: np.ndarray
    vr: np.ndarray
    layout: CacheLayout
    num_blocks: int
    num_kv_heads: int
    head_dim: int
    isa: str
    dtype: torch.dtype
    key_cache: torch.Tensor  # the split views [num_blocks, Hkv, B, D]
    value_cache: torch.Tensor


def cache_view(kv_cache, isa):
    """The :class:`CacheView` of ``kv_cache`` (a contiguous :func:`kv_cache_shape` tensor,
    bf16/fp16/fp32) for ``isa``: checks the dtype, the shape, and that ``isa`` serves its
    block size and head dim (``numkern.isa``'s table). Build it once per cache tensor; the
    views share the tensor's memory (keep the tensor alive while using them)."""
    nk_isa.attention_rule(isa)
    key_cache, value_cache = split_kv_cache(kv_cache)
    nb, hkv, b, d = check_cache("kv_cache", key_cache, None, None, isa)
    nk_isa.check_attention(isa, block_size=b, head_dim=d)
    kw, vw, layout = cache_layout(key_cache, value_cache, isa, False)
    kr, vr, _ = cache_layout(key_cache, value_cache, isa, True)
    return CacheView(
        kw=kw,
        vw=vw,
        kr=kr,
        vr=vr,
        layout=layout,
        num_blocks=nb,
        num_kv_heads=hkv,
        head_dim=d,
        isa=isa,
        dtype=kv_cache.dtype,
        key_cache=key_cache,
        value_cache=value_cache,
    )
