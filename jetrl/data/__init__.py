"""Data stage: prompt datasets, prompt templates, rewards and the built-in synthetic tasks.

Feeds the RL loop (``data <- rl``); imports nothing else from jetrl.
"""

from jetrl.data.build import DataSpec, RunDataSpec, RunPrompts, build_prompt_dataset, check_run_prompts
from jetrl.data.datasets import (
    DATASET_FORMATS, ColumnMap, DatasetConfig, PromptDataset, check_prompt_lengths, load_prompt_dataset,
)
from jetrl.data.prompt import Prompt
from jetrl.data.prompt_file import read_prompts
from jetrl.data.reward_pool import RewardPool, RewardPoolConfig
from jetrl.data.rewards import BUILTIN_REWARDS, RewardConfig, build_reward_fn, gsm8k_reward, math_reward, resolve_reward
from jetrl.data.sampler import BatchLoader, EpochSampler
from jetrl.data.tasks import TASKS, get_task
from jetrl.data.templates import TemplateConfig, decode_completion, encode_prompt, has_chat_template, render_prompt

__all__ = [
    "read_prompts", "BUILTIN_REWARDS", "DATASET_FORMATS", "TASKS", "RewardConfig", "RewardPool", "RewardPoolConfig",
    "build_prompt_dataset", "build_reward_fn", "check_prompt_lengths", "check_run_prompts", "RunDataSpec", "RunPrompts",
    "DataSpec", "decode_completion", "encode_prompt", "get_task",
    "gsm8k_reward", "math_reward", "resolve_reward", "BatchLoader", "ColumnMap", "DatasetConfig", "EpochSampler",
    "Prompt", "PromptDataset", "TemplateConfig", "has_chat_template", "load_prompt_dataset", "render_prompt",
]
