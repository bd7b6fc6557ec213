"""Matrix multiplies computed in bf16 by torch's kernels inside ONNX Runtime's graphs (`trainer.precision=bf16-mixed`).

Why: ONNX Runtime 1.19 has no bf16 MatMul/Gemm on x86 CPUs, so its graphs run every GEMM in fp32, while torch's
bf16 GEMMs run about twice as fast as fp32 on CPUs with bf16 units (avx512_bf16, amx_bf16). As with convolutions
(accel/graph/aten_conv.py), an `org.pytorch.aten::ATen` node hands the operator to torch through the ATen executor.

What it computes is what torch's CPU autocast does for these operators: inputs and weights rounded to bf16, the
product accumulated by torch's bf16 kernel; ORT never sees a bf16 tensor (every node takes and returns fp32), so the
weights, the optimizer and every other operator of the graph (softmax, normalisation, the loss) stay fp32, ORT's own.

How (its declaration at the end: the plan's `gemm` op, on the torch path in bf16-mixed; symbolics.py puts it in place
only while an ORT engine exports):
- forward: the exporter's `aten::linear`, `aten::matmul`, `aten::addmm` and `aten::bmm` become one ATen node running
  `ortflow::gemm_bf16(a, b, bias, transpose_b, output_mask)`: a @ b (b transposed for linear) + bias;
- gradient: one ATen node running `ortflow::gemm_bf16_backward`, the gradients of a and b as bf16 GEMMs (none for a
  frozen weight: the mask says which are wanted) and the bias's summed in fp32 (from a bf16 gradient, in bf16 as
  autocast sums it);
- a frozen weight (the mask's fourth boolean, set where b is a frozen parameter) is cast once and its bf16 copy reused
  from step to step (accel/graph/bf16_weights.py), where autocast casts it again every step;
- a bias is added inside the GEMM where autocast does so too (`addmm`, `linear`), not in a pass of its own.
"""

from typing import Any

import onnx
import torch
from torch.onnx import symbolic_helper

from ortflow.accel.graph import aten_nodes, aten_shapes, bf16_weights
from ortflow.accel.graph import plan as graph_plan
from ortflow.config import BF16

OPERATOR = "ortflow::gemm_bf16"
BACKWARD = "ortflow::gemm_bf16_backward"
_ARGS = "Tensor a, Tensor b, Tensor? bias, bool transpose_b, bool[] output_mask"

_LIBRARY = torch.library.Library("ortflow", "FRAGMENT")
_LIBRARY.define(f"gemm_bf16({_ARGS}) -> (Tensor, Tensor, Tensor)")
_LIBRARY.define(
    "gemm_bf16_backward(Tensor grad_output, Tensor a16, Tensor b16, Tensor? bias, bool transpose_b, bool[] output_mask)"
    " -> (Tensor, Tensor, Tensor)"
)


def is_gemm(node: onnx.NodeProto | None) -> bool:
    """Whether an ONNX node (or None) is this module's bf16 GEMM."""
    return node is not None and aten_nodes.operator(node) == OPERATOR


def _bias(bias):
    """None for a missing bias (exported as an empty tensor: a new None input cannot be emitted)."""
    return None if bias is None or bias.numel() == 0 else bias


def product_bf16(a: torch.Tensor, b: torch.Tensor, bias, transpose_b: bool, output_mask):
    """a @ b (b transposed: a linear layer) + bias on bf16 copies, in bf16; and the copies, which the gradient node
    takes instead of a and b (ORT keeps them, half the bytes, and frees the fp32 ones sooner; each weight is cast
    once per step, a frozen one once for all steps: `output_mask[3]`)."""
    bias = _bias(bias)
    a16 = a.to(torch.bfloat16)
    frozen = len(output_mask) > 3 and output_mask[3]
    b16 = bf16_weights.CACHE.bf16(b) if frozen else b.to(torch.bfloat16)
    bias16 = None if bias is None else bias.to(torch.bfloat16)
    if transpose_b:  # linear: (..., in) x (out, in)
        return torch.nn.functional.linear(a16, b16, bias16), a16, b16
    if bias16 is not None and a16.dim() == 2 and b16.dim() == 2:  # addmm (GPT-2's Conv1D), as autocast runs it
        return torch.addmm(bias16, a16, b16), a16, b16
    out = torch.matmul(a16, b16)
    return (out if bias16 is None else out + bias16), a16, b16


def _gemm(a: torch.Tensor, b: torch.Tensor, bias, transpose_b: bool, output_mask):
    """`product_bf16`, the product returned in fp32."""
    out, a16, b16 = product_bf16(a, b, bias, transpose_b, output_mask)
    return out.float(), a16, b16


def gemm_backward(grad_output: torch.Tensor, a16, b16, bias, transpose_b: bool, output_mask):
    """The gradients `output_mask` asks for (of a, b, bias) from the forward's bf16 copies of a and b, for an fp32 or
    bf16 gradient of the product; None (an undefined tensor, which ORT's ATen kernel leaves unset) for the others. A
    2-D b (a weight) gets its gradient as one GEMM over every leading dimension of a."""
    bias = _bias(bias)
    grad16 = grad_output.to(torch.bfloat16)
    grad_a = grad_b = grad_bias = None
    if output_mask[0]:
        weight = b16
        grad_a = torch.matmul(grad16, weight if transpose_b else weight.mT).sum_to_size(a16.shape)
        a_in_bf16 = len(output_mask) > 4 and output_mask[4]  # a arrived bf16 (accel/graph/bf16_edges.py)
        grad_a = grad_a if a_in_bf16 else grad_a.float()
    if output_mask[1]:
        if b16.dim() == 2:
            flat_grad, flat_a = grad16.reshape(-1, grad16.size(-1)), a16.reshape(-1, a16.size(-1))
            grad_b = (flat_grad.t() @ flat_a) if transpose_b else (flat_a.t() @ flat_grad)
            grad_b = grad_b.float()
        elif transpose_b:
            grad_b = torch.matmul(grad16.mT, a16).float().sum_to_size(b16.shape)
        else:
            grad_b = torch.matmul(a16.mT, grad16).float().sum_to_size(b16.shape)
    if output_mask[2] and bias is not None:
        grad_bias = _bias_gradient(grad_output, bias)
    return grad_a, grad_b, grad_bias


