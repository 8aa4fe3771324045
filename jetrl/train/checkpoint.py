"""Atomic, self-verifying training checkpoints: a run killed at any moment never leaves one that resume
would pick up half-written.

Layout of ``<root>/step_00000042/``::

    model.safetensors   (or whatever ``save_model`` writes: the RL loop writes ``sharded/``, the model and
                        optimizer tensors through torch.distributed.checkpoint, loadable at any number of
                        ranks, plus HuggingFace folders ``model/`` and optionally ``model_fp8/``)
    optimizer.pt        optimizer state dict (fp32 master weights and moments), when the optimizer is passed
    scheduler.pt        LR scheduler state dict
    rng.pt              python / numpy / torch (and CUDA) RNG states, as tensors and numbers
    trainer_state.json  step, data position, metrics cursor, ... (JSON, human-readable)
    COMPLETE.json       the marker: format version, step, and size + SHA-256 of every other file

Protocol: everything is written into ``<root>/.tmp-step_00000042-<pid>``, each file fsync'ed, the marker
last; the folder is renamed to ``step_00000042`` and the root fsync'ed. The rename is atomic, so a
``step_*`` folder only ever appears complete; the marker's sizes and checksums catch folders damaged later,
and resume (:func:`latest_checkpoint`) falls back to the previous complete checkpoint, with a warning. Old
checkpoints beyond ``keep_last`` are deleted marker-first, so a half-deleted one is never mistaken for valid.

Safety: every ``.pt`` file holds only tensors and plain containers and is read with
``torch.load(weights_only=True)``, which refuses to run code: a crafted file in a folder you resume from is
an error, not an exploit. Checkpoints of format version 1 (older jetrl) pickled their RNG states; they load
only with ``allow_pickle=True`` on :func:`load_checkpoint`.
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import random
import re
import shutil
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
import torch.nn as nn

CHECKPOINT_SUBDIR = "checkpoints"  # a run's checkpoints (RL and SFT), in its output folder
MARKER = "COMPLETE.json"
FORMAT_VERSION = 2  # 2: every .pt file loads with weights_only=True (1: pickled RNG states)
MODEL_FILE = "model.safetensors"
_STEP_DIR = re.compile(r"^step_(\d{8,})$")


def checkpoint_dir_name(step: int) -> str:
    """``step_00000042``: zero-padded so that names sort by step."""
    return f"step_{step:08d}"


def _fsync_file(path: Path) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
    if os.name != "posix":
        return
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _sha256(path: Path, chunk: int = 1 << 24) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


# ------------------------------------------------------------------------------------------------ RNG

def rng_state() -> dict[str, Any]:
    """Every RNG a training step may draw from: python, numpy's global, torch CPU and CUDA, as tensors
    and numbers only (so ``torch.load(weights_only=True)`` reads them back)."""
    version, words, gauss = random.getstate()
    kind, key, pos, has_gauss, cached = np.random.get_state()
    state = {"python": {"version": version, "state": torch.tensor(words, dtype=torch.int64), "gauss_next": gauss},
             "numpy": {"kind": kind, "key": torch.from_numpy(key.astype(np.int64)), "pos": int(pos),
                       "has_gauss": int(has_gauss), "cached_gaussian": float(cached)},
             "torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore the RNG states :func:`rng_state` captured (CUDA only where a GPU is present). Also takes
    the pickled form of format version 1 (the tuples of ``random.getstate`` / ``np.random.get_state``)."""
    py, npy = state["python"], state["numpy"]
    if isinstance(py, dict):
        py = (py["version"], tuple(py["state"].tolist()), py["gauss_next"])
    if isinstance(npy, dict):
        npy = (npy["kind"], npy["key"].numpy().astype(np.uint32), npy["pos"], npy["has_gauss"], npy["cached_gaussian"])
    random.setstate(py)
    np.random.set_state(npy)
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


# ------------------------------------------------------------------------------------------- saving

