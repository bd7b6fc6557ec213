"""The torch operators bf16 feature maps run through inside ORT's graphs (accel/graph/bf16_maps.py writes them): each
autocast's own computation on a bf16 map, forward and backward, bit for bit (tests/accel/graph/test_bf16_maps.py),
with its gradient definition and its output shapes for ORTModule's symbolic shape inference.

- `convolution_bf16_maps`: the convolution of bf16 copies returned in bf16, with the copies of its input and weight
  (the map itself where it arrives bf16), which its gradient node reads;
- `batch_norm_bf16` / `batch_norm_bf16_eval`: torch's mixed-precision batch norm (bf16 map; fp32 weight, bias and
  statistics); in training it writes the batch mean and biased variance into the running-statistics tensors it is
  given, in place, as ORT's own kernel does under ortflow's momentum 0 (accel/graph/batchnorm.py applies torch's update
  from them); in evaluation it reads them;
- `add_bf16`: a + b (broadcast), its ReLU taken in, with both shapes for the gradient's sums;
- `fork_bf16`: the map twice (itself, not copies), for two readers that each need its gradient; its gradient adds
  theirs in bf16, as autograd adds the gradients of a bf16 tensor read twice (ORT's Sum has no bf16 kernel);
- `global_average_pool_bf16`: torch's adaptive average pooling to 1x1 (the mean over H and W) and its gradient;
- `float_of_bf16`: the map in fp32 for a reader that is not a torch-kernel node (and its gradient back to bf16).
"""

from typing import Any

import torch
from onnx import TensorProto

from ortflow.accel.graph import aten_nodes, aten_shapes
from ortflow.accel.graph.aten_conv import bf16_or_none, float_or_none

CONVOLUTION = "ortflow::convolution_bf16_maps"
CONVOLUTION_BACKWARD = "ortflow::convolution_bf16_maps_backward"
BATCH_NORM = "ortflow::batch_norm_bf16"
BATCH_NORM_EVAL = "ortflow::batch_norm_bf16_eval"
BATCH_NORM_BACKWARD = "ortflow::batch_norm_bf16_backward"
ADD = "ortflow::add_bf16"
ADD_BACKWARD = "ortflow::add_bf16_backward"
FORK = "ortflow::fork_bf16"
FORK_BACKWARD = "ortflow::fork_bf16_backward"
POOL = "ortflow::global_average_pool_bf16"
POOL_BACKWARD = "ortflow::global_average_pool_bf16_backward"
TO_FLOAT = "ortflow::float_of_bf16"
TO_FLOAT_BACKWARD = "ortflow::float_of_bf16_backward"

_LIBRARY = torch.library.Library("ortflow", "FRAGMENT")
_CONV_ARGS = (
    "Tensor input, Tensor weight, Tensor? bias, int[] stride, int[] padding, int[] dilation, bool transposed, "
    "int[] output_padding, int groups, bool[] output_mask"
)
_NORM_ARGS = "Tensor input, Tensor weight, Tensor bias, Tensor running_mean, Tensor running_var, float eps"
_LIBRARY.define(f"convolution_bf16_maps({_CONV_ARGS}) -> (Tensor, Tensor, Tensor)")
_LIBRARY.define(f"convolution_bf16_maps_backward(Tensor grad_output, {_CONV_ARGS}) -> (Tensor, Tensor, Tensor)")
_LIBRARY.define(f"batch_norm_bf16({_NORM_ARGS}, bool[] output_mask) -> (Tensor, Tensor, Tensor)")
_LIBRARY.define(f"batch_norm_bf16_eval({_NORM_ARGS}, bool[] output_mask) -> (Tensor, Tensor, Tensor)")
_LIBRARY.define(
    "batch_norm_bf16_backward(Tensor grad_output, Tensor input, Tensor weight, Tensor save_mean, Tensor save_invstd, "
    "float eps, bool[] output_mask) -> (Tensor, Tensor, Tensor)"
)
_LIBRARY.define("add_bf16(Tensor a, Tensor b, bool relu, bool[] output_mask) -> (Tensor, Tensor, Tensor)")
_LIBRARY.define(
    "add_bf16_backward(Tensor grad_output, Tensor result, Tensor shape_a, Tensor shape_b, bool relu, "
    "bool[] output_mask) -> (Tensor, Tensor)"
)
_LIBRARY.define("fork_bf16(Tensor x) -> (Tensor, Tensor)")
_LIBRARY.define("fork_bf16_backward(Tensor grad_a, Tensor grad_b) -> Tensor")
_LIBRARY.define("global_average_pool_bf16(Tensor x) -> Tensor")
_LIBRARY.define("float_of_bf16(Tensor x) -> Tensor")
_LIBRARY.define("float_of_bf16_backward(Tensor grad_output) -> Tensor")
_LIBRARY.define("global_average_pool_bf16_backward(Tensor grad_output, Tensor x) -> Tensor")


