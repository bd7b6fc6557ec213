"""The one owner of a run dir: it finds, validates and restores the checkpoint a run continues from, writes the
run's checkpoints, run.json (from "running" to how the run ended) and the history of earlier attempts, and keeps
what an earlier attempt wrote. Only rank 0 writes; other ranks restore the same state and write nothing.

Whether a dir may be used at all, and by whom, is decided before anything is written into it (ortflow/run/guard.py).
"""

import dataclasses
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ortflow.accel.engine import Chosen, Engine, Shards
from ortflow.data.resumable import ResumableBatches
from ortflow.distributed import World
from ortflow.errors import CheckpointError, RunDirError
from ortflow.files import flatten, read_record, write_json_atomic
from ortflow.model import state_dict
from ortflow.run import checkpoint
from ortflow.run.metadata import now, start_record
from ortflow.run.trainer import LoopState

log = logging.getLogger(__name__)

STARTING, TRAINING = "starting", "training"  # run.json "stage": before / from the loop's start
# What a run writes into its dir, besides Hydra's own .hydra/ and log file.
RUN_OUTPUTS = (
    "run.json",
    "metrics.jsonl",
    "metrics.csv",  # logger.csv
    "mlflow.json",  # logger.mlflow: the run id a resume continues
    "tensorboard",
    "checkpoints",
    "onnx",
    "tokenizer.json",  # a text run's tokenizer and data manifest
    "data_manifest.json",
)
# Settings that may change between a checkpoint and the run continuing it, without a warning.
_MAY_CHANGE = (
    "trainer.resume",
    "trainer.allow_data_change",
    "trainer.max_steps",
    "trainer.checkpoint",
    "accel",
    "debug",
    "logger",
    "objective",
)


def holds_a_run(run_dir: Path) -> bool:
    return any((run_dir / name).exists() for name in (".hydra", "run.json", "checkpoints"))


def never_trained(run_dir: Path) -> bool:
    """The dir's run stopped before its first training step (a config, data or model error, or a signal during
    start-up): it wrote no checkpoint, and its record says it never reached training. Such a dir may be reused."""
    record = read_record(run_dir)
    return (
        record is not None
        and record.get("stage") == STARTING
        and not checkpoint.step_checkpoints(run_dir / "checkpoints")
        and not (run_dir / "checkpoints" / "final.pt").exists()
    )


def set_aside_previous_attempt(run_dir: Path) -> None:
    """A run started again in its old dir without resuming (an interrupted sweep's job) keeps the earlier attempt's
    files, moved to previous-attempt-N/, so that nothing is lost and the new attempt's logs do not mix with the old."""
    if not (run_dir / "run.json").exists():
        return
    n = 1 + sum(1 for _ in run_dir.glob("previous-attempt-*"))
    target = run_dir / f"previous-attempt-{n}"
    target.mkdir()
    for name in RUN_OUTPUTS:
        if (run_dir / name).exists():
            (run_dir / name).rename(target / name)
    log.info("an earlier attempt's outputs in %s were moved to %s", run_dir, target)


def find_checkpoint(resume: str | None, checkpoints: Path) -> tuple[Path, dict[str, Any]] | None:
    """The checkpoint `trainer.resume` names: None for a new run (or `auto` with no checkpoint yet)."""
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
    """Put a checkpoint's weights into the torch model (before any engine is built around it)."""
    if payload["step"] > max_steps:
        raise CheckpointError(
            f"checkpoint '{path}' is at step {payload['step']}, beyond trainer.max_steps={max_steps}; set "
            f"trainer.max_steps to at least {payload['step']}."
        )
    frozen = set(frozen_parameters(model)) if payload.get("frozen_base") else set()
    try:
        # Weights without the state_dict metadata (written before ortflow kept it) are in the model's own versions.
        result = model.load_state_dict(state_dict.with_metadata(payload["model"], model), strict=not frozen)
        if frozen and (result.unexpected_keys or set(result.missing_keys) != frozen):
            missing = sorted(set(result.missing_keys) - frozen)[:3]
            raise RuntimeError(f"\n unexpected keys {result.unexpected_keys[:3]}, missing keys {missing}")
    except (RuntimeError, TypeError, AttributeError, ValueError, KeyError) as err:
        details = "; ".join(line.strip() for line in str(err).splitlines()[1:4] if line.strip()) or str(err)
        raise CheckpointError(
            f"checkpoint '{path}' does not fit this model ({details}). Use the model settings it was written with "
            "(they are in that run's .hydra/config.yaml)."
        ) from None


