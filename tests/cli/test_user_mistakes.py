"""Mistakes a user makes at the command line, each one ``jetrl: error:`` line (or an argparse usage error) that
names the option, before any model loads: the loaders are replaced by a failing stub, so an error that comes only
after loading fails the test."""

import json
from pathlib import Path

import pytest

import jetrl.cli
import jetrl.evaluate
import jetrl.rl.loop

from cli_errors import error_line, parser_error

# one RL step of 1 prompt x 2 samples
SMALL = ["--no-progress", "--max-steps", "1", "--data.prompts_per_step=1", "--rollout.n=2",
         "--algorithm.mini_batch_size=2", "--algorithm.micro_batch_size=2"]
FILE_RUN = ["--data.task=none", "--data.reward=arithmetic"]


@pytest.fixture
def no_model(monkeypatch, tmp_path):
    """Loading a model (or starting `jetrl sft`'s training) fails the test; the working folder is a fresh one."""
    def loaded(*args, **kwargs):
        raise AssertionError("a model was loaded before the error")

    for module, name in ((jetrl.rl.loop, "load_model"), (jetrl.evaluate, "load_model"), (jetrl.cli, "load_policy"),
                         (jetrl.cli, "run_sft")):
        monkeypatch.setattr(module, name, loaded)
    monkeypatch.chdir(tmp_path)
    return tmp_path


def _jsonl(path: Path, rows: list[dict]) -> str:
    """Write ``rows`` to ``path`` in the working folder; returns its name, as a user would type it."""
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path.name


_error = error_line


def _usage_error(capsys, argv) -> str:
    return parser_error(capsys, argv).strip().splitlines()[-1]


# ------------------------------------------------------------------------------------------ train

def test_training_data_is_checked_before_the_held_out_evaluation(no_model, capsys):
    """With a held-out evaluation (the default with data.eval_path or data.task), the model was loaded and the
    evaluation run before the training data was read: a broken training file, too few rows or a misspelt reward
    surfaced minutes later."""
    good = _jsonl(no_model / "good.jsonl", [{"prompt": "1+1", "answer": "2"}, {"prompt": "2+2", "answer": "4"}])
    broken = _jsonl(no_model / "broken.jsonl", [{"prompt": "1+1", "answer": "2"}, {"prompt": "2+2"}])
    msg = _error(capsys, ["train", *FILE_RUN, f"--data.path={broken}", f"--data.eval_path={good}", *SMALL])
    assert msg == "jetrl: error: broken.jsonl: row 2 has no value in the answer column 'answer'"
    msg = _error(capsys, ["train", *FILE_RUN, f"--data.path={good}", f"--data.eval_path={good}", *SMALL,
                          "--data.prompts_per_step=4", "--algorithm.mini_batch_size=8"])
    assert msg == ("jetrl: error: data.prompts_per_step (4) is larger than the dataset (2 prompts); lower it or use "
                   "more data")
    msg = _error(capsys, ["train", "--data.reward=exact_match", *SMALL])
    assert msg.startswith("jetrl: error: data.reward: reward 'exact_match' is neither a built-in")
    assert not (no_model / "runs").exists()  # nor was the output folder made


def test_an_over_long_prompt_is_found_before_training(no_model, capsys):
    """A prompt over data.max_prompt_tokens stopped the run when its batch came up: row 5 here, at step 5."""
    rows = [{"prompt": f"{i}+1", "answer": str(i + 1)} for i in range(4)] + [{"prompt": "+".join("1" * 80),
                                                                              "answer": "80"}]
    data = _jsonl(no_model / "long.jsonl", rows)
    msg = _error(capsys, ["train", *FILE_RUN, f"--data.path={data}", "--data.shuffle=false", *SMALL,
                          "--eval-examples", "0"])
    assert msg.startswith("jetrl: error: long.jsonl: prompt 4 (row 5) has ")
    assert msg.endswith("tokens, more than data.max_prompt_tokens=64; raise it or filter the dataset")


def test_a_held_out_file_shorter_than_eval_examples_is_reported_as_it_is(no_model, capsys, monkeypatch):
    """--eval-examples 5 on a one-row held-out file evaluated one problem and reported five."""
    seen = {}

    def train_and_evaluate(config, data, **kwargs):
        seen["num_eval"] = data.num_eval
        raise ValueError("stop here")

    monkeypatch.setattr(jetrl.cli, "train_and_evaluate", train_and_evaluate)
    data = _jsonl(no_model / "one.jsonl", [{"prompt": "1+1", "answer": "2"}])
    msg = _error(capsys, ["train", *FILE_RUN, f"--data.path={data}", f"--data.eval_path={data}", *SMALL,
                          "--eval-examples", "5"])
    assert msg == "jetrl: error: stop here" and seen["num_eval"] == 1


def test_eval_examples_must_not_be_negative(no_model, capsys):
    msg = _usage_error(capsys, ["train", "--eval-examples", "-3"])
    assert msg.endswith("argument --eval-examples: must be >= 0, got -3")


