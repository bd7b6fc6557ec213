"""Everything that depends on the torch version or on onnxruntime-training internals, in one place: the only
door to private torch and ORT APIs.

Supporting another torch or ORT version means revisiting this module only. It checks the versions it was written
for (`require_supported_versions`) before any patch is applied or any export starts. Each patch below fixes one
measured failure of ORTModule 1.19.2 with torch 2.6 on the seed TransformerModel; each is applied once,
idempotently, and reads the settings of the engine that is running (no process-wide engine settings).
"""

import contextlib
import contextvars
import logging
import os
import re
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import onnx
import torch

from ortflow.accel import compat_torch, export_warnings
from ortflow.accel.rewrites import Rewrites, prepare_training_graph

log = logging.getLogger(__name__)

# ORT 1.19 reads ONNX IR <= 10, and its gradient builder mishandles LayerNormalization at opset 17.
MAX_ARTIFACTS_OPSET = 16

# The versions this module's patches were written for and tested with: (lowest, highest) major.minor, inclusive.
SUPPORTED = {"torch": ((2, 6), (2, 14)), "onnxruntime-training": ((1, 19), (1, 19)), "onnx": ((1, 16), (1, 16))}
# Set to 1 to run on versions outside SUPPORTED anyway (run.json then records "untested_versions").
ALLOW_UNTESTED = "ORTFLOW_ALLOW_UNTESTED_VERSIONS"


def installed_versions() -> dict[str, str]:
    import onnxruntime

    return {"torch": torch.__version__, "onnxruntime-training": onnxruntime.__version__, "onnx": onnx.__version__}


def untested_versions() -> dict[str, str]:
    """The installed packages whose version lies outside SUPPORTED, as {package: version}."""
    found = {}
    for package, version in installed_versions().items():
        low, high = SUPPORTED[package]
        if not low <= compat_torch.major_minor(version) <= high:
            found[package] = version
    return found


def prepare() -> list[str]:
    """Before any ORT import or export: refuse untested versions (`require_supported_versions`), then apply the
    Python-side patches the installed torch needs (compat_torch). Returns the names of those patches."""
    require_supported_versions()
    return compat_torch.apply()


def require_supported_versions() -> None:
    """Refuse, in one paragraph, a torch / onnxruntime-training / onnx combination these patches were not written
    for (unless ORTFLOW_ALLOW_UNTESTED_VERSIONS=1): a patch that silently stops applying would train wrongly or
    let ORTModule fall back to PyTorch unnoticed."""
    untested = untested_versions()
    if not untested or os.environ.get(ALLOW_UNTESTED) == "1":
        if untested:
            log.warning("running on untested versions %s (%s=1)", untested, ALLOW_UNTESTED)
        return
    from ortflow.errors import OrtflowError

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
    import importlib

    for prefix in ("torch.onnx._internal.torchscript_exporter", "torch.onnx"):
        try:
            found = getattr(importlib.import_module(f"{prefix}.{module}"), name, None)
        except ImportError:
            continue
        if found is not None:
            return found
    raise AttributeError(f"torch has no ONNX symbolic {module}.{name}")


# ------------------------------------------------------------------------------------------------- ORT side
_ORT_SYMBOLIC_OPSETS: set[int] = set()  # the opsets ORTModule has registered its symbolics at in this process


def ort_symbolic_opsets() -> set[int]:
    return _ORT_SYMBOLIC_OPSETS


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
    prepare()
    from onnxruntime.training.ortmodule._custom_gradient_registry import CustomGradientRegistry

    CustomGradientRegistry.register("org.pytorch.aten", "ATen", (operator, overload), definition)
    CustomGradientRegistry.register_all()


def load_aten_executor() -> None:
    """Let ORT run `org.pytorch.aten::ATen` nodes: register torch's operator executor (the aten_op_executor extension
    built with ORTModule's others, accel/extensions.py) with ORT, once per process. ORTModule does this itself; the
    artifacts engine calls it before its sessions."""
    from ortflow.accel.extensions import ensure_built

    ensure_built()
    prepare()
    from onnxruntime.training.ortmodule.torch_cpp_extensions.cpu.aten_op_executor import (
        load_aten_op_executor_cpp_extension,
    )

    load_aten_op_executor_cpp_extension()


