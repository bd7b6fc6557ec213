"""The dropout masks the ORT engines feed their graphs (rewrites.dropout_to_mask_inputs, fed_dropout.py): what a mask
input is, and one step's masks drawn where they are fast.

An element drops when a 32-bit random integer is below round(ratio * 2**32) (the probability is exact to 2**-33;
torch's CPU bernoulli_ compares a 24-bit float). The integers come from numpy's SFC64, the fastest of its generators
here, in streams of CHUNK values, each seeded from (the step's seed, its index), so a seed fixes the masks whatever
the number of threads that draw them. The streams, and then each mask's comparison and scaling, run on as many
threads as torch uses (numpy leaves the interpreter lock while it draws and computes): on the transformer recipe's
4.2M mask values per step, 2 threads draw in 3.3-3.9 ms against 4.8-5.3 ms on one on a 2-core Zen 5 (torch 2.14's
CPU bernoulli_ takes ~18 ms, one thread on AMD CPUs; ORT's Dropout and DropoutGrad ~20 ms).
"""

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np
import torch

CHUNK = 1 << 20  # random values per stream, and mask values per piece of work (even: streams give 64-bit values)


@dataclass(frozen=True)
class DropoutMask:
    """A graph input that replaced a Dropout: the engine feeds `shape`-shaped masks of 0 and 1/(1-ratio); or, with
    dtype uint8 (a dropout a torch-kernel node applies itself: accel/graph/bf16_edges.py), keep flags 0 and 1, the
    scale 1/(1-ratio) then in the scalar graph input `scale_input` (the artifacts engine: 1 in evaluation, where the
    masks are all 1) or a constant of the graph (ORTModule's: fed_dropout.py)."""

    name: str
    shape: tuple[int, ...]
    ratio: float
    dtype: np.dtype = field(default=np.dtype(np.float32))
    scale_input: str | None = None

    @property
    def keep_flags(self) -> bool:
        return self.dtype == np.uint8

    @property
    def scale(self) -> np.ndarray:
        """The training step's value of `scale_input`."""
        return np.array(1.0 / (1.0 - self.ratio) if self.ratio < 1.0 else 0.0, dtype=np.float32)


class MaskSampler:
    """Draws one step's dropout masks into buffers allocated once: 0 with probability `ratio`, else 1/(1-ratio) (or
    keep flags, `DropoutMask.keep_flags`).

    It is seeded from torch's generator unless a seed is given, which the loop re-seeds from (seed, step, rank) before
    every step: a run's seed fixes its masks, and a resumed run draws the masks an uninterrupted run would.
    """

    def __init__(self, masks: list[DropoutMask], threads: int | None = None) -> None:
        self.masks = masks
        self.sizes = [int(np.prod(m.shape)) for m in masks]
        self.starts = np.cumsum([0, *self.sizes]).tolist()
        total = self.starts[-1]
        self.raw = np.empty(total + total % 2, dtype=np.uint32)
        self.keep = np.empty(total, dtype=bool)
        self.out = [np.empty(m.shape, m.dtype) for m in masks]
        # (mask, first, end) pieces of at most CHUNK values
        self.pieces = [
            (i, lo, min(lo + CHUNK, size)) for i, size in enumerate(self.sizes) for lo in range(0, size, CHUNK)
        ]
        threads = threads or torch.get_num_threads()
        self.pool = ThreadPoolExecutor(threads, "ortflow-masks") if threads > 1 and total > CHUNK else None

    def draw(self, seed: int | None = None) -> list[np.ndarray]:
        """The masks, in the sampler's buffers: valid until the next call."""
        with torch.profiler.record_function("ortflow::draw_dropout_masks"):  # its own row in ortflow-bench --profile
            seed = int(torch.randint(0, 2**62, (1,))) if seed is None else seed
            self._each(lambda chunk: self._random(seed, chunk), range(-(-len(self.raw) // CHUNK)))
            self._each(lambda piece: self._mask(*piece), self.pieces)
            return self.out

    def _each(self, work, items) -> None:
        if self.pool is None:
            for item in items:
                work(item)
        else:
            for _ in self.pool.map(work, items):  # re-raises a worker's error
                pass

    def _random(self, seed: int, chunk: int) -> None:
        start = chunk * CHUNK
        stop = min(start + CHUNK, len(self.raw))
        bits = np.random.SFC64(np.random.SeedSequence(seed, spawn_key=(chunk,)))
        self.raw[start:stop] = bits.random_raw((stop - start) // 2).view(np.uint32)

    def _mask(self, index: int, lo: int, hi: int) -> None:
        mask, out = self.masks[index], self.out[index].reshape(-1)
        if mask.ratio >= 1.0:
            out[lo:hi] = 0
            return
        first = self.starts[index]
        keep = self.keep[first + lo : first + hi]
        below = np.uint32(min(round(mask.ratio * 2**32), 2**32 - 1))
        np.greater_equal(self.raw[first + lo : first + hi], below, out=keep)
        kept = 1 if mask.keep_flags else 1.0 / (1.0 - mask.ratio)  # keep flags, or kept values scaled
        np.multiply(keep, mask.dtype.type(kept), out=out[lo:hi])


def draw_masks(masks: list[DropoutMask], seed: int | None = None) -> list[np.ndarray]:
    """One step's masks in new arrays (MaskSampler.draw)."""
    return MaskSampler(masks, threads=1).draw(seed)
