"""Data stage: prompt datasets, prompt templates, rewards and the built-in synthetic tasks.

Feeds the RL loop (``data <- rl``); imports nothing else from jetrl.
"""

from jetrl.data.datasets import (
    DATASET_FORMATS,
    ColumnMap,
    DatasetConfig,
    DatasetFormat,
    PromptDataset,
    load_prompt_dataset,
)
from jetrl.data.prompt import Prompt
from jetrl.data.sampler import BatchLoader, EpochSampler
from jetrl.data.templates import TemplateConfig, has_chat_template, render_prompt

__all__ = [
    "DATASET_FORMATS",
    "BatchLoader",
    "ColumnMap",
    "DatasetConfig",
    "DatasetFormat",
    "EpochSampler",
    "Prompt",
    "PromptDataset",
    "TemplateConfig",
    "has_chat_template",
    "load_prompt_dataset",
    "render_prompt",
]
