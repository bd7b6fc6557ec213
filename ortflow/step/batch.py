"""What a batch is: `(inputs, targets)`, where inputs is one tensor, a tuple (or list) of tensors passed to the
model's forward positionally, or a dict of tensors passed by keyword. Engines work on the flat tuple of input
tensors (`Layout.flatten`) and call the model through `Layout.call`, so every engine and every ONNX export sees
the same positional signature."""

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ortflow.errors import OrtflowError

Inputs = torch.Tensor | tuple[torch.Tensor, ...] | list[torch.Tensor] | dict[str, torch.Tensor]


@dataclass(frozen=True)
class Layout:
    """The structure of a batch's inputs: one tensor (`keys` None, `single`), positional tensors, or named ones."""

    count: int
    single: bool = False
    keys: tuple[str, ...] | None = None

    def flatten(self, inputs: Inputs) -> tuple[torch.Tensor, ...]:
        """The input tensors in a fixed order; a batch of another structure than the first one is refused."""
        if layout_of(inputs) != self:
            raise OrtflowError(
                f"a data batch's inputs changed structure: {describe(inputs)}, while the first batch had "
                f"{self.describe()}. Every batch must have the same inputs."
            )
        if self.single:
            return (inputs,)
        if self.keys is not None:
            return tuple(inputs[k] for k in self.keys)
        return tuple(inputs)

    def call(self, model: nn.Module, tensors: tuple[torch.Tensor, ...]) -> Any:
        """`model` applied to the inputs in their original structure."""
        if self.keys is not None:
            return model(**dict(zip(self.keys, tensors, strict=True)))
        return model(*tensors)

    def describe(self) -> str:
        if self.single:
            return "one tensor"
        if self.keys is not None:
            return f"a dict with keys {list(self.keys)}"
        return f"a tuple of {self.count} tensors"


def layout_of(inputs: Any) -> Layout:
    if isinstance(inputs, torch.Tensor):
        return Layout(1, single=True)
    if isinstance(inputs, dict) and inputs and all(isinstance(v, torch.Tensor) for v in inputs.values()):
        return Layout(len(inputs), keys=tuple(inputs))
    if isinstance(inputs, tuple | list) and inputs and all(isinstance(v, torch.Tensor) for v in inputs):
        return Layout(len(inputs))
    raise OrtflowError(
        f"a data batch's inputs are {describe(inputs)}; ortflow takes batches (inputs, targets) whose inputs are a "
        "tensor, a tuple of tensors or a dict of tensors."
    )


def describe(inputs: Any) -> str:
    if isinstance(inputs, torch.Tensor):
        return f"one tensor {tuple(inputs.shape)} {inputs.dtype}"
    if isinstance(inputs, dict):
        return f"a dict with keys {list(inputs)}"
    if isinstance(inputs, tuple | list):
        return f"a {type(inputs).__name__} of {len(inputs)} items ({', '.join(type(v).__name__ for v in inputs)})"
    return type(inputs).__name__


def batch_size(inputs: Inputs) -> int:
    """Samples in a batch: the first input tensor's leading dimension."""
    return layout_of(inputs).flatten(inputs)[0].size(0)


def split_batch(batch: Any) -> tuple[Inputs, torch.Tensor]:
    """A loader's batch as (inputs, targets): a pair, or a longer tuple whose last item is the targets (the other
    items are then the model's positional inputs)."""
    if isinstance(batch, tuple | list) and len(batch) >= 2 and isinstance(batch[-1], torch.Tensor):
        inputs = batch[0] if len(batch) == 2 else tuple(batch[:-1])
        layout_of(inputs)
        return inputs, batch[-1]
    raise OrtflowError(
        f"a data batch is {describe(batch)}; ortflow takes batches (inputs, targets) (or (input_1, ..., input_n, "
        "targets)) whose targets are a tensor."
    )


def pad_rows(tensors: tuple[torch.Tensor, ...], missing: int) -> tuple[torch.Tensor, ...]:
    """Zero rows appended along dim 0 to each tensor."""
    return tuple(torch.cat([t, t.new_zeros((missing, *t.shape[1:]))]) for t in tensors)
