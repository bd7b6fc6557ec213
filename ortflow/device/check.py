"""The export's proof that a set trains where torch is absent: torch_free.py in a fresh interpreter (`python -I`,
torch unimportable, nothing of torch mapped), held to eager PyTorch's steps on the same batch (reference.py) and to
eager's own rounding noise, measured (eager again from weights moved by one ulp: ortflow/model/one_ulp.py), as
ortflow-check does. Which CPU (which ORT and oneDNN kernels) runs it moves the device's results no further than
rounding moves eager's; a wrong set moves them further.

- the first step, where both sides start from the same weights and noise is smallest, is held tightly: the step-1
  loss within TOLERANCE; each trainable parameter's step-1 gradient within max(GRADIENT_FLOOR, MARGIN x its own
  spread under one ulp); the first update within
  UPDATE_TOLERANCE of ORT's optimizer (AdamW as ORT computes it, clipping included) replayed on the device's own
  gradients (the learning rate, epsilon, weight decay and clipping the set carries); each BatchNorm layer's update
  of its running statistics within max(STATISTICS_FLOOR, MARGIN x its spread) of eager's (the biased variance);
- the later steps, where rounding differences grow (3-5x a step through ReLU and BatchNorm under AdamW), are held to
  eager's band: each loss within max(TOLERANCE, LOSS_MARGIN x the band at that step), the eval loss likewise, the
  parameters after the last step within max(PARAMETER_TOLERANCE, MARGIN x their spread) (relative to the largest),
  the running statistics within max(BATCHNORM_TOLERANCE x scale, MARGIN x their spread);
- dropout on: the set as shipped trains too, and its first loss must differ from the dropout-off one (the graph's
  Dropout nodes act).

`detects` states the smallest errors the check catches in this set: a step-1 gradient error (relative; in half the
parameters, and in every one), an error in the first update, in a BatchNorm layer's statistics update.
"""

import json
import math
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ortflow.device import torch_free
from ortflow.device.reference import Reference
from ortflow.errors import OrtflowError
from ortflow.model.one_ulp import relative

TOLERANCE = 1e-5  # losses, relative (the floor of the later steps' band)
PARAMETER_TOLERANCE = 1e-4  # parameters, relative to the largest: Adam moves near-zero-gradient weights by ~lr on noise
# Running statistics, relative to the largest: the weights both sides trained differ by float rounding, and so do the
# activations the statistics are taken of. With the weights held (tests/device/test_export.py) they agree to 1e-6
# absolute.
BATCHNORM_TOLERANCE = 1e-5
GRADIENT_FLOOR = 1e-5  # a step-1 gradient, relative L2: fp32 rounding of a sum in another order
UPDATE_TOLERANCE = 1e-5  # the first update against ORT's optimizer replayed on the device's gradients, relative L2
STATISTICS_FLOOR = 1e-5  # a BatchNorm layer's step-1 update of its running statistics, relative L2
MARGIN = 10.0  # a device's kernels may move a result by MARGIN x what one ulp of the weights moves eager's
LOSS_MARGIN = 30.0  # its later losses, LOSS_MARGIN x eager's band (ortflow-check's margins, check/parity.py)
SCRIPT = "train_without_torch.py"  # torch_free.py's copy beside the set


class CheckFailed(OrtflowError):
    """The set does not train as eager PyTorch does where torch is absent (the export keeps it at `<out>.failed`)."""


@dataclass
class DeviceRun:
    losses: list[float]
    eval_loss: float
    parameters: np.ndarray
    record: dict[str, Any]
    first_gradients: np.ndarray | None = None  # the trainable parameters' step-1 gradients, in the manifest's order
    first_parameters: np.ndarray | None = None  # every parameter after the first update


