"""A zoo of small model families a user might bring, each a plain builder for `model._target_`."""

import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset, TensorDataset

from ortflow.data import Data
from ortflow.data.digits import build_digits_data
from ortflow.data.text import build_text_data


def mlp(num_classes: int = 10) -> nn.Module:
    return nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, num_classes))


def cnn_batchnorm(num_classes: int = 10) -> nn.Module:
    """A CNN with BatchNorm on the digits as 8x8 images."""
    return nn.Sequential(
        nn.Unflatten(1, (1, 8, 8)),
        nn.Conv2d(1, 4, 3, padding=1),
        nn.BatchNorm2d(4),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(4 * 64, num_classes),
    )


def cnn_norms(num_classes: int = 10) -> nn.Module:
    """A CNN with GroupNorm and InstanceNorm on the digits as 8x8 images."""
    return nn.Sequential(
        nn.Unflatten(1, (1, 8, 8)),
        nn.Conv2d(1, 8, 3, padding=1),
        nn.GroupNorm(2, 8),
        nn.ReLU(),
        nn.Conv2d(8, 4, 3, padding=1),
        nn.InstanceNorm2d(4, affine=True),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(4 * 64, num_classes),
    )


class UpDown(nn.Module):
    """A depthwise convolution, a transposed convolution back up and a Conv1d over the rows, on 8x8 digits."""

    def __init__(self, num_classes: int = 10) -> None:
        super().__init__()
        self.down = nn.Conv2d(1, 4, 2, stride=2)  # (B, 4, 4, 4)
        self.depthwise = nn.Conv2d(4, 4, 3, padding=1, groups=4)
        self.up = nn.ConvTranspose2d(4, 2, 2, stride=2)  # (B, 2, 8, 8)
        self.rows = nn.Conv1d(16, 8, 3, padding=1)  # the 2x8 rows as 16 channels along the columns
        self.head = nn.Linear(8 * 8, num_classes)

    def forward(self, x):
        x = self.up(torch.relu(self.depthwise(torch.relu(self.down(x.view(-1, 1, 8, 8))))))
        return self.head(torch.relu(self.rows(x.reshape(-1, 16, 8))).flatten(1))


def up_down(num_classes: int = 10) -> nn.Module:
    return UpDown(num_classes)


class PatchClassifier(nn.Module):
    """ViT-style: 2x2 patches of the 8x8 digits cut by a strided Conv2d, one transformer layer, mean pooling."""

    def __init__(self, num_classes: int = 10, width: int = 16) -> None:
        super().__init__()
        self.patches = nn.Conv2d(1, width, 2, stride=2)
        self.position = nn.Parameter(torch.zeros(16, width))
        self.encoder = nn.TransformerEncoderLayer(width, 2, 2 * width, dropout=0.0, batch_first=True)
        self.head = nn.Linear(width, num_classes)

    def forward(self, x):
        tokens = self.patches(x.view(-1, 1, 8, 8)).flatten(2).transpose(1, 2) + self.position
        return self.head(self.encoder(tokens).mean(1))


def patch_classifier(num_classes: int = 10) -> nn.Module:
    return PatchClassifier(num_classes)


def sync_batchnorm_mlp(num_classes: int = 10, width: int = 32) -> nn.Module:
    """SyncBatchNorm, which the ORT engines refuse (it averages statistics across processes in its forward)."""
    return nn.Sequential(nn.Linear(64, width), nn.SyncBatchNorm(width), nn.ReLU(), nn.Linear(width, num_classes))


class GRULanguageModel(nn.Module):
    def __init__(self, vocab_size: int = 256, width: int = 16) -> None:
        super().__init__()
        self.embedding = nn.Embedding(vocab_size, width)
        self.rnn = nn.GRU(width, width, batch_first=True)
        self.head = nn.Linear(width, vocab_size)

    def forward(self, tokens):
        out, _ = self.rnn(self.embedding(tokens))
        return self.head(out)


def gru_lm() -> nn.Module:
    return GRULanguageModel()


class GPTBlock(nn.Module):
    """A causal self-attention block written with F.scaled_dot_product_attention, batch-first."""

    def __init__(self, vocab_size: int = 256, width: int = 16, heads: int = 2, block: int = 64) -> None:
        super().__init__()
        self.heads = heads
        self.embedding = nn.Embedding(vocab_size, width)
        self.position = nn.Parameter(torch.zeros(block, width))
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))
        self.head = nn.Linear(width, vocab_size)

    def forward(self, tokens):
        b, t = tokens.shape
        x = self.embedding(tokens) + self.position[:t]
        q, k, v = self.qkv(self.norm1(x)).split(x.size(-1), dim=-1)
        q, k, v = (z.reshape(b, t, self.heads, -1).transpose(1, 2) for z in (q, k, v))
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, -1)
        x = x + self.proj(attn)
        x = x + self.mlp(self.norm2(x))
        return self.head(x)