def save_checkpoint(root: str | Path, step: int, *, model: nn.Module | None = None,
                    save_model: Callable[[Path], None] | None = None, optimizer: Any = None, scheduler: Any = None,
                    trainer_state: dict[str, Any] | None = None, keep_last: int | None = None) -> Path:
    """Write checkpoint ``step`` under ``root`` atomically (see module doc) and return its folder.

    Args:
        model: saved as ``model.safetensors`` (tied weights handled) unless ``save_model`` is given.
        save_model: ``save_model(folder)`` writes the model itself (e.g. a HuggingFace checkpoint).
        optimizer, scheduler: objects with ``state_dict()``.
        trainer_state: JSON-serialisable run state (data position, metrics cursor, counters...).
        keep_last: delete every checkpoint folder older than the newest ``keep_last`` complete ones
            (:func:`prune_checkpoints`).
    """
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    name = checkpoint_dir_name(step)
    remove_stale_temporaries(root)
    tmp = root / f".tmp-{name}-{os.getpid()}"
    tmp.mkdir()
    try:
        try:
            state_text = json.dumps({"step": step, **(trainer_state or {})}, indent=2, allow_nan=False)
        except (TypeError, ValueError) as e:
            raise TypeError(f"trainer_state must be JSON-serialisable (ints, floats, strings, lists, dicts): {e}")
        if save_model is not None:
            save_model(tmp)
        elif model is not None:
            from safetensors.torch import save_model as save_safetensors
            save_safetensors(model, str(tmp / MODEL_FILE))
        for obj, fname in ((optimizer, "optimizer.pt"), (scheduler, "scheduler.pt")):
            if obj is not None:
                torch.save(obj.state_dict(), tmp / fname)
        torch.save(rng_state(), tmp / "rng.pt")
        (tmp / "trainer_state.json").write_text(state_text)

        files = {}
        for path in sorted(p for p in tmp.rglob("*") if p.is_file()):
            _fsync_file(path)
            files[path.relative_to(tmp).as_posix()] = {"size": path.stat().st_size, "sha256": _sha256(path)}
        for sub in sorted((p for p in tmp.rglob("*") if p.is_dir()), key=lambda p: -len(p.parts)):
            _fsync_dir(sub)
        marker = tmp / MARKER
        marker.write_text(json.dumps({"format_version": FORMAT_VERSION, "step": step, "files": files}, indent=1))
        _fsync_file(marker)
        _fsync_dir(tmp)

        final = root / name
        if final.exists():  # re-saving a step (e.g. after a resume): replace it
            _remove_checkpoint(final)
        os.rename(tmp, final)
        _fsync_dir(root)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if keep_last is not None:
        prune_checkpoints(root, keep_last)
    return final


def remove_stale_temporaries(root: str | Path) -> None:
    """Delete the ``.tmp-step_*`` folders under ``root`` (left by a save that was killed or failed: never a
    checkpoint, but they hold disk space). The folder belongs to one run, so no other save is under way there."""
    for path in Path(root).glob(".tmp-step_*"):
        shutil.rmtree(path, ignore_errors=True)


def _remove_checkpoint(path: Path) -> None:
    marker = path / MARKER
    if marker.exists():
        marker.unlink()  # first: a folder killed mid-delete is then clearly incomplete
        _fsync_dir(path)
    shutil.rmtree(path)


def list_checkpoints(root: str | Path) -> list[tuple[int, Path]]:
    """``(step, folder)`` of every ``step_*`` folder under ``root``, complete or not, by step."""
    root = Path(root)
    named = [(_STEP_DIR.match(p.name), p) for p in root.iterdir()] if root.is_dir() else []
    return sorted((int(m.group(1)), p) for m, p in named if m and p.is_dir())


def prune_checkpoints(root: str | Path, keep_last: int) -> None:
    """Delete every checkpoint folder older than the newest ``keep_last`` (>= 1) complete ones."""
    entries = list_checkpoints(root)
    complete = [step for step, path in entries if verify_checkpoint(path) is None]
    if len(complete) > keep_last:
        for step, path in entries:
            if step < complete[-keep_last]:
                _remove_checkpoint(path)


# ------------------------------------------------------------------------------------------ loading

def verify_checkpoint(path: str | Path, checksums: bool = False) -> str | None:
    """``None`` when the folder is a complete checkpoint, else the reason it is not.

    Checks the marker, the step in its name, and every recorded file's size (and SHA-256 when
    ``checksums``)."""
    path = Path(path)
    marker = path / MARKER
    if not marker.is_file():
        return f"no {MARKER} marker (the save did not finish)"
    try:
        info = json.loads(marker.read_text())
        files, step = info["files"], info["step"]
    except (ValueError, KeyError, TypeError) as e:
        return f"unreadable marker ({e})"
    m = _STEP_DIR.match(path.name)
    if m and int(m.group(1)) != step:
        return f"marker says step {step} but the folder is {path.name}"
    if "trainer_state.json" not in files:
        return "marker lists no trainer_state.json"
    for rel, entry in files.items():
        f = path / rel
        if not f.is_file():
            return f"missing file {rel}"
        size = f.stat().st_size
        if size != entry["size"]:
            return f"{rel} has {size} bytes, the marker recorded {entry['size']} (truncated or overwritten)"
        if checksums and "sha256" in entry and _sha256(f) != entry["sha256"]:
            return f"{rel} does not match its recorded SHA-256 (corrupt)"
    return None


