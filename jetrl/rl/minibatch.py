"""Which sequences make each mini-batch of an update: the same ones whatever the number of ranks.

A step's rollout batch holds ``P`` prompt groups of ``n`` samples, ``S = P * n`` sequences in prompt-major
order; rank ``r`` of ``W`` holds the contiguous share ``[r * S / W, (r + 1) * S / W)`` (whole groups). An
update makes ``K = S / M`` optimizer steps of ``M = mini_batch_size`` sequences per epoch.

The batch is cut into ``B = gcd(P, M)`` equal blocks of consecutive sequences (each ``S / B`` sequences of
whole groups). Per epoch every block is shuffled with its own permutation, drawn from one generator in
block order, and mini-batch ``k`` takes slice ``k`` (``M / B`` sequences) of every block's permutation.
So mini-batch ``k`` is a fixed set of sequences, stratified over the blocks, whatever ``W``: every valid
world size divides ``P`` and ``M`` (each rank holds whole groups and an equal share of every mini-batch),
hence divides ``B``, so each rank holds ``B / W`` whole blocks and takes from mini-batch ``k`` exactly its
blocks' slices, ``M / W`` sequences. Listed block by block, a rank's share of mini-batch ``k`` is a
contiguous piece of the one-process list: when ``micro_batch_size`` divides ``M / W`` the micro-batches
(fixed-size, consecutive) are the very ones one process makes, in the same order. Then N ranks compute the
one-process micro-batches bit for bit and differ only in how their gradients are summed.
"""

from __future__ import annotations

import math

import torch


def mini_batch_rows(num_prompts: int, n: int, mini_batch_size: int, generator: torch.Generator,
                    rank: int = 0, world_size: int = 1) -> list[list[int]]:
    """One epoch's mini-batches as rank ``rank``'s local row indices (see the module doc).

    Every rank must pass a generator in the same state (each draws every block's permutation); the result
    for ``world_size`` ranks, mapped back to global rows and concatenated in rank order, is the one-rank
    result."""
    num_seqs = num_prompts * n
    if mini_batch_size < 1 or num_seqs % mini_batch_size:
        raise ValueError(f"the mini-batch ({mini_batch_size} sequences) must divide the rollout batch "
                         f"({num_prompts} prompts x {n} = {num_seqs} sequences)")
    num_blocks = math.gcd(num_prompts, mini_batch_size)
    if world_size < 1 or num_blocks % world_size or not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} of {world_size}: the number of ranks must divide both the prompts per step "
                         f"({num_prompts}) and the mini-batch ({mini_batch_size} sequences)")
    num_minis, block_size = num_seqs // mini_batch_size, num_seqs // num_blocks
    per_block = mini_batch_size // num_blocks
    perms = [torch.randperm(block_size, generator=generator).tolist() for _ in range(num_blocks)]
    mine = range(rank * num_blocks // world_size, (rank + 1) * num_blocks // world_size)
    first = mine.start * block_size  # this rank's first global row
    return [[j * block_size + p - first for j in mine for p in perms[j][k * per_block:(k + 1) * per_block]]
            for k in range(num_minis)]


__all__ = ["mini_batch_rows"]
