"""Run a Python snippet under the Triton interpreter in a child process and return the JSON it prints.

``TRITON_INTERPRET=1`` must be set before Triton is imported, so interpreted kernel checks run in a child
(this process, and every other test, keep their ordinary Triton). The child finds this checkout's jetrl
whether or not it is installed. Skips the calling test when Triton is not installed.

The interpreter is slow (minutes per module on 2 cores), so the children of the selected test modules are
started together right after collection (:func:`prestart`, called from ``conftest.py``) and run while the
rest of the suite does; :func:`run_interpreted` then waits for the one it needs, or starts it if nobody did.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@dataclass
class _Child:
    proc: subprocess.Popen
    stdout: object  # temporary files, not pipes: a child writing much to stderr never blocks on a full pipe
    stderr: object


_STARTED: dict[str, _Child] = {}


def _key(child: str) -> str:
    return hashlib.sha1(child.encode()).hexdigest()


def _triton_installed() -> bool:
    return importlib.util.find_spec("triton") is not None


def _start(child: str) -> _Child:
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out, err = tempfile.TemporaryFile(mode="w+"), tempfile.TemporaryFile(mode="w+")
    proc = subprocess.Popen([sys.executable, "-c", child], stdout=out, stderr=err, text=True, env=env, cwd=ROOT)
    return _Child(proc, out, err)


def prestart(child: str) -> None:
    """Start ``child`` now in the background (once), so that its result is ready when a test asks for it."""
    if _triton_installed() and _key(child) not in _STARTED:
        _STARTED[_key(child)] = _start(child)


def stop_all() -> None:
    """Kill children nobody waited for (a test run cut short, or their tests deselected after collection)."""
    for started in _STARTED.values():
        if started.proc.poll() is None:
            started.proc.kill()
            started.proc.wait()
    _STARTED.clear()


def run_interpreted(child: str, what: str, timeout: int = 600) -> dict:
    """``child``'s JSON output (it must ``json.dump`` one object to stdout); ``what`` names it in failures.

    ``timeout`` counts from now, whether the child was started early or starts here."""
    if not _triton_installed():
        pytest.skip("triton is not installed (pip install triton)")
    started = _STARTED.pop(_key(child), None) or _start(child)
    try:
        returncode = started.proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        started.proc.kill()
        started.proc.wait()
        raise AssertionError(f"interpreted {what} did not finish within {timeout} s") from None
    started.stdout.seek(0)
    started.stderr.seek(0)
    stdout, stderr = started.stdout.read(), started.stderr.read()
    started.stdout.close()
    started.stderr.close()
    assert returncode == 0, f"interpreted {what} failed:\n{stderr[-4000:]}"
    return json.loads(stdout)
