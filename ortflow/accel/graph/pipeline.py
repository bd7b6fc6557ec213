"""The graph work's one pipeline, the same for both ORT engines and the device export:

    plan (GraphPlan.compute: settings, precision, target)
      -> export          torch.onnx's TorchScript exporter with the plan's symbolics in force (`exporting`)
      -> rewrites        every declared op's graph rewrite, in its order (`prepare`): fixes that make the graph
                         differentiable, dropout, speed rewrites, torch's kernels as ATen nodes
      -> ATen nodes      each given the mask of the gradients it must compute; counted
      -> (portable)      no torch-kernel node left, or the op is refused (`refuse_torch_nodes`)
      -> gradients       ORT's gradient builder (ORTModule's, or generate_artifacts), with ortflow's gradient
                         definitions registered (`register_gradients`)

The artifacts engine calls these around its own torch.onnx.export and generate_artifacts; ORTModule calls them from
inside its export through the compatibility layer's hooks (accel/graph/ortmodule_export.py). Importing this module
imports every op module: each declares its op in the plan's registry (accel/graph/plan.py).
"""

import contextlib
import contextvars
import logging
from collections.abc import Callable, Iterator

import onnx
from torch import nn

from ortflow.accel.compat import torch_onnx
from ortflow.accel.graph import (  # noqa: F401  every op module: importing one declares its op
    aten_attention,
    aten_conv,
    aten_cross_entropy,
    aten_embedding,
    aten_gelu,
    aten_gemm,
    aten_layer_norm,
    aten_max_pool,
    aten_nodes,
    aten_relu,
    aten_shapes,
    aten_upsample,
    batchnorm,
    bf16_edges,
    decompositions,
    onnx_gradients,
    rewrites,
    stop_gradients,
    symbolics,
)
from ortflow.accel.graph.plan import OPS, GraphOp, GraphPlan, GraphWork, NoPortablePath, Target

log = logging.getLogger(__name__)

# A step of a test's own, run on the prepared graph last (`planted`): a fault planted inside what an engine executes,
# to show that a check catches it. Never set outside the tests.
Plant = Callable[[onnx.ModelProto, GraphPlan, GraphWork], None]
_PLANTED: contextvars.ContextVar[Plant | None] = contextvars.ContextVar("ortflow_planted", default=None)


@contextlib.contextmanager
def planted(plant: Plant) -> Iterator[None]:
    """While inside: `plant(model, plan, work)` runs on every graph the pipeline prepares, after every other step
    (tests only: the parity check's planted bugs)."""
    token = _PLANTED.set(plant)
    try:
        yield
    finally:
        _PLANTED.reset(token)


# The order the declared ops' rewrites run in on an exported graph: fixes that make the graph trainable first, then
# dropout, speed rewrites, and torch's kernels as ATen nodes last (bf16 edges fuse the GEMM and ReLU nodes the others
# wrote). Every op with a rewrite is named here once; an op a user adds goes here too.
ORDER: tuple[str, ...] = (
    "stop_gradients",  # stop_gradients.py: counts the stops the export wrote (detach, no_grad regions)
    "attention_dropout_mode",  # rewrites.py: attention's Dropout trains (its mode fixed before dropout's rewrite)
    "batchnorm_statistics",  # batchnorm.py
    "instance_norm",  # rewrites.py: written out, ORT cannot differentiate it
    "decompositions",  # decompositions.py: activations ORT cannot differentiate, written out
    "onnx_gradients",  # onnx_gradients.py
    "dropout",  # rewrites.py: masks fed each step, or ORT's Dropout given its mask output
    "relu",  # aten_relu.py: torch's ReLU, before relu_mask rewrites those left to ORT
    "max_pool",  # aten_max_pool.py
    "gathers",  # rewrites.py
    "relu_mask",  # rewrites.py
    "embedding_lookup",  # aten_embedding.py: torch's embedding, before `embedding` rewrites those left to ORT
    "embedding",  # rewrites.py
    "gelu",  # aten_gelu.py
    "cross_entropy",  # aten_cross_entropy.py
    "bf16_edges",  # bf16_edges.py: fuses the GEMM and ReLU nodes written before it
)


def ops_in_order() -> list[GraphOp]:
    """The declared ops whose rewrites run on an exported graph, in the pipeline's order (ORDER).

    Raises:
        LookupError: an op with a rewrite that ORDER does not name (where it runs would be a guess).
    """
    rewriting = {name for name, op in OPS.items() if op.rewrite is not None}
    if missing := sorted(rewriting - set(ORDER)):
        raise LookupError(f"graph ops with a rewrite but no place in pipeline.ORDER: {', '.join(missing)}")
    return [OPS[name] for name in ORDER if name in rewriting]


@contextlib.contextmanager
def exporting(plan: GraphPlan, opset: int, module: nn.Module | None = None) -> Iterator[None]:
    """Around torch's export at `opset` of `module`: the symbolics of the plan in force, and autograd's stops
    (detach, no_grad regions) marked where they hold, from a trace of `module` with grad enabled
    (accel/graph/stop_gradients.py)."""
    with (
        symbolics.exporting(plan, opset),
        torch_onnx.before_lowering(stop_gradients.mark),
        stop_gradients.traced_with_grad(module) if module is not None else contextlib.nullcontext(),
        torch_onnx.module_backward_hooks_untraced() if module is not None else contextlib.nullcontext(),
    ):
        yield


