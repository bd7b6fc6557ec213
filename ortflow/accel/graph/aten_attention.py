"""scaled_dot_product_attention run by torch's fused bf16 kernel inside ONNX Runtime's graphs
(`trainer.precision=bf16-mixed`).

Why: torch's exporter writes attention out as MatMul, Softmax and MatMul, which ORT runs in fp32 and, for the
backward, keeps the (batch, heads, length, length) fp32 probabilities of every layer. Eager bf16 calls torch's fused
CPU kernel (flash attention), which keeps the bf16 query, key, value and output and one fp32 log-sum-exp a row. On
the Qwen2 LoRA shape (24 layers, 14 heads, batch 4 x 256) that is 14.7 MB of probabilities a layer the ORT engines
held and eager did not.

How: the `aten::scaled_dot_product_attention` symbolic emits one ATen node running `ortflow::attention_bf16`: the
query, key and value cast to bf16 (as autocast's linear layers hand them to eager's attention), torch's fused kernel,
the output returned in fp32 and the bf16 copies and the log-sum-exp for the gradient node, `ortflow::attention_bf16_
backward` (torch's fused backward), which returns the gradients of the query, key and value in fp32. Only where
torch's fused kernel is what eager runs: no dropout on the attention weights (the ORT engines' own dropout writes
that attention out, accel/graph/fed_dropout.py), no grouped-query flag (models repeat the key and value themselves),
no mask or a boolean one (added as 0 and -inf, as torch's attention adds it). Anything else keeps the exporter's
graph.
"""

from typing import Any

import torch
from torch.onnx import symbolic_helper

from ortflow.accel.graph import aten_nodes, aten_shapes
from ortflow.accel.graph import plan as graph_plan

OPERATOR = "ortflow::attention_bf16"
BACKWARD = "ortflow::attention_bf16_backward"

_LIBRARY = torch.library.Library("ortflow", "FRAGMENT")
_LIBRARY.define(
    "attention_bf16(Tensor query, Tensor key, Tensor value, Tensor mask, bool is_causal, float scale,"
    " bool[] output_mask) -> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)"
)
_LIBRARY.define(
    "attention_bf16_backward(Tensor grad_output, Tensor query16, Tensor key16, Tensor value16, Tensor output16,"
    " Tensor logsumexp, Tensor mask, bool is_causal, float scale, bool[] output_mask) -> (Tensor, Tensor, Tensor)"
)


def _added_mask(mask: torch.Tensor) -> torch.Tensor | None:
    """None for no mask (an empty tensor: a new None input cannot be emitted); a boolean mask as 0 where attention is
    allowed and -inf elsewhere, in bf16 (the fused kernel takes a mask of the query's type)."""
    if mask.numel() == 0:
        return None
    return torch.zeros(mask.shape, dtype=torch.bfloat16).masked_fill(mask.logical_not(), float("-inf"))


def _scale(scale: float) -> float | None:
    return None if scale < 0 else scale  # -1: the default, 1 / sqrt(head size)


def _attention(query, key, value, mask, is_causal: bool, scale: float, output_mask):
    q16, k16, v16 = (t.to(torch.bfloat16) for t in (query, key, value))
    out16, logsumexp = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q16, k16, v16, 0.0, is_causal, attn_mask=_added_mask(mask), scale=_scale(scale)
    )
    return out16.float(), q16, k16, v16, out16, logsumexp


def _attention_backward(grad_output, q16, k16, v16, out16, logsumexp, mask, is_causal: bool, scale: float, output_mask):
    grads = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        grad_output.to(torch.bfloat16),
        q16,
        k16,
        v16,
        out16,
        logsumexp,
        0.0,
        is_causal,
        attn_mask=_added_mask(mask),
        scale=_scale(scale),
    )
    return tuple(g.float() if wanted else None for g, wanted in zip(grads, output_mask, strict=True))


_LIBRARY.impl("attention_bf16", _attention, "CPU")
_LIBRARY.impl("attention_bf16_backward", _attention_backward, "CPU")


# ORT's gradient of the forward node: one ATen node on GO(0), the forward node's bf16 copies and log-sum-exp (its
# outputs 1 to 5), the mask, the causal flag, the scale and the gradient mask; it returns the gradients of the query,
# key and value.
aten_nodes.declare(
    OPERATOR,
    BACKWARD,
    ["GO(0)", "O(1)", "O(2)", "O(3)", "O(4)", "O(5)", "I(3)", "I(4)", "I(5)", "I(6)"],
    differentiable=(0, 1, 2),
    mask_input=6,
    fix_name="attentions_run_by_torch_bf16",
    shape=aten_shapes.attention_shape,
)


def _float4(value) -> bool:
    return symbolic_helper._get_tensor_rank(value) == 4 and value.type().scalarType() == "Float"


def _absent(value) -> bool:
    """Whether a traced optional argument was not given."""
    return value is None or symbolic_helper._is_none(value)


def _constant(value, kind: str) -> Any:
    """A traced argument's constant value (None: none given, or not a constant)."""
    if _absent(value):
        return None
    found = symbolic_helper._maybe_get_const(value, kind)
    return None if isinstance(found, torch._C.Value) else found


def attention(native):
    """The `aten::scaled_dot_product_attention` symbolic in a bf16 export: one ATen node where torch's fused kernel
    is what eager runs (module docstring); else `native`."""

    def symbolic(g, query, key, value, attn_mask=None, dropout_p=None, is_causal=None, scale=None, enable_gqa=None):
        args = (query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)
        causal, gqa, dropout = _constant(is_causal, "b"), _constant(enable_gqa, "b"), _constant(dropout_p, "f")
        no_mask = _absent(attn_mask)
        boolean = not no_mask and attn_mask.type().scalarType() == "Bool"
        given_scale = _constant(scale, "f")
        if (
            not all(_float4(t) for t in (query, key, value))
            or dropout != 0.0
            or gqa
            or causal is None
            or not (no_mask or (boolean and not causal))
            or (given_scale is None and not _absent(scale))  # a scale that is no constant
        ):
            return native(g, *args[: 8 if enable_gqa is not None else 7])
        mask = g.op("Constant", value_t=torch.zeros(0, dtype=torch.bool)) if no_mask else attn_mask
        output, *copies = g.op(
            "org.pytorch.aten::ATen",
            query,
            key,
            value,
            mask,
            g.op("Constant", value_t=torch.tensor(bool(causal))),
            g.op("Constant", value_t=torch.tensor(-1.0 if given_scale is None else float(given_scale))),
            g.op("Constant", value_t=torch.tensor([True, True, True])),  # aten_nodes.set_gradient_masks narrows it
            operator_s=OPERATOR,
            overload_name_s="",
            outputs=6,
        )
        output.setType(g.original_node.output().type())
        for copy, source in zip(copies[:3], (query, key, value), strict=True):
            copy.setType(source.type().with_dtype(torch.bfloat16))
        copies[3].setType(g.original_node.output().type().with_dtype(torch.bfloat16))
        sizes = query.type().varyingSizes()
        if sizes is not None:
            copies[4].setType(query.type().with_dtype(torch.float32).with_sizes(sizes[:-1]))
        return output

    return symbolic


NAME = "attention"
OP = graph_plan.torch_or_ort(
    NAME,
    replaces="attention written out as MatMul, Softmax, MatMul in fp32 (aten::scaled_dot_product_attention) by "
    "torch's fused bf16 kernel",
    module=__name__,
    setting="aten_attention",
    symbolics={
        "::scaled_dot_product_attention": lambda plan, native: attention(native) if plan.by_torch(NAME) else native
    },
)
