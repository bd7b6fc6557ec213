"""ONNX ops ORT 1.19 cannot differentiate, made trainable by ortflow's graph fixes: the gradients it gives ORT
(accel/graph/onnx_gradients.py) and the decompositions into ops ORT differentiates (DepthToSpace, Einsum in
accel/graph/decompositions.py). Each op alone, in the forms torch's exporter or a hand-written graph uses, is
fixed, differentiated by generate_artifacts and run one training-API step, against torch's autograd on the same
values."""

import tempfile
from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper

from ortflow.accel.graph import decompositions, onnx_gradients

Fix = Callable[[onnx.ModelProto], int]


def ort_step(
    node: onnx.NodeProto,
    params: dict[str, np.ndarray],
    consts: dict[str, np.ndarray],
    weights: np.ndarray,
    fix: Fix,
    opset: int = 16,
) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """ORT's gradients of sum(weights * node(params)) for each of `params` (trainable initializers fed to the node
    through Identity nodes, as in an exported model; `consts` its other inputs), after `fix`, and the node's
    output."""
    feeds = [helper.make_node("Identity", [f"{name}_param"], [name]) for name in params]
    loss = [
        helper.make_node("Mul", ["y", "weights"], ["weighted"]),
        helper.make_node("ReduceSum", ["weighted"], ["total"], keepdims=0),
        helper.make_node("Mul", ["total", "scale"], ["loss"]),
    ]
    initializers = [
        *(numpy_helper.from_array(v, f"{k}_param") for k, v in params.items()),
        *(numpy_helper.from_array(v, k) for k, v in consts.items()),
        numpy_helper.from_array(weights, "weights"),
    ]
    graph = helper.make_graph(
        [*feeds, node, *loss],
        "one_op",
        [helper.make_tensor_value_info("scale", TensorProto.FLOAT, [])],
        [
            helper.make_tensor_value_info("loss", TensorProto.FLOAT, []),
            helper.make_tensor_value_info("y", TensorProto.FLOAT, list(weights.shape)),
        ],
        initializers,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    assert fix(model) == 1
    onnx_gradients.register_gradients()
    y, grads = train_once(model, list(params))
    return grads, y


def train_once(model: onnx.ModelProto, trainable: list[str]) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """One training step of `model` in ORT's training API (its input: the loss scale "scale"; its outputs: "loss",
    then "y"): y, and the gradient of each trainable initializer `NAME_param` by NAME."""
    from onnxruntime.training import artifacts, onnxblock
    from onnxruntime.training.api import CheckpointState, Module

    with tempfile.TemporaryDirectory() as tmp:
        artifacts.generate_artifacts(
            model,
            requires_grad=[f"{name}_param" for name in trainable],
            loss=None,
            optimizer=onnxblock.optim.SGD(),
            artifact_directory=tmp,
            additional_output_names=["y"],
        )
        state = CheckpointState.load_checkpoint(str(Path(tmp) / "checkpoint"))
        module = Module(str(Path(tmp) / "training_model.onnx"), state, str(Path(tmp) / "eval_model.onnx"))
        module.train()
        _, y, *_ = module(np.ones((), np.float32))
        return y, {name: np.array(state.parameters[f"{name}_param"].grad) for name in trainable}


def assert_trains_as_torch(
    node: onnx.NodeProto,
    fn: Callable[..., torch.Tensor],
    params: dict[str, np.ndarray],
    fix: Fix,
    consts: dict[str, np.ndarray] | None = None,
    opset: int = 16,
) -> None:
    tensors = {k: torch.tensor(v, requires_grad=True) for k, v in params.items()}
    want = fn(*tensors.values())
    weights = np.random.default_rng(1).standard_normal(tuple(want.shape)).astype(np.float32)
    (want * torch.tensor(weights)).sum().backward()
    node = onnx.NodeProto.FromString(node.SerializeToString())  # the fix rewrites the graph's copy
    grads, y = ort_step(node, params, consts or {}, weights, fix, opset)
    np.testing.assert_allclose(y, want.detach().numpy(), rtol=1e-5, atol=1e-6)
    for name, t in tensors.items():
        np.testing.assert_allclose(grads[name], t.grad.numpy(), rtol=1e-5, atol=1e-6)


def values(shape=(3, 4, 5), ties: bool = False, seed: int = 0) -> np.ndarray:
    x = np.random.default_rng(seed).standard_normal(shape).astype(np.float32) * 2
    if ties:  # maxima and minima shared along every axis: a repeated row and column
        x = np.round(x)
        x[:, 1] = x[:, 0]
        x[..., 2] = x[..., 0]
    return x


def axis(value: int) -> dict[str, np.ndarray]:
    return {"axis": np.array(value, np.int64)}


def reductions(ties: bool) -> dict[str, tuple[onnx.NodeProto, Callable, dict, bool]]:
    cases = {
        "ReduceMax(keepdims=0)": (
            helper.make_node("ReduceMax", ["x"], ["y"], axes=[1], keepdims=0),
            lambda t: t.amax(1),
        ),
        "ReduceMin(two axes, keepdims=1)": (
            helper.make_node("ReduceMin", ["x"], ["y"], axes=[0, 2], keepdims=1),
            lambda t: t.amin((0, 2), keepdim=True),
        ),
        "ReduceMax(every axis)": (helper.make_node("ReduceMax", ["x"], ["y"], keepdims=0), torch.max),
        "ReduceMin(negative axis)": (
            helper.make_node("ReduceMin", ["x"], ["y"], axes=[-1], keepdims=0),
            lambda t: t.amin(-1),
        ),
    }
    return {f"{name}{' ties' if ties else ''}": (node, fn, {}, ties) for name, (node, fn) in cases.items()}


# name -> (node, torch's function, the node's constant inputs, ties among the input's values)
GIVEN: dict[str, tuple[onnx.NodeProto, Callable, dict, bool]] = {
    "Atan": (helper.make_node("Atan", ["x"], ["y"]), torch.atan, {}, False),
    "Tan": (helper.make_node("Tan", ["x"], ["y"]), torch.tan, {}, False),
    "Asin": (helper.make_node("Asin", ["x"], ["y"]), torch.asin, {}, False),
    "Acos": (helper.make_node("Acos", ["x"], ["y"]), torch.acos, {}, False),
    "Floor": (helper.make_node("Floor", ["x"], ["y"]), torch.floor, {}, False),
    "Ceil": (helper.make_node("Ceil", ["x"], ["y"]), torch.ceil, {}, False),
    "Round": (helper.make_node("Round", ["x"], ["y"]), torch.round, {}, False),
    "Sign": (helper.make_node("Sign", ["x"], ["y"]), torch.sign, {}, False),
    "CumSum": (helper.make_node("CumSum", ["x", "axis"], ["y"]), lambda t: t.cumsum(1), axis(1), False),
    "CumSum(reverse, last axis)": (
        helper.make_node("CumSum", ["x", "axis"], ["y"], reverse=1),
        lambda t: t.flip(2).cumsum(2).flip(2),
        axis(-1),
        False,
    ),
    "CumSum(exclusive)": (
        helper.make_node("CumSum", ["x", "axis"], ["y"], exclusive=1),
        lambda t: t.cumsum(0) - t,
        axis(0),
        False,
    ),
    "CumSum(exclusive, reverse)": (
        helper.make_node("CumSum", ["x", "axis"], ["y"], exclusive=1, reverse=1),
        lambda t: t.flip(1).cumsum(1).flip(1) - t,
        axis(1),
        False,
    ),
    "ReduceLogSumExp(keepdims=0)": (
        helper.make_node("ReduceLogSumExp", ["x"], ["y"], axes=[1], keepdims=0),
        lambda t: t.logsumexp(1),
        {},
        False,
    ),
    **reductions(ties=False),
    **reductions(ties=True),
}


@pytest.mark.parametrize("case", list(GIVEN))
def test_ort_differentiates_the_op_by_ortflows_gradient_as_torch_does(case):
    node, fn, consts, ties = GIVEN[case]
    x = values(ties=ties)
    if case in ("Tan", "Asin", "Acos"):  # inside their domains, away from tan's poles
        x = np.tanh(x) * 0.95
    assert_trains_as_torch(node, fn, {"x": x}, onnx_gradients.prepare, consts)


@pytest.mark.parametrize("ties", [False, True], ids=["distinct", "ties"])
def test_a_reduction_taking_its_axes_as_an_input_opset_18(ties):
    node = helper.make_node("ReduceMax", ["x", "axes"], ["y"], keepdims=0)
    consts = {"axes": np.array([0, 2], np.int64)}
    x = {"x": values(ties=ties)}
    assert_trains_as_torch(node, lambda t: t.amax((0, 2)), x, onnx_gradients.prepare, consts, opset=18)


def test_nodes_on_integers_are_left_alone():
    """A cumulative sum of an attention mask (position ids) is never differentiated."""
    mask = helper.make_tensor_value_info("mask", TensorProto.INT64, [2, 5])
    ids = helper.make_tensor_value_info("ids", TensorProto.INT64, [2, 5])
    axis = numpy_helper.from_array(np.array(1, np.int64), "axis")
    node = helper.make_node("CumSum", ["mask", "axis"], ["ids"], reverse=1)
    model = helper.make_model(
        helper.make_graph([node], "g", [mask], [ids], [axis]), opset_imports=[helper.make_opsetid("", 16)]
    )
    assert onnx_gradients.prepare(model) == 0
    assert [n.op_type for n in model.graph.node] == ["CumSum"]


@pytest.mark.parametrize("mode", ["DCR", "CRD"])
def test_depth_to_space_is_decomposed_for_both_modes(mode):
    node = helper.make_node("DepthToSpace", ["x"], ["y"], blocksize=2, mode=mode)

    def depth_to_space(t: torch.Tensor) -> torch.Tensor:
        if mode == "CRD":
            return torch.pixel_shuffle(t, 2)
        n, c, h, w = t.shape  # DCR: the block index before the channel
        blocks = t.reshape(n, 2, 2, c // 4, h, w).permute(0, 3, 4, 1, 5, 2)
        return blocks.reshape(n, c // 4, h * 2, w * 2)

    x = values((2, 8, 3, 5))
    assert_trains_as_torch(node, depth_to_space, {"x": x}, decompositions.decompose_ops_without_gradient)


EINSUMS = {
    "bij,bkj->bik": ((2, 5, 4), (2, 3, 4)),  # attention scores
    "bij,jk->bik": ((2, 5, 4), (4, 3)),
    "bhqd,bhkd->bhqk": ((2, 3, 4, 5), (2, 3, 6, 5)),
    "...ij,...jk->...ik": ((2, 3, 4), (2, 4, 5)),
    "...ij,jk": ((2, 3, 4), (4, 5)),  # implicit output, an ellipsis on one side
    "i,j->ij": ((3,), (4,)),  # outer product: nothing contracted
    "ij,ij->i": ((3, 4), (3, 4)),  # row-wise dot product: i kept by both
    "bij,bj->b": ((2, 3, 4), (2, 4)),  # i summed out of the first operand alone
    "ij->ji": ((3, 4),),
    "bij->bj": ((2, 3, 4),),
}


@pytest.mark.parametrize("equation", list(EINSUMS))
def test_einsum_is_decomposed_into_matmuls(equation):
    node = helper.make_node("Einsum", [f"x{i}" for i in range(len(EINSUMS[equation]))], ["y"], equation=equation)
    params = {f"x{i}": values(shape, seed=i) for i, shape in enumerate(EINSUMS[equation])}
    fn = lambda *ts: torch.einsum(equation, *ts)  # noqa: E731
    assert_trains_as_torch(node, fn, params, decompositions.decompose_ops_without_gradient)


def test_an_einsum_taking_a_diagonal_is_left_to_be_refused():
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [3, 3])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [3])
    graph = helper.make_graph([helper.make_node("Einsum", ["x"], ["y"], equation="ii->i")], "g", [x], [y])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 16)])
    assert decompositions.decompose_ops_without_gradient(model) == 0
    assert [n.op_type for n in model.graph.node] == ["Einsum"]
