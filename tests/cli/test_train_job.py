"""``jetrl train`` as one job: the run's kernel settings (``kernels:``) and CPU threads are entered once around
the held-out evaluations and the RL run together, and :func:`jetrl.rl.loop.run` called alone applies them itself."""

import pytest

import jetrl.rl.loop as loop
import jetrl.train_job as train_job
from jetrl.asset_files import DEFAULT_CONFIG, resolve_asset
from jetrl.cli import main
from jetrl.config import load_config
from jetrl.quant.kernels import tuning

DEFAULT_SPLIT = tuning.current().exact_split_k
SPLIT = DEFAULT_SPLIT + 1  # a kernel setting the CPU path ignores, so the run is the same with it
TINY = ["--no-progress", "--max-steps", "1", "--data.prompts_per_step=4", "--rollout.n=2",
        "--algorithm.mini_batch_size=8", "--algorithm.micro_batch_size=8", f"--kernels=exact_split_k={SPLIT}"]


@pytest.fixture
def thread_setups(monkeypatch):
    """Each call of jetrl.threads.configure_threads by the RL loop's thread setup (the real one still runs)."""
    calls = []
    real = loop.configure_threads

    def spy(*args, **kwargs):
        calls.append(args)
        return real(*args, **kwargs)

    monkeypatch.setattr(loop, "configure_threads", spy)
    return calls


def test_jetrl_train_evaluates_and_trains_under_the_configs_kernels_with_one_thread_setup(
        tmp_path, monkeypatch, thread_setups):
    monkeypatch.chdir(tmp_path)
    seen = {}

    def held_out_accuracy(model_path, config, num_eval, progress=True):  # what the evaluation would compute under
        seen.setdefault("evaluations", []).append(tuning.current().exact_split_k)
        return 0.5

    real_seed = loop.seed_everything

    def seed_everything(seed):  # called by the run, after its setup
        seen["run"] = tuning.current().exact_split_k
        real_seed(seed)

    monkeypatch.setattr(train_job, "held_out_accuracy", held_out_accuracy)
    monkeypatch.setattr(loop, "seed_everything", seed_everything)
    assert main(["train", "--eval-examples", "2", *TINY]) == 0
    assert seen == {"evaluations": [SPLIT, SPLIT], "run": SPLIT}  # before, after, and the run between
    assert len(thread_setups) == 1  # once per job, not once more by the run
    assert tuning.current().exact_split_k == DEFAULT_SPLIT  # the job's settings end with it


def test_the_loop_alone_applies_the_settings_and_inside_a_job_leaves_them(tmp_path, monkeypatch, thread_setups):
    config = load_config(resolve_asset(DEFAULT_CONFIG), [f"--kernels=exact_split_k={SPLIT}",
                                                         f"--trainer.output_dir={tmp_path / 'run'}"])
    config.model.path = resolve_asset(config.model.path)
    seen = []
    monkeypatch.setattr(loop, "_run", lambda *args: seen.append(tuning.current().exact_split_k) or {})
    loop.run(config)  # a script's or a test's direct call
    assert seen == [SPLIT] and len(thread_setups) == 1
    assert tuning.current().exact_split_k == DEFAULT_SPLIT
    with loop.run_settings(config) as threads:
        assert tuning.current().exact_split_k == SPLIT and len(thread_setups) == 2
        loop.run(config)
        loop.run(config)
        assert len(thread_setups) == 2 and threads >= 1  # the job's setup stands
        with tuning.override(exact_split_k=SPLIT + 1):  # the caller's own kernels: the run's settings win, as alone
            loop.run(config)
    assert seen == [SPLIT] * 4 and len(thread_setups) == 2
    other = load_config(resolve_asset(DEFAULT_CONFIG), [f"--kernels=exact_split_k={SPLIT + 2}",
                                                        f"--trainer.output_dir={tmp_path / 'run'}"])
    other.model.path = config.model.path
    with loop.run_settings(config):
        loop.run(other)  # another run's settings inside the job: its own apply
    assert seen[-1] == SPLIT + 2 and len(thread_setups) == 4
