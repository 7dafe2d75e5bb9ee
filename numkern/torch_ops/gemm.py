"""numkern's packed linear as torch custom ops (``docs/kernels.md`` §4, §12.1).

* ``convert_weight_packed(Tensor! weight) -> Tensor``: ``weight [N, K]`` or ``[E, N, K]``
  bf16/fp16/fp32 contiguous; returns the packed copy (same shape and dtype). vLLM's schema
  declares ``weight`` written; neither vLLM's kernel nor numkern's writes it. The schema
  is kept so code moves between ``torch.ops._C`` and ``torch.ops.numkern`` by the
  namespace alone; the cost is that ``torch.compile``'s functionalization may copy
  ``weight`` around the call (packing runs once, at load).
* ``weight_packed_linear(Tensor(a0!) out, Tensor(a1) mat1, Tensor(a2) mat2,
  Tensor(a3)? bias, bool is_vnni) -> ()``: ``out [M, N]`` written; dtypes and strides as
  ``numkern.weight_packed_linear``.

* ``weight_packed_linear_cpu(x [..., K], packed_weight [n, K], n, bias) -> [..., n]``:
  numkern's own (no vLLM op), a new output tensor.

The first two schemas print exactly as ``torch.ops._C.<op>.default._schema`` (``Tensor!`` is the
source spelling of ``Tensor($0! -> )``, which torch prints but does not parse).
"""

from .. import gemm
from ._lib import define, refuse_grad


def _convert_weight_packed_fake(weight):
    # numkern.convert_weight_packed is torch code (checks, permute, copy) with no kernel,
    # so it runs on fake tensors as it is: the same checks, a result of the right shape.
    return gemm.convert_weight_packed(weight)


def _weight_packed_linear_fake(out, mat1, mat2, bias, is_vnni):
    gemm._check_linear(out, mat1, mat2, bias, is_vnni)  # the real op's slow-path checks


convert_weight_packed = define(
    "convert_weight_packed(Tensor! weight) -> Tensor",
    impl=gemm.convert_weight_packed,
    fake=_convert_weight_packed_fake,
)
weight_packed_linear = define(
    "weight_packed_linear(Tensor(a0!) out, Tensor(a1) mat1, Tensor(a2) mat2, Tensor(a3)? bias, "
    "bool is_vnni) -> ()",
    impl=gemm.weight_packed_linear,
    fake=_weight_packed_linear_fake,
)


def _weight_packed_linear_cpu_fake(x, packed_weight, n, bias=None):
    """numkern.weight_packed_linear_cpu's checks and its output, without the kernel."""
    out, args = gemm.linear_cpu_args(x, packed_weight, n, bias)
    gemm._check_linear(*args)
    return out


# numkern's own: the packed linear into a new tensor, any leading dims
weight_packed_linear_cpu = define(
    "weight_packed_linear_cpu(Tensor x, Tensor packed_weight, int n, Tensor? bias=None) -> Tensor",
    impl=gemm.weight_packed_linear_cpu,
    fake=_weight_packed_linear_cpu_fake,
)
# no backward: an input requiring grad is refused (see _lib.refuse_grad)
for _op in (convert_weight_packed, weight_packed_linear, weight_packed_linear_cpu):
    refuse_grad(_op.default)
