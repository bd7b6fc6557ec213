"""`accel=artifacts`: torch.onnx.export (training mode) -> generate_artifacts -> onnxruntime.training.api.

Loss and gradients run inside ORT; the optimizer too, except AdamW with `optim.fused` (the default), which torch's
fused kernel steps on ORT's own buffers (accel/buffer_adamw.py: a quarter of ORT's AdamW time). The artifacts
(forward.onnx, training/eval/optimizer models, checkpoint) are written to <run dir>/onnx/. Final weights come back as
a torch state_dict under the original parameter names. Owns its config checks (opset range, what ORT's optimizer
graphs support, no multi-process wrappers) and its own ORT session settings.
"""

import contextlib
import logging
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import torch
from annotated_types import Ge, Interval
from omegaconf import DictConfig
from torch import nn

from ortflow.accel import buffer_adamw, failures, first_step, torch_adamw
from ortflow.accel.compat import export_warnings, ort, torch_onnx, versions
from ortflow.accel.engine import EngineContext, pad_batch, pad_eval_batch
from ortflow.accel.graph import aten_cross_entropy, aten_nodes, batchnorm, bf16_maps, bf16_weights, pipeline
from ortflow.accel.graph import plan as graph_plan
from ortflow.accel.graph.masks import MaskSampler
from ortflow.accel.graph.plan import GraphSettings
from ortflow.accel.none import debug_problems
from ortflow.config import OptimConfig, OptimName
from ortflow.distributed import MULTI_PROCESS
from ortflow.errors import OrtflowError, root_reason
from ortflow.files import as_write_failure
from ortflow.model import state_dict
from ortflow.model.hooks import PROBE_SAMPLES
from ortflow.model.probe import buffers_kept, training_forward_probe
from ortflow.ranges import ranged
from ortflow.report import terminal
from ortflow.step import clipping
from ortflow.step.batch import Inputs, Layout
from ortflow.step.loss import EvalResult, Loss

log = logging.getLogger(__name__)

NAME = "artifacts"
TITLE = "ONNX Runtime training API (export -> generate_artifacts)"  # the run header's "what executes it"
SIMPLICITY = 2  # ORT runs the whole step (accel=auto picks the simplest of equals)
EXECUTED_BY = "onnxruntime"  # describe()["executed_by"] when it ran as it should
RUNS_IN_STEP = frozenset()  # ORT runs the whole step: no hook or state update of torch's
MIN_OPSET = 14  # the lowest opset ORT's training graphs (SoftmaxCrossEntropyLoss, LayerNormalization grads) build at


@dataclass
class Settings(GraphSettings):
    """conf/accel/artifacts.yaml: the engine's own settings; the graph settings (target, rewrite_*, aten_*) are the
    graph plan's, shared with the ortmodule engine (ortflow/accel/graph/plan.py: GraphSettings)."""

    _target_: str = "ortflow.accel.artifacts.build"
    # Below 14 ORT's training graph cannot be built; at 17 ORT's gradient builder breaks on LayerNormalization.
    opset: int = ranged(versions.MAX_ARTIFACTS_OPSET, Interval(ge=MIN_OPSET, le=versions.MAX_ARTIFACTS_OPSET))
    intra_op_threads: int | None = ranged(
        None, Ge(1)
    )  # ORT's intra-op threads; null = as many as torch uses (one per physical core)
    allow_spinning: bool = True  # ORT's default; everything runs inside ORT here, so nothing competes with it
    # The first-step check (accel/first_step.py): before the first update, the engine's gradients on the first batch
    # against eager's on the same batch and weights; a difference beyond rounding stops the run. false: trust the
    # engine (the run.json record says the check was off).
    verify: bool = True


def problems(cfg: DictConfig) -> list[str]:
    found = debug_problems(cfg, NAME) + graph_plan.problems(cfg.accel, cfg.trainer.precision)
    if cfg.optim.name == OptimName.sgd and (cfg.optim.momentum or cfg.optim.weight_decay):
        found.append(
            "optim.momentum/optim.weight_decay: ORT's SGD graph (accel=artifacts) has neither; set both to 0 "
            "or use optim=adamw."
        )
    multi = [w for w in cfg.distributed.wrappers if w in MULTI_PROCESS]
    if multi:
        steps = ""
        if multi[0] == "deepspeed":
            steps = " (and DeepSpeed steps a torch optimizer, where this engine's is an ORT graph)"
        found.append(
            f"accel=artifacts with {multi[0]}: ONNX Runtime's training API (artifacts) has no data parallelism (no "
            f"gradient all-reduce between processes){steps}. Use accel=ortmodule or accel=none with "
            f"distributed={multi[0]}."
        )
    return found


