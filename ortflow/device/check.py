"""The export's proof that a set trains where torch is absent: torch_free.py in a fresh interpreter (`python -I`,
torch unimportable, nothing of torch mapped), held to eager PyTorch's steps on the same batch (reference.py).

- dropout off: the no-dropout set (or the set itself when the model has no dropout) trains `steps` steps; every
  step's loss and the eval loss after them must be within TOLERANCE (relative) of eager's, the parameters within
  PARAMETER_TOLERANCE of eager's (relative to their largest magnitude), BatchNorm's running means within
  BATCHNORM_TOLERANCE of torch's and its running variances within it of torch's update with the biased variance
  (relative to the largest statistic);
- dropout on: the set as shipped trains too, and its first loss must differ from the dropout-off one (the graph's
  Dropout nodes act).
"""

import json
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ortflow.device.reference import Reference
from ortflow.errors import OrtflowError

TOLERANCE = 1e-5  # losses, relative
PARAMETER_TOLERANCE = 1e-4  # parameters, relative to the largest: Adam moves near-zero-gradient weights by ~lr on noise
# Running statistics, relative to the largest: the weights both sides trained differ by float rounding, and so do the
# activations the statistics are taken of. With the weights held (tests/device/test_export.py) they agree to 1e-6
# absolute.
BATCHNORM_TOLERANCE = 1e-5
SCRIPT = "train_without_torch.py"  # torch_free.py's copy beside the set


@dataclass
class DeviceRun:
    losses: list[float]
    eval_loss: float
    parameters: np.ndarray
    record: dict[str, Any]


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


def run_without_torch(root: Path, set_dir: Path, steps: int, out: Path) -> DeviceRun:
    """torch_free.py (the set's copy, root/SCRIPT) on `set_dir` in a fresh isolated interpreter.

    Raises:
        OrtflowError: it failed, or torch was mapped into it.
    """
    command = [sys.executable, "-I", str(root / SCRIPT), str(set_dir), "--steps", str(steps), "--out", str(out)]
    done = subprocess.run(command, capture_output=True, text=True, check=False, timeout=600)
    if done.returncode != 0:
        tail = (done.stderr or done.stdout).strip().splitlines()[-5:]
        raise OrtflowError(
            f"the exported set in {set_dir} did not train without torch ({' / '.join(tail)}); the set is left in place "
            "for inspection. Report it with the model's layers."
        )
    record = json.loads(out.read_text())
    parameters = np.fromfile(out.with_suffix(".bin"), dtype=np.float32)
    return DeviceRun(record["losses"], record["eval_loss"], parameters, record)


def _relative(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-12)


def compare(
    device: DeviceRun,
    reference: Reference,
    tensors: list[dict[str, Any]],
    dropout_on: DeviceRun | None,
    dropout_nodes: int,
) -> Verdict:
    """The table and every failure: losses, eval loss, parameters, BatchNorm statistics, torch absent, dropout."""
    verdict = Verdict()
    for step, (got, want) in enumerate(zip(device.losses, reference.losses, strict=True), 1):
        diff = _relative(got, want)
        verdict.rows.append((f"step {step} loss", f"{got:.7f}", f"{want:.7f}", f"{diff:.1e} rel"))
        if not diff <= TOLERANCE:
            verdict.failures.append(f"step {step}'s loss differs by {diff:.2e} (relative), over {TOLERANCE:g}")
    diff = _relative(device.eval_loss, reference.eval_loss)
    verdict.rows.append(("eval loss after", f"{device.eval_loss:.7f}", f"{reference.eval_loss:.7f}", f"{diff:.1e} rel"))
    if not diff <= TOLERANCE:
        verdict.failures.append(f"the eval loss differs by {diff:.2e} (relative), over {TOLERANCE:g}")
    worst, scale, bn_mean, bn_var, bn_scale = 0.0, 0.0, 0.0, 0.0, 0.0
    for tensor in tensors:
        size = int(np.prod(tensor["shape"])) if tensor["shape"] else 1
        got = device.parameters[tensor["offset"] : tensor["offset"] + size].reshape(tensor["shape"])
        name = tensor["torch_name"]
        if name in reference.parameters:
            want = reference.parameters[name]
            worst = max(worst, float(np.abs(got - want).max()))
            scale = max(scale, float(np.abs(want).max()))
        layer, _, kind = name.rpartition(".")
        if kind == "running_mean" and layer in reference.running_mean:
            bn_mean = max(bn_mean, float(np.abs(got - reference.running_mean[layer]).max()))
            bn_scale = max(bn_scale, float(np.abs(reference.running_mean[layer]).max()))
        elif kind == "running_var" and layer in reference.running_var_biased:
            bn_var = max(bn_var, float(np.abs(got - reference.running_var_biased[layer]).max()))
            bn_scale = max(bn_scale, float(np.abs(reference.running_var_biased[layer]).max()))
    relative = worst / max(scale, 1e-12)
    verdict.rows.append(("parameters after", "", "", f"{relative:.1e} rel (max abs {worst:.1e})"))
    if not relative <= PARAMETER_TOLERANCE:
        verdict.failures.append(f"the parameters differ by {relative:.2e} (relative), over {PARAMETER_TOLERANCE:g}")
    if reference.running_mean:
        verdict.rows.append(("BatchNorm running_mean", "ORT kernel", "torch", f"{bn_mean:.1e} abs"))
        verdict.rows.append(("BatchNorm running_var", "ORT kernel", "torch, biased var", f"{bn_var:.1e} abs"))
        for what, value in (("running means", bn_mean), ("running variances", bn_var)):
            if not value <= BATCHNORM_TOLERANCE * max(bn_scale, 1.0):
                verdict.failures.append(
                    f"BatchNorm {what} differ by {value:.2e}, over {BATCHNORM_TOLERANCE:g} x {max(bn_scale, 1.0):.3g}"
                )
    maps = device.record["forbidden_maps"]
    verdict.rows.append(("torch in the process", "none" if not maps else maps[0], "", ""))
    if maps or device.record["torch_importable"] or device.record["training_package_init_run"]:
        verdict.failures.append(f"torch was reachable in the torch-free process ({device.record})")
    if dropout_on is not None:
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
    return verdict
