"""How many threads torch computes with on the CPU: :func:`configure_threads`, called where a command's work starts.

torch's default is one intra-op thread per core, which suits one process alone on a machine and fails
badly beside another busy one: its OpenMP threads spin while waiting, and a small model runs thousands of
short parallel regions a step, so when two processes' threads outnumber the cores each region waits at a
barrier for a parked thread while the other process's threads spin on the cores it needs. The reward
pool's worker processes add to the count while they score.

So by default jetrl uses at most half the cores and no more than the cores left beside the reward workers
(:func:`default_num_threads`). The user's choice wins: an explicit count (``trainer.num_threads``,
``--threads``), or else ``OMP_NUM_THREADS``, which torch already read at start-up.
"""

from __future__ import annotations

import os

import torch

THREADS_ENV = "OMP_NUM_THREADS"  # the standard variable; when set, torch's own count (read from it) stands


def available_cores() -> int:
    """The CPUs this process may run on (its affinity mask where the OS has one, else all of them)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # macOS and Windows have no affinity call
        return os.cpu_count() or 1


def default_num_threads(num_cores: int, num_reward_workers: int = 0) -> int:
    """Intra-op threads for a run on ``num_cores`` cores beside ``num_reward_workers`` reward processes: half
    the cores, no more than the cores the workers leave, at least one."""
    if num_cores < 1:
        raise ValueError(f"num_cores must be >= 1, got {num_cores}")
    if num_reward_workers < 0:
        raise ValueError(f"num_reward_workers must be >= 0, got {num_reward_workers}")
    return max(1, min(num_cores // 2, num_cores - num_reward_workers))


def configure_threads(num_threads: int | None = None, num_reward_workers: int = 0) -> int:
    """Set torch's intra-op thread count and return it: ``num_threads`` if given (>= 1); else, when
    ``OMP_NUM_THREADS`` is set, torch's count as it stands; else :func:`default_num_threads` of this
    process's cores and ``num_reward_workers``."""
    if num_threads is not None:
        if isinstance(num_threads, bool) or not isinstance(num_threads, int) or num_threads < 1:
            raise ValueError(f"the thread count must be a whole number >= 1, got {num_threads!r}")
        chosen = num_threads
    elif os.environ.get(THREADS_ENV):
        return torch.get_num_threads()
    else:
        chosen = default_num_threads(available_cores(), num_reward_workers)
    if torch.get_num_threads() != chosen:
        torch.set_num_threads(chosen)
    return chosen


__all__ = ["THREADS_ENV", "available_cores", "default_num_threads", "configure_threads"]
