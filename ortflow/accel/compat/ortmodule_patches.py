"""ORTModule 1.19.2's patches: what ortflow changes inside ORTModule, applied once and idempotently
(`patch_ortmodule`). Each patched method reads the settings of the engine running at the time (`ortmodule_scope`),
so engines in one process never mix. The graph work done around ORTModule's export (symbolics, graph fixes, shape
inference) is handed in by the caller as `ExportHooks`: this layer knows ORT's internals, not ortflow's graphs."""

import contextlib
import contextvars
import os
import sys
import threading
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import onnx
import torch

from ortflow.accel.compat import export_warnings, torch_patches
from ortflow.accel.compat.ort import apply_session_settings
from ortflow.accel.compat.versions import prepare
from ortflow.model.probe import buffers_kept

_ORT_SYMBOLIC_OPSETS: set[int] = set()  # the opsets ORTModule has registered its symbolics at in this process


def ort_symbolic_opsets() -> set[int]:
    return _ORT_SYMBOLIC_OPSETS


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
class ExportHooks:
    """The graph work around ORTModule's export, handed in by the engine (the compatibility layer knows ORT's internals,
    not ortflow's graphs). Each hook gets the running engine's `SessionSettings.graph` (None outside an engine)."""

    install: Callable[[], None]  # once, before any ORTModule is built (gradient registrations, shape handlers)
    # around torch's export of a module at an opset
    exporting: Callable[[Any, int, torch.nn.Module], contextlib.AbstractContextManager]
    # the exported graph, its trainable and its frozen parameters, the engine's graph settings
    fix: Callable[[onnx.ModelProto, set[str], set[str], Any], dict[str, int]]
    infer_shapes: Callable[[onnx.ModelProto], onnx.ModelProto]  # ORTModule's shape inference, replaced


@dataclass(frozen=True)
class SessionSettings:
    """One engine's ORT session settings (ORTModule has no option for them; ortflow applies them itself)."""

    intra_op_threads: int | None = None  # None: as many as torch uses
    allow_spinning: bool = True  # ORT's default
    graph: Any = None  # what the ExportHooks read: the graph work this engine asked for


@dataclass
class _Scope:
    settings: SessionSettings
    runs: OrtRunCounter
    fixes: dict[str, int]


# The engine whose ORTModule is running in this thread right now (set around each of its calls by `ortmodule_scope`):
# ORT's patched methods read its settings and count into its counter, so engines in one process never mix.
_ACTIVE: contextvars.ContextVar[_Scope | None] = contextvars.ContextVar("ortflow_ortmodule_scope", default=None)
_patched = False
# True while ORTModule's forward that learns the outputs runs (`_schema_forward_without_a_model_copy`): not the trace,
# so the export hooks leave it under ORTModule's no_grad.
PROBING_OUTPUTS: contextvars.ContextVar[bool] = contextvars.ContextVar("ortflow_probing_outputs", default=False)


def _count(cls: type, method: str, kind: str) -> None:
    original = getattr(cls, method)

    def counted(self, *args, **kwargs):
        result = original(self, *args, **kwargs)
        if (scope := _ACTIVE.get()) is not None:
            scope.runs.bump(kind)
        return result

    setattr(cls, method, counted)


