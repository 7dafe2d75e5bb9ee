"""The ``numkern`` torch library: the one place numkern's ops are defined as torch custom
ops (``torch.ops.numkern.<name>``).

Each area module (``gemm``, ``norm_rope``, ``moe``, ``attention``, ``gdn``) defines its ops
at import through :func:`define`: a schema (vLLM 0.32's string verbatim where vLLM's CPU
build has the op, see ``docs/kernels.md`` §12), the CPU kernel (which calls numkern's
Python op: the Numba kernels, never a fallback) and a fake (meta) implementation that
checks shapes and dtypes as the real op does and returns correctly shaped outputs.
Plain Python calls (``numkern.weight_packed_linear(...)``) stay the fast path; the
dispatcher costs several microseconds a call.
"""

import torch

NAMESPACE = "numkern"
LIB = torch.library.Library(NAMESPACE, "FRAGMENT")  # keeps the definitions alive


def define(schema, *, impl, fake):
    """Define ``numkern::<name>`` with ``schema`` (``"name(args) -> ret"``, no namespace),
    its CPU kernel ``impl`` and its fake ``fake``; returns the ``OpOverloadPacket``."""
    name = schema.split("(", 1)[0]
    LIB.define(schema)
    LIB.impl(name, impl, "CPU")
    torch.library.register_fake(f"{NAMESPACE}::{name}", fake, lib=LIB)
    return getattr(torch.ops.numkern, name)
