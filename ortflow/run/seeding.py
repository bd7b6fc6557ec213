"""Seeding: everything at start-up, then torch's and ONNX Runtime's generators again at every step.

ORT's generator state cannot be saved, so before each training step both generators that draw dropout masks are
re-seeded from (seed, step, rank): the masks then depend only on the step and the rank, so a resumed run (on any
rank of a DDP run, too) draws the same ones as an uninterrupted run, and each rank draws its own. Numpy's and
python's generators (which user code may use) are saved in checkpoints.
"""

import random

import numpy as np
import torch

from ortflow.accel.compat.ort_seed import set_ort_seed


def seed_everything(seed: int) -> None:
    """Seed python, numpy, torch and ORT's own generator (dropout inside ORT graphs)."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    set_ort_seed(seed)


def seed_step(seed: int, step: int, rank: int = 0) -> None:
    """Seed torch's and ORT's generators for training step `step` (a distinct stream per step and rank)."""
    step_seed = (seed * 1_000_003 + step + rank * 1_000_000_007) % 2**63
    torch.manual_seed(step_seed)
    set_ort_seed(step_seed)
