"""ONNX export symbolics ortflow uses while an ORT engine exports a model (`ort_export`).

- `aten::_convolution`, `aten::_convolution_mode`: convolutions as ATen nodes run by torch's kernels
  (accel/graph/aten_conv.py): transposed ones always, all with `accel.aten_conv`.
- `aten::layer_norm`: LayerNorm as an ATen node run by torch's kernels with `accel.aten_layer_norm`
  (accel/graph/aten_layer_norm.py).
- `aten::linear`, `aten::matmul`, `aten::bmm`, `aten::addmm`: bf16 GEMMs run by torch's kernels with
  trainer.precision=bf16-mixed (accel/graph/aten_gemm.py).
- `aten::batch_norm` without running statistics (BatchNorm(track_running_stats=False)) and `aten::instance_norm`:
  torch's own need the batch and channel sizes as constants ("batch_size and channel_size must be non-None",
  "ONNX export of instance_norm for unknown channel size"), which ORTModule's export, every input dimension
  dynamic, does not have. These compute the same batch statistics, and the same ones/zeros for a missing weight and
  bias, from the tensor's shape at run time.
- `aten::softplus`: written out in ops ORT differentiates with the module's beta and threshold
  (accel/graph/activations.py). torch's own symbolic writes ONNX's Softplus, which has no threshold (and which ORT
  cannot differentiate anyway).

torch keeps custom symbolics per opset for the whole process, and has no way to read one back. So each is registered
once per opset as a dispatcher: inside `ort_export` it does the above, outside it (ortflow's own inference export,
export.onnx, or a user's torch.onnx.export) it calls what would have run without it: ORT's symbolic where ORTModule
registered one, else torch's own.
"""

import contextlib
import contextvars
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.onnx import symbolic_helper

from ortflow.accel.compat import ort, ortmodule_patches, torch_onnx
from ortflow.accel.graph import activations, aten_conv, aten_gemm, aten_layer_norm, aten_upsample


@dataclass(frozen=True)
class _Export:
    aten_conv: bool  # every convolution as an ATen node (transposed ones always)
    aten_layer_norm: bool = False  # every LayerNorm as an ATen node
    bf16: bool = (
        False  # matrix multiplies (and the ATen convolutions) computed in bf16 by torch (accel/graph/aten_gemm.py)
    )


_ACTIVE: contextvars.ContextVar[_Export | None] = contextvars.ContextVar("ortflow_ort_export", default=None)
# Inside `torch_only_export`: every operator by torch's own symbolic (an inference graph any ONNX runtime can run).
_TORCH_ONLY: contextvars.ContextVar[bool] = contextvars.ContextVar("ortflow_torch_only_export", default=False)


def _torch_batch_norm(g, *args):
    return torch_onnx.torch_symbolic("symbolic_opset14", "batch_norm")(g, *args)


def _torch_instance_norm(g, *args):
    return torch_onnx.torch_symbolic("symbolic_opset9", "instance_norm")(g, *args)


def batch_norm(g, input, weight, bias, running_mean, running_var, training, momentum, eps, cudnn_enabled):
    """Without running statistics and without static sizes: the batch mean and biased variance over every axis but
    the channels (ReduceMean), fed to BatchNormalization in training mode, as torch's own symbolic does."""
    args = (input, weight, bias, running_mean, running_var, training, momentum, eps, cudnn_enabled)
    rank = symbolic_helper._get_tensor_rank(input)
    sizes = symbolic_helper._get_tensor_sizes(input) or []
    static = len(sizes) >= 2 and sizes[0] is not None and sizes[1] is not None
    tracked = not (symbolic_helper._is_none(running_mean) or symbolic_helper._is_none(running_var))
    if _ACTIVE.get() is None or tracked or static or rank is None:
        return _torch_batch_norm(g, *args)
    axes = [0, *range(2, rank)]
    mean_kept = g.op("ReduceMean", input, axes_i=axes, keepdims_i=1)  # (1, C, 1, ...)
    centred = g.op("Sub", input, mean_kept)
    variance = g.op("ReduceMean", g.op("Mul", centred, centred), axes_i=axes, keepdims_i=0)  # biased, (C,)
    mean = g.op("ReduceMean", input, axes_i=axes, keepdims_i=0)
    weight = weight if not symbolic_helper._is_none(weight) else _filled(g, mean, 1.0)
    bias = bias if not symbolic_helper._is_none(bias) else _filled(g, mean, 0.0)
    out = g.op(
        "BatchNormalization",
        input,
        weight,
        bias,
        mean,
        variance,
        epsilon_f=symbolic_helper._maybe_get_const(eps, "f"),
        momentum_f=1 - symbolic_helper._maybe_get_const(momentum, "f"),
        training_mode_i=1,
        outputs=3,
    )
    return out[0]


