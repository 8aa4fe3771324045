"""A run's checkpoint policy: which checkpoints it writes and keeps, whether one fits on the disk, which one it
resumes from, and whether a fresh run may write into an output folder.

Shared by every training loop that checkpoints a :class:`TrainerLike` (the RL trainer); the files themselves are
:mod:`jetrl.train.checkpoint`'s atomic, checksummed folders.
"""

from __future__ import annotations

import json
import shutil
import warnings
from pathlib import Path
from typing import Any, Protocol, Sequence

import torch

from jetrl.config import ConfigError, TrainerConfig
from jetrl.config.schema import ON_DISK_FULL
from jetrl.parallel import SHARDED_SUBDIR, full_weights, is_sharded, load_sharded, save_sharded
from jetrl.train.checkpoint import (CHECKPOINT_SUBDIR, checkpoint_dir_name, latest_checkpoint, list_checkpoints,
                                    load_checkpoint, remove_stale_temporaries, save_checkpoint, verify_checkpoint)
from jetrl.train.optim import MasterWeightAdamW

MODEL_SUBDIR = "model"  # the HuggingFace-format model inside each checkpoint
FP8_MODEL_SUBDIR = "model_fp8"  # with trainer.export_fp8: the block-FP8 export of the same weights


class TrainerLike(Protocol):
    """What the policy reads and restores of a trainer (:class:`jetrl.rl.trainer.Trainer` is one): its model,
    master-weight optimizer, LR scheduler, ranks (:class:`jetrl.parallel.ParallelContext`), step count and the state a
    resume needs beyond those."""

    model: torch.nn.Module
    optimizer: MasterWeightAdamW
    scheduler: Any
    parallel: Any
    step_count: int

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


def checkpoint_due(step: int, settings: TrainerConfig) -> bool:
    """Whether a checkpoint follows ``step``: every ``checkpoint_every`` steps (0: none between) and after the last."""
    every = settings.checkpoint_every
    return bool(every and step % every == 0) or step == settings.steps


def weights_only_at(step: int, settings: TrainerConfig) -> bool:
    """Whether the checkpoint after ``step`` holds the policy alone: ``weights_only`` ``all``, or ``final`` at the
    last step."""
    return settings.weights_only == "all" or (settings.weights_only == "final" and step == settings.steps)


def _optimizer_state(trainer: TrainerLike) -> dict[str, dict[str, torch.Tensor]]:
    """The optimizer's live tensors by parameter name (:meth:`~jetrl.train.optim.MasterWeightAdamW.state_by_name`)."""
    return trainer.optimizer.state_by_name({id(p): name for name, p in trainer.model.named_parameters()})


def _write_model_state(trainer: TrainerLike, folder: Path, export_fp8: bool, weights_only: bool) -> None:
    """Every rank, together: the sharded model + optimizer state (DCP; not for ``weights_only``), then the
    HuggingFace exports, written by rank 0 from the gathered full weights."""
    from jetrl.models import save_model as save_hf

    if not weights_only:
        save_sharded(folder / SHARDED_SUBDIR, trainer.model, _optimizer_state(trainer))
    with full_weights(trainer.model):
        if trainer.parallel.is_main:
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


def checkpoint_size(trainer: TrainerLike, export_fp8: bool = False, weights_only: bool = False) -> int:
    """An upper estimate of the bytes :func:`save_trainer_checkpoint` writes for ``trainer`` (over all ranks).

    Per parameter of ``b`` bytes (4 fp32, 2 bf16): the sharded weights ``b``, the AdamW state (two fp32
    moments, plus an fp32 master copy for 16-bit parameters) 8 or 12, the HuggingFace export ``b``, and with
    ``export_fp8`` the block-FP8 export, counted as ``b`` (it takes about 1). ``weights_only``: the exports
    alone. Then 2 % and 16 MiB for the metadata, tokenizer files and the small state files."""
    model = trainer.model
    weights = sum(_nbytes(p) for p in model.parameters()) + sum(_nbytes(b) for b in model.buffers())
    total = weights * (1 + int(export_fp8))
    if not weights_only:
        total += weights + _nbytes(_optimizer_state(trainer))
    return int(total * 1.02) + (16 << 20)


def _free_bytes(folder: Path) -> int:
    """Free bytes on the file system of ``folder`` (or of its nearest existing parent)."""
    existing = next(p for p in (folder, *folder.parents) if p.exists())
    return shutil.disk_usage(existing).free


def _size_text(num_bytes: float) -> str:
    return f"{num_bytes / 1e9:.2f} GB" if num_bytes >= 1e8 else f"{num_bytes / 1e6:.1f} MB"


