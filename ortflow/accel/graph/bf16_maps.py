"""bf16 feature maps handed from one torch convolution to the next (`trainer.precision=bf16-mixed`,
`accel.bf16_edges`): a CNN's conv -> BatchNorm -> ReLU -> conv chains and residual adds in bf16, as autocast runs them.

Why: every bf16 convolution node (accel/graph/aten_conv.py) takes fp32, rounds it to bf16 inside and returns fp32,
and ORT's BatchNorm, ReLU and Add between two convolutions have no bf16 kernels. So each feature map was converted
five times a step (the convolution's output, its input twice, its output's gradient, its input's gradient) where
eager autocast converts none: under CPU autocast a convolution returns bf16, and batch_norm, relu, an add of two bf16
tensors and adaptive average pooling keep bf16 bf16. On the vision recipe that was 48 times eager's conversion volume.

How (the rewrite `feature_maps`, on the exported forward graph after the other rewrites; the operators are in
accel/graph/bf16_map_ops.py): every bf16 convolution
node returns its product in bf16 (`ortflow::convolution_bf16_maps`; its input may arrive fp32, the image, or bf16),
and the nodes that follow it while autocast keeps bf16 become torch-kernel nodes on bf16:
- BatchNormalization -> `ortflow::batch_norm_bf16`: torch's mixed-precision batch norm (bf16 input, fp32 weight,
  bias and statistics), which in training writes the batch mean and biased variance into the running-statistics
  tensors it is given, in place, as ORT's own kernel does under ortflow's momentum 0 (accel/graph/batchnorm.py keeps
  torch's update from them); its eval form (`ortflow::batch_norm_bf16_eval`) normalises with the running statistics;
- Relu -> `ortflow::relu` on bf16 (accel/graph/aten_relu.py);
- Add of two bf16 maps -> `ortflow::add_bf16` (broadcast as torch broadcasts), with the ReLU that reads it taken in (a
  ResNet block's end);
- GlobalAveragePool of a 4-D map -> `ortflow::global_average_pool_bf16`; the ATen nodes of torch's own pooling
  kernels (`ortflow::max_pool2d`: accel/graph/aten_max_pool.py; ORTModule's `_adaptive_avg_pool2d` and
  `max_pool2d_with_indices`) take bf16 as they are.
A bf16 map read by two nodes that need its gradient is first split by `ortflow::fork_bf16`, whose gradient node adds
the two gradients in bf16 (ORT would add them with a Sum that has no bf16 kernel); every other reader gets the map
in fp32 from `ortflow::float_of_bf16`, where autocast converts too. Weights, biases, statistics and their gradients
stay fp32.

Every reader of a map is a torch-kernel node (ORT's Shape aside): the forks and the convolutions' saved inputs are
the map itself, not copies, and where an ORT Cast read a fork's output instead, the convolutions reading the same map
got weight gradients ~100% off in the artifacts engine (ORT evidently wrote into the memory the aliases share); with
the conversion in torch they are eager's (tests/accel/graph/test_bf16_maps.py).
"""

from dataclasses import dataclass
from typing import Any

import onnx
from onnx import TensorProto, helper

from ortflow.accel.graph import aten_conv, aten_max_pool, aten_nodes, aten_relu, onnx_values
from ortflow.accel.graph.bf16_map_ops import (
    ADD,
    BATCH_NORM,
    BATCH_NORM_EVAL,
    CONVOLUTION,
    FORK,
    POOL,
    TO_FLOAT,
)


@dataclass
class _Rewrite:
    """What becomes of one node: `kind` (its new form), and for an Add the ReLU it takes in."""

    kind: str
    relu: onnx.NodeProto | None = None


def _is_relu(node: onnx.NodeProto | None) -> bool:
    return node is not None and (node.op_type == "Relu" or aten_nodes.operator(node) == aten_relu.OPERATOR)


