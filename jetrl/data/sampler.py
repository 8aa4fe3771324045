"""Deterministic shuffling with epochs, and a batch loader whose position survives checkpoint/resume.

The position is two integers, ``epoch`` and ``offset`` (prompts already drawn in that epoch); the order of
epoch ``e`` is the permutation seeded by ``(seed, e)``, so nothing else needs saving. Every rank of a
distributed run draws the same global batch (same seed) and keeps its own slice of it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Generic, TypeVar

import numpy as np

T = TypeVar("T")


class EpochSampler:
    """An endless stream of indices in ``range(num_examples)``: each epoch one seeded permutation
    (or the identity when ``shuffle`` is off). Draws may straddle epochs: every example is seen exactly
    once per epoch."""

    def __init__(self, num_examples: int, seed: int = 0, shuffle: bool = True) -> None:
        if not isinstance(num_examples, int) or num_examples < 1:
            raise ValueError(f"num_examples must be a positive int, got {num_examples!r} (is the dataset empty?)")
        self.num_examples = num_examples
        self.seed = int(seed)
        self.shuffle = bool(shuffle)
        self.epoch, self.offset = 0, 0
        self._order: np.ndarray | None = None

    def epoch_order(self, epoch: int) -> np.ndarray:
        """The index order of ``epoch``: a pure function of (seed, epoch)."""
        if not self.shuffle:
            return np.arange(self.num_examples)
        return np.random.default_rng([self.seed, epoch]).permutation(self.num_examples)

    def take(self, count: int) -> list[int]:
        """The next ``count`` indices, moving into the next epoch when this one runs out."""
        out: list[int] = []
        while len(out) < count:
            if self._order is None:
                self._order = self.epoch_order(self.epoch)
            chunk = self._order[self.offset : self.offset + count - len(out)]
            out.extend(int(i) for i in chunk)
            self.offset += len(chunk)
            if self.offset == self.num_examples:
                self.epoch, self.offset, self._order = self.epoch + 1, 0, None
        return out

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "offset": self.offset, "seed": self.seed, "shuffle": self.shuffle,
                "num_examples": self.num_examples}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a position. The seed, shuffle flag and dataset size must match the saved ones:
        resuming over a different dataset or order would silently repeat or skip prompts."""
        for key in ("seed", "shuffle", "num_examples"):
            if key in state and state[key] != getattr(self, key):
                raise ValueError(f"data state mismatch: saved {key}={state[key]!r} but this loader has "
                                 f"{key}={getattr(self, key)!r}; resume with the same dataset and data seed")
        epoch, offset = int(state["epoch"]), int(state["offset"])
        if epoch < 0 or not 0 <= offset < self.num_examples:
            raise ValueError(f"data state out of range: epoch={epoch}, offset={offset}, size={self.num_examples}")
        self.epoch, self.offset, self._order = epoch, offset, None


class BatchLoader(Generic[T]):
    """Fixed-size batches of items from a dataset, in :class:`EpochSampler` order, endlessly.

    ``state_dict()``/``load_state_dict()`` carry the data position through a checkpoint (restoring it makes
    the following batches identical to an uninterrupted run)."""

    def __init__(self, dataset: Sequence[T], batch_size: int, seed: int = 0, shuffle: bool = True) -> None:
        if not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
        self.dataset, self.batch_size = dataset, batch_size
        self.sampler = EpochSampler(len(dataset), seed=seed, shuffle=shuffle)

    @property
    def epoch(self) -> int:
        return self.sampler.epoch

    @property
    def offset(self) -> int:
        return self.sampler.offset

    def next_batch(self) -> list[T]:
        return [self.dataset[i] for i in self.sampler.take(self.batch_size)]

    def state_dict(self) -> dict[str, Any]:
        return {**self.sampler.state_dict(), "batch_size": self.batch_size}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        # The batch size may change across a resume: the position is counted in examples, not batches.
        self.sampler.load_state_dict({k: v for k, v in state.items() if k != "batch_size"})
