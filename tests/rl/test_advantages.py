"""Advantage estimators against hand-computed values."""

import math

import pytest
import torch

from jetrl.rl.advantages import (
    batch_baseline_advantages, compute_advantages, group_advantages, num_zero_variance_groups, rloo_advantages,
    zero_variance_groups,
)

REWARDS = torch.tensor([[1.0, 0.0, 0.0, 1.0],
                        [1.0, 1.0, 1.0, 1.0],
                        [0.3, 0.3, 0.3, 0.3],   # 0.3 * 4 / 4 != 0.3 in fp32: must still give exact zeros
                        [2.0, 0.0, 1.0, 1.0]])


def test_grpo_hand_computed():
    adv = group_advantages(REWARDS, eps=1e-6)
    std0 = math.sqrt(1 / 3)  # unbiased std of [1,0,0,1]
    a0 = 0.5 / (std0 + 1e-6)
    std3 = math.sqrt(2 / 3)  # unbiased std of [2,0,1,1]: deviations 1,-1,0,0 -> 2/3
    a3 = 1.0 / (std3 + 1e-6)
    expected = torch.tensor([[a0, -a0, -a0, a0], [0, 0, 0, 0], [0, 0, 0, 0], [a3, -a3, 0, 0]])
    # fp32 arithmetic on values of order 1: a few ulps
    torch.testing.assert_close(adv, expected, rtol=1e-6, atol=1e-7)
    assert adv.dtype == torch.float32


def test_zero_variance_groups_are_exact_zero_and_counted():
    adv = group_advantages(REWARDS)
    assert torch.equal(adv[1:3], torch.zeros(2, 4))
    assert num_zero_variance_groups(REWARDS) == 2
    assert zero_variance_groups(REWARDS).tolist() == [False, True, True, False]


def test_dr_grpo_drops_std():
    adv = group_advantages(REWARDS, std_normalize=False)
    expected = torch.tensor([[0.5, -0.5, -0.5, 0.5], [0, 0, 0, 0], [0, 0, 0, 0], [1.0, -1.0, 0, 0]])
    torch.testing.assert_close(adv, expected, rtol=0, atol=1e-7)


def test_single_sample_groups_give_zero():
    r = torch.tensor([[1.0], [0.0]])
    assert torch.equal(group_advantages(r), torch.zeros(2, 1))
    assert num_zero_variance_groups(r) == 2


def test_rloo_hand_computed():
    adv = rloo_advantages(REWARDS)
    expected = torch.tensor([[2 / 3, -2 / 3, -2 / 3, 2 / 3], [0, 0, 0, 0], [0, 0, 0, 0],
                             [2 - 2 / 3, -4 / 3, 0, 0]])
    torch.testing.assert_close(adv, expected, rtol=1e-6, atol=1e-7)
    with pytest.raises(ValueError, match="at least 2 samples"):
        rloo_advantages(torch.tensor([[1.0], [0.0]]))


def test_batch_baseline():
    r = torch.tensor([[1.0, 0.0], [0.0, 0.0]])
    torch.testing.assert_close(batch_baseline_advantages(r), torch.tensor([[0.75, -0.25], [-0.25, -0.25]]))
    std = torch.tensor([1.0, 0.0, 0.0, 0.0]).std().item()
    torch.testing.assert_close(batch_baseline_advantages(r, std_normalize=True),
                               torch.tensor([[0.75, -0.25], [-0.25, -0.25]]) / (std + 1e-6))
    assert torch.equal(batch_baseline_advantages(torch.full((2, 3), 0.7)), torch.zeros(2, 3))


def test_dispatch_and_errors(gen):
    r = torch.rand(3, 5, generator=gen)
    assert torch.equal(compute_advantages(r, "grpo"), group_advantages(r))
    assert torch.equal(compute_advantages(r, "rloo"), rloo_advantages(r))
    assert torch.equal(compute_advantages(r, "reinforce", std_normalize=False), batch_baseline_advantages(r))
    with pytest.raises(ValueError, match="unknown advantage estimator"):
        compute_advantages(r, "ppo-gae")
    with pytest.raises(ValueError, match=r"shape \(P, n\)"):
        group_advantages(torch.rand(6))
    with pytest.raises(ValueError, match="NaN"):
        group_advantages(torch.tensor([[1.0, float("nan")]]))
    with pytest.raises(TypeError, match="floating"):
        group_advantages(torch.tensor([[1, 0]]))


def test_grpo_mean_zero_unit_std(gen):
    r = torch.rand(16, 8, generator=gen)
    adv = group_advantages(r)
    torch.testing.assert_close(adv.mean(dim=1), torch.zeros(16), rtol=0, atol=1e-6)
    torch.testing.assert_close(adv.std(dim=1), torch.ones(16), rtol=1e-4, atol=0)
