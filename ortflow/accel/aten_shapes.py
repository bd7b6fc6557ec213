"""Output shapes of ATen nodes for ORT's symbolic shape inference (ORTModule): ortflow's convolution, and ORTModule's
own adaptive average pooling.

Why: ORTModule infers the shapes of its exported graph with ORT's SymbolicShapeInference, which knows the shapes of
a few ATen operators only; for any other it guesses an output of the first input's rank with new symbolic dims, and
for `_adaptive_avg_pool2d` (ORTModule's export of nn.AdaptiveAvgPool2d) it gives the spatial dims new symbols too,
even for an output size of 1; with auto_merge, such symbols get merged into whatever they meet. A
squeeze-excitation block (EfficientNet, RegNetY, MobileNetV3) multiplies the feature map (B, C, H, W) by the output
of 1x1 convolutions over the pooled (B, C, 1, 1) map: the pooled map's dims were merged with H and W, so ORT's Mul
gradient saw no broadcast and skipped its ReduceSum, and the SE's last convolution's gradient node received a
(B, C, H, W) gradient for its (B, C, 1, 1) output (oneDNN: "could not create a primitive descriptor for the
convolution forward propagation primitive"). With the real output shapes (the pool's output size; torch's
convolution formula on symbolic dims) the gradient is reduced as it must be.
"""

from typing import Any

from ortflow.accel import aten_conv


def _values(inference: Any, node: Any, index: int) -> list[int] | None:
    value = inference._try_get_value(node, index)
    if value is None:
        return None
    return [int(v) for v in (value.reshape(-1) if hasattr(value, "reshape") else value)]


def convolution_shape(inference: Any, node: Any) -> None:
    """`inference._infer_*`-style handler for the `ortflow::convolution` ATen node (inputs: input, weight, bias,
    stride, padding, dilation, transposed, output_padding, groups, output_mask)."""
    import sympy
    from onnx import helper
    from onnxruntime.tools.symbolic_shape_infer import get_shape_from_sympy_shape

    x, w = inference._get_sympy_shape(node, 0), inference._get_sympy_shape(node, 1)
    stride, padding, dilation = (_values(inference, node, i) for i in (3, 4, 5))
    transposed, output_padding, groups = (_values(inference, node, i) for i in (6, 7, 8))
    shape: list[Any] = list(x[:1])
    if transposed is None or groups is None:
        shape.append(inference._new_symbolic_dim_from_output(node, 0, 1))
    else:
        shape.append(w[1] * groups[0] if transposed[0] else w[0])
    for i, (size, kernel) in enumerate(zip(x[2:], w[2:], strict=True)):
        if stride is None or padding is None or dilation is None or transposed is None or output_padding is None:
            shape.append(inference._new_symbolic_dim_from_output(node, 0, i + 2))
            continue
        s, p, d = stride[i], padding[i], dilation[i]
        if transposed[0]:
            shape.append((size - 1) * s - 2 * p + d * (kernel - 1) + output_padding[i] + 1)
        else:
            shape.append(sympy.floor((size + 2 * p - d * (kernel - 1) - 1) / s) + 1)
    inference._update_computed_dims(shape)
    elem = inference.known_vi_[node.input[0]].type.tensor_type.elem_type
    vi = inference.known_vi_[node.output[0]]
    vi.CopyFrom(helper.make_tensor_value_info(node.output[0], elem, get_shape_from_sympy_shape(shape)))


def adaptive_pool_shape(inference: Any, node: Any, fallback: Any) -> None:
    """`_adaptive_avg_pool2d` (inputs: input, output_size): (B, C, *output_size) where the size is a constant."""
    from onnx import helper
    from onnxruntime.tools.symbolic_shape_infer import get_shape_from_sympy_shape

    size = _values(inference, node, 1)
    if size is None:
        fallback(node)
        return
    x = inference._get_sympy_shape(node, 0)
    shape = [*x[: len(x) - len(size)], *size]
    elem = inference.known_vi_[node.input[0]].type.tensor_type.elem_type
    vi = inference.known_vi_[node.output[0]]
    vi.CopyFrom(helper.make_tensor_value_info(node.output[0], elem, get_shape_from_sympy_shape(shape)))


_installed = False


def install() -> None:
    """Teach ORT's SymbolicShapeInference these output shapes (once per process)."""
    global _installed
    if _installed:
        return
    from onnxruntime.tools.symbolic_shape_infer import SymbolicShapeInference

    init = SymbolicShapeInference.__init__

    def init_with_ours(self, *args, **kwargs):
        init(self, *args, **kwargs)
        dispatch = self.aten_op_dispatcher_
        dispatch[aten_conv.OPERATOR] = lambda node: convolution_shape(self, node)
        pool = dispatch.get("_adaptive_avg_pool2d", lambda node: None)
        dispatch["_adaptive_avg_pool2d"] = lambda node: adaptive_pool_shape(self, node, pool)

    SymbolicShapeInference.__init__ = init_with_ours
    _installed = True
