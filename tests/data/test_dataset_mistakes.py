"""Data files a user gets wrong: each is an error naming the file, the row and the column, before any model loads."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from jetrl.asset_files import EMBEDDED_MODEL, resolve_asset
from jetrl.data import DatasetConfig, load_prompt_dataset, read_prompts


def _jsonl(path: Path, rows: list[dict]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_chat_messages_in_the_prompt_column_are_an_error(tmp_path):
    """verl's preprocessed files hold the prompt as a list of chat turns and the answer inside a dict: read as text
    they became prompts like "[{'role': 'user', ...}]" and references like "{'ground_truth': ...}", silently."""
    turns = [{"role": "user", "content": "What is 2+3?"}]
    path = _jsonl(tmp_path / "verl.jsonl", [{"prompt": "1+1", "answer": "2"}, {"prompt": turns, "answer": "5"}])
    with pytest.raises(ValueError, match=r"verl.jsonl: row 2: the prompt column 'prompt' holds a list, not text"):
        load_prompt_dataset(path)
    path = _jsonl(tmp_path / "rm.jsonl", [{"prompt": "2+3", "reward_model": {"ground_truth": "5"}}])
    with pytest.raises(ValueError, match=r"rm.jsonl: row 1: the answer column 'reward_model' holds a dict, not text"):
        load_prompt_dataset(DatasetConfig(path=path, columns={"prompt": "prompt", "answer": "reward_model"}))


def test_numbers_still_read_as_text(tmp_path):
    path = _jsonl(tmp_path / "n.jsonl", [{"prompt": "6*7", "answer": 42}, {"prompt": 12, "answer": 3.5}])
    assert [(p.text, p.answer) for p in load_prompt_dataset(path)] == [("6*7", "42"), ("12", "3.5")]


def test_over_long_prompts_are_found_before_training(tmp_path):
    """The RL loop met an over-long prompt only when a batch drew it: after the model loaded and, for a late row,
    after hours of training. check_prompt_lengths reads them all up front, with the same tokenization."""
    from jetrl.data import check_prompt_lengths
    from jetrl.models import load_tokenizer

    tokenizer = load_tokenizer(resolve_asset(EMBEDDED_MODEL))
    rows = [{"prompt": f"{i}+1", "answer": str(i + 1)} for i in range(4)] + [{"prompt": "+".join("1" * 80),
                                                                              "answer": "80"}]
    dataset = load_prompt_dataset(_jsonl(tmp_path / "d.jsonl", rows))
    with pytest.raises(ValueError, match=r"d.jsonl: prompt 4 \(row 5\) has 1\d\d tokens, more than "
                                         r"data.max_prompt_tokens=64; raise it or filter the dataset"):
        check_prompt_lengths(dataset, tokenizer, 64)
    check_prompt_lengths(dataset, tokenizer, 512)


def test_a_prompt_file_that_is_a_folder(tmp_path):
    with pytest.raises(ValueError, match=f"prompt file {tmp_path} is a folder; give a text file"):
        read_prompts([], str(tmp_path))
