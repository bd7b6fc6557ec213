"""`accel=ortmodule`: ORTModule runs forward and backward in ONNX Runtime; torch.optim updates the weights.

Owns the ORTModule wrap, the `debug` group (ORTModule's DebugOptions), the fallback policy, this engine's own ORT
session settings, and the proof that ORT ran. Fallback policy: ORTModule silently runs PyTorch when it cannot handle
a model. With `accel.fallback=fail` (default) ORT's fallback is disabled and every training step is also checked
against this engine's ORT run counters, so a step that did not execute in ORT stops the run. With `warn` fallbacks
are allowed, logged and recorded.
"""

import contextlib
import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Any

import numpy as np
import torch
from annotated_types import Ge, Interval
from omegaconf import DictConfig
from torch import nn

from ortflow.accel import failures, first_step
from ortflow.accel.compat import ortmodule_patches
from ortflow.accel.compat.extensions import ensure_built
from ortflow.accel.engine import EngineContext, pad_batch, pad_eval_batch
from ortflow.accel.graph import aten_gemm, batchnorm, bf16_edges, bf16_weights, fed_dropout, ortmodule_export, pipeline
from ortflow.accel.graph import plan as graph_plan
from ortflow.accel.graph.masks import DropoutMask, MaskSampler, draw_masks
from ortflow.accel.graph.plan import GraphSettings
from ortflow.accel.none import EagerEngine
from ortflow.config import BF16, DebugConfig
from ortflow.distributed import MULTI_PROCESS
from ortflow.errors import OrtflowError, is_allocation_failure
from ortflow.model import hooks
from ortflow.ranges import ranged
from ortflow.report import terminal
from ortflow.step.batch import Inputs, Layout
from ortflow.step.loss import EvalResult
from ortflow.step.steps import TorchSteps
from ortflow.step.with_loss import WithLoss

log = logging.getLogger(__name__)

NAME = "ortmodule"
TITLE = "ONNX Runtime via ORTModule"  # the run header's "what executes it"
SIMPLICITY = 1  # ORT runs forward and backward; torch.optim the update (accel=auto picks the simplest of equals)
EXECUTED_BY = "onnxruntime"  # describe()["executed_by"] when it ran as it should
# The hooks it runs as eager does: its gradients reach torch's parameters through autograd (ortflow/model/hooks.py)
RUNS_IN_STEP = frozenset({hooks.Kind.parameter_hook, hooks.Kind.post_accumulate_hook})


class Fallback(Enum):
    fail = "fail"  # stop with an error if ORT cannot run the model (ORT's own fallback disabled)
    warn = "warn"  # let ORTModule fall back to PyTorch; ortflow logs it and records executed_by=pytorch


@dataclass
class Settings(GraphSettings):
    """conf/accel/ortmodule.yaml: ORTModule's own settings; the graph settings (target, rewrite_*, aten_*) are the
    graph plan's, shared with the artifacts engine (ortflow/accel/graph/plan.py: GraphSettings)."""

    _target_: str = "ortflow.accel.ortmodule.build"
    fallback: Fallback = Fallback.fail
    opset: int | None = ranged(None, Interval(ge=14, le=17))  # ORTModule's export opset; null = its default (17)
    intra_op_threads: int | None = ranged(
        None, Ge(1)
    )  # ORT's intra-op threads; null = as many as torch uses (one per physical core)
    # Idle ORT threads busy-wait for work by default. Under ORTModule, torch runs the optimizer and the glue between
    # ORT's runs on the same cores, and spinning ORT threads slow it down: off measured 15% faster per step.
    allow_spinning: bool = False
    # The first-step check (accel/first_step.py): before the first update, the engine's gradients on the first batch
    # against eager's on the same batch and weights; a difference beyond rounding stops the run. false: trust the
    # engine (the run.json record says the check was off).
    verify: bool = True


