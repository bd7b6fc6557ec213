"""Every accel mode tried for a few steps on the model and data a config describes, against eager on the same batches
and the same initial weights (dropout off): whether it trains, the losses, step-1 gradients, ORT's run proof and
the graph fixes, and eager's own noise floor for the verdict (parity.py)."""

import copy
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
from ortflow.accel.catalog import declared
from ortflow.api import register_configs
from ortflow.check import capture, parity
from ortflow.config import AUTO, BF16, FP32
from ortflow.data import Data
from ortflow.data.resumable import ResumableBatches
from ortflow.errors import ConfigError, OrtflowError, root_reason
from ortflow.model import one_ulp
from ortflow.model.probe import dropout_probabilities, training_forward_probe
from ortflow.paths import compose_config, search_dirs
from ortflow.run.runner import build_data, build_model, engine_context
from ortflow.run.seeding import seed_everything, seed_step
from ortflow.step.batch import layout_of, split_batch
from ortflow.validate import problems

# One check composes the same few configs again and again (eager, its noise runs, each mode, each verdict): while
# check() runs, each is composed once (Hydra takes ~0.2 s a composition, a deep copy ~3 ms). Outside a check nothing
# is kept: between checks a config file or a plugin's schema may change.
_COMPOSED: dict[tuple[str, ...], DictConfig] | None = None


def _compose(overrides: list[str], mode: str) -> DictConfig:
    key = (*overrides, f"accel={mode}", "logger.progress=false")
    if _COMPOSED is None:
        return compose_config(list(key))
    if key not in _COMPOSED:
        _COMPOSED[key] = compose_config(list(key))
    return copy.deepcopy(_COMPOSED[key])


def without_dropout(model: nn.Module) -> nn.Module:
    """The same model with every dropout probability at 0: the runtimes would otherwise draw different masks."""
    for module, name in dropout_probabilities(model):
        setattr(module, name, 0.0)
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
    reference: list[float] | None = None,
    grads: bool = True,
) -> dict[str, Any]:
    """Train `steps` steps of the model `model(cfg, data)` builds in `mode`, on its first batches;
    a row of the table (with `grads`, what its first step leaves under "step_one": capture.StepOne)."""
    row: dict[str, Any] = {"mode": mode}
    try:
        cfg = _compose(overrides, mode)
        if "verify" in cfg.accel:  # the check judges every engine itself: an engine's own would stop the row
            cfg.accel.verify = False
        if found := problems(cfg):
            raise OrtflowError("; ".join(found))
        seed_everything(cfg.seed)
        data = build_data(cfg)
        built = model(cfg, data)
        batches = list(itertools.islice(ResumableBatches(data.train), steps))
        with tempfile.TemporaryDirectory(prefix="ortflow-check-") as tmp:
            engine = accel.build(cfg.accel, engine_context(cfg, built, data, Path(tmp)))
            losses, times = [], []
            for step, batch in enumerate(batches, start=1):
                seed_step(cfg.seed, step)
                start = time.perf_counter()
                if step == 1 and grads:
                    first = split_batch(batch)
                    loss, row["step_one"] = capture.step_one(engine, lambda: engine.train_step(*first))  # noqa: B023
                else:
                    loss = engine.train_step(*split_batch(batch))
                losses.append(loss)
                times.append(time.perf_counter() - start)
            info = engine.describe()
    except Exception as err:  # every failure is a result here, reported in the table
        return row | {"trains": False, "reason": _one_line(err)}
    row |= {
        "trains": _executed_by(mode, overrides) in (None, info["executed_by"]) and all(map(math.isfinite, losses)),
        "executed_by": info["executed_by"],
        "losses": losses,
        "first_step_s": times[0],
        "step_ms": 1000 * statistics.median(times[1:]) if len(times) > 1 else float("nan"),
        "graph_fixes": info.get("graph_fixes", {}),
    }
    if reference is not None and len(reference) == len(losses):
        row["max_rel_loss_diff"] = max(abs(a - b) / abs(b) for a, b in zip(losses, reference, strict=True))
    return row


def _executed_by(mode: str, overrides: list[str]) -> str | None:
    """What engine `mode` says executed its steps when it ran as it should (its module's EXECUTED_BY; None: an
    engine of the search path that does not say, whose row is judged by its losses alone)."""
    return declared(accel.engines(search_dirs(overrides)).get(mode), "EXECUTED_BY")


def precisions_of(cfg: DictConfig, overrides: list[str], asked: tuple[str, ...] | None) -> tuple[str, ...]:
    """The precisions to check in: `asked` (--precision), or the config's trainer.precision. Raises ConfigError for
    trainer.precision=auto (it picks a precision by the machine: the check needs one) and for an override of
    trainer.precision that `asked` leaves out (the check would not run what the overrides ask for)."""
    given = str(cfg.trainer.precision)
    overridden = any(o.lstrip("+~").startswith("trainer.precision=") for o in overrides)
    if asked is None:
        asked = (given,)
    elif overridden and given not in asked:
        raise ConfigError(
            f"trainer.precision={given} is overridden, and --precision asks for {','.join(asked)}: the check runs "
            "every row and eager's own noise in the precisions it is asked for. Drop one of the two, or make them "
            "agree."
        )
    if AUTO in asked:
        raise ConfigError(
            f"trainer.precision={AUTO}: ortflow-check compares the engines in one precision at a time, and auto picks "
            f"one by the machine. Give it {FP32} or {BF16} (trainer.precision=... or --precision {FP32},{BF16})."
        )
    return tuple(dict.fromkeys(asked))


