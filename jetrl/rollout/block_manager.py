"""The KV block pool: fixed-size blocks, per-sequence block tables, reference counts, copy-on-write.

A sequence's token at position ``p`` lives in physical block ``block_table[p // block_size]`` at offset
``p % block_size``. The ``n`` samples of one prompt are prefilled once: their block tables start as the
same list of blocks, each block's reference count equal to the number of holders. A full shared block
stays shared for the whole generation (nobody writes into it again); the last, partially filled block
is copied on the first write by each holder but the last one (copy-on-write), so each sample continues
its own tail without touching the others'.

The manager only does bookkeeping: the (source, destination) block pairs it returns go out with the scheduler's
step, and the model runner copies them on every layer before the forward that writes into the new blocks.
"""

from __future__ import annotations

from collections import deque

import numpy as np

from jetrl.rollout.sequence import Sequence


class NoFreeBlocks(RuntimeError):
    """Raised when an allocation needs more blocks than are free (the scheduler preempts first)."""


class BlockManager:
    """Free list and reference counts of ``num_blocks`` physical blocks of ``block_size`` tokens."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"BlockManager needs num_blocks >= 1 and block_size >= 1, got {num_blocks}, "
                             f"{block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: deque[int] = deque(range(num_blocks))
        self.ref_counts = [0] * num_blocks

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def blocks_for_tokens(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def _take(self) -> int:
        if not self._free:
            raise NoFreeBlocks("no free KV blocks")
        block = self._free.popleft()
        assert self.ref_counts[block] == 0
        self.ref_counts[block] = 1
        return block

    def _release(self, block: int) -> None:
        assert self.ref_counts[block] > 0, f"double free of block {block}"
        self.ref_counts[block] -= 1
        if self.ref_counts[block] == 0:
            self._free.append(block)

    def allocate_shared(self, seqs: list[Sequence], num_tokens: int) -> None:
        """Give ``seqs`` (identical prefixes) one shared set of blocks covering ``num_tokens`` tokens."""
        needed = self.blocks_for_tokens(num_tokens)
        if needed > self.num_free_blocks:
            raise NoFreeBlocks(f"need {needed} blocks, {self.num_free_blocks} free")
        for seq in seqs:
            if seq.block_table:
                raise RuntimeError(f"{seq} already holds blocks")
        blocks = [self._take() for _ in range(needed)]
        for block in blocks:
            self.ref_counts[block] = len(seqs)
        for seq in seqs:
            seq.block_table = list(blocks)
            seq.table_version += 1

    def blocks_needed_to_write(self, seq: Sequence, num_tokens: int) -> int:
        """Blocks (new or copies) that writing ``num_tokens`` tokens from ``seq.num_computed_tokens`` on takes."""
        pos = seq.num_computed_tokens
        fresh = max(self.blocks_for_tokens(pos + num_tokens) - len(seq.block_table), 0)
        index = pos // self.block_size
        shared = index < len(seq.block_table) and self.ref_counts[seq.block_table[index]] > 1
        return fresh + shared  # only the block holding the first written slot can be shared

    def prepare_append(self, seq: Sequence, position: int | None = None) -> tuple[int, int] | None:
        """Make the slot of the token at ``position`` (default ``seq.num_computed_tokens``) writable by ``seq``
        alone.

        Allocates a fresh block at a block boundary; copies a shared partial block (returns the
        ``(src, dst)`` pair the model runner copies before the write); otherwise does nothing.
        """
        pos = seq.num_computed_tokens if position is None else position
        index = pos // self.block_size
        if index > len(seq.block_table):
            raise RuntimeError(f"{seq}: block table has a gap at position {pos}")
        if index == len(seq.block_table):
            seq.block_table.append(self._take())
            return None
        block = seq.block_table[index]
        if self.ref_counts[block] == 1:
            return None
        new = self._take()
        self._release(block)
        seq.block_table[index] = new
        seq.table_version += 1
        return (block, new)

    def free(self, seq: Sequence) -> None:
        """Drop ``seq``'s references; blocks nobody else holds return to the pool."""
        for block in seq.block_table:
            self._release(block)
        seq.block_table = []
        seq.table_version += 1


class BlockTableMirror:
    """A host array holding the block tables of one ``generate`` call's sequences, updated incrementally.

    Packing every block table into a fresh list each step costs the engine more host time than a small
    model's decode step takes on the GPU; here a sequence's row only receives the blocks appended since the
    last step, and is rewritten whole only when its ``table_version`` moved (shared-prefix allocation,
    copy-on-write of a block, or a free before recomputation). ``rows(seqs)`` is then one gather.
    """

    def __init__(self, seqs: list[Sequence], max_blocks_per_seq: int) -> None:
        self.table = np.full((max(len(seqs), 1), max(max_blocks_per_seq, 1)), -1, dtype=np.int64)
        self._row = {seq.seq_id: i for i, seq in enumerate(seqs)}
        self._version = [-1] * len(seqs)
        self._written = [0] * len(seqs)

    def rows(self, seqs: list[Sequence]) -> np.ndarray:
        """(len(seqs), width) int64 tables, -1 padded; width = the longest table among ``seqs`` (>= 1)."""
        rows = [self._sync(seq) for seq in seqs]
        width = max(max((len(seq.block_table) for seq in seqs), default=1), 1)
        return self.table[rows, :width]

    def _sync(self, seq: Sequence) -> int:
        row = self._row[seq.seq_id]
        table, written = seq.block_table, self._written[row]
        if len(table) > self.table.shape[1]:
            raise ValueError(f"{seq} holds {len(table)} blocks, more than the {self.table.shape[1]} a sequence may")
        if self._version[row] != seq.table_version or len(table) < written:
            self.table[row, :written] = -1
            self.table[row, :len(table)] = table
            self._version[row] = seq.table_version
        elif len(table) > written:
            self.table[row, written:len(table)] = table[written:]
        self._written[row] = len(table)
        return row


__all__ = ["BlockManager", "BlockTableMirror", "NoFreeBlocks"]
