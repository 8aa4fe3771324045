"""The one seam that picks who computes FP8: the PyTorch reference or the Hopper kernels.

Everything above this module (``FP8Linear``, models, the rollout engine, the trainer) calls
:func:`get_backend` and the three operations of :class:`Fp8Backend`; nothing else in jetrl knows which
backend ran. Selection, in order: :func:`use_backend` / :func:`set_backend`, the ``JETRL_FP8_BACKEND``
environment variable, then ``"auto"`` (the CUDA kernels on a Hopper-or-newer GPU when Triton imports,
the reference everywhere else).
"""

from __future__ import annotations

import contextlib
import os
from typing import Callable, Iterator, Protocol

import torch

from jetrl.quant import reference
from jetrl.quant.formats import Block, Fp8Tensor


class Fp8Backend(Protocol):
    """Operations a backend provides; each must equal the reference (see ``jetrl.quant.reference``)."""

    name: str

    def quantize(self, x: torch.Tensor, block: Block, pow2_scale: bool = False) -> Fp8Tensor: ...

    def requantize(self, t: Fp8Tensor, block: Block, pow2_scale: bool = False) -> Fp8Tensor: ...

    def gemm(self, a: Fp8Tensor, b: Fp8Tensor, out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor: ...


class ReferenceBackend:
    """Pure PyTorch, any device."""

    name = "reference"

    def quantize(self, x: torch.Tensor, block: Block, pow2_scale: bool = False) -> Fp8Tensor:
        return reference.quantize_tensor(x, block, pow2_scale)

    def requantize(self, t: Fp8Tensor, block: Block, pow2_scale: bool = False) -> Fp8Tensor:
        return reference.requantize(t, block, pow2_scale)

    def gemm(self, a: Fp8Tensor, b: Fp8Tensor, out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        return reference.gemm(a, b, out_dtype)


_FACTORIES: dict[str, Callable[[], Fp8Backend]] = {"reference": ReferenceBackend}
_INSTANCES: dict[str, Fp8Backend] = {}
_override: str | None = None
CHOICES = ("auto", "reference", "cuda")


def register_backend(name: str, factory: Callable[[], Fp8Backend]) -> None:
    """Make a backend selectable by name (the CUDA kernels register themselves lazily)."""
    _FACTORIES[name] = factory
    _INSTANCES.pop(name, None)


def _instance(name: str) -> Fp8Backend:
    if name not in _INSTANCES:
        if name == "cuda" and "cuda" not in _FACTORIES:
            import jetrl.quant.cuda  # noqa: F401  (registers "cuda"; imports Triton)
        if name not in _FACTORIES:
            raise ValueError(f"unknown FP8 backend {name!r}; choose one of {sorted(set(CHOICES) | set(_FACTORIES))}")
        _INSTANCES[name] = _FACTORIES[name]()
    return _INSTANCES[name]


_USABLE: dict[torch.device, bool] = {}


def _cuda_kernels_usable(device: torch.device) -> bool:
    """Hopper-or-newer GPU and an importable kernel module; decided once per device (a hot path)."""
    if device.type != "cuda":
        return False
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    if device not in _USABLE:
        usable = torch.cuda.is_available() and torch.cuda.get_device_capability(device)[0] >= 9
        if usable:
            try:
                _instance("cuda")
            except ImportError:
                usable = False
        _USABLE[device] = usable
    return _USABLE[device]


def selected_backend_name() -> str:
    """The configured choice: an override, else ``JETRL_FP8_BACKEND``, else ``"auto"``."""
    name = _override or os.environ.get("JETRL_FP8_BACKEND", "auto")
    if name != "auto" and name not in CHOICES and name not in _FACTORIES:
        raise ValueError(f"unknown FP8 backend {name!r} (JETRL_FP8_BACKEND?); choose one of {CHOICES}")
    return name


def get_backend(device: torch.device | str | None = None) -> Fp8Backend:
    """The backend that computes FP8 for tensors on ``device``."""
    name = selected_backend_name()
    device = torch.device(device) if device is not None else torch.device("cpu")
    if name == "auto":
        name = "cuda" if _cuda_kernels_usable(device) else "reference"
    elif name == "cuda" and device.type != "cuda":
        raise ValueError(f"FP8 backend 'cuda' was selected but the tensors are on {device}")
    return _instance(name)


def set_backend(name: str | None) -> None:
    """Force a backend for the whole process (``None`` or ``"auto"`` restores automatic choice)."""
    global _override
    if name is not None and name != "auto":
        _instance(name)  # fail now, not at the first matmul
    _override = None if name in (None, "auto") else name


@contextlib.contextmanager
def use_backend(name: str) -> Iterator[None]:
    """Temporarily force a backend (tests compare backends on the same inputs with this)."""
    global _override
    previous = _override
    set_backend(name)
    try:
        yield
    finally:
        _override = previous
