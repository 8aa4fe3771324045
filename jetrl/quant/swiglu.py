"""Fused SwiGLU: ``silu(gate) * up`` in one kernel, optionally with the 1x128 FP8 of its output.

The MLP of every supported decoder computes ``down(silu(gate(x)) * up(x))``. Unfused, that is two
elementwise kernels (silu, multiply) and, under an FP8 recipe, a third that quantizes the product for the
down projection. The fused op reads ``gate`` and ``up`` once and writes the BF16 product and, when asked,
its FP8 (data, scale) pair, which ``down``'s FP8 GEMM consumes directly.

Numerics: the PyTorch reference (:func:`swiglu_reference`) *is* the unfused model code, and the Triton
kernels reproduce its roundings op for op (see :mod:`jetrl.quant.kernels.swiglu_triton`): silu in fp32 rounded to
the dtype, the product rounded to the dtype, the FP8 taken of that rounded product. The backward rounds
where autograd of the unfused code rounds, so training sees the same gradients with or without fusion.

**Exact mode** (``exact=True``, :mod:`jetrl.quant.exact`) needs silu batch-invariant, and ATen's CPU ``F.silu`` is
not: it takes the SIMD ``exp`` on whole vectors but the C library's on the leftovers of each contiguous run, on
strided inputs and at the ends of each thread's range. The two differ in the last bit for a few percent of inputs,
so an element's bits follow the number of rows and the thread count (in fp32 nothing rounds that away: the
engine's and the trainer's log-probabilities then differ by an ulp). With ``exact`` the CPU reference computes
:func:`silu` from ops that evaluate every element alike (``torch.exp`` over one contiguous buffer, a negation, an
addition and an IEEE division, in fp32, rounded to the dtype once; the backward is ATen's ``silu_backward``, as
under ``F.silu``). Fast mode and CUDA, where every element is computed alike, keep ``F.silu``.

Dispatch: :func:`jetrl.quant.backend.choose_impl` (``impl="reference" | "triton"`` forces one).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from jetrl.quant import reference
from jetrl.quant.backend import KERNEL_DTYPES, choose_impl, keeps_forward_context
from jetrl.quant.formats import ACT, Fp8Tensor


class _SiLU(torch.autograd.Function):
    """``x / (1 + exp(-x))`` in fp32 rounded to x's dtype, from ops that compute every element alike (see the module
    doc); the backward is ATen's ``silu_backward``, the one ``F.silu``'s autograd runs."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        xf = x.float()
        return (xf / torch.exp(-xf).add_(1.0)).to(x.dtype)

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        return torch.ops.aten.silu_backward(grad, x)


def silu(x: torch.Tensor, exact: bool = False) -> torch.Tensor:
    """``F.silu(x)``; ``exact``: batch-invariant, an element's bits depending on its value alone (on the CPU
    :class:`_SiLU`, see the module doc)."""
    return _SiLU.apply(x) if exact and x.device.type == "cpu" else F.silu(x)


def swiglu_reference(gate: torch.Tensor, up: torch.Tensor, exact: bool = False) -> torch.Tensor:
    """The unfused model code, the specification of the fused kernels; ``exact``: with :func:`silu`'s batch-invariant
    form (exact mode)."""
    return silu(gate, exact) * up


