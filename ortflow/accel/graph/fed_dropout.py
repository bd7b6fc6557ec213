"""Dropout with its masks fed as inputs, for ORTModule (`accel.rewrite_dropout`).

ORT's CPU Dropout draws its random numbers slowly, on one thread. ORTModule exports whatever the wrapped module's
forward does, so the forward below takes the masks as extra inputs and, while it runs, `torch.nn.functional.dropout`
(what nn.Dropout calls) multiplies by the next mask instead of drawing one: the exported graph has `x * mask` with
the mask a graph input, and the engine draws the masks each step (masks.MaskSampler: fast, seeded from torch's
RNG). scaled_dot_product_attention with `dropout_p` (nn.MultiheadAttention's attention-weights dropout) is written
out meanwhile as torch documents it, so that its dropout goes through `nn.functional.dropout` too.

With `keep_flags` (trainer.precision=bf16-mixed with accel.bf16_edges), a dropout between a linear's ReLU and the
next linear (`linear -> relu -> dropout -> linear`, found while the masks are found) takes uint8 keep flags instead:
the forward multiplies by `keep * 1/(1-p)`, exported as `x * (Cast(keep) * scale)` with the scale a constant, which
the bf16-edges rewrite (bf16_edges.py) takes into the fused GEMM-ReLU node, so that the chain hands bf16 along. Where
that rewrite does not fuse the chain, the graph computes what a float mask gives.
"""

import contextlib
import dataclasses
import functools
import math
from collections.abc import Iterator

import numpy as np
import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from ortflow.accel.graph.masks import DropoutMask
from ortflow.errors import OrtflowError
from ortflow.model.probe import training_forward_probe
from ortflow.step.with_loss import WithLoss

_dropout = torch.nn.functional.dropout
_attention = torch.nn.functional.scaled_dot_product_attention


def attention_with_functional_dropout(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
    *,
    fp32_products: bool = False,
) -> torch.Tensor:
    """scaled_dot_product_attention, written out as torch's documentation gives it when it drops attention weights,
    its dropout a call of `nn.functional.dropout` (so that a replaced dropout applies there too). Without dropout,
    or with grouped-query attention, torch's own.

    `fp32_products` (trainer.precision=bf16-mixed): the two products are einsums, which ORT runs as its own fp32
    MatMuls (accel/graph/einsum.py), not as bf16 GEMMs (aten_gemm.py replaces matmul, not einsum). That is how torch
    computes this attention under CPU autocast: scaled_dot_product_attention with dropout takes its math path, which
    computes a bf16 query, key and value in fp32 (torch 2.6 to 2.14 alike), and so does the artifacts engine, whose
    export keeps torch's own attention. A boolean mask (is_causal's too) is then added as 0 and -inf, as that math path
    adds it, rather than filled in with a Where over the scores."""
    if dropout_p == 0.0 or enable_gqa:
        return _attention(query, key, value, attn_mask, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa)
    length, source = query.size(-2), key.size(-2)
    scores_of, weighted = _equations(query, key, value)
    scores = torch.einsum(scores_of, query, key) if fp32_products else query @ key.transpose(-2, -1)
    weights = scores * (1 / math.sqrt(query.size(-1)) if scale is None else scale)
    masks = [torch.ones(length, source, dtype=torch.bool, device=query.device).tril()] if is_causal else []
    masks += [] if attn_mask is None else [attn_mask]
    for mask in masks:
        if mask.dtype != torch.bool:
            weights = weights + mask
        elif fp32_products:
            # as torch's math path applies it: an added -inf, no Where over the scores (nor in the gradient)
            weights = weights + torch.zeros(mask.shape, dtype=weights.dtype, device=mask.device).masked_fill(
                mask.logical_not(), float("-inf")
            )
        else:
            weights = weights.masked_fill(mask.logical_not(), float("-inf"))
    weights = torch.nn.functional.dropout(torch.softmax(weights, dim=-1), dropout_p)
    return torch.einsum(weighted, weights, value) if fp32_products else weights @ value


