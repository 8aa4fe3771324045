"""Prompt datasets from JSONL/Parquet files, with column mapping and ready-made GSM8K and MATH formats.

A :class:`DatasetConfig` names a file, a format (``"gsm8k"``, ``"math"`` or ``"custom"``) and, for custom
files, which columns hold the prompt (or chat messages) and the reference answer. :func:`load_prompt_dataset`
reads it into a :class:`PromptDataset`, an indexable sequence of :class:`~jetrl.data.prompt.Prompt` that also
knows its reward function name and prompt template.
Draw batches with :class:`~jetrl.data.sampler.BatchLoader` (deterministic, resumable).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from jetrl.data.prompt import Prompt
from jetrl.data.sources import read_rows
from jetrl.data.templates import TemplateConfig, encode_prompt, render_prompt


@dataclass
class ColumnMap:
    """Which columns of a table make a :class:`Prompt`.

    Set ``prompt`` (a text column) or ``messages`` (a column of chat turns), not both. ``answer`` is the
    reference passed to the reward function.
    """

    prompt: str | None = "prompt"
    answer: str = "answer"
    messages: str | None = None

    def __post_init__(self) -> None:
        if self.messages is not None and self.prompt is not None:
            raise ValueError(f"ColumnMap: set either prompt ({self.prompt!r}) or messages ({self.messages!r}), not "
                             "both; use prompt=None with a messages column")
        if self.messages is None and self.prompt is None:
            raise ValueError("ColumnMap: one of prompt or messages must name a column")


@dataclass(frozen=True)
class DatasetFormat:
    """A ready-made dataset layout: its columns, default prompt instruction and reward function name."""

    columns: ColumnMap
    instruction: str
    reward: str | None


GSM8K_INSTRUCTION = "{prompt}\nLet's think step by step and output the final answer after \"####\"."
MATH_INSTRUCTION = "{prompt}\nLet's think step by step and output the final answer within \\boxed{}."

DATASET_FORMATS: dict[str, DatasetFormat] = {
    # GSM8K: ``answer`` is the worked solution ending in ``#### N``; gsm8k_reward reads N from it.
    "gsm8k": DatasetFormat(ColumnMap(prompt="question", answer="answer"), GSM8K_INSTRUCTION, "gsm8k"),
    # MATH / MATH-500: the reference is the short ``answer``.
    "math": DatasetFormat(ColumnMap(prompt="problem", answer="answer"), MATH_INSTRUCTION, "math"),
    "custom": DatasetFormat(ColumnMap(), "{prompt}", None),
}


@dataclass
class DatasetConfig:
    """Where prompts come from.

    ``format`` picks a layout from :data:`DATASET_FORMATS`; ``columns`` overrides its column map (for
    ``"custom"`` files name your columns here); ``template`` overrides its prompt template; ``reward``
    overrides its reward function name (see :func:`jetrl.data.rewards.resolve_reward`). ``max_examples``
    keeps the first N rows.
    """

    path: str
    format: str = "custom"
    columns: ColumnMap | None = None
    template: TemplateConfig | None = None
    reward: str | None = None
    max_examples: int | None = None

    def __post_init__(self) -> None:
        if self.format not in DATASET_FORMATS:
            raise ValueError(f"unknown dataset format {self.format!r}; choose one of {sorted(DATASET_FORMATS)}")
        if isinstance(self.columns, dict):
            self.columns = ColumnMap(**self.columns)
        if isinstance(self.template, dict):
            self.template = TemplateConfig(**self.template)
        if self.max_examples is not None and (not isinstance(self.max_examples, int) or self.max_examples < 1):
            raise ValueError(f"max_examples must be a positive int or None, got {self.max_examples!r}")


class PromptDataset(Sequence[Prompt]):
    """An in-memory, indexable list of prompts plus how to render and score them."""

    def __init__(self, prompts: Iterable[Prompt], name: str = "prompts", reward: str | None = None,
                 template: TemplateConfig | None = None) -> None:
        self.prompts = list(prompts)
        if not self.prompts:
            raise ValueError(f"dataset {name!r} is empty: it has no prompts")
        self.name, self.reward, self.template = name, reward, template or TemplateConfig()

    def __len__(self) -> int:
        return len(self.prompts)

    def __getitem__(self, i):
        return self.prompts[i]

    def render(self, prompt: Prompt, tokenizer: Any = None) -> str:
        """The policy's input text for ``prompt`` with this dataset's template (chat template if any)."""
        return render_prompt(prompt, tokenizer, self.template)

    def __repr__(self) -> str:
        return f"PromptDataset(name={self.name!r}, size={len(self)}, reward={self.reward!r})"


def prompts_from_rows(rows: Sequence[dict[str, Any]], columns: ColumnMap, available: Sequence[str],
                      source: str = "<rows>") -> list[Prompt]:
    """Map table rows to prompts; unknown columns and missing or null values fail with the row number."""
    for role, col in (("prompt", columns.prompt), ("messages", columns.messages), ("answer", columns.answer)):
        if col is not None and col not in available:
            raise ValueError(f"{source}: unknown {role} column {col!r}; available columns: "
                             f"{', '.join(map(repr, available))}")
    prompts = []
    for i, row in enumerate(rows):
        def value(col: str, role: str) -> Any:
            if col not in row or row[col] is None:
                raise ValueError(f"{source}: row {i + 1} has no value in the {role} column {col!r}")
            # a list or dict read as text would be its repr: e.g. verl's files, whose prompt is a list of chat
            # turns and whose reference sits in a dict, would give prompts and answers that are Python literals
            if role != "messages" and not isinstance(row[col], (str, int, float)):
                raise ValueError(f"{source}: row {i + 1}: the {role} column {col!r} holds a {type(row[col]).__name__}, "
                                 f"not text; point data.{role}_column at a column of text (or numbers)")
            return row[col]

        prompts.append(Prompt(index=i, answer=str(value(columns.answer, "answer")),
                              text=str(value(columns.prompt, "prompt")) if columns.prompt else None,
                              messages=tuple(value(columns.messages, "messages")) if columns.messages else None))
    return prompts


def check_prompt_lengths(dataset: PromptDataset, tokenizer: Any, max_prompt_tokens: int) -> list[np.ndarray]:
    """A ValueError naming the first prompt of ``dataset`` that, rendered and tokenized as the RL loop does
    (:func:`~jetrl.data.templates.encode_prompt`), is empty or longer than ``max_prompt_tokens``
    (``data.max_prompt_tokens``). The loop meets a prompt only when a batch draws it, so a run calls this
    before it loads the model: a bad row late in the file would otherwise stop it after hours of training.
    Returns each prompt's token ids (int32, in ``dataset`` order), which the loop takes instead of tokenizing again."""
    token_ids = []
    for prompt in dataset:
        ids = encode_prompt(tokenizer, dataset.render(prompt, tokenizer))
        where = f"{dataset.name}: prompt {prompt.index} (row {prompt.index + 1})"
        if not ids:
            raise ValueError(f"{where} tokenizes to nothing")
        if len(ids) > max_prompt_tokens:
            raise ValueError(f"{where} has {len(ids)} tokens, more than data.max_prompt_tokens={max_prompt_tokens}; "
                             f"raise it or filter the dataset")
        token_ids.append(np.asarray(ids, dtype=np.int32))
    return token_ids


def load_prompt_dataset(config: DatasetConfig | str, **overrides: Any) -> PromptDataset:
    """Read the file a :class:`DatasetConfig` names into a :class:`PromptDataset`.

    ``load_prompt_dataset("test.jsonl", format="gsm8k")`` is shorthand for a config with those fields;
    ``overrides`` replace fields of a given config."""
    config = DatasetConfig(path=config, **overrides) if isinstance(config, str) else replace(config, **overrides)
    fmt = DATASET_FORMATS[config.format]
    rows, available = read_rows(config.path)
    if not rows:
        raise ValueError(f"dataset file {config.path!r} has no rows")
    prompts = prompts_from_rows(rows[: config.max_examples], config.columns or fmt.columns, available,  # None: all
                                source=config.path)
    template = config.template or TemplateConfig(instruction=fmt.instruction)
    return PromptDataset(prompts, name=config.path, reward=config.reward or fmt.reward, template=template)
