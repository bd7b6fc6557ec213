"""distributed=deepspeed: DeepSpeed's engine around the (ORTModule-wrapped) module and the optimizer ortflow builds,
the optimizer side of the eager engines (ortflow/step/steps.py) on every rank of a multi-process run.

ortflow's settings become DeepSpeed's, never DeepSpeed's defaults: trainer.grad_clip is `gradient_clipping` (0 when
the run asks for none; DeepSpeed 0.17+ defaults to 1.0), the optimizer is the one optim= builds (torch's AdamW or
SGD, `zero_allow_untested_optimizer`), the learning rate is set by ortflow's schedule every step, and DeepSpeed's own
bf16/fp16 stay off (trainer.precision=bf16-mixed is torch's autocast inside the module, as without DeepSpeed).

Stage 0 leaves the gradients whole on every rank: the norm and the clipping are torch's, as under DDP. Under ZeRO 1
and 2 the optimizer state (and with 2 the gradients) live in DeepSpeed's partitions: the norm, the clipping and the
step skipped on a non-finite norm are DeepSpeed's own (`get_global_grad_norm`). A checkpoint keeps each rank's
partitions beside ortflow's file (`step-N.shards/`, DeepSpeed's `save_checkpoint`), which a resume loads back.

`python -m ortflow.step.deepspeed` builds DeepSpeed's just-in-time shared-memory communication op into ortflow's
cache once (`make setup-deepspeed`), so that two ranks never build it at their first step.
"""

import math
import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ortflow.config import DistributedConfig, OptimConfig
from ortflow.errors import CheckpointError, ModelError, OrtflowError
from ortflow.paths import ortflow_cache
from ortflow.step.clipping import clip_and_apply
from ortflow.step.optim import build_torch_optimizer
from ortflow.step.steps import StepsFactory

FORMAT = "deepspeed"
_TAG = "zero"  # DeepSpeed's tag inside a checkpoint's shards folder


def extensions_dir() -> Path:
    """Where DeepSpeed's just-in-time ops are built and kept: ortflow's cache, unless TORCH_EXTENSIONS_DIR says."""
    return Path(os.environ.get("TORCH_EXTENSIONS_DIR") or ortflow_cache() / "torch_extensions")


def _import_deepspeed() -> Any:
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(extensions_dir()))
    import deepspeed

    return deepspeed


def ds_config(cfg: DistributedConfig, batch_size: int, grad_clip: float | None, accumulate: int = 1) -> dict[str, Any]:
    """DeepSpeed's config for ortflow's settings. trainer.accumulate_grad_batches is DeepSpeed's accumulation under
    ZeRO (whose partitions keep only the last backward's gradients when several come before a step at an
    accumulation of 1); at stage 0 the gradients add up in place, as under DDP, and DeepSpeed's stays 1."""
    return {
        "train_micro_batch_size_per_gpu": batch_size,
        "gradient_accumulation_steps": accumulate if cfg.zero_stage else 1,
        # Stage 0 clips with torch (as DDP does); ZeRO clips its partitions. Never DeepSpeed's default of 1.0.
        "gradient_clipping": float(grad_clip or 0.0) if cfg.zero_stage else 0.0,
        "zero_optimization": {
            "stage": cfg.zero_stage,
            "overlap_comm": cfg.overlap_comm,
            "reduce_bucket_size": cfg.reduce_bucket_size,
        },
        "zero_allow_untested_optimizer": True,
        "bf16": {"enabled": False},
        "fp16": {"enabled": False},
        "steps_per_print": 2**31 - 1,
        "wall_clock_breakdown": False,
    }


def factory(cfg: DistributedConfig, batch_size: int, accumulate: int = 1) -> StepsFactory:
    """EngineContext.steps for distributed=deepspeed."""

    def make(module: nn.Module, optim: OptimConfig, grad_clip: float | None) -> "DeepSpeedSteps":
        return DeepSpeedSteps(module, optim, grad_clip, cfg, batch_size, accumulate)

    return make


def _refuse_scalars(module: nn.Module) -> None:
    """DeepSpeed (0.19) broadcasts every parameter from rank 0 as bytes, which a 0-dimensional one cannot be viewed
    as; refused before it fails inside deepspeed.initialize."""
    scalars = [
        name.removeprefix("_original_module.").removeprefix("model.")  # ORTModule's and ortflow's wrappers
        for name, p in module.named_parameters()
        if p.dim() == 0
    ]
    if scalars:
        raise ModelError(
            f"distributed=deepspeed: the model has 0-dimensional parameters ({', '.join(scalars[:5])}), which "
            "DeepSpeed cannot broadcast from rank 0 at its start (it views each parameter as bytes, and a 0-d tensor "
            "has no such view). Give them shape (1,) (nn.Parameter(torch.zeros(1))), or use distributed=ddp."
        )


