"""Bugs planted inside the training graph an ORT engine executes, for the parity check to catch
(`ortflow.accel.graph.pipeline.planted`): each plant is a last step of the graph pipeline, in one engine or both,
never a change to the values the check reads.

- `scale_gradient(parameter, scale)`: the parameter's consumers read it through an ATen node running
  `ortflow_test::scale_gradient`, identity forward, its gradient multiplied by `scale` (0: the gradient dropped);
  the gradient definition is registered in ORT's gradient registry like ortflow's own torch-kernel nodes
  (accel/graph/aten_nodes.py).
- `batchnorm_momentum(module, momentum)`: the module's BatchNormalization node gets a nonzero momentum. ortflow's
  fast target keeps running statistics by setting momentum 0 and applying torch's update on the host to what ORT's
  kernel writes (accel/graph/batchnorm.py): with `momentum` m the kernel writes m * running_mean + (1 - m) * batch
  mean, and the running mean the host computes after the first step is off by m (relative; its variance too).

Use inside `planted(...)`: `with pipeline.planted(plants.scale_gradient("head.bias", 1.01, engine="artifacts")):`.
"""

import contextlib
from collections.abc import Iterator

import numpy as np
import onnx
import torch
from onnx import helper, numpy_helper

from ortflow.accel.graph import aten_nodes, aten_shapes, pipeline
from ortflow.accel.graph.plan import GraphPlan, GraphWork

OPERATOR = "ortflow_test::scale_gradient"
BACKWARD = "ortflow_test::scale_gradient_backward"

_LIBRARY = torch.library.Library("ortflow_test", "FRAGMENT")
_LIBRARY.define("scale_gradient(Tensor x, float scale) -> Tensor")
_LIBRARY.define("scale_gradient_backward(Tensor grad_output, float scale) -> Tensor")
_LIBRARY.impl("scale_gradient", lambda x, scale: x.clone(), "CPU")
_LIBRARY.impl("scale_gradient_backward", lambda grad_output, scale: grad_output * scale, "CPU")


# The same, its gradient scaled on the first backward only (a bug on the first batch, right from the second on).
FIRST = "ortflow_test::scale_first_gradient"
FIRST_BACKWARD = "ortflow_test::scale_first_gradient_backward"
_backwards = {"calls": 0}
_LIBRARY.define("scale_first_gradient(Tensor x, float scale) -> Tensor")
_LIBRARY.define("scale_first_gradient_backward(Tensor grad_output, float scale) -> Tensor")
_LIBRARY.impl("scale_first_gradient", lambda x, scale: x.clone(), "CPU")


def _first_backward(grad_output: torch.Tensor, scale: float) -> torch.Tensor:
    _backwards["calls"] += 1
    return grad_output * scale if _backwards["calls"] == 1 else grad_output.clone()


_LIBRARY.impl("scale_first_gradient_backward", _first_backward, "CPU")


def _gradient(backward: str = BACKWARD) -> list[tuple]:
    node = (("ATen", "org.pytorch.aten"), ["GO(0)", "I(1)"], ["GI(0)"])
    return [(*node, {"operator": {"value": backward, "dtype": "string"}})]


SCALE = aten_nodes.AtenOp(
    OPERATOR,
    BACKWARD,
    differentiable=(0,),
    mask_input=None,
    gradient=_gradient,
    fix_name="planted_gradient_scales",
    shape=aten_shapes.same_shape,
)
SCALE_FIRST = aten_nodes.AtenOp(
    FIRST,
    FIRST_BACKWARD,
    differentiable=(0,),
    mask_input=None,
    gradient=lambda: _gradient(FIRST_BACKWARD),
    fix_name="planted_gradient_scales",
    shape=aten_shapes.same_shape,
)