def _accepts(node: onnx.NodeProto, index: int, plan: dict[int, _Rewrite]) -> bool:
    """Whether `node`, as rewritten, takes a bf16 map at input `index` (every rewritten node takes one at its first
    input, an Add at both)."""
    found = plan.get(id(node))
    return found is not None and (index == 0 or (found.kind == "add" and index == 1))


def feature_maps(model: onnx.ModelProto, statistics_by_host: bool) -> int:
    """Hand bf16 feature maps from torch convolution to torch convolution (module docstring). `statistics_by_host`:
    BatchNorm's running statistics are kept by the host from the batch statistics the graph writes in place (the
    plan's host path); otherwise its BatchNorms stay ORT's, in fp32. Returns how many nodes now run on bf16 maps."""
    graph = model.graph
    if not any(aten_nodes.operator(node) == aten_conv.OPERATOR_BF16 for node in graph.node):
        return 0
    types = onnx_values.value_types(model)
    constants = onnx_values.constant_values(graph)
    produced = {name for node in graph.node for name in node.output if name}
    readers: dict[str, list[tuple[onnx.NodeProto, int]]] = {}
    for node in graph.node:
        for index, name in enumerate(node.input):
            readers.setdefault(name, []).append((node, index))
    outputs = {value.name for value in graph.output}
    plan: dict[int, _Rewrite] = {}
    maps: set[str] = set()  # values that become bf16
    for node in graph.node:
        found = _decide(node, maps, types, constants, produced, readers, outputs, statistics_by_host)
        if found is None:
            continue
        plan[id(node)] = found
        maps.add((found.relu or node).output[0])
    if not maps:
        return 0
    _write(model, plan, maps, readers, outputs, types)
    aten_nodes.import_domain(model)
    return len(plan) + sum(1 for node in graph.node if aten_nodes.operator(node) == FORK)


def _decide(
    node: onnx.NodeProto,
    maps: set[str],
    types: dict[str, onnx.TypeProto],
    constants: dict[str, Any],
    produced: set[str],
    readers: dict[str, list[tuple[onnx.NodeProto, int]]],
    outputs: set[str],
    statistics_by_host: bool,
) -> _Rewrite | None:
    operator = aten_nodes.operator(node)
    if operator == aten_conv.OPERATOR_BF16:
        return _Rewrite("convolution")
    if not node.input or node.input[0] not in maps:
        return None
    if node.op_type == "BatchNormalization":
        training = onnx_values.attribute(node, "training_mode", 0) == 1
        statistics = node.input[3:5]
        if (
            len(statistics) == 2
            and not any(name in produced for name in statistics)  # the module's buffers, not computed ones
            and not any(readers.get(name) for name in node.output[1:] if name)
            and (statistics_by_host or not training)
        ):
            return _Rewrite("batch_norm" if training else "batch_norm_eval")
        return None
    if _is_relu(node):
        return _Rewrite("relu")
    if node.op_type == "Add" and len(node.input) == 2 and node.input[1] in maps:  # bf16 + bf16: bf16
        after = readers.get(node.output[0], [])
        if len(after) == 1 and _is_relu(after[0][0]) and node.output[0] not in outputs:
            return _Rewrite("add", relu=after[0][0])
        return _Rewrite("add")
    if node.op_type == "GlobalAveragePool" and (shape := _dims(types.get(node.input[0]))) and len(shape) == 4:
        return _Rewrite("pool")
    if operator in _TORCH_POOLS:  # torch's pooling kernels in ATen nodes (ortflow's, ORTModule's), in any dtype
        known = _dims(types.get(node.output[0]))
        if (known is None or any(isinstance(d, str) for d in known)) and (
            shape := _torch_pool_shape(node, types, constants)
        ) is not None:
            types[node.output[0]] = helper.make_tensor_type_proto(TensorProto.BFLOAT16, shape)
        return _Rewrite("torch_pool")
    return None


