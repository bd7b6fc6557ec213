"""ReLU in ONNX Runtime's graphs: run by torch's kernels (`accel.aten_relu`), or by ORT as `x * (x > 0)`
(`accel.rewrite_relu`), or as ORT's own Relu.

Why: ORT's CPU ReluGrad runs on one thread, so ortflow has written ReLU as `x * Cast(x > 0)` (a parallel Mul for
the gradient). On a CNN that is three passes over the feature map forward (Greater, Cast, Mul; ORT's Cast is slow)
and one back, against torch's one and one: on the vision recipe (2-core Zen 5, fp32) its seven ReLUs took 4.8 ms of
an artifacts step against eager's 1.1 ms. An `org.pytorch.aten::ATen` node runs torch's relu forward and
threshold_backward on its output as the gradient, as eager does.

How (its declaration at the end: the plan's `relu` op): each float32 `Relu` of the exported forward graph becomes
one ATen node running `ortflow::relu`; ORT builds its gradient from the definition registered here, one ATen node
running `ortflow::relu_backward(grad, output)`. With `accel.aten_relu` null (the default) only a graph that already
runs torch's kernels takes this path (its other ATen nodes have turned ORT's spin-waiting off); the others take the
ort path, where the plan's next op, `relu_mask` (rewrites.py), writes ReLU as `x * Cast(x > 0)` if
`accel.rewrite_relu` is on. bf16 edges (accel/graph/bf16_edges.py) take a ReLU between two bf16 GEMMs in any of
these forms.
"""

import onnx
import torch

from ortflow.accel.graph import aten_nodes, aten_shapes
from ortflow.accel.graph import plan as graph_plan
from ortflow.accel.graph.onnx_values import declare_type, typed_names, value_types

OPERATOR = "ortflow::relu"
BACKWARD = "ortflow::relu_backward"

_LIBRARY = torch.library.Library("ortflow", "FRAGMENT")
_LIBRARY.define("relu(Tensor x) -> Tensor")
_LIBRARY.define("relu_backward(Tensor grad_output, Tensor result) -> Tensor")


def _relu(x: torch.Tensor) -> torch.Tensor:
    return torch.relu(x)


def _relu_backward(grad_output: torch.Tensor, result: torch.Tensor) -> torch.Tensor:
    return torch.ops.aten.threshold_backward(grad_output, result, 0)  # torch's own ReLU backward, on its output


_LIBRARY.impl("relu", _relu, "CPU")
_LIBRARY.impl("relu_backward", _relu_backward, "CPU")


aten_nodes.declare(
    OPERATOR,
    BACKWARD,
    ["GO(0)", "O(0)"],
    gradients=1,
    differentiable=(0,),
    mask_input=None,
    fix_name="relus_run_by_torch",
    shape=aten_shapes.same_shape,
)


def relus_to_aten(model: onnx.ModelProto) -> int:
    """Replace each float32 `Relu` by one ATen node running `ortflow::relu`, its output typed as the input. Returns
    how many it replaced."""
    graph = model.graph
    if not any(node.op_type == "Relu" for node in graph.node):
        return 0  # (before the shape inference below)
    types = value_types(model)
    typed = typed_names(graph)
    nodes: list[onnx.NodeProto] = []
    changed = 0
    for node in graph.node:
        type_ = types.get(node.input[0]) if node.op_type == "Relu" else None
        if type_ is None or type_.tensor_type.elem_type != onnx.TensorProto.FLOAT:
            nodes.append(node)
            continue
        name = f"{node.name or node.output[0]}/relu"
        nodes.append(aten_nodes.make_node(OPERATOR, [node.input[0]], [node.output[0]], name))
        if node.output[0] not in typed:  # ORT cannot infer an ATen node's output type: the input's, shape too (an
            # Add of it and a tensor of the same shape then needs no broadcast reduction in its gradient)
            declare_type(graph, node.output[0], type_)
        changed += 1
    if changed:
        del graph.node[:]
        graph.node.extend(nodes)
        aten_nodes.import_domain(model)
    return changed


def _rewrite(model: onnx.ModelProto, plan: graph_plan.GraphPlan, work: graph_plan.GraphWork) -> None:
    # null: by torch only in a graph that already runs torch's kernels (a CNN's convolutions), where ORT's threads
    # do not spin-wait anyway; elsewhere ReLU alone would turn spinning off (the transformer recipe's artifacts step
    # was 18% slower for it)
    if plan.by_torch(NAME) and aten_nodes.follows_torch(model, plan.settings.aten_relu):
        relus_to_aten(model)  # its nodes are counted with the other ATen nodes (aten_nodes.graph_fixes)


NAME = "relu"
OP = graph_plan.torch_or_ort(
    NAME,
    replaces="Relu (ORT's gradient, ReluGrad, runs on one thread on the CPU)",
    module=__name__,
    setting="aten_relu",
    by_torch=lambda settings, precision: settings.aten_relu is not False,
    rewrite=_rewrite,
)
