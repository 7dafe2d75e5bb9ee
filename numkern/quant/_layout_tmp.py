"""TEMPORARY stand-in for H1's numkern.quant.formats (type table + sections), spec §1.
Replaced by formats' own functions at merge."""

from typing import NamedTuple

import numpy as np

from .._jit import jit

NAMES = ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K", "MXFP4")
# bits, group, offset, kind, has_min, sc_signed, lut, block
TABLE = np.array(
    [
        [8, 32, 128, 0, 0, 0, 0, 32],
        [4, 32, 8, 0, 0, 0, 0, 32],
        [4, 32, 0, 0, 1, 0, 0, 32],
        [6, 32, 16, 0, 0, 0, 0, 32],
        [6, 32, 0, 0, 1, 0, 0, 32],
        [4, 32, 0, 1, 1, 0, 0, 256],
        [6, 32, 0, 1, 1, 0, 0, 256],
        [6, 16, 32, 1, 0, 1, 0, 256],
        [4, 32, 12, 2, 0, 0, 1, 32],
    ],
    np.int64,
)


class Sections(NamedTuple):
    codes: int
    high: int
    d: int
    m: int
    D: int
    M: int
    sc: int
    mn: int
    e: int
    total: int


@jit
def sections(code, n, k):
    bits, group, kind, has_min = TABLE[code, 0], TABLE[code, 1], TABLE[code, 3], TABLE[code, 4]
    nrb = (n + 15) // 16
    g = k // group
    s = k // 256
    pos = 0
    codes = pos
    pos += nrb * k * (16 if bits == 8 else 8)
    pos = (pos + 63) // 64 * 64
    high = pos
    if bits == 6:
        pos += nrb * k * 4
    d = m = dd = mm = sc = mn = e = pos
    if kind == 0:
        d = pos
        pos = (pos + nrb * g * 32 + 63) // 64 * 64
        m = pos
        if has_min:
            pos = (pos + nrb * g * 32 + 63) // 64 * 64
    elif kind == 1:
        dd = pos
        pos = (pos + nrb * s * 64 + 63) // 64 * 64
        mm = pos
        if has_min:
            pos = (pos + nrb * s * 64 + 63) // 64 * 64
        sc = pos
        pos = (pos + nrb * g * 16 + 63) // 64 * 64
        mn = pos
        if has_min:
            pos = (pos + nrb * g * 16 + 63) // 64 * 64
    else:
        e = pos
        pos = (pos + nrb * g * 16 + 63) // 64 * 64
    return Sections(codes, high, d, m, dd, mm, sc, mn, e, pos)
