"""A NumPy reference quantiser to GGUF block bytes, for tests: every type
``numkern.quant`` keeps quantised (:data:`numkern.quant.QUANT_TYPES`).

``quantize(w, qtype) -> uint8 [..., row_bytes]``: ``w`` float ``[..., K]`` (NumPy or
torch), K a multiple of the type's GGML block (32, or 256 for the K-quants). Q8_0, Q4_0,
Q4_1, Q5_0, Q5_1 and MXFP4 use gguf's own quantisers (llama.cpp's rounding); gguf has
none for the K-quants, so Q4_K, Q5_K and Q6_K are quantised here with plain
round-to-nearest (min/max per sub-block, scales rounded to the 6-bit / int8 grid of a
fp16 super-block scale). The blocks are valid GGUF blocks, not llama.cpp's
error-minimising choice: dequantising them with ``gguf.quants.dequantize`` gives a weight
within about half a step of ``w``, which is all a test of a kernel or a loader needs.
"""

import numpy as np

from ..quant.formats import BLOCK, BLOCK_BYTES, GGML_TYPE, code_of

QK = 256  # K per K-quant super-block


def _f16(x):
    """fp32 -> (fp16-rounded value as fp32, its 2 bytes [..., 2])."""
    h = np.asarray(x, np.float32).astype(np.float16)
    return h.astype(np.float32), h[..., None].view(np.uint8)


def _div(a, b):
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(b == 0, 0, a / np.where(b == 0, 1, b))


def _pack_scale_min_k4(sc, mn):
    """6-bit sc, mn [nb, 8] -> the 12 packed bytes of Q4_K / Q5_K (inverse of gguf's
    ``Q4_K.get_scale_min``)."""
    d = sc[:, :4] | ((sc[:, 4:] >> 4) << 6)
    m = mn[:, :4] | ((mn[:, 4:] >> 4) << 6)
    md = (sc[:, 4:] & 15) | ((mn[:, 4:] & 15) << 4)
    return np.concatenate([d, m, md], axis=1).astype(np.uint8)


def _q45_k(x, qmax):
    """Q4_K (qmax 15) / Q5_K (qmax 31): x [nb, 256] -> (d, dmin, scales[12], q [nb, 256])."""
    sub = x.reshape(-1, 8, 32)
    lo = np.minimum(sub.min(axis=2), 0)  # w = d*q - m with m >= 0: the range holds 0
    scale = (sub.max(axis=2) - lo) / qmax
    big_d, d_bytes = _f16(scale.max(axis=1) / 63)
    big_m, m_bytes = _f16(-lo.min(axis=1) / 63)
    sc = np.clip(np.rint(_div(scale, big_d[:, None])), 0, 63).astype(np.uint8)
    mn = np.clip(np.rint(_div(-lo, big_m[:, None])), 0, 63).astype(np.uint8)
    dg = big_d[:, None] * sc
    mg = big_m[:, None] * mn
    q = np.clip(np.rint(_div(sub + mg[..., None], dg[..., None])), 0, qmax).astype(np.uint8)
    return d_bytes, m_bytes, _pack_scale_min_k4(sc, mn), q.reshape(-1, QK)


def _nibbles_k(q):
    """q [nb, 256] -> 128 bytes: byte 32c + i = q[64c + i] | q[64c + 32 + i] << 4."""
    q = (q & 15).reshape(-1, 4, 2, 32)
    return (q[:, :, 0] | (q[:, :, 1] << 4)).reshape(-1, 128)


def _q4_k(x):
    d, m, scales, q = _q45_k(x, 15)
    return np.concatenate([d, m, scales, _nibbles_k(q)], axis=1)


def _q5_k(x):
    d, m, scales, q = _q45_k(x, 31)
    bits = (q >> 4).reshape(-1, 8, 32)  # bit j of qh[i]: the high bit of q[32j + i]
    qh = np.packbits(bits.transpose(0, 2, 1), axis=2, bitorder="little").reshape(-1, 32)
    return np.concatenate([d, m, scales, qh, _nibbles_k(q)], axis=1)


def _q6_k(x):
    sub = x.reshape(-1, 16, 16)
    scale = np.abs(sub).max(axis=2) / 31  # q in -31..31 (the type allows -32..31)
    big_d, d_bytes = _f16(scale.max(axis=1) / 127)
    sc = np.clip(np.rint(_div(scale, big_d[:, None])), -128, 127).astype(np.int8)
    dg = big_d[:, None] * sc
    q = np.clip(np.rint(_div(sub, dg[..., None])), -32, 31).astype(np.int16) + 32
    q = q.astype(np.uint8).reshape(-1, 2, 128)  # two halves of 128
    low = (q & 15).reshape(-1, 2, 2, 64)  # element 128h + 64s + i -> ql[64h + i] nibble s
    ql = (low[:, :, 0] | (low[:, :, 1] << 4)).reshape(-1, 128)
    high = (q >> 4).reshape(-1, 2, 4, 32)  # element 128h + 32s + i -> qh[32h + i] bits 2s
    qh = high[:, :, 0] | (high[:, :, 1] << 2) | (high[:, :, 2] << 4) | (high[:, :, 3] << 6)
    return np.concatenate([ql, qh.reshape(-1, 64), sc.view(np.uint8), d_bytes], axis=1)


_OWN = {"Q4_K": _q4_k, "Q5_K": _q5_k, "Q6_K": _q6_k}


def quantize(w, qtype):
    """``w`` float ``[..., K]`` (NumPy or torch) -> GGUF bytes uint8 ``[..., row_bytes]``
    of type ``qtype`` (a name in ``numkern.quant.QUANT_TYPES``). ValueError for a K
    that is not a multiple of the type's block or a non-finite ``w``."""
    code = code_of(qtype)
    if hasattr(w, "detach"):
        w = w.detach().float().cpu().numpy()
    x = np.ascontiguousarray(w, np.float32)
    block = int(BLOCK[code])
    if x.ndim < 1 or x.shape[-1] % block:
        raise ValueError(
            f"w: expected a last dimension that is a multiple of {block} ({qtype}), "
            f"got shape {x.shape}"
        )
    if not np.isfinite(x).all():
        raise ValueError("w: expected finite values, got NaN or inf")
    row_bytes = x.shape[-1] // block * int(BLOCK_BYTES[code])
    if qtype in _OWN:
        out = _OWN[qtype](x.reshape(-1, block))
    else:
        import gguf

        out = gguf.quants.quantize(x.reshape(-1, x.shape[-1]), int(GGML_TYPE[code]))
    return np.ascontiguousarray(out, np.uint8).reshape(*x.shape[:-1], row_bytes)
