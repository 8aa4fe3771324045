"""Mini-batch k is the same set of sequences at any number of ranks, each rank an equal share of it."""

import pytest
import torch

from jetrl.rl.minibatch import mini_batch_rows

# (prompts, n, mini-batch): mini-batches smaller than a group, of whole groups, of parts of groups, one for all
SHAPES = [(4, 4, 8), (6, 3, 6), (5, 3, 3), (8, 2, 4), (32, 8, 64), (3, 5, 15), (12, 3, 9)]


def _global(num_prompts, n, mini, seed, rank, world):
    rows = mini_batch_rows(num_prompts, n, mini, torch.Generator().manual_seed(seed), rank, world)
    return [[r + rank * num_prompts * n // world for r in m] for m in rows]


@pytest.mark.parametrize("num_prompts,n,mini", SHAPES)
def test_ranks_hold_the_one_process_mini_batches(num_prompts, n, mini):
    seed = int(torch.randint(0, 2**31 - 1, ()))
    one = _global(num_prompts, n, mini, seed, 0, 1)
    S = num_prompts * n
    assert len(one) == S // mini and all(len(m) == mini for m in one)
    assert sorted(r for m in one for r in m) == list(range(S))  # every sequence once per epoch
    worlds = [w for w in range(2, 9) if num_prompts % w == 0 and mini % w == 0]
    for world in worlds:
        parts = [_global(num_prompts, n, mini, seed, rank, world) for rank in range(world)]
        for k, m in enumerate(one):
            shares = [p[k] for p in parts]
            assert all(len(s) == mini // world for s in shares)  # balanced
            # the ranks' shares, in rank order, are the one-process list: consecutive micro-batches coincide
            assert [r for s in shares for r in s] == m
            lo = [rank * S // world for rank in range(world)] + [S]
            assert all(lo[rank] <= r < lo[rank + 1] for rank, s in enumerate(shares) for r in s)  # rows it holds


def test_mini_batches_are_shuffled_and_differ_per_epoch():
    gen = torch.Generator().manual_seed(0)
    first, second = mini_batch_rows(8, 4, 8, gen), mini_batch_rows(8, 4, 8, gen)
    assert first != second and sorted(sum(first, [])) == sorted(sum(second, []))
    assert first != [list(range(k * 8, k * 8 + 8)) for k in range(4)]


def test_bad_shapes_are_refused():
    gen = torch.Generator()
    with pytest.raises(ValueError, match="must divide the rollout batch"):
        mini_batch_rows(4, 3, 5, gen)
    with pytest.raises(ValueError, match="number of ranks must divide"):
        mini_batch_rows(6, 2, 4, gen, 0, 4)
