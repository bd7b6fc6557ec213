"""ReLU by torch inside ORT's graphs (ortflow/accel/graph/aten_relu.py): torch's values and gradient (zero at 0, as
eager's), the rewrite's node typed with its input's shape, and `accel.aten_relu`'s default: torch's ReLU in a graph
that already runs torch's kernels (a CNN's convolutions), ORT's `x * (x > 0)` in one that does not."""

import copy

import onnx
import pytest
import torch
from onnx import TensorProto, helper
from torch import nn

from ortflow.accel.graph import aten_relu
from tests.accel.test_vision_engines import conv_bn, images, make_engine


def test_the_operators_are_torchs_relu_and_its_backward_with_a_zero_gradient_at_zero():
    x = torch.tensor([-2.0, -0.0, 0.0, 1e-30, 3.0], requires_grad=True)
    out = torch.relu(x)
    grad = torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0])
    (expected,) = torch.autograd.grad(out, x, grad)
    result = torch.ops.ortflow.relu(x.detach())
    assert torch.equal(result, out.detach())
    assert torch.equal(torch.ops.ortflow.relu_backward(grad, result), expected)
    assert expected.tolist() == [0.0, 0.0, 0.0, 4.0, 5.0]


def test_each_float_relu_becomes_one_aten_node_typed_as_its_input():
    value = helper.make_tensor_value_info
    shape = [4, 8, 16, 16]
    graph = helper.make_graph(
        [
            helper.make_node("Relu", ["x"], ["y"], name="r"),
            helper.make_node("Neg", ["y"], ["z"], name="n"),
            helper.make_node("Relu", ["i"], ["j"], name="int"),
        ],
        "g",
        [value("x", TensorProto.FLOAT, shape), value("i", TensorProto.INT32, [3])],
        [value("z", TensorProto.FLOAT, None), value("j", TensorProto.INT32, [3])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 16)])
    assert aten_relu.relus_to_aten(model) == 1
    relu, _, left = model.graph.node
    assert relu.op_type == "ATen" and relu.domain == "org.pytorch.aten" and left.op_type == "Relu"
    assert list(relu.input) == ["x"] and list(relu.output) == ["y"]
    (declared,) = [v for v in model.graph.value_info if v.name == "y"]  # ORT cannot infer an ATen node's output
    assert declared.type.tensor_type.elem_type == TensorProto.FLOAT
    assert [d.dim_value for d in declared.type.tensor_type.shape.dim] == shape


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Flatten(), nn.Linear(3 * 16 * 16, 32), nn.ReLU(), nn.Linear(32, 5))


@pytest.mark.parametrize(
    ("build", "setting", "by_torch"),
    [(conv_bn, None, True), (mlp, None, False), (mlp, True, True), (conv_bn, False, False)],
    ids=["cnn-default", "mlp-default", "mlp-on", "cnn-off"],
)
def test_the_default_takes_torchs_relu_where_the_graph_runs_torch_kernels_already(build, setting, by_torch, tmp_path):
    x, y = images(1)[0]
    model = build()
    relus = sum(isinstance(m, nn.ReLU) for m in model.modules())
    settings = {} if setting is None else {"aten_relu": setting}
    engine = make_engine("artifacts", copy.deepcopy(model), (x, y), tmp_path, **settings)
    fixes = engine.describe()["graph_fixes"]
    assert fixes.get("relus_run_by_torch", 0) == (relus if by_torch else 0), fixes
    assert fixes.get("relu_to_mask_mul", 0) == (0 if by_torch else relus), fixes
    training = onnx.load(str(next((tmp_path / "artifacts").rglob("training_model.onnx"))), load_external_data=False)
    ops = {n.op_type for n in training.graph.node}
    assert ("Greater" in ops) != by_torch  # the mask's comparison, where ORT runs the ReLUs
    if build is conv_bn:  # the same gradients either way (the conv engines' parity with eager: test_vision_engines)
        other = make_engine("artifacts", copy.deepcopy(model), (x, y), tmp_path / "other", aten_relu=not by_torch)
        loss, grads = engine.gradients(x, y)
        other_loss, other_grads = other.gradients(x, y)
        assert loss == pytest.approx(other_loss, rel=1e-6)
        for name, grad in grads.items():
            torch.testing.assert_close(torch.from_numpy(grad), torch.from_numpy(other_grads[name]), msg=name)
