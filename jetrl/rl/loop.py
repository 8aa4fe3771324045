"""The RL run, top to bottom: config -> model, data, engine, trainer -> steps, metrics, checkpoints.

``run(config)`` is what ``jetrl train`` calls. The config is fully validated (including the data source)
before the model is loaded. With ``trainer.resume`` the run continues from the latest complete
checkpoint in ``trainer.output_dir``: model, optimizer, scheduler, RNG states, data position and the
metrics log (truncated to the checkpoint's cursor) are restored, so a run killed at any moment loses
only the steps since its last checkpoint and then reproduces them. Resume verifies every file of the
checkpoint against the SHA-256 its marker recorded; a damaged checkpoint is skipped with a warning and
the previous complete one is used. Before each checkpoint its size is compared with the free disk space
(too little: an error naming both, or with ``trainer.on_disk_full: skip`` a warning and no checkpoint); a
write that fails anyway leaves nothing behind but the previous checkpoint (:func:`save_trainer_checkpoint`).
``trainer.weights_only`` saves the final checkpoint, or all of them, as the policy alone.

A sample whose reward fails (raises, hangs, returns a non-number, a non-finite value or one beyond the
reward pool's ``max_abs_reward``) scores 0.0 and is counted per step in ``reward/errors`` and
``reward/timeouts``; the first failure's message is printed once, and the run stops with
:class:`~jetrl.data.reward_pool.RewardFailureError` when at least ``reward.stop_fraction`` of a step's
samples failed (default 1.0: every one; see :class:`~jetrl.data.reward_pool.RewardFailureGuard`). The
bound is ``reward.max_abs``.

The output folder belongs to one run: :func:`prepare_output_dir` refuses a fresh run into a folder that
holds another run's checkpoints (resume it, choose another folder, or ``overwrite``, which deletes that
run's checkpoints and logs first). Resume with nothing to resume starts from step 0 with a warning, or
fails with ``require_checkpoint``. Before the model is loaded, the generation length is checked against
the model's context (``max_position_embeddings``) and the tokenizer against the model's vocabulary and
special tokens.

**Several GPUs.** ``torchrun --nproc-per-node N -m jetrl train CONFIG`` starts N copies of this run;
:func:`jetrl.parallel.init_parallel` makes each a rank (one process without torchrun is the one-rank
case). Every rank builds the model and data the same way; the trainer shards the model and splits each
step's prompts. Rank 0 alone saves the config, prints progress and writes metrics (which are global);
checkpoints are written by all ranks together (model and optimizer sharded through DCP, see
:func:`save_trainer_checkpoint`) and resume at any number of ranks. A rank that fails logs its error
with its rank and aborts the process group, so the whole job exits instead of hanging.
"""

from __future__ import annotations

import json
import random
import shutil
import time
import warnings
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np
import torch

from jetrl.config import ConfigError, RunConfig, load_config, save_config
from jetrl.config.schema import ON_DISK_FULL
from jetrl.data import build_prompt_dataset
from jetrl.data.reward_pool import RewardFailureGuard, RewardPool, RewardPoolConfig, RewardResult
from jetrl.models import check_tokenizer, resolve_checkpoint, resolve_device
from jetrl.models.config import DecoderConfig
from jetrl.parallel import SHARDED_SUBDIR, full_weights, init_parallel, is_sharded, load_sharded, save_sharded
from jetrl.train.checkpoint import (
    checkpoint_dir_name, latest_checkpoint, list_checkpoints, load_checkpoint, remove_stale_temporaries, save_checkpoint,
)
from jetrl.rl.metrics import METRICS_FILE, TENSORBOARD_SUBDIR, MetricsLogger
from jetrl.rl.trainer import PromptItem, Trainer
from jetrl.threads import configure_threads

CHECKPOINT_SUBDIR = "checkpoints"
MODEL_SUBDIR = "model"  # the HuggingFace-format model inside each checkpoint
FP8_MODEL_SUBDIR = "model_fp8"  # with trainer.export_fp8: the block-FP8 export of the same weights
EVAL_FILE = "eval.json"  # ``jetrl train``'s held-out accuracy before and after (jetrl.train_job)
PLOT_FILE = "curves.png"  # ``jetrl train``'s plot of the run's curves (jetrl.train_job)
# what a run writes into its output folder besides config.yaml (``overwrite`` deletes them)
RUN_OUTPUTS = (CHECKPOINT_SUBDIR, METRICS_FILE, TENSORBOARD_SUBDIR, EVAL_FILE, PLOT_FILE)


