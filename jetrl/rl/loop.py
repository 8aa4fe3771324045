"""The RL run, top to bottom: config -> model, data, engine, trainer -> steps, metrics, checkpoints.

``run(config)`` is what ``jetrl train`` calls. The config is fully validated (including the data source)
before the model is loaded. With ``trainer.resume`` the run continues from the latest complete
checkpoint in ``trainer.output_dir``: model, optimizer, scheduler, RNG states, data position and the
metrics log (truncated to the checkpoint's cursor) are restored, so a run killed at any moment loses
only the steps since its last checkpoint and then reproduces them. Which checkpoints are written (checked
against the free disk space first: ``trainer.on_disk_full``), kept (``trainer.keep_last``), which hold the policy
alone (``trainer.weights_only``) and which one is resumed from (a damaged one is skipped) is the training stage's
checkpoint policy (:mod:`jetrl.train.policy`); this module runs it.

``jetrl train`` checks the data before the run (:func:`jetrl.data.check_run_prompts`) and passes on the prompts it
read and tokenized with the tokenizer it loaded (``run``'s ``data``), so the run reads and tokenizes them, and loads
the tokenizer, once.

A sample whose reward fails scores 0.0 and is counted; too many failures in a step stop the run (the ``reward``
section, :class:`~jetrl.config.schema.RewardLimitsConfig`; :class:`~jetrl.data.reward_pool.RewardFailureGuard`).

The output folder belongs to one run (:func:`prepare_output_dir`), and the run is checked against the model's
context and tokenizer before the model is loaded (:func:`check_model`).

**Several GPUs.** ``torchrun --nproc-per-node N -m jetrl train CONFIG`` starts N copies of this run, each a rank
(:func:`jetrl.parallel.init_parallel`) that builds the model and data the same way; the trainer shards the model
and splits each step's prompts. Rank 0 alone saves the config, prints progress and writes metrics (which are
global); checkpoints are written by all ranks together and resume at any number of ranks
(:func:`jetrl.train.policy.save_trainer_checkpoint`). A rank that fails brings the whole job down instead of
hanging (:meth:`jetrl.parallel.ParallelContext.guard`).
"""

from __future__ import annotations

import contextlib
import contextvars
import random
import time
import warnings
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import numpy as np
import torch

from jetrl.config import ConfigError, RunConfig, load_config, save_config
from jetrl.data import BatchLoader, RunPrompts, build_prompt_dataset, decode_completion, encode_prompt
from jetrl.data.reward_pool import RewardFailureGuard, RewardPool, RewardPoolConfig, RewardResult
from jetrl.data.rewards import RewardConfig, build_reward_fn
from jetrl.models import check_tokenizer, load_model, load_tokenizer, resolve_checkpoint, resolve_device
from jetrl.models.config import DecoderConfig
from jetrl.parallel import init_parallel
from jetrl.rl.metrics import METRICS_FILE, TENSORBOARD_SUBDIR, MetricsLogger
from jetrl.rl.trainer import PromptItem, Trainer, rollout_sampling_params
from jetrl.rollout import RolloutEngine
from jetrl.threads import configure_threads
from jetrl.train.policy import (CHECKPOINT_SUBDIR, check_resumable, checkpoint_due, claim_output_dir, resume_trainer,
                                save_trainer_checkpoint, weights_only_at)

EVAL_FILE = "eval.json"  # ``jetrl train``'s held-out accuracy before and after (jetrl.train_job)
PLOT_FILE = "curves.png"  # ``jetrl train``'s plot of the run's curves (jetrl.train_job)
# what a run writes into its output folder besides config.yaml (``overwrite`` deletes them)
RUN_OUTPUTS = (CHECKPOINT_SUBDIR, METRICS_FILE, TENSORBOARD_SUBDIR, EVAL_FILE, PLOT_FILE)


