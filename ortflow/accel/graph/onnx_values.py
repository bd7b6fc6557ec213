"""What ONNX shape inference knows of a graph's values, for the graph rewrites."""

import onnx


def value_types(model: onnx.ModelProto) -> dict[str, onnx.TypeProto]:
    """Every value's inferred type (ONNX shape inference; exported training graphs have static shapes)."""
    inferred = onnx.shape_inference.infer_shapes(model)
    graph = inferred.graph
    return {v.name: v.type for v in (*graph.input, *graph.value_info, *graph.output)}
