"""Which side of the RL loop is running: ``"rollout"`` (generation) or ``"train"`` (scoring and updates).

A precision recipe may run the two sides in different precisions (``fp8-rollout``: FP8 generation, BF16
training). The caller says which side it is, explicitly; the side is never guessed from grad mode,
because the trainer also runs no-grad forwards (old and reference log-probabilities) that must use the
training side. Code that enters no side runs the training side.
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import Iterator, Literal

Side = Literal["rollout", "train"]
SIDES: tuple[Side, ...] = ("rollout", "train")

_current: contextvars.ContextVar[Side] = contextvars.ContextVar("jetrl_precision_side", default="train")


def current_side() -> Side:
    """The side entered by the innermost :func:`precision_side`, ``"train"`` if none."""
    return _current.get()


@contextlib.contextmanager
def precision_side(side: Side) -> Iterator[None]:
    """Run the enclosed forwards as ``side`` (the rollout engine enters ``"rollout"``)."""
    if side not in SIDES:
        raise ValueError(f"precision side must be one of {SIDES}, got {side!r}")
    token = _current.set(side)
    try:
        yield
    finally:
        _current.reset(token)
