"""Run a Python snippet under the Triton interpreter in a child process and return the JSON it prints.

``TRITON_INTERPRET=1`` must be set before Triton is imported, so interpreted kernel checks run in a child
(this process, and every other test, keep their ordinary Triton). The child finds this checkout's jetrl
whether or not it is installed. Skips the calling test when Triton is not installed.

The interpreter is slow (minutes per module on 2 cores), so the children of the selected test modules are
queued right after collection (:func:`prestart`, called from ``conftest.py``) and run while the rest of the
suite does; :func:`run_interpreted` then waits for the one it needs, or starts it at once if it has not started
yet. The children run at the lowest CPU priority, at most one per core at a time besides the one a test waits
for, in the order they were queued (the order of their tests): the suite's own process keeps a core whenever
it has work (the tests that wait for a child run after the others, see ``conftest.py``), the children take
what is left, and a few at a time do not thrash the caches as all of them at once would.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
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
_QUEUE: list[str] = []  # children queued by prestart, not started yet, in the order of their tests
_LOCK = threading.Lock()  # guards both: the feeder thread starts queued children while a test waits


def _key(child: str) -> str:
    return hashlib.sha1(child.encode()).hexdigest()


def _triton_installed() -> bool:
    return importlib.util.find_spec("triton") is not None


def _start(child: str) -> _Child:
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out, err = tempfile.TemporaryFile(mode="w+"), tempfile.TemporaryFile(mode="w+")
    proc = subprocess.Popen([sys.executable, "-c", child], stdout=out, stderr=err, text=True, env=env, cwd=ROOT)
    if hasattr(os, "setpriority"):
        try:
            os.setpriority(os.PRIO_PROCESS, proc.pid, 19)  # the lowest priority: the suite's process comes first
        except OSError:  # gone already, or not allowed here: it runs at the ordinary priority
            pass
    return _Child(proc, out, err)


def _cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def _fill() -> None:
    """Start queued children while fewer than one per core run (the lock held)."""
    running = sum(started.proc.poll() is None for started in _STARTED.values())
    while _QUEUE and running < _cores():
        child = _QUEUE.pop(0)
        _STARTED[_key(child)] = _start(child)
        running += 1


def _feed() -> None:
    """Start each queued child as a running one ends, until the queue is empty."""
    while True:
        with _LOCK:
            _fill()
            if not _QUEUE:
                return
        time.sleep(0.2)


def prestart(child: str) -> None:
    """Queue ``child`` (once) to start in the background, so that its result is ready when a test asks for it."""
    if not _triton_installed():
        return
    with _LOCK:
        if _key(child) in _STARTED or child in _QUEUE:
            return
        _QUEUE.append(child)
        if len(_QUEUE) == 1:  # the feeder stops when the queue empties: start one again
            threading.Thread(target=_feed, name="interpreted-feeder", daemon=True).start()


def stop_all() -> None:
    """Kill children nobody waited for (a test run cut short, or their tests deselected after collection)."""
    with _LOCK:
        _QUEUE.clear()
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
    with _LOCK:
        if child in _QUEUE:
            _QUEUE.remove(child)  # needed now: start it beside the running ones
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
