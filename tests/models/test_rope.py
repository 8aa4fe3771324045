"""RoPE of q and k in one launch: bitwise the unfused ``apply_rope``, forward and backward.

CPU: the reference against the model's current ``apply_rope`` (bitwise); the Triton kernel under the
interpreter in a child process (``TRITON_INTERPRET=1`` must be set before Triton is imported), bitwise
against the reference and against autograd of it, with strided views of a fused qkv projection, odd
half-dims and transposed layouts. GPU (``gpu`` marker): the same claims at Llama-8B and Qwen-like shapes.
"""

from __future__ import annotations

import pytest
import torch

from jetrl.models import transformer
from jetrl.models.rope import apply_rope, apply_rope_qk
from jetrl.quant.backend import choose_impl

from interpreted import run_interpreted

DTYPES = [torch.bfloat16, torch.float16, torch.float32]


def use_triton(x, impl):
    """Whether the seam picks the kernels for this op."""
    return choose_impl(x, impl, op="rope") == "triton"



def _cos_sin(n: int, d: int, dtype: torch.dtype, gen: torch.Generator, device="cpu"):
    inv_freq = 1.0 / (500000.0 ** (torch.arange(0, d, 2).float() / d))
    positions = torch.randint(0, 8192, (n,), generator=gen)
    cos, sin = transformer.rope_cos_sin(inv_freq, positions, dtype)
    return cos.to(device), sin.to(device)


def _qk_views(n: int, hq: int, hkv: int, d: int, dtype: torch.dtype, gen: torch.Generator, device="cpu"):
    """q and k as head views of one fused (N, (Hq + 2 Hkv) D) projection output: strided, not contiguous."""
    qkv = torch.randn(n, (hq + 2 * hkv) * d, generator=gen).to(dtype).to(device)
    q = qkv[:, : hq * d].view(n, hq, d)
    k = qkv[:, hq * d: (hq + hkv) * d].view(n, hkv, d)
    return q, k


