"""Long chains: a short prompt, a worked trace whose length ``difficulty`` sets (hundreds to thousands of tokens).

The rollout-vs-training mismatch of an FP8 rollout grows with the length of what is generated, so the
experiments need a task whose correct solutions are long and whose length is a knob, while the prompt
stays short (as in real long reasoning). The rule, counted down from ``n = difficulty`` to 1::

    if x is even: x = x / 2        else: x = x + n

Compact prompt ``start,steps``; one line per step, ``n>a op b=c``, then the final value::

    37,4            (prompt)
    4>37+4=41
    3>41+3=44
    2>44/2=22
    1>22/2=11
    #### 11

Every step depends on the line before it only, so the trace is local arithmetic on 1-4 digit numbers
that a small model learns; it never becomes periodic (the addend changes every step), so no line can be
copied from an earlier one. A correct answer needs every one of the ``difficulty`` steps right, so
accuracy falls with length and the task stays unsaturated at the long end. Values stay below
``max_start + 4 * difficulty``; with the character tokenizer a solution of difficulty 20 is about 220
tokens, 300 about 4,000 (:func:`difficulty_for_tokens` finds the difficulty for a length).

The checker reads only the ``#### <integer>`` line (a trace cut short scores 0), and parses at most
:data:`MAX_ANSWER_DIGITS` digits, so a pathological completion costs bounded time.
"""

from __future__ import annotations

import bisect
import random
import re

from jetrl.data.tasks.base import Style, Task, TaskExample, final_answer_line

MAX_ANSWER_DIGITS = 12  # a final answer of this task has at most 5 digits
_ANSWER = re.compile(r"-?\d{1,%d}" % MAX_ANSWER_DIGITS)


def chain_step(value: int, counter: int) -> tuple[str, int, int]:
    """One step of the rule: ``(operator, operand, new value)``."""
    if value % 2 == 0:
        return "/", 2, value // 2
    return "+", counter, value + counter


def mean_solution_tokens(task: "ChainTask", difficulty: int, num_examples: int = 16) -> float:
    """Mean length in tokens of the character tokenizer (characters + ``<eos>``) of the worked solutions
    of ``difficulty`` steps, over the first ``num_examples`` problems of ``task``'s seed and options."""
    probe = ChainTask(difficulty, seed=task.seed, max_start=task.max_start)
    return sum(len(ex.solution) + 1 for ex in probe.examples(num_examples)) / num_examples


def difficulty_for_tokens(num_tokens: int, task: "ChainTask | None" = None) -> int:
    """The smallest difficulty whose worked solutions are on average at least ``num_tokens`` tokens long
    (character tokenizer), by bisection on :func:`mean_solution_tokens` (it rises with the difficulty)."""
    task = task if task is not None else ChainTask()
    if isinstance(num_tokens, bool) or not isinstance(num_tokens, int) or num_tokens < 1:
        raise ValueError(f"num_tokens must be a positive int, got {num_tokens!r}")
    low, high = ChainTask.min_difficulty, ChainTask.max_difficulty
    if mean_solution_tokens(task, high) < num_tokens:
        raise ValueError(f"chain solutions of the largest difficulty ({high}) are shorter than {num_tokens} tokens")
    # below the largest difficulty, which is long enough
    return low + bisect.bisect_left(range(low, high), num_tokens, key=lambda d: mean_solution_tokens(task, d))


class ChainTask(Task):
    """``difficulty`` steps of halve-if-even-else-add-the-counter from a start in 1..``max_start``."""

    name = "chain"
    compact_format = "a start value, ',', then the number of steps"
    max_difficulty = 2048

    def __init__(self, difficulty: int | tuple[int, int] = 20, seed: int = 0, style: Style = "compact",
                 max_start: int = 999) -> None:
        super().__init__(difficulty, seed, style)
        if isinstance(max_start, bool) or not isinstance(max_start, int) or max_start < 2:
            raise ValueError(f"chain: max_start must be an int >= 2, got {max_start!r}")
        self.max_start = max_start

    def _generate(self, rng: random.Random, difficulty: int, index: int) -> TaskExample:
        start = rng.randint(1, self.max_start)
        value, lines = start, []
        for counter in range(difficulty, 0, -1):
            op, operand, new = chain_step(value, counter)
            lines.append(f"{counter}>{value}{op}{operand}={new}")
            value = new
        if self.style == "compact":
            prompt = f"{start},{difficulty}\n"
        else:
            prompt = (f"Start with {start}. For n = {difficulty} down to 1: if the number is even, halve it; "
                      f"otherwise add n. Write one step per line as n>a+n=b or n>a/2=b, then give the final "
                      f'number after "####".')
        solution = "\n".join(lines) + f"\n#### {value}"
        return TaskExample(index=index, prompt=prompt, solution=solution, answer=str(value), difficulty=difficulty)


def check_chain(completion_text: str, reference_answer: str) -> bool:
    """True when the completion's ``#### <integer>`` line (the last one) equals the reference integer."""
    reference = reference_answer.strip()
    if not _ANSWER.fullmatch(reference):
        raise ValueError(f"chain reference must be an integer of at most {MAX_ANSWER_DIGITS} digits, got "
                         f"{reference_answer[:40]!r}")
    line = final_answer_line(completion_text)
    if line is None or not _ANSWER.fullmatch(line):
        return False
    return int(line) == int(reference)


def chain_reward(completion_text: str, reference_answer: str) -> float:
    """1.0 for the correct final value of a chain-task problem, else 0.0."""
    return 1.0 if check_chain(completion_text, reference_answer) else 0.0
