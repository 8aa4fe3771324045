"""The RL algorithm of jetrl: advantages and losses as pure tensor functions, the trainer and the loop.

``Trainer`` and ``run`` import the models and the rollout engine, so they load lazily: the pure parts
(advantages, losses, mismatch metrics, checkpoints) import nothing beyond torch.
"""

from jetrl.rl.advantages import (
    batch_baseline_advantages, compute_advantages, group_advantages, num_zero_variance_groups, rloo_advantages,
)

__all__ = [
    "group_advantages", "rloo_advantages", "batch_baseline_advantages", "compute_advantages",
    "num_zero_variance_groups",
]
