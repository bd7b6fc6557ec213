"""The seeds' TransformerModel: nn.Embedding -> nn.TransformerEncoder(nn.TransformerEncoderLayer) -> nn.Linear."""

import logging

import torch
from torch import nn

log = logging.getLogger(__name__)


class TransformerModel(nn.Module):
    """Token embedding, a stack of torch's own encoder layers (layer defaults kept: dropout=0.1,
    batch_first=False, relu, post-norm) and a linear head.

    The data pipeline hands batches as (B, S); the encoder is sequence-first, so forward transposes in and out.
    With `causal=True` every position attends only to itself and earlier positions, which is what makes the
    model a language model rather than a copier of the next token.
    """

    def __init__(
        self,
        vocab_size: int,
        d_model: int,
        nhead: int,
        num_layers: int,
        dim_feedforward: int = 2048,
        dropout: float = 0.1,
        causal: bool = True,
    ) -> None:
        super().__init__()
        self.causal = causal
        self.embedding = nn.Embedding(vocab_size, d_model)
        encoder_layer = nn.TransformerEncoderLayer(
            d_model=d_model, nhead=nhead, dim_feedforward=dim_feedforward, dropout=dropout
        )
        # enable_nested_tensor only matters for padded batch_first inputs; turning it off keeps torch quiet.
        self.transformer = nn.TransformerEncoder(encoder_layer, num_layers=num_layers, enable_nested_tensor=False)
        self.fc = nn.Linear(d_model, vocab_size)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embedding(tokens.t())  # (B, S) -> (S, B, d_model)
        mask = None
        if self.causal:
            seq_len = x.size(0)
            mask = torch.triu(torch.full((seq_len, seq_len), float("-inf"), device=x.device), diagonal=1)
        # is_causal says what the mask is (torch would otherwise compare it with a causal mask on every call: a
        # data-dependent branch that torch.compile cannot trace); eager and the ONNX export take the same path.
        x = self.transformer(x, mask=mask, is_causal=self.causal)  # (S, B, d_model)
        return self.fc(x).transpose(0, 1)  # (B, S, vocab)


def build_transformer(
    vocab_size: int,
    d_model: int = 128,
    nhead: int = 4,
    num_layers: int = 2,
    dim_feedforward: int = 2048,
    dropout: float = 0.1,
    causal: bool = True,
) -> nn.Module:
    """Build the seeds' TransformerModel.

    Args:
        vocab_size: number of token ids (256 for the byte-level text data).
        d_model, nhead, num_layers, dim_feedforward, dropout: nn.TransformerEncoderLayer / Encoder arguments.
        causal: mask attention to earlier positions (needed for language modelling).

    Returns:
        The model, mapping (B, S) int64 tokens to (B, S, vocab_size) logits.
    """
    model = TransformerModel(vocab_size, d_model, nhead, num_layers, dim_feedforward, dropout, causal)
    n_params = sum(p.numel() for p in model.parameters())
    log.info("built TransformerModel: %d layers, d_model=%d, %.2fM parameters", num_layers, d_model, n_params / 1e6)
    return model
