"""Load-time repack of GGUF block-quantised weights (and GPT-OSS's MXFP4 safetensors
experts) into numkern's layout (:mod:`numkern.quant.formats`, docs/kernels.md §13), and
its exact inverse ``dequantize``.

``repack(raw, qtype, shape)``: ``raw`` uint8 ``[N, row_bytes]`` or ``[E, N, row_bytes]``
(the tensor's bytes as stored in the GGUF file, NumPy or torch), ``shape`` ``(N, K)`` or
``(E, N, K)``. ``repack_mxfp4(blocks [E, N, K/32, 16], scales [E, N, K/32])`` (or without
``E``). Both return a :class:`QuantWeight` whose ``data`` is uint8 ``[nbytes]`` or
``[E, nbytes]``.

Vectorised NumPy, one slab of row blocks at a time (about 1 MB of GGUF bytes, so the
temporaries stay in L2/L3; slabs spread over Python threads): the GGUF blocks are
turned into the layout's code planes with uint32 word operations (a word is one lane's
4 bytes) and their scales unpacked, then both written lane-interleaved. ``dequantize``
reads the layout back and evaluates ``w = d * (u - offset) + m`` in fp32 with gguf's
own order of operations (``(D * sc) * u - M * mn`` for the K-quants), so it is
bit-exact with ``gguf.quants.dequantize`` of the original bytes.
"""

import concurrent.futures
import dataclasses

import numba
import numpy as np
import torch

from .. import _boot  # noqa: F401  (numkern's Numba settings before numba.config is read)
from ..memory import weight_empty
from .formats import (
    ALIGN,
    BITS,
    BLOCK,
    BLOCK_BYTES,
    CODE,
    GROUP,
    HAS_MIN,
    KIND,
    MAX_PARTS,
    MXFP4,
    MXFP4_LUT,
    OFFSET,
    PART_FIELDS,
    PART_HEADER,
    PARTS,
    Q4_0,
    Q4_1,
    Q4_K,
    Q5_0,
    Q5_1,
    Q5_K,
    Q6_K,
    Q8_0,
    QUANT_TYPES,
    ROWS,
    SUPER,
    code_of,
    section_offsets,
)

SLAB_BYTES = 1 << 20  # GGUF bytes decoded per step: temporaries of a few MB stay cached


@dataclasses.dataclass(frozen=True, eq=False)
class QuantWeight:
    """A block-quantised weight in numkern's layout.

    ``qtype``: the type's name (``"Q4_K"``); ``code``: its row in the type table
    (:mod:`numkern.quant.formats`), the int kernels switch on; ``shape``: ``(N, K)`` or
    ``(E, N, K)`` (the logical weight); ``data``: uint8 tensor ``[nbytes]`` or
    ``[E, nbytes]``, one buffer per expert, section offsets from
    ``formats.sections(code, N, K)``."""

    qtype: str
    code: int
    shape: tuple
    data: torch.Tensor

    def __post_init__(self):
        if self.qtype == "parts" and self.code == PARTS:
            _check_parts(self)
            return
        if self.qtype not in CODE or CODE[self.qtype] != self.code:
            raise ValueError(
                f"QuantWeight: expected qtype/code from {QUANT_TYPES}, "
                f"got {self.qtype!r}/{self.code}"
            )
        shape = tuple(int(s) for s in self.shape)
        object.__setattr__(self, "shape", shape)
        n, k = shape[-2:]
        nbytes = section_offsets(self.code, n, k)["nbytes"]
        want = (*shape[:-2], nbytes)
        if (
            not isinstance(self.data, torch.Tensor)
            or self.data.dtype != torch.uint8
            or tuple(self.data.shape) != want
            or not self.data.is_contiguous()
        ):
            got = (
                f"{self.data.dtype} {tuple(self.data.shape)}"
                if isinstance(self.data, torch.Tensor)
                else type(self.data).__name__
            )
            raise ValueError(f"QuantWeight.data: expected contiguous uint8 {want}, got {got}")

    @property
    def nbytes(self):
        """Bytes of one buffer (one expert's for an ``[E, N, K]`` weight)."""
        return int(self.data.shape[-1])

    @property
    def sections(self):
        """Section name -> byte offset in each buffer (-1 where absent), and ``nbytes``."""
        if self.code == PARTS:
            raise ValueError("sections: a weight of parts has none of its own (see .parts)")
        return section_offsets(self.code, *self.shape[-2:])

    @property
    def parts(self):
        """The row ranges of a weight of parts (:func:`join_rows`) as QuantWeights viewing
        its buffer, in row order; ``(self,)`` for a weight of one type."""
        if self.code != PARTS:
            return (self,)
        head = self.data[:PART_HEADER].view(torch.int64).tolist()
        out = []
        for i in range(head[0]):
            _, code, off, rows = head[2 + PART_FIELDS * i : 2 + PART_FIELDS * (i + 1)]
            nbytes = section_offsets(code, rows, self.shape[1])["nbytes"]
            data = self.data[off : off + nbytes]
            out.append(QuantWeight(QUANT_TYPES[code], code, (rows, self.shape[1]), data))
        return tuple(out)