def instance_norm(g, input, weight, bias, running_mean, running_var, use_input_stats, momentum, eps, cudnn_enabled):
    """Without a static channel size: InstanceNormalization with ones and zeros of the input's channel count for a
    missing weight and bias (ortflow's rewrite then writes it out: ORT has no gradient for it)."""
    args = (input, weight, bias, running_mean, running_var, use_input_stats, momentum, eps, cudnn_enabled)
    sizes = symbolic_helper._get_tensor_sizes(input) or []
    static = len(sizes) >= 2 and sizes[1] is not None
    tracked = not (symbolic_helper._is_none(running_mean) or symbolic_helper._is_none(running_var))
    if _ACTIVE.get() is None or tracked or static:
        return _torch_instance_norm(g, *args)
    channels = g.op(
        "Slice",
        g.op("Shape", input),
        g.op("Constant", value_t=torch.tensor([1])),
        g.op("Constant", value_t=torch.tensor([2])),
    )
    weight = weight if not symbolic_helper._is_none(weight) else _filled(g, channels, 1.0, shape=True)
    bias = bias if not symbolic_helper._is_none(bias) else _filled(g, channels, 0.0, shape=True)
    return g.op("InstanceNormalization", input, weight, bias, epsilon_f=symbolic_helper._maybe_get_const(eps, "f"))


def _filled(g, like, value: float, shape: bool = False):
    """A float tensor of `value` shaped like `like` (or shaped `like`, a shape, with shape=True)."""
    return g.op("ConstantOfShape", like if shape else g.op("Shape", like), value_t=torch.tensor([value]))


def _convolution(g, *args):
    active = _ACTIVE.get()
    native = ort.ort_symbolic("::_convolution") or torch_onnx.torch_symbolic("symbolic_opset9", "_convolution")
    if active is None:
        return native(g, *args)
    return aten_conv.convolution_symbolic(active.aten_conv, native, active.bf16)(g, *args)


def _convolution_mode(g, *args):
    active = _ACTIVE.get()
    native = ort.ort_symbolic("::_convolution_mode") or torch_onnx.torch_symbolic(
        "symbolic_opset9", "_convolution_mode"
    )
    if active is None or not active.aten_conv:
        return native(g, *args)
    return aten_conv.convolution_mode_symbolic(native, active.bf16)(g, *args)


def _layer_norm(g, *args):
    """ortflow's ATen LayerNorm inside an ORT export with accel.aten_layer_norm; otherwise ORTModule's symbolic at the
    opsets ORTModule registered it for, torch's own at the others (ORT's emits LayerNormalization, an opset-17 op)."""
    active = _ACTIVE.get()
    if active is not None and active.aten_layer_norm:
        return aten_layer_norm.emit(g, *args)
    if g.opset in ortmodule_patches.ort_symbolic_opsets() and (found := ort.ort_symbolic("::layer_norm")) is not None:
        return found(g, *args)
    return torch_onnx.torch_symbolic("symbolic_opset17" if g.opset >= 17 else "symbolic_opset9", "layer_norm")(g, *args)


