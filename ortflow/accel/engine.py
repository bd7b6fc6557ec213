"""The Engine protocol (everything the loop needs, whichever runtime executes the model), each optional capability
an engine may offer (a small runtime-checkable protocol the loop, ortflow-check, ortflow-bench and accel=auto test
with isinstance), the EngineContext an engine is built from, and the loss/eval helpers every engine shares."""

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, TypeVar, runtime_checkable

import torch
from torch import nn

from ortflow.config import FP32, DebugConfig, OptimConfig
from ortflow.errors import OrtflowError
from ortflow.model import hooks
from ortflow.step.batch import Inputs, Layout, layout_of, pad_rows
from ortflow.step.loss import CrossEntropy, EvalResult, Loss
from ortflow.step.steps import StepsFactory, TorchSteps


def _no_wrappers(module: nn.Module) -> nn.Module:
    return module


@dataclass
class EngineContext:
    """Everything the runner hands an engine builder besides the engine's own settings (conf/accel/<mode>.yaml): the
    shared training settings an engine needs, typed, never the whole run config.

    Attributes:
        model: the user's torch model, with its initial (or resumed) weights.
        example: one (inputs, targets) batch of the training batch size, taken without drawing from the training
            loader's generator (the data order stays the same in every accel mode). Its inputs' structure (one
            tensor, a tuple or a dict of tensors) is the one every batch has.
        loss: the loss group's Loss (ortflow/step/loss.py), used identically by every engine.
        optim: the optim group (ortflow/step/optim.py); an engine either builds torch.optim from it or bakes it in.
        grad_clip: max global gradient norm, or None.
        debug: the debug group; an engine that cannot honour a debug option refuses it in its `problems`.
        onnx_dir: where the engine may write ONNX files (inside the run dir).
        wrap: the distributed wrappers (DDP) to apply around the engine's own module, outermost last.
        reduce_loss: turns this process's loss into the global one (the mean over ranks); None for one process.
        accumulate: micro-batches per optimizer step (trainer.accumulate_grad_batches); with more than 1 the loop
            calls `train_micro`.
        precision: FP32 or BF16 (trainer.precision; AUTO reaches only accel.build, which measures or resolves it):
            with BF16 an engine computes matrix multiplies, linear layers and convolutions in bf16 as torch's CPU
            autocast does; weights, optimizer state, normalisation, softmax, losses and reductions stay fp32.
        max_steps: trainer.max_steps, the steps the run trains (accel=auto weighs one-time costs, the export and the
            sessions, against it); None: unknown.
        refusals: each engine's own reasons it cannot run this run's config, by engine name (its `problems(cfg)`,
            catalog.refusals): accel=auto probes only the candidates with none. The one thing that still reads the
            run config, as a function over it: an engine's check reads any of it (the optimizer, debug options,
            distributed wrappers). None: no candidate is ruled out (a context built without a run config).
    """

    model: nn.Module
    example: tuple[Inputs, torch.Tensor]
    optim: OptimConfig
    loss: Loss = field(default_factory=CrossEntropy)
    grad_clip: float | None = None
    debug: DebugConfig | None = None
    onnx_dir: Path = field(default_factory=lambda: Path("onnx"))
    wrap: Callable[[nn.Module], nn.Module] = _no_wrappers
    reduce_loss: Callable[[float], float] | None = None
    accumulate: int = 1
    # The optimizer side of an eager engine, from (module, optim, grad_clip): torch.optim (TorchSteps), or DeepSpeed's
    # engine that takes module and optimizer together (distributed=deepspeed: ortflow/step/deepspeed.py).
    steps: StepsFactory = TorchSteps
    precision: str = FP32
    max_steps: int | None = None
    refusals: Callable[[str], list[str]] | None = None
    resumed_choice: dict[str, Any] | None = None  # accel=auto's choice recorded in the checkpoint being resumed
    # What each engine the config tree offers runs of a model's step as eager does (accel/catalog.py: runs_in_step),
    # so that a refusal names the engines that run what it refuses; accel.build fills it.
    engines_run: Mapping[str, frozenset] = field(default_factory=dict)

    def refuse_unrun(self, name: str, runs: frozenset, why: dict | None = None) -> None:
        """Refuse, before the first step, what engine `name` (which runs `runs` of ortflow/model/hooks.py's kinds as
        eager does; `why`: its own reasons) cannot run of the model's step, naming the engines that run it.

        Raises:
            ModelError: one paragraph listing the model's hooks and state updates the engine would not run.
        """
        hooks.refuse_unrun(self.model, self.example[0], name, {**self.engines_run, name: runs}, why)

    @property
    def layout(self) -> Layout:
        return layout_of(self.example[0])

    @property
    def batch_size(self) -> int:
        return self.layout.flatten(self.example[0])[0].size(0)


