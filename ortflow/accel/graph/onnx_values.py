"""What a graph's values are: their types and shapes as ONNX shape inference knows them, and who reads them."""

import math
from typing import Any

import numpy as np
import onnx
from onnx import helper, numpy_helper

# Float initializers of at least this many bytes lose their data while a graph is copied for shape inference (their
# type and dims are all it reads); smaller ones, and every integer tensor (a Reshape's shape), keep it.
ASIDE_BYTES = 1 << 16
_FLOAT_BYTES = {
    onnx.TensorProto.FLOAT: 4,
    onnx.TensorProto.DOUBLE: 8,
    onnx.TensorProto.FLOAT16: 2,
    onnx.TensorProto.BFLOAT16: 2,
}


def without_weights(model: onnx.ModelProto) -> onnx.ModelProto:
    """A copy of the model for shape inference: its large float initializers keep their type and dims, not their data.

    Why: shape inference serialises the whole model, parses it back and returns a copy. For a model whose weights
    are 1.4 GB (the 359M-parameter LoRA shape in docs/performance.md) that was ~4 GB more resident memory at each
    rewrite that asks for the graph's types, the build's peak. Without the data a copy is the graph alone."""
    light = onnx.ModelProto()
    light.ir_version = model.ir_version
    light.opset_import.extend(model.opset_import)
    light.functions.extend(model.functions)
    source, graph = model.graph, light.graph
    graph.name = source.name
    for field in ("node", "input", "output", "value_info"):
        getattr(graph, field).extend(getattr(source, field))
    for init in source.initializer:
        if _FLOAT_BYTES.get(init.data_type, 0) * math.prod(init.dims) < ASIDE_BYTES:
            graph.initializer.append(init)
        else:
            light_init = graph.initializer.add()
            light_init.name, light_init.data_type = init.name, init.data_type
            light_init.dims.extend(init.dims)
    return light


def value_types(model: onnx.ModelProto) -> dict[str, onnx.TypeProto]:
    """Every value's inferred type (ONNX shape inference; exported training graphs have static shapes)."""
    graph = onnx.shape_inference.infer_shapes(without_weights(model)).graph
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


def reader_nodes(graph: onnx.GraphProto) -> dict[str, list[onnx.NodeProto | None]]:
    """Who reads each value: the nodes taking it as an input, and None for each time it is a graph output."""
    found: dict[str, list[onnx.NodeProto | None]] = {}
    for node in graph.node:
        for name in node.input:
            found.setdefault(name, []).append(node)
    for value in graph.output:
        found.setdefault(value.name, []).append(None)
    return found


def data_readers(readers: dict[str, list[onnx.NodeProto | None]], name: str) -> list[onnx.NodeProto | None]:
    """The readers of `name` (from `reader_nodes`) that read its data: every one but Shape nodes, which read only its
    dims (ORTModule's exports read a view's sizes so)."""
    return [n for n in readers.get(name, []) if n is None or n.op_type != "Shape"]


def place_before(graph: onnx.GraphProto, before: dict[int, list[onnx.NodeProto]], dropped: set[int]) -> None:
    """Rewrite the graph's node list in place, keeping its order: the nodes `before[id(node)]` go just before `node`,
    and the nodes whose id is in `dropped` go."""
    kept: list[onnx.NodeProto] = []
    for node in graph.node:
        kept += before.get(id(node), [])
        if id(node) not in dropped:
            kept.append(node)
    del graph.node[:]
    graph.node.extend(kept)


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
