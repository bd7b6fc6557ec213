"""Cross-entropy run by torch's kernels inside ONNX Runtime's graphs (`accel.aten_cross_entropy`).

Why: ORT's CPU SoftmaxCrossEntropyLoss is a slow kernel at a language model's vocabulary: on GPT-2's (1024 x 50,257)
logits, 237 ms a step forward and 53 ms for its gradient (`ortflow-bench --profile`, 2-core Zen 5), against about
45 + 50 ms for torch's log_softmax and its backward; in bf16-mixed LoRA fine-tuning that was a quarter of the ORT
engines' step. It also keeps the whole (N, C) log-probabilities for its gradient (206 MB there), where torch's
gradient needs only the logits the graph holds anyway. Its declaration (at the end): the plan's `cross_entropy` op,
`accel.aten_cross_entropy`.

How: `softmax_cross_entropies_to_aten` replaces each exported `SoftmaxCrossEntropyLoss` (the export of
`F.cross_entropy`; no class weights, reduction mean or sum) with one ATen node running `ortflow::cross_entropy`
(torch's `F.cross_entropy`); its gradient is one ATen node running `ortflow::cross_entropy_backward`: the softmax of
the logits, minus one at each target, scaled by the loss's gradient over the counted targets, in two passes over the
logits. The artifacts engine then exports the loss with the model instead of appending ORT's loss block. With
`accel.aten_cross_entropy=false` the loss stays ORT's own (the ORT-native path).
"""

import numpy as np
import onnx
import torch
from onnx import helper, numpy_helper

from ortflow.accel.graph import aten_gemm, aten_nodes, aten_shapes, onnx_values
from ortflow.accel.graph import plan as graph_plan
from ortflow.config import BF16

OPERATOR = "ortflow::cross_entropy"
BACKWARD = "ortflow::cross_entropy_backward"
FUSED = "ortflow::linear_cross_entropy_bf16"
FUSED_BACKWARD = "ortflow::linear_cross_entropy_bf16_backward"
RETURN_LOGITS = "return_logits"  # the name of the fused node's flag input's Constant, after the loss's
# Rows of logits per pass of the fused loss: their fp32 copy (32 x 50,257 x 4 bytes = 6.4 MB) stays in the cache
ROWS_PER_PASS = 32
# SoftmaxCrossEntropyLoss's reduction attribute, as the int the operators take
REDUCTIONS = {"mean": 1, "sum": 2}
# No ignore_index attribute: every target counts (no class id is this negative)
NO_IGNORED = -(2**62)

_LIBRARY = torch.library.Library("ortflow", "FRAGMENT")
_LIBRARY.define("cross_entropy(Tensor logits, Tensor target, int ignore_index, int reduction) -> Tensor")
_LIBRARY.define(
    "cross_entropy_backward(Tensor grad_loss, Tensor logits, Tensor target, int ignore_index, int reduction) -> Tensor"
)


def _reduction(code: int) -> str:
    return next(name for name, value in REDUCTIONS.items() if value == code)


def _cross_entropy(logits: torch.Tensor, target: torch.Tensor, ignore_index: int, reduction: int) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(logits, target, ignore_index=ignore_index, reduction=_reduction(reduction))


def _cross_entropy_backward(
    grad_loss: torch.Tensor, logits: torch.Tensor, target: torch.Tensor, ignore_index: int, reduction: int
) -> torch.Tensor:
    """d loss / d logits for logits (N, C, d1, ...) and targets (N, d1, ...): (softmax - one-hot) times the loss's
    gradient, divided by the number of counted targets for a mean; ignored targets' rows are zero."""
    keep = target != ignore_index
    grad = torch.softmax(logits, dim=1)
    ones = keep.unsqueeze(1).to(grad.dtype)
    grad.scatter_add_(1, target.masked_fill(~keep, 0).unsqueeze(1), ones.neg())
    scale = grad_loss.to(grad.dtype)
    if _reduction(reduction) == "mean":
        scale = scale / keep.sum()
    return grad.mul_(ones * scale)


_LIBRARY.impl("cross_entropy", _cross_entropy, "CPU")
_LIBRARY.impl("cross_entropy_backward", _cross_entropy_backward, "CPU")

