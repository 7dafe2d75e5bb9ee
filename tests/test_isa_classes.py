"""numkern.isa's decisions for every class of CPU this project meets, without running a
kernel: the table of docs/kernels.md §3.5 against ``isa.decide``; each class's feature
list against LLVM's code generator for its CPU name; the host's decision against its
class and against the describe() line captured on a host of that class."""

import os
import re

import llvmlite.binding as llvm
import pytest

from numkern import isa

from .conftest import ROOT, run_child

COLUMNS = (
    "class", "llvm", "isas", "attention", "prefill_tiles", "gemm", "moe_layout", "quant",
    "gdn", "prefetch", "fallback", "fallback_paths",
)  # fmt: skip


def doc_rows():
    """``{class: {column: text}}`` of the table in docs/kernels.md §3.5."""
    with open(os.path.join(ROOT, "docs", "kernels.md"), encoding="utf-8") as f:
        text = f.read()
    section = text.split("### 3.5 ", 1)[1].split("\n## ", 1)[0]
    rows = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != len(COLUMNS) or cells[0] in ("class", "---"):
            continue
        rows[cells[0]] = dict(zip(COLUMNS, cells))
    return rows


def as_row(name):
    """The cells of §3.5 that ``isa.decide`` gives for class ``name``."""
    d = isa.decide_class(name)
    fb = "—"
    if d.fallback_mask:
        m = isa.decide_class(name, d.fallback_mask)
        fb = f"{m.gemm}, {m.quant}"
    return {
        "class": name,
        "llvm": isa.CPU_CLASSES[name].llvm_name,
        "isas": ", ".join(d.isas),
        "attention": d.attention,
        "prefill_tiles": d.prefill_tiles,
        "gemm": d.gemm,
        "moe_layout": d.moe_layout,
        "quant": d.quant,
        "gdn": "dpbf16" if d.gdn_bf16 else "fp32",
        "prefetch": str(d.prefetch_k2),
        "fallback": d.fallback_mask or "none",
        "fallback_paths": fb,
    }


def test_docs_table_is_the_decision_of_every_class():
    rows = doc_rows()
    assert set(rows) == set(isa.CPU_CLASSES)
    for name in isa.CPU_CLASSES:
        assert rows[name] == as_row(name), name


def test_the_classes_the_issue_names_are_there():
    want = ("Zen 3", "Zen 4", "Zen 5", "Skylake-SP", "Ice Lake-SP", "Sapphire Rapids")
    want += ("Emerald Rapids", "Granite Rapids", "Alder Lake (AVX-VNNI, no AVX-512)")
    assert set(want) <= set(isa.CPU_CLASSES)
    assert any(not ({"avx", "neon"} & set(c.features)) for c in isa.CPU_CLASSES.values())
    for c in isa.CPU_CLASSES.values():
        assert set(c.features) <= set(isa.CLASS_FEATURES), c


def test_decide_is_pure_and_checks_its_class():
    a = isa.decide("znver4", isa.CPU_CLASSES["Zen 4"].features)
    assert a == isa.decide("znver4", {f: True for f in isa.CPU_CLASSES["Zen 4"].features})
    assert a == isa.decide_class("Zen 4") and a.why("gemm")
    with pytest.raises(ValueError, match="name: expected one of"):
        isa.decide_class("Pentium 4")
    for args, match in [
        ((None, ["avx2"]), "cpu: expected LLVM's CPU name"),
        (("znver4", "avx2"), "features: expected LLVM feature names"),
        (("znver4", 3), "features: expected LLVM feature names"),
        (("znver4", [1, 2]), "features: expected LLVM feature names"),
    ]:
        with pytest.raises(TypeError, match=match):
            isa.decide(*args)
    with pytest.raises(ValueError, match="only be removed"):
        isa.apply_mask(["avx2"], "+avx512f")
    # AMX counts only with both of its features (the host's drop them when refused)
    spr = set(isa.CPU_CLASSES["Sapphire Rapids"].features)
    assert isa.decide("sapphirerapids", spr - {"amx-tile"}).moe_layout == "vec"
    assert isa.decide_class("Sapphire Rapids", "-amx-tile").isas == ("vec", "vec16")


# ---------------------------------------------------------------------------------------
# the feature lists against LLVM's definitions of each name

