"""torch's TorchScript ONNX exporter as the ORT engines use it: the training-mode export and torch's own symbolics,
wherever the installed torch keeps them."""

import importlib
from pathlib import Path

import torch


# ----------------------------------------------------------------------------------------------- torch side
def export_training_onnx(
    model: torch.nn.Module,
    args: tuple[torch.Tensor, ...],
    path: Path,
    opset: int,
    input_names: list[str],
    output_names: list[str],
) -> None:
    """torch.onnx.export in training mode as ORT's training-artifacts flow expects: parameters kept as
    initializers named like the torch state_dict, no constant folding, dropout kept live.

    Every dimension is static, that of `args` (the engine pads short batches to it). A dynamic batch axis made
    ORT's Reshape gradient wrong: it rebuilds the input's shape from the inferred one, writing 0 ("copy this
    dimension from the input") for the symbolic batch dimension, and the input it copies from is the flattened
    gradient, (B*T, C): a (B, T, C) -> (B*T, C) reshape then fails with "requested shape {B*T,T,C}".
    """
    torch.onnx.export(
        model,
        args,
        str(path),
        input_names=input_names,
        output_names=output_names,
        export_params=True,
        do_constant_folding=False,
        training=torch.onnx.TrainingMode.TRAINING,
        opset_version=opset,
        dynamo=False,  # the TorchScript exporter: the default from torch 2.9 on is the torch.export-based one
    )


def torch_symbolic(module: str, name: str):
    """torch's own ONNX symbolic `name` from its `module` (symbolic_opset9, ...): the TorchScript exporter's modules
    moved under torch.onnx._internal.torchscript_exporter in torch 2.9, and the old names re-export only public ones."""
    for prefix in ("torch.onnx._internal.torchscript_exporter", "torch.onnx"):
        try:
            found = getattr(importlib.import_module(f"{prefix}.{module}"), name, None)
        except ImportError:
            continue
        if found is not None:
            return found
    raise AttributeError(f"torch has no ONNX symbolic {module}.{name}")
