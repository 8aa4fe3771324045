"""What a built-in synthetic task is: a seeded generator of problems with worked solutions.

Each example is a pure function of ``(task name, seed, index)``: example 17 of seed 0 is the same on every
machine and in every run, and no list needs storing. ``difficulty`` is the number of reasoning steps a
worked solution takes (one line of chain of thought per step), so it sets how long a correct rollout must
be; pass ``(low, high)`` to draw it per example.

Two prompt styles: ``"compact"`` -- a few characters over :data:`COMPACT_ALPHABET`, for the embedded
character-level model; ``"natural"`` -- an English instruction, for pretrained LLMs. Solutions are the same
in both: one ``a op b=c`` line per step, then the final answer line ``#### <answer>``.
"""

from __future__ import annotations

import operator
import random
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar, Literal, get_args

from jetrl.data.datasets import PromptDataset
from jetrl.data.prompt import Prompt
from jetrl.data.templates import TemplateConfig

Style = Literal["compact", "natural"]
STYLES: tuple[str, ...] = get_args(Style)

# Every character the compact prompts and worked solutions of the built-in tasks use.
COMPACT_ALPHABET = "0123456789+-*/=()>,# \n"
# The operations of the worked solutions, on ints ("/" is used only where it divides exactly).
OPERATIONS = {"+": operator.add, "-": operator.sub, "*": operator.mul, "/": operator.floordiv}


@dataclass(frozen=True)
class TaskExample:
    """One generated problem: the ``prompt`` text, a worked ``solution`` (chain of thought, then
    ``#### <answer>``), the ``answer`` reference the task's reward takes, and its ``difficulty`` in steps."""

    index: int
    prompt: str
    solution: str
    answer: str
    difficulty: int

    def to_prompt(self) -> Prompt:
        return Prompt(index=self.index, text=self.prompt, answer=self.answer)


class Task(ABC):
    """A seeded problem generator. Subclasses set ``name`` and ``compact_format`` and implement ``_generate``
    (from a private ``random.Random``); the task's reward is registered under ``name`` in
    :data:`jetrl.data.rewards.BUILTIN_REWARDS`."""

    name: ClassVar[str]
    compact_format: ClassVar[str] = ""  # what a compact prompt is, in words (``jetrl generate`` shows it)
    min_difficulty: ClassVar[int] = 1
    max_difficulty: ClassVar[int] = 64

    def __init__(self, difficulty: int | tuple[int, int] = 3, seed: int = 0, style: Style = "compact") -> None:
        low, high = (difficulty, difficulty) if isinstance(difficulty, int) else tuple(difficulty)
        if not (isinstance(low, int) and isinstance(high, int)):
            raise TypeError(f"{self.name}: difficulty must be an int or a (low, high) pair of ints, got {difficulty!r}")
        if not self.min_difficulty <= low <= high <= self.max_difficulty:
            raise ValueError(f"{self.name}: difficulty must lie in [{self.min_difficulty}, {self.max_difficulty}] "
                             f"(low <= high), got {difficulty!r}")
        if style not in STYLES:
            raise ValueError(f"{self.name}: style must be one of {', '.join(map(repr, STYLES))}, got {style!r}")
        self.difficulty_range = (low, high)
        self.seed = int(seed)
        self.style = style

    def example(self, index: int) -> TaskExample:
        """Example ``index``: deterministic in (task, seed, index)."""
        if index < 0:
            raise ValueError(f"example index must be >= 0, got {index}")
        rng = random.Random(f"{self.name}/{self.seed}/{index}")  # str seeds hash with SHA-512: stable
        difficulty = rng.randint(*self.difficulty_range)
        return self._generate(rng, difficulty, index)

    def examples(self, num_examples: int, start: int = 0) -> list[TaskExample]:
        return [self.example(i) for i in range(start, start + num_examples)]

    def dataset(self, num_examples: int, start: int = 0) -> PromptDataset:
        """``num_examples`` prompts (indices ``start ...``) scored by this task's reward. Use a different
        ``seed`` (or a disjoint ``start`` range) for an evaluation set."""
        prompts = [ex.to_prompt() for ex in self.examples(num_examples, start)]
        name = f"{self.name}(seed={self.seed})"
        return PromptDataset(prompts, name=name, reward=self.name, template=TemplateConfig())

    @abstractmethod
    def _generate(self, rng: random.Random, difficulty: int, index: int) -> TaskExample: ...


def final_answer_line(text: str) -> str | None:
    """The text after the last ``####`` up to the end of that line, stripped; None if there is none."""
    at = text.rfind("####")
    return None if at < 0 else text[at + 4 :].split("\n", 1)[0].strip()
