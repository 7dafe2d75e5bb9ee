"""The tolerances numkern's tests hold its ops to: one table, keyed by ``(kind, dtype)``.

A ``kind`` is an op (``"linear"``, ``"moe"``, ``"gdn_conv"``...) or a kind of comparison
(``"assert_close"``'s defaults, an op against vLLM's, the decoder's logits); ``dtype`` is
the dtype of the output compared. Each entry is a :class:`Tolerance`: an element of an
output ``out`` passes against its reference ``ref`` when

    |out - ref| <= ulps * ulp(ref) + rel * |ref| + mag * magnitude + peak * max|ref| + abs

with ``ulp(ref)`` the spacing of the output dtype at the reference rounded to it,
``magnitude`` the sum of the magnitudes of the terms behind the element (the scale of
fp32 summation error: the ``magnitude=True`` outputs of :mod:`numkern.testing.reference`)
and ``max|ref|`` the largest reference entry compared. The fields an entry leaves at 0 are
not part of its bound; each test's helper applies the terms its comparison has (the
comments below say which helper). Every value is what the tests hold today, with why:
none is looser than the comparison it replaced, and where two tests disagreed about the
same comparison the tighter one is kept, or both with why they differ.

Units used in the comments: ``u`` is a dtype's unit roundoff, the relative error of one
round-to-nearest (2^-8 bf16, 2^-11 fp16, 2^-24 fp32), half the ulp at 1.
"""

from typing import NamedTuple

import torch

BF16, FP16, FP32, FP64 = torch.bfloat16, torch.float16, torch.float32, torch.float64


class Tolerance(NamedTuple):
    """One bound (module docstring); a field left at 0 is not part of it."""

    ulps: float = 0.0  # units in the last place of the output dtype, at the rounded ref
    rel: float = 0.0  # of |ref|
    mag: float = 0.0  # of the sum of the terms' magnitudes
    peak: float = 0.0  # of the largest |ref| compared
    abs: float = 0.0  # absolute


_T = Tolerance

