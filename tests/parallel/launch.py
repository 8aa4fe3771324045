"""Run a function on N CPU ranks (gloo) the way torchrun would: one process per rank, torchrun's variables.

Processes are forked (no re-import of torch: a rank starts in milliseconds), or spawned on a machine with a CUDA
device: there the parent has asked CUDA for its devices, after which a forked child's first CUDA call (the optimizer
asks whether the stream is capturing a graph) fails with "initialization error". Each rank returns its result
through a pickle file. A rank that raises fails :func:`run_ranks` with its traceback, and the others are
terminated (``torch.multiprocessing`` does that), so a broken test cannot hang the suite."""

from __future__ import annotations

import os
import pickle
import socket
import tempfile
import time
from pathlib import Path
from typing import Any, Callable


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, fn: Callable, world_size: int, port: int, out_dir: str, args: tuple) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_WORLD_SIZE=str(world_size),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    _forget_parents_forkserver()
    import torch
    torch.set_num_threads(1)
    result = fn(rank, *args)
    Path(out_dir, f"rank{rank}.pkl").write_bytes(pickle.dumps(result))
    import torch.distributed as dist
    if dist.is_initialized():  # (a rank that aborted the group has none left)
        dist.destroy_process_group()


def _forget_parents_forkserver() -> None:
    """A forked rank inherits the parent's record of its forkserver (a process that is not the rank's child),
    so the rank's own forkserver pools (the reward pool) would fail to start; let the rank start its own."""
    from multiprocessing import forkserver

    server = forkserver._forkserver
    server._forkserver_pid = server._forkserver_address = server._forkserver_alive_fd = None


def run_ranks(fn: Callable[..., Any], world_size: int, *args: Any, timeout_s: float = 240.0) -> list[Any]:
    """``[fn(rank, *args) for each rank]``, run in ``world_size`` processes; ``fn`` sets up its own
    process group (e.g. :func:`jetrl.parallel.init_parallel`) from the variables set here."""
    import torch
    import torch.multiprocessing as mp

    start_method = "spawn" if torch.cuda.is_available() else "fork"
    with tempfile.TemporaryDirectory() as out:
        ctx = mp.start_processes(_entry, args=(fn, world_size, free_port(), out, args), nprocs=world_size,
                                 join=False, start_method=start_method)
        deadline = time.monotonic() + timeout_s
        while not ctx.join(timeout=max(0.0, deadline - time.monotonic())):  # returns when any rank ends
            if time.monotonic() >= deadline:
                for process in ctx.processes:
                    process.kill()
                raise TimeoutError(f"the {world_size} ranks did not finish within {timeout_s:.0f} s")
        return [pickle.loads(Path(out, f"rank{r}.pkl").read_bytes()) for r in range(world_size)]