def save_trainer_checkpoint(trainer: TrainerLike, root: str | Path, metrics_cursor: int | None,
                            keep_last: int | None = None, export_fp8: bool = False, weights_only: bool = False,
                            on_disk_full: str = "error") -> Path | None:
    """Checkpoint everything a resume needs (see :mod:`jetrl.train.checkpoint`); called by every rank. Returns
    the checkpoint's folder, or None when it was skipped for lack of space.

    The model and optimizer tensors go through ``torch.distributed.checkpoint`` into ``sharded/`` (each
    rank writes its slices; any number of ranks can load them). Rank 0 also writes the model as a
    HuggingFace folder (``model/``) and with ``export_fp8`` as a block-FP8 one (``model_fp8/``, the layout vLLM
    and SGLang load). ``weights_only``: those exports alone, not resumable.

    Disk space: stale temporary folders are removed and the checkpoint's size (:func:`checkpoint_size`, whole:
    older checkpoints are pruned only after it is complete) is compared with the free space. Too little is a
    :class:`CheckpointSpaceError`, or with ``on_disk_full="skip"`` a warning, and nothing is written. A write
    that fails anyway is a :class:`CheckpointWriteError`, leaving the previous complete checkpoint as it was.

    Rank 0 runs the atomic protocol and tells the other ranks the folder to write into; nobody returns
    before the checkpoint is complete."""
    if on_disk_full not in ON_DISK_FULL:
        raise ValueError(f"on_disk_full must be one of {list(ON_DISK_FULL)}, got {on_disk_full!r}")
    par, root, step = trainer.parallel, Path(root), trainer.step_count
    problem = None
    if par.is_main:
        remove_stale_temporaries(root)
        needed, free = checkpoint_size(trainer, export_fp8, weights_only), _free_bytes(root)
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
            _write_model_state(trainer, folder, export_fp8, weights_only)
            par.barrier()  # rank 0 finishes the marker and the rename
            return root / checkpoint_dir_name(step)
        state = {**trainer.state_dict(), "metrics_cursor": metrics_cursor, "weights_only": weights_only}

        def save_model(folder: Path) -> None:
            par.broadcast_object(str(folder))
            _write_model_state(trainer, folder, export_fp8, weights_only)

        path = save_checkpoint(root, step, save_model=save_model, scheduler=None if weights_only else trainer.scheduler,
                               trainer_state=state, keep_last=keep_last)
    except Exception as e:
        cause = next((line for line in str(e).splitlines() if line.strip()), type(e).__name__)
        previous = latest_checkpoint(root, checksums=False) if par.is_main else None
        kept = f"the previous checkpoint {previous} is kept" if previous else "there is no earlier checkpoint"
        raise CheckpointWriteError(f"checkpoint step {step} could not be written in {root} ({type(e).__name__}: "
                                   f"{cause[:300]}; {_size_text(_free_bytes(root))} free): nothing of it was "
                                   f"kept, {kept}") from e
    par.barrier()
    return path


def resume_trainer(trainer: TrainerLike, root: str | Path, allow_pickle: bool = False) -> dict[str, Any] | None:
    """Restore ``trainer`` from the latest complete checkpoint under ``root`` whose files match their
    recorded SHA-256 (newer damaged ones are skipped with a warning); returns its trainer state (with
    ``metrics_cursor``), or None when there is no checkpoint. Called by every rank; the checkpoint may come
    from any number of ranks. ``allow_pickle``: see :func:`jetrl.train.checkpoint.load_checkpoint` (only for
    trusted checkpoints of older jetrl versions)."""
    path = latest_checkpoint(root, checksums=True)
    if path is None:
        return None
    configured = _lr_schedule(trainer.scheduler)
    if json.loads((path / "trainer_state.json").read_text()).get("weights_only"):
        raise ValueError(f"{path} holds the policy only (trainer.weights_only), without the optimizer state a "
                         f"resume needs: start a new run from its {MODEL_SUBDIR}/ folder (model.path), or delete it "
                         f"to resume from an earlier full checkpoint")
    if (path / SHARDED_SUBDIR).is_dir():
        load_sharded(path / SHARDED_SUBDIR, trainer.model, _optimizer_state(trainer))
        trainer.optimizer.sync_params_from_masters()
        loaded = load_checkpoint(path, scheduler=trainer.scheduler, checksums=False, allow_pickle=allow_pickle)
        for group, lr in zip(trainer.optimizer.param_groups, trainer.scheduler.get_last_lr()):
            group["lr"] = lr  # the scheduler's state holds the last LR; the groups are not in the checkpoint
    else:  # written before sharded checkpoints: a HuggingFace model or model.safetensors + optimizer.pt
        if is_sharded(trainer.model):
            raise ValueError(f"{path} predates sharded checkpoints; resume it with one process (then it is "
                             f"saved in the sharded format that any number of ranks can load)")
        from jetrl.models.checkpoint import load_weights

        load_model = (lambda folder: load_weights(trainer.model, str(folder / MODEL_SUBDIR))) \
            if (path / MODEL_SUBDIR).is_dir() else None
        loaded = load_checkpoint(path, model=None if load_model else trainer.model, load_model=load_model,
                                 optimizer=trainer.optimizer, scheduler=trainer.scheduler, allow_pickle=allow_pickle,
                                 checksums=False)  # just verified by latest_checkpoint: one read of the files
    trainer.load_state_dict(loaded.trainer_state)
    restored = _lr_schedule(trainer.scheduler)
    changed = [f"{key} {restored[key]} (configured: {configured[key]})" for key in configured
               if restored.get(key) != configured[key]]
    if changed:
        warnings.warn(f"resuming from {path}: its LR schedule goes on, not this run's config: {', '.join(changed)}; "
                      f"for a new schedule start a new run from its {MODEL_SUBDIR}/ folder (model.path)",
                      RuntimeWarning, stacklevel=2)
    from jetrl.quant import refresh_fp8_weights
    refresh_fp8_weights(trainer.model)
    return loaded.trainer_state


