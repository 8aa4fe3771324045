"""Checkpoints and disk space: the size estimate, too little space (an error or a skip), a write that fails
midway (nothing partial left, the previous checkpoint kept), and weights-only checkpoints."""

import resource
import shutil
import signal
from pathlib import Path

import pytest
import torch

from jetrl.config import ConfigError, load_config
from jetrl.train.checkpoint import latest_checkpoint, list_checkpoints, verify_checkpoint
from jetrl.train.policy import (
    CheckpointSpaceError, CheckpointWriteError, checkpoint_size, resume_trainer, save_trainer_checkpoint,
)
from toy_rl import MODEL, ToyPrompts, decode, low_token_reward


def _trainer(dtype=torch.float32):
    from jetrl.models import DecoderConfig, build_model
    from jetrl.rl.trainer import Trainer
    from jetrl.rollout import RolloutEngine

    cfg = load_config(None, ["--recipe=bf16", "--data.prompts_per_step=2", "--rollout.n=2", "--rollout.max_tokens=4",
                                  "--algorithm.micro_batch_size=4"])
    model = build_model(DecoderConfig(**MODEL), dtype=dtype, recipe="bf16", seed=0)
    engine = RolloutEngine(model, max_num_seqs=8, num_blocks=32, block_size=4, progress=False)
    trainer = Trainer(cfg, model, engine, ToyPrompts(2), low_token_reward, decode)
    trainer.step()  # the optimizer has its state
    return trainer


def _bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


@pytest.mark.parametrize("dtype,per_param", [(torch.float32, 16), (torch.bfloat16, 16)])
def test_the_size_estimate_bounds_what_is_written(tmp_path, dtype, per_param):
    trainer = _trainer(dtype)
    numel = sum(p.numel() for p in trainer.model.parameters())
    for weights_only in (False, True):
        path = save_trainer_checkpoint(trainer, tmp_path / str(weights_only), None, weights_only=weights_only)
        written, estimate = _bytes(path), checkpoint_size(trainer, weights_only=weights_only)
        assert written <= estimate <= 1.05 * written + (16 << 20), (written, estimate)
        # the README's sizes per parameter: 16 bytes in full, the parameter's own bytes for the weights alone
        expected = dtype.itemsize if weights_only else per_param
        assert expected <= written / numel < expected * 1.05, written / numel


def _full_disk(free):
    return lambda path: shutil._ntuple_diskusage(10 * free + 1, 9 * free + 1, free)  # (total, used, free)


def test_too_little_space_is_one_clear_error_or_a_warning(tmp_path, monkeypatch):
    trainer = _trainer()
    needed = checkpoint_size(trainer)
    stale = tmp_path / ".tmp-step_00000007-123"  # left by a killed save: removed before the space is measured
    stale.mkdir()
    monkeypatch.setattr(shutil, "disk_usage", _full_disk(needed - 1))
    with pytest.raises(CheckpointSpaceError) as info:
        save_trainer_checkpoint(trainer, tmp_path, None)
    message = str(info.value)
    assert isinstance(info.value, OSError) and "\n" not in message  # the command line prints it as one line
    assert f"checkpoint step 1 needs about {needed / 1e6:.1f} MB in {tmp_path}" in message
    assert "trainer.on_disk_full=skip" in message and "trainer.weights_only" in message
    assert list_checkpoints(tmp_path) == [] and not stale.exists()
    with pytest.warns(RuntimeWarning, match="not written; the run goes on"):
        assert save_trainer_checkpoint(trainer, tmp_path, None, on_disk_full="skip") is None
    assert list(tmp_path.iterdir()) == []
    monkeypatch.setattr(shutil, "disk_usage", _full_disk(needed))
    assert verify_checkpoint(save_trainer_checkpoint(trainer, tmp_path, None)) is None
    with pytest.raises(ConfigError, match="trainer.on_disk_full must be one of"):
        load_config(None, ["--trainer.on_disk_full=ignore"])
    with pytest.raises(ValueError, match="on_disk_full must be one of"):  # a typo is no silent "error"
        save_trainer_checkpoint(trainer, tmp_path, None, on_disk_full="skpi")


def test_a_write_that_fails_midway_keeps_the_previous_checkpoint(tmp_path):
    """A real failed write: the file size limit (RLIMIT_FSIZE) makes the OS refuse the large files of the second
    checkpoint partway, as a full disk would."""
    trainer = _trainer()
    first = save_trainer_checkpoint(trainer, tmp_path, None)
    trainer.step()
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a failed write, not a killed process
    resource.setrlimit(resource.RLIMIT_FSIZE, (64 << 10, hard))
    try:
        with pytest.raises(CheckpointWriteError) as info:
            save_trainer_checkpoint(trainer, tmp_path, None, keep_last=1)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, handler)
    message = str(info.value)
    assert "\n" not in message and f"checkpoint step 2 could not be written in {tmp_path}" in message
    assert f"the previous checkpoint {first} is kept" in message
    assert sorted(p.name for p in tmp_path.iterdir()) == [first.name]  # no step_00000002, no temporary folder
    assert latest_checkpoint(tmp_path) == first and verify_checkpoint(first, checksums=True) is None


def test_weights_only_checkpoints_hold_the_policy_and_are_not_resumed(tmp_path):
    from jetrl.models.checkpoint import load_weights

    trainer = _trainer()
    path = save_trainer_checkpoint(trainer, tmp_path, None, weights_only=True)
    assert (path / "model").is_dir() and not (path / "sharded").exists() and not (path / "scheduler.pt").exists()
    fresh = _trainer()
    load_weights(fresh.model, str(path / "model"))
    assert all(torch.equal(a, b) for a, b in zip(trainer.model.parameters(), fresh.model.parameters()))
    with pytest.raises(ValueError, match="holds the policy only .* without the optimizer state"):
        resume_trainer(fresh, tmp_path)
    with pytest.raises(ConfigError, match="trainer.weights_only must be one of"):
        load_config(None, ["--trainer.weights_only=yes"])


def test_which_steps_checkpoint_and_which_hold_the_policy_alone():
    from jetrl.config import TrainerConfig
    from jetrl.train.policy import checkpoint_due, weights_only_at

    every3 = TrainerConfig(steps=7, checkpoint_every=3, weights_only="final")
    assert [s for s in range(1, 8) if checkpoint_due(s, every3)] == [3, 6, 7]  # and after the last
    assert [weights_only_at(s, every3) for s in (3, 6, 7)] == [False, False, True]
    final_only = TrainerConfig(steps=4, checkpoint_every=0, weights_only="all")
    assert [s for s in range(1, 5) if checkpoint_due(s, final_only)] == [4]
    assert weights_only_at(4, final_only) and not weights_only_at(4, TrainerConfig(steps=4))


def test_resuming_from_nothing_warns_or_fails(tmp_path):
    from jetrl.train.policy import check_resumable

    with pytest.warns(RuntimeWarning, match="nothing to resume"):
        assert check_resumable(tmp_path, require_checkpoint=False) is False
    with pytest.raises(FileNotFoundError, match="nothing to resume"):
        check_resumable(tmp_path, require_checkpoint=True)
