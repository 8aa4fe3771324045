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

Every child starts the same way, importing torch and Triton (seconds of CPU each): one process, the "zygote",
imports them once under the interpreter and forks each child from there (:class:`_Zygote`), so that a child
runs its snippet as ``python -c`` would, without paying for those imports again.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import signal
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
    proc: _Forked
    stdout: object  # temporary files, not pipes: a child writing much to stderr never blocks on a full pipe
    stderr: object


_STARTED: dict[str, _Child] = {}
_QUEUE: list[str] = []  # children queued by prestart, not started yet, in the order of their tests
_LOCK = threading.Lock()  # guards both: the feeder thread starts queued children while a test waits


def _key(child: str) -> str:
    return hashlib.sha1(child.encode()).hexdigest()


def _triton_installed() -> bool:
    return importlib.util.find_spec("triton") is not None


def _env() -> dict[str, str]:
    return dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))


def _lower_priority(pid: int) -> None:
    if hasattr(os, "setpriority"):
        try:
            os.setpriority(os.PRIO_PROCESS, pid, 19)  # the lowest priority: the suite's process comes first
        except OSError:  # gone already, or not allowed here: it runs at the ordinary priority
            pass


# The zygote: imports what every child imports first, then reads one request a line on stdin (JSON: id, code and
# the two output files) and forks a child for it that runs the code as ``python -c`` would; it reports on its
# stdout ``started ID PID`` and ``exit ID STATUS`` (STATUS as subprocess's returncode). At the end of its stdin it
# kills the children still running and exits.
_ZYGOTE = r'''
import json, os, select, signal, sys, time, traceback
import torch, triton, triton.language  # noqa: F401

def run(code, stdout, stderr):
    os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
    for fd, path in ((1, stdout), (2, stderr)):
        os.dup2(os.open(path, os.O_WRONLY | os.O_TRUNC), fd)
    sys.argv = ["-c"]
    status = 0
    try:
        exec(compile(code, "<string>", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
    except SystemExit as e:
        if isinstance(e.code, int) or e.code is None:
            status = e.code or 0
        else:
            print(e.code, file=sys.stderr)
            status = 1
    except BaseException:
        traceback.print_exc()
        status = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)

report = os.fdopen(os.dup(1), "w", buffering=1)
os.dup2(os.open(os.devnull, os.O_WRONLY), 1)
children, pending, stdin_open = {}, b"", True
while stdin_open or children:
    if stdin_open and select.select([0], [], [], 0.1)[0]:
        data = os.read(0, 65536)
        stdin_open = bool(data)
        pending += data
        while b"\n" in pending:
            line, pending = pending.split(b"\n", 1)
            request = json.loads(line)
            pid = os.fork()
            if pid == 0:
                os.close(report.fileno())
                run(request["code"], request["stdout"], request["stderr"])
            children[pid] = request["id"]
            report.write(f"started {request['id']} {pid}\n")
        if not stdin_open:
            for pid in children:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
    elif not stdin_open:
        time.sleep(0.1)
    while children:
        pid, status = os.waitpid(-1, os.WNOHANG)
        if pid == 0:
            break
        report.write(f"exit {children.pop(pid)} {os.waitstatus_to_exitcode(status)}\n")
'''


class _Forked:
    """A child forked by the zygote, with the calls of ``subprocess.Popen`` this module uses."""

    def __init__(self, zygote: _Zygote, ident: int, stderr_path: str) -> None:
        self.zygote, self.ident, self.stderr_path = zygote, ident, stderr_path
        self.pid: int | None = None  # once the zygote has reported it
        self.returncode: int | None = None
        self.kill_asked = False

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        with self.zygote.changed:
            if not self.zygote.changed.wait_for(lambda: self.returncode is not None, timeout):
                raise subprocess.TimeoutExpired(f"interpreted child {self.ident}", timeout)
        return self.returncode

    def kill(self) -> None:
        with self.zygote.changed:
            self.kill_asked = True
            if self.pid is not None and self.returncode is None:
                try:
                    os.kill(self.pid, signal.SIGKILL)
                except ProcessLookupError:  # ended already: its exit is on the way
                    pass


class _Zygote:
    """The process the children fork from (``_ZYGOTE``), and a thread that reads its reports."""

    def __init__(self) -> None:
        self.stderr = tempfile.TemporaryFile(mode="w+")
        self.proc = subprocess.Popen([sys.executable, "-c", _ZYGOTE], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self.stderr, text=True, env=_env(), cwd=ROOT)
        _lower_priority(self.proc.pid)  # the children inherit it
        self.children: dict[int, _Forked] = {}
        self.changed = threading.Condition()
        threading.Thread(target=self._read, name="interpreted-zygote", daemon=True).start()

    def fork(self, child: str, stdout: str, stderr: str) -> _Forked:
        with self.changed:
            forked = self.children[len(self.children)] = _Forked(self, len(self.children), stderr)
            self.proc.stdin.write(json.dumps({"id": forked.ident, "code": child, "stdout": stdout,
                                              "stderr": stderr}) + "\n")
            self.proc.stdin.flush()
        return forked

    def _read(self) -> None:
        for line in self.proc.stdout:
            what, ident, value = line.split()
            with self.changed:
                forked = self.children[int(ident)]
                if what == "started":
                    forked.pid = int(value)
                    if forked.kill_asked:
                        os.kill(forked.pid, signal.SIGKILL)
                else:
                    forked.returncode = int(value)
                self.changed.notify_all()
        self.proc.wait()
        self.stderr.seek(0)
        died = f"the zygote exited with status {self.proc.returncode}: {self.stderr.read()[-2000:]}"
        with self.changed:  # children whose end was not reported: failed
            for forked in self.children.values():
                if forked.returncode is None:
                    forked.returncode = -9
                    with open(forked.stderr_path, "a") as f:
                        f.write(died)
            self.changed.notify_all()

    def close(self) -> None:
        """End the zygote: it kills the children still running first."""
        try:
            self.proc.stdin.close()
        except OSError:
            pass
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


_ZYGOTE_PROCESS: _Zygote | None = None


def _start(child: str) -> _Child:
    """Fork ``child`` from the zygote (started on first use)."""
    global _ZYGOTE_PROCESS
    if _ZYGOTE_PROCESS is None:
        _ZYGOTE_PROCESS = _Zygote()
    out = tempfile.NamedTemporaryFile(mode="w+")  # named: the child opens them by path
    err = tempfile.NamedTemporaryFile(mode="w+")
    return _Child(_ZYGOTE_PROCESS.fork(child, out.name, err.name), out, err)


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
    """Kill children nobody waited for (a test run cut short, or their tests deselected after collection), then
    end the zygote."""
    global _ZYGOTE_PROCESS
    with _LOCK:
        _QUEUE.clear()
        for started in _STARTED.values():
            if started.proc.poll() is None:
                started.proc.kill()
                started.proc.wait()
        _STARTED.clear()
        if _ZYGOTE_PROCESS is not None:
            _ZYGOTE_PROCESS.close()
            _ZYGOTE_PROCESS = None


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