_FUSED_ARGS = (
    "Tensor a, Tensor b, Tensor? bias, bool transpose_b, bool[] output_mask, int[] shape, Tensor target, "
    "int ignore_index, int reduction, bool return_logits"
)
_LIBRARY.define(f"linear_cross_entropy_bf16({_FUSED_ARGS}) -> (Tensor, Tensor, Tensor, Tensor, Tensor)")
_LIBRARY.define(
    "linear_cross_entropy_bf16_backward(Tensor grad_loss, Tensor grad_logits, Tensor a16, Tensor b16, Tensor? bias, "
    "bool transpose_b, bool[] output_mask) -> (Tensor, Tensor, Tensor)"
)


def _loss_and_gradient(scores: torch.Tensor, target: torch.Tensor, ignore_index: int, reduction: int) -> torch.Tensor:
    """Cross-entropy of bf16 logits (N, C) in fp32, ROWS_PER_PASS rows at a time; each pass overwrites its rows of
    `scores` with d loss / d logits (softmax - one-hot, times 1 / counted targets for a mean) in bf16. Returns the
    loss. Per row as autocast's eager loss computes it: the bf16 logits in fp32, log-sum-exp minus the target's."""
    keep = target != ignore_index
    scale = 1.0 / keep.sum() if _reduction(reduction) == "mean" else torch.ones((), dtype=torch.float32)
    safe = target.masked_fill(~keep, 0).unsqueeze(1)
    total = torch.zeros((), dtype=torch.float32)
    for start in range(0, scores.size(0), ROWS_PER_PASS):
        rows = slice(start, start + ROWS_PER_PASS)
        x, kept, picked = scores[rows].float(), keep[rows].unsqueeze(1).float(), safe[rows]
        lse = torch.logsumexp(x, 1, keepdim=True)
        total += ((lse - x.gather(1, picked)) * kept).sum()
        x.sub_(lse).exp_().scatter_add_(1, picked, kept.neg())
        scores[rows] = x.mul_(kept * scale)
    return total * scale


def _linear_cross_entropy(
    a, b, bias, transpose_b: bool, output_mask, shape, target, ignore_index, reduction, return_logits: bool
):
    """The LM head's bf16 GEMM and the loss on its logits, reshaped to `shape` (ONNX Reshape: 0 copies the
    dimension): the loss, d loss / d logits in bf16 (the logits' shape; saved for the gradient node, in the logits'
    own buffer), the GEMM's bf16 copies of a and b, and the logits in fp32 if `return_logits` (else an empty
    tensor: a training graph that returns no logits)."""
    logits, a16, b16 = aten_gemm.product_bf16(a, b, bias, transpose_b, output_mask)
    returned = logits.float() if return_logits else logits.new_empty(0, dtype=torch.float32)
    scores = logits.reshape([logits.size(i) if size == 0 else size for i, size in enumerate(shape)])
    if scores.dim() == 2:
        loss = _loss_and_gradient(scores, target.reshape(-1), ignore_index, reduction)
        return loss, scores.reshape(logits.shape), a16, b16, returned  # the gradient, wherever reshape put it
    # classes at dimension 1 of (N, C, d1, ...): rows of C for the loss, the gradient moved back
    flat = scores.movedim(1, -1).reshape(-1, scores.size(1)) if scores.dim() > 2 else scores.reshape(1, -1)
    loss = _loss_and_gradient(flat, target.reshape(-1), ignore_index, reduction)
    grad = flat.reshape(scores.movedim(1, -1).shape).movedim(-1, 1) if scores.dim() > 2 else flat
    return loss, grad.reshape(logits.shape).contiguous(), a16, b16, returned


def _linear_cross_entropy_backward(grad_loss, grad_logits, a16, b16, bias, transpose_b: bool, output_mask):
    """The GEMM's gradients (`output_mask`) from the saved d loss / d logits times the loss's gradient."""
    scale = float(grad_loss)
    grad = grad_logits if scale == 1.0 else grad_logits * scale
    return aten_gemm.gemm_backward(grad, a16, b16, bias, transpose_b, output_mask)


