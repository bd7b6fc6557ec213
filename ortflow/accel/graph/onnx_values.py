"""What a graph's values are: their types and shapes as ONNX shape inference knows them, and who reads them."""

from typing import Any

import numpy as np
import onnx
from onnx import helper, numpy_helper


def value_types(model: onnx.ModelProto) -> dict[str, onnx.TypeProto]:
    """Every value's inferred type (ONNX shape inference; exported training graphs have static shapes)."""
    inferred = onnx.shape_inference.infer_shapes(model)
    graph = inferred.graph
    return {v.name: v.type for v in (*graph.input, *graph.value_info, *graph.output)}


def typed_names(graph: onnx.GraphProto) -> set[str]:
    """The values whose element type the graph already declares (inputs, value_info, outputs)."""
    return {v.name for v in (*graph.input, *graph.value_info, *graph.output) if v.type.tensor_type.elem_type}


def declare_type(graph: onnx.GraphProto, name: str, type_: onnx.TypeProto) -> None:
    """Declare value `name`'s type in the graph's value_info (ORT cannot infer an ATen node's output type)."""
    graph.value_info.append(helper.make_empty_tensor_value_info(name))
    graph.value_info[-1].type.CopyFrom(type_)


def attribute(node: onnx.NodeProto, name: str, default: Any = None) -> Any:
    """A node's attribute `name` as a Python value (ints, floats, bytes, lists, tensors), or `default` if absent."""
    found = next((a for a in node.attribute if a.name == name), None)
    return default if found is None else helper.get_attribute_value(found)


def constants(graph: onnx.GraphProto) -> dict[str, onnx.TensorProto]:
    """The graph's constants by name, as stored (nothing converted): its initializers and its Constant nodes' `value`
    tensors."""
    found = {init.name: init for init in graph.initializer}
    for node in graph.node:
        if node.op_type == "Constant" and (value := attribute(node, "value")) is not None:
            found[node.output[0]] = value
    return found


def constant_values(graph: onnx.GraphProto) -> dict[str, np.ndarray]:
    """`constants`, each as a numpy array."""
    return {name: numpy_helper.to_array(tensor) for name, tensor in constants(graph).items()}


def readers(graph: onnx.GraphProto) -> dict[str, int]:
    """How many times each value is read: as a node's input, or as a graph output."""
    count: dict[str, int] = {}
    for node in graph.node:
        for name in node.input:
            count[name] = count.get(name, 0) + 1
    for out in graph.output:
        count[out.name] = count.get(out.name, 0) + 1
    return count


def replace_nodes(graph: onnx.GraphProto, replacements: dict[str, list[onnx.NodeProto]], dropped: set[str]) -> None:
    """Rewrite the graph's node list in place, keeping its order: a node whose first output is a key of
    `replacements` becomes those nodes, one whose first output is in `dropped` goes."""
    kept: list[onnx.NodeProto] = []
    for node in graph.node:
        first = node.output[0] if node.output else None
        if first in replacements:
            kept.extend(replacements[first])
        elif first not in dropped:
            kept.append(node)
    del graph.node[:]
    graph.node.extend(kept)
