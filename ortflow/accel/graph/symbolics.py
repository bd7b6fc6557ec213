"""The export symbolics in force while an ORT engine exports a model (`exporting`), and around ortflow's inference
export (`torch_only_export`).

While an ORT engine exports under a graph plan (accel/graph/plan.py), every torch operator an op declares
(`GraphOp.symbolics`) runs that op's symbolic for the path the plan chose (its ATen node, or the native symbolic:
ORTModule's where it registered one at that opset, else torch's own). Under the portable target, the operators
ORTModule exports as ATen nodes (its embedding, pooling, group_norm, ...: ORT_ATEN_SYMBOLICS) run torch's own, so
the graph holds ONNX and com.microsoft operators only.

Decompositions declare symbolics too (Softplus with the module's beta and threshold: decompositions.py). Two fixes
hold in every ORT export: `aten::batch_norm` without running statistics (BatchNorm(track_running_stats=
False)) and `aten::instance_norm`, whose torch symbolics need the batch and channel sizes as constants ("batch_size
and channel_size must be non-None", "ONNX export of instance_norm for unknown channel size"), which ORTModule's
export, every input dimension dynamic, does not have. These compute the same batch statistics, and the same
ones/zeros for a missing weight and bias, from the tensor's shape at run time.

torch keeps custom symbolics per opset for the whole process, and has no way to read one back. So each is registered
once per opset as a dispatcher: inside an ORT export it does the above, outside it (ortflow's own inference export,
export.onnx, or a user's torch.onnx.export) it calls what would have run without it: ORT's symbolic where ORTModule
registered one, else torch's own.
"""

import contextlib
import contextvars
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.onnx import symbolic_helper

from ortflow.accel.compat import ort, ortmodule_patches, torch_onnx
from ortflow.accel.graph import plan as graph_plan

_ACTIVE: contextvars.ContextVar[graph_plan.GraphPlan | None] = contextvars.ContextVar(
    "ortflow_ort_export", default=None
)
# Inside `torch_only_export`: every operator by torch's own symbolic (an inference graph any ONNX runtime can run).
_TORCH_ONLY: contextvars.ContextVar[bool] = contextvars.ContextVar("ortflow_torch_only_export", default=False)


# ORTModule's symbolics (onnxruntime/training/ortmodule/_custom_op_symbolic_registry.py) that emit ATen nodes, which
# only torch can run: a portable export takes torch's own for these. Its others emit ONNX or com.microsoft operators
# whose gradients ORT builds (its cross-entropy's SoftmaxCrossEntropyLossInternal keeps the log-probabilities its
# gradient reads, which torch's own SoftmaxCrossEntropyLoss export does not): a portable export keeps them.
ORT_ATEN_SYMBOLICS = frozenset(
    f"::{name}"
    for name in (
        "adaptive_avg_pool2d",
        "argmax",
        "avg_pool2d",
        "bitwise_or",
        "diagonal",
        "embedding",
        "group_norm",
        "max",
        "max_pool2d",
        "min",
        "multinomial",
        "numpy_T",
        "scaled_dot_product_attention",
        "unfold",
    )
)


def own_torch_symbolic(name: str, opset: int) -> Callable[..., Any] | None:
    """torch's own symbolic for `::name` at `opset` (what its exporter registers itself), or None."""
    return torch_onnx.default_symbolic(name.removeprefix("::"), opset)


def native(name: str, opset: int) -> Callable[..., Any]:
    """What `::name` exports as without ortflow's symbolic: ORTModule's symbolic where ORTModule registered its
    symbolics at this opset (unless it emits an ATen node under a portable plan, or in `torch_only_export`), else
    torch's own."""
    active = _ACTIVE.get()
    torch_only = _TORCH_ONLY.get() or (active is not None and active.portable and name in ORT_ATEN_SYMBOLICS)
    if not torch_only and opset in ortmodule_patches.ort_symbolic_opsets() and (found := ort.ort_symbolic(name)):
        return found
    own = own_torch_symbolic(name, opset)
    if own is None:  # torch's exporter then says which operator it cannot export, where it meets one

        def missing(g, *args):
            operator = name.removeprefix("::")
            raise RuntimeError(f"Exporting the operator {operator} to ONNX opset {opset} is not supported")

        return missing
    return own


