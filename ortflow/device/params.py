"""Parameters trained on a device back into the run's torch model: the flat float32 buffer a runtime hands out
(onnxruntime-web's getContiguousParameters, the download button of the page) cut by the manifest's offsets."""

import copy
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from ortflow.errors import OrtflowError


def read_buffer(path: Path) -> np.ndarray:
    """A raw little-endian float32 file.

    Raises:
        OrtflowError: it cannot be read, or is not a whole number of float32 values.
    """
    try:
        raw = path.read_bytes()
    except OSError as err:
        raise OrtflowError(
            f"'{path}' cannot be read ({err.strerror}); give the parameters file the page downloaded."
        ) from None
    if len(raw) % 4:
        raise OrtflowError(f"'{path}' holds {len(raw)} bytes, not a whole number of float32 values.")
    return np.frombuffer(raw, dtype="<f4").astype(np.float32)


def into_model(buffer: np.ndarray, manifest: dict[str, Any], model: nn.Module, source: str) -> nn.Module:
    """A copy of `model` holding the buffer's values: every parameter (getContiguousParameters(false)) or the
    trainable ones (true); what the buffer lacks (num_batches_tracked, frozen values in a trainable-only buffer)
    keeps the model's. Tied weights stay tied (written through the module's own tensors).

    Raises:
        OrtflowError: the buffer's size fits neither layout, or names a tensor the model lacks or shapes it otherwise.
    """
    params = manifest["parameters"]
    if buffer.size == params["count"]:
        key, tensors = "offset", params["tensors"]
    elif buffer.size == params["trainable_count"]:
        key, tensors = "trainable_offset", [t for t in params["tensors"] if t["trainable"]]
    else:
        raise OrtflowError(
            f"{source} holds {buffer.size} float32 values, but the set has {params['count']} parameters "
            f"({params['trainable_count']} trainable): it was not downloaded from this set; give the set's folder with "
            "--set."
        )
    model = copy.deepcopy(model)
    own = dict(model.named_parameters()) | dict(model.named_buffers())
    with torch.no_grad():
        for tensor in tensors:
            name, shape = tensor["torch_name"], tensor["shape"]
            target = own.get(name)
            if target is None or list(target.shape) != list(shape):
                found = "missing" if target is None else f"of shape {list(target.shape)}"
                raise OrtflowError(
                    f"the set's parameter {name} {shape} does not fit the run's model ({found}): the set was exported "
                    "from another run; give that run's directory."
                )
            start = tensor[key]
            size = int(np.prod(shape)) if shape else 1
            target.copy_(torch.from_numpy(buffer[start : start + size].reshape(shape).copy()))
    return model