def seed_everything(seed: int) -> None:
    """Seed python's, numpy's and torch's global RNGs (the rollout and the update use their own seeds)."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def _parameter_names(model: torch.nn.Module) -> dict[int, str]:
    return {id(p): name for name, p in model.named_parameters()}


def _write_model_state(trainer: Trainer, folder: Path, hf_format: bool, export_fp8: bool, weights_only: bool) -> None:
    """Every rank, together: the sharded model + optimizer state (DCP; not for ``weights_only``), then the
    HuggingFace exports, written by rank 0 from the gathered full weights."""
    if not weights_only:
        save_sharded(folder / SHARDED_SUBDIR, trainer.model,
                     trainer.optimizer.state_by_name(_parameter_names(trainer.model)))
    if hf_format or export_fp8:
        from jetrl.models import save_model as save_hf

        with full_weights(trainer.model):
            if trainer.parallel.is_main:
                if hf_format:
                    save_hf(trainer.model, folder / MODEL_SUBDIR)
                if export_fp8:
                    save_hf(trainer.model, folder / FP8_MODEL_SUBDIR, fp8=True)


class CheckpointSpaceError(OSError):
    """The disk holding the checkpoints has less free space than the next checkpoint needs."""


class CheckpointWriteError(OSError):
    """Writing a checkpoint failed; nothing of it was kept, and the previous complete one is still there."""


def _nbytes(tensors: Any) -> int:
    """Bytes of the tensors in a (nested dict of) tensor(s), at their global shape (a DTensor counts whole)."""
    if isinstance(tensors, dict):
        return sum(_nbytes(v) for v in tensors.values())
    return tensors.numel() * tensors.element_size()


def checkpoint_size(trainer: Trainer, hf_format: bool = True, export_fp8: bool = False,
                    weights_only: bool = False) -> int:
    """An upper estimate of the bytes :func:`save_trainer_checkpoint` writes for ``trainer`` (over all ranks).

    Per parameter of ``b`` bytes (4 fp32, 2 bf16): the sharded weights ``b``, the AdamW state (two fp32
    moments, plus an fp32 master copy for 16-bit parameters) 8 or 12, the HuggingFace export ``b``, and with
    ``export_fp8`` the block-FP8 export, counted as ``b`` (it takes about 1). ``weights_only``: the exports
    alone. Then 2 % and 16 MiB for the metadata, tokenizer files and the small state files."""
    model = trainer.model
    weights = sum(_nbytes(p) for p in model.parameters()) + sum(_nbytes(b) for b in model.buffers())
    total = weights * (int(hf_format or weights_only) + int(export_fp8))
    if not weights_only:
        total += weights + _nbytes(trainer.optimizer.state_by_name(_parameter_names(model)))
    return int(total * 1.02) + (16 << 20)


def _free_bytes(folder: Path) -> int:
    """Free bytes on the file system of ``folder`` (or of its nearest existing parent)."""
    existing = next(p for p in (folder, *folder.parents) if p.exists())
    return shutil.disk_usage(existing).free


def _size_text(num_bytes: float) -> str:
    return f"{num_bytes / 1e9:.2f} GB" if num_bytes >= 1e8 else f"{num_bytes / 1e6:.1f} MB"


def save_trainer_checkpoint(trainer: Trainer, root: str | Path, metrics_cursor: int | None,
                            keep_last: int | None = None, hf_format: bool = True, export_fp8: bool = False,
                            weights_only: bool = False, on_disk_full: str = "error") -> Path | None:
    """Checkpoint everything a resume needs (see :mod:`jetrl.train.checkpoint`); called by every rank. Returns
    the checkpoint's folder, or None when it was skipped for lack of space.

    The model and optimizer tensors go through ``torch.distributed.checkpoint`` into ``sharded/`` (each
    rank writes its slices; any number of ranks can load them). ``hf_format`` also writes the model as a
    HuggingFace folder (``model/``) and ``export_fp8`` as a block-FP8 one (``model_fp8/``, the layout vLLM
    and SGLang load, holding exactly the FP8 weights the rollout engine used), from rank 0.
    ``weights_only``: the policy alone (``model/`` and with ``export_fp8`` ``model_fp8/``), without the
    sharded weights, the optimizer and the scheduler: not resumable (:func:`resume_trainer` says so).

    Disk space: first, stale temporary folders of failed saves are removed, and the checkpoint's size
    (:func:`checkpoint_size`) is compared with the free space of ``root``'s disk (the previous checkpoints
    are pruned only after the new one is complete, so it needs its whole size). Too little is a
    :class:`CheckpointSpaceError` naming both, or with ``on_disk_full="skip"`` a warning, and nothing is
    written. A write that fails anyway (a full disk, an I/O error) is a :class:`CheckpointWriteError`:
    the temporary folder is gone, no ``step_*`` folder appeared, and the previous complete checkpoint is
    what a resume picks.

    Rank 0 runs the atomic protocol (temporary folder, marker, rename) and tells the other ranks the
    folder to write into; nobody returns before the checkpoint is complete."""
    if on_disk_full not in ON_DISK_FULL:
        raise ValueError(f"on_disk_full must be one of {list(ON_DISK_FULL)}, got {on_disk_full!r}")
    par, root, step = trainer.parallel, Path(root), trainer.step_count
    problem = None
    if par.is_main:
        remove_stale_temporaries(root)
        needed, free = checkpoint_size(trainer, hf_format, export_fp8, weights_only), _free_bytes(root)
        if free < needed:
            problem = (f"checkpoint step {step} needs about {_size_text(needed)} in {root}, which has "
                       f"{_size_text(free)} free")
    problem = par.broadcast_object(problem)
    if problem is not None:
        if on_disk_full == "skip":
            warnings.warn(f"{problem}: not written; the run goes on (trainer.on_disk_full=skip)", RuntimeWarning,
                          stacklevel=2)
            return None
        raise CheckpointSpaceError(f"{problem}: free some space, keep fewer checkpoints (trainer.keep_last), save "
                                   f"the policy only (trainer.weights_only=final or all), or go on without "
                                   f"checkpoints that do not fit (trainer.on_disk_full=skip)")
    try:
        if not par.is_main:
            folder = Path(par.broadcast_object(None))
            _write_model_state(trainer, folder, hf_format, export_fp8, weights_only)
            par.barrier()  # rank 0 finishes the marker and the rename
            return root / checkpoint_dir_name(step)
        state = {**trainer.state_dict(), "metrics_cursor": metrics_cursor, "weights_only": weights_only}

        def save_model(folder: Path) -> None:
            par.broadcast_object(str(folder))
            _write_model_state(trainer, folder, hf_format, export_fp8, weights_only)

        path = save_checkpoint(root, step, save_model=save_model,
                               scheduler=None if weights_only else trainer.scheduler, trainer_state=state,
                               keep_last=keep_last)
    except Exception as e:
        cause = next((line for line in str(e).splitlines() if line.strip()), type(e).__name__)
        previous = latest_checkpoint(root, checksums=False) if par.is_main else None
        kept = f"the previous checkpoint {previous} is kept" if previous else "there is no earlier checkpoint"
        raise CheckpointWriteError(f"checkpoint step {step} could not be written in {root} ({type(e).__name__}: "
                                   f"{cause[:300]}; {_size_text(_free_bytes(root))} free): nothing of it was "
                                   f"kept, {kept}") from e
    par.barrier()
    return path


def resume_trainer(trainer: Trainer, root: str | Path, allow_pickle: bool = False) -> dict[str, Any] | None:
    """Restore ``trainer`` from the latest complete checkpoint under ``root`` whose files match their
    recorded SHA-256 (newer damaged ones are skipped with a warning); returns its trainer state (with
    ``metrics_cursor``), or None when there is no checkpoint. Called by every rank; the checkpoint may come
    from any number of ranks. ``allow_pickle``: see :func:`jetrl.train.checkpoint.load_checkpoint` (only for
    trusted checkpoints of older jetrl versions)."""
    path = latest_checkpoint(root, checksums=True)
    if path is None:
        return None
    if json.loads((path / "trainer_state.json").read_text()).get("weights_only"):
        raise ValueError(f"{path} holds the policy only (trainer.weights_only), without the optimizer state a "
                         f"resume needs: start a new run from its {MODEL_SUBDIR}/ folder (model.path), or delete it "
                         f"to resume from an earlier full checkpoint")
    if (path / SHARDED_SUBDIR).is_dir():
        load_sharded(path / SHARDED_SUBDIR, trainer.model,
                     trainer.optimizer.state_by_name(_parameter_names(trainer.model)))
        trainer.optimizer.sync_params_from_masters()
        loaded = load_checkpoint(path, scheduler=trainer.scheduler, checksums=False, allow_pickle=allow_pickle)
        for group, lr in zip(trainer.optimizer.param_groups, trainer.scheduler.get_last_lr()):
            group["lr"] = lr  # the scheduler's state holds the last LR; the groups are not in the checkpoint
    else:  # written before sharded checkpoints: a HuggingFace model or model.safetensors + optimizer.pt
        if is_sharded(trainer.model):
            raise ValueError(f"{path} predates sharded checkpoints; resume it with one process (then it is "
                             f"saved in the sharded format that any number of ranks can load)")
        load_model = None
        if (path / MODEL_SUBDIR).is_dir():
            from jetrl.models.checkpoint import load_weights

            def load_model(folder: Path) -> None:
                load_weights(trainer.model, str(folder / MODEL_SUBDIR))
        loaded = load_checkpoint(path, model=None if load_model else trainer.model, load_model=load_model,
                                 optimizer=trainer.optimizer, scheduler=trainer.scheduler,
                                 checksums=False,  # just verified by latest_checkpoint: one read of the files
                                 allow_pickle=allow_pickle)
    trainer.load_state_dict(loaded.trainer_state)
    from jetrl.quant import refresh_fp8_weights
    refresh_fp8_weights(trainer.model)
    return loaded.trainer_state


def prepare_output_dir(config: RunConfig, overwrite: bool = False) -> Path:
    """Create ``trainer.output_dir`` and make sure this run may write there; returns it.

    A fresh run (no ``trainer.resume``) into a folder holding another run's checkpoints is refused with a
    FileExistsError: that run's higher-numbered checkpoints would outlive the new run's, pruning would
    delete the new ones, and the summary would report the old run. ``overwrite`` deletes the old run's
    outputs (:data:`RUN_OUTPUTS`) first. A path through a file is a ConfigError. Cheap: call it before
    any slow work so that a bad folder fails first."""
    out = Path(config.trainer.output_dir)
    blocker = next((p for p in (out, *out.parents) if p.exists() and not p.is_dir()), None)
    if blocker is not None:
        raise ConfigError(f"trainer.output_dir {out} cannot be created: {blocker} is a file")
    if overwrite and config.trainer.resume:
        raise ConfigError("overwrite deletes the run that resume would continue: choose one")
    ckpt_root = out / CHECKPOINT_SUBDIR
    if overwrite:
        for name in RUN_OUTPUTS:
            path = out / name
            if path.is_dir():
                shutil.rmtree(path)
            elif path.exists():
                path.unlink()
    elif not config.trainer.resume:
        found = list_checkpoints(ckpt_root)
        if found:
            raise FileExistsError(
                f"{out} holds the checkpoints of another run (up to step {found[-1][0]}): continue it with --resume "
                f"(trainer.resume=true), write the new run elsewhere with --output-dir (trainer.output_dir), or "
                f"delete the old run first with --overwrite")
    out.mkdir(parents=True, exist_ok=True)
    return out


def check_model(config: RunConfig) -> tuple[str, DecoderConfig, Any]:
    """Read the policy's config.json and tokenizer (not its weights) and check the run against them: the
    longest sequence (``data.max_prompt_tokens + rollout.max_tokens``) fits in the model's context, and the
    tokenizer matches the model (:func:`jetrl.models.check_tokenizer`), and ``model.checkpoint_blocks`` is at most
    its blocks. Returns (checkpoint folder, model config, tokenizer). A ``rollout.top_k`` above the vocabulary size
    is only a warning (it samples from all), shown once per process however often this is called."""
    from jetrl.models import load_tokenizer

    folder = resolve_checkpoint(config.model.path)
    model_config = DecoderConfig.from_file(folder)
    model_config.check_context(config.data.max_prompt_tokens + config.rollout.max_tokens,
                               "data.max_prompt_tokens + rollout.max_tokens")
    blocks = config.model.checkpoint_blocks
    if blocks is not None and blocks > model_config.num_hidden_layers:
        raise ConfigError(f"model.checkpoint_blocks ({blocks}) is more than the model's "
                          f"{model_config.num_hidden_layers} decoder blocks")
    where = config.model.tokenizer or folder
    tokenizer = load_tokenizer(where)
    check_tokenizer(tokenizer, model_config, where)
    if config.rollout.top_k > model_config.vocab_size:  # a UserWarning: shown once per process
        warnings.warn(f"rollout.top_k={config.rollout.top_k} is larger than the vocabulary ({model_config.vocab_size} "
                      f"tokens), so it keeps every token")
    return folder, model_config, tokenizer


def guarded_rewards(pool: RewardPool, guard: RewardFailureGuard) -> Callable[[list[str], list[str]], RewardResult]:
    """The trainer's reward function: ``pool`` scores the completions, ``guard`` reports the first failure
    once and stops the run when too many of the step's samples failed; the
    :class:`~jetrl.data.reward_pool.RewardResult` carries the failure counts into the step's metrics."""

    def reward_fn(texts: list[str], refs: list[str]) -> RewardResult:
        result = pool.score(texts, refs)
        guard.check(result)
        return result

    return reward_fn


