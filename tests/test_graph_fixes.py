"""The ONNX graph fixes ortflow applies before ORT builds gradients keep the forward result unchanged."""

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

from ortflow.accel.compat import add_dropout_masks, constant_gathers_to_slices


def run(model: onnx.ModelProto, feeds: dict) -> list:
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)


def gather_model() -> onnx.ModelProto:
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [3, 4, 5])
    shapes = {"first": [4, 5], "last": [4, 5], "mid": [3, 5]}
    outs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, shape) for n, shape in shapes.items()]
    dims = helper.make_tensor_value_info("dim0", TensorProto.INT64, [])
    nodes = [
        helper.make_node("Constant", [], ["i0"], value=numpy_helper.from_array(np.array(0, dtype=np.int64))),
        helper.make_node("Constant", [], ["i_last"], value=numpy_helper.from_array(np.array(-1, dtype=np.int64))),
        helper.make_node("Constant", [], ["i2"], value=numpy_helper.from_array(np.array(2, dtype=np.int64))),
        helper.make_node("Gather", ["x", "i0"], ["first"], axis=0),
        helper.make_node("Gather", ["x", "i_last"], ["last"], axis=0),
        helper.make_node("Gather", ["x", "i2"], ["mid"], axis=1),
        helper.make_node("Shape", ["x"], ["shape"]),
        helper.make_node("Gather", ["shape", "i0"], ["dim0"]),
    ]
    graph = helper.make_graph(nodes, "g", [x], [*outs, dims])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 16)])


def test_constant_gathers_become_slices_with_identical_results():
    model = gather_model()
    x = np.random.default_rng(0).standard_normal((3, 4, 5)).astype(np.float32)
    expected = run(model, {"x": x})
    assert constant_gathers_to_slices(model) == 3  # the Shape -> Gather stays
    onnx.checker.check_model(model)
    ops = [n.op_type for n in model.graph.node]
    assert ops.count("Gather") == 1 and ops.count("Slice") == 3
    for got, want in zip(run(model, {"x": x}), expected, strict=True):
        np.testing.assert_array_equal(got, want)


def test_dropout_gets_its_mask_output_and_the_same_forward():
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 8])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 8])
    graph = helper.make_graph([helper.make_node("Dropout", ["x"], ["y"], name="drop")], "g", [x], [y])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 16)])
    feeds = {"x": np.ones((2, 8), np.float32)}
    expected = run(model, feeds)
    assert add_dropout_masks(model) == 1 and add_dropout_masks(model) == 0
    assert list(model.graph.node[0].output) == ["y", "drop_mask"]
    np.testing.assert_array_equal(run(model, feeds)[0], expected[0])  # inference-mode dropout is identity