def _unfused_apply_rope(x, cos, sin):
    """The decoder's RoPE before fusion, verbatim: what the reference must keep reproducing."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


@pytest.mark.parametrize("dtype", DTYPES)
def test_reference_is_the_unfused_model_code(dtype, gen):
    cos, sin = _cos_sin(9, 64, dtype, gen)
    q, k = _qk_views(9, 6, 2, 64, dtype, gen)
    assert torch.equal(apply_rope(q, cos, sin), _unfused_apply_rope(q, cos, sin))
    q_out, k_out = apply_rope_qk(q, k, cos, sin, impl="reference")
    assert torch.equal(q_out, _unfused_apply_rope(q, cos, sin))
    assert torch.equal(k_out, _unfused_apply_rope(k, cos, sin))
    assert not torch.isnan(q_out).any() and not torch.isnan(k_out).any()


def test_automatic_dispatch_runs_the_reference_on_cpu(gen, monkeypatch):
    cos, sin = _cos_sin(3, 16, torch.bfloat16, gen)
    q, k = _qk_views(3, 4, 2, 16, torch.bfloat16, gen)
    assert not use_triton(q, None) and not use_triton(q, "reference")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert use_triton(q, "triton")
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(ValueError, match="needs CUDA tensors"):
        apply_rope_qk(q, k, cos, sin, impl="triton")
    q_out, _ = apply_rope_qk(q, k, cos, sin)
    assert torch.equal(q_out, apply_rope(q, cos, sin))


def test_bad_inputs_raise_clear_errors(gen):
    cos, sin = _cos_sin(4, 16, torch.bfloat16, gen)
    q, k = _qk_views(4, 4, 2, 16, torch.bfloat16, gen)
    with pytest.raises(ValueError, match="3-D"):
        apply_rope_qk(q.reshape(4, 64), k, cos, sin)
    with pytest.raises(ValueError, match="tokens and head_dim"):
        apply_rope_qk(q, k[:3], cos, sin)
    with pytest.raises(ValueError, match=r"\(N, head_dim\)"):
        apply_rope_qk(q, k, cos[:, :8], sin[:, :8])
    with pytest.raises(TypeError, match="share one dtype"):
        apply_rope_qk(q, k, cos.float(), sin.float())
    with pytest.raises(TypeError, match="bfloat16, float16 or float32"):
        apply_rope_qk(q.to(torch.int32), k, cos, sin)
    with pytest.raises(ValueError, match="even"):
        odd = torch.randn(4, 2, 15, generator=gen).to(torch.bfloat16)
        apply_rope_qk(odd, odd, odd[:, 0], odd[:, 0])
    with pytest.raises(ValueError, match="impl must be one of"):
        apply_rope_qk(q, k, cos, sin, impl="cuda")


# --------------------------------------------------------------------------------------------------
# Triton kernel under the interpreter (CPU, child process)

_CHILD = r'''
import json, sys
import torch
from jetrl.models import transformer
from jetrl.models.rope import apply_rope, apply_rope_qk

def same(a, b):
    return a.shape == b.shape and a.dtype == b.dtype and bool(torch.equal(a, b))

g = torch.Generator().manual_seed(5)

def cos_sin(n, d, dtype):
    inv = 1.0 / (1000000.0 ** (torch.arange(0, d, 2).float() / d))
    return transformer.rope_cos_sin(inv, torch.randint(0, 30000, (n,), generator=g), dtype)

res = {}
# (N, Hq, Hkv, D): Qwen-like GQA, an odd half (D = 10), one kv head, MHA
for (n, hq, hkv, d) in [(7, 12, 2, 64), (3, 3, 1, 10), (5, 4, 4, 32)]:
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        key = f"{n}x{hq}x{hkv}x{d}-{str(dtype)[6:]}"
        cos, sin = cos_sin(n, d, dtype)
        qkv = torch.randn(n, (hq + 2 * hkv) * d, generator=g).to(dtype)
        q = qkv[:, : hq * d].view(n, hq, d)
        k = qkv[:, hq * d: (hq + hkv) * d].view(n, hkv, d)
        r = {}
        q_out, k_out = apply_rope_qk(q, k, cos, sin, impl="triton")
        r["forward_bitwise"] = same(q_out, apply_rope(q, cos, sin)) and same(k_out, apply_rope(k, cos, sin))
        r["contiguous_out"] = q_out.is_contiguous() and k_out.is_contiguous()
        r["nan_free"] = not bool(torch.isnan(q_out).any() or torch.isnan(k_out).any())
        qq, kk = q.detach().clone().requires_grad_(True), k.detach().clone().requires_grad_(True)
        gq = torch.randn(n, hq, d, generator=g).to(dtype)
        gk = torch.randn(n, d, hkv, generator=g).to(dtype).transpose(1, 2)  # a strided incoming gradient
        ours = torch.autograd.grad(apply_rope_qk(qq, kk, cos, sin, impl="triton"), (qq, kk), (gq, gk))
        theirs = torch.autograd.grad((apply_rope(qq, cos, sin), apply_rope(kk, cos, sin)), (qq, kk), (gq, gk))
        r["backward_bitwise"] = all(same(a, b) for a, b in zip(ours, theirs))
        r["grad_nan_free"] = not any(bool(torch.isnan(t).any()) for t in ours)
        res[key] = r

# other layouts: head_dim-strided q (a transposed buffer), non-contiguous cos/sin (halves of one buffer)
n, h, d = 6, 4, 16
q = torch.randn(n, d, h, generator=g).to(torch.bfloat16).transpose(1, 2)
k = torch.randn(h, n, d, generator=g).to(torch.bfloat16).transpose(0, 1)
cs = torch.randn(n, 2 * d, generator=g).to(torch.bfloat16)
cos, sin = cs[:, :d], cs[:, d:]
q_out, k_out = apply_rope_qk(q, k, cos, sin, impl="triton")
res["layouts"] = {"forward_bitwise": same(q_out, apply_rope(q, cos, sin)) and same(k_out, apply_rope(k, cos, sin))}
json.dump(res, sys.stdout)
'''


@pytest.fixture(scope="module")
def interpreted():
    return run_interpreted(_CHILD, "kernel")


@pytest.mark.parametrize("check", ["forward_bitwise", "contiguous_out", "nan_free", "backward_bitwise",
                                   "grad_nan_free"])
def test_interpreted_kernel(interpreted, check):
    cases = {k: v for k, v in interpreted.items() if k != "layouts"}
    assert len(cases) == 9
    failed = [case for case, r in cases.items() if not r[check]]
    assert not failed, f"{check} fails for {failed}"


def test_interpreted_kernel_reads_any_strides(interpreted):
    assert interpreted["layouts"]["forward_bitwise"]


# --------------------------------------------------------------------------------------------------
# GPU: the Triton kernel against the reference on the same device (run on the H200)

GPU_SHAPES = [(64, 32, 8, 128), (4096, 32, 8, 128), (64, 12, 2, 128), (4096, 12, 2, 128)]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", GPU_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_gpu_forward_and_backward_bitwise(shape, dtype):
    n, hq, hkv, d = shape
    gen = torch.Generator().manual_seed(n + hq)
    cos, sin = _cos_sin(n, d, dtype, gen, "cuda")
    q, k = _qk_views(n, hq, hkv, d, dtype, gen, "cuda")
    q_out, k_out = apply_rope_qk(q, k, cos, sin, impl="triton")
    assert not torch.isnan(q_out).any() and not torch.isnan(k_out).any()
    assert torch.equal(q_out, apply_rope(q, cos, sin)), "q differs from the unfused apply_rope"
    assert torch.equal(k_out, apply_rope(k, cos, sin)), "k differs from the unfused apply_rope"
    qq, kk = q.detach().clone().requires_grad_(True), k.detach().clone().requires_grad_(True)
    gq = torch.randn(n, hq, d, device="cuda").to(dtype)
    gk = torch.randn(n, hkv, d, device="cuda").to(dtype)
    ours = torch.autograd.grad(apply_rope_qk(qq, kk, cos, sin, impl="triton"), (qq, kk), (gq, gk))
    theirs = torch.autograd.grad((apply_rope(qq, cos, sin), apply_rope(kk, cos, sin)), (qq, kk), (gq, gk))
    assert torch.equal(ours[0], theirs[0]) and torch.equal(ours[1], theirs[1]), "backward differs from autograd"


@pytest.mark.gpu
def test_gpu_automatic_dispatch_follows_the_fp8_backend():
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("the cuda FP8 backend needs a Hopper (sm_90+) GPU")
    from jetrl.quant import use_backend

    gen = torch.Generator().manual_seed(0)
    q, _ = _qk_views(4, 4, 2, 64, torch.bfloat16, gen, "cuda")
    with use_backend("cuda"):
        assert use_triton(q, None)
    with use_backend("reference"):
        assert not use_triton(q, None)
