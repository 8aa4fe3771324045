"""The decode GEMM and the kernels around it as programmatic dependent launches on the GPU
(``tuning.decode_gemm_pdl``): the same bits as the plain launches, the GEMM alone, and the decode step's chain of
kernels eager and replayed in a CUDA graph.

The compiled ordering (nothing read or written before ``griddepcontrol.wait``) is checked on the CPU
(``tests/quant/test_decode_gemm_pdl.py``); here a chain of producer -> GEMM -> consumer ... is replayed on fresh
inputs, so a kernel that read its input before the kernel writing it finished would give other bits.
"""

from __future__ import annotations

import pytest
import torch

from jetrl.quant import ACT, WEIGHT
from jetrl.quant.kernels import tuning

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def cuda_backend():
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("programmatic dependent launch and the FP8 kernels need a Hopper (sm_90+) GPU")
    from jetrl.quant.kernels.cuda_backend import CudaBackend

    return CudaBackend()


def _weights(cuda_backend, g, widths, k):
    return [cuda_backend.quantize(torch.randn(n, k, generator=g, device="cuda", dtype=torch.bfloat16), WEIGHT)
            for n in widths]


# (m, weight widths (more than one: a grouped launch), k): the 8B linears at decode sizes, the grouped q/k/v up to
# 256 rows, a partial last K block with TMA (1104) and without (1100: pointer loads)
CASES = [(1, (4096, 1024, 1024), 4096), (16, (4096,), 4096), (64, (28672,), 4096), (64, (4096,), 14336),
         (256, (4096, 1024, 1024), 4096), (37, (1000,), 1104), (37, (300,), 1100)]


@pytest.mark.parametrize("case", range(len(CASES)))
def test_pdl_launch_gives_the_plain_launchs_bits(cuda_backend, case):
    from jetrl.quant.kernels import gemm_decode_triton as dk

    m, widths, k = CASES[case]
    g = torch.Generator(device="cuda").manual_seed(case * 31)
    a = cuda_backend.quantize(torch.randn(m, k, generator=g, device="cuda", dtype=torch.bfloat16), ACT)
    ws = _weights(cuda_backend, g, widths, k)

    def run():
        if len(ws) == 1:
            return dk.fp8_decode_gemm(a.data, a.scale, ws[0].data, ws[0].scale, 128, torch.bfloat16)
        return dk.fp8_decode_gemm_grouped(a.data, a.scale, [(w.data, w.scale, None) for w in ws], torch.bfloat16)

    with tuning.override(decode_gemm_pdl=False):
        plain = run()
    with tuning.override(decode_gemm_pdl=True):
        pdl = run()
        again = run()
    assert torch.isfinite(plain.float()).all()
    assert torch.equal(pdl, plain) and torch.equal(again, plain)
    assert int(dk._locks(a.data.device).abs().sum()) == 0


def _chain(cuda_backend, x, norm_w, w_o, w_gate_up, w_down, cos, sin):
    """norm -> GEMM -> 1x128 quantizer -> GEMM -> norm -> GEMM -> SwiGLU -> GEMM -> RoPE in the decode step's manner,
    each kernel fed by the one just before it, the second norm's residual by the GEMM three kernels back; with PDL
    each launches while the one before it runs."""
    from jetrl.quant.kernels import gemm_decode_triton as dk
    from jetrl.quant.kernels.norm_triton import rms_norm_forward
    from jetrl.quant.kernels.quantize_triton import quantize_act_1x128
    from jetrl.quant.kernels.rope_triton import rope_qk
    from jetrl.quant.kernels.swiglu_triton import swiglu_fwd

    def gemm(data, scale, w):
        return dk.fp8_decode_gemm(data, scale, w.data, w.scale, 128, torch.bfloat16)

    _, _, _, q = rms_norm_forward(x, None, norm_w, 1e-5, quantize=True, pow2_scale=True)
    y1 = gemm(q.data, q.scale, w_o)
    data, scale = quantize_act_1x128(y1, pow2_scale=True)
    y = gemm(data, scale, w_o)
    _, _, _, q = rms_norm_forward(y, y1, norm_w, 1e-5, quantize=True, pow2_scale=True)
    gu = gemm(q.data, q.scale, w_gate_up)
    _, data, scale = swiglu_fwd(gu[:, :14336], gu[:, 14336:], quantize=True, pow2_scale=True)
    y = gemm(data, scale, w_down).view(-1, 32, 128)
    q, k = rope_qk(y, y[:, :8], cos, sin)
    return torch.cat([q.flatten(1), k.flatten(1)], dim=1)


@pytest.mark.parametrize("m", [16, 64])
def test_pdl_chain_replayed_in_a_graph(cuda_backend, m):
    g = torch.Generator(device="cuda").manual_seed(m)
    norm_w = torch.rand(4096, generator=g, device="cuda", dtype=torch.bfloat16) + 0.5
    (w_o,) = _weights(cuda_backend, g, (4096,), 4096)
    (w_gate_up,) = _weights(cuda_backend, g, (28672,), 4096)
    (w_down,) = _weights(cuda_backend, g, (4096,), 14336)
    x = torch.empty(m, 4096, device="cuda", dtype=torch.bfloat16)
    angles = torch.rand(m, 64, generator=g, device="cuda") * 6.0
    cos, sin = (torch.cat([f(angles)] * 2, dim=1).to(torch.bfloat16) for f in (torch.cos, torch.sin))
    inputs = [torch.randn(m, 4096, generator=g, device="cuda", dtype=torch.bfloat16) for _ in range(6)]
    with tuning.override(decode_gemm_pdl=False):
        expected = [_chain(cuda_backend, inp, norm_w, w_o, w_gate_up, w_down, cos, sin) for inp in inputs]
    with tuning.override(decode_gemm_pdl=True):
        x.copy_(inputs[0])
        _chain(cuda_backend, x, norm_w, w_o, w_gate_up, w_down, cos, sin)  # compile outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = _chain(cuda_backend, x, norm_w, w_o, w_gate_up, w_down, cos, sin)
        for _ in range(3):
            for inp, want in zip(inputs, expected):
                x.copy_(inp)
                graph.replay()
                torch.cuda.synchronize()
                assert torch.isfinite(out.float()).all() and torch.equal(out, want)
