"""Exact mode's Triton kernels on CPU under TRITON_INTERPRET=1 (see ``tests/interpreted.py``): the batch-invariant
FP8 and 16/32-bit GEMMs and the one attention kernel against their references; the attention kernel's bits
independent of the paging (pages of 8 vs the packed rows' one-token pages) and of the fully masked chunks a row
walks with a longer neighbour.

bf16 operands are left to the GPU tests: the interpreter's ``tl.dot`` on bf16 is not the hardware's. So is the
batch invariance of the dot products themselves: the interpreter computes every ``tl.dot`` tile with numpy's
sgemm (fp16 and FP8 operands upcast), which does not give a row the same bits at every position of a fixed-shape
tile; the GPU's MMA does, and tests/exact/test_exact_gpu.py checks it there. The bitwise checks here keep each
compared row at the same position of its tile."""

import importlib.util

import pytest

from interpreted import run_interpreted

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                reason="triton is not installed (pip install triton) ")

_CHILD = r'''
import json, sys
import torch
from jetrl.quant import ACT, WEIGHT, quantize_tensor
from jetrl.quant import reference as R
from jetrl.quant.kernels import gemm_exact_triton as E
import dataclasses
from jetrl.quant.kernels.exact_attention_triton import exact_attention_fwd, number_tiles
from jetrl.models.attention import (PagedAttentionMetadata, exact_attention_reference, packed_as_paged)

out = {}
g = torch.Generator().manual_seed(0)

# FP8 blockwise GEMM: (M, K) x (N, K) with 128x128 and 1x128 right operands
for n, k, rows_b in ((192, 300, 128), (96, 256, 1)):
    x = torch.randn(70, k, generator=g)
    qx = quantize_tensor(x, ACT)
    qw = quantize_tensor(torch.randn(n, k, generator=g), WEIGHT if rows_b == 128 else ACT)
    full = E.exact_fp8_gemm(qx.data, qx.scale, qw.data, qw.scale, rows_b, torch.float32)
    ref = R.gemm(qx, qw, torch.float32)
    bound = (k + 2) * 2.0 ** -24 * (qx.dequantize().abs() @ qw.dequantize().abs().t())
    out[f"fp8-{n}x{k}-close"] = bool(((full - ref).abs() <= bound + 1e-30).all())

# 16/32-bit GEMM
for dtype in (torch.float32, torch.float16):
    x = torch.randn(70, 200, generator=g).to(dtype)
    w = torch.randn(80, 200, generator=g).to(dtype)
    full = E.exact_matmul(x, w)
    ref = x.double() @ w.double().t()
    half = dtype == torch.float16
    out[f"matmul-{dtype}-close"] = bool(torch.allclose(full.double(), ref, rtol=1e-3 if half else 1e-5,
                                                       atol=1e-2 if half else 1e-4))

# attention. Under the interpreter a tl.dot row's bits depend on its position in the tile (numpy's sgemm), so
# the bitwise checks keep each compared row at the same tile position and vary what the kernel may not depend
# on: the page size and block table (paged cache vs the packed rows), and the extra fully masked chunks a row
# walks when its tile reaches further than it does
for dtype in (torch.float32, torch.float16):
    lengths = [1, 7, 70, 130]
    cu = [0]
    for L in lengths:
        cu.append(cu[-1] + L)
    q = torch.randn(cu[-1], 4, 16, generator=g).to(dtype)
    k = torch.randn(cu[-1], 2, 16, generator=g).to(dtype)
    v = torch.randn(cu[-1], 2, 16, generator=g).to(dtype)
    meta = packed_as_paged(cu, "cpu")
    packed = exact_attention_fwd(q, k[:, None], v[:, None], meta, 0.25)
    ref = exact_attention_reference(q, k[:, None], v[:, None], meta, 0.25)
    tol = 2e-3 if dtype == torch.float16 else 1e-5
    out[f"attn-{dtype}-close"] = bool(torch.allclose(packed.float(), ref.float(), rtol=tol, atol=tol))
    page = 8
    width = -(-max(lengths) // page) + 2
    nblocks = sum(-(-L // page) for L in lengths) + 2
    perm = torch.randperm(nblocks, generator=g).tolist()
    kc = torch.zeros(nblocks, page, 2, 16, dtype=dtype)
    vc = torch.zeros_like(kc)
    tables = torch.full((len(lengths), width), -1, dtype=torch.int32)
    for s, L in enumerate(lengths):
        for j in range(L):
            if j % page == 0:
                tables[s, j // page] = perm.pop()
            kc[tables[s, j // page], j % page] = k[cu[s] + j]
            vc[tables[s, j // page], j % page] = v[cu[s] + j]
    last = torch.tensor([c - 1 for c in cu[1:]])
    dmeta = PagedAttentionMetadata(torch.arange(5, dtype=torch.int32), torch.tensor(lengths, dtype=torch.int32),
                                   tables, torch.zeros(4, dtype=torch.long), 1, max(lengths))
    decode = exact_attention_fwd(q[last], kc, vc, dmeta, 0.25)  # each row alone in its tile, through pages of 8
    alone = torch.stack([exact_attention_fwd(q[r:r + 1], k[:, None], v[:, None], PagedAttentionMetadata(
        torch.tensor([0, 1], dtype=torch.int32), torch.tensor([lengths[i]], dtype=torch.int32),
        meta.block_tables[i:i + 1], torch.zeros(1, dtype=torch.long), 1, lengths[i]), 0.25)[0]
        for i, r in enumerate(last.tolist())])  # the same rows alone, through the packed rows' one-token pages
    out[f"attn-{dtype}-paged-bitwise"] = bool(torch.equal(decode, alone))
    # the program numbering made once per forward (plan_exact_attention) is a schedule: the same bits
    planned = exact_attention_fwd(q, k[:, None], v[:, None], dataclasses.replace(
        meta, exact_tiles=number_tiles(meta, cu[-1], 4, 2)), 0.25)
    planned_decode = exact_attention_fwd(q[last], kc, vc, dataclasses.replace(
        dmeta, exact_tiles=number_tiles(dmeta, 4, 4, 2)), 0.25)
    out[f"attn-{dtype}-planned-bitwise"] = bool(torch.equal(planned, packed) and torch.equal(planned_decode, decode))
    # a prefill chunk of the last 10 rows of the 70-token sequence: its tile walks 2 chunks, so rows 60-63
    # (keys < 64) walk one fully masked chunk; alone, rows 60-61 walk one chunk
    chunk = exact_attention_fwd(q[cu[2] + 60:cu[3]], kc, vc, PagedAttentionMetadata(
        torch.tensor([0, 10], dtype=torch.int32), torch.tensor([70], dtype=torch.int32), tables[2:3],
        torch.zeros(10, dtype=torch.long), 10, 70), 0.25)
    short = exact_attention_fwd(q[cu[2] + 60:cu[2] + 62], kc, vc, PagedAttentionMetadata(
        torch.tensor([0, 2], dtype=torch.int32), torch.tensor([62], dtype=torch.int32), tables[2:3],
        torch.zeros(2, dtype=torch.long), 2, 62), 0.25)
    out[f"attn-{dtype}-masked-chunk-bitwise"] = bool(torch.equal(chunk[:2], short))
    pref_ref = exact_attention_reference(q[cu[2] + 60:cu[3]], kc, vc, PagedAttentionMetadata(
        torch.tensor([0, 10], dtype=torch.int32), torch.tensor([70], dtype=torch.int32), tables[2:3],
        torch.zeros(10, dtype=torch.long), 10, 70), 0.25)
    out[f"attn-{dtype}-prefill-close"] = bool(torch.allclose(chunk.float(), pref_ref.float(), rtol=tol, atol=tol))
json.dump(out, sys.stdout)
'''


@pytest.fixture(scope="module")
def interpreted():
    return run_interpreted(_CHILD, "exact kernels", timeout=900)


def test_exact_gemms_match_references(interpreted):
    results = {k: v for k, v in interpreted.items() if not k.startswith("attn") and k.endswith("close")}
    assert len(results) == 4 and all(results.values()), results




@pytest.mark.parametrize("what", ["-close", "prefill-close", "paged-bitwise", "masked-chunk-bitwise", "planned-bitwise"])
def test_exact_attention_kernel(interpreted, what):
    results = {k: v for k, v in interpreted.items() if k.startswith("attn") and k.endswith(what)}
    assert len(results) == (4 if what == "-close" else 2) and all(results.values()), results
