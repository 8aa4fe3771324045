"""Advantage estimators for outcome-reward RL: pure functions on a ``(P, n)`` reward tensor.

Row ``p`` holds the rewards of the ``n`` samples drawn for prompt ``p`` (the rollout engine returns them in
prompt-major order, so ``rewards = torch.tensor(flat).view(P, n)``). Every estimator returns one advantage
per sample, ``(P, n)``, that the loss broadcasts over the sample's response tokens.

* :func:`group_advantages` (GRPO; Dr. GRPO without the std division, which up-weights near-uniform groups:
  too easy or too hard prompts).
* :func:`rloo_advantages` (REINFORCE leave-one-out: the mean of the group's other samples as the baseline).
* :func:`batch_baseline_advantages` (REINFORCE with the batch mean reward as the baseline).

A group whose rewards are all equal carries no learning signal under a group baseline: its advantages
are exactly 0 (not a rounding residue of ``r - mean``) and :func:`num_zero_variance_groups` counts such
groups for the metrics (DAPO's dynamic sampling would drop them).
"""

from __future__ import annotations

from typing import Callable

import torch

from jetrl.config.choices import choice_registry


def _check_rewards(rewards: torch.Tensor) -> None:
    if not isinstance(rewards, torch.Tensor):
        raise TypeError(f"rewards must be a torch.Tensor of shape (P, n), got {type(rewards).__name__}")
    if rewards.ndim != 2:
        raise ValueError(f"rewards must have shape (P, n) (prompts x samples), got {tuple(rewards.shape)}")
    if not rewards.is_floating_point():
        raise TypeError(f"rewards must be a floating-point tensor, got {rewards.dtype}")
    if rewards.numel() == 0:
        raise ValueError(f"rewards is empty (shape {tuple(rewards.shape)})")
    if not bool(torch.isfinite(rewards).all()):
        raise ValueError("rewards contain NaN or inf; fix the reward function (a failed check should score 0)")


def zero_variance_groups(rewards: torch.Tensor) -> torch.Tensor:
    """``(P,)`` bool: the groups whose ``n`` rewards are all identical (a single-sample group counts)."""
    _check_rewards(rewards)
    return (rewards == rewards[:, :1]).all(dim=1)


def num_zero_variance_groups(rewards: torch.Tensor) -> int:
    """How many prompts got the same reward on every sample (no signal under a group baseline)."""
    return int(zero_variance_groups(rewards).sum())


def group_advantages(rewards: torch.Tensor, std_normalize: bool = True, eps: float = 1e-6) -> torch.Tensor:
    """GRPO advantages ``(r - mean) / (std + eps)`` within each prompt's group; ``(P, n)`` -> ``(P, n)``.

    ``std`` is the unbiased sample standard deviation over the group (as in the GRPO reference
    implementations). ``std_normalize=False`` gives Dr. GRPO's ``r - mean``. Zero-variance groups get
    exactly 0. Computed in fp32 whatever the reward dtype; returned in fp32.
    """
    _check_rewards(rewards)
    if eps < 0:
        raise ValueError(f"eps must be >= 0, got {eps}")
    r = rewards.float()
    centered = r - r.mean(dim=1, keepdim=True)
    if std_normalize and r.shape[1] > 1:
        centered = centered / (r.std(dim=1, keepdim=True) + eps)
    return centered.masked_fill(zero_variance_groups(rewards)[:, None], 0.0)


def rloo_advantages(rewards: torch.Tensor) -> torch.Tensor:
    """REINFORCE leave-one-out: ``r_i - mean_{j != i} r_j`` per group; needs ``n >= 2``."""
    _check_rewards(rewards)
    n = rewards.shape[1]
    if n < 2:
        raise ValueError(f"RLOO needs at least 2 samples per prompt, got n={n}")
    r = rewards.float()
    loo_mean = (r.sum(dim=1, keepdim=True) - r) / (n - 1)
    return (r - loo_mean).masked_fill(zero_variance_groups(rewards)[:, None], 0.0)


def batch_baseline_advantages(rewards: torch.Tensor, std_normalize: bool = False, eps: float = 1e-6) -> torch.Tensor:
    """REINFORCE with the batch mean reward as baseline (optionally divided by the batch std)."""
    _check_rewards(rewards)
    r = rewards.float()
    adv = r - r.mean()
    if std_normalize and r.numel() > 1:
        adv = adv / (r.std() + eps)
    return torch.zeros_like(adv) if bool((rewards == rewards.flatten()[0]).all()) else adv


# name -> estimator(rewards, std_normalize, eps), for the names of jetrl.config.choices (the config checks
# algorithm.advantage_estimator against them). RLOO's leave-one-out baseline takes no std normalisation.
ADVANTAGE_ESTIMATORS: dict[str, Callable[[torch.Tensor, bool, float], torch.Tensor]] = choice_registry(
    "advantage_estimator", {"grpo": group_advantages,
                            "rloo": lambda rewards, std_normalize, eps: rloo_advantages(rewards),
                            "reinforce": batch_baseline_advantages})


def compute_advantages(rewards: torch.Tensor, estimator: str = "grpo", std_normalize: bool = True,
                       eps: float = 1e-6) -> torch.Tensor:
    """Dispatch on the configured estimator name (a key of :data:`ADVANTAGE_ESTIMATORS`)."""
    if estimator not in ADVANTAGE_ESTIMATORS:
        raise ValueError(f"unknown advantage estimator {estimator!r}; choose one of {tuple(ADVANTAGE_ESTIMATORS)}")
    return ADVANTAGE_ESTIMATORS[estimator](rewards, std_normalize, eps)


__all__ = ["ADVANTAGE_ESTIMATORS", "group_advantages", "rloo_advantages", "batch_baseline_advantages",
           "compute_advantages", "zero_variance_groups", "num_zero_variance_groups"]
