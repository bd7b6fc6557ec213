"""onnxruntime-training's private APIs the engines need outside ORTModule's patches: its symbolic and gradient
registries, torch's operator executor, session options, its seed and the training API's optimizer."""

import contextlib
import logging
import os
import sys
from collections.abc import Iterator
from pathlib import Path

import torch

from ortflow.accel.compat.versions import prepare


def ort_symbolic(name: str):
    """The symbolic ORTModule registers for `name` ("::_convolution", ...), or None (none, or ORTModule not imported:
    then it registered nothing)."""
    registry = sys.modules.get("onnxruntime.training.ortmodule._custom_op_symbolic_registry")
    return None if registry is None else registry.CustomOpSymbolicRegistry._SYMBOLICS.get(name)


def ort_symbolic_names() -> list[str]:
    """The operators ORTModule has symbolics for (none before ORTModule is imported)."""
    registry = sys.modules.get("onnxruntime.training.ortmodule._custom_op_symbolic_registry")
    return [] if registry is None else list(registry.CustomOpSymbolicRegistry._SYMBOLICS)


def register_ort_gradient(operator: str, overload: str, definition) -> None:
    """Give ORT's gradient builder the gradient `definition()` of `org.pytorch.aten::ATen` nodes running `operator`
    (ORTModule's custom gradient registry, the format of its _custom_gradient_registry.py), and publish the registry
    to ORT's C++ side (ORTModule publishes it again when it is built; the artifacts engine needs it before
    generate_artifacts). Imports ORTModule (the torch patches first)."""
    _register("org.pytorch.aten", "ATen", (operator, overload), definition)


def register_onnx_gradient(op_type: str, definition, domain: str = "") -> None:
    """Give ORT's gradient builder the gradient `definition()` of every `domain::op_type` node: a standard ONNX op
    ORT has no gradient builder for (same registry and format as `register_ort_gradient`). ORT keys these
    definitions by domain and op type only: a definition cannot read the node's attributes, so it must hold for
    every attribute value the graphs it sees use. Both ORTModule and generate_artifacts consult the registry.
    Imports ORTModule (the torch patches first)."""
    _register(domain, op_type, (), definition)


def _register(domain: str, name: str, attributes: tuple[str, ...], definition) -> None:
    prepare()
    from onnxruntime.training.ortmodule._custom_gradient_registry import CustomGradientRegistry

    CustomGradientRegistry.register(domain, name, attributes, definition)
    CustomGradientRegistry.register_all()


def load_aten_executor() -> None:
    """Let ORT run `org.pytorch.aten::ATen` nodes: register torch's operator executor (the aten_op_executor extension
    built with ORTModule's others, compat/extensions.py) with ORT, once per process. ORTModule does this itself; the
    artifacts engine calls it before its sessions."""
    from ortflow.accel.compat.extensions import ensure_built

    ensure_built()
    prepare()
    from onnxruntime.training.ortmodule.torch_cpp_extensions.cpu.aten_op_executor import (
        load_aten_op_executor_cpp_extension,
    )

    load_aten_op_executor_cpp_extension()


# A folder: every ORT session an engine creates writes ORT's own profile (per-node timings) there
# (`ortflow-bench --profile` sets it in its worker processes).
ORT_PROFILE_DIR = "ORTFLOW_ORT_PROFILE_DIR"


def apply_session_settings(
    options, intra_op_threads: int | None, allow_spinning: bool, profile_name: str = "ort_profile"
) -> None:
    """Thread settings (and profiling, when ORTFLOW_ORT_PROFILE_DIR is set) on an onnxruntime.SessionOptions.

    ORT names a profile by its prefix and the second its session started: sessions started in the same second with
    the same `profile_name` write over each other's file."""
    # None: as many threads as torch uses, so one budget holds for both runtimes (one per physical core unless
    # OMP_NUM_THREADS or torch.set_num_threads says otherwise).
    options.intra_op_num_threads = intra_op_threads if intra_op_threads is not None else torch.get_num_threads()
    options.add_session_config_entry("session.intra_op.allow_spinning", "1" if allow_spinning else "0")
    if profile_dir := os.environ.get(ORT_PROFILE_DIR):
        options.enable_profiling = True
        options.profile_file_prefix = str(Path(profile_dir) / profile_name)


def profiling() -> bool:
    """Whether ORT sessions write profiles (ORTFLOW_ORT_PROFILE_DIR)."""
    return bool(os.environ.get(ORT_PROFILE_DIR))


@contextlib.contextmanager
def quiet_root_logger() -> Iterator[None]:
    """generate_artifacts logs each file it saves through the root logger at INFO; keep that out of run logs."""
    root = logging.getLogger()
    level = root.level
    root.setLevel(max(level, logging.WARNING))
    try:
        yield
    finally:
        root.setLevel(level)


def gradient_views(state, names: list[str]) -> list[torch.Tensor]:
    """The gradient buffers of the training API's parameters `names` (an `api.CheckpointState`) as torch tensors that
    share their memory (DLPack; no copy), valid until the next training or optimizer run. The public
    `state.parameters[name].grad` copies each buffer into a new numpy array."""
    grads = (state._state.get_parameter(name).grad for name in names)
    return [buffer_view(grad) for grad in grads if grad.has_value()]


def buffer_view(value) -> torch.Tensor:
    """An ORT OrtValue's buffer as a torch tensor sharing its memory (DLPack; no copy)."""
    return torch.from_dlpack(value.to_dlpack())


def ort_optimizer(path: Path, module, options=None):
    """onnxruntime.training.api.Optimizer over `module`; with `options`, its session gets those instead of the
    module's (the training API offers no argument for it: it reads the module's private `_session_options`)."""
    from onnxruntime.training import api

    if options is not None:
        module._session_options = options
    return api.Optimizer(str(path), module)
