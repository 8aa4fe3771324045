"""FP8 GEMM and FP8Linear: the three GEMMs follow the documented flow, stay close to BF16, learn."""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from jetrl.quant import ACT, TOKEN, WEIGHT, FP8Linear, Fp8Tensor, gemm, quantize_tensor
from jetrl.quant.reference import expand_scale


def rel_err(ref: torch.Tensor, x: torch.Tensor) -> float:
    assert torch.isfinite(x).all(), "non-finite values"
    x, ref = x.detach().double(), ref.detach().double()
    return float((x - ref).norm() / ref.norm())


def deq64(t: Fp8Tensor) -> torch.Tensor:
    """Dequantize in float64 with the scale expanded independently of the code under test."""
    return t.data.double() * expand_scale(t.scale.double(), t.block, tuple(t.data.shape))


# ---------------------------------------------------------------------------------------------- GEMM


@pytest.mark.parametrize("b_block", [WEIGHT, ACT])
@pytest.mark.parametrize("mnk", [(64, 256, 384), (130, 200, 260)])
def test_gemm_equals_dequantized_matmul(gen, b_block, mnk):
    m, n, k = mnk
    a = quantize_tensor(torch.randn(m, k, generator=gen), ACT)
    b = quantize_tensor(torch.randn(n, k, generator=gen), b_block)
    out = gemm(a, b, out_dtype=torch.float32)
    ref = deq64(a) @ deq64(b).t()
    # fp32 accumulation over K <= 384 terms: relative error ~ sqrt(K) * 2^-24, far below 1e-5
    assert rel_err(ref, out) < 1e-5
    out_bf16 = gemm(a, b)
    assert out_bf16.dtype == torch.bfloat16
    # BF16 output rounding: 2^-9 relative per element
    assert rel_err(ref, out_bf16) < 2 ** -8


def test_gemm_operand_errors(gen):
    a = quantize_tensor(torch.randn(64, 256, generator=gen), ACT)
    with pytest.raises(ValueError, match="left operand"):
        gemm(quantize_tensor(torch.randn(64, 256, generator=gen), WEIGHT), a)
    with pytest.raises(ValueError, match="right operand"):
        gemm(a, quantize_tensor(torch.randn(256, 64, generator=gen), TOKEN))
    with pytest.raises(ValueError, match="contraction"):
        gemm(a, quantize_tensor(torch.randn(64, 128, generator=gen), WEIGHT))


# ------------------------------------------------------------------------------------------ FP8Linear


def emulate_fp8_linear(x, w, b, g):
    """The documented flow, op by op, in float64: Fprop, DGrad (W^T from W's tiles), WGrad (128x1)."""
    qx = quantize_tensor(x, ACT)
    qw = quantize_tensor(w, WEIGHT)
    y = deq64(qx) @ deq64(qw).t() + b.double()
    qg = quantize_tensor(g, ACT)
    dx = deq64(qg) @ deq64(qw)
    qg_tok = quantize_tensor(g, TOKEN)
    qx_tok = quantize_tensor(qx.dequantize(), TOKEN)
    dw = deq64(qg_tok).t() @ deq64(qx_tok)
    return y, dx, dw, g.double().sum(0)


@pytest.mark.parametrize("mnk", [(256, 384, 256), (200, 130, 300)])
def test_fp8_linear_matches_emulation(gen, mnk):
    m, n, k = mnk
    layer = FP8Linear(k, n)
    with torch.no_grad():
        layer.bias.normal_(generator=gen)
    x = torch.randn(m, k, generator=gen, requires_grad=True)
    g = torch.randn(m, n, generator=gen)
    y = layer(x)
    y.backward(g)
    ry, rdx, rdw, rdb = emulate_fp8_linear(x.detach(), layer.weight.detach(), layer.bias.detach(), g)
    # same quantized operands, fp32 accumulation (<= 300 terms) vs float64: fp32 rounding level
    for ref, got in ((ry, y), (rdx, x.grad), (rdw, layer.weight.grad), (rdb, layer.bias.grad)):
        assert rel_err(ref, got) < 1e-5