def frozen_parameters(model: nn.Module) -> dict[str, torch.Tensor]:
    """The parameters that do not train (model.freeze, LoRA's base weights), by state_dict name."""
    return {name: p for name, p in model.named_parameters(remove_duplicate=False) if not p.requires_grad}


def frozen_base(model: nn.Module) -> str | None:
    """The fingerprint of the model's frozen parameters (sha256 of their content); None when all of them train."""
    frozen = frozen_parameters(model)
    return checkpoint.digest(frozen) if frozen else None


def check_same_base(saved: str | None, current: str | None, path: Path) -> None:
    """A checkpoint of a run with frozen parameters holds only the trained ones: continuing it on another frozen base
    (another pretrained model, other model.freeze patterns) would pair its weights with foreign ones."""
    if saved != current:
        raise CheckpointError(
            f"checkpoint '{path}' was trained on a frozen base with fingerprint {str(saved)[:16]}, and this run's "
            f"frozen parameters have {str(current)[:16]} (another pretrained model, model.freeze or peft setting). "
            "Resume with the base model and settings it was trained with, or start a new run."
        )


def check_same_data(saved: dict[str, Any] | None, current: dict[str, Any], path: Path, allow_change: bool) -> None:
    """Refuse to continue a checkpoint on other data: a tokenizer that differs always (the model's embeddings mean
    other tokens), a data fingerprint that differs unless trainer.allow_data_change=true. A checkpoint or data
    without a fingerprint is not checked (logged).

    Raises:
        CheckpointError: naming both fingerprints and the key that allows the change.
    """
    saved = saved or {}
    old_tok, new_tok = saved.get("tokenizer"), current.get("tokenizer")
    if old_tok is not None and new_tok is not None and old_tok != new_tok:
        raise CheckpointError(
            f"checkpoint '{path}' was trained with tokenizer {old_tok}, and this run's data is encoded with "
            f"{new_tok}: the model's token ids would mean other text. Use the data.tokenizer it was trained with "
            "(that run's .hydra/config.yaml), or start a new run."
        )
    old, new = saved.get("fingerprint"), current.get("fingerprint")
    if old is None or new is None:
        log.info("resume: the data's fingerprint is unknown (%s -> %s); the data is not compared", old, new)
        return
    if old != new:
        if allow_change:
            log.warning("resuming on changed data (fingerprint %s -> %s), as trainer.allow_data_change asks", old, new)
            return
        raise CheckpointError(
            f"checkpoint '{path}' was trained on other data: the data's fingerprint was {old} and is now {new} (a "
            "source file or a data setting changed). Continuing would train on different data than the run so far. "
            "Restore the data, or set trainer.allow_data_change=true to continue on the new data."
        )


def _history(previous: dict[str, Any]) -> list[dict[str, Any]]:
    """Earlier attempts in this run dir, oldest first, each as its status, times, error, metrics and placement."""
    keep = ("started", "finished", "status", "error", "command", "metrics", "resumed_from", "placement")
    return [*previous.get("attempts", []), {k: previous[k] for k in keep if k in previous}]


