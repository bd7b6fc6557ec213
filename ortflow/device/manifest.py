"""manifest.json: everything a device needs to know to train an exported set, and what differs from the run.

Its keys (docs/devices.md describes each): format, ortflow, onnxruntime, opset, domains, files, batch_size,
inputs/outputs (static shapes and dtypes of the training and eval graphs), example_batch, preprocessing, loss,
optimizer, learning_rate, parameters (the flat buffer's order), batchnorm, dropout, run, differences, check.
"""

from pathlib import Path
from typing import Any

import numpy as np
import onnx
from omegaconf import DictConfig, OmegaConf

from ortflow.config import FP32, OptimConfig, OptimName, SchedulerName
from ortflow.device import graphs, portable
from ortflow.device.artifact_set import PREFIX, ArtifactSet

FORMAT = "ortflow-device-artifacts/1"
EXAMPLE_FOLDER = "example"


def io_spec(values: Any, names: list[str] | None = None) -> list[dict[str, Any]]:
    """Name, static shape and dtype of graph inputs or outputs (only `names`, in the graph's order, when given)."""
    spec = []
    for value in values:
        if names is not None and value.name not in names:
            continue
        tensor = value.type.tensor_type
        spec.append(
            {
                "name": value.name,
                "shape": [d.dim_value if d.HasField("dim_value") else d.dim_param for d in tensor.shape.dim],
                "dtype": onnx.helper.tensor_dtype_to_np_dtype(tensor.elem_type).name,
            }
        )
    return spec


def write_example(folder: Path, names: list[str], feeds: list[np.ndarray]) -> list[dict[str, Any]]:
    """The example batch as raw little-endian C-order files (readable as typed arrays in JS), described."""
    folder.mkdir(parents=True, exist_ok=True)
    described = []
    for name, array in zip(names, feeds, strict=True):
        file = f"{name}.bin"
        array = np.ascontiguousarray(array)
        array.astype(array.dtype.newbyteorder("<")).tofile(folder / file)
        described.append({"name": name, "file": file, "dtype": array.dtype.name, "shape": list(array.shape)})
    return described


def parameters(artifact: ArtifactSet) -> dict[str, Any]:
    rows, offset, trainable_offset = [], 0, 0
    for name, shape, trainable in artifact.parameters:
        size = int(np.prod(shape)) if shape else 1
        rows.append(
            {
                "name": name,
                "torch_name": name.removeprefix(PREFIX),
                "shape": shape,
                "trainable": trainable,
                "offset": offset,
                "trainable_offset": trainable_offset if trainable else None,
            }
        )
        offset += size
        trainable_offset += size if trainable else 0
    return {
        "buffer": "float32 little-endian: getContiguousParameters(false) holds every parameter in this order "
        "(offset), getContiguousParameters(true) the trainable ones (trainable_offset)",
        "count": offset,
        "trainable_count": trainable_offset,
        "tensors": rows,
    }


def optimizer(optim: OptimConfig, grad_clip: float | None) -> dict[str, Any]:
    clip = {"grad_clip": grad_clip, "clip_by": "ORT's InplaceClipGradNorm (as torch.nn.utils.clip_grad_norm_)"}
    if optim.name == OptimName.adamw:
        return {
            "name": "adamw",
            "op": "com.microsoft AdamWOptimizer",
            "betas": [float(b) for b in optim.betas],
            "eps": float(optim.eps),
            "weight_decay": float(optim.weight_decay),
            "adam_mode": 1,
            "semantics": "Hugging Face's AdamW: bias correction in the step size, eps added to sqrt(v), weight "
            "decay after the update (torch.optim.AdamW decays first and places eps after correcting v)",
            **clip,
        }
    return {"name": "sgd", "op": "com.microsoft SGDOptimizerV2", "semantics": "p -= lr * g", **clip}


def learning_rate(lr: float, run_lr: float, scale: float) -> dict[str, Any]:
    return {
        "value": lr,
        "run_peak_lr": run_lr,
        "runtime_start_lr": portable.RUNTIME_LR,
        "scale": scale,
        "where": f"optimizer_model.onnx multiplies its learning_rate input by the constant {graphs.LR_SCALE} "
        f"({scale:g}): leave the runtime at its starting rate {portable.RUNTIME_LR:g} (onnxruntime-web cannot change "
        "it); a runtime's set_learning_rate(x) trains at x times the scale",
    }


def batchnorm(momenta: dict[str, float]) -> dict[str, Any] | None:
    if not momenta:
        return None
    return {
        "layers": {name.removeprefix(PREFIX): {"momentum": m} for name, m in momenta.items()},
        "updated_by": "ORT's BatchNorm kernel inside the training graph, in place in the checkpoint's running "
        "statistics (frozen parameters in the flat buffer)",
        "running_mean": "(1 - momentum) * running_mean + momentum * batch_mean, as torch",
        "running_var": "(1 - momentum) * running_var + momentum * BIASED batch variance (torch uses the unbiased "
        "variance, n / (n - 1) larger, n the values per channel in a batch)",
        "num_batches_tracked": "not counted on a device (ortflow-import-artifacts keeps the run's value)",
        "momentum_none": "refused at export (a cumulative average has no fixed momentum)",
    }


def differences(cfg: DictConfig, lr: float, batch_size: int, dropout_nodes: int, has_batchnorm: bool) -> list[str]:
    """What trains differently on a device than in the run."""
    found = []
    engine = OmegaConf.select(cfg, "accel._target_") or "?"
    found.append(f"engine: the run trained with {engine.rsplit('.', 2)[-2]}; the set with ORT's on-device training API")
    precision = OmegaConf.select(cfg, "trainer.precision") or FP32
    if precision != FP32:
        found.append(f"precision: the run trained in {precision}; the set trains in fp32")
    scheduler = OmegaConf.select(cfg, "scheduler.name")
    scheduler = getattr(scheduler, "value", scheduler)
    warmup = OmegaConf.select(cfg, "scheduler.warmup_steps") or 0
    if scheduler != SchedulerName.constant.value or warmup:
        found.append(
            f"learning rate: the run followed scheduler={scheduler} (warmup {warmup}); the set trains at the constant "
            f"{lr:g} (no runtime applies a schedule from the set; onnxruntime-web has no learning-rate setter)"
        )
    if lr != float(cfg.optim.lr):
        found.append(f"learning rate: {lr:g} instead of the run's peak optim.lr={float(cfg.optim.lr):g}")
    accumulate = OmegaConf.select(cfg, "trainer.accumulate_grad_batches") or 1
    if accumulate > 1:
        found.append(f"gradient accumulation: the run averaged {accumulate} batches a step; the set takes one")
    found.append(
        f"batch: exactly {batch_size} samples (static shapes); a shorter batch must be padded (cross-entropy targets "
        "-100 carry no loss) or left out"
    )
    found.append("optimizer state: starts fresh on the device (moments zero, step 0)")
    if dropout_nodes:
        found.append("dropout: masks drawn by the runtime's own generator (onnxruntime-web's cannot be seeded)")
    if has_batchnorm:
        found.append(
            "BatchNorm: running variance updated with the biased batch variance; num_batches_tracked not counted"
        )
    if OmegaConf.select(cfg, "optim.name") in ("adamw", OptimName.adamw):
        found.append("AdamW: ORT's (adam_mode=1, Hugging Face's) conventions, not torch.optim.AdamW's")
    return found
