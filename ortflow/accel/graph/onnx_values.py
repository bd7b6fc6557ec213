"""What a graph's values are: their types and shapes as ONNX shape inference knows them, and who reads them."""

import onnx


def value_types(model: onnx.ModelProto) -> dict[str, onnx.TypeProto]:
    """Every value's inferred type (ONNX shape inference; exported training graphs have static shapes)."""
    inferred = onnx.shape_inference.infer_shapes(model)
    graph = inferred.graph
    return {v.name: v.type for v in (*graph.input, *graph.value_info, *graph.output)}


def readers(graph: onnx.GraphProto) -> dict[str, int]:
    """How many times each value is read: as a node's input, or as a graph output."""
    count: dict[str, int] = {}
    for node in graph.node:
        for name in node.input:
            count[name] = count.get(name, 0) + 1
    for out in graph.output:
        count[out.name] = count.get(out.name, 0) + 1
    return count