def _convolution(input, weight, bias, stride, padding, dilation, transposed, output_padding, groups, output_mask):
    """The convolution of bf16 copies (autocast's), returned in bf16, and the copies of input and weight, which the
    gradient node takes (no copy of an input that arrives bf16; each converted once per step, as autocast does)."""
    args = (stride, padding, dilation, transposed, output_padding, groups)
    input16, weight16 = bf16_or_none(input), bf16_or_none(weight)
    return torch.ops.aten.convolution(input16, weight16, bf16_or_none(bias), *args), input16, weight16


def _convolution_backward(
    grad_output, input16, weight16, bias, stride, padding, dilation, transposed, output_padding, groups, output_mask
):
    """Its gradients from the bf16 gradient, as autocast's convolution_backward computes them (the bias's summed by
    the kernel in bf16): the input's in bf16 where it arrived bf16 (`output_mask[3]`), the others in fp32."""
    args = (stride, padding, dilation, transposed, output_padding, groups)
    grad_input, grad_weight, grad_bias = torch.ops.ortflow.convolution_backward(
        grad_output, input16, weight16, bf16_or_none(bias), *args, output_mask[:3]
    )
    if grad_input is not None and not output_mask[3]:
        grad_input = grad_input.float()
    return grad_input, float_or_none(grad_weight), float_or_none(grad_bias)


def _batch_norm(input, weight, bias, running_mean, running_var, eps, output_mask):
    """Training: torch's batch norm of the bf16 input with the batch's statistics, and the batch mean and biased
    variance written into `running_mean` and `running_var` (momentum 1 writes the unbiased variance; rescaled)."""
    out, mean, invstd = torch.ops.aten.native_batch_norm(input, weight, bias, running_mean, running_var, True, 1.0, eps)
    count = input.numel() // input.size(1)
    running_var.mul_((count - 1) / count)
    return out, mean, invstd


def _batch_norm_eval(input, weight, bias, running_mean, running_var, eps, output_mask):
    """Evaluation: normalised with the running statistics, which stay as they are."""
    return torch.ops.aten.native_batch_norm(input, weight, bias, running_mean, running_var, False, 0.0, eps)


def _batch_norm_backward(grad_output, input, weight, save_mean, save_invstd, eps, output_mask):
    mask = [bool(m) for m in output_mask]
    return torch.ops.aten.native_batch_norm_backward(
        grad_output, input, weight, None, None, save_mean, save_invstd, True, eps, mask
    )


def _add(a, b, relu: bool, output_mask):
    """a + b (broadcast as torch broadcasts), its ReLU taken in; and the shapes of a and b, which the gradient sums
    to."""
    out = a + b
    shapes = (torch.tensor(a.shape, dtype=torch.int64), torch.tensor(b.shape, dtype=torch.int64))
    return (out.relu_() if relu else out), *shapes


def _add_backward(grad_output, result, shape_a, shape_b, relu: bool, output_mask):
    """Each input's gradient, summed over what broadcasting added (autograd's sum_to_size): where both have the
    output's shape, the same tensor twice (nothing downstream writes into it), a copy where it would be the incoming
    gradient itself, which ORT may reuse."""
    grad = torch.ops.aten.threshold_backward(grad_output, result, 0) if relu else grad_output.clone()

    def to(shape: torch.Tensor) -> torch.Tensor:
        size = torch.Size(shape.tolist())
        return grad if size == grad.shape else grad.sum_to_size(size)

    return (to(shape_a) if output_mask[0] else None), (to(shape_b) if output_mask[1] else None)


def _fork(x):
    """The map for two readers: x itself twice, not copies (safe where every reader is a torch-kernel node, as
    bf16_maps.py makes them: an ORT Cast reading such an alias corrupted the map)."""
    return x, x


def _fork_backward(grad_a, grad_b):
    return grad_a + grad_b  # bf16, as autograd adds the gradients of a bf16 tensor read twice


def _pool(x):
    return torch.ops.aten.adaptive_avg_pool2d(x, [1, 1])  # torch: the mean over H and W, in bf16


def _pool_backward(grad_output, x):
    return grad_output.expand(x.shape) / (x.size(2) * x.size(3))  # the mean's gradient, as autograd's


def _to_float(x):
    return x.float()


def _to_float_backward(grad_output):
    return grad_output.to(torch.bfloat16)


for _name, _function in (
    ("float_of_bf16", _to_float),
    ("float_of_bf16_backward", _to_float_backward),
    ("convolution_bf16_maps", _convolution),
    ("convolution_bf16_maps_backward", _convolution_backward),
    ("batch_norm_bf16", _batch_norm),
    ("batch_norm_bf16_eval", _batch_norm_eval),
    ("batch_norm_bf16_backward", _batch_norm_backward),
    ("add_bf16", _add),
    ("add_bf16_backward", _add_backward),
    ("fork_bf16", _fork),
    ("fork_bf16_backward", _fork_backward),
    ("global_average_pool_bf16", _pool),
    ("global_average_pool_bf16_backward", _pool_backward),
):
    _LIBRARY.impl(_name, _function, "CPU")


