"""ONNX graph rewrites ortflow applies to an exported forward graph before ORT builds its gradient.

Two kinds. Fixes, always applied, make a graph ORT can differentiate at all (`add_dropout_masks`). Speed rewrites
replace a node whose ORT CPU training kernel is slow (single-threaded or contending) with nodes whose forward result
is the same and whose gradient ORT runs fast; each is optional in the accel config and on by default only where
`ortflow-bench` measured it faster (docs/performance.md). Every rewrite returns how many nodes it changed. Each is
declared at the end as a graph-plan op (accel/graph/plan.py): the `dropout` op's fed masks are `accel.rewrite_dropout`
(ORTModule's own way of feeding them: fed_dropout.py), the speed rewrites `accel.rewrite_*`; all of them write ONNX
operators only, so the portable target keeps them, but for the fed masks.
"""

import logging

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from ortflow.accel.compat import ort
from ortflow.accel.graph import aten_nodes
from ortflow.accel.graph import plan as graph_plan
from ortflow.accel.graph.masks import DropoutMask
from ortflow.accel.graph.onnx_values import attribute, constant_values, readers, replace_nodes, value_types

log = logging.getLogger(__name__)


# ------------------------------------------------------------------------------------------------- helpers
def _const(nodes: list[onnx.NodeProto], name: str, value: np.ndarray) -> str:
    nodes.append(helper.make_node("Constant", [], [name], value=numpy_helper.from_array(value)))
    return name


def _static_shape(type_: onnx.TypeProto | None) -> tuple[int, ...] | None:
    if type_ is None or not type_.tensor_type.HasField("shape"):
        return None
    dims = type_.tensor_type.shape.dim
    if not all(d.HasField("dim_value") for d in dims):
        return None
    return tuple(d.dim_value for d in dims)


