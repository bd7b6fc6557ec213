"""Model builders (conf/model): plain typed functions returning an nn.Module, referenced by `_target_`; the
contract every model meets is checked in contract.py. Two adapters let models that do not meet it as written train
unchanged: `sequence_first` (data.batch_first=false) and `select_output` (model._output_=KEY, for a forward that
returns a tuple, a dict or an object with the logits as one of its fields)."""

from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf
from torch import nn

from ortflow.errors import ModelError


def _swap(value: Any) -> Any:
    return value.transpose(0, 1) if isinstance(value, torch.Tensor) and value.dim() >= 2 else value


def _to_sequence_first(_module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    return tuple(_swap(a) for a in args), {k: _swap(v) for k, v in kwargs.items()}


def _to_batch_first(_module: nn.Module, _args: tuple, output: torch.Tensor) -> torch.Tensor:
    return output.transpose(0, 1)


def sequence_first(model: nn.Module) -> nn.Module:
    """Let a sequence-first model, (T, B, ...) -> (T, B, ..., C), take ortflow's batch-first batches: forward hooks
    transpose its inputs (every input tensor of 2 or more dimensions) and its output, so the engines (and ONNX
    exports, which trace the hooks) see a batch-first model, and its state_dict keeps its own names."""
    model.register_forward_pre_hook(_to_sequence_first, with_kwargs=True)
    model.register_forward_hook(_to_batch_first)
    return model


# `model._output_=KEY`: which element of a forward's tuple/dict/object output holds the logits (ortflow's key: it
# is not passed to the builder).
OUTPUT_KEY = "_output_"
FREEZE_KEY = "freeze"  # ortflow's key in every model group (model.freeze, ortflow/model/freeze.py)


def builder_node(model: DictConfig) -> DictConfig:
    """The model group without ortflow's own keys (_output_, freeze): what the builder is called with."""
    return OmegaConf.masked_copy(model, [k for k in model if k not in (OUTPUT_KEY, FREEZE_KEY)])


def output_keys(output: Any) -> list[str]:
    """The fields a forward's output offers: a tuple's indices, a dict's (or ModelOutput's) keys, an object's public
    attributes."""
    if isinstance(output, dict):
        return [str(k) for k in output]
    if isinstance(output, tuple | list):
        return [str(i) for i in range(len(output))]
    return [k for k in vars(output) if not k.startswith("_")] if hasattr(output, "__dict__") else []


def pick(output: Any, key: str) -> Any:
    """`output[int(key)]` for a tuple or list, `output[key]` for a mapping, `getattr(output, key)` otherwise.

    Raises:
        ModelError: the output has no such field (the message names the ones it has).
    """
    try:
        if isinstance(output, tuple | list):
            return output[int(key)]
        if isinstance(output, dict):
            return output[key]
        return getattr(output, key)
    except (IndexError, KeyError, AttributeError, ValueError):
        raise ModelError(
            f"model._output_={key!r}: the model's forward returned a {type(output).__name__} without that field; it "
            f"has {output_keys(output)}. Set model._output_ to the one holding the logits."
        ) from None


def select_output(model: nn.Module, key: str) -> nn.Module:
    """Let a model whose forward returns a tuple, a dict or an object (a Hugging Face ModelOutput, say) train: a
    forward hook keeps only the logits at `key`. The engines and ONNX exports then see a tensor-returning model."""
    model.register_forward_hook(lambda _module, _args, output: pick(output, key))
    return model
