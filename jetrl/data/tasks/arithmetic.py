"""Multi-step arithmetic: a starting number and ``difficulty`` operations applied left to right.

Compact prompt ``12+7-3*2\\n`` (strictly left to right, no precedence), worked solution::

    12+7=19
    19-3=16
    16*2=32
    #### 32

Every operation must be carried out, so a correct chain of thought is exactly ``difficulty`` lines long.
Multiplication and division use a one-digit operand, division only when exact, and every intermediate
value stays within ``±max_value``.
"""

from __future__ import annotations

import random

from jetrl.data.answers import extract_final_number, parse_number
from jetrl.data.tasks.base import Style, Task, TaskExample, final_answer_line

_WORDS = {"+": "add {}", "-": "subtract {}", "*": "multiply by {}", "/": "divide by {}"}


def _apply(op: str, a: int, b: int) -> int:
    if op == "+":
        return a + b
    if op == "-":
        return a - b
    if op == "*":
        return a * b
    return a // b  # exact: the generator only divides multiples


class ArithmeticTask(Task):
    """Left-to-right chains of + - * / with a worked solution; ``difficulty`` = number of operations."""

    name = "arithmetic"
    compact_format = "a bare expression of + - * / applied left to right, no precedence"

    def __init__(
        self,
        difficulty: int | tuple[int, int] = 3,
        seed: int = 0,
        style: Style = "compact",
        max_operand: int = 20,
        max_value: int = 999,
    ) -> None:
        super().__init__(difficulty, seed, style)
        if max_operand < 2 or max_value < max_operand * 9:
            raise ValueError(f"need max_operand >= 2 and max_value >= 9 * max_operand, got {max_operand}, {max_value}")
        self.max_operand = max_operand
        self.max_value = max_value

    def _generate(self, rng: random.Random, difficulty: int, index: int) -> TaskExample:
        value = rng.randint(1, self.max_operand)
        start, ops, lines = value, [], []
        for _ in range(difficulty):
            options = [("+", rng.randint(1, self.max_operand)), ("-", rng.randint(1, self.max_operand))]
            k = rng.randint(2, 9)
            if abs(value * k) <= self.max_value:
                options.append(("*", k))
            if value != 0 and value % k == 0:
                options.append(("/", k))
            op, operand = rng.choice(options)
            if op == "+" and value + operand > self.max_value:
                op = "-"
            if op == "-" and value - operand < -self.max_value:
                op = "+"
            new = _apply(op, value, operand)
            lines.append(f"{value}{op}{operand}={new}")
            ops.append((op, operand))
            value = new
        if self.style == "compact":
            prompt = str(start) + "".join(f"{op}{x}" for op, x in ops) + "\n"
        else:
            steps = ", then ".join(_WORDS[op].format(x) for op, x in ops)
            prompt = (
                f"Start with {start}; {steps}. What is the result? Work one operation per line, "
                f'then give the final number after "####".'
            )
        solution = "\n".join(lines) + f"\n#### {value}"
        return TaskExample(index=index, prompt=prompt, solution=solution, answer=str(value), difficulty=difficulty)

    def check(self, completion_text: str, reference_answer: str) -> bool:
        return check_arithmetic(completion_text, reference_answer)


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
