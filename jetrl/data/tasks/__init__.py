"""Built-in synthetic reasoning tasks, generated deterministically from a seed, with checkers.

``get_task("arithmetic", difficulty=4, seed=0)`` / ``get_task("countdown", difficulty=3)`` /
``get_task("chain", difficulty=300)`` (long traces: about 4,000 tokens); each task's
reward is also registered under its name in :data:`jetrl.data.rewards.BUILTIN_REWARDS`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from jetrl.data.datasets import PromptDataset
from jetrl.data.tasks.arithmetic import ArithmeticTask, arithmetic_reward, check_arithmetic
from jetrl.data.tasks.chain import ChainTask, chain_reward, check_chain, difficulty_for_tokens
from jetrl.data.tasks.base import COMPACT_ALPHABET, STYLES, Task, TaskExample, final_answer_line
from jetrl.data.tasks.countdown import CountdownTask, check_countdown, countdown_reward, evaluate_expression

TASKS: dict[str, type[Task]] = {}


def register_task(cls: type[Task]) -> type[Task]:
    """Add a :class:`Task` subclass to the registry under ``cls.name`` (usable as a decorator)."""
    if not (isinstance(cls, type) and issubclass(cls, Task)):
        raise TypeError(f"register_task expects a Task subclass, got {cls!r}")
    TASKS[cls.name] = cls
    return cls


register_task(ArithmeticTask)
register_task(CountdownTask)
register_task(ChainTask)


def get_task(name: str, **kwargs: Any) -> Task:
    """A task instance by name, configured by keyword (``difficulty``, ``seed``, ``style``, task options)."""
    if name not in TASKS:
        raise ValueError(f"unknown task {name!r}; built-in tasks: {', '.join(sorted(TASKS))}")
    try:
        return TASKS[name](**kwargs)
    except TypeError as e:
        raise TypeError(f"task {name!r}: {e}") from None


@dataclass
class TaskConfig:
    """A built-in task as a prompt source: ``name``, its ``difficulty`` (int or ``(low, high)``),
    ``seed``, prompt ``style``, task-specific ``options`` (e.g. ``max_operand``, ``num_distractors``) and
    which examples: indices ``start .. start + num_examples``. An evaluation set takes another seed."""

    name: str = "arithmetic"
    difficulty: int | tuple[int, int] = 3
    seed: int = 0
    style: str = "compact"
    num_examples: int = 10_000
    start: int = 0
    options: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if isinstance(self.difficulty, list):
            self.difficulty = tuple(self.difficulty)
        if not isinstance(self.num_examples, int) or self.num_examples < 1:
            raise ValueError(f"num_examples must be a positive int, got {self.num_examples!r}")
        if not isinstance(self.start, int) or self.start < 0:
            raise ValueError(f"start must be an int >= 0, got {self.start!r}")

    def build(self) -> Task:
        return get_task(self.name, difficulty=self.difficulty, seed=self.seed, style=self.style, **self.options)


def task_dataset(config: TaskConfig) -> PromptDataset:
    """The prompts of a built-in task, scored by the task's reward (``dataset.reward == config.name``)."""
    return config.build().dataset(config.num_examples, config.start)


__all__ = [
    "TaskConfig",
    "task_dataset",
    "COMPACT_ALPHABET",
    "TASKS",
    "STYLES",
    "ArithmeticTask",
    "ChainTask",
    "chain_reward",
    "check_chain",
    "difficulty_for_tokens",
    "CountdownTask",
    "Task",
    "TaskExample",
    "arithmetic_reward",
    "check_arithmetic",
    "check_countdown",
    "countdown_reward",
    "evaluate_expression",
    "final_answer_line",
    "get_task",
    "register_task",
]
