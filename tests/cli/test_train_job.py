"""``jetrl train`` as one job: the run's kernel settings (``kernels:``) and CPU threads are entered once around
the held-out evaluations and the RL run together, and :func:`jetrl.rl.loop.run` called alone applies them itself."""

import json

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

    def held_out_accuracy(model_path, config, num_eval, progress=True, tokenizer=None):
        seen.setdefault("evaluations", []).append(tuning.current().exact_split_k)  # the kernel setting it runs under
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


def test_jetrl_train_on_a_file_reports_held_out_accuracy_on_data_eval_path(tmp_path, monkeypatch, capsys):
    """A run on a dataset file with a held-out file evaluates its first --eval-examples rows before and after
    training (the embedded model, arithmetic rows in the compact format); without one, --eval-examples is one
    error before any work."""
    import json

    from jetrl.data.tasks import get_task

    monkeypatch.chdir(tmp_path)

    def write(name, seed, n):
        problems = get_task("arithmetic", difficulty=3, seed=seed, style="compact").dataset(n)
        path = tmp_path / name
        path.write_text("".join(json.dumps({"prompt": p.text, "answer": p.answer}) + "\n" for p in problems))
        return path

    train, held_out = write("train.jsonl", 1, 16), write("test.jsonl", 2, 12)
    data = ["--data.task=none", f"--data.path={train}", "--data.reward=arithmetic"]
    assert main(["train", *data, f"--data.eval_path={held_out}", "--eval-examples", "6", "--output-dir", "run",
                 *TINY]) == 0
    report = json.loads((tmp_path / "run" / "eval.json").read_text())
    assert report["file"] == str(held_out) and report["num_examples"] == 6
    assert 0.0 <= report["greedy_accuracy_before"] <= 1.0 and 0.0 <= report["greedy_accuracy_after"] <= 1.0
    capsys.readouterr()
    assert main(["train", *data, "--eval-examples", "4", "--output-dir", "run2", *TINY]) != 0
    assert "held-out file (data.eval_path" in capsys.readouterr().err
    assert not (tmp_path / "run2").exists()  # refused before the output folder is made


def test_eval_path_errors_come_before_any_work(tmp_path, monkeypatch, capsys):
    """A held-out file without a training file, or one that does not exist, is one error before the output folder
    is made; --eval-examples 0 skips the evaluation and so the file."""
    monkeypatch.chdir(tmp_path)
    assert main(["train", "--data.task=none", f"--data.eval_path={tmp_path / 'test.jsonl'}", "--output-dir", "a",
                 *TINY]) != 0
    assert "set data.path too" in capsys.readouterr().err and not (tmp_path / "a").exists()
    assert main(["train", f"--data.eval_path={tmp_path / 'test.jsonl'}", "--output-dir", "a", *TINY]) != 0
    assert "is for a run on a file" in capsys.readouterr().err and not (tmp_path / "a").exists()  # a task run
    train = tmp_path / "train.jsonl"
    train.write_text("".join(json.dumps({"prompt": f"{i}+1\n", "answer": str(i + 1)}) + "\n" for i in range(8)))
    data = ["--data.task=none", f"--data.path={train}", "--data.reward=arithmetic", "--data.eval_path=missing.jsonl"]
    assert main(["train", *data, "--output-dir", "b", *TINY]) != 0
    assert "--eval-examples 0" in capsys.readouterr().err and not (tmp_path / "b").exists()
    assert main(["train", *data, "--eval-examples", "0", "--output-dir", "c", *TINY]) == 0


def test_a_run_that_saved_no_checkpoint_reports_no_accuracy_after_it(tmp_path, monkeypatch, capsys):
    """``trainer.on_disk_full: skip`` on a full disk skips every save: the job still ends with its summary, the
    accuracy before training and no accuracy after it (was: a TypeError after the whole run)."""
    import jetrl.train.policy as policy

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(train_job, "held_out_accuracy", lambda *args, **kwargs: 0.25)
    monkeypatch.setattr(policy, "_free_bytes", lambda folder: 0)  # a full disk
    assert main(["train", "--eval-examples", "2", "--trainer.on_disk_full=skip", *TINY]) == 0
    out = capsys.readouterr()
    assert "not written; the run goes on" in out.err and "no complete checkpoint" in out.err
    assert "0.250 -> no checkpoint to evaluate" in out.out
    result = json.loads((tmp_path / "runs/tiny-default/eval.json").read_text())
    assert result["greedy_accuracy_before"] == 0.25 and result["greedy_accuracy_after"] is None
    assert result["checkpoint"] is None


