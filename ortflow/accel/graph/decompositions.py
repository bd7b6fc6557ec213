"""ONNX ops ONNX Runtime 1.19 cannot differentiate, written out in ops it can (a graph fix both ORT engines apply to
every exported forward graph, `graph_fixes.ops_without_gradient_decomposed`).

ORT registers no gradient builder for these ops ("The gradient builder has not been registered: HardSwish"; the
full list, measured: docs/ort-gradients.md, `python -m ortflow.accel.graph.gradient_survey`), so torchvision's
MobileNetV3 (nn.Hardswish, nn.Hardsigmoid), SELU networks, Mish (Softplus), sub-pixel upsampling (nn.PixelShuffle)
and einsums could not train. Each rewrite computes the op with ops ORT differentiates (Where, Mul, Add, Exp, Log,
Reshape, Transpose, MatMul, ...), so the graph stays torch-free (the artifacts engine needs no torch at training
time). The activations follow torch's float32 kernels (accel/graph/activations.py): values and gradients within 3
ulp of torch's over |x| <= 100, as measured in docs/ort-gradients.md.

| ONNX op (torch layer) | written as |
|---|---|
| HardSigmoid(alpha, beta) (nn.Hardsigmoid) | torch's: Where(x <= -3, 0, Where(x >= 3, 1, (x + 3) / 6)) |
| HardSwish (nn.Hardswish) | Where(x <= -3, 0, Where(x >= 3, x * 6 / 6, x * (x + 3) / 6)) |
| Elu(alpha) (nn.ELU) | Where(x > 0, x, alpha * expm1(x <= 0 part)), expm1 a Taylor polynomial near 0 |
| Selu(alpha, gamma) (nn.SELU) | Where(x > 0, gamma * x, (alpha * gamma) * expm1(...)) |
| Celu(alpha) (nn.CELU) | Where(x > 0, x, alpha * expm1(... / alpha)) |
| Softplus (nn.Mish; nn.Softplus by ortflow's symbolic) | max(x, 0) + log1p(exp(-abs(x))), log1p compensated |
| PRelu(x, slope) (nn.PReLU) | Where(x > 0, x, slope * x) |
| DepthToSpace(blocksize, mode) (nn.PixelShuffle) | Reshape, Transpose, Reshape: ONNX's own definition of it |
| Einsum(equation) (torch.einsum) | Transpose, ReduceSum, Reshape, MatMul (accel/graph/einsum.py); not diagonals |

nn.Softplus reaches here only outside an ORT export: ortflow's `aten::softplus` symbolic (accel/graph/symbolics.py)
writes the same decomposition with the module's beta and threshold, which ONNX's Softplus cannot carry.

The ops with no exact rewrite in ops ORT differentiates (Atan, CumSum, ReduceMax, ...) get a gradient of ortflow's
instead: accel/graph/onnx_gradients.py.
"""

from collections.abc import Callable
from typing import Any

import numpy as np
import onnx
import torch
from onnx import TensorProto, helper, numpy_helper
from torch.onnx import symbolic_helper

from ortflow.accel.graph import activations, einsum
from ortflow.accel.graph import plan as graph_plan
from ortflow.accel.graph.onnx_values import attribute, value_types

Emit = Callable[[str, list[str], dict], str]  # (op, inputs, attributes) -> output name
Ints = Callable[[list[int]], str]  # an int64 constant -> its name


def _depth_to_space(node: onnx.NodeProto, emit: Emit, ints: Ints) -> str:
    """ONNX's definition: (N, C*b*b, H, W) viewed as (N, b, b, C, H, W) (mode DCR) or (N, C, b, b, H, W) (CRD),
    transposed to (N, C, H, b, W, b), viewed as (N, C, H*b, W*b). The sizes come from the input's shape at run time
    (a batch left dynamic by the export stays so)."""
    b = attribute(node, "blocksize", 1)
    crd = attribute(node, "mode", b"DCR") == b"CRD"
    x = node.input[0]
    shape = emit("Shape", [x], {})
    n = emit("Slice", [shape, ints([0]), ints([1])], {})
    hw = emit("Slice", [shape, ints([2]), ints([4])], {})
    split = emit("Concat", [n, ints([-1, b, b] if crd else [b, b, -1]), hw], {"axis": 0})
    blocks = emit("Reshape", [x, split], {})
    moved = emit("Transpose", [blocks], {"perm": [0, 1, 4, 2, 5, 3] if crd else [0, 3, 4, 1, 5, 2]})
    merged = emit("Concat", [n, ints([-1]), emit("Mul", [hw, ints([b, b])], {})], {"axis": 0})
    return emit("Reshape", [moved, merged], {})


