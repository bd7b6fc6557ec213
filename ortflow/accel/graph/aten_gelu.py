"""GELU's tanh approximation run by torch's kernels inside ONNX Runtime's graphs (`trainer.precision=bf16-mixed`).

Why: ORT fuses the exported formula `0.5 * x * (1 + tanh(sqrt(2/pi) * (x + 0.044715 * x^3)))` (GPT-2's `gelu_new`,
`nn.GELU(approximate="tanh")`) into FastGelu, whose CPU gradient FastGeluGrad is a slow kernel: on a (1024, 3072)
fp32 tensor, 105 ms a call against 4-10 ms for torch's `gelu_backward` (2-core Zen 5, one process, interleaved). On the
GPT-2-shaped LoRA model of docs/finetune.md (6 layers) that was about 0.6 s of every ORT step in bf16-mixed, more than
the whole gap to eager. As with the other torch-kernel nodes (accel/graph/aten_nodes.py), an `org.pytorch.aten::ATen`
node hands the operator to torch through the ATen executor.

How: `tanh_gelus_to_aten` finds the formula in the exported ONNX graph (before ORT fuses it) and replaces it with one
ATen node running `ortflow::gelu_tanh` (torch's `gelu(approximate="tanh")`, in fp32 like ORT's FastGelu); its gradient
is one ATen node running `ortflow::gelu_tanh_backward` (torch's `gelu_backward`). Only in bf16-mixed, where torch's
kernels already run in the graph: with trainer.precision=fp32 the graph stays ORT's own.
"""

import math

import numpy as np
import onnx
import torch
from onnx import helper, numpy_helper

from ortflow.accel.graph import aten_nodes, aten_shapes, onnx_values
from ortflow.accel.graph import plan as graph_plan

OPERATOR = "ortflow::gelu_tanh"
BACKWARD = "ortflow::gelu_tanh_backward"

_LIBRARY = torch.library.Library("ortflow", "FRAGMENT")
_LIBRARY.define("gelu_tanh(Tensor x) -> Tensor")
_LIBRARY.define("gelu_tanh_backward(Tensor grad_output, Tensor x) -> Tensor")


