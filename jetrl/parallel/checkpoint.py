"""Sharded checkpoints through ``torch.distributed.checkpoint`` (DCP), loadable at any number of ranks.

:func:`save_sharded` writes the model's and the optimizer's tensors into one DCP folder: each rank writes
the slices it holds (a DTensor's local shard; a plain tensor, which every rank holds, once, by whichever rank
DCP's planner picks) plus a ``.metadata`` file mapping every tensor's global shape to its pieces.
:func:`load_sharded` reads them back into the tensors of the current layout, whatever it is: an FSDP model on 2
ranks reads what one process wrote and the reverse, because DCP reads each requested slice from whichever pieces
overlap it.

The model state comes from ``torch.distributed.checkpoint.state_dict.get_model_state_dict`` and goes
back through ``set_model_state_dict``. The optimizer's state is passed in as a nested dict of tensors
keyed by parameter name (jetrl's optimizer keeps fp32 master copies that are not the model's parameters,
so it names its own state; see ``MasterWeightAdamW.state_by_name``); DCP loads into those tensors in
place.

Loading runs no code from the folder. DCP reads its ``.metadata`` with plain ``pickle`` and non-tensor
entries with ``torch.load(weights_only=False)``, either of which would run whatever a crafted file asks
for. So :func:`save_sharded` accepts tensors only, and :func:`load_sharded` checks ``.metadata`` first
(:func:`check_metadata`).

Both functions are collective: every rank calls them with the same folder (on a file system every rank
sees). One process without a process group is the one-rank case. A failed write (a full disk) is a
:class:`ShardedWriteError` on every rank, naming the ranks that failed. Atomicity (a checkpoint counts only
when complete) is the caller's: :mod:`jetrl.train.checkpoint` writes into a temporary folder and renames it.
"""

from __future__ import annotations

import contextlib
import io
import pickle
import warnings
from pathlib import Path
from typing import Any, Iterator

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.checkpoint.api import CheckpointException

SHARDED_SUBDIR = "sharded"  # the DCP folder inside a checkpoint


def save_sharded(folder: str | Path, model: nn.Module, optimizer_state: dict[str, Any] | None = None) -> None:
    """Write ``model``'s state dict and ``optimizer_state`` (a nested dict of tensors) as a DCP folder."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    state = {"model": get_model_state_dict(model), **({} if optimizer_state is None else {"optim": optimizer_state})}
    _check_tensors_only(state)
    with _one_process_is_intended():
        try:
            dcp.save(state, checkpoint_id=str(folder), no_dist=not dist.is_initialized())
        except CheckpointException as e:  # a BaseException, which carries every failed rank's traceback
            raise ShardedWriteError(f"writing {folder} failed on rank(s) {sorted(e.failures)}: "
                                    f"{_first_failure(e)}") from e


def load_sharded(folder: str | Path, model: nn.Module, optimizer_state: dict[str, Any] | None = None) -> None:
    """Load a folder written by :func:`save_sharded` into ``model`` and, in place, into the tensors of
    ``optimizer_state`` (the same nested layout the save was given), resharding as needed.

    A name or shape that the checkpoint lacks is an error naming it (DCP's own message)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    folder = Path(folder)
    if not (folder / ".metadata").is_file():
        raise FileNotFoundError(f"{folder} is not a torch.distributed.checkpoint folder (no .metadata)")
    check_metadata(folder / ".metadata")
    state = {"model": get_model_state_dict(model), **({} if optimizer_state is None else {"optim": optimizer_state})}
    with _one_process_is_intended():
        dcp.load(state, checkpoint_id=str(folder), no_dist=not dist.is_initialized())
    set_model_state_dict(model, state["model"])


class ShardedWriteError(RuntimeError):
    """A sharded save failed on some rank (a full disk, an I/O error): the message names the ranks and the
    first one's error; the traceback DCP gathered is the cause."""


def _first_failure(error: Any) -> str:
    """``Type: first line`` of the lowest failed rank's exception in DCP's ``CheckpointException``."""
    wrapped = error.failures[min(error.failures)]
    exc = wrapped[0] if isinstance(wrapped, tuple) else wrapped
    line = next((x for x in str(exc).splitlines() if x.strip()), "")
    return f"{type(exc).__name__}: {line}" if line else type(exc).__name__


class UnsafeCheckpointError(ValueError):
    """A sharded checkpoint holds something that loading it would have to unpickle as code."""


def _allowed_global(module: str, name: str) -> bool:
    """The globals DCP's metadata refers to: its own dataclasses and enums, dtypes, sizes, layouts, paths. A dotted
    name (pickle protocol 4 resolves "os.system" through a module's own imports) is none of them."""
    if "." in name:
        return False
    if module == "torch.distributed.checkpoint.metadata":  # a class defined there, not a name it imported
        import torch.distributed.checkpoint.metadata as metadata

        found = getattr(metadata, name, None)
        return isinstance(found, type) and found.__module__ == module
    if module == "torch":
        return name == "Size" or isinstance(getattr(torch, name, None), torch.dtype)
    return (module, name) in {("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
                              ("torch.serialization", "_get_layout"), ("collections", "OrderedDict"),
                              ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"),
                              ("pathlib", "WindowsPath"), ("pathlib", "PureWindowsPath")}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if not _allowed_global(module, name):
            raise UnsafeCheckpointError(f"refusing to load {module}.{name}: a DCP checkpoint's metadata holds only "
                                        f"DCP's own metadata classes (a crafted or foreign file?)")
        return super().find_class(module, name)


def check_metadata(path: str | Path) -> Any:
    """Unpickle a DCP ``.metadata`` file with an allow-list of globals and return it; raise
    :class:`UnsafeCheckpointError` for any other global or for a non-tensor entry (DCP would read those
    with ``torch.load(weights_only=False)``)."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    path = Path(path)
    metadata = _MetadataUnpickler(io.BytesIO(path.read_bytes())).load()
    entries = getattr(metadata, "state_dict_metadata", None)
    if not isinstance(entries, dict):
        raise UnsafeCheckpointError(f"{path} is not DCP metadata")
    pickled = sorted(k for k, v in entries.items() if isinstance(v, BytesStorageMetadata))
    if pickled:
        raise UnsafeCheckpointError(f"{path} lists non-tensor entries {pickled[:5]} that DCP would unpickle; jetrl "
                                    f"writes tensors only")
    return metadata


def _check_tensors_only(state: Any, prefix: str = "") -> None:
    if isinstance(state, dict):
        for key, value in state.items():
            _check_tensors_only(value, f"{prefix}{key}.")
    elif not isinstance(state, torch.Tensor):
        raise TypeError(f"sharded checkpoints hold tensors only; {prefix.rstrip('.')} is a {type(state).__name__} "
                        f"(store it as a tensor, or in the trainer state)")


@contextlib.contextmanager
def _one_process_is_intended() -> Iterator[None]:
    """Silence DCP's warning that it runs without a process group: one process is a supported case."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is .*uninitialized, assuming the intent")
        yield


__all__ = ["save_sharded", "load_sharded", "check_metadata", "UnsafeCheckpointError", "ShardedWriteError",
           "SHARDED_SUBDIR"]
