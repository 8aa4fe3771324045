"""The one dataset builder: a data spec (the config's data section, or any object with its fields) to prompts."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from jetrl.data import TASKS, build_prompt_dataset, get_task


def spec(**fields) -> SimpleNamespace:
    base = dict(path=None, format="custom", task=None, difficulty=1, task_style="compact", num_examples=8,
                prompt_column=None,
                answer_column=None, instruction=None, system_prompt=None, reward=None, max_examples=None)
    return SimpleNamespace(**{**base, **fields})


def test_task_prompts_come_from_the_seed():
    name = sorted(TASKS)[0]
    ds = build_prompt_dataset(spec(task=name, difficulty=2, num_examples=5), seed=7)
    expected = get_task(name, difficulty=2, seed=7).dataset(5)
    assert len(ds) == 5 and [p.text for p in ds] == [p.text for p in expected]
    assert [p.text for p in build_prompt_dataset(spec(task=name, num_examples=5), seed=8)] != [p.text for p in ds]
    natural = build_prompt_dataset(spec(task=name, difficulty=2, task_style="natural", num_examples=5), seed=7)
    expected = get_task(name, difficulty=2, seed=7, style="natural").dataset(5)
    assert [p.text for p in natural] == [p.text for p in expected] and natural[0].text != ds[0].text
    assert [p.answer for p in natural] == [p.answer for p in ds]  # the same problems, asked in English


def test_a_tasks_reward_instruction_and_system_prompt_follow_the_spec():
    """``data.reward``, ``data.instruction`` and ``data.system_prompt`` apply to a built-in task as to a file (were
    dropped: the held-out evaluation then scored with the task's reward while training used the configured one)."""
    name = sorted(TASKS)[0]
    ds = build_prompt_dataset(spec(task=name, num_examples=3, reward="gsm8k", instruction="Solve: {prompt}",
                                   system_prompt="You are a calculator."), seed=7)
    assert ds.reward == "gsm8k"
    assert ds.render(ds[0]).startswith(f"You are a calculator.\n\nSolve: {ds[0].text}")
    plain = build_prompt_dataset(spec(task=name, num_examples=3), seed=7)
    assert plain.reward == name and plain.template == get_task(name, seed=7).dataset(3).template


def test_file_with_column_template_reward_and_row_overrides(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps({"q": f"{i}+1", "a": str(i + 1)}) + "\n" for i in range(4)))
    ds = build_prompt_dataset(spec(path=str(path), format="gsm8k", prompt_column="q", answer_column="a",
                                   instruction="Q: {prompt}", system_prompt="Be brief.", reward="arithmetic",
                                   max_examples=3), seed=0)
    assert [p.text for p in ds] == ["0+1", "1+1", "2+1"] and [p.answer for p in ds] == ["1", "2", "3"]
    assert ds.reward == "arithmetic"
    assert ds.template.instruction == "Q: {prompt}" and ds.template.system_prompt == "Be brief."
    # no overrides: the format's own reward and instruction
    plain = build_prompt_dataset(spec(path=str(path), format="gsm8k", prompt_column="q", answer_column="a"), seed=0)
    assert plain.reward == "gsm8k" and "####" in plain.template.instruction and len(plain) == 4


@pytest.mark.parametrize("fields, message", [
    (dict(), "no prompts"),
    (dict(path="x.jsonl", format="gsm9k"), r"unknown dataset format 'gsm9k'; choose one of \['custom', 'gsm8k'"),
    (dict(path="x.jsonl", task="arithmetic"), "set one"),
])
def test_bad_specs_say_what_to_fix(fields, message):
    with pytest.raises(ValueError, match=message):
        build_prompt_dataset(spec(**fields), seed=0)


def test_the_config_data_section_is_a_spec():
    from jetrl.config import DataConfig

    name = sorted(TASKS)[0]
    ds = build_prompt_dataset(DataConfig(task=name, num_examples=3), seed=1)
    assert len(ds) == 3