class DeepSpeedSteps:
    """DeepSpeed's engine (`deepspeed.initialize`) over `module` and a torch optimizer of its trainable parameters."""

    def __init__(
        self,
        module: nn.Module,
        optim: OptimConfig,
        grad_clip: float | None,
        cfg: DistributedConfig,
        batch_size: int,
        accumulate: int = 1,
    ) -> None:
        _refuse_scalars(module)
        deepspeed = _import_deepspeed()
        self.trainable = [p for p in module.parameters() if p.requires_grad]
        optimizer = build_torch_optimizer(self.trainable, optim)  # ZeRO steps it on its own flat fp32 partitions
        self.stage = cfg.zero_stage
        self.grad_clip = grad_clip
        config = ds_config(cfg, batch_size, grad_clip, accumulate)
        self.engine, self.optimizer, _, _ = deepspeed.initialize(model=module, optimizer=optimizer, config=config)
        self.module: nn.Module = self.engine
        self.accumulation = config["gradient_accumulation_steps"]  # DeepSpeed's: ZeRO counts the micro-batches
        self.drops_at_nonfinite_loss = self.accumulation == 1
        self.shards: str | None = None  # the folder of the last save_shards, by name

    def backward(self, loss: torch.Tensor, micro_batches: int) -> None:
        if self.accumulation == 1:
            self.engine.backward(loss / micro_batches)  # stage 0: gradients add up in place, as under DDP
            return
        if micro_batches != self.accumulation:
            raise OrtflowError(
                f"a step of {micro_batches} micro-batches under DeepSpeed's accumulation of {self.accumulation} "
                "(trainer.accumulate_grad_batches): a bug in ortflow, please report it."
            )
        self.engine.backward(loss)  # DeepSpeed divides by its accumulation
        if not self.engine.is_gradient_accumulation_boundary():
            self.engine.step()  # counts the micro-batch; the boundary's step applies (step())

    def step(self) -> float:
        if self.stage == 0:  # whole gradients, all-reduced by DeepSpeed's backward: torch's norm and clipping
            norm = clip_and_apply(self.trainable, self.grad_clip, self.engine.step)
            self.zero_grad()
            return norm
        self.engine.step()  # ZeRO: DeepSpeed's norm and clipping; a non-finite norm skips the step (norm inf)
        norm = self.engine.get_global_grad_norm()
        self.zero_grad()
        return math.nan if norm is None else float(norm)

    def zero_grad(self) -> None:
        self.engine.zero_grad()

    def state(self) -> dict[str, Any]:
        world = dist.get_world_size() if dist.is_initialized() else 1
        return {"format": FORMAT, "zero_stage": self.stage, "world_size": world, "shards": self.shards}

    def save_shards(self, directory: Path) -> None:
        """Every rank's partitions into `directory` (DeepSpeed's save_checkpoint; a collective)."""
        self.engine.save_checkpoint(str(directory), tag=_TAG, save_latest=False)
        self.shards = directory.name

    def load(self, state: dict[str, Any]) -> bool:
        if state.get("format") != FORMAT:
            return False
        world = dist.get_world_size() if dist.is_initialized() else 1
        if (state["world_size"], state["zero_stage"]) != (world, self.stage):
            raise CheckpointError(
                f"the checkpoint being resumed was written by distributed=deepspeed on {state['world_size']} "
                f"processes with distributed.zero_stage={state['zero_stage']}, and this run has {world} with "
                f"zero_stage={self.stage}: each rank's optimizer state is its own partition, which ortflow does not "
                "convert to another count or stage. Resume with the same distributed.nproc_per_node x nnodes and "
                "zero_stage, or start a new run from its weights (checkpoints/final.pt)."
            )
        shards = Path(state["shards"])
        if not (shards / _TAG).is_dir():
            raise CheckpointError(
                f"{shards}: the DeepSpeed partitions this checkpoint needs are missing (the folder beside the step "
                "file, written by every rank); resume from another checkpoint or start a new run."
            )
        self.engine.load_checkpoint(str(shards), tag=_TAG, load_optimizer_states=True, load_lr_scheduler_states=False)
        return True


def build_ops() -> Path:
    """Build DeepSpeed's shared-memory communication op (its CPU accelerator's, at the first initialize) into
    ortflow's cache, once per machine. Returns the folder."""
    _import_deepspeed()
    from deepspeed.ops.op_builder.cpu import ShareMemCommBuilder

    ShareMemCommBuilder().load()
    return extensions_dir()


if __name__ == "__main__":
    print(f"DeepSpeed's ops are in {build_ops()}")