def _softplus(g, self, beta, threshold):
    """torch's softplus(x, beta, threshold) in an ORT export; ORT's symbolic or torch's own outside it."""
    native = ort.ort_symbolic("::softplus") or torch_onnx.torch_symbolic("symbolic_opset9", "softplus")
    beta_value = symbolic_helper._maybe_get_const(beta, "f")
    threshold_value = symbolic_helper._maybe_get_const(threshold, "f")
    constants = all(isinstance(v, float | int) for v in (beta_value, threshold_value))
    if _ACTIVE.get() is None or not constants:
        return native(g, self, beta, threshold)
    scalar_type = symbolic_helper._try_get_scalar_type(self)  # the constants take the input's type
    dtype = scalar_type.dtype() if scalar_type is not None else torch.float32

    def emit(op: str, inputs: list, attributes: dict):
        return g.op(op, *inputs)

    def const(value: float):
        return g.op("Constant", value_t=torch.tensor(value, dtype=dtype))

    return activations.softplus(emit, const, self, float(beta_value), float(threshold_value))


def _gemm(name: str, bf16_symbolic: Callable[[Any], Any]) -> Callable[..., Any]:
    """The `aten::<name>` dispatcher: accel/graph/aten_gemm.py's bf16 ATen node in a bf16 ORT export, otherwise ORT's
    symbolic where ORTModule registered one, else torch's own."""

    def symbolic(g, *args):
        native = ort.ort_symbolic(f"::{name}") or torch_onnx.torch_symbolic("symbolic_opset9", name)
        active = _ACTIVE.get()
        if active is None or not active.bf16:
            return native(g, *args)
        return bf16_symbolic(native)(g, *args)

    return symbolic


SYMBOLICS: dict[str, Callable[..., Any]] = {
    "::linear": _gemm("linear", aten_gemm.linear),
    "::matmul": _gemm("matmul", aten_gemm.matmul),
    "::bmm": _gemm("bmm", aten_gemm.matmul),
    "::addmm": _gemm("addmm", aten_gemm.addmm),
    "::_convolution": _convolution,
    "::_convolution_mode": _convolution_mode,
    "::batch_norm": batch_norm,
    "::instance_norm": instance_norm,
    "::layer_norm": _layer_norm,
    "::softplus": _softplus,
}


def _own_torch_symbolic(name: str, opset: int):
    """torch's own symbolic for `::name` at `opset` (the newest opset module defining it), or None."""
    for version in range(opset, 8, -1):
        try:
            return torch_onnx.torch_symbolic(f"symbolic_opset{version}", name.removeprefix("::"))
        except AttributeError:
            continue
    return None


def _torch_only_dispatcher(name: str, opset: int, otherwise: Callable[..., Any]) -> Callable[..., Any]:
    def symbolic(g, *args):
        if _TORCH_ONLY.get() and (own := _own_torch_symbolic(name, opset)) is not None:
            return own(g, *args)
        return otherwise(g, *args)

    return symbolic


@contextlib.contextmanager
def torch_only_export(opset: int) -> Iterator[None]:
    """Around ortflow's inference export (export.onnx): torch's own symbolics for the operators ORTModule registers
    its own for (its ATen embedding, ...) and for ortflow's, so the file holds standard ONNX operators only. What is
    registered stays a dispatcher: outside this context it calls what ran before (ORT's, or ortflow's)."""
    names = {name for name in ort.ort_symbolic_names() if name.startswith("::")}
    for name in names - set(SYMBOLICS):
        registered = ort.ort_symbolic(name)
        torch.onnx.register_custom_op_symbolic(name, _torch_only_dispatcher(name, opset, registered), opset)
    for name, symbolic in SYMBOLICS.items():
        torch.onnx.register_custom_op_symbolic(name, _torch_only_dispatcher(name, opset, symbolic), opset)
    token = _TORCH_ONLY.set(True)
    try:
        yield
    finally:
        _TORCH_ONLY.reset(token)


@contextlib.contextmanager
def ort_export(opset: int, aten_conv_all: bool, aten_layer_norm: bool = False, bf16: bool = False) -> Iterator[None]:
    """Around an ORT engine's export at `opset`: ortflow's symbolics in force (registered over whatever was there at
    that opset, ORTModule's own included, which they call where they change nothing)."""
    for name, symbolic in SYMBOLICS.items():
        torch.onnx.register_custom_op_symbolic(name, symbolic, opset)
    token = _ACTIVE.set(_Export(aten_conv_all, aten_layer_norm, bf16))
    try:
        with aten_upsample.exporting(opset):  # upsampling as ATen nodes: ORT has no CPU ResizeGrad
            yield
    finally:
        _ACTIVE.reset(token)
