"""The Triton quantization kernels on CPU, under the Triton interpreter, bitwise against the reference.

The interpreter is switched on by ``TRITON_INTERPRET=1`` before Triton is imported, so the kernels run
in child processes and this process (and every other test) keeps its ordinary Triton, if any. Three children
run side by side, the quantization cases of each scale rounding (``pow2`` false, true) and the GEMMs, and report
per case whether FP8 bytes and scales (or the GEMM's outputs) equal the reference's.
"""

from __future__ import annotations

import importlib.util

import pytest

from interpreted import run_interpreted

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                reason="triton is not installed (pip install triton) ")


_COMMON = r'''
import json, sys
import torch
from jetrl.quant import reference as R
from jetrl.quant.kernels import gemm_decode_triton as D
from jetrl.quant.kernels import gemm_triton as G
from jetrl.quant.kernels import quantize_triton as T

def same(a, b):
    if a.dtype == torch.float8_e4m3fn:
        a, b = a.view(torch.uint8), b.view(torch.uint8)
    return a.shape == b.shape and bool(torch.equal(a, b))

'''

# the quantization kernels on every case, for the scale roundings in POW2S
_QUANT = _COMMON + r'''
def inputs():
    g = torch.Generator().manual_seed(7)
    for (m, k) in [(1, 1), (7, 5), (130, 300), (256, 256), (3, 129)]:
        for dtype in (torch.bfloat16, torch.float32, torch.float16):
            if (m, k) == (256, 256) and dtype != torch.float16:
                continue  # whole 128 x 128 blocks: one dtype is enough (130 x 300 covers every dtype; time)
            # mixed magnitudes along K, fresh randoms; then special rows
            x = torch.randn(m, k, generator=g) * torch.logspace(-5, 5, k)
            if dtype == torch.float16:
                x = x.clamp(-6e4, 6e4)
            x = x.to(dtype)
            if m > 2 and k > 3:
                x[1] = 0                      # an all-zero row: zero 1x128 blocks
                x[2, 3] = 6e4 if dtype == torch.float16 else 1e30  # saturation (a huge value next to small ones)
                x[2, 0] = -1e-30 if dtype == torch.float32 else 0.0
            yield f"{m}x{k}-{str(dtype)[6:]}", x
    x = torch.randn(300, 200, generator=g, dtype=torch.float64)
    yield "300x200-float64", x
    yield "noncontig-200x300", torch.randn(300, 200, generator=g).t()
    yield "zeros-256x256", torch.zeros(256, 256)

NARROW_CASES = {"130x300-bfloat16", "3x129-float32", "256x256-float16", "300x200-float64", "noncontig-200x300",
                "zeros-256x256"}
# signed zeros next to ordinary values (the reciprocal division's correction must keep -0)
ZERO_CASES = {"130x300-bfloat16", "3x129-float32", "256x256-float16", "noncontig-200x300", "zeros-256x256"}

def inf_blocks_match():
    # a block holding an inf has scale inf: x / inf is +-0 and inf / inf NaN, as in the reference; the
    # interpreter's NaN bits are not the GPU's, so every element but the infs themselves is compared
    x = torch.randn(130, 260, generator=torch.Generator().manual_seed(11))
    x[5, 7], x[9, 200], x[5, 8] = float("inf"), -float("inf"), -0.0
    keep = ~torch.isinf(x)
    ok = True
    for pow2 in POW2S:
        ra, rsa = R.quantize(x, (1, 128), pow2)
        rt, rst = R.quantize(x, (128, 1), pow2)
        rw, rsw = R.quantize(x, (128, 128), pow2)
        d, s = T.quantize_act_1x128(x, pow2)
        ok = ok and same(d[keep], ra[keep]) and same(s, rsa)
        d, s = T.quantize_token_128x1(x, pow2)
        ok = ok and same(d[keep], rt[keep]) and same(s, rst)
        d, s, dt = T.quantize_weight_128x128(x, pow2, emit_t=True)
        ok = ok and same(d[keep], rw[keep]) and same(s, rsw) and same(dt[keep.t()], rw.t()[keep.t()])
    return ok

INF_OK = inf_blocks_match()
results = {}
for name, x in inputs():
    for pow2 in POW2S:
        key = f"{name}-pow2={pow2}"
        r = {}
        ra, rsa = R.quantize(x, (1, 128), pow2)
        rt, rst = R.quantize(x, (128, 1), pow2)
        rw, rsw = R.quantize(x, (128, 128), pow2)
        d, s = T.quantize_act_1x128(x, pow2)
        r["act"] = same(d, ra) and same(s, rsa)
        r["nan_free"] = not bool(torch.isnan(d.float()).any())
        td, ts = T.quantize_token_128x1(x, pow2)
        r["token"] = same(td, rt) and same(ts, rst)
        d, s, dt = T.quantize_weight_128x128(x, pow2, emit_t=True)
        r["weight"] = same(d, rw) and same(s, rsw) and same(dt, rw.t().contiguous())
        dt2, st2 = T.transpose_weight_128x128(d, s)  # W^T from W's FP8 tiles: the emit_t bytes, the scales transposed
        r["weight_transpose"] = dt2.is_contiguous() and same(dt2, rw.t().contiguous()) and same(st2, rsw.t())
        qa = R.quantize_tensor(x, (1, 128), pow2)
        rq = R.requantize(qa, (128, 1), pow2)
        d, s = T.requantize_act_to_token(qa.data, qa.scale, pow2)
        r["requant"] = same(d, rq.data) and same(s, rq.scale)
        # WGrad's operands: zero rows up to a multiple of 128 (the reference of the padded input), x's own bytes
        m = x.shape[0]
        wt, wq = R.quantize_tensor(x, (128, 1), pow2, whole_blocks=True), R.requantize(qa, (128, 1), pow2, whole_blocks=True)
        td, ts = T.quantize_token_128x1(x, pow2, whole_blocks=True)
        d, s = T.requantize_act_to_token(qa.data, qa.scale, pow2, whole_blocks=True)
        r["token_whole_blocks"] = (td.shape[0] % 128 == 0 and same(td, wt.data) and same(ts, wt.scale)
                                   and same(td[:m], rt) and same(d, wq.data) and same(s, wq.scale)
                                   and not bool(td[m:].float().any()) and not bool(d[m:].float().any()))
        # other tiles and warps than the kernels' constants (the benchmark sweep's), passed to the launchers: a
        # subset of the cases keeps this fast
        ok = True
        for bk in ((64, 128) if name in NARROW_CASES else ()):
            td, ts = T.quantize_token_128x1(x, pow2, block_k=bk, num_warps=4)
            ok = ok and same(td, rt) and same(ts, rst)
            d, s = T.requantize_act_to_token(qa.data, qa.scale, pow2, block_k=bk, num_warps=4)
            ok = ok and same(d, rq.data) and same(s, rq.scale)
            d, s = T.quantize_act_1x128(x, pow2, block_m=64, num_warps=8)
            ok = ok and same(d, ra) and same(s, rsa)
            d, s, dt = T.quantize_weight_128x128(x, pow2, emit_t=True, num_warps=8)
            ok = ok and same(d, rw) and same(s, rsw) and same(dt, rw.t().contiguous())
            dt2, st2 = T.transpose_weight_128x128(d, s, num_warps=8)
            ok = ok and same(dt2, rw.t().contiguous()) and same(st2, rsw.t())
        r["tuned_tiles"] = ok
        ok = INF_OK
        if name in ZERO_CASES:
            xz = x.clone()
            xz[0, : min(5, xz.shape[1])] = -0.0  # signed zeros next to ordinary values
            za, zsa = R.quantize(xz, (1, 128), pow2)
            zt, zst = R.quantize(xz, (128, 1), pow2)
            zw, zsw = R.quantize(xz, (128, 128), pow2)
            zq = R.quantize_tensor(xz, (1, 128), pow2)
            zr = R.requantize(zq, (128, 1), pow2)
            d, s = T.quantize_act_1x128(xz, pow2)
            ok = ok and same(d, za) and same(s, zsa)
            td, ts = T.quantize_token_128x1(xz, pow2)
            ok = ok and same(td, zt) and same(ts, zst)
            d, s, dt = T.quantize_weight_128x128(xz, pow2, emit_t=True)
            ok = ok and same(d, zw) and same(s, zsw) and same(dt, zw.t().contiguous())
            d, s = T.requantize_act_to_token(zq.data, zq.scale, pow2)
            ok = ok and same(d, zr.data) and same(s, zr.scale)
        r["signed_zeros_and_inf_blocks"] = ok
        results[key] = r

json.dump({"quant": results}, sys.stdout)
'''

