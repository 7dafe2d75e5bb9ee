"""numkern.isa: feature detection, the ISA list, overrides and the masked fallback."""

import llvmlite.binding as llvm
import pytest
import torch

from numkern import cpu_features, isa, supported_isas

from .conftest import run_child


def test_features_come_from_llvm():
    feats = cpu_features()
    assert {"avx2", "avx512f", "avx512bf16", "avx512vnni", "amx-tile", "amx-bf16", "neon"} <= set(
        feats
    )
    host = dict(llvm.get_host_cpu_features())
    if not isa._host()[2]:  # no mask in this process: identical to LLVM's view
        for name, on in feats.items():
            assert on == bool(host.get(name, False)), name


def test_supported_isas_follow_features():
    isas = supported_isas()
    assert "vec" in isas and "vec16" in isas
    assert ("amx" in isas) == isa.amx_usable()
    if isa.is_x86():
        assert "neon" not in isas


def test_check_isa_errors():
    with pytest.raises(ValueError, match="expected one of"):
        isa.check_isa("avx9000")
    with pytest.raises(TypeError, match="expected a str"):
        isa.check_isa(3)
    if "amx" not in supported_isas():
        with pytest.raises(ValueError, match="cannot run on this CPU"):
            isa.check_isa("amx")
    assert isa.check_isa("vec") == "vec"


def test_isa_override(monkeypatch):
    monkeypatch.delenv("NUMKERN_ISA", raising=False)
    assert isa.isa_override() is None
    monkeypatch.setenv("NUMKERN_ISA", "vec16")
    assert isa.isa_override() == "vec16"
    monkeypatch.setenv("NUMKERN_ISA", "sse")
    with pytest.raises(ValueError, match="NUMKERN_ISA"):
        isa.isa_override()
    if "neon" not in supported_isas():
        monkeypatch.setenv("NUMKERN_ISA", "neon")
        with pytest.raises(ValueError, match="cannot run on this CPU"):
            isa.isa_override()


@pytest.mark.parametrize(
    "mask,match", [("+avx512f", "only be removed"), ("-not-a-feature", "unknown feature")]
)
def test_bad_mask_is_an_error(mask, match):
    code = "import numkern"
    with pytest.raises(pytest.fail.Exception, match=match):
        run_child(code, {"NUMKERN_CPU_FEATURES": mask})


_FALLBACK = """
import re, torch, numba, numkern
from numba import types
from numkern import _tiles, isa
feats = numkern.cpu_features()
assert not feats["avx512f"] and not feats["avx512bw"] and not feats["avx512bf16"], feats
assert not feats["amx-tile"] and "amx" not in numkern.supported_isas()
assert feats["avx2"] == MASK.startswith("-avx512f"), feats
torch.manual_seed(1)
outs = []
for m, n, k in ((1, 200, 2050), (5, 64, 96), (33, 97, 256)):
    w = torch.randn(n, k).bfloat16(); x = torch.randn(m, k).bfloat16(); b = torch.randn(n)
    out = torch.empty(m, n, dtype=torch.bfloat16)
    numkern.weight_packed_linear(out, x, numkern.convert_weight_packed(w), b, True)
    outs.append(out)
torch.save(outs, %r)
u16 = types.Array(types.uint16, 1, "C"); f32 = types.Array(types.float32, 1, "C")
i = types.int64; u32 = types.Array(types.uint32, 1, "C")
rows, wt = types.UniTuple(i, 8), types.NamedTuple([u32, *[i] * 4], _tiles.Weights)
sig = (f32, rows, wt, i, i, f32, rows)
_tiles.tile8.compile(sig)  # (the kernels inline it through tile8_rows: compile it alone)
asm = _tiles.tile8.inspect_asm(sig)
print("ZMM" if "zmm" in asm else "NOZMM", "YMM" if "ymm" in asm else "NOYMM")
print("VEX", len(re.findall(r"^\\s+v[a-z]", asm, re.M)))
"""


