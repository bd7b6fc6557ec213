"""Model builders (conf/model): plain typed functions returning an nn.Module, referenced by `_target_`; the
contract every model meets is checked in contract.py, and `sequence_first` adapts a sequence-first model."""

import torch
from torch import nn


def _to_sequence_first(_module: nn.Module, args: tuple) -> tuple:
    return (args[0].transpose(0, 1), *args[1:])


def _to_batch_first(_module: nn.Module, _args: tuple, output: torch.Tensor) -> torch.Tensor:
    return output.transpose(0, 1)


def sequence_first(model: nn.Module) -> nn.Module:
    """Let a sequence-first model, (T, B, ...) -> (T, B, ..., C), take ortflow's batch-first batches: forward hooks
    transpose its input and its output, so the engines (and ONNX exports, which trace the hooks) see a batch-first
    model, and its state_dict keeps its own names."""
    model.register_forward_pre_hook(_to_sequence_first)
    model.register_forward_hook(_to_batch_first)
    return model
