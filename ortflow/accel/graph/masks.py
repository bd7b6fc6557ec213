"""The dropout masks the ORT engines feed their graphs (rewrites.dropout_to_mask_inputs, fed_dropout.py): what a mask
input is, and one step's masks drawn where they are fast.

An element drops when a 32-bit random integer is below round(ratio * 2**32) (the probability is exact to 2**-33;
torch's CPU bernoulli_ compares a 24-bit float). The integers come from numpy's SFC64, the fastest of its generators
here, in streams of STREAM values of one mask, each seeded from (the step's seed, the mask, the stream's place), so a
seed fixes the masks whatever the number of threads that draw them. The streams run on as many threads as torch uses
(numpy leaves the interpreter lock while it draws and computes), each a BLOCK at a time: the bits are compared and
the mask written while they are still in the core's cache. On the transformer recipe's 4.2M mask values per step,
2 threads drew in 3.3-3.9 ms against 4.8-5.3 ms on one on a 2-core Zen 5 (torch 2.14's CPU bernoulli_ takes ~18 ms,
one thread on AMD CPUs; ORT's Dropout and DropoutGrad ~20 ms); drawing every stream whole first and comparing after
moved 10 bytes a value through memory, 67 ms a step for d_model 512's 34M values on a 2-core Intel Xeon.
"""

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np
import torch

STREAM = 1 << 20  # mask values per random stream: the unit of work, the same whatever the number of threads
BLOCK = 1 << 17  # values drawn, compared and scaled at once: 512 KB of random bits, held in a core's L2


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
        self.out = [np.empty(m.shape, m.dtype) for m in masks]
        sizes = [int(np.prod(m.shape)) for m in masks]
        self.streams = [  # (mask, first, end) of each stream
            (i, lo, min(lo + STREAM, size)) for i, size in enumerate(sizes) for lo in range(0, size, STREAM)
        ]
        threads = threads or torch.get_num_threads()
        self.pool = ThreadPoolExecutor(threads, "ortflow-masks") if threads > 1 and len(self.streams) > 1 else None

    def draw(self, seed: int | None = None) -> list[np.ndarray]:
        """The masks, in the sampler's buffers: valid until the next call."""
        with torch.profiler.record_function("ortflow::draw_dropout_masks"):  # its own row in ortflow-bench --profile
            seed = int(torch.randint(0, 2**62, (1,))) if seed is None else seed
            if self.pool is None:
                for stream in self.streams:
                    self._stream(seed, *stream)
            else:
                for _ in self.pool.map(lambda stream: self._stream(seed, *stream), self.streams):  # re-raises
                    pass
            return self.out

    def _stream(self, seed: int, index: int, lo: int, hi: int) -> None:
        """Mask `index`'s values lo..hi from their own stream, seeded from (seed, index, lo), a block at a time: the
        random bits are compared and the mask written while they are in the cache."""
        mask, out = self.masks[index], self.out[index].reshape(-1)
        if mask.ratio >= 1.0:
            out[lo:hi] = 0
            return
        bits = np.random.SFC64(np.random.SeedSequence(seed, spawn_key=(index, lo // STREAM)))
        below = np.uint32(min(round(mask.ratio * 2**32), 2**32 - 1))
        kept = mask.dtype.type(1 if mask.keep_flags else 1.0 / (1.0 - mask.ratio))  # keep flags, or kept values scaled
        for start in range(lo, hi, BLOCK):
            stop = min(start + BLOCK, hi)
            raw = bits.random_raw((stop - start + 1) // 2).view(np.uint32)[: stop - start]
            if mask.keep_flags:
                np.greater_equal(raw, below, out=out[start:stop].view(np.bool_))
            else:
                np.multiply(np.greater_equal(raw, below), kept, out=out[start:stop])


def draw_masks(masks: list[DropoutMask], seed: int | None = None) -> list[np.ndarray]:
    """One step's masks in new arrays (MaskSampler.draw)."""
    return MaskSampler(masks, threads=1).draw(seed)
