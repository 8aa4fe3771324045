"""`jetrl generate` says what the model expects: its --help shows a prompt the embedded model answers, and the
output header names the model's task and precision recipe."""

import re

import pytest

from jetrl.asset_files import EMBEDDED_MODEL, resolve_asset
from jetrl.cli import main
from jetrl.sft.train import model_task


def _left_to_right(expression: str) -> int:
    """The value of a compact arithmetic prompt: + - * / applied left to right (division is exact)."""
    tokens = re.findall(r"\d+|[-+*/]", expression)
    value = int(tokens[0])
    for op, operand in zip(tokens[1::2], map(int, tokens[2::2])):
        value = {"+": value + operand, "-": value - operand, "*": value * operand, "/": value // operand}[op]
    return value


def test_help_shows_a_prompt_the_embedded_model_answers(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["generate", "--help"])
    assert exit_info.value.code == 0
    help_text = " ".join(capsys.readouterr().out.split())
    assert "arithmetic task" in help_text and "left to right" in help_text
    example = re.search(r"Try: jetrl generate '([^']+)'", help_text).group(1)

    assert main(["generate", example]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == f"jetrl generate: {EMBEDDED_MODEL} (greedy, bf16 recipe)"
    assert lines[1].startswith("model: trained by jetrl sft on the arithmetic task, difficulty 3: a bare expression")
    assert lines[2] == f"=== {example}"
    assert lines[-1] == f"#### {_left_to_right(example)}", lines  # the documented prompt works


def test_header_goes_to_stderr_with_jsonl(capsys):
    assert main(["generate", "1+2*3", "--jsonl", "--max-tokens", "4"]) == 0
    captured = capsys.readouterr()
    assert captured.out.startswith('{"prompt": "1+2*3"') and "arithmetic task" in captured.err


def test_model_task(tmp_path):
    task = model_task(resolve_asset(EMBEDDED_MODEL))
    assert (task.name, task.difficulty) == ("arithmetic", "3") and task.example == "19-9*3*9"
    assert model_task(tmp_path) is None  # not a jetrl sft model: nothing to say
    (tmp_path / "sft_metrics.json").write_text('{"config": {"task": "countdown", "difficulty": [2, 4], '
                                               '"eval_seed": 7}}')
    task = model_task(tmp_path)
    assert (task.name, task.difficulty) == ("countdown", "2-4") and ">" in task.example


def test_readme_shows_a_prompt_of_the_embedded_model():
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    assert f"jetrl generate '{model_task(resolve_asset(EMBEDDED_MODEL)).example}'" in readme
