"""The one seam that answers "which implementation runs this op on these tensors": the reference or the kernels.

Everything above this module (``FP8Linear``, the fused norm and SwiGLU, the models' RoPE, attention and
log-probabilities, the rollout sampler, the trainer) asks here; nothing else in jetrl tests ``x.is_cuda`` to
pick a kernel (only ``bf16``'s stacked decode GEMM, a plain PyTorch GEMM, is GPU-only: :mod:`jetrl.quant.linear`),
or probes a backend for an operation.

**The FP8 backend** (:class:`Fp8Backend`) computes every FP8 operation, the fused entry points included (the
reference backend builds those from its basic operations, so callers never check whether a backend has them). Two
backends exist: ``"reference"`` (:class:`ReferenceBackend`, pure PyTorch, any device: the specification) and
``"cuda"`` (:mod:`jetrl.quant.kernels.cuda_backend`: Triton and Gluon kernels and cuBLAS on Hopper). Selection, in
order: :func:`use_backend` / :func:`set_backend`, the ``JETRL_FP8_BACKEND`` environment variable, then ``"auto"``
(the CUDA kernels on a Hopper-or-newer GPU when Triton imports, the reference everywhere else).

**The fused kernels** (:data:`FUSED_OPS`) follow the backend: :func:`choose_impl` says ``"triton"`` (the kernels of
:mod:`jetrl.quant.kernels`) where the device's backend has ``fused_kernels`` (the CUDA backend), ``"reference"``
(the PyTorch formulas, the specification of each kernel) elsewhere. So ``JETRL_FP8_BACKEND=reference`` turns every
custom kernel off at once. :func:`fused_impl` forces one implementation for a block of code; the tests run a whole
model through the interpreted kernels on CPU with ``fused_impl("triton")`` under ``TRITON_INTERPRET=1``.

**Public FP8 operations**: :func:`quantize` and :func:`gemm` dispatch through the backend.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import importlib
import importlib.util
import os
from typing import Callable, Iterator, NamedTuple, Protocol, Sequence

import torch

from jetrl.quant import reference
from jetrl.quant.formats import ACT, TOKEN, WEIGHT, Block, Fp8Tensor


class GemmWeight(NamedTuple):
    """An FP8 weight a model's forward multiplies, as GEMM planning sees it: ``n`` x ``k`` (a group's stacked
    weight for linears that run as one, q/k/v or gate/up), ``biased_group``: such a group with biases (its
    decode-sized launches may keep the decode kernel, which adds them in its epilogue)."""

    n: int
    k: int
    biased_group: bool = False


class Fp8Backend(Protocol):
    """Operations a backend provides; each must equal the reference (see ``jetrl.quant.reference``)."""

    name: str
    fused_kernels: bool  # whether the ops of FUSED_OPS run their kernels on this backend's devices

    def quantize(self, x: torch.Tensor, block: Block, pow2_scale: bool = False, *,
                 whole_blocks: bool = False) -> Fp8Tensor:
        """``x`` per ``block``. ``whole_blocks``: that of ``x`` with zero rows up to a multiple of ``block[0]``
        (:func:`jetrl.quant.reference.pad_to_whole_blocks`: WGrad's operands)."""

    def requantize(self, t: Fp8Tensor, block: Block, pow2_scale: bool = False, *,
                   whole_blocks: bool = False) -> Fp8Tensor:
        """``t`` re-quantized per ``block`` (``whole_blocks`` as in :meth:`quantize`)."""

    def gemm(self, a: Fp8Tensor, b: Fp8Tensor, out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor: ...

    def quantize_weight_pair(self, w: torch.Tensor, pow2_scale: bool = False) -> tuple[Fp8Tensor, Fp8Tensor]:
        """W per 128x128 tile and W^T's quantized form with row-major data (the values of the first's ``t()``)."""

    def transpose_weight(self, q: Fp8Tensor) -> Fp8Tensor:
        """W^T's quantized form with row-major data from W's (``q``: 128x128 tiles, row-major data): the bytes and
        scales of :meth:`quantize_weight_pair`'s second result, without reading the weight again (DGrad's
        operand when the linear keeps no W^T of its own, ``tuning.cache_weight_t``)."""

    def quantize_act_and_token(self, x: torch.Tensor, pow2_scale: bool = False, *,
                               whole_blocks: bool = False) -> tuple[Fp8Tensor, Fp8Tensor]:
        """x per 1x128 and per 128x1 (grad_out for DGrad and WGrad; ``whole_blocks`` for the 128x1 one, as in
        :meth:`quantize`)."""

    def grouped_gemm(self, a: Fp8Tensor, weights: list[Fp8Tensor], biases: list[torch.Tensor | None],
                     out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor | None:
        """``cat([a @ w.T (+ bias)], dim=1)`` for weights sharing the input ``a``, or ``None`` where the backend
        does not group these operands (the caller then runs the layers one by one)."""

    def add_bias(self, y: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        """``y + bias.to(y.dtype)`` for a GEMM output ``y`` (M, N) and ``bias`` (N,): the bias added to every row,
        each sum rounded once to y's dtype. May write into ``y`` (a fresh GEMM output nobody else holds)."""

    def prepare_gemms(self, token_counts: list[int], device: torch.device, weights: Sequence[GemmWeight]) -> float:
        """Compile ahead what GEMMs of these weights need at these token counts (kernels compiled at first use,
        such as DeepGEMM's); the seconds taken, 0 where nothing is compiled ahead."""

    def gemm_exact(self, a: Fp8Tensor, b: Fp8Tensor, out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        """:meth:`gemm` computing each row of ``a`` identically whatever M is (exact mode, :mod:`jetrl.quant.exact`)."""

    def grouped_gemm_exact(self, a: Fp8Tensor, weights: list[Fp8Tensor],
                           out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor | None:
        """``cat([gemm_exact(a, w)], dim=1)``, the same bits, in fewer launches; or ``None`` where the backend does not
        group these operands (the caller then runs the layers one by one)."""

    def matmul_exact(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """Batch-invariant ``x @ w.T`` in x's dtype, x (M, K) and w (N, K) 16/32-bit floats (exact mode)."""


class ReferenceBackend:
    """Pure PyTorch, any device; the fused entry points are compositions of the basic operations."""

    name = "reference"
    fused_kernels = False

    def quantize(self, x: torch.Tensor, block: Block, pow2_scale: bool = False, *,
                 whole_blocks: bool = False) -> Fp8Tensor:
        return reference.quantize_tensor(x, block, pow2_scale, whole_blocks=whole_blocks)

    def requantize(self, t: Fp8Tensor, block: Block, pow2_scale: bool = False, *,
                   whole_blocks: bool = False) -> Fp8Tensor:
        return reference.requantize(t, block, pow2_scale, whole_blocks=whole_blocks)

    def gemm(self, a: Fp8Tensor, b: Fp8Tensor, out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        return reference.gemm(a, b, out_dtype)

    def quantize_weight_pair(self, w: torch.Tensor, pow2_scale: bool = False) -> tuple[Fp8Tensor, Fp8Tensor]:
        q = self.quantize(w, WEIGHT, pow2_scale)
        return q, self.transpose_weight(q)

    def transpose_weight(self, q: Fp8Tensor) -> Fp8Tensor:
        return Fp8Tensor(q.data.t().contiguous(), q.scale.t(), WEIGHT)

    def quantize_act_and_token(self, x: torch.Tensor, pow2_scale: bool = False, *,
                               whole_blocks: bool = False) -> tuple[Fp8Tensor, Fp8Tensor]:
        return self.quantize(x, ACT, pow2_scale), self.quantize(x, TOKEN, pow2_scale, whole_blocks=whole_blocks)

    def grouped_gemm(self, a: Fp8Tensor, weights: list[Fp8Tensor], biases: list[torch.Tensor | None],
                     out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor | None:
        outs = []
        for w, b in zip(weights, biases, strict=True):
            y = self.gemm(a, w, out_dtype)
            outs.append(y + b.to(y.dtype) if b is not None else y)  # as FP8Linear adds its bias
        return torch.cat(outs, dim=1)

    def add_bias(self, y: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        return y + bias.to(y.dtype)

    def prepare_gemms(self, token_counts: list[int], device: torch.device, weights: Sequence[GemmWeight]) -> float:
        return 0.0  # nothing compiled at first use

    def gemm_exact(self, a: Fp8Tensor, b: Fp8Tensor, out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        return reference.gemm_exact(a, b, out_dtype)

    def grouped_gemm_exact(self, a: Fp8Tensor, weights: list[Fp8Tensor],
                           out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor | None:
        return torch.cat([self.gemm_exact(a, w, out_dtype) for w in weights], dim=1)

    def matmul_exact(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return reference.matmul_exact(x, w)


def _cuda_backend() -> Fp8Backend:
    return importlib.import_module("jetrl.quant.kernels.cuda_backend").CudaBackend()  # imports Triton


CHOICES = ("auto", "reference", "cuda")
_FACTORIES: dict[str, Callable[[], Fp8Backend]] = {"reference": ReferenceBackend, "cuda": _cuda_backend}
_INSTANCES: dict[str, Fp8Backend] = {}
_override: str | None = None


def _instance(name: str) -> Fp8Backend:
    if name not in _INSTANCES:
        if name not in _FACTORIES:
            raise ValueError(f"unknown FP8 backend {name!r}; choose one of {CHOICES}")
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
    if name not in CHOICES:
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


# --------------------------------------------------------------------------------------------------
# the fused kernels

KERNEL_DTYPES = (torch.bfloat16, torch.float16, torch.float32)  # the float dtypes the fused kernels take
FUSED_OPS = ("rms_norm", "swiglu", "rope", "logprobs", "paged_decode", "seeded_sample", "exact_attention", "kv_write")
IMPLS = ("reference", "triton")
_FORCED: contextvars.ContextVar[str | None] = contextvars.ContextVar("jetrl_fused_impl", default=None)


@functools.lru_cache(maxsize=None)
def triton_installed() -> bool:
    return importlib.util.find_spec("triton") is not None


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


def choose_impl(x: torch.Tensor, impl: str | None, *, op: str, eligible: bool = True) -> str:
    """``"triton"`` or ``"reference"`` for the fused op ``op`` (one of :data:`FUSED_OPS`) on tensors like ``x``.

    ``impl`` given (or forced by :func:`fused_impl`) wins, after a check that the kernels can run on ``x``
    (CUDA tensors, or any under ``TRITON_INTERPRET=1``). Otherwise the kernels run where ``x`` is a CUDA tensor
    whose FP8 backend has ``fused_kernels`` and ``eligible`` holds (e.g. a dtype the kernels take).
    """
    if op not in FUSED_OPS:
        raise ValueError(f"choose_impl: op must be one of {FUSED_OPS}, got {op!r}")
    if impl is None:
        impl = _FORCED.get()
    if impl is not None and impl not in IMPLS:
        raise ValueError(f"{op}: impl must be one of {IMPLS} or None (automatic), got {impl!r}")
    if impl == "triton" and not x.is_cuda:
        from jetrl.quant.kernels.tuning import interpreting  # kernels are imported lazily (tests/test_layering.py)

        if not interpreting():
            raise ValueError(f"{op}: impl='triton' needs CUDA tensors (or TRITON_INTERPRET=1), got tensors on "
                             f"{x.device}")
    if impl is not None:
        return impl
    if not (eligible and x.is_cuda and triton_installed()):
        return "reference"
    return "triton" if get_backend(x.device).fused_kernels else "reference"


def keeps_forward_context(cls: type) -> type:
    """Class decorator for a ``torch.autograd.Function``: its ``backward`` runs in a copy of the context variables its
    ``forward`` saw (the kernel tuning in force, a forced fused implementation). Autograd runs a CUDA backward on its
    own device threads, which start with empty context variables, so without this a backward would read the
    defaults whatever the forward ran under."""
    forward, backward = cls.forward, cls.backward

    def forward_in_context(ctx, *args):
        ctx.forward_context = contextvars.copy_context()
        return forward(ctx, *args)

    def backward_in_context(ctx, *grads):
        return ctx.forward_context.run(backward, ctx, *grads)

    forward_in_context.__doc__, backward_in_context.__doc__ = forward.__doc__, backward.__doc__
    cls.forward, cls.backward = staticmethod(forward_in_context), staticmethod(backward_in_context)
    return cls


# --------------------------------------------------------------------------------------------------
# public FP8 operations


def quantize(x: torch.Tensor, block: Block = ACT, pow2_scale: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize a 2-D tensor to E4M3 with fp32 scales per ``block`` ((1,128), (128,128) or (128,1)).

    Returns ``(data, scale)`` with ``x ~= data * scale`` broadcast over each block; the exact arithmetic
    is in :mod:`jetrl.quant.formats`. Every backend returns the same bytes.
    """
    reference._check_input(x)
    t = get_backend(x.device).quantize(x, block, pow2_scale)
    return t.data, t.scale


def gemm(a: Fp8Tensor, b: Fp8Tensor, out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Blockwise FP8 ``a @ b.T`` (see :func:`jetrl.quant.reference.gemm` for the operand rules)."""
    return get_backend(a.data.device).gemm(a, b, out_dtype)


def prepare_gemms(token_counts: list[int], device: torch.device | str, weights: Sequence[GemmWeight]) -> float:
    """Compile ahead, on ``device``'s backend, what FP8 GEMMs of ``weights`` (e.g. a model's,
    :func:`jetrl.quant.linear.forward_gemm_weights`) need at these token counts (the CUDA backend: DeepGEMM's
    kernels, where it runs them); the seconds taken."""
    device = torch.device(device)
    return get_backend(device).prepare_gemms(list(token_counts), device, list(weights))
