"""Reward computation in worker processes with a per-sample timeout.

A reward function is user code: it may loop forever on a pathological completion (a sympy expression that
never simplifies), raise, or crash its interpreter. :class:`RewardPool` runs it in ``num_workers``
processes (started by ``forkserver``, so it is safe next to torch and CUDA) and guarantees that
``score()`` returns in bounded time: a sample that runs past ``timeout_s`` scores 0.0 and is counted as a
timeout, its worker is killed and replaced, and the rest of that worker's work is handed out again; a
sample that raises (or returns a non-finite value, or one beyond ``max_abs_reward``: a reward of 1e30 is a
bug, not a very good answer) scores 0.0 and is counted as an error; a worker that dies takes only its
current sample with it.

Samples travel in chunks, results come back one message per sample, so the parent always knows which
sample a worker is on and when it started. Worst case for one call: about ``ceil(n / num_workers) *
timeout_s`` plus restarts. A failed sample is never silent: see :class:`RewardFailureGuard`.
"""

from __future__ import annotations

import contextlib
import math
import multiprocessing as mp
import os
import pickle
import signal
import threading
import time
import warnings
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from typing import Any

from jetrl.data.rewards import RewardFn, resolve_reward, warm_up

MAX_ERROR_MESSAGES = 10
MAX_MESSAGE_CHARS = 500  # an error message is kept (and printed) as an excerpt of at most this many characters
MAX_STARTUP_DEATHS = 3  # consecutive worker deaths before start-up before the pool gives up
START_METHOD = "forkserver"  # fast restarts, and safe next to torch and CUDA
STARTUP_TIMEOUT_S = 120.0  # for a worker to import the reward function and warm up


@dataclass
class RewardPoolConfig:
    """``num_workers`` processes (0: compute inline in the caller, no timeout enforcement -- for
    debugging only); ``timeout_s`` per sample; ``chunk_size`` samples per message; ``max_abs_reward``: a reward
    whose magnitude exceeds it scores 0.0 and counts as an error (None: only non-finite rewards do)."""

    num_workers: int = 2
    timeout_s: float = 10.0
    chunk_size: int = 16
    max_abs_reward: float | None = None

    def __post_init__(self) -> None:
        if self.max_abs_reward is not None and (
                isinstance(self.max_abs_reward, bool) or not isinstance(self.max_abs_reward, (int, float))
                or not self.max_abs_reward > 0 or not math.isfinite(self.max_abs_reward)):
            raise ValueError(f"max_abs_reward must be a positive finite number or None, got {self.max_abs_reward!r}")
        if not isinstance(self.num_workers, int) or self.num_workers < 0:
            raise ValueError(f"num_workers must be an int >= 0, got {self.num_workers!r}")
        if not isinstance(self.chunk_size, int) or self.chunk_size < 1:
            raise ValueError(f"chunk_size must be an int >= 1, got {self.chunk_size!r}")
        if not isinstance(self.timeout_s, (int, float)) or not math.isfinite(self.timeout_s) or self.timeout_s <= 0:
            raise ValueError(f"timeout_s must be a positive finite number of seconds, got {self.timeout_s!r}")


@dataclass
class RewardResult:
    """Rewards in input order, and what went wrong. ``status[i]`` is ``"ok"``, ``"timeout"`` or
    ``"error"``; ``errors`` holds the messages of the lowest-numbered failed samples (``"sample i: ..."``, at most
    :data:`MAX_ERROR_MESSAGES`), so the first one does not depend on which worker finished first."""

    rewards: list[float]
    status: list[str]
    num_timeouts: int = 0
    num_errors: int = 0
    errors: list[str] = field(default_factory=list)
    _failures: list[tuple[int, str]] = field(default_factory=list, repr=False)  # every failure, in arrival order

    @property
    def num_failed(self) -> int:
        return self.num_timeouts + self.num_errors


def excerpt(text: str, limit: int = MAX_MESSAGE_CHARS) -> str:
    """``text`` if it is at most ``limit`` characters, else its start and end around a ``[... N chars ...]``
    mark (an error message may quote a whole pathological completion)."""
    if len(text) <= limit:
        return text
    head, tail = (limit - 40) * 2 // 3, (limit - 40) // 3
    return f"{text[:head]} [... {len(text) - head - tail} chars ...] {text[len(text) - tail:]}"


