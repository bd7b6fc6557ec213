"""Convolutions run by torch's own kernels inside ONNX Runtime's graphs (`accel.aten_conv`; transposed ones always).

Why: ORT's CPU build trains convolutions with its own kernels, about half as fast as torch's oneDNN ones (a plain
VGG-style CNN trained at 0.44x eager in both ORT engines; ORT's ConvGrad alone was two thirds of a step), and it has
no ConvTransposeGrad at all ("Could not find an implementation for ConvTransposeGrad"). ORT can hand chosen nodes to
torch: an `org.pytorch.aten::ATen` node runs a torch operator through the ATen executor extension (built with
ORTModule's other extensions, accel/compat/extensions.py).

How (its declaration at the end: the plan's `convolution` op, `accel.aten_conv`; symbolics.py puts it in place only
while an ORT engine exports):
- forward: the exporter's `aten::_convolution` (every nn.Conv*d, F.conv*d and transposed convolution) becomes one
  ATen node running `ortflow::convolution` (aten::convolution, plus which gradients it needs); the same for
  `aten::_convolution_mode` (padding="same"/"valid") where that padding is symmetric;
- gradient: ORT builds it from the definition registered here: one ATen node running `ortflow::convolution_backward`
  (aten::convolution_backward for the gradients asked for). One node and no helper: ORT's gradient builder rejected
  a helper node computing the bias size for a convolution whose input needs no gradient (the image's).

The engines load the executor before their sessions and turn ORT's spin-waiting off (idle ORT threads spinning
compete with the torch threads running these kernels).
"""

from typing import Any

import torch
from torch.onnx import symbolic_helper

from ortflow.accel.graph import aten_nodes, aten_shapes, symbolics
from ortflow.accel.graph import plan as graph_plan
from ortflow.config import BF16

OPERATOR = "ortflow::convolution"  # the forward node's operator
BACKWARD = "ortflow::convolution_backward"
OPERATOR_BF16 = "ortflow::convolution_bf16"  # trainer.precision=bf16-mixed: computed on bf16 copies
BACKWARD_BF16 = "ortflow::convolution_bf16_backward"
_ARGS = (
    "Tensor input, Tensor weight, Tensor? bias, int[] stride, int[] padding, int[] dilation, bool transposed, "
    "int[] output_padding, int groups, bool[] output_mask"
)

# Two torch operators ORT's ATen executor calls by name. The forward is aten::convolution itself plus `output_mask`
# (which of input, weight and bias need a gradient; set per node after the export, aten_nodes.set_gradient_masks),
# so that the gradient node, which receives the forward node's inputs, computes only those: ORT leaves a gradient nobody
# needs unconnected and refuses an operator that returns it anyway.
_LIBRARY = torch.library.Library("ortflow", "DEF")
_LIBRARY.define(f"convolution({_ARGS}) -> Tensor")
_LIBRARY.define(f"convolution_backward(Tensor grad_output, {_ARGS}) -> (Tensor, Tensor, Tensor)")
_LIBRARY.define(f"convolution_bf16({_ARGS}) -> Tensor")
_LIBRARY.define(f"convolution_bf16_backward(Tensor grad_output, {_ARGS}) -> (Tensor, Tensor, Tensor)")


def _convolution(input, weight, bias, stride, padding, dilation, transposed, output_padding, groups, output_mask):
    return torch.ops.aten.convolution(
        input, weight, bias, stride, padding, dilation, transposed, output_padding, groups
    )


def _convolution_backward(
    grad_output, input, weight, bias, stride, padding, dilation, transposed, output_padding, groups, output_mask
):
    """aten::convolution_backward for the gradients `output_mask` asks for; None (an undefined tensor, which ORT's
    ATen kernel leaves unset) for the others. The bias size comes from the weight's shape."""
    mask = [bool(output_mask[0]), bool(output_mask[1]), bool(output_mask[2]) and bias is not None]
    channels = weight.size(1) * groups if transposed else weight.size(0)
    grads = torch.ops.aten.convolution_backward(
        grad_output.contiguous(),
        input,
        weight,
        [channels] if bias is not None else None,
        stride,
        padding,
        dilation,
        transposed,
        output_padding,
        groups,
        mask,
    )
    return tuple(grad if wanted else None for grad, wanted in zip(grads, mask, strict=True))


def bf16_or_none(tensor: torch.Tensor | None) -> torch.Tensor | None:
    """`tensor` in bf16 (itself if it is bf16 already); None stays None."""
    return None if tensor is None else tensor.to(torch.bfloat16)


def _convolution_bf16(input, weight, bias, stride, padding, dilation, transposed, output_padding, groups, output_mask):
    """trainer.precision=bf16-mixed: the convolution of bf16 copies (torch's CPU autocast), returned in fp32."""
    args = (stride, padding, dilation, transposed, output_padding, groups, output_mask)
    return _convolution(bf16_or_none(input), bf16_or_none(weight), bf16_or_none(bias), *args).float()


def _convolution_bf16_backward(
    grad_output, input, weight, bias, stride, padding, dilation, transposed, output_padding, groups, output_mask
):
    """The input and weight gradients as bf16 convolutions, returned in fp32; the bias gradient summed in fp32."""
    args = (stride, padding, dilation, transposed, output_padding, groups)
    grad_input, grad_weight, _ = _convolution_backward(
        bf16_or_none(grad_output),
        bf16_or_none(input),
        bf16_or_none(weight),
        bias,
        *args,
        [output_mask[0], output_mask[1], False],
    )
    grad_bias = None
    if bool(output_mask[2]) and bias is not None:
        grad_bias = grad_output.sum([0, *range(2, grad_output.dim())])
    return float_or_none(grad_input), float_or_none(grad_weight), grad_bias


