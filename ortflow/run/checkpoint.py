"""Full training checkpoints: one file per checkpoint, written atomically, kept to a retention limit, and
validated on load so that a truncated, corrupt or foreign file is named in a clear error.

A checkpoint holds everything a run needs to continue as if never stopped: the model weights under the torch
model's own names (so any accel mode loads any other's), the optimizer state in the form its engine keeps it
(torch.optim's state_dict, or ONNX Runtime's CheckpointState with its optimizer state), the RNG states, the data
position, the loop's counters, and the resolved config it was written with.
"""

import hashlib
import logging
import random
import re
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ortflow import files
from ortflow.errors import CheckpointError
from ortflow.model import state_dict

log = logging.getLogger(__name__)

FORMAT = "ortflow-checkpoint"
VERSION = 1
REQUIRED = ("format", "version", "step", "accel", "model", "optimizer", "rng", "data", "loop", "config")
_NAME = re.compile(r"^step-(\d+)\.pt$")


def step_path(directory: Path, step: int) -> Path:
    return directory / f"step-{step:08d}.pt"


def step_checkpoints(directory: Path) -> list[tuple[int, Path]]:
    """(step, path) of the step checkpoints in `directory`, newest first."""
    if not directory.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in directory.iterdir() if (m := _NAME.match(p.name))]
    return sorted(found, reverse=True)


def digest(tree: Any) -> str:
    """sha256 over a payload's content: every tensor's dtype, shape and bytes, every other value's repr.

    torch.load does not check the zip CRCs, so a flipped bit inside a tensor loads silently; this catches it."""
    h = hashlib.sha256()

    def walk(node: Any) -> None:
        if isinstance(node, torch.Tensor):
            flat = node.detach().reshape(-1).contiguous()
            h.update(f"T{flat.dtype}{tuple(node.shape)}".encode())
            h.update(flat.view(torch.uint8).numpy())  # the tensor's memory, not a copy
        elif isinstance(node, dict):
            for key in sorted(node, key=repr):
                h.update(repr(key).encode())
                walk(node[key])
            if (versions := state_dict.metadata(node)) is not None:  # a state_dict's module versions
                h.update(b"M")
                walk(dict(versions))
        elif isinstance(node, list | tuple):
            h.update(b"[")
            for item in node:
                walk(item)
            h.update(b"]")
        elif isinstance(node, bytes):
            h.update(b"B%d:" % len(node))
            h.update(node)
        else:
            h.update(repr(node).encode())

    walk(tree)
    return h.hexdigest()


def _content(payload: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in payload.items() if k != "digest"}


def seal(payload: dict[str, Any]) -> dict[str, Any]:
    """The payload with the digest of its content added (what load() checks)."""
    return {**payload, "digest": digest(_content(payload))}


def write_atomic(payload: dict[str, Any], path: Path) -> None:
    """torch.save through a temporary file in the same directory, fsync, then rename: the final name only ever
    holds a complete file, whatever kills the process.

    Raises:
        RunDirError: the file system refused the write (e.g. the disk is full); no temporary file is left.
    """
    files.write_atomic(path, lambda file: torch.save(payload, file))


