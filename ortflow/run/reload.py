"""A finished (or interrupted) run rebuilt from its run dir: its config from run.json, its data (with the run's own
tokenizer, for text), and its model holding the chosen weights. The Python API's `load_run` and `ortflow-predict`
both use it."""

import json
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf
from torch import nn

from ortflow.errors import CheckpointError, ConfigError, DataError, RunDirError
from ortflow.files import read_record
from ortflow.model import state_dict

WEIGHTS = ("best", "final")
TEXT_BUILDER = "ortflow.data.text.build_text_data"
TOKENIZER_FILE, RUN_MANIFEST = "tokenizer.json", "data_manifest.json"  # what a text run's dir keeps (runner.py)


def rebuild(run_dir: Path, weights: str, text: Path | None = None) -> tuple[DictConfig, Any, nn.Module, Path]:
    """The run's config, data (its own, or `text` for a text run), and model with the chosen weights, in eval mode.

    Args:
        weights: "best" (checkpoints/best.pt; final.pt when the run made no evaluation) or "final".

    Raises:
        RunDirError: the directory holds no ortflow run.
        CheckpointError: the weights file is missing or does not fit the run's model.
        ConfigError, DataError, ModelError: the run's data or model cannot be rebuilt here.
    """
    from ortflow.run.runner import build_data, build_model

    if weights not in WEIGHTS:
        raise ConfigError(f"weights={weights!r}: choose one of {WEIGHTS}.")
    record = read_record(run_dir)
    if not record or "config" not in record:
        raise RunDirError(f"'{run_dir}' holds no run.json with a config; give a run directory written by ortflow.")
    cfg = OmegaConf.create(record["config"])
    if text is not None and cfg.data.get("_target_") != TEXT_BUILDER:
        raise DataError(f"--text: the run in {run_dir} was not trained on text (data={cfg.data._target_}).")
    if cfg.data.get("_target_") == TEXT_BUILDER:
        use_run_tokenizer(cfg, run_dir, record, text)
    path = run_dir / "checkpoints" / f"{weights}.pt"
    if weights == "best" and not path.is_file():
        path = run_dir / "checkpoints" / "final.pt"  # a run without evaluations has no best.pt
    if not path.is_file():
        raise CheckpointError(
            f"'{path}' does not exist: the run has not finished (status {record.get('status', '?')!r}); resume it, or "
            "load its final weights."
        )
    data = build_data(cfg)
    if cfg.data.get("_target_") == TEXT_BUILDER:
        check_tokenizer(data, run_dir)
    model = build_model(cfg, data)
    try:
        # final.pt and best.pt written before ortflow kept the state_dict metadata: in the model's own versions
        model.load_state_dict(state_dict.with_metadata(torch.load(path, map_location="cpu", weights_only=True), model))
    except Exception as err:  # a foreign, truncated or mismatched file
        reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise CheckpointError(f"'{path}' cannot be loaded into the run's model ({reason}).") from None
    return cfg, data, model.eval(), path


def use_run_tokenizer(cfg: DictConfig, run_dir: Path, record: dict[str, Any], text: Path | None) -> None:
    """Point the run's text config at the run's own tokenizer: for --text, the tokenizer file the run dir keeps
    (the byte tokenizer when it keeps none); for the run's validation split, the prepared folder it trained on
    when it still exists, else its source prepared again with that tokenizer file."""
    tokenizer = run_dir / TOKENIZER_FILE
    if text is not None:
        cfg.data.source = str(text)
        cfg.data.tokenizer = str(tokenizer) if tokenizer.is_file() else "bytes"
        return
    prepared = (record.get("data") or {}).get("prepared")
    if prepared and (Path(prepared) / "manifest.json").is_file():
        cfg.data.source = prepared
    elif tokenizer.is_file():
        cfg.data.tokenizer = str(tokenizer)


def check_tokenizer(data: Any, run_dir: Path) -> None:
    """Refuse data encoded with another tokenizer than the run's (its manifest in the run dir says which)."""
    manifest = run_dir / RUN_MANIFEST
    if not manifest.is_file():
        return  # a run from before token files: bytes
    tokenizer = json.loads(manifest.read_text())["tokenizer"]
    expected = "bytes" if tokenizer["kind"] == "bytes" else "sha256:" + tokenizer["sha256"][:16]
    if data.tokenizer != expected:
        raise DataError(
            f"the data was encoded with tokenizer {data.tokenizer}, but the run in {run_dir} was trained with "
            f"{expected} ({manifest}); its token ids would mean other text."
        )
