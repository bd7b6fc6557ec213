"""`accel=compile`: eager PyTorch's step with the model and its loss compiled by `torch.compile` (inductor, C++ kernels
on the CPU); torch's autograd runs the compiled backward and torch.optim updates the weights, as in accel=none.

What it has from the eager engine: the optimizer, clipping, accumulation, the non-finite guard, DDP (around the
compiled module), bf16-mixed (torch's CPU autocast, inside the compiled graph), checkpoints under the model's own
parameter names (the user's model is compiled in place; its state_dict has no `_orig_mod.` prefix), frozen
parameters and LoRA, and the hooks on parameters. Proof that it ran compiled: its backend counts each run of a graph
inductor compiled (accel/compat/inductor.py), as ORT's run counters prove the ORT engines ran; a step that ran no
compiled graph (dynamo fell back to eager PyTorch, e.g. past its recompile limit) stops the run.

Compile time is the first step's (and the first evaluation's: eval mode is a graph of its own); a batch of another
shape (a short last batch) compiles once more. Each compilation is counted and recorded in run.json. Inductor's
caches live in ortflow's cache (accel/compat/inductor.py: cache_folder), so a second run of the same model compiles
from the cache in a second or two.
"""

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Any

import torch
from omegaconf import DictConfig

from ortflow.accel.compat import inductor
from ortflow.accel.engine import EngineContext
from ortflow.accel.none import EagerEngine, debug_problems
from ortflow.config import BF16
from ortflow.errors import ConfigError, ModelError, OrtflowError
from ortflow.model import hooks
from ortflow.step.batch import Inputs
from ortflow.step.loss import EvalResult
from ortflow.step.with_loss import WithLoss

log = logging.getLogger(__name__)

NAME = "compile"
TITLE = "PyTorch compiled by torch.compile (inductor)"  # the run header's "what executes it"
SIMPLICITY = 3  # torch's own autograd and optimizer, with generated kernels and a compile step before the first
EXECUTED_BY = "inductor"  # describe()["executed_by"] when every step ran inductor's compiled graphs
# Dynamo traces the forward and AOTAutograd the backward; the gradients reach the parameters through torch's autograd,
# so hooks on parameters run as in eager. A module's backward hooks break the graph (refused).
RUNS_IN_STEP = frozenset({hooks.Kind.parameter_hook, hooks.Kind.post_accumulate_hook})
# Why it refuses the other kinds (ortflow/model/hooks.py words the ORT engines' reasons).
WHY_UNRUN = {
    hooks.Kind.backward_hook: "torch.compile traces a module's backward into the compiled graph, where a module's "
    "backward hooks cannot run (they need torch's compiled autograd)",
    hooks.Kind.global_hook: "torch.compile traces the module calls into one graph, so a hook torch calls around every "
    "module call would run only while it traces",
    hooks.Kind.hook_in_forward: "torch.compile traces the forward into one graph and cannot keep a hook that the "
    "forward registers on a tensor it computes",
    hooks.Kind.state_update: "torch.compile replays only the in-place updates it can trace, and compiles the step "
    "again for each new value of a Python attribute until it gives up, so ortflow refuses them before training",
}
WHY_UNRUN[hooks.Kind.backward_pre_hook] = WHY_UNRUN[hooks.Kind.legacy_backward_hook] = WHY_UNRUN[
    hooks.Kind.backward_hook
]
WHY_UNRUN[hooks.Kind.stateful_forward] = WHY_UNRUN[hooks.Kind.state_update]


class Mode(Enum):
    default = "default"  # torch.compile's default: a balance of compile time and speed
    max_autotune = "max-autotune-no-cudagraphs"  # longer compile, tries more kernel variants (CPU: no CUDA graphs)


@dataclass
class Settings:
    """conf/accel/compile.yaml: torch.compile's own settings."""

    _target_: str = "ortflow.accel.compile.build"
    mode: Mode = Mode.default
    # true: the whole model is one graph, and a construct torch.compile cannot trace is refused before training;
    # false: dynamo breaks the graph there and runs the rest in eager PyTorch (the breaks are counted and recorded).
    fullgraph: bool = True


def problems(cfg: DictConfig) -> list[str]:
    found = debug_problems(cfg, NAME)
    if (unverified := inductor.unverified_torch()) is not None:
        found.append(unverified)
    if inductor.cxx_compiler() is None:
        found.append(
            "accel=compile: torch.compile's inductor backend generates C++ kernels on the CPU and needs a C++ compiler "
            "(g++ or clang++ on PATH, or $CXX), and none was found. Install one (Debian: apt-get install g++) or "
            "train with accel=none."
        )
    if "deepspeed" in cfg.distributed.wrappers:
        found.append(
            "accel=compile with distributed=deepspeed is not offered: DeepSpeed's engine would wrap the compiled "
            "module and run its own gradient hooks and partitioned step around it, which ortflow has not verified "
            "against the eager run. Use accel=none or accel=ortmodule with distributed=deepspeed, or accel=compile "
            "with distributed=ddp."
        )
    return found


