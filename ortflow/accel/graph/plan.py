"""The graph plan: for every op ortflow's graph work touches, which path its graphs take, decided once per engine
from the graph settings (`accel.*`, the one list: `GraphSettings`), the precision and a target.

Each op module (aten_conv.py, aten_gemm.py, ..., fed_dropout.py, batchnorm.py, rewrites.py) declares its `GraphOp`
here: what it replaces, the paths it has, which the `fast` target takes, and the export symbolics and graph rewrite
that carry each path out (its gradient and shape rule are its ATen nodes' declarations, accel/graph/aten_nodes.py).
The pipeline (accel/graph/pipeline.py) applies the plan in one order for both ORT engines and the device export.

Paths:
- `torch`: an `org.pytorch.aten::ATen` node run by torch's kernels inside ORT (needs torch and ortflow's extension
  where the graph runs);
- `ort`: ORT's own operators (ONNX and com.microsoft only): what ORT runs anywhere, a phone or a browser included;
- `fed`: values the host feeds each step as graph inputs (dropout masks);
- `host`: state the host keeps around each step (BatchNorm's running statistics, updated by torch's formula).

Targets: `fast` (the default) takes ortflow's measured choices for speed on a CPU beside torch; `portable` takes
`ort` for every op, so the graphs hold only ONNX and com.microsoft operators, dropout inside the graph as ORT's
own Dropout and BatchNorm's running statistics updated by ORT's kernel inside the graph: `accel=artifacts
accel.target=portable` trains the very graphs a device would get. An op without an `ort` path is refused there,
naming the op and the module of the model it comes from.
"""

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from enum import Enum
from types import MappingProxyType
from typing import Any

from annotated_types import Ge

from ortflow.config import BF16, FP32
from ortflow.ranges import ranged


class Target(Enum):
    fast = "fast"  # ortflow's choices for speed beside torch (torch's kernels inside ORT, fed masks, host state)
    portable = "portable"  # ONNX and com.microsoft operators only: the graphs a device trains


class Path(Enum):
    torch = "torch"  # an ATen node run by torch's kernels inside ORT
    ort = "ort"  # ORT's own operators, wherever ORT runs
    fed = "fed"  # inputs the host feeds the graph each step
    host = "host"  # state the host keeps around each step

    @property
    def portable(self) -> bool:
        return self is Path.ort


