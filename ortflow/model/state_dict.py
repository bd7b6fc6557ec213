"""A model's weights as a state_dict kept whole: the tensors and the state_dict's `_metadata`, each module's version.

torch's `Module.state_dict()` returns an OrderedDict whose `_metadata` attribute holds every module's `_version`, and
`load_state_dict` hands each module its entry: a module that changed its layout between versions converts older
weights in `_load_from_state_dict` (BatchNorm adds `num_batches_tracked`, torchvision's MNASNet rebuilds its stem for
version 1 and refuses a state_dict without a version at all). A dict comprehension over a state_dict drops the
metadata, so weights copied, filtered or sent through ortflow keep it here: what an engine returns, checkpoints,
final.pt and best.pt, resume and every export.
"""

from collections import OrderedDict
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

StateDict = dict[str, torch.Tensor]


def metadata(weights: Mapping[str, Any]) -> Any:
    """The state_dict metadata `weights` carries (None for a plain dict)."""
    return getattr(weights, "_metadata", None)


def copied(model: nn.Module) -> StateDict:
    """`model`'s state_dict with every tensor copied (detached), its metadata kept."""
    state = model.state_dict()
    return with_metadata(OrderedDict((k, v.detach().clone()) for k, v in state.items()), state)


def with_metadata(weights: Mapping[str, torch.Tensor], source: Mapping[str, Any] | nn.Module) -> StateDict:
    """`weights` (a new OrderedDict, the same tensors) with the state_dict metadata of `source`: a state_dict's own, or
    a module's (its state_dict's). Weights that already carry metadata keep theirs."""
    kept = metadata(weights)
    if kept is None:
        kept = metadata(source.state_dict() if isinstance(source, nn.Module) else source)
    result = OrderedDict(weights)
    if kept is not None:
        result._metadata = kept  # type: ignore[attr-defined]
    return result


def without(weights: Mapping[str, torch.Tensor], names: set[str]) -> StateDict:
    """`weights` without the entries `names` (frozen parameters a checkpoint leaves out), metadata kept."""
    return with_metadata(OrderedDict((k, v) for k, v in weights.items() if k not in names), weights)
