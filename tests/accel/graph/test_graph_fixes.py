"""The ONNX graph fixes and speed rewrites ortflow applies before ORT builds gradients keep the forward result and
the gradients unchanged; the dropout masks the engine draws keep dropout's distribution."""

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper

from ortflow.accel.compat import export_warnings
from ortflow.accel.graph import masks as masks_module
from ortflow.accel.graph.masks import DropoutMask, MaskSampler, draw_masks
from ortflow.accel.graph.rewrites import (
    add_dropout_masks,
    attention_dropout_in_training_mode,
    constant_gathers_to_slices,
    dropout_to_mask_inputs,
    packed_projections_to_splits,
    relu_to_mask_mul,
    small_embeddings_to_onehot_matmul,
)


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


def one_node_model(node: onnx.NodeProto, inputs, outputs, initializers=()) -> onnx.ModelProto:
    graph = helper.make_graph([node], "g", inputs, outputs, initializer=list(initializers))
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 16)])


def test_relu_becomes_a_mask_multiply_with_identical_results():
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 50])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, 50])
    model = one_node_model(helper.make_node("Relu", ["x"], ["y"]), [x], [y])
    feeds = {"x": np.random.default_rng(0).standard_normal((4, 50)).astype(np.float32)}
    feeds["x"][0, :10] = 0.0  # relu's kink
    expected = run(model, feeds)
    assert relu_to_mask_mul(model) == 1
    onnx.checker.check_model(model)
    assert "Relu" not in [n.op_type for n in model.graph.node]
    np.testing.assert_array_equal(run(model, feeds)[0], expected[0])


def test_a_small_embedding_becomes_a_onehot_matmul_with_identical_results():
    weight = np.random.default_rng(1).standard_normal((10, 6)).astype(np.float32)
    ids = helper.make_tensor_value_info("ids", TensorProto.INT64, [3, 5])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [3, 5, 6])
    node = helper.make_node("Gather", ["weight", "ids"], ["y"])
    model = one_node_model(node, [ids], [y], [numpy_helper.from_array(weight, "weight")])
    feeds = {"ids": np.random.default_rng(2).integers(0, 10, (3, 5))}
    expected = run(model, feeds)
    assert small_embeddings_to_onehot_matmul(model, max_vocab=9) == 0  # a vocabulary above the limit stays
    assert small_embeddings_to_onehot_matmul(model, max_vocab=10) == 1
    onnx.checker.check_model(model)
    assert [n.op_type for n in model.graph.node if n.op_type != "Constant"] == ["OneHot", "MatMul"]
    np.testing.assert_array_equal(run(model, feeds)[0], expected[0])


def dropout_model(ratio: float, training: bool) -> onnx.ModelProto:
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 8])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 8])
    nodes = [
        helper.make_node("Constant", [], ["ratio"], value=numpy_helper.from_array(np.array(ratio, np.float32))),
        helper.make_node("Constant", [], ["training"], value=numpy_helper.from_array(np.array(training))),
        helper.make_node("Dropout", ["x", "ratio", "training"], ["y"], name="drop"),
    ]
    return helper.make_model(helper.make_graph(nodes, "g", [x], [y]), opset_imports=[helper.make_opsetid("", 16)])


def test_training_dropout_becomes_a_multiply_by_a_mask_input():
    assert dropout_to_mask_inputs(dropout_model(0.25, training=False)) == []  # inference-mode dropout stays
    model = dropout_model(0.25, training=True)
    masks = dropout_to_mask_inputs(model)
    assert masks == [DropoutMask("dropout_mask_0", (2, 8), 0.25)]
    onnx.checker.check_model(model)
    assert "Dropout" not in [n.op_type for n in model.graph.node]
    x = np.random.default_rng(3).standard_normal((2, 8)).astype(np.float32)
    (mask,) = draw_masks(masks)
    np.testing.assert_array_equal(run(model, {"x": x, "dropout_mask_0": mask})[0], x * mask)


@pytest.mark.parametrize("ratio", [0.1, 0.5])
def test_drawn_dropout_masks_keep_the_kept_fraction_and_the_scale(ratio):
    (mask,) = draw_masks([DropoutMask("m", (1000, 1000), ratio)], seed=0)
    keep = 1.0 - ratio
    kept = mask != 0
    # The kept fraction is binomial: 5 standard deviations of 1e6 draws.
    assert abs(kept.mean() - keep) < 5 * np.sqrt(keep * ratio / mask.size)
    np.testing.assert_array_equal(np.unique(mask[kept]), [np.float32(1.0 / keep)])  # dropout's 1/(1-p) scale
    assert not draw_masks([DropoutMask("m", (4,), 1.0)])[0].any()  # p=1 drops everything, as torch does
    assert draw_masks([DropoutMask("m", (4,), 0.0)])[0].tolist() == [1.0] * 4


