"""Process wrappers around the model in the configured order, validated before any process group starts, and the
process group, data sharding and cross-rank reductions under them.

Order (innermost first) is `distributed.wrappers`; `accel` marks where the accel mode's own wrapper sits. What an
engine allows around it (ORTModule innermost, no data parallelism in the artifacts engine) is that engine's own
check (ortflow/accel/<mode>.py: problems); this module knows the wrappers, not the engines.
"""

import gc
import importlib.util
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import TypeVar

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler

from ortflow.config import DistributedConfig
from ortflow.errors import OrtflowError

T = TypeVar("T")

WRAPPERS = ("accel", "ddp", "deepspeed", "dp")
MULTI_PROCESS = ("ddp", "deepspeed")  # wrappers that run one process per replica (and need torchrun)
ZERO_STAGES = (0, 1, 2)  # distributed=deepspeed's ZeRO stages on offer (3 partitions the parameters themselves)
BACKENDS = ("gloo", "nccl", "mpi")


@dataclass(frozen=True)
class World:
    """This process's place among the training processes (torchrun's RANK, LOCAL_RANK, WORLD_SIZE)."""

    rank: int = 0
    local_rank: int = 0
    size: int = 1

    @property
    def is_main(self) -> bool:
        """Rank 0: the only process that writes run.json, TensorBoard, metrics and checkpoints."""
        return self.rank == 0


def world_from_env() -> World:
    env = os.environ
    return World(int(env.get("RANK", 0)), int(env.get("LOCAL_RANK", 0)), int(env.get("WORLD_SIZE", 1)))


def under_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ or "LOCAL_RANK" in os.environ


def processes(cfg: DistributedConfig) -> int:
    return cfg.nproc_per_node * cfg.nnodes


def problems(cfg: DistributedConfig) -> list[str]:
    """Everything wrong with the wrapper order and launch settings, each naming the key and the fix."""
    found = []
    if cfg.name not in ("none", *MULTI_PROCESS):
        found.append(
            f"distributed.name={cfg.name!r} is not one of {('none', *MULTI_PROCESS)}; choose distributed=ddp or "
            "distributed=deepspeed."
        )
    wrappers = list(cfg.wrappers)
    unknown = [w for w in wrappers if w not in WRAPPERS]
    if unknown:
        return [f"distributed.wrappers: unknown {unknown}; choose from {list(WRAPPERS)} (innermost first)."]
    if wrappers.count("accel") != 1:
        return ["distributed.wrappers must name `accel` exactly once: where the accel mode's wrapper sits."]
    multi = [w for w in wrappers if w in MULTI_PROCESS]
    if len(set(multi)) < len(multi):
        found.append(f"distributed.wrappers={wrappers}: name each multi-process wrapper once.")
    elif len(multi) > 1:
        found.append(
            f"distributed.wrappers={wrappers} has both {multi}: each replicates the model over the processes and "
            "reduces its gradients; choose one (distributed=ddp or distributed=deepspeed)."
        )
    if cfg.name != "none" and cfg.name not in wrappers:
        found.append(f"distributed={cfg.name} needs {cfg.name} in distributed.wrappers (e.g. [accel,{cfg.name}]).")
    if cfg.name == "none" and multi:
        found.append(f"distributed.wrappers has {multi[0]} but distributed=none; choose distributed={multi[0]}.")
    cores = os.cpu_count() or 1
    if cfg.nproc_per_node > cores:
        found.append(
            f"distributed.nproc_per_node={cfg.nproc_per_node} is more than this machine's {cores} CPU cores: ortflow "
            f"trains on the CPU, one process per core at most (each with its own copy of the model); use at most "
            f"distributed.nproc_per_node={cores}."
        )
    if not cfg.node_rank < cfg.nnodes:
        found.append(f"distributed.node_rank={cfg.node_rank} must be in [0, distributed.nnodes={cfg.nnodes}).")
    if processes(cfg) > 1 and not multi:
        found.append(
            f"{processes(cfg)} processes (distributed.nproc_per_node x nnodes) need a multi-process wrapper; use "
            "distributed=ddp or distributed=deepspeed."
        )
    if "deepspeed" in wrappers:
        found += _deepspeed_problems(cfg, wrappers)
    if cfg.backend not in BACKENDS:
        found.append(f"distributed.backend={cfg.backend!r} is not one of {BACKENDS}.")
    elif cfg.backend == "nccl" and not torch.cuda.is_available():
        found.append("distributed.backend=nccl needs CUDA GPUs; use distributed.backend=gloo on CPU.")
    return found


def _deepspeed_problems(cfg: DistributedConfig, wrappers: list[str]) -> list[str]:
    """What distributed=deepspeed cannot run: DeepSpeed not installed, a ZeRO stage not on offer, DeepSpeed anywhere
    but outermost (it takes the optimizer as well as the model)."""
    found = []
    if wrappers[-1] != "deepspeed":
        found.append(
            f"distributed.wrappers={wrappers}: DeepSpeed's engine takes the model and its optimizer, so it is the "
            "outermost wrapper; use distributed.wrappers=[accel,deepspeed]."
        )
    if importlib.util.find_spec("deepspeed") is None:
        found.append(
            "distributed=deepspeed needs DeepSpeed, which is not installed: pip install 'ortflow[deepspeed]' (an "
            "optional extra: ORTModule imports DeepSpeed whenever it is installed, which costs every ORTModule start "
            "about a second)."
        )
    if processes(cfg) == 1:
        found.append(
            "distributed=deepspeed with one process (distributed.nproc_per_node x nnodes = 1): DeepSpeed's engine "
            "replicates the model over processes and partitions its state among them; set "
            "distributed.nproc_per_node=2 or more, or train one process with distributed=none."
        )
    if cfg.zero_stage not in ZERO_STAGES:
        found.append(
            f"distributed.zero_stage={cfg.zero_stage}: ZeRO-3 partitions the parameters themselves, so the model "
            "ortflow checkpoints, evaluates and exports would hold no weights outside DeepSpeed's gather, and around "
            "ORTModule it fails in ORT's export (ORT's ZeRO-3 support needs a DeepSpeed function removed in 0.13.2; "
            f"the CPU needs 0.14.1 or later). Choose distributed.zero_stage from {list(ZERO_STAGES)}."
        )
    return found


