"""An embedding lookup in ONNX Runtime's graphs run by torch's kernels (`accel.aten_embedding`), as ORTModule's
export already runs it.

Why: the artifacts engine's export writes `nn.Embedding` as `Gather(W, ids)`, whose CPU gradient GatherGrad contends
across threads, so ortflow has written a small vocabulary's lookup as `MatMul(OneHot(ids), W)` (rewrites.py,
`accel.rewrite_embedding_max_vocab`): on the transformer recipe in bf16-mixed that is 2.1 ms a step under ORT's
profiler (OneHot 0.8, the (tokens x vocabulary) MatMul 0.5 and its gradient's Gemm 0.8; 2-core Zen 5), about 4% of
the step. torch's `embedding` copies the rows, and its `embedding_dense_backward` adds the gradient rows into a zero
weight gradient, as eager PyTorch does.

How (its declaration at the end: the plan's `embedding_lookup` op): each `Gather` of a 2-D float32 initializer along
axis 0 with non-constant ids becomes one ATen node running `ortflow::embedding(weight, ids)`; its gradient is one
ATen node running `ortflow::embedding_backward(grad, ids, weight)` (the weight only for its number of rows). With
`accel.aten_embedding` null (the default) only a graph that already runs torch's kernels takes this path, as
aten_relu.py explains; the others keep the Gather, which the plan's next op, `embedding`, may write as OneHot @ W.
"""

import onnx
import torch

from ortflow.accel.graph import aten_nodes
from ortflow.accel.graph import plan as graph_plan
from ortflow.accel.graph.onnx_values import attribute, constant_values, declare_type, typed_names, value_types

OPERATOR = "ortflow::embedding"
BACKWARD = "ortflow::embedding_backward"

_LIBRARY = torch.library.Library("ortflow", "FRAGMENT")
_LIBRARY.define("embedding(Tensor weight, Tensor ids) -> Tensor")
_LIBRARY.define("embedding_backward(Tensor grad_output, Tensor ids, Tensor weight) -> Tensor")


def _embedding(weight: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    return torch.embedding(weight, ids)


def _embedding_backward(grad_output: torch.Tensor, ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    # torch's own backward of an embedding without padding_idx or scale_grad_by_freq (what a Gather computes)
    return torch.ops.aten.embedding_dense_backward(grad_output, ids, weight.size(0), -1, False)


_LIBRARY.impl("embedding", _embedding, "CPU")
_LIBRARY.impl("embedding_backward", _embedding_backward, "CPU")


aten_nodes.declare(
    OPERATOR,
    BACKWARD,
    ["GO(0)", "I(1)", "I(0)"],
    gradients=1,
    differentiable=(0,),
    mask_input=None,
    fix_name="embeddings_run_by_torch",
)  # no shape rule: only the artifacts engine's graphs hold these nodes, typed where they are written


def embeddings_to_aten(model: onnx.ModelProto) -> int:
    """Replace each `Gather(W, ids)` on a 2-D float32 initializer W along axis 0, ids not constant, by one ATen node
    running `ortflow::embedding`, its output typed as the Gather's. Returns how many it replaced."""
    graph = model.graph
    weights = {i.name: i for i in graph.initializer}
    constants = constant_values(graph)
    found = [
        node
        for node in graph.node
        if node.op_type == "Gather"
        and (weight := weights.get(node.input[0])) is not None
        and len(weight.dims) == 2
        and weight.data_type == onnx.TensorProto.FLOAT
        and attribute(node, "axis", 0) == 0
        and node.input[1] not in constants
    ]
    if not found:
        return 0  # (before the shape inference below)
    types = value_types(model)
    typed = typed_names(graph)
    replaced = {id(node) for node in found}
    nodes: list[onnx.NodeProto] = []
    for node in graph.node:
        if id(node) not in replaced:
            nodes.append(node)
            continue
        name = f"{node.name or node.output[0]}/embedding"
        nodes.append(aten_nodes.make_node(OPERATOR, list(node.input), [node.output[0]], name))
        if node.output[0] not in typed and node.output[0] in types:  # ORT cannot infer an ATen node's output type
            declare_type(graph, node.output[0], types[node.output[0]])
    del graph.node[:]
    graph.node.extend(nodes)
    aten_nodes.import_domain(model)
    return len(found)


def _rewrite(model: onnx.ModelProto, plan: graph_plan.GraphPlan, work: graph_plan.GraphWork) -> None:
    # null: by torch only in a graph that already runs torch's kernels (aten_relu.py says why)
    if plan.by_torch(NAME) and aten_nodes.follows_torch(model, plan.settings.aten_embedding):
        embeddings_to_aten(model)  # its nodes are counted with the other ATen nodes (aten_nodes.graph_fixes)


NAME = "embedding_lookup"
OP = graph_plan.torch_or_ort(
    NAME,
    replaces="an embedding's Gather (ORT's gradient, GatherGrad, contends across threads on the CPU)",
    module=__name__,
    setting="aten_embedding",
    by_torch=lambda settings, precision: settings.aten_embedding is not False,
    rewrite=_rewrite,
)