_PROBES = r"""
define void @avx512f(ptr %p) #0 {
  %a = load <16 x float>, ptr %p
  %b = fmul <16 x float> %a, %a
  store <16 x float> %b, ptr %p
  ret void
}
define void @avx2(ptr %p) #0 {
  %a = load <8 x i32>, ptr %p
  %q = getelementptr <8 x i32>, ptr %p, i64 1
  %c = load <8 x i32>, ptr %q
  %b = mul <8 x i32> %a, %c
  store <8 x i32> %b, ptr %p
  ret void
}
define void @fma(ptr %p) #0 {
  %a = load <8 x float>, ptr %p
  %b = call <8 x float> @llvm.fma.v8f32(<8 x float> %a, <8 x float> %a, <8 x float> %a)
  store <8 x float> %b, ptr %p
  ret void
}
define void @f16c(ptr %p, ptr %q) #0 {
  %a = load <8 x half>, ptr %p
  %b = fpext <8 x half> %a to <8 x float>
  store <8 x float> %b, ptr %q
  ret void
}
define void @avx512bf16(ptr %p, ptr %q) #0 {
  %a = load <16 x float>, ptr %p
  %b = fptrunc <16 x float> %a to <16 x bfloat>
  store <16 x bfloat> %b, ptr %q
  ret void
}
define void @avx512fp16(ptr %p) #0 {
  %a = load <32 x half>, ptr %p
  %b = fadd <32 x half> %a, %a
  store <32 x half> %b, ptr %p
  ret void
}
declare <8 x float> @llvm.fma.v8f32(<8 x float>, <8 x float>, <8 x float>)
attributes #0 = { "min-legal-vector-width"="512" }
"""
# vpmaddwd + add fold into vpdpwssd where the CPU has VNNI; the 512-bit intrinsic needs
# AVX512-BW (compiled only where the probe above found AVX-512), the 256-bit one AVX2
# (compiled with AVX-512 off, so only AVX-VNNI's VEX form can take it).
_VNNI = r"""
define void @vnni(ptr %p) #0 {
  %a = load <V x i32>, ptr %p
  %q = getelementptr <V x i32>, ptr %p, i64 1
  %c = load <W x i16>, ptr %q
  %r = getelementptr <V x i32>, ptr %p, i64 2
  %d = load <W x i16>, ptr %r
  %m = call <V x i32> @INTRINSIC(<W x i16> %c, <W x i16> %d)
  %s = add <V x i32> %a, %m
  store <V x i32> %s, ptr %p
  ret void
}
declare <V x i32> @INTRINSIC(<W x i16>, <W x i16>)
attributes #0 = { "min-legal-vector-width"="512" }
"""
_SIGNS = {
    "avx512f": r"zmm",
    "avx2": r"vpmulld\s+.*ymm",
    "fma": r"vfmadd",
    "f16c": r"vcvtph2ps",
    "avx512bf16": r"vcvtneps2bf16",
    "avx512fp16": r"vaddph",
}


def _asm(ir, cpu, features=""):
    llvm.initialize_native_target()
    llvm.initialize_native_asmprinter()
    tm = llvm.Target.from_triple("x86_64-unknown-linux-gnu").create_target_machine(
        cpu=cpu, features=features, opt=2
    )
    mod = llvm.parse_assembly(ir)
    mod.triple = tm.triple
    return tm.emit_assembly(mod)


def _bodies(asm):
    return {m.group(1): m.group(2) for m in re.finditer(r"\n(\w+):\n(.*?)\.Lfunc_end", asm, re.S)}


def llvm_features(cpu):
    """The features of CLASS_FEATURES that LLVM's code generator shows for ``cpu``: each
    probe's instruction appears only where the feature is on (AMX is not probed: a tile
    instruction for a CPU without it aborts LLVM, not a test)."""
    body = _bodies(_asm(_PROBES, cpu))
    found = {f for f, sign in _SIGNS.items() if re.search(sign, body[f])}
    if "avx512f" in found:
        ir = _VNNI.replace("<V", "<16").replace("<W", "<32")
        ir = ir.replace("INTRINSIC", "llvm.x86.avx512.pmaddw.d.512")
        if "vpdpwssd" in _asm(ir, cpu):
            found.add("avx512vnni")
    if "avx2" in found:
        ir = _VNNI.replace("<V", "<8").replace("<W", "<16")
        ir = ir.replace("INTRINSIC", "llvm.x86.avx2.pmadd.wd")
        if "vpdpwssd" in _asm(ir, cpu, "-avx512f"):
            found.add("avxvnni")
    return found


X86_CLASSES = [n for n, c in isa.CPU_CLASSES.items() if "neon" not in c.features]


@pytest.mark.skipif(not isa.is_x86(), reason="LLVM's x86 target: on an x86 host")
@pytest.mark.parametrize("name", X86_CLASSES)
def test_class_features_are_llvms(name):
    c = isa.CPU_CLASSES[name]
    want = set(c.features) & (set(_SIGNS) | {"avx512vnni", "avxvnni"})
    assert llvm_features(c.llvm_name) == want, c.llvm_name