def _convolution_shape(inference: Any, node: Any) -> None:
    aten_shapes.convolution_shape(inference, node)
    inference.known_vi_[node.output[0]].type.tensor_type.elem_type = TensorProto.BFLOAT16
    aten_shapes._set(inference, node, 1, TensorProto.BFLOAT16, inference._get_sympy_shape(node, 0))
    aten_shapes._set(inference, node, 2, TensorProto.BFLOAT16, inference._get_sympy_shape(node, 1))


def _batch_norm_shape(inference: Any, node: Any, saved: int | None = None) -> None:
    """The bf16 map's shape; the saved mean and inverse deviation (C,) in training, empty (`saved` 0) in evaluation."""
    x = inference._get_sympy_shape(node, 0)
    aten_shapes._set(inference, node, 0, TensorProto.BFLOAT16, x)
    aten_shapes._set(inference, node, 1, TensorProto.FLOAT, [x[1] if saved is None else saved])
    aten_shapes._set(inference, node, 2, TensorProto.FLOAT, [x[1] if saved is None else saved])


def _batch_norm_eval_shape(inference: Any, node: Any) -> None:
    _batch_norm_shape(inference, node, saved=0)


def _add_shape(inference: Any, node: Any) -> None:
    """The broadcast of the two inputs' shapes (numpy's rule, as torch's), bf16; the two shapes, int64."""
    a, b = inference._get_sympy_shape(node, 0), inference._get_sympy_shape(node, 1)
    width = max(len(a), len(b))
    a, b = [1] * (width - len(a)) + a, [1] * (width - len(b)) + b
    shape = [y if x == 1 else x for x, y in zip(a, b, strict=True)]
    inference._update_computed_dims(shape)
    aten_shapes._set(inference, node, 0, TensorProto.BFLOAT16, shape)
    aten_shapes._set(inference, node, 1, TensorProto.INT64, [len(a)])
    aten_shapes._set(inference, node, 2, TensorProto.INT64, [len(b)])


def _fork_shape(inference: Any, node: Any) -> None:
    x = inference._get_sympy_shape(node, 0)
    aten_shapes._set(inference, node, 0, TensorProto.BFLOAT16, x)
    aten_shapes._set(inference, node, 1, TensorProto.BFLOAT16, x)


def _to_float_shape(inference: Any, node: Any) -> None:
    aten_shapes._set(inference, node, 0, TensorProto.FLOAT, inference._get_sympy_shape(node, 0))


def _pool_shape(inference: Any, node: Any) -> None:
    x = inference._get_sympy_shape(node, 0)
    aten_shapes._set(inference, node, 0, TensorProto.BFLOAT16, [*x[:2], 1, 1])


# The gradient node reads GO(0) (bf16), the forward's bf16 copies of input and weight, and its other inputs.
aten_nodes.declare(
    CONVOLUTION,
    CONVOLUTION_BACKWARD,
    ["GO(0)", "O(1)", "O(2)", *(f"I({i})" for i in range(2, 10))],
    differentiable=(0, 1, 2),
    mask_input=9,
    fix_name="convolutions_run_by_torch_bf16",
    bf16_input=0,
    shape=_convolution_shape,
)
for _forward, _shape in ((BATCH_NORM, _batch_norm_shape), (BATCH_NORM_EVAL, _batch_norm_eval_shape)):
    aten_nodes.declare(
        _forward,
        BATCH_NORM_BACKWARD,
        ["GO(0)", "I(0)", "I(1)", "O(1)", "O(2)", "I(5)", "I(6)"],
        differentiable=(0, 1, 2),
        mask_input=6,
        fix_name="batchnorms_run_by_torch_bf16",
        shape=_shape,
    )
aten_nodes.declare(
    ADD,
    ADD_BACKWARD,
    ["GO(0)", "O(0)", "O(1)", "O(2)", "I(2)", "I(3)"],
    gradients=2,
    differentiable=(0, 1),
    mask_input=3,
    fix_name="adds_run_by_torch_bf16",
    shape=_add_shape,
)
aten_nodes.declare(
    FORK,
    FORK_BACKWARD,
    ["GO(0)", "GO(1)"],
    gradients=1,
    differentiable=(0,),
    mask_input=None,
    fix_name="bf16_maps_read_twice",
    shape=_fork_shape,
)
aten_nodes.declare(
    POOL,
    POOL_BACKWARD,
    ["GO(0)", "I(0)"],
    gradients=1,
    differentiable=(0,),
    mask_input=None,
    fix_name="poolings_run_by_torch_bf16",
    shape=_pool_shape,
)


aten_nodes.declare(
    TO_FLOAT,
    TO_FLOAT_BACKWARD,
    ["GO(0)"],
    gradients=1,
    differentiable=(0,),
    mask_input=None,
    fix_name="bf16_maps_to_fp32",
    shape=_to_float_shape,
)
