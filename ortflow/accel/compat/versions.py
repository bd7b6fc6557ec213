"""The torch, onnxruntime-training and onnx versions the compatibility layer was written for, checked before any patch
is applied or any export starts (`prepare`)."""

import contextlib
import importlib.metadata
import logging
import os

import torch

from ortflow.accel.compat import ort_seed, torch_patches
from ortflow.errors import OrtflowError

log = logging.getLogger(__name__)

# ORT 1.19 reads ONNX IR <= 10, and its gradient builder mishandles LayerNormalization at opset 17.
MAX_ARTIFACTS_OPSET = 16

# The versions this module's patches were written for and tested with: (lowest, highest) major.minor, inclusive.
SUPPORTED = {"torch": ((2, 6), (2, 15)), "onnxruntime-training": ((1, 19), (1, 19)), "onnx": ((1, 16), (1, 16))}

# Set to 1 to run on versions outside SUPPORTED anyway (run.json then records "untested_versions").
ALLOW_UNTESTED = "ORTFLOW_ALLOW_UNTESTED_VERSIONS"


def _version(module: str, *distributions: str) -> str:
    """From the first installed distribution's metadata, else the imported module's `__version__` (importing
    onnxruntime and onnx takes 0.2 s and 0.3 s an eager run does not need)."""
    for distribution in distributions:
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            return importlib.metadata.version(distribution)
    return importlib.import_module(module).__version__


def installed_versions() -> dict[str, str]:
    return {
        "torch": torch.__version__,
        "onnxruntime-training": _version("onnxruntime", "onnxruntime-training-cpu", "onnxruntime-training"),
        "onnx": _version("onnx", "onnx"),
    }


def untested_versions() -> dict[str, str]:
    """The installed packages whose version lies outside SUPPORTED, as {package: version}."""
    found = {}
    for package, version in installed_versions().items():
        low, high = SUPPORTED[package]
        if not low <= torch_patches.major_minor(version) <= high:
            found[package] = version
    return found


def prepare() -> list[str]:
    """Before any ORT import or export: refuse untested versions (`require_supported_versions`), then apply the
    Python-side patches the installed torch needs (torch_patches), then import ORT's binding and give it the seed set
    before it was imported (ort_seed.seed_on_import). Returns the names of those patches."""
    require_supported_versions()
    applied = torch_patches.apply()
    ort_seed.seed_on_import()
    return applied


def require_supported_versions() -> None:
    """Refuse, in one paragraph, a torch / onnxruntime-training / onnx combination these patches were not written
    for (unless ORTFLOW_ALLOW_UNTESTED_VERSIONS=1): a patch that silently stops applying would train wrongly or
    let ORTModule fall back to PyTorch unnoticed."""
    untested = untested_versions()
    if not untested or os.environ.get(ALLOW_UNTESTED) == "1":
        if untested:
            log.warning("running on untested versions %s (%s=1)", untested, ALLOW_UNTESTED)
        return

    def span(package: str) -> str:
        (a, b), (c, d) = SUPPORTED[package]
        return f"{package} {a}.{b}" + ("" if (a, b) == (c, d) else f" to {c}.{d}")

    raise OrtflowError(
        "the ORT engines were written and tested for "
        + ", ".join(span(p) for p in SUPPORTED)
        + "; installed: "
        + ", ".join(f"{p} {v}" for p, v in installed_versions().items())
        + f" ({', '.join(untested)} outside that range). Install a supported stack (pip install -e . in a fresh "
        f"venv), use accel=none, or set {ALLOW_UNTESTED}=1 to try anyway (run.json then records it)."
    )
