"""Public FP8 operations, dispatched through the backend seam (reference on CPU, kernels on Hopper)."""

from __future__ import annotations

import torch

from jetrl.quant import reference
from jetrl.quant.backend import get_backend
from jetrl.quant.formats import ACT, Block, Fp8Tensor, check_block


def quantize(x: torch.Tensor, block: Block = ACT, pow2_scale: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize a 2-D tensor to E4M3 with fp32 scales per ``block`` ((1,128), (128,128) or (128,1)).

    Returns ``(data, scale)`` with ``x ~= data * scale`` broadcast over each block; the exact arithmetic
    is in :mod:`jetrl.quant.formats`. Every backend returns the same bytes.
    """
    reference._check_input(x)
    t = get_backend(x.device).quantize(x, check_block(block), pow2_scale)
    return t.data, t.scale


def dequantize(data: torch.Tensor, scale: torch.Tensor, block: Block) -> torch.Tensor:
    """fp32 ``data * scale`` with each scale broadcast over its block."""
    return reference.dequantize(data, scale, block)


def gemm(a: Fp8Tensor, b: Fp8Tensor, out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Blockwise FP8 ``a @ b.T`` (see :func:`jetrl.quant.reference.gemm` for the operand rules)."""
    reference.check_gemm_operands(a, b)
    return get_backend(a.data.device).gemm(a, b, out_dtype)