def custom_functions(model: nn.Module, layout: Layout, inputs: tuple[torch.Tensor, ...]) -> list[str]:
    """The custom torch.autograd.Function classes a forward pass of `model` goes through (found in its autograd
    graph). The ONNX export inlines their forward ops, so ORT would differentiate those ops and silently ignore the
    Function's own backward (a straight-through estimator, say). The forward takes the batch's first samples: which
    Functions it goes through does not depend on the batch size, and the fp32 activations of a whole batch were the
    build's largest memory on a 359M-parameter model (2.2 GB at batch 4)."""
    inputs = tuple(t[:PROBE_SAMPLES] for t in inputs)
    found, seen, stack = set(), set(), []
    training = model.training
    model.eval()  # no dropout draws, no BatchNorm statistics updated by this probe
    try:
        with torch.enable_grad():
            out = layout.call(model, inputs)
    finally:
        model.train(training)
    if isinstance(out, torch.Tensor) and out.grad_fn is not None:
        stack.append(out.grad_fn)
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if isinstance(node, torch.autograd.function.BackwardCFunction):
            found.add(type(node).__name__.removesuffix("Backward"))
        stack += [next_node for next_node, _ in node.next_functions]
    return sorted(found)


@contextlib.contextmanager
def _cannot_train(
    what: str, by: str = "ORT's training API", model: nn.Module | None = None, plan: graph_plan.GraphPlan | None = None
) -> Iterator[None]:
    """Errors while the model is exported or ORT builds or loads its graphs, as one paragraph naming the op, the
    module of `model` that produced it, and what works instead (accel/failures.py); one at what the graph work wrote
    into the graphs made under `plan` is possibly ortflow's (failures.GraphWorkError)."""
    try:
        yield
    except failures.GraphWorkError:
        raise
    except (*failures.engine_errors(), onnx.checker.ValidationError, OSError) as err:
        if (refused := failures.no_portable_path(err, NAME, model)) is not None:
            raise refused from None
        if (failure := as_write_failure(err, "the run dir's onnx/ folder")) is not None:
            raise failure from err  # the model is fine: the disk is full
        if isinstance(err, OSError) or not failures.is_model_limit(err):
            raise  # ortflow's own bug, or the user's code: the traceback says where
        if (where := failures.written_by_ortflow(err, plan)) is not None:
            raise failures.possibly_ortflows(err, NAME, f"{what} ({by})", where) from err
        raise OrtflowError(failures.paragraph(err, NAME, f"{what} ({by})", model, INSTEAD)) from err


INSTEAD = "accel=ortmodule may train it (it runs some ops through torch); accel=none always does."


def build(ctx: EngineContext, **settings: Any) -> "ArtifactsEngine":
    return ArtifactsEngine(ctx, Settings(**settings))


_PREFIX = "model."  # the exported wrappers store the user's model as `.model`: initializers carry this prefix


class OutputForLoss(nn.Module):
    """Exported when ORT has a loss block for the loss: the model's output in the layout that block takes (for
    cross-entropy, logits flattened to (N, C), as ORT's SoftmaxCrossEntropyLoss expects)."""

    def __init__(self, model: nn.Module, loss: Loss, layout: Layout, targets: torch.Tensor) -> None:
        super().__init__()
        self.model, self.loss, self.layout, self.targets = model, loss, layout, targets  # targets: their shape

    def forward(self, *inputs: torch.Tensor) -> torch.Tensor:
        return self.loss.flat_output(self.layout.call(self.model, inputs), self.targets)


