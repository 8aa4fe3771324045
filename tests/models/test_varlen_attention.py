"""Packed-sequence attention of the training forward: one flash-attention launch over all sequences (CUDA) against
its reference, one causal SDPA per sequence; shapes users have (ragged lengths, head_dim 64 and 128, GQA 1-8)."""

from __future__ import annotations

import pytest
import torch

from jetrl.models.attention import flash_varlen_eligible, varlen_attention, varlen_attention_reference


def _packed(lengths, hq, hkv, d, device, dtype, seed):
    g = torch.Generator(device=device).manual_seed(seed)
    n = sum(lengths)
    q, k, v = (torch.randn(n, h, d, generator=g, device=device).to(dtype) for h in (hq, hkv, hkv))
    cu = [0]
    for length in lengths:
        cu.append(cu[-1] + length)
    return q, k, v, cu


def test_cpu_runs_the_reference():
    q, k, v, cu = _packed([5, 1, 9], 4, 2, 64, "cpu", torch.bfloat16, 0)
    assert not flash_varlen_eligible(q, k)
    assert torch.equal(varlen_attention(q, k, v, cu, 0.125), varlen_attention_reference(q, k, v, cu, 0.125))
    with pytest.raises(ValueError, match="cu_seqlens"):
        varlen_attention(q, k, v, [0, 5, 14], 0.125)


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("heads", [(8, 8), (14, 2), (12, 2), (28, 4), (32, 8), (8, 1)])
def test_flash_varlen_equals_per_sequence_sdpa(head_dim, heads):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    hq, hkv = heads
    lengths = [1, 250, 37, 1024, 129, 3]  # ragged, unaligned, one of a single token
    q, k, v, cu = _packed(lengths, hq, hkv, head_dim, "cuda", torch.bfloat16, head_dim + hq)
    assert flash_varlen_eligible(q, k)
    grad = torch.randn(q.shape, device="cuda", dtype=torch.bfloat16)
    results = []
    for fn in (varlen_attention, varlen_attention_reference):
        qi, ki, vi = (t.clone().requires_grad_() for t in (q, k, v))
        out = fn(qi, ki, vi, cu, head_dim ** -0.5)
        out.backward(grad)
        results.append([out.float(), qi.grad.float(), ki.grad.float(), vi.grad.float()])
    for got, ref, what in zip(*results, ("out", "dq", "dk", "dv")):
        assert torch.isfinite(got).all(), what
        # both are flash kernels in bf16 (fp32 accumulation, other tilings): agreement to bf16 rounding, a relative
        # norm error of a few 2^-8 at most
        rel = float((got - ref).norm() / ref.norm())
        assert rel < 1e-2, f"{what}: relative error {rel:.2e}"