def problems(cfg: DictConfig) -> list[str]:
    """Wrapper order (ORTModule innermost, no DataParallel), opset range, the graph plan's settings."""
    found = graph_plan.problems(cfg.accel, cfg.trainer.precision)
    wrappers = list(cfg.distributed.wrappers)
    if "dp" in wrappers:
        found.append(
            "distributed.wrappers has dp (torch.nn.DataParallel) with accel=ortmodule: DataParallel copies the "
            "module into one replica per device on every forward, and ORTModule's ONNX Runtime session cannot be "
            "replicated that way. Use distributed=ddp (DistributedDataParallel, one process per device) instead."
        )
    if "accel" in wrappers:
        for w in wrappers[: wrappers.index("accel")]:
            if w in MULTI_PROCESS:
                found.append(
                    f"distributed.wrappers={wrappers} puts {w} inside ORTModule. ORTModule must be the innermost "
                    f"wrapper ({w} hooks the gradients ORTModule's graph produces); use "
                    f"distributed.wrappers=[accel,{w}]."
                )
    return found


def debug_options(debug: DebugConfig, onnx_dir: Path):
    """ORTModule's DebugOptions from the `debug` group; saved graphs go to `onnx_dir` (inside the run dir)."""
    from onnxruntime.training.ortmodule import DebugOptions, LogLevel

    save_path = ""
    if debug.save_onnx:
        onnx_dir.mkdir(parents=True, exist_ok=True)
        save_path = str(onnx_dir)
    return DebugOptions(
        log_level=LogLevel[debug.log_level.value],
        save_onnx=debug.save_onnx,
        onnx_prefix=debug.onnx_prefix,
        save_path=save_path,
    )


def build(ctx: EngineContext, **settings: Any) -> "ORTModuleEngine":
    return ORTModuleEngine(ctx, Settings(**settings))