def _lr_schedule(scheduler: Any) -> dict[str, Any]:
    """What a ``LambdaLR`` of :func:`~jetrl.train.optim.build_lr_scheduler` computes from: its schedule's fields
    (warm-up, total steps, shape, floor) and base LRs, which its ``state_dict`` carries into a checkpoint."""
    return {**vars(scheduler.lr_lambdas[0]), "base_lrs": list(scheduler.base_lrs)}


def has_checkpoint(ckpt_root: str | Path) -> bool:
    """Whether ``ckpt_root`` holds a complete checkpoint: its marker and files of their recorded sizes (a quick check,
    no SHA-256s), without a warning."""
    return any(verify_checkpoint(path, checksums=False) is None for _, path in list_checkpoints(ckpt_root))


def check_resumable(ckpt_root: str | Path, require_checkpoint: bool, warn: bool = True) -> bool:
    """For a run that resumes: whether ``ckpt_root`` holds a complete checkpoint (its marker and files of their
    recorded sizes: a quick check; :func:`resume_trainer` checks the SHA-256s). None there is a FileNotFoundError
    with ``require_checkpoint``, else (with ``warn``: rank 0) a warning that the run starts from step 0."""
    if has_checkpoint(ckpt_root):
        return True
    found = list_checkpoints(ckpt_root)
    if require_checkpoint:
        raise FileNotFoundError(f"nothing to resume: {ckpt_root} holds no checkpoint" if not found else
                                f"nothing to resume: every checkpoint in {ckpt_root} is incomplete or damaged "
                                f"({', '.join(path.name for _, path in found)})")
    if warn:
        warnings.warn(f"nothing to resume in {ckpt_root}; starting from step 0", RuntimeWarning, stacklevel=3)
    return False


def claim_output_dir(out: str | Path, *, resume: bool, overwrite: bool, outputs: Sequence[str]) -> Path:
    """Create the output folder ``out`` and make sure this run may write there; returns it.

    A fresh run (not ``resume``) into a folder holding another run's checkpoints (in :data:`CHECKPOINT_SUBDIR`) is
    refused with a FileExistsError: that run's higher-numbered checkpoints would outlive the new run's, pruning
    would delete the new ones, and the summary would report the old run. ``overwrite`` deletes the old run's
    ``outputs`` (names in ``out``) first. A path through a file is a ConfigError. Cheap: call it before any slow
    work so that a bad folder fails first."""
    out = Path(out)
    blocker = next((p for p in (out, *out.parents) if p.exists() and not p.is_dir()), None)
    if blocker is not None:
        raise ConfigError(f"trainer.output_dir {out} cannot be created: {blocker} is a file")
    if overwrite and resume:
        raise ConfigError("overwrite deletes the run that resume would continue: choose one")
    ckpt_root = out / CHECKPOINT_SUBDIR
    if overwrite:
        for name in outputs:
            path = out / name
            if path.is_dir():
                shutil.rmtree(path)
            elif path.exists():
                path.unlink()
    elif not resume:
        found = list_checkpoints(ckpt_root)
        if found:
            raise FileExistsError(
                f"{out} holds the checkpoints of another run (up to step {found[-1][0]}): continue it with --resume "
                f"(trainer.resume=true), write the new run elsewhere with --output-dir (trainer.output_dir), or "
                f"delete the old run first with --overwrite")
    out.mkdir(parents=True, exist_ok=True)
    return out


__all__ = ["CHECKPOINT_SUBDIR", "MODEL_SUBDIR", "FP8_MODEL_SUBDIR", "TrainerLike", "checkpoint_due",
           "weights_only_at", "checkpoint_size", "save_trainer_checkpoint", "resume_trainer", "check_resumable",
           "has_checkpoint", "claim_output_dir", "CheckpointSpaceError", "CheckpointWriteError"]
