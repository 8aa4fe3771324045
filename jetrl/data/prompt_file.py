"""Prompts given on a command line: arguments, and a text or JSONL file of them (``jetrl generate``)."""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

from jetrl.data.sources import read_jsonl, read_text, table_kind


def read_prompts(prompts: Sequence[str], file: str | None) -> list[str]:
    """Prompts from the arguments, then from ``file`` (UTF-8; one per line, where the two characters ``\\n``
    stand for a line break; the lines of a JSONL file, named as a dataset's are (``.jsonl``, ``.json``,
    ``.ndjson``, any case), take their "prompt"). A missing file, a Parquet file, bytes that are not UTF-8, or a
    JSONL line that is not an object, has no "prompt" or holds neither text nor a number there is an error
    naming the file (and the line or row); so is no prompt at all."""
    out = list(prompts)
    if file:
        path, fix = Path(file), "give a text file with one prompt per line, or JSONL with 'prompt'"
        if not path.exists():
            raise FileNotFoundError(f"prompt file {file} does not exist; {fix}")
        if path.is_dir():
            raise ValueError(f"prompt file {file} is a folder; {fix}")
        kind = table_kind(path)
        if kind == "parquet":
            raise ValueError(f"prompt file {file} is Parquet; {fix}")
        if kind == "jsonl":
            for i, row in enumerate(read_jsonl(path, required=("prompt",)), start=1):
                if not isinstance(row["prompt"], (str, int, float)):  # as a dataset's prompt column
                    raise ValueError(f"prompt file {file}: row {i}'s 'prompt' is a {type(row['prompt']).__name__}, "
                                     f"not text")
                out.append(str(row["prompt"]))
        else:
            out += [line.replace("\\n", "\n") for line in read_text(path).splitlines() if line.strip()]
    if not out:
        raise ValueError("no prompts: pass them as arguments or with --file")
    return out


__all__ = ["read_prompts"]
