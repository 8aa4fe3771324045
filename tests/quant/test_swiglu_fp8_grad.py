"""SwiGLU's backward with the gate/up projection's grad_out quantization fused in (``swiglu_bwd_fp8``, tuning
``swiglu_grad_fp8``).

The kernel, under the Triton interpreter: its FP8 bytes and scales are bitwise what the unfused path gives
(SwiGLU's backward kernel, then the 1x128 and 128x1 quantization kernels of its output) and what the reference
quantization of that output gives, at unaligned token counts, in every dtype, with both scale roundings and with and
without whole 128-row token blocks. The op (``grouped_linear_swiglu``): a ``jet`` model's MLP and whole training
step give bitwise the unfused outputs and gradients, on the reference paths and (the MLP) through the interpreted
kernels; where it does not apply it declines."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from interpreted import run_interpreted
from jetrl.models import build_model, token_logprobs
from jetrl.quant import grouped_linear_swiglu
from jetrl.quant.kernels import tuning

needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                  reason="triton is not installed (pip install triton)")
QWEN = dict(model_type="qwen2", vocab_size=300, hidden_size=256, intermediate_size=384, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=True)

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

# the op inside an MLP through the interpreted SwiGLU kernels (the FP8 backend is the reference on the CPU)
from jetrl.models import build_model
from jetrl.quant import fused_impl
from jetrl.quant.kernels import tuning
cfg = dict(model_type="qwen2", vocab_size=300, hidden_size=256, intermediate_size=384, num_hidden_layers=1,
           num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
runs = {}
for fused in (False, True):
    mlp = build_model(cfg, dtype=torch.bfloat16, recipe="jet", seed=2).model.layers[0].mlp
    x = torch.randn(131, 256, generator=torch.Generator().manual_seed(9)).to(torch.bfloat16).requires_grad_(True)
    gy = torch.randn(131, 256, generator=torch.Generator().manual_seed(10)).to(torch.bfloat16)
    with fused_impl("triton"), tuning.override(swiglu_grad_fp8=fused):
        y = mlp(x)
        took = type(y.grad_fn.next_functions[0][0]).__name__  # the down projection's input: the fused op's output?
        y.backward(gy)
    runs[fused] = [y.detach(), x.grad] + [p.grad for p in mlp.parameters()]
    runs[f"took-{fused}"] = took
res["mlp"] = {"act": all(same(a, b) for a, b in zip(runs[False], runs[True])),
              "fused": runs["took-True"] == "_Fp8GateUpSwiGLUFunctionBackward" != runs["took-False"],
              "token": True, "act_reference": True, "token_reference": True}
json.dump(res, sys.stdout)
'''

CHECKS = ("act", "token", "act_reference", "token_reference")


@pytest.fixture(scope="module")
def interpreted():
    return run_interpreted(_CHILD, "fused SwiGLU backward + FP8")


@needs_triton
@pytest.mark.parametrize("check", CHECKS)
def test_fused_swiglu_backward_quantization_bitwise(interpreted, check):
    kernel = {case: r for case, r in interpreted.items() if case != "mlp"}
    assert len(kernel) == 6
    failed = [case for case, r in kernel.items() if not r[check]]
    assert not failed, f"{check}: differs for {failed}"


@needs_triton
def test_the_op_in_an_mlp_through_the_interpreted_kernels_is_bitwise_unfused(interpreted):
    assert interpreted["mlp"]["fused"], "the MLP did not run the fused op with swiglu_grad_fp8"
    assert interpreted["mlp"]["act"], "the MLP's output or a gradient differs with swiglu_grad_fp8"


@needs_triton
def test_width_must_be_whole_blocks():
    from jetrl.quant.kernels import swiglu_triton

    x = torch.zeros(3, 200, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="multiple of 128"):
        swiglu_triton.swiglu_bwd_fp8(x, x, x)


def _training_step(fused: bool, checkpointing: bool):
    model = build_model(QWEN, dtype=torch.bfloat16, recipe="jet", seed=4)
    model.set_activation_checkpointing(checkpointing)
    ids = torch.randint(2, 300, (203,), generator=torch.Generator().manual_seed(1))
    pos = torch.cat([torch.arange(90), torch.arange(113)])
    cu = torch.tensor([0, 90, 203])
    with tuning.override(swiglu_grad_fp8=fused):
        lp, _ = token_logprobs(model, ids, pos, cu, 113, torch.roll(ids, -1))
        lp.sum().backward()
    return [lp.detach()] + [p.grad for p in model.parameters()]


@pytest.mark.parametrize("checkpointing", [False, True])
def test_a_jet_training_step_is_bitwise_the_unfused_one(checkpointing):
    """The op changes where grad_out is quantized, not its bytes: a whole step of a ``jet`` model (203 tokens in two
    sequences, with and without per-block checkpointing) gives the same log-probs and every parameter's gradient."""
    unfused, fused = _training_step(False, checkpointing), _training_step(True, checkpointing)
    assert len(fused) == len(unfused) > 2
    for a, b in zip(unfused, fused):
        assert b is not None and torch.isfinite(b.float()).all() and torch.equal(a, b)