def test_drawn_masks_follow_torchs_seed_and_differ_between_sites_and_steps():
    masks = [DropoutMask("a", (64, 32), 0.1), DropoutMask("b", (64, 32), 0.1)]
    torch.manual_seed(7)
    first, second = draw_masks(masks), draw_masks(masks)
    torch.manual_seed(7)
    again = draw_masks(masks)
    for got, want in zip(again, first, strict=True):
        np.testing.assert_array_equal(got, want)  # the run's seed fixes the masks (and a resumed RNG state too)
    assert not np.array_equal(first[0], first[1]) and not np.array_equal(first[0], second[0])


def test_masks_drawn_on_threads_are_the_masks_one_thread_draws():
    """A seed fixes the masks whatever the threads: masks across the sampler's stream (STREAM values) and block
    boundaries, of odd sizes, different ratios, dtypes and keep flags; the buffers are reused from one step to the
    next."""
    chunk = masks_module.STREAM
    masks = [
        DropoutMask("a", (3, chunk // 2 + 7), 0.1),
        DropoutMask("b", (chunk + 5,), 0.5, np.dtype(np.float16)),
        DropoutMask("c", (2, 9), 1.0),
        DropoutMask("d", (chunk // 3,), 0.25, np.dtype(np.uint8), scale_input="s"),
    ]
    sampler = MaskSampler(masks, threads=2)
    assert sampler.pool is not None
    for seed in (0, 1):
        want = draw_masks(masks, seed=seed)
        got = sampler.draw(seed)
        for m, g, w in zip(masks, got, want, strict=True):
            assert g.dtype == w.dtype == m.dtype and g.shape == m.shape
            np.testing.assert_array_equal(g, w, err_msg=m.name)
    assert 0.45 < (got[1] != 0).mean() < 0.55 and not got[2].any() and set(np.unique(got[3])) == {0, 1}
    flat = got[0].reshape(-1)
    assert (flat[: chunk // 2] != flat[chunk : chunk + chunk // 2]).any()  # a second stream is not the first again


def test_a_dropout_exported_without_training_mode_is_put_in_training_mode():
    """torch exports scaled_dot_product_attention's dropout as Dropout(x, ratio): ONNX's inference mode."""
    model = dropout_model(0.5, training=True)
    del model.graph.node[2].input[2:]  # as torch writes it
    feeds = {"x": np.ones((2, 8), np.float32)}
    np.testing.assert_array_equal(run(model, feeds)[0], feeds["x"])  # the identity: no dropout at all
    assert attention_dropout_in_training_mode(model) == 1 and attention_dropout_in_training_mode(model) == 0
    onnx.checker.check_model(model)
    assert set(np.unique(run(model, feeds)[0]).tolist()) == {0.0, 2.0}  # now it drops, scaled by 1/(1-p)


def test_multihead_attentions_packed_split_becomes_one_split_with_identical_results(tmp_path):
    torch.manual_seed(0)

    class SelfAttention(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.attention = torch.nn.MultiheadAttention(16, 2)  # sequence first: (length, batch, 16)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.attention(x, x, x, need_weights=False)[0]

    x = torch.randn(5, 3, 16)
    path = tmp_path / "attention.onnx"
    with export_warnings.expected():  # the legacy exporter's notices and tracer constants, as ortflow's exports
        torch.onnx.export(SelfAttention().eval(), (x,), str(path), opset_version=16, dynamo=False)
    model = onnx.load(str(path))
    feeds = {model.graph.input[0].name: x.numpy()}
    expected = run(model, feeds)
    assert packed_projections_to_splits(model) == 1 and packed_projections_to_splits(model) == 0
    onnx.checker.check_model(model)
    ops = [n.op_type for n in model.graph.node]
    assert ops.count("Split") == 1 and "Gather" not in ops and "Transpose" not in ops[: ops.index("Split")]
    for got, want in zip(run(model, feeds), expected, strict=True):
        np.testing.assert_array_equal(got, want)
