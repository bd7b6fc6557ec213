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
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
import torch
from onnx import helper, numpy_helper

from ortflow.accel import compat_torch

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


# ------------------------------------------------------------------------------------------------- ORT side
def add_dropout_masks(model: onnx.ModelProto) -> int:
    """Give every Dropout node its optional `mask` output. Returns how many nodes were changed.

    torch exports the attention-weights dropout of scaled_dot_product_attention with one output, while ORT's
    Dropout gradient reads the mask (`gradient_builder_base.h: i < node_->OutputDefs().size()`). Asking for the
    mask changes nothing in the forward result.
    """
    changed = 0
    for node in model.graph.node:
        if node.op_type == "Dropout" and len(node.output) == 1:
            node.output.append(f"{node.name or node.output[0]}_mask")
            changed += 1
    return changed


def _constants(graph: onnx.GraphProto) -> dict[str, np.ndarray]:
    values = {init.name: numpy_helper.to_array(init) for init in graph.initializer}
    for node in graph.node:
        if node.op_type == "Constant":
            for attr in node.attribute:
                if attr.name == "value":
                    values[node.output[0]] = numpy_helper.to_array(attr.t)
    return values


def constant_gathers_to_slices(model: onnx.ModelProto) -> int:
    """Rewrite `Gather(x, <constant scalar i>)` as `Squeeze(Slice(x, i, i+1))`. Returns how many were rewritten.

    nn.MultiheadAttention splits its packed q/k/v projection with proj[0], proj[1], proj[2], which export as
    Gathers with constant indices. ORT's CPU GatherGrad scatters element by element and contends across threads:
    ~10 ms each per step for batch 32 x 64 x 128 on 2 cores, over a third of the step. Slice's gradient is a
    plain copy. Gathers on shapes (Shape -> Gather) are left alone; they are tiny and feed shape inference.
    """
    graph = model.graph
    constants = _constants(graph)
    producer = {out: node.op_type for node in graph.node for out in node.output}
    opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 17)
    nodes, changed = [], 0
    for node in graph.node:
        index = constants.get(node.input[1]) if node.op_type == "Gather" and len(node.input) == 2 else None
        if index is None or index.ndim != 0 or producer.get(node.input[0]) == "Shape":
            nodes.append(node)
            continue
        i = int(index)
        axis = next((a.i for a in node.attribute if a.name == "axis"), 0)
        base = node.name or node.output[0]

        def const(name: str, value: int, base: str = base) -> str:
            out = f"{base}/{name}"
            nodes.append(helper.make_node("Constant", [], [out], value=numpy_helper.from_array(np.array([value]))))
            return out

        end = i + 1 if i != -1 else np.iinfo(np.int64).max  # i=-1: slice to the end
        starts, ends, axes = const("starts", i), const("ends", end), const("axes", axis)
        sliced = f"{base}/sliced"
        nodes.append(helper.make_node("Slice", [node.input[0], starts, ends, axes], [sliced], name=f"{base}/Slice"))
        if opset >= 13:
            nodes.append(helper.make_node("Squeeze", [sliced, axes], [node.output[0]], name=f"{base}/Squeeze"))
        else:
            nodes.append(helper.make_node("Squeeze", [sliced], [node.output[0]], name=f"{base}/Squeeze", axes=[axis]))
        changed += 1
    del graph.node[:]
    graph.node.extend(nodes)
    return changed


def prepare_training_graph(model: onnx.ModelProto, rewrite_gathers: bool = True) -> dict[str, int]:
    """All graph fixes ortflow applies to an exported forward graph before ORT builds its gradient; returns how
    many nodes each fix changed (only the fixes that changed something)."""
    fixes = {"dropout_mask_outputs": add_dropout_masks(model)}
    if rewrite_gathers:
        fixes["constant_gathers_to_slices"] = constant_gathers_to_slices(model)
    fixes = {name: count for name, count in fixes.items() if count}
    if fixes:
        log.debug("graph fixes applied: %s", fixes)
    return fixes


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
    rewrite_gathers: bool = True  # constant-index Gather -> Slice before the gradient is built


@dataclass
class _Scope:
    settings: SessionSettings
    runs: OrtRunCounter
    fixes: dict[str, int]


# The engine whose ORTModule is running in this thread right now (set around each of its calls by `ortmodule_scope`):
# ORT's patched methods read its settings and count into its counter, so engines in one process never mix.
_ACTIVE: contextvars.ContextVar[_Scope | None] = contextvars.ContextVar("ortflow_ortmodule_scope", default=None)
_patched = False


def apply_session_settings(options, intra_op_threads: int | None, allow_spinning: bool) -> None:
    """Thread settings on an onnxruntime.SessionOptions."""
    if intra_op_threads is not None:
        options.intra_op_num_threads = intra_op_threads
    options.add_session_config_entry("session.intra_op.allow_spinning", "1" if allow_spinning else "0")


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
    from onnxruntime.tools.symbolic_shape_infer import SymbolicShapeInference
    from onnxruntime.training.ortmodule import _execution_agent
    from onnxruntime.training.ortmodule._graph_execution_manager import GraphExecutionManager
    from onnxruntime.training.ortmodule._graph_transition_manager import GraphTransitionManager

    _count(_execution_agent.TrainingAgent, "run_forward", "forward")
    _count(_execution_agent.TrainingAgent, "run_backward", "backward")
    _count(_execution_agent.InferenceAgent, "run_forward", "inference")

    get_exported = GraphTransitionManager._get_exported_model

    def get_exported_with_masks(*args, **kwargs):
        with compat_torch.exporting():
            exported_model, output_schema = get_exported(*args, **kwargs)
        scope = _ACTIVE.get()
        fixes = prepare_training_graph(exported_model, scope.settings.rewrite_gathers if scope else True)
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
            return onnx.shape_inference.infer_shapes(model)

    session_config = GraphExecutionManager._get_session_config

    def session_config_with_threads(self):
        options, providers, provider_options = session_config(self)
        settings = scope.settings if (scope := _ACTIVE.get()) is not None else SessionSettings()
        apply_session_settings(options, settings.intra_op_threads, settings.allow_spinning)
        return options, providers, provider_options

    GraphExecutionManager._get_session_config = session_config_with_threads
    GraphTransitionManager._get_exported_model = staticmethod(get_exported_with_masks)
    GraphTransitionManager._infer_shapes = staticmethod(infer_shapes)
    _patched = True


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


@contextlib.contextmanager
def quiet_export() -> Iterator[None]:
    """Silence torch.onnx's warnings about training-mode export, which ortflow asks for on purpose."""
    import warnings

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", module=r"torch\.onnx")
        yield
