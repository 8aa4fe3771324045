"""CUDA graphs of a model's work: what a replay depends on, and one way to capture.

The rollout's decode steps (:mod:`jetrl.rollout.model_runner`) and the update's micro-batches
(:mod:`jetrl.rl.update_graphs`) both capture their model's kernels once per shape and replay them. Both rely on
the same things staying put, and capture the same way:

* :func:`storage_key`: what a replay reads and writes that can move under it: the kernel tuning in force (a graph
  replays the kernels chosen when it was captured), every parameter's storage (and its gradient's, for graphs
  that run the backward), and every FP8 weight cache the linears hold, each brought to the current weight version
  in place first (so graphs survive optimizer steps; a recipe swap, which replaces the modules, does not). Graphs
  stay valid while the key compares equal.
* :func:`capture`: ``run`` captured on a side stream into a shared memory pool, optionally after one eager warm-up
  run there (autotuning, lazily made caches and kernels); in thread-local error mode, so that another thread's
  CUDA calls cannot invalidate it, and without the synchronize, garbage collection and cache release that
  ``torch.cuda.graph`` does per capture (a capture then issues kernels without waiting for the GPU). A capture
  that fails raises :class:`CaptureFailed` and leaves the device able to capture again, into another pool (torch
  keeps the failed capture's pool marked as recording, so no later capture can begin in it); its caller falls back
  to running eagerly and says so once (:func:`warn_eager`), and captures later only into a fresh pool.
"""

from __future__ import annotations

import contextlib
import warnings
from typing import Callable, TypeVar

import torch

from jetrl.quant import fp8_linears

T = TypeVar("T")


class CaptureFailed(RuntimeError):
    """A CUDA-graph capture that did not complete; the message says why."""


def storage_key(model: torch.nn.Module, *, grads: bool, transposes: bool) -> tuple:
    """What graphs of ``model``'s work depend on (see the module doc); compare keys with ``==``. ``grads``: the
    gradient buffers too (graphs that accumulate into them); ``transposes``: the FP8 linears' W^T copies too (a
    forward reads W alone). FP8 caches are those of the precision side in force."""
    from jetrl.quant.kernels import tuning

    ptrs: list = [tuning.current()]
    for p in model.parameters():
        ptrs.append(p.data_ptr())
        if grads:
            ptrs.append(-1 if p.grad is None else p.grad.data_ptr())
    for layer in fp8_linears(model):
        ptrs.append(id(layer))  # a recipe swap replaces the modules the graphs captured
        if layer.uses_fp8():
            for q in layer.current_fp8_tensors(transposes=transposes):
                ptrs += [q.data.data_ptr(), q.scale.data_ptr()]
    return tuple(ptrs)


def capture(run: Callable[[], T], *, stream: torch.cuda.Stream, pool, warmup: bool = False
            ) -> tuple[torch.cuda.CUDAGraph, T]:
    """A graph of ``run()`` captured on ``stream`` into ``pool``, and the outputs ``run`` returned while captured
    (the tensors a replay writes). ``warmup``: run it eagerly on ``stream`` first. The current stream waits for
    ``stream`` afterwards. Raises :class:`CaptureFailed` when the capture fails."""
    main = torch.cuda.current_stream(stream.device)
    stream.wait_stream(main)
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.stream(stream):
            if warmup:
                run()
            graph.capture_begin(pool=pool, capture_error_mode="thread_local")
            try:
                out = run()
            finally:
                _end_capture(graph, pool, stream.device)
    except Exception as exc:
        main.wait_stream(stream)
        raise CaptureFailed(f"{type(exc).__name__}: {exc}") from exc
    main.wait_stream(stream)
    return graph, out


def _end_capture(graph: torch.cuda.CUDAGraph, pool, device: torch.device) -> None:
    """``graph.capture_end()``, and where it fails (a capture that something invalidated, e.g. a host
    synchronization), the end of the device allocator's routing of the capture's allocations to ``pool``, which
    torch leaves on in that case. ``pool`` itself stays unusable: a capture that begins in it again fails ("already
    recording to mempool_id"), so callers move to a fresh pool."""
    try:
        graph.capture_end()
    except Exception:
        with contextlib.suppress(RuntimeError):  # capture_end ended the routing itself where it failed later on
            torch._C._cuda_endAllocateToPool(device.index, pool)
        raise


def warn_eager(what: str, error: BaseException, consequence: str, stacklevel: int = 3) -> None:
    """The one warning a failed capture gives: ``what`` could not be captured (``error``: a
    :class:`CaptureFailed`, or what went wrong around the capture), and what runs eagerly instead
    (``consequence``). ``stacklevel`` as :func:`warnings.warn` takes it from the caller."""
    reason = str(error) if isinstance(error, CaptureFailed) else f"{type(error).__name__}: {error}"
    warnings.warn(f"CUDA graph capture of {what} failed ({reason}); {consequence}", RuntimeWarning,
                  stacklevel=stacklevel + 1)


__all__ = ["CaptureFailed", "capture", "storage_key", "warn_eager"]