def _check_pair(gate: torch.Tensor, up: torch.Tensor) -> None:
    for name, t in (("gate", gate), ("up", up)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"swiglu: {name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dtype not in KERNEL_DTYPES:
            raise TypeError(f"swiglu: {name} must be bfloat16, float16 or float32, got {t.dtype}")
        if t.dim() < 1:
            raise ValueError(f"swiglu: {name} must have at least one dimension, got a scalar")
    if gate.shape != up.shape:
        raise ValueError(f"swiglu: gate and up must have the same shape, got {tuple(gate.shape)} and {tuple(up.shape)}")
    if gate.dtype != up.dtype:
        raise TypeError(f"swiglu: gate and up must have the same dtype, got {gate.dtype} and {up.dtype}")
    if gate.device != up.device:
        raise ValueError(f"swiglu: gate and up must be on the same device, got {gate.device} and {up.device}")


def _rows(x: torch.Tensor) -> torch.Tensor:
    """(..., K) as 2-D (M, K) with a unit column stride (a view where possible)."""
    x = x.reshape(x.shape[:-1].numel(), x.shape[-1])
    return x if x.stride(1) == 1 or x.shape[1] <= 1 else x.contiguous()


def _halves(a: torch.Tensor, b: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(a, b)``, or with ``b`` None the two halves of ``a``'s columns (``cat([gate, up], -1)``)."""
    if b is not None:
        return a, b
    k = a.shape[1] // 2
    return a[:, :k], a[:, k:]


@keeps_forward_context  # the backward kernels read the forward's tuning on autograd's CUDA threads too
class _SwiGLU(torch.autograd.Function):
    """Triton forward/backward of ``silu(gate) * up`` on 2-D inputs ``gate`` and ``up``, or with ``up`` None on one
    (M, 2K) input ``cat([gate, up], -1)``, whose gradient is then one (M, 2K) tensor. The FP8 outputs carry no
    gradient."""

    @staticmethod
    def forward(ctx, a, b, quantize: bool, pow2_scale: bool, fp8_only: bool):
        from jetrl.quant.kernels import swiglu_triton

        gate, up = _halves(a, b)
        out, data, scale = swiglu_triton.swiglu_fwd(gate, up, quantize, pow2_scale, write_out=not fp8_only)
        if out is None:
            out = _unwritten(gate)
        ctx.save_for_backward(a, b)
        if quantize:
            ctx.mark_non_differentiable(data, scale)
        return out, data, scale

    @staticmethod
    def backward(ctx, grad, _grad_data, _grad_scale):
        from jetrl.quant.kernels import swiglu_triton

        a, b = ctx.saved_tensors
        d_a = torch.empty(a.shape, dtype=a.dtype, device=a.device)
        d_b = None if b is None else torch.empty(b.shape, dtype=b.dtype, device=b.device)
        swiglu_triton.swiglu_bwd(_rows(grad), *_halves(a, b), *_halves(d_a, d_b))
        return d_a, d_b, None, None, None


_NANS: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}


def _unwritten(like: torch.Tensor) -> torch.Tensor:
    """The BF16 output that ``fp8_only`` leaves unwritten: one NaN broadcast to ``like``'s shape and dtype (no
    memory), so that a reader that should have taken the FP8 gets NaN, never stale memory. The NaN is made once per
    dtype and device outside CUDA-graph capture (a graph would hold one fill launch per call; a tensor first made
    inside one holds its NaN only once the graph has run), and read-only."""
    key = (like.dtype, like.device)
    nan = _NANS.get(key)
    if nan is None:
        nan = torch.full((), float("nan"), dtype=like.dtype, device=like.device)
        if not (like.is_cuda and torch.cuda.is_current_stream_capturing()):
            _NANS[key] = nan
    return nan.expand(like.shape)


def _swiglu(gate: torch.Tensor, up: torch.Tensor, gate_up: torch.Tensor | None, quantize: bool, pow2_scale: bool,
            fp8_only: bool, impl: str | None, exact: bool) -> tuple[torch.Tensor, Fp8Tensor | None]:
    """:func:`swiglu`; ``gate_up``: the packed input whose halves ``gate`` and ``up`` are (None: two tensors)."""
    _check_pair(gate, up)
    if fp8_only and not quantize:
        raise ValueError("swiglu: fp8_only=True needs quantize=True (the FP8 output is the only one written)")
    if choose_impl(gate, impl, op="swiglu") != "triton":
        out = swiglu_reference(gate, up, exact)
        fp8 = reference.quantize_tensor(out.detach().reshape(-1, out.shape[-1]), ACT, pow2_scale) if quantize else None
        # under fp8_only NaN everywhere like the kernels' unwritten out (``out + NaN``: the gradient still flows)
        return (out + _unwritten(out) if fp8_only else out), fp8
    a, b = (_rows(gate), _rows(up)) if gate_up is None else (_rows(gate_up), None)
    out, data, scale = _SwiGLU.apply(a, b, quantize, pow2_scale, bool(fp8_only))
    return out.reshape(*gate.shape[:-1], out.shape[-1]), (Fp8Tensor(data, scale, ACT) if quantize else None)


def swiglu(gate: torch.Tensor, up: torch.Tensor, *, quantize: bool = False, pow2_scale: bool = False,
           fp8_only: bool = False, impl: str | None = None,
           exact: bool = False) -> tuple[torch.Tensor, Fp8Tensor | None]:
    """``silu(gate) * up`` for ``gate``/``up`` of shape (..., K); differentiable in both.

    Returns ``(out, fp8)``: ``out`` (..., K) in the inputs' dtype; ``fp8`` (when ``quantize``) the 1x128
    quantization of ``out`` flattened to (M, K), bitwise ``reference.quantize(out, (1, 128), pow2_scale)``,
    else ``None``. ``exact``: batch-invariant (exact mode; the kernels are, the reference takes :func:`silu`'s exact
    form).

    ``fp8_only`` (with ``quantize``): the caller's consumer reads the FP8 alone (an FP8 linear handed ``fp8``), so
    the BF16 product is not written: ``out`` then reads NaN everywhere (one NaN broadcast on the kernels' path; the
    product plus NaN on the reference's), and it stays differentiable: the gradient flows as through the product.
    """
    return _swiglu(gate, up, None, quantize, pow2_scale, fp8_only, impl, exact)


def swiglu_packed(gate_up: torch.Tensor, *, quantize: bool = False, pow2_scale: bool = False,
                  fp8_only: bool = False, impl: str | None = None,
                  exact: bool = False) -> tuple[torch.Tensor, Fp8Tensor | None]:
    """:func:`swiglu` of ``gate_up`` (..., 2K) = ``cat([gate, up], -1)`` (a fused gate/up projection's output).

    Same math and outputs as ``swiglu(gate_up[..., :K], gate_up[..., K:])`` (``fp8_only`` included); the gradient
    is one (..., 2K) tensor written by one kernel.
    """
    if not isinstance(gate_up, torch.Tensor):
        raise TypeError(f"swiglu_packed: gate_up must be a torch.Tensor, got {type(gate_up).__name__}")
    if gate_up.dim() < 1 or gate_up.shape[-1] % 2:
        raise ValueError(f"swiglu_packed: gate_up's last dimension must be even (gate and up side by side), "
                         f"got shape {tuple(gate_up.shape)}")
    k = gate_up.shape[-1] // 2
    return _swiglu(gate_up[..., :k], gate_up[..., k:], gate_up, quantize, pow2_scale, fp8_only, impl, exact)
