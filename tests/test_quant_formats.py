"""numkern.quant's layout (docs/kernels.md §13): the repack of every type is exact
(dequantising the repacked weight equals gguf's own dequantisation bit for bit), the
bytes sit where the layout says, MXFP4 in both forms matches the OCP MX spec, and bad
input is refused by name.

The references are independent of the code under test: ``gguf.quants.dequantize`` on
the original bytes, the layout's byte formulas written out as plain loops, a NumPy
decoder of E2M1/E8M0 written from the OCP MX v1.0 spec, and transformers'
``convert_moe_packed_tensors`` for GPT-OSS's safetensors form. Nothing here compiles a
kernel but ``sections`` (one small function).
"""

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as GT

from numkern.quant import QUANT_TYPES, QuantWeight, dequantize, repack, repack_mxfp4
from numkern.quant import formats as F
from numkern.testing.quantize import quantize

ODD_N = 37  # rows: not a multiple of the 16-row block (2 whole blocks + 5 rows)
SCALE_FIELDS = {  # per type: (byte offset, kind) of each scale field in a GGUF block
    "Q8_0": [(0, "f16")],
    "Q4_0": [(0, "f16")],
    "Q4_1": [(0, "f16"), (2, "f16")],
    "Q5_0": [(0, "f16")],
    "Q5_1": [(0, "f16"), (2, "f16")],
    "Q4_K": [(0, "f16"), (2, "f16")],
    "Q5_K": [(0, "f16"), (2, "f16")],
    "Q6_K": [(208, "f16")],
    "MXFP4": [(0, "e8m0")],
}
# fp16 bit patterns at the edges: +-0, smallest subnormal, largest normal, 1, -1
EXTREME_F16 = np.array([0x0000, 0x8000, 0x0001, 0x8001, 0x7BFF, 0xFBFF, 0x3C00, 0xBC00], "<u2")
EXTREME_E8M0 = np.array([0, 1, 2, 126, 127, 128, 200, 254], np.uint8)


def _odd_k(qtype):
    return int(F.BLOCK[F.CODE[qtype]]) * 3  # an odd multiple of the type's block


def _row_bytes(qtype, k):
    c = F.CODE[qtype]
    return k // int(F.BLOCK[c]) * int(F.BLOCK_BYTES[c])


def _plain(shape, dtype):
    return torch.empty(shape, dtype=dtype)


def _gguf(raw, qtype):
    with np.errstate(over="ignore"):  # MXFP4 2^126 * 12 overflows to inf (in both)
        return gguf.quants.dequantize(raw, GT[qtype])


def _finite_scales(raw, qtype):
    """Random bytes made valid: every non-finite scale field replaced (in place)."""
    blk = raw.reshape(-1, int(F.BLOCK_BYTES[F.CODE[qtype]]))
    for off, kind in SCALE_FIELDS[qtype]:
        if kind == "e8m0":
            blk[:, off] = np.minimum(blk[:, off], 254)
        else:
            v = np.ascontiguousarray(blk[:, off : off + 2]).view("<u2")
            v[(v & 0x7C00) == 0x7C00] &= 0xBBFF  # exponent 31 -> 30: finite
            blk[:, off : off + 2] = v.view(np.uint8)
    return raw


def _assert_bits_equal(got, ref):
    assert got.shape == ref.shape and got.dtype == np.float32
    diff = got.view(np.uint32) != ref.view(np.uint32)
    assert not diff.any(), f"{diff.sum()} elements differ, first at {np.argwhere(diff)[0]}"


@pytest.mark.parametrize("qtype", QUANT_TYPES)
def test_random_bytes_dequantize_bit_exact(qtype):
    """Any valid block (random codes, random finite scales incl. subnormal and negative),
    2-D with N = 37 and 3-D (MoE) with E = 3: bit-exact with gguf."""
    rng = np.random.default_rng(F.CODE[qtype])
    k = _odd_k(qtype)
    for shape in ((ODD_N, k), (1, k), (3, 13, k)):
        raw = rng.integers(0, 256, (*shape[:-1], _row_bytes(qtype, k)), dtype=np.uint8)
        raw = _finite_scales(raw, qtype)
        w = repack(torch.from_numpy(raw), qtype, shape, empty=_plain)
        assert (w.qtype, w.code, w.shape) == (qtype, F.CODE[qtype], shape)
        assert w.data.shape == (*shape[:-2], F.section_offsets(w.code, *shape[-2:])["nbytes"])
        _assert_bits_equal(dequantize(w).numpy(), _gguf(raw, qtype))


