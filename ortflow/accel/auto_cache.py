"""accel=auto's cache of decisions on this machine (~/.cache/ortflow/auto), keyed by what it measured: the model's
structure, the batch's shapes, the loss, optimizer and engine settings, the versions (ortflow's included), the CPU."""

import dataclasses
import functools
import hashlib
import importlib.metadata
import json
import logging
import os
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from ortflow import machine
from ortflow.accel import catalog
from ortflow.accel.auto_decision import Probe, Runoff
from ortflow.accel.compat import versions
from ortflow.accel.engine import EngineContext

log = logging.getLogger(__name__)


CACHE_FORMAT = 3


def cache_key(ctx: EngineContext, names: list[str], precisions: list[str], settings: dict[str, Any]) -> str:
    """What the probe measured, hashed: the model's structure and parameter shapes, the batch's shapes, the loss,
    optimizer and engine settings, the candidates and precisions, the versions (ortflow's too) and the CPU."""
    inputs, targets = ctx.example
    flat = ctx.layout.flatten(inputs)
    what = {
        "format": CACHE_FORMAT,
        "model": repr(ctx.model),
        "parameters": [(n, list(p.shape), str(p.dtype), p.requires_grad) for n, p in ctx.model.named_parameters()],
        "inputs": [(list(t.shape), str(t.dtype)) for t in (*flat, targets)],
        "loss": _describe(ctx.loss),
        "optim": OmegaConf.to_container(ctx.optim, enum_to_str=True)
        if isinstance(ctx.optim, DictConfig)
        else repr(ctx.optim),
        "grad_clip": ctx.grad_clip,
        "accumulate": ctx.accumulate,
        "candidates": names,
        "precisions": precisions,
        "settings": {k: str(v) for k, v in sorted(settings.items()) if v is not None},
        "versions": versions.installed_versions(),
        "ortflow": ortflow_version(),
        "machine": machine.describe(),
    }
    return hashlib.sha256(json.dumps(what, sort_keys=True, default=str).encode()).hexdigest()[:32]


@functools.cache
def ortflow_version() -> str:
    """ortflow's release and a digest of its engines' code (accel/): a checkout that changed an engine probes anew."""
    digest = hashlib.sha256()
    root = Path(catalog.__file__).parent
    for path in sorted(root.rglob("*.py")):
        digest.update(path.relative_to(root).as_posix().encode() + path.read_bytes())
    try:
        release = importlib.metadata.version("ortflow")
    except importlib.metadata.PackageNotFoundError:
        release = "unknown"
    return f"{release}+{digest.hexdigest()[:12]}"


def _describe(obj: Any) -> str:
    """An object's class and settings, without the memory address a default repr carries."""
    text = repr(obj)
    if " at 0x" in text:
        settings = {k: v for k, v in vars(obj).items() if not k.startswith("_")}
        text = f"{type(obj).__module__}.{type(obj).__qualname__}({json.dumps(settings, sort_keys=True, default=str)})"
    return text


def cache_dir() -> Path:
    root = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(root) / "ortflow" / "auto"


def read_cache(key: str) -> dict[str, Any] | None:
    """A cached decision: the probes that ran (failures are never cached), the runoff, the choice."""
    try:
        record = json.loads((cache_dir() / f"{key}.json").read_text())
        record["probes"] = [Probe(**probe) for probe in record["probes"]]
        record["runoff"] = Runoff(**record["runoff"]) if record.get("runoff") else None
        return record
    except (OSError, ValueError, KeyError, TypeError):
        return None  # none yet, or unreadable: probe again


def write_cache(key: str, probes: list[Probe], run: Runoff | None) -> None:
    ran = [dataclasses.asdict(p) for p in probes if p.step_ms is not None]
    try:
        folder = cache_dir()
        folder.mkdir(parents=True, exist_ok=True)
        staged = folder / f".{key}.{os.getpid()}.tmp"
        record = {"probes": ran, "runoff": dataclasses.asdict(run) if run is not None and not run.error else None}
        staged.write_text(json.dumps(record))
        os.replace(staged, folder / f"{key}.json")
    except OSError as err:  # a read-only home: the run goes on, the next one probes again
        log.info("accel=auto: the probe could not be cached (%s)", err)


def forget(key: str) -> None:
    """Drop a cached decision (its choice no longer builds)."""
    (cache_dir() / f"{key}.json").unlink(missing_ok=True)
