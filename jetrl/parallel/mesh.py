"""Ranks, the device mesh and the few collectives an RL step needs -- for one process or many.

A run launched with ``torchrun`` has ``WORLD_SIZE`` processes (ranks), one per GPU; torchrun sets
``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT``. :func:`init_parallel`
reads them, starts the default process group (NCCL on GPU, gloo on CPU) with a timeout, and builds the
device mesh FSDP2 shards over:

* ``shard_size`` None (or equal to the world size): a 1-D mesh ``("shard",)``: every rank holds a
  1/world_size slice of every parameter (FSDP).
* ``shard_size`` s < world size: a 2-D mesh ``("replicate", "shard")`` of shape (world / s, s): the
  weights are sharded within each group of s ranks (e.g. the GPUs of one node, where all-gathers are fast)
  and replicated across groups, whose gradients are all-reduced (HSDP).

Every rank is a data-parallel rank either way: it rolls out and trains on its own slice of the batch.

A process started without torchrun is the one-rank case of the same code: :class:`ParallelContext` with
``world_size == 1``, no process group and no mesh; every collective below returns its input, so the
trainer calls them unconditionally.

**Failures.** A rank that raises inside :meth:`ParallelContext.guard` brings its peers down at once; one that
dies silently (killed, stuck) makes the others' collectives fail after ``timeout_s``. Under torchrun the
first rank to exit non-zero brings the job down.
"""

from __future__ import annotations

import contextlib
import logging
import os
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Iterator, Sequence

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)

TORCHRUN_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@dataclass
class ParallelContext:
    """Where this process sits in the job: its rank, the world size, its device and the FSDP mesh (None in the
    one-rank case: nothing to shard). The collectives are over all ranks."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    mesh: Any = None  # torch.distributed.device_mesh.DeviceMesh | None

    @property
    def is_main(self) -> bool:
        """Rank 0: the one process that prints progress and writes metrics, plots and exports."""
        return self.rank == 0

    @property
    def is_distributed(self) -> bool:
        return self.world_size > 1

    def shard_bounds(self, num_items: int, what: str = "items") -> tuple[int, int]:
        """``[lo, hi)``: this rank's contiguous share of ``num_items`` (which must divide evenly, so every
        rank runs the same number of forwards and collectives)."""
        if num_items % self.world_size:
            raise ValueError(f"{num_items} {what} cannot be split evenly over {self.world_size} ranks; "
                             f"make it a multiple of the number of GPUs")
        per = num_items // self.world_size
        return self.rank * per, (self.rank + 1) * per

    def _reduce(self, values: Sequence[float], op: Any) -> list[float]:
        if not self.is_distributed:
            return [float(v) for v in values]
        t = torch.tensor([float(v) for v in values], dtype=torch.float64, device=self.device)
        dist.all_reduce(t, op=op)
        return t.tolist()

    def sum(self, values: Sequence[float]) -> list[float]:
        """Element-wise sum over ranks (float64 on the wire)."""
        return self._reduce(values, dist.ReduceOp.SUM)

    def max(self, values: Sequence[float]) -> list[float]:
        """Element-wise maximum over ranks."""
        return self._reduce(values, dist.ReduceOp.MAX)

    def gather_objects(self, obj: Any) -> list[Any]:
        """Every rank's ``obj`` (picklable), in rank order, on every rank."""
        if not self.is_distributed:
            return [obj]
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj)
        return out

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        """Rank ``src``'s ``obj`` on every rank."""
        if not self.is_distributed:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=src)
        return box[0]

    def barrier(self) -> None:
        if self.is_distributed:
            dist.barrier()

    @contextlib.contextmanager
    def guard(self) -> Iterator[None]:
        """Run a rank's work so that a failure is logged with the rank and brings the job down.

        On an exception: log it as ``rank R/W failed``, abort the process group (peers waiting in a
        collective get an error now, not after the timeout) and re-raise, so the process exits non-zero."""
        try:
            yield
        except BaseException as exc:
            if self.is_distributed:
                log.error("rank %d/%d failed: %s: %s", self.rank, self.world_size, type(exc).__name__, exc,
                          exc_info=not isinstance(exc, KeyboardInterrupt))
                if dist.is_initialized():
                    from torch.distributed.distributed_c10d import _abort_process_group
                    _abort_process_group()
            raise

    def close(self) -> None:
        """Tear the process group down at the end of a run (nothing to do on one rank)."""
        if self.is_distributed and dist.is_initialized():
            dist.destroy_process_group()


def launched_by_torchrun() -> bool:
    """Whether torchrun's environment is present (``WORLD_SIZE`` and friends)."""
    return all(v in os.environ for v in TORCHRUN_VARS)


def launched_rank() -> int:
    """This process's rank as torchrun set it (0 without torchrun): for the work only rank 0 does before or
    after the ranks meet, such as the command line's evaluations, plots and summaries."""
    return int(os.environ["RANK"]) if launched_by_torchrun() else 0


def init_parallel(device: str | torch.device = "auto", shard_size: int | None = None,
                  timeout_s: float = 600.0) -> ParallelContext:
    """Set this process up as a rank of the job torchrun launched (see the module doc).

    ``device`` is the configured device: ``"auto"`` (CUDA when present), ``"cpu"`` or ``"cuda"``; with
    several ranks each takes ``cuda:LOCAL_RANK``. Without torchrun's variables (or with a world size of 1)
    no process group is created and the context has one rank."""
    device = torch.device(("cuda" if torch.cuda.is_available() else "cpu") if str(device) == "auto" else device)
    if shard_size is not None and shard_size < 1:
        raise ValueError(f"distributed.shard_size must be >= 1, got {shard_size}")
    world_size = int(os.environ.get("WORLD_SIZE", "1")) if launched_by_torchrun() else 1
    if world_size == 1:
        return ParallelContext(device=device)
    rank, local_rank = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])
    shard = shard_size or world_size
    if world_size % shard:
        raise ValueError(f"distributed.shard_size={shard} must divide the number of ranks ({world_size})")
    if device.type == "cuda":
        if local_rank >= torch.cuda.device_count():
            raise RuntimeError(f"rank {rank}: LOCAL_RANK={local_rank} but only {torch.cuda.device_count()} GPUs "
                               f"are visible; launch at most one process per GPU (torchrun --nproc-per-node)")
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        backend = "nccl"
    elif device.type == "cpu":
        backend = "gloo"
    else:
        raise ValueError(f"several ranks need a cuda or cpu device, got {device}")
    if not dist.is_initialized():
        kwargs = {"device_id": device} if backend == "nccl" else {}
        dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s), **kwargs)
    from torch.distributed.device_mesh import init_device_mesh
    dims = {"shard": shard} if shard == world_size else {"replicate": world_size // shard, "shard": shard}
    mesh = init_device_mesh(device.type, tuple(dims.values()), mesh_dim_names=tuple(dims))
    return ParallelContext(rank=rank, world_size=world_size, local_rank=local_rank, device=device, mesh=mesh)


__all__ = ["ParallelContext", "init_parallel", "launched_by_torchrun", "launched_rank", "TORCHRUN_VARS"]