@pytest.mark.parametrize("qtype", QUANT_TYPES)
def test_extreme_and_zero_scales_bit_exact(qtype):
    """Every scale field set to each edge value (zero, -0, subnormal, fp16 max, E8M0 0,
    1, 254), each K-quant sub-scale at 0 and its largest: bit-exact with gguf."""
    rng = np.random.default_rng(100 + F.CODE[qtype])
    k = _odd_k(qtype)
    n = 32
    raw = rng.integers(0, 256, (n, _row_bytes(qtype, k)), dtype=np.uint8)
    blk = raw.reshape(n, 3, -1)
    for off, kind in SCALE_FIELDS[qtype]:
        edges = EXTREME_E8M0 if kind == "e8m0" else EXTREME_F16.view(np.uint8).reshape(-1, 2)
        pick = rng.integers(0, len(edges), (n, 3))
        if kind == "e8m0":
            blk[..., off] = edges[pick]
        else:
            blk[..., off : off + 2] = edges[pick]
    if qtype in ("Q4_K", "Q5_K"):  # 6-bit sc/mn all 0 in rows 0-7, all 63 in rows 8-15
        blk[:8, :, 4:16] = 0
        blk[8:16, :, 4:16] = 0xFF
    if qtype == "Q6_K":  # int8 sub-scales at -128, 127, 0
        blk[:8, :, 192:208] = 0x80
        blk[8:16, :, 192:208] = 0x7F
        blk[16:24, :, 192:208] = 0
    w = repack(raw, qtype, (n, k), empty=_plain)
    _assert_bits_equal(dequantize(w).numpy(), _gguf(raw, qtype))


@pytest.mark.parametrize("qtype", QUANT_TYPES)
def test_quantised_weight_round_trip_and_casts(qtype):
    """A real weight through numkern.testing.quantize: valid blocks close to the weight,
    the repack exact, ``dtype=`` one cast of the fp32 result, ``rows=`` those rows."""
    torch.manual_seed(0)
    k = _odd_k(qtype)
    wf = torch.randn(ODD_N, k)
    raw = quantize(wf, qtype)
    assert raw.shape == (ODD_N, _row_bytes(qtype, k)) and raw.dtype == np.uint8
    ref = _gguf(raw, qtype)
    rel = np.abs(ref - wf.numpy()).max() / np.abs(wf.numpy()).max()
    assert rel < 0.25  # a valid quantisation of wf (MXFP4's gguf rounding clips most)
    w = repack(raw, qtype, (ODD_N, k))
    _assert_bits_equal(dequantize(w).numpy(), ref)
    expect = torch.from_numpy(ref).to(torch.bfloat16)
    assert torch.equal(
        dequantize(w, dtype=torch.bfloat16).view(torch.int16), expect.view(torch.int16)
    )
    rows = [36, 0, 17, 17, 5]
    _assert_bits_equal(dequantize(w, rows=torch.tensor(rows)).numpy(), ref[rows])