@contextlib.contextmanager
def declared() -> Iterator[None]:
    """The planted operators known to ortflow's ATen-node registry while inside (the registry is process-wide)."""
    aten_nodes.register(SCALE)
    aten_nodes.register(SCALE_FIRST)
    try:
        yield
    finally:
        del aten_nodes.OPS[SCALE.forward], aten_nodes.OPS[SCALE_FIRST.forward]


def graph_name(names: set[str], parameter: str) -> str:
    """The graph's name for the torch parameter `parameter` among `names` (the artifacts engine prefixes `model.`,
    ORTModule's export its wrappers' attribute names)."""
    found = [n for n in names if n == parameter or n.endswith("." + parameter)]
    if len(found) != 1:
        raise AssertionError(f"parameter {parameter!r}: {len(found)} graph names match among {sorted(names)[:8]}...")
    return found[0]


def _plant_for(engine: str | None, plant: pipeline.Plant) -> pipeline.Plant:
    def run(model: onnx.ModelProto, plan: GraphPlan, work: GraphWork) -> None:
        if engine is None or plan.engine == engine:
            plant(model, plan, work)

    return run


def scale_gradient(
    parameter: str, scale: float, engine: str | None = None, first_step_only: bool = False
) -> pipeline.Plant:
    """A plant multiplying the gradient of the torch parameter `parameter` by `scale` (in `engine` only, or both;
    with `first_step_only`, on the first backward run after this call only, whichever engine runs it: the first
    batch's gradient wrong, every later one right, even in an engine built again). The forward graph ORTModule
    prepares for evaluation has no trainable parameters: it is left alone."""
    _backwards["calls"] = 0

    def plant(model: onnx.ModelProto, plan: GraphPlan, work: GraphWork) -> None:
        graph = model.graph
        if not work.trainable:
            return
        name = graph_name(work.trainable, parameter)
        read = f"{name}/planted_scale"
        for node in graph.node:
            for i, value in enumerate(node.input):
                if value == name:
                    node.input[i] = read
        factor = numpy_helper.from_array(np.array(scale, np.float32), f"{read}/factor")
        nodes = [
            helper.make_node("Constant", [], [factor.name], value=factor),
            helper.make_node(
                "ATen",
                [name, factor.name],
                [read],
                name=f"{read}/aten",
                domain="org.pytorch.aten",
                operator=FIRST if first_step_only else OPERATOR,
                overload_name="",
            ),
        ]
        kept = list(graph.node)
        del graph.node[:]
        graph.node.extend([*nodes, *kept])
        if not any(o.domain == "org.pytorch.aten" for o in model.opset_import):
            model.opset_import.append(helper.make_opsetid("org.pytorch.aten", 1))
        graph.value_info.append(helper.make_empty_tensor_value_info(read))
        graph.value_info[-1].type.tensor_type.elem_type = onnx.TensorProto.FLOAT

    return _plant_for(engine, plant)


def batchnorm_momentum(module: str, momentum: float, engine: str | None = None) -> pipeline.Plant:
    """A plant giving the BatchNormalization node of the torch module `module` the momentum `momentum`."""

    def plant(model: onnx.ModelProto, plan: GraphPlan, work: GraphWork) -> None:
        mean = f"{module}.running_mean"
        nodes = [
            n
            for n in model.graph.node
            if n.op_type == "BatchNormalization" and any(i == mean or i.endswith("." + mean) for i in n.input)
        ]
        if len(nodes) != 1:
            raise AssertionError(f"BatchNorm {module!r}: {len(nodes)} BatchNormalization nodes read {mean}")
        attributes = {a.name: a for a in nodes[0].attribute}
        if "momentum" in attributes:
            attributes["momentum"].f = momentum
        else:
            nodes[0].attribute.append(helper.make_attribute("momentum", momentum))

    return _plant_for(engine, plant)


def combined(*plants: pipeline.Plant) -> pipeline.Plant:
    """Several plants as one (each on the graph in turn)."""

    def plant(model: onnx.ModelProto, plan: GraphPlan, work: GraphWork) -> None:
        for each in plants:
            each(model, plan, work)

    return plant