class DatasetPrompts:
    """Adapts a ``jetrl.data`` prompt dataset to the trainer: renders and tokenizes each prompt."""

    def __init__(self, dataset: Any, tokenizer: Any, batch_size: int, seed: int, shuffle: bool,
                 max_prompt_tokens: int) -> None:
        from jetrl.data import BatchLoader

        self.dataset, self.tokenizer = dataset, tokenizer
        self.loader = BatchLoader(dataset, batch_size, seed=seed, shuffle=shuffle)
        self.max_prompt_tokens = max_prompt_tokens

    def decode(self, ids: list[int]) -> str:
        """Completion text for the reward function (special tokens such as the final EOS dropped)."""
        from jetrl.data import decode_completion

        return decode_completion(self.tokenizer, ids)

    def next_batch(self) -> list[PromptItem]:
        """The next ``batch_size`` prompts, rendered and tokenized; over-long prompts are an error."""
        from jetrl.data import encode_prompt

        items = []
        for prompt in self.loader.next_batch():
            ids = encode_prompt(self.tokenizer, self.dataset.render(prompt, self.tokenizer))
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
    """Set and return torch's CPU threads for the run: ``trainer.num_threads``, else ``OMP_NUM_THREADS`` as torch
    read it, else the default for this machine's cores beside the run's reward workers (see
    :func:`jetrl.threads.configure_threads`). :func:`run` calls it first; so does a caller that computes with
    the run's config before it (``jetrl train``'s evaluation before training)."""
    return configure_threads(config.trainer.num_threads, reward_pool_config(config).num_workers)


