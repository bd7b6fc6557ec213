"""`export.onnx=true`: the trained model as an inference ONNX file, <run dir>/model.onnx.

Whatever engine trained it, the file is exported from the torch model holding the trained weights (the artifacts
engine's weights come back from ORT's checkpoint state as a torch state_dict first): eval mode (no dropout),
torch.onnx.export (TorchScript exporter) at `export.opset`, one graph input per model input (`input`, or
`input_0`, `input_1`, ... for several) and the output `output`, all with a dynamic batch axis. The run then checks
the file with onnxruntime's InferenceSession on a validation batch and on its first sample alone (the batch axis
is really dynamic) and records the largest absolute difference from torch in run.json ("export").
"""

import logging
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from ortflow.accel.compat import export_warnings
from ortflow.accel.graph import pipeline
from ortflow.data import Data
from ortflow.errors import OrtflowError, root_reason
from ortflow.model import state_dict
from ortflow.step.batch import Layout, layout_of, split_batch

log = logging.getLogger(__name__)

FILE = "model.onnx"


class InferenceModel(nn.Module):
    """The user's model with positional tensor inputs (a dict-input model gets its keywords back)."""

    def __init__(self, model: nn.Module, layout: Layout) -> None:
        super().__init__()
        self.model, self.layout = model, layout

    def forward(self, *inputs: torch.Tensor) -> torch.Tensor:
        return self.layout.call(self.model, inputs)


def input_names(count: int) -> list[str]:
    return ["input"] if count == 1 else [f"input_{i}" for i in range(count)]


def inference_onnx(
    model: nn.Module, weights: dict[str, torch.Tensor], data: Data, run_dir: Path, opset: int, tolerance: float = 1e-4
) -> dict[str, Any]:
    """Export `model` with `weights` to run_dir/model.onnx and check it against torch; the run.json record."""
    import onnxruntime

    model.load_state_dict(state_dict.with_metadata(weights, model))
    model.eval()
    inputs, _ = split_batch(next(iter(data.val)))
    layout = layout_of(inputs)
    tensors = layout.flatten(inputs)
    names = input_names(len(tensors))
    path = run_dir / FILE
    wrapped = InferenceModel(model, layout).eval()  # torch.onnx.export restores the mode it found: keep eval
    try:
        with export_warnings.expected(), pipeline.inference_export(opset):
            torch.onnx.export(
                wrapped,
                tensors,
                str(path),
                input_names=names,
                output_names=["output"],
                dynamic_axes={name: {0: "batch"} for name in [*names, "output"]},
                opset_version=opset,
                dynamo=False,
            )
    except Exception as err:
        raise OrtflowError(
            f"export.onnx: torch.onnx.export could not export the trained model ({root_reason(err)}). The weights "
            "are in checkpoints/final.pt; set export.onnx=false, or try another export.opset."
        ) from err
    session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    worst, scale, sizes = 0.0, 1.0, []
    for batch in (tensors, tuple(t[:1] for t in tensors)):
        with torch.no_grad():
            expected = wrapped(*batch).numpy()  # eval mode, as the exported graph: no dropout, running statistics
        (got,) = session.run(["output"], {n: t.numpy() for n, t in zip(names, batch, strict=True)})
        worst = max(worst, float(np.abs(got - expected).max()))
        scale = max(scale, float(np.abs(expected).max()))
        sizes.append(int(batch[0].size(0)))
    record = {
        "file": str(path),
        "opset": opset,
        "inputs": names,
        "max_abs_diff": worst,
        "tolerance": tolerance * scale,
        "batch_sizes_checked": sizes,
    }
    if not worst <= tolerance * scale:  # (a NaN difference fails too)
        path.unlink(missing_ok=True)
        raise OrtflowError(
            f"export.onnx: the exported model.onnx gives outputs that differ from the trained torch model by "
            f"{worst:.3g} on validation batches, more than export.tolerance={tolerance:g} x the outputs' scale "
            f"({scale:.3g}); the file was removed rather than left to give wrong answers. The trained weights are in "
            "checkpoints/final.pt. Try another export.opset, or report the model's layers that export differently."
        )
    log.info("exported %s (opset %d); ONNX Runtime vs torch, max abs difference %.3g", path, opset, worst)
    return record
