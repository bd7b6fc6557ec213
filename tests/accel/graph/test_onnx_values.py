"""A graph's value types come from shape inference on the graph without its weights' data: the same types, and the
model itself untouched."""

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from ortflow.accel.graph.onnx_values import ASIDE_BYTES, value_types, without_weights


def _model() -> onnx.ModelProto:
    rows = ASIDE_BYTES // 4 // 64 + 2  # a float weight just over the size whose data is left out (an even width)
    weight = numpy_helper.from_array(np.ones((64, rows), np.float32), "w")
    shape = numpy_helper.from_array(np.array([-1, 2, rows // 2], np.int64), "shape")  # data shape inference reads
    bias = numpy_helper.from_array(np.ones(rows, np.float32), "b")  # small: kept
    nodes = [
        helper.make_node("MatMul", ["x", "w"], ["y"]),
        helper.make_node("Add", ["y", "b"], ["z"]),
        helper.make_node("Reshape", ["z", "shape"], ["out"]),
    ]
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [8, 64])
    out = helper.make_tensor_value_info("out", TensorProto.FLOAT, None)
    graph = helper.make_graph(nodes, "g", [x], [out], [weight, shape, bias])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_value_types_match_full_shape_inference_without_copying_the_weights():
    model = _model()
    before = model.SerializeToString()
    light = without_weights(model)
    kept = {i.name: i.HasField("raw_data") for i in light.graph.initializer}
    assert kept == {"w": False, "shape": True, "b": True}
    assert light.ByteSize() < model.ByteSize() - ASIDE_BYTES
    full = onnx.shape_inference.infer_shapes(model).graph
    expected = {v.name: v.type for v in (*full.input, *full.value_info, *full.output)}
    types = value_types(model)
    assert types == expected and types["out"].tensor_type.shape.dim[2].dim_value == (ASIDE_BYTES // 4 // 64 + 2) // 2
    assert model.SerializeToString() == before  # the model's own weights are where they were
