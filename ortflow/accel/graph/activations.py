"""Activations ORT 1.19 cannot differentiate (Elu, Selu, Celu, Softplus, HardSigmoid, HardSwish, PRelu), written in
ops it can, to torch's float32 results: torch's formula for the value, torch's conventions at the kinks, and
gradients that ORT's own derivative of the graph computes within a few ulp of torch's backward.

Measured over a grid of 50,000 points with |x| up to 100, values near 0 and every threshold and kink included
(tests/accel/graph/test_decomposition_precision.py, the table in docs/ort-gradients.md): values and gradients within
3 ulp of torch's, except HardSwish's gradient near x = -1.5, where it crosses 0 and torch's own x / 3 + 1/2 cancels.

How, and why so:
- ONNX has no Expm1 or Log1p, and exp(u) - 1, log(1 + w) lose every digit as u, w -> 0. `expm1` takes a degree-7
  Taylor polynomial for -0.3 <= u <= 0 (its first omitted term is under 2^-27 of the result) and Exp(u) - 1 below,
  where |expm1(u)| >= 1/4 and the subtraction loses at most a bit or two. `log1p` adds the rounding error of
  1 + w back (Log(u) + (w - (u - 1)) / u, u = 1 + w), exact to first order.
- Branches are chosen with Where and comparisons written as torch's kernels write them (`x > 0`, `x <= -3`): Min,
  Max, Relu and Clip split or drop the gradient at a tie (Min(x, 0) gave half of ELU's gradient at x = 0, Clip a
  non-zero HardSigmoid gradient at x = -3).
- The branch Where discards is computed too: its inputs are kept finite (the exponential only ever sees u <= 0), so a
  zero gradient there never becomes inf * 0 = NaN.

`emit(op, inputs, attributes)` adds one node and returns its output's name; `const(value)` a scalar of the input's
type. The same functions write the nodes of decompositions.py's graph rewrite and of symbolics.py's Softplus
symbolic (which keeps the module's beta and threshold: the ONNX op has neither).
"""

import math
from collections.abc import Callable

Emit = Callable[[str, list, dict], object]  # (op, inputs, attributes) -> the output's name (or value)
Const = Callable[[float], object]  # a scalar constant of the input's element type

EXPM1_SERIES_FROM = -0.3  # expm1's Taylor polynomial on [EXPM1_SERIES_FROM, 0]
EXPM1_DEGREE = 7
TORCH_HARDSIGMOID = (1 / 6, 0.5)  # (alpha, beta) of torch's nn.Hardsigmoid as its exporter writes them


def expm1(emit: Emit, const: Const, u: object) -> object:
    """exp(u) - 1 for u <= 0 (the ELU family's negative side), within 2 ulp of torch's expm1."""
    series = const(1 / math.factorial(EXPM1_DEGREE))  # u * (1 + u * (1/2 + u * (1/6 + ...))), Horner's scheme
    for k in range(EXPM1_DEGREE - 1, 0, -1):
        series = emit("Add", [emit("Mul", [u, series], {}), const(1 / math.factorial(k))], {})
    series = emit("Mul", [u, series], {})
    direct = emit("Sub", [emit("Exp", [u], {}), const(1.0)], {})
    return emit("Where", [emit("Less", [u, const(EXPM1_SERIES_FROM)], {}), direct, series], {})


def log1p(emit: Emit, const: Const, w: object) -> object:
    """log(1 + w) for 0 <= w <= 1: Log(u) plus the rounding error of u = 1 + w, (w - (u - 1)) / u (exact: w <= 1)."""
    u = emit("Add", [w, const(1.0)], {})
    lost = emit("Sub", [w, emit("Sub", [u, const(1.0)], {})], {})
    return emit("Add", [emit("Log", [u], {}), emit("Div", [lost, u], {})], {})


