"""Model layers on numkern's kernels.

``Linear`` is the dispatch of every unquantized projection (and MoE router): the weight
is packed once at load into vLLM's VNNI layout, a bias is converted to fp32 once into the
layer's own copy, and each call runs numkern's packed kernel into a preallocated output.

GEMM path policy (docs/kernels.md §4): numkern's packed kernel for every M. A shape
class would go to torch only where ``bench/bench_gemm.py`` on the machine shows torch
faster; on the AVX-512 machine this was written on (no AMX), numkern was 1.05-2.4x torch
fp32 and 0.8-4x torch bf16 at M in {1, 16, 128}, so there is no exception (a large-M
prefill on oneDNN's AMX path would be the candidate, once a bench on an AMX machine
measures the crossover; ``engine.platform.engine_torch_threads`` then needs revisiting).
"""

import math
from typing import NamedTuple

import numpy as np
import torch

import numkern

from .memory import pack, place
from .platform import log_once


class Linear:
    """``y = x @ W.T + b`` with ``W [N, K]`` packed once; ``x [..., K]`` -> ``[..., N]``."""

    def __init__(self, weight, bias=None):
        if not isinstance(weight, torch.Tensor) or weight.ndim != 2:
            raise TypeError(f"weight: expected a 2-D torch.Tensor, got {type(weight).__name__}")
        self.out_features, self.in_features = weight.shape
        self.dtype = weight.dtype
        self.packed = pack(weight.detach())
        self.bias = None
        if bias is not None:
            if tuple(bias.shape) != (self.out_features,):
                raise ValueError(
                    f"bias: expected shape [{self.out_features}], got {list(bias.shape)}"
                )
            # the layer's own fp32 copy, made once (the caller's tensor is never aliased)
            self.bias = bias.detach().to(torch.float32, copy=True).contiguous()
        log_once(
            ("gemm", self.dtype), "GEMM path for %s: numkern packed kernel for all M", self.dtype
        )

    def __call__(self, x, out=None):
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)
        m = x2.shape[0]
        if out is None:
            out = torch.empty((m, self.out_features), dtype=self.dtype)
        numkern.weight_packed_linear(out, x2, self.packed, self.bias, True)
        return out.reshape(*lead, self.out_features)


def dispatch_unquantized_gemm(layer):
    """Pack ``layer.weight`` (and its bias) once; returns the :class:`Linear` to call.

    ``layer`` is anything with ``weight [N, K]`` and an optional ``bias [N]`` attribute,
    e.g. a ``torch.nn.Linear`` or a router gate.
    """
    return Linear(layer.weight, getattr(layer, "bias", None))