def test_a_resume_with_nothing_to_resume_measures_the_accuracy_before_training(tmp_path, monkeypatch, capsys):
    """``--resume`` into a folder without a checkpoint starts from the configured model (with a warning), so its
    held-out accuracy before training is measured as a fresh run's is; a run that does resume keeps the one its
    first part recorded (was: dropped from eval.json and the summary)."""
    calls = []
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(train_job, "held_out_accuracy", lambda path, *args, **kwargs: calls.append(path) or 0.5)
    assert main(["train", "--resume", "--eval-examples", "2", *TINY]) == 0
    assert "nothing to resume" in capsys.readouterr().err
    assert len(calls) == 2 and "checkpoints" not in calls[0]  # before (the configured model) and after
    calls.clear()
    assert main(["train", "--resume", "--eval-examples", "2", "--no-progress", "--max-steps", "2",
                 *TINY[3:]]) == 0  # resumes from step 1's checkpoint: not measured again, the recorded one kept
    assert len(calls) == 1 and "checkpoints" in calls[0]
    assert "0.500 -> 0.500" in capsys.readouterr().out
    assert json.loads((tmp_path / "runs/tiny-default/eval.json").read_text())["greedy_accuracy_before"] == 0.5


def test_jetrl_train_reads_and_tokenizes_the_training_file_once(tmp_path, monkeypatch):
    """The checks before the model loads read the file and tokenized every prompt; the run then read the file again
    and tokenized each prompt a batch drew once more. Here the file is read once and each prompt tokenized once."""
    import jetrl.data.datasets as datasets
    import jetrl.data.sources as sources

    monkeypatch.chdir(tmp_path)
    train = tmp_path / "train.jsonl"
    train.write_text("".join(json.dumps({"prompt": f"{i}+1", "answer": str(i + 1)}) + "\n" for i in range(6)))
    reads, encoded = [], []
    real_read, real_encode = sources.read_jsonl, datasets.encode_prompt

    def read_jsonl(path, *args, **kwargs):
        reads.append(str(path))
        return real_read(path, *args, **kwargs)

    def encode_prompt(tokenizer, text):
        encoded.append(text)
        return real_encode(tokenizer, text)

    monkeypatch.setattr(sources, "read_jsonl", read_jsonl)
    for module in (datasets, loop):  # where the checks and the run tokenize prompts
        monkeypatch.setattr(module, "encode_prompt", encode_prompt)
    data = ["--data.task=none", f"--data.path={train}", "--data.reward=arithmetic"]
    assert main(["train", *data, "--eval-examples", "0", "--no-progress", "--max-steps", "2", *TINY[3:]]) == 0
    assert reads == [str(train)]
    assert len(encoded) == 6 and len(set(encoded)) == 6


def test_jetrl_train_loads_the_policy_tokenizer_once(tmp_path, monkeypatch):
    """The checks before the model loads, the evaluation before training and the run each loaded the tokenizer
    (four loads with the evaluation after training). Now the checks' tokenizer serves the run and the evaluation
    before it; the evaluation after training loads the checkpoint's own copy."""
    from transformers import AutoTokenizer

    monkeypatch.chdir(tmp_path)
    loads = []
    real = AutoTokenizer.from_pretrained.__func__

    def from_pretrained(cls, path, *args, **kwargs):
        loads.append(str(path))
        return real(cls, path, *args, **kwargs)

    monkeypatch.setattr(AutoTokenizer, "from_pretrained", classmethod(from_pretrained))
    assert main(["train", "--eval-examples", "2", *TINY]) == 0
    assert len(loads) == 2 and "checkpoints" not in loads[0] and "checkpoints" in loads[1], loads