_GEMM = _COMMON + r'''
# GEMM: the Triton blockwise GEMM against dequantize-then-fp32-matmul
g = torch.Generator().manual_seed(3)
gemm = {}
for (m, n, k) in [(20, 200, 300), (33, 128, 256)]:
    a = R.quantize_tensor(torch.randn(m, k, generator=g), (1, 128))
    for name, b in (("tile", R.quantize_tensor(torch.randn(n, k, generator=g), (128, 128))),
                    ("act", R.quantize_tensor(torch.randn(n, k, generator=g), (1, 128)))):
        ref = R.gemm(a, b, torch.float32).double()
        out = G.blockwise_fp8_gemm(a.data, a.scale, b.data, b.scale, 128 if name == "tile" else 1,
                                   torch.float32, G.GemmConfig(16, 32, 1, 4, 2)).double()
        bound = (a.dequantize().double().abs() @ b.dequantize().double().abs().t()) * (k + 2) * 2.0 ** -24
        gemm[f"{m}x{n}x{k}-{name}"] = bool(((out - ref).abs() <= bound).all())
# the split-K decode GEMM: several splits (incl. a last split shorter than the others), both b layouts
for (m, n, k, split, bn) in [(1, 200, 300, 1, 64), (5, 128, 1024, 4, 64), (33, 130, 1100, 6, 32)]:
    a = R.quantize_tensor(torch.randn(m, k, generator=g), (1, 128))
    for name, b in (("tile", R.quantize_tensor(torch.randn(n, k, generator=g), (128, 128))),
                    ("act", R.quantize_tensor(torch.randn(n, k, generator=g), (1, 128)))):
        ref = R.gemm(a, b, torch.float32).double()
        cfg = D.DecodeGemmConfig(block_n=bn, split_k=split, num_warps=4, num_stages=2)
        run = lambda: D.fp8_decode_gemm(a.data, a.scale, b.data, b.scale, 128 if name == "tile" else 1,
                                        torch.float32, cfg).double()
        out = run()
        bound = (a.dequantize().double().abs() @ b.dequantize().double().abs().t()) * (k + 2) * 2.0 ** -24
        gemm[f"decode-{m}x{n}x{k}-split{split}-{name}"] = bool(((out - ref).abs() <= bound).all()) and \
            torch.equal(out, run())
# grouped: up to three weights sharing the input, with and without biases, equal to one-by-one calls
for (m, ns, k, split) in [(3, (256, 128, 128), 512, 2), (20, (200, 130), 300, 1)]:
    a = R.quantize_tensor(torch.randn(m, k, generator=g), (1, 128))
    for with_bias in (False, True):
        ws = []
        for n in ns:
            q = R.quantize_tensor(torch.randn(n, k, generator=g), (128, 128))
            ws.append((q.data, q.scale, torch.randn(n, generator=g).to(torch.bfloat16) if with_bias else None))
        cfg = D.DecodeGemmConfig(block_n=64, split_k=split, num_warps=4, num_stages=2)
        out = D.fp8_decode_gemm_grouped(a.data, a.scale, ws, torch.bfloat16, cfg)
        sep = [D.fp8_decode_gemm(a.data, a.scale, d, sc, 128, torch.bfloat16, cfg) for d, sc, _ in ws]
        sep = [y + b if b is not None else y for y, (_, _, b) in zip(sep, ws)]
        gemm[f"grouped-{m}-{len(ns)}-bias{with_bias}"] = bool(torch.equal(out, torch.cat(sep, 1)))
# tuning variants: K blocks per iteration, TMA descriptor loads (K % 16 == 0; a partial last K block; and a K
# where TMA does not apply, which falls back to pointer loads), row tiles (a partial last one), 128/256-row tiles
from triton.tools.tensor_descriptor import TensorDescriptor
made = []
_from_tensor = TensorDescriptor.from_tensor
TensorDescriptor.from_tensor = staticmethod(lambda t, shape, *r: made.append(tuple(shape)) or _from_tensor(t, shape))
for (m, n, k, cfg) in [(40, 130, 1040, D.DecodeGemmConfig(64, 3, 4, 2, block_m=16, k_unroll=2, tma=True)),
                       (5, 200, 1100, D.DecodeGemmConfig(128, 2, 4, 2, k_unroll=2, tma=True)),
                       (70, 64, 256, D.DecodeGemmConfig(256, 1, 4, 2, block_m=32))]:
    a = R.quantize_tensor(torch.randn(m, k, generator=g), (1, 128))
    b = R.quantize_tensor(torch.randn(n, k, generator=g), (128, 128))
    ref = R.gemm(a, b, torch.float32).double()
    run = lambda: D.fp8_decode_gemm(a.data, a.scale, b.data, b.scale, 128, torch.float32, cfg).double()
    out = run()
    bound = (a.dequantize().double().abs() @ b.dequantize().double().abs().t()) * (k + 2) * 2.0 ** -24
    gemm[f"decode-{m}x{n}x{k}-{cfg.name}"] = bool(((out - ref).abs() <= bound).all()) and \
        (m != 40 or torch.equal(out, run()))
gemm["decode-tma-descriptors"] = made[:2] == [(16, 128), (64, 128)] and len(made) == 4  # first case only, twice
ws = []
for n in (256, 128, 72):
    q = R.quantize_tensor(torch.randn(n, 512, generator=g), (128, 128))
    ws.append((q.data, q.scale, torch.randn(n, generator=g).to(torch.bfloat16)))
a = R.quantize_tensor(torch.randn(3, 512, generator=g), (1, 128))
cfg = D.DecodeGemmConfig(block_n=64, split_k=2, num_warps=4, num_stages=2, k_unroll=2, tma=True)
out = D.fp8_decode_gemm_grouped(a.data, a.scale, ws, torch.bfloat16, cfg)
sep = torch.cat([D.fp8_decode_gemm(a.data, a.scale, d, s, 128, torch.bfloat16, cfg) + b for d, s, b in ws], 1)
gemm["grouped-tma-unrolled"] = bool(torch.equal(out, sep)) and len(made) == 4 + 4 + 3 * 2
TensorDescriptor.from_tensor = _from_tensor
gemm["decode-counters-reset"] = int(D._locks(torch.device("cpu")).abs().sum()) == 0
json.dump({"gemm": gemm}, sys.stdout)
'''