def _equations(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> tuple[str, str]:
    """The attention's two einsum equations, each leading dim named where the operands have one rank: ORTModule's
    export may leave an ellipsis's rank unknown to the graph's types, and ORT has no Einsum gradient, so an
    einsum with one could not be written as the MatMul it is (accel/graph/einsum.py needs the ranks)."""
    if not query.dim() == key.dim() == value.dim() or query.dim() > 24:
        return "...qd,...kd->...qk", "...qk,...kd->...qd"
    lead = "abcefghijlmnoprstuvwxyz"[: query.dim() - 2]  # not q, k, d
    return f"{lead}qd,{lead}kd->{lead}qk", f"{lead}qk,{lead}kd->{lead}qd"


@contextlib.contextmanager
def _dropout_replaced(replacement, fp32_products: bool = False) -> Iterator[None]:
    torch.nn.functional.dropout = replacement
    torch.nn.functional.scaled_dot_product_attention = functools.partial(
        attention_with_functional_dropout, fp32_products=fp32_products
    )
    try:
        yield
    finally:
        torch.nn.functional.dropout = _dropout
        torch.nn.functional.scaled_dot_product_attention = _attention


class _LinearReluChains(TorchFunctionMode):
    """Which tensors of one forward are the ReLU of a linear's output, and which dropout outputs a linear reads."""

    RELUS = (torch.relu, torch.relu_, torch.nn.functional.relu, torch.Tensor.relu, torch.Tensor.relu_)

    def __init__(self) -> None:
        super().__init__()
        self.linear_outputs: set[int] = set()
        self.relu_of_linear: set[int] = set()
        self.dropped: dict[int, int] = {}  # a dropout's output -> its site's index
        self.read_by_linear: set[int] = set()  # sites a linear reads
        self.alive: list[torch.Tensor] = []  # the tensors named by id above, kept so that no id is reused

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        first = args[0] if args else None
        if func is torch.nn.functional.linear:
            if id(first) in self.dropped:
                self.read_by_linear.add(self.dropped[id(first)])
            self._mark(self.linear_outputs, out)
        elif func in self.RELUS and id(first) in self.linear_outputs:
            self._mark(self.relu_of_linear, out)
        return out

    def _mark(self, where: set[int], tensor: object) -> None:
        if isinstance(tensor, torch.Tensor):
            where.add(id(tensor))
            self.alive.append(tensor)

    def site(self, x: torch.Tensor, dropped: torch.Tensor, index: int) -> None:
        """A dropout site: its input `x` and output `dropped`."""
        if id(x) in self.relu_of_linear:
            self.dropped[id(dropped)] = index
            self.alive.append(dropped)


def find_masks(module: WithLoss, example: tuple[torch.Tensor, ...], keep_flags: bool = False) -> list[DropoutMask]:
    """The dropout sites (functional dropout in training mode with p > 0) of one training forward of `module` on
    `example` (flat inputs and targets), in call order. Its buffers are restored afterwards. With `keep_flags`, the
    sites between a linear's ReLU and a linear take uint8 keep flags (module docstring)."""
    found: list[DropoutMask] = []
    chains = _LinearReluChains()
    inside: list[bool] = []  # under the function mode, torch's dropout hands itself (this function) to the mode

    def record(x: torch.Tensor, p: float = 0.5, training: bool = True, inplace: bool = False) -> torch.Tensor:
        if not training or p <= 0 or inside:
            return _dropout(x, p, training, inplace)
        inside.append(True)
        try:
            dropped = _dropout(x, p, training, inplace)
        finally:
            inside.pop()
        found.append(DropoutMask(f"dropout_mask_{len(found)}", tuple(x.shape), float(p), np.dtype(str(x.dtype)[6:])))
        chains.site(x, dropped, len(found) - 1)
        return dropped

    with training_forward_probe(module), _dropout_replaced(record), chains if keep_flags else contextlib.nullcontext():
        module(*example)
    if keep_flags:
        for index in chains.read_by_linear:
            found[index] = dataclasses.replace(found[index], dtype=np.dtype(np.uint8))
    return found


class WithLossAndMasks(WithLoss):
    """WithLoss whose forward takes the dropout masks after the flat inputs and before the targets."""

    def __init__(self, inner: WithLoss, masks: list[DropoutMask], fp32_attention: bool = False) -> None:
        super().__init__(inner.model, inner.loss, inner.layout, inner.autocast)
        self.masks = masks
        self.fp32_attention = fp32_attention  # attention_with_functional_dropout's fp32_products

    def forward(self, *tensors: torch.Tensor):
        n = len(self.masks)
        *inputs, targets = tensors
        masks = iter(inputs[len(inputs) - n :])
        sites = iter(self.masks)

        def multiply(x: torch.Tensor, p: float = 0.5, training: bool = True, inplace: bool = False) -> torch.Tensor:
            if not training or p == 0:
                return _dropout(x, p, training, inplace)
            site, mask = next(sites, None), next(masks, None)
            if site is None or mask is None or tuple(x.shape) != site.shape or float(p) != site.ratio:
                raise OrtflowError(
                    "accel.rewrite_dropout: this model's dropout calls differ from those found when the engine was "
                    f"built (a dropout of shape {tuple(x.shape)}, p={p} where "
                    f"{'none' if site is None else f'shape {site.shape}, p={site.ratio}'} was expected): its forward "
                    "changes with the input. Set accel.rewrite_dropout=false."
                )
            if mask.dtype == torch.uint8:  # keep flags (module docstring)
                return x * (mask.to(x.dtype) * site.scale.item())
            return x * mask

        if not self.training:
            return super().forward(*inputs[: len(inputs) - n], targets)
        with _dropout_replaced(multiply, self.fp32_attention):
            return super().forward(*inputs[: len(inputs) - n], targets)


def wrap(
    module: WithLoss, example: tuple[torch.Tensor, ...], keep_flags: bool = False, fp32_attention: bool = False
) -> tuple[nn.Module, list[DropoutMask]]:
    """`module` taking its dropout masks as inputs, and the masks it takes; `module` itself when it has none.
    `keep_flags`: as find_masks; `fp32_attention`: attention_with_functional_dropout's `fp32_products`."""
    masks = find_masks(module, example, keep_flags)
    return (WithLossAndMasks(module, masks, fp32_attention), masks) if masks else (module, [])
