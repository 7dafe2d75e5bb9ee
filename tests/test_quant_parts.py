"""numkern.quant.join_rows: one weight of parts of several types (docs/kernels.md §13.9).

A fused q|k|v whose parts differ in type (a Q4_K_M file's Q6_K ``attn_v``) runs as one
QuantWeight: every output column is the column of its own part's weight, so
``quant_linear`` on the joined weight must equal, bit for bit, ``quant_linear`` on each
part with its columns of the bias, at M = 1 (the GEMV), M = 3 (4-row tiles) and M = 16
and 37 (AMX-INT8 tiles where the host has them, else the vector code); and
``dequantize`` the concatenation of the parts' own. Compiles no new variant: the
kernels take the parts' codes at run time.
"""

import numpy as np
import pytest
import torch

from numkern.quant import QuantWeight, dequantize, join_rows, quant_linear, repack
from numkern.testing.quantize import quantize

K = 512
# (type, rows): every part but the last whole 16-row blocks; the last one a tail
PARTS = (("Q4_K", 64), ("Q6_K", 32), ("Q8_0", 16), ("MXFP4", 40))


def _weights(parts=PARTS, seed=0):
    rng = np.random.default_rng(seed)
    out = []
    for qtype, n in parts:
        w = rng.standard_normal((n, K)).astype(np.float32) * 0.05
        out.append(repack(quantize(w, qtype), qtype, (n, K)))
    return out


def test_join_rows_is_its_parts():
    ws = _weights()
    j = join_rows(ws)
    assert j.qtype == "parts" and j.shape == (sum(n for _, n in PARTS), K)
    assert [p.qtype for p in j.parts] == [t for t, _ in PARTS]
    for p, w in zip(j.parts, ws):
        assert torch.equal(p.data, w.data)
    dense = dequantize(j)
    assert torch.equal(dense, torch.cat([dequantize(w) for w in ws]))
    rows = torch.tensor([0, 63, 64, 100, 151])
    assert torch.equal(dequantize(j, rows=rows), dense[rows])


@pytest.mark.parametrize(("m", "dt"), [(1, torch.bfloat16), (3, torch.float32),
                                       (16, torch.bfloat16), (37, torch.bfloat16)])  # fmt: skip
def test_quant_linear_equals_each_part(m, dt):
    ws = _weights(seed=m)
    j = join_rows(ws)
    g = torch.Generator().manual_seed(m)
    x = torch.randn(m, K, generator=g).to(dt)
    bias = torch.randn(j.shape[0], generator=g)
    out = torch.full((m, j.shape[0]), float("nan"), dtype=dt)
    quant_linear(out, x, j, bias)
    c = 0
    for w in ws:
        n = w.shape[0]
        ref = torch.empty(m, n, dtype=dt)
        quant_linear(ref, x, w, bias[c : c + n].contiguous())
        assert torch.equal(out[:, c : c + n], ref), (w.qtype, m)
        c += n


def test_join_rows_refusals():
    ws = _weights()
    with pytest.raises(ValueError, match=r"weights\[0\]: expected a multiple of 16 rows"):
        join_rows(_weights((("Q4_K", 40), ("Q8_0", 16))))
    other_k = repack(quantize(np.zeros((16, 256), np.float32), "Q8_0"), "Q8_0", (16, 256))
    with pytest.raises(ValueError, match=r"weights\[1\]: expected K = 512"):
        join_rows([ws[0], other_k])
    with pytest.raises(ValueError, match=r"weights\[0\]: expected a 2-D weight of one type"):
        join_rows([join_rows(ws[:2]), ws[2]])
    with pytest.raises(TypeError, match=r"weights\[1\]: expected a QuantWeight"):
        join_rows([ws[0], torch.zeros(3)])
    with pytest.raises(ValueError, match="weights: expected 1 to 8"):
        join_rows([])
    j = join_rows(ws)
    bad = j.data.clone()
    bad[:8] = torch.tensor([9], dtype=torch.int64).view(torch.uint8)  # 9 parts
    with pytest.raises(ValueError, match="not a valid buffer of parts"):
        QuantWeight("parts", j.code, j.shape, bad)
    with pytest.raises(ValueError, match="not a valid buffer of parts"):
        QuantWeight("parts", j.code, (j.shape[0] + 1, K), j.data)
    with pytest.raises(ValueError, match="a weight of parts has none"):
        _ = j.sections
