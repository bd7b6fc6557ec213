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


aten_nodes.declare(
    OPERATOR,
    BACKWARD,
    ["GO(0)", "I(0)"],
    gradients=1,
    differentiable=(0,),
    mask_input=None,
    fix_name="gelus_run_by_torch",
    shape=aten_shapes.same_shape,
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


class _Formula:
    """The exported graph as the GELU formula's matcher reads it: constants, who produces and who reads each value."""

    def __init__(self, graph: onnx.GraphProto) -> None:
        self.scalars = _scalars(graph)
        self.producer = {out: node for node in graph.node for out in node.output}
        self.reads = onnx_values.readers(graph)
        self.consumers: dict[str, list[onnx.NodeProto]] = {}
        for node in graph.node:
            for name in node.input:
                self.consumers.setdefault(name, []).append(node)

    def near(self, name: str, which: str) -> bool:
        return name in self.scalars and math.isclose(self.scalars[name], _CONSTANTS[which], rel_tol=1e-5)

    def split(self, node: onnx.NodeProto | None, op: str, which: str) -> str | None:
        """The other operand of a binary `op` node with the constant `which` as one operand (None: no match)."""
        if node is None or node.op_type != op or len(node.input) != 2:
            return None
        a, b = node.input
        return a if self.near(b, which) else b if self.near(a, which) else None

    def only_read_once(self, *nodes: onnx.NodeProto) -> bool:
        return all(self.reads.get(node.output[0], 0) == 1 for node in nodes)

    def _cubic(self, inner: onnx.NodeProto) -> tuple[str, tuple[onnx.NodeProto, onnx.NodeProto]] | None:
        """x and the nodes of `Mul(Pow(x, 3), 0.044715)`, where `inner` is `Add(x, that)` in either order."""
        found = None
        for first, second in (inner.input, inner.input[::-1]):
            cube_term = self.producer.get(second)
            power_name = self.split(cube_term, "Mul", "coefficient")
            power = self.producer.get(power_name) if power_name else None
            cube = power is not None and power.op_type == "Pow" and self.near(power.input[1], "cube")
            if power is not None and cube and power.input[0] == first:
                found = first, (cube_term, power)
        return found

    def match(self, tanh: onnx.NodeProto) -> tuple[str, list[onnx.NodeProto], onnx.NodeProto] | None:
        """x, the formula's nodes before the final Mul, and that Mul, for the GELU around `tanh` (None: no GELU)."""
        scaled = self.producer.get(tanh.input[0])
        inner_name = self.split(scaled, "Mul", "scale")
        inner = self.producer.get(inner_name) if inner_name else None
        if inner is None or inner.op_type != "Add" or scaled is None:
            return None
        cubic = self._cubic(inner)
        if cubic is None or len(self.consumers.get(tanh.output[0], [])) != 1:
            return None
        x = cubic[0]
        plus_one = self.consumers[tanh.output[0]][0]
        if self.split(plus_one, "Add", "one") != tanh.output[0] or len(self.consumers.get(plus_one.output[0], [])) != 1:
            return None
        final = self.consumers[plus_one.output[0]][0]
        if final.op_type != "Mul":
            return None
        half_name = final.input[1] if final.input[0] == plus_one.output[0] else final.input[0]
        half = self.producer.get(half_name)
        if self.split(half, "Mul", "half") != x or half is None:
            return None
        pattern = [cubic[1][1], cubic[1][0], inner, scaled, tanh, plus_one, half]
        return (x, pattern, final) if self.only_read_once(*pattern) else None


def tanh_gelus_to_aten(model: onnx.ModelProto) -> int:
    """Replace each exported tanh-approximated GELU, `Mul(Mul(x, 0.5), Add(Tanh(Mul(Add(x, Mul(Pow(x, 3), 0.044715)),
    sqrt(2/pi))), 1))` with the operands of each Mul and Add in either order, whose intermediate values nothing else
    reads, by one ATen node running `ortflow::gelu_tanh(x)`. Returns how many it replaced."""
    graph = model.graph
    formula = _Formula(graph)
    replaced: dict[str, onnx.NodeProto] = {}  # the final Mul's output -> its ATen node
    dropped: set[str] = set()  # the formula's nodes, by their (unique) output
    for tanh in (n for n in graph.node if n.op_type == "Tanh"):
        found = formula.match(tanh)
        if found is None:
            continue
        x, pattern, final = found
        replaced[final.output[0]] = aten_nodes.make_node(
            OPERATOR, [x], [final.output[0]], f"{final.name or final.output[0]}/gelu_tanh"
        )
        dropped.update(n.output[0] for n in (*pattern, final))
    if not replaced:
        return 0
    onnx_values.replace_nodes(graph, {out: [node] for out, node in replaced.items()}, dropped)
    aten_nodes.import_domain(model)
    _type_as_inputs(graph, replaced)
    return len(replaced)


def _type_as_inputs(graph: onnx.GraphProto, replaced: dict[str, onnx.NodeProto]) -> None:
    """ORT cannot infer an ATen node's output type: each output is typed as its input (the graph's floats)."""
    typed = {v.name: v for v in (*graph.input, *graph.value_info, *graph.output)}
    for out, node in replaced.items():
        if out in typed and typed[out].type.tensor_type.elem_type:
            continue
        source = typed.get(node.input[0])
        elem = source.type.tensor_type.elem_type if source is not None else 0
        graph.value_info.append(helper.make_empty_tensor_value_info(out))
        graph.value_info[-1].type.tensor_type.elem_type = elem or onnx.TensorProto.FLOAT


def _rewrite(model: onnx.ModelProto, plan: graph_plan.GraphPlan, work: graph_plan.GraphWork) -> None:
    if plan.by_torch(NAME):  # its nodes are counted with the other ATen nodes (aten_nodes.graph_fixes)
        tanh_gelus_to_aten(model)


NAME = "gelu"
OP = graph_plan.torch_or_ort(
    NAME,
    replaces="GELU's tanh approximation (ORT fuses its formula into FastGelu, whose gradient is FastGeluGrad)",
    module=__name__,
    setting="aten_gelu",
    rewrite=_rewrite,
)
