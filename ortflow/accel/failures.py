"""An ORT engine's failure as one paragraph: what failed (the ONNX op and the module of the user's model that
produced it), why (ORT's or torch's own reason, without its source locations), and what works instead.

Only for what ORT or torch's exporter cannot do with the model (`is_model_limit`): a known message of theirs, or an
exception raised inside them, at an op of the model. One at a node ortflow's graph work wrote (a rewrite's node, an
ATen node running an ortflow operator, their gradients) or about a value such a node produced is possibly ortflow's
(`written_by_ortflow`, GraphWorkError: traceback kept, exit 1), unless the op is on the documented list of what ORT
cannot train. An exception raised in ortflow's own code is ortflow's bug and keeps its traceback
(the command says so and exits with 1), whatever its type; one raised in the user's own code keeps it too.

ORT's exceptions embed C++ signatures, whole Python tracebacks and graph node names; the node names carry the
exporter's module scopes (`/layer1/layer1.0/conv1/Conv`, `/_original_module/model/b/ATen_Grad/ATen_0`), which map
back to the user's `named_modules()`. Both engines wrap their export, graph build and steps with `explained`.
"""

import contextlib
import re
from collections.abc import Iterator

from torch import nn

from ortflow.accel.graph.plan import GraphPlan, NoPortablePath, refusal_in
from ortflow.errors import ModelError, OrtflowError, is_allocation_failure, origin, root_reason

# ORT's and torch's messages that name the failing op and node (op, node)
_PATTERNS = (
    re.compile(r"gradient builder has not been registered: (?P<op>\w+) for node (?P<node>\S+)"),
    re.compile(r"Could not find an implementation for (?P<op>\w+)\(\d+\) node with name '(?P<node>[^']+)'"),
    re.compile(r"running (?P<op>\w+) node\. Name:'(?P<node>[^']+)'"),
    re.compile(r"Exporting the operator '?(?P<op>[\w:.]+)'? to ONNX"),
    re.compile(r"ONNX export of operator (?P<op>[\w:.]+)"),
    re.compile(r"[Nn]ode \(?(?P<node>/[^\s)'\"]+)\)?"),
)
# What ORT and torch's exporter say when they cannot handle a model: their limits, not ortflow's bugs.
_KNOWN_LIMITS = re.compile(
    r"\[ONNXRuntimeError\]|Status Message:|gradient builder has not been registered|Could not find an implementation"
    r"|Exporting the operator|ONNX export of operator|Unsupported: ONNX|could not create a primitive"
    r"|ShapeInferenceError|type inference failed|is not supported|ORTModule does not support"
)
# A Python exception inside an ATen node (an ortflow operator's Python code that torch runs inside ORT's graph): ORT
# keeps only its text. Torch's own kernels raise RuntimeError.
_PYTHON_ERROR_IN_ORT = re.compile(
    r"Status Message: (TypeError|AttributeError|NameError|KeyError|IndexError|UnboundLocalError|AssertionError"
    r"|ValueError|ZeroDivisionError|RecursionError|ImportError)\b"
)
_WRAPPERS = ("_original_module", "model")  # ORTModule's and ortflow's wrappers around the user's model
NO_GRADIENT_DOC = "docs/ort-gradients.md"


def op_and_node(text: str) -> tuple[str | None, str | None]:
    """The ONNX op and graph node an ORT or exporter message names (either may be None)."""
    op = node = None
    for pattern in _PATTERNS:
        if (found := pattern.search(text)) is not None:
            groups = found.groupdict()
            op = op or groups.get("op")
            node = node or groups.get("node")
        if op and node:
            break
    return op, node


def module_path(node: str, model: nn.Module | None) -> str | None:
    """The user's module (dotted path and class) an exported node belongs to, from the exporter's scope names
    (each either a child's name or its path from the exported root: `/model/model.1/CumSum`, `/model/up/up.0/`):
    the deepest module of the user's model the scopes name."""
    path = ""
    segments = [s for s in node.strip("/").split("/")[:-1] if s and not s.endswith("_Grad")]
    for segment in segments:
        path = segment if not path or segment.startswith(path + ".") else f"{path}.{segment}"
    for wrapper in _WRAPPERS:  # the engines' wrappers, outermost first, each at most once
        if path == wrapper:
            path = ""
        elif path.startswith(wrapper + "."):
            path = path[len(wrapper) + 1 :]
    modules = dict(model.named_modules()) if model is not None else {}
    while path and modules and path not in modules:  # the deepest module of the user's model on that path
        path = path.rsplit(".", 1)[0] if "." in path else ""
    # a segment that is itself a module's whole path (a child of a Sequential: `up.0`) may name a deeper one
    named = [s for s in segments if s in modules and s not in _WRAPPERS]
    if named and len(named[-1]) > len(path):
        path = named[-1]
    if not path:
        return None
    return f"{path} ({type(modules[path]).__name__})" if path in modules else path