class OrtRunCounter:
    """Counts ORT's own session runs inside one ORTModule engine: proof that ORT, not PyTorch, executed a step."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.forward = 0  # training-graph forward runs (TrainingAgent.run_forward)
        self.backward = 0  # training-graph backward runs (TrainingAgent.run_backward)
        self.inference = 0  # eval-graph runs (InferenceAgent.run_forward)

    def bump(self, kind: str) -> None:
        with self._lock:
            setattr(self, kind, getattr(self, kind) + 1)

    def snapshot(self) -> tuple[int, int, int]:
        return self.forward, self.backward, self.inference


@dataclass(frozen=True)
class SessionSettings:
    """One engine's ORT session settings (ORTModule has no option for them; ortflow applies them itself)."""

    intra_op_threads: int | None = None  # None: ORT's default (one per physical core)
    allow_spinning: bool = True  # ORT's default
    rewrites: Rewrites = field(default_factory=Rewrites)  # the graph rewrites applied before the gradient is built
    aten_conv: bool = False  # every convolution exported as an ATen node run by torch (accel/aten_conv.py)
    aten_layer_norm: bool = False  # every LayerNorm exported as an ATen node run by torch (accel/aten_layer_norm.py)
    bf16: bool = False  # matrix multiplies and ATen convolutions computed in bf16 by torch (accel/aten_gemm.py)

    @property
    def torch_kernels(self) -> bool:
        """Whether the exported graphs may hold ATen nodes that torch runs (then ORT must not spin-wait)."""
        return self.aten_conv or self.aten_layer_norm or self.bf16


@dataclass
class _Scope:
    settings: SessionSettings
    runs: OrtRunCounter
    fixes: dict[str, int]


# The engine whose ORTModule is running in this thread right now (set around each of its calls by `ortmodule_scope`):
# ORT's patched methods read its settings and count into its counter, so engines in one process never mix.
_ACTIVE: contextvars.ContextVar[_Scope | None] = contextvars.ContextVar("ortflow_ortmodule_scope", default=None)
_patched = False


# A folder: every ORT session an engine creates writes ORT's own profile (per-node timings) there
# (`ortflow-bench --profile` sets it in its worker processes).
ORT_PROFILE_DIR = "ORTFLOW_ORT_PROFILE_DIR"


def apply_session_settings(
    options, intra_op_threads: int | None, allow_spinning: bool, profile_name: str = "ort_profile"
) -> None:
    """Thread settings (and profiling, when ORTFLOW_ORT_PROFILE_DIR is set) on an onnxruntime.SessionOptions.

    ORT names a profile by its prefix and the second its session started: sessions started in the same second with
    the same `profile_name` write over each other's file."""
    if intra_op_threads is not None:
        options.intra_op_num_threads = intra_op_threads
    options.add_session_config_entry("session.intra_op.allow_spinning", "1" if allow_spinning else "0")
    if profile_dir := os.environ.get(ORT_PROFILE_DIR):
        options.enable_profiling = True
        options.profile_file_prefix = str(Path(profile_dir) / profile_name)


def _count(cls: type, method: str, kind: str) -> None:
    original = getattr(cls, method)

    def counted(self, *args, **kwargs):
        result = original(self, *args, **kwargs)
        if (scope := _ACTIVE.get()) is not None:
            scope.runs.bump(kind)
        return result

    setattr(cls, method, counted)


