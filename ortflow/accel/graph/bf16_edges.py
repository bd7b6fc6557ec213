"""bf16 handed from one torch-kernel GEMM to the next (`trainer.precision=bf16-mixed`, `accel.bf16_edges`).

Why: every bf16 GEMM node (accel/graph/aten_gemm.py) takes fp32, rounds it to bf16 inside, and returns fp32, so a
feed-forward block `linear1 -> ReLU -> dropout -> linear2` converts its widest tensor (tokens x dim_feedforward) four
times a step that torch's autocast never converts: linear1's product to fp32 and back to bf16 for linear2, and the
gradient the same way round. Under CPU autocast linear returns bf16, and relu and dropout keep a bf16 input bf16, so
eager hands bf16 along. ORT's CPU kernels have no bf16 arithmetic (Greater, Mul, Relu and their gradients fail on
bf16), so the ReLU and the dropout mask between the two GEMMs cannot stay ORT's and be bf16.

How: the rewrite finds `ATen gemm_bf16 -> ReLU (Relu, or the relu rewrite's x * (x > 0)) -> [x * m, m a graph
input: a fed dropout mask; or x * (Cast(keep) * scale), ORTModule's keep flags] -> ATen gemm_bf16 (its first
input)` where every intermediate has that one reader, and
makes the first GEMM one node running `ortflow::gemm_bf16_relu`: the product, ReLU and mask in torch, as autocast
rounds them (the product in bf16, the mask applied in float and rounded to bf16 once), returning bf16, which the
second GEMM takes as it is. Its gradient node (`ortflow::gemm_bf16_relu_backward`) takes the bf16 gradient the second
GEMM's gradient node now returns (a GEMM told by its mask that its input arrives bf16 returns that input's gradient
in bf16: `aten_nodes.AtenOp.bf16_input`) and applies mask and ReLU from the saved bf16 output (where the mask is not
zero, output > 0 exactly where the product was). Weights, biases and their gradients stay fp32 and ORT's optimizer's.
"""

import dataclasses
from typing import Any

import numpy as np
import onnx
import torch
from onnx import TensorProto, helper, numpy_helper

from ortflow.accel.graph import (
    aten_gemm,
    aten_nodes,
    aten_relu,
    aten_shapes,
    batchnorm,
    bf16_gated_edges,
    bf16_gelu_edges,
    bf16_maps,
    onnx_values,
)
from ortflow.accel.graph import plan as graph_plan
from ortflow.config import BF16

OPERATOR = "ortflow::gemm_bf16_relu"
BACKWARD = "ortflow::gemm_bf16_relu_backward"

_LIBRARY = torch.library.Library("ortflow", "FRAGMENT")
_LIBRARY.define(
    "gemm_bf16_relu(Tensor a, Tensor b, Tensor? bias, bool transpose_b, bool[] output_mask, Tensor mask, "
    "Tensor scale) -> (Tensor, Tensor, Tensor)"
)
_LIBRARY.define(
    "gemm_bf16_relu_backward(Tensor grad_output, Tensor out16, Tensor mask, Tensor scale, Tensor a16, Tensor b16, "
    "Tensor? bias, bool transpose_b, bool[] output_mask) -> (Tensor, Tensor, Tensor)"
)


def _masked(x: torch.Tensor, keep: torch.Tensor, scale: torch.Tensor, inplace: bool = False) -> torch.Tensor:
    """x (bf16) with dropout applied as autocast's dropout computes it on a bf16 tensor, `x * keep * scale` in bf16
    (the scale applied in fp32 and rounded once): no conversion of x. `keep`: uint8 flags (the artifacts engine
    feeds them, with the scale beside them: `masks.DropoutMask.scale_input`; all 1 and scale 1 in evaluation);
    empty: no dropout."""
    if keep.numel() == 0:
        return x
    return (x.mul_(keep) if inplace else x.mul(keep)).mul_(float(scale))