def start(cfg: DistributedConfig) -> World:
    """Join the process group torchrun set up (environment variables), if there is more than one process."""
    world = world_from_env()
    if world.size > 1 and not dist.is_initialized():
        # torch.distributed.nn.functional binds `group=group.WORLD` as default arguments when it is imported, and
        # DistributedDataParallel imports it (through torch._dynamo) on first use. Imported after the group exists,
        # those defaults hold the group for the life of the process: destroy_process_group then cannot free its
        # gloo backend, whose three threads (2 workers and the TCP event loop) run on through interpreter shutdown.
        # Imported first, the defaults are None.
        import torch.distributed.nn  # noqa: F401

        dist.init_process_group(cfg.backend, timeout=timedelta(seconds=cfg.timeout_s))
    return world


def settle() -> None:
    """After a run's last step and its last file, on every rank: wait until all ranks got here (a barrier). No rank
    then tears its connections down while a peer is still in an earlier collective or still writing.

    Called only when the run ended normally on this rank: a rank that failed goes straight to `stop` (its peers'
    next collective, this barrier included, then fails at once on the closed connection)."""
    if dist.is_initialized():
        dist.barrier()


def stop() -> None:
    """Release a run's native resources in an order that leaves none of them to interpreter shutdown: first the
    engine (DDP's reducer and ORT's sessions live in reference cycles, which a collection frees now, while ORT's
    environment and the process group still exist), then the process group, whose gloo backend then stops and joins
    its threads. Left to shutdown, the sessions outlived the ORT environment that ORT's atexit handler deletes, and
    the gloo threads ran on through interpreter finalization and exit().

    First a moment with the GIL released: a gloo worker drops its finished work (the last reference to a tensor with
    a Python object, which takes the GIL) while holding the work-queue mutex that ProcessGroupGloo's destructor takes
    with the GIL held. Destroyed in that window, a rank deadlocked at the end of the run (seen on torch 2.6)."""
    if dist.is_initialized():
        time.sleep(0.1)
    gc.collect()
    if dist.is_initialized():
        dist.destroy_process_group()


def wrapper(cfg: DistributedConfig, world: World) -> Callable[[nn.Module], nn.Module]:
    """Applies the wrappers listed outside `accel`, in order, to the (accel-wrapped) module."""

    def wrap(module: nn.Module) -> nn.Module:
        wrappers = list(cfg.wrappers)
        for name in wrappers[wrappers.index("accel") + 1 :] + wrappers[: wrappers.index("accel")]:
            if name == "ddp" and world.size > 1:
                module = nn.parallel.DistributedDataParallel(module)
            elif name == "dp":
                module = nn.DataParallel(module)
            # deepspeed: DeepSpeed's engine takes the optimizer too; it wraps the module where the optimizer is built
            # (ortflow/step/deepspeed.py, through EngineContext.steps)
        return module

    return wrap


def mean_across_ranks(value: float) -> float:
    """The mean of a per-rank scalar over all ranks (the global loss)."""
    if not dist.is_initialized():
        return value
    tensor = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(tensor)
    return float(tensor) / dist.get_world_size()


def any_rank(flag: bool) -> bool:
    """True on every rank when it is true on any (all ranks then stop at the same step)."""
    if not dist.is_initialized():
        return flag
    tensor = torch.tensor([int(flag)])
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return bool(tensor)


def gather(value: object) -> list:
    """`value` from every rank, in rank order (on every rank)."""
    if not dist.is_initialized():
        return [value]
    values: list = [None] * dist.get_world_size()
    dist.all_gather_object(values, value)
    return values


def from_main(make: Callable[[], T], timeout_s: float) -> T:
    """`make()` run on rank 0 only (a slow measurement), its result handed to every rank; the other ranks wait up to
    `timeout_s` (a group of its own: the default group's collectives time out after distributed.timeout_s)."""
    if not dist.is_initialized():
        return make()
    # The group lives until the process group is destroyed (distributed.stop): destroying a subgroup right after its
    # broadcast left the ranks out of step on torch 2.6 (the next collective, DDP's parameter check, timed out).
    group = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))
    failure: BaseException | None = None
    box: list = [None]
    if dist.get_rank() == 0:
        try:
            box = [("ok", make())]
        except Exception as err:  # every rank stops with it, none waits for a result that never comes
            failure, box = err, [("failed", str(err))]
    dist.broadcast_object_list(box, src=0, group=group)
    if failure is not None:
        raise failure
    status, value = box[0]
    if status != "ok":
        raise OrtflowError(f"rank 0 failed ({value})")
    return value


def shard(loader: DataLoader, world: World, seed: int) -> DataLoader:
    """The same training data, each rank reading its own 1/world.size of every epoch (DistributedSampler). A source
    that shards itself (`shard(rank, world_size)`, e.g. ortflow.data.tokens.blocks.RandomBlocks) is asked to."""
    if hasattr(loader, "shard"):
        return loader.shard(world.rank, world.size)
    sampler = DistributedSampler(
        loader.dataset, num_replicas=world.size, rank=world.rank, shuffle=True, seed=seed, drop_last=True
    )
    return DataLoader(
        loader.dataset, loader.batch_size, sampler=sampler, drop_last=True, num_workers=loader.num_workers
    )