@pytest.mark.parametrize("mnk", [(512, 384, 512), (300, 200, 260)])
def test_fp8_linear_close_to_bf16_linear(gen, mnk):
    m, n, k = mnk
    ref = nn.Linear(k, n, dtype=torch.bfloat16)
    fp8 = FP8Linear.from_linear(nn.Linear(k, n, dtype=torch.bfloat16))
    fp8.load_state_dict(ref.state_dict())
    x = torch.randn(m, k, generator=gen).to(torch.bfloat16)
    g = torch.randn(m, n, generator=gen).to(torch.bfloat16)
    outs = []
    for layer in (ref, fp8):
        xi = x.clone().requires_grad_()
        y = layer(xi)
        y.backward(g)
        assert y.dtype == torch.bfloat16 and xi.grad.dtype == torch.bfloat16
        assert layer.weight.grad.dtype == torch.bfloat16
        outs.append((y, xi.grad, layer.weight.grad))
    for r, f in zip(*outs):
        err = rel_err(r, f)
        # E4M3 rounds each operand with a relative error uniform in +-2^-4 (RMS ~2^-4/sqrt(3) = 3.6%);
        # two quantized operands give ~3.5-5% relative norm error on Gaussian data (about 26-29 dB).
        # Below 8% is healthy; above 0.5% proves FP8 really ran (BF16 alone is ~0.3%).
        assert 5e-3 < err < 8e-2, err


def test_leading_shapes_and_bias_free(gen):
    layer = FP8Linear(256, 128, bias=False)
    x = torch.randn(2, 3, 5, 256, generator=gen)
    y = layer(x)
    assert y.shape == (2, 3, 5, 128)
    assert rel_err(layer(x.reshape(30, 256)).reshape(2, 3, 5, 128), y) == 0.0
    assert list(layer.state_dict()) == ["weight"]


def test_saves_fp8_input_not_bf16(gen):
    layer = FP8Linear(256, 384, dtype=torch.bfloat16)
    x = torch.randn(512, 256, generator=gen).to(torch.bfloat16).requires_grad_()
    saved = []

    def pack(t):
        saved.append((t.dtype, tuple(t.shape)))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        layer(x).sum().backward()
    assert (E4M3 := torch.float8_e4m3fn, (512, 256)) in saved, saved
    big_bf16 = [s for s in saved if s[0] == torch.bfloat16 and s[1][0] * s[1][1] >= x.numel()]
    assert not big_bf16, f"a BF16 tensor of the input's size was saved for backward: {big_bf16}"
    assert all(d in (E4M3, torch.float32) for d, _ in saved), saved


def test_weight_cache_follows_versions(gen):
    layer = FP8Linear(256, 256)
    q1 = layer.quantized_weight()
    assert layer.quantized_weight() is q1, "unchanged weight must not be re-quantized"
    before = q1.data.clone()
    opt = torch.optim.SGD(layer.parameters(), lr=0.5)
    layer(torch.randn(8, 256, generator=gen)).square().sum().backward()
    opt.step()
    q2 = layer.quantized_weight()
    assert not torch.equal(q2.data.view(torch.uint8), before.view(torch.uint8)), "stale FP8 weight after a step"
    # re-quantized into the same buffers: CUDA graphs that read them stay valid
    assert q2.data.data_ptr() == q1.data.data_ptr() and q2.scale.data_ptr() == q1.scale.data_ptr()
    assert torch.equal(q2.data.view(torch.uint8), quantize_tensor(layer.weight.detach(), WEIGHT).data.view(torch.uint8))
    # a change the version counter cannot see needs an explicit refresh
    layer.weight.data.mul_(-1)
    assert layer.quantized_weight() is q2
    q2_values = q2.data.float().clone()
    layer.invalidate_weight_cache()
    q3 = layer.quantized_weight()
    assert torch.equal(q3.data.float(), -q2_values)


def test_check_finite_and_shape_errors(gen):
    layer = FP8Linear(128, 64, check_finite=True)
    x = torch.randn(4, 128, generator=gen)
    x[1, 7] = float("nan")
    with pytest.raises(FloatingPointError, match="non-finite"):
        layer(x)
    # with x's FP8 form handed in, that form is what is read and checked (x itself may be an unwritten placeholder)
    from jetrl.quant import quantize_tensor
    clean = torch.randn(4, 128, generator=gen)
    placeholder = torch.full((), float("nan")).expand(4, 128)
    assert torch.isfinite(layer(placeholder, x_fp8=quantize_tensor(clean, (1, 128)))).all()
    with pytest.raises(FloatingPointError, match="non-finite"):
        layer(clean, x_fp8=quantize_tensor(x, (1, 128)))
    with pytest.raises(ValueError, match="128 features"):
        layer(torch.randn(4, 100))
    with pytest.raises(TypeError, match="nn.Linear"):
        FP8Linear.from_linear(nn.Conv1d(3, 3, 1))


def test_from_linear_shares_parameters():
    plain = nn.Linear(256, 128)
    layer = FP8Linear.from_linear(plain)
    assert layer.weight is plain.weight and layer.bias is plain.bias
    assert layer.state_dict().keys() == plain.state_dict().keys()
    back = layer.to_linear()
    assert type(back) is nn.Linear and back.weight is plain.weight


def _mlp(fp8: bool, seed: int) -> nn.Module:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(128, 256), nn.SiLU(), nn.Linear(256, 256), nn.SiLU(), nn.Linear(256, 128))
    if fp8:
        from jetrl.quant import apply_recipe

        apply_recipe(model, "jet")
    return model