@dataclass
class Verdict:
    rows: list[tuple[str, str, str, str]] = field(default_factory=list)  # (what, device, eager, difference)
    failures: list[str] = field(default_factory=list)

    def table(self) -> str:
        widths = [
            max(len(r[i]) for r in [("", "device (no torch)", "eager torch", "difference"), *self.rows])
            for i in range(4)
        ]
        lines = [
            " | ".join(
                h.ljust(w) for h, w in zip(("", "device (no torch)", "eager torch", "difference"), widths, strict=True)
            )
        ]
        lines.append("-+-".join("-" * w for w in widths))
        lines += [" | ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) for row in self.rows]
        return "\n".join(lines)


def run_without_torch(root: Path, set_dir: Path, steps: int, out: Path, *options: str) -> DeviceRun:
    """torch_free.py (the set's copy, root/SCRIPT) on `set_dir` in a fresh isolated interpreter (`options`: its
    own, e.g. --threads 1).

    Raises:
        OrtflowError: it failed, or torch was mapped into it.
    """
    command = [sys.executable, "-I", str(root / SCRIPT), str(set_dir), "--steps", str(steps), "--out", str(out)]
    command += options
    done = subprocess.run(command, capture_output=True, text=True, check=False, timeout=600)
    if done.returncode != 0:
        tail = (done.stderr or done.stdout).strip().splitlines()[-5:]
        raise CheckFailed(
            f"the exported set did not train without torch ({' / '.join(tail)}); the set is kept for inspection. "
            "Report it with the model's layers."
        )
    record = json.loads(out.read_text())
    parameters = np.fromfile(out.with_suffix(".bin"), dtype=np.float32)
    first = [
        np.fromfile(out.with_suffix(suffix), dtype=np.float32) if out.with_suffix(suffix).is_file() else None
        for suffix in (torch_free.FIRST_GRADIENTS, torch_free.FIRST_PARAMETERS)
    ]
    return DeviceRun(record["losses"], record["eval_loss"], parameters, record, *first)


def _relative(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-12)


def _moved(after: dict[str, np.ndarray], before: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    return {name: np.asarray(after[name], np.float64) - before[name] for name in before if name in after}


def _largest_difference(got: dict[str, np.ndarray], want: dict[str, np.ndarray]) -> float:
    return max((float(np.abs(np.asarray(got[n]) - want[n]).max()) for n in want if n in got), default=0.0)


@dataclass
class Envelope:
    """Eager's own noise: how far one ulp of the weights moves what the check compares (runs: eager again from
    weights moved by one ulp, on the same batch)."""

    gradients: dict[str, float]  # each trainable parameter's step-1 gradient (relative L2)
    statistics: dict[str, float]  # each running statistic's step-1 update (relative L2)
    band: list[float]  # per step, the largest relative move of the loss so far
    eval_band: float
    parameters: float  # after the last step, largest absolute move over the largest parameter
    final_statistics: float  # after the last step, the running statistics' largest absolute move

    @classmethod
    def measure(cls, eager: Reference, runs: list[Reference]) -> "Envelope":
        moved = _moved(eager.first.statistics, eager.initial_statistics)
        runs_moved = [_moved(r.first.statistics, eager.initial_statistics) for r in runs]  # each run's, once
        scale = max((float(np.abs(v).max()) for v in eager.parameters.values()), default=1.0)
        band, worst = [], 0.0
        for step, want in enumerate(eager.losses):
            worst = max([worst, *(_relative(r.losses[step], want) for r in runs)])
            band.append(worst)
        return cls(
            gradients={
                n: max(relative(r.first.gradients.get(n, np.inf), g) for r in runs)
                for n, g in eager.first.gradients.items()
            },
            statistics={n: max(relative(r_moved[n], m) for r_moved in runs_moved) for n, m in moved.items()},
            band=band,
            eval_band=max(_relative(r.eval_loss, eager.eval_loss) for r in runs),
            parameters=max(_largest_difference(r.parameters, eager.parameters) for r in runs) / max(scale, 1e-12),
            final_statistics=max(
                max(
                    _largest_difference(r.running_mean, eager.running_mean),
                    _largest_difference(r.running_var_biased, eager.running_var_biased),
                )
                for r in runs
            ),
        )

    def gradient_tolerance(self, name: str) -> float:
        """Each parameter's own: one ulp moves an early layer's gradient through a ReLU or BatchNorm near its kink by
        1e-3 (the vision recipe), a late layer's by 1e-6; a device's kernels move them as far (measured: at most
        0.13 of these tolerances), and a shared tolerance would be blind to an error in the late ones."""
        return max(GRADIENT_FLOOR, MARGIN * self.gradients.get(name, 0.0))

    def statistics_tolerance(self, name: str) -> float:
        return max(STATISTICS_FLOOR, MARGIN * self.statistics.get(name, 0.0))

    def loss_tolerance(self, step: int) -> float:
        """Step 1 (same weights): TOLERANCE; later steps, eager's band at that step."""
        return TOLERANCE if step == 1 else max(TOLERANCE, LOSS_MARGIN * self.band[step - 1])

    def detects(self) -> dict[str, Any]:
        """The smallest errors this check catches in the set (relative): a step-1 gradient error in half the
        parameters (the median tolerance) and in every one (the largest, named), the first update's, a BatchNorm
        layer's statistics update."""
        tolerances = {n: self.gradient_tolerance(n) for n in self.gradients}
        coarsest = max(tolerances, key=tolerances.__getitem__, default=None)
        return {
            "step1_gradient_median": float(np.median(list(tolerances.values()))) if tolerances else GRADIENT_FLOOR,
            "step1_gradient_every_parameter": tolerances[coarsest] if coarsest else GRADIENT_FLOOR,
            "coarsest_parameter": coarsest,
            "first_update": UPDATE_TOLERANCE,
            "batchnorm_statistics_update": max(
                (self.statistics_tolerance(n) for n in self.statistics), default=STATISTICS_FLOOR
            ),
        }

    def record(self) -> dict[str, Any]:
        return {
            "loss_band": self.band,
            "eval_band": self.eval_band,
            "parameters": self.parameters,
            "final_statistics": self.final_statistics,
        }


def _by_name(tensors: list[dict[str, Any]], flat: np.ndarray, trainable: bool) -> dict[str, np.ndarray]:
    """A device's flat buffer as torch names -> tensors: every parameter (offset), or the trainable ones."""
    found = {}
    for t in tensors:
        if trainable and not t["trainable"]:
            continue
        offset = t["trainable_offset"] if trainable else t["offset"]
        size = int(np.prod(t["shape"])) if t["shape"] else 1
        found[t["torch_name"]] = flat[offset : offset + size].reshape(t["shape"])
    return found


def device_gradients(device: DeviceRun, tensors: list[dict[str, Any]]) -> dict[str, np.ndarray]:
    """The device's step-1 gradients by torch name (empty when it wrote none)."""
    if device.first_gradients is None:
        return {}
    return _by_name(tensors, device.first_gradients, trainable=True)


def _worst(diffs: dict[str, tuple[float, float]]) -> tuple[str, float, float]:
    """The name, difference and tolerance of the entry furthest over (or nearest) its tolerance."""
    name = max(diffs, key=lambda n: diffs[n][0] / diffs[n][1])
    return name, *diffs[name]


def _first_step(
    verdict: "Verdict",
    device: DeviceRun,
    eager: Reference,
    tensors: list[dict[str, Any]],
    envelope: Envelope,
    replay: tuple[dict[str, np.ndarray], dict[str, np.ndarray]],
) -> None:
    """Step 1: the gradients, the update against ORT's optimizer replayed on the device's gradients, BatchNorm."""
    if device.first_gradients is None or device.first_parameters is None:
        verdict.failures.append("the torch-free run wrote no first-step gradients or parameters")
        return
    grads = device_gradients(device, tensors)
    diffs = {
        n: (relative(grads.get(n, np.inf), g), envelope.gradient_tolerance(n)) for n, g in eager.first.gradients.items()
    }
    if diffs:
        name, diff, tol = _worst(diffs)
        verdict.rows.append(("step 1 gradients", "", "", f"worst '{name}' {diff:.1e} rel (tolerance {tol:.1e})"))
        over = sorted(n for n, (d, t) in diffs.items() if not d <= t)
        if over:
            verdict.failures.append(
                f"the step-1 gradients of {over[:5]} differ beyond eager's own noise (worst '{name}': {diff:.2e} "
                f"relative, tolerance {tol:.2e})"
            )
    after = _by_name(tensors, device.first_parameters, trainable=False)
    before, replayed = replay
    diff = relative(
        np.concatenate([np.asarray(after[n], np.float64).reshape(-1) - before[n].reshape(-1) for n in replayed]),
        np.concatenate([(replayed[n] - before[n]).reshape(-1) for n in replayed]),
    ) if replayed else 0.0  # fmt: skip
    verdict.rows.append(("first update", "set's optimizer", "ORT's, replayed", f"{diff:.1e} rel"))
    if not diff <= UPDATE_TOLERANCE:
        verdict.failures.append(
            f"the first update differs by {diff:.2e} (relative) from ORT's optimizer replayed on the device's own "
            f"gradients with the run's settings (learning rate, epsilon, weight decay, clipping), over "
            f"{UPDATE_TOLERANCE:g}"
        )
    moved = _moved(eager.first.statistics, eager.initial_statistics)
    if moved:
        got = _moved({n: after[n] for n in moved if n in after}, eager.initial_statistics)
        diffs = {n: (relative(got.get(n, np.inf), m), envelope.statistics_tolerance(n)) for n, m in moved.items()}
        name, diff, tol = _worst(diffs)
        worst = f"worst '{name}' {diff:.1e} rel (tolerance {tol:.1e})"
        verdict.rows.append(("step 1 BatchNorm update", "ORT kernel", "torch, biased var", worst))
        if over := sorted(n for n, (d, t) in diffs.items() if not d <= t):
            verdict.failures.append(
                f"the step-1 updates of the running statistics {over[:5]} differ beyond eager's own noise (worst "
                f"'{name}': {diff:.2e} relative, tolerance {tol:.2e})"
            )


def _losses(
    verdict: Verdict,
    device: DeviceRun,
    reference: Reference,
    tensors: list[dict[str, Any]],
    envelope: Envelope,
    replay: tuple[dict[str, np.ndarray], dict[str, np.ndarray]],
) -> None:
    """Each step's loss held to eager's, and the rest of step 1 (gradients, update, BatchNorm) after its loss."""
    for step, (got, want) in enumerate(zip(device.losses, reference.losses, strict=True), 1):
        diff, tol = _relative(got, want), envelope.loss_tolerance(step)
        verdict.rows.append((f"step {step} loss", f"{got:.7f}", f"{want:.7f}", f"{diff:.1e} rel (tol {tol:.0e})"))
        if not diff <= tol:
            verdict.failures.append(f"step {step}'s loss differs by {diff:.2e} (relative), over {tol:.2g}")
        if step == 1:
            _first_step(verdict, device, reference, tensors, envelope, replay)


def _eval_loss(verdict: Verdict, device: DeviceRun, reference: Reference, envelope: Envelope) -> None:
    """The eval loss after the steps held to eager's, within LOSS_MARGIN x eager's band."""
    diff, tol = _relative(device.eval_loss, reference.eval_loss), max(TOLERANCE, LOSS_MARGIN * envelope.eval_band)
    verdict.rows.append(
        ("eval loss after", f"{device.eval_loss:.7f}", f"{reference.eval_loss:.7f}", f"{diff:.1e} rel (tol {tol:.0e})")
    )
    if not diff <= tol:
        verdict.failures.append(f"the eval loss differs by {diff:.2e} (relative), over {tol:.2g}")


def _final_parameters(verdict: Verdict, after: dict[str, np.ndarray], reference: Reference, envelope: Envelope) -> None:
    """The parameters after the last step held to eager's, relative to the largest."""
    scale = max((float(np.abs(v).max()) for v in reference.parameters.values()), default=1.0)
    moved = _largest_difference(after, reference.parameters) / max(scale, 1e-12)
    tol = max(PARAMETER_TOLERANCE, MARGIN * envelope.parameters)
    verdict.rows.append(("parameters after", "", "", f"{moved:.1e} rel to the largest (tol {tol:.0e})"))
    if not moved <= tol:
        verdict.failures.append(f"the parameters differ by {moved:.2e} (relative), over {tol:.2g}")


def _final_statistics(verdict: Verdict, after: dict[str, np.ndarray], reference: Reference, envelope: Envelope) -> None:
    """The BatchNorm running statistics after the last step held to eager's (the biased variance), if any."""
    if not reference.running_mean:
        return
    statistics = {n: after[f"{n}.running_mean"] for n in reference.running_mean if f"{n}.running_mean" in after}
    bn_mean = _largest_difference(statistics, reference.running_mean)
    variances = {n: after[f"{n}.running_var"] for n in reference.running_var_biased if f"{n}.running_var" in after}
    bn_var = _largest_difference(variances, reference.running_var_biased)
    bn_scale = max(
        float(np.abs(v).max()) for v in (*reference.running_mean.values(), *reference.running_var_biased.values())
    )
    tol = max(BATCHNORM_TOLERANCE * max(bn_scale, 1.0), MARGIN * envelope.final_statistics)
    verdict.rows.append(("BatchNorm running_mean", "ORT kernel", "torch", f"{bn_mean:.1e} abs (tol {tol:.0e})"))
    verdict.rows.append(("BatchNorm running_var", "ORT kernel", "torch, biased var", f"{bn_var:.1e} abs"))
    for what, value in (("running means", bn_mean), ("running variances", bn_var)):
        if not value <= tol:
            verdict.failures.append(f"BatchNorm {what} differ by {value:.2e}, over {tol:.2g}")


def _torch_absent(verdict: Verdict, device: DeviceRun) -> None:
    """Torch absent from the torch-free process: not mapped into it, not importable, its training package not run."""
    maps = device.record["forbidden_maps"]
    verdict.rows.append(("torch in the process", "none" if not maps else maps[0], "", ""))
    if maps or device.record["torch_importable"] or device.record["training_package_init_run"]:
        verdict.failures.append(f"torch was reachable in the torch-free process ({device.record})")


def _dropout(verdict: Verdict, device: DeviceRun, dropout_on: DeviceRun | None, dropout_nodes: int) -> None:
    """With dropout on, the shipped set's first loss differs from the dropout-off one (its Dropout nodes act), and
    every loss it trains to, the eval loss included, is finite."""
    if dropout_on is None:
        return
    first, off = dropout_on.losses[0], device.losses[0]
    verdict.rows.append(
        (
            f"dropout on ({dropout_nodes} nodes)",
            f"{first:.7f}",
            f"off: {off:.7f}",
            f"{_relative(first, off):.1e} rel",
        )
    )
    if first == off:
        verdict.failures.append("the set's Dropout nodes did not act: its first loss equals the dropout-off one")
    for step, loss in enumerate([*dropout_on.losses, dropout_on.eval_loss], 1):
        if not math.isfinite(loss):
            what = "its eval loss" if step > len(dropout_on.losses) else f"step {step}'s loss"
            verdict.failures.append(f"the set as shipped (dropout on) trained to a non-finite loss: {what} is {loss}")
            break


def compare(
    device: DeviceRun,
    reference: Reference,
    tensors: list[dict[str, Any]],
    dropout_on: DeviceRun | None,
    dropout_nodes: int,
    envelope: Envelope,
    replay: tuple[dict[str, np.ndarray], dict[str, np.ndarray]],
) -> Verdict:
    """The table and every failure: the first step (losses, gradients, update, BatchNorm), the later losses, the eval
    loss, parameters and BatchNorm statistics after the steps, torch absent, dropout."""
    verdict = Verdict()
    _losses(verdict, device, reference, tensors, envelope, replay)
    _eval_loss(verdict, device, reference, envelope)
    after = _by_name(tensors, device.parameters, trainable=False)
    _final_parameters(verdict, after, reference, envelope)
    _final_statistics(verdict, after, reference, envelope)
    _torch_absent(verdict, device)
    _dropout(verdict, device, dropout_on, dropout_nodes)
    return verdict