def gpt_block() -> nn.Module:
    return GPTBlock()


class DropoutBlock(GPTBlock):
    """GPTBlock with dropout in each form a user writes it: the attention weights' (scaled_dot_product_attention's
    dropout_p), a functional F.dropout and an nn.Dropout module."""

    def __init__(self, p: float = 0.1) -> None:
        super().__init__()
        self.p = p
        self.drop = nn.Dropout(p)

    def forward(self, tokens):
        b, t = tokens.shape
        x = self.embedding(tokens) + self.position[:t]
        q, k, v = self.qkv(self.norm1(x)).split(x.size(-1), dim=-1)
        q, k, v = (z.reshape(b, t, self.heads, -1).transpose(1, 2) for z in (q, k, v))
        p = self.p if self.training else 0.0
        attn = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True).transpose(1, 2).reshape(b, t, -1)
        x = x + F.dropout(self.proj(attn), p, self.training)
        x = x + self.drop(self.mlp(self.norm2(x)))
        return self.head(x)


def dropout_block() -> nn.Module:
    return DropoutBlock()


class TiedEmbeddings(nn.Module):
    def __init__(self, vocab_size: int = 256, width: int = 16) -> None:
        super().__init__()
        self.embedding = nn.Embedding(vocab_size, width)
        self.mix = nn.Linear(width, width)
        self.head = nn.Linear(width, vocab_size, bias=False)
        self.head.weight = self.embedding.weight  # one tensor, two uses

    def forward(self, tokens):
        return self.head(torch.tanh(self.mix(self.embedding(tokens))))


def tied_embeddings() -> nn.Module:
    return TiedEmbeddings()


def frozen_submodule() -> nn.Module:
    model = nn.Sequential(nn.Embedding(256, 16), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 256))
    for p in model[0].parameters():
        p.requires_grad = False  # a frozen pretrained embedding
    return model


class ScaledTanh(torch.autograd.Function):
    """A custom autograd Function: tanh(x) * 2 with its own backward."""

    @staticmethod
    def forward(ctx, x):
        y = torch.tanh(x)
        ctx.save_for_backward(y)
        return 2 * y

    @staticmethod
    def backward(ctx, grad):
        (y,) = ctx.saved_tensors
        return grad * 2 * (1 - y * y)


