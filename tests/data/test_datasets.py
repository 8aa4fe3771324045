"""Prompt datasets: JSONL/Parquet loading with column mapping, GSM8K/MATH formats, clear errors."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from jetrl.data import ColumnMap, DatasetConfig, Prompt, PromptDataset, load_prompt_dataset

ROWS = [
    {"q": "What is 2+3?", "a": "5", "sol": "2+3=5", "tag": "easy", "id": 10},
    {"q": "What is 7*6?", "a": 42, "sol": "7*6=42", "tag": "mid", "id": 11},
    {"q": "Solve $x^{2}=9$ for $x>0$.", "a": "3", "sol": "x=3", "tag": "hard", "id": 12},
]
COLUMNS = ColumnMap(prompt="q", answer="a")


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def write_parquet(path: Path, rows: list[dict]) -> Path:
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


@pytest.mark.parametrize("writer,name", [(write_jsonl, "d.jsonl"), (write_parquet, "d.parquet")])
def test_custom_columns_from_file(tmp_path, writer, name):
    # JSONL keeps the mixed int/str answers (converted to str on load); a Parquet column has one type.
    path = writer(tmp_path / name, ROWS if writer is write_jsonl else [{**r, "a": str(r["a"])} for r in ROWS])
    ds = load_prompt_dataset(DatasetConfig(path=str(path), columns=COLUMNS, reward="gsm8k"))
    assert isinstance(ds, PromptDataset) and len(ds) == 3 and ds.reward == "gsm8k"
    for i, (prompt, row) in enumerate(zip(ds, ROWS)):
        assert prompt == Prompt(index=i, text=row["q"], answer=str(row["a"]))


def test_columns_given_as_dict_and_max_examples(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", ROWS)
    ds = load_prompt_dataset(str(path), columns={"prompt": "q", "answer": "a"}, max_examples=2)
    assert [p.text for p in ds] == [ROWS[0]["q"], ROWS[1]["q"]]
    assert ds[1].answer == "42"


def test_chat_messages_column(tmp_path):
    rows = [{"conv": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "1+1?"}], "gold": "2"}]
    path = write_jsonl(tmp_path / "chat.jsonl", rows)
    ds = load_prompt_dataset(str(path), columns=ColumnMap(prompt=None, messages="conv", answer="gold"))
    assert ds[0].text is None and ds[0].messages == tuple(rows[0]["conv"]) and ds[0].answer == "2"


def test_missing_file_says_which(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.jsonl"):
        load_prompt_dataset(str(tmp_path / "nope.jsonl"))


def test_unknown_column_lists_available(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", ROWS)
    with pytest.raises(ValueError, match=r"unknown prompt column 'question'.*'q', 'a', 'sol', 'tag', 'id'"):
        load_prompt_dataset(str(path), format="gsm8k")
    with pytest.raises(ValueError, match=r"unknown answer column 'nope'"):
        load_prompt_dataset(str(path), columns=ColumnMap(prompt="q", answer="nope"))


def test_empty_and_malformed_files(tmp_path):
    (tmp_path / "empty.jsonl").write_text("\n\n")
    with pytest.raises(ValueError, match="has no rows"):
        load_prompt_dataset(str(tmp_path / "empty.jsonl"))
    pq.write_table(pa.table({"prompt": pa.array([], pa.string()), "answer": pa.array([], pa.string())}),
                   tmp_path / "empty.parquet")
    with pytest.raises(ValueError, match="has no rows"):
        load_prompt_dataset(str(tmp_path / "empty.parquet"))
    (tmp_path / "bad.jsonl").write_text('{"prompt": "a", "answer": "1"}\n{"prompt": \n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2: not valid JSON"):
        load_prompt_dataset(str(tmp_path / "bad.jsonl"))
    (tmp_path / "null.jsonl").write_text('{"prompt": "a", "answer": "1"}\n{"prompt": "b", "answer": null}\n')
    with pytest.raises(ValueError, match=r"row 2 has no value in the answer column 'answer'"):  # rows count from 1
        load_prompt_dataset(str(tmp_path / "null.jsonl"))
    (tmp_path / "d.csv").write_text("prompt,answer\n")
    with pytest.raises(ValueError, match=r"name it .jsonl or .parquet"):
        load_prompt_dataset(str(tmp_path / "d.csv"))
    with pytest.raises(ValueError, match="is empty"):
        PromptDataset([])


def test_config_validation():
    with pytest.raises(ValueError, match="unknown dataset format 'gsm9k'"):
        DatasetConfig(path="x.jsonl", format="gsm9k")
    with pytest.raises(ValueError, match="not both"):
        ColumnMap(prompt="q", messages="m")
    with pytest.raises(ValueError, match="max_examples"):
        DatasetConfig(path="x.jsonl", max_examples=0)
    with pytest.raises(TypeError, match="unexpected keyword argument .colums."):
        load_prompt_dataset(DatasetConfig(path="x.jsonl"), colums={})
    with pytest.raises(ValueError, match="exactly one of text and messages"):
        Prompt(index=0, answer="1")


def test_gsm8k_format_on_shared_data(gsm8k_test_path, gsm8k_test_rows):
    ds = load_prompt_dataset(str(gsm8k_test_path), format="gsm8k")
    assert len(ds) == len(gsm8k_test_rows) == 1319 and ds.reward == "gsm8k"
    for prompt, row in zip(ds, gsm8k_test_rows):
        assert prompt.text == row["question"] and prompt.answer == row["answer"]
        assert "\n#### " in prompt.answer
    rendered = ds.render(ds[0])
    assert rendered.startswith(gsm8k_test_rows[0]["question"]) and rendered.endswith('after "####".')


def test_math_format_on_shared_data(math500_path, math500_rows):
    ds = load_prompt_dataset(DatasetConfig(path=str(math500_path), format="math"))
    assert len(ds) == len(math500_rows) == 500 and ds.reward == "math"
    for prompt, row in zip(ds, math500_rows):
        assert (prompt.text, prompt.answer) == (row["problem"], row["answer"])
    assert ds.render(ds[0]).endswith("within \\boxed{}.")


def test_math_format_on_parquet_with_only_its_columns(tmp_path, math500_rows):
    rows = [{"problem": r["problem"], "answer": r["answer"]} for r in math500_rows[:20]]
    path = write_parquet(tmp_path / "math.parquet", rows)
    ds = load_prompt_dataset(str(path), format="math")
    assert [p.answer for p in ds] == [r["answer"] for r in rows]
