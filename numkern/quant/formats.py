"""The quantised-weight types and numkern's layout of them (docs/kernels.md §13).

One table, indexed by a type's ``code`` (the int the kernels switch on), and one
function, :func:`sections`, that gives the byte offsets of a repacked weight's sections
from (code, N, K). Both are plain module-level data and a ``numkern.jit`` function, so
the repack (Python), ``dequantize`` and the kernels (Numba) read the same definition.

Layout of one weight ``[N, K]`` (one buffer per expert for MoE), ``uint8``:

* rows in **row blocks of R = 16** (``nrb = ceil(N / 16)``; pad rows have zero codes and
  zero scales); inside a row block a 64-byte vector holds 16 lanes of 4 bytes, lane
  ``j`` = row ``j`` of the block (the operand of ``vpdpbusd``).
* codes ``u`` are unsigned; ``w[n, k] = d_g[n] * (u - OFFSET) + m_g[n]`` for ``k`` in
  scale group ``g`` (``GROUP`` K wide).
* ``BITS`` 4: per row block per chunk of 8 K (``k0 = 8c``) 64 bytes, lane ``j`` byte
  ``i`` = ``u[j, k0+i] | u[j, k0+4+i] << 4``.
  ``BITS`` 6: the low nibbles as for 4, then a high plane, per chunk of 16 K 64 bytes,
  lane ``j`` byte ``i`` = ``h(k0+i) | h(k0+4+i) << 2 | h(k0+8+i) << 4 | h(k0+12+i) << 6``
  with ``h = u >> 4``.
  ``BITS`` 8: per chunk of 4 K 64 bytes, lane ``j`` byte ``i`` = ``u[j, k0+i]``.
  MXFP4 stores its E2M1 code as the nibble; ``u = MXFP4_LUT[nibble]``.
* scales, per ``KIND``: 0: ``d`` fp16 bits ``[nrb, G, 16]``, ``m`` fp16 bits (``HAS_MIN``);
  1: ``D`` fp32 ``[nrb, S, 16]`` (one per 256 K), ``M`` fp32 (``HAS_MIN``), ``sc`` u8
  (i8 for Q6_K) ``[nrb, G, 16]``, ``mn`` u8 (``HAS_MIN``), with ``d_g = D * sc`` and
  ``m_g = -(M * mn)``; 2: ``e`` u8 ``[nrb, G, 16]`` (E8M0, ``d_g = 2^(e - 128)``,
  gguf's ``e8m0_to_fp32_half``).

Every section starts 64-byte aligned, in the order of :data:`SECTION_NAMES`.
"""

import numpy as np

from .._jit import jit

ROWS = 16  # rows per row block: one 512-bit vector of 16 int32 lanes, lane j = row j
LANE_BYTES = 4  # bytes per lane: the 4 products vpdpbusd sums into one int32 lane
ALIGN = 64  # section alignment: one cache line / one zmm load

# The type table: row = a type's code. GGML_TYPE is gguf's GGMLQuantizationType value.
QUANT_TYPES = ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K", "MXFP4")
CODE = {name: i for i, name in enumerate(QUANT_TYPES)}
Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K, MXFP4 = range(len(QUANT_TYPES))

GGML_TYPE = np.array([8, 2, 3, 6, 7, 12, 13, 14, 39], np.int64)
BITS = np.array([8, 4, 4, 6, 6, 4, 6, 6, 4], np.int64)  # code width in the layout
GROUP = np.array([32, 32, 32, 32, 32, 32, 32, 16, 32], np.int64)  # K per scale d_g
OFFSET = np.array([128, 8, 0, 16, 0, 0, 0, 32, 12], np.int64)  # w = d * (u - OFFSET) + m
KIND = np.array([0, 0, 0, 0, 0, 1, 1, 1, 2], np.int64)  # scale kind (module docstring)
HAS_MIN = np.array([0, 0, 1, 0, 1, 1, 1, 0, 0], np.int64)
BLOCK = np.array([32, 32, 32, 32, 32, 256, 256, 256, 32], np.int64)  # GGML block: K | it
BLOCK_BYTES = np.array([34, 18, 20, 22, 24, 144, 176, 210, 17], np.int64)  # GGUF bytes
SUPER = 256  # K per fp32 D/M of the K-quants (kind 1)

