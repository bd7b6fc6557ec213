"""A profiled step's time by kind of work (`ortflow-bench --profile`): GEMM, attention, dtype conversions,
element-wise, dropout masks, optimizer, the frameworks' own ranges, and the time no kernel accounts for.

Where each number comes from, so no work is counted twice:
- torch's operators by self time (eager's whole step; in the ORT engines, what torch runs around ORT and the torch
  kernels ORT's graph calls through its ATen nodes);
- ORT's kernels, except its ATen nodes (their work is the torch operators they call, already counted);
- dtype conversions are the profile's own count (torch's fp32<->bf16 copies and ORT's Casts); copies that keep
  the dtype are element-wise;
- "outside kernels" is the profiled step's wall time minus all of the above: the ATen nodes' own overhead, ORT's
  scheduling, Python. It is what neither profiler attributes to an operator.
Operators are put in a kind by their name; an aten operator or ORT kernel this module does not name is element-wise
(the remainder of a step's kernels, after the named kinds)."""

from typing import Any

GEMM = "GEMM"
ATTENTION = "attention"
CONVERSIONS = "conversions"
ELEMENTWISE = "element-wise"
DROPOUT = "dropout masks"
OPTIMIZER = "optimizer"
RANGES = "framework ranges"
OUTSIDE = "outside kernels"
KINDS = (GEMM, ATTENTION, CONVERSIONS, ELEMENTWISE, DROPOUT, OPTIMIZER, RANGES, OUTSIDE)

_GEMM = {
    "aten::mm",
    "aten::addmm",
    "aten::bmm",
    "aten::baddbmm",
    "aten::addbmm",
    "aten::matmul",
    "aten::linear",
    "aten::convolution",
    "aten::mkldnn_convolution",
    "aten::convolution_backward",
    "MatMul",
    "Gemm",
    "FusedMatMul",
    "FusedGemm",
    "Conv",
    "ConvGrad",
}
_ATTENTION = (
    "aten::_scaled_dot_product",
    "aten::scaled_dot_product",
    "aten::_flash_attention",
    "aten::_softmax",
    "aten::softmax",
    "aten::_safe_softmax",
    "Softmax",
    "SoftmaxGrad",
    "Attention",
)
_DROPOUT = {
    "aten::bernoulli_",
    "aten::native_dropout",
    "aten::native_dropout_backward",
    "aten::uniform_",
    "aten::rand",
    "aten::rand_like",
    "ortflow::draw_dropout_masks",
    "Dropout",
    "DropoutGrad",
    "BitmaskDropout",
    "BitmaskDropoutGrad",
    "BiasDropout",
    "RandomUniform",
    "RandomUniformLike",
}
_OPTIMIZER = ("aten::_fused_adam", "aten::_foreach_", "AdamW", "AdamOptimizer", "SGDOptimizer", "Optimizer.")


def kind_of(op: str) -> str:
    """The kind of work of an operator named by either profiler (see the module's docstring)."""
    if op in _GEMM:
        return GEMM
    if op.startswith(_ATTENTION):
        return ATTENTION
    if op in _DROPOUT:
        return DROPOUT
    if op.startswith(_OPTIMIZER):
        return OPTIMIZER
    if op.startswith("aten::") or ("::" not in op and op[:1].isupper()):
        return ELEMENTWISE  # an aten operator, or an ORT kernel (ORT's op types are capitalised)
    return RANGES  # autograd's and the optimizer's ranges, ortflow's composite ops: their self time is glue


def by_kind(result: dict[str, Any]) -> dict[str, float]:
    """A --profile result's milliseconds per step by kind of work (KINDS, in that order)."""
    ms = dict.fromkeys(KINDS, 0.0)
    for row in result.get("torch_ops", []):
        if not row.get("ort_run"):
            ms[kind_of(row["op"])] += row["ms_per_step"]
    for row in result.get("ort_ops", []):
        if row["op"] != "ATen":
            ms[kind_of(row["op"])] += row["ms_per_step"]
    converted = result.get("conversions", {}).get("total", {}).get("ms", 0.0)
    moved = min(converted, ms[ELEMENTWISE])  # the copies and Casts that convert, out of element-wise
    ms[ELEMENTWISE] -= moved
    ms[CONVERSIONS] += moved
    ms[OUTSIDE] = max(0.0, result["step_ms"] - sum(ms.values()))
    return ms
