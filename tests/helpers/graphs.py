"""The graphs an ORT engine trains, built for a recipe, and a canonical text of a graph to compare them by.

`engine_graphs` builds one engine the way a run does (the recipe's data and model, shrunk by `SMALL`) and returns
its training graph: for the artifacts engine the training and eval models it wrote, for ORTModule the training graph
(forward and gradient, as ORT optimised it) after one training step. `signature` is a graph as lines of text: every
node's domain, op, inputs, outputs and attributes (a tensor by its type, shape and a digest of its bytes), the
graph's inputs and outputs with their types, and the initializers' names and shapes (not their values: weights).
"""

import copy
import hashlib
import re
import tempfile
from pathlib import Path

import onnx
import torch
from onnx import helper

from ortflow import accel
from ortflow.accel.compat import ortmodule_patches
from ortflow.paths import compose_config
from ortflow.run.runner import build_data, build_model, engine_context
from ortflow.run.seeding import seed_everything, seed_step
from ortflow.step.batch import split_batch
from tests.conftest import TINY_TRANSFORMER

# Each recipe shrunk to seconds, keeping every kind of layer it has (dropout included).
SMALL = {
    "transformer": TINY_TRANSFORMER,
    "vision": ["model.width=8", "data.batch_size=8"],
    "digits": ["data.batch_size=8"],
}


def _attribute(attr: onnx.AttributeProto) -> str:
    value = helper.get_attribute_value(attr)
    if isinstance(value, onnx.TensorProto):
        digest = hashlib.sha256(value.SerializeToString()).hexdigest()[:16]
        return f"{attr.name}=tensor({value.data_type},{list(value.dims)},{digest})"
    if isinstance(value, bytes):
        value = value.decode(errors="replace")
    if isinstance(value, list):
        value = [v.decode(errors="replace") if isinstance(v, bytes) else v for v in value]
    return f"{attr.name}={value!r}"


def _value(info: onnx.ValueInfoProto) -> str:
    tensor = info.type.tensor_type
    dims = [d.dim_value if d.HasField("dim_value") else d.dim_param for d in tensor.shape.dim]
    return f"{info.name}:{tensor.elem_type}{dims}"


_COUNTED = re.compile(r"(onnx::[\w.]+::)(\d+)")  # onnxblock's names carry a process-wide counter


def _renumbered(lines: list[str]) -> list[str]:
    """onnxblock's counted names (`onnx::loss::4`) numbered by first appearance in the graph instead: the same graph
    built later in a process gets higher counts."""
    numbers: dict[str, int] = {}

    def number(found: re.Match) -> str:
        return f"{found.group(1)}#{numbers.setdefault(found.group(0), len(numbers))}"

    return [_COUNTED.sub(number, line) for line in lines]


def signature(model: onnx.ModelProto) -> list[str]:
    """The graph as lines: what it takes and returns, its initializers' names and shapes, each node in order."""
    return _renumbered(_lines(model))


def _lines(model: onnx.ModelProto) -> list[str]:
    graph = model.graph
    lines = [f"opset {o.domain or 'ai.onnx'} {o.version}" for o in sorted(model.opset_import, key=lambda o: o.domain)]
    lines += [f"input {_value(v)}" for v in graph.input]
    lines += [f"output {_value(v)}" for v in graph.output]
    lines += [f"initializer {i.name} {i.data_type} {list(i.dims)}" for i in graph.initializer]
    for node in graph.node:
        attributes = " ".join(_attribute(a) for a in sorted(node.attribute, key=lambda a: a.name))
        lines.append(
            f"{node.domain or 'ai.onnx'}::{node.op_type}({', '.join(node.input)}) -> {list(node.output)} "
            f"{attributes}".rstrip()
        )
    return lines


def digest(lines: list[str]) -> str:
    return hashlib.sha256("\n".join(lines).encode()).hexdigest()


def op_counts(model: onnx.ModelProto) -> dict[str, int]:
    counts: dict[str, int] = {}
    for node in model.graph.node:
        key = f"{node.domain or 'ai.onnx'}::{node.op_type}"
        counts[key] = counts.get(key, 0) + 1
    return dict(sorted(counts.items()))


def engine_graphs(recipe: str, mode: str, precision: str, *overrides: str) -> dict[str, onnx.ModelProto]:
    """The graphs `mode` trains for the shrunk `recipe` in `precision` (see the module's docstring)."""
    cfg = compose_config(
        [f"+recipe={recipe}", *SMALL[recipe], f"accel={mode}", f"trainer.precision={precision}", *overrides]
    )
    seed_everything(cfg.seed)
    data = build_data(cfg)
    model = build_model(cfg, data)
    with tempfile.TemporaryDirectory(prefix="ortflow-graphs-") as tmp:
        engine = accel.build(cfg.accel, engine_context(cfg, copy.deepcopy(model), data, Path(tmp)))
        if mode == "artifacts":
            onnx_dir = Path(tmp) / "onnx"
            return {
                name: onnx.load(str(onnx_dir / f"{name}_model.onnx"), load_external_data=False)
                for name in ("training", "eval", "optimizer")
            }
        seed_step(cfg.seed, 1)
        engine.train_step(*split_batch(next(iter(data.train))))
        graph = ortmodule_patches.training_graph(engine.module)
        assert graph is not None and engine.describe()["ort_train_steps"] == 1
        return {"training": graph}


def recipe_losses(recipe: str, mode: str, *overrides: str | None, steps: int = 4):
    """`steps` training losses of the shrunk `recipe` in `mode` from the recipe's seed (the same initial weights and
    batches in every mode), and the engine (None-valued overrides are left out)."""
    cfg = compose_config([f"+recipe={recipe}", *SMALL[recipe], f"accel={mode}", *(o for o in overrides if o)])
    seed_everything(cfg.seed)
    data = build_data(cfg)
    model = build_model(cfg, data)
    batches = iter(data.train)
    tmp = tempfile.mkdtemp(prefix="ortflow-graphs-")
    engine = accel.build(cfg.accel, engine_context(cfg, model, data, Path(tmp)))
    losses = []
    for step in range(1, steps + 1):
        seed_step(cfg.seed, step)
        losses.append(engine.train_step(*split_batch(next(batches))))
    return losses, engine


CASES = [
    (recipe, mode, precision)
    for recipe in ("transformer", "vision", "digits")
    for precision in ("fp32", "bf16-mixed")
    for mode in ("ortmodule", "artifacts")
]


def torch_ready() -> bool:
    return torch.__version__.split("+")[0] == "2.14.1"
