"""An ORT engine's failure as one paragraph: what failed (the ONNX op and the module of the user's model that
produced it), why (ORT's or torch's own reason, without its source locations), and what works instead.

Only for what ORT or torch's exporter cannot do with the model (`is_model_limit`): a known message of theirs, or an
exception raised inside them. An exception raised in ortflow's own code is ortflow's bug and keeps its traceback
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
def explained(engine: str, stage: str, model: nn.Module | None, instead: str) -> Iterator[None]:
    """Turn an engine's exception inside into one OrtflowError paragraph (memory failures and ortflow's own errors
    pass through: the runner explains those)."""
    try:
        yield
    except OrtflowError:
        raise
    except (RuntimeError, ValueError, AssertionError, TypeError, NotImplementedError, NoPortablePath) as err:
        if (refused := no_portable_path(err, engine, model)) is not None:
            raise refused from None
        if is_allocation_failure(err) or not is_model_limit(err):
            raise
        raise OrtflowError(paragraph(err, engine, stage, model, instead)) from err
