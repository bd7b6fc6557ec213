"""The decompositions of ops ORT cannot differentiate against torch's float32 kernels, values and gradients, in ulp.

Each activation is run as ORT trains it: the ONNX node (or torch's export of the module under ortflow's symbolics)
decomposed into ops ORT differentiates (accel/graph/activations.py), differentiated by generate_artifacts and run one
training-API step on a grid of about 50,000 points: |x| up to 100, a log-spaced sweep down to the smallest
subnormals, and every kink and threshold with its neighbouring floats. The gradient is that of sum(y), so it is
dy/dx itself. Distances are in units in the last place of float32 (adjacent floats are 1 ulp apart, +0 and -0 are
0 apart). Each side is judged against the exact function (float64, its formula written out below): the
decomposition must be within 4 ulp of it, or no farther from it than torch's own float32 kernel is (torch 2.6
computes ELU as exp(x) - 1, far from exact near 0, and gives HardSwish a gradient of -1/2 at x = -3, the kink's
right-hand slope: where torch is the inexact side the decomposition is not blamed for it). At a kink either one-sided
derivative is exact. `pytest -s` prints the table docs/ort-gradients.md shows (distances from torch's kernel)."""

import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
import torch
import torch.nn.functional as F
from onnx import TensorProto, helper, numpy_helper

from ortflow.accel import artifacts
from ortflow.accel.compat import export_warnings, torch_onnx
from ortflow.accel.graph import decompositions, pipeline
from ortflow.accel.graph import plan as graph_plan
from tests.accel.graph.test_ops_without_gradient import ort_step, train_once, values

MAX_ULP = 4


def ulp_distance(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """How many float32 values lie between a and b, elementwise (0 for +0 and -0)."""
    ia = np.asarray(a, np.float32).view(np.int32).astype(np.int64)
    ib = np.asarray(b, np.float32).view(np.int32).astype(np.int64)
    # Floats ordered as integers: negative ones mirrored below zero.
    return np.abs(np.where(ia < 0, -(ia & 0x7FFFFFFF), ia) - np.where(ib < 0, -(ib & 0x7FFFFFFF), ib))


def grid(kinks: tuple[float, ...]) -> np.ndarray:
    """|x| <= 100 in steps of 0.005, 10^-45 to 100 log-spaced, the smallest subnormals, 0, and each kink (and the
    sign-mirrored ones) with the floats just above and below it."""
    positive = np.concatenate(
        [
            np.linspace(0, 100, 20001),
            np.logspace(-45, 2, 4000),
            np.arange(1, 5) * float(np.finfo(np.float32).smallest_subnormal),
        ]
    ).astype(np.float32)
    marks = np.array([abs(k) for k in kinks], np.float32)
    marks = np.concatenate([marks, np.nextafter(marks, np.float32(np.inf)), np.nextafter(marks, np.float32(0))])
    both = np.concatenate([positive, marks])
    return np.unique(np.concatenate([both, -both]))


def trained(
    nodes: list[onnx.NodeProto], x: np.ndarray, params: dict[str, np.ndarray], y_shape: tuple[int, ...] | None = None
) -> tuple[np.ndarray, ...]:
    """y and the gradients of sum(y) for x and each of `params` (trainable initializers, read through Identity
    nodes as in an exported model), from ORT's training graph of `nodes` (reading "x", writing "y", shaped like x
    unless `y_shape`)."""
    trainable = {"x": x, **params}
    feeds = [helper.make_node("Identity", [f"{name}_param"], [name]) for name in trainable]
    loss = [
        helper.make_node("ReduceSum", ["y"], ["total"], keepdims=0),
        helper.make_node("Mul", ["total", "scale"], ["loss"]),
    ]
    graph = helper.make_graph(
        [*feeds, *nodes, *loss],
        "decomposed",
        [helper.make_tensor_value_info("scale", TensorProto.FLOAT, [])],
        [
            helper.make_tensor_value_info("loss", TensorProto.FLOAT, []),
            helper.make_tensor_value_info("y", TensorProto.FLOAT, list(y_shape or x.shape)),
        ],
        [numpy_helper.from_array(v, f"{name}_param") for name, v in trainable.items()],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 16)])
    y, grads = train_once(model, list(trainable))
    return (y, *grads.values())


