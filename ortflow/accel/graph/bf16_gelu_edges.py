"""bf16 handed through GELU from one torch-kernel GEMM to the next (`trainer.precision=bf16-mixed`,
`accel.bf16_edges`): GPT-2's MLP, `c_fc -> gelu_new -> c_proj`, as autocast runs it.

Why: the GELU between two bf16 GEMMs runs by torch (accel/graph/aten_gelu.py), but on fp32: the first GEMM returned
its bf16 product as fp32, and the second rounded the GELU's fp32 output back to bf16, and their gradients the same
way round. Four conversions of the MLP's widest tensor (tokens x 4 x width) a layer and step, which eager never
makes: under CPU autocast addmm returns bf16 and gelu keeps a bf16 input bf16. And the GELU's input was saved for
the backward in fp32, twice eager's bytes.

How (`gemm_gelu_chains`, after bf16_edges.py's ReLU chains): a `gemm_bf16 -> [Reshape] -> ATen gelu_tanh ->
[Reshape] -> gemm_bf16 (its first input)` chain, every value in it read once (Shape nodes aside: ORTModule's
exports read a view's sizes), becomes
- the first GEMM `ortflow::gemm_bf16_out`, the same product returned in bf16 (its gradient node is the GEMM's own,
  which takes a bf16 gradient as it is);
- the Reshapes (ORT's, which move bytes of any type) on the bf16 values, and after them the GELU node (torch's
  `gelu(approximate="tanh")` and `gelu_backward`, which keep bf16 bf16, as autograd does): element-wise, it may
  move, and the second GEMM then reads a tensor torch made (see `gemm_gelu_chains`). Shape nodes read the value of
  the same shape in the new order;
- the second GEMM told that its input arrives bf16 (aten_nodes.AtenOp.bf16_input), so its gradient node returns
  that input's gradient in bf16.
A chain with anything else between the GEMMs (a dropout mask, a second reader) is left as it is.
"""

from collections.abc import Iterable
from typing import Any

import onnx
import torch
from onnx import TensorProto, helper

from ortflow.accel.graph import aten_gelu, aten_gemm, aten_nodes, aten_shapes, onnx_values

OPERATOR = "ortflow::gemm_bf16_out"

_LIBRARY = torch.library.Library("ortflow", "FRAGMENT")
_LIBRARY.define(
    "gemm_bf16_out(Tensor a, Tensor b, Tensor? bias, bool transpose_b, bool[] output_mask) -> (Tensor, Tensor, Tensor)"
)
_LIBRARY.impl("gemm_bf16_out", aten_gemm.product_bf16, "CPU")


def shape(inference: Any, node: Any) -> None:
    """The product's shape in bf16; outputs 1 and 2 the bf16 copies of a and b."""
    product, a, b = aten_shapes._product_shape(inference, node)
    for index, dims in enumerate((product, a, b)):
        aten_shapes._set(inference, node, index, TensorProto.BFLOAT16, dims)


# Its gradient is the GEMM's own node (aten_gemm.py), on the same inputs.
aten_nodes.declare(
    OPERATOR,
    aten_gemm.BACKWARD,
    ["GO(0)", "O(1)", "O(2)", "I(2)", "I(3)", "I(4)"],
    differentiable=(0, 1, 2),
    mask_input=4,
    fix_name="matmuls_run_by_torch_bf16",
    frozen_input=1,
    bf16_input=0,
    shape=shape,
)


Chain = tuple[list[onnx.NodeProto], list[tuple[onnx.NodeProto, int]]]


def _chain(first: onnx.NodeProto, readers: dict[str, list]) -> Chain | None:
    """The nodes from the GEMM `first` to the next GEMM, both included, where they form `[Reshape] -> gelu_tanh ->
    [Reshape]` between them and each value is read by the next node's first input, and otherwise only by Shape nodes
    (ORTModule's exports read the sizes of a view's input); and those Shape nodes, each with how many of the chain's
    Reshapes its value is past. None otherwise."""
    chain: list[onnx.NodeProto] = [first]
    shapes: list[tuple[onnx.NodeProto, int]] = []
    value, gelu, reshaped = first.output[0], False, 0
    while True:
        found = readers.get(value, [])
        main = onnx_values.data_readers(readers, value)
        node = main[0] if len(main) == 1 else None
        if node is None or node.input[0] != value or value in node.input[1:]:
            return None
        shapes += [(n, reshaped) for n in found if n is not None and n.op_type == "Shape"]
        chain.append(node)
        if aten_gemm.is_gemm(node):
            return (chain, shapes) if gelu else None
        if aten_nodes.operator(node) == aten_gelu.OPERATOR and not gelu:
            gelu = True
        elif node.op_type == "Reshape":
            reshaped += 1
        else:
            return None
        value = node.output[0]


def type_bf16(graph: onnx.GraphProto, names: list[str], gone: Iterable[str] = ()) -> None:
    """Type the values `names` bf16 in the graph's value_info (any entry they had before replaced); the entries of
    the values `gone` (renamed) are dropped."""
    dropped = {*names, *gone}
    kept = [v for v in graph.value_info if v.name not in dropped]
    del graph.value_info[:]
    graph.value_info.extend(kept)
    for name in names:
        graph.value_info.append(helper.make_empty_tensor_value_info(name))
        graph.value_info[-1].type.tensor_type.elem_type = TensorProto.BFLOAT16


def gemm_gelu_chains(model: onnx.ModelProto) -> int:
    """Hand bf16 from GEMM through GELU to GEMM (module docstring). Returns how many chains now do."""
    graph = model.graph
    found_readers = onnx_values.reader_nodes(graph)
    renamed: dict[str, str] = {}
    moved: dict[int, onnx.NodeProto] = {}  # the second GEMM -> the GELU placed just before it
    for first in list(graph.node):
        if not aten_gemm.is_gemm(first):
            continue
        found = _chain(first, found_readers)
        if found is None:
            continue
        chain, shapes = found
        aten_nodes.set_operator(first, OPERATOR)
        between, second = chain[1:-1], chain[-1]
        gelu = next(n for n in between if aten_nodes.operator(n) == aten_gelu.OPERATOR)
        # The GELU (element-wise) moves after the Reshapes: the second GEMM then reads a tensor torch made. Its bf16
        # input returned as its saved copy must not be ORT's memory, which ORT reuses once its last reader ran.
        value, reshaped = first.output[0], []  # reshaped[r]: the value past r of the chain's Reshapes
        for node in [first, *(n for n in between if n is not gelu), gelu]:
            edge = f"{node.output[0]}/bf16"
            renamed[node.output[0]] = edge
            node.output[0] = edge
            if node is not first:
                node.input[0] = value
            value = edge
            reshaped.append(edge)
        second.input[0] = value
        for shape, past in shapes:  # the value of the same shape (the GELU keeps it)
            shape.input[0] = reshaped[past]
        moved[id(second)] = gelu
    if renamed:
        onnx_values.place_before(graph, {k: [gelu] for k, gelu in moved.items()}, {id(g) for g in moved.values()})
        type_bf16(graph, list(renamed.values()), renamed)
    return len(moved)
