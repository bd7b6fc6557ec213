"""torch's TorchScript ONNX exporter as the ORT engines use it: the training-mode export and torch's own symbolics,
wherever the installed torch keeps them."""

import contextlib
import contextvars
import importlib
from collections.abc import Callable, Iterator
from pathlib import Path

import torch


# ----------------------------------------------------------------------------------------------- torch side
def export_training_onnx(
    model: torch.nn.Module,
    args: tuple[torch.Tensor, ...],
    path: Path,
    opset: int,
    input_names: list[str],
    output_names: list[str],
) -> None:
    """torch.onnx.export in training mode as ORT's training-artifacts flow expects: parameters kept as
    initializers named like the torch state_dict, no constant folding, dropout kept live.

    Every dimension is static, that of `args` (the engine pads short batches to it). A dynamic batch axis made
    ORT's Reshape gradient wrong: it rebuilds the input's shape from the inferred one, writing 0 ("copy this
    dimension from the input") for the symbolic batch dimension, and the input it copies from is the flattened
    gradient, (B*T, C): a (B, T, C) -> (B*T, C) reshape then fails with "requested shape {B*T,T,C}".
    """
    torch.onnx.export(
        model,
        args,
        str(path),
        input_names=input_names,
        output_names=output_names,
        export_params=True,
        do_constant_folding=False,
        training=torch.onnx.TrainingMode.TRAINING,
        opset_version=opset,
        dynamo=False,  # the TorchScript exporter: the default from torch 2.9 on is the torch.export-based one
    )


def torch_symbolic(module: str, name: str):
    """torch's own ONNX symbolic `name` from its `module` (symbolic_opset9, ...): the TorchScript exporter's modules
    moved under torch.onnx._internal.torchscript_exporter in torch 2.9, and the old names re-export only public ones."""
    for prefix in ("torch.onnx._internal.torchscript_exporter", "torch.onnx"):
        try:
            found = getattr(importlib.import_module(f"{prefix}.{module}"), name, None)
        except ImportError:
            continue
        if found is not None:
            return found
    raise AttributeError(f"torch has no ONNX symbolic {module}.{name}")


def default_symbolic(name: str, opset: int):
    """The symbolic torch's TorchScript exporter itself registers for `aten::name` at `opset` (the newest of its own
    at or below it), whatever custom symbolic is registered over it; None if it has none. Read from its registry
    (registration.registry: its base functions, not the custom overrides), under torch.onnx._internal before torch
    2.9 and under its torchscript_exporter package since."""
    for module in ("torch.onnx._internal.torchscript_exporter.registration", "torch.onnx._internal.registration"):
        try:
            registration = importlib.import_module(module)
            break
        except ImportError:
            continue
    else:
        raise ImportError("torch's TorchScript exporter registry was not found")
    group = registration.registry.get_function_group(f"aten::{name}")
    if group is None:
        return None
    own = {version: fn for version, fn in group._functions._base.items() if version <= opset}
    return own[max(own)] if own else None


# ----------------------------------------------------------------------------------------------- graph passes
# A pass of ortflow's own run on torch's traced graph right before the exporter lowers it to ONNX (where the nodes
# it drops, `aten::detach`, are still there), while `before_lowering` is in force. The exporter calls
# torch._C._jit_pass_onnx through the module each time, so one wrapper set once serves every torch of the range.
_PASS: contextvars.ContextVar[Callable[[torch._C.Graph], None] | None] = contextvars.ContextVar(
    "ortflow_pass_before_onnx", default=None
)


def _install_pass_hook() -> None:
    lowering = torch._C._jit_pass_onnx
    if getattr(lowering, "_ortflow_hook", False):
        return

    def lower(graph, operator_export_type):
        if (run := _PASS.get()) is not None:
            run(graph)
        return lowering(graph, operator_export_type)

    lower._ortflow_hook = True  # type: ignore[attr-defined]
    torch._C._jit_pass_onnx = lower


@contextlib.contextmanager
def before_lowering(graph_pass: Callable[[torch._C.Graph], None]) -> Iterator[None]:
    """While inside: `graph_pass(graph)` runs on each traced TorchScript graph torch exports, before its symbolics
    turn it into ONNX."""
    _install_pass_hook()
    token = _PASS.set(graph_pass)
    try:
        yield
    finally:
        _PASS.reset(token)


@contextlib.contextmanager
def module_backward_hooks_untraced() -> Iterator[None]:
    """While inside: modules' backward hooks are not set up around their calls (torch.utils.hooks.BackwardHook), as
    under torch.no_grad(). A forward traced with grad enabled would wrap them in autograd Functions the tracer cannot
    record ("Error while setting up backward hooks"); an ORT engine runs no module backward hook anyway (it refuses a
    model that has one, ortflow/model/hooks.py)."""
    from torch.utils import hooks

    saved = hooks.BackwardHook.setup_input_hook, hooks.BackwardHook.setup_output_hook
    hooks.BackwardHook.setup_input_hook = lambda self, args: args  # type: ignore[method-assign]
    hooks.BackwardHook.setup_output_hook = lambda self, args: args  # type: ignore[method-assign]
    try:
        yield
    finally:
        hooks.BackwardHook.setup_input_hook, hooks.BackwardHook.setup_output_hook = saved
