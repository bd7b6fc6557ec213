"""Every accel mode tried for a few steps on the model and data a config describes, against eager on the same batches
and the same initial weights (dropout off): whether it trains, the losses, step-1 gradients, ORT's run proof and
the graph fixes, and eager's own noise floor for the verdict (parity.py)."""

import itertools
import math
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig
from torch import nn

from ortflow import accel
from ortflow.api import register_configs
from ortflow.check import parity
from ortflow.config import FP32
from ortflow.data import Data
from ortflow.data.resumable import ResumableBatches
from ortflow.errors import OrtflowError, root_reason
from ortflow.model.probe import training_forward_probe
from ortflow.paths import compose_config
from ortflow.run.runner import build_data, build_model, engine_context
from ortflow.run.seeding import seed_everything, seed_step
from ortflow.step.batch import layout_of, split_batch
from ortflow.validate import problems

# Every accel mode the config tree offers that trains itself (accel.engines(): conf/accel/*.yaml), eager first: it is
# the reference. accel=auto is left out: it trains with one of the others (its probe is its own comparison).
MODES = tuple(accel.engines())


def _compose(overrides: list[str], mode: str):
    return compose_config([*overrides, f"accel={mode}", "logger.progress=false"])


DROPOUTS = (nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout, nn.FeatureAlphaDropout)


def without_dropout(model: nn.Module) -> nn.Module:
    """The same model with every dropout probability at 0: the runtimes would otherwise draw different masks."""
    for module in model.modules():
        if isinstance(module, DROPOUTS) or type(module).__name__ == "StochasticDepth":  # torchvision.ops's too
            module.p = 0.0
        if isinstance(module, nn.MultiheadAttention):
            module.dropout = 0.0
    return model


def draws_random_numbers(model: nn.Module, inputs) -> bool:
    """Whether two training-mode forwards of `model` on `inputs` under different seeds differ: dropout that
    `without_dropout` cannot reach (F.dropout, scaled_dot_product_attention's dropout_p, a random augmentation).
    The model's buffers (BatchNorm statistics) are restored."""
    layout = layout_of(inputs)
    outputs = []
    with training_forward_probe(model):
        for seed in (0, 1):
            torch.manual_seed(seed)
            outputs.append(layout.call(model, layout.flatten(inputs)))
    first, second = outputs
    return isinstance(first, torch.Tensor) and not torch.equal(first, second)


def _one_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    if isinstance(err, OrtflowError):
        return " ".join(line.strip(" -") for line in text)
    return root_reason(err)


def fresh_model(cfg: DictConfig, data: Data) -> nn.Module:
    """The model as a run builds it from `cfg` (seeded first, like the data: the same initial weights every time),
    hooks, buffers and state included, with dropout off. A copy.deepcopy of a built model would not do: it drops the
    hooks on its parameters."""
    return without_dropout(build_model(cfg, data))


def try_mode(
    mode: str,
    overrides: list[str],
    steps: int,
    model: Callable[[DictConfig, Data], nn.Module],
    reference: list[float] | None,
    grads: bool = True,
):
    """Train `steps` steps of the model `model(cfg, data)` builds in `mode`; a row of the table (with `grads`, its
    step-1 gradients under "_grads", for the caller to compare)."""
    row: dict[str, Any] = {"mode": mode}
    try:
        cfg = _compose(overrides, mode)
        if found := problems(cfg):
            raise OrtflowError("; ".join(found))
        seed_everything(cfg.seed)
        data = build_data(cfg)
        built = model(cfg, data)
        batches = list(itertools.islice(ResumableBatches(data.train), steps))
        with tempfile.TemporaryDirectory(prefix="ortflow-check-") as tmp:
            engine = accel.build(cfg.accel, engine_context(cfg, built, data, Path(tmp)))
            losses, times = [], []
            step_one = parity.capture_step_one(engine, split_batch(batches[0])) if grads else None
            for step, batch in enumerate(batches, start=1):
                seed_step(cfg.seed, step)
                start = time.perf_counter()
                losses.append(engine.train_step(*split_batch(batch)))
                times.append(time.perf_counter() - start)
            info = engine.describe()
            if step_one is not None:
                row["_grads"] = step_one()
    except Exception as err:  # every failure is a result here, reported in the table
        return row | {"trains": False, "reason": _one_line(err)}
    row |= {
        "trains": info["executed_by"] in ("pytorch", "onnxruntime") and all(map(math.isfinite, losses)),
        "executed_by": info["executed_by"],
        "losses": losses,
        "first_step_s": times[0],
        "step_ms": 1000 * statistics.median(times[1:]) if len(times) > 1 else float("nan"),
        "graph_fixes": info.get("graph_fixes", {}),
    }
    if reference is not None and len(reference) == len(losses):
        row["max_rel_loss_diff"] = max(abs(a - b) / abs(b) for a, b in zip(losses, reference, strict=True))
    return row


