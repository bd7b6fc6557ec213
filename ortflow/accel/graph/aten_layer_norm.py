"""LayerNorm run by torch's kernels inside ONNX Runtime's graphs (`accel.aten_layer_norm`).

Why: ORT's CPU LayerNormalizationGrad is a slow kernel: at d_model 512 (4 layers, block 128, batch 16) it took
142 ms of an artifacts step against 11 ms for torch's native_layer_norm_backward (ortflow-bench --profile). As with
convolutions (accel/graph/aten_conv.py), an `org.pytorch.aten::ATen` node hands the operator to torch through the ATen
executor extension.

How (its declaration at the end: the plan's `layer_norm` op, `accel.aten_layer_norm`; symbolics.py puts it in place
only while an ORT engine exports):
- forward: the exporter's `aten::layer_norm` (nn.LayerNorm, F.layer_norm) becomes one ATen node running
  `ortflow::layer_norm` (aten::native_layer_norm: the output, and the mean and 1/std per row it keeps for the
  gradient), with a mask of which of input, weight and bias need a gradient (aten_nodes.set_gradient_masks);
- gradient: one ATen node running `ortflow::layer_norm_backward` (aten::native_layer_norm_backward) on the output's
  gradient, the forward node's inputs and its saved mean and 1/std.
"""

from typing import Any

import torch
from torch.onnx import symbolic_helper

from ortflow.accel.graph import aten_nodes
from ortflow.accel.graph import plan as graph_plan

OPERATOR = "ortflow::layer_norm"
BACKWARD = "ortflow::layer_norm_backward"
_ARGS = "Tensor input, Tensor? weight, Tensor? bias, int[] normalized_shape, float eps, bool[] output_mask"

_LIBRARY = torch.library.Library("ortflow", "FRAGMENT")
_LIBRARY.define(f"layer_norm({_ARGS}) -> (Tensor, Tensor, Tensor)")
_LIBRARY.define(
    f"layer_norm_backward(Tensor grad_output, {_ARGS}, Tensor mean, Tensor rstd) -> (Tensor, Tensor, Tensor)"
)


def _layer_norm(input, weight, bias, normalized_shape, eps, output_mask):
    return torch.ops.aten.native_layer_norm(input, normalized_shape, weight, bias, eps)


def _layer_norm_backward(grad_output, input, weight, bias, normalized_shape, eps, output_mask, mean, rstd):
    """aten::native_layer_norm_backward for the gradients `output_mask` asks for; None (an undefined tensor, which
    ORT's ATen kernel leaves unset) for the others."""
    mask = [bool(output_mask[0]), bool(output_mask[1]) and weight is not None]
    mask.append(bool(output_mask[2]) and bias is not None)
    grads = torch.ops.aten.native_layer_norm_backward(
        grad_output.contiguous(), input, normalized_shape, mean, rstd, weight, bias, mask
    )
    return tuple(grad if wanted else None for grad, wanted in zip(grads, mask, strict=True))


_LIBRARY.impl("layer_norm", _layer_norm, "CPU")
_LIBRARY.impl("layer_norm_backward", _layer_norm_backward, "CPU")


# ORT's gradient of the forward node: one ATen node on GO(0), the forward node's six inputs and its saved mean and
# 1/std; it returns the gradients of input, weight and bias (the first three inputs, which may get one; the mask is
# the forward node's sixth input).
aten_nodes.declare(
    OPERATOR,
    BACKWARD,
    ["GO(0)", *(f"I({i})" for i in range(6)), "O(1)", "O(2)"],
    differentiable=(0, 1, 2),
    mask_input=5,
    fix_name="layer_norms_run_by_torch",
)


@symbolic_helper.parse_args("v", "is", "v", "v", "f", "none")
def emit(g: Any, input, normalized_shape, weight, bias, eps, cudnn_enable) -> Any:
    """One ATen node running ortflow::layer_norm; its output typed as the traced LayerNorm's, the saved statistics
    as float tensors of the input's rank."""
    output, mean, rstd = g.op(
        "org.pytorch.aten::ATen",
        input,
        weight,
        bias,
        g.op("Constant", value_t=torch.tensor(normalized_shape, dtype=torch.int64)),
        g.op("Constant", value_t=torch.tensor(eps, dtype=torch.float32)),
        g.op("Constant", value_t=torch.tensor([True, True, True])),  # aten_nodes.set_gradient_masks narrows it
        operator_s=OPERATOR,
        overload_name_s="",
        outputs=3,
    )
    traced = g.original_node.output().type()
    output.setType(traced)
    rank = symbolic_helper._get_tensor_rank(input)
    if rank is not None:
        statistics = traced.with_dtype(torch.float32).with_sizes([None] * rank)
        mean.setType(statistics)
        rstd.setType(statistics)
    return output


def _layer_norm_symbolic(plan: graph_plan.GraphPlan, native) -> Any:
    """The `aten::layer_norm` symbolic: ortflow's ATen node on the torch path, else `native` (ORTModule's at the
    opsets it registered it for, torch's own at the others: ORT's emits LayerNormalization, an opset-17 op)."""
    return emit if plan.by_torch(NAME) else native


NAME = "layer_norm"
OP = graph_plan.torch_or_ort(
    NAME,
    replaces="LayerNormalization (aten::layer_norm: nn.LayerNorm, F.layer_norm)",
    module=__name__,
    setting="aten_layer_norm",
    symbolics={"::layer_norm": _layer_norm_symbolic},
)
