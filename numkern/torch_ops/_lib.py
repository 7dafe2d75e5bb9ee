"""The ``numkern`` torch library: the one place numkern's ops are defined as torch custom
ops (``torch.ops.numkern.<name>``).

Each area module (``gemm``, ``norm_rope``, ``moe``, ``attention``, ``gdn``) defines its ops
at import through :func:`define`: a schema (vLLM 0.32's string verbatim where vLLM's CPU
build has the op, see ``docs/kernels.md`` §12), the CPU kernel (which calls numkern's
Python op: the Numba kernels, never a fallback) and a fake (meta) implementation that
checks shapes and dtypes as the real op does and returns correctly shaped outputs.
Plain Python calls (``numkern.weight_packed_linear(...)``) stay the fast path; the
dispatcher costs several microseconds a call.

No op has a backward: :func:`refuse_grad` registers an op's Autograd kernel, which
refuses an input that requires grad while grad mode is on (a TypeError naming it), so
a graph never silently loses a gradient (and ``torch.library.opcheck``'s
autograd-registration test finds a kernel at the Autograd key).
"""

import torch

from .. import _check as C

NAMESPACE = "numkern"
LIB = torch.library.Library(NAMESPACE, "FRAGMENT")  # keeps the definitions alive
_Tensor = torch.Tensor


def define(schema, *, impl, fake):
    """Define ``numkern::<name>`` with ``schema`` (``"name(args) -> ret"``, no namespace),
    its CPU kernel ``impl`` and its fake ``fake``; returns the ``OpOverloadPacket``.
    ``fake=None``: an op of no tensors (ints and strings in, ints out): ``impl`` is its
    one kernel, for every backend and for tracing (there is no data to fake)."""
    name = schema.split("(", 1)[0]
    LIB.define(schema)
    if fake is None:
        LIB.impl(name, impl, "CompositeExplicitAutograd")
    else:
        LIB.impl(name, impl, "CPU")
        torch.library.register_fake(f"{NAMESPACE}::{name}", fake, lib=LIB)
    return getattr(torch.ops.numkern, name)


def dtype_of(name, value):
    """The float dtype a schema's ``str`` names: ``"bfloat16"``, ``"float16"`` or
    ``"float32"`` (TypeError otherwise): numkern's own schemas take dtypes as strings."""
    named = {C.dtype_name(dt): dt for dt in C.FLOATS}
    if value not in named:
        raise TypeError(f"{name}: expected one of {tuple(named)}, got {value!r}")
    return named[value]


def refuse_grad(op):
    """Register the Autograd kernel of ``op`` (an ``OpOverload`` of this library, or a
    packet: its default overload) and return ``op``: a
    TypeError naming the first argument that requires grad while grad mode is on (the op
    has no backward), else ``op`` below autograd. Under ``torch.no_grad()`` the op runs,
    so ``nn.Parameter`` inputs work there."""
    given = op
    if isinstance(op, torch._ops.OpOverloadPacket):
        op = op.default
    names = [a.name for a in op._schema.arguments]
    grad_enabled, below_autograd = torch.is_grad_enabled, torch._C._AutoDispatchBelowAutograd

    def autograd(*args, **kwargs):
        # plain loops, not pytree: this runs on every call, and pytree cost 3 us more
        if grad_enabled():
            for name, value in (*zip(names, args), *kwargs.items()):
                if isinstance(value, (list, tuple)):
                    bad = any(isinstance(t, _Tensor) and t.requires_grad for t in value)
                else:
                    bad = isinstance(value, _Tensor) and value.requires_grad
                if bad:
                    raise TypeError(
                        f"{name}: expected a tensor that does not require grad ({op.name()} "
                        f"has no backward; call it under torch.no_grad() or pass .detach()), "
                        f"got requires_grad=True"
                    )
        with below_autograd():
            return op(*args, **kwargs)

    name = op._schema.name.split("::", 1)[1]
    overload = op._schema.overload_name
    LIB.impl(f"{name}.{overload}" if overload else name, autograd, "Autograd")
    return given
