"""Triton kernel of a linear layer's bias: ``y + bias`` over the rows of a GEMM output, in place.

ATen's ``y + bias`` for a (M, N) ``y`` and a (N,) ``bias`` broadcasts the bias with a zero row stride, which
sends it to ATen's generic (not vectorized) elementwise loop: at a training micro-batch of q/k/v outputs that
loop reads and writes far below the copy bandwidth. This kernel adds the bias tile by tile, each row of a tile
reading the same bias slice.

The arithmetic is ATen's: both operands in fp32, one addition, the sum rounded to y's dtype (nearest even, under
the interpreter too: :func:`~jetrl.quant.kernels.quantize_triton.cast_rne`), so the result is bitwise
``y + bias.to(y.dtype)``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from jetrl.quant.kernels.quantize_triton import cast_rne

BLOCK_M = 16
BLOCK_N = 256
DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@triton.jit(do_not_specialize=["M"])
def _add_bias_kernel(y_ptr, b_ptr, M, N, stride_m, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = rn < N
    mask = (rm < M)[:, None] & n_ok[None, :]
    bias = tl.load(b_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)
    ptrs = y_ptr + rm.to(tl.int64)[:, None] * stride_m + rn[None, :]
    out = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32) + bias[None, :]
    tl.store(ptrs, cast_rne(out, y_ptr.dtype.element_ty), mask=mask)


def supports(y: torch.Tensor, bias: torch.Tensor) -> bool:
    """Whether :func:`add_bias_` takes these operands: a 2-D ``y`` of a 16- or 32-bit float dtype with unit column
    stride and a 1-D ``bias`` of y's dtype and width, contiguous, on y's device."""
    return (y.dim() == 2 and y.dtype in DTYPES and (y.shape[1] <= 1 or y.stride(1) == 1) and bias.dim() == 1
            and bias.dtype == y.dtype and bias.shape[0] == y.shape[1] and bias.is_contiguous()
            and bias.device == y.device)


def add_bias_(y: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """``y += bias`` over the rows of ``y`` (see :func:`supports`); returns ``y``."""
    if not supports(y, bias):
        raise ValueError(f"add_bias_: needs a 2-D {[str(d)[6:] for d in DTYPES]} y with unit column stride and a "
                         f"contiguous bias of its dtype and width; got y {tuple(y.shape)} {y.dtype} strides "
                         f"{tuple(y.stride())}, bias {tuple(bias.shape)} {bias.dtype}")
    m, n = y.shape
    if m and n:
        grid = (triton.cdiv(m, BLOCK_M), triton.cdiv(n, BLOCK_N))
        _add_bias_kernel[grid](y, bias, m, n, y.stride(0), BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, num_warps=4,
                               enable_fp_fusion=False)
    return y
