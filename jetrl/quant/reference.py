"""Pure-PyTorch reference of jetrl's FP8 numerics: the specification every kernel is tested against.

Runs on any device. :func:`dequantize` and :func:`expand_scale` live with the format
(:mod:`jetrl.quant.formats`, which :class:`Fp8Tensor` needs) and are re-exported here. The arithmetic is exactly the convention in :mod:`jetrl.quant.formats`; GPU
kernels reproduce the quantization bit for bit and the GEMMs to output rounding.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from jetrl.quant.formats import (
    ACT,
    AMAX_EPS,
    E4M3,
    E4M3_MAX,
    WEIGHT,
    Block,
    Fp8Tensor,
    check_block,
    dequantize,
    expand_scale,
    scale_shape,
)

__all__ = ["quantize", "quantize_tensor", "dequantize", "expand_scale", "requantize", "gemm",
           "check_gemm_operands", "compute_scale", "round_scale_to_pow2"]

_FLOAT_INPUTS = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def _check_input(x: torch.Tensor, what: str = "input") -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{what} must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() != 2:
        raise ValueError(f"{what} must be 2-D (M, K) to be quantized, got shape {tuple(x.shape)}")
    if x.dtype not in _FLOAT_INPUTS:
        raise TypeError(f"{what} must be float32/bfloat16/float16/float64 to be quantized, got {x.dtype}")


def _blocked(x: torch.Tensor, block: Block) -> torch.Tensor:
    """Zero-pad a 2-D tensor to whole blocks and view it as (Mb, bm, Kb, bk)."""
    m, k = x.shape
    bm, bk = block
    mb, kb = scale_shape((m, k), block)
    x = F.pad(x, (0, kb * bk - k, 0, mb * bm - m))
    return x.view(mb, bm, kb, bk)


def round_scale_to_pow2(scale: torch.Tensor) -> torch.Tensor:
    """Round positive fp32 scales up to the next power of two (exact powers stay), bitwise.

    Done on the fp32 bit pattern (drop the mantissa, bump the exponent if it was non-zero), so every
    backend gets identical results without relying on log2/exp2 accuracy.
    """
    bits = scale.contiguous().view(torch.int32)
    exponent = bits & 0x7F800000
    has_mantissa = (bits & 0x007FFFFF) != 0
    return torch.where(has_mantissa, exponent + (1 << 23), exponent).view(torch.float32)


def compute_scale(amax: torch.Tensor, pow2_scale: bool = False) -> torch.Tensor:
    """fp32 scale from a block's max |x|: ``max(amax, 1e-4) / 448`` (IEEE division, not a reciprocal)."""
    amax = amax.float().clamp_min(AMAX_EPS)
    # Divide by a tensor, not a Python scalar: CUDA's div-by-scalar multiplies by the reciprocal,
    # which is not the correctly rounded quotient the kernels compute.
    scale = amax / torch.full_like(amax, E4M3_MAX)
    return round_scale_to_pow2(scale) if pow2_scale else scale


def quantize(x: torch.Tensor, block: Block = ACT, pow2_scale: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize a 2-D tensor to E4M3 with one fp32 scale per ``block``.

    Returns ``(data, scale)``: ``data`` has ``x``'s shape in ``float8_e4m3fn``; ``scale`` is fp32 of shape
    ``(ceil(M/bm), ceil(K/bk))``. Partial blocks at the edges are quantized over their valid elements.
    See :mod:`jetrl.quant.formats` for the exact arithmetic.
    """
    _check_input(x)
    block = check_block(block)
    m, k = x.shape
    xb = _blocked(x.float(), block)  # (Mb, bm, Kb, bk)
    scale = compute_scale(xb.abs().amax(dim=(1, 3)), pow2_scale)  # (Mb, Kb)
    q = (xb / scale[:, None, :, None]).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3)
    data = q.view(xb.shape[0] * block[0], xb.shape[2] * block[1])[:m, :k].contiguous()
    return data, scale


def quantize_tensor(x: torch.Tensor, block: Block = ACT, pow2_scale: bool = False) -> Fp8Tensor:
    """:func:`quantize` returning an :class:`Fp8Tensor`."""
    data, scale = quantize(x, block, pow2_scale)
    return Fp8Tensor(data, scale, check_block(block))


def requantize(t: Fp8Tensor, block: Block, pow2_scale: bool = False) -> Fp8Tensor:
    """Re-quantize an FP8 tensor with another block shape: dequantize in fp32, then quantize.

    WGrad uses this to turn the saved (1, 128) activation into (128, 1) token groups.
    """
    return quantize_tensor(t.dequantize(), block, pow2_scale)


def check_gemm_operands(a: Fp8Tensor, b: Fp8Tensor) -> None:
    """Raise unless ``a @ b.T`` is a supported blockwise FP8 GEMM."""
    if a.block != ACT:
        raise ValueError(f"FP8 GEMM: the left operand must have (1, 128) blocks, got {a.block}")
    if b.block not in (ACT, WEIGHT):
        raise ValueError(f"FP8 GEMM: the right operand must have (1, 128) or (128, 128) blocks, got {b.block}")
    if a.shape[1] != b.shape[1]:
        raise ValueError(
            f"FP8 GEMM: contraction dims differ: a is {tuple(a.shape)}, b is {tuple(b.shape)} (computes a @ b.T)"
        )


def gemm(a: Fp8Tensor, b: Fp8Tensor, out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Blockwise FP8 GEMM ``a @ b.T``: dequantize both operands blockwise, multiply in fp32, cast.

    ``a`` is (M, K) with (1, 128) blocks; ``b`` is (N, K) with (128, 128) blocks (Fprop: W; DGrad: W^T)
    or (1, 128) blocks (WGrad: both operands grouped by 128 along the token dimension, which is K here).
    """
    check_gemm_operands(a, b)
    return (a.dequantize() @ b.dequantize().t()).to(out_dtype)
