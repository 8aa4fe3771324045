"""Prompts given on a command line: arguments, and a text or JSONL file of them (``jetrl generate``)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Sequence


def read_prompts(prompts: Sequence[str], file: str | None) -> list[str]:
    """Prompts from the arguments, then from ``file`` (UTF-8; one per line, where the two characters ``\\n``
    stand for a line break; JSONL lines take their "prompt"). A missing file, bytes that are not UTF-8, a
    JSONL line that is not an object with "prompt", or no prompt at all is an error naming the file and line."""
    out = list(prompts)
    if file:
        path = Path(file)
        if not path.exists():
            raise FileNotFoundError(f"prompt file {file} does not exist; give a text file with one prompt per line, "
                                    f"or JSONL with 'prompt'")
        raw = path.read_bytes()
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            line = raw[:e.start].count(b"\n") + 1
            raise ValueError(f"{file} line {line} is not UTF-8 text") from None
        for i, line in enumerate(text.splitlines()):
            if not line.strip():
                continue
            if path.suffix == ".jsonl":
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as e:
                    raise ValueError(f"{file} line {i + 1} is not JSON: {e}") from None
                if not isinstance(row, dict) or "prompt" not in row:
                    raise ValueError(f"{file} line {i + 1} has no 'prompt' field")
                out.append(str(row["prompt"]))
            else:
                out.append(line.replace("\\n", "\n"))
    if not out:
        raise ValueError("no prompts: pass them as arguments or with --file")
    return out


__all__ = ["read_prompts"]
