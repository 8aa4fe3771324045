"""Sharded checkpoints (DCP) resume at another number of ranks: 2 -> 1 and 1 -> 2."""

import torch

from launch import run_ranks
from toy_run import assert_metrics_close, full_params, make_trainer

# two optimizer steps per RL step: each rank takes its share of the same mini-batches at either world size
OVERRIDES = ["--algorithm.mini_batch_size=4", "--algorithm.micro_batch_size=2"]


def _run(rank, root, resume, num_steps, save):
    """Optionally resume from ``root``, run ``num_steps`` steps, optionally checkpoint into ``root``."""
    from jetrl.parallel import init_parallel
    from jetrl.train.policy import resume_trainer, save_trainer_checkpoint

    trainer = make_trainer("bf16", OVERRIDES, init_parallel("cpu"))
    if resume:
        assert resume_trainer(trainer, root)["step"] == 1
    metrics = [trainer.step() for _ in range(num_steps)]
    if save:
        save_trainer_checkpoint(trainer, root, metrics_cursor=None)
    return metrics, full_params(trainer.model)


def _uninterrupted():
    trainer = make_trainer("bf16", OVERRIDES)
    return [trainer.step() for _ in range(2)]


def test_save_on_two_ranks_resume_on_one(tmp_path):
    from safetensors.torch import load_file

    saved = run_ranks(_run, 2, tmp_path, False, 1, True)
    folder = tmp_path / "step_00000001"
    assert (folder / "COMPLETE.json").is_file() and (folder / "sharded" / ".metadata").is_file()
    hf = load_file(str(folder / "model" / "model.safetensors"))  # the HF export: the gathered full weights
    assert all(torch.equal(hf[name], value) for name, value in saved[0][1].items() if name in hf)
    resumed, _ = _run(0, tmp_path, True, 1, False)
    assert_metrics_close(_uninterrupted()[1], resumed[0])


def test_save_on_one_process_resume_on_two_ranks(tmp_path):
    _run(0, tmp_path, False, 1, True)
    resumed = run_ranks(_run, 2, tmp_path, True, 1, False)
    reference = _uninterrupted()[1]
    for metrics, _ in resumed:
        assert_metrics_close(reference, metrics[0])