class ORTModuleEngine:
    """ORTModule-wrapped model + loss (innermost wrapper; ctx.wrap's DDP goes around it), stepped by torch.optim
    through an EagerEngine."""

    name = NAME

    def __init__(self, ctx: EngineContext, settings: Settings) -> None:
        self.plan = graph_plan.GraphPlan.compute(settings, ctx.precision, NAME)
        batchnorm.refuse_unsupported(ctx.model, NAME, self.plan)
        ctx.refuse_unrun(NAME, RUNS_IN_STEP)  # module backward hooks, state a forward changes
        ensure_built()
        self.fallback = settings.fallback
        # Torch's kernels run inside ORT's graphs with ATen nodes: idle ORT threads must not spin against them.
        spinning = settings.allow_spinning and not self.plan.torch_kernels
        self.session = ortmodule_patches.SessionSettings(settings.intra_op_threads, spinning, self.plan)
        self.runs = ortmodule_patches.OrtRunCounter()  # this engine's own ORT runs: the proof that ORT executed
        self.graph_fixes: dict[str, int] = {}  # ortflow's fixes applied to the exported graphs
        self.module = self._ortmodule(ctx, settings)
        if self.masks:
            self.graph_fixes["dropout_to_mask_inputs"] = len(self.masks)
        self.sampler = MaskSampler(self.masks)
        self.eval_masks = tuple(torch.ones(m.shape, dtype=getattr(torch, m.dtype.name)) for m in self.masks)
        self.loss, self.layout = ctx.loss, ctx.layout
        self.user_model = ctx.model  # failures name its modules
        self.inner = self._eager_half(ctx)
        self.batch_size = ctx.batch_size  # the shape ORT's graphs are exported for
        self.bf16 = ctx.precision == BF16
        self.called: set[str] = set()  # the modes ("train", "eval") already run once
        self.ort_steps = 0
        self.torch_steps = 0
        # Not beside DeepSpeed's engine (it owns the backward and the gradients' partitions), nor where PyTorch may run
        # the step (accel.fallback=warn)
        self.check = first_step.Pending(settings.verify and ctx.steps is TorchSteps and self.fallback == Fallback.fail)
        self.alone = ctx.reduce_loss is None  # one process: the first step's gradients are this batch's own
        self.ort_evals = 0
        self.torch_evals = 0

    def _ortmodule(self, ctx: EngineContext, settings: Settings) -> nn.Module:
        """The model and its loss (WithLoss) under ORTModule, its dropouts fed as mask inputs where the plan says so;
        finds the BatchNorms whose running statistics ortflow keeps (self.norms) and the fed masks (self.masks)."""
        ortmodule_patches.patch_ortmodule(ortmodule_export.HOOKS)
        with ortmodule_patches.ortmodule_construction(
            fallback_allowed=settings.fallback == Fallback.warn, opset=settings.opset
        ):
            from onnxruntime.training.ortmodule import ORTModule

            with_loss: nn.Module = WithLoss(ctx.model, ctx.loss, ctx.layout)
            example = (*ctx.layout.flatten(ctx.example[0]), ctx.example[1])
            # BatchNorm running statistics: ORT writes each batch's statistics into the torch buffers, ortflow
            # applies torch's update around every training forward (accel/graph/batchnorm.py); on ORT's path its
            # kernel's own update stays there.
            self.norms = batchnorm.BatchNorms.find(ctx.model, lambda: with_loss(*example), NAME)
            self.batch_statistics = batchnorm.BatchStatistics.of(ctx.model)
            self.masks: list[DropoutMask] = []
            self.fp32_attention = False
            if self.plan.path("dropout") is graph_plan.Path.fed:
                # keep flags where the bf16 edges fuse a linear -> ReLU -> dropout -> linear chain
                keep_flags = self.plan.by_torch(bf16_edges.NAME)
                # attention in fp32 where autocast computes it so (fed_dropout.attention_with_functional_dropout)
                fp32_attention = self.plan.by_torch(aten_gemm.NAME)
                with_loss, self.masks = fed_dropout.wrap(with_loss, example, keep_flags, fp32_attention)
                self.fp32_attention = fp32_attention
            return ORTModule(with_loss, debug_options(ctx.debug, ctx.onnx_dir))

    def _eager_half(self, ctx: EngineContext) -> EagerEngine:
        """The eager engine that steps ORTModule's module with torch.optim (ctx's wrappers around it; BatchNorms'
        running statistics kept after each forward)."""
        # The inner engine gets the padded, flattened input tensors (positional), then the dropout masks.
        flat = Layout(ctx.layout.count + len(self.masks))
        trained: nn.Module = self.module
        if self.norms is not None:
            kept_by = batchnorm.UpdatedAfterForward
            if self.plan.path(batchnorm.NAME) is graph_plan.Path.ort:
                kept_by = batchnorm.CountedAfterForward
            trained = kept_by(self.module, self.norms, lambda: self.runs.forward)
        return EagerEngine(
            ctx.wrap(trained), ctx.model, ctx.loss, flat, ctx.optim, ctx.grad_clip, ctx.reduce_loss, ctx.steps
        )

    def _run(self, step, inputs: torch.Tensor, targets: torch.Tensor, mode: str):
        """Call `step` in this engine's ORT scope, turning ORTModule's "cannot run this model" exceptions into a
        clear user error."""
        # ORTModule exports and builds its sessions on the first call in each mode; ORT logs its graph transformers
        # to stderr meanwhile (at INFO, whatever the severity asked for): that goes to ortflow.log.
        first = mode not in self.called
        self.called.add(mode)
        if self.bf16:  # ORT reads the frozen weights from their torch parameters: their bf16 copies hold while those do
            bf16_weights.CACHE.serve_torch_parameters(list(self.user_model.parameters()))
        try:
            with (
                terminal.native_stderr("onnxruntime") if first else contextlib.nullcontext(),
                ortmodule_patches.ortmodule_scope(self.session, self.runs, self.graph_fixes),
            ):
                return step(inputs, targets)
        except (ortmodule_patches.ortmodule_fallback_error(), *failures.engine_errors()) as err:
            if (refused := failures.no_portable_path(err, NAME, self.user_model, self.plan)) is not None:
                raise refused from None
            if isinstance(err, OrtflowError | failures.GraphWorkError) or is_allocation_failure(err):
                raise
            if not failures.is_model_limit(err):
                raise  # ortflow's own bug, or the user's code: the traceback says where
            stage = f"export, build and run its first {mode} step" if first else f"run a {mode} step"
            if (where := failures.written_by_ortflow(err, self.plan)) is not None:
                raise failures.possibly_ortflows(err, NAME, stage, where) from err
            instead = (
                "Set accel.fallback=warn to let PyTorch run it instead (recorded as executed_by=pytorch), or use "
                "accel=artifacts or accel=none."
            )
            raise OrtflowError(failures.paragraph(err, NAME, stage, self.user_model, instead)) from err

    def _not_in_ort(self, what: str) -> None:
        message = (
            f"ORTModule did not execute the {what} in ONNX Runtime (PyTorch ran it instead). The log above "
            "shows ORT's reason. "
        )
        if self.fallback == Fallback.fail:
            raise OrtflowError(message + "Set accel.fallback=warn to allow PyTorch fallback, or use accel=none.")
        log.warning(
            message + "accel.fallback=warn lets the run go on; run.json's engine counts the steps PyTorch ran "
            "(torch_fallback_train_steps); accel.fallback=fail stops the run instead."
        )

    @property
    def last_grad_norm(self) -> float | None:
        return self.inner.last_grad_norm

    def train_step(self, inputs: Inputs, targets: torch.Tensor) -> float:
        return self.train_micro([(inputs, targets)])

    def train_micro(self, micro: Sequence[tuple[Inputs, torch.Tensor]]) -> float:
        for _, targets in micro:
            self.batch_statistics.check_training_batch(targets.size(0), self.batch_size, NAME)
        padded = [pad_batch(self.layout.flatten(x), y, self.batch_size, self.loss) for x, y in micro]
        in_step = self.check.due and len(micro) == 1 and self.alone
        if not in_step:
            self.check.before_first_update(lambda: self._verify(*padded[0]))
        if self.masks:  # each micro-batch its own masks (the sampler's buffers serve one at a time)
            draws = [self.sampler.draw()] if len(micro) == 1 else [draw_masks(self.masks) for _ in micro]
            padded = [((*x, *map(torch.from_numpy, d)), y) for (x, y), d in zip(padded, draws, strict=True)]
        if in_step:
            self._check_in_step(*padded[0])
        before = self.runs.snapshot()
        try:
            loss = self._run(lambda _x, _y: self.inner.train_micro(padded), None, None, "train")
        finally:
            self.inner.before_update = None  # a step stopped before its update: the next one is checked instead
        if not math.isfinite(loss):
            return loss  # forward only (no backward ran); the loop decides whether to stop or skip
        after = self.runs.snapshot()
        # Proof, not absence of an error: ORT's own training session ran both the forward and the backward.
        if after[0] > before[0] and after[1] > before[1]:
            self.ort_steps += 1
        else:
            self.torch_steps += 1
            self._not_in_ort("training step (forward and backward)")
        return loss

    def _check_in_step(self, tensors: tuple[torch.Tensor, ...], targets: torch.Tensor) -> None:
        """The first-step check on the first step itself: eager's gradients now, from this engine's own module run
        eagerly on the step's inputs and dropout masks (fed_dropout.WithLossAndMasks: the masks applied where ORT
        applies them), and the step's gradients after its backward, before its update."""
        eager_loss = first_step.eager_module(self.user_model, self.loss, self.layout, self.plan.precision)
        reference = eager_loss
        if self.masks:
            reference = fed_dropout.WithLossAndMasks(eager_loss, self.masks, self.fp32_attention)
        eager = first_step.eager_side(self.user_model, reference, (*tensors, targets), dropout_kept=bool(self.masks))

        def step_gradients() -> dict[str, np.ndarray] | str:
            graph = ortmodule_patches.training_graph(self.module)
            if graph is not None and first_step.ort_dropout(graph):
                return first_step.ORT_DROPOUT
            trained = self.user_model.named_parameters()
            return {n: p.grad.detach().float().numpy() for n, p in trained if p.requires_grad and p.grad is not None}

        self.inner.before_update = lambda: self.check.before_first_update(
            lambda: first_step.judge(NAME, self.plan.precision, eager, step_gradients)
        )

    def _verify(self, tensors: tuple[torch.Tensor, ...], targets: torch.Tensor) -> first_step.Verdict:
        """The first-step check (accel/first_step.py): one forward and backward of ORTModule's training graph with
        every dropout mask all ones, the gradients read from the parameters' .grad (no optimizer step); outside any
        distributed wrapper, so nothing is all-reduced."""

        def engine_gradients() -> dict[str, np.ndarray] | str:
            self.module.train()
            trainable = [(n, p) for n, p in self.user_model.named_parameters() if p.requires_grad]
            for _, p in trainable:
                p.grad = None
            before = self.runs.snapshot()
            with torch.enable_grad():
                self._run(lambda x, y: self.module(*x, *self.eval_masks, y).backward(), tensors, targets, "train")
            ran = self.runs.snapshot()
            # the counters stay the training steps' proof: the check's own runs are taken back out of them
            self.runs.forward, self.runs.backward, self.runs.inference = before
            if not (ran[0] > before[0] and ran[1] > before[1]):
                return "ORTModule ran the check's step in PyTorch (a fallback: the training step says so)"
            grads = {n: p.grad.detach().float().numpy().copy() for n, p in trainable if p.grad is not None}
            graph = ortmodule_patches.training_graph(self.module)
            return first_step.ORT_DROPOUT if graph is not None and first_step.ort_dropout(graph) else grads

        flat = (*tensors, targets)
        precision = self.plan.precision
        eager_loss = first_step.eager_module(self.user_model, self.loss, self.layout, precision)
        return first_step.verify(NAME, self.user_model, eager_loss, flat, precision, engine_gradients)

    @torch.no_grad()
    def _eval(self, tensors: tuple[torch.Tensor, ...], targets: torch.Tensor) -> torch.Tensor:
        self.module.eval()
        return self.module(*tensors, *self.eval_masks, targets)[1]

    def eval_step(self, inputs: Inputs, targets: torch.Tensor) -> EvalResult:
        real = targets.size(0)
        self.batch_statistics.check_eval_batch(real, self.batch_size, NAME)
        tensors, padded = pad_eval_batch(self.layout.flatten(inputs), targets, self.batch_size)
        before = self.runs.inference
        output = self._run(self._eval, tensors, padded, "eval")
        result = self.loss.sums(output[:real], targets)
        if self.runs.inference > before:
            self.ort_evals += 1
        else:
            self.torch_evals += 1
            self._not_in_ort("evaluation forward")
        return result

    def set_lr(self, lr: float) -> None:
        self.inner.set_lr(lr)

    def model_state_dict(self) -> dict[str, torch.Tensor]:
        return self.inner.model_state_dict()

    def optimizer_state(self) -> dict[str, Any]:
        return self.inner.optimizer_state()

    def load_optimizer_state(self, state: dict[str, Any]) -> bool:
        return self.inner.load_optimizer_state(state)

    def save_shards(self, directory: Path) -> None:
        self.inner.save_shards(directory)

    def _graph_portable(self) -> bool | None:
        """Whether ORTModule's training graph holds only operators ORT runs without torch (None before it is built)."""
        graph = ortmodule_patches.training_graph(self.module)
        return None if graph is None else pipeline.portable(graph)

    def describe(self) -> dict[str, Any]:
        executed = "onnxruntime" if self.torch_steps == 0 and self.ort_steps > 0 else "pytorch"
        if self.ort_steps and self.torch_steps:
            executed = "mixed"
        return {
            "engine": self.name,
            "executed_by": executed,
            "ort_train_steps": self.ort_steps,
            "torch_fallback_train_steps": self.torch_steps,
            "ort_eval_batches": self.ort_evals,
            "torch_fallback_eval_batches": self.torch_evals,
            "graph_fixes": dict(self.graph_fixes),
            "graph_plan": self.plan.record(self._graph_portable()),
            "first_step_check": self.check.record(),
            **(self.norms.describe() if self.norms is not None else {}),
        }
