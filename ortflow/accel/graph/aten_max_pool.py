"""2-D max-pooling run by torch's kernels inside ONNX Runtime's graphs (`accel.aten_max_pool`).

Why: ORT's CPU MaxPool runs on one thread. On torchvision's ResNet-18 (64x64, batch 32, fp32, 2-core Zen 5) its stem
max-pool took 8.6 ms a step forward plus 1.7 ms for MaxPoolGrad in the artifacts engine, against 4.8 ms for torch's
`max_pool2d_with_indices` in eager: the artifacts engine trained at 0.94x eager where ORTModule, whose export already
writes max_pool2d as an ATen node running torch's kernel, trained at 1.00x.

How (its declaration at the end: the plan's `max_pool` op): each 2-D `MaxPool` of the exported forward graph (4-D
input, the same padding on both sides, its indices not read) becomes one ATen node running `ortflow::max_pool2d`
(torch's max_pool2d_with_indices, in the input's dtype); ORT builds its gradient from the definition registered here,
one ATen node running `ortflow::max_pool2d_backward` on the input and the indices. With `accel.aten_max_pool` null
(the default) only a graph that already runs torch's kernels (a CNN's convolutions) takes this path, as ReLU's does;
the portable target keeps ORT's MaxPool. ORTModule's own export of max_pool2d is an ATen node already (its registry's
`max_pool2d_with_indices`), so the rewrite finds nothing to do there.
"""

import math
from typing import Any

import onnx
import torch
from onnx import TensorProto, helper

from ortflow.accel.graph import aten_nodes, aten_shapes, onnx_values
from ortflow.accel.graph import plan as graph_plan

OPERATOR = "ortflow::max_pool2d"
BACKWARD = "ortflow::max_pool2d_backward"

_LIBRARY = torch.library.Library("ortflow", "FRAGMENT")
_ARGS = "int[] kernel, int[] stride, int[] padding, int[] dilation, bool ceil_mode"
_LIBRARY.define(f"max_pool2d(Tensor x, {_ARGS}) -> (Tensor, Tensor)")
_LIBRARY.define(f"max_pool2d_backward(Tensor grad_output, Tensor x, {_ARGS}, Tensor indices) -> Tensor")


def _max_pool(x, kernel, stride, padding, dilation, ceil_mode: bool):
    return torch.ops.aten.max_pool2d_with_indices(x, kernel, stride, padding, dilation, ceil_mode)


def _max_pool_backward(grad_output, x, kernel, stride, padding, dilation, ceil_mode: bool, indices):
    return torch.ops.aten.max_pool2d_with_indices_backward(
        grad_output, x, kernel, stride, padding, dilation, ceil_mode, indices
    )


_LIBRARY.impl("max_pool2d", _max_pool, "CPU")
_LIBRARY.impl("max_pool2d_backward", _max_pool_backward, "CPU")


def output_shape(size: list[Any], kernel, stride, padding, dilation, ceil: bool, floor=math.floor, ceiling=math.ceil):
    """torch's pooling formula for the spatial sizes `size` (ints, or sympy expressions with sympy's floor and
    ceiling); a setting given once holds for every dimension, as in torch."""
    kernel, stride, padding, dilation = (
        [v[0]] * len(size) if len(v) == 1 else v for v in (kernel, stride, padding, dilation)
    )
    shape = []
    for i, n in enumerate(size):
        span = (n + 2 * padding[i] - dilation[i] * (kernel[i] - 1) - 1) / stride[i]
        shape.append((ceiling(span) if ceil else floor(span)) + 1)
    return shape


def _shape(inference: Any, node: Any) -> None:
    """(B, C, H', W') in the input's dtype; the indices int64 (ORTModule's symbolic shape inference)."""
    import sympy

    x = inference._get_sympy_shape(node, 0)
    settings = [aten_shapes._values(inference, node, i) for i in range(1, 6)]
    if None in settings:
        spatial = [inference._new_symbolic_dim_from_output(node, 0, i + 2) for i in range(len(x) - 2)]
    else:
        kernel, stride, padding, dilation, ceil = settings
        spatial = output_shape(x[2:], kernel, stride, padding, dilation, bool(ceil[0]), sympy.floor, sympy.ceiling)
    shape = [*x[:2], *spatial]
    inference._update_computed_dims(shape)
    elem = inference.known_vi_[node.input[0]].type.tensor_type.elem_type
    aten_shapes._set(inference, node, 0, elem, shape)
    aten_shapes._set(inference, node, 1, TensorProto.INT64, shape)


