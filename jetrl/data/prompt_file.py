"""Prompts given on a command line: arguments, and a text or JSONL file of them (``jetrl generate``)."""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

from jetrl.data.sources import read_jsonl, read_text


def read_prompts(prompts: Sequence[str], file: str | None) -> list[str]:
    """Prompts from the arguments, then from ``file`` (UTF-8; one per line, where the two characters ``\\n``
    stand for a line break; JSONL lines take their "prompt"). A missing file, bytes that are not UTF-8, a
    JSONL line that is not an object or has no "prompt", or no prompt at all is an error naming the file and
    the line."""
    out = list(prompts)
    if file:
        path = Path(file)
        if not path.exists():
            raise FileNotFoundError(f"prompt file {file} does not exist; give a text file with one prompt per line, "
                                    f"or JSONL with 'prompt'")
        if path.is_dir():
            raise ValueError(f"prompt file {file} is a folder; give a text file with one prompt per line, or JSONL "
                             f"with 'prompt'")
        if path.suffix == ".jsonl":
            out += [str(row["prompt"]) for row in read_jsonl(path, required=("prompt",))]
        else:
            out += [line.replace("\\n", "\n") for line in read_text(path).splitlines() if line.strip()]
    if not out:
        raise ValueError("no prompts: pass them as arguments or with --file")
    return out


__all__ = ["read_prompts"]
