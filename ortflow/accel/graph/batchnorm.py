"""BatchNorm running statistics in the ORT engines, kept exactly as eager PyTorch keeps them.

Eager PyTorch: each training forward of an nn.BatchNorm* normalises with the batch's mean and (biased) variance and
updates its buffers in place: running_mean and running_var move towards the batch's mean and *unbiased* variance by
`momentum` (by 1/num_batches_tracked, a cumulative average, when momentum is None), num_batches_tracked adds 1.
Evaluation normalises with the running statistics.

ONNX Runtime by itself (onnxruntime-training 1.19.2, CPU) normalises training batches right, but keeps the
statistics wrong: its BatchNorm training kernel writes `m * old + (1 - m) * batch` into the running-statistics
tensors it is given, in place (its outputs alias those inputs; under ORTModule these are the torch buffers
themselves, in the artifacts engine the checkpoint state's tensors), with the biased batch variance and the momentum
the export baked in; num_batches_tracked never changes; and the export runs one more training forward in torch.

ortflow's design, the same in both engines:
1. The exported training graph's BatchNormalization nodes get momentum 0 (`batch_statistics_in_place`): ORT's
   in-place write then leaves exactly the batch mean and biased variance it normalised with in those tensors.
2. Around every training forward (`BatchNorms.keep`, `mark_unwritten`, `after`): the running statistics are kept
   (the torch buffers own them) and the running variances ORT is given are set to -1; afterwards a variance still
   at -1 means ORT did not write it, which stops the run rather than keep wrong statistics; otherwise torch's own
   update is applied to the kept values with the batch statistics ORT left there, into the torch buffers.
So engine.model_state_dict(), checkpoints, eval and export all see eager's statistics (measured: <= 2e-7 after
several steps, momentum set or None), and the graph gains no node: the statistics are those ORT computed anyway.

Refused, with the reason (`refuse_unsupported`): nn.SyncBatchNorm (it averages statistics across processes inside its
forward), a BatchNorm subclass with a forward of its own (ortflow reproduces torch's update, not an unknown one), a
tracking BatchNorm called more than once per forward (ORT's writes of the two calls land in the same tensors), and
InstanceNorm with track_running_stats=True (ORT's InstanceNormalization keeps no running statistics).
"""

import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import onnx
import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.nn.modules.instancenorm import _InstanceNorm

from ortflow.accel.graph import plan as graph_plan
from ortflow.errors import ModelError, OrtflowError
from ortflow.model.probe import training_forward_probe

# The classes whose forward is torch's own _BatchNorm.forward (the update ortflow reproduces).
_TORCH_FORWARD = _BatchNorm.forward
# Subclasses whose forward is a copy of torch's (the same update), followed by elementwise layers: timm's
# BatchNormAct2d (its `drop` and `act` after F.batch_norm), in nearly every timm CNN.
_COPIES_OF_TORCH_FORWARD = (("timm.layers.norm_act", "BatchNormAct2d"),)


def _follows_torchs_update(module: _BatchNorm) -> bool:
    forward = type(module).forward
    if forward is _TORCH_FORWARD:
        return True
    for module_name, class_name in _COPIES_OF_TORCH_FORWARD:
        known = getattr(sys.modules.get(module_name), class_name, None)
        if known is not None and forward is known.forward:
            return True
    return False


UNWRITTEN = -1.0  # a variance ORT's BatchNorm kernel can never write (variances are >= 0)


@dataclass(frozen=True)
class Site:
    """One BatchNorm that tracks running statistics and runs in the training forward."""

    name: str  # the module's name in the model: its buffers are <name>.running_mean, .running_var, ...
    module: _BatchNorm
    count: int  # values per channel in one batch (numel / channels): the n of the unbiased correction n / (n - 1)