def decomposed(node: onnx.NodeProto) -> list[onnx.NodeProto]:
    """The nodes decompositions.py writes for `node` (inputs "x" and its other inputs, output "y")."""
    graph = helper.make_graph([node], "one_op", [], [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 16)])
    assert decompositions.decompose_ops_without_gradient(model) == 1
    assert node.op_type not in {n.op_type for n in model.graph.node}
    return list(model.graph.node)


def exported(fn: Callable[[torch.Tensor], torch.Tensor], x: np.ndarray) -> list[onnx.NodeProto]:
    """The nodes of `fn` as an ORT engine exports it (ortflow's symbolics in force)."""

    class Module(torch.nn.Module):
        def forward(self, t: torch.Tensor) -> torch.Tensor:
            return fn(t)

    with (
        tempfile.TemporaryDirectory() as tmp,
        pipeline.exporting(graph_plan.GraphPlan.compute(artifacts.Settings(aten_conv=False), "fp32", "artifacts"), 16),
        export_warnings.expected(),
    ):
        path = Path(tmp) / "model.onnx"
        torch_onnx.export_training_onnx(Module(), (torch.from_numpy(x),), path, 16, ["x"], ["y"])
        return list(onnx.load(path).graph.node)


# Exact values and derivatives (float64) of each function: (y, dy/dx) at x, and for PReLU dy/dslope too.
SELU_ALPHA, SELU_SCALE = 1.6732632423543772848170429916717, 1.0507009873554804934193349852946


def elu(alpha: float, scale: float = 1.0) -> Callable[..., tuple[np.ndarray, ...]]:
    return lambda x: (
        scale * np.where(x > 0, x, alpha * np.expm1(np.minimum(x, 0))),
        scale * np.where(x > 0, 1.0, alpha * np.exp(np.minimum(x, 0))),
    )


def celu(alpha: float) -> Callable[..., tuple[np.ndarray, ...]]:
    return lambda x: (
        np.maximum(x, 0) + np.minimum(0, alpha * np.expm1(np.minimum(x, 0) / alpha)),
        np.where(x > 0, 1.0, np.exp(np.minimum(x, 0) / alpha)),
    )


def softplus(beta: float = 1.0, threshold: float = 20.0) -> Callable[..., tuple[np.ndarray, ...]]:
    def exact(x: np.ndarray) -> tuple[np.ndarray, ...]:
        linear = beta * x > threshold
        bx = np.where(linear, 0.0, beta * x)
        smooth = np.logaddexp(0.0, bx) / beta  # log(1 + exp(bx)), without overflow
        sigmoid = np.exp(-np.logaddexp(0.0, -bx))  # 1 / (1 + exp(-bx)), exact far into both tails
        return np.where(linear, x, smooth), np.where(linear, 1.0, sigmoid)

    return exact


def hardsigmoid(x: np.ndarray) -> tuple[np.ndarray, ...]:
    return np.clip(x / 6 + 0.5, 0, 1), np.where(np.abs(x) < 3, 1 / 6, 0.0)


def hardswish(x: np.ndarray) -> tuple[np.ndarray, ...]:
    return x * np.clip(x + 3, 0, 6) / 6, np.where(x < -3, 0.0, np.where(x > 3, 1.0, (2 * x + 3) / 6))


def prelu(x: np.ndarray, slope: np.ndarray) -> tuple[np.ndarray, ...]:
    return np.where(x > 0, x, slope * x), np.where(x > 0, 1.0, slope), np.where(x > 0, 0.0, x)


@dataclass
class Case:
    graph: Callable[[np.ndarray], list[onnx.NodeProto]]  # the ONNX nodes ORT trains, for the grid x
    torch_fn: Callable[..., torch.Tensor]
    exact: Callable[..., tuple[np.ndarray, ...]]  # float64: y and the gradients, as exact as float64 holds them
    kinks: tuple[float, ...] = ()
    slope: bool = False  # PRelu: a second trainable input, one slope per element
    # Where the gradient may be farther from torch's than MAX_ULP: (which x, the absolute bound there, why).
    gradient_allowance: tuple[Callable[[np.ndarray], np.ndarray], float, str] | None = None


def node(op: str, **attributes) -> Callable[[np.ndarray], list[onnx.NodeProto]]:
    inputs = ["x", "slope"] if op == "PRelu" else ["x"]
    return lambda x: decomposed(helper.make_node(op, inputs, ["y"], **attributes))


