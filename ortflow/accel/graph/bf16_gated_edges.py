"""bf16 handed through a gated MLP's SiLU-and-multiply (`trainer.precision=bf16-mixed`, `accel.bf16_edges`):
Llama's, Qwen2's and Mistral's `down_proj(silu(gate_proj(x)) * up_proj(x))`, as autocast runs it.

Why: between the bf16 GEMMs, ORT ran `g * sigmoid(g) * u` in fp32 (its CPU kernels have no bf16 arithmetic), so the
gate's and the up-projection's products came out of their GEMMs as fp32 and the down-projection rounded the result
back to bf16, and the gradients the same way round: the MLP's widest tensors (tokens x intermediate size) converted
six times a layer and step, and saved for the backward in fp32 (the gate's product, its sigmoid, the SiLU and the
up-projection's product). On the Qwen2-0.5B LoRA shape those conversions were 68% of all the step's conversion
time. Under CPU autocast linear returns bf16, and silu and the multiply keep bf16 bf16.

How (`gated_chains`, on the exported forward graph after the GEMMs are torch's): where `gemm_bf16 (gate) ->
Sigmoid, Mul -> Mul <- gemm_bf16 (up)` feeds a `gemm_bf16`'s first input and every value in it has that one reader
(Shape nodes aside), the gate and up GEMMs return their products in bf16 (`ortflow::gemm_bf16_out`), and one ATen
node computes `silu(g) * u` on them as autocast does (`ortflow::silu_mul`: silu rounded to bf16, then the product),
placed just before the down-projection, which is told its input arrives bf16 (its gradient node returns that input's
gradient in bf16). The gradient (`ortflow::silu_mul_backward`) is autograd's on bf16: `grad * silu(g)` for u and
`silu_backward(grad * u, g)` for g, from the two bf16 products it saves.
"""

import onnx
import torch

from ortflow.accel.graph import aten_gemm, aten_nodes, aten_shapes, bf16_gelu_edges, onnx_values

OPERATOR = "ortflow::silu_mul"
BACKWARD = "ortflow::silu_mul_backward"

_LIBRARY = torch.library.Library("ortflow", "FRAGMENT")
_LIBRARY.define("silu_mul(Tensor g, Tensor u) -> Tensor")
_LIBRARY.define("silu_mul_backward(Tensor grad_output, Tensor g, Tensor u) -> (Tensor, Tensor)")


def _silu_mul(g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.silu(g) * u


def _silu_mul_backward(grad_output: torch.Tensor, g: torch.Tensor, u: torch.Tensor):
    grad = grad_output.to(g.dtype)
    grad_u = grad * torch.nn.functional.silu(g)
    grad_g = torch.ops.aten.silu_backward(grad * u, g)
    return grad_g, grad_u


_LIBRARY.impl("silu_mul", _silu_mul, "CPU")
_LIBRARY.impl("silu_mul_backward", _silu_mul_backward, "CPU")


aten_nodes.declare(
    OPERATOR,
    BACKWARD,
    ["GO(0)", "I(0)", "I(1)"],
    gradients=2,
    differentiable=(0, 1),
    mask_input=None,
    fix_name="gated_mlps_run_by_torch_bf16",
    shape=aten_shapes.same_shape,
)


def _only(readers: dict[str, list], name: str) -> onnx.NodeProto | None:
    """The one reader of `name` besides Shape nodes (None: none, several, or a graph output)."""
    found = onnx_values.data_readers(readers, name)
    return found[0] if len(found) == 1 else None


def _gate(
    name: str, producers: dict[str, onnx.NodeProto], readers: dict[str, list]
) -> tuple[onnx.NodeProto, list[onnx.NodeProto]] | None:
    """Where `name` is `Mul(g, Sigmoid(g))` (either order) of a GEMM's product g that nothing else reads: the gate
    GEMM and the two nodes."""
    mul = producers.get(name)
    if mul is None or mul.op_type != "Mul" or len(mul.input) != 2:
        return None
    for g, s in (mul.input, mul.input[::-1]):
        sigmoid = producers.get(s)
        gate = producers.get(g)
        if sigmoid is None or sigmoid.op_type != "Sigmoid" or sigmoid.input[0] != g or not aten_gemm.is_gemm(gate):
            continue
        plain = onnx_values.data_readers(readers, g)
        if sorted(map(id, plain)) == sorted((id(sigmoid), id(mul))) and _only(readers, s) is mul:
            return gate, [sigmoid, mul]
    return None


def gated_chains(model: onnx.ModelProto) -> int:
    """Hand bf16 through each gated MLP's SiLU-and-multiply (module docstring). Returns how many now do."""
    graph = model.graph
    readers = onnx_values.reader_nodes(graph)
    producers = {name: node for node in graph.node for name in node.output}
    removed: set[int] = set()
    placed: dict[int, list[onnx.NodeProto]] = {}  # the down GEMM -> the silu_mul node placed just before it
    bf16: list[str] = []
    for down in list(graph.node):
        product = producers.get(down.input[0]) if aten_gemm.is_gemm(down) else None
        if product is None or product.op_type != "Mul" or _only(readers, product.output[0]) is not down:
            continue
        if down.input[0] in down.input[1:]:
            continue
        for silu, u in (product.input, product.input[::-1]):
            gate = _gate(silu, producers, readers)
            up = producers.get(u)
            if gate is None or not aten_gemm.is_gemm(up) or _only(readers, u) is not product or up is gate[0]:
                continue
            if _only(readers, silu) is not product:
                continue
            for gemm in (gate[0], up):
                aten_nodes.set_operator(gemm, bf16_gelu_edges.OPERATOR)  # the product in bf16
            g, edge = gate[0].output[0], product.output[0]  # the same value, now bf16 (Shape nodes may read it)
            placed[id(down)] = [aten_nodes.make_node(OPERATOR, [g, u], [edge], f"{product.name or edge}/silu_mul")]
            removed.update(id(n) for n in (*gate[1], product))
            bf16 += [g, u, edge]
            break
    if placed:
        onnx_values.place_before(graph, placed, removed)
        bf16_gelu_edges.type_bf16(graph, bf16)
        aten_nodes.import_domain(model)
    return len(placed)
