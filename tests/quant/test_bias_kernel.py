"""A linear layer's bias over its GEMM output (``Fp8Backend.add_bias``): the Triton kernel under the interpreter,
bitwise ``y + bias`` (ATen's broadcast add: fp32 sum, one rounding) at unaligned shapes in every dtype it takes;
the reference backend and the FP8 linear's forward on CPU."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from interpreted import run_interpreted
from jetrl.quant import backend as seam

_CHILD = r'''
import json, sys
import torch
from jetrl.quant.kernels import bias_triton as B

def same(a, b):  # the same bits, NaNs in the same places (the interpreter's NaN payloads are not the GPU's)
    nan = a.isnan()
    bits = torch.int32 if a.dtype == torch.float32 else torch.int16
    return bool(torch.equal(nan, b.isnan())) and bool(torch.equal(a[~nan].view(bits), b[~nan].view(bits)))

g = torch.Generator().manual_seed(3)
out = {}
for m, n in [(1, 1), (7, 5), (130, 300), (17, 2048), (300, 257)]:
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        # sums that round: y and bias of different magnitudes, signed zeros, an inf and a nan
        y = (torch.randn(m, n, generator=g) * torch.logspace(-3, 3, n)).to(dtype)
        bias = (torch.randn(n, generator=g) * 7.0).to(dtype)
        if m > 2 and n > 3:
            y[1, 0], bias[0] = -0.0, -0.0
            y[2, 1], y[2, 2], bias[3] = float("inf"), float("nan"), 1e-3
        ref = y + bias
        got = B.add_bias_(y.clone(), bias)
        out[f"{m}x{n}-{str(dtype)[6:]}"] = same(got, ref)
# a strided row view (a column slice of a wider output) writes only its own columns
wide = torch.randn(9, 40, generator=g).to(torch.bfloat16)
view, bias = wide[:, 8:30], torch.randn(22, generator=g).to(torch.bfloat16)
expect = wide.clone()
expect[:, 8:30] = view + bias
B.add_bias_(view, bias)
out["row-strided-view"] = same(wide, expect)
json.dump(out, sys.stdout)
'''


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed (pip install triton)")
def test_bias_kernel_bitwise_equals_the_broadcast_add():
    cases = run_interpreted(_CHILD, "bias kernel")
    assert len(cases) == 16
    failed = [case for case, ok in cases.items() if not ok]
    assert not failed, f"add_bias_ differs from y + bias for {failed}"


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed (pip install triton)")
def test_bias_kernel_refuses_operands_it_does_not_take():
    from jetrl.quant.kernels import bias_triton

    y = torch.zeros(4, 6, dtype=torch.bfloat16)
    for bad_y, bad_b in [(y, torch.zeros(5, dtype=torch.bfloat16)), (y, torch.zeros(6)),
                         (y.t(), torch.zeros(4, dtype=torch.bfloat16)), (y[None], torch.zeros(6, dtype=torch.bfloat16)),
                         (y.to(torch.float64), torch.zeros(6, dtype=torch.float64))]:
        assert not bias_triton.supports(bad_y, bad_b)
        with pytest.raises(ValueError, match="add_bias_: needs"):
            bias_triton.add_bias_(bad_y, bad_b)


def test_reference_add_bias_is_the_broadcast_add(gen):
    y = torch.randn(13, 70, generator=gen).to(torch.bfloat16)
    bias = torch.randn(70, generator=gen)  # an fp32 bias is cast to y's dtype first, as the linear did
    got = seam.ReferenceBackend().add_bias(y, bias)
    assert got.dtype == torch.bfloat16 and torch.equal(got, y + bias.to(torch.bfloat16))
