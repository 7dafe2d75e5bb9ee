"""The fallback run: the code users of CPUs without AVX-512 get, on this CPU.

CI runs the tests marked ``fallback`` a second time with AVX-512 and AMX masked, in a
second pytest process alongside the main run (``python -m pytest --fallback-run``, see
``tests/conftest.py``); on its own::

    NUMKERN_CPU_FEATURES=-avx512f,-amx-tile python -m pytest -m fallback

where numkern's kernels compile for AVX2 (their 16-lane vectors lowered to pairs of
256-bit registers; a separate cache entry from the unmasked build) and are held to the
same references. The run is almost all compilation (a cold cache in CI), so each kernel
variant is compiled by one marked test and the others reuse it. Which test covers which
family (bf16 and fp32, vec and vec16; not the amx layouts, chosen only where AMX is):

* GEMM: ``test_gemm.py``, decode (M = 1) and a blocked M in bf16 and fp32 (fp16's tiles
  are the same code on another carrier, whose widening ``test_simd.py`` checks), and the
  widening path taken on such a CPU (``test_paths_follow_the_cpu``).
* attention: ``test_attention.py``, vec in bf16 and vec16 in fp32 (one kernel per dtype:
  its soft-cap, NaN-value and tolerance cases reuse them).
* MoE: ``test_moe.py``, vec in bf16 and fp32 (the bf16 kernel is first compiled by
  ``test_gemm.py::test_paths_follow_the_cpu``, which checks that such a CPU widens).
* SIMD intrinsics: ``test_simd.py``.
* norm, rope, Gated DeltaNet (chunked and recurrent rule, conv prefill and update,
  gating, gated norm): here, by calling their modules' tests with one parameter set
  each. RMS norm and rope run their serial and their prange path on one bf16 kernel each
  (the path is a run-time choice: two sets, one compilation); in fp32 their row kernels
  (``norm._rows``, ``rope._rows``) run inside the decoder stack below. The conv update
  runs on the kernel of the conv prefill.
* the decoder stack (``numkern.decoder``, every layer in one kernel): ``decoder-fp32``
  here against the reference forward (q/k head norms included), and the tiny-model
  engine parity test against transformers, which runs the same fp32 stack. The stack is
  the largest compilation of the run (about 30-40 s): one dtype only, compiled once.

In the ordinary run these calls compile nothing their modules' own cases would not (the
same kernels, whichever module runs first), and add about 1.5 s.
"""

import pytest
import torch
import transformers

from engine.llm import SamplingParams

from . import hf_models as hm
from . import (
    test_decoder,
    test_gdn_conv,
    test_gdn_gating,
    test_gdn_norm,
    test_gdn_rule,
    test_norm,
    test_rope,
)
from .close import rtol_atol

pytestmark = pytest.mark.fallback

BF, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32

# (id, a test of another module, its arguments): a serial and a parallel (prange) path
# where the family has both, on one kernel (the same dtypes: another dtype is another
# compilation, 1.3-2 s). The decoder stack in fp32 only, the dtype of the engine parity
# test below, which then loads it
FAMILIES = [
    ("rms_norm-bf16-fp32w", test_norm.test_rms_norm, ((7, 97), BF, FP32)),
    ("rms_norm-bf16-fp32w-prange", test_norm.test_rms_norm, ((70, 97), BF, FP32)),
    ("fused_add_rms_norm-fp16", test_norm.test_fused_add_rms_norm, ((70, 1000), FP16, FP16)),
    ("rope-bf16", test_rope.test_rotary_embedding, (BF, FP32, 5, 3, 1, 40, 40, True, 2)),
    ("rope-bf16-prange", test_rope.test_rotary_embedding, (BF, FP32, 70, 4, 2, 64, 64, True, 3)),
    ("gdn-chunked-bf16", test_gdn_rule.test_chunked_matches_loop, (BF, True)),
    ("gdn-recurrent-fp32", test_gdn_rule.test_recurrent_matches_loop, (FP32, False, 0.5, 1.0)),
    ("gdn-conv-fwd", test_gdn_conv.test_fwd, (FP32, 72, True, True, False, False, 3)),
    ("gdn-conv-update", test_gdn_conv.test_update, (FP32, True, True)),
    ("gdn-gating", test_gdn_gating.test_gating, (BF, FP32)),
    ("gdn-norm", test_gdn_norm.test_matches_transformers, ((5, 7, 128), BF, BF)),
    ("decoder-fp32", test_decoder.test_decoder_equals_the_reference_forward, (FP32, True, False)),
]


@pytest.mark.parametrize("test,args", [pytest.param(t, a, id=i) for i, t, a in FAMILIES])
def test_family(test, args):
    test(*args)


TINY = hm.TINY


def test_engine_parity_with_transformers(tmp_path):
    """A tiny random Llama in fp32: the prompt's logits within 1e-4 of transformers', and
    12 greedy tokens equal to its own, with a second request batched beside it."""
    hf = hm.random_model(transformers.LlamaConfig(**TINY), 15)
    hf.save_pretrained(tmp_path)
    llm = hm.engine(str(tmp_path))
    prompts = [hm.prompt(11), hm.prompt(40, 1)]
    with torch.no_grad():
        ref = hf(torch.tensor([prompts[0]])).logits[0]
    torch.testing.assert_close(llm.prompt_logits(prompts[0]), ref, **rtol_atol("engine_logits"))
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    outs = llm.generate(prompts, sp)
    assert [o.token_ids for o in outs] == [hm.hf_greedy(hf, p, 12) for p in prompts]
