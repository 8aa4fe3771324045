"""Where the per-step metrics go: a JSONL file (always), TensorBoard (optional), and phase timers.

**JSONL.** One JSON object per line, one line per logged step, written with a single ``write`` of the
whole line on a file opened for appending and flushed at once, so a crash leaves at most one partial
last line. The *cursor* is the file's byte length; a checkpoint stores it, and a resumed run truncates
the file to it, so the log holds each step exactly once, in order (the steps after the checkpoint are
re-run and re-logged). Non-finite floats are written as the strings ``"nan"``, ``"inf"``, ``"-inf"``
(strict JSON has no NaN).

**TensorBoard.** Imported lazily; when ``tensorboard`` is not installed the writer warns once and does
nothing.

**Timers.** :class:`PhaseTimer` measures wall time per named phase (rollout, reference, old-logprob,
update, weight refresh), synchronising the CUDA device at the boundaries when one is used, so that
asynchronous kernels are charged to the phase that launched them.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import time
import warnings
from pathlib import Path
from typing import Any, Iterator, Mapping

import torch


def _jsonable(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        value = value.item() if value.numel() == 1 else value.tolist()
    if isinstance(value, float) and not math.isfinite(value):
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
    if isinstance(value, Mapping):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if hasattr(value, "item") and callable(value.item):  # numpy scalars
        return _jsonable(value.item())
    return value


class JsonlWriter:
    """Appends one JSON line per record; resumable to a byte cursor (see module doc)."""

    def __init__(self, path: str | Path, resume_cursor: int | None = None) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if resume_cursor is None:
            self.path.write_bytes(b"")  # a fresh run starts a fresh log
        else:
            size = self.path.stat().st_size if self.path.exists() else 0
            if resume_cursor > size:
                raise ValueError(f"metrics file {self.path} has {size} bytes, less than the checkpoint's cursor "
                                 f"{resume_cursor}: it does not belong to this run")
            with open(self.path, "r+b" if self.path.exists() else "wb") as f:
                f.truncate(resume_cursor)
                f.flush()
                os.fsync(f.fileno())
        self._file = open(self.path, "ab")

    def write(self, record: Mapping[str, Any]) -> None:
        line = json.dumps(_jsonable(record), allow_nan=False, separators=(",", ":")) + "\n"
        self._file.write(line.encode())
        self._file.flush()

    def cursor(self) -> int:
        """Byte length of the log with everything written so far made durable (store it in checkpoints)."""
        self._file.flush()
        os.fsync(self._file.fileno())
        return self._file.tell()

    def close(self) -> None:
        if not self._file.closed:
            self._file.close()


def read_jsonl(path: str | Path) -> list[dict[str, Any]]:
    """The records of a metrics log; a partial last line (a crash mid-write) is dropped."""
    records = []
    for line in Path(path).read_bytes().split(b"\n"):
        if not line:
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            break  # only the last line can be partial
    return records


class TensorBoardWriter:
    """Scalars to TensorBoard when it is installed; otherwise a no-op after one warning."""

    def __init__(self, log_dir: str | Path) -> None:
        self._writer = None
        try:
            from torch.utils.tensorboard import SummaryWriter
        except (ImportError, ModuleNotFoundError):
            warnings.warn("tensorboard is not installed (pip install tensorboard); metrics go to JSONL only",
                          stacklevel=2)
            return
        self._writer = SummaryWriter(log_dir=str(log_dir))

    @property
    def enabled(self) -> bool:
        return self._writer is not None

    def write(self, step: int, metrics: Mapping[str, Any]) -> None:
        if self._writer is None:
            return
        for key, value in metrics.items():
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                continue
            self._writer.add_scalar(key, value, global_step=step)
        self._writer.flush()

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()


class MetricsLogger:
    """Fans one step's metrics out to the JSONL log and, optionally, TensorBoard."""

    def __init__(self, output_dir: str | Path, tensorboard: bool = False, resume_cursor: int | None = None,
                 filename: str = "metrics.jsonl") -> None:
        self.jsonl = JsonlWriter(Path(output_dir) / filename, resume_cursor=resume_cursor)
        self.tensorboard = TensorBoardWriter(Path(output_dir) / "tensorboard") if tensorboard else None

    def log(self, step: int, metrics: Mapping[str, Any]) -> None:
        record = {"step": step, **metrics}
        self.jsonl.write(record)
        if self.tensorboard is not None:
            self.tensorboard.write(step, _jsonable(dict(metrics)))

    def cursor(self) -> int:
        return self.jsonl.cursor()

    def close(self) -> None:
        self.jsonl.close()
        if self.tensorboard is not None:
            self.tensorboard.close()


class PhaseTimer:
    """Accumulates wall-clock seconds per phase: ``with timer.phase("rollout"): ...``."""

    def __init__(self, device: torch.device | str | None = None) -> None:
        device = torch.device(device) if device is not None else None
        self._cuda = device is not None and device.type == "cuda"
        self.seconds: dict[str, float] = {}

    def _sync(self) -> None:
        if self._cuda:
            torch.cuda.synchronize()

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        self._sync()
        start = time.perf_counter()
        try:
            yield
        finally:
            self._sync()
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - start

    def metrics(self, prefix: str = "time/") -> dict[str, float]:
        return {f"{prefix}{k}": v for k, v in self.seconds.items()}

    def reset(self) -> None:
        self.seconds.clear()


__all__ = ["JsonlWriter", "read_jsonl", "TensorBoardWriter", "MetricsLogger", "PhaseTimer"]