def _forward(a, b, bias, transpose_b: bool, output_mask, mask, scale):
    out, a16, b16 = aten_gemm.product_bf16(a, b, bias, transpose_b, output_mask)
    return _masked(torch.relu(out), mask, scale, inplace=True), a16, b16


def _backward(grad_output, out16, mask, scale, a16, b16, bias, transpose_b: bool, output_mask):
    grad = _masked(grad_output.to(torch.bfloat16), mask, scale)
    grad = torch.ops.aten.threshold_backward(grad, out16, 0)  # where the mask kept it, out16 > 0 iff the product was
    return aten_gemm.gemm_backward(grad, a16, b16, bias, transpose_b, output_mask)


_LIBRARY.impl("gemm_bf16_relu", _forward, "CPU")
_LIBRARY.impl("gemm_bf16_relu_backward", _backward, "CPU")


def shape(inference: Any, node: Any) -> None:
    """The product's shape in bf16; outputs 1 and 2 the bf16 copies of a and b."""
    product, a, b = aten_shapes._product_shape(inference, node)
    aten_shapes._set(inference, node, 0, TensorProto.BFLOAT16, product)
    aten_shapes._set(inference, node, 1, TensorProto.BFLOAT16, a)
    aten_shapes._set(inference, node, 2, TensorProto.BFLOAT16, b)


# The gradient node reads GO(0) (bf16), the forward's bf16 output, mask and scale, its bf16 copies of a and b, bias,
# transpose flag and gradient mask.
aten_nodes.declare(
    OPERATOR,
    BACKWARD,
    ["GO(0)", "O(0)", "I(5)", "I(6)", "O(1)", "O(2)", "I(2)", "I(3)", "I(4)"],
    differentiable=(0, 1, 2),
    mask_input=4,
    fix_name="matmuls_run_by_torch_bf16",
    frozen_input=1,
    bf16_input=0,
    shape=shape,
)


def _only(readers: dict[str, list], name: str) -> onnx.NodeProto | None:
    found = readers.get(name, [])
    return found[0] if len(found) == 1 else None


def _relu(z: str, readers: dict[str, list]) -> tuple[str, list[onnx.NodeProto]] | None:
    """The ReLU of z (its output and its nodes) when z has no other reader: Relu(z), or x * Cast(x > 0)."""
    found = readers.get(z, [])
    if (
        len(found) == 1
        and found[0] is not None
        and (found[0].op_type == "Relu" or aten_nodes.operator(found[0]) == aten_relu.OPERATOR)
    ):
        return found[0].output[0], [found[0]]
    if len(found) != 2 or None in found:
        return None
    greater = next((n for n in found if n.op_type == "Greater" and n.input[0] == z), None)
    mul = next((n for n in found if n.op_type == "Mul" and z in n.input), None)
    if greater is None or mul is None:
        return None
    cast = _only(readers, greater.output[0])
    if cast is None or cast.op_type != "Cast" or _only(readers, cast.output[0]) is not mul:
        return None
    if set(mul.input) != {z, cast.output[0]}:
        return None
    return mul.output[0], [greater, cast, mul]


def _zero(constants: dict[str, onnx.TensorProto], names: Any) -> bool:
    """Whether the one name given is a constant equal to 0."""
    tensor = constants.get(names[0]) if len(names) == 1 else None
    return tensor is not None and bool((numpy_helper.to_array(tensor) == 0).all())