def share_tied(weights: dict[str, torch.Tensor], model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """`weights` (a model_state_dict from any engine) with the model's tied entries (a language model's embedding and
    output layer) sharing one tensor again, so torch.save writes them once. An engine that copies weights out of its
    runtime returns each name its own copy: the tied GPT-2 LM head is 154 MB written twice otherwise. The state_dict
    metadata (module versions) is kept, the model's own when `weights` has none."""
    shared = state_dict.with_metadata(weights, model)
    first: dict[tuple[int, torch.dtype, tuple[int, ...]], str] = {}
    for name, tensor in model.state_dict().items():
        if tensor.numel() == 0 or name not in shared:
            continue
        key = (tensor.data_ptr(), tensor.dtype, tuple(tensor.shape))
        if key not in first:
            first[key] = name
        elif torch.equal(shared[name], shared[first[key]]):
            shared[name] = shared[first[key]]
    return shared


def remove_partial_writes(directory: Path) -> None:
    """Delete temporary files a killed process left behind (never complete, never under a final name)."""
    for tmp in directory.glob(".*.tmp-*") if directory.is_dir() else []:
        log.info("removing %s, a checkpoint write that never completed", tmp)
        tmp.unlink(missing_ok=True)


def prune(directory: Path, keep: int | None) -> None:
    """Keep the newest `keep` step checkpoints (None: all)."""
    if keep is None:
        return
    for _, path in step_checkpoints(directory)[keep:]:
        path.unlink(missing_ok=True)
        shutil.rmtree(shards_path(path), ignore_errors=True)


def shards_path(step_file: Path) -> Path:
    """The folder beside a step checkpoint holding the state each rank keeps for itself (DeepSpeed's ZeRO
    partitions, written by every rank before rank 0 writes the step file; absent for the other wrappers)."""
    return step_file.with_suffix(".shards")


def load(path: Path) -> dict[str, Any]:
    """Read and check an ortflow checkpoint.

    Raises:
        CheckpointError: the file is missing, unreadable, truncated or corrupt, or not an ortflow checkpoint.
    """
    if not path.exists():
        raise CheckpointError(
            f"checkpoint '{path}' does not exist. Give an existing checkpoint file or trainer.resume=auto."
        )
    if not path.is_file():
        raise CheckpointError(
            f"checkpoint '{path}' is not a file (a checkpoint is one file, e.g. checkpoints/step-*.pt)."
        )
    try:
        # weights_only: a checkpoint is data; loading one never runs code from the file.
        payload = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:
        reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        if "weights_only" in reason:  # torch's advice to load unsafely: never for a file that fails a safe load
            reason = "it holds objects a safe (weights-only) load refuses to rebuild"
        raise CheckpointError(
            f"checkpoint '{path}' cannot be read: it is truncated, corrupt or not a torch checkpoint file ({reason}). "
            "Use another checkpoint (trainer.resume=auto picks the newest valid one in the run dir)."
        ) from None
    if isinstance(payload, dict) and payload.get("format") == FORMAT:
        if not isinstance(payload.get("version"), int) or payload["version"] > VERSION:
            raise CheckpointError(
                f"checkpoint '{path}' has format version {payload.get('version')!r}; this ortflow reads version "
                f"{VERSION} and older. Use the ortflow version that wrote it."
            )
        missing = [key for key in REQUIRED if key not in payload]
        if missing:
            raise CheckpointError(f"checkpoint '{path}' is incomplete: it lacks {missing}. Use another checkpoint.")
        if payload.get("digest") != digest(_content(payload)):
            raise CheckpointError(
                f"checkpoint '{path}' is corrupt: its content does not match the checksum written with it (the file "
                "changed after it was written). Use another checkpoint (trainer.resume=auto picks the newest valid)."
            )
        return payload
    if isinstance(payload, dict) and payload and all(isinstance(v, torch.Tensor) for v in payload.values()):
        raise CheckpointError(
            f"checkpoint '{path}' holds model weights only (like checkpoints/final.pt), not a training checkpoint "
            "with optimizer, RNG and data position. Resume from a checkpoints/step-*.pt file."
        )
    raise CheckpointError(f"checkpoint '{path}' is not an ortflow checkpoint (it holds a {type(payload).__name__}).")


def latest_valid(directory: Path) -> tuple[Path, dict[str, Any]] | None:
    """The newest checkpoint in `directory` that loads; None if there is none at all.

    Raises:
        CheckpointError: there are checkpoints, but none of them is valid (each one is named with its problem).
    """
    problems = []
    for _, path in step_checkpoints(directory):
        try:
            return path, load(path)
        except CheckpointError as err:
            log.warning("skipping %s: %s", path, err)
            problems.append(str(err))
    if problems:
        raise CheckpointError(
            f"trainer.resume=auto: no checkpoint in '{directory}' is valid, so there is nothing safe to continue "
            f"from: {' '.join(problems)}"
        )
    return None


# ------------------------------------------------------------------------------------------------- RNG state
def rng_state() -> dict[str, Any]:
    """Python, numpy and torch generator states, as plain data (a checkpoint loads with weights_only)."""
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    return {
        "python": random.getstate(),
        "numpy": {
            "kind": kind,
            "keys": torch.from_numpy(keys.astype(np.int64)),
            "pos": pos,
            "gauss": (has_gauss, gauss),
        },
        "torch": torch.get_rng_state(),
    }


def set_rng_state(state: dict[str, Any]) -> None:
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    np_state = state["numpy"]
    keys = np_state["keys"].numpy().astype(np.uint32)
    np.random.set_state((np_state["kind"], keys, np_state["pos"], *np_state["gauss"]))
    torch.set_rng_state(state["torch"])
