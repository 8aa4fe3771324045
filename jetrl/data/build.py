"""The prompts of a run or an evaluation, from a data spec: a built-in task or a JSONL/Parquet file.

:func:`build_prompt_dataset` is the one place that turns the data section of a config (anything with
the fields of :class:`DataSpec`, e.g. ``jetrl.config.DataConfig``) into a :class:`PromptDataset`: the RL
loop and ``jetrl eval`` both call it, so a file or task reads the same way in training and evaluation.
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any, Protocol

import numpy as np

from jetrl.data.datasets import (
    DATASET_FORMATS, ColumnMap, DatasetConfig, PromptDataset, check_prompt_lengths, load_prompt_dataset,
)
from jetrl.data.rewards import RewardConfig, build_reward_fn
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
    """The prompts ``spec`` names; a task draws its ``num_examples`` problems from ``seed``. ``reward``,
    ``instruction`` and ``system_prompt`` apply to a task's prompts as to a file's."""
    if spec.task is not None:
        if spec.path is not None:
            raise ValueError(f"a data spec names a file ({spec.path!r}) and a task ({spec.task!r}): set one")
        dataset = get_task(spec.task, difficulty=spec.difficulty, seed=seed, style=spec.task_style).dataset(
            spec.num_examples)
        dataset.reward = spec.reward or dataset.reward  # training and held-out evaluation score alike
        if spec.instruction or spec.system_prompt:
            dataset.template = dataclasses.replace(dataset.template, system_prompt=spec.system_prompt,
                                                   instruction=spec.instruction or dataset.template.instruction)
        return dataset
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


class RunDataSpec(DataSpec, Protocol):
    """A run's data section (``jetrl.config.DataConfig``): a :class:`DataSpec` with the prompts a step takes, the
    longest prompt allowed and the held-out file."""

    prompts_per_step: int
    max_prompt_tokens: int
    eval_path: str | None


@dataclasses.dataclass
class RunPrompts:
    """A run's prompts as :func:`check_run_prompts` read and checked them, for the RL loop to take instead of
    reading and tokenizing them again: the ``dataset``, each prompt's ``token_ids`` (in dataset order), the
    ``tokenizer`` that made them (the run's, loaded once) and ``num_eval``, the number of held-out problems to
    evaluate on."""

    dataset: PromptDataset
    token_ids: list[np.ndarray]
    tokenizer: Any
    num_eval: int = 0


def check_run_prompts(spec: RunDataSpec, seed: int, tokenizer: Any, num_eval: int = 0) -> RunPrompts:
    """Read and check a run's prompts before its model loads, as the RL loop will use them: enough for one step,
    a reward that resolves, and every prompt tokenized within ``max_prompt_tokens`` (the loop meets a prompt only
    when a batch draws it); with ``num_eval`` held-out problems from ``eval_path``, that file's first ``num_eval``
    rows are read too (columns and values; not their token counts). Returns the prompts with their token ids,
    ``tokenizer`` and ``num_eval``, or the held-out file's row count where that is smaller (with a warning), so
    that the accuracy is reported over the problems actually evaluated."""
    dataset = build_prompt_dataset(spec, seed=seed)
    if len(dataset) < spec.prompts_per_step:
        raise ValueError(f"data.prompts_per_step ({spec.prompts_per_step}) is larger than the dataset "
                         f"({len(dataset)} prompts); lower it or use more data")
    build_reward_fn(RewardConfig(name=spec.reward), default=dataset.reward)
    token_ids = check_prompt_lengths(dataset, tokenizer, spec.max_prompt_tokens)
    if num_eval and spec.eval_path is not None:
        held_out = build_prompt_dataset(dataclasses.replace(spec, path=spec.eval_path, task=None,  # type: ignore
                                                            max_examples=num_eval), seed=seed)
        if len(held_out) < num_eval:
            warnings.warn(f"data.eval_path {spec.eval_path} has {len(held_out)} rows, fewer than the {num_eval} "
                          f"held-out problems asked for: the accuracy is over its {len(held_out)}")
            num_eval = len(held_out)
    return RunPrompts(dataset, token_ids, tokenizer, num_eval)


__all__ = ["DataSpec", "RunDataSpec", "RunPrompts", "build_prompt_dataset", "check_run_prompts"]