def refuse_unsupported(model: nn.Module, mode: str, plan: graph_plan.GraphPlan | None = None) -> None:
    """Refuse, before any export, normalisation layers whose statistics the engine cannot keep as torch does (or,
    where the plan leaves them to ORT's kernel, as ORT can).

    Raises:
        ModelError: naming the layer, why, and what trains it.
    """
    by_ort = plan is not None and plan.path(NAME) is graph_plan.Path.ort
    for name, module in model.named_modules():
        label = f"'{name}' ({type(module).__name__})" if name else type(module).__name__
        if by_ort and isinstance(module, _BatchNorm) and module.track_running_stats and module.momentum is None:
            raise ModelError(
                f"accel={mode} accel.target={plan.target.value} cannot train the model's {label} with "
                "momentum=None: its running statistics are then a cumulative average over every batch, and ONNX "
                "Runtime's BatchNormalization kernel, which updates them inside the graph there, only has an "
                "exponential moving average. Give the layer a momentum (torch's default is 0.1), or use "
                "accel.target=fast (ortflow keeps the statistics as torch does)."
            )
        if isinstance(module, nn.SyncBatchNorm):
            raise ModelError(
                f"accel={mode} cannot train the model's {label}: SyncBatchNorm averages the batch statistics across "
                "processes inside its forward, and an exported ONNX Runtime graph computes them from its own "
                "process's batch only, so training would normalise differently from eager PyTorch. Use accel=none, "
                "or nn.BatchNorm1d/2d/3d (per-process statistics) in the model."
            )
        if isinstance(module, _BatchNorm) and not _follows_torchs_update(module):
            raise ModelError(
                f"accel={mode} cannot train the model's {label}: it subclasses BatchNorm with a forward of its own, "
                "and ortflow keeps running statistics by reproducing torch's own BatchNorm update, which that forward "
                "may not follow. Use accel=none, or nn.BatchNorm1d/2d/3d."
            )
        if isinstance(module, _InstanceNorm) and module.track_running_stats:
            raise ModelError(
                f"accel={mode} cannot train the model's {label} with track_running_stats=True: ONNX Runtime's "
                "InstanceNormalization keeps no running statistics, so evaluation would use the initial ones. Use "
                "accel=none, or track_running_stats=False (the default: per-sample statistics in evaluation too)."
            )


def tracking(model: nn.Module) -> list[tuple[str, _BatchNorm]]:
    """The model's BatchNorm layers that keep running statistics."""
    return [(n, m) for n, m in model.named_modules() if isinstance(m, _BatchNorm) and m.track_running_stats]


def batch_statistics_in_place(model: onnx.ModelProto) -> int:
    """Set momentum 0 on every training-mode BatchNormalization: ORT's kernel then writes the batch mean and biased
    variance themselves into the running-statistics tensors it is given (in place), for `BatchNorms.after` to read.
    The normalised output does not depend on the momentum. Returns how many nodes changed."""
    changed = 0
    for node in model.graph.node:
        if node.op_type != "BatchNormalization":
            continue
        attributes = {a.name: a for a in node.attribute}
        if "training_mode" not in attributes or attributes["training_mode"].i != 1:
            continue
        if "momentum" in attributes:
            attributes["momentum"].f = 0.0
        else:
            node.attribute.append(onnx.helper.make_attribute("momentum", 0.0))
        changed += 1
    return changed


def inference_batch_norms(model: onnx.ModelProto) -> int:
    """In an eval graph made from a training graph: keep only the normalised output of every BatchNormalization
    and drop the nodes that only fed the rest. ORT's eval-graph conversion sets training_mode=0 but keeps the
    running-statistics outputs, which ORT then refuses to load ('This number of op outputs should be 1 when
    Training_mode = False'). Returns how many nodes changed."""
    graph = model.graph
    changed = 0
    for node in graph.node:
        if node.op_type == "BatchNormalization" and len(node.output) > 1:
            del node.output[1:]
            changed += 1
    while True:  # drop what fed nothing but the removed outputs
        used = {name for node in graph.node for name in node.input} | {out.name for out in graph.output}
        alive = [node for node in graph.node if any(name in used for name in node.output)]
        if len(alive) == len(graph.node):
            break
        del graph.node[:]
        graph.node.extend(alive)
    return changed


@dataclass(frozen=True)
class BatchStatistics:
    """A model's BatchNorm layers, whose outputs depend on the whole batch: in training, and in evaluation too for
    those without running statistics. The ORT engines pad a short batch to the size their graphs were built for; for
    these layers the padding rows would join the batch's statistics, so such a batch is refused instead (ortflow's
    loaders never hand one to such a model: data/short_batches.py)."""

    training: tuple[str, ...] = ()
    eval: tuple[str, ...] = ()

    @classmethod
    def of(cls, model: nn.Module) -> "BatchStatistics":
        norms = [(n or type(m).__name__, m) for n, m in model.named_modules() if isinstance(m, _BatchNorm)]
        return cls(tuple(n for n, _ in norms), tuple(n for n, m in norms if not m.track_running_stats))

    def check_training_batch(self, size: int, full: int, mode: str) -> None:
        """Raises ModelError for a training batch shorter than `full` when the model has batch statistics."""
        if size < full and self.training:
            self._refuse("training", size, full, mode, self.training)

    def check_eval_batch(self, size: int, full: int, mode: str) -> None:
        """Raises ModelError for an eval batch shorter than `full` when the model has eval-time batch statistics."""
        if size < full and self.eval:
            self._refuse("evaluation", size, full, mode, self.eval)

    @staticmethod
    def _refuse(what: str, size: int, full: int, mode: str, layers: tuple[str, ...]) -> None:
        raise ModelError(
            f"accel={mode} got a {what} batch of {size} samples, fewer than the {full} its ONNX Runtime graphs were "
            f"built for, and the model's BatchNorm layers ({', '.join(layers[:3])}) normalise with the batch's "
            f"statistics in {what}: the rows that would pad it would change them. Give the loader full batches "
            "(drop_last=True; ortflow's own loaders leave short batches out for such a model)."
        )