def patch_ortmodule(hooks: ExportHooks) -> None:
    """Apply the ORTModule fixes (idempotent: the first call's hooks stay). Import ORTModule only after calling this.

    The patched methods read the settings of the engine running at the time (see `ortmodule_scope`)."""
    global _patched
    if _patched:
        return
    prepare()
    with export_warnings.expected():
        # ORTModule imports its hooks on its first forward; their ZeRO-offload helper warns without DeepSpeed.
        import onnxruntime.training.utils.hooks  # noqa: F401
    hooks.install()  # before any ORTModule is built: it publishes ORT's gradient registry then
    from onnxruntime.training.ortmodule import _execution_agent
    from onnxruntime.training.ortmodule._custom_op_symbolic_registry import CustomOpSymbolicRegistry
    from onnxruntime.training.ortmodule._graph_execution_manager import GraphExecutionManager
    from onnxruntime.training.ortmodule._graph_transition_manager import GraphTransitionManager

    _record_symbolic_opsets(CustomOpSymbolicRegistry)
    _count(_execution_agent.TrainingAgent, "run_forward", "forward")
    _count(_execution_agent.TrainingAgent, "run_backward", "backward")
    _count(_execution_agent.InferenceAgent, "run_forward", "inference")
    _sessions_with_engine_settings(GraphExecutionManager)
    _fix_exported_graphs(GraphTransitionManager, hooks)
    _gradients_for_trainable_parameters_only()
    _schema_forward_without_a_model_copy()
    _capture_only_real_streams()
    _patched = True


def _record_symbolic_opsets(registry: type) -> None:
    """ORTModule's symbolic registry (CustomOpSymbolicRegistry) notes each opset it registers its symbolics at, in
    `_ORT_SYMBOLIC_OPSETS`."""
    register_all = registry.register_all.__func__

    def register_all_recorded(cls, onnx_opset_version):
        _ORT_SYMBOLIC_OPSETS.add(onnx_opset_version)
        return register_all(cls, onnx_opset_version)

    registry.register_all = classmethod(register_all_recorded)


def _sessions_with_engine_settings(manager: type) -> None:
    """Every ORT session ORTModule's GraphExecutionManager creates gets the running engine's thread count and
    spinning (ORT's defaults outside an engine)."""
    session_config = manager._get_session_config

    def session_config_with_threads(self):
        options, providers, provider_options = session_config(self)
        settings = scope.settings if (scope := _ACTIVE.get()) is not None else SessionSettings()
        apply_session_settings(options, settings.intra_op_threads, settings.allow_spinning)
        return options, providers, provider_options

    manager._get_session_config = session_config_with_threads


def _fix_exported_graphs(transitions: type, hooks: ExportHooks) -> None:
    """ORTModule's GraphTransitionManager exports inside the hooks' `exporting`, has each exported graph fixed by
    `hooks.fix` (the fixes counted into the running engine's scope) and infers shapes with `hooks.infer_shapes`."""
    get_exported = transitions._get_exported_model

    def get_exported_fixed(*args, **kwargs):
        scope = _ACTIVE.get()
        graph = scope.settings.graph if scope is not None else None
        with (
            export_warnings.expected(),
            torch_patches.exporting(),
            hooks.exporting(graph, kwargs["onnx_opset_version"], kwargs["flattened_module"]),
        ):
            exported_model, output_schema = get_exported(*args, **kwargs)
        # The parameters ORTModule builds the gradient of (`_gradients_for_trainable_parameters_only`).
        parameters = dict(kwargs["flattened_module"].named_parameters())
        trainable = {name for name, p in parameters.items() if p.requires_grad}
        fixes = hooks.fix(exported_model, trainable, set(parameters) - trainable, graph)
        if scope is not None:
            scope.fixes.update(fixes)
        return exported_model, output_schema

    transitions._get_exported_model = staticmethod(get_exported_fixed)
    transitions._infer_shapes = staticmethod(hooks.infer_shapes)


# Which parameters required a gradient when each ORTModule (training) graph was exported: one per
# GraphTransitionManager, held only as long as it lives.
_TRAINABLE_AT_EXPORT: "weakref.WeakKeyDictionary[Any, tuple[bool, ...]]" = weakref.WeakKeyDictionary()


