"""The one registry of the `org.pytorch.aten::ATen` operators ortflow exports: operators torch runs inside ORT's
graphs, each declared by the module of its graph-plan op (accel/graph/plan.py) with its gradient and shape rule
(`AtenOp`): convolutions (aten_conv.py), LayerNorm (aten_layer_norm.py), bf16 matrix multiplies (aten_gemm.py),
GELU's tanh approximation (aten_gelu.py), the cross-entropy loss and its fusion with the LM head's GEMM
(aten_cross_entropy.py) and upsampling (aten_upsample.py); and what ORT's graphs need around them.

The graph plan's portable target takes none of them: every op has an ORT-native path there, or is refused. A graph
holding any of them runs only where torch and the ATen executor extension are loaded: the engines count them
(`count_all`) to load the executor and turn ORT's spin-waiting off.

Each such forward operator takes, as one of its inputs, a boolean mask of which of its tensor inputs need a gradient:
its gradient node (which receives the forward node's inputs) then computes only those, since ORT leaves a gradient
nobody needs unconnected and refuses an operator that returns it anyway. ORT's gradient builder leaves the gradient
nodes' outputs untyped, and its type inference cannot type a custom operator's outputs: ortflow declares them.
"""

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import onnx

from ortflow.accel.compat import ort
from ortflow.accel.graph.onnx_values import attribute


@dataclass(frozen=True)
class AtenOp:
    forward: str  # the forward node's `operator` attribute
    backward: str  # its gradient node's
    differentiable: tuple[int, ...]  # the forward node's tensor inputs that may get a gradient, in mask order
    mask_input: int | None  # the forward node's input holding that mask; None: the operator takes none
    # ORT's gradient definition (format of onnxruntime's _custom_gradient_registry); None: ORTModule's registry has it
    gradient: Callable[[], list[tuple]] | None
    fix_name: str  # how its nodes are counted among an engine's graph fixes (run.json, the engine's describe())
    overload: str = ""  # the forward node's `overload_name`
    # The forward node's input whose being a frozen parameter is appended to the mask (one more boolean after the
    # gradients'): the operator may then reuse a copy of it from step to step (accel/graph/bf16_weights.py). None: no
    # such flag.
    frozen_input: int | None = None
    # The forward node's input that may arrive in bf16 (accel/graph/bf16_edges.py): one more boolean after the others
    # says whether it does, and the gradient node then returns that input's gradient in bf16. None: always fp32.
    bf16_input: int | None = None
    # Its output shapes for ORT's symbolic shape inference (ORTModule), as `handler(inference, node)`
    # (accel/graph/aten_shapes.py); None: ORT's own rule, or the node never reaches that inference.
    shape: Callable[[Any, Any], None] | None = None
    # The gradient node's inputs as declared (GO(k), I(k), O(k)): a gradient output whose forward input the gradient
    # node reads gets that input's type (type_gradient_outputs).
    gradient_inputs: tuple[str, ...] = ()


OPS: dict[str, AtenOp] = {}


def one_node_gradient(backward: str, inputs: list[str], gradients: int = 3) -> Callable[[], list[tuple]]:
    """The gradient definition ortflow's operators share: one ATen node running `backward` on `inputs` (GO(0), I(k),
    O(k): see onnxruntime's _custom_gradient_registry.py), returning the gradients of the first `gradients` inputs."""
    node = (("ATen", "org.pytorch.aten"), inputs, [f"GI({i})" for i in range(gradients)])
    return lambda: [(*node, {"operator": {"value": backward, "dtype": "string"}})]


def import_domain(model: onnx.ModelProto) -> None:
    """Have the model's opset imports name the ATen nodes' domain (once), after a rewrite wrote such nodes."""
    if not any(o.domain == "org.pytorch.aten" for o in model.opset_import):
        model.opset_import.append(onnx.helper.make_opsetid("org.pytorch.aten", 1))


def register(op: AtenOp) -> None:
    OPS[op.forward] = op


def declare(
    forward: str,
    backward: str,
    gradient_inputs: list[str] | None,
    *,
    differentiable: tuple[int, ...],
    mask_input: int | None,
    fix_name: str,
    gradients: int = 3,
    **optional: Any,
) -> AtenOp:
    """Register one of ortflow's operators, the way every op module declares its own: `forward` runs in an ATen node,
    and its gradient is one ATen node running `backward` on `gradient_inputs` (one_node_gradient; None: ORTModule's
    registry has it), returning the gradients of the first `gradients` inputs. `optional`: AtenOp's other fields
    (overload, frozen_input, bf16_input, shape)."""
    gradient = None if gradient_inputs is None else one_node_gradient(backward, gradient_inputs, gradients)
    inputs = tuple(gradient_inputs or ())
    op = AtenOp(forward, backward, differentiable, mask_input, gradient, fix_name, gradient_inputs=inputs, **optional)
    register(op)
    return op


def register_gradients() -> None:
    """Give ORT the gradient of every registered operator (once per process; ORTModule publishes its registry when it
    is built, the artifacts engine before generate_artifacts). Imports ORTModule (the torch patches first)."""
    for op in OPS.values():
        if op.gradient is not None:
            ort.register_ort_gradient(op.forward, op.overload, op.gradient)


