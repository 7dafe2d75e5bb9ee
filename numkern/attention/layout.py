"""The KV cache's layout: its geometry, shape, the K/V views, their checks and the
kernels' view.

A layer's cache is ``kv_cache [num_blocks, Hkv, B, 2*D]`` (vLLM 0.32's allocation); see
the package docstring for the order inside each half-slab, which depends on the ISA.

A KV-cache group's :class:`CacheGeometry` (blocks, kv heads, block size, head dim, dtype
and ISA) is validated once, when it is made; :func:`kv_cache_shape`, :func:`cache_view`
and :func:`numkern.attention.plan_attention` take it, and the plan and the view record
the very object (``plan.geometry``, ``view.geometry``), so a run can check that a plan
and the cache it runs on were made for one geometry by comparing the two.
"""

from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch

from .. import _check as C
from .. import isa as nk_isa
from .kernels import CacheLayout


@dataclass(frozen=True)
class CacheGeometry:
    """One KV-cache group's cache: ``num_blocks`` blocks of ``block_size`` tokens,
    ``num_kv_heads`` heads of ``head_dim``, ``dtype`` (bf16, fp16 or fp32), in the layout
    of ``isa``. Validated when made, against ``numkern.isa``'s table (the isa serves the
    block size, the head dim and the dtype): the one check of these sizes; whoever holds
    one need not check them again. A group makes it once and hands the same object to its
    caches' views and its plans."""

    num_blocks: int
    num_kv_heads: int
    block_size: int
    head_dim: int
    dtype: torch.dtype
    isa: str

    def __post_init__(self):
        C.check_int("num_blocks", self.num_blocks, low=1)
        C.check_int("num_kv_heads", self.num_kv_heads, low=1)
        if self.dtype not in C.FLOATS:
            raise TypeError(
                f"dtype: expected a torch bfloat16, float16 or float32, got {self.dtype!r}"
            )
        nk_isa.attention_rule(self.isa)
        nk_isa.check_attention(
            self.isa, block_size=self.block_size, head_dim=self.head_dim, dtype=self.dtype
        )

    @property
    def layout(self):
        """The cache layout ``isa`` reads and writes (``"vec"`` or ``"amx"``)."""
        return nk_isa.attention_rule(self.isa).layout

    @property
    def shape(self):
        """The cache tensor's shape, :func:`kv_cache_shape`."""
        return (self.num_blocks, self.num_kv_heads, self.block_size, 2 * self.head_dim)


def kv_cache_shape(num_blocks, num_kv_heads=None, block_size=None, head_dim=None):
    """``(num_blocks, num_kv_heads, block_size, 2 * head_dim)``, as vLLM 0.32 allocates;
    given a :class:`CacheGeometry` alone, its shape."""
    if isinstance(num_blocks, CacheGeometry):
        if (num_kv_heads, block_size, head_dim) != (None, None, None):
            raise TypeError("kv_cache_shape: expected a CacheGeometry alone, or four sizes")
        return num_blocks.shape
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
    geometry: CacheGeometry  # the group's, when given one; else made from the tensor


def cache_view(kv_cache, geometry):
    """The :class:`CacheView` of ``kv_cache`` (a contiguous :func:`kv_cache_shape` tensor,
    bf16/fp16/fp32) for ``geometry``, a :class:`CacheGeometry` (the tensor must have its
    shape and dtype; the view keeps the object), or an isa name (the geometry is then read
    from the tensor and validated: the isa serves its dtype, block size and head dim).
    Build it once per cache tensor; the views share the tensor's memory (keep the tensor
    alive while using them)."""
    if isinstance(geometry, CacheGeometry):  # validated when made: the tensor must match
        C.check_dtype("kv_cache", kv_cache, (geometry.dtype,))
        C.check_shape("kv_cache", kv_cache, geometry.shape)
        isa = geometry.isa
    else:
        isa = geometry
        nk_isa.attention_rule(isa)
    key_cache, value_cache = split_kv_cache(kv_cache)
    nb, hkv, b, d = check_cache("kv_cache", key_cache, None, None, isa)
    if not isinstance(geometry, CacheGeometry):
        geometry = CacheGeometry(nb, hkv, b, d, kv_cache.dtype, isa)
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
        geometry=geometry,
    )