@runtime_checkable
class Engine(Protocol):
    """What the loop talks to. Built-in implementations: accel/none.py, accel/ortmodule.py, accel/artifacts.py,
    accel/compile.py. The optional capabilities (CAPABILITIES) are tested with isinstance, never by attribute."""

    name: str

    def train_step(self, inputs: Inputs, targets: torch.Tensor) -> float:
        """Forward, backward and optimizer step on one batch; returns the batch's mean loss.

        A NaN or infinite loss, or gradients whose global norm is not finite (reported as `last_grad_norm`), leave the
        weights and the optimizer untouched (the step is not applied); the loop then stops or skips the step."""
        ...

    # The optional capabilities an engine may add are the protocols below (MicroBatches, GradNorm, Shards, ...).

    def eval_step(self, inputs: Inputs, targets: torch.Tensor) -> EvalResult:
        """Loss and metric sums on one batch (Loss.sums), in eval mode, without touching the parameters."""
        ...

    def set_lr(self, lr: float) -> None: ...

    def model_state_dict(self) -> dict[str, torch.Tensor]:
        """The current weights under the torch model's own state_dict names."""
        ...

    def optimizer_state(self) -> dict[str, Any]:
        """The optimizer's state as this engine keeps it, tagged {"format": "torch" | "onnxruntime", ...}."""
        ...

    def load_optimizer_state(self, state: dict[str, Any]) -> bool:
        """Restore a state from optimizer_state(); False if it is the other runtime's format (the optimizer then
        starts fresh: torch.optim and ORT's optimizer graphs keep their moments in forms that do not convert)."""
        ...

    def describe(self) -> dict[str, Any]:
        """What really executed so far (runtime, counts of ORT runs, fallbacks) for logs and metadata."""
        ...


@runtime_checkable
class MicroBatches(Protocol):
    """Gradient accumulation (trainer.accumulate_grad_batches > 1: the loop refuses an engine without it)."""

    def train_micro(self, micro: Sequence[tuple[Inputs, torch.Tensor]]) -> float:
        """One optimizer step over the micro-batches; returns their mean loss (train_step's guard applies)."""
        ...


@runtime_checkable
class GradNorm(Protocol):
    """The global gradient norm of the last step before clipping, or None (NaN/inf: the step was not applied); the
    loop logs it and its non-finite guard reads it."""

    last_grad_norm: float | None


@runtime_checkable
class Shards(Protocol):
    """State a rank keeps for itself (DeepSpeed's ZeRO partitions), which its optimizer_state() names by folder."""

    def save_shards(self, directory: Path) -> None:
        """Called on every rank before rank 0 writes a checkpoint."""
        ...


@runtime_checkable
class Chosen(Protocol):
    """An engine that chose another to train with (accel=auto, trainer.precision=auto): its choice, which the run
    header, run.json and every checkpoint record ({"accel", "precision", "by", "title", ...})."""

    choice: dict[str, Any]


@runtime_checkable
class Wraps(Protocol):
    """An engine whose optimizer half is another engine (ORTModule's: the eager engine around ORTModule), which
    ortflow-check reads the model and the optimizer of."""

    inner: Any


@runtime_checkable
class UserModel(Protocol):
    """An engine that keeps the user's torch model (the owner of the state_dict names) as `model`: ortflow-check reads
    which parameters train, and which names are buffers, from it."""

    model: nn.Module


@runtime_checkable
class TorchStepped(UserModel, Protocol):
    """An engine stepped by an optimizer on the user's model (eager, compile, ORTModule's inner: torch.optim):
    ortflow-check reads the first step's gradients from the parameters when `optimizer` is torch's."""

    optimizer: Any


@runtime_checkable
class OrtState(Protocol):
    """The artifacts engine's side of ORT training: its CheckpointState (`state.parameters[name].grad`), the graph
    names of the trainable parameters, and the optimizer ortflow-check wraps to read the gradients before a step."""

    state: Any
    trainable: Sequence[str]
    optimizer: Any


# The capabilities a wrapping engine (accel=auto's AutoEngine, ortflow-bench's Timed) forwards exactly where the
# engine it wraps has them (`forwarding`).
CAPABILITIES: tuple[type, ...] = (MicroBatches, GradNorm, Shards, Chosen, Wraps, UserModel, TorchStepped, OrtState)


