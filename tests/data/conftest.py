"""Fixtures for the data tests: the shared reference data sets (skipped with a message where absent)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest


def shared_data_dir() -> Path:
    """``$JETRL_SHARED_DATA``, else ``../shared/data`` next to the repository root."""
    env = os.environ.get("JETRL_SHARED_DATA")
    if env:
        return Path(env)
    return Path(__file__).resolve().parents[2] / ".." / "shared" / "data"


def _rows(relative: str) -> list[dict]:
    path = shared_data_dir() / relative
    if not path.exists():
        pytest.skip(f"reference data {relative} not found under {shared_data_dir()} (set JETRL_SHARED_DATA)")
    with path.open(encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


@pytest.fixture(scope="session")
def gsm8k_test_path() -> Path:
    _rows("gsm8k/test.jsonl")
    return shared_data_dir() / "gsm8k" / "test.jsonl"


@pytest.fixture(scope="session")
def math500_path() -> Path:
    _rows("math500/test.jsonl")
    return shared_data_dir() / "math500" / "test.jsonl"


@pytest.fixture(scope="session")
def gsm8k_test_rows() -> list[dict]:
    return _rows("gsm8k/test.jsonl")


@pytest.fixture(scope="session")
def math500_rows() -> list[dict]:
    return _rows("math500/test.jsonl")