# ---------------------------------------------------------------------------------------
# the host, and the hosts of this project's sessions

# describe() as printed on hosts of these classes (a CI run's header, a bench's), with the
# features numkern reports there
CAPTURED = {
    # Intel Xeon, Emerald Rapids class (KVM, 2 vCPUs; LLVM: rocketlake), 2026-12-05 (quant=amx
    # from issue 40: AMX-INT8 tiles)
    "Emerald Rapids": "cpu=rocketlake features=[avx avx2 fma f16c avx512f avx512bw avx512vl "
    "avx512dq avx512bf16 avx512vnni avx512fp16 avxvnni amx-tile amx-bf16 amx-int8] "
    "isas=['amx', 'vec', 'vec16'] gemm=amx(tile=32x32,k_slice=32,from_m=5) "
    "moe=amx(rows/expert>=0) prefetch=16 attn_prefill=qk8x32,pv4x64 attn_bf16=amx "
    "moe_bf16_layout=amx quant=amx gdn_bf16=dpbf16 fallback=-avx512f,-amx-tile",
}
# What earlier sessions recorded of the other hosts (the features of docs/speed.json's
# headers and of their notes, not kept in the repository, and the paths they name):
# (LLVM name, features, paths)
RECORDED = {
    "Zen 4": (
        "znver4",
        "avx avx2 fma f16c avx512f avx512bw avx512vl avx512dq avx512bf16 avx512vnni",
        "gemm=dpbf16(tile=8x32,k_slice=2048) moe=dpbf16(rows/expert>=0) prefetch=none",
    ),
    "Skylake-SP": (
        "skylake-avx512",
        "avx avx2 fma f16c avx512f avx512bw avx512vl avx512dq",
        "gemm=widen(tile=8x32,k_slice=512) moe=widen prefetch=16",
    ),
    "Zen 3": ("znver3", "avx avx2 fma f16c", "gemm=fma256(tile=6x16,k_slice=512,from_m=5)"),
}


def _host_class():
    """The class whose features (as numkern reads them) are the unmasked host's."""
    name = llvm.get_host_cpu_name()
    raw = isa.apply_mask(dict(llvm.get_host_cpu_features()), "")
    for cls, c in isa.CPU_CLASSES.items():
        same = set(c.features) == raw & set(isa.CLASS_FEATURES)
        if same and (c.llvm_name == name or cls in CAPTURED):
            return cls
    return None


def test_captured_and_recorded_hosts():
    for cls, line in CAPTURED.items():
        name = line.split()[0].removeprefix("cpu=")
        feats = line.split("features=[")[1].split("]")[0].split()
        feats += ["sse2", "ssse3", "sse4.2"]
        d = isa.decide(name, feats)
        assert isa.describe_decision(d) == line
        assert (
            isa.describe_decision(isa.decide_class(cls)).split("] ", 1)[1] == line.split("] ", 1)[1]
        )
    for cls, (name, feats, paths) in RECORDED.items():
        line = isa.describe_decision(isa.decide(name, feats.split()))
        assert paths in line, (cls, line)
        ours = isa.describe_decision(isa.decide_class(cls))
        assert ours.split("] ", 1)[1] == line.split("] ", 1)[1], cls


def test_host_decides_as_its_class():
    """The host's decision (no mask in this process) is its class's, where the host is
    one of CPU_CLASSES; and a child with the fallback mask decides what decision_under
    says for it, and describes it so."""
    cls = _host_class()
    if cls is None:
        pytest.skip(f"host {llvm.get_host_cpu_name()} is of none of isa.CPU_CLASSES")
    if os.environ.get("NUMKERN_CPU_FEATURES"):
        pytest.skip("a masked process: test_fallback_child_decides_as_asked covers it")
    d, c = isa.decision(), isa.decide_class(cls)
    if not isa.amx_permitted():
        c = isa.decide_class(cls, "-amx-tile")
    assert d._replace(cpu="", features=frozenset(), prefetch_k2=0) == c._replace(
        cpu="", features=frozenset(), prefetch_k2=0
    )


@pytest.mark.skipif(isa.narrower_mask()[0] is None, reason=isa.narrower_mask()[1])
def test_fallback_child_decides_as_asked():
    mask = isa.narrower_mask()[0]
    code = "from numkern import isa; print(isa.describe())"
    got = run_child(code, {"NUMKERN_CPU_FEATURES": mask}).strip()
    assert got == isa.describe_decision(isa.decision_under(mask), masked=True)
