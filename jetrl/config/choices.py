"""The names a choice field of the config may take, one list per kind, below the stages that implement them.

The RL stage's registries (advantage estimators, KL estimators, loss aggregations, LR schedules) map these
names to functions through :func:`choice_registry`, which refuses a registry whose names are not this list,
in this order: the config checks a field against them without importing the stage above it, and a name
added on one side only is an error at import. (The precision recipes live in :mod:`jetrl.quant.recipe`.)
"""

from __future__ import annotations

from typing import Mapping, TypeVar

CHOICES: dict[str, tuple[str, ...]] = {
    "advantage_estimator": ("grpo", "rloo", "reinforce"),          # jetrl.rl.advantages.ADVANTAGE_ESTIMATORS
    "kl_estimator": ("k1", "k2", "k3"),                            # jetrl.rl.losses.KL_ESTIMATORS
    "loss_aggregation": ("token", "sequence", "sequence-sum-norm"),  # jetrl.rl.losses.AGGREGATIONS
    "lr_schedule": ("constant", "cosine", "linear"),               # jetrl.train.optim.LR_SCHEDULES
}

V = TypeVar("V")


def choice_registry(kind: str, implementations: Mapping[str, V]) -> dict[str, V]:
    """``implementations`` as a dict, after checking that its names are exactly ``CHOICES[kind]`` in order."""
    if kind not in CHOICES:
        raise ValueError(f"no choice list of {kind!r}; the kinds are {list(CHOICES)}")
    names = tuple(implementations)
    if names != CHOICES[kind]:
        raise ValueError(f"the {kind} registry names {list(names)}, but jetrl.config.choices.CHOICES[{kind!r}] "
                         f"lists {list(CHOICES[kind])}: add or remove the name in both")
    return dict(implementations)


__all__ = ["CHOICES", "choice_registry"]
