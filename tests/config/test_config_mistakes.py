"""Config mistakes that used to pass silently or end in a traceback: each is now a ConfigError that names the key."""

import json

import pytest

from jetrl.config import ConfigError, load_config


@pytest.mark.parametrize("text, message", [
    # a second section of the same name replaced the first: optim.lr silently went back to its default
    ("optim:\n  lr: 1.0e-5\nrollout:\n  n: 4\noptim:\n  warmup_steps: 3\n", "line 5: 'optim' is set twice"),
    ("optim:\n  lr: 1.0e-5\n  lr: 2.0e-5\n", "line 3: 'lr' is set twice"),
])
def test_a_key_set_twice_in_a_yaml_file_is_an_error(tmp_path, text, message):
    path = tmp_path / "run.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=f"config file {path} {message}"):
        load_config(path)


def test_a_key_set_twice_in_a_json_file_is_an_error(tmp_path):
    path = tmp_path / "run.json"
    path.write_text('{"optim": {"lr": 1e-5}, "optim": {"warmup_steps": 3}}')
    with pytest.raises(ConfigError, match="'optim' is set twice"):
        load_config(path)
    path.write_text(json.dumps({"optim": {"lr": 1e-5}, "rollout": {"n": 4}}))  # distinct keys still load
    assert load_config(path).optim.lr == 1e-5


@pytest.mark.parametrize("device", ["cuda:abc", "cuda:-1", "cuda:", "nvidia", "CUDA"])
def test_device_strings_torch_cannot_parse_are_config_errors(device):
    """`cuda:abc` passed the config and then raised torch's RuntimeError (a traceback) at start-up."""
    with pytest.raises(ConfigError, match=rf"model.device must be 'auto', 'cpu', 'cuda' or 'cuda:N', got '{device}'"):
        load_config(None, [f"--model.device={device}"])


@pytest.mark.parametrize("device", ["auto", "cpu", "cuda", "cuda:0", "cuda:7"])
def test_valid_device_strings(device):
    assert load_config(None, [f"--model.device={device}"]).model.device == device


def test_grpo_with_one_sample_per_prompt_is_an_error():
    """A GRPO group of one sample has advantage 0: the run would train for its whole length and learn nothing."""
    with pytest.raises(ConfigError, match=r"algorithm.advantage_estimator='grpo' needs rollout.n >= 2"):
        load_config(None, ["--rollout.n=1", "--algorithm.micro_batch_size=1"])
    # the batch-mean baseline needs no group
    config = load_config(None, ["--rollout.n=1", "--algorithm.micro_batch_size=1",
                                "--algorithm.advantage_estimator=reinforce"])
    assert config.rollout.n == 1


def test_home_relative_paths_are_expanded(tmp_path, monkeypatch):
    """`--data.path=~/x.jsonl` is not expanded by the shell (the ~ is not at the start of the word): the data file
    was reported missing and `trainer.output_dir: ~/runs/a` made a folder named '~' in the working directory."""
    monkeypatch.setenv("HOME", str(tmp_path))
    config = load_config(None, ["--model.path=~/model", "--model.tokenizer=~/tok", "--data.path=~/train.jsonl",
                                "--data.eval_path=~/test.jsonl", "--trainer.output_dir=~/runs/a"])
    assert config.model.path == str(tmp_path / "model") and config.model.tokenizer == str(tmp_path / "tok")
    assert config.data.path == str(tmp_path / "train.jsonl")
    assert config.data.eval_path == str(tmp_path / "test.jsonl")
    assert config.trainer.output_dir == str(tmp_path / "runs" / "a")
    assert load_config(None, ["--model.path=jetrl:tiny-arith"]).model.path == "jetrl:tiny-arith"
