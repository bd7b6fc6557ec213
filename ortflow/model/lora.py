"""`+peft=lora`: LoRA adapters (the `peft` library) on a model=hf model or any nn.Module whose target modules are
Linear, Conv or transformers' Conv1D layers. Only the adapters train (peft freezes the base weights, and every engine
leaves frozen parameters alone: ortflow/model/freeze.py); the state_dict names become peft's
(base_model.model.<name>, with lora_A/lora_B beside each target's base_layer).

    ortflow model=hf model.name_or_path=DIR +peft=lora peft.r=8 peft.alpha=16
    ortflow model=custom model._target_=my.build +peft=lora 'peft.target_modules=[fc1,fc2]'
"""

import logging
import warnings
from typing import Any

from torch import nn

from ortflow.errors import ConfigError, ModelError
from ortflow.model.hf import HFModel

log = logging.getLogger(__name__)

# The end of a transformers model's class name -> peft's task type (which head peft keeps trainable, how it calls it).
TASK_TYPES = {
    "ForCausalLM": "CAUSAL_LM",
    "ForSequenceClassification": "SEQ_CLS",
    "ForTokenClassification": "TOKEN_CLS",
}


def _peft() -> Any:
    try:
        import peft
    except ImportError:
        raise ModelError(
            "+peft=lora needs the peft library, which is not installed: pip install 'ortflow[hf]'."
        ) from None
    return peft


def _linear_names(model: nn.Module) -> list[str]:
    kinds = (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d)
    return [name for name, m in model.named_modules() if isinstance(m, kinds) or type(m).__name__ == "Conv1D"]


def apply_lora(model: nn.Module, settings: Any) -> nn.Module:
    """`model` with LoRA adapters on its target modules and every other parameter frozen.

    Args:
        model: a model=hf model (HFModel: the adapters go on the transformers model inside, with peft's task type) or
            any nn.Module (its target modules must then be named).
        settings: the peft group: r, alpha, dropout, target_modules (null: peft's defaults for the architecture),
            bias.

    Raises:
        ConfigError: no target modules given for a model peft has no defaults for, a target that matches no module,
            or a target module type LoRA does not support.
    """
    peft = _peft()
    inner = model.model if isinstance(model, HFModel) else model
    name = type(inner).__name__
    task_type = next((t for end, t in TASK_TYPES.items() if name.endswith(end)), None)
    targets = list(settings.target_modules) if settings.target_modules is not None else None
    config = peft.LoraConfig(
        r=settings.r,
        lora_alpha=settings.alpha,
        lora_dropout=settings.dropout,
        target_modules=targets,
        bias=getattr(settings.bias, "value", settings.bias),
        task_type=task_type,
    )
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # peft's notes on fan_in_fan_out for transformers' Conv1D
            adapted = peft.get_peft_model(inner, config)
    except (ValueError, TypeError) as err:
        reason = str(err).strip().splitlines()[0]
        candidates = _linear_names(inner)
        shown = ", ".join(candidates[:8]) + (", ..." if len(candidates) > 8 else "")
        raise ConfigError(
            f"+peft=lora on {name}: {reason}. Set peft.target_modules to the Linear/Conv modules to adapt (names or "
            f"name suffixes; this model's: {shown or 'none'}); null takes peft's defaults for the transformers "
            "architectures it knows."
        ) from None
    trainable = sum(p.numel() for p in adapted.parameters() if p.requires_grad)
    log.info("LoRA r=%d on %s: %d trainable parameters", settings.r, sorted(config.target_modules), trainable)
    if isinstance(model, HFModel):
        model.model = adapted
        return model
    return adapted


def peft_model(model: nn.Module) -> Any:
    """The peft model inside a run's model (None when it has no adapters)."""
    peft = _peft()
    for module in model.modules():
        if isinstance(module, peft.PeftModel):
            return module
    return None