def patch_ortmodule() -> None:
    """Apply the ORTModule fixes (idempotent). Import ORTModule only after calling this.

    The patched methods read the settings of the engine running at the time (see `ortmodule_scope`)."""
    global _patched
    if _patched:
        return
    prepare()
    with export_warnings.expected():
        # ORTModule imports its hooks on its first forward; their ZeRO-offload helper warns without DeepSpeed.
        import onnxruntime.training.utils.hooks  # noqa: F401
    from ortflow.accel import aten_nodes, symbolics

    aten_nodes.register_gradients()  # before any ORTModule is built: it publishes ORT's gradient registry then
    from onnxruntime.training.ortmodule._custom_op_symbolic_registry import CustomOpSymbolicRegistry

    register_all = CustomOpSymbolicRegistry.register_all.__func__

    def register_all_recorded(cls, onnx_opset_version):
        _ORT_SYMBOLIC_OPSETS.add(onnx_opset_version)
        return register_all(cls, onnx_opset_version)

    CustomOpSymbolicRegistry.register_all = classmethod(register_all_recorded)
    from onnxruntime.tools.symbolic_shape_infer import SymbolicShapeInference
    from onnxruntime.training.ortmodule import _execution_agent

    from ortflow.accel import aten_shapes

    aten_shapes.install()  # the ATen convolutions' output shapes (squeeze-excitation's broadcast gradient)
    from onnxruntime.training.ortmodule._graph_execution_manager import GraphExecutionManager
    from onnxruntime.training.ortmodule._graph_transition_manager import GraphTransitionManager

    _count(_execution_agent.TrainingAgent, "run_forward", "forward")
    _count(_execution_agent.TrainingAgent, "run_backward", "backward")
    _count(_execution_agent.InferenceAgent, "run_forward", "inference")

    get_exported = GraphTransitionManager._get_exported_model

    def get_exported_with_masks(*args, **kwargs):
        scope = _ACTIVE.get()
        settings = scope.settings if scope is not None else SessionSettings()
        opset = kwargs["onnx_opset_version"]
        with (
            export_warnings.expected(),
            compat_torch.exporting(),
            symbolics.ort_export(opset, settings.aten_conv, settings.aten_layer_norm, settings.bf16),
        ):
            exported_model, output_schema = get_exported(*args, **kwargs)
        rewrites = scope.settings.rewrites if scope else Rewrites()
        fixes, masks = prepare_training_graph(exported_model, rewrites)
        assert not masks, "ORTModule cannot feed dropout masks"  # Rewrites.dropout_masks is artifacts-only
        if torch_nodes := aten_nodes.count_all(exported_model):
            # ORTModule builds its gradient graph for every parameter, frozen ones too (it exports them all as
            # requiring a gradient and drops the frozen ones' afterwards): so must the ATen nodes.
            parameters = {name for name, _ in kwargs["flattened_module"].named_parameters()}
            aten_nodes.set_gradient_masks(exported_model, parameters)
        fixes.update(aten_nodes.graph_fixes(torch_nodes))
        if scope is not None:
            scope.fixes.update(fixes)
        return exported_model, output_schema

    def infer_shapes(model: onnx.ModelProto) -> onnx.ModelProto:
        # Symbolic shape inference asserts in _infer_Reshape (is_literal(shape_rank)) on the Reshape that
        # nn.MultiheadAttention exports; ONNX's own shape inference handles that graph.
        try:
            return SymbolicShapeInference.infer_shapes(model, auto_merge=True, guess_output_rank=True)
        except AssertionError:
            log.info("ORT symbolic shape inference failed on this graph; using ONNX shape inference instead")
            inferred = onnx.shape_inference.infer_shapes(model)
            return _plain_dim_names(_type_group_norm_statistics(inferred))

    session_config = GraphExecutionManager._get_session_config

    def session_config_with_threads(self):
        options, providers, provider_options = session_config(self)
        settings = scope.settings if (scope := _ACTIVE.get()) is not None else SessionSettings()
        apply_session_settings(options, settings.intra_op_threads, settings.allow_spinning)
        return options, providers, provider_options

    GraphExecutionManager._get_session_config = session_config_with_threads
    GraphTransitionManager._get_exported_model = staticmethod(get_exported_with_masks)
    GraphTransitionManager._infer_shapes = staticmethod(infer_shapes)
    _capture_only_real_streams()
    _patched = True


def _has_descriptor(stream) -> bool:
    try:
        stream.fileno()
    except (AttributeError, OSError, ValueError):  # io.UnsupportedOperation is an OSError and a ValueError
        return False
    return True


def _capture_only_real_streams() -> None:
    """ORTModule captures native output during its first export by duplicating sys.stdout's and sys.stderr's file
    descriptors. A Jupyter kernel's streams have none (fileno() raises), and ORT's clean-up then fails with a
    TypeError that hides the cause: there, the capture is skipped and ORT's native output goes where it would."""
    from onnxruntime.training.ortmodule import _logger

    capture = _logger._suppress_os_stream_output

    @contextlib.contextmanager
    def capture_if_possible(enable=True, on_exit=None):
        with capture(enable=enable and _has_descriptor(sys.stdout) and _has_descriptor(sys.stderr), on_exit=on_exit):
            yield

    _logger._suppress_os_stream_output = capture_if_possible


def _type_group_norm_statistics(model: onnx.ModelProto) -> onnx.ModelProto:
    """Type the mean and rstd outputs of the ATen native_group_norm nodes ORTModule exports nn.GroupNorm with (as
    its input), which only ORT's symbolic shape inference types: without a type ORT refuses the graph ("type
    inference failed"). For graphs where that inference failed (a Reshape of a dynamic shape, e.g. nn.Unflatten)."""
    graph = model.graph
    types = {v.name: v.type.tensor_type.elem_type for v in (*graph.input, *graph.value_info, *graph.output)}
    typed = {v.name: v for v in graph.value_info}
    for node in graph.node:
        operators = [a.s for a in node.attribute if a.name == "operator"]
        if node.op_type != "ATen" or operators != [b"native_group_norm"]:
            continue
        for name in node.output[1:]:
            if name and not types.get(name):
                info = typed.get(name) or graph.value_info.add()
                info.name = name
                info.type.tensor_type.elem_type = types.get(node.input[0]) or onnx.TensorProto.FLOAT
    return model


