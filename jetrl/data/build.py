"""The prompts of a run or an evaluation, from a data spec: a built-in task or a JSONL/Parquet file.

:func:`build_prompt_dataset` is the one place that turns the data section of a config (anything with
the fields of :class:`DataSpec`, e.g. ``jetrl.config.DataConfig``) into a :class:`PromptDataset`: the RL
loop and ``jetrl eval`` both call it, so a file or task reads the same way in training and evaluation.
"""

from __future__ import annotations

from typing import Protocol

from jetrl.data.datasets import DATASET_FORMATS, ColumnMap, DatasetConfig, PromptDataset, load_prompt_dataset
from jetrl.data.tasks import get_task
from jetrl.data.templates import TemplateConfig


class DataSpec(Protocol):
    """Where prompts come from: a built-in ``task`` (with ``difficulty`` and ``num_examples``), or a file at
    ``path`` in a ready-made ``format`` whose columns, instruction, system prompt, reward name and row
    count the other fields may override (None keeps the format's)."""

    path: str | None
    format: str
    task: str | None
    difficulty: int
    task_style: str
    num_examples: int
    prompt_column: str | None
    answer_column: str | None
    instruction: str | None
    system_prompt: str | None
    reward: str | None
    max_examples: int | None


def build_prompt_dataset(spec: DataSpec, seed: int) -> PromptDataset:
    """The prompts ``spec`` names; a task draws its ``num_examples`` problems from ``seed``."""
    if spec.task is not None:
        if spec.path is not None:
            raise ValueError(f"a data spec names a file ({spec.path!r}) and a task ({spec.task!r}): set one")
        return get_task(spec.task, difficulty=spec.difficulty, seed=seed, style=spec.task_style).dataset(
            spec.num_examples)
    if spec.path is None:
        raise ValueError("no prompts: name a file (JSONL/Parquet) or a built-in task")
    config = DatasetConfig(path=spec.path, format=spec.format, reward=spec.reward, max_examples=spec.max_examples)
    fmt = DATASET_FORMATS[config.format]
    if spec.prompt_column or spec.answer_column:
        config.columns = ColumnMap(prompt=spec.prompt_column or fmt.columns.prompt,
                                   answer=spec.answer_column or fmt.columns.answer)
    if spec.instruction or spec.system_prompt:
        config.template = TemplateConfig(instruction=spec.instruction or fmt.instruction,
                                         system_prompt=spec.system_prompt)
    return load_prompt_dataset(config)


__all__ = ["DataSpec", "build_prompt_dataset"]
