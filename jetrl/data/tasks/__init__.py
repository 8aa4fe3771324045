"""Built-in synthetic reasoning tasks, generated deterministically from a seed, with checkers.

``get_task("arithmetic", difficulty=4, seed=0)`` / ``get_task("countdown", difficulty=3)`` /
``get_task("chain", difficulty=300)`` (long traces: about 4,000 tokens); each task's
reward is also registered under its name in :data:`jetrl.data.rewards.BUILTIN_REWARDS`.
"""

from __future__ import annotations

from typing import Any

from jetrl.data.tasks.arithmetic import ArithmeticTask, arithmetic_reward, check_arithmetic
from jetrl.data.tasks.chain import ChainTask, chain_reward, check_chain, difficulty_for_tokens
from jetrl.data.tasks.base import COMPACT_ALPHABET, STYLES, Task, TaskExample, final_answer_line
from jetrl.data.tasks.countdown import CountdownTask, check_countdown, countdown_reward, evaluate_expression

TASKS: dict[str, type[Task]] = {cls.name: cls for cls in (ArithmeticTask, CountdownTask, ChainTask)}


def get_task(name: str, **kwargs: Any) -> Task:
    """A task instance by name, configured by keyword (``difficulty``, ``seed``, ``style``, task options)."""
    if name not in TASKS:
        raise ValueError(f"unknown task {name!r}; built-in tasks: {', '.join(sorted(TASKS))}")
    try:
        return TASKS[name](**kwargs)
    except TypeError as e:
        raise TypeError(f"task {name!r}: {e}") from None


__all__ = ["COMPACT_ALPHABET", "TASKS", "STYLES", "ArithmeticTask", "ChainTask", "chain_reward", "check_chain",
           "difficulty_for_tokens", "CountdownTask", "Task", "TaskExample", "arithmetic_reward", "check_arithmetic",
           "check_countdown", "countdown_reward", "evaluate_expression", "final_answer_line", "get_task"]
