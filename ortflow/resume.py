"""Continuing a run: find the checkpoint `trainer.resume` names, restore a run's state from it, and write the
checkpoints that a later resume reads."""

import dataclasses
import logging
from pathlib import Path
from typing import Any

from torch import nn

from ortflow import checkpoint
from ortflow.accel.engine import Engine
from ortflow.data.resumable import ResumableBatches
from ortflow.errors import OrtflowError
from ortflow.loop import LoopState
from ortflow.metadata import flatten

log = logging.getLogger(__name__)

# Settings that may change between a checkpoint and the run continuing it, without a warning.
_MAY_CHANGE = ("trainer.resume", "trainer.max_steps", "trainer.checkpoint", "accel", "debug", "logger", "objective")


def find(resume: str | None, checkpoints: Path) -> tuple[Path, dict[str, Any]] | None:
    """The checkpoint to continue from: None for a new run (or `auto` with no checkpoint yet)."""
    if resume is None:
        return None
    if resume == "auto":
        checkpoint.remove_partial_writes(checkpoints)
        found = checkpoint.latest_valid(checkpoints)
        if found is None:
            log.info("trainer.resume=auto: no checkpoint in %s yet; starting from step 0", checkpoints)
        return found
    path = Path(resume).expanduser().absolute()
    return path, checkpoint.load(path)


def config_differences(saved: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """`key: saved -> current` for every setting that differs, apart from those a resume may change."""
    old, new = flatten(saved), flatten(current)
    keys = sorted(k for k in old.keys() | new.keys() if not k.startswith(_MAY_CHANGE))
    return [f"{k}: {old.get(k)!r} -> {new.get(k)!r}" for k in keys if old.get(k) != new.get(k)]


def load_weights(model: nn.Module, payload: dict[str, Any], path: Path, max_steps: int) -> None:
    """Put the checkpoint's weights into the torch model (before any engine is built around it)."""
    if payload["step"] > max_steps:
        raise OrtflowError(
            f"checkpoint '{path}' is at step {payload['step']}, beyond trainer.max_steps={max_steps}; set "
            f"trainer.max_steps to at least {payload['step']}."
        )
    try:
        model.load_state_dict(payload["model"], strict=True)
    except (RuntimeError, TypeError, AttributeError) as err:
        details = "; ".join(line.strip() for line in str(err).splitlines()[1:4] if line.strip()) or str(err)
        raise OrtflowError(
            f"checkpoint '{path}' does not fit this model ({details}). Use the model settings it was written with "
            "(they are in that run's .hydra/config.yaml)."
        ) from None


def restore(engine: Engine, batches: ResumableBatches, payload: dict[str, Any], path: Path) -> tuple[LoopState, bool]:
    """Optimizer, data position, RNG states and loop counters from a checkpoint; returns the loop state and
    whether the optimizer state was restored too."""
    restored = engine.load_optimizer_state(payload["optimizer"])
    if not restored:
        log.warning(
            "checkpoint %s was written by accel=%s: its weights are loaded, but its optimizer state is kept in "
            "another runtime's form, so the optimizer starts fresh",
            path,
            payload["accel"],
        )
    batches.load_state_dict(payload["data"])
    if not batches.exact:
        log.warning("the training DataLoader has no generator: the batch order after resuming is not reproduced")
    state = LoopState(**payload["loop"])
    checkpoint.set_rng_state(payload["rng"])
    log.info("resumed from %s at step %d (written by accel=%s)", path, state.step, payload["accel"])
    return state, restored


class Checkpointer:
    """Writes the run's full state to checkpoints/step-NNNNNNNN.pt and prunes to `keep`."""

    def __init__(
        self,
        directory: Path,
        keep: int | None,
        engine: Engine,
        batches: ResumableBatches,
        accel: str,
        config: dict[str, Any],
    ) -> None:
        self.directory = directory
        self.keep = keep
        self.engine = engine
        self.batches = batches
        self.accel = accel
        self.config = config

    def __call__(self, state: LoopState) -> str:
        payload = checkpoint.seal(
            {
                "format": checkpoint.FORMAT,
                "version": checkpoint.VERSION,
                "step": state.step,
                "accel": self.accel,
                "model": self.engine.model_state_dict(),
                "optimizer": self.engine.optimizer_state(),
                "rng": checkpoint.rng_state(),
                "data": self.batches.state_dict(),
                "loop": dataclasses.asdict(state),
                "config": self.config,
            }
        )
        path = checkpoint.step_path(self.directory, state.step)
        checkpoint.write_atomic(payload, path)
        checkpoint.prune(self.directory, self.keep)
        log.info("checkpoint %s", path)
        return str(path)