def elu_family(
    emit: Emit, const: Const, x: object, negcoef: float, poscoef: float = 1.0, input_scale: float = 1.0
) -> object:
    """torch's elu(x, alpha, scale, input_scale): x > 0 ? x * scale : expm1(x * input_scale) * alpha * scale, with
    `negcoef` = alpha * scale (in float32, as torch's kernel multiplies them). Elu: (alpha); Selu: (alpha * gamma,
    gamma); Celu: (alpha, 1, 1 / alpha)."""
    positive = emit("Greater", [x, const(0.0)], {})
    negative = emit("Where", [positive, const(0.0), x], {})  # x <= 0 (the gradient of x there, 1, at 0 too)
    if input_scale != 1.0:
        negative = emit("Mul", [negative, const(input_scale)], {})
    curve = emit("Mul", [expm1(emit, const, negative), const(negcoef)], {})
    line = x if poscoef == 1.0 else emit("Mul", [x, const(poscoef)], {})
    return emit("Where", [positive, line, curve], {})


def log1p_exp(emit: Emit, const: Const, y: object) -> object:
    """log(1 + exp(y)) for every y, never overflowing: max(y, 0) + log1p(exp(-|y|)). Its gradient at y = 0 is 1/2
    (|y| is written with Where: Abs and Relu have a zero gradient at 0)."""
    positive = emit("Greater", [y, const(0.0)], {})
    minus_abs = emit("Where", [positive, emit("Neg", [y], {}), y], {})
    return emit(
        "Add",
        [emit("Where", [positive, y, const(0.0)], {}), log1p(emit, const, emit("Exp", [minus_abs], {}))],
        {},
    )


def softplus(emit: Emit, const: Const, x: object, beta: float = 1.0, threshold: float | None = None) -> object:
    """torch's softplus(x, beta, threshold): x * beta > threshold ? x : log1p(exp(x * beta)) / beta. threshold None:
    ONNX's Softplus, which has none (nn.Mish's: torch's mish has none either)."""
    scaled = x if beta == 1.0 else emit("Mul", [x, const(beta)], {})
    smooth = log1p_exp(emit, const, scaled)
    if beta != 1.0:
        smooth = emit("Div", [smooth, const(beta)], {})
    if threshold is None:
        return smooth
    return emit("Where", [emit("Greater", [scaled, const(threshold)], {}), x, smooth], {})


def hardsigmoid(emit: Emit, const: Const, x: object, alpha: float, beta: float) -> object:
    """max(0, min(1, alpha * x + beta)), gradient alpha strictly inside and 0 at both kinks. torch's (1/6, 1/2) as its
    kernel computes it, (x + 3) / 6: alpha * x + 1/2 cancels near x = -3."""
    if math.isclose(alpha, TORCH_HARDSIGMOID[0], rel_tol=1e-7) and beta == TORCH_HARDSIGMOID[1]:
        low, high = emit("LessOrEqual", [x, const(-3.0)], {}), emit("GreaterOrEqual", [x, const(3.0)], {})
        ramp = emit("Div", [emit("Add", [x, const(3.0)], {}), const(6.0)], {})
    else:
        ramp = emit("Add", [emit("Mul", [x, const(alpha)], {}), const(beta)], {})
        low, high = emit("LessOrEqual", [ramp, const(0.0)], {}), emit("GreaterOrEqual", [ramp, const(1.0)], {})
    return emit("Where", [low, const(0.0), emit("Where", [high, const(1.0), ramp], {})], {})


def hardswish(emit: Emit, const: Const, x: object) -> object:
    """torch's x * min(max(x + 3, 0), 6) / 6, bit for bit; its gradient 0 for x <= -3, 1 for x >= 3 (torch's kinks)."""
    six = const(6.0)
    low, high = emit("LessOrEqual", [x, const(-3.0)], {}), emit("GreaterOrEqual", [x, const(3.0)], {})
    ramp = emit("Div", [emit("Mul", [x, emit("Add", [x, const(3.0)], {})], {}), six], {})
    line = emit("Div", [emit("Mul", [x, six], {}), six], {})  # x * 6 / 6, as torch rounds it
    return emit("Where", [low, const(0.0), emit("Where", [high, line, ramp], {})], {})


def prelu(emit: Emit, const: Const, x: object, slope: object) -> object:
    """x > 0 ? x : slope * x, torch's gradients for both (the slope's at x = 0 included)."""
    return emit("Where", [emit("Greater", [x, const(0.0)], {}), x, emit("Mul", [slope, x], {})], {})