# ------------------------------------------------------------------------------------------------- fixes
def add_dropout_masks(model: onnx.ModelProto) -> int:
    """Give every Dropout node its optional `mask` output.

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


def attention_dropout_in_training_mode(model: onnx.ModelProto) -> int:
    """Give a Dropout exported without its `training_mode` input (ONNX: inference mode, the identity) a constant
    True, on a graph exported in training mode.

    torch's exporter writes scaled_dot_product_attention's attention-weights dropout (nn.MultiheadAttention's
    `dropout`) as `Dropout(x, ratio)` with no training_mode, so ORT ran it as the identity while eager PyTorch
    drops attention weights. Every other dropout torch exports in training mode carries training_mode = True.
    """
    graph = model.graph
    constants = constant_values(graph)
    nodes: list[onnx.NodeProto] = []
    changed = 0
    for node in graph.node:
        ratio = constants.get(node.input[1]) if node.op_type == "Dropout" and len(node.input) > 1 else None
        if ratio is None or float(ratio) == 0.0 or (len(node.input) > 2 and node.input[2]):
            nodes.append(node)
            continue
        training = _const(nodes, f"{node.name or node.output[0]}/training_mode", np.array(True))
        del node.input[2:]
        node.input.append(training)
        nodes.append(node)
        changed += 1
    del graph.node[:]
    graph.node.extend(nodes)
    return changed


def decompose_instance_norms(model: onnx.ModelProto) -> int:
    """Rewrite every `InstanceNormalization(x, scale, bias)` as the arithmetic it stands for:
    `d = x - ReduceMean(x, spatial axes)`, `y = d / Sqrt(ReduceMean(d * d, spatial axes) + epsilon) * scale + bias`
    (scale and bias per channel, axis 1).

    ORT 1.19 has no gradient for InstanceNormalization ("The gradient builder has not been registered"), and torch
    exports both nn.InstanceNorm* and nn.GroupNorm with it (GroupNorm as Reshape(N, G, -1) -> InstanceNormalization
    with ones and zeros -> Reshape -> Mul(weight) -> Add(bias)). The replacement's ops all have ORT gradients and give
    the same values (measured: GroupNorm trains at eager's loss within 1.2e-7). A constant all-ones scale and
    all-zeros bias (GroupNorm's) are left out; the constants that fed only them are removed.
    """
    graph = model.graph
    if not any(node.op_type == "InstanceNormalization" for node in graph.node):
        return 0
    # Constant nodes only: an initializer may be a trainable parameter that merely starts at ones or zeros.
    constants = {
        node.output[0]: numpy_helper.to_array(attr.t)
        for node in graph.node
        if node.op_type == "Constant"
        for attr in node.attribute
        if attr.name == "value"
    }
    types = value_types(model)
    opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 17)
    nodes: list[onnx.NodeProto] = []
    changed = 0
    for node in graph.node:
        type_ = types.get(node.input[0]) if node.op_type == "InstanceNormalization" else None
        if type_ is None or not type_.tensor_type.HasField("shape") or len(type_.tensor_type.shape.dim) < 3:
            nodes.append(node)  # not an InstanceNormalization, or its input's rank is unknown
            continue
        _instance_norm_arithmetic(nodes, node, len(type_.tensor_type.shape.dim), constants, opset)
        changed += 1
    del graph.node[:]
    graph.node.extend(nodes)
    _remove_unused_constants(graph)
    return changed


def _instance_norm_arithmetic(
    nodes: list[onnx.NodeProto], node: onnx.NodeProto, rank: int, constants: dict[str, np.ndarray], opset: int
) -> None:
    """Append to `nodes` the arithmetic standing for the InstanceNormalization `node` (input of rank `rank`), its last
    op writing the node's output."""
    base = node.name or node.output[0]
    x, scale, bias = node.input[0], node.input[1], node.input[2]
    epsilon = attribute(node, "epsilon", 1e-5)
    axes = list(range(2, rank))
    eps = _const(nodes, f"{base}/epsilon", np.array(epsilon, dtype=np.float32))
    nodes.append(_reduce_mean(nodes, f"{base}/mean", x, axes, opset))
    nodes += [
        helper.make_node("Sub", [x, f"{base}/mean"], [f"{base}/centred"], name=f"{base}/Sub"),
        helper.make_node("Mul", [f"{base}/centred"] * 2, [f"{base}/squared"], name=f"{base}/Square"),
    ]
    nodes.append(_reduce_mean(nodes, f"{base}/variance", f"{base}/squared", axes, opset))
    nodes += [
        helper.make_node("Add", [f"{base}/variance", eps], [f"{base}/variance_eps"], name=f"{base}/Add"),
        helper.make_node("Sqrt", [f"{base}/variance_eps"], [f"{base}/std"], name=f"{base}/Sqrt"),
        helper.make_node("Div", [f"{base}/centred", f"{base}/std"], [f"{base}/normalised"], name=f"{base}/Div"),
    ]
    # Per-channel affine, (C,) reshaped to (C, 1, ..., 1), unless it is the identity.
    shape = _const(nodes, f"{base}/channel_shape", np.array([-1] + [1] * (rank - 2), dtype=np.int64))
    result = f"{base}/normalised"
    for op, role, value, identity in (("Mul", "scale", scale, 1.0), ("Add", "shift", bias, 0.0)):
        known = constants.get(value)
        if known is not None and np.all(known == identity):
            continue
        param, out = f"{base}/{role}_per_channel", f"{base}/{role}d"
        nodes.append(helper.make_node("Reshape", [value, shape], [param], name=f"{base}/{role}_reshape"))
        nodes.append(helper.make_node(op, [result, param], [out], name=f"{base}/{role}"))
        result = out
    last = next(n for n in reversed(nodes) if result in n.output)
    last.output[0] = node.output[0]  # the last op writes the InstanceNormalization's output


def _reduce_mean(nodes: list[onnx.NodeProto], name: str, value: str, axes: list[int], opset: int) -> onnx.NodeProto:
    """ReduceMean over `axes` keeping them (from opset 18 on the axes are an input, a constant added to `nodes`)."""
    if opset >= 18:
        axes_input = _const(nodes, f"{name}/axes", np.array(axes, dtype=np.int64))
        return helper.make_node("ReduceMean", [value, axes_input], [name], name=name, keepdims=1)
    return helper.make_node("ReduceMean", [value], [name], name=name, axes=axes, keepdims=1)


def _remove_unused_constants(graph: onnx.GraphProto) -> None:
    """Constant nodes nothing reads any more (initializers are left: they may be parameters the engine names)."""
    used = {name for node in graph.node for name in node.input} | {out.name for out in graph.output}
    alive = [n for n in graph.node if n.op_type != "Constant" or any(o in used for o in n.output)]
    del graph.node[:]
    graph.node.extend(alive)


# ------------------------------------------------------------------------------------------------- speed
def constant_gathers_to_slices(model: onnx.ModelProto) -> int:
    """Rewrite `Gather(x, <constant scalar i>)` as `Squeeze(Slice(x, i, i+1))`.

    nn.MultiheadAttention splits its packed q/k/v projection with proj[0], proj[1], proj[2], which export as
    Gathers with constant indices. ORT's CPU GatherGrad scatters element by element and contends across threads:
    ~10 ms each per step for batch 32 x 64 x 128 on 2 cores, over a third of the step. Slice's gradient is a
    plain copy. Gathers on shapes (Shape -> Gather) are left alone; they are tiny and feed shape inference.
    """
    graph = model.graph
    constants = constant_values(graph)
    producer = {out: node.op_type for node in graph.node for out in node.output}
    opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 17)
    nodes: list[onnx.NodeProto] = []
    changed = 0
    for node in graph.node:
        index = constants.get(node.input[1]) if node.op_type == "Gather" and len(node.input) == 2 else None
        if index is None or index.ndim != 0 or producer.get(node.input[0]) == "Shape":
            nodes.append(node)
            continue
        i = int(index)
        axis = attribute(node, "axis", 0)
        base = node.name or node.output[0]
        end = i + 1 if i != -1 else np.iinfo(np.int64).max  # i=-1: slice to the end
        starts = _const(nodes, f"{base}/starts", np.array([i]))
        ends = _const(nodes, f"{base}/ends", np.array([end]))
        axes = _const(nodes, f"{base}/axes", np.array([axis]))
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


def _only_reader(
    graph_readers: dict[str, int], producers: dict[str, onnx.NodeProto], name: str, op: str
) -> onnx.NodeProto | None:
    """The node of type `op` that produces `name`, where `name` has no other reader; None otherwise."""
    node = producers.get(name)
    return node if node is not None and node.op_type == op and graph_readers.get(name) == 1 else None


def _axes(node: onnx.NodeProto, values: dict[str, np.ndarray]) -> list[int] | None:
    """An Unsqueeze's or Squeeze's axes, from its attribute (opset < 13) or its constant input."""
    if len(node.input) > 1:
        return values[node.input[1]].reshape(-1).tolist() if node.input[1] in values else None
    return attribute(node, "axes")


def packed_projections_to_splits(model: onnx.ModelProto) -> int:
    """Split nn.MultiheadAttention's packed q/k/v projection with one Split.

    torch splits the packed projection `p` (..., 3E) as `p.unflatten(-1, (3, E)).unsqueeze(0).transpose(0, -2)
    .squeeze(-2)` followed by `p[0], p[1], p[2]`. That exports as Reshape, Unsqueeze, Transpose, Squeeze and three
    constant-index Gathers, which ORT differentiates with three zero-filled gradients of the whole packed tensor
    (SliceGrad or GatherGrad), a Sum of the three and a Transpose back: 2-4 ms a layer per step at d_model 512
    (docs/performance.md). q, k and v are the unflattened tensor's three slices along its axis of 3, so a Split of
    that axis (sizes 1, 1, 1: ORT stops with an error if the axis is not 3 long) and a Squeeze each give them, and the
    Split's gradient is one Concat. Returns how many splits were rewritten."""
    graph = model.graph
    values = constant_values(graph)
    count = readers(graph)
    producers = {out: node for node in graph.node for out in node.output}
    opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 17)
    gathers: dict[str, dict[int, onnx.NodeProto]] = {}
    for node in graph.node:
        index = values.get(node.input[1]) if node.op_type == "Gather" and len(node.input) == 2 else None
        if index is not None and index.ndim == 0 and attribute(node, "axis", 0) == 0:
            gathers.setdefault(node.input[0], {})[int(index)] = node
    replacements: dict[str, list[onnx.NodeProto]] = {}
    dropped: set[str] = set()
    for packed, by_index in gathers.items():
        if opset < 13 or sorted(by_index) != [0, 1, 2] or count.get(packed) != 3:  # Split's sizes as an input: 13
            continue
        squeeze = producers.get(packed)
        if squeeze is None or squeeze.op_type != "Squeeze" or _axes(squeeze, values) not in ([3], [-2]):
            continue
        transpose = _only_reader(count, producers, squeeze.input[0], "Transpose")
        if transpose is None or attribute(transpose, "perm") != [3, 1, 2, 0, 4]:
            continue
        unsqueeze = _only_reader(count, producers, transpose.input[0], "Unsqueeze")
        if unsqueeze is None or _axes(unsqueeze, values) != [0]:
            continue
        unflattened = unsqueeze.input[0]  # (length, batch, 3, E): the Transpose's 5 axes make it rank 4
        base = unsqueeze.name or unflattened
        nodes: list[onnx.NodeProto] = []
        pieces = [f"{base}/packed_split_{i}" for i in range(3)]
        sizes = _const(nodes, f"{base}/packed_split_sizes", np.array([1, 1, 1]))
        axes = _const(nodes, f"{base}/packed_split_axes", np.array([2]))
        nodes.append(helper.make_node("Split", [unflattened, sizes], pieces, name=f"{base}/packed_split", axis=2))
        nodes += [
            helper.make_node("Squeeze", [piece, axes], [by_index[i].output[0]], name=f"{base}/packed_squeeze_{i}")
            for i, piece in enumerate(pieces)
        ]
        replacements[by_index[0].output[0]] = nodes
        dropped |= {n.output[0] for n in (unsqueeze, transpose, squeeze, by_index[1], by_index[2])}
    if replacements:
        replace_nodes(graph, replacements, dropped)
        _remove_unused_constants(graph)  # the Gathers' indices
    return len(replacements)