def _torch_pool_shape(
    node: onnx.NodeProto, types: dict[str, onnx.TypeProto], constants: dict[str, Any]
) -> list[int] | None:
    """The output shape of a torch pooling node (`_TORCH_POOLS`) where its input's shape and its settings are known
    (the exporter gives an ATen node's output symbolic dims)."""
    shape = _dims(types.get(node.input[0]))
    if shape is None or len(shape) != 4 or any(isinstance(d, str) for d in shape):
        return None
    values = [constants.get(name) for name in node.input[1:]]
    if any(v is None for v in values):
        return None
    if aten_nodes.operator(node) == "_adaptive_avg_pool2d":
        return [*shape[:2], *(int(v) for v in values[0].reshape(-1))]
    kernel, stride, padding, dilation, ceil = (v.reshape(-1).tolist() for v in values)
    return [*shape[:2], *aten_max_pool.output_shape(shape[2:], kernel, stride or kernel, padding, dilation, ceil[0])]


_TORCH_POOLS = ("_adaptive_avg_pool2d", "max_pool2d_with_indices", aten_max_pool.OPERATOR)


def _dims(type_: onnx.TypeProto | None) -> list[Any] | None:
    if type_ is None or not type_.tensor_type.HasField("shape"):
        return None
    dims = [d.dim_value if d.HasField("dim_value") else d.dim_param for d in type_.tensor_type.shape.dim]
    return dims if all(d not in (0, "") for d in dims) else None


def _write(
    model: onnx.ModelProto,
    plan: dict[int, _Rewrite],
    maps: set[str],
    readers: dict[str, list[tuple[onnx.NodeProto, int]]],
    outputs: set[str],
    types: dict[str, onnx.TypeProto],
) -> None:
    """Rewrite the planned nodes; each bf16 map `v` becomes `v/bf16`, split by forks among the readers that need its
    gradient in bf16, and given back in fp32 under its own name (`float_of_bf16`) where anything else reads it."""
    graph = model.graph
    fused = {id(found.relu) for found in plan.values() if found.relu is not None}
    routed: dict[tuple[int, int], str] = {}  # (reader, input index) -> the name it reads instead
    nodes: list[onnx.NodeProto] = []
    typed: list[onnx.ValueInfoProto] = []
    for node in graph.node:
        if id(node) in fused:
            continue
        for index in range(len(node.input)):
            if (id(node), index) in routed:
                node.input[index] = routed[(id(node), index)]
        found = plan.get(id(node))
        if found is None:
            nodes.append(node)
            continue
        value = (found.relu or node).output[0]  # an Add's: the output of the ReLU it took in
        edge = f"{value}/bf16"
        nodes += _rewritten(node, found, edge)
        typed.append(_typed(edge, types.get(value)))
        if found.kind == "convolution":
            typed += [_typed(f"{edge}/{s}", types.get(node.input[i])) for i, s in ((0, "input"), (1, "weight"))]
        if found.kind == "add":  # the inputs' shapes (their ranks may differ: broadcast)
            typed += [_typed(f"{edge}/shape_{k}", None, TensorProto.INT64) for k in "ab"]
        if found.kind.startswith("batch_norm"):  # the saved statistics: (C,) in training, empty in evaluation
            typed += [_typed(f"{edge}/{s}", None, TensorProto.FLOAT) for s in ("mean", "invstd")]
        gradients, others = [], value in outputs
        for reader, index in readers.get(value, []):
            if reader.op_type == "Shape":
                routed[(id(reader), index)] = edge
            elif _accepts(reader, index, plan):
                gradients.append((reader, index))
            else:
                others = True
        sources = _forks(edge, len(gradients) + others, nodes, typed, types.get(value))
        routed.update(zip(((id(r), i) for r, i in gradients), sources, strict=False))
        if others:  # fp32 for every other reader, under the map's own name
            nodes.append(aten_nodes.make_node(TO_FLOAT, [sources[-1]], [value], f"{value}/fp32"))
            typed.append(_typed(value, types.get(value), TensorProto.FLOAT))
    value_info = [v for v in graph.value_info if v.name not in maps]
    del graph.value_info[:]
    graph.value_info.extend([*value_info, *typed])
    del graph.node[:]
    graph.node.extend(nodes)