def check(overrides: list[str], steps: int, modes: list[str], precisions: tuple[str, ...] = (FP32,)) -> dict[str, Any]:
    """Build the model once (checking its contract), then try each mode on the same model built afresh, in each
    precision."""
    register_configs()
    cfg = _compose(overrides, "none")
    seed_everything(cfg.seed)
    data = build_data(cfg)
    model = fresh_model(cfg, data)
    random = draws_random_numbers(model, split_batch(next(iter(data.train)))[0])
    rows: list[dict[str, Any]] = []
    eager: dict[str, tuple[list[float] | None, dict]] = {}  # precision -> eager's losses and step-1 gradients
    for precision in dict.fromkeys((FP32, *precisions)):  # eager fp32 first: every floor is measured from it
        settings = [*overrides, f"trainer.precision={precision}"]
        reference = None
        for mode in ["none", *[m for m in modes if m != "none"]]:
            row = try_mode(mode, settings, steps, fresh_model, reference) | {"precision": precision}
            got = row.pop("_grads", None)
            if mode == "none":
                reference = row.get("losses")
                eager[precision] = (reference, got or {})
            elif got is not None:
                row["grad_rel_diff"] = parity.gradient_difference(got, eager[precision][1])
            if mode in modes and precision in precisions:
                rows.append(row)
    floors, gradient_floors = [], []
    reference_fp32, grads_fp32 = eager[FP32]
    if reference_fp32 is not None:  # eager against itself, every weight one ulp away: the noise any engine is held to
        for seed in parity.NOISE_SEEDS:
            one_ulp = lambda cfg, data, seed=seed: parity.perturbed(fresh_model(cfg, data), seed)  # noqa: E731
            noisy = try_mode("none", overrides, steps, one_ulp, reference_fp32)
            floors.append(noisy.get("max_rel_loss_diff", math.nan))
            if (got := noisy.pop("_grads", None)) is not None and grads_fp32:
                gradient_floors.append(parity.gradient_difference(got, grads_fp32))
    floor = max(floors) if floors and all(map(math.isfinite, floors)) else None
    gradient_floor = max((g for g in gradient_floors if g is not None), default=None)
    low = {}  # precision -> (loss floor, gradient tolerance): eager in it against eager fp32
    for precision, (losses, grads) in eager.items():
        if precision != FP32 and losses is not None and reference_fp32 is not None:
            loss_floor = max(abs(a - b) / abs(b) for a, b in zip(losses, reference_fp32, strict=True))
            low[precision] = (max(loss_floor, floor or 0.0), parity.gradient_difference(grads, grads_fp32))
    for row in rows:
        if row["mode"] != "none" and row.get("trains"):
            if row["precision"] == FP32:
                row["verdict"] = parity.verdict(row, floor, gradient_floor)
            elif row["precision"] in low:
                loss_floor, tolerance = low[row["precision"]]
                what = f"eager {row['precision']}"
                row["verdict"] = parity.verdict(row, loss_floor, gradient_tolerance=tolerance, what=what)
    target = cfg.model.get("_target_", "?")
    return {
        "overrides": overrides,
        "steps": steps,
        "model": target,
        "rows": rows,
        "noise_floor": floor,
        "noise_floors": floors,
        "gradient_floor": gradient_floor,
        "precision_floors": {p: {"loss": f, "step1_grads": g} for p, (f, g) in low.items()},
        "chaotic": floor is not None and floor > parity.CHAOTIC_FLOOR,
        "random_forward": random,
        "torch": torch.__version__,
    }