@pytest.mark.heavy
@pytest.mark.skipif(isa.narrower_mask()[0] is None, reason=isa.narrower_mask()[1])
def test_masked_fallback_gives_same_results(tmp_path):
    """With the host's widest vector features masked in a child (isa.narrower_mask), the
    GEMM compiles to the narrower code (AVX-512 masked: 256-bit, no zmm; AVX masked:
    128-bit SSE, no VEX instruction at all) and gives the same bits as this process."""
    mask = isa.narrower_mask()[0]
    path = tmp_path / "outs.pt"
    stdout = run_child(f"MASK = {mask!r}\n" + _FALLBACK % str(path), {"NUMKERN_CPU_FEATURES": mask})
    if mask.startswith("-avx512f"):
        assert "NOZMM" in stdout and "YMM" in stdout, stdout
    else:
        assert "NOZMM NOYMM" in stdout and "VEX 0" in stdout, stdout
    theirs = torch.load(path)
    torch.manual_seed(1)
    import numkern

    for (m, n, k), other in zip(((1, 200, 2050), (5, 64, 96), (33, 97, 256)), theirs):
        w = torch.randn(n, k).bfloat16()
        x = torch.randn(m, k).bfloat16()
        b = torch.randn(n)
        out = torch.empty(m, n, dtype=torch.bfloat16)
        numkern.weight_packed_linear(out, x, numkern.convert_weight_packed(w), b, True)
        assert torch.equal(out, other)


# ---------------------------------------------------------------------------------------
# the table of variant rules


def test_stream_rule_follows_the_cpu_compiled_for():
    """The weight streams' prefetch distance is the row of LLVM's CPU name (the codegen
    consequence, per CPU: test_gemm_paths_codegen), named in describe()."""
    from numkern import _tiles

    rule = isa.stream_rule()
    assert rule == isa.STREAM.get(llvm.get_host_cpu_name(), isa.STREAM_DEFAULT)
    assert _tiles.PREFETCH_K2 == rule.prefetch_k2
    assert f"prefetch={rule.prefetch_k2 or 'none'}" in isa.describe()


@pytest.mark.fallback
def test_prefill_tiles_follow_the_vector_registers():
    """The prefill attention's tiles are the row of the (masked) vector registers, the
    attention kernels compile that row, and describe() names it (the AVX2 row's codegen:
    test_attention.test_prefill_tiles_fit_16_ymm_without_avx512)."""
    from numkern.attention import kernels, tiles

    rule, why = isa.prefill_tiles()
    assert rule is isa.PREFILL_TILES["avx512" if isa.has_avx512() else "avx2"] and why
    assert tiles.PREFILL is rule and (kernels.PR, kernels.PV) == (rule.group_rows, rule.pv_rows)
    want = f"attn_prefill=qk{rule.group_rows}x{rule.qk_keys},pv{rule.pv_rows}x{rule.pv_dims}"
    assert want in isa.describe()


def test_attention_rules_table():
    rules = isa.ATTENTION
    assert tuple(rules) == isa.ISAS
    got = {name: (r.block_multiple, r.head_dim_multiple, r.cpu) for name, r in rules.items()}
    assert got == {
        "amx": (32, 32, "amx"),
        "vec": (32, 16, "any"),
        "vec16": (16, 16, "any"),
        "neon": (32, 16, "arm"),
    }
    assert rules["amx"].dtypes == ("bfloat16",)
    assert all(rules[n].dtypes == ("bfloat16", "float16", "float32") for n in ("vec", "vec16"))
    assert isa.engine_block_multiple() == 32 and isa.engine_head_dims() == (16, 16, 512)
    isa.check_attention("amx", block_size=64, head_dim=96, dtype=torch.bfloat16)
    isa.check_attention("vec16", block_size=48, head_dim=80, dtype=torch.float32)
    for name, kw, match in [
        ("amx", dict(block_size=64, head_dim=80), "head_dim: expected a multiple of 32"),
        ("vec", dict(block_size=32, head_dim=528), "up to 512"),
        ("vec", dict(block_size=48, head_dim=64), "block_size: expected a multiple of 32"),
        ("vec16", dict(block_size=8, head_dim=64), "block_size: expected a multiple of 16"),
        ("avx", dict(block_size=32, head_dim=64), "isa: expected one of"),
        ("vec", dict(block_size=0, head_dim=64), "block_size: expected an int >= 1, got 0"),
        ("vec", dict(block_size=-32, head_dim=64), "block_size: expected an int >= 1"),
        ("vec16", dict(block_size=32, head_dim=0), "head_dim: expected an int >= 1, got 0"),
        ("vec16", dict(block_size=32, head_dim=-32), "head_dim: expected an int >= 1"),
    ]:
        with pytest.raises(ValueError, match=match):
            isa.check_attention(name, **kw)
    # a dtype the variant does not take is a TypeError (as check_cache raises for it)
    for name, kw, match in [
        ("amx", dict(block_size=32, head_dim=64, dtype=torch.float16), "needs bfloat16"),
        ("vec", dict(block_size="32", head_dim=64), "block_size: expected an int, got str"),
        ("vec", dict(block_size=32, head_dim=64.0), "head_dim: expected an int, got float"),
    ]:
        with pytest.raises(TypeError, match=match):
            isa.check_attention(name, **kw)