def _call_reward(fn: RewardFn, completion: str, reference: str) -> tuple[float, str | None]:
    """(reward, None) or (0.0, error message): never raises for a bad sample."""
    try:
        raw = fn(completion, reference)
        if isinstance(raw, (str, bytes)):  # float() would read "1" as a number: a reward returns one
            raise TypeError(f"the reward returned {type(raw).__name__} {raw!r}, not a number")
        value = float(raw)
    except Exception as e:  # a reward function's bug or a pathological input: score 0, report
        return 0.0, excerpt(f"{type(e).__name__}: {e}")
    if not math.isfinite(value):
        return 0.0, f"non-finite reward {value}"
    return value, None


def _watch_parent(parent_pid: int) -> None:
    """Exit when the process that started us goes away (so a hung worker cannot outlive its run)."""
    while True:
        time.sleep(1.0)
        if os.getppid() != parent_pid:
            os._exit(1)


def _worker_main(conn: Connection, payload: bytes) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle
    threading.Thread(target=_watch_parent, args=(os.getppid(),), daemon=True).start()
    try:
        fn = resolve_reward(pickle.loads(payload))
        warm_up(fn)
    except BaseException as e:
        conn.send(("init_error", f"{type(e).__name__}: {e}"))
        return
    conn.send(("ready", None))
    with contextlib.suppress(EOFError):  # the parent closed the pipe: done, as on its None
        for chunk in iter(conn.recv, None):
            for index, completion, reference in chunk:
                conn.send((index, *_call_reward(fn, completion, reference)))


class _Worker:
    def __init__(self, ctx: Any, payload: bytes) -> None:
        self.conn, child_conn = ctx.Pipe(duplex=True)
        self.process = ctx.Process(target=_worker_main, args=(child_conn, payload), daemon=True)
        self.process.start()
        child_conn.close()
        self.started_at = time.monotonic()
        self.ready = False
        self.pending: deque[tuple[int, str, str]] = deque()  # samples sent, not yet answered
        self.progress_at = 0.0  # when the current sample started (last message or dispatch)

    def kill(self) -> None:
        if self.process.is_alive():
            self.process.kill()
        self.process.join(timeout=5)
        self.conn.close()