class OutputAndLoss(nn.Module):
    """Exported when ORT has no loss block for the loss (label smoothing, a user's loss): the loss is traced into
    the graph with the model, taking the targets as the graph's last input; outputs (loss, output)."""

    def __init__(self, model: nn.Module, loss: Loss, layout: Layout, scale: float = 1.0) -> None:
        super().__init__()
        self.model, self.loss, self.layout, self.scale = model, loss, layout, scale

    def forward(self, *tensors: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        *inputs, targets = tensors
        output = self.layout.call(self.model, tuple(inputs))
        loss = self.loss(output, targets)
        return (loss * self.scale if self.scale != 1.0 else loss), output


def _optimizer_block(optim: OptimConfig, grad_clip: float | None):
    from onnxruntime.training import onnxblock

    clip = clipping.ort_clip_block(grad_clip)
    if optim.name == OptimName.adamw:
        return torch_adamw.adamw_block(tuple(optim.betas), optim.eps, optim.weight_decay, clip)  # torch's conventions
    return onnxblock.optim.SGD(clip_grad=clip)


def _returns_loss_only(training: onnx.ModelProto, output: str) -> None:
    """The training graph without the model's output among its outputs: the training step reads the loss only, and
    ORT then copies no (batch x classes) output out of its session each step (GPT-2's logits: 206 MB); a fused
    LM-head loss computes no fp32 logits at all. The value stays typed (ORT infers no ATen node's types)."""
    graph = training.graph
    graph.value_info.extend(o for o in graph.output if o.name == output)
    kept = [o for o in graph.output if o.name != output]
    del graph.output[:]
    graph.output.extend(kept)
    aten_cross_entropy.stop_returning_logits(training)


def _loss(fetched: tuple | np.ndarray) -> float:
    """The loss of a training-graph run (which returns it alone: `_returns_loss_only`; a tuple's first value
    otherwise)."""
    return float(fetched[0] if isinstance(fetched, tuple) else fetched)


class ArtifactsEngine:
    """Trains through onnxruntime.training.api's CheckpointState, Module and Optimizer."""

    name = NAME

    def __init__(self, ctx: EngineContext, settings: Settings) -> None:
        """ctx.model's current weights become the initial weights; ctx.example's shape is the one ORT trains on.

        The build, step by step: `_plan` (where each part of the step runs; what the engine refuses), `_find_norms`
        (BatchNorm's running statistics), `_prepare_forward` (the model exported and rewritten: the forward graph),
        `_generate` (ORT's training, eval and optimizer graphs and checkpoint), `_session_settings`, `_open` (the
        sessions and the optimizer)."""
        versions.prepare()
        example_inputs = self._plan(ctx, settings)
        self._find_norms(example_inputs)
        forward = self._prepare_forward(ctx, settings, example_inputs)
        self._generate(forward, ctx.optim, ctx.grad_clip)
        self._session_settings(ctx, settings)
        loading = _cannot_train("load its training and eval graphs", model=self.model, plan=self.plan)
        with terminal.native_stderr("onnxruntime"), loading:
            self._open(self.onnx_dir / "checkpoint", ctx.optim.lr)
        self.last_grad_norm: float | None = None
        self.steps = 0
        self.evals = 0
        tensors = len(dict(self.model.named_parameters()))
        log.info("artifacts in %s; ORT trains %d parameter tensors", self.onnx_dir, tensors)

    def _plan(self, ctx: EngineContext, settings: Settings) -> tuple[torch.Tensor, ...]:
        """The graph plan (accel/graph/plan.py) and the engine's refusals of what it cannot train (unsupported
        BatchNorms, hooks and state updates, custom autograd Functions); returns the example's input tensors."""
        import onnxruntime

        onnxruntime.set_default_logger_severity(3)  # ORT's graph-transformer chatter is INFO; keep errors only
        self.plan = graph_plan.GraphPlan.compute(settings, ctx.precision, NAME)
        model = self.model = ctx.model
        batchnorm.refuse_unsupported(model, NAME, self.plan)
        ctx.refuse_unrun(NAME, RUNS_IN_STEP)  # parameter and module hooks, state a forward changes
        self.loss, self.layout = ctx.loss, ctx.layout
        self.batch_size = ctx.batch_size
        self.accumulate = ctx.accumulate
        self.onnx_dir = ctx.onnx_dir
        self.onnx_dir.mkdir(parents=True, exist_ok=True)
        model.train()
        if functions := custom_functions(model, self.layout, self.layout.flatten(ctx.example[0])):
            raise OrtflowError(
                f"accel=artifacts cannot train this model: it uses the custom torch.autograd.Function "
                f"{', '.join(functions)}. The ONNX export keeps only its forward ops, so ORT would differentiate "
                "those and silently ignore the Function's own backward. Use accel=ortmodule (it runs such Functions "
                "through torch, backward included) or accel=none."
            )
        return self.layout.flatten(ctx.example[0])

    def _find_norms(self, example_inputs: tuple[torch.Tensor, ...]) -> None:
        """BatchNorm running statistics: ORT writes each batch's statistics into its state's tensors, ortflow applies
        torch's update to the torch buffers after every training forward (accel/graph/batchnorm.py); on the plan's
        ORT path ORT's kernel keeps them inside the graph, and the torch buffers follow ORT's state."""
        model = self.model
        self.norms = batchnorm.BatchNorms.find(model, lambda: self.layout.call(model, example_inputs), NAME)
        self.statistics_by_ort = self.plan.path(batchnorm.NAME) is graph_plan.Path.ort
        self.batch_statistics = batchnorm.BatchStatistics.of(model)

    def _prepare_forward(
        self, ctx: EngineContext, settings: Settings, example_inputs: tuple[torch.Tensor, ...]
    ) -> onnx.ModelProto:
        """The forward graph ORT builds the training graph from (`_export`), and what its rewrites leave the engine:
        the graph fixes, the dropout masks fed as inputs, torch's kernels inside ORT, the first-step check."""
        # With accumulation the exported loss is divided by the micro-batch count (ORT adds the gradients up).
        # The loss by torch (accel.aten_cross_entropy): the loss is exported too, its SoftmaxCrossEntropyLoss torch's.
        by_torch = self.plan.by_torch(aten_cross_entropy.NAME)
        self.loss_block = self.loss.ort_block() if self.accumulate == 1 and not by_torch else None
        forward, work = self._export(ctx, settings.opset, example_inputs)
        self.graph_fixes, self.masks = work.fixes, work.masks
        self.check = first_step.Pending(settings.verify, first_step.ort_dropout(forward))
        self.aten_nodes = work.torch_nodes  # torch's kernels inside ORT (accel/graph/aten_nodes.py)
        if self.aten_nodes:
            ort.load_aten_executor()
        pipeline.register_gradients(work)
        self.sampler = MaskSampler(self.masks)
        self.eval_masks = [np.ones(m.shape, m.dtype) for m in self.masks]  # evaluation keeps every unit
        return forward

    def _session_settings(self, ctx: EngineContext, settings: Settings) -> None:
        """The optimizer's kind, ORT's session options and threads, and the graph names of the trainable parameters."""
        # AdamW by torch's fused kernel over ORT's buffers (optim.fused); else ORT's optimizer graph
        self.optim, self.grad_clip = ctx.optim, ctx.grad_clip
        self.fused_adamw = ctx.optim.name == OptimName.adamw and ctx.optim.fused
        import onnxruntime

        self.options = onnxruntime.SessionOptions()
        self.options.log_severity_level = 3  # errors only: ORT logs every graph transformer it applies at INFO
        # Torch's kernels run inside ORT's graphs with ATen nodes: idle ORT threads must not spin against them.
        self.intra_op_threads = settings.intra_op_threads
        self.allow_spinning = settings.allow_spinning and not self.aten_nodes
        ort.apply_session_settings(self.options, self.intra_op_threads, self.allow_spinning)
        self.trainable = [_PREFIX + n for n, p in self.model.named_parameters() if p.requires_grad]

    def _export(
        self, ctx: EngineContext, opset: int, example_inputs: tuple[torch.Tensor, ...]
    ) -> tuple[onnx.ModelProto, graph_plan.GraphWork]:
        """The model (with its loss, or in the layout ORT's loss block takes) exported in training mode under the
        plan, and the graph pipeline's rewrites on it: the forward graph ORT builds the training graph from."""
        model, example_targets = self.model, ctx.example[1]
        names = [f"input_{i}" for i in range(len(example_inputs))] if len(example_inputs) > 1 else ["input"]
        if self.loss_block is not None:  # ORT's own loss block on the exported output
            exported: nn.Module = OutputForLoss(model, self.loss, self.layout, example_targets)
            args, outputs = example_inputs, ["output"]
        else:  # the loss is exported with the model
            exported = OutputAndLoss(model, self.loss, self.layout, 1.0 / self.accumulate)
            args = (*example_inputs, example_targets)
            names, outputs = [*names, "targets"], ["loss", "output"]
        forward_path = self.onnx_dir / "forward.onnx"
        with (
            export_warnings.expected(),
            _cannot_train("export the model (and its loss) to ONNX", "torch.onnx.export", model),
            training_forward_probe(model),  # the export traces one training forward: its BatchNorm update is undone
            pipeline.exporting(self.plan, opset, exported),
        ):
            torch_onnx.export_training_onnx(exported, args, forward_path, opset, names, outputs)
        forward = onnx.load(str(forward_path))
        work = graph_plan.GraphWork(
            trainable={_PREFIX + n for n, p in model.named_parameters() if p.requires_grad},
            frozen={_PREFIX + n for n, p in model.named_parameters() if not p.requires_grad},
            feeds={name: t.numpy() for name, t in zip(names, args, strict=True)},
            masks_as_inputs=True,
        )
        with _cannot_train("prepare its graphs", model=model):
            pipeline.prepare(forward, self.plan, work)
        return forward, work

    def _generate(self, forward: onnx.ModelProto, optim: OptimConfig, grad_clip: float | None) -> None:
        """ORT's training, eval and optimizer models and checkpoint from the prepared forward graph, into onnx_dir."""
        from onnxruntime.training import artifacts

        model, onnx_dir = self.model, self.onnx_dir
        params = dict(model.named_parameters())
        # The running statistics become (frozen) checkpoint-state tensors: ORT's eval graph reads them from there.
        self.running = [(_PREFIX + s.name + ".running_mean", _PREFIX + s.name + ".running_var") for s in self.sites]
        initializers = {i.name for i in forward.graph.initializer}
        if missing := [name for pair in self.running for name in pair if name not in initializers]:
            raise OrtflowError(f"accel=artifacts: the exported graph has no initializer {missing[0]}.")
        with (
            terminal.native_stderr("onnxruntime"),
            ort.quiet_root_logger(),
            _cannot_train("build its training graph", "generate_artifacts", model, self.plan),
        ):
            artifacts.generate_artifacts(
                forward,
                requires_grad=[_PREFIX + n for n, p in params.items() if p.requires_grad],
                frozen_params=[_PREFIX + n for n, p in params.items() if not p.requires_grad]
                + [name for pair in self.running for name in pair],
                loss=self.loss_block,  # None: the graph's first output ("loss") is the loss
                optimizer=_optimizer_block(optim, grad_clip),
                artifact_directory=onnx_dir,
                additional_output_names=["output"] if self.loss_block is not None else None,
            )
        training_path = onnx_dir / "training_model.onnx"
        training_model = onnx.load(str(training_path))  # parameters are graph inputs: a small file
        if self.aten_nodes:
            aten_nodes.type_gradient_outputs(training_model)
        _returns_loss_only(training_model, "output")
        onnx.save(training_model, str(training_path))
        eval_path = onnx_dir / "eval_model.onnx"
        eval_model = onnx.load(str(eval_path))
        ort_norms = any(node.op_type == "BatchNormalization" for node in forward.graph.node)
        if ort_norms:
            self.graph_fixes["eval_batchnorm_outputs"] = batchnorm.inference_batch_norms(eval_model)
        if bf16_norms := bf16_maps.eval_batch_norms(eval_model):  # bf16 BatchNorms: their eval form
            self.graph_fixes["eval_batchnorms_bf16"] = bf16_norms
        if ort_norms or bf16_norms:
            onnx.save(eval_model, str(eval_path))
        optimizer_model = onnx.load(str(onnx_dir / "optimizer_model.onnx"))
        self.graphs_portable = pipeline.portable(training_model, eval_model, optimizer_model)

    def _open(self, checkpoint: Path, lr: float) -> None:
        """Training session, eval session and optimizer over the ORT checkpoint file `checkpoint`."""
        from onnxruntime.training import api

        self.state = api.CheckpointState.load_checkpoint(str(checkpoint))
        # Profiling (ortflow-bench --profile): ORT would write the training and eval sessions' profiles into one
        # file, so the eval session (unused there) is left out and the optimizer's session gets a file of its own.
        eval_model = None if ort.profiling() else str(self.onnx_dir / "eval_model.onnx")
        self.module = api.Module(
            str(self.onnx_dir / "training_model.onnx"), self.state, eval_model, session_options=self.options
        )
        self._share_weights()
        if self.fused_adamw:
            self.optimizer = buffer_adamw.BufferAdamW(self.state, self.trainable, self.optim, self.grad_clip, lr)
        else:
            self.optimizer = self._ort_optimizer(lr)
        self._write_running_statistics()  # the torch buffers own them (a resumed run: the checkpoint's)

    def _share_weights(self) -> None:
        """The torch model's parameters become views of the weights ORT's state holds (DLPack, no copy): the engine
        keeps one copy of the model, not two (344 MB less on the GPT-2-124M shape, 1.44 GB on the Qwen2 LoRA shape),
        and the torch model holds the weights ORT trains, step by step (the first-step check's eager side, a
        checkpoint). A resume's new state is shared the same way. Every parameter is one of the state's tensors: the
        exported graph holds each as an initializer, and generate_artifacts put them all in the checkpoint."""
        with torch.no_grad():
            for name, param in self.model.named_parameters():
                weights = ort.buffer_view(self.state._state.get_parameter(_PREFIX + name).data)
                if weights.shape != param.shape or weights.dtype != param.dtype:
                    raise OrtflowError(
                        f"accel=artifacts: ORT's state holds the parameter {name} as {weights.dtype} "
                        f"{tuple(weights.shape)}, the model as {param.dtype} {tuple(param.shape)}."
                    )
                param.data = weights

    def _ort_optimizer(self, lr: float) -> Any:
        """ORT's training-API Optimizer over the module (its optimizer graph); profiled into a file of its own."""
        import onnxruntime

        options = None
        if ort.profiling():
            options = onnxruntime.SessionOptions()
            ort.apply_session_settings(options, self.intra_op_threads, self.allow_spinning, "ort_profile_optimizer")
        optimizer = ort.ort_optimizer(self.onnx_dir / "optimizer_model.onnx", self.module, options)
        optimizer.set_learning_rate(lr)
        return optimizer

    @property
    def sites(self) -> list[batchnorm.Site]:
        return self.norms.sites if self.norms is not None else []

    def _write_running_statistics(self) -> None:
        """The torch buffers' running statistics into ORT's state (where the eval graph reads them)."""
        for site, (mean, var) in zip(self.sites, self.running, strict=True):
            self.state.parameters[mean].data = site.module.running_mean.numpy().copy()
            self.state.parameters[var].data = site.module.running_var.numpy().copy()

    def _serve_frozen_weights(self) -> None:
        """Before each run of a graph: the bf16 GEMM nodes' copies of frozen weights (accel/graph/bf16_weights.py) are
        of this engine's ORT state, valid while it is the same state (a resume opens a new one)."""
        if self.aten_nodes:
            bf16_weights.CACHE.serve_ort_state(self.state)

    def _training_forward(self, feeds: list[np.ndarray]) -> float:
        """One call of the training graph (forward and backward, gradients added up); with BatchNorm, torch's update
        of the running statistics from the batch statistics ORT writes into its state (accel/graph/batchnorm.py)."""
        self._serve_frozen_weights()
        if self.norms is None:
            return _loss(self.module(*feeds))
        if self.statistics_by_ort:  # ORT's kernel updated them in its state: the torch buffers follow
            loss = _loss(self.module(*feeds))
            for site, (mean, var) in zip(self.sites, self.running, strict=True):
                site.module.running_mean.copy_(torch.from_numpy(np.array(self.state.parameters[mean].data)))
                site.module.running_var.copy_(torch.from_numpy(np.array(self.state.parameters[var].data)))
            self.norms.counted()
            return loss
        kept = self.norms.keep()
        for site, (_, var) in zip(self.sites, self.running, strict=True):
            self.state.parameters[var].data = np.full(site.module.running_var.shape, batchnorm.UNWRITTEN, np.float32)
        loss = _loss(self.module(*feeds))
        batch = [(self.state.parameters[mean].data, self.state.parameters[var].data) for mean, var in self.running]
        self.norms.after(kept, batch)
        self._write_running_statistics()
        return loss

    def _feeds(self, tensors: tuple[torch.Tensor, ...], targets: torch.Tensor, train: bool) -> list[np.ndarray]:
        """The session's inputs in its order: the batch's tensors and targets, and (with rewrite_dropout) the
        dropout masks, freshly drawn for a training step and all ones for evaluation."""
        flat_targets = self.loss.flat_targets(targets) if self.loss_block is not None else targets
        given = [t.numpy() for t in (*tensors, flat_targets)]
        if not self.masks:
            return given
        drawn = self.sampler.draw() if train else self.eval_masks
        by_name = dict(zip((m.name for m in self.masks), drawn, strict=True))
        for mask in self.masks:  # a mask applied by a torch-kernel node: its scale beside it (1: evaluation)
            if mask.scale_input:
                by_name[mask.scale_input] = mask.scale if train else np.array(1.0, dtype=np.float32)
        batch = iter(given)
        return [by_name[name] if name in by_name else next(batch) for name in self.module.input_names()]

    def train_step(self, inputs: Inputs, targets: torch.Tensor) -> float:
        return self.train_micro([(inputs, targets)])

    def train_micro(self, micro: Sequence[tuple[Inputs, torch.Tensor]]) -> float:
        """ORT's training API adds each micro-batch's gradients into its gradient buffers (the exported loss is
        already divided by the micro-batch count when it is more than 1); then the norm, the step, the reset."""
        if len(micro) != self.accumulate:
            raise ValueError(f"this engine was built for {self.accumulate} micro-batches a step, got {len(micro)}")
        self.module.train()
        # the check on the step itself where its gradients are the batch's own (no masks drawn, one micro-batch)
        in_step = self.check.due and len(micro) == 1 and not self.masks
        if not in_step:
            self.check.before_first_update(lambda: self._verify(*micro[0]))
        losses = []
        for inputs, targets in micro:
            self.batch_statistics.check_training_batch(targets.size(0), self.batch_size, NAME)
            tensors, padded = pad_batch(self.layout.flatten(inputs), targets, self.batch_size, self.loss)
            if in_step:
                eager_loss = first_step.eager_module(self.model, self.loss, self.layout, self.plan.precision)
                eager = first_step.eager_side(self.model, eager_loss, (*tensors, padded))
            feeds = self._feeds(tensors, padded, train=True)
            with (
                torch.profiler.record_function("ortflow::ort_training_graph"),
                failures.explained(NAME, "run a training step", self.model, INSTEAD, self.plan),
            ):
                loss = self._training_forward(feeds)
            losses.append(loss * self.accumulate)
            if not math.isfinite(losses[-1]):
                break
        mean = sum(losses) / len(losses)
        self.last_grad_norm = None
        if math.isfinite(mean):
            if in_step:
                self.check.before_first_update(lambda: first_step.judge(NAME, self.plan.precision, eager, self._grads))
            self.last_grad_norm = self._grad_norm()
            if math.isfinite(self.last_grad_norm):
                if self.fused_adamw:
                    with torch.profiler.record_function("ortflow::fused_adamw"):
                        self.optimizer.step(self.last_grad_norm)
                else:
                    with torch.profiler.record_function("ortflow::ort_optimizer_graph"):
                        self.optimizer.step()
                self.steps += 1
        self.module.lazy_reset_grad()  # a non-finite loss or gradient: the gradients are dropped, the weights stay
        return mean

    def gradients(self, inputs: Inputs, targets: torch.Tensor) -> tuple[float, dict[str, np.ndarray]]:
        """One forward and backward pass without an optimizer step: the loss and the trainable parameters' gradients
        by torch name (for checking graph rewrites and parity). The gradient buffers are reset afterwards."""
        self.module.train()
        self.batch_statistics.check_training_batch(targets.size(0), self.batch_size, NAME)
        tensors, padded = pad_batch(self.layout.flatten(inputs), targets, self.batch_size, self.loss)
        loss = self._training_forward(self._feeds(tensors, padded, train=True))
        grads = {name.removeprefix(_PREFIX): np.array(self.state.parameters[name].grad) for name in self.trainable}
        self.module.lazy_reset_grad()
        return loss, grads

    def _verify(self, inputs: Inputs, targets: torch.Tensor) -> first_step.Verdict:
        """The first-step check (accel/first_step.py): one call of the training graph with every dropout mask all
        ones and no update; BatchNorm's statistics, here and in ORT's state, as they were."""
        self.batch_statistics.check_training_batch(targets.size(0), self.batch_size, NAME)
        tensors, padded = pad_batch(self.layout.flatten(inputs), targets, self.batch_size, self.loss)

        def engine_gradients() -> dict[str, np.ndarray]:
            updates = self.norms.updates if self.norms is not None else 0
            explained = failures.explained(NAME, "run a training step", self.model, INSTEAD, self.plan)
            with buffers_kept(self.model), explained:
                self._training_forward(self._feeds(tensors, padded, train=False))
            if self.norms is not None:
                self.norms.updates = updates  # describe()'s count is the training steps'
                self._write_running_statistics()
            found = {name: g * self.accumulate for name, g in self._grads().items()}
            self.module.lazy_reset_grad()
            return found

        flat = (*tensors, padded)
        eager_loss = first_step.eager_module(self.model, self.loss, self.layout, self.plan.precision)
        return first_step.verify(NAME, self.model, eager_loss, flat, self.plan.precision, engine_gradients)

    def _grads(self) -> dict[str, np.ndarray]:
        """The gradient buffers as the last backward left them, by torch name (views, read before the reset)."""
        views = zip(self.trainable, ort.gradient_views(self.state, self.trainable), strict=True)
        return {n.removeprefix(_PREFIX): g.float().numpy() for n, g in views}

    def _grad_norm(self) -> float:
        """The global gradient norm before clipping, computed as eager computes it (torch's norms in float32,
        clip_grad_norm_'s), over ORT's gradient buffers read in place after the backward passes and before the
        optimizer graph (which clips with the same norm). Reading them as numpy copies and summing in float64 took
        10-12 ms a step on ResNet-18's 11M parameters, this 2.0 ms (2-core Zen 5)."""
        with torch.profiler.record_function("ortflow::grad_norm"):
            grads = ort.gradient_views(self.state, self.trainable)
            return float(torch.nn.utils.get_total_norm(grads))  # 0.0 for no gradients

    def eval_step(self, inputs: Inputs, targets: torch.Tensor) -> EvalResult:
        real = targets.size(0)
        self.batch_statistics.check_eval_batch(real, self.batch_size, NAME)
        tensors, padded = pad_eval_batch(self.layout.flatten(inputs), targets, self.batch_size)
        self.module.eval()
        self._serve_frozen_weights()
        with failures.explained(NAME, "run an evaluation step", self.model, INSTEAD, self.plan):
            _, output = self.module(*self._feeds(tensors, padded, train=False))
        self.evals += 1
        output = torch.from_numpy(np.asarray(output))
        if self.loss_block is not None:  # back from the loss block's layout to the model's own
            output = self.loss.unflat_output(output, padded)
        return self.loss.sums(output[:real], targets)

    def set_lr(self, lr: float) -> None:
        self.optimizer.set_learning_rate(lr)

    def model_state_dict(self) -> dict[str, torch.Tensor]:
        """The weights ORT holds (the torch model's parameters are views of them: `_share_weights`), and the buffers
        the torch model keeps (BatchNorm's running statistics), copied, with the state_dict's metadata."""
        return state_dict.copied(self.model)

    def optimizer_state(self) -> dict[str, Any]:
        """torch's fused AdamW: its state_dict, as eager's and ORTModule's (the weights are the checkpoint's model
        state: an engine built on them holds the same ORT state). ORT's optimizer graph: ORT's CheckpointState with
        the optimizer's moments and step count, as the bytes of ORT's own file."""
        from onnxruntime.training import api

        if self.fused_adamw:
            return self.optimizer.state()
        tmp = self.onnx_dir / "checkpoint.saving"
        try:
            api.CheckpointState.save_checkpoint(self.state, str(tmp), include_optimizer_state=True)
            # As a uint8 tensor: torch.save writes a tensor's bytes straight into the file, where a bytes object is
            # pickled through two more in-memory copies (ORT's state holds every weight: hundreds of MB).
            saved = torch.from_numpy(np.fromfile(tmp, dtype=np.uint8))
            return {"format": "onnxruntime", "checkpoint": saved, "lr": self.optimizer.get_learning_rate()}
        except RuntimeError as err:  # ORT's own write failed (a full disk): named as such, the partial file removed
            raise as_write_failure(err, tmp) or err from None
        finally:
            tmp.unlink(missing_ok=True)

    def load_optimizer_state(self, state: dict[str, Any]) -> bool:
        if self.fused_adamw:
            return self.optimizer.load(state)
        if state.get("format") != "onnxruntime":
            return False
        resumed = self.onnx_dir / "checkpoint.resumed"
        saved = state["checkpoint"]  # a uint8 tensor (bytes in checkpoints written before)
        if isinstance(saved, bytes):
            resumed.write_bytes(saved)
        else:
            saved.numpy().tofile(resumed)
        try:
            self._open(resumed, state["lr"])
        except RuntimeError as err:
            raise OrtflowError(
                f"the ONNX Runtime state inside the checkpoint cannot be loaded ({root_reason(err)}); the "
                "checkpoint is corrupt or was written for another model. Use another checkpoint."
            ) from None
        return True

    def describe(self) -> dict[str, Any]:
        return {
            "engine": self.name,
            "executed_by": "onnxruntime",
            "ort_train_steps": self.steps,
            "optimizer": "torch fused AdamW on ORT's buffers" if self.fused_adamw else "ORT's optimizer graph",
            "ort_eval_batches": self.evals,
            "graph_fixes": self.graph_fixes,
            "graph_plan": self.plan.record(self.graphs_portable),
            "first_step_check": self.check.record(),
            **(self.norms.describe() if self.norms is not None else {}),
        }