def make_node(operator: str, inputs: list[str], outputs: list[str], name: str) -> onnx.NodeProto:
    """An `org.pytorch.aten::ATen` node running `operator` (the export's form: no overload name)."""
    return onnx.helper.make_node(
        "ATen", inputs, outputs, name=name, domain="org.pytorch.aten", operator=operator, overload_name=""
    )


def set_operator(node: onnx.NodeProto, name: str) -> None:
    """Make an ATen node run the operator `name` instead."""
    for found in node.attribute:
        if found.name == "operator":
            found.s = name.encode()


def follows_torch(model: onnx.ModelProto, setting: bool | None) -> bool:
    """Whether an op whose setting is null-by-default takes torch's kernels in this graph: where the setting says so,
    and for null only where the graph already runs torch's kernels (ORT's threads then do not spin-wait anyway; a
    torch-kernel node alone would turn spinning off)."""
    return setting is not None or bool(count_all(model))


def operator(node: onnx.NodeProto) -> str | None:
    """The `operator` an ATen node runs (None for any other node)."""
    if node.op_type != "ATen":
        return None
    found = attribute(node, "operator")
    return None if found is None else found.decode()


def count_all(model: onnx.ModelProto) -> dict[str, int]:
    """How many nodes of an exported graph run each registered operator (those present only)."""
    counts: dict[str, int] = {}
    for node in model.graph.node:
        if (name := operator(node)) in OPS:
            counts[name] = counts.get(name, 0) + 1
    return counts


def graph_fixes(counts: dict[str, int]) -> dict[str, int]:
    """`count_all`'s counts under their graph-fix names."""
    fixes: dict[str, int] = {}
    for name, n in counts.items():
        fixes[OPS[name].fix_name] = fixes.get(OPS[name].fix_name, 0) + n
    return fixes


def set_gradient_masks(model: onnx.ModelProto, trainable: set[str], frozen: set[str] = frozenset()) -> None:
    """Give every registered ATen node of an exported graph the mask of the gradients it must compute: whether each
    of its differentiable inputs depends on a trainable parameter (`trainable`: their graph names). An image fed to
    the first convolution, or a frozen layer's weight, gets no gradient. An operator with a `frozen_input` gets one
    more boolean: whether that input is one of the frozen parameters `frozen` (their graph names); one with a
    `bf16_input`, one more: whether that input is typed bf16 in the graph."""
    graph = model.graph
    types = _elem_types(graph)
    reached = set(trainable)
    for node in graph.node:  # nodes are in execution order
        if any(name in reached for name in node.input):
            reached.update(name for name in node.output if name)
    kept = []
    for node in graph.node:
        if (op := OPS.get(operator(node) or "")) is not None and op.mask_input is not None:
            mask = [len(node.input) > i and node.input[i] in reached for i in op.differentiable]
            if op.frozen_input is not None:
                mask.append(node.input[op.frozen_input] in frozen)
            if op.bf16_input is not None:
                mask.append(types.get(node.input[op.bf16_input]) == onnx.TensorProto.BFLOAT16)
            name = f"{node.name or node.output[0]}/output_mask"
            kept.append(
                onnx.helper.make_node("Constant", [], [name], value=onnx.numpy_helper.from_array(np.array(mask)))
            )
            node.input[op.mask_input] = name
        kept.append(node)
    del graph.node[:]
    graph.node.extend(kept)


def _elem_types(graph: onnx.GraphProto) -> dict[str, int]:
    typed = {v.name: v.type.tensor_type.elem_type for v in (*graph.input, *graph.value_info, *graph.output)}
    return typed | {i.name: i.data_type for i in graph.initializer}


def type_gradient_outputs(model: onnx.ModelProto) -> int:
    """Declare the types of the registered gradient nodes' outputs in a training graph: each the type of the forward
    input it is the gradient of (read by the gradient node itself, or found through the forward outputs it reads),
    else that of the gradient it receives (its first input). Returns how many it declared."""
    graph = model.graph
    backward = {op.backward: op for op in OPS.values()}
    typed = _elem_types(graph)
    forward_of = {name: node for node in graph.node if operator(node) in OPS for name in node.output if name}
    declared = 0
    for node in graph.node:
        op = backward.get(operator(node) or "")
        if op is None:
            continue
        source = next((forward_of[name] for name in node.input[1:] if name in forward_of), None)
        incoming = typed.get(node.input[0]) or onnx.TensorProto.FLOAT
        for k, name in enumerate(node.output):
            if not name or typed.get(name):
                continue
            elem = incoming
            read = f"I({op.differentiable[k]})" if k < len(op.differentiable) else None
            at = op.gradient_inputs.index(read) if read in op.gradient_inputs else len(node.input)
            if at < len(node.input):  # the gradient node reads that forward input itself
                elem = typed.get(node.input[at]) or incoming
            elif source is not None and operator(source) == op.forward and k < len(op.differentiable):
                elem = typed.get(source.input[op.differentiable[k]]) or incoming
            graph.value_info.append(onnx.helper.make_empty_tensor_value_info(name))
            graph.value_info[-1].type.tensor_type.elem_type = elem
            typed[name] = elem
            declared += 1
    return declared
