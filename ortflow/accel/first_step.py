"""The first-step check every ORT-engine run makes before its first update (`accel.verify`, on by default): the
engine's gradients on the first batch against eager PyTorch's on the same batch and the same weights, one eager
forward and backward.

It is the net under everything an export can lose that no one has listed yet (a stop-gradient, a hook, a graph
rewrite that is wrong for this model): an engine that would train another model than the one the user wrote stops
before it changes a weight or writes a checkpoint, naming the parameters and how far off they are.

Where it can, the engine's side is its real first step: eager's gradients are taken just before it, on the same
batch with the same dropout masks (ORTModule's fed masks applied by its own module run eagerly), and compared after
the step's backward, before its update; the check then costs one eager forward and backward. Where it cannot (the
artifacts engine's masks, which belong to its graph; gradient accumulation; a distributed wrapper, which reduces the
step's gradients) both sides run a training forward of their own with dropout off (eager's dropout modules at p=0
for the call; the engine's fed masks all ones). Either way BatchNorm's running statistics and torch's random state
are restored after eager's side, so the run trains exactly as it would without the check. A model whose training
forward draws random numbers that neither side can turn off (F.dropout with a fixed p, a random augmentation), a
graph whose dropout ORT draws itself (the portable target, accel.rewrite_dropout=false) or an engine under DeepSpeed
is not checked: the record says why.

The measure: each parameter's relative L2 difference, ||g_engine - g_eager|| / max(||g_eager||, floor), the floor
being FLOOR of the gradient a parameter of its size would have at the batch's typical entry (the RMS over every
gradient entry): a gradient that is rounding noise by itself (a bias before a BatchNorm, zero in exact arithmetic)
is judged against the scale of the gradients it sits among. TOLERANCE per precision: a correct engine's
differences are rounding (fp32: 2.6e-7 to 1.3e-6 on the recipes; bf16-mixed: eager's own bf16 kernels
against the engine's, a few %), a 10% error in fp32 and a 50% one in bf16-mixed are well beyond them.
"""

import contextlib
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import onnx
import torch
from torch import nn

from ortflow.config import BF16
from ortflow.errors import OrtflowError
from ortflow.model import one_ulp
from ortflow.model.probe import buffers_kept, dropout_off
from ortflow.step.with_loss import WithLoss

TOLERANCE = {"fp32": 2e-2, BF16: 0.25}
FLOOR = {"fp32": 1e-2, BF16: 5e-2}
SHOWN = 3  # parameters named in the error
FIRST_STEP = "the first training step"  # Verdict.engine_side: the step's own gradients, before its update
OWN_PASS = "a pass of its own"  # a forward and backward of the engine's with dropout off, no update
ORT_DROPOUT = (
    "ORT draws this graph's dropout masks itself (accel.target=portable or accel.rewrite_dropout=false), which no "
    "eager run can match"
)


@dataclass
class Finding:
    parameter: str
    error: float  # relative L2 difference (inf: a gradient on one side only, or not finite)


@dataclass
class Verdict:
    """The check's record (run.json's engine.first_step_check)."""

    status: str  # "passed", "failed", "skipped", "off"
    reason: str = ""
    tolerance: float | None = None
    worst: list[Finding] = field(default_factory=list)
    parameters: int = 0
    seconds: float = 0.0
    engine_side: str = ""  # where the engine's gradients came from: FIRST_STEP or OWN_PASS

    def record(self) -> dict[str, Any]:
        found: dict[str, Any] = {"status": self.status}
        if self.reason:
            found["reason"] = self.reason
        if self.status in ("passed", "failed"):
            found.update(
                tolerance=self.tolerance,
                parameters=self.parameters,
                worst=[{"parameter": f.parameter, "error": f.error} for f in self.worst],
                seconds=round(self.seconds, 4),
                engine_side=self.engine_side,
            )
        return found


def ort_dropout(graph: onnx.ModelProto) -> bool:
    """Whether an engine's graph draws dropout masks itself (ORT's Dropout nodes; ortflow's fed masks are inputs)."""
    return any(n.op_type == "Dropout" for n in graph.graph.node)