class RewardPool:
    """Score completions against references with ``reward_fn`` in worker processes.

    ``reward_fn`` is a reward name or dotted path (see :func:`jetrl.data.rewards.resolve_reward`) or a
    picklable callable (a module-level function, a ``functools.partial`` of one, what
    :func:`~jetrl.data.rewards.build_reward_fn` returns). Workers start at construction and persist across
    calls; use the pool as a context manager or call :meth:`close`.
    """

    def __init__(self, reward_fn: str | RewardFn, config: RewardPoolConfig | None = None) -> None:
        self.config = config or RewardPoolConfig()
        self._fn = resolve_reward(reward_fn)  # fails now, with a clear message, on a bad name
        try:
            self._payload = pickle.dumps(reward_fn)
        except Exception as e:
            raise TypeError(f"reward function {reward_fn!r} cannot be sent to worker processes ({e}); define it at "
                            "module level (no lambdas or closures) or name it as 'package.module:function'") from None
        self._startup_deaths = 0
        self._workers: list[_Worker] = []
        if self.config.num_workers > 0:
            self._ctx = mp.get_context(START_METHOD)
            self._workers = [_Worker(self._ctx, self._payload) for _ in range(self.config.num_workers)]

    def __enter__(self) -> RewardPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.close()

    def close(self) -> None:
        """Stop the workers (politely, then by force)."""
        for worker in self._workers:
            with contextlib.suppress(OSError, ValueError):
                worker.conn.send(None)
        deadline = time.monotonic() + 2.0
        for worker in self._workers:
            worker.process.join(timeout=max(0.0, deadline - time.monotonic()))
            worker.kill()
        self._workers = []

    def score(self, completions: Sequence[str], references: Sequence[str]) -> RewardResult:
        """Reward of each completion against its reference, in order, in bounded time."""
        if len(completions) != len(references):
            raise ValueError(f"got {len(completions)} completions but {len(references)} references")
        for name, seq in (("completions", completions), ("references", references)):
            bad = next((i for i, s in enumerate(seq) if not isinstance(s, str)), None)
            if bad is not None:
                raise TypeError(f"{name}[{bad}] is a {type(seq[bad]).__name__}, expected str")
        n = len(completions)
        result = RewardResult(rewards=[0.0] * n, status=["ok"] * n)
        if self.config.num_workers == 0:
            for i in range(n):
                self._record(result, i, *_call_reward(self._fn, completions[i], references[i]))
        elif n:  # no samples: nothing to send (a closed pool too)
            if not self._workers:
                raise RuntimeError("RewardPool.score() called after close()")
            try:
                self._score_in_workers(result, completions, references)
            except BaseException:  # e.g. Ctrl-C: busy workers hold stale work, never reuse them
                for worker in list(self._workers):
                    if worker.pending:
                        self._replace(worker)
                raise
        # the messages of the lowest-numbered failed samples, whatever order the workers finished in
        result.errors = [message for _, message in sorted(result._failures)[:MAX_ERROR_MESSAGES]]
        return result

    def _record(self, result: RewardResult, index: int, value: float, error: str | None, kind: str = "error") -> None:
        bound = self.config.max_abs_reward
        if error is None and bound is not None and abs(value) > bound:
            value, error = 0.0, f"reward {value:g} is beyond max_abs_reward={bound:g}"
        result.rewards[index] = value
        if error is None:
            return
        result.status[index] = kind
        if kind == "timeout":
            result.num_timeouts += 1
        else:
            result.num_errors += 1
        result._failures.append((index, f"sample {index}: {error}"))

    def _replace(self, worker: _Worker) -> _Worker:
        worker.kill()
        fresh = _Worker(self._ctx, self._payload)
        self._workers[self._workers.index(worker)] = fresh
        return fresh

    def _score_in_workers(self, result: RewardResult, completions: Sequence[str], references: Sequence[str]) -> None:
        cfg = self.config
        n = len(completions)
        # Small batches are spread over all workers; large ones go in chunks of chunk_size.
        chunk_size = max(1, min(cfg.chunk_size, math.ceil(n / (4 * len(self._workers)))))
        todo: deque[tuple[int, str, str]] = deque((i, completions[i], references[i]) for i in range(n))
        remaining = n

        def fail_current(worker: _Worker, kind: str, message: str) -> None:
            """The worker's current sample fails; its other samples go back in the queue."""
            nonlocal remaining
            index, _, _ = worker.pending.popleft()
            self._record(result, index, 0.0, message, kind)
            remaining -= 1
            todo.extendleft(reversed(worker.pending))
            worker.pending.clear()

        while remaining:
            now = time.monotonic()
            for worker in list(self._workers):  # hand out work to idle ready workers
                if worker.ready and not worker.pending and todo:
                    chunk = [todo.popleft() for _ in range(min(chunk_size, len(todo)))]
                    try:
                        worker.conn.send(chunk)
                    except OSError:  # died while idle (killed from outside): nothing of ours was lost
                        todo.extendleft(reversed(chunk))
                        self._replace(worker)
                        continue
                    worker.pending.extend(chunk)
                    worker.progress_at = now
            busy = [w for w in self._workers if w.pending or not w.ready]
            deadlines = [w.progress_at + cfg.timeout_s if w.ready else w.started_at + STARTUP_TIMEOUT_S for w in busy]
            wait_s = max(0.0, min(deadlines) - time.monotonic()) if deadlines else None
            watched = {w.conn: w for w in busy}
            sentinels = {w.process.sentinel: w for w in busy}
            ready_objs = wait(list(watched) + list(sentinels), timeout=wait_s)
            now = time.monotonic()
            dead: list[_Worker] = []
            for obj in ready_objs:
                if obj in sentinels:
                    if not sentinels[obj].process.is_alive():
                        dead.append(sentinels[obj])
                    continue
                worker = watched[obj]
                try:
                    while worker.conn.poll():
                        message = worker.conn.recv()  # ("ready"|"init_error", detail) or (index, value, error)
                        if message[0] == "ready":
                            worker.ready = True
                            self._startup_deaths = 0
                        elif message[0] == "init_error":
                            self.close()
                            raise RuntimeError(f"reward worker failed to start: {message[1]}")
                        else:
                            index, value, error = message
                            sent_index, _, _ = worker.pending.popleft()
                            assert sent_index == index, "reward worker answered out of order"
                            self._record(result, index, value, error)
                            remaining -= 1
                            worker.progress_at = now
                except (EOFError, OSError):
                    dead.append(worker)
            for worker in list(self._workers):
                if worker in dead:
                    if worker.pending:
                        worker.process.join(timeout=1.0)
                        fail_current(worker, "error", f"reward worker died (exit code {worker.process.exitcode})")
                    elif not worker.ready:
                        self._startup_deaths += 1
                        if self._startup_deaths >= MAX_STARTUP_DEATHS:
                            code = worker.process.exitcode
                            self.close()
                            raise RuntimeError(f"reward workers died while starting, {MAX_STARTUP_DEATHS} times in a "
                                               f"row (last exit code {code}); is the reward function importable in "
                                               "a fresh process? (see its traceback above)")
                    self._replace(worker)
                elif worker.pending and now - worker.progress_at > cfg.timeout_s:
                    fail_current(worker, "timeout", f"timed out after {cfg.timeout_s:g} s")
                    self._replace(worker)
                elif not worker.ready and now - worker.started_at > STARTUP_TIMEOUT_S:
                    self.close()
                    raise RuntimeError(f"reward worker did not start within {STARTUP_TIMEOUT_S:g} s")