class RunDir:
    """One run dir and everything in it that outlives the process: run.json, the attempts history, checkpoints.

    Use: `open()` once validation passed (finds the checkpoint to continue from and records the run as running),
    `start(model, make_engine, batches)` to get the engine and the loop state (fresh or restored), `save` as the
    loop's checkpoint callback, `finish(...)` when the run ends however it ends.
    """

    def __init__(
        self,
        path: Path,
        config: dict[str, Any],
        overrides: list[str],
        seed: int,
        world: World | None = None,
    ) -> None:
        self.path = path
        self.checkpoints = path / "checkpoints"
        self.config = config
        self.world = world or World()
        self.record = start_record(config, overrides, seed) | {"stage": STARTING}
        self.previous = read_record(path)
        if self.previous:
            self.record["attempts"] = _history(self.previous)
        self.source: tuple[Path, dict[str, Any]] | None = None
        self.keep: int | None = None
        self._engine: Engine | None = None
        self.frozen_base: str | None = None
        self.frozen: set[str] = set()
        self._batches: ResumableBatches | None = None
        self._model: nn.Module | None = None  # the torch model the engine trains: its state_dict metadata

    @property
    def writes(self) -> bool:
        return self.world.is_main

    def _write_record(self) -> None:
        if self.writes:
            write_json_atomic(self.path / "run.json", self.record)

    def open(self, resume: str | None, keep: int | None, world: World | None = None) -> None:
        """Find and check the checkpoint `resume` names, and record this attempt as running. A new run in a dir
        that holds an earlier attempt's outputs (re-run sweep job) moves them aside first."""
        self.world = world or self.world
        self.keep = keep
        self.source = find_checkpoint(resume, self.checkpoints)
        # An earlier attempt that trained is moved aside whole; one that never trained stays in "attempts" only.
        if self.writes and self.source is None and self.previous and self.previous.get("stage") != STARTING:
            set_aside_previous_attempt(self.path)
            self.record.pop("attempts", None)  # moved along with the earlier run.json
        self._write_record()

    def start(
        self,
        model: nn.Module,
        make_engine: Callable[[nn.Module], Engine],
        batches: ResumableBatches,
        max_steps: int,
        data_identity: dict[str, str | None] | None = None,
        allow_data_change: bool = False,
    ) -> tuple[Engine, LoopState | None]:
        """The engine around `model` and the loop state to continue from (None for a fresh run): a resumed run gets
        the checkpoint's weights before the engine is built, then its optimizer state, data position, RNG states
        and loop counters.

        Args:
            data_identity: the data's fingerprint and tokenizer (Data.fingerprint, Data.tokenizer), recorded in
                run.json and every checkpoint; a resume on other data is refused (see check_same_data).

        Raises:
            CheckpointError: the checkpoint does not fit the model, or was written on other data.
        """
        self.data_identity = dict(data_identity or {})
        self.frozen_base = frozen_base(model)  # of the model as built: the base a checkpoint's weights go with
        self.frozen = set(frozen_parameters(model))
        self.record["data_identity"] = self.data_identity
        if self.source is not None:
            path, payload = self.source
            check_same_data(payload.get("data_identity"), self.data_identity, path, allow_data_change)
            check_same_base(payload.get("frozen_base"), self.frozen_base, path)
            load_weights(model, payload, path, max_steps)
        engine = make_engine(model)
        self._engine, self._batches, self._model = engine, batches, model
        self.record["stage"] = TRAINING  # from here on the dir holds a run that trained (never reused)
        self._write_record()
        if self.source is None:
            return engine, None
        return engine, self._restore(engine, batches, self.source)

    def _restore(self, engine: Engine, batches: ResumableBatches, source: tuple[Path, dict[str, Any]]) -> LoopState:
        """Continue from the checkpoint `source` (its path and payload): its optimizer state into `engine`, its data
        position into `batches`, its RNG states, and what was resumed noted in the record; returns its loop state."""
        path, payload = source
        optimizer = payload["optimizer"]
        if optimizer.get("shards"):  # each rank's own state, in a folder beside the step file (distributed=deepspeed)
            optimizer = {**optimizer, "shards": str(path.parent / optimizer["shards"])}
        restored = engine.load_optimizer_state(optimizer)
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
        changes = config_differences(payload["config"], self.config)
        if changes:
            log.warning("settings that differ from the checkpoint's: %s", "; ".join(changes))
        self.record["resumed_from"] = {
            "checkpoint": str(path),
            "step": state.step,
            "written_by_accel": payload["accel"],
            "optimizer_restored": restored,
            "config_changes": changes,
        }
        log.info("resumed from %s at step %d (written by accel=%s)", path, state.step, payload["accel"])
        return state

    def resumed_choice(self) -> dict[str, Any] | None:
        """The engine choice (accel=auto's) recorded in the checkpoint this run resumes from, if any."""
        return self.source[1].get("engine_choice") if self.source is not None else None

    def save(self, state: LoopState) -> str:
        """The loop's checkpoint callback: the run's full state to checkpoints/step-NNNNNNNN.pt (rank 0 only; the
        other ranks hold the same state), pruned to the newest `keep`. Returns the checkpoint's path."""
        path = checkpoint.step_path(self.checkpoints, state.step)
        if isinstance(self._engine, Shards):  # on every rank: the state each keeps for itself
            self._engine.save_shards(checkpoint.shards_path(path))
        if not self.writes:
            return str(path)
        assert self._engine is not None and self._batches is not None, "save() before start()"
        assert self._model is not None
        weights = state_dict.with_metadata(self._engine.model_state_dict(), self._model)  # module versions kept
        payload = checkpoint.seal(
            {
                "format": checkpoint.FORMAT,
                "version": checkpoint.VERSION,
                "step": state.step,
                "accel": self._engine.name,
                # Frozen parameters are left out (a LoRA checkpoint holds its adapters); their fingerprint stays.
                "model": state_dict.without(weights, self.frozen),
                "frozen_base": self.frozen_base,
                "optimizer": self._engine.optimizer_state(),
                "rng": checkpoint.rng_state(),
                "data": self._batches.state_dict(),
                "loop": dataclasses.asdict(state),
                "config": self.config,
                "data_identity": self.data_identity,
                # accel=auto's: a resume keeps it
                "engine_choice": self._engine.choice if isinstance(self._engine, Chosen) else None,
            }
        )
        checkpoint.write_atomic(payload, path)
        checkpoint.prune(self.checkpoints, self.keep)
        log.info("checkpoint %s", path)
        return str(path)

    def release(self) -> None:
        """Let go of the engine once the loop is over (no `save` after it), so that its native resources (ORT
        sessions, DDP's reducer) can be freed before the process group is torn down."""
        self._engine = self._batches = self._model = None

    def write_final(self, weights: dict[str, Any]) -> None:
        """The final weights alone, loadable with torch.load + model.load_state_dict (no ortflow needed)."""
        if self.writes:
            checkpoint.write_atomic(weights, self.checkpoints / "final.pt")

    def write_best(self, weights: dict[str, Any]) -> None:
        """The weights of the best evaluation so far (by the run's objective), like final.pt; replaced atomically."""
        if self.writes:
            checkpoint.write_atomic(weights, self.checkpoints / "best.pt")

    def note(self, **fields: Any) -> None:
        """Fields of run.json's record that its next write carries, whatever the run's status then (the metrics of a
        run that trained and failed after)."""
        self.record |= fields

    def finish(self, status: str, **fields: Any) -> None:
        """Record how the run ended ("completed", "failed", "preempted") with the given fields. For a run that ends
        with an error, a run.json that cannot be written (the disk that failed the run is full) is reported in the
        log and does not hide that error; the run.json before stays as it was."""
        self.record |= {"status": status, "finished": now(), **fields}
        if status == "completed":
            self._write_record()
            return
        try:
            self._write_record()
        except RunDirError as err:
            log.error("run.json could not record that the run %s: %s", status, err)