def relu_to_mask_mul(model: onnx.ModelProto) -> int:
    """Rewrite `Relu(x)` as `x * Cast(x > 0)`.

    The same values for finite x (relu's -0.0 vs 0.0 aside) and the same gradient, dy * (x > 0), which ORT
    computes as a parallel Mul instead of its single-threaded CPU ReluGrad. Only float32 Relus are rewritten.
    """
    graph = model.graph
    if not any(node.op_type == "Relu" for node in graph.node):
        return 0  # (before the shape inference below)
    types = value_types(model)
    nodes: list[onnx.NodeProto] = []
    changed = 0
    for node in graph.node:
        type_ = types.get(node.input[0]) if node.op_type == "Relu" else None
        if type_ is None or type_.tensor_type.elem_type != TensorProto.FLOAT:
            nodes.append(node)
            continue
        base = node.name or node.output[0]
        zero = _const(nodes, f"{base}/zero", np.array(0.0, dtype=np.float32))
        nodes += [
            helper.make_node("Greater", [node.input[0], zero], [f"{base}/positive"], name=f"{base}/Greater"),
            helper.make_node("Cast", [f"{base}/positive"], [f"{base}/gate"], name=f"{base}/Cast", to=TensorProto.FLOAT),
            helper.make_node("Mul", [node.input[0], f"{base}/gate"], [node.output[0]], name=f"{base}/Mul"),
        ]
        changed += 1
    del graph.node[:]
    graph.node.extend(nodes)
    return changed