def prepare(model: onnx.ModelProto, plan: GraphPlan, work: GraphWork) -> GraphWork:
    """Every declared op's rewrite on the exported forward graph `model`, then the ATen nodes' gradient masks: the
    graph ORT's gradient builder gets. Returns `work` with the counts (`fixes`), the dropout masks to feed and the
    number of torch-kernel nodes.

    Raises:
        NoPortablePath: a portable plan left an ATen node in the graph (an operator with no ORT-native export).
    """
    exported = {node.name for node in model.graph.node}
    for op in ops_in_order():
        before = dict(work.fixes)
        op.rewrite(model, plan, work)
        if work.fixes != before:
            plan.applied.add(op.name)
    torch_nodes = aten_nodes.count_all(model)
    if torch_nodes:
        # Gradients only for the differentiable inputs that depend on a trainable parameter (ORT refuses an operator
        # that returns one nobody needs), and none for a frozen weight (its bf16 copy is kept from step to step).
        aten_nodes.set_gradient_masks(model, work.trainable, work.frozen)
    if (plant := _PLANTED.get()) is not None:
        plant(model, plan, work)
        torch_nodes = aten_nodes.count_all(model)
    _record_written(model, exported, plan)
    work.fixes.update(aten_nodes.graph_fixes(torch_nodes))
    work.torch_nodes = sum(torch_nodes.values())
    if plan.target is Target.portable:
        try:
            refuse_torch_nodes(model)
        except NoPortablePath as refused:
            plan.refusals.append(refused)
            raise
    if work.fixes:
        log.debug("graph fixes applied: %s", work.fixes)
    return work


def _record_written(model: onnx.ModelProto, exported: set[str], plan: GraphPlan) -> None:
    """Note in the plan the nodes of the prepared graph the graph work wrote (not in the exported graph `exported`,
    or ATen nodes running an ortflow operator), the values they produce and the model's nodes that read them."""
    for node in model.graph.node:
        if node.op_type == "Constant":
            continue
        if node.name not in exported or (aten_nodes.operator(node) or "").startswith("ortflow::"):
            plan.written_nodes.add(node.name or node.output[0])
            plan.written_values.update(name for name in node.output if name)
        elif any(name in plan.written_values for name in node.input):
            plan.written_readers.add(node.name)


def torch_node_names(model: onnx.ModelProto) -> list[str]:
    """The nodes of a graph that only torch can run (org.pytorch.aten ATen nodes)."""
    return [n.name or n.output[0] for n in model.graph.node if n.domain == "org.pytorch.aten"]


# ORT operators that call back into Python and torch: ORTModule's custom autograd Functions, torch's ATen kernels
_NEEDS_TORCH = {"ATen", "PythonOp", "PythonOpGrad"}


def portable(*models: onnx.ModelProto) -> bool:
    """Whether graphs hold only ONNX and com.microsoft operators that run without Python and torch (what ORT runs
    anywhere)."""
    return all(
        n.domain in ("", "ai.onnx", "com.microsoft") and n.op_type not in _NEEDS_TORCH
        for model in models
        for n in model.graph.node
    )


def refuse_torch_nodes(model: onnx.ModelProto) -> None:
    """Raises NoPortablePath for the first torch-kernel node of a graph made under the portable target."""
    for node in model.graph.node:
        if node.domain == "org.pytorch.aten":
            operator = next((a.s.decode() for a in node.attribute if a.name == "operator"), node.op_type)
            name = node.name or node.output[0]
            raise NoPortablePath(
                f"the torch operator {operator}",
                name.rsplit("/", 1)[0] + "/" if "/" in name else "",
                "it was exported as an ATen node, which only torch can run, and ortflow has no ORT-native form of it",
            )


def register_gradients(work: GraphWork) -> None:
    """Give ORT's gradient builder ortflow's definitions the prepared graph needs (the artifacts engine, before
    generate_artifacts; ORTModule registers all of them when it is first built: `install`)."""
    if work.torch_nodes:
        aten_nodes.register_gradients()
    if work.fixes.get("ops_given_ort_gradients"):
        onnx_gradients.register_gradients()


def install() -> None:
    """Before the first ORTModule is built: every gradient definition and shape rule ortflow declares."""
    aten_nodes.register_gradients()  # ORTModule publishes ORT's gradient registry when it is built
    onnx_gradients.register_gradients()  # and the standard ONNX ops ORT has no gradient builder for
    aten_shapes.install()  # the ATen nodes' output shapes (squeeze-excitation's broadcast gradient)


def inference_export(opset: int) -> contextlib.AbstractContextManager:
    """Around ortflow's inference export (export.onnx): torch's own symbolics for every operator, so the file holds
    standard ONNX operators only (symbolics.torch_only_export)."""
    return symbolics.torch_only_export(opset)