aten_nodes.declare(
    OPERATOR,
    BACKWARD,
    ["GO(0)", *(f"I({i})" for i in range(6)), "O(1)"],
    gradients=1,
    differentiable=(0,),
    mask_input=None,
    fix_name="max_pools_run_by_torch",
    shape=_shape,
)


def _eligible(node: onnx.NodeProto, types: dict[str, onnx.TypeProto], read: set[str]) -> bool:
    """A 2-D MaxPool torch's max_pool2d computes: a 4-D float input, explicit padding the same on both sides, its
    indices not read."""
    if node.op_type != "MaxPool":
        return False
    type_ = types.get(node.input[0])
    rank = len(type_.tensor_type.shape.dim) if type_ is not None and type_.tensor_type.HasField("shape") else None
    pads = list(onnx_values.attribute(node, "pads", [0, 0, 0, 0]))
    return (
        rank == 4
        and type_.tensor_type.elem_type in (TensorProto.FLOAT, TensorProto.BFLOAT16)
        and onnx_values.attribute(node, "auto_pad", b"NOTSET") == b"NOTSET"
        and pads[:2] == pads[2:]
        and not any(name in read for name in node.output[1:] if name)
    )


def max_pools_to_aten(model: onnx.ModelProto) -> int:
    """Replace each eligible MaxPool (`_eligible`) by one ATen node running `ortflow::max_pool2d`, its output typed
    as the input, its settings Constants before it. Returns how many it replaced."""
    graph = model.graph
    if not any(node.op_type == "MaxPool" for node in graph.node):
        return 0
    types = onnx_values.value_types(model)
    read = {name for node in graph.node for name in node.input} | {v.name for v in graph.output}
    nodes: list[onnx.NodeProto] = []
    typed: list[onnx.ValueInfoProto] = []
    changed = 0
    for node in graph.node:
        if not _eligible(node, types, read):
            nodes.append(node)
            continue
        base = f"{node.name or node.output[0]}/torch"
        settings = {
            "kernel": list(onnx_values.attribute(node, "kernel_shape")),
            "stride": list(onnx_values.attribute(node, "strides", [1, 1])),
            "padding": list(onnx_values.attribute(node, "pads", [0, 0, 0, 0]))[:2],
            "dilation": list(onnx_values.attribute(node, "dilations", [1, 1])),
        }
        inputs = [node.input[0]]
        for key, values in settings.items():
            tensor = helper.make_tensor(f"{base}/{key}", TensorProto.INT64, [len(values)], values)
            nodes.append(helper.make_node("Constant", [], [f"{base}/{key}"], value=tensor))
            inputs.append(f"{base}/{key}")
        ceil_mode = bool(onnx_values.attribute(node, "ceil_mode", 0))
        ceil = helper.make_tensor(f"{base}/ceil_mode", TensorProto.BOOL, [], [ceil_mode])
        nodes.append(helper.make_node("Constant", [], [f"{base}/ceil_mode"], value=ceil))
        inputs.append(f"{base}/ceil_mode")
        outputs = [node.output[0], f"{base}/indices"]
        nodes.append(aten_nodes.make_node(OPERATOR, inputs, outputs, base))
        x = types[node.input[0]].tensor_type
        dims = [d.dim_value if d.HasField("dim_value") else None for d in x.shape.dim]
        spatial = None
        if None not in dims:
            spatial = output_shape(dims[2:], *settings.values(), ceil_mode)
        shape = None if spatial is None else [*dims[:2], *spatial]
        typed.append(helper.make_tensor_value_info(node.output[0], x.elem_type, shape))
        typed.append(helper.make_tensor_value_info(outputs[1], TensorProto.INT64, shape))
        changed += 1
    if changed:
        retyped = {v.name for v in typed}
        kept = [v for v in graph.value_info if v.name not in retyped]
        del graph.value_info[:]
        graph.value_info.extend([*kept, *typed])
        del graph.node[:]
        graph.node.extend(nodes)
        aten_nodes.import_domain(model)
    return changed


def _rewrite(model: onnx.ModelProto, plan: graph_plan.GraphPlan, work: graph_plan.GraphWork) -> None:
    # null: in graphs that already run torch's kernels (a CNN's convolutions) only, as ReLU's path
    if plan.by_torch(NAME) and aten_nodes.follows_torch(model, plan.settings.aten_max_pool):
        max_pools_to_aten(model)  # its nodes are counted with the other ATen nodes (aten_nodes.graph_fixes)


NAME = "max_pool"
OP = graph_plan.torch_or_ort(
    NAME,
    replaces="MaxPool (ORT's CPU MaxPool runs on one thread)",
    module=__name__,
    setting="aten_max_pool",
    by_torch=lambda settings, precision: settings.aten_max_pool is not False,
    rewrite=_rewrite,
)