def latest_checkpoint(root: str | Path, checksums: bool = True) -> Path | None:
    """The newest complete checkpoint under ``root`` (None if there is none). Incomplete or corrupt
    folders (a missing marker or file, a wrong size, and with ``checksums`` a SHA-256 that differs from
    the recorded one) are skipped with a warning saying why."""
    for step, path in reversed(list_checkpoints(root)):
        reason = verify_checkpoint(path, checksums=checksums)
        if reason is None:
            return path
        warnings.warn(f"ignoring checkpoint {path}: {reason}", RuntimeWarning, stacklevel=2)
    return None


@dataclass
class LoadedCheckpoint:
    """What :func:`load_checkpoint` read besides what it loaded into the given objects."""

    path: Path
    step: int
    trainer_state: dict[str, Any]


def load_checkpoint(path: str | Path, *, model: nn.Module | None = None,
                    load_model: Callable[[Path], None] | None = None, optimizer: Any = None, scheduler: Any = None,
                    checksums: bool = True, allow_pickle: bool = False) -> LoadedCheckpoint:
    """Restore a checkpoint written by :func:`save_checkpoint` into the given objects.

    The model is loaded from ``model.safetensors`` (strict: every key must match) or by
    ``load_model(folder)``; optimizer and scheduler through ``load_state_dict``; the RNG states are
    restored last, so that nothing after this call has drawn from them. ``checksums``: verify the
    files' SHA-256 first (pass False only for a folder just verified, e.g. by :func:`latest_checkpoint`).
    ``allow_pickle``: see Safety in the module doc (unpickling runs code: only for checkpoints you trust)."""
    path = Path(path)
    reason = verify_checkpoint(path, checksums=checksums)
    if reason is not None:
        raise ValueError(f"cannot load checkpoint {path}: {reason}")

    def load_pt(fname: str, location: str | None = "cpu") -> Any:
        try:
            return torch.load(path / fname, map_location=location, weights_only=True)
        except pickle.UnpicklingError as e:
            if not allow_pickle:
                raise ValueError(
                    f"refusing to unpickle {path / fname}: it holds more than tensors and plain containers, so "
                    "loading it could run arbitrary code. A checkpoint written by an older jetrl (format version "
                    "1) that you trust loads with allow_pickle=True; otherwise the file was tampered with. "
                    f"({str(e).splitlines()[0][:200]})") from None
            return torch.load(path / fname, map_location=location, weights_only=False)

    # every .pt file is read (and refused, if need be) before anything is modified
    targets = {fname: obj for obj, fname in ((optimizer, "optimizer.pt"), (scheduler, "scheduler.pt"))
               if obj is not None}
    states = {}
    for fname in targets:
        if not (path / fname).is_file():
            raise FileNotFoundError(f"{path} has no {fname}")
        states[fname] = load_pt(fname)
    rng = load_pt("rng.pt", None)
    state = json.loads((path / "trainer_state.json").read_text())

    if load_model is not None:
        load_model(path)
    elif model is not None:
        from safetensors.torch import load_model as load_safetensors
        if not (path / MODEL_FILE).is_file():
            raise FileNotFoundError(f"{path} has no {MODEL_FILE}; it was saved with a custom save_model, "
                                    f"pass the matching load_model")
        missing, unexpected = load_safetensors(model, str(path / MODEL_FILE), strict=False)
        if missing or unexpected:
            raise ValueError(f"checkpoint {path} does not match the model: missing {sorted(missing)[:5]}, "
                             f"unexpected {sorted(unexpected)[:5]}")
    for fname, obj in targets.items():
        obj.load_state_dict(states[fname])
    set_rng_state(rng)
    return LoadedCheckpoint(path, int(state["step"]), state)


__all__ = ["save_checkpoint", "load_checkpoint", "latest_checkpoint", "verify_checkpoint", "prune_checkpoints",
           "list_checkpoints", "remove_stale_temporaries", "LoadedCheckpoint", "rng_state", "set_rng_state",
           "checkpoint_dir_name", "CHECKPOINT_SUBDIR", "MARKER"]
