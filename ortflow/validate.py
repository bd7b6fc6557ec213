"""Cross-field rules checked once at start-up, all reported together, each naming the key and the fix.

Single-key types and allowed keys are the schema's job (ortflow/config.py); this module holds the rules that
involve several groups (trainer x scheduler x data x model), and asks the chosen engine (ortflow/accel) and the
distributed settings (ortflow/distributed.py) for their own rules.
"""

import dataclasses
import logging

from hydra.utils import get_object
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import MissingMandatoryValue, OmegaConfBaseException

from ortflow import accel, distributed, ranges
from ortflow.config import FINAL_METRICS, PRECISIONS, OptimName
from ortflow.errors import collect
from ortflow.model import FREEZE_KEY, OUTPUT_KEY

log = logging.getLogger(__name__)


def objectives(cfg: DictConfig) -> tuple[str, ...]:
    """The metrics a run with this config reports: FINAL_METRICS, its loss's eval metrics, and its data's (text:
    eval/bits_per_byte)."""
    try:
        metrics = getattr(get_object(cfg.loss._target_), "metrics", ())
    except Exception:  # a user's loss (or one that does not import: loss.build reports it)
        metrics = ()
    from_data = ("eval/bits_per_byte",) if _is_text(cfg.data) else ()
    return (*FINAL_METRICS, *(f"eval/{m}" for m in metrics), *from_data)


def _is_text(data: DictConfig) -> bool:
    return "_target_" in data and str(data._target_).endswith("build_text_data")


def unknown_keys(node: DictConfig, path: str = "") -> list[str]:
    """Keys that a schema does not declare. Hydra's `+key=value` can add them even in struct mode; the code
    would then silently ignore them."""
    found = []
    schema = OmegaConf.get_type(node)
    if dataclasses.is_dataclass(schema):
        declared = {f.name for f in dataclasses.fields(schema)}
        if path == "model.":
            declared.update((OUTPUT_KEY, FREEZE_KEY))  # ortflow's own keys in every model group, never ignored
        for key in node:
            if key not in declared:
                found.append(f"{path}{key} is not a setting ortflow knows; remove it (known: {sorted(declared)}).")
    for key in node:
        child = node._get_node(key)
        if isinstance(child, DictConfig):
            found += unknown_keys(child, f"{path}{key}.")
    return found


def problems(cfg: DictConfig) -> list[str]:
    """Every cross-field problem in `cfg`, as messages naming the key to change."""
    found = _unreadable(cfg)
    if found:
        return found  # the rules below read these keys
    found = ranges.problems(cfg)  # every single-key range the schema declares, all at once
    found += accel.problems(cfg)
    found += _metric_problems(cfg)
    found += distributed.problems(cfg.distributed)
    found += _trainer_problems(cfg.trainer)
    found += _model_data_problems(cfg)
    found += _export_problems(cfg)
    return found


def _unreadable(cfg: DictConfig) -> list[str]:
    """What keeps the rules from reading the config: a value that does not resolve (reported alone), else the keys
    no schema declares and the required ones left ???."""
    try:
        OmegaConf.to_container(cfg, resolve=True)
    except MissingMandatoryValue:
        pass  # reported below, with every other ??? key
    except OmegaConfBaseException as err:
        reason = str(err).splitlines()[0]
        return [f"{err.full_key or 'the config'}: a value cannot be resolved ({reason}); fix or remove it."]
    found = unknown_keys(cfg)
    found += [
        f"{key} is required (it is ???); set it, e.g. {key}=<value>." for key in sorted(OmegaConf.missing_keys(cfg))
    ]
    return found


def _metric_problems(cfg: DictConfig) -> list[str]:
    """The objective and the early-stopping metric, each checked against the metrics this run reports."""
    found = []
    if cfg.objective not in (reported := objectives(cfg)):
        found.append(
            f"objective={cfg.objective!r} is not a metric this run reports (with loss {cfg.loss._target_}); choose "
            f"one of {reported}."
        )
    stop_metric = cfg.trainer.early_stopping.metric
    if stop_metric is not None and stop_metric not in (evals := [m for m in reported if m.startswith("eval/")]):
        found.append(
            f"trainer.early_stopping.metric={stop_metric!r} is not an eval metric this run reports; choose one of "
            f"{evals} (or null to turn early stopping off)."
        )
    return found


def _trainer_problems(trainer: DictConfig) -> list[str]:
    """The trainer's precision and its resume setting."""
    found = []
    if trainer.precision not in PRECISIONS:
        found.append(
            f"trainer.precision={trainer.precision!r} is not a precision ortflow trains in; choose one of "
            f"{', '.join(PRECISIONS)} (bf16-mixed: matmuls and convolutions in bf16, as torch's CPU autocast)."
        )
    if trainer.resume is not None and not trainer.resume.strip():
        found.append("trainer.resume is empty; use trainer.resume=auto, a checkpoint path, or leave it out.")
    return found


def _model_data_problems(cfg: DictConfig) -> list[str]:
    """The model against the data it trains on (its kind of inputs, its vocabulary) and the model's own shape."""
    found = []
    data = cfg.data
    is_text = _is_text(data)
    model_target = cfg.model.get("_target_", "")
    if is_text and model_target == "ortflow.model.mlp.build_mlp":
        found.append(
            "model=mlp takes float features per sample (data=digits or data=diabetes), but data=text gives token "
            "ids; use model=transformer with data=text, or data=digits with model=mlp."
        )
    if model_target.endswith("build_transformer") and cfg.model.nhead > 0 and cfg.model.d_model % cfg.model.nhead:
        found.append(f"model.nhead={cfg.model.nhead} must divide model.d_model={cfg.model.d_model}.")
    vocab = cfg.model.get("vocab_size")  # null: the tokenizer's (filled once the data is built)
    if is_text and vocab is not None and data.tokenizer == "bytes" and vocab < 256:
        found.append(
            f"model.vocab_size={vocab}: byte-level text data (data.tokenizer=bytes) needs vocab_size >= 256; leave "
            "it null to follow the data."
        )
    return found


def _export_problems(cfg: DictConfig) -> list[str]:
    """The export settings that need another one set, or an optimizer the export can run."""
    found = []
    if cfg.export.hf_adapter_only and not cfg.export.hf:
        found.append("export.hf_adapter_only=true shapes the export.hf folder; set export.hf=true too (or drop it).")
    if cfg.export.device_web and not cfg.export.device:
        found.append("export.device_web=true adds a page to the export.device folder; set export.device=true too.")
    if cfg.export.device and cfg.optim.name == OptimName.sgd and (cfg.optim.momentum or cfg.optim.weight_decay):
        found.append(
            "export.device=true with optim=sgd and optim.momentum/optim.weight_decay: ORT's on-device SGD has "
            "neither; use optim=adamw, set both to 0, or drop export.device."
        )
    return found


def warnings(cfg: DictConfig) -> list[str]:
    """Settings that are adjusted rather than refused (a quick run of a long recipe), one line each."""
    found = []
    if cfg.scheduler.warmup_steps > cfg.trainer.max_steps:
        found.append(
            f"scheduler.warmup_steps={cfg.scheduler.warmup_steps} is longer than trainer.max_steps="
            f"{cfg.trainer.max_steps}: the warmup is cut to {cfg.trainer.max_steps} steps."
        )
    return found


def validate(cfg: DictConfig) -> None:
    """Raise one OrtflowError listing every problem, or log the adjustments (warnings) and return."""
    collect(problems(cfg), "The configuration has problems (fix these keys and run again):")
    for warning in warnings(cfg):
        log.warning(warning)