def _gelu(x: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.gelu(x, approximate="tanh")


def _gelu_backward(grad_output: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return torch.ops.aten.gelu_backward(grad_output, x, approximate="tanh")


_LIBRARY.impl("gelu_tanh", _gelu, "CPU")
_LIBRARY.impl("gelu_tanh_backward", _gelu_backward, "CPU")


_gradient = aten_nodes.one_node_gradient(BACKWARD, ["GO(0)", "I(0)"], gradients=1)


aten_nodes.register(
    aten_nodes.AtenOp(
        OPERATOR,
        BACKWARD,
        differentiable=(0,),
        mask_input=None,
        gradient=_gradient,
        fix_name="gelus_run_by_torch",
        shape=aten_shapes.same_shape,
    )
)

_CONSTANTS = {"cube": 3.0, "coefficient": 0.044715, "scale": math.sqrt(2.0 / math.pi), "one": 1.0, "half": 0.5}


def _scalars(graph: onnx.GraphProto) -> dict[str, float]:
    """The graph's scalar float constants (Constant nodes and initializers holding one value) by name."""
    found: dict[str, float] = {}
    constants = (n for n in graph.node if n.op_type == "Constant")
    tensors = [(n.output[0], a.t) for n in constants for a in n.attribute if a.name == "value"]
    tensors += [(i.name, i) for i in graph.initializer]
    for name, tensor in tensors:
        value = numpy_helper.to_array(tensor)
        if value.size == 1 and np.issubdtype(value.dtype, np.floating):
            found[name] = float(value.reshape(()))
    return found


def tanh_gelus_to_aten(model: onnx.ModelProto) -> int:
    """Replace each exported tanh-approximated GELU, `Mul(Mul(x, 0.5), Add(Tanh(Mul(Add(x, Mul(Pow(x, 3), 0.044715)),
    sqrt(2/pi))), 1))` with the operands of each Mul and Add in either order, whose intermediate values nothing else
    reads, by one ATen node running `ortflow::gelu_tanh(x)`. Returns how many it replaced."""
    graph = model.graph
    scalars = _scalars(graph)
    producer = {out: node for node in graph.node for out in node.output}
    reads = onnx_values.readers(graph)

    def near(name: str, which: str) -> bool:
        return name in scalars and math.isclose(scalars[name], _CONSTANTS[which], rel_tol=1e-5)

    def split(node: onnx.NodeProto | None, op: str, which: str) -> str | None:
        """The other operand of a binary `op` node with the constant `which` as one operand (None: no match)."""
        if node is None or node.op_type != op or len(node.input) != 2:
            return None
        a, b = node.input
        return a if near(b, which) else b if near(a, which) else None

    def only_read_once(*nodes: onnx.NodeProto) -> bool:
        return all(reads.get(node.output[0], 0) == 1 for node in nodes)

    replaced: dict[str, onnx.NodeProto] = {}  # the final Mul's output -> its ATen node
    dropped: set[str] = set()  # the formula's nodes, by their (unique) output
    consumers: dict[str, list[onnx.NodeProto]] = {}
    for node in graph.node:
        for name in node.input:
            consumers.setdefault(name, []).append(node)
    for tanh in (n for n in graph.node if n.op_type == "Tanh"):
        scaled = producer.get(tanh.input[0])
        inner_name = split(scaled, "Mul", "scale")
        inner = producer.get(inner_name) if inner_name else None
        if inner is None or inner.op_type != "Add" or scaled is None:
            continue
        x = cubic = None
        for first, second in (inner.input, inner.input[::-1]):
            cube_term = producer.get(second)
            power_name = split(cube_term, "Mul", "coefficient")
            power = producer.get(power_name) if power_name else None
            cube = power is not None and power.op_type == "Pow" and near(power.input[1], "cube")
            if power is not None and cube and power.input[0] == first:
                x, cubic = first, (cube_term, power)
        if x is None or cubic is None or len(consumers.get(tanh.output[0], [])) != 1:
            continue
        plus_one = consumers[tanh.output[0]][0]
        if split(plus_one, "Add", "one") != tanh.output[0] or len(consumers.get(plus_one.output[0], [])) != 1:
            continue
        final = consumers[plus_one.output[0]][0]
        if final.op_type != "Mul":
            continue
        half_name = final.input[1] if final.input[0] == plus_one.output[0] else final.input[0]
        half = producer.get(half_name)
        if split(half, "Mul", "half") != x or half is None:
            continue
        pattern = [cubic[1], cubic[0], inner, scaled, tanh, plus_one, half]
        if not only_read_once(*pattern):
            continue
        replaced[final.output[0]] = helper.make_node(
            "ATen",
            [x],
            [final.output[0]],
            name=f"{final.name or final.output[0]}/gelu_tanh",
            domain="org.pytorch.aten",
            operator=OPERATOR,
            overload_name="",
        )
        dropped.update(n.output[0] for n in (*pattern, final))
    if not replaced:
        return 0
    onnx_values.replace_nodes(graph, {out: [node] for out, node in replaced.items()}, dropped)
    aten_nodes.import_domain(model)
    # ORT cannot infer an ATen node's output type: each output is typed as its input (the graph's floats)
    typed = {v.name: v for v in (*graph.input, *graph.value_info, *graph.output)}
    for out, node in replaced.items():
        if out in typed and typed[out].type.tensor_type.elem_type:
            continue
        source = typed.get(node.input[0])
        elem = source.type.tensor_type.elem_type if source is not None else 0
        graph.value_info.append(helper.make_empty_tensor_value_info(out))
        graph.value_info[-1].type.tensor_type.elem_type = elem or onnx.TensorProto.FLOAT
    return len(replaced)


def _rewrite(model: onnx.ModelProto, plan: graph_plan.GraphPlan, work: graph_plan.GraphWork) -> None:
    if plan.by_torch(NAME):  # its nodes are counted with the other ATen nodes (aten_nodes.graph_fixes)
        tanh_gelus_to_aten(model)


NAME = "gelu"
OP = graph_plan.declare(
    graph_plan.GraphOp(
        NAME,
        replaces="GELU's tanh approximation (ORT fuses its formula into FastGelu, whose gradient is FastGeluGrad)",
        module=__name__,
        paths=(graph_plan.Path.torch, graph_plan.Path.ort),
        choose=lambda settings, precision, engine: (
            graph_plan.Path.torch if graph_plan.switch(settings, "aten_gelu", precision) else graph_plan.Path.ort
        ),
        setting="aten_gelu",
        rewrite=_rewrite,
    )
)