class BatchNorms:
    """The tracking BatchNorm layers a model's training forward runs, and torch's update of their statistics.

    Built from one training forward (buffers restored afterwards) that finds which layers run, on how many values
    per channel, and refuses a layer run twice.
    """

    def __init__(self, sites: list[Site]) -> None:
        self.sites = sites
        self.updates = 0  # training forwards whose statistics were updated (describe(): the proof it happened)

    @classmethod
    def find(cls, model: nn.Module, forward: Callable[[], Any], mode: str) -> "BatchNorms | None":
        """The sites of `model`'s tracking BatchNorms as one training-mode call of `forward` runs them; None when it
        has none.

        Raises:
            ModelError: a tracking BatchNorm runs more than once in one forward.
        """
        names = dict((m, n) for n, m in tracking(model))
        if not names:
            return None
        calls: list[tuple[_BatchNorm, int]] = []

        def record(module: nn.Module, args: tuple, _output: Any) -> None:
            if module.training and args:
                calls.append((module, args[0].numel() // args[0].size(1)))

        handles = [module.register_forward_hook(record) for module in names]
        try:
            with training_forward_probe(model):
                forward()
        finally:
            for handle in handles:
                handle.remove()
        seen: set[_BatchNorm] = set()
        for module, _ in calls:
            if module in seen:
                raise ModelError(
                    f"accel={mode} cannot train the model's BatchNorm '{names[module]}': one training forward runs it "
                    "more than once, and ONNX Runtime writes the batch statistics of every run into the same tensors, "
                    "so only the last run's could update the running statistics (eager PyTorch updates them once per "
                    "run). Use accel=none, or a separate BatchNorm for each use."
                )
            seen.add(module)
        sites = [Site(names[module], module, count) for module, count in calls]
        return cls(sites) if sites else None

    def keep(self) -> list[tuple[torch.Tensor, ...]]:
        """Before a training forward: the running statistics as they are (torch's update starts from them)."""
        return [
            (s.module.running_mean.clone(), s.module.running_var.clone(), s.module.num_batches_tracked.clone())
            for s in self.sites
        ]

    @torch.no_grad()
    def mark_unwritten(self) -> None:
        """-1 into the running variances of the torch buffers (those ORTModule gives ORT): a variance ORT's kernel
        leaves at -1 was not written."""
        for site in self.sites:
            site.module.running_var.fill_(UNWRITTEN)

    @torch.no_grad()
    def after(
        self,
        kept: list[tuple[torch.Tensor, ...]],
        batch: Sequence[tuple[torch.Tensor | np.ndarray, torch.Tensor | np.ndarray]] | None = None,
        in_ort: bool = True,
    ) -> None:
        """After a training forward: torch's update of the kept statistics with each site's batch mean and biased
        variance (default: what ORT left in the torch buffers), into the torch buffers.

        `in_ort=False`: PyTorch ran the forward instead (ORTModule's fallback; on its first step once more, to read
        the outputs' structure), updating the buffers itself each time, from the -1 variances: the batch statistics
        are recovered from the result (`_recovered`) and torch's single update applied.

        Raises:
            OrtflowError: a running variance still holds the -1 written before the forward (ORT did not write it).
        """
        if batch is None:
            batch = [(s.module.running_mean.clone(), s.module.running_var.clone()) for s in self.sites]
        for site, (mean, var, count), (now_mean, now_var) in zip(self.sites, kept, batch, strict=True):
            module = site.module
            factor = 1.0 / float(count + 1) if module.momentum is None else float(module.momentum)
            now_mean, now_var = torch.as_tensor(now_mean).double(), torch.as_tensor(now_var).double()
            if in_ort:
                if bool((now_var == UNWRITTEN).any()):
                    raise OrtflowError(
                        f"ONNX Runtime did not write the batch statistics of BatchNorm '{site.name}' into its running "
                        "statistics as ortflow expects of onnxruntime-training 1.19 (an in-place write by its "
                        "BatchNorm kernel), so they cannot be kept as eager PyTorch keeps them. Use accel=none."
                    )
                # As torch's CPU kernel: in double precision, the variance unbiased by n / (n - 1).
                batch_mean, unbiased = now_mean, now_var * (site.count / max(site.count - 1, 1))
            else:
                batch_mean, unbiased = self._recovered(module, mean, count, now_mean, now_var)
            # Through .data: autograd may hold the buffers for a backward still to come (PyTorch's fallback), and
            # this write must not bump their version (as torch's own in-kernel update does not).
            module.num_batches_tracked.data.copy_(count + 1)
            module.running_mean.data.copy_(mean.double() * (1 - factor) + batch_mean * factor)
            module.running_var.data.copy_(var.double() * (1 - factor) + unbiased * factor)
        self.updates += 1

    @staticmethod
    def _recovered(
        module: _BatchNorm, mean: torch.Tensor, count: torch.Tensor, now_mean: torch.Tensor, now_var: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The batch mean and unbiased variance behind PyTorch's own updates of its buffers by the same batch, run
        `runs` times from (kept mean, variance -1): now = a * start + (1 - a) * batch, a the product of the runs'
        (1 - factor). With momentum 0 nothing moved (and nothing will): the kept values."""
        runs = int(module.num_batches_tracked) - int(count)
        keep = 1.0
        for run in range(1, runs + 1):
            keep *= 1.0 - (1.0 / float(count + run) if module.momentum is None else float(module.momentum))
        if runs < 1:
            raise OrtflowError("neither ONNX Runtime nor PyTorch ran this model's BatchNorm in its training forward.")
        if keep == 1.0:
            return mean.double(), torch.zeros_like(now_var)
        return (now_mean - keep * mean.double()) / (1 - keep), (now_var - keep * UNWRITTEN) / (1 - keep)

    @torch.no_grad()
    def counted(self) -> None:
        """After a training forward whose statistics ORT's kernel updated inside the graph: num_batches_tracked + 1."""
        for site in self.sites:
            site.module.num_batches_tracked.data.add_(1)
        self.updates += 1

    def describe(self) -> dict[str, int]:
        return {"batchnorm_layers": len(self.sites), "batchnorm_updates": self.updates}


class UpdatedAfterForward(nn.Module):
    """Around an ORTModule whose graph writes batch statistics into the torch buffers: each training forward is
    bracketed by `BatchNorms.keep` + `mark_unwritten` and `after`, so the buffers hold torch's update when it
    returns. `forward_runs()` counts ORT's training forwards (to tell ORT's run from PyTorch's fallback)."""

    def __init__(self, module: nn.Module, norms: BatchNorms, forward_runs: Callable[[], int]) -> None:
        super().__init__()
        self.module = module
        self.norms = norms
        self.forward_runs = forward_runs

    def forward(self, *args: Any) -> Any:
        if not self.training:
            return self.module(*args)
        kept = self.norms.keep()
        self.norms.mark_unwritten()
        runs = self.forward_runs()
        output = self.module(*args)
        self.norms.after(kept, in_ort=self.forward_runs() > runs)
        return output


class CountedAfterForward(nn.Module):
    """Around an ORTModule whose graph keeps BatchNorm's running statistics itself (ORT's kernel updates the torch
    buffers in place, the plan's ORT path): after each training forward ORT ran, num_batches_tracked counts it, as
    torch's forward does (ORT's kernel has no such counter; a forward PyTorch ran instead counted itself)."""

    def __init__(self, module: nn.Module, norms: BatchNorms, forward_runs: Callable[[], int]) -> None:
        super().__init__()
        self.module = module
        self.norms = norms
        self.forward_runs = forward_runs

    def forward(self, *args: Any) -> Any:
        runs = self.forward_runs()
        output = self.module(*args)
        if self.training and self.forward_runs() > runs:
            self.norms.counted()
        return output


def _rewrite(model: onnx.ModelProto, plan: graph_plan.GraphPlan, work: graph_plan.GraphWork) -> None:
    """The host path: momentum 0 (the batch statistics left in place for the host's update). ORT's path: the
    momentum torch's export wrote (1 - the module's), ORT's kernel updating the statistics inside the graph."""
    if plan.path(NAME) is graph_plan.Path.host:
        work.count("batchnorm_batch_statistics_in_place", batch_statistics_in_place(model))


NAME = "batchnorm_statistics"
OP = graph_plan.declare(
    graph_plan.GraphOp(
        NAME,
        "BatchNorm's running statistics: torch's update by the host (exact), or ORT's kernel inside the graph "
        "(biased batch variance, no num_batches_tracked)",
        __name__,
        (graph_plan.Path.host, graph_plan.Path.ort),
        lambda settings, precision, engine: graph_plan.Path.host,
        rewrite=_rewrite,
    )
)