def run(config: RunConfig | str | Path, overrides: Sequence[str] = (),
        on_step: Callable[[int, dict[str, float]], None] | None = None,
        require_checkpoint: bool = False) -> dict[str, float]:
    """Run RL as configured; returns the last step's metrics. ``config`` may be a file path.
    ``on_step(step, metrics)`` is called after every step on rank 0 (the command line's progress bar).
    Under torchrun every rank calls this (see the module doc). With ``trainer.resume`` and no checkpoint to
    resume from, the run warns and starts from step 0, unless ``require_checkpoint``, which makes that a
    FileNotFoundError."""
    if not isinstance(config, RunConfig):
        config = load_config(config, overrides)
    elif overrides:
        raise ValueError("overrides apply to a config file; pass a path, or change the RunConfig directly")
    config.check_complete()
    resolve_device(config.model.device)  # a clear error for a device this machine lacks, before any rank starts
    configure_run_threads(config)
    parallel = init_parallel(config.model.device, config.distributed.shard_size, config.distributed.timeout_s)
    from jetrl.quant.kernels import tuning

    try:
        with parallel.guard(), tuning.override(**config.kernel_settings):  # the rollout's and the trainer's
            return _run(config, parallel, on_step, require_checkpoint)
    finally:
        parallel.close()


