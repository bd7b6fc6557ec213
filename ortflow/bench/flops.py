"""A training step's FLOPs, counted by torch without running the model's arithmetic where it can: the numerator of the
bench's model FLOP utilisation."""

import contextlib
import copy
import logging
from collections.abc import Iterator

import torch

from ortflow.data import Data
from ortflow.run.runner import example_batch
from ortflow.step.batch import layout_of
from ortflow.step.loss import Loss


def model_flops(model: torch.nn.Module, data: Data, objective: Loss) -> int:
    """FLOPs of one training step (forward + backward), counted by torch: on a copy of the model on the meta
    device (shapes only, no arithmetic: free at any size), or, for a model that cannot run there (a transformers
    model calls .item()), on the model itself on the CPU, its buffers, gradients and the RNG restored afterwards (a
    copy would add the model's size to the peak memory the bench reports)."""
    from torch.utils.flop_counter import FlopCounterMode

    inputs, targets = example_batch(data.train)
    tensors = layout_of(inputs).flatten(inputs)
    for device in ("meta", "cpu"):
        try:
            with contextlib.ExitStack() as stack:
                if device == "meta":
                    counted = copy.deepcopy(model).to(device).train()
                else:
                    counted = stack.enter_context(_restored_after(model)).train()
                with FlopCounterMode(display=False) as counter:
                    args = tuple(t.to(device) for t in tensors)
                    objective(layout_of(inputs).call(counted, args), targets.to(device)).backward()
                return counter.get_total_flops()
        except (RuntimeError, NotImplementedError, TypeError, ValueError) as err:
            logging.getLogger(__name__).info("FLOPs not countable on %s (%s)", device, err)
            if device == "cpu":
                raise
    raise AssertionError("unreachable")


@contextlib.contextmanager
def _restored_after(model: torch.nn.Module) -> Iterator[torch.nn.Module]:
    """`model`, whose buffers (BatchNorm's statistics), training mode, gradients and the torch RNG (dropout) are as
    before once the block ends."""
    buffers = {name: b.clone() for name, b in model.named_buffers()}
    training = model.training
    with torch.random.fork_rng():
        try:
            yield model
        finally:
            for param in model.parameters():
                param.grad = None
            with torch.no_grad():
                for name, b in model.named_buffers():
                    b.copy_(buffers[name])
            model.train(training)