def _check_parts(w):
    """A weight of parts' header against its shape and buffer (ValueError naming it)."""
    shape = tuple(int(s) for s in w.shape)
    object.__setattr__(w, "shape", shape)
    d = w.data
    if not (isinstance(d, torch.Tensor) and d.dtype == torch.uint8 and d.dim() == 1
            and d.is_contiguous() and d.numel() >= PART_HEADER and len(shape) == 2):  # fmt: skip
        raise ValueError(
            f"QuantWeight.data: expected a contiguous 1-D uint8 buffer of parts for shape "
            f"(N, K), got {getattr(d, 'dtype', type(d).__name__)} "
            f"{tuple(getattr(d, 'shape', ()))} for shape {shape}"
        )
    head = d[:PART_HEADER].view(torch.int64).tolist()
    count, nbytes = head[0], head[1]
    ok = 1 <= count <= MAX_PARTS and nbytes == d.numel()
    row, end = 0, PART_HEADER
    for i in range(count if ok else 0):
        rb0, code, off, rows = head[2 + PART_FIELDS * i : 2 + PART_FIELDS * (i + 1)]
        ok = ok and 0 <= code < PARTS and rows > 0 and rb0 * ROWS == row and off >= end
        ok = ok and (i == count - 1 or rows % ROWS == 0) and shape[1] % BLOCK[code] == 0
        if not ok:
            break
        end = off + section_offsets(code, rows, shape[1])["nbytes"]
        row += rows
    if not (ok and row == shape[0] and end <= nbytes):
        raise ValueError(f"QuantWeight.data: not a valid buffer of parts for shape {shape}")


