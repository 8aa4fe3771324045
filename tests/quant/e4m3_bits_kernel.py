"""A test kernel around the decode kernel's E4M3 conversion by bit operations (``_load_e4m3_bytes``): 64 rows of 4
E4M3 values -> bf16 or fp32, through the PTX (``ptx=True``, a GPU) or Triton's integer ops (the interpreter).
Imported by ``test_decode_attention_bits.py`` and its interpreter child (a jitted kernel needs a source file)."""

import torch
import triton
import triton.language as tl

from jetrl.quant.kernels import paged_attention_triton as P


@triton.jit
def _convert_bytes_kernel(src, dst, DTYPE: tl.constexpr, PTX: tl.constexpr):
    row = tl.arange(0, 64)
    x = P._load_e4m3_bytes(src, row * 4, row < 64, tl.arange(0, 4), 4, DTYPE, PTX)
    tl.store(dst + row[:, None] * 4 + tl.arange(0, 4)[None, :], x)


def convert_bytes(codes: torch.Tensor, dtype: torch.dtype, ptx: bool) -> torch.Tensor:
    """``codes`` (64, 4) float8_e4m3fn -> (64, 4) ``dtype`` (bfloat16 or float32)."""
    out = torch.empty(64, 4, dtype=dtype, device=codes.device)
    _convert_bytes_kernel[(1,)](codes, out, tl.bfloat16 if dtype == torch.bfloat16 else tl.float32, ptx)
    return out
