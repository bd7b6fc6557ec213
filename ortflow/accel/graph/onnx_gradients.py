"""Gradients ortflow gives ONNX Runtime for standard ONNX ops it has no gradient builder for, written in ONNX ops ORT
runs natively (so the artifacts engine's graphs stay torch-free), and the graph fix that makes every such node one
its gradient holds for (`graph_fixes.ops_given_ort_gradients`, both ORT engines).

ORT's gradient builder consults the gradient registry ORTModule uses for its ATen operators (compat's
`register_onnx_gradient`) for any op, keyed by domain and op type only: a definition sees the node's inputs,
outputs and output gradients (I(k), O(k), GO(k)), never its attributes. So each definition below is written for
one form of its op, and `prepare` rewrites every node into that form first:

- Atan, Tan, Asin, Acos: dY / (X * X + 1), dY * (Y * Y + 1), dY / sqrt(1 - X * X), -dY / sqrt(1 - X * X), as
  torch computes them. Any node.
- Floor, Ceil, Round, Sign: zeros, as torch's. Any node.
- CumSum (torch.cumsum): CumSum(dY, axis, reverse=1), for exclusive=0, reverse=0 (torch's export). Other nodes
  become that CumSum between Gathers reversing the axis and a Pad shifting it by one (exact: the same sums).
- ReduceMax, ReduceMin (amax/amin, max(), max(dim)): (dY / count) * (X == Y), the count over the reduced axes
  (those where Y's shape is 1), torch's amax gradient (tied elements share it), for keepdims=1. keepdims=0 nodes
  become keepdims=1 and a Squeeze of the reduced axes.

ReduceLogSumExp (torch.logsumexp) has an ORT gradient builder that breaks on keepdims=0; its nodes get the same
keepdims rewrite, and ORT's own gradient.

torch's max(dim) (and min(dim)) gives the whole gradient to the one index it returns where several elements tie;
here they share it, as amax does. Without ties (real data) both are the same.
"""

from collections.abc import Callable

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from ortflow.accel.compat import ort
from ortflow.accel.graph import plan as graph_plan
from ortflow.accel.graph.onnx_values import attribute, constant_values, value_types
from ortflow.errors import ModelError

Definition = Callable[[], list[tuple]]


def _scalar(name: str, value: float) -> list[tuple]:
    """Nodes making `name` a scalar of the forward input's element type (the registry's tensor constants are 1-D of
    one element; reshaped to rank 0 they broadcast against a scalar input without changing its shape)."""
    return [
        ("Constant", [], [f"{name}_1d"], {"value": {"value": value, "dtype": "IElemType(0)", "is_tensor": True}}),
        ("Constant", [], [f"{name}_shape"], {"value": {"value": [], "dtype": "int", "is_tensor": True}}),
        ("Reshape", [f"{name}_1d", f"{name}_shape"], [name]),
    ]


def atan_gradient() -> list[tuple]:
    return [
        *_scalar("one", 1.0),
        ("Mul", ["I(0)", "I(0)"], ["square"]),
        ("Add", ["square", "one"], ["denominator"]),
        ("Div", ["GO(0)", "denominator"], ["GI(0)"]),
    ]


def tan_gradient() -> list[tuple]:
    return [
        *_scalar("one", 1.0),
        ("Mul", ["O(0)", "O(0)"], ["square"]),
        ("Add", ["square", "one"], ["slope"]),
        ("Mul", ["GO(0)", "slope"], ["GI(0)"]),
    ]


def _arcsine_slope() -> list[tuple]:
    """sqrt(1 - X * X), the denominator of asin's and acos's derivatives."""
    return [
        *_scalar("one", 1.0),
        ("Mul", ["I(0)", "I(0)"], ["square"]),
        ("Sub", ["one", "square"], ["rest"]),
        ("Sqrt", ["rest"], ["root"]),
    ]


def asin_gradient() -> list[tuple]:
    return [*_arcsine_slope(), ("Div", ["GO(0)", "root"], ["GI(0)"])]


def acos_gradient() -> list[tuple]:
    return [*_arcsine_slope(), ("Neg", ["GO(0)"], ["minus"]), ("Div", ["minus", "root"], ["GI(0)"])]


def zero_gradient() -> list[tuple]:
    return [
        ("Shape", ["I(0)"], ["shape"]),
        (
            "ConstantOfShape",
            ["shape"],
            ["GI(0)"],
            {"value": {"value": 0.0, "dtype": "IElemType(0)", "is_tensor": True}},
        ),
    ]


