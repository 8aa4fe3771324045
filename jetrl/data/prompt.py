"""The record every prompt source produces: one problem and its reference answer."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Prompt:
    """One problem for rollout.

    Exactly one of ``text`` (a plain prompt) and ``messages`` (chat turns, ``[{"role", "content"}, ...]``)
    is set. ``answer`` is the reference the reward function compares against, in the dataset's own form
    (GSM8K: the full ``answer`` text ending in ``#### N``; MATH: the ``answer`` field; built-in tasks: the
    task's reference string). ``index`` is the row in the source, stable across shuffles and resumes.
    """

    index: int
    answer: str
    text: str | None = None
    messages: tuple[dict[str, str], ...] | None = None

    def __post_init__(self) -> None:
        if (self.text is None) == (self.messages is None):
            raise ValueError(f"prompt {self.index}: set exactly one of text and messages")
        if self.messages is not None:
            messages = tuple(self.messages)
            for turn in messages:
                if not isinstance(turn, dict) or "role" not in turn or "content" not in turn:
                    raise ValueError(f"prompt {self.index}: each chat message must be a dict with 'role' and "
                                     f"'content', got {turn!r}")
            object.__setattr__(self, "messages", messages)