def float_or_none(tensor: torch.Tensor | None) -> torch.Tensor | None:
    """`tensor` in fp32 (itself if it is fp32 already); None stays None."""
    return None if tensor is None else tensor.float()


_LIBRARY.impl("convolution", _convolution, "CPU")
_LIBRARY.impl("convolution_backward", _convolution_backward, "CPU")
_LIBRARY.impl("convolution_bf16", _convolution_bf16, "CPU")
_LIBRARY.impl("convolution_bf16_backward", _convolution_bf16_backward, "CPU")


# ORT's gradient of the forward node: one ATen node on GO(0) and the forward node's ten inputs, returning the
# gradients of input, weight and bias (which may get one); the mask is the forward node's tenth input.
_GRADIENT_INPUTS = ["GO(0)", *(f"I({i})" for i in range(10))]
for _forward, _backward, _fixes in (
    (OPERATOR, BACKWARD, "convolutions_run_by_torch"),
    (OPERATOR_BF16, BACKWARD_BF16, "convolutions_run_by_torch_bf16"),
):
    aten_nodes.declare(
        _forward,
        _backward,
        _GRADIENT_INPUTS,
        differentiable=(0, 1, 2),
        mask_input=9,
        fix_name=_fixes,
        shape=aten_shapes.convolution_shape,
    )


def _ints(g: Any, values: list[int]) -> Any:
    return g.op("Constant", value_t=torch.tensor(values, dtype=torch.int64))


def emit(
    g: Any, input, weight, bias, stride, padding, dilation, transposed, output_padding, groups, bf16: bool = False
) -> Any:
    """One ATen node running ortflow::convolution (ortflow::convolution_bf16 with `bf16`; its output typed as the
    traced convolution's)."""
    output = g.op(
        "org.pytorch.aten::ATen",
        input,
        weight,
        bias,
        _ints(g, stride),
        _ints(g, padding),
        _ints(g, dilation),
        g.op("Constant", value_t=torch.tensor(bool(transposed))),
        _ints(g, output_padding),
        g.op("Constant", value_t=torch.tensor(groups, dtype=torch.int64)),
        g.op("Constant", value_t=torch.tensor([True, True, True])),  # aten_nodes.set_gradient_masks narrows it
        operator_s=OPERATOR_BF16 if bf16 else OPERATOR,
        overload_name_s="",
    )
    output.setType(g.original_node.output().type())
    return output


def _transposed_refused(g: Any) -> None:
    raise graph_plan.NoPortablePath(
        "a transposed convolution",
        symbolics.scope(g),
        "ONNX Runtime's CPU build has no gradient for ConvTranspose (ortflow runs it with torch's kernels, which a "
        "device does not have)",
    )


def _convolution_symbolic(plan: graph_plan.GraphPlan, native) -> Any:
    """The `aten::_convolution` symbolic: an ATen node for every convolution on the torch path, and for transposed
    ones on the ORT path too where the target allows (ORT has no CPU gradient for ConvTranspose); else `native`."""
    bf16 = plan.precision == BF16

    @symbolic_helper.parse_args("v", "v", "v", "is", "is", "is", "i", "is", "i", "i", "i", "i", "i")
    def symbolic(
        g,
        input,
        weight,
        bias,
        stride,
        padding,
        dilation,
        transposed,
        output_padding,
        groups,
        benchmark,
        deterministic,
        cudnn_enabled,
        allow_tf32=None,
    ):
        args = (input, weight, bias, stride, padding, dilation, transposed, output_padding, groups)
        if transposed and plan.portable:
            _transposed_refused(g)
        if not (plan.by_torch(NAME) or transposed):
            return native(g, *args, benchmark, deterministic, cudnn_enabled, allow_tf32)
        return emit(g, *args, bf16=bf16)

    return symbolic


def _convolution_mode_symbolic(plan: graph_plan.GraphPlan, native) -> Any:
    """The `aten::_convolution_mode` symbolic (padding="valid" or "same", stride 1) on the torch path: an ATen node
    with the padding written out where it is the same on both sides of every dimension; otherwise `native`."""
    bf16 = plan.precision == BF16

    @symbolic_helper.parse_args("v", "v", "v", "is", "s", "is", "i")
    def symbolic(g, input, weight, bias, stride, padding, dilation, groups):
        if not plan.by_torch(NAME):
            return native(g, input, weight, bias, stride, padding, dilation, groups)
        sizes = symbolic_helper._get_tensor_sizes(weight)
        kernel = sizes[2:] if sizes else None
        if kernel is None or any(k is None for k in kernel) or padding not in ("valid", "same"):
            return native(g, input, weight, bias, stride, padding, dilation, groups)
        dilation = dilation if len(dilation) == len(kernel) else dilation * len(kernel)
        totals = [d * (k - 1) for d, k in zip(dilation, kernel, strict=True)]
        if padding == "same" and any(t % 2 for t in totals):
            return native(g, input, weight, bias, stride, padding, dilation, groups)
        pads = [t // 2 for t in totals] if padding == "same" else [0] * len(kernel)
        stride = stride if len(stride) == len(kernel) else stride * len(kernel)
        return emit(g, input, weight, bias, stride, pads, dilation, False, [0] * len(kernel), groups, bf16=bf16)

    return symbolic


NAME = "convolution"
OP = graph_plan.torch_or_ort(
    NAME,
    replaces="Conv and ConvTranspose (aten::_convolution, aten::_convolution_mode: nn.Conv*d, F.conv*d)",
    module=__name__,
    setting="aten_conv",
    by_torch=lambda settings, precision: bool(settings.aten_conv),
    symbolics={"::_convolution": _convolution_symbolic, "::_convolution_mode": _convolution_mode_symbolic},
)
