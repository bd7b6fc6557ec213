"""The graph work around ORTModule's own export (the `ExportHooks` the ortmodule engine hands to the compatibility
layer's ORTModule patches): the graph pipeline (accel/graph/pipeline.py) under the running engine's plan, the
symbolics while torch exports and the rewrites on the exported graph, and shape inference that survives graphs ORT's
symbolic inference rejects."""

import contextlib
import logging
import re
from collections.abc import Iterator

import onnx
from torch import nn

from ortflow.accel.compat.ortmodule_patches import ExportHooks
from ortflow.accel.graph import batchnorm, pipeline
from ortflow.accel.graph.plan import GraphPlan, GraphWork, Path
from ortflow.model.probe import buffers_kept

log = logging.getLogger(__name__)


@contextlib.contextmanager
def _exporting(plan: GraphPlan | None, opset: int, module: nn.Module) -> Iterator[None]:
    if plan is None:  # an ORTModule built outside an ortflow engine: ORTModule's own export
        yield
        return
    # The export traces one training forward in torch. Where ORT's kernel keeps BatchNorm's statistics, the update
    # that trace makes is undone (the host's path overwrites it with its own).
    kept = plan.path(batchnorm.NAME) is Path.ort
    with pipeline.exporting(plan, opset, module), buffers_kept(module) if kept else contextlib.nullcontext():
        yield


def _fix(model: onnx.ModelProto, trainable: set[str], frozen: set[str], plan: GraphPlan | None) -> dict[str, int]:
    if plan is None:
        return {}
    # ORTModule feeds dropout masks as its module's inputs (graph/fed_dropout.py), never as graph inputs. It builds
    # its gradient graph for the trainable parameters only (the compatibility layer's patch), so the ATen nodes
    # compute no gradient for a frozen weight either (and keep its bf16 copy from step to step).
    work = pipeline.prepare(model, plan, GraphWork(trainable, frozen))
    pipeline.register_gradients(work)  # those declared since ORTModule was first built too
    return work.fixes


def _infer_shapes(model: onnx.ModelProto) -> onnx.ModelProto:
    """ORT's symbolic shape inference, or ONNX's own where it fails: it asserts in _infer_Reshape
    (is_literal(shape_rank)) on the Reshape that nn.MultiheadAttention exports; ONNX's handles that graph."""
    from onnxruntime.tools.symbolic_shape_infer import SymbolicShapeInference

    try:
        return SymbolicShapeInference.infer_shapes(model, auto_merge=True, guess_output_rank=True)
    except AssertionError:
        log.info("ORT symbolic shape inference failed on this graph; using ONNX shape inference instead")
        inferred = onnx.shape_inference.infer_shapes(model)
        return _plain_dim_names(_type_group_norm_statistics(inferred))


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


HOOKS = ExportHooks(install=pipeline.install, exporting=_exporting, fix=_fix, infer_shapes=_infer_shapes)