_LIBRARY.impl("linear_cross_entropy_bf16", _linear_cross_entropy, "CPU")
_LIBRARY.impl("linear_cross_entropy_bf16_backward", _linear_cross_entropy_backward, "CPU")


aten_nodes.declare(
    OPERATOR,
    BACKWARD,
    ["GO(0)", "I(0)", "I(1)", "I(2)", "I(3)"],
    gradients=1,
    differentiable=(0,),
    mask_input=None,
    fix_name="cross_entropies_run_by_torch",
    shape=aten_shapes.scalar_shape,
)
aten_nodes.declare(
    FUSED,
    FUSED_BACKWARD,
    ["GO(0)", "O(1)", "O(2)", "O(3)", "I(2)", "I(3)", "I(4)"],
    differentiable=(0, 1, 2),  # the GEMM's a, b and bias, at the GEMM node's input positions
    mask_input=4,
    fix_name="lm_head_losses_fused_bf16",
    frozen_input=1,
    shape=aten_shapes.linear_loss_shape,
)


def _plain(node: onnx.NodeProto) -> bool:
    """ONNX's SoftmaxCrossEntropyLoss(scores, labels), or ORTModule's export of F.cross_entropy,
    com.microsoft's SoftmaxCrossEntropyLossInternal(scores, labels, weight, ignore_index), without class weights and
    with a float loss."""
    if node.op_type == "SoftmaxCrossEntropyLoss" and node.domain in ("", "ai.onnx"):
        return len(node.input) == 2
    if node.op_type == "SoftmaxCrossEntropyLossInternal" and node.domain == "com.microsoft":
        weighted = len(node.input) > 2 and node.input[2] != ""
        return (
            not weighted
            and onnx_values.attribute(node, "output_type", onnx.TensorProto.FLOAT) == onnx.TensorProto.FLOAT
        )
    return False


def softmax_cross_entropies_to_aten(model: onnx.ModelProto) -> int:
    """Replace each plain softmax cross-entropy (`_plain`; reduction mean or sum; its log-probabilities output, if
    any, unread) by one ATen node running `ortflow::cross_entropy`, keeping its output name. Returns how many it
    replaced; any other stays ORT's."""
    graph = model.graph
    reads = onnx_values.readers(graph)
    kept, replaced = [], 0
    for node in graph.node:
        reduction = onnx_values.attribute(node, "reduction", b"mean")
        reduction = reduction.decode() if isinstance(reduction, bytes) else reduction
        unread = len(node.output) < 2 or not node.output[1] or reads.get(node.output[1], 0) == 0
        if not (_plain(node) and unread and reduction in REDUCTIONS):
            kept.append(node)
            continue
        base = node.name or node.output[0]
        ignore_index = node.input[3] if len(node.input) > 3 and node.input[3] else None  # the Internal op's input
        constants = {"reduction": torch.tensor(REDUCTIONS[reduction], dtype=torch.int64)}
        if ignore_index is None:
            constants["ignore_index"] = torch.tensor(
                onnx_values.attribute(node, "ignore_index", NO_IGNORED), dtype=torch.int64
            )
        for key, value in constants.items():
            kept.append(
                helper.make_node("Constant", [], [f"{base}/{key}"], value=numpy_helper.from_array(value.numpy()))
            )
        inputs = [node.input[0], node.input[1], ignore_index or f"{base}/ignore_index", f"{base}/reduction"]
        kept.append(aten_nodes.make_node(OPERATOR, inputs, [node.output[0]], f"{base}/cross_entropy"))
        replaced += 1
    if not replaced:
        return 0
    del graph.node[:]
    graph.node.extend(kept)
    aten_nodes.import_domain(model)
    # ORT cannot infer an ATen node's output type: the loss is a float scalar, as SoftmaxCrossEntropyLoss's was
    typed = onnx_values.typed_names(graph)
    for node in graph.node:
        if aten_nodes.operator(node) == OPERATOR and node.output[0] not in typed:
            graph.value_info.append(helper.make_tensor_value_info(node.output[0], onnx.TensorProto.FLOAT, []))
    return replaced