def _members(capability: type) -> list[str]:
    """A capability protocol's members (its own and those it extends): its annotated attributes and its methods."""
    names = [n for k in capability.__mro__ for n in (*vars(k).get("__annotations__", {}), *vars(k))]
    return list(dict.fromkeys(n for n in names if not n.startswith("_")))


def _forwarded(name: str) -> property:
    def read(self: "Wrapper") -> Any:
        return getattr(self.wrapped, name)

    def write(self: "Wrapper", value: Any) -> None:
        setattr(self.wrapped, name, value)

    return property(read, write, doc=f"the wrapped engine's {name}")


class Wrapper:
    """An engine around another one: the required methods go to `wrapped`; the optional capabilities are there
    exactly when the wrapped engine has them (build one with `forwarding`), none found by `__getattr__`."""

    def __init__(self, wrapped: Engine) -> None:
        self.wrapped = wrapped

    @property
    def name(self) -> str:
        return self.wrapped.name

    def train_step(self, inputs: Inputs, targets: torch.Tensor) -> float:
        return self.wrapped.train_step(inputs, targets)

    def eval_step(self, inputs: Inputs, targets: torch.Tensor) -> EvalResult:
        return self.wrapped.eval_step(inputs, targets)

    def set_lr(self, lr: float) -> None:
        self.wrapped.set_lr(lr)

    def model_state_dict(self) -> dict[str, torch.Tensor]:
        return self.wrapped.model_state_dict()

    def optimizer_state(self) -> dict[str, Any]:
        return self.wrapped.optimizer_state()

    def load_optimizer_state(self, state: dict[str, Any]) -> bool:
        return self.wrapped.load_optimizer_state(state)

    def describe(self) -> dict[str, Any]:
        return self.wrapped.describe()


W = TypeVar("W", bound=Wrapper)


def _defines(wrapper: type, name: str) -> bool:
    """Whether `wrapper` has `name` of its own: a class attribute or one annotated on the class (set in __init__)."""
    return any(name in vars(k) or name in vars(k).get("__annotations__", {}) for k in wrapper.__mro__)


def forwarding(wrapper: type[W], engine: Engine) -> type[W]:
    """`wrapper` (a Wrapper subclass), extended by the capabilities `engine` has that `wrapper` does not define itself,
    each member forwarded to the wrapped engine: what isinstance finds on it is what the engine offers."""
    members: dict[str, Any] = {}
    for capability in CAPABILITIES:
        if isinstance(engine, capability):
            for name in _members(capability):
                if not _defines(wrapper, name):
                    members.setdefault(name, _forwarded(name))
    if not members:
        return wrapper
    return type(wrapper.__name__, (wrapper,), {**members, "__qualname__": wrapper.__qualname__})


def pad_batch(
    tensors: tuple[torch.Tensor, ...], targets: torch.Tensor, batch_size: int, loss: Loss
) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
    """Pad a short training batch along dim 0 to `batch_size`: zero inputs, targets that carry no loss.

    ORT graphs are exported for the example batch's shape; a smaller batch would hit shapes baked into the graph.
    Padded rows carry no loss and samples do not interact across the batch dimension (the model contract), so the
    mean loss over the real rows is unchanged. A loss without such targets (mse, a custom loss) refuses a short
    batch (ortflow's loaders give full training batches only). A model with batch statistics (BatchNorm) would mix
    the padding into them: the runner never hands it a short batch (ortflow/data/short_batches.py).
    """
    missing = batch_size - targets.size(0)
    if missing <= 0:
        return tensors, targets
    padding = loss.pad_targets(targets, missing)
    if padding is None:
        raise OrtflowError(
            f"a training batch has {targets.size(0)} samples, fewer than the batch size {batch_size}, and this loss "
            f"({type(loss).__name__}) has no targets that carry no loss to pad it with. Give the training loader "
            "drop_last=True (ortflow's own data builders do)."
        )
    return pad_rows(tensors, missing), torch.cat([targets, padding])


def pad_eval_batch(
    tensors: tuple[torch.Tensor, ...], targets: torch.Tensor, batch_size: int
) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
    """Pad a short eval batch with zero rows; only the real rows' outputs are scored (Loss.sums). A model whose eval
    outputs depend on the batch (BatchNorm without running statistics) never gets here with a short batch."""
    missing = batch_size - targets.size(0)
    if missing <= 0:
        return tensors, targets
    return pad_rows(tensors, missing), torch.cat([targets, targets.new_zeros((missing, *targets.shape[1:]))])
