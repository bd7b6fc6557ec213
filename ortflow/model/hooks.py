"""What torch runs in a training step besides the forward's operations, found before the first step: hooks on parameters
and modules, torch's global module hooks, gradient hooks a forward registers, and state a training forward changes in
place (buffers, parameters, attributes).

Eager PyTorch runs all of it. An ONNX Runtime engine runs the graphs it exported: torch runs the model's forward
once, to export it, and never runs its backward, so a hook or a state update the graphs do not hold would run only at
export, or never. Each engine declares the kinds it runs as eager does (its module's RUNS_IN_STEP: ORTModule's
gradients reach the parameters through torch's autograd, so parameter hooks fire as in eager; a forward hook that
transforms outputs is traced into the graph, as is a reparametrisation like weight_norm's pre-hook) and refuses the
rest before the first step, naming the module, the parameter or buffer and the hook (`refuse_unrun`). The table of
kinds against engines: docs/models.md ("Hooks and state a training step changes"). BatchNorm's running statistics are
not in it: both ORT engines keep them as eager does (ortflow/accel/graph/batchnorm.py).

How state updates are found: two training-mode forwards of the example batch, from the same torch seed; what the
second one changes (the first may fill caches once) is a state update, and outputs that differ between the two mean
the forward depends on state it changes or on random numbers drawn outside torch. The model is left as it was.
"""

import copy
import logging
import math
import traceback
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.nn.modules import module as torch_module
from torch.nn.modules.batchnorm import _BatchNorm
from torch.overrides import TorchFunctionMode

from ortflow.errors import ModelError
from ortflow.step.batch import Inputs, layout_of

log = logging.getLogger(__name__)


class Kind(Enum):
    """What torch runs in a step besides the forward's operations (the rows of the docs' table)."""

    parameter_hook = "gradient hook on a parameter (Tensor.register_hook)"
    post_accumulate_hook = "post-accumulate-grad hook on a parameter (register_post_accumulate_grad_hook)"
    backward_hook = "module backward hook (register_full_backward_hook)"
    backward_pre_hook = "module backward pre-hook (register_full_backward_pre_hook)"
    legacy_backward_hook = "module backward hook (register_backward_hook)"
    global_hook = "global module hook (torch.nn.modules.module.register_module_*_hook)"
    hook_in_forward = "gradient hook registered by the forward on a tensor it computes"
    state_update = "parameter, buffer or attribute a training forward changes in place (a counter, spectral_norm's u)"
    stateful_forward = "training forward whose outputs change from one call to the next on the same batch"


# Why an ONNX Runtime engine cannot run each kind.
_WHY = {
    Kind.parameter_hook: "ONNX Runtime computes and applies the gradients inside its own graphs, so they never reach "
    "the parameter in torch and its hooks never run",
    Kind.backward_hook: "ONNX Runtime runs the whole backward as one graph, so torch never runs a module's backward "
    "and its backward hooks never run",
    Kind.global_hook: "torch calls them around every module call, and ONNX Runtime runs the model as one graph, so "
    "they would run only while the model is exported",
    Kind.state_update: "ONNX Runtime runs the exported graph, which computes the outputs but writes no state back: "
    "torch runs the forward only once, to export it, so the update would happen once instead of every step",
}
_WHY[Kind.post_accumulate_hook] = _WHY[Kind.parameter_hook]
_WHY[Kind.backward_pre_hook] = _WHY[Kind.legacy_backward_hook] = _WHY[Kind.backward_hook]
_WHY[Kind.hook_in_forward] = (
    "torch runs the forward only once, to export it, and never runs the backward of ONNX Runtime's graph, so the hook "
    "would never run"
)
_WHY[Kind.stateful_forward] = (
    "the exported graph freezes whatever the forward read when it was exported, so every step would compute what the "
    "first one did"
)


@dataclass(frozen=True)
class Finding:
    kind: Kind
    what: str  # the parameter, buffer, attribute or module, and the hook: "parameter '0.weight' (hook mask)"


def hook_name(hook: Any) -> str:
    """A hook as a user recognises it: its function's qualified name, or its class (torch's SpectralNorm)."""
    inner = getattr(hook, "func", hook)  # functools.partial
    name = getattr(inner, "__qualname__", None) or type(inner).__name__
    owner = getattr(inner, "__module__", None)
    return f"{owner}.{name}" if owner and owner not in ("builtins", "__main__") else name


