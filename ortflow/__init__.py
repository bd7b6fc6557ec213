"""ortflow: Hydra-config-driven PyTorch training whose fast path is ONNX Runtime training.

The Python API (the `ortflow` command takes the same path):

    import ortflow
    cfg = ortflow.compose(["+recipe=digits", "accel=artifacts"])      # validated DictConfig
    result = ortflow.train(cfg)                                        # or ortflow.train([...overrides])
    result.metrics, result.model, result.run_dir, result.record
    result = ortflow.load_run("outputs/2026-11-24/10-00-00-000000")   # a finished run

Errors a user can fix raise OrtflowError subclasses. `import ortflow` stays light: the API's modules (torch,
Hydra, ONNX Runtime) load on first use.
"""

import importlib.metadata
from typing import Any

from ortflow.errors import (
    CheckpointError,
    ConfigError,
    DataError,
    ModelError,
    OrtflowError,
    RunDirError,
    TrainingDiverged,
)

__all__ = [
    "CheckpointError",
    "ConfigError",
    "DataError",
    "ModelError",
    "OrtflowError",
    "RunDirError",
    "RunResult",
    "TrainingDiverged",
    "__version__",
    "compose",
    "load_run",
    "train",
]
__version__ = importlib.metadata.version("ortflow")  # pyproject.toml's, the one place it is written

_API = ("compose", "train", "load_run", "RunResult")


def __getattr__(name: str) -> Any:
    if name in _API:
        from ortflow import api

        return getattr(api, name)
    raise AttributeError(f"module 'ortflow' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(__all__)