# MXFP4: E2M1 code -> u; u - 12 is the doubled E2M1 value (gguf's kvalues + 12)
MXFP4_KVALUES = np.array([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12], np.int64)
MXFP4_LUT = (MXFP4_KVALUES + 12).astype(np.uint8)

# A weight of parts (``numkern.quant.join_rows``): row ranges of several types, one buffer
# (docs/kernels.md §13.9). Its code is PARTS (past the table: no row of it); its buffer
# starts with a header of int64 ``[count, nbytes, then per part: first row block, code,
# byte offset, rows]`` of PART_HEADER bytes, each part's own buffer 64-byte aligned after.
PARTS = len(QUANT_TYPES)
MAX_PARTS = 8
PART_FIELDS = 4
PART_HEADER = -(-(2 + PART_FIELDS * MAX_PARTS) * 8 // ALIGN) * ALIGN

# sections() returns these offsets, then the buffer's size; an absent section is -1.
# kind 0: d, m = fp16 bits; kind 1: d = D fp32, m = M fp32, sc, mn; kind 2: d = e u8.
SECTION_NAMES = ("codes", "high", "d", "m", "sc", "mn")


def code_of(qtype):
    """The table row of a type name (``"Q4_K"``); ValueError naming the argument."""
    if qtype not in CODE:
        raise ValueError(f"qtype: expected one of {', '.join(QUANT_TYPES)}, got {qtype!r}")
    return CODE[qtype]


@jit
def sections(code, n, k):
    """Byte offsets ``(codes, high, d, m, sc, mn, nbytes)`` of a repacked ``[n, k]``
    weight of type ``code``; -1 for a section the type lacks. ``k`` must be a multiple of
    ``BLOCK[code]`` (checked by the callers that take user input). Each section's size is
    rounded up to ``ALIGN`` (64) bytes, so every one starts aligned."""
    a = ALIGN - 1
    lanes = (n + ROWS - 1) // ROWS * ROWS  # N padded to whole row blocks
    g = k // GROUP[code]
    has_min = HAS_MIN[code] != 0
    # nibble plane (bits 4 and 6: K/2 bytes a row) or byte plane (bits 8: K bytes a row)
    pos = (lanes * k // (1 if BITS[code] == 8 else 2) + a) // ALIGN * ALIGN
    high = -1
    if BITS[code] == 6:  # 2 high bits a code: K/4 bytes a row
        high = pos
        pos += (lanes * k // 4 + a) // ALIGN * ALIGN
    d = pos
    m = -1
    sc = -1
    mn = -1
    if KIND[code] == 0:  # fp16 d (and m) per group
        pos += (lanes * g * 2 + a) // ALIGN * ALIGN
        if has_min:
            m = pos
            pos += (lanes * g * 2 + a) // ALIGN * ALIGN
    elif KIND[code] == 1:  # fp32 D (and M) per 256 K, 8-bit sc (and mn) per group
        s = k // SUPER
        pos += (lanes * s * 4 + a) // ALIGN * ALIGN
        if has_min:
            m = pos
            pos += (lanes * s * 4 + a) // ALIGN * ALIGN
        sc = pos
        pos += (lanes * g + a) // ALIGN * ALIGN
        if has_min:
            mn = pos
            pos += (lanes * g + a) // ALIGN * ALIGN
    else:  # E8M0 e per group
        pos += (lanes * g + a) // ALIGN * ALIGN
    return 0, high, d, m, sc, mn, pos


def section_offsets(code, n, k):
    """:func:`sections` evaluated in Python (no compilation): a dict name -> offset (-1
    where absent) plus ``"nbytes"``."""
    offs = [int(v) for v in sections.py_func(code, n, k)]
    return dict(zip((*SECTION_NAMES, "nbytes"), offs))
