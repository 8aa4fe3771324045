"""The TMA blockwise FP8 GEMM for training-sized M (:mod:`jetrl.quant.kernels.gemm_tma_triton`) on CPU, under the
Triton interpreter, against :func:`jetrl.quant.reference.gemm`, and its routing (forced by the tuning only).

The operands are made by the quantization kernels as the CUDA backend makes them for the three training GEMMs
(Fprop: x per 1x128 in its padded buffers and W per 128x128 tile with the padded scale buffer; DGrad: dy per 1x128
and the row-major W^T copy with its scales in cuBLAS's layout; WGrad: dy and x per 128x1 along the tokens with
whole blocks, transposed), at unaligned token counts. Each result must lie within the recursive-summation bound
``(K + 2) * 2^-24 * sum |a||b|`` of the reference (the bound of the blockwise GEMM's interpreter test): both sum
K fp32 products in different orders, and a wrong scale, block or tile edge misses it by orders of magnitude.
"""

from __future__ import annotations

import importlib.util

import pytest

from interpreted import run_interpreted

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                reason="triton is not installed (pip install triton) ")

_CHILD = r'''
import json, sys
import torch
from jetrl.quant import reference as R
from jetrl.quant.formats import ACT, TOKEN, WEIGHT, Fp8Tensor
from jetrl.quant.kernels import gemm_tma_triton as TG
from jetrl.quant.kernels import quantize_triton as T
from jetrl.quant.kernels import tuning

# the TMA path must run where the layouts allow: the pointer fallback is counted
fallbacks = []
_fallback = TG.blockwise_fp8_gemm
TG.blockwise_fp8_gemm = lambda *args, **kw: fallbacks.append(1) or _fallback(*args, **kw)

def operands(m, n, k, g):
    """(pairing, a, b) as the CUDA backend quantizes them: x (m, k), W (n, k), dy (m, n)."""
    x, w, dy = torch.randn(m, k, generator=g), torch.randn(n, k, generator=g), torch.randn(m, n, generator=g)
    qx = Fp8Tensor(*T.quantize_act_1x128(x), ACT)
    data, scale, data_t = T.quantize_weight_128x128(w, emit_t=True)
    scale_t = T.tile_scale_buffer(scale.shape[1], scale.shape[0], w.device)
    scale_t.copy_(scale.t())
    qw, qw_t = Fp8Tensor(data, scale, WEIGHT), Fp8Tensor(data_t, scale_t, WEIGHT)
    qdy = Fp8Tensor(*T.quantize_act_1x128(dy), ACT)
    qdy_tok = Fp8Tensor(*T.quantize_token_128x1(dy, whole_blocks=True), TOKEN)
    qx_tok = Fp8Tensor(*T.quantize_token_128x1(x, whole_blocks=True), TOKEN)
    return [("fprop", qx, qw), ("dgrad", qdy, qw_t), ("wgrad", qdy_tok.t(), qx_tok.t())]

def within_bound(a, b, out):
    ref = R.gemm(a, b, torch.float32).double()
    k = a.shape[1]
    bound = (a.dequantize().double().abs() @ b.dequantize().double().abs().t()) * (k + 2) * 2.0 ** -24
    return out.shape == ref.shape and bool(((out.double() - ref).abs() <= bound).all())

CONFIGS = [TG.TmaGemmConfig(64, 128, 4, 2),
           TG.TmaGemmConfig(32, 64, 4, 2, group_m=2, persistent=True, skew=True, tma_store=True),
           TG.TmaGemmConfig(64, 256, 4, 2, row_scale=False)]
g = torch.Generator().manual_seed(17)
res = {}
for i, m in enumerate((1, 77, 300)):
    for pairing, a, b in operands(m, 384, 256, g):
        rows = 128 if b.block == WEIGHT else 1
        for cfg in (CONFIGS[i], CONFIGS[(i + 1) % 3]):
            out = TG.tma_fp8_gemm(a.data, a.scale, b.data, b.scale, rows, torch.float32, cfg)
            res[f"{pairing}-m{m}-{cfg.name}"] = within_bound(a, b, out)
        # bf16 output, the tiles from the tuning object
        with tuning.override(tma_gemm_block_m=32, tma_gemm_block_n=128, tma_gemm_num_warps=4, tma_gemm_num_stages=2,
                             tma_gemm_persistent=m == 77):
            out = TG.tma_fp8_gemm(a.data, a.scale, b.data, b.scale, rows)
        ref = R.gemm(a, b, torch.bfloat16).float()
        res[f"{pairing}-m{m}-tuning-bf16"] = out.dtype == torch.bfloat16 and bool(
            ((out.float() - ref).abs() <= 2.0 ** -7 * ref.abs() + 1e-6 * ref.abs().max()).all())
res["tma-path-taken"] = not fallbacks
# a K TMA cannot read (rows not 16-byte aligned): the pointer GEMM, the same bound
x = R.quantize_tensor(torch.randn(5, 200, generator=g), (1, 128))
w = R.quantize_tensor(torch.randn(130, 200, generator=g), (128, 128))
out = TG.tma_fp8_gemm(x.data, x.scale, w.data, w.scale, 128, torch.float32)
res["fallback-unaligned-k"] = within_bound(x, w, out) and len(fallbacks) == 1
json.dump(res, sys.stdout)
'''


def test_tma_gemm_matches_reference_for_the_three_pairings():
    res = run_interpreted(_CHILD, "TMA GEMM")
    assert len(res) >= 3 * 3 * 3 + 2, res
    failed = [case for case, ok in res.items() if not ok]
    assert not failed, f"TMA GEMM outside the summation bound (or not on its TMA path): {failed}"


def test_tma_gemm_only_when_the_tuning_forces_it():
    pytest.importorskip("triton")
    from jetrl.quant import reference as R
    from jetrl.quant.kernels import cuda_backend, tuning

    import torch

    a = R.quantize_tensor(torch.randn(300, 256), (1, 128))
    b = R.quantize_tensor(torch.randn(384, 256), (128, 128))
    assert tuning.KernelTuning().gemm == "auto" or tuning.current().gemm != "triton-tma"
    with tuning.override(gemm="auto"):
        assert cuda_backend.gemm_path(a, b) != "triton-tma"
    with tuning.override(gemm="triton-tma"):
        assert cuda_backend.gemm_path(a, b) == "triton-tma"
        assert cuda_backend.gemm_path(R.quantize_tensor(torch.randn(1, 256), (1, 128)), b) == "triton-tma"
    with pytest.raises(ValueError):
        tuning.KernelTuning(tma_gemm_block_m=96)
    with pytest.raises(ValueError):
        tuning.KernelTuning(tma_gemm_skew=1)