@pytest.mark.parametrize("argv, message", [
    # Hydra's form (verl's scripts): was "config file optim.lr=1e-5 does not exist"
    (["train", "optim.lr=1e-5"], "unexpected argument 'optim.lr=1e-5': overrides look like --section.key=value; "
                                 "write --optim.lr=1e-5"),
    (["config", "check", "optim.lr=1e-5"], "unexpected argument 'optim.lr=1e-5'"),
    # argparse's form: 1e-5 was taken for the config file ("config file 1e-5 does not exist")
    (["train", "--optim.lr", "1e-5"], "unexpected argument '--optim.lr': overrides look like --section.key=value; "
                                      "write --optim.lr=VALUE"),
])
def test_overrides_in_another_form_say_how_to_write_them(no_model, capsys, argv, message):
    assert _error(capsys, argv).startswith(f"jetrl: error: {message}")


# ------------------------------------------------------------------------------------------ eval, generate

@pytest.mark.parametrize("argv, message", [
    (["eval", "--temperature", "-1"], "argument --temperature: must be 0 (greedy) or >= 1e-05, got -1.0"),
    (["eval", "--temperature", "nan"], "argument --temperature: must be 0 (greedy) or >= 1e-05, got nan"),
    (["eval", "--top-p", "0"], "argument --top-p: must be in (0, 1], got 0.0"),
    (["generate", "--top-p", "1.5", "1+2"], "argument --top-p: must be in (0, 1], got 1.5"),
    (["generate", "--temperature", "-0.5", "1+2"], "argument --temperature: must be 0 (greedy) or >= 1e-05, got -0.5"),
    (["eval", "--temperature", "1e-30"], "argument --temperature: must be 0 (greedy) or >= 1e-05, got 1e-30"),
    (["eval", "--k", "0"], "argument --k: must be >= 1, got 0"),
    (["eval", "--device", "nvidia"], "argument --device: must be 'auto', 'cpu', 'cuda' or 'cuda:N', got 'nvidia'"),
    (["generate", "--device", "cuda:x", "1+2"], "argument --device: must be 'auto', 'cpu', 'cuda' or 'cuda:N'"),
    (["sft", "--device", "nvidia"], "argument --device: must be 'auto', 'cpu', 'cuda' or 'cuda:N'"),
    (["check-fp8", "--device", "nvidia"], "argument --device: must be 'auto', 'cpu', 'cuda' or 'cuda:N'"),
    (["sft", "--eval-every", "-1"], "argument --eval-every: must be >= 0, got -1"),
])
def test_sampling_and_device_options_are_checked_by_the_parser(no_model, capsys, argv, message):
    """A bad --temperature or --top-p was reported after the model loaded, as SamplingParams.* rather than the
    option; --device gpu ended in torch's RuntimeError traceback."""
    assert message in _usage_error(capsys, argv)


def test_eval_options_are_checked_before_the_model_loads(no_model, capsys):
    (no_model / "afile").write_text("")
    msg = _error(capsys, ["eval", "--k", "4"])
    assert msg == "jetrl: error: pass@4 needs --n >= 4 samples per prompt (now 1)"
    msg = _error(capsys, ["eval", "--n", "4"])
    assert msg == ("jetrl: error: greedy decoding (--temperature 0) gives one completion per prompt; set "
                   "--temperature > 0 for --n > 1")
    msg = _error(capsys, ["eval", "--reward", "exact"])
    assert msg.startswith("jetrl: error: reward 'exact' is neither a built-in")
    # the samples file: written after the whole evaluation, so a bad path lost all of it
    assert _error(capsys, ["eval", "--output", "."]) == "jetrl: error: --output . is a folder; give a file path"
    msg = _error(capsys, ["eval", "--output", "afile/samples.jsonl"])
    assert msg == "jetrl: error: --output afile/samples.jsonl cannot be written: afile is not a folder"


def test_eval_options_of_the_other_data_mode_are_errors(no_model, capsys):
    """A task's options with --data, or a file's without it, were silently ignored (the run evaluated something
    else than asked)."""
    data = _jsonl(no_model / "p.jsonl", [{"prompt": "1+1\n", "answer": "2"}])
    msg = _error(capsys, ["eval", "--data", data, "--task", "chain", "--difficulty", "0"])
    assert msg == "jetrl: error: --task, --difficulty choose a built-in task, not --data's file"
    msg = _error(capsys, ["eval", "--prompt-column", "question", "--format", "custom"])
    assert msg == "jetrl: error: --format, --prompt-column describe a --data file (none given)"


def test_eval_examples_need_something_held_out(no_model, capsys):
    data = _jsonl(no_model / "p.jsonl", [{"prompt": "1+1\n", "answer": "2"}])
    msg = _error(capsys, ["train", *FILE_RUN, f"--data.path={data}", "--eval-examples", "3", *SMALL])
    assert msg.startswith("jetrl: error: --eval-examples measures held-out accuracy on a built-in task")
    assert not (no_model / "runs").exists()


def test_sft_into_a_file_says_so(no_model, capsys):
    (no_model / "afile").write_text("")
    msg = _error(capsys, ["sft", "--output-dir", "afile", "--steps", "1"])
    assert msg == "jetrl: error: --output-dir afile is a file; give a folder"