def _label(name: str, module: nn.Module) -> str:
    return f"module '{name}' ({type(module).__name__})" if name else f"the model ({type(module).__name__})"


def _hooks(hooks: dict | None) -> str:
    return ", ".join(hook_name(h) for h in (hooks or {}).values())


def registered_hooks(model: nn.Module) -> list[Finding]:
    """The hooks registered on the model's parameters and modules, and torch's global module hooks, that torch runs
    in the backward (or around every module call, for the global ones). Forward hooks on the model's modules are not
    listed: they are traced into an exported graph; their side effects are found by `state_updates`."""
    found = []
    for name, p in model.named_parameters():
        if p._backward_hooks:
            found.append(Finding(Kind.parameter_hook, f"parameter '{name}' (hook {_hooks(p._backward_hooks)})"))
        if p._post_accumulate_grad_hooks:
            hooks = _hooks(p._post_accumulate_grad_hooks)
            found.append(Finding(Kind.post_accumulate_hook, f"parameter '{name}' (hook {hooks})"))
    for name, module in model.named_modules():
        if module._backward_hooks:
            kind = Kind.backward_hook if module._is_full_backward_hook else Kind.legacy_backward_hook
            found.append(Finding(kind, f"{_label(name, module)} (hook {_hooks(module._backward_hooks)})"))
        if module._backward_pre_hooks:
            hooks = _hooks(module._backward_pre_hooks)
            found.append(Finding(Kind.backward_pre_hook, f"{_label(name, module)} (hook {hooks})"))
    for kind, hooks in (
        ("forward", torch_module._global_forward_hooks),
        ("forward pre-", torch_module._global_forward_pre_hooks),
        ("backward", torch_module._global_backward_hooks),
        ("backward pre-", torch_module._global_backward_pre_hooks),
    ):
        if hooks:
            found.append(Finding(Kind.global_hook, f"every module: global {kind}hook {_hooks(hooks)}"))
    return found


# ------------------------------------------------------------------------------------ what a training forward changes
_REGISTRATIONS = (torch.Tensor.register_hook, torch.Tensor.register_post_accumulate_grad_hook)
_TORCH_DIR = str(Path(torch.__file__).parent)


def _caller() -> str:
    """file:line of the innermost frame outside torch and this module (where the forward registered a hook)."""
    for frame in reversed(traceback.extract_stack()):
        if not frame.filename.startswith(_TORCH_DIR) and frame.filename != __file__:
            return f"{Path(frame.filename).name}:{frame.lineno}"
    return "?"


class _RegisteredHooks(TorchFunctionMode):
    """Records the gradient hooks registered while it is active (Tensor.register_hook goes through torch functions)."""

    def __init__(self) -> None:
        super().__init__()
        self.found: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _REGISTRATIONS:
            hook = args[1] if len(args) > 1 else kwargs.get("hook")
            self.found.append(f"{func.__name__}({hook_name(hook)}) at {_caller()}")
        return func(*args, **kwargs)


PROBE_SAMPLES = 2  # the probe's forwards take the example batch's first samples (two: BatchNorm1d needs more than one)
_TORCH_SLOTS = frozenset(vars(nn.Module()))  # what torch itself keeps in every module's __dict__


def _fingerprint(value: Any) -> Any:
    """What changes when an attribute changes in place or is rebound to another value (a tensor rebound to a new one,
    as weight_norm's pre-hook does every forward, is not a change: outputs that depend on it are)."""
    if isinstance(value, torch.Tensor):
        return ("tensor", value._version)
    if isinstance(value, bool | int | str | bytes | complex | Enum | type(None)):
        return value
    if isinstance(value, float):
        return "nan" if math.isnan(value) else value
    if isinstance(value, set | frozenset):
        return ("set", frozenset(value))
    if isinstance(value, list | tuple | dict):
        items = value.items() if isinstance(value, dict) else enumerate(value)
        inner = tuple((k, v if isinstance(v, int | float | str | bool) else id(v)) for k, v in items)
        return (type(value).__name__, inner)
    return ("object", id(value))


def _attributes(model: nn.Module) -> dict[tuple[str, str], Any]:
    return {
        (name, key): _fingerprint(value)
        for name, module in model.named_modules()
        for key, value in vars(module).items()
        if key not in _TORCH_SLOTS
    }


