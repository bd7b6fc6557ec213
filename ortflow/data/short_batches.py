"""The short-batch policy: no padded row ever reaches a model whose outputs depend on its batch.

The ORT engines run graphs exported for one batch size and pad a shorter batch with rows that carry no loss
(accel/engine.py: pad_batch, pad_eval_batch). That is exact only when samples do not interact; a model with batch
statistics (BatchNorm: model/batch_dependence.py) would normalise its real rows with the padding's zeros, and
eager PyTorch, which runs the short batch as it is, would compute something else again. So, in every accel mode:

- training: a model that depends on its batch in training (any BatchNorm) gets only full batches; a shorter one is
  skipped (ortflow's own loaders drop it already; a user's loader may not). Other models train on short batches
  (padded by the ORT engines, exactly).
- evaluation: a model that depends on its batch in evaluation too (BatchNorm with track_running_stats=False) is
  scored on full batches only; a shorter one (the split's last, usually) is dropped. Other models are scored on
  every batch (padded by the ORT engines, only the real rows scored).

"Full" is the training batch size, the one the ORT graphs are exported for. The counts go to run.json (data
"short_batches"), so a run says what it left out.
"""

import logging
from collections.abc import Iterable, Iterator
from typing import Any

from ortflow.errors import DataError
from ortflow.model.batch_dependence import BatchDependence
from ortflow.step.batch import batch_size, split_batch

log = logging.getLogger(__name__)


class FullBatches:
    """The batches of `loader`; with `skip`, those with fewer than `size` samples are left out and counted.

    Any other attribute (dataset, sampler, generator, batch_size, ...) is the loader's, so ResumableBatches and the
    runner see the loader itself.
    """

    def __init__(self, loader: Iterable, size: int, skip: bool, split: str) -> None:
        self.loader = loader
        self.size = size
        self.skip = skip
        self.split = split
        self.short = 0  # short batches met (skipped, with `skip`)
        self.short_samples = 0

    def __iter__(self) -> Iterator[Any]:
        full = 0
        for batch in self.loader:
            n = batch_size(split_batch(batch)[0])
            if n < self.size:
                self.short += 1
                self.short_samples += n
                if self.skip:
                    continue
            full += 1
            yield batch
        if self.skip and full == 0 and self.short:
            raise DataError(
                f"the {self.split} loader gave no batch of the training batch size {self.size}, only shorter ones; a "
                "model with batch statistics (BatchNorm) never gets padded batches, so short ones are left out. "
                "Lower data.batch_size or give the loader more samples."
            )

    def __len__(self) -> int:
        return len(self.loader)  # type: ignore[arg-type]

    def __getattr__(self, name: str) -> Any:  # only for names FullBatches itself lacks
        if "loader" not in self.__dict__:
            raise AttributeError(name)
        return getattr(self.__dict__["loader"], name)


class ShortBatches:
    """The policy for one run: wraps the training and evaluation loaders, and records what it did."""

    def __init__(self, dependence: BatchDependence, size: int) -> None:
        self.dependence = dependence
        self.size = size
        self.train: FullBatches | None = None
        self.val: FullBatches | None = None

    def wrap(self, train: Iterable, val: Iterable) -> tuple[FullBatches, FullBatches]:
        """The loaders the run uses: short training batches skipped when the model depends on its batch in training,
        short evaluation batches dropped when it does in evaluation."""
        self.train = FullBatches(train, self.size, self.dependence.in_training, "training")
        self.val = FullBatches(val, self.size, self.dependence.in_eval, "validation")
        if self.dependence.in_training:
            log.info(
                "the model depends on its batch (%s): short training batches are skipped%s",
                self.dependence.describe(),
                ", and short evaluation batches dropped" if self.dependence.in_eval else "",
            )
        return self.train, self.val

    def record(self) -> dict[str, Any]:
        """run.json's data.short_batches: the batch size, the model's dependence, and per split the policy applied
        and the short batches met (and samples in them) over the run."""
        assert self.train is not None and self.val is not None, "record() before wrap()"
        return {
            "batch_size": self.size,
            "model_depends_on_batch": self.dependence.record(),
            "train": _split_record(self.train, "skipped", "kept"),
            "eval": _split_record(self.val, "dropped", "kept"),
        }


def _split_record(loader: FullBatches, left_out: str, kept: str) -> dict[str, Any]:
    return {"policy": left_out if loader.skip else kept, "short_batches": loader.short, "samples": loader.short_samples}
