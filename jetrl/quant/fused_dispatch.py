"""Which implementation the fused elementwise ops (RMSNorm, SwiGLU, RoPE) run: one rule for all of them.

``"triton"``: the fused kernels (CUDA tensors; CPU tensors only under ``TRITON_INTERPRET=1``).
``"reference"``: the PyTorch formulas, on any device. Automatic choice (``impl=None``): the kernels for CUDA
tensors when Triton is installed and the FP8 backend of the device is ``"cuda"`` (so
``JETRL_FP8_BACKEND=reference`` turns every custom kernel off at once), the reference otherwise.

:func:`fused_impl` forces one implementation for a block of code (tests run a whole model through the
interpreted kernels with it).
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import importlib.util
import os
from typing import Iterator

import torch

IMPLS = ("reference", "triton")
_FORCED: contextvars.ContextVar[str | None] = contextvars.ContextVar("jetrl_fused_impl", default=None)


@functools.lru_cache(maxsize=None)
def triton_installed() -> bool:
    return importlib.util.find_spec("triton") is not None


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


@contextlib.contextmanager
def fused_impl(impl: str | None) -> Iterator[None]:
    """Run the fused ops of this block with ``impl`` (``None``: the automatic choice)."""
    if impl is not None and impl not in IMPLS:
        raise ValueError(f"fused_impl: impl must be one of {IMPLS} or None, got {impl!r}")
    token = _FORCED.set(impl)
    try:
        yield
    finally:
        _FORCED.reset(token)


def choose_impl(x: torch.Tensor, impl: str | None, eligible: bool = True, op: str = "fused op") -> str:
    """``"triton"`` or ``"reference"`` for an op on tensors like ``x``.

    ``impl`` given (or forced by :func:`fused_impl`) wins, after a check that the kernels can run on
    ``x``; ``eligible=False`` (e.g. a dtype the kernels do not take) keeps the automatic choice on the
    reference.
    """
    if impl is None:
        impl = _FORCED.get()
    if impl is not None and impl not in IMPLS:
        raise ValueError(f"{op}: impl must be one of {IMPLS} or None (automatic), got {impl!r}")
    if impl == "triton" and not x.is_cuda and not _interpreting():
        raise ValueError(f"{op}: impl='triton' needs CUDA tensors (or TRITON_INTERPRET=1), got tensors on {x.device}")
    if impl is not None:
        return impl
    if not (eligible and x.is_cuda and triton_installed()):
        return "reference"
    from jetrl.quant.backend import get_backend

    return "triton" if get_backend(x.device).name == "cuda" else "reference"


__all__ = ["IMPLS", "fused_impl", "choose_impl", "triton_installed"]
