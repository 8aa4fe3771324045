"""The RL algorithm of jetrl: advantages and losses as pure tensor functions, the trainer and the loop.

``Trainer`` and ``run`` import the models and the rollout engine, so they load lazily: the pure parts
(advantages, losses, mismatch metrics) import nothing beyond torch and the config's choice names. Checkpoints
and the optimizer live in the training stage below (:mod:`jetrl.train`), which SFT shares.
"""

from jetrl.rl.advantages import (
    batch_baseline_advantages, compute_advantages, group_advantages, num_zero_variance_groups, rloo_advantages,
)
from jetrl.rl.losses import kl_penalty, policy_loss, truncated_is_weights
from jetrl.rl.mismatch import mismatch_metrics

def __getattr__(name: str):
    # Trainer and run import the models and the rollout engine: load them on first use only
    if name == "Trainer":
        from jetrl.rl.trainer import Trainer
        return Trainer
    if name == "run":
        from jetrl.rl.loop import run
        return run
    raise AttributeError(f"module 'jetrl.rl' has no attribute {name!r}")


__all__ = [
    "Trainer", "run", "policy_loss", "mismatch_metrics", "group_advantages", "rloo_advantages", "batch_baseline_advantages", "compute_advantages",
    "num_zero_variance_groups", "kl_penalty", "truncated_is_weights",
]