def _gradients_for_trainable_parameters_only() -> None:
    """ORTModule 1.19.2 exports every parameter as requiring a gradient (GraphTransitionManager._export_model lists
    all of `named_parameters()`, whatever their requires_grad), builds its gradient graph for all of them, and then
    drops the frozen ones' gradients in torch: a frozen layer's weight-gradient GEMMs run every step and their outputs
    are held until then. Only with its skip-checks off (ORTMODULE_SKIPCHECK_POLICY; on by default, as ortflow keeps
    them) would its `_reprocess_check` notice on the second step and rebuild the gradient graph.

    Here, ORTModule lists only the parameters with requires_grad as trainable, so its gradient builder computes
    nothing for the frozen ones (and the ExportHooks get those names: the ATen nodes' gradient masks agree). When
    requires_grad changes after an export (a layer unfrozen or frozen), the next training forward exports and builds
    the graphs again, as ORTModule does when the model changes, skip-checks or not."""
    from onnxruntime.training.ortmodule._graph_transition_manager import GraphTransitionManager
    from onnxruntime.training.ortmodule._training_manager import TrainingManager

    export_model = GraphTransitionManager._export_model

    def export_model_trainable_only(*args, **kwargs):
        exported, schema, input_names, names_require_grad = export_model(*args, **kwargs)
        frozen = {name for name, p in kwargs["flattened_module"].named_parameters() if not p.requires_grad}
        return exported, schema, input_names, [name for name in names_require_grad if name not in frozen]

    forward = TrainingManager.forward

    def forward_exported_for_current_trainable(self, *inputs, **kwargs):
        trainable = tuple(p.requires_grad for p in self._flattened_module.parameters())
        transitions = self._graph_transition_manager
        if transitions._exported_model_info is not None and _TRAINABLE_AT_EXPORT.get(transitions) != trainable:
            # Exported, built and given a session again, whatever the skip-checks say.
            transitions._exported_model_info = None
            self._execution_agent = None
        _TRAINABLE_AT_EXPORT[transitions] = trainable
        return forward(self, *inputs, **kwargs)

    GraphTransitionManager._export_model = staticmethod(export_model_trainable_only)
    TrainingManager.forward = forward_exported_for_current_trainable


def _schema_forward_without_a_model_copy() -> None:
    """Before each export ORTModule 1.19.2 runs one forward to learn its outputs' structure, on a deep copy of the
    whole module, parameters and frozen weights included ("in case the model is stateful"; on CPU it always copies).
    The copy lives beside the training session: on the Qwen2-0.5B-shaped LoRA benchmark the eval graph's export took
    the run's peak memory 1 GB above the training steps'.

    Here the forward runs on the module itself, and its buffers are put back afterwards: what a forward changes in a
    module's tensors is its buffers (BatchNorm's statistics in training mode), as the copy protected. Python state a
    forward changes (a call counter) is changed by the export's own trace of the module all the same. It runs under
    ORTModule's no_grad: `PROBING_OUTPUTS` tells the export hooks, which trace the forward with grad on, that this
    forward is not the trace."""
    from onnxruntime.training.ortmodule import _io

    parse = _io.parse_outputs_for_onnx_export_and_extract_schema

    def parse_on_the_module(module, flatten_args, logger, clone_module):
        token = PROBING_OUTPUTS.set(True)
        try:
            with buffers_kept(module):
                return parse(module, flatten_args, logger, False)
        finally:
            PROBING_OUTPUTS.reset(token)

    _io.parse_outputs_for_onnx_export_and_extract_schema = parse_on_the_module


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
    from a module global and environment variables, which are restored afterwards. Call `patch_ortmodule` first."""
    assert _patched, "patch_ortmodule() before an ORTModule is built"
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


def training_graph(module: torch.nn.Module) -> onnx.ModelProto | None:
    """The training graph (forward and gradient, as ORT optimised it) an ORTModule last built; None before its first
    training step."""
    return module._torch_module._execution_manager(True)._onnx_models.optimized_model


def ortmodule_fallback_error() -> type[BaseException]:
    """The exception type ORTModule raises when it cannot run a model (and may not fall back)."""
    from onnxruntime.training.ortmodule._fallback_exceptions import ORTModuleFallbackException

    return ORTModuleFallbackException
