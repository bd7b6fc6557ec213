"""Which ONNX ops the installed ONNX Runtime can train: every op torch's exporter emits for a list of torch.nn /
torch.nn.functional layers, each run alone as a one-op graph through `generate_artifacts` and one training step of
`onnxruntime.training.api` (so a gradient builder that exists but has no CPU kernel fails too).

    python -m ortflow.accel.graph.gradient_survey [--opset 16] [--markdown]

How: each layer is exported (TorchScript exporter, training mode, the opset the artifacts engine uses); the value of
every tensor in its graph is computed by ORT's inference session; each node then becomes a graph of its own whose
float inputs are trainable initializers holding those values and whose loss is the sum of its first output.
Integer-only ops (Shape, Gather of shapes, ...) are not differentiable and are listed as such.
"""

import argparse
import io
import logging
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx
import torch
import torch.nn.functional as F
from onnx import TensorProto, helper, numpy_helper
from torch import nn

from ortflow.accel.compat import export_warnings, versions

log = logging.getLogger(__name__)


class _Fn(nn.Module):
    def __init__(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        super().__init__()
        self.fn = fn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fn(x)


IMAGE = (2, 4, 6, 6)
SEQ = (2, 5, 4)
# name -> (module, input shape)
LAYERS: dict[str, tuple[Callable[[], nn.Module], tuple[int, ...]]] = {
    # activations
    **{
        name: (cls, IMAGE)
        for name, cls in {
            "ReLU": nn.ReLU,
            "ReLU6": nn.ReLU6,
            "LeakyReLU": nn.LeakyReLU,
            "PReLU": nn.PReLU,
            "RReLU(eval)": lambda: nn.RReLU().eval(),
            "ELU": nn.ELU,
            "SELU": nn.SELU,
            "CELU": nn.CELU,
            "GELU": nn.GELU,
            "GELU(tanh)": lambda: nn.GELU(approximate="tanh"),
            "SiLU": nn.SiLU,
            "Mish": nn.Mish,
            "Hardswish": nn.Hardswish,
            "Hardsigmoid": nn.Hardsigmoid,
            "Hardtanh": nn.Hardtanh,
            "Hardshrink": nn.Hardshrink,
            "Softshrink": nn.Softshrink,
            "Tanhshrink": nn.Tanhshrink,
            "Sigmoid": nn.Sigmoid,
            "LogSigmoid": nn.LogSigmoid,
            "Tanh": nn.Tanh,
            "Softplus": nn.Softplus,
            "Softsign": nn.Softsign,
            "Threshold": lambda: nn.Threshold(0.1, 0.0),
            "Softmax": lambda: nn.Softmax(dim=1),
            "LogSoftmax": lambda: nn.LogSoftmax(dim=1),
            "Softmin": lambda: nn.Softmin(dim=1),
            "Softmax2d": nn.Softmax2d,
            "GLU": lambda: nn.GLU(dim=1),
        }.items()
    },
    # pooling
    "MaxPool2d": (lambda: nn.MaxPool2d(2), IMAGE),
    "MaxPool2d(ceil,3x3,s2)": (lambda: nn.MaxPool2d(3, 2, ceil_mode=True), IMAGE),
    "MaxPool1d": (lambda: nn.MaxPool1d(2), SEQ),
    "AvgPool2d": (lambda: nn.AvgPool2d(2), IMAGE),
    "AvgPool2d(pad,count_include_pad=False)": (lambda: nn.AvgPool2d(3, 1, 1, count_include_pad=False), IMAGE),
    "AvgPool1d": (lambda: nn.AvgPool1d(2), SEQ),
    "AdaptiveAvgPool2d(1)": (lambda: nn.AdaptiveAvgPool2d(1), IMAGE),
    "AdaptiveAvgPool2d(3)": (lambda: nn.AdaptiveAvgPool2d(3), IMAGE),
    "AdaptiveMaxPool2d(1)": (lambda: nn.AdaptiveMaxPool2d(1), IMAGE),
    "AdaptiveAvgPool1d(1)": (lambda: nn.AdaptiveAvgPool1d(1), SEQ),
    "LPPool2d": (lambda: nn.LPPool2d(2, 2), IMAGE),
    # padding
    "ZeroPad2d": (lambda: nn.ZeroPad2d(1), IMAGE),
    "ConstantPad2d": (lambda: nn.ConstantPad2d(1, 0.5), IMAGE),
    "ReflectionPad2d": (lambda: nn.ReflectionPad2d(1), IMAGE),
    "ReplicationPad2d": (lambda: nn.ReplicationPad2d(1), IMAGE),
    "CircularPad2d": (lambda: nn.CircularPad2d(1), IMAGE),
    # upsampling and rearranging
    "Upsample(nearest)": (lambda: nn.Upsample(scale_factor=2, mode="nearest"), IMAGE),
    "Upsample(bilinear)": (lambda: nn.Upsample(scale_factor=2, mode="bilinear"), IMAGE),
    "Upsample(bilinear,align_corners)": (
        lambda: nn.Upsample(scale_factor=2, mode="bilinear", align_corners=True),
        IMAGE,
    ),
    "Upsample(bicubic)": (lambda: nn.Upsample(scale_factor=2, mode="bicubic"), IMAGE),
    "interpolate(size)": (lambda: _Fn(lambda x: F.interpolate(x, size=(9, 9), mode="bilinear")), IMAGE),
    "PixelShuffle": (lambda: nn.PixelShuffle(2), IMAGE),
    "PixelUnshuffle": (lambda: nn.PixelUnshuffle(2), IMAGE),
    "ChannelShuffle": (lambda: nn.ChannelShuffle(2), IMAGE),
    "Flatten": (nn.Flatten, IMAGE),
    "roll": (lambda: _Fn(lambda x: torch.roll(x, 1, dims=2)), IMAGE),
    "flip": (lambda: _Fn(lambda x: torch.flip(x, dims=[3])), IMAGE),
    "cumsum": (lambda: _Fn(lambda x: torch.cumsum(x, dim=1)), SEQ),
    "einsum": (lambda: _Fn(lambda x: torch.einsum("bij,bkj->bik", x, x)), SEQ),
    "transpose/permute": (lambda: _Fn(lambda x: x.permute(0, 2, 3, 1)), IMAGE),
    "chunk/cat": (lambda: _Fn(lambda x: torch.cat(x.chunk(2, dim=1)[::-1], dim=1)), IMAGE),
    "gather/index": (lambda: _Fn(lambda x: x[:, [2, 0, 1]]), IMAGE),
    "tril": (lambda: _Fn(lambda x: torch.tril(x)), SEQ),
    "topk": (lambda: _Fn(lambda x: torch.topk(x, 2, dim=1).values), SEQ),
    "sort": (lambda: _Fn(lambda x: torch.sort(x, dim=1).values), SEQ),
    "max(dim)": (lambda: _Fn(lambda x: x.max(dim=1).values), SEQ),
    "amax/amin": (lambda: _Fn(lambda x: x.amax(dim=1) - x.amin(dim=1)), SEQ),
    "where/masked_fill": (lambda: _Fn(lambda x: x.masked_fill(x > 0.5, -1.0)), SEQ),
    "clamp": (lambda: _Fn(lambda x: x.clamp(-0.5, 0.5)), SEQ),
    # normalisation and similarity
    "LayerNorm": (lambda: nn.LayerNorm(4), SEQ),
    "GroupNorm": (lambda: nn.GroupNorm(2, 4), IMAGE),
    "InstanceNorm2d": (lambda: nn.InstanceNorm2d(4, affine=True), IMAGE),
    "LocalResponseNorm": (lambda: nn.LocalResponseNorm(2), IMAGE),
    "normalize": (lambda: _Fn(lambda x: F.normalize(x, dim=-1)), SEQ),
    "cosine_similarity": (lambda: _Fn(lambda x: F.cosine_similarity(x, x.flip(1), dim=-1)), SEQ),
    "var/std": (lambda: _Fn(lambda x: x.var(dim=1, keepdim=True) + x.std(dim=2, keepdim=True)), IMAGE),
    "norm": (lambda: _Fn(lambda x: torch.linalg.vector_norm(x, dim=-1)), SEQ),
    # elementwise math
    "pow/sqrt/rsqrt": (lambda: _Fn(lambda x: x.pow(2) + (x.abs() + 1).sqrt() + (x.abs() + 1).rsqrt()), SEQ),
    "exp/log/log1p": (lambda: _Fn(lambda x: x.exp() + (x.abs() + 1).log() + x.abs().log1p()), SEQ),
    "sin/cos": (lambda: _Fn(lambda x: x.sin() + x.cos()), SEQ),
    "erf": (lambda: _Fn(lambda x: torch.erf(x)), SEQ),
    "reciprocal/neg/sign": (lambda: _Fn(lambda x: (x.abs() + 1).reciprocal() - x * x.sign()), SEQ),
    "atan": (lambda: _Fn(lambda x: torch.atan(x)), SEQ),
    "floor/round (x + ...)": (lambda: _Fn(lambda x: x + x.floor() + x.round()), SEQ),
    "ceil (x + ...)": (lambda: _Fn(lambda x: x + x.ceil()), SEQ),
    "tan/asin/acos": (lambda: _Fn(lambda x: x.tanh().tan() + x.tanh().asin() + x.tanh().acos()), SEQ),
    "fmod": (lambda: _Fn(lambda x: torch.fmod(x, 0.7)), SEQ),
    "prod": (lambda: _Fn(lambda x: x.prod(dim=1)), SEQ),
    "logsumexp": (lambda: _Fn(lambda x: torch.logsumexp(x, dim=1)), SEQ),
    "det": (lambda: _Fn(lambda x: torch.linalg.det(x[:, :4])), SEQ),
    # layers with weights
    "Linear": (lambda: nn.Linear(4, 3), SEQ),
    "Bilinear": (lambda: _Bilinear(), SEQ),
    "Embedding": (lambda: _Embedding(), SEQ),
    "Conv2d": (lambda: nn.Conv2d(4, 3, 3), IMAGE),
    "ConvTranspose2d": (lambda: nn.ConvTranspose2d(4, 3, 2, stride=2), IMAGE),
    "Conv1d": (lambda: nn.Conv1d(5, 3, 3), SEQ),
    "Dropout": (lambda: nn.Dropout(0.1), SEQ),
    "MultiheadAttention": (lambda: _Attention(), SEQ),
}


class _Bilinear(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Bilinear(4, 4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer(x, x)


class _Embedding(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Embedding(10, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer((x.abs() * 3).long().clamp(max=9)).sum(-2) * x


class _Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.MultiheadAttention(4, 2, batch_first=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer(x, x, x)[0]


UNTESTED = ""
CONSTANT = "no differentiable instance (shapes, constants, integer outputs)"


@dataclass
class OpResult:
    op: str  # domain-qualified when not the default domain
    status: str  # "trains", "not differentiable (integer output)", or the failure's first line
    layers: list[str] = field(default_factory=list)

    @property
    def trains(self) -> bool:
        return self.status in ("trains", CONSTANT)


def export_layer(module: nn.Module, shape: tuple[int, ...], opset: int) -> onnx.ModelProto:
    torch.manual_seed(0)
    buffer = io.BytesIO()
    with export_warnings.expected():  # the legacy exporter in training mode, on purpose
        torch.onnx.export(
            module.train(),
            (torch.randn(*shape),),
            buffer,
            input_names=["x"],
            output_names=["y"],
            do_constant_folding=False,
            training=torch.onnx.TrainingMode.TRAINING,
            opset_version=opset,
            dynamo=False,
        )
    return onnx.load_from_string(buffer.getvalue())


def all_values(model: onnx.ModelProto, shape: tuple[int, ...]) -> dict[str, np.ndarray]:
    """Every tensor of the graph for one random input (ORT's inference session, every node output a graph output)."""
    import onnxruntime

    inferred = onnx.shape_inference.infer_shapes(model)
    typed = {v.name: v for v in (*inferred.graph.value_info, *inferred.graph.output)}
    listed = {o.name for o in model.graph.output}
    probe = onnx.ModelProto()
    probe.CopyFrom(model)
    for node in probe.graph.node:
        for name in node.output:
            if name and name not in listed and name in typed:
                probe.graph.output.append(typed[name])
                listed.add(name)
    session = onnxruntime.InferenceSession(probe.SerializeToString(), providers=["CPUExecutionProvider"])
    x = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
    names = [o.name for o in session.get_outputs()]
    values = dict(zip(names, session.run(names, {"x": x}), strict=True))
    values["x"] = x
    values |= {i.name: numpy_helper.to_array(i) for i in model.graph.initializer}
    for node in model.graph.node:
        if node.op_type == "Constant":
            values[node.output[0]] = numpy_helper.to_array(node.attribute[0].t)
    return values


def differentiable_values(model: onnx.ModelProto) -> set[str]:
    """Values computed from the input or a parameter (what a training graph differentiates; not constants such as
    Resize's scales or Clip's bounds)."""
    reached = {"x", *(i.name for i in model.graph.initializer)}
    for node in model.graph.node:
        if any(name in reached for name in node.input):
            reached.update(name for name in node.output if name)
    return reached


def one_op_graph(
    original: onnx.NodeProto, values: dict[str, np.ndarray], opset: int, differentiable: set[str]
) -> tuple[onnx.ModelProto, list]:
    """The node alone: its float inputs trainable initializers, its other inputs constants, loss = sum of its first
    float output. Returns the model and the trainable names (empty: nothing to differentiate)."""
    initializers, trainable, feeds, seen = [], [], [], set()
    for name in original.input:
        if not name or name in seen:
            continue
        seen.add(name)
        value = values[name]
        if (
            value.dtype == np.float32 and name in differentiable
        ):  # a trainable parameter through an Identity, as in an exported model
            initializers.append(numpy_helper.from_array(value, name + "__param"))
            trainable.append(name + "__param")
            feeds.append(helper.make_node("Identity", [name + "__param"], [name]))
        else:
            initializers.append(numpy_helper.from_array(value, name))
    node = original
    out = node.output[0]
    # the loss times a fed scale of 1: a training graph without inputs crashes ORT's Module
    loss_nodes = [
        helper.make_node("ReduceSum", [out], ["total"], keepdims=0),
        helper.make_node("Mul", ["total", "scale"], ["loss"]),
    ]
    graph = helper.make_graph(
        [*feeds, node, *loss_nodes],
        "one_op",
        [helper.make_tensor_value_info("scale", TensorProto.FLOAT, [])],
        [helper.make_tensor_value_info("loss", TensorProto.FLOAT, [])],
        initializers,
    )
    opsets = [helper.make_opsetid("", opset)]
    if node.domain:
        opsets.append(helper.make_opsetid(node.domain, 1))
    return helper.make_model(graph, opset_imports=opsets), trainable


def train_one_op(model: onnx.ModelProto, trainable: list[str], workdir: Path) -> str:
    """'trains', or the first line of what failed: generate_artifacts, the session, or a step."""
    from onnxruntime.training import artifacts, onnxblock
    from onnxruntime.training.api import CheckpointState, Module, Optimizer

    try:
        artifacts.generate_artifacts(
            model, requires_grad=trainable, loss=None, optimizer=onnxblock.optim.SGD(), artifact_directory=workdir
        )
    except Exception as err:
        return f"graph build: {_first_line(err)}"
    try:
        state = CheckpointState.load_checkpoint(str(workdir / "checkpoint"))
        module = Module(str(workdir / "training_model.onnx"), state, str(workdir / "eval_model.onnx"))
        optimizer = Optimizer(str(workdir / "optimizer_model.onnx"), module)
        module.train()
        module(np.ones((), np.float32))
        optimizer.step()
    except Exception as err:
        return f"training session: {_first_line(err)}"
    return "trains"


def _first_line(err: Exception) -> str:
    """The reason in an error's first line, without ORT's source location and C++ signature."""
    text = str(err).strip().splitlines()
    line = text[0] if text else type(err).__name__
    if "[ONNXRuntimeError]" in line:
        line = line.rsplit("[ONNXRuntimeError]", 1)[1].split(" : ", 2)[-1]
    if " was false. " in line:
        line = line.rsplit(" was false. ", 1)[1]
    return line.strip()


def survey(opset: int = 16, layers: dict | None = None) -> dict[str, OpResult]:
    """ONNX op -> whether ORT trains it, and the layers that emitted it."""
    versions.prepare()
    import onnxruntime

    onnxruntime.set_default_logger_severity(4)
    results: dict[str, OpResult] = {}
    for layer, (build, shape) in (layers or LAYERS).items():
        log.info("surveying %s", layer)
        try:
            model = export_layer(build(), shape, opset)
            values = all_values(model, shape)
            differentiable = differentiable_values(model)
        except Exception as err:
            results[f"(export of {layer})"] = OpResult(f"(export of {layer})", f"export: {_first_line(err)}", [layer])
            continue
        for node in model.graph.node:
            if node.op_type == "Constant":
                continue
            op = f"{node.domain}.{node.op_type}" if node.domain else node.op_type
            result = results.setdefault(op, OpResult(op, UNTESTED, []))
            if layer not in result.layers:
                result.layers.append(layer)
            if result.status not in (UNTESTED, CONSTANT):  # tested on a differentiable instance already
                continue
            out = values.get(node.output[0])
            one, trainable = one_op_graph(node, values, opset, differentiable)
            if out is None or out.dtype != np.float32 or not trainable:
                result.status = CONSTANT
                continue
            with tempfile.TemporaryDirectory() as tmp:
                result.status = train_one_op(one, trainable, Path(tmp))
    return results


def markdown(results: dict[str, OpResult]) -> str:
    lines = ["| ONNX op | trains in ORT | emitted by |", "|---|---|---|"]
    for op in sorted(results, key=lambda k: (results[k].trains, k.lower())):
        result = results[op]
        lines.append(f"| {op} | {result.status} | {', '.join(result.layers)} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--opset", type=int, default=16)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    import onnxruntime

    results = survey(args.opset)
    print(f"onnxruntime {onnxruntime.__version__}, torch {torch.__version__}, opset {args.opset}\n")
    print(markdown(results))


if __name__ == "__main__":
    main()
