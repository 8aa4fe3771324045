"""Any token count on the fast GEMM route (CPU): WGrad's operands have whole 128-token blocks, the 1x128
operands' buffers hold M rounded up to 4 rows, and cuBLAS's layouts are views of those buffers (no copy).

The GPU side (the kernels' bytes, the route taken, FP8Linear against the reference) is in
``tests/quant/test_kernels_gpu.py``; the kernels' bytes under the interpreter in ``test_triton_interpret.py``.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from jetrl.quant import ACT, TOKEN, WEIGHT, FP8Linear, Fp8Tensor, reference as R
from jetrl.quant import backend
from jetrl.quant.backend import ReferenceBackend, use_backend

# the token counts users have: 1, around a block, unaligned to 4 / 16 / 128, and a real micro-batch's
TOKEN_COUNTS = (1, 3, 127, 129, 250, 1001)


@pytest.mark.parametrize("m", TOKEN_COUNTS)
@pytest.mark.parametrize("pow2", [False, True])
def test_whole_blocks_is_the_padded_input(m, pow2):
    g = torch.Generator().manual_seed(m)
    x = (torch.randn(m, 200, generator=g) * torch.logspace(-3, 3, 200)).to(torch.bfloat16)
    plain = R.quantize_tensor(x, TOKEN, pow2)
    whole = R.quantize_tensor(x, TOKEN, pow2, whole_blocks=True)
    rows = -(-m // 128) * 128
    assert tuple(whole.shape) == (rows, 200)
    assert torch.equal(whole.data[:m].view(torch.uint8), plain.data.view(torch.uint8))
    assert torch.equal(whole.scale, plain.scale)  # zeros move no block's maximum
    assert not whole.data[m:].float().any()
    # and re-quantizing the saved 1x128 activation the same way
    qa = R.quantize_tensor(x, ACT, pow2)
    rq, rq_whole = R.requantize(qa, TOKEN, pow2), R.requantize(qa, TOKEN, pow2, whole_blocks=True)
    assert torch.equal(rq_whole.data[:m].view(torch.uint8), rq.data.view(torch.uint8))
    assert torch.equal(rq_whole.scale, rq.scale) and not rq_whole.data[m:].float().any()


class _SpyBackend(ReferenceBackend):
    """The reference backend, recording each GEMM's operands' shapes and blocks."""

    def __init__(self):
        self.gemms: list[tuple[tuple[int, int], tuple[int, int], tuple[int, int]]] = []

    def gemm(self, a, b, out_dtype=torch.bfloat16):
        self.gemms.append((tuple(a.shape), tuple(b.shape), b.block))
        return super().gemm(a, b, out_dtype)


@pytest.mark.parametrize("m", TOKEN_COUNTS)
def test_wgrad_contracts_over_whole_blocks_and_equals_the_unpadded_spec(m, monkeypatch):
    """Every WGrad GEMM sees K % 128 == 0 (the shape rule of the cuBLAS route) at any token count, and the
    gradients equal the reference's WGrad of the unpadded operands (zero rows add nothing to dW)."""
    from jetrl.quant.kernels import gemm_scaled_mm  # the route's shape rule; imports no Triton

    spy = _SpyBackend()
    monkeypatch.setitem(backend._INSTANCES, "reference", spy)  # the reference backend, spied on
    g = torch.Generator().manual_seed(100 + m)
    layer = FP8Linear(256, 384, bias=False)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(384, 256, generator=g) * 0.05)
    x = torch.randn(m, 256, generator=g, requires_grad=True)
    dy = torch.randn(m, 384, generator=g)
    with use_backend("reference"):
        layer(x).backward(dy)
    wgrad = [(a, b) for a, b, block in spy.gemms if block == ACT]
    assert len(wgrad) == 1
    (n, k_a), (k_out, k_b) = wgrad[0]
    assert (n, k_out) == (384, 256) and k_a == k_b == -(-m // 128) * 128
    qa = Fp8Tensor(torch.zeros(n, k_a, dtype=torch.float8_e4m3fn), torch.ones(n, k_a // 128), ACT)
    qb = Fp8Tensor(torch.zeros(k_out, k_b, dtype=torch.float8_e4m3fn), torch.ones(k_out, k_b // 128), ACT)
    assert gemm_scaled_mm.supports(qa, qb)
    # the spec's WGrad: unpadded 128x1 operands (partial last block), dequantized, fp32 product
    qx = R.requantize(R.quantize_tensor(x.detach(), ACT), TOKEN)
    qg = R.quantize_tensor(dy, TOKEN)
    expected = R.gemm(qg.t(), qx.t(), torch.float32).double()
    # the same fp32 products summed in another order (and with zeros): the recursive-summation bound
    bound = (qg.t().dequantize().double().abs() @ qx.t().dequantize().double().abs().t()) * (m + 2) * 2.0 ** -24
    grad = layer.weight.grad.double()
    assert not torch.isnan(grad).any()
    assert bool(((grad - expected).abs() <= bound).all())


def test_rows_view_reads_the_padded_buffers_without_a_copy():
    from jetrl.quant.kernels.gemm_scaled_mm import _rows_view

    m, k = 6, 256
    rows = 8
    data = torch.zeros((rows, k), dtype=torch.float8_e4m3fn)[:m]
    scale_buf = torch.arange(2 * rows, dtype=torch.float32).view(2, rows)
    view = _rows_view(data, scale_buf[:, :m].t(), rows)
    assert view is not None
    d, s = view
    assert d.shape == (rows, k) and d.data_ptr() == data.data_ptr()
    assert s.shape == (rows, 2) and s.stride() == (1, rows) and torch.equal(s, scale_buf.t())
    # buffers of exactly M rows (made elsewhere) have no room: the caller pads a copy instead
    assert _rows_view(torch.zeros((m, k), dtype=torch.float8_e4m3fn), torch.ones(2, m).t(), rows) is None
    assert _rows_view(data, torch.ones(m, 2), rows) is None  # row-major scales: not cuBLAS's layout


def test_tile_scale_is_a_view_of_the_padded_weight_scale():
    from jetrl.quant.kernels.gemm_scaled_mm import _tile_scale

    rb, kb = 3, 7  # K/128 = 7: cuBLAS wants it padded to 8
    buf = torch.zeros((rb, 8))
    buf[:, :kb] = torch.rand(rb, kb) + 1
    view = buf[:, :kb]
    out = _tile_scale(view)
    assert out.shape == (8, rb) and out.data_ptr() == buf.data_ptr()  # no copy
    assert torch.equal(out.t()[:, :kb], view) and not out.t()[:, kb:].any()
    plain = view.contiguous()  # a scale of exactly K/128 columns: padded (a copy), the same values
    padded = _tile_scale(plain)
    assert padded.shape == (8, rb) and torch.equal(padded, out)


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_producers_allocate_rows_rounded_to_four():
    """The 1x128 producers' buffers hold M rounded up to 4 rows (the layout :func:`_rows_view` takes)."""
    from jetrl.quant.kernels.quantize_triton import act_buffers, act_rows, token_rows

    assert [act_rows(m) for m in (1, 4, 5, 127, 129)] == [4, 4, 8, 128, 132]
    assert [token_rows(m, True) for m in (1, 128, 129, 15288)] == [128, 128, 256, 15360]
    assert token_rows(129, False) == 129
    data, scale_buf = act_buffers(5, 300, torch.device("cpu"))
    assert data.shape == (5, 300) and data.untyped_storage().nbytes() == 8 * 300
    assert scale_buf.shape == (3, 8)
