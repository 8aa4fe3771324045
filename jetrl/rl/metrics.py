"""The per-step metrics: what one RL step reports, and where it goes (a JSONL file, TensorBoard, timers).

**What a step reports.** :func:`step_metrics` assembles :meth:`jetrl.rl.trainer.Trainer.step`'s flat
``group/name`` dict, as pure functions of what the step produced (the names: ``docs/metrics.md``).

**JSONL.** One JSON object per line, one line per logged step, written with a single ``write`` of the
whole line on a file opened for appending and flushed at once, so a crash leaves at most one partial
last line. The *cursor* is the file's byte length; a checkpoint stores it, and a resumed run truncates
the file to it, so the log holds each step exactly once, in order (the steps after the checkpoint are
re-run and re-logged). Non-finite floats are written as the strings ``"nan"``, ``"inf"``, ``"-inf"``
(strict JSON has no NaN).

**Timers.** :class:`PhaseTimer` synchronises the CUDA device at the phase boundaries, so that asynchronous
kernels are charged to the phase that launched them.
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

import numpy as np
import torch

from jetrl.rl.advantages import num_zero_variance_groups
from jetrl.rl.batch import RolloutBatch
from jetrl.rl.losses import _as_bool_mask, aggregate, kl_penalty
from jetrl.rl.mismatch import mismatch_metrics

# the engine's stats a step reports, by metric name (host and graph-capture time are parts of time/rollout), and how
# ranks that each ran an engine combine them (every rank decodes its share at the same time: preemptions and
# throughputs add up; host and capture times overlap; the KV capacity is one engine's, as a memory budget is one GPU's)
ENGINE_STATS = (("preemptions", "rollout/preemptions", "sum"),
                ("kv_capacity_tokens", "rollout/kv_capacity_tokens", "max"),
                ("decode_tokens_per_s", "throughput/rollout_decode_tokens_per_s", "sum"),
                ("host_seconds", "time/rollout_host", "max"),
                ("graph_capture_seconds", "time/rollout_graph_capture", "max"))


def global_engine_stats(stats: Mapping[str, float], parallel: Any) -> dict[str, float]:
    """``stats`` (this rank's engine's ``last_stats``) with the reported ones combined over ``parallel``'s ranks
    (:data:`ENGINE_STATS`), so a data-parallel run's metrics read like one engine's. A collective: every rank
    calls it."""
    out = dict(stats)
    if parallel.is_distributed:
        for op in ("sum", "max"):
            keys = [key for key, _, how in ENGINE_STATS if how == op]
            out.update(zip(keys, getattr(parallel, op)([float(stats.get(key, 0.0)) for key in keys])))
    return out


def batch_metrics(batch: RolloutBatch) -> dict[str, float]:
    """Rewards (``(P, n)``), response lengths and truncation, and advantages of one rollout batch.

    ``reward/accuracy`` is the share of rewards >= 1; ``reward/zero_variance_*`` the prompts whose samples all got
    the same reward (no signal under a group baseline); ``reward/errors`` and ``reward/timeouts`` the samples
    whose reward failed (scored 0)."""
    rewards = batch.rewards
    lengths = torch.tensor(batch.response_lens, dtype=torch.float32)
    num_flat = num_zero_variance_groups(rewards)
    return {
        "reward/mean": float(rewards.mean()),
        "reward/std": float(rewards.std()) if rewards.numel() > 1 else 0.0,
        "reward/accuracy": float((rewards >= 1.0).float().mean()),
        "reward/zero_variance_groups": float(num_flat),
        "reward/zero_variance_frac": num_flat / rewards.shape[0],
        "reward/errors": float(batch.num_reward_errors),
        "reward/timeouts": float(batch.num_reward_timeouts),
        "response/length_mean": float(lengths.mean()),
        "response/length_max": float(lengths.max()),
        "response/truncation_rate": sum(batch.truncated) / len(batch.truncated),
        "advantage/mean": float(batch.advantages.mean()),
        "advantage/abs_mean": float(batch.advantages.abs().mean()),
    }


def logprob_metrics(rollout_logprobs: torch.Tensor, train_logprobs: torch.Tensor, mask: torch.Tensor,
                    ref_logprobs: torch.Tensor | None = None, tis_cap: float | None = None,
                    checked: torch.Tensor | None = None) -> dict[str, float]:
    """``mismatch/*``: the rollout's against the training side's log-probs of the same ``(S, R)`` tokens
    (see :func:`jetrl.rl.mismatch.mismatch_metrics`); with ``ref_logprobs``, ``kl_ref/k3``: the k3
    estimate of KL(policy || reference) averaged over the valid tokens. ``checked`` ((S, R) bool): the tokens
    whose training-side log-prob was computed, where not all were; the ``mismatch/*`` statistics are then over
    those, and ``mismatch/checked_frac`` is their share of the valid tokens."""
    checked_mask = mask if checked is None else _as_bool_mask(mask) & _as_bool_mask(checked)
    mm = mismatch_metrics(rollout_logprobs, train_logprobs, checked_mask, tis_cap=tis_cap)
    out = {f"mismatch/{k}": v for k, v in mm.items() if k != "num_tokens"}
    if checked is not None:
        valid, seen = float(_as_bool_mask(mask).sum()), float(checked_mask.sum())
        out["mismatch/checked_frac"] = seen / max(valid, 1.0)
        if seen == 0 < valid:  # nothing was checked: not a zero mismatch
            out.update({k: math.nan for k in out if k != "mismatch/checked_frac"})
    if ref_logprobs is not None:
        out["kl_ref/k3"] = float(aggregate(kl_penalty(train_logprobs, ref_logprobs, mask, "k3"), mask))
    return out


def timing_metrics(seconds: Mapping[str, float], tokens_per_phase: Mapping[str, float]) -> dict[str, float]:
    """``time/<phase>`` and ``time/step`` (their sum), and ``throughput/<phase>_tokens_per_s`` for the
    phases that ran and have a token count."""
    out = {**{f"time/{k}": v for k, v in seconds.items()}, "time/step": sum(seconds.values())}
    out.update({f"throughput/{phase}_tokens_per_s": count / max(seconds[phase], 1e-9)
                for phase, count in tokens_per_phase.items() if phase in seconds})
    return out


def step_metrics(batch: RolloutBatch, train_logprobs: torch.Tensor, ref_logprobs: torch.Tensor | None,
                 actor: Mapping[str, float], seconds: Mapping[str, float], *, generated_tokens: float,
                 ppo_epochs: int, tis_cap: float | None = None, engine_stats: Mapping[str, float] | None = None,
                 checked: torch.Tensor | None = None) -> dict[str, float]:
    """One RL step's metrics (flat ``group/name`` keys), assembled from what its phases produced:
    ``train_logprobs`` are the training side's ``(S, R)`` log-probs of the batch's tokens, ``ref_logprobs`` the
    reference policy's (with a KL penalty), ``actor`` the update's ``actor/*`` metrics, ``seconds`` the wall time
    per phase, ``engine_stats`` the engine's ``last_stats``. The scoring phases' throughput counts every token of
    every sequence, the update's ``ppo_epochs`` times. ``checked``: see :func:`logprob_metrics` (exact mode
    without the old_logprob pass; ``train_logprobs`` holds the engine's outside it)."""
    scored_tokens = float(sum(t.numel() for t in batch.tokens))
    phase_tokens = {"rollout": generated_tokens, "old_logprob": scored_tokens, "reference": scored_tokens,
                    "update": scored_tokens * ppo_epochs}
    engine_stats = engine_stats or {}
    return {**batch_metrics(batch),
            **logprob_metrics(batch.rollout_logprobs, train_logprobs, batch.mask, ref_logprobs, tis_cap, checked),
            **actor, **timing_metrics(seconds, phase_tokens), "response/num_tokens": float(batch.mask.sum()),
            **{name: float(engine_stats[key]) for key, name, _ in ENGINE_STATS if key in engine_stats}}


def _jsonable(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        value = value.item() if value.numel() == 1 else value.tolist()
    if isinstance(value, float) and not math.isfinite(value):
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
    if isinstance(value, Mapping):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, np.generic):
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
        self._file.write((json.dumps(_jsonable(record), allow_nan=False, separators=(",", ":")) + "\n").encode())
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


METRICS_FILE = "metrics.jsonl"  # a run's per-step metrics, one JSON object a line (jetrl.plotting reads it)
TENSORBOARD_SUBDIR = "tensorboard"


class MetricsLogger:
    """Fans one step's metrics out to the JSONL log and, optionally, TensorBoard's scalars (imported lazily; when
    ``tensorboard`` is not installed, a warning and the JSONL log alone)."""

    def __init__(self, output_dir: str | Path, tensorboard: bool = False, resume_cursor: int | None = None) -> None:
        self.jsonl = JsonlWriter(Path(output_dir) / METRICS_FILE, resume_cursor=resume_cursor)
        self.tensorboard = None
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:
                warnings.warn("tensorboard is not installed (pip install tensorboard); metrics go to JSONL only",
                              stacklevel=2)
            else:
                self.tensorboard = SummaryWriter(log_dir=str(Path(output_dir) / TENSORBOARD_SUBDIR))

    def log(self, step: int, metrics: Mapping[str, Any]) -> None:
        self.jsonl.write({"step": step, **metrics})
        if self.tensorboard is not None:
            for key, value in metrics.items():
                if isinstance(value, np.generic) or (isinstance(value, torch.Tensor) and value.numel() == 1):
                    value = value.item()
                if isinstance(value, (int, float)) and not isinstance(value, bool):  # NaN and inf too: a scalar
                    self.tensorboard.add_scalar(key, value, global_step=step)
            self.tensorboard.flush()

    def close(self) -> None:
        self.jsonl.close()
        if self.tensorboard is not None:
            self.tensorboard.close()


class PhaseTimer:
    """Accumulates wall-clock seconds per phase: ``with timer.phase("rollout"): ...``; on a GPU also each phase's
    peak of allocated memory (:meth:`memory_metrics`; the device's peak counter is reset as a phase starts)."""

    def __init__(self, device: torch.device | str | None = None) -> None:
        self._device = torch.device(device) if device is not None else None
        self._cuda = self._device is not None and self._device.type == "cuda"
        self.seconds: dict[str, float] = {}
        self.peak_bytes: dict[str, int] = {}

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        if self._cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats(self._device)
        start = time.perf_counter()
        try:
            yield
        finally:
            if self._cuda:
                torch.cuda.synchronize()
                peak = torch.cuda.max_memory_allocated(self._device)
                self.peak_bytes[name] = max(self.peak_bytes.get(name, 0), peak)
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - start

    def memory_metrics(self) -> dict[str, float]:
        """``memory/<phase>_peak_gib`` per phase and ``memory/peak_gib`` (their maximum); empty off the GPU."""
        out = {f"memory/{k}_peak_gib": v / 2 ** 30 for k, v in self.peak_bytes.items()}
        if out:
            out["memory/peak_gib"] = max(out.values())
        return out


__all__ = ["METRICS_FILE", "TENSORBOARD_SUBDIR", "step_metrics", "global_engine_stats", "batch_metrics",
           "logprob_metrics", "timing_metrics", "ENGINE_STATS", "JsonlWriter", "read_jsonl", "MetricsLogger",
           "PhaseTimer"]