# --8<-- [start:graph-settings]
@dataclass
class GraphSettings:
    """The graph settings both ORT engines share (`accel.KEY`; their engines' Settings extend this class). Each
    switchable op has its key here and its declaration in its own module (`GraphOp.setting` names the key)."""

    # fast: ortflow's measured choices for speed on a CPU beside torch. portable: ONNX and com.microsoft operators
    # only (every op ORT's own, dropout inside the graph, BatchNorm statistics updated by ORT's kernel): the graphs
    # a phone or a browser can train (ortflow-export-artifacts), at ORT's own speed; fp32 only.
    target: Target = Target.fast
    # MultiheadAttention's q/k/v split as one Split, other constant-index Gathers as Slices, before the gradient is
    # built: ORT's CPU GatherGrad was a third of the transformer's step, and the split's three whole-size SliceGrads
    # with their Sum 11% of it at d_model 512 in bf16. Off only to compare or to rule it out.
    rewrite_gathers: bool = True
    # ReLU run by torch's kernels inside ORT's graphs (relu, threshold_backward; accel/graph/aten_relu.py), not by
    # ORT: on the vision recipe (2-core Zen 5, fp32) ORTModule went from 0.76x to 0.86-1.03x eager, artifacts from
    # 0.78x to 0.82-0.87x. null: in graphs that already run torch's kernels (convolutions, bf16 GEMMs) only; alone,
    # in the fp32 transformer recipe, it cost artifacts 18% (it turns ORT's spin-waiting off).
    aten_relu: bool | None = None
    # 2-D max-pooling run by torch's kernels inside ORT's graphs (accel/graph/aten_max_pool.py): ORT's CPU MaxPool runs
    # on one thread (ResNet-18 64x64, fp32: 8.6 ms a step against torch's 4.8; artifacts 0.94x eager with it, ORTModule,
    # whose export already runs torch's, 1.00x). null: in graphs that already run torch's kernels, as aten_relu.
    aten_max_pool: bool | None = None
    # An embedding's Gather run by torch's kernels inside the artifacts engine's graphs (embedding and its dense
    # backward; accel/graph/aten_embedding.py), as ORTModule's export already runs it, instead of ORT's contending
    # GatherGrad or the OneHot @ W below (transformer recipe, bf16-mixed, 2-core Zen 5: 2.1 ms of a 58 ms step under
    # ORT's profiler). null: in graphs that already run torch's kernels, as aten_relu.
    aten_embedding: bool | None = None
    # Where ORT runs ReLU: Relu -> x * (x > 0): ORT's CPU ReluGrad runs on one thread; the Mul it becomes runs in
    # parallel.
    rewrite_relu: bool = True
    # Embedding Gather on a weight of at most this many rows -> OneHot @ W: W's gradient becomes a Gemm instead of
    # ORT's contending GatherGrad, at the cost of a (tokens x vocabulary) matmul. Measured in artifacts on the
    # transformer recipe (docs/performance.md): +13% at vocabulary 256, even at 1024, -11% at 4096. 0 = off;
    # null: 512 in artifacts, 0 in ortmodule (not measured there).
    rewrite_embedding_max_vocab: int | None = ranged(None, Ge(0))
    # Dropout -> x * mask, the masks fed as inputs, drawn each step by a fast generator seeded from torch's per-step
    # seed (so from the run's seed, resumed exactly): ORT's CPU Dropout draws its random numbers slowly, on one
    # thread. ORTModule: F.dropout (nn.Dropout, attention weights) multiplies by the masks while it exports.
    rewrite_dropout: bool = True
    # Convolutions run by torch's kernels inside ORT's graphs (ATen nodes; accel/graph/aten_conv.py), not ORT's own
    # CPU Conv/ConvGrad: a VGG-style CNN trained ~1.2x faster in both ORT engines (docs/performance.md). Transposed
    # convolutions always are (ORT's CPU build cannot differentiate ConvTranspose). Spin-waiting is then off
    # whatever allow_spinning says: spinning ORT threads would compete with torch's.
    aten_conv: bool = True
    # LayerNorm run by torch's kernels inside ORT's graphs (accel/graph/aten_layer_norm.py). null: on with
    # trainer.precision=bf16-mixed (torch's kernels already run in the graph and ORT's single-threaded
    # LayerNormalizationGrad is then the largest cost left), off in fp32, where it was slower at d_model 128 (-10
    # to -15%), no faster at 512, and turns spin-waiting off; on, it lowers artifacts' peak memory (-410 MB at
    # d_model 512).
    aten_layer_norm: bool | None = None
    # GELU's tanh approximation (GPT-2's gelu_new) run by torch's kernels inside ORT's graphs
    # (accel/graph/aten_gelu.py), not ORT's FastGelu/FastGeluGrad, whose gradient took 105 ms per (1024 x 3072) call
    # against torch's 4-10 ms on a 2-core Zen 5. null: on with trainer.precision=bf16-mixed, off in fp32.
    aten_gelu: bool | None = None
    # scaled_dot_product_attention run by torch's fused bf16 kernel inside ORT's graphs (accel/graph/aten_attention.py)
    # where eager runs that kernel (no attention dropout), not written out as fp32 MatMuls and Softmax, whose
    # probabilities the backward keeps (14.7 MB a layer at the Qwen2 LoRA shape). null: on with
    # trainer.precision=bf16-mixed, off in fp32.
    aten_attention: bool | None = None
    # Cross-entropy run by torch's kernels inside ORT's graphs (accel/graph/aten_cross_entropy.py), not ORT's
    # SoftmaxCrossEntropyLoss, which took 237 ms forward + 53 ms gradient on GPT-2's (1024 x 50,257) logits against
    # ~95 ms for torch's on a 2-core Zen 5. null: on with trainer.precision=bf16-mixed, off in fp32.
    aten_cross_entropy: bool | None = None
    # bf16 handed from one bf16 GEMM to the next through a ReLU and a dropout mask (a transformer's feed-forward
    # block), the ReLU and the mask then run by torch (accel/graph/bf16_edges.py), through GPT-2's GELU and a gated
    # MLP's SiLU-and-multiply (bf16_gelu_edges.py, bf16_gated_edges.py), and a CNN's feature maps from
    # convolution to convolution through BatchNorm, ReLU, residual adds and pooling run by torch on bf16
    # (accel/graph/bf16_maps.py), as autocast hands bf16 along: the vision recipe converted 48x eager bf16's volume a
    # step without it, 1.0x with it. null: on with trainer.precision=bf16-mixed; fp32 has no bf16 edges.
    bf16_edges: bool | None = None


# --8<-- [end:graph-settings]


def target_of(settings: Any) -> Target:
    """The target an engine's settings (or accel config node) name; fast where they name none."""
    value = getattr(settings, "target", None)
    return Target.fast if value is None else Target(value.value if isinstance(value, Enum) else value)


