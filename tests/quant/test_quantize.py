"""Quantization is bitwise equal to an independent float64 model of the scale convention."""

import math

import numpy as np
import pytest
import torch

from jetrl.quant import ACT, TOKEN, WEIGHT, E4M3, dequantize, quantize
from jetrl.quant.reference import quantize_tensor

BLOCKS = [ACT, WEIGHT, TOKEN]
EPS32 = float(np.float32(1e-4))  # the 1e-4 floor as the fp32 value the spec uses


def _f32(x: torch.Tensor) -> torch.Tensor:
    """Round float64 values to the nearest fp32 (correct rounding of one +,-,*,/ done in float64)."""
    return x.to(torch.float32).to(torch.float64)


def e4m3_rne_f64(v: torch.Tensor) -> torch.Tensor:
    """Round float64 values in [-448, 448] to the E4M3 grid, ties to even, written from the format's
    definition (3 mantissa bits, min normal exponent -6, subnormal step 2^-9), not from PyTorch's cast."""
    a = v.abs()
    _, exponent = torch.frexp(a)  # a = m * 2^exponent, m in [0.5, 1)  ->  floor(log2 a) = exponent - 1
    e = torch.clamp(exponent.to(torch.float64) - 1, min=-6)
    quantum = torch.exp2(e - 3)
    return torch.copysign(torch.round(a / quantum) * quantum, v)  # torch.round: half to even; keeps -0


def reference_quantize_f64(x: torch.Tensor, block, pow2: bool = False):
    """Independent float64 model: per-block loops, no shared code with jetrl."""
    x64 = x.to(torch.float64)
    m, k = x.shape
    bm, bk = block
    mb, kb = math.ceil(m / bm), math.ceil(k / bk)
    data = torch.empty_like(x64)
    scale = torch.empty(mb, kb, dtype=torch.float64)
    for i in range(mb):
        for j in range(kb):
            tile = x64[i * bm:(i + 1) * bm, j * bk:(j + 1) * bk]
            amax = max(tile.abs().max().item(), EPS32)
            s = _f32(torch.tensor(amax / 448.0, dtype=torch.float64)).item()
            if pow2:
                mant, e = math.frexp(s)
                s = s if mant == 0.5 else math.ldexp(1.0, e)
            q = _f32(tile / s).clamp(-448.0, 448.0)
            data[i * bm:(i + 1) * bm, j * bk:(j + 1) * bk] = e4m3_rne_f64(q)
            scale[i, j] = s
    return data, scale


def assert_bitwise(x, block, pow2=False):
    data, scale = quantize(x, block, pow2_scale=pow2)
    ref_data, ref_scale = reference_quantize_f64(x, block, pow2)
    assert data.dtype == E4M3 and data.shape == x.shape
    assert scale.dtype == torch.float32 and scale.shape == ref_scale.shape
    assert not torch.isnan(data.float()).any(), "NaN in FP8 data"
    assert torch.equal(scale.double(), ref_scale), "scales differ from the float64 reference"
    assert torch.equal(data.double(), ref_data), "FP8 values differ from the float64 reference"
    # byte-level: the reference grid values cast exactly to the same E4M3 bytes
    assert torch.equal(data.view(torch.uint8), ref_data.to(E4M3).view(torch.uint8))


@pytest.mark.parametrize("block", BLOCKS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(256, 384), (130, 200), (1, 5), (300, 129)])
def test_bitwise_random(gen, block, dtype, shape):
    x = (torch.randn(shape, generator=gen) * torch.rand(shape, generator=gen).mul(8).exp()).to(dtype)
    assert_bitwise(x, block)


@pytest.mark.parametrize("block", BLOCKS)
def test_bitwise_pow2_scales(gen, block):
    x = torch.randn(200, 260, generator=gen) * 3.7
    assert_bitwise(x, block, pow2=True)
    _, scale = quantize(x, block, pow2_scale=True)
    mant, _ = torch.frexp(scale)
    assert torch.all(mant == 0.5), "pow2 scales must be exact powers of two"


@pytest.mark.parametrize("block", BLOCKS)
def test_special_magnitudes(gen, block):
    x = torch.randn(256, 256, generator=gen)
    x[:128, :128] = 0.0  # zero block
    x[128:, :128] = 3.25  # constant block
    x[:128, 128:] *= 1e30  # huge
    x[128:, 128:] *= 1e-30  # tiny (below the 1e-4 amax floor)
    x[5, 200] = -1e-30
    assert_bitwise(x, block)
    data, scale = quantize(x, block)
    assert torch.isfinite(scale).all() and torch.isfinite(data.float()).all()


def test_zero_block_gives_zeros_no_nan():
    data, scale = quantize(torch.zeros(128, 256), WEIGHT)
    assert torch.equal(data.float(), torch.zeros(128, 256))
    assert torch.equal(scale, torch.full((1, 2), EPS32 / 448, dtype=torch.float32))


def test_mixed_magnitudes_and_saturation(gen):
    x = torch.randn(4, 256, generator=gen)
    x[0, :64] *= 1e3
    x[0, 64:128] *= 1e-3
    assert_bitwise(x, ACT)
    data, scale = quantize(x, ACT)
    # the block maximum maps exactly to +-448 (saturation at the top of the range, never NaN)
    assert data.float().abs().amax(dim=1).eq(448).all()


@pytest.mark.parametrize("block", BLOCKS)
def test_roundtrip_within_half_ulp(gen, block):
    x = torch.randn(260, 300, generator=gen) * 5
    data, scale = quantize(x, block)
    y = dequantize(data, scale, block)
    from jetrl.quant.reference import expand_scale

    s = expand_scale(scale, block, tuple(x.shape)).double()
    v = (x.double() / s).abs()
    _, exponent = torch.frexp(v)
    quantum = torch.exp2(torch.clamp(exponent.double() - 1, min=-6) - 3)
    err = (y.double() - x.double()).abs()
    # half an E4M3 ulp at the element's magnitude, scaled back; 1e-6 slack covers the fp32 division
    assert torch.all(err <= 0.5 * quantum * s * (1 + 1e-6) + 1e-30)


@pytest.mark.parametrize("shape", [(256, 384), (130, 200)])
def test_transposes_need_no_requantization(gen, shape):
    x = torch.randn(shape, generator=gen)
    w = quantize_tensor(x, WEIGHT)
    wt = quantize_tensor(x.t().contiguous(), WEIGHT)
    assert torch.equal(w.t().data.view(torch.uint8), wt.data.view(torch.uint8))
    assert torch.equal(w.t().scale, wt.scale)
    a = quantize_tensor(x, TOKEN).t()  # (128, 1) blocks of x == (1, 128) blocks of x^T
    b = quantize_tensor(x.t().contiguous(), ACT)
    assert a.block == ACT
    assert torch.equal(a.data.view(torch.uint8), b.data.view(torch.uint8)) and torch.equal(a.scale, b.scale)
    assert torch.equal(w.t().dequantize(), w.dequantize().t())


def test_bad_inputs():
    with pytest.raises(ValueError, match="2-D"):
        quantize(torch.randn(2, 3, 128))
    with pytest.raises(TypeError, match="int64"):
        quantize(torch.arange(256).view(2, 128))
    with pytest.raises(ValueError, match="block"):
        quantize(torch.randn(128, 128), (64, 64))
    data, scale = quantize(torch.randn(128, 256), ACT)
    with pytest.raises(ValueError, match="scale shape"):
        dequantize(data, scale[:, :1], ACT)