def module_of_operator(op: str, model: nn.Module | None) -> str | None:
    """The user's module whose class is named after a torch operator (`aten::channel_shuffle` -> nn.ChannelShuffle):
    the exporter's message about an operator it cannot export names no scope."""
    if model is None:
        return None
    wanted = op.rsplit("::", 1)[-1].replace("_", "").lower()
    for name, module in model.named_modules():
        if name and type(module).__name__.lower() == wanted:
            return f"{name} ({type(module).__name__})"
    return None


def no_portable_path(
    err: BaseException, engine: str, model: nn.Module | None, plan: GraphPlan | None = None
) -> ModelError | None:
    """The user's error for an op the portable target has no path for: in `err`'s chain, or recorded in the plan
    where the graph work met it (ORTModule turns what an export raises into an exception of its own); None if it
    is not that."""
    found = refusal_in(err)
    if found is None and plan is not None and plan.refusals:
        found = plan.refusals[-1]
    if found is None:
        return None
    where = module_path(found.scope + "op", model) if found.scope else None
    module = f"module {where}" if where else "a module of the model"
    return ModelError(
        f"accel={engine} accel.target=portable cannot train the model's {module}: it has {found.what}, and {found.why}"
        ". The portable target runs only ONNX Runtime's own operators, the graphs a device trains. Use "
        "accel.target=fast (ortflow runs it with torch's kernels inside ORT), or a model without it."
    )


# ORT's messages about a value of a node (type inference: "... of input parameter (NAME) of operator (OP) in node
# (NODE) is invalid"; shape errors name the node's inputs the same way)
_VALUE = re.compile(r"input parameter \((?P<value>[^)]+)\)|input arg \((?P<arg>[^)]+)\)")


_TYPE_OR_SHAPE = re.compile(
    r"Type Error|ShapeInferenceError|inconsistent type|bound to different types|Incompatible dimensions|shape mismatch"
)


def engine_errors() -> tuple[type[BaseException], ...]:
    """What an ORT engine's export, graph build and steps raise: Python's errors, ORT's own exception classes (its
    pybind layer's: Fail, InvalidArgument, InvalidGraph, ...; plain Exceptions) and ONNX's shape inference's."""
    from onnx.shape_inference import InferenceError
    from onnxruntime.capi import onnxruntime_pybind11_state as state

    ort = tuple(
        value
        for value in vars(state).values()
        if isinstance(value, type) and issubclass(value, Exception) and value.__module__ == state.__name__
    )
    python = (RuntimeError, ValueError, AssertionError, TypeError, NotImplementedError, NoPortablePath)
    return (*python, InferenceError, *ort)


class GraphWorkError(RuntimeError):
    """ORT failed at a node ortflow's graph work wrote, or on a value one produced: possibly a bug in ortflow (the
    command keeps the traceback and exits with 1), not a limit of the model."""


def written_by_ortflow(err: BaseException, plan: GraphPlan | None) -> str | None:
    """The node or value ortflow's graph work wrote that ORT's or torch's message about `err` names (a node ORT
    built the gradient of one of them, `<node>_Grad/...`, included); None where it names none of them. An op on the
    node is judged by where it came from, whatever ORT says of it: one ortflow wrote without a gradient builder or a
    CPU kernel is ortflow's; the same op exported from the model is the model's."""
    if plan is None or not (plan.written_nodes or plan.written_values):
        return None
    text = _all_text(err)
    _, node = op_and_node(text)
    named = [node] if node else []
    named += re.findall(r"Name:'([^']+)'|node with name '([^']+)'|in node \(([^)]+)\)|node name: ([^)\s]+)", text)
    typing = bool(_TYPE_OR_SHAPE.search(text))
    for found in named:
        for name in found if isinstance(found, tuple) else (found,):
            if name and (name in plan.written_nodes or name.split("_Grad/")[0] in plan.written_nodes):
                return f"graph node {name}"
            if name and typing and name in plan.written_readers:  # a type or shape ortflow's node handed on
                return f"graph node {name} (reading a value ortflow's graph work wrote)"
    for found in _VALUE.finditer(text):
        value = found.group("value") or found.group("arg")
        if value in plan.written_values:
            return f"value {value}"
    return None


