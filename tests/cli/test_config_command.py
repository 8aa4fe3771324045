"""``jetrl config show / check / reference``: the resolved config as commented YAML that loads back, validation
without a model, one ``jetrl: error:`` line (exit status 2) for a bad file or override."""

from pathlib import Path

import pytest

from jetrl.asset_files import DEFAULT_CONFIG, resolve_asset
from jetrl.cli import USAGE_ERROR, main
from jetrl.config import load_config
from jetrl.registries import configuration_reference

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = sorted((REPO / "examples").glob("*.yaml"))


def _one_error_line(capsys, *fragments):
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("jetrl: error: "), captured.err
    for fragment in fragments:
        assert fragment in lines[0]
    return lines[0]


def test_show_without_arguments_prints_the_embedded_default_which_loads_back(tmp_path, capsys):
    assert main(["config", "show"]) == 0
    text = capsys.readouterr().out
    assert text.startswith("# jetrl config show jetrl:tiny_default.yaml\n")
    assert "  task: arithmetic" in text and "# completions sampled per prompt" in text
    shown = tmp_path / "shown.yaml"
    shown.write_text(text)
    assert load_config(shown) == load_config(resolve_asset(DEFAULT_CONFIG))


def test_show_applies_overrides_and_the_output_loads_back(tmp_path, capsys):
    example = REPO / "examples" / "gsm8k_qwen2.5_jet.yaml"
    overrides = ["--optim.lr=2e-6", "--rollout.n=4", "--data.system_prompt=Be brief. # really", "--exact=true",
                 "--algorithm.mini_batch_size=64"]
    assert main(["config", "show", str(example), *overrides]) == 0
    shown = tmp_path / "shown.yaml"
    shown.write_text(capsys.readouterr().out)
    config = load_config(shown)
    assert config == load_config(example, overrides)
    assert config.optim.lr == 2e-6 and config.rollout.n == 4 and config.data.system_prompt == "Be brief. # really"


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.name)
def test_check_passes_every_example_config(example, capsys):
    assert main(["config", "check", str(example)]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"{example}: valid (") and "sequences per RL step" in out


def test_check_does_not_load_the_model(tmp_path, capsys):
    """A model folder that does not exist is no error for check (the weights are not its business)."""
    assert main(["config", "check", str(REPO / "examples" / "tiny_default.yaml"),
                 f"--model.path={tmp_path / 'no-such-model'}"]) == 0


@pytest.mark.parametrize("args, fragments", [
    (["--optim.lrr=1"], ["unknown config key 'optim.lrr'", "did you mean 'optim.lr'"]),
    (["--rollout.n=many"], ["rollout.n must be an int"]),
    (["--data.task=arithmetc"], ["data.task must be one of", "did you mean 'arithmetic'"]),
    (["--data.format=gsm9k"], ["data.format must be one of"]),
    (["--data.reward=nope"], ["data.reward: reward 'nope'"]),
    (["--model.path="], ["model.path is empty"]),
    (["--kernels=no_such_knob=1"], ["kernels"]),
    (["--rollout.n=3"], ["must be divisible by algorithm.mini_batch_size"]),
    (["optim.lr=1"], ["unexpected argument 'optim.lr=1'"]),
])
def test_check_reports_one_error_line(args, fragments, capsys):
    assert main(["config", "check", str(REPO / "examples" / "tiny_default.yaml"), *args]) == USAGE_ERROR
    _one_error_line(capsys, *fragments)


def test_check_and_show_report_a_bad_file_in_one_line(tmp_path, capsys):
    assert main(["config", "check", str(tmp_path / "missing.yaml")]) == USAGE_ERROR
    _one_error_line(capsys, "does not exist")
    broken = tmp_path / "broken.yaml"
    broken.write_text("rollout:\n  n: [1\n")
    assert main(["config", "show", str(broken)]) == USAGE_ERROR
    _one_error_line(capsys, "not valid YAML", "line 3")


def test_check_needs_a_file_and_reference_takes_no_overrides(capsys):
    with pytest.raises(SystemExit) as done:
        main(["config", "check"])
    assert done.value.code == USAGE_ERROR
    with pytest.raises(SystemExit) as done:
        main(["config", "reference", "--optim.lr=1"])
    assert done.value.code == USAGE_ERROR and "unrecognized arguments" in capsys.readouterr().err


def test_reference_prints_the_configuration_reference(capsys):
    assert main(["config", "reference"]) == 0
    assert capsys.readouterr().out == configuration_reference()