TOLERANCES = {
    # --- numkern.testing.assert_close's defaults (compare.DEFAULT_ULPS) -----------------
    # one rounding of the output (a kernel computing in fp32 and rounding once is within 1
    # ulp of a rounded fp32 reference) and room for one more, as vLLM's ops round some
    # intermediates
    ("assert_close", BF16): _T(ulps=2),
    ("assert_close", FP16): _T(ulps=2),
    # the reordering of fp32 sums
    ("assert_close", FP32): _T(ulps=64),
    ("assert_close", FP64): _T(ulps=64),
    # --- the packed linear (tests/test_gemm.py assert_close_linear; rel + mag) ----------
    # kernel and reference both sum in fp32, in different orders (up to ~K * 2^-24 of the
    # sum of |terms|, typically ~sqrt(K) * 2^-24: mag 1e-5), then round once to the output
    # dtype, which can land one unit u away from the rounded reference. fp32: the rel
    # term covers a bias that dominates the sum (the magnitude counts x*w only); the
    # reference is fp32 torch, so it is not the 0 of a float64 reference (quant_linear's)
    ("linear", BF16): _T(rel=2.0**-8, mag=1e-5),
    ("linear", FP16): _T(rel=2.0**-11, mag=1e-5),
    ("linear", FP32): _T(rel=2e-6, mag=1e-5),
    # ours against vLLM's linear (test_gemm test_vllm_linear_outputs): each side rounds
    # once from its own fp32 sums, so two units u apart, plus 1e-2 for outputs that cancel
    # near zero (N(0, 1) inputs, K up to 2048: sums of |terms| ~1300, in two orders)
    ("linear_vllm", BF16): _T(rel=2.0**-7, abs=1e-2),
    # 16-bit activations with an fp32 weight into an fp32 out (test_gemm), against a
    # float64 reference: fp32 sums in another order, of the largest output and relative
    ("linear_fp32_weight", FP32): _T(rel=1e-5, peak=1e-5),
    # --- the AMX tiles (tests/test_amx.py; rel + abs) ----------------------------------
    # a tile product (emulated or real) against the fp32 product: fp32 sums of exact bf16
    # products in another order (a few fp32 ulps of sums of size ~10)
    ("amx_product", FP32): _T(rel=1e-5, abs=1e-4),
    # the real tiles against their emulation: the order of fp32 sums differs (about an
    # fp32 ulp); bf16 outputs: one bf16 rounding apart
    ("amx_emulated", FP32): _T(rel=1e-5, abs=1e-5),
    ("amx_emulated", BF16): _T(rel=2.0**-7, abs=1e-6),
    # the prefill attention on real tiles against the emulated ones: a bf16 rounding
    # apart, plus the attention's fp32 accumulation term (as attention's abs)
    ("amx_attention_emulated", BF16): _T(rel=2.0**-7, abs=1e-5),
    # --- the quantised linear (tests/test_quant_linear.py check; rel + mag) -------------
    # a float64 reference on the dequantised weight: fp32 sums (1e-5 of the terms) and one
    # rounding of the output (u; fp32 output: none beyond the sums, hence 0); the int8
    # path adds its documented activation bound (test_quant_linear.int8_bound)
    ("quant_linear", BF16): _T(rel=2.0**-8, mag=1e-5),
    ("quant_linear", FP16): _T(rel=2.0**-11, mag=1e-5),
    ("quant_linear", FP32): _T(rel=0.0, mag=1e-5),
    # the int8 path's block scale amax / 127 (fp32) against float64: the division rounds
    ("int8_scale", FP32): _T(rel=1e-6),
    # --- the torch ops against vLLM's (tests/test_torch_ops_gemm_norm.py; rel + abs) -----
    # ``units`` rounding units of the output (eps: 2^-7 bf16, 2^-10 fp16, 2^-23 fp32)
    # relative, plus 1e-6: the norms and rotary one unit (each rounds once from fp32), the
    # linear two (each side rounds once from its own fp32 sum; K = 256, so unlike
    # linear_vllm's K to 2048 no cancellation allowance beyond 1e-6)
    ("torch_ops_vllm", BF16): _T(rel=2.0**-7, abs=1e-6),
    ("torch_ops_vllm", FP16): _T(rel=2.0**-10, abs=1e-6),
    ("torch_ops_vllm", FP32): _T(rel=2.0**-23, abs=1e-6),
    # --- paged attention (tests/test_attention.py assert_close_attn; rel + abs) --------
    # one rounding of the output (u) plus fp32 accumulation of the softmax sums (1e-5 of
    # outputs of size ~1); fp32: 2u, as moe's (the reference is fp32 torch, its own exp
    # and sums round; the abs term dominates at outputs of size ~1). test_attention had
    # 4u (2^-22) for fp32, test_moe 2u: the tighter passes both files
    ("attention", BF16): _T(rel=2.0**-8, abs=1e-5),
    ("attention", FP16): _T(rel=2.0**-11, abs=1e-5),
    ("attention", FP32): _T(rel=2.0**-23, abs=1e-5),
    # vLLM's attention against the reference: its kernels round P to the cache dtype
    # before P @ V, a second rounding: twice the unit, and 4 such units absolute
    ("attention_vllm", BF16): _T(rel=2.0**-7, abs=2.0**-5),
    ("attention_vllm", FP16): _T(rel=2.0**-10, abs=2.0**-8),
    ("attention_vllm", FP32): _T(rel=2.0**-21, abs=2.0**-19),
    # --- fused MoE, bf16/fp16/fp32 and quantised (tests/test_moe.py assert_close_moe,
    # tests/test_quant_moe.py; rel + mag + abs) ------------------------------------------
    # one output rounding (u; fp32 2u: the reference is fp32 torch) plus activation
    # roundings that may land one unit apart (a quarter unit of the sum of |terms|; fp32:
    # 1e-6, its sums). A helper's ``units`` scales rel and the quarter unit, not the fp32
    # floor of mag (max(units * rel / 4, mag))
    ("moe", BF16): _T(rel=2.0**-8, mag=2.0**-10, abs=1e-6),
    ("moe", FP16): _T(rel=2.0**-11, mag=2.0**-13, abs=1e-6),
    ("moe", FP32): _T(rel=2.0**-23, mag=1e-6, abs=1e-6),
    # the routing weights against an fp32 softmax of the same logits (test_moe,
    # fuzz_cases): exp and the sums in another order
    ("topk_softmax", FP32): _T(rel=1e-6, abs=1e-7),
    # grouped_topk: also sigmoid scoring, a score-correction bias and a scaling factor,
    # each one more fp32 operation before the renormalising division
    ("grouped_topk", FP32): _T(rel=1e-5, abs=1e-6),
    # --- RMS norm and rotary (tests/close.py within; ulps + mag) -----------------------
    # one unit of the output at the rounded float64 reference (a 16-bit result rounded the
    # wrong way once passes, two units do not) plus the fp32 arithmetic's own error, 2^-22
    # of the terms (|ref| for a norm, |a c| + |b s| for a rotation)
    ("norm", BF16): _T(ulps=1, mag=2.0**-22),
    ("norm", FP16): _T(ulps=1, mag=2.0**-22),
    ("norm", FP32): _T(ulps=1, mag=2.0**-22),
    ("rope", BF16): _T(ulps=1, mag=2.0**-22),
    ("rope", FP16): _T(ulps=1, mag=2.0**-22),
    ("rope", FP32): _T(ulps=1, mag=2.0**-22),
    # --- Gated DeltaNet --------------------------------------------------------------
    # the causal conv (tests/close.py within; ulps + mag): one unit at the rounded float64
    # reference plus 2^-20 of the taps' magnitudes: fp32 sums of 4 taps and the SiLU's
    # vector exp (~2e-7 relative). Also ours against vLLM's conv, mag its |output| (its
    # vdpbf16ps sums pairs of taps in another order)
    ("gdn_conv", BF16): _T(ulps=1, mag=2.0**-20),
    ("gdn_conv", FP16): _T(ulps=1, mag=2.0**-20),
    ("gdn_conv", FP32): _T(ulps=1, mag=2.0**-20),
    # the gates (g fp32, beta in the input's dtype; mag: |ref|): a unit plus 2^-20
    # relative for exp and log1p (vector polynomials, a few fp32 units)
    ("gdn_gating", BF16): _T(ulps=1, mag=2.0**-20),
    ("gdn_gating", FP32): _T(ulps=1, mag=2.0**-20),
    # the same in the fuzz (tests/fuzz_cases.py), which also draws fp16 and arguments up
    # to 30 times larger: there g falls below fp32's smallest normal (measured -3.4e-43),
    # where the kernel's vector exp flushes to 0 (simd.vexp: 0 below -87.3) and the
    # float64 reference does not; 1e-30 absolute, the floor the fuzz has always had
    ("gdn_gating_fuzz", BF16): _T(ulps=1, mag=2.0**-20, abs=1e-30),
    ("gdn_gating_fuzz", FP16): _T(ulps=1, mag=2.0**-20, abs=1e-30),
    ("gdn_gating_fuzz", FP32): _T(ulps=1, mag=2.0**-20, abs=1e-30),
    # ours against vLLM's g: its vector exp/log are approximations (exp_u20)
    ("gdn_gating_vllm", FP32): _T(rel=2.0**-14, abs=1e-6),
    # the delta rule, recurrent and chunked (tests/test_gdn_rule.py; rel + peak): one
    # rounding of the output (u) against the float64 loop, plus fp32 arithmetic over a
    # chunk's sums and the recurrence, 4e-6 of the largest entry (measured about 3e-7 on
    # the tests' shapes); the state is fp32
    ("gdn_rule", BF16): _T(rel=2.0**-8, peak=4e-6),
    ("gdn_rule", FP16): _T(rel=2.0**-11, peak=4e-6),
    ("gdn_rule", FP32): _T(rel=2.0**-24, peak=4e-6),
    # the chunked form's bf16 path (vdpbf16ps) rounds q, k, W, S, V', the decayed scores
    # and keys and (I + L)^-1 to bf16 before its products (docs/kernels.md): vLLM's bound
    # of the largest entry (measured 0.3-0.65% on the tests' shapes, vLLM's op 0.5-0.55%)
    ("gdn_rule_dp", BF16): _T(peak=0.015),
    # the gated norm against transformers' module with its three roundings
    # (tests/test_gdn_norm.py): bf16 at most two units (a flip in the first rounding
    # carries into the next two; bit-equal on all but 1 in 1000 elements besides); fp32
    # 2^-20 relative (the vector exp's ~2e-7, and exp, rsqrt, the division each round)
    ("gdn_norm", BF16): _T(ulps=2),
    ("gdn_norm", FP16): _T(ulps=2),
    ("gdn_norm", FP32): _T(rel=2.0**-20),
    # --- the fused decoder run (tests/test_decoder.py; peak) --------------------------
    # logits against the torch reference forward, of the largest logit: fp32 float
    # rounding; 16-bit two units of eps (2^-7 bf16, 2^-10 fp16), as rounding flips at the
    # same points propagate through the layers (measured: bf16 0.009-0.014 of 0.0156)
    ("decoder", BF16): _T(peak=2.0**-6),
    ("decoder", FP16): _T(peak=2.0**-9),
    ("decoder", FP32): _T(peak=1e-5),
    # --- sharded MoE and GDN (tests/test_moe_parallel.py, test_engine_gdn.py) ----------
    # the op's two halves of the experts (ids -1 elsewhere), their fp32 outputs summed,
    # against the unsplit call: one more fp32 addition per element
    ("moe_ep_halves", FP32): _T(rel=1e-6, abs=1e-6),
    # a quantised op's halves against its reference and their sum against the whole; the
    # engine's MoE layer as two ranks' parts (TP splits each expert's intermediate sums):
    # fp32 partial sums in another order
    ("moe_shards", FP32): _T(rel=1e-5, abs=1e-5),
    # quantised experts as two ranks' parts (MXFP4, Q8_0 and Q4_K): a share that splits a
    # block is dequantised and runs another kernel than the whole layer's
    ("moe_shards_quant", FP32): _T(rel=1e-4, abs=1e-4),
    # a GDN layer as two ranks' heads summed against the whole layer (fp32), through the
    # conv, the rule's recurrence and out_proj's partial sums; each rank's state is its
    # heads of the whole one's, the same recurrence per head
    ("gdn_shards", FP32): _T(rel=1e-4, abs=1e-5),
    ("gdn_shards_state", FP32): _T(abs=1e-6),
    # --- the engine and its checkpoints (torch.testing.assert_close: rel + abs) --------
    # fp32 logits against transformers' fp32 forward on tiny random checkpoints: fp32
    # sums in other orders through a few layers (logits of size ~1)
    ("engine_logits", FP32): _T(rel=1e-4, abs=1e-4),
    # the GDN families (tests/test_engine_gdn.py): also the chunked rule's chunk sums and
    # the recurrent state carried through 32 decode steps, both fp32 in another order
    ("engine_logits_gdn", FP32): _T(rel=5e-4, abs=5e-4),
    # the partial sums of tensor-parallel ranks, reduced in fp32, against one process's
    ("engine_tp", FP32): _T(abs=1e-4),
    # ours in a dtype against transformers in the same dtype (tests/test_engine_model.py),
    # beyond twice HF's own distance from its fp32 run: a rounding unit of the largest
    # logit (fp32: 1e-5, float rounding)
    ("engine_logits_hf", BF16): _T(peak=2.0**-8),
    ("engine_logits_hf", FP16): _T(peak=2.0**-11),
    ("engine_logits_hf", FP32): _T(peak=1e-5),
    # a prompt in one step against the same prompt run by several workers (bf16): the
    # attention's splits follow the thread count, and a split reorders fp32 sums: a unit
    ("engine_split", BF16): _T(peak=2.0**-7),
    # one GGUF file's fp32 logits two ways (quantised weights kept or dequantised; the
    # engine or transformers' GGUF loader): fp32 sums in other orders (measured 9.4e-5 at
    # a largest logit of 27 for SmolLM2 against transformers)
    ("engine_gguf", FP32): _T(peak=1e-5),
    # A_log as a GGUF file stores it, -exp(A_log), read back: log(exp(a)) is a to ~1 ulp
    ("gguf_a_log", FP32): _T(abs=2e-7),
    # llama.cpp on the GGUF writer's files against HF fp32 (KV cache in F32), measured
    # (AMD EPYC Zen 4, llama-cpp-python 0.3.36): 1e-6 to 1e-5 for the SiLU families;
    # ~1.5e-3 for Gemma (ggml's tanh-GELU is an fp16 table); 0.010 for GPT-OSS (its YaRN
    # ramp: llama.cpp rounds the correction dims, HF's GptOssConfig does not)
    ("llama_cpp", FP32): _T(abs=1e-4),
    ("llama_cpp_gemma", FP32): _T(abs=5e-3),
    ("llama_cpp_gpt_oss", FP32): _T(abs=3e-2),
    # the rotary inverse frequencies against transformers' (published configs): fp32
    # powers computed another way
    ("rope_inv_freq", FP32): _T(rel=1e-6),
    # --- smoke checks against plain torch, no magnitudes -------------------------------
    # an RMS norm against torch's fp32 norm rounded to the dtype (test_compile_cache: the
    # cached kernels compute): a 16-bit unit (2^-7) relative and absolute; fp32 1e-5
    ("norm_torch", BF16): _T(rel=2.0**-7, abs=2.0**-7),
    ("norm_torch", FP16): _T(rel=2.0**-7, abs=2.0**-7),
    ("norm_torch", FP32): _T(rel=1e-5, abs=1e-5),
    # one bf16 row through the packed linear against fp32 torch (tests/test_memory.py):
    # fp32 sums of 1024 products of magnitude ~1, rounded once to bf16 (2^-9 relative)
    ("linear_torch", BF16): _T(rel=2.0**-8, abs=1e-2),
    # --- an op against its reference through assert_close (tests/test_testing_api.py,
    # docs/testing.md's tour: assert_close(out, ref, ulps=t.ulps, atol=t.abs or
    # t.peak * max|ref|)) -------------------------------------------------------------
    # assert_close's ulps, plus: fp32 sums of 64 terms of ~1 in two orders, where they
    # cancel to near zero
    ("linear_assert_close", BF16): _T(ulps=2, abs=1e-4),
    # an activation rounded one unit the other way moves a sum by a fraction of a unit of
    # the largest output
    ("moe_assert_close", BF16): _T(ulps=2, peak=2.0**-10),
    # fp32 accumulation of the softmax sums (attention's abs)
    ("attention_assert_close", BF16): _T(ulps=2, abs=1e-5),
    # fp32 sums of 4 taps of ~1 cancelling near zero
    ("gdn_conv_assert_close", BF16): _T(ulps=2, abs=1e-5),
    # --- numkern.simd (tests/test_simd.py) --------------------------------------------
    # vexp against float64 over its finite range: a polynomial after range reduction,
    # its documented 2.5 units of fp32 (2^-23) measured over 2^20 points
    ("vexp", FP32): _T(rel=2.5 * 2.0**-23),
    # vtanh (from vexp) against float64, absolute
    ("vtanh", FP32): _T(abs=2e-7),
    # vdpbf16ps against fp32 sums of the same bf16 pairs: the pair's products summed in
    # another order (values of size ~1)
    ("dpbf16", FP32): _T(rel=1e-6, abs=1e-6),
}


def tolerance(kind, dtype):
    """The :class:`Tolerance` of ``kind`` for outputs of ``dtype`` (a torch dtype); a
    ``KeyError`` names the kinds the table has for that dtype."""
    try:
        return TOLERANCES[kind, dtype]
    except KeyError:
        kinds = sorted(k for k, d in TOLERANCES if d == dtype)
        msg = f"no tolerance for ({kind!r}, {dtype}); kinds for {dtype}: {kinds}"
        raise KeyError(msg) from None
