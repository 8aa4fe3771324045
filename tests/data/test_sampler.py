"""Deterministic shuffling, epochs, and data-position resume."""

from __future__ import annotations

import pytest

from jetrl.data import BatchLoader, EpochSampler, Prompt, PromptDataset


def make_dataset(n: int) -> PromptDataset:
    return PromptDataset([Prompt(index=i, text=f"p{i}", answer=str(i)) for i in range(n)])


def test_each_epoch_is_a_seeded_permutation():
    sampler = EpochSampler(37, seed=5)
    epochs = [sampler.take(37) for _ in range(3)]
    for order in epochs:
        assert sorted(order) == list(range(37))
    assert epochs[0] != epochs[1] != epochs[2] and epochs[0] != list(range(37))
    assert EpochSampler(37, seed=5).take(111) == sum(epochs, [])  # same seed, same stream
    assert EpochSampler(37, seed=6).take(37) != epochs[0]
    assert EpochSampler(37, seed=5, shuffle=False).take(40) == list(range(37)) + [0, 1, 2]


def test_batches_straddle_epochs_without_skipping():
    loader = BatchLoader(make_dataset(10), batch_size=4, seed=1)
    seen = [p.index for _ in range(5) for p in loader.next_batch()]  # 20 prompts = 2 epochs
    assert sorted(seen[:10]) == list(range(10)) and sorted(seen[10:]) == list(range(10))
    assert (loader.epoch, loader.offset) == (2, 0)


@pytest.mark.parametrize("steps_before", [0, 3, 7, 12])
def test_resume_continues_the_same_stream(steps_before):
    straight = BatchLoader(make_dataset(23), batch_size=5, seed=11)
    expected = [[p.index for p in straight.next_batch()] for _ in range(20)]

    first = BatchLoader(make_dataset(23), batch_size=5, seed=11)
    for _ in range(steps_before):
        first.next_batch()
    state = first.state_dict()
    assert state["epoch"] * 23 + state["offset"] == steps_before * 5
    resumed = BatchLoader(make_dataset(23), batch_size=5, seed=11)
    resumed.load_state_dict(dict(state))
    got = [[p.index for p in resumed.next_batch()] for _ in range(20 - steps_before)]
    assert got == expected[steps_before:]


def test_resume_refuses_a_different_dataset_or_seed():
    state = BatchLoader(make_dataset(23), batch_size=5, seed=11).state_dict()
    with pytest.raises(ValueError, match="num_examples=23"):
        BatchLoader(make_dataset(24), batch_size=5, seed=11).load_state_dict(state)
    with pytest.raises(ValueError, match="seed=11"):
        BatchLoader(make_dataset(23), batch_size=5, seed=12).load_state_dict(state)
    with pytest.raises(ValueError, match="out of range"):
        BatchLoader(make_dataset(23), batch_size=5, seed=11).load_state_dict({**state, "offset": 23})
    with pytest.raises(ValueError, match="batch_size"):
        BatchLoader(make_dataset(3), batch_size=0)
