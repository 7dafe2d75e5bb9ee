"""A GGUF file (llama.cpp) read with NumPy and torch: metadata in one pass, tensors when
the model takes them.

Layout (GGUF v2 and v3, little-endian): magic ``GGUF``, version u32, tensor count u64,
metadata count u64; each metadata entry a key (u64 length + UTF-8 bytes), a value type
u32 and the value (an array: element type u32, count u64, the elements); each tensor's
info a name, a dims count u32, the dims u64 (fastest first), a GGML type u32 and a data
offset u64; the tensors' data from the next multiple of ``general.alignment`` (32).

Why not ``gguf.GGUFReader``: it builds a NumPy memmap view per array element, and a
Llama tokenizer's 49K tokens and 49K merges took 4-7 s (cProfile of SmolLM2's load, AMD
EPYC VM, 2 vCPUs). Here a string array is one Python pass over its bytes (60-90 ms for
both, same machine), a numeric array one ``np.frombuffer``, and a tensor is dequantized
only when asked for (:meth:`GGUFFile.tensor`), straight into the model dtype with
torch: Q4_0, Q4_1, Q8_0, F16, BF16 and F32 here (fp32 arithmetic, as ``gguf.quants``:
each product of an fp16 scale and a small integer is exact, so the result is bit for
bit theirs), the other types through ``gguf.quants`` itself.

Every read is bounds-checked: a truncated or corrupt file is a ValueError saying what
ran past the end, and a corrupt count runs into the end of the file quickly rather than
looping on empty reads.
"""

import math
import mmap
import os
import struct
from typing import NamedTuple

import numpy as np
import torch

MAGIC = b"GGUF"
VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
MAX_DIMS = 4  # GGML_MAX_DIMS

# metadata value types: id -> (struct format, NumPy dtype); 8 string, 9 array
_SCALARS = {
    0: ("<B", np.uint8),
    1: ("<b", np.int8),
    2: ("<H", np.uint16),
    3: ("<h", np.int16),
    4: ("<I", np.uint32),
    5: ("<i", np.int32),
    6: ("<f", np.float32),
    7: ("<?", np.bool_),
    10: ("<Q", np.uint64),
    11: ("<q", np.int64),
    12: ("<d", np.float64),
}
_STRING, _ARRAY = 8, 9

# GGML tensor types read here: id -> (name, elements per block, bytes per block)
F32, F16, Q4_0, Q4_1, Q8_0, BF16 = 0, 1, 2, 3, 8, 30
_NATIVE = {
    F32: ("F32", 1, 4),
    F16: ("F16", 1, 2),
    Q4_0: ("Q4_0", 32, 18),
    Q4_1: ("Q4_1", 32, 20),
    Q8_0: ("Q8_0", 32, 34),
    BF16: ("BF16", 1, 2),
}
_FLOATS = {F32: torch.float32, F16: torch.float16, BF16: torch.bfloat16}
# elements dequantized per round of torch calls: a 4 MB fp32 scratch, reused (a
# projection is one round; a 49K-row embedding 28, not a 113 MB temporary)
CHUNK_ELEMENTS = 1 << 20


class TensorInfo(NamedTuple):
    name: str
    ggml_type: int
    shape: tuple  # slowest first (NumPy / HF order)
    offset: int  # of its first byte in the file
    nbytes: int


def _type_sizes(ggml_type):
    """(name, elements per block, bytes per block) of a GGML type; ValueError if unknown."""
    if ggml_type in _NATIVE:
        return _NATIVE[ggml_type]
    import gguf  # the rarer types: their sizes and dequantization are gguf's

    try:
        t = gguf.GGMLQuantizationType(ggml_type)
    except ValueError:
        raise ValueError(f"unknown GGML type {ggml_type}") from None
    return (t.name, *gguf.GGML_QUANT_SIZES[t])


def type_block(ggml_type):
    """``(values, bytes)`` of one quantization block of the GGML type (F32: ``(1, 4)``);
    ValueError if unknown."""
    return _type_sizes(ggml_type)[1:]


def type_name(ggml_type):
    """The GGML type's name ("Q4_K"); ValueError if unknown."""
    return _type_sizes(ggml_type)[0]


