"""Model layers on numkern's kernels.

``Linear`` is the dispatch of every unquantized projection (and MoE router): the weight
is packed once at load into vLLM's VNNI layout, a bias is converted to fp32 once into the
layer's own copy, and each call runs numkern's packed kernel into a preallocated output.

GEMM path policy (DESIGN §2): numkern's packed kernel for every M. A shape class may go
to torch only where ``bench/bench_gemm.py`` on the machine shows torch faster; on the
AVX-512 machine this was written on (no AMX), numkern was 1.05-2.4x torch fp32 and 0.8-4x
torch bf16 at M in {1, 16, 128}, so there is no exception. ``TORCH_MIN_M`` is where such
an exception plugs in (large-M prefill with oneDNN's AMX path); it stays None until a
bench on an AMX machine measures the crossover.
"""

import torch

import numkern

from .platform import log_once

TORCH_MIN_M = None  # M from which torch.nn.functional.linear is used; None: never


class Linear:
    """``y = x @ W.T + b`` with ``W [N, K]`` packed once; ``x [..., K]`` -> ``[..., N]``."""

    def __init__(self, weight, bias=None):
        if not isinstance(weight, torch.Tensor) or weight.ndim != 2:
            raise TypeError(f"weight: expected a 2-D torch.Tensor, got {type(weight).__name__}")
        self.out_features, self.in_features = weight.shape
        self.dtype = weight.dtype
        self.packed = numkern.convert_weight_packed(weight.detach().contiguous())
        self.bias = None
        if bias is not None:
            if tuple(bias.shape) != (self.out_features,):
                raise ValueError(
                    f"bias: expected shape [{self.out_features}], got {list(bias.shape)}"
                )
            # the layer's own fp32 copy, made once (the caller's tensor is never aliased)
            self.bias = bias.detach().to(torch.float32, copy=True).contiguous()
        self._weight_for_torch = weight.detach() if TORCH_MIN_M is not None else None
        log_once(
            ("gemm", self.dtype),
            "GEMM path for %s: numkern packed kernel for all M%s",
            self.dtype,
            "" if TORCH_MIN_M is None else f", torch for M >= {TORCH_MIN_M}",
        )

    def __call__(self, x, out=None):
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)
        m = x2.shape[0]
        if TORCH_MIN_M is not None and m >= TORCH_MIN_M:
            y = torch.nn.functional.linear(x2, self._weight_for_torch, None)
            if self.bias is not None:
                y = (y.float() + self.bias).to(self.dtype)
            return y.reshape(*lead, self.out_features)
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