class _Kept:
    """Every module's attributes (with a copy of the containers' items and of plain tensors) and buffers, to restore
    after the probe's forwards."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.modules = list(model.modules())
        self.training = [m.training for m in self.modules]  # each module's own mode (a frozen part kept in eval)
        self.attributes = [
            {k: (v, _fingerprint(v), _copy(v)) for k, v in vars(m).items() if k not in _TORCH_SLOTS}
            for m in self.modules
        ]
        self.buffers = {name: b.clone() for name, b in model.named_buffers()}

    @torch.no_grad()
    def restore(self) -> None:
        for module, training in zip(self.modules, self.training, strict=True):
            module.training = training
        for module, kept in zip(self.modules, self.attributes, strict=True):
            for key in [k for k in vars(module) if k not in _TORCH_SLOTS and k not in kept]:
                del module.__dict__[key]  # added by the forward
            for key, (value, fingerprint, saved) in kept.items():
                module.__dict__[key] = value  # rebound by the forward: the object it held before
                if saved is None or _fingerprint(value) == fingerprint:
                    continue
                if isinstance(value, torch.Tensor):
                    value.copy_(saved)
                elif isinstance(value, list):
                    value[:] = saved
                else:  # dict or set
                    value.clear()
                    value.update(saved)
        for name, b in self.model.named_buffers():
            if name in self.buffers:
                b.copy_(self.buffers[name])


def _copy(value: Any) -> Any:
    """What restores `value`'s contents after an in-place change (None: identity alone restores it)."""
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, list | dict | set):
        return copy.copy(value)
    return None


