"""Autograd's stop-gradients in ORT's graphs: `x.detach()`, and a `torch.no_grad()` or `torch.inference_mode()`
region inside the forward.

torch's exporter writes neither: `h.detach()` becomes plain `h`, and a value computed under `no_grad` is the same ONNX
value as one computed with grad, so ORT's gradient builder would differentiate through them and train another model
than eager's. So, while an ORT engine exports:

- the forward is traced with grad enabled (`traced_with_grad`: ORTModule exports under torch.no_grad()), and every
  torch call made inside a no_grad or inference_mode region gets its tensors that require grad detached first
  (`_NoGradRegions`): the trace records the region's entry as the detach eager's autograd implies;
- just before the exporter lowers the traced graph to ONNX, `mark` turns every `aten::detach` into a stop;
- on the exported graph, `_resolve` drops the stops whose input no trainable parameter reaches (a detach of a buffer,
  a mask, a cache, a frozen weight's product: nothing to stop there) and counts the others.

Each stop is `SequenceAt(SequenceConstruct(x), 0)`: the same values, but an edge carrying a sequence, which ORT's
gradient builder never differentiates through (it builds gradients of tensors only), so nothing flows back into `x`
and nothing is computed for it: eager's gradients exactly. Both are standard ONNX operators ORT runs on every build,
so the fast and the portable target, and the device export, honour stops alike. The cost is two copies of the
stopped value per step.
"""

import contextlib
from collections.abc import Iterator
from typing import Any

import onnx
import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from ortflow.accel.compat import ortmodule_patches
from ortflow.accel.graph import plan as graph_plan

NAME = "stop_gradients"
MARKER = "ortflow::stop_gradient"


def mark(graph: torch._C.Graph) -> int:
    """Make every `aten::detach` of `graph` (and its blocks) a stop (a MARKER node; the rewrite `_resolve` drops those
    whose input carries no gradient). Returns the number of detaches marked."""
    marked = 0
    for nodes in [graph.nodes(), *(block.nodes() for block in _blocks(graph))]:
        for node in list(nodes):
            if node.kind() not in ("aten::detach", "aten::detach_"):
                continue
            stop = graph.create(MARKER, [node.inputsAt(0)], 1)
            stop.output().setType(node.output().type())
            stop.insertBefore(node)
            node.output().replaceAllUsesWith(stop.output())
            node.destroy()
            marked += 1
    return marked


def _blocks(graph: torch._C.Graph) -> list[Any]:
    found = []
    stack = list(graph.nodes())
    while stack:
        node = stack.pop()
        for block in node.blocks():
            found.append(block)
            stack.extend(block.nodes())
    return found


class _NoGradRegions(TorchFunctionMode):
    """While a forward is traced: a torch call made with grad disabled (inside `torch.no_grad()` or
    `torch.inference_mode()`) gets its tensors that require grad detached first, so the trace records the region's
    entry as the detach eager's autograd implies."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not torch.is_grad_enabled():
            args, kwargs = _detached((args, kwargs))
        return func(*args, **kwargs)


def _detached(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach() if value.requires_grad else value
    if isinstance(value, (list, tuple)):
        return type(value)(_detached(v) for v in value)
    if isinstance(value, dict):
        return {k: _detached(v) for k, v in value.items()}
    return value


def _stop_symbolic(plan: graph_plan.GraphPlan, native: Any) -> Any:
    def symbolic(g, value):
        sequence = g.op("SequenceConstruct", value)
        stopped = g.op("SequenceAt", sequence, g.op("Constant", value_t=torch.tensor(0, dtype=torch.int64)))
        stopped.setType(value.type())
        return stopped

    return symbolic


def _dropped(_: Any) -> torch.Tensor:
    raise RuntimeError(
        "the model's forward ran a backward while torch exported it to ONNX: an ONNX graph cannot hold that"
    )


@contextlib.contextmanager
def traced_with_grad(module: nn.Module) -> Iterator[None]:
    """While inside: `module`'s forward runs with grad enabled (ORTModule exports under torch.no_grad(), where every
    traced value would say it requires no grad and a no_grad region could not be told from the rest). No tensor is
    saved for a backward the trace never runs: autograd keeping every activation made the export's peak an fp32
    training step's (GPT-2-124M shape, batch 8 x 256: 4.7 GB above the model)."""
    previous: list[bool] = []

    modes: list[contextlib.ExitStack] = []

    def enable(mod: nn.Module, args: Any) -> None:
        previous.append(torch.is_grad_enabled())
        if ortmodule_patches.PROBING_OUTPUTS.get():  # not the trace: ORTModule's forward that learns the outputs
            modes.append(contextlib.ExitStack())
            return
        torch.set_grad_enabled(True)
        stack = contextlib.ExitStack()
        stack.enter_context(_NoGradRegions())
        stack.enter_context(torch.autograd.graph.saved_tensors_hooks(lambda _: None, _dropped))
        modes.append(stack)

    def restore(mod: nn.Module, args: Any, output: Any) -> None:
        modes.pop().close()
        torch.set_grad_enabled(previous.pop())

    handles = [module.register_forward_pre_hook(enable), module.register_forward_hook(restore)]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()
        while modes:  # the forward raised: its modes were not left (the grad mode, the exporter's no_grad restores)
            modes.pop().close()


def _stops(model: onnx.ModelProto) -> dict[str, tuple[str, str]]:
    """The stops of an exported graph, by the value each gives: (the sequence it reads, the value stopped)."""
    made = {n.output[0]: n.input[0] for n in model.graph.node if n.op_type == "SequenceConstruct" and len(n.input) == 1}
    return {
        n.output[0]: (n.input[0], made[n.input[0]])
        for n in model.graph.node
        if n.op_type == "SequenceAt" and n.input[0] in made
    }


def _resolve(model: onnx.ModelProto, plan: graph_plan.GraphPlan, work: graph_plan.GraphWork) -> None:
    """Drop the stops whose input no trainable parameter reaches (a buffer's detach, a mask's, a frozen weight's):
    nothing to stop there. Count the others."""
    graph = model.graph
    reached = set(work.trainable)
    for node in graph.node:  # the exporter writes nodes in a topological order
        if any(name in reached for name in node.input):
            reached.update(node.output)
    found = _stops(model)
    dropped = {value: stopped for value, (_, stopped) in found.items() if stopped not in reached}
    if dropped:
        written = set(dropped) | {found[value][0] for value in dropped}  # each stop's SequenceAt and SequenceConstruct
        kept = [n for n in graph.node if not (n.output and n.output[0] in written)]
        del graph.node[:]
        graph.node.extend(kept)
        for node in graph.node:
            for i, name in enumerate(node.input):
                if name in dropped:
                    node.input[i] = dropped[name]
        for output in graph.output:
            if output.name in dropped:  # a graph output that is a stopped value keeps its name: an Identity
                graph.node.append(onnx.helper.make_node("Identity", [dropped[output.name]], [output.name]))
    work.count(NAME, len(found) - len(dropped))


OP = graph_plan.one_path(
    NAME,
    graph_plan.Path.ort,
    replaces="detach(), no_grad regions and other stop-gradients, which torch's export drops",
    module=__name__,
    symbolics={MARKER: _stop_symbolic},
    rewrite=_resolve,
)
