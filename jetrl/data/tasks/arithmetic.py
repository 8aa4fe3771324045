"""Multi-step arithmetic: a starting number and ``difficulty`` operations applied left to right.

Compact prompt ``12+7-3*2\\n`` (strictly left to right, no precedence), worked solution::

    12+7=19
    19-3=16
    16*2=32
    #### 32

Every operation must be carried out, so a correct chain of thought is exactly ``difficulty`` lines long.
Operands of + and - lie in 1..:data:`MAX_OPERAND`; multiplication and division use a one-digit operand,
division only when exact, and every intermediate value stays within ``±``:data:`MAX_VALUE`.
"""

from __future__ import annotations

import random

from jetrl.data.answers import extract_final_number, parse_number
from jetrl.data.tasks.base import OPERATIONS, Task, TaskExample, final_answer_line

MAX_OPERAND = 20  # the start value and the operands of + and - lie in 1..MAX_OPERAND
MAX_VALUE = 999  # every intermediate value stays within +-MAX_VALUE
_WORDS = {"+": "add {}", "-": "subtract {}", "*": "multiply by {}", "/": "divide by {}"}


class ArithmeticTask(Task):
    """Left-to-right chains of + - * / with a worked solution; ``difficulty`` = number of operations."""

    name = "arithmetic"
    compact_format = "a bare expression of + - * / applied left to right, no precedence"

    def _generate(self, rng: random.Random, difficulty: int, index: int) -> TaskExample:
        value = rng.randint(1, MAX_OPERAND)
        start, ops, lines = value, [], []
        for _ in range(difficulty):
            options = [("+", rng.randint(1, MAX_OPERAND)), ("-", rng.randint(1, MAX_OPERAND))]
            k = rng.randint(2, 9)
            if abs(value * k) <= MAX_VALUE:
                options.append(("*", k))
            if value != 0 and value % k == 0:
                options.append(("/", k))
            op, operand = rng.choice(options)
            if op == "+" and value + operand > MAX_VALUE:
                op = "-"
            if op == "-" and value - operand < -MAX_VALUE:
                op = "+"
            new = OPERATIONS[op](value, operand)
            lines.append(f"{value}{op}{operand}={new}")
            ops.append((op, operand))
            value = new
        if self.style == "compact":
            prompt = str(start) + "".join(f"{op}{x}" for op, x in ops) + "\n"
        else:
            steps = ", then ".join(_WORDS[op].format(x) for op, x in ops)
            prompt = (f"Start with {start}; {steps}. What is the result? Work one operation per line, "
                      f'then give the final number after "####".')
        solution = "\n".join(lines) + f"\n#### {value}"
        return TaskExample(index=index, prompt=prompt, solution=solution, answer=str(value), difficulty=difficulty)


def check_arithmetic(completion_text: str, reference_answer: str) -> bool:
    """True when the completion's final answer (after ``####``; else its last number) equals the
    reference integer."""
    expected = parse_number(reference_answer.strip())
    if expected is None:
        raise ValueError(f"arithmetic reference must be a number, got {reference_answer!r}")
    line = final_answer_line(completion_text)
    got = extract_final_number(line if line else completion_text)
    return got is not None and got == expected


def arithmetic_reward(completion_text: str, reference_answer: str) -> float:
    """1.0 for a correct final answer to an arithmetic-task problem, else 0.0."""
    return 1.0 if check_arithmetic(completion_text, reference_answer) else 0.0
