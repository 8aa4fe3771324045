"""Fused residual add + RMSNorm, optionally with the 1x128 FP8 quantization of its output.

A decoder layer normalises ``h = x + residual`` twice; unfused that is a residual add, six small
reduction/elementwise kernels and, in the ``jet`` recipe, one activation-quantization kernel for the next
linear. :func:`rms_norm` does all of it in one kernel on CUDA (:mod:`jetrl.quant.kernels.norm_triton`) and in
plain PyTorch elsewhere (:func:`rms_norm_reference`, the specification). Both round where the model's
unfused code rounds: the add in the activation dtype, the normalised value cast back to that dtype before
the weight multiplies it. The FP8 output is bitwise ``reference.quantize(out, (1, 128), pow2_scale)`` of
the very ``out`` returned, so a consumer that takes it gets exactly what quantizing ``out`` would give.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from jetrl.quant import reference
from jetrl.quant.formats import ACT, Fp8Tensor
from jetrl.quant.backend import KERNEL_DTYPES, choose_impl, keeps_forward_context

# dtypes rms_norm takes: the kernels' (KERNEL_DTYPES) and float64, which takes the reference path; others are a
# TypeError
_REFERENCE_DTYPES = KERNEL_DTYPES + (torch.float64,)


class NormOutput(NamedTuple):
    """Result of :func:`rms_norm`."""

    out: torch.Tensor  # (..., D) ``weight * normalised(h)``, dtype promote(weight, x)
    residual: torch.Tensor | None  # (..., D) ``h = x + residual`` (the new residual stream), or None
    out_fp8: Fp8Tensor | None  # 1x128 FP8 of ``out`` viewed as (M, D), only with ``quantize=True``


def _check_inputs(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"rms_norm: x must be a torch.Tensor, got {type(x).__name__}")
    if not isinstance(weight, torch.Tensor):
        raise TypeError(f"rms_norm: weight must be a torch.Tensor, got {type(weight).__name__}")
    if x.dim() < 1 or x.shape[-1] == 0:
        raise ValueError(f"rms_norm: x must have a non-empty last dimension, got shape {tuple(x.shape)}")
    if weight.dim() != 1 or weight.shape[0] != x.shape[-1]:
        raise ValueError(f"rms_norm: weight must have shape ({x.shape[-1]},) to match x {tuple(x.shape)}, got "
                         f"{tuple(weight.shape)}")
    if x.dtype not in _REFERENCE_DTYPES or weight.dtype not in _REFERENCE_DTYPES:
        raise TypeError(f"rms_norm: x and weight must be bf16/fp16/fp32/fp64, got {x.dtype} and {weight.dtype}")
    if weight.device != x.device:
        raise ValueError(f"rms_norm: weight is on {weight.device} but x is on {x.device}")
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not eps >= 0:
        raise ValueError(f"rms_norm: eps must be a non-negative float, got {eps!r}")
    if residual is not None:
        if not isinstance(residual, torch.Tensor):
            raise TypeError(f"rms_norm: residual must be a torch.Tensor or None, got {type(residual).__name__}")
        for what, error in (("shape", ValueError), ("dtype", TypeError), ("device", ValueError)):
            if getattr(residual, what) != getattr(x, what):
                raise error(f"rms_norm: residual {what} {getattr(residual, what)} differs from x's {getattr(x, what)}")


def rms_norm_reference(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
    *,
    quantize: bool = False,
    pow2_scale: bool = False,
) -> NormOutput:
    """The specification: the model's unfused formulas, op for op (autograd differentiates them)."""
    _check_inputs(x, weight, eps, residual)
    h = x + residual if residual is not None else x
    h32 = h.float()
    normed = (h32 * torch.rsqrt(h32.pow(2).mean(-1, keepdim=True) + eps)).to(h.dtype)
    out = weight * normed
    out_fp8 = reference.quantize_tensor(out.detach().reshape(-1, out.shape[-1]), ACT, pow2_scale) if quantize else None
    return NormOutput(out, h if residual is not None else None, out_fp8)