def small_embeddings_to_onehot_matmul(model: onnx.ModelProto, max_vocab: int) -> int:
    """Rewrite an embedding lookup `Gather(W, ids)` (W a 2-D float weight with at most `max_vocab` rows, ids not
    constant) as `MatMul(OneHot(ids, V), W)`.

    The same values (each output row is 1 * W[id] plus zeros) and the same gradient; ORT computes W's gradient as a
    Gemm of the one-hot rows with the output gradient instead of its contending CPU GatherGrad. The one-hot tensor
    has V values per id, hence the vocabulary limit. Ids outside [-V, V) would give a zero row instead of an error.
    """
    graph = model.graph
    weights = {i.name: i for i in graph.initializer}
    constants = constant_values(graph)
    nodes: list[onnx.NodeProto] = []
    changed = 0
    for node in graph.node:
        weight = weights.get(node.input[0]) if node.op_type == "Gather" else None
        axis = attribute(node, "axis", 0)
        if (
            weight is None
            or len(weight.dims) != 2
            or weight.data_type != TensorProto.FLOAT
            or weight.dims[0] > max_vocab
            or axis != 0
            or node.input[1] in constants
        ):
            nodes.append(node)
            continue
        base = node.name or node.output[0]
        depth = _const(nodes, f"{base}/depth", np.array([weight.dims[0]], dtype=np.int64))
        values = _const(nodes, f"{base}/onehot_values", np.array([0.0, 1.0], dtype=np.float32))
        onehot = f"{base}/onehot"
        nodes += [
            helper.make_node("OneHot", [node.input[1], depth, values], [onehot], name=f"{base}/OneHot", axis=-1),
            helper.make_node("MatMul", [onehot, node.input[0]], [node.output[0]], name=f"{base}/MatMul"),
        ]
        changed += 1
    del graph.node[:]
    graph.node.extend(nodes)
    return changed


