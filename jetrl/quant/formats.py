"""FP8 formats and THE scale convention of jetrl.

Every FP8 tensor in jetrl is E4M3 (``torch.float8_e4m3fn``, largest finite value 448) with fp32
scales, one per block of the 2-D tensor. Three block shapes exist, named by role:

=============  ===========  ===========================================================
block          name         used for
=============  ===========  ===========================================================
``(1, 128)``   ``ACT``      activations and grad_out: one scale per row per 128 columns
``(128, 128)`` ``WEIGHT``   weights: one scale per 128x128 tile (transposes for free)
``(128, 1)``   ``TOKEN``    WGrad operands: one scale per 128 rows (tokens) per column
=============  ===========  ===========================================================

The scale convention (DeepSeek-V3 / DeepGEMM), all arithmetic in fp32::

    amax  = max(max |x| over the block, 1e-4)
    scale = amax / 448                       (IEEE fp32 division, round-to-nearest-even)
    scale = 2 ** ceil(log2(scale))           (only with pow2_scale: the UE8M0 format)
    data  = e4m3(clamp(x / scale, -448, 448))  (fp32 division, then RNE cast to E4M3)
    x    ~= data * scale

The clamp comes before the cast because PyTorch's cast to ``float8_e4m3fn`` does not saturate (it
gives NaN above about 464); with the clamp every backend saturates identically. The 1e-4 floor keeps
an all-zero block finite (its data is all zeros, its scale 1e-4/448).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

E4M3 = torch.float8_e4m3fn
E4M3_MAX = 448.0
AMAX_EPS = 1e-4
BLOCK_SIZE = 128

ACT = (1, BLOCK_SIZE)
WEIGHT = (BLOCK_SIZE, BLOCK_SIZE)
TOKEN = (BLOCK_SIZE, 1)
BLOCKS = (ACT, WEIGHT, TOKEN)

Block = tuple[int, int]


def check_block(block: Block) -> Block:
    """Return ``block`` as a tuple if it is one of the three supported shapes, else raise."""
    block = tuple(int(b) for b in block)  # type: ignore[assignment]
    if block not in BLOCKS:
        raise ValueError(f"unsupported block shape {block}; jetrl uses {ACT}, {WEIGHT} or {TOKEN}")
    return block  # type: ignore[return-value]


def scale_shape(shape: tuple[int, int], block: Block) -> tuple[int, int]:
    """Shape of the scale tensor for a 2-D tensor of ``shape``: ``(ceil(M/bm), ceil(K/bk))``."""
    m, k = shape
    bm, bk = block
    return (-(-m // bm), -(-k // bk))


def expand_scale(scale: torch.Tensor, block: Block, shape: tuple[int, int]) -> torch.Tensor:
    """Broadcast a (Mb, Kb) scale over its blocks and crop to ``shape``."""
    bm, bk = block
    return scale.repeat_interleave(bm, dim=0).repeat_interleave(bk, dim=1)[: shape[0], : shape[1]]


def dequantize(data: torch.Tensor, scale: torch.Tensor, block: Block) -> torch.Tensor:
    """fp32 values ``data * scale`` with each scale broadcast over its block."""
    block = check_block(block)
    if data.dim() != 2:
        raise ValueError(f"FP8 data must be 2-D, got shape {tuple(data.shape)}")
    expected = scale_shape(tuple(data.shape), block)
    if tuple(scale.shape) != expected:
        raise ValueError(f"scale shape {tuple(scale.shape)} does not fit data {tuple(data.shape)} with block {block}; "
                         f"expected {expected}")
    return data.float() * expand_scale(scale.float(), block, tuple(data.shape))


@dataclass(frozen=True)
class Fp8Tensor:
    """A blockwise-quantized 2-D tensor: E4M3 ``data`` (M, K), fp32 ``scale`` (ceil(M/bm), ceil(K/bk)).

    The pair is what every GEMM in jetrl consumes. ``t()`` gives the quantized form of the transpose by
    transposing data and scales (no re-quantization): a (128, 128)-block weight W yields W^T for DGrad,
    and a (128, 1)-block operand yields the (1, 128) operand that WGrad's GEMM reads.
    """

    data: torch.Tensor  # (M, K) float8_e4m3fn
    scale: torch.Tensor  # (ceil(M/bm), ceil(K/bk)) float32
    block: Block

    @property
    def shape(self) -> torch.Size:
        return self.data.shape

    def t(self) -> "Fp8Tensor":
        return Fp8Tensor(self.data.t(), self.scale.t(), (self.block[1], self.block[0]))  # (1,128) <-> (128,1)

    def dequantize(self) -> torch.Tensor:
        return dequantize(self.data, self.scale, self.block)