def _plain_dim_names(model: onnx.ModelProto) -> onnx.ModelProto:
    """Symbolic dimension names as sympy reads them: the exporter names the dimensions of an ATen node's outputs
    after the node ("ATen/_original_module/model/model.2/ATen_output_0_dim_0"), which ORT's own symbolic shape
    inference replaces but ONNX's keeps, and ORTModule's memory report then fails to parse them (sympy's parse_expr)
    on the first step."""
    graph = model.graph
    for value in (*graph.input, *graph.value_info, *graph.output):
        for dim in value.type.tensor_type.shape.dim:
            if dim.HasField("dim_param"):
                dim.dim_param = re.sub(r"\W", "_", dim.dim_param)
    return model


@contextlib.contextmanager
def ortmodule_scope(settings: SessionSettings, runs: OrtRunCounter, fixes: dict[str, int]) -> Iterator[None]:
    """Around every call into one engine's ORTModule: ORT's export, session creation and runs inside see this
    engine's settings, count into its counter and record the graph fixes applied into `fixes`; torch's fused MHA
    inference path (which cannot be exported: ORTModule would fall back to PyTorch in eval and stay there) is off
    only for the duration."""
    token = _ACTIVE.set(_Scope(settings, runs, fixes))
    fastpath = torch.backends.mha.get_fastpath_enabled()
    torch.backends.mha.set_fastpath_enabled(False)
    try:
        yield
    finally:
        torch.backends.mha.set_fastpath_enabled(fastpath)
        _ACTIVE.reset(token)


@contextlib.contextmanager
def ortmodule_construction(*, fallback_allowed: bool, opset: int | None) -> Iterator[None]:
    """While an ORTModule is constructed: its fallback policy and export opset. ORTModule reads both only then,
    from a module global and environment variables, which are restored afterwards."""
    patch_ortmodule()
    from onnxruntime.training import ortmodule
    from onnxruntime.training.ortmodule._fallback import _FallbackPolicy

    if fallback_allowed:
        policy = (
            _FallbackPolicy.FALLBACK_UNSUPPORTED_DEVICE
            | _FallbackPolicy.FALLBACK_UNSUPPORTED_DATA
            | _FallbackPolicy.FALLBACK_UNSUPPORTED_TORCH_MODEL
            | _FallbackPolicy.FALLBACK_UNSUPPORTED_ONNX_MODEL
        )
    else:
        policy = _FallbackPolicy.FALLBACK_DISABLE
    saved_env = {key: os.environ.get(key) for key in ("ORTMODULE_FALLBACK_POLICY", "ORTMODULE_ONNX_OPSET_VERSION")}
    saved_policy = ortmodule.ORTMODULE_FALLBACK_POLICY
    # The module global is what the fallback manager reads; the environment variable overrides it in the runtime
    # options (and only changes the start-up banner otherwise), so both are set.
    ortmodule.ORTMODULE_FALLBACK_POLICY = policy
    os.environ.pop("ORTMODULE_FALLBACK_POLICY", None)
    if not fallback_allowed:
        os.environ["ORTMODULE_FALLBACK_POLICY"] = policy.name
    os.environ.pop("ORTMODULE_ONNX_OPSET_VERSION", None)
    if opset is not None:
        os.environ["ORTMODULE_ONNX_OPSET_VERSION"] = str(opset)
    try:
        yield
    finally:
        ortmodule.ORTMODULE_FALLBACK_POLICY = saved_policy
        for key, value in saved_env.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def ortmodule_fallback_error() -> type[BaseException]:
    """The exception type ORTModule raises when it cannot run a model (and may not fall back)."""
    from onnxruntime.training.ortmodule._fallback_exceptions import ORTModuleFallbackException

    return ORTModuleFallbackException


def set_ort_seed(seed: int) -> None:
    """Seed ONNX Runtime's own generator (dropout inside ORT graphs); ORT exposes it only in its private binding."""
    from onnxruntime.capi import _pybind_state

    _pybind_state.set_seed(seed)


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


def profiling() -> bool:
    """Whether ORT sessions write profiles (ORTFLOW_ORT_PROFILE_DIR)."""
    return bool(os.environ.get(ORT_PROFILE_DIR))


def ort_optimizer(path: Path, module, options=None):
    """onnxruntime.training.api.Optimizer over `module`; with `options`, its session gets those instead of the
    module's (the training API offers no argument for it: it reads the module's private `_session_options`)."""
    from onnxruntime.training import api

    if options is not None:
        module._session_options = options
    return api.Optimizer(str(path), module)