def _shapes_by_running(model: onnx.ModelProto, names: list[str], feeds: dict[str, np.ndarray]) -> dict[str, tuple]:
    """The shapes of values `names` in one ORT run of `model` on `feeds` (where ONNX shape inference gives up,
    e.g. after nn.MultiheadAttention's computed Reshapes; the training graphs have static shapes)."""
    import onnxruntime

    if aten_nodes.count_all(model):  # torch's kernels in the graph: ORT runs them through torch's executor
        ort.load_aten_executor()
    probe = onnx.ModelProto()
    probe.CopyFrom(model)
    probe.graph.output.extend(helper.make_empty_tensor_value_info(name) for name in names)
    session = onnxruntime.InferenceSession(probe.SerializeToString(), providers=["CPUExecutionProvider"])
    values = session.run(names, feeds)
    return {name: tuple(np.shape(value)) for name, value in zip(names, values, strict=True)}


def dropout_to_mask_inputs(model: onnx.ModelProto, feeds: dict[str, np.ndarray] | None = None) -> list[DropoutMask]:
    """Rewrite every training-mode `Dropout(x, ratio)` as `x * mask`, `mask` a new graph input of x's (static)
    shape that the engine fills each step with 0 and 1/(1-ratio) (`draw_masks`).

    ORT's CPU Dropout draws its random numbers slowly, on one thread (as does RandomUniformLike: a random mask
    built inside the graph is no faster). The gradient becomes a Mul by the same mask. A Dropout is left as it is
    when its ratio or training mode is not a constant, its ratio is 0 (ORT copies its input then), its shape is not
    known (from shape inference or, given `feeds`, one run), or its own mask output is used by another node.
    """
    graph = model.graph
    constants = constant_values(graph)
    types = value_types(model)
    used = readers(graph)
    dropouts = [n.input[0] for n in graph.node if n.op_type == "Dropout"]
    shapes = {name: _static_shape(types.get(name)) for name in dropouts}
    if feeds is not None and (unknown := [name for name, shape in shapes.items() if shape is None]):
        shapes |= _shapes_by_running(model, unknown, feeds)
    nodes: list[onnx.NodeProto] = []
    masks: list[DropoutMask] = []
    for node in graph.node:
        if node.op_type != "Dropout":
            nodes.append(node)
            continue
        ratio = constants.get(node.input[1]) if len(node.input) > 1 and node.input[1] else np.array(0.5)
        training = constants.get(node.input[2]) if len(node.input) > 2 and node.input[2] else np.array(False)
        type_ = types.get(node.input[0])
        shape = shapes[node.input[0]]
        mask_used = len(node.output) > 1 and used.get(node.output[1], 0) > 0
        if ratio is None or float(ratio) == 0.0 or training is None or not bool(training) or shape is None or mask_used:
            nodes.append(node)
            continue
        name = f"dropout_mask_{len(masks)}"
        elem = type_.tensor_type.elem_type if type_ is not None else TensorProto.FLOAT
        graph.input.append(helper.make_tensor_value_info(name, elem, list(shape)))
        dtype = np.dtype(helper.tensor_dtype_to_np_dtype(elem))
        masks.append(DropoutMask(name, shape, float(ratio), dtype))
        nodes.append(helper.make_node("Mul", [node.input[0], name], [node.output[0]], name=f"{name}/Mul"))
    del graph.node[:]
    graph.node.extend(nodes)
    return masks


