"""A user's data builder for a Hugging Face classification model: dict batches (input_ids, attention_mask) with
padding at the end of each sequence, and one class per sequence (does token 7 occur in its real tokens?)."""

import torch
from torch.utils.data import DataLoader, Dataset

from ortflow.data import Data


class _Sequences(Dataset):
    def __init__(self, n: int, length: int, vocab: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(8, vocab, (n, length), generator=g)
        self.lengths = torch.randint(length // 2, length + 1, (n,), generator=g)
        self.mask = (torch.arange(length)[None, :] < self.lengths[:, None]).long()
        plant = torch.rand(n, generator=g) < 0.5
        self.ids[plant, 0] = 7
        self.ids = self.ids * self.mask  # padding id 0 after each sequence
        self.labels = plant.long()

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int):
        return {"input_ids": self.ids[i], "attention_mask": self.mask[i]}, self.labels[i]


def token_classes(batch_size: int = 8, length: int = 16, vocab: int = 64, seed: int = 0) -> Data:
    train = DataLoader(
        _Sequences(256, length, vocab, seed),
        batch_size,
        shuffle=True,
        drop_last=True,
        generator=torch.Generator().manual_seed(seed),
    )
    val = DataLoader(_Sequences(64, length, vocab, seed + 1), batch_size)
    return Data(train, val, {"source": "tests.helpers.hf_data.token_classes", "vocab_size": vocab})
