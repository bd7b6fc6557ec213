"""What a device export checks and changes in the artifacts engine's ONNX files.

- `scale_learning_rate`: the optimizer model multiplies its `learning_rate` input by a constant, so that a runtime
  left at its default rate (portable.RUNTIME_LR) trains at the run's rate.
- `portability_problems`: a node a device cannot run (an org.pytorch.aten node: torch's kernel inside ORT), or a
  training input the device cannot feed (a dropout mask the host would draw).
- `dropout_nodes`: what the manifest says about the graph.
"""

import numpy as np
import onnx
from onnx import helper, numpy_helper

TORCH_DOMAIN = "org.pytorch.aten"
LR_INPUT = "learning_rate"
LR_SCALE = "ortflow.learning_rate_scale"  # the constant's initializer in optimizer_model.onnx
OPTIMIZER_OPS = ("AdamWOptimizer", "SGDOptimizerV2")
LAZY_RESET_GRAD = "lazy_reset_grad"  # ORT's own training input (whether to zero the gradient buffers first)
GRAD_BUFFER = "_grad.accumulation.buffer"  # ORT's gradient buffers: training inputs the runtime feeds itself


def scale_learning_rate(model: onnx.ModelProto, scale: float) -> int:
    """Feed the optimizer op `learning_rate * scale` instead of `learning_rate` (a float32 constant). Returns the
    number of optimizer ops changed (0: the model was scaled already or holds no known optimizer op).

    Raises:
        ValueError: the model has no `learning_rate` input.
    """
    graph = model.graph
    if LR_INPUT not in {i.name for i in graph.input}:
        raise ValueError(f"the optimizer model has no '{LR_INPUT}' input")
    if any(init.name == LR_SCALE for init in graph.initializer):
        return 0
    scaled = LR_INPUT + ".scaled"
    changed = 0
    for node in graph.node:
        if node.op_type in OPTIMIZER_OPS and node.input and node.input[0] == LR_INPUT:
            node.input[0] = scaled
            changed += 1
    if changed:
        graph.initializer.append(numpy_helper.from_array(np.array([scale], np.float32), LR_SCALE))
        graph.node.insert(0, helper.make_node("Mul", [LR_INPUT, LR_SCALE], [scaled], name="ortflow_scale_lr"))
    return changed


def hugging_face_adamw(model: onnx.ModelProto) -> int:
    """Give the optimizer model's AdamWOptimizer ops adam_mode=1 (Hugging Face's AdamW conventions), the ones a set
    for a device trains with and its reference reproduces (reference.py); the artifacts engine trains with torch's
    (adam_mode=0: accel/torch_adamw.py). Returns the number of ops changed."""
    changed = 0
    for node in model.graph.node:
        if node.op_type == "AdamWOptimizer":
            kept = [a for a in node.attribute if a.name != "adam_mode"]
            del node.attribute[:]
            node.attribute.extend([*kept, helper.make_attribute("adam_mode", 1)])
            changed += 1
    return changed


def learning_rate_scale(model: onnx.ModelProto) -> float | None:
    """The constant `scale_learning_rate` put in, or None."""
    for init in model.graph.initializer:
        if init.name == LR_SCALE:
            return float(numpy_helper.to_array(init).reshape(-1)[0])
    return None


def domains(model: onnx.ModelProto) -> list[str]:
    """The op domains the graph's nodes use ('' is ONNX's own)."""
    return sorted({node.domain for node in model.graph.node})


def portability_problems(name: str, model: onnx.ModelProto, allowed_inputs: set[str] | None) -> list[str]:
    """Why the file `name` cannot train on a device: torch-kernel nodes, inputs a device cannot feed (checked when
    `allowed_inputs` is given)."""
    found = []
    torch_ops = sorted({_aten_name(n) for n in model.graph.node if n.domain == TORCH_DOMAIN})
    if torch_ops:
        found.append(f"{name} holds {len(torch_ops)} kind(s) of org.pytorch.aten node ({', '.join(torch_ops[:4])})")
    if allowed_inputs is None:
        return found
    initializers = {i.name for i in model.graph.initializer}
    extra = [i.name for i in model.graph.input if i.name not in allowed_inputs and i.name not in initializers]
    if extra:
        found.append(f"{name} takes inputs a device cannot feed ({', '.join(extra[:4])})")
    return found


def _aten_name(node: onnx.NodeProto) -> str:
    """An ATen node's torch operator (its `operator` attribute), else its op type."""
    for attribute in node.attribute:
        if attribute.name == "operator":
            return attribute.s.decode()
    return node.op_type


def dropout_nodes(model: onnx.ModelProto) -> int:
    return sum(1 for node in model.graph.node if node.op_type == "Dropout")