def _bias_gradient(grad_output: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """The bias's gradient in fp32: an fp32 gradient summed in fp32; a bf16 one (a GEMM whose output is a bf16 edge,
    accel/graph/bf16_edges.py) summed over its rows as autocast's addmm backward sums it (bf16, accumulated in fp32
    by torch's kernel), without converting the whole gradient."""
    if grad_output.dtype != torch.bfloat16 or bias.dim() != 1 or bias.numel() != grad_output.size(-1):
        return grad_output.float().sum_to_size(bias.shape)
    return grad_output.reshape(-1, bias.numel()).sum(0).float()


_LIBRARY.impl("gemm_bf16", _gemm, "CPU")
_LIBRARY.impl("gemm_bf16_backward", gemm_backward, "CPU")


# ORT's gradient of the forward node: one ATen node on GO(0), the forward node's bf16 copies of a and b (its outputs 1
# and 2), its bias, transpose flag and mask; it returns the gradients of a, b and bias (which may get one; the mask is
# the forward node's fifth input).
aten_nodes.declare(
    OPERATOR,
    BACKWARD,
    ["GO(0)", "O(1)", "O(2)", "I(2)", "I(3)", "I(4)"],
    differentiable=(0, 1, 2),
    mask_input=4,
    fix_name="matmuls_run_by_torch_bf16",
    frozen_input=1,  # b: a frozen weight's bf16 copy is kept from step to step
    bf16_input=0,  # a: bf16 where the GEMM before it hands bf16 along (accel/graph/bf16_edges.py)
    shape=aten_shapes.gemm_shape,
)


def _emit(g: Any, a, b, bias, transpose_b: bool) -> Any:
    output, a16, b16 = g.op(
        "org.pytorch.aten::ATen",
        a,
        b,
        bias,
        g.op("Constant", value_t=torch.tensor(transpose_b)),
        g.op("Constant", value_t=torch.tensor([True, True, True])),  # aten_nodes.set_gradient_masks narrows it
        operator_s=OPERATOR,
        overload_name_s="",
        outputs=3,
    )
    output.setType(g.original_node.output().type())
    a16.setType(a.type().with_dtype(torch.bfloat16))
    b16.setType(b.type().with_dtype(torch.bfloat16))
    return output


def _float(value) -> bool:
    """Whether a traced value is a float32 tensor of known rank >= 2 (the only ones made bf16 GEMMs)."""
    rank = symbolic_helper._get_tensor_rank(value)
    return rank is not None and rank >= 2 and value.type().scalarType() == "Float"


def linear(native):
    """The `aten::linear` symbolic in a bf16 export: an ATen node for a float input and weight; else `native`."""

    def symbolic(g, input, weight, bias):
        if not (_float(input) and _float(weight)) or symbolic_helper._get_tensor_rank(weight) != 2:
            return native(g, input, weight, bias)
        return _emit(g, input, weight, bias, True)

    return symbolic


def matmul(native):
    """`aten::matmul` and `aten::bmm` in a bf16 export: an ATen node for float operands of rank >= 2 (1-D operands,
    whose gradients torch reduces differently, keep `native`)."""

    def symbolic(g, a, b):
        if not (_float(a) and _float(b)):
            return native(g, a, b)
        return _emit(g, a, b, g.op("Constant", value_t=torch.zeros(0)), False)  # no bias: an empty tensor

    return symbolic


def addmm(native):
    """`aten::addmm` (GPT-2's Conv1D: bias + x @ W) in a bf16 export: an ATen node where beta and alpha are 1."""

    def symbolic(g, bias, a, b, beta, alpha):
        ones = all(symbolic_helper._maybe_get_const(s, "f") == 1 for s in (beta, alpha))
        if not (ones and _float(a) and _float(b) and _float_any(bias)):
            return native(g, bias, a, b, beta, alpha)
        return _emit(g, a, b, bias, False)

    return symbolic


def _float_any(value) -> bool:
    return value.type().scalarType() == "Float" if value.type().kind() == "TensorType" else False


def _on_torch_path(bf16_symbolic):
    """A symbolic factory: `bf16_symbolic(native)` where the plan runs GEMMs by torch, else `native`."""
    return lambda plan, native: bf16_symbolic(native) if plan.by_torch(NAME) else native


NAME = "gemm"
OP = graph_plan.torch_or_ort(
    NAME,
    replaces="MatMul and Gemm in fp32 (aten::linear, aten::matmul, aten::bmm, aten::addmm) by bf16 GEMMs",
    module=__name__,
    by_torch=lambda settings, precision: precision == BF16,
    symbolics={
        "::linear": _on_torch_path(linear),
        "::matmul": _on_torch_path(matmul),
        "::bmm": _on_torch_path(matmul),
        "::addmm": _on_torch_path(addmm),
    },
)
