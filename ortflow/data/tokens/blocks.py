"""Training batches as random blocks of a token file, with a position a checkpoint saves; validation as a fixed
set of windows. Blocks are read from the file row by row (ortflow/data/tokens/store.py: TokenArray.rows), so memory does
not depend on the corpus' size.

Batch n of a run is a pure function of (seed, n): its generator is seeded from both, so the position is a single
counter, a resumed run draws exactly the batches an uninterrupted one would, and nothing depends on how many
batches were drawn before in this process. Each step the train split is cut into slots of block_size + 1 tokens
at a random shift, and batch_size x world_size distinct slots are drawn; rank r takes the r-th run of
batch_size. So ranks never share a token within a step, and N ranks with batch B see the same blocks as one
process with batch N x B.
"""

from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset, default_collate

from ortflow.data.tokens.store import TokenArray
from ortflow.errors import CheckpointError, DataError

KIND = "random_blocks"


def _pair(window: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.from_numpy(window.astype(np.int64))
    return tokens[..., :-1].contiguous(), tokens[..., 1:].contiguous()


class Windows(Dataset):
    """Non-overlapping windows of block_size + 1 tokens in order: input = window[:-1], target = window[1:]. The
    validation split (the same windows at every evaluation) and the example batches."""

    def __init__(self, tokens: TokenArray, block_size: int) -> None:
        self.tokens, self.block_size = tokens, block_size

    def __len__(self) -> int:
        return max(0, (len(self.tokens) - 1) // self.block_size)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not 0 <= i < len(self):
            raise IndexError(i)
        return _pair(self.tokens.rows(np.array([i * self.block_size]), self.block_size + 1)[0])


class RandomBlocks:
    """Endless training batches (inputs, targets) of shape (batch_size, block_size) from random blocks of `tokens`.

    A stateful source: `state_dict()` is its position (batches drawn), `load_state_dict` restores it, and
    `shard(rank, world_size)` gives a rank its share of every step. `dataset`, `batch_size` and `collate_fn` are
    there for code that builds an example batch as from a DataLoader.
    """

    def __init__(
        self,
        tokens: TokenArray,
        block_size: int,
        batch_size: int,
        seed: int,
        rank: int = 0,
        world_size: int = 1,
    ) -> None:
        self.tokens, self.block_size, self.batch_size, self.seed = tokens, block_size, batch_size, seed
        self.rank, self.world_size = rank, world_size
        self.position = 0
        self.dataset = Windows(tokens, block_size)
        self.collate_fn = default_collate
        slots = (len(tokens) - block_size) // (block_size + 1)  # at the largest shift
        if slots < batch_size * world_size:
            raise DataError(
                f"data: the train split has {len(tokens):,} tokens, too few for one step of "
                f"{world_size} rank(s) x data.batch_size={batch_size} distinct blocks of data.block_size="
                f"{block_size} + 1 tokens. Use a larger corpus, or lower data.block_size/data.batch_size."
            )

    def shard(self, rank: int, world_size: int) -> "RandomBlocks":
        """The same stream, rank `rank` of `world_size` taking its own blocks of every step."""
        shard = RandomBlocks(self.tokens, self.block_size, self.batch_size, self.seed, rank, world_size)
        shard.position = self.position
        return shard

    def offsets(self, index: int) -> np.ndarray:
        """Start of every block of batch `index`, all ranks' (batch_size x world_size, distinct and disjoint)."""
        span = self.block_size + 1
        rng = np.random.default_rng([self.seed, index])
        shift = int(rng.integers(0, span))
        slots = (len(self.tokens) - shift) // span
        chosen = rng.choice(slots, size=self.batch_size * self.world_size, replace=False)
        return shift + chosen.astype(np.int64) * span

    def batch(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's batch `index`: (inputs, targets), int64, (batch_size, block_size).

        Raises:
            DataError: a block of the token file that this step reads, on any rank, changed since it was prepared
                (every rank checks the whole step's blocks, so all stop at the same step).
        """
        every = self.offsets(index)
        self.tokens.check(every, self.block_size + 1)
        mine = every[self.rank * self.batch_size : (self.rank + 1) * self.batch_size]
        return _pair(self.tokens.rows(mine, self.block_size + 1))  # (B, block_size + 1) read from the file

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        while True:
            index = self.position
            self.position += 1
            yield self.batch(index)

    def state_dict(self) -> dict[str, Any]:
        return {"kind": KIND, "position": self.position, "seed": self.seed, "tokens": len(self.tokens)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Raises CheckpointError for a position saved by another kind of loader."""
        if not isinstance(state, dict) or state.get("kind") != KIND:
            raise CheckpointError(
                "the checkpoint's data position was saved by another data loader (a run from before token files, or "
                "other data); continue it with the data it was written with, or start a new run."
            )
        self.position = int(state["position"])