def _forks(
    edge: str, count: int, nodes: list[onnx.NodeProto], typed: list[onnx.ValueInfoProto], like: onnx.TypeProto | None
) -> list[str]:
    """`count` names carrying the map `edge` to readers that each need its gradient: `edge` itself for one, else the
    outputs of a chain of forks (appended to `nodes`)."""
    names, source = [], edge
    for k in range(count - 1):
        pair = [f"{edge}/fork{k}/0", f"{edge}/fork{k}/1"]
        nodes.append(aten_nodes.make_node(FORK, [source], pair, f"{edge}/fork{k}"))
        typed += [_typed(name, like) for name in pair]
        names.append(pair[0])
        source = pair[1]
    return [*names, source]


def _typed(name: str, like: onnx.TypeProto | None, elem: int = TensorProto.BFLOAT16) -> onnx.ValueInfoProto:
    """A value_info for `name`: `like`'s shape (if known) with element type `elem`."""
    value = helper.make_empty_tensor_value_info(name)
    if like is not None and like.HasField("tensor_type"):
        value.type.CopyFrom(like)
    value.type.tensor_type.elem_type = elem
    return value


def _rewritten(node: onnx.NodeProto, found: _Rewrite, edge: str) -> list[onnx.NodeProto]:
    """The planned node in its bf16 form, writing `edge`, after the Constants it reads."""
    name = node.name or node.output[0]
    if found.kind in ("convolution", "torch_pool", "relu") and node.op_type == "ATen":
        node.output[0] = edge
        if found.kind == "convolution":
            aten_nodes.set_operator(node, CONVOLUTION)
            node.output.extend([f"{edge}/input", f"{edge}/weight"])
        return [node]
    if found.kind == "relu":
        return [aten_nodes.make_node(aten_relu.OPERATOR, [node.input[0]], [edge], f"{name}/bf16")]
    if found.kind == "pool":
        return [aten_nodes.make_node(POOL, [node.input[0]], [edge], f"{name}/bf16")]
    base = f"{name}/bf16"
    if found.kind == "add":
        relu, mask = _constant(f"{base}/relu", found.relu is not None), _constant(f"{base}/mask", [True, True])
        shapes = [f"{edge}/shape_a", f"{edge}/shape_b"]
        return [
            relu,
            mask,
            aten_nodes.make_node(ADD, [*node.input, relu.output[0], mask.output[0]], [edge, *shapes], base),
        ]
    eps = _constant(f"{base}/eps", float(onnx_values.attribute(node, "epsilon", 1e-5)))
    mask = _constant(f"{base}/mask", [True, True, True])
    operator = BATCH_NORM if found.kind == "batch_norm" else BATCH_NORM_EVAL
    inputs = [*node.input[:5], eps.output[0], mask.output[0]]
    return [eps, mask, aten_nodes.make_node(operator, inputs, [edge, f"{edge}/mean", f"{edge}/invstd"], base)]


def _constant(name: str, value: Any) -> onnx.NodeProto:
    """A Constant node: a float, a bool, or a list of bools (a gradient mask, set after the rewrites)."""
    if isinstance(value, list):
        tensor = helper.make_tensor(name, TensorProto.BOOL, [len(value)], value)
    elif isinstance(value, bool):
        tensor = helper.make_tensor(name, TensorProto.BOOL, [], [value])
    else:
        tensor = helper.make_tensor(name, TensorProto.FLOAT, [], [value])
    return helper.make_node("Constant", [], [name], value=tensor)


def eval_batch_norms(model: onnx.ModelProto) -> int:
    """In an eval graph made from a training graph (the artifacts engine's): each bf16 BatchNorm in its eval form
    (the running statistics, not written). Returns how many it changed."""
    changed = 0
    for node in model.graph.node:
        if aten_nodes.operator(node) == BATCH_NORM:
            aten_nodes.set_operator(node, BATCH_NORM_EVAL)
            changed += 1
    return changed
