"""A switchable torch-kernel op as a user of the graph plan would add one: this module plus one settings field.

`Tanh` nodes run by torch's `aten::tanh` inside ORT's graphs (gradient: `aten::tanh_backward` on the output's
gradient and the forward's output), switched by `aten_tanh`. Importing the module declares the op; `declared()`
declares it for the duration of a test and takes it out again (the registries are process-wide).
"""

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import onnx
from onnx import helper

from ortflow.accel import artifacts, ortmodule
from ortflow.accel.graph import aten_nodes, aten_shapes, onnx_values, pipeline
from ortflow.accel.graph import plan as graph_plan

NAME = "tanh"


def _gradient() -> list[tuple]:
    node = (("ATen", "org.pytorch.aten"), ["GO(0)", "O(0)"], ["GI(0)"])
    return [(*node, {"operator": {"value": "tanh_backward", "dtype": "string"}})]


TANH = aten_nodes.AtenOp(
    "tanh",
    "tanh_backward",
    differentiable=(0,),
    mask_input=None,
    gradient=_gradient,
    fix_name="tanhs_run_by_torch",
    shape=aten_shapes.same_shape,
)


def tanhs_to_aten(model: onnx.ModelProto) -> int:
    """Every Tanh node as an ATen node running torch's tanh (its output typed as its input)."""
    graph = model.graph
    replaced = {
        node.output[0]: [
            helper.make_node(
                "ATen",
                [node.input[0]],
                [node.output[0]],
                name=f"{node.name}/aten",
                domain="org.pytorch.aten",
                operator="tanh",
                overload_name="",
            )
        ]
        for node in graph.node
        if node.op_type == "Tanh"
    }
    onnx_values.replace_nodes(graph, replaced, set())
    if replaced and not any(o.domain == "org.pytorch.aten" for o in model.opset_import):
        model.opset_import.append(helper.make_opsetid("org.pytorch.aten", 1))
    for out in replaced:
        graph.value_info.append(helper.make_empty_tensor_value_info(out))
        graph.value_info[-1].type.tensor_type.elem_type = onnx.TensorProto.FLOAT
    return len(replaced)


def _rewrite(model: onnx.ModelProto, plan: graph_plan.GraphPlan, work: graph_plan.GraphWork) -> None:
    if plan.by_torch(NAME):
        tanhs_to_aten(model)


OP = graph_plan.GraphOp(
    NAME,
    "Tanh by torch's kernel",
    __name__,
    (graph_plan.Path.torch, graph_plan.Path.ort),
    lambda settings, precision, engine: (
        graph_plan.Path.torch if getattr(settings, "aten_tanh", False) else graph_plan.Path.ort
    ),
    setting="aten_tanh",
    rewrite=_rewrite,
)


# The one field, on each engine's settings (a user adds it to GraphSettings in ortflow/accel/graph/plan.py)
@dataclass
class ArtifactsSettings(artifacts.Settings):
    aten_tanh: bool = True


@dataclass
class ORTModuleSettings(ortmodule.Settings):
    aten_tanh: bool = True


@contextlib.contextmanager
def declared() -> Iterator[graph_plan.GraphOp]:
    graph_plan.declare(OP)
    aten_nodes.register(TANH)
    order = pipeline.ORDER
    at = order.index("bf16_edges")
    pipeline.ORDER = (*order[:at], NAME, *order[at:])  # a user adds its name to the table
    try:
        yield OP
    finally:
        del graph_plan.OPS[NAME], aten_nodes.OPS[TANH.forward]
        pipeline.ORDER = order