class WithCustomFunction(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embedding, self.head = nn.Embedding(256, 16), nn.Linear(16, 256)

    def forward(self, tokens):
        return self.head(ScaledTanh.apply(self.embedding(tokens)))


def custom_function() -> nn.Module:
    return WithCustomFunction()


class DoubleInPlace(torch.autograd.Function):
    """A custom Function that modifies its input in place (ctx.mark_dirty) and returns a second, non-differentiable
    output: the case whose dirty-tensor bookkeeping changed in newer torch."""

    @staticmethod
    def forward(ctx, x):
        x.mul_(2)
        ctx.mark_dirty(x)
        sign = torch.sign(x)
        ctx.mark_non_differentiable(sign)
        return x, sign

    @staticmethod
    def backward(ctx, grad, _grad_sign):
        return grad * 2


class WithInPlaceFunction(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embedding, self.head = nn.Embedding(256, 16), nn.Linear(16, 256)

    def forward(self, tokens):
        doubled, sign = DoubleInPlace.apply(self.embedding(tokens) + 0)
        return self.head(torch.tanh(doubled) + 0.1 * sign)


def inplace_function() -> nn.Module:
    return WithInPlaceFunction()


class WithBuffers(nn.Module):
    """A registered buffer (a fixed sinusoidal position table) used in forward."""

    def __init__(self, width: int = 16, block: int = 64) -> None:
        super().__init__()
        position = torch.arange(block).unsqueeze(1) / (10000 ** (torch.arange(width) / width))
        self.register_buffer("table", torch.sin(position) / math.sqrt(width))
        self.embedding, self.head = nn.Embedding(256, width), nn.Linear(width, 256)

    def forward(self, tokens):
        return self.head(self.embedding(tokens) + self.table[: tokens.size(1)])


def buffers() -> nn.Module:
    return WithBuffers()


class TwoInputs(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embedding, self.head = nn.Embedding(256, 16), nn.Linear(16, 256)

    def forward(self, tokens, mask):
        return self.head(self.embedding(tokens) * mask.unsqueeze(-1))


def two_inputs() -> nn.Module:
    return TwoInputs()


class ReturnsDict(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embedding, self.head = nn.Embedding(256, 16), nn.Linear(16, 256)

    def forward(self, tokens):
        return {"logits": self.head(self.embedding(tokens))}


def returns_dict() -> nn.Module:
    return ReturnsDict()


class ReturnsTuple(nn.Module):
    """(logits, hidden state), as nn.GRU-based models often return."""

    def __init__(self) -> None:
        super().__init__()
        self.embedding, self.rnn, self.head = (
            nn.Embedding(256, 16),
            nn.GRU(16, 16, batch_first=True),
            nn.Linear(16, 256),
        )

    def forward(self, tokens):
        out, hidden = self.rnn(self.embedding(tokens))
        return self.head(out), hidden


def returns_tuple() -> nn.Module:
    return ReturnsTuple()


class Output:
    """A library-style output object (like a Hugging Face ModelOutput) with the logits as an attribute."""

    def __init__(self, logits, features) -> None:
        self.logits, self.features = logits, features


class ReturnsObject(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embedding, self.head = nn.Embedding(256, 16), nn.Linear(16, 256)

    def forward(self, tokens):
        features = self.embedding(tokens)
        return Output(self.head(features), features)


def returns_object() -> nn.Module:
    return ReturnsObject()


def dict_inputs() -> nn.Module:
    """The same two-input model, fed a dict batch: forward(tokens=..., mask=...)."""
    return TwoInputs()


class _WithMask(Dataset):
    """Text samples plus a float mask input, as a tuple (tokens, mask, targets) or ({"tokens", "mask"}, targets)."""

    def __init__(self, samples: Dataset, as_dict: bool) -> None:
        self.samples, self.as_dict = samples, as_dict

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, i: int):
        tokens, targets = self.samples[i]
        mask = (tokens % 3).float() / 2 + 0.5
        return ({"tokens": tokens, "mask": mask}, targets) if self.as_dict else (tokens, mask, targets)


def masked_text(batch_size: int = 8, block_size: int = 16, seed: int = 0, as_dict: bool = False) -> Data:
    """A user's data builder with two model inputs per batch
    (data=custom data._target_=tests.helpers.zoo.masked_text)."""
    text = build_text_data("python_docs", block_size, batch_size, 0.1, seed)
    train = DataLoader(
        _WithMask(text.train.dataset, as_dict),
        batch_size,
        shuffle=True,
        drop_last=True,
        generator=torch.Generator().manual_seed(seed),
    )
    return Data(train, DataLoader(_WithMask(text.val.dataset, as_dict), batch_size), text.info)


def even_digits(batch_size: int = 32, seed: int = 0) -> Data:
    """Binary labels: is the digit even? float (B, 1) targets, for loss=bce_with_logits."""
    digits = build_digits_data(batch_size, 0.25, seed)

    def binary(loader: DataLoader, **kwargs) -> DataLoader:
        x, y = loader.dataset.tensors
        return DataLoader(TensorDataset(x, (y % 2 == 0).float().unsqueeze(1)), batch_size, **kwargs)

    gen = torch.Generator().manual_seed(seed)
    return Data(binary(digits.train, shuffle=True, drop_last=True, generator=gen), binary(digits.val), digits.info)


def mean_abs_error(output: torch.Tensor, targets: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    """A user's own loss function (loss=custom loss._target_=tests.helpers.zoo.mean_abs_error)."""
    return scale * (output - targets).abs().mean()


def a_number(output: torch.Tensor, targets: torch.Tensor) -> int:
    """Not a loss: returns a Python int."""
    return 1


def _no_gradient(grad: torch.Tensor) -> torch.Tensor:
    return torch.zeros_like(grad)


def gradient_masked(num_classes: int = 10) -> nn.Module:
    """The digits MLP whose first layer's weight has a hook returning a zero gradient (gradient masking, a way to
    freeze or prune): eager PyTorch and ORTModule keep that weight where it started."""
    model = mlp(num_classes)
    model[0].weight.register_hook(_no_gradient)
    return model


class ConvBiasBatchNorm(nn.Module):
    """Convolutions with biases before BatchNorms (a common shape): those biases' gradients are 0 in exact arithmetic,
    rounding noise in any engine."""

    def __init__(self, num_classes: int = 10) -> None:
        super().__init__()
        self.body = nn.Sequential(
            nn.Unflatten(1, (1, 8, 8)),
            nn.Conv2d(1, 8, 3, padding=1),
            nn.BatchNorm2d(8),
            nn.ReLU(),
            nn.Conv2d(8, 8, 3, padding=1),
            nn.BatchNorm2d(8),
            nn.ReLU(),
            nn.Flatten(),
        )
        self.head = nn.Linear(8 * 64, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))


def conv_bias_batchnorm(num_classes: int = 10) -> nn.Module:
    return ConvBiasBatchNorm(num_classes)