def _declared(name: str, factory: graph_plan.SymbolicFactory) -> Callable[..., Any]:
    """The dispatcher of an operator an op declares: its symbolic under the active plan, else the native one."""

    def symbolic(g, *args):
        active = _ACTIVE.get()
        if _TORCH_ONLY.get() or active is None:
            return native(name, g.opset)(g, *args)
        return factory(active, native(name, g.opset))(g, *args)

    return symbolic


def _ort_registered(name: str, registered: Callable[..., Any]) -> Callable[..., Any]:
    """The dispatcher of an operator ORTModule registers a symbolic for and no op declares: torch's own in
    `torch_only_export`, and in a portable export where ORTModule's emits ATen nodes; otherwise what ran before:
    ORTModule's at the opsets it registered its symbolics at, torch's own at the others."""

    def symbolic(g, *args):
        active = _ACTIVE.get()
        portable = _TORCH_ONLY.get() or (active is not None and active.portable and name in ORT_ATEN_SYMBOLICS)
        own = own_torch_symbolic(name, g.opset)
        if own is not None and (portable or g.opset not in ortmodule_patches.ort_symbolic_opsets()):
            return own(g, *args)
        return registered(g, *args)

    return symbolic


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


# The fixes every ORT export keeps (whatever the plan), by torch operator.
FIXES: dict[str, Callable[..., Any]] = {"::batch_norm": batch_norm, "::instance_norm": instance_norm}


def _dispatchers() -> dict[str, Callable[..., Any]]:
    """Every operator ortflow registers a symbolic for: the declared ops' and the fixes."""
    found = dict(FIXES)
    for op in graph_plan.OPS.values():
        for name, factory in op.symbolics.items():
            found[name] = _declared(name, factory)
    return found


def _register(opset: int) -> None:
    """ortflow's dispatchers at `opset`, and one for each operator ORTModule registers that no op declares."""
    ours = _dispatchers()
    for name in ort.ort_symbolic_names():
        if name.startswith("::") and name not in ours and (registered := ort.ort_symbolic(name)) is not None:
            torch.onnx.register_custom_op_symbolic(name, _ort_registered(name, registered), opset)
    for name, symbolic in ours.items():
        torch.onnx.register_custom_op_symbolic(name, symbolic, opset)


@contextlib.contextmanager
def torch_only_export(opset: int) -> Iterator[None]:
    """Around ortflow's inference export (export.onnx): torch's own symbolics for the operators ORTModule registers
    its own for (its ATen embedding, ...) and for ortflow's, so the file holds standard ONNX operators only. What is
    registered stays a dispatcher: outside this context it calls what ran before (ORT's, or ortflow's)."""
    _register(opset)
    token = _TORCH_ONLY.set(True)
    try:
        yield
    finally:
        _TORCH_ONLY.reset(token)


@contextlib.contextmanager
def exporting(plan: graph_plan.GraphPlan, opset: int) -> Iterator[None]:
    """Around an ORT engine's export at `opset`: ortflow's symbolics in force for `plan` (registered over whatever was
    there at that opset, ORTModule's own included, which they call where the plan changes nothing)."""
    _register(opset)
    token = _ACTIVE.set(plan)
    try:
        yield
    except Exception as err:  # a refusal is kept where the engine finds it, whatever wraps it on its way out
        if (refused := graph_plan.refusal_in(err)) is not None:
            plan.refusals.append(refused)
        raise
    finally:
        _ACTIVE.reset(token)


def scope(g: Any) -> str:
    """The module path of the torch node being exported, as ONNX node names carry it (`/model/up/up.0/`), for naming
    the module in an error."""
    try:
        name = g.original_node.scopeName()
    except AttributeError:
        return ""
    # "pkg.Wrapper::/pkg.Model::model/torch.nn.modules.conv.ConvTranspose2d::up": each part `class::attribute`
    parts = [part.rpartition("::")[2] for part in name.split("/")]
    return "/" + "".join(f"{p}/" for p in parts if p)