def problems(accel: Any, precision: str) -> list[str]:
    """The graph settings' rules across keys: the portable target trains in fp32 (ORT's own kernels have no bf16
    GEMM on CPU; bf16-mixed there is torch's kernels inside ORT)."""
    if target_of(accel) is Target.portable and precision != FP32:
        return [
            f"accel.target=portable with trainer.precision={precision}: the portable target runs every op with ONNX "
            "Runtime's own kernels, which have no bf16 matrix multiply on CPU (ortflow's bf16-mixed runs torch's "
            "kernels inside ORT's graphs, which a device does not have). Use trainer.precision=fp32, or "
            "accel.target=fast."
        ]
    return []


def setting_names() -> list[str]:
    """Every graph setting's key (`accel.KEY`)."""
    return [f.name for f in fields(GraphSettings)]


def switch(settings: Any, key: str, precision: str) -> bool:
    """A boolean graph setting's value, null meaning "on in bf16-mixed, off in fp32"."""
    value = getattr(settings, key)
    return precision == BF16 if value is None else bool(value)


# A symbolic factory: given the plan and the symbolic that would run without ortflow (ORT's or torch's own), the
# symbolic to register for one torch operator while an ORT engine exports.
SymbolicFactory = Callable[["GraphPlan", Callable[..., Any]], Callable[..., Any]]


@dataclass(frozen=True)
class GraphOp:
    """One op of the graph work, declared by the module that implements it."""

    name: str  # the plan's key (run.json's graph_plan.ops)
    replaces: str  # what it replaces: the torch operator or module, the ONNX op ORT would run otherwise
    module: str  # the module implementing it
    paths: tuple[Path, ...]  # the paths it has (Path.ort among them: ORT can run it natively)
    # The fast target's path from (settings, precision, engine name); the portable target takes Path.ort.
    choose: Callable[[Any, str, str], Path]
    setting: str | None = None  # the GraphSettings key that switches it (None: precision and target decide)
    # torch operator ("::_convolution") -> factory of the symbolic in force while an ORT engine exports
    symbolics: Mapping[str, SymbolicFactory] = field(default_factory=lambda: MappingProxyType({}))
    # Applied to the exported forward graph, in the order of pipeline.ORDER (which names every op with a rewrite):
    # `rewrite(model, plan, work)` reads its own path from the plan and counts what it changed into the work
    # (`GraphWork.count`: the engine's graph fixes).
    rewrite: Callable[[Any, "GraphPlan", "GraphWork"], None] | None = None


OPS: dict[str, GraphOp] = {}


@dataclass
class GraphWork:
    """One exported forward graph's way through the pipeline: what the engine hands in (which parameters train,
    example inputs, how it feeds dropout masks) and what the rewrites hand back (their counts, the masks to feed)."""

    trainable: set[str]  # the trainable parameters' names in the graph
    frozen: set[str] = field(default_factory=set)  # the frozen ones'
    feeds: dict[str, Any] | None = None  # example inputs by graph input name, to find shapes inference cannot
    masks_as_inputs: bool = False  # the engine feeds dropout masks as graph inputs (the artifacts engine's way)
    fixes: dict[str, int] = field(default_factory=dict)  # graph fix or rewrite -> nodes it changed
    masks: list[Any] = field(default_factory=list)  # the DropoutMasks the engine must feed (masks_as_inputs)
    torch_nodes: int = 0  # ATen nodes torch runs in the prepared graph

    def count(self, name: str, changed: int) -> None:
        if changed:
            self.fixes[name] = self.fixes.get(name, 0) + changed


def declare(op: GraphOp) -> GraphOp:
    """Add an op to the registry (each op module, once, at import). Where its rewrite runs: pipeline.ORDER."""
    OPS[op.name] = op
    return op


def one_path(
    name: str,
    path: Path,
    *,
    replaces: str,
    module: str,
    setting: str | None = None,
    symbolics: Mapping[str, SymbolicFactory] | None = None,
    rewrite: Callable[[Any, "GraphPlan", "GraphWork"], None] | None = None,
) -> GraphOp:
    """Declare an op with a single path, whatever the settings and the precision (a graph fix ORT needs, a rewrite
    a boolean `setting` turns off inside its own code, an op only torch's kernels run)."""

    def choose(settings: Any, precision: str, engine: str) -> Path:
        return path

    named = MappingProxyType({}) if symbolics is None else symbolics
    return declare(GraphOp(name, replaces, module, (path,), choose, setting, named, rewrite))


