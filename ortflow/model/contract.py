"""The model contract, checked once on one batch before the first step, the same for every engine.

A builder returns an `nn.Module`. Its forward takes the batch's inputs (one tensor, the tensors of a tuple
positionally, or those of a dict by keyword), each `(B, ...)` (or `(T, B, ...)` with `data.batch_first=false`),
and returns a float tensor the loss takes (ortflow/step/loss.py): for cross-entropy, logits `(B, ..., C)` whose leading
dimensions are the targets' and whose last dimension C covers every class id in the targets; for mse and
bce_with_logits, the targets' shape. Samples must not interact across the batch dimension
(the engines pad short batches, and DDP splits batches): a probe that changes one sample must leave the other
samples' outputs unchanged, except through batch statistics (BatchNorm), a known dependence that check_model
reports (model/batch_dependence.py) and the runner honours by never padding such a model's batches
(data/short_batches.py). A violation is one ModelError naming the builder, what it returned and what was expected.
"""

from typing import Any

import torch
from torch import nn

from ortflow.errors import ModelError, OrtflowError
from ortflow.model.batch_dependence import BatchDependence, known_layers, moves_in_eval
from ortflow.step.batch import Inputs, describe, layout_of
from ortflow.step.loss import Loss


def check_builder_result(model: Any, target: str) -> nn.Module:
    """The builder's result if it is an nn.Module; otherwise one clear error naming the builder."""
    if not isinstance(model, nn.Module):
        raise OrtflowError(
            f"model._target_={target} returned {type(model).__name__} ({_short(model)}), not a torch.nn.Module. A "
            "model builder is a function (or class) returning the nn.Module to train."
        )
    if not any(p.requires_grad for p in model.parameters()):
        raise OrtflowError(f"model._target_={target} returned a model without trainable parameters; nothing to train.")
    return model


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


@torch.no_grad()
def check_model(model: nn.Module, inputs: Inputs, targets: torch.Tensor, loss: Loss, target: str) -> BatchDependence:
    """Run the contract's checks on one batch, in eval mode (no dropout), leaving the model as it was; return how
    the model depends on the other samples of a batch (batch statistics).

    Raises:
        ModelError: the forward fails on the batch, its output does not fit the loss, or it mixes samples other than
            through batch statistics.
    """
    layout = layout_of(inputs)
    tensors = layout.flatten(inputs)
    was_training = model.training
    model.eval()
    try:
        try:
            out = layout.call(model, tensors)
        except ModelError:
            raise  # already says what is wrong (e.g. an output key the forward does not return)
        except Exception as err:
            raise OrtflowError(
                f"model._target_={target}: the model's forward failed on a data batch of inputs "
                f"{describe(inputs)} ({type(err).__name__}: {str(err).strip().splitlines()[0]}). "
                "Check that the model fits the data (e.g. data=digits gives 64 float features per sample, data=text "
                "gives int64 token ids, data=diabetes 10 float features; a tuple of inputs is passed positionally, "
                "a dict by keyword)."
            ) from None
        _check_output(out, targets, loss, target)
        return _batch_dependence(model, layout, tensors, out, target)
    finally:
        model.train(was_training)


def _check_output(out: Any, targets: torch.Tensor, loss: Loss, target: str) -> None:
    if not isinstance(out, torch.Tensor):
        hint = ""
        if isinstance(out, tuple | list):
            hint = f" It returns {len(out)} items: choose the output with model._output_=INDEX (e.g. 0)."
        elif isinstance(out, dict) or hasattr(out, "__dict__"):
            keys = list(out) if isinstance(out, dict) else [k for k in vars(out) if not k.startswith("_")]
            hint = f" Choose the output among {keys[:8]} with model._output_=KEY (e.g. +model._output_=logits)."
        raise OrtflowError(
            f"model._target_={target}: forward returned {type(out).__name__} ({_short(out)}); expected a float "
            f"tensor for the loss ({type(loss).__name__})." + hint
        )
    if not out.is_floating_point():
        raise OrtflowError(
            f"model._target_={target}: forward returned a {out.dtype} tensor; expected a float tensor for the loss "
            f"({type(loss).__name__})."
        )
    if problem := loss.problem(out, targets):
        raise OrtflowError(f"model._target_={target}: {problem}.")


def _batch_dependence(
    model: nn.Module, layout: Any, tensors: tuple[torch.Tensor, ...], out: torch.Tensor, target: str
) -> BatchDependence:
    """The model's batch statistics; a ModelError if samples interact in eval mode in any other way."""
    known = known_layers(model)
    if tensors[0].size(0) < 2:
        return known
    call = lambda batch: layout.call(model, batch)  # noqa: E731
    if moves_in_eval(model, call, tensors, out, known):
        raise ModelError(
            f"model._target_={target} mixes samples across the batch dimension: changing one sample of a batch "
            "changed the other samples' outputs. ortflow hands batches batch-first, (B, T, ...); the likely cause is "
            "a sequence-first layer (e.g. nn.TransformerEncoderLayer or nn.MultiheadAttention with "
            "batch_first=False, nn.GRU/LSTM without batch_first=True) fed batch-first data. Set "
            "data.batch_first=false to hand the model (T, B, ...) inputs (its outputs are transposed back), or "
            "make the model batch-first. (Batch statistics, BatchNorm's, are a known dependence and were held fixed "
            "for this check.)"
        )
    return known
