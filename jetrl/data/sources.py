"""Reading table rows from JSONL and Parquet files, with errors that say what to fix."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal, get_args

FileType = Literal["auto", "jsonl", "parquet"]
FILE_TYPES: tuple[str, ...] = get_args(FileType)

_SUFFIXES = {".jsonl": "jsonl", ".json": "jsonl", ".ndjson": "jsonl", ".parquet": "parquet", ".pq": "parquet"}


def detect_file_type(path: Path) -> str:
    """``"jsonl"`` or ``"parquet"`` from the file name."""
    kind = _SUFFIXES.get(path.suffix.lower())
    if kind is None:
        raise ValueError(
            f"cannot tell the format of {str(path)!r} from its suffix {path.suffix!r}; name it .jsonl or "
            f".parquet, or set file_type='jsonl' or 'parquet'"
        )
    return kind


def read_rows(path: str | Path, file_type: FileType = "auto") -> tuple[list[dict[str, Any]], list[str]]:
    """All rows of a JSONL or Parquet file as dicts, plus the column names (in first-seen order)."""
    path = Path(path).expanduser()
    if not path.exists():
        raise FileNotFoundError(f"dataset file not found: {str(path)!r} (resolved to {str(path.resolve())!r})")
    if path.is_dir():
        raise ValueError(f"dataset path {str(path)!r} is a folder; give the .jsonl or .parquet file inside it")
    kind = detect_file_type(path) if file_type == "auto" else file_type
    if kind == "jsonl":
        rows = _read_jsonl(path)
    elif kind == "parquet":
        rows = _read_parquet(path)
    else:
        raise ValueError(f"file_type must be one of {', '.join(map(repr, FILE_TYPES))}, got {file_type!r}")
    columns: dict[str, None] = {}
    for row in rows:
        columns.update(dict.fromkeys(row))
    return rows, list(columns)


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    rows = []
    raw = path.read_bytes()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = raw[:e.start].count(b"\n") + 1
        raise ValueError(f"{path}:{line}: not UTF-8 text; save the file as UTF-8") from None
    for line_number, line in enumerate(text.split("\n"), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(
                f"{path}:{line_number}: not valid JSON ({e.msg}); each line must be one object"
            ) from None
        if not isinstance(row, dict):
            raise ValueError(f"{path}:{line_number}: expected a JSON object per line, got {type(row).__name__}")
        rows.append(row)
    return rows


def _read_parquet(path: Path) -> list[dict[str, Any]]:
    import pyarrow.parquet as pq  # heavy: imported only when a Parquet file is read

    try:
        table = pq.read_table(path)
    except Exception as e:  # pyarrow raises its own ArrowInvalid etc.
        raise ValueError(f"{path}: not a readable Parquet file ({e})") from None
    return table.to_pylist()
