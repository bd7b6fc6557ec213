"""ortflow: Hydra-config-driven PyTorch training whose fast path is ONNX Runtime training."""

from ortflow.errors import OrtflowError

__all__ = ["OrtflowError", "__version__"]
__version__ = "0.1.0"