def cumsum_gradient() -> list[tuple]:
    """For exclusive=0, reverse=0: each input element adds to every output from its own position on."""
    return [("CumSum", ["GO(0)", "I(1)"], ["GI(0)"], {"reverse": {"value": 1, "dtype": "int"}})]


def extremum_gradient() -> list[tuple]:
    """For keepdims=1 (Y broadcasts against X): torch's amax/amin gradient, (dY / count) * mask."""
    return [
        *_scalar("one", 1.0),
        *_scalar("zero", 0.0),
        ("Equal", ["I(0)", "O(0)"], ["hit"]),
        ("Where", ["hit", "one", "zero"], ["mask"]),
        # the reduced axes: where Y's (kept) dims are 1 (an unreduced dim of 1 sums over one element)
        ("Shape", ["O(0)"], ["y_shape"]),
        ("Constant", [], ["int_one"], {"value": {"value": 1, "dtype": "int", "is_tensor": True}}),
        ("Equal", ["y_shape", "int_one"], ["is_one"]),
        ("NonZero", ["is_one"], ["where_one"]),
        ("Constant", [], ["flat"], {"value": {"value": [-1], "dtype": "int", "is_tensor": True}}),
        ("Reshape", ["where_one", "flat"], ["axes"]),
        ("ReduceSum", ["mask", "axes"], ["count"], {"keepdims": {"value": 1, "dtype": "int"}}),
        ("Div", ["GO(0)", "count"], ["shared"]),
        ("Mul", ["shared", "mask"], ["GI(0)"]),
    ]


GRADIENTS: dict[str, Definition] = {
    "Atan": atan_gradient,
    "Tan": tan_gradient,
    "Asin": asin_gradient,
    "Acos": acos_gradient,
    "Floor": zero_gradient,
    "Ceil": zero_gradient,
    "Round": zero_gradient,
    "Sign": zero_gradient,
    "CumSum": cumsum_gradient,
    "ReduceMax": extremum_gradient,
    "ReduceMin": extremum_gradient,
}


# Ops ORT has a gradient builder for that fails on keepdims=0 ("Unsqueeze_1 has input size 1 not in range [min=2,"
# from opset 13 on): rewritten into keepdims=1 and a Squeeze as ReduceMax is, ORT's own gradient then holds.
KEEPDIMS_FOR_ORT = ("ReduceLogSumExp",)
_KEEPDIMS = ("ReduceMax", "ReduceMin", *KEEPDIMS_FOR_ORT)


def register_gradients() -> None:
    """Give ORT every definition of GRADIENTS (idempotent; ORTModule publishes the registry again when it is built).
    The registry is the process's: any graph ORT differentiates afterwards gets these definitions, so a graph must
    have been through `prepare` first (both engines' graph fixes). Imports ORTModule (the torch patches first)."""
    for op_type, definition in GRADIENTS.items():
        ort.register_onnx_gradient(op_type, definition)


def _drop(node: onnx.NodeProto, attribute: str) -> None:
    kept = [a for a in node.attribute if a.name != attribute]
    del node.attribute[:]
    node.attribute.extend(kept)


class _Writer:
    """Nodes replacing one node, named after it."""

    def __init__(self, base: str) -> None:
        self.base = base
        self.nodes: list[onnx.NodeProto] = []

    def ints(self, values: list[int] | int) -> str:
        name = f"{self.base}/ints_{len(self.nodes)}"
        tensor = numpy_helper.from_array(np.array(values, dtype=np.int64), name)
        self.nodes.append(helper.make_node("Constant", [], [name], name=name, value=tensor))
        return name

    def op(self, op_type: str, inputs: list[str], output: str | None = None, **attrs) -> str:
        name = f"{self.base}/{op_type}_{len(self.nodes)}"
        self.nodes.append(helper.make_node(op_type, inputs, [output or name], name=name, **attrs))
        return output or name


