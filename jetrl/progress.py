"""One progress bar for every long loop of jetrl: RL steps, SFT steps, evaluation and rollouts.

A thin layer over ``tqdm`` with the few calls the loops need, so they all look and behave the same: the
bar goes to stderr (stdout stays free for results), a disabled bar prints nothing, and the bar closes when
its ``with`` block ends, even on an error. A leaf module: it imports nothing of jetrl, so every stage may
use it.
"""

from __future__ import annotations

import sys
from typing import Any

from tqdm.auto import tqdm


class Progress:
    """A progress bar over ``total`` units (None when the total is unknown), labelled ``desc``; with
    ``enabled=False`` every call does nothing. ``set_postfix`` takes values already formatted as text."""

    def __init__(self, total: int | None, desc: str, unit: str = "it", enabled: bool = True) -> None:
        if total is not None and total < 0:
            raise ValueError(f"progress total must be >= 0 or None, got {total}")
        self._bar = tqdm(total=total, desc=desc, unit=unit, dynamic_ncols=True, file=sys.stderr) if enabled else None

    def update(self, n: int = 1) -> None:
        if self._bar is not None:
            self._bar.update(n)

    def set_postfix(self, **values: Any) -> None:
        if self._bar is not None:
            self._bar.set_postfix(values)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


__all__ = ["Progress"]
