"""The graph work around ORTModule's own export (the `ExportHooks` the ortmodule engine hands to the compatibility
layer's ORTModule patches): ortflow's symbolics while torch exports, ortflow's graph fixes on the exported graph, and
shape inference that survives graphs ORT's symbolic inference rejects."""

import contextlib
import logging
import re
from collections.abc import Iterator
from dataclasses import dataclass, field

import onnx

from ortflow.accel.compat.ortmodule_patches import ExportHooks
from ortflow.accel.graph import aten_cross_entropy, aten_gelu, aten_nodes, aten_shapes, onnx_gradients, symbolics
from ortflow.accel.graph.rewrites import Rewrites, prepare_training_graph

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ExportSettings:
    """The graph work one ORTModule engine asked for."""

    rewrites: Rewrites = field(default_factory=Rewrites)  # the graph rewrites applied before the gradient is built
    aten_conv: bool = False  # every convolution exported as an ATen node run by torch (graph/aten_conv.py)
    aten_layer_norm: bool = False  # every LayerNorm exported as an ATen node run by torch (graph/aten_layer_norm.py)
    bf16: bool = False  # matrix multiplies and ATen convolutions computed in bf16 by torch (graph/aten_gemm.py)
    aten_gelu: bool = False  # GELU's tanh approximation as an ATen node run by torch (graph/aten_gelu.py)
    aten_cross_entropy: bool = False  # the loss's SoftmaxCrossEntropyLoss run by torch (graph/aten_cross_entropy.py)

    @property
    def torch_kernels(self) -> bool:
        """Whether the exported graphs may hold ATen nodes that torch runs (then ORT must not spin-wait)."""
        return self.aten_conv or self.aten_layer_norm or self.bf16 or self.aten_gelu or self.aten_cross_entropy


def _install() -> None:
    aten_nodes.register_gradients()  # ORTModule publishes ORT's gradient registry when it is built
    onnx_gradients.register_gradients()  # and the standard ONNX ops ORT has no gradient builder for
    aten_shapes.install()  # the ATen convolutions' output shapes (squeeze-excitation's broadcast gradient)


@contextlib.contextmanager
def _exporting(settings: ExportSettings | None, opset: int) -> Iterator[None]:
    settings = settings or ExportSettings()
    with symbolics.ort_export(opset, settings.aten_conv, settings.aten_layer_norm, settings.bf16):
        yield


def _fix(
    model: onnx.ModelProto, trainable: set[str], frozen: set[str], settings: ExportSettings | None
) -> dict[str, int]:
    settings = settings or ExportSettings()
    fixes, masks = prepare_training_graph(model, settings.rewrites)
    assert not masks, "ORTModule cannot feed dropout masks"  # Rewrites.dropout_masks is artifacts-only
    if settings.aten_gelu:  # GELU's gradient by torch, not ORT's FastGeluGrad
        aten_gelu.tanh_gelus_to_aten(model)
    if settings.aten_cross_entropy:  # the loss by torch (in bf16 fused with the LM head), not ORT's
        aten_cross_entropy.losses_to_aten(model, settings.bf16)
    if torch_nodes := aten_nodes.count_all(model):
        # ORTModule builds its gradient graph for the trainable parameters only (the compatibility layer's patch), so
        # the ATen nodes compute no gradient for a frozen weight either (and keep its bf16 copy from step to step).
        aten_nodes.set_gradient_masks(model, trainable, frozen)
    fixes.update(aten_nodes.graph_fixes(torch_nodes))
    return fixes


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


HOOKS = ExportHooks(install=_install, exporting=_exporting, fix=_fix, infer_shapes=_infer_shapes)