def _run(config: RunConfig, parallel: Any, on_step: Callable[[int, dict[str, float]], None] | None,
         require_checkpoint: bool) -> dict[str, float]:
    device = parallel.device
    out = Path(config.trainer.output_dir)
    if parallel.is_main:
        prepare_output_dir(config)
    parallel.barrier()  # every rank sees the folder checked and created
    ckpt_root = out / CHECKPOINT_SUBDIR
    if config.trainer.resume and not list_checkpoints(ckpt_root):
        if require_checkpoint:
            raise FileNotFoundError(f"nothing to resume: {ckpt_root} holds no checkpoint")
        if parallel.is_main:
            warnings.warn(f"nothing to resume in {ckpt_root}; starting from step 0", RuntimeWarning, stacklevel=2)

    from jetrl.data.rewards import RewardConfig, build_reward_fn
    from jetrl.models import load_model
    from jetrl.rollout import RolloutEngine

    seed_everything(config.trainer.seed)
    dataset = build_prompt_dataset(config.data, seed=config.trainer.seed)  # data errors before the model is loaded
    if len(dataset) < config.data.prompts_per_step:
        raise ConfigError(f"data.prompts_per_step ({config.data.prompts_per_step}) is larger than the dataset "
                          f"({len(dataset)} prompts); lower it or use more data")
    reward = build_reward_fn(RewardConfig(name=config.data.reward), default=getattr(dataset, "reward", None))
    folder, _, tokenizer = check_model(config)
    if parallel.is_main:
        save_config(config, out / "config.yaml")
    model = load_model(folder, dtype=getattr(torch, config.model.dtype), device=device, recipe=config.recipe)
    if config.model.gradient_checkpointing:
        model.set_activation_checkpointing(True, blocks=config.model.checkpoint_blocks)
    prompts = DatasetPrompts(dataset, tokenizer, config.data.prompts_per_step, config.trainer.seed,
                             config.data.shuffle, config.data.max_prompt_tokens)
    # the KV pool is sized for the longest sequence a rollout can make, not the model's full context
    engine = RolloutEngine(model, tokenizer, progress=config.rollout.progress and parallel.is_main,
                           max_num_seqs=min(256, config.rollout_batch_size),
                           max_model_len=config.data.max_prompt_tokens + config.rollout.max_tokens,
                           memory_budget=config.rollout.memory_budget, exact=config.exact,
                           kv_fp8=config.kv_fp8)
    pool = RewardPool(reward, reward_pool_config(config))
    guard = RewardFailureGuard(stop_fraction=config.reward.stop_fraction)
    trainer = Trainer(config, model, engine, prompts, guarded_rewards(pool, guard), prompts.decode, parallel=parallel)
    cursor = None
    if config.trainer.resume:
        state = resume_trainer(trainer, ckpt_root, allow_pickle=config.trainer.allow_pickle)
        cursor = state.get("metrics_cursor") if state else None
    # rank 0 writes the (global) metrics; the others only take part in the collectives
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
            every, final = config.trainer.checkpoint_every, step == config.trainer.steps
            if (every and step % every == 0) or final:
                weights_only = config.trainer.weights_only == "all" or (config.trainer.weights_only == "final" and final)
                save_trainer_checkpoint(trainer, ckpt_root, logger.cursor() if logger is not None else None,
                                        keep_last=config.trainer.keep_last, export_fp8=config.trainer.export_fp8,
                                        weights_only=weights_only, on_disk_full=config.trainer.on_disk_full)
    finally:
        if logger is not None:
            logger.close()
        pool.close()
    return metrics


__all__ = ["run", "configure_run_threads", "reward_pool_config", "save_trainer_checkpoint", "resume_trainer",
           "checkpoint_size", "CheckpointSpaceError", "CheckpointWriteError", "DatasetPrompts", "seed_everything",
           "guarded_rewards", "prepare_output_dir", "check_model", "RUN_OUTPUTS", "EVAL_FILE", "PLOT_FILE"]