def gemm_relu_chains(model: onnx.ModelProto, masks: list | None = None) -> int:
    """Fuse each `gemm_bf16 -> ReLU -> [x * graph input] -> gemm_bf16` chain (module docstring) so that bf16 flows
    from the first GEMM to the second. `masks`: the dropout masks the engine feeds as graph inputs
    (masks.DropoutMask, the artifacts engine's); a fused one is fed from then on as uint8 keep flags and a scale
    (its `scale_input`), replaced in the list. ORTModule's masks are its module's inputs: where its module feeds keep
    flags (fed_dropout.py), the graph multiplies by `Cast(keep) * scale`, and the fused node takes `keep` and the
    scale constant. A chain through any other mask stays as it is: an fp32 mask applied in torch (`mask != 0`, then
    the multiply) measured slower than ORT's fp32 edges at d_model 512 (1.10x against 1.15x eager bf16). Returns how
    many it fused."""
    graph = model.graph
    types = {v.name: v.type.tensor_type.elem_type for v in graph.input}
    readers = onnx_values.reader_nodes(graph)
    producers = {name: node for node in graph.node for name in node.output}
    constants = onnx_values.constants(graph)
    removed: set[int] = set()
    changed = 0
    before: dict[int, list[onnx.NodeProto]] = {}  # Constants to place before a fused node (empty mask, scale)
    fed = None if masks is None else {m.name: i for i, m in enumerate(masks)}
    for first in graph.node:
        if not aten_gemm.is_gemm(first) or id(first) in removed:
            continue
        chain = _chain(first, readers, producers, constants, types, fed)
        if chain is None:
            continue
        mask, scale, nodes, after = chain
        before[id(first)] = _fuse(graph, first, after, mask, scale, masks, fed)
        constant = producers.get(scale)
        if constant is not None and constant.op_type == "Constant":
            before[id(first)].append(constant)  # read by the fused node from now on: placed before it
            nodes.append(constant)
        removed.update(id(node) for node in nodes)
        changed += 1
    if changed:
        onnx_values.place_before(graph, before, removed)
    return changed


def _chain(
    first: onnx.NodeProto,
    readers: dict[str, list[onnx.NodeProto]],
    producers: dict[str, onnx.NodeProto],
    constants: dict[str, onnx.TensorProto],
    types: dict[str, int],
    fed: dict[str, int] | None,
) -> tuple[str, str, list[onnx.NodeProto], onnx.NodeProto] | None:
    """The chain from the GEMM `first` to the next GEMM: the mask it multiplies by ("" if none), the scale of keep
    flags already in the graph ("" if none), the nodes between (ReLU, a dropout at 0, the mask's nodes) and the
    second GEMM; None where `first` starts no chain to fuse."""
    relu = _relu(first.output[0], readers)
    if relu is None:
        return None
    out, nodes = relu
    mask, scale, after = "", "", _only(readers, out)
    if after is not None and after.op_type == "Dropout" and _zero(constants, after.input[1:2]):
        out, nodes = after.output[0], [*nodes, after]  # dropout at 0: the identity
        after = _only(readers, out)
    if after is not None and after.op_type == "Mul" and out in after.input:
        other = after.input[1] if after.input[0] == out else after.input[0]
        flags = _keep_flags(other, readers, producers, constants, types)
        if flags is not None:
            mask, scale, mask_nodes = flags
            nodes = [*nodes, *mask_nodes]
        elif fed is None or other not in fed or types.get(other) != TensorProto.FLOAT:
            return None  # only a mask the engine feeds as a graph input and can feed as keep flags
        else:
            mask = other
        out, nodes = after.output[0], [*nodes, after]
        after = _only(readers, out)
    if not aten_gemm.is_gemm(after) or after.input[0] != out or after.input[1] == out:
        return None
    return mask, scale, nodes, after


def _keep_flags(
    name: str,
    readers: dict[str, list[onnx.NodeProto]],
    producers: dict[str, onnx.NodeProto],
    constants: dict[str, onnx.TensorProto],
    types: dict[str, int],
) -> tuple[str, str, list[onnx.NodeProto]] | None:
    """Where `name` is `Cast(keep) * scale` (ORTModule's keep flags: fed_dropout.py), each read once, with `keep` a
    uint8 graph input and `scale` a constant scalar (an initializer, or a Constant only that Mul reads, which the
    fused node then reads instead): keep, scale and the two nodes."""
    mul = producers.get(name)
    if mul is None or mul.op_type != "Mul" or _only(readers, name) is None:
        return None
    for cast_out, scale in (mul.input, reversed(mul.input)):
        cast = producers.get(cast_out)
        if (
            cast is not None
            and cast.op_type == "Cast"
            and types.get(cast.input[0]) == TensorProto.UINT8
            and _only(readers, cast_out) is mul
            and _scalar(constants, scale)
            and (scale not in producers or _only(readers, scale) is mul)  # an initializer, or a movable Constant
        ):
            return cast.input[0], scale, [cast, mul]
    return None