class Pending:
    """An engine's check: made once, before its first update (`before_first_update`), unless `accel.verify=false`
    or the engine's graph draws dropout inside ORT (`ort_dropout`), where both sides cannot turn it off."""

    def __init__(self, enabled: bool, ort_dropout: bool = False) -> None:
        self.enabled, self.ort_dropout = enabled, ort_dropout
        self.verdict: Verdict | None = None

    @property
    def due(self) -> bool:
        """Whether the next update is the first and will be checked (eager's side worth computing)."""
        return self.verdict is None and self.enabled and not self.ort_dropout

    def before_first_update(self, check: Callable[[], Verdict]) -> None:
        """Run `check()` if this is the first update (the verdict kept; FirstStepDiffers raised through)."""
        if self.verdict is not None:
            return
        if not self.enabled:
            self.verdict = Verdict("off", "accel.verify=false")
        elif self.ort_dropout:
            self.verdict = Verdict("skipped", ORT_DROPOUT)
        else:
            try:
                self.verdict = check()
            except FirstStepDiffers as differs:
                self.verdict = differs.verdict
                raise

    def record(self) -> dict[str, Any]:
        return (self.verdict or Verdict("pending", "no training step yet")).record()


@contextlib.contextmanager
def untouched(model: nn.Module) -> Iterator[None]:
    """The model's buffers, its parameters' .grad and torch's random state as they were, afterwards."""
    rng = torch.get_rng_state()
    grads = {name: p.grad for name, p in model.named_parameters()}
    try:
        with buffers_kept(model):
            yield
    finally:
        for name, p in model.named_parameters():
            p.grad = grads[name]
        torch.set_rng_state(rng)


def eager_module(model: nn.Module, loss: Any, layout: Any, precision: str) -> WithLoss:
    """The model and its loss as eager PyTorch trains them in `precision` (bf16-mixed: under CPU autocast)."""
    return WithLoss(model, loss, layout, autocast=precision == BF16)


def eager_gradients(
    model: nn.Module, with_loss: nn.Module, tensors: tuple[torch.Tensor, ...]
) -> dict[str, np.ndarray] | None:
    """Eager's gradients of every trainable parameter of `model` from one training forward and backward of
    `with_loss` (the model and its loss: eager_module, or ORTModule's own module with the step's dropout masks) on the
    flat batch `tensors`, by torch name (a parameter the backward does not reach: zeros); None where the forward drew
    from torch's random generator (told by its state, not by a second forward). Hooks on the parameters and modules
    run, as in eager's step."""
    with_loss.train()
    for p in model.parameters():
        p.grad = None
    drawn = torch.get_rng_state()
    with torch.enable_grad():
        with_loss(*tensors).backward()
    if not torch.equal(drawn, torch.get_rng_state()):  # the forward drew random numbers: another draw, other values
        return None
    return {
        name: (p.grad.detach().float().numpy().copy() if p.grad is not None else np.zeros(p.shape, np.float32))
        for name, p in model.named_parameters()
        if p.requires_grad
    }


@dataclass
class Eager:
    """Eager's side of the check, taken before the engine's: its gradients (None: not reproducible) and its time."""

    gradients: dict[str, np.ndarray] | None
    seconds: float


RANDOM = (
    "the model's training forward draws random numbers besides its dropout modules (F.dropout with a fixed p, a "
    "random augmentation): eager's gradients cannot be reproduced"
)


def eager_side(
    model: nn.Module, with_loss: nn.Module, tensors: tuple[torch.Tensor, ...], dropout_kept: bool = False
) -> Eager:
    """eager_gradients with the model untouched afterwards (buffers, .grad, random state); its dropout modules at
    p=0 for the call unless `dropout_kept` (`with_loss` applies fed dropout masks itself)."""
    started = time.perf_counter()
    with untouched(model), contextlib.nullcontext() if dropout_kept else dropout_off(model):
        found = eager_gradients(model, with_loss, tensors)
    return Eager(found, time.perf_counter() - started)


