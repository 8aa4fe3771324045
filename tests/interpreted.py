"""Run a Python snippet under the Triton interpreter in a child process and return the JSON it prints.

``TRITON_INTERPRET=1`` must be set before Triton is imported, so interpreted kernel checks run in a child
(this process, and every other test, keep their ordinary Triton). The child finds this checkout's jetrl
whether or not it is installed. Skips the calling test when Triton is not installed.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def run_interpreted(child: str, what: str, timeout: int = 600) -> dict:
    """``child``'s JSON output (it must ``json.dump`` one object to stdout); ``what`` names it in failures."""
    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed (pip install triton)")
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, env=env, cwd=ROOT,
                          timeout=timeout)
    assert proc.returncode == 0, f"interpreted {what} failed:\n{proc.stderr[-4000:]}"
    return json.loads(proc.stdout)
