"""The warnings ortflow's ONNX exports trigger on purpose, silenced exactly where they are triggered.

Every export ortflow runs (ORTModule's, the artifacts engine's, the inference export.onnx) uses torch's TorchScript
exporter, which ORT 1.19 needs, at static shapes, and the training-artifacts export asks for training mode: torch
warns about each of these choices on every export. Inside `expected()` those warnings, and only those, are dropped;
the first time in a process one line in the log says so. Any other warning passes through.
"""

import contextlib
import logging
import warnings
from collections.abc import Iterator

import torch

log = logging.getLogger(__name__)

# (category, regular expression matching the start of the message, why it is expected)
EXPECTED: tuple[tuple[type[Warning], str, str], ...] = (
    (
        torch.jit.TracerWarning,
        "",
        "the export traces at static shapes: Python numbers taken from tensors are constants on purpose",
    ),
    (
        DeprecationWarning,
        r"You are using the legacy TorchScript-based ONNX export",
        "ORT 1.19 reads the TorchScript exporter's graphs",
    ),
    (
        DeprecationWarning,
        r"Setting `training` to something other than default is deprecated",
        "ORT's training artifacts need a training-mode export",
    ),
    (
        FutureWarning,
        r"Setting `training` to something other than default is deprecated",
        "(the same warning as torch 2.6 words it)",
    ),
    (
        DeprecationWarning,
        r"The feature will be removed\. Please remove usage of this function",
        "(the same, from inside torch's exporter)",
    ),
    (
        UserWarning,
        r"ONNX Preprocess - Removing mutation from node aten::add_ on block input: '[\w.-]*num_batches_tracked'",
        "BatchNorm's counter is updated by ortflow around each step (accel/graph/batchnorm.py), not inside the graph",
    ),
    (
        UserWarning,
        r"ONNX export mode is set to TrainingMode\.EVAL, but operator 'batch_norm' is set to train=True",
        "ORTModule exports BatchNorm in training mode on purpose; ortflow keeps its statistics (graph/batchnorm.py)",
    ),
    (
        UserWarning,
        r"DeepSpeed import error",
        "ORTModule imports its ZeRO-offload helper, which warns without DeepSpeed; ortflow does not use ZeRO",
    ),
)

_said = False


@contextlib.contextmanager
def expected() -> Iterator[None]:
    """Drop the exporter's expected warnings (EXPECTED) while the block runs; say so once per process."""
    global _said
    if not _said:
        _said = True
        log.info(
            "the ONNX exporter's expected warnings are silenced during ortflow's exports (tracer constants at "
            "static shapes, the legacy TorchScript exporter ORT needs, training-mode export; see "
            "ortflow/accel/compat/export_warnings.py)"
        )
    with warnings.catch_warnings():
        for category, message, _ in EXPECTED:
            warnings.filterwarnings("ignore", message=message, category=category)
        yield