SERIES = (0.3, 3.0, 0.9, 0.15)  # where expm1's Taylor branch ends (x * input_scale = -0.3) for the alphas below
CASES: dict[str, Case] = {
    "Elu (nn.ELU())": Case(node("Elu", alpha=1.0), F.elu, elu(1.0), SERIES),
    "Elu (nn.ELU(0.5))": Case(node("Elu", alpha=0.5), lambda t: F.elu(t, 0.5), elu(0.5), SERIES),
    "Selu (nn.SELU())": Case(node("Selu"), F.selu, elu(SELU_ALPHA, SELU_SCALE), SERIES),
    "Celu (nn.CELU(3))": Case(node("Celu", alpha=3.0), lambda t: F.celu(t, 3.0), celu(3.0), SERIES),
    "Celu (nn.CELU(0.5))": Case(node("Celu", alpha=0.5), lambda t: F.celu(t, 0.5), celu(0.5), SERIES),
    "Softplus (in nn.Mish)": Case(node("Softplus"), F.softplus, softplus(1.0, np.inf), (17.0, 20.0, 88.0)),
    "nn.Softplus()": Case(lambda x: exported(F.softplus, x), F.softplus, softplus(), (17.0, 20.0, 88.0)),
    "nn.Softplus(beta=2, threshold=5)": Case(
        lambda x: exported(lambda t: F.softplus(t, 2.0, 5.0), x),
        lambda t: F.softplus(t, 2.0, 5.0),
        softplus(2.0, 5.0),
        (2.5, 10.0),
    ),
    "nn.Softplus(beta=0.5, threshold=1)": Case(
        lambda x: exported(lambda t: F.softplus(t, 0.5, 1.0), x),
        lambda t: F.softplus(t, 0.5, 1.0),
        softplus(0.5, 1.0),
        (2.0, 40.0),
    ),
    "HardSigmoid (nn.Hardsigmoid)": Case(
        node("HardSigmoid", alpha=1 / 6, beta=0.5), F.hardsigmoid, hardsigmoid, (3.0,)
    ),
    "HardSwish (nn.Hardswish)": Case(
        node("HardSwish"),
        F.hardswish,
        hardswish,
        (3.0, 1.5),
        gradient_allowance=(
            lambda x: np.abs(x + 1.5) < 0.2,
            2**-24,
            "torch's gradient x / 3 + 1/2 cancels as it crosses 0 at x = -1.5, ortflow's (x + 3) / 6 + x / 6 too: "
            "each is within a fraction of an ulp of 1/2 (2^-24) of the exact (2x + 3) / 6, so of each other, which "
            "is many ulp of the small result",
        ),
    ),
    "PRelu (nn.PReLU)": Case(node("PRelu"), lambda t, w: F.prelu(t.unsqueeze(0), w)[0], prelu, slope=True),
}


def from_exact(got: np.ndarray, exact: Callable[..., tuple[np.ndarray, ...]], index: int, *args: np.ndarray) -> Any:
    """Ulp from the exact result `exact(*args)[index]` rounded to float32, at x and at the floats next to it in
    float64 (the nearest of the three: at a kink either one-sided derivative is exact; elsewhere they agree)."""
    x, *rest = (np.asarray(a, np.float64) for a in args)
    found = [ulp_distance(got, exact(at, *rest)[index].astype(np.float32)) for at in (x, *neighbours(x))]
    return np.minimum.reduce(found)