@keeps_forward_context  # the backward kernels read the forward's tuning on autograd's CUDA threads too
class _FusedRMSNorm(torch.autograd.Function):
    """Triton forward and backward on 2-D rows. Saves ``h`` (``x`` itself, or the returned residual
    stream: no extra memory) and the per-row fp32 ``rstd``, so the backward repeats no reduction."""

    @staticmethod
    def forward(ctx, x, residual, weight, eps, quantize, pow2_scale):
        from jetrl.quant.kernels import norm_triton

        out, h, rstd, fp8 = norm_triton.rms_norm_forward(x, residual, weight, eps, quantize, pow2_scale)
        ctx.set_materialize_grads(False)
        ctx.has_residual = residual is not None
        ctx.save_for_backward(h if residual is not None else x, weight, rstd)
        q_data, q_scale = (fp8.data, fp8.scale) if fp8 is not None else (None, None)
        if fp8 is not None:
            ctx.mark_non_differentiable(q_data, q_scale)
        return out, h, q_data, q_scale

    @staticmethod
    def backward(ctx, grad_out, grad_h, _grad_q, _grad_scale):
        from jetrl.quant.kernels import norm_triton

        h, weight, rstd = ctx.saved_tensors
        need_x, need_res, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1], ctx.needs_input_grad[2]
        if grad_out is None:  # only the residual stream was used: it passes its gradient through unchanged
            return grad_h if need_x else None, grad_h if need_res else None, None, None, None, None
        grad_in, grad_w = norm_triton.rms_norm_backward(grad_out, grad_h if ctx.has_residual else None, h, weight,
                                                        rstd, compute_dweight=need_w)
        # grad of x and of the input residual are both grad_h: one tensor serves both (autograd never
        # accumulates in place into a gradient that is referenced twice)
        return (grad_in if need_x else None, grad_in if need_res else None, grad_w, None, None, None)


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
    *,
    quantize: bool = False,
    pow2_scale: bool = False,
    impl: str | None = None,
) -> NormOutput:
    """``weight * rmsnorm(x + residual)`` with the new residual stream and optionally the FP8 of the output.

    ``impl``: ``"reference"`` (PyTorch, any device), ``"triton"`` (the fused kernels; on CPU only under
    ``TRITON_INTERPRET=1``), ``None``: the kernels for CUDA tensors when the FP8 backend of the device is
    ``"cuda"``, the reference otherwise. Differentiable w.r.t. ``x``, ``residual`` and ``weight`` through
    ``out`` and ``residual``; ``out_fp8`` is not differentiable.
    """
    _check_inputs(x, weight, eps, residual)
    kernel_dtypes = x.dtype in KERNEL_DTYPES and weight.dtype in KERNEL_DTYPES
    if impl == "triton" and not kernel_dtypes:
        raise TypeError(f"rms_norm: the Triton kernels take bf16/fp16/fp32, got x {x.dtype}, weight {weight.dtype}")
    impl = choose_impl(x, impl, eligible=kernel_dtypes, op="rms_norm")
    if impl == "reference" or not kernel_dtypes:  # (a block forcing the kernels still runs other dtypes here)
        return rms_norm_reference(x, weight, eps, residual, quantize=quantize, pow2_scale=pow2_scale)

    shape = x.shape
    x2 = x.reshape(-1, x.shape[-1]).contiguous()  # the backward reads a saved x as row-major (M, D) rows
    r2 = residual.reshape(-1, residual.shape[-1]) if residual is not None else None
    needs_grad = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (x, weight, residual))
    if needs_grad:
        out, h, q_data, q_scale = _FusedRMSNorm.apply(x2, r2, weight, float(eps), bool(quantize), bool(pow2_scale))
        fp8 = Fp8Tensor(q_data, q_scale, ACT) if quantize else None
    else:
        from jetrl.quant.kernels import norm_triton

        out, h, _, fp8 = norm_triton.rms_norm_forward(x2, r2, weight, float(eps), bool(quantize), bool(pow2_scale))
    return NormOutput(out.view(shape), h.view(shape) if h is not None else None, fp8)