def _expected_codes(u, bits):
    """The layout's code planes written out byte by byte (docs/kernels.md §13) from the
    codes u [N, K]: (plane, high plane or None)."""
    n, k = u.shape
    nrb = -(-n // 16)
    up = np.zeros((nrb * 16, k), np.int64)
    up[:n] = u
    if bits == 8:
        plane = np.zeros(nrb * 16 * k, np.uint8)
        for rb in range(nrb):
            for c in range(k // 4):
                for j in range(16):
                    for i in range(4):
                        plane[rb * 16 * k + c * 64 + j * 4 + i] = up[16 * rb + j, 4 * c + i]
        return plane, None
    plane = np.zeros(nrb * 8 * k, np.uint8)
    for rb in range(nrb):
        for c in range(k // 8):
            for j in range(16):
                for i in range(4):
                    lo, hi = up[16 * rb + j, 8 * c + i], up[16 * rb + j, 8 * c + 4 + i]
                    plane[rb * 8 * k + c * 64 + j * 4 + i] = (lo & 15) | (hi & 15) << 4
    if bits == 4:
        return plane, None
    high = np.zeros(nrb * 4 * k, np.uint8)
    for rb in range(nrb):
        for c in range(k // 16):
            for j in range(16):
                for i in range(4):
                    h = [up[16 * rb + j, 16 * c + 4 * q + i] >> 4 for q in range(4)]
                    high[rb * 4 * k + c * 64 + j * 4 + i] = h[0] | h[1] << 2 | h[2] << 4 | h[3] << 6
    return plane, high


# per type: the GGUF bytes that make every scale 1 (and every min 0), so that gguf's
# dequantised value is the code minus the offset: fields (offset, bytes)
UNIT_SCALES = {
    "Q8_0": [(0, b"\x00\x3c")],
    "Q4_0": [(0, b"\x00\x3c")],
    "Q4_1": [(0, b"\x00\x3c"), (2, b"\x00\x00")],
    "Q5_0": [(0, b"\x00\x3c")],
    "Q5_1": [(0, b"\x00\x3c"), (2, b"\x00\x00")],
    "Q4_K": [(0, b"\x00\x3c"), (2, b"\x00\x00"), (4, bytes([1] * 4 + [0] * 4 + [1] * 4))],
    "Q5_K": [(0, b"\x00\x3c"), (2, b"\x00\x00"), (4, bytes([1] * 4 + [0] * 4 + [1] * 4))],
    "Q6_K": [(192, bytes([1] * 16)), (208, b"\x00\x3c")],
    "MXFP4": [(0, bytes([128]))],
}


@pytest.mark.parametrize("qtype", QUANT_TYPES)
def test_layout_bytes_where_the_spec_puts_them(qtype):
    """With unit scales gguf's value is ``u - offset``: the code planes hold u at the
    bytes the layout's formulas name, pad rows are zero, and the scale sections hold
    each row's block scales ``[nrb, G, 16]`` (random scales, read from the raw bytes)."""
    rng = np.random.default_rng(200 + F.CODE[qtype])
    code = F.CODE[qtype]
    n, k = 21, int(F.BLOCK[code])
    raw = rng.integers(0, 256, (n, _row_bytes(qtype, k)), dtype=np.uint8)
    for off, b in UNIT_SCALES[qtype]:
        raw[:, off : off + len(b)] = np.frombuffer(b, np.uint8)
    ref = _gguf(raw, qtype)
    if qtype == "MXFP4":  # the nibble is the E2M1 code: u = LUT[code]
        nib = np.concatenate([raw[:, 1:17] & 15, raw[:, 1:17] >> 4], axis=1)
        assert np.array_equal(F.MXFP4_LUT[nib].astype(np.float32) - 12, ref)
        u = nib
    else:
        u = (ref + F.OFFSET[code]).astype(np.int64)
    w = repack(raw, qtype, (n, k), empty=lambda s, d: torch.full(s, 0xAB, dtype=d))
    buf = w.data.numpy()
    offs = w.sections
    plane, high = _expected_codes(u, int(F.BITS[code]))
    assert np.array_equal(buf[offs["codes"] : offs["codes"] + plane.size], plane)
    if high is not None:
        assert np.array_equal(buf[offs["high"] : offs["high"] + high.size], high)
    # the scales: random again, checked against the raw fields
    raw = _finite_scales(rng.integers(0, 256, raw.shape, dtype=np.uint8), qtype)
    buf = repack(raw, qtype, (n, k), empty=_plain).data.numpy()
    nrb = 2
    pad = np.zeros((nrb * 16 - n, raw.shape[1]), np.uint8)
    rawp = np.concatenate([raw, pad])  # pad rows: zero scales

    def section(name, dt, width):
        a = buf[offs[name] :].view(dt)[: nrb * width * 16]
        return a.reshape(nrb, width, 16).transpose(0, 2, 1).reshape(nrb * 16, width)

    def f16(off):
        return np.ascontiguousarray(rawp[:, off : off + 2]).view("<u2")

    if F.KIND[code] == 0:
        assert np.array_equal(section("d", "<u2", 1), f16(0))
        if F.HAS_MIN[code]:
            assert np.array_equal(section("m", "<u2", 1), f16(2))
    elif F.KIND[code] == 1:
        d_off = 208 if qtype == "Q6_K" else 0
        assert np.array_equal(section("d", "<f4", 1), f16(d_off).view(np.float16).astype("<f4"))
        if qtype == "Q6_K":
            assert np.array_equal(section("sc", np.int8, 16), rawp[:, 192:208].view(np.int8))
        else:
            sc, mn = gguf.quants.Q4_K.get_scale_min(np.ascontiguousarray(rawp[:, 4:16]))
            assert np.array_equal(section("m", "<f4", 1), f16(2).view(np.float16).astype("<f4"))
            assert np.array_equal(section("sc", np.uint8, 8), sc)
            assert np.array_equal(section("mn", np.uint8, 8), mn)
    else:
        assert np.array_equal(section("d", np.uint8, 1), rawp[:, :1])


@pytest.mark.parametrize("n,k", [(1, 256), (21, 768), (100, 512)])
def test_sections_aligned_disjoint_and_jit_callable(n, k):
    """Every section 64-byte aligned, in order, with its size from the layout; the
    function compiles (the kernels call it) and agrees with its Python evaluation."""
    nrb = -(-n // 16)
    for code, qtype in enumerate(QUANT_TYPES):
        offs = F.section_offsets(code, n, k)
        assert F.sections(code, n, k) == tuple(offs.values())
        g = k // int(F.GROUP[code])
        sizes = {"codes": nrb * 16 * k * (1 if F.BITS[code] == 8 else 0.5)}
        if F.BITS[code] == 6:
            sizes["high"] = nrb * 4 * k
        kind = F.KIND[code]
        sizes["d"] = nrb * 16 * (2 * g if kind == 0 else 4 * k // 256 if kind == 1 else g)
        if F.HAS_MIN[code]:
            sizes["m"] = sizes["d"]
        if kind == 1:
            sizes["sc"] = nrb * 16 * g
            if F.HAS_MIN[code]:
                sizes["mn"] = nrb * 16 * g
        pos = 0
        for name in F.SECTION_NAMES:
            if name not in sizes:
                assert offs[name] == -1, (qtype, name)
                continue
            assert offs[name] >= pos and offs[name] % 64 == 0, (qtype, name)
            assert offs[name] - pos < 64, (qtype, name)  # no more than alignment between
            pos = offs[name] + int(sizes[name])
        assert offs["nbytes"] == -(-pos // 64) * 64, qtype


# --- MXFP4 against the OCP Microscaling Formats (MX) v1.0 spec ----------------------------


def _ocp_e2m1(code):
    """E2M1 (OCP MX v1.0 §5.3.3): sign bit 3, exponent bits 2-1 (bias 1), mantissa bit 0;
    exponent 0 is subnormal (0.5 * m)."""
    code = np.asarray(code, np.int64)
    s, e, m = code >> 3, (code >> 1) & 3, code & 1
    mag = np.where(e == 0, 0.5 * m, 2.0 ** (e - 1) * (1 + 0.5 * m))
    return np.where(s == 1, -mag, mag)


def _ocp_e8m0(x):
    """E8M0 (OCP MX v1.0 §5.4.1): 2^(x - 127), 0xFF = NaN."""
    x = np.asarray(x, np.float64)
    return np.where(x == 255, np.nan, 2.0 ** (x - 127))


def _assert_values_equal(got, ref):
    """Equal values (E2M1's -0, code 8, dequantises to +0 as in gguf and ggml: equal)."""
    assert got.shape == ref.shape and got.dtype == np.float32
    diff = got != ref
    assert not diff.any(), f"{diff.sum()} elements differ, first at {np.argwhere(diff)[0]}"


def _mxfp4_case(seed, e, n, kb):
    rng = np.random.default_rng(seed)
    codes = rng.integers(0, 16, (e, n, kb, 32))  # element order along K
    scales = rng.integers(100, 155, (e, n, kb)).astype(np.uint8)
    scales[0, 0, :3] = [0, 1, 254]  # the E8M0 edges (fp32 holds 2^-127 * 0.5 .. 6 * 2^127)
    ref = _ocp_e2m1(codes) * _ocp_e8m0(scales)[..., None]
    with np.errstate(over="ignore"):
        ref = ref.reshape(e, n, kb * 32).astype(np.float32)  # exact: the product is a power
    return codes, scales, ref


def test_mxfp4_both_forms_match_ocp_spec():
    """GPT-OSS safetensors form (element 2i = byte i's low nibble, 2i+1 its high) and
    GGUF's form (element i low, 16 + i high; one E8M0 byte before each block) of the same
    values: each dequantises to the OCP spec's value, and both repack to the same bytes."""
    e, n, kb = 2, 19, 3
    codes, scales, ref = _mxfp4_case(7, e, n, kb)
    blocks = (codes[..., 0::2] | codes[..., 1::2] << 4).astype(np.uint8)  # [E, N, K/32, 16]
    ws = repack_mxfp4(torch.from_numpy(blocks), torch.from_numpy(scales), empty=_plain)
    assert ws.shape == (e, n, kb * 32) and ws.qtype == "MXFP4"
    _assert_values_equal(dequantize(ws).numpy(), ref)
    qs = (codes[..., :16] | codes[..., 16:] << 4).astype(np.uint8)
    raw = np.concatenate([scales[..., None], qs], axis=-1).reshape(e, n, -1)
    wg = repack(raw, "MXFP4", (e, n, kb * 32), empty=_plain)
    _assert_values_equal(dequantize(wg).numpy(), ref)
    assert torch.equal(ws.data, wg.data)
    # a 2-D (dense) weight in the safetensors form
    w2 = repack_mxfp4(blocks[1], scales[1], empty=_plain)
    _assert_values_equal(dequantize(w2).numpy(), ref[1])


def test_mxfp4_safetensors_matches_transformers():
    """transformers' own MXFP4 dequantisation of GPT-OSS experts (fp32, its [E, K, N]
    layout) equals ours transposed."""
    mx = pytest.importorskip("transformers.integrations.mxfp4")
    codes, scales, _ = _mxfp4_case(8, 2, 24, 3)
    scales[0, 0, :3] = 127  # transformers' ldexp path: keep to normal exponents
    blocks = torch.from_numpy((codes[..., 0::2] | codes[..., 1::2] << 4).astype(np.uint8))
    theirs = mx.convert_moe_packed_tensors(blocks, torch.from_numpy(scales), dtype=torch.float32)
    ours = dequantize(repack_mxfp4(blocks, torch.from_numpy(scales), empty=_plain))
    assert torch.equal(ours.transpose(1, 2), theirs)


# --- refusals -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "qtype,off,value",
    [
        ("Q8_0", 0, 0x7C00),  # +inf d
        ("Q4_1", 2, 0xFE00),  # NaN m
        ("Q5_0", 0, 0xFC00),  # -inf d
        ("Q4_K", 2, 0x7C00),  # inf dmin
        ("Q6_K", 208, 0x7E00),  # NaN d
        ("MXFP4", 0, 255),  # E8M0 NaN
    ],
)
def test_non_finite_block_scale_names_tensor_and_block(qtype, off, value):
    k = _odd_k(qtype)
    raw = quantize(np.random.default_rng(3).standard_normal((3, 20, k)), qtype)
    blk = raw.reshape(3, 20, 3, -1)
    if qtype == "MXFP4":
        blk[1, 17, 2, off] = value
    else:
        blk[1, 17, 2, off : off + 2] = np.array([value], "<u2").view(np.uint8)
    block = int(F.BLOCK[F.CODE[qtype]])
    with pytest.raises(
        ValueError,
        match=rf"blk\.3\.ffn_up_exps\.weight: .*{qtype} block at "
        rf"expert 1, row 17, K {2 * block}\.\.{3 * block - 1} \(block 2",
    ):
        repack(raw, qtype, (3, 20, k), name="blk.3.ffn_up_exps.weight", empty=_plain)


def test_mxfp4_safetensors_nan_scale_refused():
    blocks = np.zeros((2, 4, 3, 16), np.uint8)
    scales = np.full((2, 4, 3), 127, np.uint8)
    scales[1, 2, 0] = 255
    with pytest.raises(
        ValueError,
        match=r"mlp\.experts\.down_proj_blocks: E8M0 scale 255 \(NaN\) "
        r"in MXFP4 block at expert 1, row 2, K 0\.\.31",
    ):
        repack_mxfp4(blocks, scales, name="mlp.experts.down_proj_blocks")


def test_bad_arguments_refused_by_name():
    raw = np.zeros((16, _row_bytes("Q4_K", 256)), np.uint8)
    with pytest.raises(
        ValueError, match=r"w1: K of a Q4_K weight must be a multiple of 256, got 96"
    ):
        repack(np.zeros((16, 54), np.uint8), "Q4_K", (16, 96), name="w1")
    with pytest.raises(
        ValueError, match=r"raw: expected Q4_K bytes of shape \(16, 144\), got \(15, 144\)"
    ):
        repack(raw[:15], "Q4_K", (16, 256))
    with pytest.raises(ValueError, match=r"qtype: expected one of Q8_0, .*MXFP4, got 'Q2_K'"):
        repack(raw, "Q2_K", (16, 256))
    with pytest.raises(ValueError, match=r"shape: expected \(N, K\) or \(E, N, K\), got \(256,\)"):
        repack(raw, "Q4_K", (256,))
    with pytest.raises(TypeError, match=r"raw: expected dtype uint8, got float32"):
        repack(raw.astype(np.float32), "Q4_K", (16, 256))
    with pytest.raises(ValueError, match=r"scales: expected shape \(2, 4, 3\), got \(2, 4, 2\)"):
        repack_mxfp4(np.zeros((2, 4, 3, 16), np.uint8), np.zeros((2, 4, 2), np.uint8))
    with pytest.raises(
        ValueError, match=r"blocks: expected \[E, N, K/32, 16\] or \[N, K/32, 16\], got \(4, 3, 8\)"
    ):
        repack_mxfp4(np.zeros((4, 3, 8), np.uint8), np.zeros((4, 3), np.uint8))
    with pytest.raises(
        ValueError, match=r"w: expected a last dimension that is a multiple of 256 \(Q6_K\)"
    ):
        quantize(np.zeros((2, 96), np.float32), "Q6_K")
    w = repack(raw, "Q4_K", (16, 256), empty=_plain)
    with pytest.raises(
        ValueError,
        match=r"QuantWeight.data: expected contiguous uint8 \(4864,\), got torch.uint8 \(2432,\)",
    ):
        QuantWeight("Q4_K", w.code, (20, 256), w.data)
    with pytest.raises(ValueError, match=r"rows: expected 1-D indices in \[0, 16\)"):
        dequantize(w, rows=[16])


def test_threads_and_a_file_read_back(tmp_path):
    """A tensor written by gguf's writer and read back by its reader (a memmap
    ``[E, N, row_bytes]``) repacks as read; 1 and 3 threads give the same bytes; the
    first bad slab's error is the one raised whatever the thread count."""
    raw = quantize(np.random.default_rng(4).standard_normal((3, 40, 512)), "Q5_K")
    path = str(tmp_path / "t.gguf")
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_tensor("blk.0.ffn_up_exps.weight", raw, raw_dtype=GT.Q5_K)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    t = gguf.GGUFReader(path).tensors[0]
    shape = tuple(int(s) for s in reversed(t.shape))
    assert shape == (3, 40, 512) and t.data.shape == raw.shape
    one = repack(t.data, t.tensor_type.name, shape, empty=_plain, threads=1)
    three = repack(raw, "Q5_K", shape, empty=_plain, threads=3)
    assert torch.equal(one.data, three.data)
    _assert_bits_equal(dequantize(one).numpy(), _gguf(raw, "Q5_K"))
    bad = raw.copy()
    bad.reshape(3, 40, 2, -1)[2, 1, 0, 0:2] = [0, 0x7C]  # expert 2 row 1, then expert 1
    bad.reshape(3, 40, 2, -1)[1, 39, 1, 0:2] = [0, 0x7C]
    for threads in (1, 3):
        with pytest.raises(ValueError, match=r"expert 1, row 39, K 256\.\.511"):
            repack(bad, "Q5_K", shape, empty=_plain, threads=threads)
    with pytest.raises(ValueError, match=r"threads: expected an int >= 1 or None, got 0"):
        repack(raw, "Q5_K", shape, threads=0)


def test_allocator_and_default_placement():
    """``empty=`` receives ``([E,] nbytes, uint8)`` and its tensor is the weight's data;
    by default ``numkern.memory.weight_empty`` places it."""
    calls = []

    def arena(shape, dtype):
        calls.append((shape, dtype))
        return torch.zeros(shape, dtype=dtype)

    raw = quantize(np.ones((2, 16, 64), np.float32), "Q8_0")
    w = repack(raw, "Q8_0", (2, 16, 64), empty=arena)
    assert calls == [((2, w.nbytes), torch.uint8)]
    assert w.nbytes == F.section_offsets(F.Q8_0, 16, 64)["nbytes"]
    assert torch.equal(repack(raw, "Q8_0", (2, 16, 64)).data, w.data)
