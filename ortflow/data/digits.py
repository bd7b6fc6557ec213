"""scikit-learn's bundled handwritten digits (1,797 8x8 images, 10 classes), shipped inside the package."""

import logging

import torch
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from torch.utils.data import DataLoader, TensorDataset

from ortflow.data import Data, tensors_fingerprint

log = logging.getLogger(__name__)


def build_digits_data(batch_size: int, val_fraction: float, seed: int, num_workers: int = 0) -> Data:
    """Stratified train/held-out split of the digits, pixels scaled to [0, 1].

    Args:
        batch_size: images per batch.
        val_fraction: share of the images held out for evaluation.
        seed: seeds the split and the training shuffle.
        num_workers: DataLoader worker processes.
    """
    digits = load_digits()
    x = torch.tensor(digits.data / 16.0, dtype=torch.float32)  # (N, 64)
    y = torch.tensor(digits.target, dtype=torch.long)  # (N,)
    x_tr, x_val, y_tr, y_val = train_test_split(x, y, test_size=val_fraction, random_state=seed, stratify=y.numpy())
    generator = torch.Generator().manual_seed(seed)
    train = DataLoader(
        TensorDataset(x_tr, y_tr),
        batch_size,
        shuffle=True,
        drop_last=True,
        generator=generator,
        num_workers=num_workers,
    )
    val = DataLoader(TensorDataset(x_val, y_val), batch_size, shuffle=False, num_workers=num_workers)
    log.info("digits: %d train / %d held-out images", len(x_tr), len(x_val))
    info = {"source": "sklearn.load_digits", "train_images": len(x_tr), "val_images": len(x_val)}
    return Data(train, val, info, fingerprint=tensors_fingerprint(x_tr, y_tr, x_val, y_val))