class _Cursor:
    """Bounds-checked little-endian reads from a buffer."""

    def __init__(self, buf):
        self.buf, self.size, self.pos = buf, len(buf), 0

    def need(self, nbytes, what):
        if self.pos + nbytes > self.size:
            raise ValueError(
                f"a read of {what} at byte {self.pos} runs past the end of the file "
                f"({self.size} bytes; truncated?)"
            )

    def scalar(self, fmt):
        n = struct.calcsize(fmt)
        self.need(n, f"1 x {fmt[1:]}")
        (v,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += n
        return v

    def string(self):
        n = self.scalar("<Q")
        self.need(n, f"a string of {n} bytes")
        s = self.buf[self.pos : self.pos + n]
        self.pos += n
        return str(s, "utf-8")

    def strings(self, count):
        """``count`` strings, in one pass over their bytes."""
        self.need(8 * count, f"{count} strings")  # each takes at least its length
        buf, pos, size = self.buf, self.pos, self.size
        unpack = struct.Struct("<Q").unpack_from
        out = []
        for i in range(count):
            if pos + 8 > size:
                self.pos = pos
                self.need(8, f"the length of string {i} of {count}")
            (n,) = unpack(buf, pos)
            pos += 8
            if pos + n > size:
                self.pos = pos
                self.need(n, f"string {i} of {count} ({n} bytes)")
            out.append(str(buf[pos : pos + n], "utf-8"))
            pos += n
        self.pos = pos
        return out

    def array(self, dtype, count):
        nbytes = np.dtype(dtype).itemsize * count
        self.need(nbytes, f"{count} x {np.dtype(dtype).name}")
        little = np.dtype(dtype).newbyteorder("<")
        a = np.frombuffer(self.buf, dtype=little, count=count, offset=self.pos)
        self.pos += nbytes
        return a.astype(dtype)  # a copy: the file's map may go

    def value(self, vtype):
        if vtype in _SCALARS:
            return self.scalar(_SCALARS[vtype][0])
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY:
            etype, count = self.scalar("<I"), self.scalar("<Q")
            if etype in _SCALARS:
                a = self.array(_SCALARS[etype][1], count)
                return a.tolist() if etype == 7 else a  # bools as a list
            if etype == _STRING:
                return self.strings(count)
            if etype == _ARRAY:  # nested arrays (none in published files): element-wise
                return [self.value(_ARRAY) for _ in range(self._bounded(count, 12))]
            raise ValueError(f"unknown array element type {etype}")
        raise ValueError(f"unknown value type {vtype}")

    def _bounded(self, count, min_bytes):
        self.need(count * min_bytes, f"{count} entries")
        return count


class GGUFFile:
    """The metadata (``meta``: key -> int, float, bool, str, a NumPy array of numbers or a
    list of strings) and tensor infos (``tensors``: name -> :class:`TensorInfo`, in file
    order) of a GGUF file, its tensors read by :meth:`tensor`. ValueError for a file
    that is not a readable GGUF file."""

    def __init__(self, path):
        self.path = os.fspath(path)
        with open(self.path, "rb") as f:
            # a private map: torch.frombuffer wants a writable buffer (never written)
            self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
        c = _Cursor(self._map)
        c.need(4, "the magic")
        if bytes(self._map[:4]) != MAGIC:
            raise ValueError(f"not a GGUF file (magic {bytes(self._map[:4])!r})")
        c.pos = 4
        version = c.scalar("<I")
        if version & 0xFFFF == 0:
            raise ValueError(f"a big-endian GGUF file (version {version:#x}); not supported")
        if version not in VERSIONS:
            raise ValueError(f"GGUF version {version}; this reader takes {VERSIONS}")
        n_tensors, n_meta = c.scalar("<Q"), c.scalar("<Q")
        # every entry takes bytes: a corrupt count runs into the end of the file at once
        c.need(n_meta * 12 + n_tensors * 24, f"{n_meta} metadata entries, {n_tensors} tensors")
        self.meta = {}
        for _ in range(n_meta):
            key = c.string()
            if key in self.meta:
                raise ValueError(f"metadata key {key!r}: listed twice")
            vtype = c.scalar("<I")
            try:
                self.meta[key] = c.value(vtype)
            except ValueError as e:
                raise ValueError(f"metadata key {key!r}: {e}") from None
        infos = []
        for _ in range(n_tensors):
            name = c.string()
            n_dims = c.scalar("<I")
            if n_dims > MAX_DIMS:
                raise ValueError(f"tensor {name!r}: {n_dims} dims (at most {MAX_DIMS})")
            dims = [c.scalar("<Q") for _ in range(n_dims)]
            infos.append((name, dims, c.scalar("<I"), c.scalar("<Q")))
        align = self.meta.get("general.alignment", DEFAULT_ALIGNMENT)
        if not (isinstance(align, int) and align > 0 and align & (align - 1) == 0):
            raise ValueError(f"general.alignment: expected a power of two, got {align!r}")
        start = -(-c.pos // align) * align
        self.tensors = {}
        for name, dims, ggml_type, offset in infos:
            if name in self.tensors:
                raise ValueError(f"tensor {name!r}: listed twice")
            try:
                self.tensors[name] = self._info(name, dims, ggml_type, start + offset)
            except ValueError as e:
                raise ValueError(f"tensor {name!r}: {e}") from None

    def _info(self, name, dims, ggml_type, offset):
        type_name, block, block_bytes = _type_sizes(ggml_type)
        n = 1
        for d in dims:
            n *= d
        if dims and dims[0] % block:
            raise ValueError(f"{type_name} rows of {dims[0]} are not whole blocks of {block}")
        nbytes = n // block * block_bytes
        if offset + nbytes > len(self._map):
            raise ValueError(
                f"a read of {nbytes} x uint8 at byte {offset} runs past the end of the file "
                f"({len(self._map)} bytes; truncated?)"
            )
        return TensorInfo(name, ggml_type, tuple(reversed(dims)), offset, nbytes)

    def raw(self, name):
        """The tensor's bytes as a uint8 torch tensor over the file's map (no copy)."""
        t = self.tensors[name]
        return torch.frombuffer(self._map, dtype=torch.uint8, count=t.nbytes, offset=t.offset)

    def rows(self, name):
        """How many rows the tensor has: its leading dims flattened (a 1-D tensor: each
        element a row), each row whole quantization blocks."""
        t = self.tensors[name]
        return math.prod(t.shape[:-1]) if len(t.shape) > 1 else (t.shape[0] if t.shape else 1)

    def raw_rows(self, name, row_order=None):
        """The stored bytes as ``[rows, bytes per row]`` uint8 (see :meth:`rows`): a view
        of the file's map, or with ``row_order`` (indices of rows) a gathered copy."""
        raw = self.raw(name).view(self.rows(name), -1)
        return raw if row_order is None else raw[row_order]

    def tensor(self, name, dtype=torch.float32, *, row_order=None):
        """The tensor ``name`` dequantized to ``dtype`` (a new tensor, HF shape: slowest
        dim first). ``row_order``: indices of its rows (:meth:`rows`: the leading dims
        flattened) taken, in that order, before anything is dequantized; the result is
        then ``[len(row_order), row]`` (1-D: ``[len(row_order)]``)."""
        t = self.tensors[name]
        shape = t.shape
        if row_order is None:
            raw = self.raw(name)
        else:
            raw = self.raw_rows(name, row_order).reshape(-1)
            shape = (len(row_order), *shape[1:]) if len(shape) == 1 else (len(row_order), shape[-1])
        if t.ggml_type in _FLOATS:
            return raw.view(_FLOATS[t.ggml_type]).to(dtype, copy=True).view(shape)
        if t.ggml_type not in _NATIVE:
            import gguf

            w = gguf.quants.dequantize(raw.numpy(), gguf.GGMLQuantizationType(t.ggml_type))
            return torch.from_numpy(np.ascontiguousarray(w)).to(dtype).view(shape)
        out = torch.empty(shape, dtype=dtype)
        _, block, block_bytes = _NATIVE[t.ggml_type]
        blocks = raw.view(-1, block_bytes)
        flat = out.view(-1, block)
        step = max(1, CHUNK_ELEMENTS // block)
        for b0 in range(0, blocks.shape[0], step):
            b1 = min(b0 + step, blocks.shape[0])
            _dequantize_blocks(t.ggml_type, blocks[b0:b1], flat[b0:b1])
        return out


def _dequantize_blocks(ggml_type, blocks, out):
    """Blocks ``[n, bytes per block]`` uint8 of a native quantized type -> ``out [n, 32]``
    (any float dtype), as ``gguf.quants`` computes them in fp32.

    Each step is a same-dtype torch op: a mixed one (uint8 times fp32) takes torch's
    scalar casting loop, 3x slower over a model (0.56 vs 0.18 s for SmolLM2's Q4_1
    tensors, one thread). The 16 bytes of nibbles are split 4 bytes at a time, the low
    nibbles being the block's first 16 values."""
    n = blocks.shape[0]
    d = blocks[:, 0:2].contiguous().view(torch.float16).float()  # [n, 1]: the scales
    if ggml_type == Q8_0:
        w = blocks[:, 2:].view(torch.int8).float()
        w.mul_(d)
    else:  # Q4_0, Q4_1: the nibbles are the 16 bytes after the scale (and Q4_1's min)
        qs = blocks[:, -16:]
        if qs.storage_offset() % 4 or qs.stride(0) % 4:  # Q4_0's 18-byte blocks
            qs = qs.contiguous()
        qs = qs.view(torch.int32)  # [n, 4]
        q = torch.empty(n, 2, 4, dtype=torch.int32)
        torch.bitwise_and(qs, 0x0F0F0F0F, out=q[:, 0])
        torch.bitwise_right_shift(qs, 4, out=q[:, 1])
        q[:, 1].bitwise_and_(0x0F0F0F0F)
        w = q.view(torch.uint8).view(n, 32).float()
        if ggml_type == Q4_0:
            w.sub_(8).mul_(d)
        else:
            w.mul_(d).add_(blocks[:, 2:4].contiguous().view(torch.float16).float())
    out.copy_(w)