def fuse_lm_head_losses(model: onnx.ModelProto) -> int:
    """In a bf16 graph, replace each `ortflow::cross_entropy` on a Reshape of a bf16 GEMM's output, where nothing
    else reads the logits (a graph output may: the artifacts engine's eval graph returns them), by one ATen node
    running `ortflow::linear_cross_entropy_bf16`: the logits stay bf16 (no fp32 copy of the (tokens x vocabulary)
    logits, no cast of their gradient back to bf16) and the loss is computed as autocast's eager loss computes it,
    with its gradient, in one pass. Returns how many it fused; `stop_returning_logits` turns the logits output
    off in a training graph that need not return them."""
    graph = model.graph
    producer = {out: node for node in graph.node for out in node.output if out}
    reads = onnx_values.readers(graph)
    outputs = {o.name for o in graph.output}

    fused: dict[str, list[onnx.NodeProto]] = {}  # the loss's output -> the fused node and its constant
    dropped: set[str] = set()  # the first outputs of the nodes the fused ones replace
    for loss in (n for n in graph.node if aten_nodes.operator(n) == OPERATOR):
        reshape = producer.get(loss.input[0])
        if reshape is None or reshape.op_type != "Reshape" or onnx_values.attribute(reshape, "allowzero", 0):
            continue
        gemm = producer.get(reshape.input[0])
        if not aten_gemm.is_gemm(gemm) or gemm.output[0] != reshape.input[0]:
            continue
        logits = gemm.output[0]
        if reads.get(logits, 0) != 1 + (logits in outputs) or reads.get(loss.input[0], 0) != 1:
            continue
        base = loss.name or loss.output[0]
        flag = helper.make_node(
            "Constant", [], [f"{base}/{RETURN_LOGITS}"], value=numpy_helper.from_array(np.array(logits in outputs))
        )
        fused[loss.output[0]] = [
            flag,
            aten_nodes.make_node(
                FUSED,
                [*gemm.input[:5], reshape.input[1], *loss.input[1:4], flag.output[0]],
                [loss.output[0], f"{base}/logits_gradient", gemm.output[1], gemm.output[2], logits],
                f"{gemm.name or logits}/linear_cross_entropy_bf16",
            ),
        ]
        dropped.update((logits, reshape.output[0]))
    if not fused:
        return 0
    onnx_values.replace_nodes(graph, fused, dropped)
    for _, node in fused.values():  # the saved gradient is a bf16 tensor (ORT cannot infer an ATen node's types)
        graph.value_info.append(helper.make_empty_tensor_value_info(node.output[1]))
        graph.value_info[-1].type.tensor_type.elem_type = onnx.TensorProto.BFLOAT16
    return len(fused)


def losses_to_aten(model: onnx.ModelProto, bf16: bool) -> None:
    """What `accel.aten_cross_entropy` does to an exported graph, in both engines: each plain softmax cross-entropy
    by torch, and in bf16 the LM head's GEMM and loss in one node where they can be."""
    softmax_cross_entropies_to_aten(model)
    if bf16:
        fuse_lm_head_losses(model)


def stop_returning_logits(model: onnx.ModelProto) -> int:
    """In a training graph whose caller no longer returns the logits (the artifacts engine's: its eval graph, built
    from the same forward graph, still does), the fused nodes compute no fp32 logits. Returns how many there are."""
    flags = [n for n in model.graph.node if n.op_type == "Constant" and n.output[0].endswith(f"/{RETURN_LOGITS}")]
    for flag in flags:
        flag.attribute[0].t.CopyFrom(numpy_helper.from_array(np.array(False)))
    return len(flags)


def _rewrite(model: onnx.ModelProto, plan: graph_plan.GraphPlan, work: graph_plan.GraphWork) -> None:
    if plan.by_torch(NAME):  # its nodes are counted with the other ATen nodes (aten_nodes.graph_fixes)
        losses_to_aten(model, plan.precision == BF16)


NAME = "cross_entropy"
OP = graph_plan.torch_or_ort(
    NAME,
    replaces="SoftmaxCrossEntropyLoss (F.cross_entropy); in bf16 fused with the LM head's GEMM",
    module=__name__,
    setting="aten_cross_entropy",
    rewrite=_rewrite,
)
