"""Autograd's stop-gradients in ORT's graphs: `x.detach()`, a `torch.no_grad()` or `torch.inference_mode()` region
inside the forward, and any other op whose output torch says carries no gradient though its input does.

torch's exporter writes none of them: `h.detach()` becomes plain `h`, and a value computed under `no_grad` is the
same ONNX value as one computed with grad, so ORT's gradient builder would differentiate through them and train
another model than eager's. What autograd knew is still in the traced graph, just before the exporter lowers it to
ONNX: each value's `requires_grad`, as the trace (run with grad enabled: `traced_with_grad`) computed it. There
`mark` puts a stop on every edge where a value that requires grad enters an op whose floating-point outputs do not
(a detach, the first op of a no_grad region reading a trainable value, a non-differentiable op), and only there: a
detach of what carries no gradient (a buffer, a mask, a cache, a frozen weight's product) is left to the exporter,
which drops it, as before.

Each stop is `SequenceAt(SequenceConstruct(x), 0)`: the same values, but an edge carrying a sequence, which ORT's
gradient builder never differentiates through (it builds gradients of tensors only), so nothing flows back into `x`
and nothing is computed for it: eager's gradients exactly. Both are standard ONNX operators ORT runs on every
build, so the fast and the portable target, and the device export, honour stops alike. The cost is two copies of the
stopped value per step.
"""

import contextlib
from collections.abc import Iterator
from typing import Any

import onnx
import torch
from torch import nn

from ortflow.accel.graph import plan as graph_plan

NAME = "stop_gradients"
MARKER = "ortflow::stop_gradient"
_FLOATS = {"Float", "Double", "Half", "BFloat16"}


def _requires_grad(value: torch._C.Value) -> bool | None:
    """Whether a float tensor value required grad when traced (None: not a float tensor, or not known)."""
    kind = value.type()
    if not isinstance(kind, torch._C.TensorType) or kind.scalarType() not in _FLOATS:
        return None
    return value.requiresGrad()


def _no_gradient_out(node: torch._C.Node) -> bool:
    """Whether an op gives none of its float outputs a gradient (factories shaped like their input excepted: their
    export reads only the shape, already a stop in ORT)."""
    kind = node.kind()
    if kind == MARKER or kind.endswith("_like") or kind.startswith("aten::new_"):
        return False
    flags = [_requires_grad(v) for v in node.outputs() if _is_float(v)]
    return bool(flags) and all(flag is False for flag in flags)


def _is_float(value: torch._C.Value) -> bool:
    kind = value.type()
    return isinstance(kind, torch._C.TensorType) and kind.scalarType() in _FLOATS


def mark(graph: torch._C.Graph) -> int:
    """Put a stop (a MARKER node) on every input edge of `graph` (and its blocks) where a value that requires grad
    enters an op that gives no gradient out. Returns the number of stops."""
    stops = 0
    for nodes in [graph.nodes(), *(block.nodes() for block in _blocks(graph))]:
        for node in list(nodes):
            if not _no_gradient_out(node):
                continue
            for index, value in enumerate(list(node.inputs())):
                if _requires_grad(value):
                    stop = graph.create(MARKER, [value], 1)
                    stop.output().setType(value.type())
                    stop.insertBefore(node)
                    node.replaceInput(index, stop.output())
                    stops += 1
    return stops


def _blocks(graph: torch._C.Graph) -> list[Any]:
    found = []
    stack = list(graph.nodes())
    while stack:
        node = stack.pop()
        for block in node.blocks():
            found.append(block)
            stack.extend(block.nodes())
    return found


def _stop_symbolic(plan: graph_plan.GraphPlan, native: Any) -> Any:
    def symbolic(g, value):
        sequence = g.op("SequenceConstruct", value)
        stopped = g.op("SequenceAt", sequence, g.op("Constant", value_t=torch.tensor(0, dtype=torch.int64)))
        stopped.setType(value.type())
        return stopped

    return symbolic


@contextlib.contextmanager
def traced_with_grad(module: nn.Module) -> Iterator[None]:
    """While inside: `module`'s forward runs with grad enabled (ORTModule exports under torch.no_grad(), where every
    traced value would say it requires no grad and a no_grad region could not be told from the rest)."""
    previous: list[bool] = []

    def enable(mod: nn.Module, args: Any) -> None:
        previous.append(torch.is_grad_enabled())
        torch.set_grad_enabled(True)

    def restore(mod: nn.Module, args: Any, output: Any) -> None:
        torch.set_grad_enabled(previous.pop())

    handles = [module.register_forward_pre_hook(enable), module.register_forward_hook(restore)]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()
        if previous:  # the forward raised: its grad mode was not restored
            torch.set_grad_enabled(previous[0])


def stops(model: onnx.ModelProto) -> list[onnx.NodeProto]:
    """The stops of an exported graph: SequenceAt nodes reading a one-tensor SequenceConstruct."""
    made = {n.output[0] for n in model.graph.node if n.op_type == "SequenceConstruct" and len(n.input) == 1}
    return [n for n in model.graph.node if n.op_type == "SequenceAt" and n.input[0] in made]


def _count(model: onnx.ModelProto, plan: graph_plan.GraphPlan, work: graph_plan.GraphWork) -> None:
    work.count(NAME, len(stops(model)))


OP = graph_plan.declare(
    graph_plan.GraphOp(
        NAME,
        replaces="detach(), no_grad regions and other stop-gradients, which torch's export drops",
        module=__name__,
        paths=(graph_plan.Path.ort,),
        choose=lambda settings, precision, engine: graph_plan.Path.ort,
        symbolics={MARKER: _stop_symbolic},
        rewrite=_count,
    )
)