def _cumsum(node: onnx.NodeProto, constants: dict[str, np.ndarray], rank: int | None) -> list[onnx.NodeProto]:
    """A CumSum with exclusive or reverse set, as the plain CumSum (exclusive=0, reverse=0) its gradient holds for:
    reverse runs it between two Gathers that reverse the axis, exclusive shifts its result by one along the axis
    (the sum of the elements before each one is the inclusive sum one position earlier; a Pad puts the first 0)."""
    exclusive, reverse = attribute(node, "exclusive", 0), attribute(node, "reverse", 0)
    axis_value = constants.get(node.input[1])
    if axis_value is None or rank is None:
        raise ModelError(
            f"CumSum node {node.name or node.output[0]} has exclusive or reverse set and an axis or input rank "
            "unknown before training: ortflow's gradient for CumSum cannot handle it; use accel=none."
        )
    axis = int(axis_value.reshape(-1)[0]) % rank
    w = _Writer(node.name or node.output[0])
    value = node.input[0]

    def flip(x: str) -> str:
        # Gather(x, size - 1 - Range(0, size)): ORT's SliceGrad fails on a step of -1 along the last axis, and ORT
        # fuses a Gather of a descending Range into a wrong Slice.
        size = w.op("Gather", [w.op("Shape", [x]), w.ints(axis)])
        last = w.op("Sub", [size, w.ints(1)])
        indices = w.op("Sub", [last, w.op("Range", [w.ints(0), size, w.ints(1)])])
        return w.op("Gather", [x, indices], axis=axis)

    if reverse:
        value = flip(value)
    value = w.op("CumSum", [value, node.input[1]])
    if exclusive:
        head = w.op("Slice", [value, w.ints([0]), w.ints([-1]), w.ints([axis])])
        pads = [0] * (2 * rank)
        pads[axis] = 1
        value = w.op("Pad", [head, w.ints(pads)])
    if reverse:
        value = flip(value)
    w.nodes[-1].output[0] = node.output[0]
    return w.nodes


def _keep_dims(node: onnx.NodeProto, constants: dict[str, np.ndarray]) -> list[onnx.NodeProto]:
    """A reduction with keepdims=0 as one with keepdims=1 (its gradient's form) and a Squeeze of its reduced axes
    (all of them when it reduces every axis)."""
    axes = attribute(node, "axes")
    if axes is None and len(node.input) > 1 and node.input[1]:  # opset 18: the axes are an input
        known = constants.get(node.input[1])
        if known is None:
            raise ModelError(
                f"{node.op_type} node {node.name or node.output[0]} reduces axes computed in the graph: ortflow's "
                "gradient for it needs them known before training; use accel=none."
            )
        axes = [int(a) for a in known.reshape(-1)]
    if not axes and attribute(node, "noop_with_empty_axes", 0):  # opset 18: no reduction, Y is X (any form holds)
        return [node]
    w = _Writer(node.name or node.output[0])
    kept = f"{w.base}/kept"
    _drop(node, "keepdims")
    node.attribute.append(helper.make_attribute("keepdims", 1))
    output = node.output[0]
    node.output[0] = kept
    w.nodes.append(node)
    if axes:
        w.op("Squeeze", [kept, w.ints(axes)], output)
    else:  # every axis reduced: a scalar
        w.op("Reshape", [kept, w.ints([])], output)
    return w.nodes


_FLOATS = {TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.BFLOAT16, TensorProto.DOUBLE}


def prepare(model: onnx.ModelProto) -> int:
    """Rewrite every node of GRADIENTS' ops (and of KEEPDIMS_FOR_ORT's) on floating-point values into the form its
    gradient is written for; returns how many such nodes the graph holds (ORT differentiates them where they lie on
    a trainable path). Nodes on integers (a cumulative sum of an attention mask) are left as they are."""
    graph = model.graph
    ours = (*GRADIENTS, *KEEPDIMS_FOR_ORT)
    if not any(n.op_type in ours and n.domain in ("", "ai.onnx") for n in graph.node):
        return 0
    types = value_types(model)
    constants = constant_values(graph)
    nodes: list[onnx.NodeProto] = []
    count = 0
    for node in graph.node:
        type_ = types.get(node.input[0]) if node.input else None
        elem = type_.tensor_type.elem_type if type_ is not None else TensorProto.UNDEFINED
        if node.op_type not in ours or node.domain not in ("", "ai.onnx") or elem not in (*_FLOATS, 0):
            nodes.append(node)
            continue
        count += 1
        if node.op_type == "CumSum" and (attribute(node, "exclusive", 0) or attribute(node, "reverse", 0)):
            has_shape = type_ is not None and type_.tensor_type.HasField("shape")
            nodes.extend(_cumsum(node, constants, len(type_.tensor_type.shape.dim) if has_shape else None))
        elif node.op_type in _KEEPDIMS and not attribute(node, "keepdims", 1):
            nodes.extend(_keep_dims(node, constants))
        else:
            nodes.append(node)
    del graph.node[:]
    graph.node.extend(nodes)
    return count


def _rewrite(model: onnx.ModelProto, plan: graph_plan.GraphPlan, work: graph_plan.GraphWork) -> None:
    work.count("ops_given_ort_gradients", prepare(model))


graph_plan.one_path(
    "onnx_gradients",
    graph_plan.Path.ort,
    replaces="ONNX ops ORT has no gradient builder for (Atan, CumSum, ReduceMax, ...): given gradients in ONNX ops",
    module=__name__,
    rewrite=_rewrite,
)
