"""Cross-field rules checked once at start-up, all reported together, each naming the key and the fix.

Single-key types and allowed keys are the schema's job (ortflow/config.py); this module holds the rules that
involve several groups (trainer x scheduler x data x model), and asks the chosen engine (ortflow/accel) and the
distributed settings (ortflow/distributed.py) for their own rules.
"""

import dataclasses

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import MissingMandatoryValue, OmegaConfBaseException

from ortflow import accel, distributed
from ortflow.errors import collect
from ortflow.trainer import FINAL_METRICS

OBJECTIVES = FINAL_METRICS


def unknown_keys(node: DictConfig, path: str = "") -> list[str]:
    """Keys that a schema does not declare. Hydra's `+key=value` can add them even in struct mode; the code
    would then silently ignore them."""
    found = []
    schema = OmegaConf.get_type(node)
    if dataclasses.is_dataclass(schema):
        declared = {f.name for f in dataclasses.fields(schema)}
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
    if found:
        return found  # the rules below read these keys
    trainer, data = cfg.trainer, cfg.data
    found += accel.problems(cfg)
    if cfg.objective not in OBJECTIVES:
        found.append(f"objective={cfg.objective!r} is not a metric ortflow reports; choose one of {OBJECTIVES}.")
    found += distributed.problems(cfg.distributed)
    for key in ("max_steps", "log_every"):
        if trainer[key] < 1:
            found.append(f"trainer.{key}={trainer[key]} must be >= 1.")
    if trainer.eval_every < 0:
        found.append(f"trainer.eval_every={trainer.eval_every} must be >= 0 (0 = only at the end).")
    if trainer.eval_batches is not None and trainer.eval_batches < 1:
        found.append(f"trainer.eval_batches={trainer.eval_batches} must be >= 1, or null for all.")
    if trainer.grad_clip is not None and trainer.grad_clip <= 0:
        found.append(f"trainer.grad_clip={trainer.grad_clip} must be > 0, or null for no clipping.")
    if trainer.checkpoint.every < 0:
        found.append(f"trainer.checkpoint.every={trainer.checkpoint.every} must be >= 0 (0 = only at the end).")
    if trainer.checkpoint.keep is not None and trainer.checkpoint.keep < 1:
        found.append(f"trainer.checkpoint.keep={trainer.checkpoint.keep} must be >= 1, or null to keep all.")
    if trainer.max_skipped_steps < 0:
        found.append(f"trainer.max_skipped_steps={trainer.max_skipped_steps} must be >= 0.")
    if trainer.resume is not None and not trainer.resume.strip():
        found.append("trainer.resume is empty; use trainer.resume=auto, a checkpoint path, or leave it out.")
    if cfg.optim.lr <= 0:
        found.append(f"optim.lr={cfg.optim.lr} must be > 0.")
    if cfg.scheduler.name.value != "constant" and cfg.scheduler.warmup_steps >= trainer.max_steps:
        found.append(
            f"scheduler.warmup_steps={cfg.scheduler.warmup_steps} must be below trainer.max_steps={trainer.max_steps}."
        )
    if "batch_size" in data and data.batch_size < 1:
        found.append(f"data.batch_size={data.batch_size} must be >= 1.")
    if "val_fraction" in data and not 0 < data.val_fraction < 1:
        found.append(f"data.val_fraction={data.val_fraction} must be between 0 and 1.")
    if "block_size" in data and data.block_size < 1:
        found.append(f"data.block_size={data.block_size} must be >= 1.")
    is_text = "_target_" in data and data._target_.endswith("build_text_data")
    model_target = cfg.model.get("_target_", "")
    if is_text and model_target == "ortflow.model.mlp.build_mlp":
        found.append(
            "model=mlp takes 64 float features per sample (data=digits), but data=text gives token ids; use "
            "model=transformer with data=text, or data=digits with model=mlp."
        )
    if model_target.endswith("build_transformer") and cfg.model.d_model % cfg.model.nhead:
        found.append(f"model.nhead={cfg.model.nhead} must divide model.d_model={cfg.model.d_model}.")
    if is_text and "vocab_size" in cfg.model and cfg.model.vocab_size < 256:
        found.append(f"model.vocab_size={cfg.model.vocab_size}: byte-level text data needs vocab_size >= 256.")
    return found


def validate(cfg: DictConfig) -> None:
    """Raise one OrtflowError listing every problem, or return."""
    collect(problems(cfg), "The configuration has problems (fix these keys and run again):")
