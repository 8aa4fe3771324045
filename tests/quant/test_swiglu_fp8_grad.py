"""SwiGLU's backward with the gate/up projection's grad_out quantization fused in (tuning ``swiglu_grad_fp8``).

The op (``grouped_linear_swiglu``): a ``jet`` model's MLP and whole training step give bitwise the unfused outputs
and gradients, on the reference paths and (the MLP) through the interpreted Triton kernels (where the FP8 backend
has no fused kernel, SwiGLU's backward kernel writes d(gate, up) and the backend quantizes it); where it does not
apply it declines. The CUDA backend's Gluon kernel (``quantize_swiglu_grad``): compiled for sm_90a here (no
register spills, shared memory within an SM's), and on the GPU bitwise the unfused path at unaligned token counts,
in every dtype, with both scale roundings."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from interpreted import run_interpreted
from sm90_compile import skip_without_sm90_compiler
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

def same(a, b):
    if a.dtype == torch.float8_e4m3fn:
        a, b = a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8)
    return a.shape == b.shape and a.dtype == b.dtype and bool(torch.equal(a, b))

res = {}

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
              "fused": runs["took-True"] == "_Fp8GateUpSwiGLUFunctionBackward" != runs["took-False"]}
json.dump(res, sys.stdout)
'''


@pytest.fixture(scope="module")
def interpreted():
    return run_interpreted(_CHILD, "fused SwiGLU backward + FP8")


@needs_triton
def test_the_op_in_an_mlp_through_the_interpreted_kernels_is_bitwise_unfused(interpreted):
    assert interpreted["mlp"]["fused"], "the MLP did not run the fused op with swiglu_grad_fp8"
    assert interpreted["mlp"]["act"], "the MLP's output or a gradient differs with swiglu_grad_fp8"


@pytest.mark.parametrize("dtype, vec", [("bf16", 8), ("fp32", 4)])
def test_the_gluon_kernel_compiles_for_sm90_without_spills(dtype, vec):
    """The kernel compiles for the H200 (sm_90a) from its source here: no local-memory traffic (register spills) and
    its shared memory (the tile's two halves and the transposed FP8 tile) within an SM's."""
    import re

    skip_without_sm90_compiler()
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    from jetrl.quant.kernels import quantize_gluon

    if not quantize_gluon.available():
        pytest.skip("this Triton has no Gluon")
    kernel = quantize_gluon._kernels()[2]
    names = kernel.arg_names
    consts = dict(POW2=False, IS_BF16=dtype == "bf16", FMA=True, VEC=vec)
    ptrs = {"g_ptr": f"*{dtype}", "gate_ptr": f"*{dtype}", "up_ptr": f"*{dtype}", "act_ptr": "*fp8e4nv",
            "act_scale_ptr": "*fp32", "tok_ptr": "*fp8e4nv", "tok_scale_ptr": "*fp32"}
    ints = {"M", "K", "KB", "stride_gm", "stride_xm", "stride_um", "ACT_SCALE_M", "OUT_M"}
    assert set(names) == set(consts) | set(ptrs) | ints, set(names) ^ (set(consts) | set(ptrs) | ints)
    signature = {n: "constexpr" if n in consts else ptrs.get(n, "i32") for n in names}
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in names if n in ptrs or n in ("K", "OUT_M")}
    src = GluonASTSource(fn=kernel, signature=signature, constexprs={(names.index(n),): v for n, v in consts.items()},
                         attrs=attrs)
    compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                              options=dict(num_warps=quantize_gluon.NUM_WARPS, enable_fp_fusion=False))
    ptx = compiled.asm["ptx"]
    assert not re.search(r"\b(ld|st)\.local", ptx)
    assert compiled.metadata.shared <= 232448  # an H200 SM's shared memory per block
    # per thread 128 elements of each half: silu's and the slope's IEEE divisions, and the scales' reciprocals
    assert len(re.findall(r"div\.rn\.f32", ptx)) >= 256


def test_width_must_be_whole_blocks():
    from jetrl.quant.kernels import quantize_gluon

    x = torch.zeros(3, 200, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="multiple of 128"):
        quantize_gluon.swiglu_bwd_act_and_token(x, x, x)


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
@pytest.mark.parametrize("m, k, dtype", [(1, 1024, torch.bfloat16), (77, 1024, torch.float16), (4097, 1024, torch.bfloat16),
                                         (2049, 8960, torch.bfloat16), (300, 256, torch.float32)])
@pytest.mark.parametrize("pow2", [False, True])
def test_kernel_on_the_gpu_is_the_unfused_path_bitwise(m, k, dtype, pow2):
    """On the GPU: the Gluon kernel against SwiGLU's backward kernel followed by the backend's one-pass
    quantization of its output (the path it replaces), at unaligned token counts and the 1.5B model's width; the
    zero token rows up to a multiple of 128 included."""
    _hopper()
    from jetrl.quant import get_backend
    from jetrl.quant.kernels import swiglu_triton

    g = torch.Generator(device="cuda").manual_seed(m)
    gate_up = (torch.randn(m, 2 * k, generator=g, device="cuda") * 3).to(dtype)
    grad = torch.randn(m, k, generator=g, device="cuda").to(dtype)
    gate_up[0, :7] = torch.tensor([0.0, -0.0, 60.0, -60.0, 1e-3, -100.0, 100.0])  # extremes of silu and its slope
    d = torch.empty(m, 2 * k, dtype=dtype, device="cuda")
    swiglu_triton.swiglu_bwd(grad, gate_up[:, :k], gate_up[:, k:], d[:, :k], d[:, k:])
    backend = get_backend(d.device)
    qa, qt = backend.quantize_act_and_token(d, pow2, whole_blocks=True)
    fused = backend.quantize_swiglu_grad(grad, gate_up[:, :k], gate_up[:, k:], pow2)
    assert fused is not None, "the CUDA backend did not take its fused kernel"
    fa, ft = fused
    bits = lambda t: t.contiguous().view(torch.uint8)  # noqa: E731
    assert torch.equal(bits(fa.data), bits(qa.data)) and torch.equal(fa.scale, qa.scale)
    assert torch.equal(bits(ft.data), bits(qt.data)) and torch.equal(ft.scale, qt.scale)
    assert fa.scale.stride() == qa.scale.stride() and ft.data.stride() == qt.data.stride()
    assert ft.data.shape[0] % 128 == 0 and not bits(ft.data[m:]).any()


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