def rope_inv_freq(head_dim, theta, scaling, max_position_embeddings):
    """(inv_freq [D/2] fp32, attention factor) for default, linear, llama3 and YaRN rope."""
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    kind = (scaling or {}).get("rope_type", "default")
    if kind == "default":
        return inv.float(), 1.0
    if kind == "linear":  # positions divided by the factor (Gemma 3's global rope)
        return (inv / scaling["factor"]).float(), 1.0
    if kind == "llama3":
        factor = scaling["factor"]
        low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
        old = scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > old / low, inv / factor, inv)
        smooth = (old / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old / high) & (wavelen <= old / low)
        return torch.where(medium, smoothed, scaled).float(), 1.0
    if kind == "yarn":
        factor = scaling["factor"]
        old = scaling.get("original_max_position_embeddings") or max_position_embeddings

        def mscale(s, m=1.0):
            return 1.0 if s <= 1 else 0.1 * m * math.log(s) + 1.0

        att = scaling.get("attention_factor")
        if att is None:
            if scaling.get("mscale") and scaling.get("mscale_all_dim"):
                att = mscale(factor, scaling["mscale"]) / mscale(factor, scaling["mscale_all_dim"])
            else:
                att = mscale(factor)
        beta_fast = scaling.get("beta_fast") or 32
        beta_slow = scaling.get("beta_slow") or 1

        def corr_dim(rot):
            return head_dim * math.log(old / (rot * 2 * math.pi)) / (2 * math.log(theta))

        lo, hi = corr_dim(beta_fast), corr_dim(beta_slow)
        if scaling.get("truncate", True):
            lo, hi = math.floor(lo), math.ceil(hi)
        lo, hi = max(lo, 0), min(hi, head_dim - 1)
        if lo == hi:
            hi += 0.001
        ramp = ((torch.arange(head_dim // 2, dtype=torch.float64) - lo) / (hi - lo)).clamp(0, 1)
        extra = 1 - ramp
        return (inv / factor * (1 - extra) + inv * extra).float(), float(att)
    raise ValueError(
        f"rope_scaling: unsupported rope_type {kind!r} (default, linear, llama3, yarn)"
    )


class Rotary:
    """Rotary embedding tables (rotate-half form, as HF Llama/Qwen3) for
    ``numkern.rope.rotary_embedding`` and ``numkern.decoder``."""

    def __init__(self, head_dim, theta, scaling, max_positions):
        self.inv_freq, self.factor = rope_inv_freq(head_dim, theta, scaling, max_positions)
        self.cos_sin = np.zeros((0, head_dim), np.float32)

    def cos_sin_cache(self, n):
        """fp32 ``[>= n, D]``: cos of each position's D/2 frequencies, then their sin
        (vLLM's ``cos_sin_cache`` layout); grown on demand, shared by every layer."""
        if self.cos_sin.shape[0] < n:
            n = max(n, 2 * self.cos_sin.shape[0], 256)
            freqs = torch.outer(torch.arange(n, dtype=torch.float32), self.inv_freq)
            table = torch.cat([freqs.cos(), freqs.sin()], 1) * self.factor
            self.cos_sin = table.numpy()
        return self.cos_sin


class SharedExpert(NamedTuple):
    """A dense gated MLP every token runs beside its routed experts (Qwen2-MoE), its
    output scaled by ``sigmoid(x @ expert_gate.T)``; ``S`` its intermediate size."""

    gate_proj: torch.Tensor  # [S, H]
    up_proj: torch.Tensor  # [S, H]
    down_proj: torch.Tensor  # [H, S]
    expert_gate: torch.Tensor  # [1, H]


class QuantSharedExpert(NamedTuple):
    """:class:`SharedExpert` kept in a GGUF file's types beside quantised experts:
    ``gate_up`` one ``numkern.quant.QuantWeight`` ``[2S, H]`` (gate rows, then up rows;
    a weight of parts where their types differ), ``down`` ``[H, S]``, ``expert_gate``
    dense ``[1, H]``."""

    gate_up: object
    down: object
    expert_gate: torch.Tensor


def shared_expert_chunks(shared, inter):
    """The shared expert as experts of intermediate size ``inter``: (w13 [C, 2 inter, H]
    gate rows then up rows, w2 [C, H, inter]), its neurons in ``C = ceil(S / inter)``
    chunks; the last chunk's padding neurons have zero gate, up and down weights, so they
    add exactly 0 (silu(0) * 0)."""
    s, h = shared.gate_proj.shape
    c = -(-s // inter)
    pad = c * inter - s

    def rows(w):  # [S, H] -> [C, inter, H]
        return torch.nn.functional.pad(w, (0, 0, 0, pad)).reshape(c, inter, h)

    w13 = torch.cat([rows(shared.gate_proj), rows(shared.up_proj)], 1)
    w2 = rows(shared.down_proj.T).transpose(1, 2)
    return w13, w2


NEURON_ALIGN = 32  # numkern.moe.fused_moe's I (and prepack's N, K): a multiple of 32


def pad_neurons(w13, w2, w13_bias=None, *, interleaved=False):
    """Experts of ``I`` neurons (``w13 [E, 2I, H]``: gate rows then up rows, or with
    ``interleaved`` gate/up pairs; ``w2 [E, H, I]``; ``w13_bias [E, 2I]`` or None) padded
    with zero neurons to a multiple of :data:`NEURON_ALIGN` (a rank's share of a small
    ``moe_intermediate_size``): a zero neuron has zero gate, up, bias and down weights,
    so it adds exactly 0 (every activation of a zero gate is 0). As they are when ``I``
    is a multiple already."""
    e_n, i2, h = w13.shape
    i_n = i2 // 2
    pad = -i_n % NEURON_ALIGN
    if not pad:
        return w13, w2, w13_bias
    # [E, I, 2, ...] (pairs) or [E, 2, I, ...] (halves): the neuron dimension padded
    dim = 1 if interleaved else 2
    shape = (e_n, i_n, 2) if interleaved else (e_n, 2, i_n)

    def neurons(t, *rest):
        t = t.reshape(*shape, *rest)
        widths = [0, 0] * (t.ndim - dim - 1) + [0, pad]
        return torch.nn.functional.pad(t, widths).reshape(e_n, 2 * (i_n + pad), *rest)

    w13 = neurons(w13, h)
    w2 = torch.nn.functional.pad(w2, (0, pad))
    return w13, w2, None if w13_bias is None else neurons(w13_bias)


class FusedMoE:
    """Router on the packed small-GEMM path, top-k softmax routing, numkern's fused MoE.

    ``w13 [E, 2I, H]``, ``w2 [E, H, I]``, ``router [E, H]`` and the optional biases in
    numkern's layouts (``numkern.moe``); ``router_bias [E]`` is added to the logits.
    ``shared`` (a :class:`SharedExpert`) runs in the same ``fused_moe`` call: its chunks
    (:func:`shared_expert_chunks`) are experts ``E..E+C-1``, which every token gets
    beside its top-k with the weight ``sigmoid(gate logit)``, the gate being one more row
    of the router's GEMM. The MLP is a sum over its intermediate neurons, so this is the
    shared expert's output up to fp32 summation order. An ``I`` that is not a multiple
    of 32 is padded with zero neurons (:func:`pad_neurons`).

    ``w13``/``w2`` may be ``numkern.quant.QuantWeight`` experts (GPT-OSS's MXFP4): kept
    as they are (no prepack), their biases fp32; no shared expert then.

    One rank's part (issue 29; ``engine.models.experts`` loads it): under tensor
    parallelism each expert's slice of its neurons (and of the shared expert's), under
    expert parallelism (``experts=(e0, e1)``) the whole experts ``e0..e1-1`` of the
    router's ``E`` (and a slice of the shared expert's neurons): the router is the whole
    one, and a routed id outside the rank's experts becomes -1 (``numkern.moe``'s "no
    expert here"). Either way the call returns the rank's partial sum, which the model
    all-reduces.
    """

    def __init__(
        self,
        router,
        w13,
        w2,
        topk,
        renormalize,
        *,
        isa,
        activation="silu",
        router_bias=None,
        w13_bias=None,
        w2_bias=None,
        shared=None,
        experts=None,
    ):
        from numkern import moe

        self.moe = moe
        self.num_routed = router.shape[0]  # the router's experts (all of the model's)
        e0, e1 = (0, self.num_routed) if experts is None else experts
        if not (0 <= e0 < e1 <= self.num_routed and e1 - e0 == w13.shape[0]):
            raise ValueError(
                f"experts: expected (e0, e1) within the router's {self.num_routed} experts "
                f"holding w13's {w13.shape[0]}, got {experts}"
            )
        self.experts = (e0, e1)
        # int32 [E]: a routed id's local expert, -1 for another rank's (None: all here)
        self.local_ids = None
        if (e0, e1) != (0, self.num_routed):
            ids = torch.arange(self.num_routed, dtype=torch.int32)
            self.local_ids = torch.where((ids >= e0) & (ids < e1), ids - e0, -1).int()
        self.shared_ids = None  # int32 [1, C]: the shared expert's chunks, or None
        self.shared_q = None  # a QuantSharedExpert beside quantised experts, or None
        self.quantized = moe.is_quantized(w13)
        if self.quantized != isinstance(shared, QuantSharedExpert) and shared is not None:
            want = "a QuantSharedExpert" if self.quantized else "a SharedExpert"
            raise ValueError(
                f"shared: expected None or {want} with {'quantised' if self.quantized else 'dense'}"
                f" experts, got a {type(shared).__name__}"
            )
        if not self.quantized:
            w13, w2, w13_bias = pad_neurons(
                w13, w2, w13_bias, interleaved=activation == "swigluoai"
            )
        if self.quantized and shared is not None:  # its own GEMMs, after the experts
            if w13_bias is not None or w2_bias is not None:
                raise ValueError("shared: expected no expert biases beside a shared expert")
            self.shared_q = shared
            router = torch.cat([router, shared.expert_gate])
        elif shared is not None:
            c13, c2 = shared_expert_chunks(shared, w13.shape[1] // 2)
            local = w13.shape[0]
            if w13_bias is not None or w2_bias is not None:
                raise ValueError("shared: expected no expert biases beside a shared expert")
            w13, w2 = torch.cat([w13, c13]), torch.cat([w2, c2])
            router = torch.cat([router, shared.expert_gate])
            self.shared_ids = torch.arange(local, local + len(c13), dtype=torch.int32)[None]
        self.router = Linear(router, router_bias)
        self.topk = topk
        self.renormalize = renormalize
        self.isa = isa
        self.activation = activation
        if self.quantized:  # numkern's one quantised layout, in huge pages already
            self.w13, self.w2 = w13, w2
            self.w13_bias = None if w13_bias is None else w13_bias.float().contiguous()
            self.w2_bias = None if w2_bias is None else w2_bias.float().contiguous()
            return
        self.w13 = place(moe.prepack_moe_weight(w13.contiguous(), isa))
        self.w2 = place(moe.prepack_moe_weight(w2.contiguous(), isa))
        self.w13_bias = None if w13_bias is None else w13_bias.contiguous()
        self.w2_bias = None if w2_bias is None else w2_bias.contiguous()

    def __call__(self, x):
        logits = self.router(x)  # [T, E] (and the shared expert's gate logit)
        e_n = self.num_routed
        tw, ti = self.moe.topk_softmax(logits[:, :e_n], self.topk, self.renormalize)
        if self.local_ids is not None:  # expert parallel: another rank's experts -> -1
            ti = self.local_ids[ti.long()]
        if self.shared_ids is not None:  # [T, k + C]: the top-k, then the shared chunks
            t_n, c_n = ti.shape[0], self.shared_ids.shape[1]
            gate = torch.sigmoid(logits[:, e_n:].float()).expand(t_n, c_n)
            tw = torch.cat([tw, gate], 1)
            ti = torch.cat([ti, self.shared_ids.expand(t_n, c_n)], 1)
        out = torch.empty_like(x)
        self.moe.fused_moe(
            out,
            x.contiguous(),
            self.w13,
            self.w2,
            self.w13_bias,
            self.w2_bias,
            tw,
            ti,
            activation=self.activation,
            isa=self.isa,
        )
        if self.shared_q is not None:
            out += self._shared(x, logits[:, e_n:])
        return out

    def _shared(self, x, gate_logit):
        """The quantised shared expert's output, ``sigmoid(gate) * down(silu(gate(x)) *
        up(x))`` (numkern.quant's GEMMs, the gating in torch, fp32 before the cast)."""
        q = self.shared_q
        quant = numkern.quant
        gu = torch.empty(x.shape[0], q.gate_up.shape[0], dtype=x.dtype)
        quant.quant_linear(gu, x.contiguous(), q.gate_up)
        s = gu.shape[1] // 2
        act = (torch.nn.functional.silu(gu[:, :s].float()) * gu[:, s:].float()).to(x.dtype)
        y = torch.empty(x.shape[0], q.down.shape[0], dtype=x.dtype)
        quant.quant_linear(y, act, q.down)
        return (torch.sigmoid(gate_logit.float()) * y.float()).to(x.dtype)