def judge(
    engine_name: str,
    precision: str,
    eager: Eager,
    engine_gradients: Callable[[], dict[str, np.ndarray] | str],
    engine_side: str = FIRST_STEP,
) -> Verdict:
    """The engine's gradients (`engine_gradients()`, taken from `engine_side`, or why they cannot be compared)
    against eager's.

    Raises:
        FirstStepDiffers: a parameter's gradient off by more than the precision's TOLERANCE.
    """
    if eager.gradients is None:
        return Verdict("skipped", RANDOM)
    started = time.perf_counter()
    got = engine_gradients()
    if isinstance(got, str):
        return Verdict("skipped", got)
    tolerance = TOLERANCE.get(precision, TOLERANCE["fp32"])
    findings = compare(eager.gradients, got, precision)
    verdict = Verdict(
        "passed",
        tolerance=tolerance,
        worst=findings[:SHOWN],
        parameters=len(findings),
        seconds=eager.seconds + time.perf_counter() - started,
        engine_side=engine_side,
    )
    off = [f for f in findings if not f.error <= tolerance]
    if off:
        verdict.status = "failed"
        raise FirstStepDiffers(engine_name, precision, off, verdict)
    return verdict


def compare(eager: dict[str, np.ndarray], engine: dict[str, np.ndarray], precision: str) -> list[Finding]:
    """Each parameter's relative difference (Finding), worst first: against its gradient's norm, floored at FLOOR
    of its neighbours' scale (one_ulp.gradient_scales)."""
    finite = {name: g for name, g in eager.items() if np.all(np.isfinite(g))}
    # eager's own gradient not finite: the loop's non-finite guard stops or skips that step
    scales = one_ulp.gradient_scales(finite, FLOOR.get(precision, FLOOR["fp32"]))
    found = []
    for name, want in finite.items():
        got = engine.get(name)
        got = np.zeros_like(want) if got is None else np.asarray(got).reshape(want.shape)
        found.append(Finding(name, one_ulp.scaled(got, want, scales[name])))
    return sorted(found, key=lambda f: -f.error)


def verify(
    engine_name: str,
    model: nn.Module,
    with_loss: nn.Module,
    tensors: tuple[torch.Tensor, ...],
    precision: str,
    engine_gradients: Callable[[], dict[str, np.ndarray] | str],
) -> Verdict:
    """The check as a step of its own, for an engine about to make its first update: eager's gradients (dropout
    off), then the engine's (`engine_gradients()`: one forward and backward of its training graph with dropout off,
    no update; or why they cannot be compared), judged. Engines that can take their gradients from the first step
    itself call eager_side before it and judge after its backward instead (no second engine pass).

    Raises:
        FirstStepDiffers: a parameter's gradient off by more than the precision's TOLERANCE.
    """
    eager = eager_side(model, with_loss, tensors)
    if eager.gradients is None:
        return judge(engine_name, precision, eager, dict)

    def engine_side() -> dict[str, np.ndarray] | str:
        with untouched(model):  # the model as it trains: an engine exporting now traces its real dropout sites
            return engine_gradients()

    return judge(engine_name, precision, eager, engine_side, OWN_PASS)


def _percent(error: float) -> str:
    return "no finite value" if not math.isfinite(error) else f"{error:.1%} off"


class FirstStepDiffers(OrtflowError):
    """An engine's step-1 gradients are not eager's: it would train another model than the user's."""

    def __init__(self, engine: str, precision: str, off: list[Finding], verdict: Verdict) -> None:
        named = ", ".join(f"'{f.parameter}' {_percent(f.error)}" for f in off[:SHOWN])
        more = f" and {len(off) - SHOWN} more" if len(off) > SHOWN else ""
        super().__init__(
            f"accel={engine}'s first-step check failed: its step-1 gradients on the first batch differ from eager "
            f"PyTorch's on the same batch and weights ({precision}, dropout off): {named}{more} (relative L2 "
            f"difference; tolerance {verdict.tolerance:.0%}, far above rounding). The engine would train a "
            "different model than the one you wrote, so the run stopped before its first update and before any "
            "checkpoint. Run `ortflow-check` with the same overrides for the full picture (every engine against "
            'eager\'s own noise), see docs/troubleshooting.md ("The first-step check failed"), and use accel=none '
            "meanwhile; accel.verify=false trains anyway."
        )
        self.verdict = verdict
