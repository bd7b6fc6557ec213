"""Output shapes of ATen nodes for ORT's symbolic shape inference (ORTModule): the rules ortflow's ATen operators
declare (`AtenOp.shape`: convolutions, bf16 GEMMs, GELUs, cross-entropies), and ORTModule's own adaptive average
pooling.

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

from ortflow.accel.graph import aten_nodes


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


def _set(inference: Any, node: Any, index: int, elem: int, shape: list[Any]) -> None:
    from onnx import helper
    from onnxruntime.tools.symbolic_shape_infer import get_shape_from_sympy_shape

    name = node.output[index]
    inference.known_vi_[name].CopyFrom(helper.make_tensor_value_info(name, elem, get_shape_from_sympy_shape(shape)))


def _product_shape(inference: Any, node: Any) -> tuple[list[Any], list[Any], list[Any]]:
    """The shape of a @ b (b transposed) for a node with the GEMM's inputs (a, b, bias, transpose_b, ...), with
    matmul's broadcast of the leading dims; and a's and b's shapes."""
    a, b = inference._get_sympy_shape(node, 0), inference._get_sympy_shape(node, 1)
    transpose = _values(inference, node, 3)
    if transpose and transpose[0]:  # a linear layer: b is the (out, in) weight
        shape = [*a[:-1], b[0]]
    else:
        batch_a, batch_b = a[:-2], b[:-2]
        width = max(len(batch_a), len(batch_b))
        batch_a, batch_b = [1] * (width - len(batch_a)) + batch_a, [1] * (width - len(batch_b)) + batch_b
        batch = [y if x == 1 else x for x, y in zip(batch_a, batch_b, strict=True)]
        shape = [*batch, a[-2], b[-1]]
    inference._update_computed_dims(shape)
    return shape, a, b


def gemm_shape(inference: Any, node: Any) -> None:
    """The `ortflow::gemm_bf16` node: a @ b in fp32; outputs 1 and 2 are bf16 copies of a and b."""
    from onnx import TensorProto

    shape, a, b = _product_shape(inference, node)
    _set(inference, node, 0, TensorProto.FLOAT, shape)  # fp32 also where a arrives bf16 (bf16_edges.py)
    _set(inference, node, 1, TensorProto.BFLOAT16, a)
    _set(inference, node, 2, TensorProto.BFLOAT16, b)


def attention_shape(inference: Any, node: Any) -> None:
    """`ortflow::attention_bf16`: the output in fp32 (the query's shape with the value's last dim), the bf16 copies
    of the query, key, value and output, and the fp32 log-sum-exp (the query's shape without its last dim)."""
    from onnx import TensorProto

    q, k, v = (inference._get_sympy_shape(node, i) for i in range(3))
    out = [*q[:-1], v[-1]]
    _set(inference, node, 0, TensorProto.FLOAT, out)
    for index, shape in ((1, q), (2, k), (3, v), (4, out)):
        _set(inference, node, index, TensorProto.BFLOAT16, shape)
    _set(inference, node, 5, TensorProto.FLOAT, q[:-1])


def linear_loss_shape(inference: Any, node: Any) -> None:
    """`ortflow::linear_cross_entropy_bf16` (the GEMM's inputs, then the loss's): the loss, a float scalar; the
    logits' gradient, bf16 of the product's shape; the bf16 copies of a and b; the logits in fp32."""
    from onnx import TensorProto

    shape, a, b = _product_shape(inference, node)
    _set(inference, node, 0, inference.known_vi_[node.input[0]].type.tensor_type.elem_type, [])
    _set(inference, node, 1, TensorProto.BFLOAT16, shape)
    _set(inference, node, 2, TensorProto.BFLOAT16, a)
    _set(inference, node, 3, TensorProto.BFLOAT16, b)
    _set(inference, node, 4, TensorProto.FLOAT, shape)  # the logits, if returned (else empty)


def same_shape(inference: Any, node: Any) -> None:
    """An element-wise ATen node (`ortflow::gelu_tanh`): its input's type and shape."""
    _set(
        inference,
        node,
        0,
        inference.known_vi_[node.input[0]].type.tensor_type.elem_type,
        inference._get_sympy_shape(node, 0),
    )


def scalar_shape(inference: Any, node: Any) -> None:
    """A reduced loss (`ortflow::cross_entropy`): a scalar of its first input's type."""
    _set(inference, node, 0, inference.known_vi_[node.input[0]].type.tensor_type.elem_type, [])


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
        for op in aten_nodes.OPS.values():
            if op.shape is not None:
                dispatch[op.forward] = lambda node, rule=op.shape: rule(self, node)
        pool = dispatch.get("_adaptive_avg_pool2d", lambda node: None)
        dispatch["_adaptive_avg_pool2d"] = lambda node: adaptive_pool_shape(self, node, pool)

    SymbolicShapeInference.__init__ = init_with_ours
    _installed = True