def seed_everything(seed: int) -> None:
    """Seed python's, numpy's and torch's global RNGs (the rollout and the update use their own seeds)."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def prepare_output_dir(config: RunConfig, overwrite: bool = False) -> Path:
    """:func:`jetrl.train.policy.claim_output_dir` of ``trainer.output_dir`` (``overwrite`` deletes the old run's
    :data:`RUN_OUTPUTS`); returns it. Cheap: call it before any slow work."""
    return claim_output_dir(config.trainer.output_dir, resume=config.trainer.resume, overwrite=overwrite,
                            outputs=RUN_OUTPUTS)


def check_model(config: RunConfig, tokenizer: Any = None) -> tuple[str, DecoderConfig, Any]:
    """Read the policy's config.json and tokenizer (not its weights; ``tokenizer``: the one already loaded from
    ``model.tokenizer`` or the checkpoint, checked again) and check the run against them: the
    longest sequence (``data.max_prompt_tokens + rollout.max_tokens``) fits in the model's context, and the
    tokenizer matches the model (:func:`jetrl.models.check_tokenizer`), ``model.checkpoint_blocks`` is at most
    its blocks, and (first, before any file is read) the rollout's sampling parameters are valid. Returns
    (checkpoint folder, model config, tokenizer). A ``rollout.top_k`` above the vocabulary size is only a warning
    (it samples from all), shown once per process however often this is called."""
    try:
        rollout_sampling_params(config)
    except ValueError as exc:
        raise ConfigError(f"rollout: {exc}") from None
    folder = resolve_checkpoint(config.model.path)
    model_config = DecoderConfig.from_file(folder)
    model_config.check_context(config.data.max_prompt_tokens + config.rollout.max_tokens,
                               "data.max_prompt_tokens + rollout.max_tokens")
    blocks = config.model.checkpoint_blocks
    if blocks is not None and blocks > model_config.num_hidden_layers:
        raise ConfigError(f"model.checkpoint_blocks ({blocks}) is more than the model's "
                          f"{model_config.num_hidden_layers} decoder blocks")
    where = config.model.tokenizer or folder
    if tokenizer is None:
        tokenizer = load_tokenizer(where)
    check_tokenizer(tokenizer, model_config, where)
    if config.rollout.top_k > model_config.vocab_size:  # a UserWarning: shown once per process
        warnings.warn(f"rollout.top_k={config.rollout.top_k} is larger than the vocabulary ({model_config.vocab_size} "
                      f"tokens), so it keeps every token")
    return folder, model_config, tokenizer


def guarded_rewards(pool: RewardPool, guard: RewardFailureGuard,
                    parallel: Any = None) -> Callable[[list[str], list[str]], RewardResult]:
    """The trainer's reward function: ``pool`` scores the completions and ``guard`` checks the
    :class:`~jetrl.data.reward_pool.RewardResult`, whose failure counts go into the step's metrics. Under
    ``parallel`` (several ranks, each scoring its share) the guard judges the whole step's counts."""

    def reward_fn(texts: list[str], refs: list[str]) -> RewardResult:
        result = pool.score(texts, refs)
        counts = None
        if parallel is not None and parallel.is_distributed:  # every rank scores once per step: a collective
            counts = [int(c) for c in parallel.sum([result.num_errors, result.num_timeouts, len(result.rewards)])]
        guard.check(result, counts)
        return result

    return reward_fn


class DatasetPrompts:
    """Adapts a ``jetrl.data`` prompt dataset to the trainer: renders and tokenizes each prompt, or takes its ids
    from ``token_ids`` (each prompt's, in dataset order, as :func:`jetrl.data.check_prompt_lengths` returns them)."""

    def __init__(self, dataset: Any, tokenizer: Any, batch_size: int, seed: int, shuffle: bool,
                 max_prompt_tokens: int, token_ids: Sequence[np.ndarray] | None = None) -> None:
        if token_ids is not None and len(token_ids) != len(dataset):
            raise ValueError(f"{len(token_ids)} prompts' token ids for a dataset of {len(dataset)}")
        self.dataset, self.tokenizer, self.token_ids = dataset, tokenizer, token_ids
        self.loader = BatchLoader(range(len(dataset)), batch_size, seed=seed, shuffle=shuffle)  # positions
        self.max_prompt_tokens = max_prompt_tokens

    def decode(self, ids: list[int]) -> str:
        """Completion text for the reward function (special tokens such as the final EOS dropped)."""
        return decode_completion(self.tokenizer, ids)

    def next_batch(self) -> list[PromptItem]:
        """The next ``batch_size`` prompts with their token ids; over-long prompts are an error."""
        items = []
        for i in self.loader.next_batch():
            prompt = self.dataset[i]
            ids = (self.token_ids[i].tolist() if self.token_ids is not None else
                   encode_prompt(self.tokenizer, self.dataset.render(prompt, self.tokenizer)))
            if not ids:
                raise ValueError(f"prompt {prompt.index} tokenizes to nothing")
            if len(ids) > self.max_prompt_tokens:
                raise ValueError(f"prompt {prompt.index} has {len(ids)} tokens, more than data.max_prompt_tokens="
                                 f"{self.max_prompt_tokens}; raise it or filter the dataset")
            items.append(PromptItem(ids, prompt.answer))
        return items

    def state_dict(self) -> dict[str, Any]:
        return self.loader.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.loader.load_state_dict(state)