def _tensors(value: Any) -> Iterator[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        yield value.detach()
    elif isinstance(value, list | tuple):
        for item in value:
            yield from _tensors(item)
    elif isinstance(value, dict):
        for item in value.values():
            yield from _tensors(item)


def _same_outputs(first: Any, second: Any) -> bool:
    a, b = list(_tensors(first)), list(_tensors(second))
    if len(a) != len(b):
        return False
    for x, y in zip(a, b, strict=True):
        if x.shape != y.shape or x.dtype != y.dtype:
            return False
        if x.is_floating_point():
            if not torch.allclose(x, y, rtol=1e-5, atol=1e-6 * float(y.abs().max().clamp(min=1.0)), equal_nan=True):
                return False
        elif not torch.equal(x, y):
            return False
    return True


def _checksums(model: nn.Module) -> dict[str, tuple[int, str, str]]:
    """What changes when a parameter changes in place (through `.data` too, which leaves its version as it was); as
    strings, so that a NaN equals itself."""
    with torch.no_grad():
        return {n: (p._version, str(float(p.sum())), str(float(p.norm()))) for n, p in model.named_parameters()}


def _kept_by_engines(model: nn.Module) -> set[str]:
    """Buffers every engine keeps as eager does: tracking BatchNorms' running statistics (accel/graph/batchnorm.py)."""
    return {
        f"{name}.{buffer}" if name else buffer
        for name, module in model.named_modules()
        if isinstance(module, _BatchNorm) and module.track_running_stats
        for buffer in ("running_mean", "running_var", "num_batches_tracked")
    }


def _forward_hooks(modules: dict[str, nn.Module], name: str) -> str:
    """The forward hooks of the module that owns `name` (a buffer or attribute's module), for the message."""
    module = modules.get(name)
    if module is None:
        return ""
    hooks = [f"forward pre-hook {hook_name(h)}" for h in module._forward_pre_hooks.values()]
    hooks += [f"forward hook {hook_name(h)}" for h in module._forward_hooks.values()]
    return f"; {_label(name, module)} has {', '.join(hooks)}" if hooks else ""


def state_updates(model: nn.Module, inputs: Inputs) -> list[Finding]:
    """What two training-mode forwards of `inputs` show: gradient hooks the forward registers, parameters, buffers
    and attributes the second forward changes in place (BatchNorm's running statistics apart), and outputs that
    differ between the two (from the same torch seed). Every module's mode, buffers and attributes are restored and
    torch's random state is left as it was."""
    layout = layout_of(inputs)
    tensors = tuple(t[:PROBE_SAMPLES] for t in layout.flatten(inputs))  # what a forward changes does not need more
    modules = dict(model.named_modules())
    kept = _Kept(model)
    hooks = _RegisteredHooks()
    model.train()
    try:
        with torch.random.fork_rng(devices=[]), hooks, torch.enable_grad():
            torch.manual_seed(0)
            first = _detached(layout.call(model, tensors))
            buffers = {name: b.clone() for name, b in model.named_buffers()}
            attributes, sums = _attributes(model), _checksums(model)
            torch.manual_seed(0)
            second = _detached(layout.call(model, tensors))
        found = [Finding(Kind.hook_in_forward, f"the forward calls {hook}") for hook in dict.fromkeys(hooks.found)]
        skip = _kept_by_engines(model)
        for name, b in model.named_buffers():
            if name in buffers and name not in skip and not torch.equal(b, buffers[name]):
                owner = name.rpartition(".")[0]
                found.append(Finding(Kind.state_update, f"buffer '{name}'{_forward_hooks(modules, owner)}"))
        for name, checksum in _checksums(model).items():
            if sums.get(name) != checksum:
                found.append(Finding(Kind.state_update, f"parameter '{name}'"))
        for (owner, key), value in _attributes(model).items():
            if attributes.get((owner, key), value) != value:
                label = f"{owner}.{key}" if owner else key
                found.append(Finding(Kind.state_update, f"attribute '{label}'{_forward_hooks(modules, owner)}"))
        if not _same_outputs(first, second):
            found.append(Finding(Kind.stateful_forward, f"the model ({type(model).__name__})"))
        return found
    finally:
        kept.restore()


def _detached(output: Any) -> Any:
    if isinstance(output, torch.Tensor):
        return output.detach()
    if isinstance(output, list | tuple):
        return type(output)(_detached(o) for o in output) if isinstance(output, list) else tuple(map(_detached, output))
    if isinstance(output, dict):
        return {k: _detached(v) for k, v in output.items()}
    return output


# ------------------------------------------------------------------------------------------------------- refusal
def refuse_unrun(
    model: nn.Module,
    inputs: Inputs,
    mode: str,
    engines: dict[str, frozenset[Kind]],
    why: dict[Kind, str] | None = None,
) -> None:
    """Refuse, before the first step, a model whose step runs something engine `mode` cannot run as eager does
    (`engines`: each engine's name and the kinds it runs), naming each parameter, buffer, attribute or module and its
    hook, why (`why`: the engine's own reasons; by default an ONNX Runtime engine's), and which engines run it.

    Raises:
        ModelError: one paragraph listing everything found.
    """
    runs = engines.get(mode, frozenset())
    found = registered_hooks(model)
    if any(kind not in runs for kind in (Kind.hook_in_forward, Kind.state_update, Kind.stateful_forward)):
        found += state_updates(model, inputs)
    unrun = [f for f in found if f.kind not in runs]
    if not unrun:
        if found:
            log.info("accel=%s runs as eager PyTorch does: %s", mode, "; ".join(f.what for f in found))
        return
    kinds = list(dict.fromkeys(f.kind for f in unrun))
    listed = "; ".join(f"{k.value}: {', '.join(f.what for f in unrun if f.kind == k)}" for k in kinds)
    reasons = _WHY | (why or {})
    why_text = "; ".join(dict.fromkeys(reasons[k] for k in kinds))
    others = [m for m, kept in engines.items() if m != mode and all(k in kept for k in kinds)]
    instead = " or ".join(f"accel={m}" for m in others)
    them = "them" if len(unrun) > 1 else "it"
    alternatives = f"Use {instead}, which run{'s' if len(others) == 1 else ''} {them} as eager PyTorch does, or take"
    raise ModelError(
        f"accel={mode} cannot train this model as eager PyTorch does: {listed}. With accel={mode}, {why_text}. "
        f"{alternatives if others else 'Take'} {them} out of the model."
    )


def copy_model(model: nn.Module) -> nn.Module:
    """A deep copy of `model` that keeps its parameters' hooks (copy.deepcopy drops them: nn.Parameter's deepcopy
    makes a new Parameter from the data alone)."""
    copied = copy.deepcopy(model)
    originals = dict(model.named_parameters())
    for name, p in copied.named_parameters():
        source = originals[name]
        if source._backward_hooks:
            p._backward_hooks = OrderedDict(source._backward_hooks)
        if source._post_accumulate_grad_hooks:
            p._post_accumulate_grad_hooks = OrderedDict(source._post_accumulate_grad_hooks)
    return copied