def neighbours(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    return np.nextafter(x, -np.inf), np.nextafter(x, np.inf)


@pytest.mark.parametrize("name", list(CASES))
def test_values_and_gradients_are_within_4_ulp_of_exact_or_as_close_as_torchs_float32(name):
    case = CASES[name]
    x = grid(case.kinks)
    params = {"slope": np.random.default_rng(0).uniform(0.01, 1, x.shape).astype(np.float32)} if case.slope else {}
    y, *grads = trained(case.graph(x), x, params)
    inputs = [torch.tensor(x, requires_grad=True), *(torch.tensor(v, requires_grad=True) for v in params.values())]
    want = case.torch_fn(*inputs)
    want.sum().backward()
    args = (x, *params.values())
    theirs = [want.detach().numpy(), *(t.grad.numpy() for t in inputs)]
    checked = np.ones(x.shape, bool)
    note = ""
    if case.gradient_allowance is not None:  # the gradient's cancellation: bounded absolutely there
        where, bound, why = case.gradient_allowance
        checked = ~where(x)
        exact_gradient = case.exact(x.astype(np.float64), *params.values())[1]
        assert np.abs(grads[0] - exact_gradient)[~checked].max() <= bound, why
        note = f"; where |x + 1.5| < 0.2: {np.abs(grads[0] - theirs[1])[~checked].max() / 2**-24:.2g} x 2^-24 apart"
    for index, (ours, torchs) in enumerate(zip([y, *grads], theirs, strict=True)):
        mine, own = from_exact(ours, case.exact, index, *args), from_exact(torchs, case.exact, index, *args)
        # Within 4 ulp of exact, or no farther from it than torch's float32, or within 4 ulp of torch's (where both
        # are off alike: a subnormal gradient far in a tail).
        bad = checked & (mine > np.maximum(MAX_ULP, own)) & (ulp_distance(ours, torchs) > MAX_ULP)
        what = "value" if index == 0 else f"gradient {index}"
        assert not bad.any(), (
            f"{what} {mine[bad].max()} ulp from exact (torch's float32 {own[bad][mine[bad].argmax()]}) at "
            f"x={x[bad][mine[bad].argmax()]!r}"
        )
    value = ulp_distance(y, theirs[0])  # the table docs/ort-gradients.md shows: distances from torch's kernel
    gradient = np.maximum.reduce([ulp_distance(g, t) for g, t in zip(grads, theirs[1:], strict=True)])
    print(f"\n| {name} | {len(x):,} | {value.max()} | {gradient[checked].max()}{note} |")


def test_the_grid_holds_the_kinks_and_the_values_near_0():
    x = grid((3.0,))
    for mark in (3.0, -3.0, float(np.nextafter(np.float32(3), np.float32(4))), 0.0, 1e-30, -1e-30, 100.0, -100.0):
        assert np.isclose(x, mark, rtol=0.05, atol=0).any() if abs(mark) < 1e-20 else (x == np.float32(mark)).any()
    assert np.abs(x).max() == 100 and (x[(x > 0)] < 1e-44).any()


def test_ulp_distance_counts_the_floats_between():
    one = np.float32(1)
    assert ulp_distance(one, np.nextafter(one, np.float32(2))) == 1
    assert ulp_distance(np.float32(-0.0), np.float32(0.0)) == 0
    smallest = np.finfo(np.float32).smallest_subnormal
    assert ulp_distance(smallest, -smallest) == 2
    assert ulp_distance(one, np.float32(1 + 4 * 2**-23)) == 4


def test_depth_to_space_and_einsum_against_torch():
    """Data movement is bit for bit; an einsum's products are summed by ORT's MatMul in another order than torch's:
    within 4 ulp of the output's largest magnitude (an element whose sum cancels can be many ulp of itself away)."""
    x = values((2, 8, 3, 5)) * 20
    d2s = helper.make_node("DepthToSpace", ["x"], ["y"], blocksize=2, mode="CRD")
    y, dx = trained(decomposed(d2s), x, {}, (2, 2, 6, 10))
    t = torch.tensor(x, requires_grad=True)
    want = F.pixel_shuffle(t, 2)
    want.sum().backward()
    assert ulp_distance(y, want.detach().numpy()).max() == 0 and ulp_distance(dx, t.grad.numpy()).max() == 0
    a, b = values((2, 3, 6, 5), seed=1) * 20, values((2, 3, 7, 5), seed=2) * 20
    einsum = helper.make_node("Einsum", ["x", "b"], ["y"], equation="bhqd,bhkd->bhqk")
    weights = np.random.default_rng(3).standard_normal((2, 3, 6, 7)).astype(np.float32)
    grads, y = ort_step(einsum, {"x": a, "b": b}, {}, weights, decompositions.decompose_ops_without_gradient)
    ta, tb = torch.tensor(a, requires_grad=True), torch.tensor(b, requires_grad=True)
    want = torch.einsum("bhqd,bhkd->bhqk", ta, tb)
    (want * torch.tensor(weights)).sum().backward()
    for ours, theirs in ((y, want.detach()), (grads["x"], ta.grad), (grads["b"], tb.grad)):
        scale = np.spacing(np.abs(theirs.numpy()).max().astype(np.float32))
        assert np.abs(ours - theirs.numpy()).max() <= MAX_ULP * scale
