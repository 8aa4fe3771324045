"""CUDA graphs of a model's work: what a replay depends on, and one way to capture.

The rollout's decode steps (:mod:`jetrl.rollout.model_runner`) and the update's micro-batches
(:mod:`jetrl.rl.update_graphs`) both capture their model's kernels once per shape and replay them. Both rely on
the same things staying put (:func:`storage_key`: graphs stay valid while it compares equal, across optimizer
steps but not a recipe swap, which replaces the modules), and capture the same way (:func:`capture`). A capture
that fails raises :class:`CaptureFailed` and leaves the device able to capture again, into another pool; its
caller falls back to running eagerly and says so once (:func:`warn_eager`).
"""

from __future__ import annotations

import contextlib
import gc
import warnings
from typing import Callable, TypeVar

import torch

from jetrl.quant import bf16_stacks, fp8_linears

T = TypeVar("T")


class CaptureFailed(RuntimeError):
    """A CUDA-graph capture that did not complete; the message says why."""


def storage_key(model: torch.nn.Module, *, grads: bool, transposes: bool) -> tuple:
    """What a replay of ``model``'s work reads and writes that can move under it; compare keys with ``==``: the kernel
    tuning in force (a graph replays the kernels chosen at capture), every parameter's storage, every FP8 weight
    cache of the precision side in force and every stacked BF16 weight (:func:`jetrl.quant.bf16_stacks`), each
    brought to the current weight version in place first.
    ``grads``: the gradient buffers too (graphs that accumulate into them); ``transposes``: the FP8 linears' W^T
    copies too (a forward reads W alone)."""
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
    for module in model.modules():
        for stack in bf16_stacks(module):
            ptrs += [id(module), stack.weight.data_ptr(), -1 if stack.bias is None else stack.bias.data_ptr()]
    return tuple(ptrs)


def capture(run: Callable[[], T], *, stream: torch.cuda.Stream, pool, warmup: bool = False
            ) -> tuple[torch.cuda.CUDAGraph, T]:
    """A graph of ``run()`` captured on ``stream`` into ``pool``, and the outputs ``run`` returned while captured
    (the tensors a replay writes). ``warmup``: run it eagerly on ``stream`` first (autotuning, lazily made caches and
    kernels). The capture runs in thread-local error mode, so that another thread's CUDA calls cannot invalidate it,
    and without the synchronize, garbage collection and cache release ``torch.cuda.graph`` does per capture; Python's
    cyclic garbage collector is off while it runs, because a collection there may destroy an unreachable earlier
    graph, whose ``cudaGraphExecDestroy`` invalidates the capture (pytorch/pytorch#161037). The current stream waits
    for ``stream`` afterwards. Raises :class:`CaptureFailed` when the capture fails."""
    main = torch.cuda.current_stream(stream.device)
    stream.wait_stream(main)
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.stream(stream):
            if warmup:
                run()
            collecting = gc.isenabled()
            gc.disable()
            try:
                graph.capture_begin(pool=pool, capture_error_mode="thread_local")
                try:
                    out = run()
                finally:
                    _end_capture(graph, pool, stream.device)
            finally:
                if collecting:
                    gc.enable()
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
