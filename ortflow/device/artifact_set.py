"""One set of training artifacts for a device, made by the artifacts engine with the portable settings
(portable.ENGINE_SETTINGS) from a model's current weights, then finished for a device: the learning rate carried in
the optimizer model, the engine's scratch files removed, and anything a device cannot run refused."""

import copy
from dataclasses import dataclass
from pathlib import Path

import onnx
import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.nn.modules.dropout import _DropoutNd

from ortflow.accel import artifacts
from ortflow.accel.engine import EngineContext
from ortflow.config import OptimConfig
from ortflow.device import graphs, portable
from ortflow.errors import OrtflowError
from ortflow.step.batch import Inputs
from ortflow.step.loss import Loss

FILES = {
    "training_model": "training_model.onnx",
    "eval_model": "eval_model.onnx",
    "optimizer_model": "optimizer_model.onnx",
    "checkpoint": "checkpoint",
}
PREFIX = "model."  # the artifacts engine's prefix of the torch names in its graphs
SCRATCH = ("forward.onnx",)  # the engine's own files a device does not need


@dataclass
class ArtifactSet:
    """What the manifest needs to know about a written set."""

    folder: Path
    user_inputs: list[str]  # the training and eval graphs' data inputs, targets last
    loss_by_ort_block: bool  # ORT's loss block on the model's output (targets flattened), else the loss in the graph
    parameters: list[tuple[str, list[int], bool]]  # (graph name, shape, trainable) in the flat buffer's order
    dropout_nodes: int
    learning_rate_scale: float


def batchnorm_momenta(model: nn.Module) -> dict[str, float]:
    """Torch's momentum of every tracking BatchNorm, by its name in the graphs.

    Raises:
        OrtflowError: a layer with momentum=None (a cumulative average: ORT's kernel has only a fixed momentum).
    """
    found = {}
    for name, module in model.named_modules():
        if isinstance(module, _BatchNorm) and module.track_running_stats:
            if module.momentum is None:
                raise OrtflowError(
                    f"the model's BatchNorm '{name}' has momentum=None (a cumulative average of the batch statistics), "
                    "which ORT's BatchNorm kernel cannot express on a device: it updates running statistics with a "
                    "fixed momentum. Train the model with a BatchNorm momentum (torch's default is 0.1) to export it."
                )
            found[PREFIX + name] = float(module.momentum)
    return found


def without_dropout(model: nn.Module) -> nn.Module:
    """A copy of `model` whose dropout layers drop nothing: nn.Dropout*'s p, and the float dropout attributes
    attention layers use inside their forward (nn.MultiheadAttention's `dropout`, transformers' `attention_dropout`)."""
    copied = copy.deepcopy(model)
    for module in copied.modules():
        if isinstance(module, _DropoutNd):
            module.p = 0.0
        for key, value in vars(module).items():
            if "dropout" in key and isinstance(value, float) and not isinstance(value, bool):
                setattr(module, key, 0.0)
    return copied


def _write_engine_set(
    model: nn.Module,
    example: tuple[Inputs, torch.Tensor],
    loss: Loss,
    optim: OptimConfig,
    grad_clip: float | None,
    folder: Path,
) -> tuple[bool, list[str], set[str], set[str]]:
    """Write the engine's set into `folder`, its checkpoint from the engine's state and its scratch files removed."""
    ctx = EngineContext(
        model=model,
        example=example,
        optim=optim,
        loss=loss,
        grad_clip=grad_clip,
        onnx_dir=folder,
        precision=portable.PRECISION,
    )
    engine = artifacts.build(ctx, **portable.ENGINE_SETTINGS)
    loss_by_ort_block = engine.loss_block is not None
    user_inputs = list(engine.module.input_names())
    trainable = set(engine.trainable)
    state_names = {name for name, _ in engine.state.parameters}  # the checkpoint's (weights and frozen statistics)
    # The engine's state holds the model's running statistics (it writes them in when it opens); the checkpoint file
    # generate_artifacts wrote holds those after the export's traced training forward: the state replaces it.
    from onnxruntime.training import api

    api.CheckpointState.save_checkpoint(engine.state, str(folder / FILES["checkpoint"]), include_optimizer_state=False)
    del engine  # its sessions hold the files open
    for name in SCRATCH:
        (folder / name).unlink(missing_ok=True)
    return loss_by_ort_block, user_inputs, trainable, state_names


def _carry_learning_rate(folder: Path, scale: float) -> None:
    """Make the optimizer model carry the run's learning rate (`scale` x the runtime's) and Hugging Face's AdamW."""
    optimizer = onnx.load(str(folder / FILES["optimizer_model"]))
    graphs.scale_learning_rate(optimizer, scale)
    graphs.hugging_face_adamw(optimizer)
    onnx.save(optimizer, str(folder / FILES["optimizer_model"]))


def _parameters(
    training: onnx.ModelProto, state_names: set[str], trainable: set[str]
) -> list[tuple[str, list[int], bool]]:
    """The training graph's parameter inputs as (graph name, shape, trainable), in the flat buffer's order."""
    initializer_names = {i.name for i in training.graph.initializer}
    parameters = []
    for value in training.graph.input:
        if value.name not in state_names or value.name in initializer_names:
            continue  # data inputs, lazy_reset_grad, the gradient accumulation buffers
        shape = [d.dim_value for d in value.type.tensor_type.shape.dim]
        parameters.append((value.name, shape, value.name in trainable))
    return parameters


def _refuse_unportable(
    folder: Path,
    training: onnx.ModelProto,
    user_inputs: list[str],
    parameters: list[tuple[str, list[int], bool]],
) -> None:
    """Raise if any of the set's models holds what a device cannot run or takes an input a device does not feed."""
    buffers = {v.name for v in training.graph.input if v.name.endswith(graphs.GRAD_BUFFER)}
    allowed = {*user_inputs, graphs.LAZY_RESET_GRAD, *(p[0] for p in parameters), *buffers}
    problems = []
    for key, file in FILES.items():
        if key != "checkpoint":
            inputs = allowed if key != "optimizer_model" else None  # the optimizer's inputs are ORT's own
            problems += graphs.portability_problems(file, onnx.load(str(folder / file)), inputs)
    if problems:
        raise OrtflowError(
            "the exported set cannot train on a device: " + "; ".join(problems) + ". An op exported as torch's "
            "kernel has no ORT-native path for this model (upsampling is one today); export a model without it."
        )


def build(
    model: nn.Module,
    example: tuple[Inputs, torch.Tensor],
    loss: Loss,
    optim: OptimConfig,
    lr: float,
    grad_clip: float | None,
    folder: Path,
) -> ArtifactSet:
    """Write a set for `model`'s current weights into `folder` (the model itself is left as it was).

    Raises:
        OrtflowError: the engine cannot export the model, or the set holds what a device cannot run.
    """
    model = copy.deepcopy(model).float()
    folder.mkdir(parents=True, exist_ok=True)
    loss_by_ort_block, user_inputs, trainable, state_names = _write_engine_set(
        model, example, loss, optim, grad_clip, folder
    )

    training = onnx.load(str(folder / FILES["training_model"]))
    scale = lr / portable.RUNTIME_LR
    _carry_learning_rate(folder, scale)

    parameters = _parameters(training, state_names, trainable)
    _refuse_unportable(folder, training, user_inputs, parameters)
    return ArtifactSet(folder, user_inputs, loss_by_ort_block, parameters, graphs.dropout_nodes(training), scale)
