"""A model a user brings: referenced as model._target_=tests.helpers.user_model.build_model, never registered."""

import inspect
import os
import signal

from torch import nn


def build_model(vocab_size: int, d_model: int, **_ignored) -> nn.Module:
    """Embedding + linear: the transformer config's keys arrive as keyword arguments."""
    return nn.Sequential(nn.Embedding(vocab_size, d_model), nn.Linear(d_model, vocab_size))


def build_bigram(vocab_size: int, width: int) -> nn.Module:
    """Used with model=custom, whose keys are whatever the user adds."""
    return nn.Sequential(nn.Embedding(vocab_size, width), nn.Linear(width, vocab_size))


class NaNAtStep(nn.Module):
    """A byte-level bigram model whose training loss turns NaN on the listed training forward calls (1-based)."""

    def __init__(self, vocab_size: int, width: int, nan_steps: list[int]) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Embedding(vocab_size, width), nn.Linear(width, vocab_size))
        self.nan_steps = set(nan_steps)
        self.calls = 0

    def forward(self, inputs):
        logits = self.net(inputs)
        if self.training:
            self.calls += 1
            if self.calls in self.nan_steps:
                return logits * float("nan")
        return logits


def build_nan_at_step(vocab_size: int, width: int, nan_steps: list[int]) -> nn.Module:
    """Used with model=custom: `+model.nan_steps=[5]` makes step 5's loss NaN (eager only)."""
    return NaNAtStep(vocab_size, width, nan_steps)


class DiesOnRank(nn.Module):
    """A bigram model whose process exits abruptly on one rank at one training step (a crashed worker)."""

    def __init__(self, vocab_size: int, width: int, rank: int, step: int) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Embedding(vocab_size, width), nn.Linear(width, vocab_size))
        self.dies = int(os.environ.get("RANK", 0)) == rank
        self.step, self.calls = step, 0

    def forward(self, inputs):
        if self.training:
            self.calls += 1
            if self.dies and self.calls == self.step:
                os._exit(3)
        return self.net(inputs)


def build_dies_on_rank(vocab_size: int, width: int, rank: int, step: int) -> nn.Module:
    return DiesOnRank(vocab_size, width, rank, step)


def _inside(filename: str, function: str) -> bool:
    return any(f.filename.endswith(filename) and f.function == function for f in inspect.stack())


class SignalAt(nn.Module):
    """A bigram model that sends its own process a signal at one moment of a run: while it is built (start-up),
    while it is exported to ONNX, in its 2nd training forward, in an eval forward, or while a checkpoint of it is
    written (its state_dict is read during training)."""

    def __init__(self, vocab_size: int, width: int, moment: str, sig: str) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Embedding(vocab_size, width), nn.Linear(width, vocab_size))
        self.moment, self.sig, self.calls, self.sent = moment, getattr(signal, sig), 0, False
        if moment == "checkpoint":  # while ortflow's RunDir.save reads the weights to write a checkpoint
            self._register_state_dict_hook(lambda *_: self._send() if _inside("rundir.py", "save") else None)
        if moment == "start-up":
            self._send()

    def _send(self) -> None:
        if not self.sent:
            self.sent = True
            os.kill(os.getpid(), self.sig)

    def forward(self, inputs):
        import torch

        if self.moment == "export" and torch.onnx.is_in_onnx_export():
            self._send()
        elif self.moment == "train" and self.training:  # (accel=none: a counter in the forward is refused by ORT's)
            self.calls += 1
            if self.calls == 2:
                self._send()
        elif not self.training and self.moment == "eval" and _inside("trainer.py", "evaluate"):
            self._send()
        return self.net(inputs)


def build_signal_at(vocab_size: int, width: int, moment: str, sig: str) -> nn.Module:
    return SignalAt(vocab_size, width, moment, sig)


class OutOfMemory(nn.Module):
    """A bigram model whose first training forward fails as torch's CPU allocator does when memory runs out."""

    def __init__(self, vocab_size: int, width: int) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Embedding(vocab_size, width), nn.Linear(width, vocab_size))

    def forward(self, inputs):
        if self.training:
            raise RuntimeError(
                "[enforce fail at alloc_cpu.cpp:117] data. DefaultCPUAllocator: not enough memory: you tried to "
                "allocate 34359738368 bytes."
            )
        return self.net(inputs)


def build_out_of_memory(vocab_size: int, width: int) -> nn.Module:
    return OutOfMemory(vocab_size, width)


class ReturnsInt(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Linear(2, 2)

    def forward(self, inputs):
        return 3


def build_returns_int(**_ignored) -> nn.Module:
    return ReturnsInt()


def build_wrong_rank(vocab_size: int, width: int) -> nn.Module:
    """Logits (B, C) for (B, T) targets: the sequence dimension is pooled away."""
    return nn.Sequential(nn.Embedding(vocab_size, width), nn.Flatten(), nn.LazyLinear(vocab_size))


def build_too_few_classes(vocab_size: int, width: int) -> nn.Module:
    return nn.Sequential(nn.Embedding(vocab_size, width), nn.Linear(width, 10))


def build_batchnorm_mlp(num_classes: int = 10, width: int = 32) -> nn.Module:
    return nn.Sequential(nn.Linear(64, width), nn.BatchNorm1d(width), nn.ReLU(), nn.Linear(width, num_classes))


class Product(nn.Module):
    """Each position scaled by the product of its features: its ONNX op, ReduceProd, has no gradient in ONNX
    Runtime 1.19."""

    def forward(self, x):
        return x * x.prod(dim=-1, keepdim=True)


def build_product(vocab_size: int, width: int) -> nn.Module:
    """A bigram model with a feature product between its embedding and its head (module `1`)."""
    return nn.Sequential(nn.Embedding(vocab_size, width), Product(), nn.Linear(width, vocab_size))


class VersionedLinear(nn.Linear):
    """A linear layer whose state_dict format is at version 3: its `_load_from_state_dict` refuses a state_dict
    without that version, as torchvision's MNASNet does (a module that changed its layout converts older versions
    there, and needs to know which one it is given)."""

    _version = 3

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, *args) -> None:
        version = local_metadata.get("version")
        if version != self._version:
            raise ValueError(f"VersionedLinear '{prefix}' needs its state_dict version {self._version}, got {version}")
        super()._load_from_state_dict(state_dict, prefix, local_metadata, *args)


def build_versioned(num_classes: int = 10, width: int = 32) -> nn.Module:
    """A digits MLP of VersionedLinear layers (use with data=digits)."""
    return nn.Sequential(VersionedLinear(64, width), nn.ReLU(), VersionedLinear(width, num_classes))


class RefusesItsWeights(nn.Linear):
    """A linear layer that trains, then refuses every state_dict it is given (a bug in a module's loading code)."""

    def _load_from_state_dict(self, *_args) -> None:
        raise RuntimeError("this layer cannot load a state_dict")


def build_refuses_its_weights(num_classes: int = 10) -> nn.Module:
    return nn.Sequential(nn.Linear(64, 32), nn.ReLU(), RefusesItsWeights(32, num_classes))