def build(ctx: EngineContext, **settings: Any) -> "CompiledEngine":
    return CompiledEngine(ctx, Settings(**settings))


def _settle(with_loss: WithLoss, example: tuple[torch.Tensor, ...]) -> None:
    """One eager forward in eval mode (no statistics updated, no gradients) before compiling, so that what a model or
    loss decides on its first call (the loss's class dimension, a lazy module's shape) is decided once: dynamo would
    otherwise compile the first step again for the second, whose Python state differs."""
    was_training = with_loss.training
    with torch.no_grad():
        with_loss.eval()
        with_loss(*example)
    with_loss.train(was_training)


def _one_paragraph(err: Exception) -> str:
    lines = [line.strip() for line in str(err).strip().splitlines() if line.strip()]
    return " ".join(lines[:3])[:600] if lines else type(err).__name__


class CompiledEngine(EagerEngine):
    """The eager engine around `torch.compile(WithLoss(model, loss))` (ctx.wrap's DDP around the compiled module)."""

    name = NAME

    def __init__(self, ctx: EngineContext, settings: Settings) -> None:
        if (unverified := inductor.unverified_torch()) is not None:
            raise ConfigError(unverified)
        ctx.refuse_unrun(NAME, RUNS_IN_STEP, WHY_UNRUN)  # module backward hooks, state a forward changes
        self.cache = inductor.use_cache_folder()
        inductor.reset()  # this engine's model compiles afresh (another engine in this process may have compiled)
        self.backend = inductor.CountingBackend(mode=settings.mode.value)
        self.fullgraph = settings.fullgraph
        self.breaks_before = inductor.graph_breaks()
        with_loss = WithLoss(ctx.model, ctx.loss, ctx.layout, autocast=ctx.precision == BF16)
        _settle(with_loss, (*ctx.layout.flatten(ctx.example[0]), ctx.example[1]))
        compiled = torch.compile(with_loss, backend=self.backend, fullgraph=settings.fullgraph, dynamic=False)
        super().__init__(ctx.wrap(compiled), ctx.model, ctx.loss, ctx.layout, ctx.optim, ctx.grad_clip, ctx.reduce_loss)
        self.first_step_s: float | None = None
        self.compiled_steps = 0
        self.compiled_evals = 0

    def _compiled(self, what: str, run: Any) -> Any:
        """Run `run()`, proving by the backend's counter that a compiled graph ran; torch.compile's errors (an op or
        construct it cannot trace or compile) are the model's limits on this engine, in one paragraph."""
        before, graphs = self.backend.runs, self.backend.graphs
        start = time.perf_counter()
        try:
            result = run()
            if self.backend.graphs != graphs:
                inductor.stop_compile_workers()  # not beside the training steps that follow
        except inductor.compile_errors() as err:
            if inductor.is_recompile_limit(err):
                raise ModelError(
                    f"accel=compile: torch.compile compiled the model's {what} {inductor.recompile_limit()} times (a "
                    "graph for each new batch shape or Python value it specialises on) and its recompile limit stops "
                    "it there. Give every batch the same shape (ortflow's loaders do), or train with accel=none."
                ) from None
            raise ModelError(
                f"accel=compile cannot compile the model's {what}: torch.compile stopped with: {_one_paragraph(err)}. "
                "With accel.fullgraph=true a construct dynamo cannot trace (a graph break) is refused; "
                "accel.fullgraph=false runs such parts in eager PyTorch, or train with accel=none."
            ) from None
        if self.first_step_s is None:
            self.first_step_s = time.perf_counter() - start
        if self.backend.runs == before:
            raise OrtflowError(
                f"accel=compile: the {what} ran no compiled graph: torch.compile ran it in eager PyTorch (dynamo "
                f"gave up on the model after {self.backend.graphs} compilations; its recompile limit is "
                f"{inductor.recompile_limit()}). The run stops rather than train slower than asked "
                "without saying so; train with accel=none, or give every batch the same shape."
            )
        return result

    def train_micro(self, micro: Sequence[tuple[Inputs, torch.Tensor]]) -> float:
        loss = self._compiled("training step", lambda: super(CompiledEngine, self).train_micro(micro))
        self.compiled_steps += 1
        return loss

    def eval_step(self, inputs: Inputs, targets: torch.Tensor) -> EvalResult:
        result = self._compiled("evaluation forward", lambda: super(CompiledEngine, self).eval_step(inputs, targets))
        self.compiled_evals += 1
        return result

    def describe(self) -> dict[str, Any]:
        breaks = inductor.graph_breaks() - self.breaks_before
        return {
            "engine": self.name,
            "executed_by": EXECUTED_BY if self.compiled_steps and not breaks else "pytorch",
            "compiled_steps": self.compiled_steps,
            "compiled_evals": self.compiled_evals,
            "compiled_runs": self.backend.runs,
            "graphs_compiled": self.backend.graphs,
            "compile_s": round(self.backend.compile_s, 3),
            "first_step_s": round(self.first_step_s, 3) if self.first_step_s is not None else None,
            "graph_breaks": breaks,
            "fullgraph": self.fullgraph,
            "inductor_cache": str(self.cache),
        }
