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
not: its loop computes ``x / (1 + exp(-x))`` with the SIMD ``exp`` on whole vectors but with the C library's
``exp`` on the elements left over at the end of each contiguous run (fewer than two vectors), on strided inputs,
and at the ends of the ranges that several threads split a large tensor into. The two ``exp`` differ in the last
bit for a few percent of inputs, so an element's bits depend on where it lands in the tensor: on the number of rows
and, with several threads, on how that number divides among them (in fp32 nothing rounds the difference away: the
engine's and the trainer's log-probabilities then differ by an ulp). With ``exact`` the reference on the CPU
computes the formula from ops that evaluate every element alike (:func:`silu`): ``torch.exp`` (one vector-math
function over the whole buffer, leftover elements included; strided inputs through a contiguous buffer), a
negation, an addition and an IEEE division, in fp32, rounded to the dtype once; the backward is ATen's
``silu_backward``, as under ``F.silu``. Fast mode keeps ``F.silu`` (its CPU numerics unchanged); so does CUDA,
where ``F.silu`` and the kernels compute every element alike.

Dispatch (:func:`jetrl.quant.backend.choose_impl`): CUDA tensors go to the Triton kernels when the FP8 backend
for the device is ``"cuda"``; everything else runs the reference. ``impl="reference" | "triton"`` forces one (the Triton
kernels run on CPU tensors under ``TRITON_INTERPRET=1``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from jetrl.quant import reference
from jetrl.quant.backend import choose_impl, keeps_forward_context
from jetrl.quant.formats import ACT, Fp8Tensor

_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def use_triton(x: torch.Tensor, impl: str | None) -> bool:
    """Whether ``impl`` (``None`` = automatic, see :func:`jetrl.quant.backend.choose_impl`) selects the kernels."""
    return choose_impl(x, impl, op="swiglu") == "triton"


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
    """``F.silu(x)``; ``exact``: batch-invariant, an element's bits depending on its value alone (not on its position
    in ``x``, ``x``'s size or strides, or the thread count): on the CPU the formula from ops that compute every element
    alike (ATen's CPU ``F.silu`` does not, see the module doc), elsewhere ``F.silu``."""
    return _SiLU.apply(x) if exact and x.device.type == "cpu" else F.silu(x)


def swiglu_reference(gate: torch.Tensor, up: torch.Tensor, exact: bool = False) -> torch.Tensor:
    """The unfused model code, the specification of the fused kernels; ``exact``: with :func:`silu`'s batch-invariant
    form (exact mode)."""
    return silu(gate, exact) * up


def _check_pair(gate: torch.Tensor, up: torch.Tensor) -> None:
    for name, t in (("gate", gate), ("up", up)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"swiglu: {name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dtype not in _DTYPES:
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


@keeps_forward_context  # the backward kernels read the forward's tuning on autograd's CUDA threads too
class _SwiGLU(torch.autograd.Function):
    """Triton forward/backward of ``silu(gate) * up`` on 2-D inputs; the FP8 outputs carry no gradient."""

    @staticmethod
    def forward(ctx, gate, up, quantize: bool, pow2_scale: bool, fp8_only: bool):
        from jetrl.quant.kernels import swiglu_triton

        out, data, scale = swiglu_triton.swiglu_fwd(gate, up, quantize, pow2_scale, write_out=not fp8_only)
        if out is None:
            out = _unwritten(gate)
        ctx.save_for_backward(gate, up)
        if quantize:
            ctx.mark_non_differentiable(data, scale)
        return out, data, scale

    @staticmethod
    def backward(ctx, grad, _grad_data, _grad_scale):
        from jetrl.quant.kernels import swiglu_triton

        gate, up = ctx.saved_tensors
        d_gate = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
        d_up = torch.empty(up.shape, dtype=up.dtype, device=up.device)
        swiglu_triton.swiglu_bwd(_rows(grad), gate, up, d_gate, d_up)
        return d_gate, d_up, None, None, None


@keeps_forward_context  # the backward kernels read the forward's tuning on autograd's CUDA threads too
class _SwiGLUPacked(torch.autograd.Function):
    """As :class:`_SwiGLU` for one (M, 2K) input ``cat([gate, up], -1)``; its gradient is one (M, 2K) tensor."""

    @staticmethod
    def forward(ctx, gate_up, quantize: bool, pow2_scale: bool, fp8_only: bool):
        from jetrl.quant.kernels import swiglu_triton

        k = gate_up.shape[1] // 2
        out, data, scale = swiglu_triton.swiglu_fwd(gate_up[:, :k], gate_up[:, k:], quantize, pow2_scale,
                                                    write_out=not fp8_only)
        if out is None:
            out = _unwritten(gate_up[:, :k])
        ctx.save_for_backward(gate_up)
        if quantize:
            ctx.mark_non_differentiable(data, scale)
        return out, data, scale

    @staticmethod
    def backward(ctx, grad, _grad_data, _grad_scale):
        from jetrl.quant.kernels import swiglu_triton

        (gate_up,) = ctx.saved_tensors
        k = gate_up.shape[1] // 2
        d = torch.empty(gate_up.shape, dtype=gate_up.dtype, device=gate_up.device)
        swiglu_triton.swiglu_bwd(_rows(grad), gate_up[:, :k], gate_up[:, k:], d[:, :k], d[:, k:])
        return d, None, None, None


def _unwritten(like: torch.Tensor) -> torch.Tensor:
    """The BF16 output that ``fp8_only`` leaves unwritten: one NaN broadcast to ``like``'s shape and dtype (no
    memory), so that a reader that should have taken the FP8 gets NaN, never stale memory."""
    return torch.full((), float("nan"), dtype=like.dtype, device=like.device).expand(like.shape)


def _finish(out2d: torch.Tensor, data, scale, lead_shape, quantize: bool):
    out = out2d.reshape(*lead_shape, out2d.shape[-1])
    return out, (Fp8Tensor(data, scale, ACT) if quantize else None)


def _fp8_only(fp8_only: bool, quantize: bool) -> bool:
    if fp8_only and not quantize:
        raise ValueError("swiglu: fp8_only=True needs quantize=True (the FP8 output is the only one written)")
    return bool(fp8_only)


def _reference_out(out: torch.Tensor, fp8_only: bool) -> torch.Tensor:
    """The reference's ``out``; under ``fp8_only`` NaN everywhere like the kernels' unwritten one (``out + NaN``:
    the gradient still flows as through ``out``)."""
    return out + _unwritten(out) if fp8_only else out


def _reference_fp8(out: torch.Tensor, quantize: bool, pow2_scale: bool) -> Fp8Tensor | None:
    if not quantize:
        return None
    return reference.quantize_tensor(out.detach().reshape(-1, out.shape[-1]), ACT, pow2_scale)


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
    _check_pair(gate, up)
    fp8_only = _fp8_only(fp8_only, quantize)
    if not use_triton(gate, impl):
        out = swiglu_reference(gate, up, exact)
        return _reference_out(out, fp8_only), _reference_fp8(out, quantize, pow2_scale)
    out, data, scale = _SwiGLU.apply(_rows(gate), _rows(up), quantize, pow2_scale, fp8_only)
    return _finish(out, data, scale, gate.shape[:-1], quantize)


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
    _check_pair(gate_up[..., :k], gate_up[..., k:])
    fp8_only = _fp8_only(fp8_only, quantize)
    if not use_triton(gate_up, impl):
        out = swiglu_reference(gate_up[..., :k], gate_up[..., k:], exact)
        return _reference_out(out, fp8_only), _reference_fp8(out, quantize, pow2_scale)
    out, data, scale = _SwiGLUPacked.apply(_rows(gate_up), quantize, pow2_scale, fp8_only)
    return _finish(out, data, scale, gate_up.shape[:-1], quantize)