def test_selection_checks_its_arguments():
    bf = torch.bfloat16
    for args, match in [
        ((bf, 0, 64), "block_size: expected an int >= 1, got 0"),
        ((bf, -32, 64), "block_size: expected an int >= 1"),
        ((bf, 32, 0), "head_dim: expected an int >= 1, got 0"),
    ]:
        with pytest.raises(ValueError, match=match):
            isa.attention_isa(*args)
    with pytest.raises(ValueError, match="block_size"):  # checked before the override
        isa.attention_isa(bf, 0, 64, override="vec")
    for args, match in [
        ((bf, "32", 64), "block_size: expected an int, got str"),
        ((bf, 32, None), "head_dim: expected an int, got NoneType"),
        ((torch.int32, 32, 64), "dtype: expected bfloat16 or float16 or float32, got int32"),
    ]:
        with pytest.raises(TypeError, match=match):
            isa.attention_isa(*args)
    with pytest.raises(ValueError, match=r"moe isa override: expected one of \('amx', 'vec'\)"):
        isa.moe_isa(bf, override="neon")


@pytest.mark.parametrize(
    "cls,amx,x86",
    [("Zen 4", False, True), ("Emerald Rapids", True, True), ("ARM Neoverse N1", False, False)],
)
def test_selection_rules(cls, amx, x86):
    """The selection for another CPU class: its decision (isa.decide_class) passed in."""
    cpu = isa.decide_class(cls)
    bf, fp = torch.bfloat16, torch.float16
    assert isa.attention_isa(bf, 128, 80, cpu=cpu)[0] == "vec16"  # head_dim 16 but not 32
    assert isa.attention_isa(bf, 128, 128, cpu=cpu)[0] == (
        "amx" if amx else "vec" if x86 else "neon"
    )
    assert isa.attention_isa(fp, 128, 128, cpu=cpu)[0] == ("vec" if x86 else "neon")
    assert isa.attention_isa(bf, 48, 128, cpu=cpu)[0] == "vec16"  # block size not of 32
    assert isa.attention_isa(bf, 128, 128, override="vec16", cpu=cpu) == ("vec16", "override")
    want = ("amx", "AMX usable and bf16") if amx else ("vec", "no usable AMX")
    assert isa.moe_isa(bf, cpu=cpu) == want
    assert isa.moe_isa(fp, cpu=cpu)[0] == "vec" and isa.moe_isa(bf, override="vec")[0] == "vec"
    with pytest.raises(ValueError, match="moe isa override"):
        isa.moe_isa(bf, override="vec16")
    with pytest.raises(ValueError, match="isa override"):
        isa.attention_isa(bf, 128, 128, override="sse")


def test_selection_with_amx_masked():
    code = (
        "import torch; from numkern import isa\n"
        "assert isa.attention_isa(torch.bfloat16, 128, 128)[0] == 'vec'\n"
        "assert isa.moe_isa(torch.bfloat16)[0] == 'vec' and 'amx' not in isa.supported_isas()\n"
        "print('OK')"
    )
    assert "OK" in run_child(code, {"NUMKERN_CPU_FEATURES": "-amx-tile"})


_NO_AMX = """
import torch
from engine.platform import get_attn_isa, isa_overrides
from numkern import isa
assert "amx" not in isa.supported_isas() and not isa.amx_usable()
calls = {
    "check_isa": lambda: isa.check_isa("amx"),
    "NUMKERN_ISA": isa.isa_override,
    "attention_isa": lambda: isa.attention_isa(torch.bfloat16, 128, 128, override="amx"),
    "engine, NUMKERN_ISA": isa_overrides,
    "engine, isa=": lambda: get_attn_isa(torch.bfloat16, 128, 128, override="amx"),
}
for name, call in calls.items():
    try:
        call()
    except ValueError as e:
        assert "'amx' cannot run on this CPU" in str(e), (name, e)
        print(name, "refused")
    else:
        raise SystemExit(f"{name}: amx accepted on a CPU without AMX")
"""


def test_amx_is_an_error_where_amx_is_absent():
    """On a CPU without AMX (masked here, so the test runs on any CPU), asking for amx —
    by name, by NUMKERN_ISA, or through the engine's choice — is a ValueError naming the
    CPU, never a silent choice of another variant."""
    out = run_child(_NO_AMX, {"NUMKERN_CPU_FEATURES": "-amx-tile", "NUMKERN_ISA": "amx"})
    assert out.count("refused") == 5, out