def join_rows(weights, *, empty=None):
    """One :class:`QuantWeight` (``qtype`` ``"parts"``) of the row-wise concatenation of
    2-D ``weights`` of any types with one K: ``quant_linear`` and the decoder run each
    row block on its part's type (docs/kernels.md §13.9). Every part but the last must
    have whole row blocks (a multiple of 16 rows); at most ``MAX_PARTS`` (8) parts.
    ``empty``: the allocator of ``data`` (default ``numkern.memory.weight_empty``)."""
    weights = list(weights)
    if not 1 <= len(weights) <= MAX_PARTS:
        raise ValueError(f"weights: expected 1 to {MAX_PARTS} QuantWeights, got {len(weights)}")
    k = None
    for i, w in enumerate(weights):
        if not isinstance(w, QuantWeight):
            raise TypeError(f"weights[{i}]: expected a QuantWeight, got {type(w).__name__}")
        if len(w.shape) != 2 or w.code == PARTS:
            raise ValueError(
                f"weights[{i}]: expected a 2-D weight of one type, got {w.qtype} {w.shape}"
            )
        k = w.shape[1] if k is None else k
        if w.shape[1] != k:
            raise ValueError(f"weights[{i}]: expected K = {k} (weights[0]'s), got {w.shape}")
        if i < len(weights) - 1 and w.shape[0] % ROWS:
            raise ValueError(
                f"weights[{i}]: expected a multiple of {ROWS} rows (every part but the last "
                f"starts a row block), got {w.shape[0]}"
            )
    head = [len(weights), 0]
    off, rows = PART_HEADER, 0
    for w in weights:
        head += [rows // ROWS, w.code, off, w.shape[0]]
        off += -(-w.nbytes // ALIGN) * ALIGN
        rows += w.shape[0]
    head[1] = off
    data = (weight_empty if empty is None else empty)((off,), torch.uint8)
    if data.dtype != torch.uint8 or tuple(data.shape) != (off,):
        raise ValueError(f"empty: expected a uint8 tensor ({off},), got {data.dtype} {data.shape}")
    data.zero_()
    header = torch.tensor(head, dtype=torch.int64).view(torch.uint8)
    data[: header.numel()] = header
    for i, w in enumerate(weights):
        o = head[2 + PART_FIELDS * i + 2]
        data[o : o + w.nbytes] = w.data
    return QuantWeight("parts", PARTS, (rows, k), data)


def _as_u8(name, x):
    if isinstance(x, torch.Tensor):
        if x.dtype != torch.uint8 or not x.is_cpu:
            raise TypeError(f"{name}: expected a CPU uint8 tensor, got {x.dtype} on {x.device}")
        x = x.numpy()
    elif isinstance(x, np.ndarray):
        if x.dtype != np.uint8:
            raise TypeError(f"{name}: expected dtype uint8, got {x.dtype}")
    else:
        raise TypeError(f"{name}: expected a torch.Tensor or numpy.ndarray, got {type(x).__name__}")
    return np.ascontiguousarray(x)


def _check_shape(name, qtype, code, shape):
    if not isinstance(shape, (tuple, list)) or len(shape) not in (2, 3):
        raise ValueError(f"shape: expected (N, K) or (E, N, K), got {shape!r}")
    shape = tuple(int(s) for s in shape)
    if min(shape) < 1:
        raise ValueError(f"shape: expected positive sizes, got {shape}")
    k = shape[-1]
    if k % BLOCK[code]:
        raise ValueError(
            f"{name}: K of a {qtype} weight must be a multiple of {BLOCK[code]}, got {k}"
        )
    return shape


def _allocate(empty, shape, code):
    n, k = shape[-2:]
    nbytes = section_offsets(code, n, k)["nbytes"]
    data = (weight_empty if empty is None else empty)((*shape[:-2], nbytes), torch.uint8)
    if data.dtype != torch.uint8 or tuple(data.shape) != (*shape[:-2], nbytes):
        raise ValueError(
            f"empty: expected a uint8 tensor {(*shape[:-2], nbytes)}, "
            f"got {data.dtype} {tuple(data.shape)}"
        )
    return data


# --- decoding GGUF blocks into the layout's planes, a row at a time -----------------------
#
# The planes are built with uint32 word operations, one word = one lane's 4 bytes, so a
# step touches K/8 words a row instead of K codes: ``lo`` [r, K/8] (the nibble plane's
# word of chunk c), ``hi`` [r, K/16] (the high plane's), ``byte`` [r, K/4] (Q8_0).

NIB = np.uint32(0x0F0F0F0F)  # the low nibble of each byte of a word


def _f16_bits(b):
    """[..., 2] bytes -> uint16 fp16 bits [...]"""
    return np.ascontiguousarray(b).view("<u2")[..., 0]


def _words(b):
    """uint8 [..., 4m] (any strides) -> uint32 [..., m], byte i of word w = b[4w + i]."""
    return np.ascontiguousarray(b).view("<u4")


def _nibble_plane_split(qs, r):
    """GGML's split nibble order: groups of B bytes holding elements 0..B-1 (low nibbles)
    and B..2B-1 (high nibbles), qs [r, ngroups, B] -> the nibble plane's words [r, K/8].
    Chunk c of the low half takes the low nibbles of words 2c, 2c+1; of the high half
    their high nibbles."""
    w = _words(qs)  # [r, ng, B/4]
    even, odd = w[..., 0::2], w[..., 1::2]
    out = np.empty((*even.shape[:2], 2, even.shape[2]), np.uint32)
    lo = (even & NIB) | ((odd & NIB) << 4)
    hi = ((even >> 4) & NIB) | (odd & ~NIB)
    if qs.shape[-1] == 16:  # 2 words a half: move them as one uint64 (2.5x: no 2-long loops)
        o64 = out.reshape(*out.shape[:2], 2, 2).view(np.uint64)[..., 0]
        o64[:, :, 0] = lo.view(np.uint64)[..., 0]
        o64[:, :, 1] = hi.view(np.uint64)[..., 0]
    else:
        out[:, :, 0] = lo
        out[:, :, 1] = hi
    return out.reshape(r, -1)


def _nibble_plane_codes(u):
    """Codes u [r, K] (uint8, < 16 after masking) -> the nibble plane's words [r, K/8]."""
    w = _words(u)
    return (w[:, 0::2] & NIB) | ((w[:, 1::2] & NIB) << 4)


def _high_plane(h):
    """2-bit high parts h [r, K] (uint8 values 0..3) -> the high plane's words [r, K/16]:
    byte i of chunk c = h(16c+i) | h(16c+4+i) << 2 | h(16c+8+i) << 4 | h(16c+12+i) << 6."""
    w = _words(h)
    return w[:, 0::4] | (w[:, 1::4] << 2) | (w[:, 2::4] << 4) | (w[:, 3::4] << 6)


def _scale_min_k4(s):
    """Q4_K/Q5_K's 12 packed bytes [r, nb, 12] -> 6-bit sc, mn [r, nb, 8] (gguf's
    ``Q4_K.get_scale_min``)."""
    d, m, md = s[..., 0:4], s[..., 4:8], s[..., 8:12]
    sc = np.concatenate([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], axis=-1)
    mn = np.concatenate([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], axis=-1)
    return sc, mn


def _decode(code, blk):
    """GGUF blocks of r rows [r, nb, BLOCK_BYTES] -> (planes dict of words, scales dict
    of [r, G] or [r, S])."""
    r, nb = blk.shape[:2]
    sc = {}
    planes = {}
    if code == Q8_0:
        sc["d"] = _f16_bits(blk[..., 0:2])
        planes["byte"] = _words(blk[..., 2:34]).reshape(r, -1) ^ np.uint32(0x80808080)
    elif code in (Q4_0, Q4_1, Q5_0, Q5_1, MXFP4):
        p = 1 if code == MXFP4 else 2
        if code == MXFP4:
            sc["d"] = np.ascontiguousarray(blk[..., 0])
        else:
            sc["d"] = _f16_bits(blk[..., 0:2])
        if code in (Q4_1, Q5_1):
            sc["m"] = _f16_bits(blk[..., 2:4])
            p = 4
        if code in (Q5_0, Q5_1):  # bit b of the little-endian u32 qh: element b's 5th bit
            h = np.unpackbits(blk[..., p : p + 4], axis=-1, bitorder="little")
            planes["hi"] = _high_plane(h.reshape(r, -1))
            p += 4
        planes["lo"] = _nibble_plane_split(blk[..., p : p + 16], r)
    elif code in (Q4_K, Q5_K):
        sc["d"] = _f16_bits(blk[..., 0:2]).view(np.float16).astype(np.float32)
        sc["m"] = _f16_bits(blk[..., 2:4]).view(np.float16).astype(np.float32)
        sc["sc"], sc["mn"] = _scale_min_k4(blk[..., 4:16])
        planes["lo"] = _nibble_plane_split(blk[..., -128:].reshape(r, nb * 4, 32), r)
        if code == Q5_K:  # bit j of qh[i]: the 5th bit of element 32j + i
            qh = _words(blk[..., 16:48])[:, :, None, :]  # [r, nb, 1, 8]
            shifts = np.arange(8, dtype=np.uint32)[:, None]
            h = (qh >> shifts) & np.uint32(0x01010101)  # [r, nb, 8 (j), 8 words]
            planes["hi"] = _high_plane(h.view(np.uint8).reshape(r, -1))
    elif code == Q6_K:
        planes["lo"] = _nibble_plane_split(blk[..., 0:128].reshape(r, nb * 2, 64), r)
        qh = _words(blk[..., 128:192]).reshape(r, nb, 2, 1, 8)  # qh[32h + i] bits 2s:
        shifts = np.array([0, 2, 4, 6], np.uint32)[:, None]  # element 128h + 32s + i
        h = (qh >> shifts) & np.uint32(0x03030303)  # [r, nb, 2, 4 (s), 8 words]
        planes["hi"] = _high_plane(h.view(np.uint8).reshape(r, -1))
        sc["sc"] = blk[..., 192:208].view(np.int8)
        sc["d"] = _f16_bits(blk[..., 208:210]).view(np.float16).astype(np.float32)
    return planes, {key: np.ascontiguousarray(v).reshape(r, -1) for key, v in sc.items()}


def _bad_scales(code, sc):
    """Boolean [r, nb] per GGML block: a non-finite scale (or E8M0 NaN = 255)."""
    kind = KIND[code]
    if kind == 0:
        bad = (sc["d"] & 0x7C00) == 0x7C00
        if "m" in sc:
            bad |= (sc["m"] & 0x7C00) == 0x7C00
    elif kind == 1:
        bad = ~np.isfinite(sc["d"])
        if "m" in sc:
            bad |= ~np.isfinite(sc["m"])
    else:
        bad = sc["d"] == 255
    return bad


def _raise_bad(name, qtype, code, bad, e, n0, stacked):
    row, blk = (int(i[0]) for i in np.nonzero(bad))
    where = f"expert {e}, " if stacked else ""
    k0 = blk * int(BLOCK[code])
    what = "E8M0 scale 255 (NaN)" if code == MXFP4 else "non-finite block scale"
    raise ValueError(
        f"{name}: {what} in {qtype} block at {where}row {n0 + row}, "
        f"K {k0}..{k0 + int(BLOCK[code]) - 1} (block {blk} of the row)"
    )


# --- writing the layout: planes and scales of whole row blocks from row r0 ----------------

_PLANE_SECTION = {"lo": "codes", "byte": "codes", "hi": "high"}


def _write_lanes(buf, off, r0, a):
    """a [16 * nrb, X] (one value a row per X) of whole row blocks from row r0 (a
    multiple of 16) -> its section, stored [nrb, X, 16]: lane j = row j."""
    rows, x = a.shape
    nrb = rows // ROWS
    size = ROWS * x * a.itemsize
    dst = buf[off + r0 // ROWS * size : off + (r0 // ROWS + nrb) * size].view(a.dtype)
    dst.reshape(nrb, x, ROWS)[...] = a.reshape(nrb, ROWS, x).transpose(0, 2, 1)


def _pad_rows(a, rows):
    if a.shape[0] == rows:
        return a
    out = np.zeros((rows, *a.shape[1:]), a.dtype)
    out[: a.shape[0]] = a
    return out


def _zero_gaps(buf, offs, code, n, k):
    """Zero the alignment gaps between sections (an arena's memory may hold old bytes)."""
    lanes = -(-n // ROWS) * ROWS
    g = k // GROUP[code]
    s = k // SUPER
    sizes = {
        "codes": lanes * k // (1 if BITS[code] == 8 else 2),
        "high": lanes * k // 4,
        "d": lanes * (g * 2 if KIND[code] == 0 else s * 4 if KIND[code] == 1 else g),
        "m": lanes * (g * 2 if KIND[code] == 0 else s * 4),
        "sc": lanes * g,
        "mn": lanes * g,
    }
    for name, size in sizes.items():
        if offs[name] >= 0:
            end = offs[name] + size
            buf[end : -(-end // ALIGN) * ALIGN] = 0


def _repack_rows(name, qtype, code, shape, decoded, empty, threads):
    """Shared by both repacks: ``decoded(e, n0, n1) -> (planes, scales)`` of rows
    n0..n1, written one slab of row blocks at a time; slabs write disjoint bytes, so
    ``threads`` Python threads share them (NumPy releases the GIL in its loops)."""
    stacked = len(shape) == 3
    n, k = shape[-2:]
    data = _allocate(empty, shape, code)
    offs = section_offsets(code, n, k)
    bufs = data.numpy().reshape(-1, data.shape[-1])
    row_bytes = k // int(BLOCK[code]) * int(BLOCK_BYTES[code])
    slab = max(ROWS, SLAB_BYTES // row_bytes // ROWS * ROWS)

    def one(task):
        e, n0 = task
        n1 = min(n, n0 + slab)
        planes, sc = decoded(e, n0, n1)
        bad = _bad_scales(code, sc)
        if bad.any():
            _raise_bad(name, qtype, code, bad, e, n0, stacked)
        rows = -(-(n1 - n0) // ROWS) * ROWS  # pad rows: zero codes, zero scales
        for key, words in planes.items():
            _write_lanes(bufs[e], offs[_PLANE_SECTION[key]], n0, _pad_rows(words, rows))
        for key, v in sc.items():
            _write_lanes(bufs[e], offs[key], n0, _pad_rows(v, rows))

    tasks = [(e, n0) for e in range(len(bufs)) for n0 in range(0, n, slab)]
    if threads is None:  # the kernels' own thread count (config: starts no thread pool)
        threads = numba.config.NUMBA_NUM_THREADS
    if not isinstance(threads, int) or threads < 1:
        raise ValueError(f"threads: expected an int >= 1 or None, got {threads!r}")
    if threads > 1 and len(tasks) > 1:
        with concurrent.futures.ThreadPoolExecutor(min(threads, len(tasks))) as pool:
            list(pool.map(one, tasks))  # re-raises the first failing slab's error, in order
    else:
        for task in tasks:
            one(task)
    for buf in bufs:
        _zero_gaps(buf, offs, code, n, k)
    return QuantWeight(qtype, code, shape, data)


def repack(raw, qtype, shape, *, empty=None, name="raw", threads=None):
    """GGUF tensor bytes -> :class:`QuantWeight` in numkern's layout.

    ``raw``: uint8 ``[N, row_bytes]`` or ``[E, N, row_bytes]`` (NumPy or torch), the
    tensor's bytes as stored (``row_bytes = K / block * block_bytes``); ``qtype``: one of
    :data:`QUANT_TYPES`; ``shape``: ``(N, K)`` or ``(E, N, K)``; ``empty(shape, dtype)``:
    the allocator of ``data`` (default ``numkern.memory.weight_empty``, huge pages);
    ``name``: the tensor's name in error messages; ``threads``: Python threads sharing
    the slabs (default Numba's thread count, ``NUMBA_NUM_THREADS``; 1: the calling
    thread only). ValueError for a K that is not a
    multiple of the type's block, a ``raw`` of another shape, or a non-finite block scale
    (naming the tensor, expert, row and block)."""
    code = code_of(qtype)
    shape = _check_shape(name, qtype, code, shape)
    raw = _as_u8(name, raw)
    k = shape[-1]
    row_bytes = k // int(BLOCK[code]) * int(BLOCK_BYTES[code])
    want = (*shape[:-1], row_bytes)
    if raw.shape != want and not (raw.ndim == 1 and raw.size == np.prod(want)):
        raise ValueError(f"{name}: expected {qtype} bytes of shape {want}, got {raw.shape}")
    blocks = raw.reshape(-1, shape[-2], k // int(BLOCK[code]), int(BLOCK_BYTES[code]))

    def decoded(e, n0, n1):
        return _decode(code, blocks[e, n0:n1])

    return _repack_rows(name, qtype, code, shape, decoded, empty, threads)


def repack_mxfp4(blocks, scales, *, empty=None, name="blocks", threads=None):
    """GPT-OSS's safetensors MXFP4 (``*_blocks`` uint8 ``[E, N, K/32, 16]``, ``*_scales``
    uint8 ``[E, N, K/32]``, or both without ``E``) -> :class:`QuantWeight` of type MXFP4,
    shape ``(E, N, K)``. In this form element ``2i`` of a block is byte ``i``'s low
    nibble and ``2i + 1`` its high nibble (transformers' ``convert_moe_packed_tensors``);
    the value is ``E2M1 * 2^(scale - 127)``. ``empty``, ``name``, ``threads``: as for
    :func:`repack`. ValueError for mismatched shapes or an E8M0 scale of 255 (NaN)."""
    blocks = _as_u8(name, blocks)
    scales = _as_u8("scales", scales)
    if blocks.ndim not in (3, 4) or blocks.shape[-1] != 16:
        raise ValueError(f"{name}: expected [E, N, K/32, 16] or [N, K/32, 16], got {blocks.shape}")
    if scales.shape != blocks.shape[:-1]:
        raise ValueError(f"scales: expected shape {blocks.shape[:-1]}, got {scales.shape}")
    shape = (*blocks.shape[:-2], blocks.shape[-2] * 32)
    shape = _check_shape(name, "MXFP4", MXFP4, shape)
    n = shape[-2]
    b4 = blocks.reshape(-1, n, blocks.shape[-2], 16)
    s3 = scales.reshape(-1, n, blocks.shape[-2])

    def decoded(e, n0, n1):
        b = b4[e, n0:n1]
        u = np.stack([b & 15, b >> 4], axis=-1)  # interleaved: element 2i, 2i + 1
        lo = _nibble_plane_codes(u.reshape(n1 - n0, -1))
        return {"lo": lo}, {"d": np.ascontiguousarray(s3[e, n0:n1])}

    return _repack_rows(name, "MXFP4", MXFP4, shape, decoded, empty, threads)


# --- dequantize --------------------------------------------------------------------------


def _read_scales(buf, off, rbs, x, dt):
    size = ROWS * x * np.dtype(dt).itemsize
    sec = buf[off : off + (int(rbs[-1]) + 1) * size].view(dt).reshape(-1, x, ROWS)
    return sec[rbs].transpose(0, 2, 1).reshape(-1, x)


def _read_codes(buf, offs, code, rbs, k):
    nrb = len(rbs)
    if BITS[code] == 8:
        sec = buf[offs["codes"] :][: (int(rbs[-1]) + 1) * ROWS * k]
        return sec.reshape(-1, k // 4, ROWS, 4)[rbs].transpose(0, 2, 1, 3).reshape(-1, k)
    half = ROWS * k // 2
    sec = buf[offs["codes"] : offs["codes"] + (int(rbs[-1]) + 1) * half]
    c = sec.reshape(-1, k // 8, ROWS, 4)[rbs].transpose(0, 2, 1, 3)  # [nrb, 16, K/8, 4]
    u = np.stack([c & 15, c >> 4], axis=3).reshape(nrb * ROWS, k)
    if BITS[code] == 6:
        quarter = ROWS * k // 4
        sec = buf[offs["high"] : offs["high"] + (int(rbs[-1]) + 1) * quarter]
        h = sec.reshape(-1, k // 16, ROWS, 4)[rbs].transpose(0, 2, 1, 3)
        shifts = np.array([0, 2, 4, 6], np.uint8).reshape(4, 1)
        h = (h[..., None, :] >> shifts) & 3  # [nrb, 16, K/16, 4, 4]
        u = u | (h.reshape(nrb * ROWS, k) << 4)
    return u


def _dequantize_blocks(buf, code, n, k, rbs):
    """Row blocks ``rbs`` (ascending int array) of one buffer -> fp32 [16 * len, K]."""
    offs = section_offsets(code, n, k)
    u = _read_codes(buf, offs, code, rbs, k)
    rows = u.shape[0]
    g = k // int(GROUP[code])
    group = int(GROUP[code])
    kind = KIND[code]
    if kind == 0:
        d = _read_scales(buf, offs["d"], rbs, g, np.uint16).view(np.float16).astype(np.float32)
        q = (u.astype(np.int16) - np.int16(OFFSET[code])).astype(np.float32)
        w = d.reshape(rows, g, 1) * q.reshape(rows, g, group)
        if HAS_MIN[code]:
            m = _read_scales(buf, offs["m"], rbs, g, np.uint16).view(np.float16)
            w = w + m.astype(np.float32).reshape(rows, g, 1)
    elif kind == 1:
        s = k // SUPER
        per = SUPER // group  # groups per 256 K
        big_d = _read_scales(buf, offs["d"], rbs, s, np.float32)
        sc_dt = np.int8 if code == Q6_K else np.uint8
        sc = _read_scales(buf, offs["sc"], rbs, g, sc_dt).astype(np.float32)
        d = (big_d.reshape(rows, s, 1) * sc.reshape(rows, s, per)).reshape(rows, g, 1)
        q = (u.astype(np.int16) - np.int16(OFFSET[code])).astype(np.float32)
        w = d * q.reshape(rows, g, group)
        if HAS_MIN[code]:
            big_m = _read_scales(buf, offs["m"], rbs, s, np.float32)
            mn = _read_scales(buf, offs["mn"], rbs, g, np.uint8).astype(np.float32)
            dm = (big_m.reshape(rows, s, 1) * mn.reshape(rows, s, per)).reshape(rows, g, 1)
            w = w - dm
    else:
        e = _read_scales(buf, offs["d"], rbs, g, np.uint8).astype(np.uint32)
        bits = np.where(e < 2, np.uint32(0x00200000) << e, (e - np.uint32(1)) << np.uint32(23))
        d = bits.astype(np.uint32).view(np.float32).reshape(rows, g, 1)
        q = MXFP4_LUT[u].astype(np.int8) - np.int8(OFFSET[code])
        with np.errstate(over="ignore"):  # 2^126 * 12 is inf in fp32, as in gguf
            w = d * q.astype(np.float32).reshape(rows, g, group)
    return w.reshape(rows, k)


def dequantize(w, *, dtype=torch.float32, rows=None):
    """The weight as a dense ``[N, K]`` (``[E, N, K]``) tensor of ``dtype``: fp32 computed
    as gguf does (bit-exact with ``gguf.quants.dequantize`` of the original bytes), then
    one cast. ``rows``: int row indices (a 2-D weight only) -> ``[len(rows), K]``, only
    their row blocks decoded (an embedding lookup)."""
    if not isinstance(w, QuantWeight):
        raise TypeError(f"w: expected a QuantWeight, got {type(w).__name__}")
    if w.code == PARTS:  # its parts' rows, in order (with rows: only each part's own)
        if rows is None:
            return torch.cat([dequantize(p, dtype=dtype) for p in w.parts])
        idx = torch.as_tensor(rows, dtype=torch.int64)
        if idx.dim() != 1 or (idx.numel() and (idx.min() < 0 or idx.max() >= w.shape[0])):
            raise ValueError(f"rows: expected 1-D indices in [0, {w.shape[0]}), got {idx}")
        out, r0 = torch.empty((len(idx), w.shape[1]), dtype=dtype), 0
        for p in w.parts:
            mine = ((idx >= r0) & (idx < r0 + p.shape[0])).nonzero().reshape(-1)
            if mine.numel():
                out[mine] = dequantize(p, dtype=dtype, rows=idx[mine] - r0)
            r0 += p.shape[0]
        return out
    n, k = w.shape[-2:]
    bufs = w.data.numpy().reshape(-1, w.nbytes)
    nrb = -(-n // ROWS)
    if rows is not None:
        if len(w.shape) != 2:
            raise ValueError(f"rows: expected a 2-D weight, got shape {w.shape}")
        idx = np.asarray(rows.cpu() if isinstance(rows, torch.Tensor) else rows, np.int64)
        if idx.ndim != 1 or (idx.size and (idx.min() < 0 or idx.max() >= n)):
            raise ValueError(f"rows: expected 1-D indices in [0, {n}), got {idx}")
        if not idx.size:
            return torch.empty((0, k), dtype=dtype)
        rbs, inv = np.unique(idx // ROWS, return_inverse=True)
        dense = _dequantize_blocks(bufs[0], w.code, n, k, rbs)
        out = dense.reshape(-1, ROWS, k)[inv.reshape(-1), idx % ROWS]
        return torch.from_numpy(np.ascontiguousarray(out)).to(dtype)
    out = np.empty((len(bufs), n, k), np.float32)
    step = max(1, SLAB_BYTES // (ROWS * k * 4))  # row blocks per step: about 1 MB fp32
    for e, buf in enumerate(bufs):
        for rb0 in range(0, nrb, step):
            rbs = np.arange(rb0, min(nrb, rb0 + step))
            dense = _dequantize_blocks(buf, w.code, n, k, rbs)
            r0 = rb0 * ROWS
            out[e, r0 : min(n, r0 + dense.shape[0])] = dense[: n - r0]
    return torch.from_numpy(out.reshape(w.shape)).to(dtype)