class RewardFailureError(RuntimeError):
    """Too many of one call's samples failed to be scored (see :class:`RewardFailureGuard`)."""


class RewardFailureGuard:
    """Makes failed rewards visible (the RL loop runs it after every call): :meth:`check` reports the first
    failure's message (an excerpt) once per guard (to ``log``; by default as a :class:`RuntimeWarning`), and
    raises :class:`RewardFailureError` when at least ``stop_fraction`` of a result's samples failed (errors and
    timeouts together).

    The default ``stop_fraction=1.0`` stops only when *every* sample failed: then the reward function
    itself is broken (wrong signature, a reference format it cannot read, a crash on import) and every
    advantage would be zero, so the run could never learn. A lower value also stops on partial failure,
    e.g. ``0.5`` when half of a step's samples failed."""

    def __init__(self, stop_fraction: float = 1.0, log: Callable[[str], None] | None = None) -> None:
        if isinstance(stop_fraction, bool) or not isinstance(stop_fraction, (int, float)) \
                or not 0 < stop_fraction <= 1:
            raise ValueError(f"stop_fraction must be in (0, 1], got {stop_fraction!r}")
        self.stop_fraction = float(stop_fraction)
        # by default a Python warning (``jetrl`` prints it as one ``jetrl: warning:`` line)
        self.log = log if log is not None else lambda message: warnings.warn(message, RuntimeWarning, stacklevel=3)
        self.has_reported = False

    def check(self, result: RewardResult, step_counts: Sequence[int] | None = None) -> None:
        """``step_counts``: ``(errors, timeouts, samples)`` of the whole step where ``result`` is one rank's share
        (the stop rule is the step's, and every rank decides alike); by default ``result``'s own."""
        errors, timeouts, n = step_counts if step_counts is not None else (
            result.num_errors, result.num_timeouts, len(result.rewards))
        failed = errors + timeouts
        if not n or not failed:
            return
        first = result.errors[0] if result.errors else "(on another rank)"
        counts = f"{errors} errors, {timeouts} timeouts"
        if failed >= self.stop_fraction * n:
            raise RewardFailureError(f"the reward failed for {failed} of {n} samples ({counts}), at "
                                     f"least {self.stop_fraction:g} of them; stopping the run. First failure: "
                                     f"{excerpt(first)}")
        if not self.has_reported:
            self.has_reported = True
            self.log(f"the reward failed for {failed} of {n} samples ({counts}); they score "
                     f"0.0 and are counted in reward/errors and reward/timeouts. First failure: {excerpt(first)} "
                     "(reported once)")
