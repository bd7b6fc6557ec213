"""ORTModule 1.19.2's Python side on torch releases newer than it was written for.

Each patch is keyed on the torch versions it is for and carries its reason in one line; `apply()` applies the
ones the installed torch needs (idempotent) and returns their names (run.json records them). Nothing inside the
installed onnxruntime package is edited: modules are aliased and functions wrapped at import time.
The C++ side (the extensions ORTModule loads) is patched in `accel/compat/cpp_patches.py`.
"""

import contextlib
import contextvars
import functools
import importlib
import sys
import types
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

Version = tuple[int, int]


def major_minor(version: str) -> Version:
    """'2.14.1+cpu' -> (2, 14); (0, 0) for a version string it cannot read."""
    parts = version.split("+")[0].split(".")
    try:
        return int(parts[0]), int(parts[1])
    except (IndexError, ValueError):
        return (0, 0)


def torch_version() -> Version:
    return major_minor(torch.__version__)


def cpu_only_build() -> bool:
    """A torch built without CUDA or ROCm (e.g. from PyTorch's CPU wheel index)."""
    return torch.version.cuda is None and getattr(torch.version, "hip", None) is None


@dataclass(frozen=True)
class Patch:
    name: str
    since: Version  # first torch major.minor that needs it
    reason: str
    apply: Callable[[], None]
    cpu_builds_only: bool = False  # needed only by a torch built without CUDA/ROCm


# Set while ORTModule exports a model (see `exporting`): only its export call gets `dynamo=False` by default.
_ORT_EXPORTING: contextvars.ContextVar[bool] = contextvars.ContextVar("ortflow_ort_exporting", default=False)
_applied: list[str] = []


def _alias_moved_onnx_modules() -> None:
    base = "torch.onnx._internal.torchscript_exporter"
    for old, new in (
        ("torch.onnx._internal.jit_utils", f"{base}.jit_utils"),
        ("torch.onnx._globals", f"{base}._globals"),
        ("torch.onnx._type_utils", f"{base}._type_utils"),
    ):
        if old in sys.modules:
            continue
        module = importlib.import_module(new)
        sys.modules[old] = module
        parent, _, leaf = old.rpartition(".")
        setattr(importlib.import_module(parent), leaf, module)


def _stub_beartype() -> None:
    name = "torch.onnx._internal._beartype"
    if name in sys.modules:
        return
    stub = types.ModuleType(name, "pass-through stand-in for the removed torch.onnx._internal._beartype")
    stub.beartype = lambda function: function  # type: ignore[attr-defined]
    sys.modules[name] = stub
    torch.onnx._internal._beartype = stub  # type: ignore[attr-defined]


def _torchscript_export_for_ort() -> None:
    original = torch.onnx.export
    if getattr(original, "_ortflow_wrapped", False):
        return

    @functools.wraps(original)  # keeps the signature: ORTModule inspects the export function's parameters
    def export(*args, **kwargs):
        if _ORT_EXPORTING.get():
            kwargs.setdefault("dynamo", False)
        return original(*args, **kwargs)

    export._ortflow_wrapped = True  # type: ignore[attr-defined]
    torch.onnx.export = export


def _alias_moved_convolution_symbolics() -> None:
    # By module name: the package attribute torch.onnx.symbolic_opset9 may be the moved module, not the shim that
    # `from torch.onnx.symbolic_opset9 import ...` reads.
    shim = importlib.import_module("torch.onnx.symbolic_opset9")
    moved = importlib.import_module("torch.onnx._internal.torchscript_exporter.symbolic_opset9")
    for name in ("_convolution", "_convolution_mode"):
        if not hasattr(shim, name):
            setattr(shim, name, getattr(moved, name))


def _no_nvtx_ranges() -> None:
    from onnxruntime.training.utils import torch_profile_utils

    torch_profile_utils.torch_nvtx_range_push = lambda message: None
    torch_profile_utils.torch_nvtx_range_pop = lambda: None


PATCHES = (
    Patch(
        "alias_moved_onnx_modules",
        (2, 9),
        "torch.onnx's jit_utils, _globals and _type_utils moved under _internal/torchscript_exporter; ORTModule "
        "imports the old names",
        _alias_moved_onnx_modules,
    ),
    Patch(
        "stub_removed_beartype",
        (2, 9),
        "torch.onnx._internal._beartype is gone; ORTModule's ZeRO-3 module imports it",
        _stub_beartype,
    ),
    Patch(
        "torchscript_export_for_ortmodule",
        (2, 9),
        "torch.onnx.export defaults to the torch.export-based exporter; ORTModule's graph needs the TorchScript "
        "one (dynamo=False)",
        _torchscript_export_for_ort,
    ),
    Patch(
        "alias_moved_convolution_symbolics",
        (2, 9),
        "torch.onnx.symbolic_opset9 no longer re-exports the private _convolution and _convolution_mode; "
        "ORTModule's Conv symbolics import them, so every nn.Conv* failed to export",
        _alias_moved_convolution_symbolics,
    ),
    Patch(
        "no_nvtx_ranges_on_cpu_builds",
        (2, 6),
        "a CPU-only torch's torch.cuda.nvtx.range_push raises ('NVTX functions not installed'); ORTModule marks "
        "its steps with NVTX ranges",
        _no_nvtx_ranges,
        cpu_builds_only=True,
    ),
)


def needed(version: Version | None = None, cpu_only: bool | None = None) -> list[Patch]:
    """The patches the given (default: installed) torch version and build need."""
    version = version or torch_version()
    cpu_only = cpu_only_build() if cpu_only is None else cpu_only
    return [patch for patch in PATCHES if version >= patch.since and (cpu_only or not patch.cpu_builds_only)]


def apply() -> list[str]:
    """Apply the patches the installed torch needs, once; returns their names. Call before importing ORTModule."""
    for patch in needed():
        if patch.name not in _applied:
            patch.apply()
            _applied.append(patch.name)
    return list(_applied)


@contextlib.contextmanager
def exporting() -> Iterator[None]:
    """Around ORTModule's own export: torch.onnx.export defaults to dynamo=False inside."""
    token = _ORT_EXPORTING.set(True)
    try:
        yield
    finally:
        _ORT_EXPORTING.reset(token)