def torch_or_ort(
    name: str,
    *,
    replaces: str,
    module: str,
    setting: str | None = None,
    by_torch: Callable[[Any, str], bool] | None = None,
    symbolics: Mapping[str, SymbolicFactory] | None = None,
    rewrite: Callable[[Any, "GraphPlan", "GraphWork"], None] | None = None,
) -> GraphOp:
    """Declare an op that runs either in torch's kernels (Path.torch: ortflow's ATen nodes) or as ORT's own
    (Path.ort), the fast target taking torch's where `by_torch(settings, precision)`; by default where the boolean
    setting `setting` says so (`switch`: null is on in bf16-mixed). The way the ATen-node ops declare themselves."""
    if by_torch is None:
        if setting is None:
            raise ValueError(f"graph op {name}: torch_or_ort needs a setting or by_torch")
        key = setting

        def by_torch(settings: Any, precision: str) -> bool:
            return switch(settings, key, precision)

    chosen = by_torch

    def choose(settings: Any, precision: str, engine: str) -> Path:
        return Path.torch if chosen(settings, precision) else Path.ort

    named = MappingProxyType({}) if symbolics is None else symbolics
    return declare(GraphOp(name, replaces, module, (Path.torch, Path.ort), choose, setting, named, rewrite))


class NoPortablePath(Exception):
    """The portable target met an op of the model that has no ORT-native path. Raised where the graph work meets it
    (an export symbolic, a graph rewrite); the engine names the model's module from `scope` (the exporter's module
    scope, `/up/up.0/`) in the user's error."""

    def __init__(self, what: str, scope: str, why: str) -> None:
        super().__init__(f"{what} at {scope or 'an unknown module'}: {why}")
        self.what, self.scope, self.why = what, scope, why


def refusal_in(err: BaseException | None) -> NoPortablePath | None:
    """The NoPortablePath among an exception's causes and contexts (torch's exporter and ORTModule wrap what a
    symbolic raises, some with a new cause and the original as context), or None."""
    seen: set[int] = set()
    stack = [err]
    while stack:
        err = stack.pop()
        if err is None or id(err) in seen:
            continue
        if isinstance(err, NoPortablePath):
            return err
        seen.add(id(err))
        stack += [err.__context__, err.__cause__]
    return None


@dataclass(frozen=True)
class GraphPlan:
    """Each op's path, computed once (`compute`) for one engine."""

    target: Target
    engine: str  # the engine's name (accel=...)
    precision: str
    settings: Any  # the GraphSettings (an engine's Settings) it was computed from
    paths: Mapping[str, Path]
    # The ops of the model the target has no path for, as the graph work met them (an exporter or ORTModule may wrap
    # the exception, losing it; the engine reads them here)
    refusals: list[NoPortablePath] = field(default_factory=list, compare=False)
    # The ops whose rewrites changed a graph made under this plan (the pipeline adds them)
    applied: set[str] = field(default_factory=set, compare=False)
    # The nodes ortflow's graph work wrote into the graphs made under this plan (the rewrites' nodes, and the ATen
    # nodes running ortflow's operators), and the values they produce: an error that ORT raises at one of them, or
    # about one of those values, is possibly ortflow's, not the model's (accel/failures.py: written_by_ortflow)
    written_nodes: set[str] = field(default_factory=set, compare=False)
    written_values: set[str] = field(default_factory=set, compare=False)
    written_readers: set[str] = field(default_factory=set, compare=False)  # the model's nodes reading such values

    @classmethod
    def compute(cls, settings: Any, precision: str, engine: str) -> "GraphPlan":
        target = target_of(settings)
        paths = {}
        for op in OPS.values():
            # portable: ORT's own everywhere; an op without that path refuses where the model has it
            paths[op.name] = Path.ort if target is Target.portable else op.choose(settings, precision, engine)
        return cls(target, engine, precision, settings, MappingProxyType(paths))

    def path(self, op: str) -> Path:
        return self.paths[op]

    def by_torch(self, op: str) -> bool:
        return self.paths[op] is Path.torch

    @property
    def portable(self) -> bool:
        return self.target is Target.portable

    @property
    def torch_kernels(self) -> bool:
        """Whether the plan sends any op to torch's kernels (then ORT's idle threads must not spin-wait against
        them, where the engine cannot count the nodes its graphs really hold before ORT opens its sessions)."""
        return any(path is Path.torch for path in self.paths.values())

    def record(self, operators_portable: bool | None = None) -> dict[str, Any]:
        """run.json's `graph_plan`: the target, each op's path, and whether the graphs the engine trained are what a
        device can train: only ONNX and com.microsoft operators (`operators_portable`, read from the graphs; None:
        not known yet) and no op of the model on a path a device lacks (fed masks, statistics kept by the host)."""
        by_paths = all(self.paths[op].portable for op in self.applied)
        return {
            "target": self.target.value,
            "ops": {op: path.value for op, path in self.paths.items()},
            "portable": None if operators_portable is None else operators_portable and by_paths,
        }
