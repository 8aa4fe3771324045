"""Prompt datasets from JSONL/Parquet files, with column mapping and ready-made GSM8K and MATH formats.

A :class:`DatasetConfig` names a file, a format (``"gsm8k"``, ``"math"`` or ``"custom"``) and, for custom
files, which columns hold the prompt (or chat messages), the reference answer and optional solution and
metadata. :func:`load_prompt_dataset` reads it into a :class:`PromptDataset`, an indexable sequence of
:class:`~jetrl.data.prompt.Prompt` that also knows its reward function name and prompt template.
Draw batches with :class:`~jetrl.data.sampler.BatchLoader` (deterministic, resumable).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, fields, replace
from typing import Any, overload

from jetrl.data.prompt import Prompt
from jetrl.data.sources import FILE_TYPES, FileType, read_rows
from jetrl.data.templates import TemplateConfig, render_prompt


@dataclass
class ColumnMap:
    """Which columns of a table make a :class:`Prompt`.

    Set ``prompt`` (a text column) or ``messages`` (a column of chat turns), not both. ``answer`` is the
    reference passed to the reward function; ``solution`` (optional) a worked solution; ``metadata``
    extra columns copied into ``Prompt.metadata``.
    """

    prompt: str | None = "prompt"
    answer: str = "answer"
    messages: str | None = None
    solution: str | None = None
    metadata: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.messages is not None and self.prompt is not None:
            raise ValueError(
                f"ColumnMap: set either prompt ({self.prompt!r}) or messages ({self.messages!r}), not both; "
                "use prompt=None with a messages column"
            )
        if self.messages is None and self.prompt is None:
            raise ValueError("ColumnMap: one of prompt or messages must name a column")
        if isinstance(self.metadata, str):
            self.metadata = (self.metadata,)
        self.metadata = tuple(self.metadata)

    def required(self) -> list[tuple[str, str]]:
        """(role, column) pairs that every row must have."""
        pairs = [("prompt", self.prompt), ("messages", self.messages), ("answer", self.answer),
                 ("solution", self.solution)]
        pairs += [("metadata", c) for c in self.metadata]
        return [(role, col) for role, col in pairs if col is not None]


@dataclass(frozen=True)
class DatasetFormat:
    """A ready-made dataset layout: its columns, default prompt instruction and reward function name."""

    name: str
    columns: ColumnMap
    instruction: str
    reward: str | None


GSM8K_INSTRUCTION = "{prompt}\nLet's think step by step and output the final answer after \"####\"."
MATH_INSTRUCTION = "{prompt}\nLet's think step by step and output the final answer within \\boxed{}."

DATASET_FORMATS: dict[str, DatasetFormat] = {
    # GSM8K: ``answer`` is the worked solution ending in ``#### N``; gsm8k_reward reads N from it.
    "gsm8k": DatasetFormat(
        "gsm8k", ColumnMap(prompt="question", answer="answer", solution="answer"), GSM8K_INSTRUCTION, "gsm8k"
    ),
    # MATH / MATH-500: the reference is the short ``answer``; the ``solution`` carries a \boxed{} answer too.
    "math": DatasetFormat(
        "math",
        ColumnMap(prompt="problem", answer="answer", solution="solution", metadata=("subject", "level", "unique_id")),
        MATH_INSTRUCTION,
        "math",
    ),
    "custom": DatasetFormat("custom", ColumnMap(), "{prompt}", None),
}


@dataclass
class DatasetConfig:
    """Where prompts come from.

    ``format`` picks a layout from :data:`DATASET_FORMATS`; ``columns`` overrides its column map (for
    ``"custom"`` files name your columns here); ``template`` overrides its prompt template; ``reward``
    overrides its reward function name (see :func:`jetrl.data.rewards.resolve_reward`). Optional metadata
    columns of a ready-made format are copied only where present. ``max_examples`` keeps the first N rows.
    """

    path: str
    format: str = "custom"
    columns: ColumnMap | None = None
    template: TemplateConfig | None = None
    reward: str | None = None
    file_type: FileType = "auto"
    max_examples: int | None = None

    def __post_init__(self) -> None:
        if self.format not in DATASET_FORMATS:
            raise ValueError(f"unknown dataset format {self.format!r}; choose one of {sorted(DATASET_FORMATS)}")
        if isinstance(self.columns, dict):
            self.columns = ColumnMap(**self.columns)
        if isinstance(self.template, dict):
            self.template = TemplateConfig(**self.template)
        if self.file_type not in FILE_TYPES:
            raise ValueError(f"file_type must be one of {', '.join(map(repr, FILE_TYPES))}, got {self.file_type!r}")
        if self.max_examples is not None and (not isinstance(self.max_examples, int) or self.max_examples < 1):
            raise ValueError(f"max_examples must be a positive int or None, got {self.max_examples!r}")


class PromptDataset(Sequence[Prompt]):
    """An in-memory, indexable list of prompts plus how to render and score them."""

    def __init__(
        self,
        prompts: Iterable[Prompt],
        name: str = "prompts",
        reward: str | None = None,
        template: TemplateConfig | None = None,
    ) -> None:
        self.prompts = list(prompts)
        if not self.prompts:
            raise ValueError(f"dataset {name!r} is empty: it has no prompts")
        self.name = name
        self.reward = reward
        self.template = template or TemplateConfig()

    def __len__(self) -> int:
        return len(self.prompts)

    @overload
    def __getitem__(self, i: int) -> Prompt: ...
    @overload
    def __getitem__(self, i: slice) -> list[Prompt]: ...
    def __getitem__(self, i):
        return self.prompts[i]

    def render(self, prompt: Prompt, tokenizer: Any = None) -> str:
        """The policy's input text for ``prompt`` with this dataset's template (chat template if any)."""
        return render_prompt(prompt, tokenizer, self.template)

    def __repr__(self) -> str:
        return f"PromptDataset(name={self.name!r}, size={len(self)}, reward={self.reward!r})"


def prompts_from_rows(
    rows: Sequence[dict[str, Any]],
    columns: ColumnMap,
    available: Sequence[str],
    source: str = "<rows>",
    optional_metadata: bool = False,
) -> list[Prompt]:
    """Map table rows to prompts; unknown columns and missing or null values fail with the row number."""
    metadata_cols = columns.metadata
    if optional_metadata:
        metadata_cols = tuple(c for c in metadata_cols if c in available)
        columns = replace(columns, metadata=metadata_cols)
    for role, col in columns.required():
        if col not in available:
            raise ValueError(
                f"{source}: unknown {role} column {col!r}; available columns: {', '.join(map(repr, available))}"
            )
    prompts = []
    for i, row in enumerate(rows):
        def value(col: str, role: str) -> Any:
            if col not in row or row[col] is None:
                raise ValueError(f"{source}: row {i + 1} has no value in the {role} column {col!r}")
            return row[col]

        answer = value(columns.answer, "answer")
        prompts.append(
            Prompt(
                index=i,
                answer=answer if isinstance(answer, str) else str(answer),
                text=str(value(columns.prompt, "prompt")) if columns.prompt else None,
                messages=tuple(value(columns.messages, "messages")) if columns.messages else None,
                solution=str(value(columns.solution, "solution")) if columns.solution else None,
                metadata={c: row.get(c) for c in metadata_cols},
            )
        )
    return prompts


def load_prompt_dataset(config: DatasetConfig | str, **overrides: Any) -> PromptDataset:
    """Read the file a :class:`DatasetConfig` names into a :class:`PromptDataset`.

    ``load_prompt_dataset("test.jsonl", format="gsm8k")`` is shorthand for a config with those fields.
    """
    if isinstance(config, str):
        config = DatasetConfig(path=config, **overrides)
    elif overrides:
        known = {f.name for f in fields(DatasetConfig)}
        unknown = sorted(set(overrides) - known)
        if unknown:
            raise TypeError(f"unknown DatasetConfig field(s) {unknown}; known: {sorted(known)}")
        config = replace(config, **overrides)
    fmt = DATASET_FORMATS[config.format]
    rows, available = read_rows(config.path, config.file_type)
    if not rows:
        raise ValueError(f"dataset file {config.path!r} has no rows")
    if config.max_examples is not None:
        rows = rows[: config.max_examples]
    prompts = prompts_from_rows(
        rows,
        config.columns or fmt.columns,
        available,
        source=config.path,
        optional_metadata=config.columns is None,
    )
    template = config.template or TemplateConfig(instruction=fmt.instruction)
    return PromptDataset(prompts, name=config.path, reward=config.reward or fmt.reward, template=template)