# one child per scale rounding and one for the GEMMs: they run side by side (tests/interpreted.py)
_CHILD = (*(_QUANT.replace("POW2S", f"({pow2},)") for pow2 in (False, True)), _GEMM)


@pytest.fixture(scope="module")
def interpreted():
    *quant, gemm = _CHILD
    results = {"quant": {}, "gemm": run_interpreted(gemm, "GEMM kernels")["gemm"]}
    for child in quant:
        results["quant"].update(run_interpreted(child, "quantization kernels")["quant"])
    return results


KERNELS = ("act", "token", "token_whole_blocks", "weight", "weight_transpose", "requant", "nan_free", "tuned_tiles", "signed_zeros_and_inf_blocks")


@pytest.mark.parametrize("kernel", KERNELS)
def test_quantization_kernel_bitwise_equals_reference(interpreted, kernel):
    cases = interpreted["quant"]
    assert len(cases) >= 30
    failed = [case for case, result in cases.items() if not result[kernel]]
    assert not failed, f"{kernel}: FP8 bytes or scales differ from the reference for {failed}"


def test_blockwise_gemm_matches_dequantized_matmul(interpreted):
    # both sides sum K fp32 products in different orders: the standard recursive-summation bound
    # (K + 2) * 2^-24 * sum |a||b| covers it; a wrong scale or block would miss by orders of magnitude
    assert interpreted["gemm"] and all(interpreted["gemm"].values()), interpreted["gemm"]