def reward_pool_config(config: RunConfig) -> RewardPoolConfig:
    """The run's reward pool: the pool's default worker count, the config's bound on a reward's magnitude."""
    return RewardPoolConfig(max_abs_reward=config.reward.max_abs)


def configure_run_threads(config: RunConfig) -> int:
    """Set and return torch's CPU threads for the run (:func:`jetrl.threads.configure_threads` of
    ``trainer.num_threads`` beside the run's reward workers); :func:`run_settings` calls it when a job starts."""
    return configure_threads(config.trainer.num_threads, reward_pool_config(config).num_workers)


# the settings of the job in force in this context: (what they were made of, the thread count chosen, the kernel
# tuning object the job's override put in force)
_JOB_SETTINGS: contextvars.ContextVar[tuple[tuple, int, Any] | None] = contextvars.ContextVar("jetrl_run_settings",
                                                                                             default=None)


@contextlib.contextmanager
def run_settings(config: RunConfig) -> Iterator[int]:
    """The run's process settings for the enclosed block, entered once per job; yields the thread count.

    Torch's CPU threads (:func:`configure_run_threads`) and the run's kernel settings (``kernels:``, through
    :func:`jetrl.quant.kernels.tuning.override`). A job that computes with the config around :func:`run` (``jetrl
    train``'s held-out evaluations, :func:`jetrl.train_job.train_and_evaluate`) enters it around all of that work;
    :func:`run` enters it too, which inside a job with the same settings does nothing (no second thread setup; no
    second override while the job's is the one in force), and alone (a script, a test, a rank of torchrun) applies
    them."""
    from jetrl.quant.kernels import tuning

    settings = config.kernel_settings
    key = (config.trainer.num_threads, reward_pool_config(config).num_workers, tuple(sorted(settings.items())))
    active = _JOB_SETTINGS.get()
    if active is not None and active[0] == key:
        # the caller changed the kernels inside the job: the run's settings win, as they would alone
        with contextlib.nullcontext() if tuning.current() is active[2] else tuning.override(**settings):
            yield active[1]
        return
    threads = configure_run_threads(config)
    with tuning.override(**settings) as in_force:  # the rollout's, the trainer's and the evaluations'
        token = _JOB_SETTINGS.set((key, threads, in_force))
        try:
            yield threads
        finally:
            _JOB_SETTINGS.reset(token)


def run(config: RunConfig | str | Path, overrides: Sequence[str] = (),
        on_step: Callable[[int, dict[str, float]], None] | None = None,
        require_checkpoint: bool = False, data: RunPrompts | None = None) -> dict[str, float]:
    """Run RL as configured; returns the last step's metrics. ``config`` may be a file path.
    ``on_step(step, metrics)`` is called after every step on rank 0 (the command line's progress bar).
    Under torchrun every rank calls this (see the module doc). With ``trainer.resume`` and no checkpoint to
    resume from, the run warns and starts from step 0, unless ``require_checkpoint``, which makes that a
    FileNotFoundError. ``data``: the prompts :func:`jetrl.data.check_run_prompts` read and tokenized for this
    config, used as they are, with its tokenizer; None reads the data section's prompts and loads the tokenizer
    here."""
    if not isinstance(config, RunConfig):
        config = load_config(config, overrides)
    elif overrides:
        raise ValueError("overrides apply to a config file; pass a path, or change the RunConfig directly")
    config.check_complete()
    resolve_device(config.model.device)  # a clear error for a device this machine lacks, before any rank starts
    with run_settings(config):  # threads and kernels: the caller's job's, else this run's own
        parallel = init_parallel(config.model.device, config.distributed.shard_size, config.distributed.timeout_s)
        try:
            with parallel.guard():
                return _run(config, parallel, on_step, require_checkpoint, data)
        finally:
            parallel.close()


