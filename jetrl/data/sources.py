"""Reading text, JSONL and Parquet files, with errors that say what to fix; checking where an output will go."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

_SUFFIXES = {".jsonl": "jsonl", ".json": "jsonl", ".ndjson": "jsonl", ".parquet": "parquet", ".pq": "parquet"}


def table_kind(path: str | Path) -> str | None:
    """"jsonl" or "parquet", as the file's name tells (its suffix, any case); None for another name."""
    return _SUFFIXES.get(Path(path).suffix.lower())


def read_rows(path: str | Path) -> tuple[list[dict[str, Any]], list[str]]:
    """All rows of a JSONL or Parquet file (told apart by the file name) as dicts, plus the column names (in
    first-seen order)."""
    path = Path(path).expanduser()
    if not path.exists():
        raise FileNotFoundError(f"dataset file not found: {str(path)!r} (resolved to {str(path.resolve())!r})")
    if path.is_dir():
        raise ValueError(f"dataset path {str(path)!r} is a folder; give the .jsonl or .parquet file inside it")
    kind = table_kind(path)
    if kind is None:
        raise ValueError(f"cannot tell the format of {str(path)!r} from its suffix {path.suffix!r}; name it .jsonl "
                         "or .parquet")
    rows = read_jsonl(path) if kind == "jsonl" else _read_parquet(path)
    return rows, list(dict.fromkeys(column for row in rows for column in row))


def read_text(path: Path) -> str:
    """The file's UTF-8 text; other bytes are an error naming the line."""
    raw = path.read_bytes()
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = raw[:e.start].count(b"\n") + 1
        raise ValueError(f"{path} line {line} is not UTF-8 text; save the file as UTF-8") from None


def read_jsonl(path: Path, required: tuple[str, ...] = ()) -> list[dict[str, Any]]:
    """The JSON objects of a UTF-8 file, one a line (blank lines skipped), each holding the keys ``required``;
    anything else is an error naming the line."""
    rows = []
    for line_number, line in enumerate(read_text(path).split("\n"), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{line_number}: not valid JSON ({e.msg}); each line must be one object") from None
        if not isinstance(row, dict):
            raise ValueError(f"{path}:{line_number}: expected a JSON object per line, got {type(row).__name__}")
        missing = [key for key in required if key not in row]
        if missing:
            raise ValueError(f"{path}:{line_number}: no {', '.join(repr(k) for k in missing)} field")
        rows.append(row)
    return rows


def check_output_path(path: str, what: str, folder: bool = False) -> str:
    """``path`` with a leading ``~`` expanded, the path to write: a ValueError unless it can be written as a file
    (``folder``: made as a folder; missing parent folders are made by the writer), naming it as ``what`` (e.g. the
    option that gave it). A command checks this before the work whose result goes there."""
    target = Path(path).expanduser()
    if folder and target.is_file():
        raise ValueError(f"{what} {path} is a file; give a folder")
    if not folder and target.is_dir():
        raise ValueError(f"{what} {path} is a folder; give a file path")
    existing = next(p for p in target.parents if p.exists())  # the nearest one there: "." or "/" at the latest
    if not existing.is_dir():
        raise ValueError(f"{what} {path} cannot be written: {existing} is not a folder")
    return str(target)


def _read_parquet(path: Path) -> list[dict[str, Any]]:
    import pyarrow.parquet as pq  # heavy: imported only when a Parquet file is read

    try:
        table = pq.read_table(path)
    except Exception as e:  # pyarrow raises its own ArrowInvalid etc.
        raise ValueError(f"{path}: not a readable Parquet file ({e})") from None
    return table.to_pylist()
