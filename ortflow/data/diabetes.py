"""scikit-learn's bundled diabetes set (442 patients, 10 standardised features, one real-valued target: disease
progression after a year), shipped inside scikit-learn: a regression task with no download."""

import logging

import torch
from sklearn.datasets import load_diabetes
from sklearn.model_selection import train_test_split
from torch.utils.data import DataLoader, TensorDataset

from ortflow.data import Data, tensors_fingerprint

log = logging.getLogger(__name__)


def build_diabetes_data(batch_size: int, val_fraction: float, seed: int, num_workers: int = 0) -> Data:
    """Random train/held-out split; targets standardised with the training split's mean and deviation.

    Batches are ((B, 10) float features, (B, 1) float targets). `info["mean_predictor_mse"]` is the held-out mean
    squared error of always predicting the training mean (in the standardised unit eval/loss uses with loss=mse):
    the baseline a regression model must beat.

    Args:
        batch_size: patients per batch.
        val_fraction: share of the patients held out for evaluation.
        seed: seeds the split and the training shuffle.
        num_workers: DataLoader worker processes.
    """
    x, y = load_diabetes(return_X_y=True)
    x_tr, x_val, y_tr, y_val = train_test_split(x, y, test_size=val_fraction, random_state=seed)
    mean, std = float(y_tr.mean()), float(y_tr.std())

    def tensors(features, targets) -> tuple[torch.Tensor, torch.Tensor]:
        scaled = (torch.tensor(targets, dtype=torch.float32) - mean) / std
        return torch.tensor(features, dtype=torch.float32), scaled.unsqueeze(1)

    (xt, yt), (xv, yv) = tensors(x_tr, y_tr), tensors(x_val, y_val)
    generator = torch.Generator().manual_seed(seed)
    train = DataLoader(
        TensorDataset(xt, yt), batch_size, shuffle=True, drop_last=True, generator=generator, num_workers=num_workers
    )
    val = DataLoader(TensorDataset(xv, yv), batch_size, shuffle=False, num_workers=num_workers)
    baseline = float(yv.square().mean())  # the training mean is 0 in the standardised unit
    log.info("diabetes: %d train / %d held-out patients", len(xt), len(xv))
    info = {
        "source": "sklearn.load_diabetes",
        "train_patients": len(xt),
        "val_patients": len(xv),
        "target_mean": mean,
        "target_std": std,
        "mean_predictor_mse": baseline,
    }
    return Data(train, val, info, fingerprint=tensors_fingerprint(xt, yt, xv, yv))