def _train(model: nn.Module, steps: int = 200) -> list[float]:
    gen = torch.Generator().manual_seed(7)
    teacher = torch.randn(128, 128, generator=gen) / 128 ** 0.5
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3)
    losses = []
    for _ in range(steps):
        x = torch.randn(128, 128, generator=gen)
        loss = F.mse_loss(model(x), torch.tanh(x @ teacher) * 2)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def test_tiny_mlp_learns_in_jet_like_bf16():
    bf16 = _train(_mlp(False, 0))
    jet = _train(_mlp(True, 0))
    assert sum(isinstance(m, FP8Linear) for m in _mlp(True, 0).modules()) == 3
    start, end_bf16, end_jet = sum(jet[:10]) / 10, sum(bf16[-20:]) / 20, sum(jet[-20:]) / 20
    assert all(torch.isfinite(torch.tensor(jet)))
    assert end_jet < 0.2 * start, "FP8 training did not learn"
    # FP8 noise costs a little final loss (about 7% here); within 15% of the unquantized run
    assert end_jet < 1.15 * end_bf16, (end_jet, end_bf16)


# ------------------------------------------------------------------------ pre-quantized inputs


@pytest.mark.parametrize("pow2", [False, True])
def test_prequantized_input_gives_identical_results(gen, pow2):
    """A producer's 1x128 quantization of x, handed over as ``x_fp8``, changes nothing: same output, same
    gradients, bit for bit (it is the quantization the layer would have made itself)."""
    from jetrl.quant import call_linear, fp8_input_scaling

    layer = FP8Linear(256, 192, bias=True, dtype=torch.bfloat16, pow2_scale=pow2)
    with torch.no_grad():
        layer.weight.normal_(0, 0.05, generator=gen)
        layer.bias.normal_(0, 0.05, generator=gen)
    x = torch.randn(3, 50, 256, generator=gen).to(torch.bfloat16)
    results = []
    for pre in (False, True):
        xi = x.clone().requires_grad_(True)
        x_fp8 = quantize_tensor(xi.detach().reshape(-1, 256), ACT, pow2) if pre else None
        assert fp8_input_scaling(layer) is pow2
        y = call_linear(layer, xi, x_fp8)
        y.float().square().sum().backward()
        results.append((y.detach(), xi.grad, layer.weight.grad.clone(), layer.bias.grad.clone()))
        layer.zero_grad(set_to_none=True)
    for a, b in zip(*results):
        assert torch.isfinite(a.float()).all() and torch.equal(a, b)


def test_prequantized_input_checks_and_scaling_agreement(gen):
    from jetrl.quant import fp8_input_scaling, precision_side

    a = FP8Linear(256, 128, dtype=torch.bfloat16)
    b = FP8Linear(256, 128, dtype=torch.bfloat16, pow2_scale=True)
    plain = nn.Linear(256, 128)
    assert fp8_input_scaling(a) is False and fp8_input_scaling(b) is True
    assert fp8_input_scaling(a, b) is None  # different scalings: no shared input
    assert fp8_input_scaling(a, plain) is None and fp8_input_scaling() is None
    a.fp8_rollout = False
    with precision_side("rollout"):
        assert fp8_input_scaling(a) is None  # BF16 on this side
    x = torch.randn(4, 256, generator=gen).to(torch.bfloat16)
    with pytest.raises(ValueError, match="x_fp8"):
        a(x, x_fp8=quantize_tensor(x[:2], ACT))
    with pytest.raises(ValueError, match="x_fp8"):
        a(x, x_fp8=quantize_tensor(x, TOKEN))


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("shape", [(37, 256), (2, 5, 256)])
def test_no_grad_forward_skips_autograd_with_the_same_bits(bias, shape):
    """Without grad (rollout, scoring) the FP8 linear runs Fprop alone, outside the autograd function: the same bits
    as the grad-enabled forward, no graph node; a weight changed in place is re-quantized on the next call."""
    torch.manual_seed(sum(shape))
    layer = FP8Linear(256, 384, bias=bias)
    x = torch.randn(*shape)
    with torch.no_grad():
        fast = layer(x)
    assert fast.grad_fn is None and fast.shape == (*shape[:-1], 384)
    tracked = layer(x.clone().requires_grad_())
    assert tracked.grad_fn is not None and torch.equal(fast, tracked.detach())
    with torch.no_grad():
        layer.weight.mul_(-1.0)  # a new weight version
        flipped = layer(x)
    assert torch.isfinite(flipped).all()
    expected = -fast if not bias else -(fast - layer.bias) + layer.bias
    assert torch.allclose(flipped, expected, rtol=0, atol=1e-5)
