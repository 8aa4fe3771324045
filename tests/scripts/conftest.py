"""The experiment scripts live in ``scripts/`` (run as ``python scripts/exp_*.py``, which puts that folder on
the path for their ``import exp_common``); the tests import them the same way."""

import sys
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"


@pytest.fixture(scope="session")
def scripts_path():
    sys.path.insert(0, str(SCRIPTS))
    yield SCRIPTS
    sys.path.remove(str(SCRIPTS))
