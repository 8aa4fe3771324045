"""Countdown: combine the given numbers with + - * / (each number at most once) to reach a target.

A search task: the prompt gives numbers and a target, the model must find an expression. The generator
builds the target by combining ``difficulty + 1`` numbers in ``difficulty`` steps (natural numbers all the
way: no negative or fractional intermediates), so a worked solution exists with one line per step::

    3,5,7,2>24          (compact prompt: numbers, '>', target)
    5*3=15
    15+7=22
    22+2=24
    #### 5*3+7+2

Shorter solutions may exist (a subset of the numbers can hit the target), so ``difficulty`` bounds the
solution length from above. The numbers lie in 1..:data:`MAX_NUMBER`, the target (and every product on
the way) in 1..:data:`MAX_TARGET`. The checker parses the final expression with a small recursive-descent
parser (no ``eval``), evaluates it in exact fractions, and requires every number used to be available
(multiset) and the value to equal the target.
"""

from __future__ import annotations

import random
import re
from collections import Counter
from fractions import Fraction

from jetrl.data.tasks.base import OPERATIONS, Task, TaskExample, final_answer_line

MAX_NUMBER = 20  # the given numbers lie in 1..MAX_NUMBER
MAX_TARGET = 999  # the target, and every product on the way to it, lie in 1..MAX_TARGET
MAX_EXPRESSION_CHARS = 200
_PRECEDENCE = {"+": 1, "-": 1, "*": 2, "/": 2}
_TOKEN = re.compile(r"\s*(\d+|[-+*/()])")
_REFERENCE = re.compile(r"^\s*(\d+(?:\s*,\s*\d+)*)\s*>\s*(\d+)\s*$")


class CountdownTask(Task):
    """Reach a target from ``difficulty + 1`` numbers in 1..:data:`MAX_NUMBER`."""

    name = "countdown"
    compact_format = "numbers, '>', then the target to reach with them"
    max_difficulty = 8

    def _generate(self, rng: random.Random, difficulty: int, index: int) -> TaskExample:
        while True:  # rejection sampling; each draw advances the same seeded rng, so it stays deterministic
            numbers = [rng.randint(1, MAX_NUMBER) for _ in range(difficulty + 1)]
            pool = [(n, str(n), 3) for n in numbers]  # (value, expression, precedence of its top operator)
            lines = []
            while len(pool) > 1:
                (a, ea, pa), (b, eb, pb) = [pool.pop(rng.randrange(len(pool))) for _ in range(2)]
                if a < b:
                    (a, ea, pa), (b, eb, pb) = (b, eb, pb), (a, ea, pa)
                ops = ["+"] + (["-"] if a > b else []) + (["*"] if a * b <= MAX_TARGET else [])
                ops += ["/"] if b > 1 and a % b == 0 else []
                op = rng.choice(ops)
                value = OPERATIONS[op](a, b)
                lines.append(f"{a}{op}{b}={value}")
                pool.append((value, _join(ea, pa, op, eb, pb), _PRECEDENCE[op]))
            target, expression, _ = pool[0]
            if 1 <= target <= MAX_TARGET and target not in numbers:
                break
        rng.shuffle(numbers)
        reference = ",".join(map(str, numbers)) + f">{target}"
        if self.style == "compact":
            prompt = reference + "\n"
        else:
            prompt = (f"Using the numbers {', '.join(map(str, numbers))} (each at most once) and the operations "
                      f"+, -, *, /, write an expression equal to {target}. Work one operation per line, then give "
                      f'the expression after "####".')
        solution = "\n".join(lines) + f"\n#### {expression}"
        return TaskExample(index=index, prompt=prompt, solution=solution, answer=reference, difficulty=difficulty)


def _join(left: str, left_prec: int, op: str, right: str, right_prec: int) -> str:
    """``left op right`` with only the parentheses that precedence and left-associativity require."""
    prec = _PRECEDENCE[op]
    if left_prec < prec:
        left = f"({left})"
    if right_prec < prec or (right_prec == prec and op in "-/"):
        right = f"({right})"
    return f"{left}{op}{right}"


def parse_reference(reference_answer: str) -> tuple[list[int], int]:
    """``"3,5,7,2>24"`` -> ``([3, 5, 7, 2], 24)``."""
    match = _REFERENCE.match(reference_answer)
    if not match:
        raise ValueError(f"countdown reference must look like '3,5,7,2>24', got {reference_answer!r}")
    return [int(x) for x in match.group(1).split(",")], int(match.group(2))


def evaluate_expression(expression: str) -> tuple[Fraction, list[int]]:
    """Exact value of an expression over non-negative integers, + - * / and parentheses, and the numbers
    it uses. ValueError for anything else (unary minus, other characters, division by zero, too long)."""
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise ValueError(f"expression longer than {MAX_EXPRESSION_CHARS} characters")
    tokens, pos = [], 0
    expression = expression.rstrip()
    while pos < len(expression):
        match = _TOKEN.match(expression, pos)
        if not match:
            raise ValueError(f"unexpected character {expression[pos]!r} at {pos} in {expression!r}")
        tokens.append(match.group(1))
        pos = match.end()
    used: list[int] = []
    at = 0

    def peek() -> str | None:
        return tokens[at] if at < len(tokens) else None

    def take() -> str:
        nonlocal at
        if at >= len(tokens):
            raise ValueError(f"expression {expression!r} ends early")
        at += 1
        return tokens[at - 1]

    def atom() -> Fraction:
        token = take()
        if token == "(":
            value = sum_()
            if take() != ")":
                raise ValueError(f"unbalanced parentheses in {expression!r}")
            return value
        if token.isdigit():
            used.append(int(token))
            return Fraction(int(token))
        raise ValueError(f"expected a number or '(' in {expression!r}, got {token!r}")

    def product() -> Fraction:
        value = atom()
        while peek() in ("*", "/"):
            op, rhs = take(), atom()
            if op == "/" and rhs == 0:
                raise ValueError(f"division by zero in {expression!r}")
            value = value * rhs if op == "*" else value / rhs
        return value

    def sum_() -> Fraction:
        value = product()
        while peek() in ("+", "-"):
            op, rhs = take(), product()
            value = value + rhs if op == "+" else value - rhs
        return value

    value = sum_()
    if at != len(tokens):
        raise ValueError(f"unexpected {tokens[at]!r} in {expression!r}")
    return value, used


def check_countdown(completion_text: str, reference_answer: str) -> bool:
    """True when the expression after the last ``####`` uses only available numbers (each at most as
    often as given) and equals the target."""
    numbers, target = parse_reference(reference_answer)
    expression = final_answer_line(completion_text)
    if not expression:
        return False
    try:
        value, used = evaluate_expression(expression)
    except ValueError:
        return False
    if Counter(used) - Counter(numbers):  # some number used more often than given
        return False
    return value == target


def countdown_reward(completion_text: str, reference_answer: str) -> float:
    """1.0 for a valid expression reaching the target, else 0.0."""
    return 1.0 if check_countdown(completion_text, reference_answer) else 0.0
