"""Seeding: everything at start-up, and ONNX Runtime's generator again at every step.

ORT's generator state cannot be saved, so it is re-seeded before each training step from (seed, step): the
dropout masks inside ORT graphs then depend only on the step, and a resumed run draws the same ones as an
uninterrupted run. Torch's, numpy's and python's generators are saved in checkpoints instead.
"""

import random

import numpy as np
import torch


def _set_ort_seed(seed: int) -> None:
    from onnxruntime.capi import _pybind_state

    _pybind_state.set_seed(seed)


def seed_everything(seed: int) -> None:
    """Seed python, numpy, torch and ORT's own generator (dropout inside ORT graphs)."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    _set_ort_seed(seed)


def seed_ort_for_step(seed: int, step: int, rank: int = 0) -> None:
    """Seed ORT's generator for training step `step` (a distinct, reproducible stream per step and rank)."""
    _set_ort_seed((seed * 1_000_003 + step + rank * 1_000_000_007) % 2**63)
