"""Everything that depends on the torch version or on onnxruntime-training internals, in one place.

Supporting another torch or ORT version means revisiting this module only. Each patch below fixes one measured
failure of ORTModule 1.19.2 with torch 2.6 on the seed TransformerModel; each is applied once, idempotently.
"""

import contextlib
import logging
import os
import threading
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import onnx
import torch
from onnx import helper, numpy_helper

log = logging.getLogger(__name__)

# ORT 1.19 reads ONNX IR <= 10, and its gradient builder mishandles LayerNormalization at opset 17.
MAX_ARTIFACTS_OPSET = 16


# ----------------------------------------------------------------------------------------------- torch side
def disable_transformer_fastpath() -> None:
    """Keep nn.TransformerEncoderLayer off torch's fused inference kernel.

    In eval mode under no_grad the layer calls `torch._transformer_encoder_layer_fwd`, which the ONNX exporter
    cannot export: ORTModule's eval export fails, falls back to PyTorch, and training stays there afterwards.
    """
    torch.backends.mha.set_fastpath_enabled(False)


def export_training_onnx(model: torch.nn.Module, example: torch.Tensor, path: Path, opset: int) -> None:
    """torch.onnx.export in training mode as ORT's training-artifacts flow expects: parameters kept as
    initializers named like the torch state_dict, no constant folding, dropout kept live.

    The batch dimension is dynamic; other dimensions are those of `example`.
    """
    torch.onnx.export(
        model,
        (example,),
        str(path),
        input_names=["input"],
        output_names=["logits"],
        dynamic_axes={"input": {0: "batch"}, "logits": {0: "batch"}},
        export_params=True,
        do_constant_folding=False,
        training=torch.onnx.TrainingMode.TRAINING,
        opset_version=opset,
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


def prepare_training_graph(model: onnx.ModelProto, rewrite_gathers: bool = True) -> None:
    """All graph fixes ortflow applies to an exported forward graph before ORT builds its gradient."""
    if changed := add_dropout_masks(model):
        log.debug("added the mask output to %d Dropout node(s)", changed)
    if rewrite_gathers and (changed := constant_gathers_to_slices(model)):
        log.debug("rewrote %d constant-index Gather node(s) as Slice", changed)


class OrtRunCounter:
    """Counts ORT's own session runs inside ORTModule: proof that ORT, not PyTorch, executed a step."""

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


ORT_RUNS = OrtRunCounter()
_patched = False
# Settings for the ORTModules this process creates next (see configure_ortmodule); ORTModule has no option for them.
_ORTMODULE: dict[str, int | bool | None] = {"intra_op_threads": None, "allow_spinning": True, "rewrite_gathers": True}


def apply_session_settings(options, intra_op_threads: int | None, allow_spinning: bool) -> None:
    """Thread settings on an onnxruntime.SessionOptions."""
    if intra_op_threads is not None:
        options.intra_op_num_threads = intra_op_threads
    options.add_session_config_entry("session.intra_op.allow_spinning", "1" if allow_spinning else "0")


def _count(cls: type, method: str, kind: str) -> None:
    original = getattr(cls, method)

    def counted(self, *args, **kwargs):
        result = original(self, *args, **kwargs)
        ORT_RUNS.bump(kind)
        return result

    setattr(cls, method, counted)


def patch_ortmodule() -> None:
    """Apply the ORTModule fixes (idempotent). Import ORTModule only after calling this."""
    global _patched
    if _patched:
        return
    from onnxruntime.tools.symbolic_shape_infer import SymbolicShapeInference
    from onnxruntime.training.ortmodule import _execution_agent
    from onnxruntime.training.ortmodule._graph_execution_manager import GraphExecutionManager
    from onnxruntime.training.ortmodule._graph_transition_manager import GraphTransitionManager

    _count(_execution_agent.TrainingAgent, "run_forward", "forward")
    _count(_execution_agent.TrainingAgent, "run_backward", "backward")
    _count(_execution_agent.InferenceAgent, "run_forward", "inference")

    get_exported = GraphTransitionManager._get_exported_model

    def get_exported_with_masks(*args, **kwargs):
        exported_model, output_schema = get_exported(*args, **kwargs)
        prepare_training_graph(exported_model, bool(_ORTMODULE["rewrite_gathers"]))
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
        apply_session_settings(options, _ORTMODULE["intra_op_threads"], bool(_ORTMODULE["allow_spinning"]))
        return options, providers, provider_options

    GraphExecutionManager._get_session_config = session_config_with_threads
    GraphTransitionManager._get_exported_model = staticmethod(get_exported_with_masks)
    GraphTransitionManager._infer_shapes = staticmethod(infer_shapes)
    _patched = True


def configure_ortmodule(
    *,
    fallback_allowed: bool,
    opset: int | None,
    intra_op_threads: int | None,
    allow_spinning: bool,
    rewrite_gathers: bool,
) -> None:
    """Everything ORTModule reads when it is constructed or first exports, for the ORTModules created next.

    Applies ortflow's patches (patch_ortmodule) first. opset=None keeps ORTModule's default opset.
    """
    patch_ortmodule()
    _set_fallback(fallback_allowed)
    if opset is None:
        os.environ.pop("ORTMODULE_ONNX_OPSET_VERSION", None)
    else:
        os.environ["ORTMODULE_ONNX_OPSET_VERSION"] = str(opset)
    _ORTMODULE.update(intra_op_threads=intra_op_threads, allow_spinning=allow_spinning, rewrite_gathers=rewrite_gathers)


def _set_fallback(allowed: bool) -> None:
    """ORTModule's fallback manager reads the module global ORTMODULE_FALLBACK_POLICY at construction; the
    ORTMODULE_FALLBACK_POLICY environment variable only changes what its start-up banner prints. Set both."""
    from onnxruntime.training import ortmodule
    from onnxruntime.training.ortmodule._fallback import _FallbackPolicy

    if allowed:
        policy = (
            _FallbackPolicy.FALLBACK_UNSUPPORTED_DEVICE
            | _FallbackPolicy.FALLBACK_UNSUPPORTED_DATA
            | _FallbackPolicy.FALLBACK_UNSUPPORTED_TORCH_MODEL
            | _FallbackPolicy.FALLBACK_UNSUPPORTED_ONNX_MODEL
        )
        os.environ.pop("ORTMODULE_FALLBACK_POLICY", None)
    else:
        policy = _FallbackPolicy.FALLBACK_DISABLE
        os.environ["ORTMODULE_FALLBACK_POLICY"] = policy.name
    ortmodule.ORTMODULE_FALLBACK_POLICY = policy


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