def _without_precision(overrides: list[str]) -> list[str]:
    return [o for o in overrides if not o.lstrip("+~").startswith("trainer.precision=")]


def _noise_runs(settings: list[str], steps: int, precision: str) -> list[dict[str, Any]]:
    """Eager again from weights moved by one ulp of the precision it computes in (bf16's with bf16-mixed)."""
    dtype = torch.bfloat16 if precision == BF16 else torch.float32
    runs = []
    for seed in one_ulp.NOISE_SEEDS:
        moved = lambda cfg, data, seed=seed: one_ulp.perturbed(fresh_model(cfg, data), seed, dtype)  # noqa: E731
        runs.append(try_mode("none", settings, steps, moved))
    return runs


def settings_in(overrides: list[str], precision: str) -> list[str]:
    """The overrides with trainer.precision set to `precision` (and no other setting of it)."""
    return [*_without_precision(overrides), f"trainer.precision={precision}"]


def reference(settings: list[str], steps: int) -> tuple[dict[str, Any], parity.Envelope | None]:
    """Eager's row and its own noise (None where eager did not train) for the config `settings` describe."""
    eager = try_mode("none", settings, steps, fresh_model)
    if not eager["trains"]:
        return eager, None
    precision = str(_compose(settings, "none").trainer.precision)
    fp32 = None
    if precision == BF16:  # bf16 rows are held to eager fp32's step-1 gradients (parity.Envelope.measure)
        exact = try_mode("none", settings_in(settings, FP32), 1, fresh_model)
        fp32 = exact["step_one"].gradients if exact["trains"] else None
    return eager, parity.Envelope.measure(eager, _noise_runs(settings, steps, precision), precision, fp32)


def judged(mode: str, settings: list[str], steps: int, envelope: parity.Envelope | None) -> dict[str, Any]:
    """`mode`'s row, with its verdict against eager's envelope when both trained."""
    row = try_mode(mode, settings, steps, fresh_model)
    if envelope is not None and row["trains"]:
        cfg = _compose(settings, mode)
        row["verdict"] = parity.judge(row, envelope, cfg.optim, cfg.trainer.grad_clip)
    return row


def check(
    overrides: list[str],
    steps: int,
    modes: list[str],
    precisions: tuple[str, ...] | None = None,
    strict: bool = False,
    accept_unjudgeable: bool = False,
) -> dict[str, Any]:
    """Build the model once (checking its contract), then, in each precision, eager (the reference), eager from
    one-ulp weights (its own noise: parity.Envelope) and each mode, every one on the model built afresh as a run
    builds it; each mode's verdict (parity.judge).

    Args:
        overrides: a training run's overrides (accel= is ignored).
        steps: training steps per mode.
        modes: the accel modes to try (eager always runs: it is the reference).
        precisions: trainer.precision values to check in (default: the config's own).
        strict: raise ParityFailed when a row differs, does not train, cannot be judged (or nothing could be
            compared).
        accept_unjudgeable: with `strict`, a row the check cannot judge (eager's own runs too chaotic) passes.

    Raises:
        ConfigError: the config, or precisions the check cannot honour.
        ParityFailed: with `strict`, a row that differs.
    """
    global _COMPOSED
    register_configs()
    _COMPOSED = {}
    try:
        return _check(overrides, steps, modes, precisions, strict, accept_unjudgeable)
    finally:
        _COMPOSED = None


def _check(
    overrides: list[str],
    steps: int,
    modes: list[str],
    precisions: tuple[str, ...] | None,
    strict: bool,
    accept_unjudgeable: bool = False,
) -> dict[str, Any]:
    cfg = _compose(overrides, "none")
    if cfg.distributed.name != "none":
        raise ConfigError(
            f"distributed={cfg.distributed.name}: ortflow-check compares the engines in one process, on the same "
            "batches as eager; a multi-process wrapper (its gradients all-reduced, under DeepSpeed partitioned) is "
            "not part of what it compares. Drop the distributed override: each wrapper's runs are tested against "
            "one process's (docs/distributed.md)."
        )
    precisions = precisions_of(cfg, overrides, precisions)
    seed_everything(cfg.seed)
    data = build_data(cfg)
    model = fresh_model(cfg, data)
    random = draws_random_numbers(model, split_batch(next(iter(data.train)))[0])
    rows: list[dict[str, Any]] = []
    envelopes: dict[str, dict[str, Any]] = {}
    for precision in precisions:
        settings = settings_in(overrides, precision)
        eager, envelope = reference(settings, steps)
        if envelope is not None:
            envelopes[precision] = envelope.record()
        if "none" in modes:
            rows.append(eager | {"precision": precision})
        for mode in [m for m in modes if m != "none"]:
            rows.append(judged(mode, settings, steps, envelope) | {"precision": precision})
    for row in rows:
        row.pop("step_one", None)
    report = {
        "overrides": overrides,
        "steps": steps,
        "model": cfg.model.get("_target_", "?"),
        "precisions": list(precisions),
        "rows": rows,
        "envelopes": envelopes,
        "random_forward": random,
        "torch": torch.__version__,
    }
    if strict and (failed := parity.failures(report, accept_unjudgeable)):
        raise parity.ParityFailed(failed, report)
    return report