def possibly_ortflows(err: BaseException, engine: str, stage: str, where: str) -> GraphWorkError:
    """The error for a failure at what ortflow's graph work wrote (`where`), chained to ORT's."""
    return GraphWorkError(
        f"accel={engine} could not {stage}: ONNX Runtime failed at {where}, which ortflow's graph work wrote into "
        f"the graph, not at an op of your model ({_reason(err)}). This is possibly a bug in ortflow: please report it "
        "with this traceback. The graph settings (accel.rewrite_*, accel.aten_*, accel.bf16_edges; docs/engines.md) "
        "turn ortflow's rewrites off one by one, to train meanwhile."
    )


def is_model_limit(err: BaseException) -> bool:
    """Whether `err` says what ORT or torch's exporter cannot do with the model (a known message of theirs, or raised
    inside them), rather than a bug of ortflow's or an error of the user's own code."""
    text = _all_text(err)
    if _PYTHON_ERROR_IN_ORT.search(text):
        return False
    return bool(_KNOWN_LIMITS.search(text)) or origin(err).kind == "library"


def _all_text(err: BaseException) -> str:
    parts = []
    seen: set[int] = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        parts.append(str(err))
        err = err.__cause__ or err.__context__
    return "\n".join(parts)


def paragraph(err: BaseException, engine: str, stage: str, model: nn.Module | None, instead: str) -> str:
    """`accel=ENGINE failed to STAGE: the ONNX op OP from module PATH (REASON). INSTEAD`"""
    text = _all_text(err)
    op, node = op_and_node(text)
    where = module_path(node, model) if node else None
    if op and "::" in op:  # a torch operator the exporter has no ONNX for
        where = where or module_of_operator(op, model)
        what = f"the torch operator {op}"
    else:
        what = f"the ONNX op {op}" if op else "an op"
    if where:
        what += f" of module {where}"
    elif node:
        what += f" (graph node {node})"
    hint = ""
    if "gradient builder has not been registered" in text or "Could not find an implementation for" in text:
        hint = f" ONNX Runtime has no gradient for it on CPU ({NO_GRADIENT_DOC} lists every such op)."
    return f"accel={engine} could not {stage}: {what} failed ({_reason(err)}).{hint} {instead}"


def _reason(err: BaseException) -> str:
    """ORT's own reason: the first line after its status message or error code, else the root cause's last line."""
    text = _all_text(err)
    for pattern in (r"Status Message: (?P<reason>[^\n]+)", r"\[ONNXRuntimeError\] : \d+ : \w+ : (?P<reason>[^\n]+)"):
        if (found := re.search(pattern, text)) is not None:
            reason = found.group("reason")
            break
    else:
        reason = root_reason(err)
    if " was false. " in reason:
        reason = reason.rsplit(" was false. ", 1)[1]
    return reason.split(" Run workload with environment variable")[0].strip().rstrip(".")


@contextlib.contextmanager
def explained(
    engine: str, stage: str, model: nn.Module | None, instead: str, plan: GraphPlan | None = None
) -> Iterator[None]:
    """Turn an engine's exception inside into one OrtflowError paragraph (memory failures and ortflow's own errors
    pass through: the runner explains those); one at what ortflow's graph work wrote into the graphs made under
    `plan` becomes a GraphWorkError (possibly ortflow's)."""
    try:
        yield
    except (OrtflowError, GraphWorkError):
        raise
    except engine_errors() as err:
        if (refused := no_portable_path(err, engine, model)) is not None:
            raise refused from None
        if is_allocation_failure(err) or not is_model_limit(err):
            raise
        if (where := written_by_ortflow(err, plan)) is not None:
            raise possibly_ortflows(err, engine, stage, where) from err
        raise OrtflowError(paragraph(err, engine, stage, model, instead)) from err