def _write(
    node: onnx.NodeProto, emit: Emit, const: Callable[[float], str], ints: Ints, ranks: list[int | None]
) -> str | None:
    """The decomposition of `node`, returning the name of the value that replaces its output (None: not one of
    ours, or a form of it left as it is). `ranks`: its inputs' ranks where known."""
    x = node.input[0]
    op = node.op_type
    if op == "HardSigmoid":
        return activations.hardsigmoid(emit, const, x, attribute(node, "alpha", 0.2), attribute(node, "beta", 0.5))
    if op == "HardSwish":
        return activations.hardswish(emit, const, x)
    if op == "Elu":
        return activations.elu_family(emit, const, x, attribute(node, "alpha", 1.0))
    if op == "Selu":  # torch's elu(x, alpha, scale=gamma): alpha * gamma rounded to float32 as its kernel does
        alpha = np.float32(attribute(node, "alpha", 1.67326319217681884765625))
        gamma = np.float32(attribute(node, "gamma", 1.05070102214813232421875))
        return activations.elu_family(emit, const, x, float(alpha * gamma), float(gamma))
    if op == "Celu":  # torch's elu(x, alpha, scale=1, input_scale=1 / alpha)
        alpha = attribute(node, "alpha", 1.0)
        return activations.elu_family(emit, const, x, alpha, input_scale=float(np.float32(1 / alpha)))
    if op == "Softplus":
        return activations.softplus(emit, const, x)
    if op == "PRelu":
        return activations.prelu(emit, const, x, node.input[1])
    if op == "DepthToSpace":
        return _depth_to_space(node, emit, ints)
    if op == "Einsum":
        equation = attribute(node, "equation", b"").decode()
        if (parsed := einsum.parse(equation, ranks)) is None:
            return None
        return einsum.decompose(list(node.input), *parsed, emit, ints)
    return None


OPS = ("HardSigmoid", "HardSwish", "Elu", "Selu", "Celu", "Softplus", "PRelu", "DepthToSpace", "Einsum")


def _rank(type_: onnx.TypeProto | None) -> int | None:
    if type_ is None or not type_.tensor_type.HasField("shape"):
        return None
    return len(type_.tensor_type.shape.dim)


def decompose_ops_without_gradient(model: onnx.ModelProto) -> int:
    """Rewrite every node of `OPS` (default domain) in the forward graph; returns how many."""
    graph = model.graph
    if not any(node.op_type in OPS and node.domain in ("", "ai.onnx") for node in graph.node):
        return 0
    types = value_types(model)
    nodes: list[onnx.NodeProto] = []
    changed = 0
    for node in graph.node:
        if node.op_type not in OPS or node.domain not in ("", "ai.onnx"):
            nodes.append(node)
            continue
        type_ = types.get(node.input[0])
        elem = type_.tensor_type.elem_type if type_ is not None and type_.tensor_type.elem_type else TensorProto.FLOAT
        base = node.name or node.output[0]
        written: list[onnx.NodeProto] = []

        def emit(op: str, inputs: list[str], attrs: dict, base=base, written=written) -> str:
            out = f"{base}/{op}_{len(written)}"
            written.append(helper.make_node(op, inputs, [out], name=out, **attrs))
            return out

        def const(value: float, base=base, written=written, elem=elem) -> str:
            out = f"{base}/const_{len(written)}"
            tensor = helper.make_tensor(out, elem, [], [value])
            written.append(helper.make_node("Constant", [], [out], name=out, value=tensor))
            return out

        def ints(values: list[int], base=base, written=written) -> str:
            out = f"{base}/ints_{len(written)}"
            tensor = numpy_helper.from_array(np.array(values, dtype=np.int64), out)
            written.append(helper.make_node("Constant", [], [out], name=out, value=tensor))
            return out

        ranks = [_rank(types.get(name)) for name in node.input]
        result = _write(node, emit, const, ints, ranks)
        if result is None:  # a form without a decomposition: ORT refuses it as before
            nodes.append(node)
            continue
        last = next(n for n in reversed(written) if result in n.output)
        last.output[0] = node.output[0]  # the last op writes the original output
        nodes.extend(written)
        changed += 1
    del graph.node[:]
    graph.node.extend(nodes)
    return changed


def _rewrite(model: onnx.ModelProto, plan: graph_plan.GraphPlan, work: graph_plan.GraphWork) -> None:
    work.count("ops_without_gradient_decomposed", decompose_ops_without_gradient(model))


def _softplus(plan: graph_plan.GraphPlan, native: Any) -> Any:
    """torch's softplus(x, beta, threshold), written out with the module's beta and threshold (ONNX's Softplus, what
    torch's own symbolic writes, has no threshold, and ORT cannot differentiate it); `native` where they are not
    constants."""

    def symbolic(g: Any, self: Any, beta: Any, threshold: Any) -> Any:
        beta_value = symbolic_helper._maybe_get_const(beta, "f")
        threshold_value = symbolic_helper._maybe_get_const(threshold, "f")
        if not all(isinstance(v, float | int) for v in (beta_value, threshold_value)):
            return native(g, self, beta, threshold)
        scalar_type = symbolic_helper._try_get_scalar_type(self)  # the constants take the input's type
        dtype = scalar_type.dtype() if scalar_type is not None else torch.float32

        def emit(op: str, inputs: list, attributes: dict) -> Any:
            return g.op(op, *inputs)

        def const(value: float) -> Any:
            return g.op("Constant", value_t=torch.tensor(value, dtype=dtype))

        return activations.softplus(emit, const, self, float(beta_value), float(threshold_value))

    return symbolic


graph_plan.one_path(
    "decompositions",
    graph_plan.Path.ort,
    replaces="ops ORT cannot differentiate (HardSwish, Elu, Softplus, PRelu, DepthToSpace, Einsum, ...), written out",
    module=__name__,
    symbolics={"::softplus": _softplus},  # with the module's beta and threshold, which ONNX's Softplus lacks
    rewrite=_rewrite,
)