def test_the_op_runs_where_it_applies_and_declines_elsewhere():
    mlp = build_model(QWEN, dtype=torch.bfloat16, recipe="jet", seed=4).model.layers[0].mlp
    projections = mlp.input_projections()
    x = torch.randn(37, 256).to(torch.bfloat16).requires_grad_(True)
    kw = dict(quantize_out=True, out_pow2=False)
    assert grouped_linear_swiglu(projections, x, **kw) is None  # off by default
    with tuning.override(swiglu_grad_fp8=True):
        act, act_fp8 = grouped_linear_swiglu(projections, x, **kw)
        assert type(act.grad_fn).__name__ == "_Fp8GateUpSwiGLUFunctionBackward"
        assert act.shape == (37, 384) and act_fp8.shape == (37, 384) and act_fp8.block == (1, 128)
        assert grouped_linear_swiglu(projections, x, quantize_out=False, out_pow2=False)[1] is None
        assert grouped_linear_swiglu(projections, x, exact=True, **kw) is None  # exact mode: its own forward
        with torch.no_grad():  # rollout, scoring: nothing to fuse into a backward
            assert grouped_linear_swiglu(projections, x, **kw) is None
        biased = build_model({**QWEN, "model_type": "llama", "mlp_bias": True}, dtype=torch.bfloat16, recipe="jet", seed=4)
        assert grouped_linear_swiglu(biased.model.layers[0].mlp.input_projections(), x, **kw) is None
        bf16 = build_model(QWEN, dtype=torch.bfloat16, recipe="bf16", seed=4)
        assert grouped_linear_swiglu(bf16.model.layers[0].mlp.input_projections(), x, **kw) is None


def _hopper():
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("the FP8 kernels need a Hopper (sm_90+) GPU")


@pytest.mark.gpu
@pytest.mark.parametrize("m, k", [(1, 1024), (77, 1024), (4097, 1024), (2049, 8960)])
@pytest.mark.parametrize("pow2", [False, True])
def test_kernel_on_the_gpu_is_the_unfused_path_bitwise(m, k, pow2):
    """On the GPU: the fused kernel against SwiGLU's backward kernel followed by the backend's one-pass
    quantization of its output (the path it replaces), at unaligned token counts and the 1.5B model's width."""
    _hopper()
    from jetrl.quant import get_backend
    from jetrl.quant.kernels import swiglu_triton

    g = torch.Generator(device="cuda").manual_seed(m)
    gate_up = (torch.randn(m, 2 * k, generator=g, device="cuda") * 3).to(torch.bfloat16)
    grad = torch.randn(m, k, generator=g, device="cuda").to(torch.bfloat16)
    d = torch.empty(m, 2 * k, dtype=torch.bfloat16, device="cuda")
    swiglu_triton.swiglu_bwd(grad, gate_up[:, :k], gate_up[:, k:], d[:, :k], d[:, k:])
    qa, qt = get_backend(d.device).quantize_act_and_token(d, pow2, whole_blocks=True)
    data, scale, tok, tok_scale = swiglu_triton.swiglu_bwd_fp8(grad, gate_up[:, :k], gate_up[:, k:], pow2)
    bits = lambda t: t.contiguous().view(torch.uint8)  # noqa: E731
    assert torch.equal(bits(data), bits(qa.data)) and torch.equal(scale, qa.scale)
    assert torch.equal(bits(tok), bits(qt.data)) and torch.equal(tok_scale, qt.scale)
    assert scale.stride() == qa.scale.stride() and tok.stride() == qt.data.stride()


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1001, 4097])
def test_an_mlp_on_the_gpu_is_the_unfused_one_bitwise(tokens):
    """A ``jet`` MLP of the 1.5B model's widths on the GPU, fused against unfused: output and every gradient."""
    _hopper()
    cfg = {**QWEN, "hidden_size": 1536, "intermediate_size": 8960, "num_attention_heads": 12,
           "num_key_value_heads": 2, "num_hidden_layers": 1}
    runs = {}
    for fused in (False, True):
        mlp = build_model(cfg, dtype=torch.bfloat16, device="cuda", recipe="jet", seed=2).model.layers[0].mlp
        g = torch.Generator(device="cuda").manual_seed(tokens)
        x = torch.randn(tokens, 1536, generator=g, device="cuda").to(torch.bfloat16).requires_grad_(True)
        gy = torch.randn(tokens, 1536, generator=g, device="cuda").to(torch.bfloat16)
        with tuning.override(swiglu_grad_fp8=fused):
            y = mlp(x)
            took = type(y.grad_fn.next_functions[0][0]).__name__
            y.backward(gy)
        runs[fused] = [y.detach(), x.grad] + [p.grad for p in mlp.parameters()]
        assert (took == "_Fp8GateUpSwiGLUFunctionBackward") == fused, took
    for a, b in zip(runs[False], runs[True]):
        assert torch.isfinite(b.float()).all() and torch.equal(a, b)
