"""SwiGLU's backward with the gate/up projection's grad_out quantization fused in (``swiglu_bwd_fp8``): under the
Triton interpreter, its FP8 bytes and scales are bitwise what the unfused path gives (SwiGLU's backward kernel,
then the 1x128 and 128x1 quantization kernels of its output) and what the reference quantization of that output
gives, at unaligned token counts, in every dtype, with both scale roundings and with and without whole 128-row
token blocks."""

from __future__ import annotations

import importlib.util

import pytest

from interpreted import run_interpreted

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                reason="triton is not installed (pip install triton)")

_CHILD = r'''
import json, sys
import torch
from jetrl.quant import reference as R
from jetrl.quant.kernels import quantize_triton as T
from jetrl.quant.kernels import swiglu_triton as S

def same(a, b):
    if a.dtype == torch.float8_e4m3fn:
        a, b = a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8)
    return a.shape == b.shape and a.dtype == b.dtype and bool(torch.equal(a, b))

g = torch.Generator().manual_seed(5)
res = {}
# (rows, width, dtype, pow2 scales, whole 128-row token blocks)
CASES = [(1, 128, torch.bfloat16, False, True), (37, 256, torch.bfloat16, True, True),
         (37, 256, torch.float16, False, False), (257, 128, torch.bfloat16, False, True),
         (257, 128, torch.float32, True, False), (130, 256, torch.float16, True, True)]
for m, k, dtype, pow2, whole in CASES:
    gate_up = (torch.randn(m, 2 * k, generator=g) * torch.logspace(-2, 2, 2 * k)).to(dtype)
    grad = (torch.randn(m, k, generator=g) * 3).to(dtype)
    if m > 2:
        grad[1] = 0  # an all-zero row of d: zero 1x128 blocks
        gate_up[2, 5] = 60.0  # a large d gate next to small ones
    gate, up = gate_up[:, :k], gate_up[:, k:]  # row-strided halves, as the packed projection's output
    d = torch.empty(m, 2 * k, dtype=dtype)
    S.swiglu_bwd(grad, gate, up, d[:, :k], d[:, k:])  # the unfused path: d, then its quantizations
    key = f"{m}x{k}-{str(dtype)[6:]}-pow2={pow2}-whole={whole}"
    data, scale, tok, tok_scale = S.swiglu_bwd_fp8(grad, gate, up, pow2, whole)
    ad, ascale = T.quantize_act_1x128(d, pow2)
    td, tscale = T.quantize_token_128x1(d, pow2, whole)
    rd, rs = R.quantize(d, (1, 128), pow2)
    r = {
        "act": same(data, ad) and same(scale, ascale) and scale.stride() == ascale.stride(),
        "token": same(tok, td) and same(tok_scale, tscale) and tok.stride() == td.stride(),
        "act_reference": same(data, rd) and same(scale, rs),
    }
    rt, rts = R.quantize(d, (128, 1), pow2)
    r["token_reference"] = same(tok[:m], rt) and same(tok_scale, rts) and (
        not whole or (tok.shape[0] % 128 == 0 and not tok[m:].view(torch.uint8).any()))
    res[key] = r
json.dump(res, sys.stdout)
'''

CHECKS = ("act", "token", "act_reference", "token_reference")


@pytest.fixture(scope="module")
def interpreted():
    return run_interpreted(_CHILD, "fused SwiGLU backward + FP8")


@pytest.mark.parametrize("check", CHECKS)
def test_fused_swiglu_backward_quantization_bitwise(interpreted, check):
    assert len(interpreted) == 6
    failed = [case for case, r in interpreted.items() if not r[check]]
    assert not failed, f"{check}: differs for {failed}"


def test_width_must_be_whole_blocks():
    import torch

    from jetrl.quant.kernels import swiglu_triton

    x = torch.zeros(3, 200, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="multiple of 128"):
        swiglu_triton.swiglu_bwd_fp8(x, x, x)
