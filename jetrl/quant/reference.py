"""Pure-PyTorch reference of jetrl's FP8 numerics: the specification every kernel is tested against.

Runs on any device. The arithmetic is exactly the convention in :mod:`jetrl.quant.formats` (where
:func:`dequantize` and :func:`expand_scale` live, re-exported here); GPU kernels reproduce the quantization bit for
bit and the GEMMs to output rounding.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from jetrl.quant.formats import (
    ACT, AMAX_EPS, E4M3, E4M3_MAX, WEIGHT, Block, Fp8Tensor, check_block, dequantize, expand_scale, scale_shape,
)

__all__ = ["quantize", "quantize_tensor", "pad_to_whole_blocks", "dequantize", "expand_scale", "requantize", "gemm",
           "check_gemm_operands", "compute_scale", "round_scale_to_pow2", "gemm_exact", "matmul_exact",
           "row_invariant_matmul", "EXACT_ROW_CHUNK", "EXACT_KV_CHUNK"]

# exact mode (see jetrl.quant.exact): rows of one fixed-shape product in the batch-invariant GEMMs, and key
# positions per step of exact attention's online softmax (the reference and the kernel)
EXACT_ROW_CHUNK = 64
EXACT_KV_CHUNK = 64

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


def pad_to_whole_blocks(x: torch.Tensor, block: Block) -> torch.Tensor:
    """``x`` (M, K) with zero rows appended up to a multiple of ``block[0]`` rows.

    Quantizing the result gives x's own bytes and scales on its rows (the zeros move no block's maximum,
    exactly like :func:`quantize`'s padding of a partial block) and zeros past them: WGrad's 128x1 operands
    take this form so that its GEMM, which contracts over the rows (tokens), sees whole 128-row blocks."""
    rows = -(-x.shape[0] // block[0]) * block[0]
    return F.pad(x, (0, 0, 0, rows - x.shape[0])) if rows != x.shape[0] else x


def quantize_tensor(x: torch.Tensor, block: Block = ACT, pow2_scale: bool = False, *,
                    whole_blocks: bool = False) -> Fp8Tensor:
    """:func:`quantize` returning an :class:`Fp8Tensor`; ``whole_blocks``: that of ``pad_to_whole_blocks(x, block)``."""
    block = check_block(block)
    data, scale = quantize(pad_to_whole_blocks(x, block) if whole_blocks else x, block, pow2_scale)
    return Fp8Tensor(data, scale, block)


def requantize(t: Fp8Tensor, block: Block, pow2_scale: bool = False, *, whole_blocks: bool = False) -> Fp8Tensor:
    """Re-quantize an FP8 tensor with another block shape: dequantize in fp32, then quantize.

    WGrad uses this to turn the saved (1, 128) activation into (128, 1) token groups.
    """
    return quantize_tensor(t.dequantize(), block, pow2_scale, whole_blocks=whole_blocks)


def check_gemm_operands(a: Fp8Tensor, b: Fp8Tensor) -> None:
    """Raise unless ``a @ b.T`` is a supported blockwise FP8 GEMM."""
    if a.block != ACT:
        raise ValueError(f"FP8 GEMM: the left operand must have (1, 128) blocks, got {a.block}")
    if b.block not in (ACT, WEIGHT):
        raise ValueError(f"FP8 GEMM: the right operand must have (1, 128) or (128, 128) blocks, got {b.block}")
    if a.shape[1] != b.shape[1]:
        raise ValueError(f"FP8 GEMM: contraction dims differ: a is {tuple(a.shape)}, b is {tuple(b.shape)} "
                         "(computes a @ b.T)")


def gemm(a: Fp8Tensor, b: Fp8Tensor, out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Blockwise FP8 GEMM ``a @ b.T``: dequantize both operands blockwise, multiply in fp32
    (:func:`row_invariant_matmul`), cast.

    ``a`` is (M, K) with (1, 128) blocks; ``b`` is (N, K) with (128, 128) blocks (Fprop: W; DGrad: W^T)
    or (1, 128) blocks (WGrad: both operands grouped by 128 along the token dimension, which is K here).
    Each row of the output is computed identically whatever M is (fixed-shape products of 64 rows), so a row's
    result does not depend on how many rows ``a`` has (a decode step's few or a training micro-batch's thousands):
    the CPU's rollout and trainer compute the same FP8 policy. The same function as :func:`gemm_exact` (the
    reference needs no faster, order-changing variant); kernels match it to output rounding.
    """
    check_gemm_operands(a, b)
    return row_invariant_matmul(a.dequantize(), b.dequantize(), out_dtype)


def row_invariant_matmul(a: torch.Tensor, b: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """``a @ b.T`` for a (M, K) and b (N, K), each output row computed identically whatever M is.

    The rows are padded with zeros to whole chunks of :data:`EXACT_ROW_CHUNK` and each chunk is one product
    of the same shape, in ``a``'s dtype; the result is cast to ``out_dtype`` (default: ``a``'s). The
    reference backend's exact GEMMs; runs on any device.
    """
    if a.dim() != 2 or b.dim() != 2 or a.shape[1] != b.shape[1]:
        raise ValueError(f"row_invariant_matmul: a (M, K) and b (N, K) needed, got {tuple(a.shape)} and "
                         f"{tuple(b.shape)}")
    m, n = a.shape[0], b.shape[0]
    chunk = EXACT_ROW_CHUNK
    out = torch.empty((m, n), dtype=out_dtype or a.dtype, device=a.device)
    if m == 0:
        return out
    padded = a.new_zeros((-(-m // chunk)) * chunk, a.shape[1])
    padded[:m] = a
    for start in range(0, m, chunk):
        end = min(m, start + chunk)
        out[start:end] = F.linear(padded[start:start + chunk], b)[:end - start]
    return out


def matmul_exact(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Batch-invariant ``x @ w.T`` in x's dtype (exact mode's non-FP8 linears and LM head)."""
    return row_invariant_matmul(x, w)


def gemm_exact(a: Fp8Tensor, b: Fp8Tensor, out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Exact mode's GEMM: each row of ``a`` computed identically whatever M is, which the reference's :func:`gemm`
    already is (the kernels' exact GEMMs, like their fast ones, match it to output rounding: their bits are each
    other's, not this function's)."""
    return gemm(a, b, out_dtype)
