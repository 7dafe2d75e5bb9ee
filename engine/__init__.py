"""A small CPU inference engine on numkern's kernels.

Follow one prompt through it: ``python -m engine generate "..."`` (``engine.__main__``)
makes an :class:`LLM` (``engine.llm``), which loads the checkpoint (``engine.loader``),
packs its weights into a :class:`~engine.models.DecoderModel`, decides each KV-cache
group's ISA once (``engine.attention``, ``engine.platform``) and allocates the caches
(``engine.kv_cache``), then loads the model's kernels (:meth:`LLM.warmup`). Each step,
the scheduler (``engine.scheduler``) picks the requests and their chunks, the model
runner (``engine.runner``) builds the step's arrays and attention plan and calls the
model's one forward path, which runs ``numkern.decoder.DecoderStack`` (all layers in one
Numba call; an MoE layer's experts between calls); :class:`LLM` samples, checks stop
conditions and detokenises.
"""

from .layers import Linear, dispatch_unquantized_gemm
from .llm import LLM, RequestOutput, SamplingParams

__all__ = ["LLM", "Linear", "RequestOutput", "SamplingParams", "dispatch_unquantized_gemm"]