# ------------------------------------------------------------------------------------------------- declarations
def _attention_dropout(model: onnx.ModelProto, plan: graph_plan.GraphPlan, work: graph_plan.GraphWork) -> None:
    work.count("attention_dropout_in_training_mode", attention_dropout_in_training_mode(model))


def _instance_norms(model: onnx.ModelProto, plan: graph_plan.GraphPlan, work: graph_plan.GraphWork) -> None:
    work.count("instance_norm_decomposed", decompose_instance_norms(model))


def _dropout(model: onnx.ModelProto, plan: graph_plan.GraphPlan, work: graph_plan.GraphWork) -> None:
    """The fed path where the engine feeds graph inputs (ORTModule feeds its module's inputs: fed_dropout.py, before
    the export); ORT's own Dropout otherwise, each given the mask output its gradient reads."""
    if plan.path("dropout") is graph_plan.Path.fed and work.masks_as_inputs:
        work.masks = dropout_to_mask_inputs(model, work.feeds)
        work.count("dropout_to_mask_inputs", len(work.masks))
    work.count("dropout_mask_outputs", add_dropout_masks(model))


def _gathers(model: onnx.ModelProto, plan: graph_plan.GraphPlan, work: graph_plan.GraphWork) -> None:
    if plan.settings.rewrite_gathers:
        work.count("packed_projections_to_splits", packed_projections_to_splits(model))
        work.count("constant_gathers_to_slices", constant_gathers_to_slices(model))


def _relu(model: onnx.ModelProto, plan: graph_plan.GraphPlan, work: graph_plan.GraphWork) -> None:
    if plan.settings.rewrite_relu:
        work.count("relu_to_mask_mul", relu_to_mask_mul(model))


# rewrite_embedding_max_vocab=null: where it was measured faster (artifacts, docs/performance.md); off elsewhere
EMBEDDING_MAX_VOCAB = {"artifacts": 512}


def _embeddings(model: onnx.ModelProto, plan: graph_plan.GraphPlan, work: graph_plan.GraphWork) -> None:
    vocab = plan.settings.rewrite_embedding_max_vocab
    vocab = EMBEDDING_MAX_VOCAB.get(plan.engine, 0) if vocab is None else vocab
    if vocab:
        work.count("embedding_to_onehot_matmul", small_embeddings_to_onehot_matmul(model, vocab))


graph_plan.one_path(
    "attention_dropout_mode",
    graph_plan.Path.ort,
    replaces="scaled_dot_product_attention's Dropout exported without training_mode (run as the identity): made to "
    "train",
    module=__name__,
    rewrite=_attention_dropout,
)
graph_plan.one_path(
    "instance_norm",
    graph_plan.Path.ort,
    replaces="InstanceNormalization (nn.InstanceNorm*d, nn.GroupNorm), which ORT cannot differentiate: written out",
    module=__name__,
    rewrite=_instance_norms,
)
graph_plan.declare(
    graph_plan.GraphOp(
        "dropout",
        "Dropout (nn.Dropout, F.dropout, attention weights): masks fed each step, or ORT's own Dropout",
        __name__,
        (graph_plan.Path.fed, graph_plan.Path.ort),
        lambda settings, precision, engine: graph_plan.Path.fed if settings.rewrite_dropout else graph_plan.Path.ort,
        setting="rewrite_dropout",
        rewrite=_dropout,
    )
)
graph_plan.one_path(
    "gathers",
    graph_plan.Path.ort,
    replaces="MultiheadAttention's q/k/v split as one Split (its gradient one Concat); other constant-index Gathers as "
    "Slices: no GatherGrad",
    module=__name__,
    setting="rewrite_gathers",
    rewrite=_gathers,
)
graph_plan.one_path(
    "relu_mask",
    graph_plan.Path.ort,
    replaces="a Relu ORT runs (accel/graph/aten_relu.py) as x * (x > 0): a parallel Mul, not its single-threaded "
    "ReluGrad",
    module=__name__,
    setting="rewrite_relu",
    rewrite=_relu,
)
graph_plan.one_path(
    "embedding",
    graph_plan.Path.ort,
    replaces="a small embedding's Gather as OneHot @ W: a Gemm instead of ORT's contending GatherGrad",
    module=__name__,
    setting="rewrite_embedding_max_vocab",
    rewrite=_embeddings,
)
