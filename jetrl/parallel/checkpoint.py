"""Sharded checkpoints through ``torch.distributed.checkpoint`` (DCP), loadable at any number of ranks.

:func:`save_sharded` writes the model's and the optimizer's tensors into one DCP folder: each rank writes
the slices it holds (a DTensor's local shard; a plain tensor once, by rank 0) plus a ``.metadata`` file
mapping every tensor's global shape to its pieces. :func:`load_sharded` reads them back into the tensors
of the current layout, whatever it is: an FSDP model on 2 ranks reads what one process wrote and the
reverse, because DCP reads each requested slice from whichever pieces overlap it.

The model state comes from ``torch.distributed.checkpoint.state_dict.get_model_state_dict`` and goes
back through ``set_model_state_dict``. The optimizer's state is passed in as a nested dict of tensors
keyed by parameter name (jetrl's optimizer keeps fp32 master copies that are not the model's parameters,
so it names its own state; see ``MasterWeightAdamW.state_by_name``); DCP loads into those tensors in
place.

Both functions are collective: every rank calls them with the same folder (on a file system every rank
sees). One process without a process group is the one-rank case. Atomicity (a checkpoint counts only
when complete) is the caller's: :mod:`jetrl.rl.checkpoint` writes into a temporary folder and renames it.
"""

from __future__ import annotations

import contextlib
import warnings
from pathlib import Path
from typing import Any, Iterator

import torch
import torch.nn as nn

SHARDED_SUBDIR = "sharded"  # the DCP folder inside a checkpoint


def save_sharded(folder: str | Path, model: nn.Module, optimizer_state: dict[str, Any] | None = None) -> None:
    """Write ``model``'s state dict and ``optimizer_state`` (a nested dict of tensors) as a DCP folder."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    state = {"model": get_model_state_dict(model)}
    if optimizer_state is not None:
        state["optim"] = optimizer_state
    with _one_process_is_intended():
        dcp.save(state, checkpoint_id=str(folder), no_dist=not _distributed())


def load_sharded(folder: str | Path, model: nn.Module, optimizer_state: dict[str, Any] | None = None) -> None:
    """Load a folder written by :func:`save_sharded` into ``model`` and, in place, into the tensors of
    ``optimizer_state`` (the same nested layout the save was given), resharding as needed.

    A name or shape that the checkpoint lacks is an error naming it (DCP's own message)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    folder = Path(folder)
    if not (folder / ".metadata").is_file():
        raise FileNotFoundError(f"{folder} is not a torch.distributed.checkpoint folder (no .metadata)")
    state = {"model": get_model_state_dict(model)}
    if optimizer_state is not None:
        state["optim"] = optimizer_state
    with _one_process_is_intended():
        dcp.load(state, checkpoint_id=str(folder), no_dist=not _distributed())
    set_model_state_dict(model, state["model"])
    if optimizer_state is not None:
        _copy_into(optimizer_state, state["optim"])


def _distributed() -> bool:
    """Whether a process group exists (one process without torchrun has none: DCP then runs locally)."""
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()


@contextlib.contextmanager
def _one_process_is_intended() -> Iterator[None]:
    """Silence DCP's warning that it runs without a process group: one process is a supported case."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is .*uninitialized, assuming the intent")
        yield


@torch.no_grad()
def _copy_into(target: dict[str, Any], loaded: dict[str, Any]) -> None:
    """Make sure ``target``'s tensors hold ``loaded``'s values (DCP loads in place; this covers any
    value it replaced instead)."""
    for key, value in loaded.items():
        if isinstance(value, dict):
            _copy_into(target[key], value)
        elif isinstance(value, torch.Tensor) and value is not target[key]:
            target[key].copy_(value)


__all__ = ["save_sharded", "load_sharded", "SHARDED_SUBDIR"]
