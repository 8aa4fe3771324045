"""``jetrl.rl.loop.run`` on two ranks (what ``torchrun -m jetrl train`` runs): rank 0 writes, checkpoints shard."""

import json

from launch import run_ranks


def _train(rank, out):
    from jetrl.asset_files import DEFAULT_CONFIG, EMBEDDED_MODEL, resolve_asset
    from jetrl.rl.loop import run

    return run(resolve_asset(DEFAULT_CONFIG), [
        f"--model.path={resolve_asset(EMBEDDED_MODEL)}", "--model.device=cpu", f"--trainer.output_dir={out}",
        "--trainer.steps=2", "--trainer.checkpoint_every=1", "--trainer.keep_last=2", "--data.prompts_per_step=4",
        "--rollout.n=2", "--rollout.max_tokens=8", "--algorithm.mini_batch_size=8", "--algorithm.micro_batch_size=4"])


def test_two_rank_run_logs_once_and_checkpoints_every_step(tmp_path):
    last = run_ranks(_train, 2, tmp_path)
    assert last[0]["reward/mean"] == last[1]["reward/mean"]  # the metrics are global on every rank
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2]  # rank 0 alone writes
    for step in (1, 2):
        folder = tmp_path / "checkpoints" / f"step_{step:08d}"
        assert (folder / "COMPLETE.json").is_file() and (folder / "sharded" / ".metadata").is_file()
        assert (folder / "model" / "config.json").is_file()
        assert json.loads((folder / "trainer_state.json").read_text())["data"]  # the data position