def _run(config: RunConfig, parallel: Any, on_step: Callable[[int, dict[str, float]], None] | None,
         require_checkpoint: bool, data: RunPrompts | None = None) -> dict[str, float]:
    out = Path(config.trainer.output_dir)
    if parallel.is_main:
        prepare_output_dir(config)
    parallel.barrier()  # every rank sees the folder checked and created
    ckpt_root = out / CHECKPOINT_SUBDIR
    if config.trainer.resume:
        check_resumable(ckpt_root, require_checkpoint, warn=parallel.is_main)

    seed_everything(config.trainer.seed)
    # data errors before the model is loaded
    dataset = data.dataset if data is not None else build_prompt_dataset(config.data, seed=config.trainer.seed)
    if len(dataset) < config.data.prompts_per_step:
        raise ConfigError(f"data.prompts_per_step ({config.data.prompts_per_step}) is larger than the dataset "
                          f"({len(dataset)} prompts); lower it or use more data")
    reward = build_reward_fn(RewardConfig(name=config.data.reward), default=dataset.reward)
    folder, _, tokenizer = check_model(config, data.tokenizer if data is not None else None)
    if parallel.is_main:
        save_config(config, out / "config.yaml")
    model = load_model(folder, dtype=getattr(torch, config.model.dtype), device=parallel.device, recipe=config.recipe)
    if config.model.gradient_checkpointing:
        model.set_activation_checkpointing(True, blocks=config.model.checkpoint_blocks)
    prompts = DatasetPrompts(dataset, tokenizer, config.data.prompts_per_step, config.trainer.seed,
                             config.data.shuffle, config.data.max_prompt_tokens,
                             token_ids=data.token_ids if data is not None else None)
    # the KV pool is sized for the longest sequence a rollout can make, not the model's full context
    engine = RolloutEngine(model, tokenizer, progress=config.rollout.progress and parallel.is_main,
                           max_num_seqs=min(256, config.rollout_batch_size),
                           max_model_len=config.data.max_prompt_tokens + config.rollout.max_tokens,
                           memory_budget=config.rollout.memory_budget, exact=config.exact,
                           kv_fp8=config.kv_fp8, decode_steps=config.rollout.decode_steps)
    pool = RewardPool(reward, reward_pool_config(config))
    guard = RewardFailureGuard(stop_fraction=config.reward.stop_fraction)
    trainer = Trainer(config, model, engine, prompts, guarded_rewards(pool, guard, parallel), prompts.decode,
                      parallel=parallel)
    cursor = None
    if config.trainer.resume:
        state = resume_trainer(trainer, ckpt_root, allow_pickle=config.trainer.allow_pickle)
        if state is None and require_checkpoint:  # the quick check passed, the checksums did not
            raise FileNotFoundError(f"nothing to resume: no checkpoint in {ckpt_root} matches its recorded SHA-256s")
        cursor = state.get("metrics_cursor") if state else None
    logger = MetricsLogger(out, tensorboard=config.trainer.tensorboard, resume_cursor=cursor) \
        if parallel.is_main else None
    metrics: dict[str, float] = {}
    try:
        while trainer.step_count < config.trainer.steps:
            start = time.perf_counter()
            metrics = trainer.step()
            metrics["time/step_wall"] = time.perf_counter() - start
            step = trainer.step_count
            if logger is not None and (step % config.trainer.log_every == 0 or step == config.trainer.steps):
                logger.log(step, metrics)
            if on_step is not None and parallel.is_main:
                on_step(step, metrics)
            if checkpoint_due(step, config.trainer):
                save_trainer_checkpoint(trainer, ckpt_root, logger.jsonl.cursor() if logger is not None else None,
                                        keep_last=config.trainer.keep_last, export_fp8=config.trainer.export_fp8,
                                        weights_only=weights_only_at(step, config.trainer),
                                        on_disk_full=config.trainer.on_disk_full)
    finally:
        if logger is not None:
            logger.close()
        pool.close()
    return metrics


__all__ = ["run", "run_settings", "configure_run_threads", "reward_pool_config", "DatasetPrompts", "seed_everything",
           "guarded_rewards", "prepare_output_dir", "check_model", "RUN_OUTPUTS", "EVAL_FILE", "PLOT_FILE"]