def _scalar(constants: dict[str, onnx.TensorProto], name: str) -> bool:
    """Whether `name` is a constant float scalar."""
    tensor = constants.get(name)
    return tensor is not None and tensor.data_type == TensorProto.FLOAT and numpy_helper.to_array(tensor).size == 1


def _fuse(
    graph: onnx.GraphProto,
    first: onnx.NodeProto,
    after: onnx.NodeProto,
    mask: str,
    scale: str,
    masks: list | None,
    fed: dict[str, int] | None,
) -> list[onnx.NodeProto]:
    """Make `first` the fused node (ReLU and `mask` inside, its bf16 output read by the GEMM `after`; `scale`: the
    graph's scale of keep flags, if any); returns the Constants to place before it (an empty mask and scale where
    there are none)."""
    base = first.name or first.output[0]
    constants = []
    if not mask:
        mask, scale = f"{base}/no_mask", f"{base}/no_scale"
        constants += [_empty(scale), _empty(mask)]
    elif not scale:
        scale = _keep_and_scale(graph, masks, fed[mask])
    first.input.extend([mask, scale])
    aten_nodes.set_operator(first, OPERATOR)
    edge = f"{base}/bf16"
    first.output[0] = edge
    after.input[0] = edge
    graph.value_info.append(helper.make_empty_tensor_value_info(edge))
    graph.value_info[-1].type.tensor_type.elem_type = TensorProto.BFLOAT16
    return constants


def _empty(name: str) -> onnx.NodeProto:
    """A Constant holding an empty float tensor: no mask, or no scale beside the mask."""
    return helper.make_node("Constant", [], [name], value=helper.make_tensor(name, TensorProto.FLOAT, [0], []))


def _keep_and_scale(graph: onnx.GraphProto, masks: list, index: int) -> str:
    """Make fed mask `masks[index]` uint8 keep flags with a float scale beside it (both graph inputs); the scale's
    name."""
    mask = masks[index]
    scale = f"{mask.name}/scale"
    masks[index] = dataclasses.replace(mask, dtype=np.dtype(np.uint8), scale_input=scale)
    value = next(v for v in graph.input if v.name == mask.name)
    value.type.tensor_type.elem_type = TensorProto.UINT8
    graph.input.append(helper.make_tensor_value_info(scale, TensorProto.FLOAT, []))
    return scale


def _rewrite(model: onnx.ModelProto, plan: graph_plan.GraphPlan, work: graph_plan.GraphWork) -> None:
    if plan.by_torch(NAME):
        fed = work.masks if work.masks_as_inputs else None
        work.count("bf16_edges_between_gemms", gemm_relu_chains(model, fed))
        work.count("bf16_edges_through_gelus", bf16_gelu_edges.gemm_gelu_chains(model))
        work.count("bf16_edges_through_gated_mlps", bf16_gated_edges.gated_chains(model))
        by_host = plan.path(batchnorm.NAME) is graph_plan.Path.host
        work.count("bf16_maps_between_convolutions", bf16_maps.feature_maps(model, by_host))


NAME = "bf16_edges"
OP = graph_plan.torch_or_ort(
    NAME,
    replaces="fp32 edges between bf16 GEMMs (GEMM -> ReLU -> dropout -> GEMM, GEMM -> GELU -> GEMM, gated MLPs' "
    "SiLU-and-multiply) and between bf16 convolutions (BatchNorm, ReLU, residual adds, pooling) by bf16 ones, what "
    "lies between run by torch",
    module=__name__,
    setting="bf16_edges",
    by_torch=lambda settings, precision: graph_plan.switch(settings, "bf16_edges", precision) and precision == BF16,
    rewrite=_rewrite,
)
