"""Exact mode's split-K GEMMs: the split heuristic (plain CPU), and the kernels under TRITON_INTERPRET=1 (see
``tests/interpreted.py``): with S > 1 splits a row's bits do not depend on M nor on the schedule (the splits as
separate programs summed through the workspace, or one program walking them), S = 1 gives the bits of the kernel
before split-K (``unsplit_exact_gemm.py``), and the results stay within a rigorous error bound of the reference.

As in test_exact_interpret.py, the bitwise checks keep each compared row at the same position of its 64-row tile
(rows 0..M-1 of a larger batch): the interpreter's ``tl.dot`` is numpy's sgemm, whose bits for a row may depend on
its position in the tile; the GPU's MMA does not, and test_exact_gpu.py checks the 8B shapes there."""

import importlib.util

import pytest

from interpreted import run_interpreted
from jetrl.quant.kernels import tuning

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                reason="triton is not installed (pip install triton) ")

_CHILD = r'''
import json, sys
import torch
sys.path.insert(0, "tests/exact")
from unsplit_exact_gemm import unsplit_gemm
from jetrl.quant import ACT, WEIGHT, quantize_tensor
from jetrl.quant import reference as R
from jetrl.quant.kernels import gemm_exact_triton as E, tuning

out = {}
g = torch.Generator().manual_seed(0)
ROWS = (1, 3, 64, 130)
FULL = 136  # 3 row tiles; with exact_split_max_m = 128 (set below; the default is 256) M = 1, 3, 64 run the splits
            # as separate programs (workspace + reduction), M = 130 and 136 one program per tile walking its splits

def cases(name, fn, ref, k, splits_list, bound):
    """fn(m, over, tiles) -> the first m rows through the kernel under tuning.override(**over), launched with
    ``tiles`` (E.ExactTiles; default E.EXACT_TILES)."""
    with tuning.override(exact_split_k=1):
        s1 = fn(FULL, {})
    out[f"{name}-s1-equals-unsplit"] = bool(torch.equal(s1, ref))
    for splits in splits_list:
        over = dict(exact_split_k=splits, exact_split_max_m=128)
        with tuning.override(**over):
            cfg = E.exact_config(8, k)
        out[f"{name}-s{splits}-config"] = cfg.split_k == splits
        full = fn(FULL, over)
        out[f"{name}-s{splits}-rows-bitwise"] = all(bool(torch.equal(fn(m, over), full[:m])) for m in ROWS)
        # both schedules at the same M: all separate programs vs one program per tile (``full``, M > 128)
        across = fn(FULL, dict(over, exact_split_max_m=FULL))
        out[f"{name}-s{splits}-schedules-bitwise"] = bool(torch.equal(across, full))
        if full.dtype == torch.float32:  # the split is taken: another summation order changes some last bits
            out[f"{name}-s{splits}-differs-from-s1"] = not torch.equal(full, s1)
        out[f"{name}-s{splits}-close"] = bool(((full.double() - R_ref[name]).abs() <= bound(splits)).all())
        if splits == splits_list[0]:  # the wide schedule's larger tiles (bitwise: the GPU's claim, test_exact_gpu.py)
            wide = fn(FULL, dict(over, exact_wide_min_m=FULL),
                      E.ExactTiles(wide_block_m=128, wide_block_n=64, wide_mm_block_n=64, wide_num_warps=8,
                                   wide_num_stages=2))
            out[f"{name}-wide"] = bool(((wide.double() - R_ref[name]).abs() <= bound(splits)).all())

R_ref = {}

# FP8 blockwise: K = 700 (6 blocks of 128, the last one 60 wide) against 128x128 weight scales, split in 2 (3 + 3
# blocks) and 3 (2 + 2 + 2); K = 640 against 1x128 scales (the WGrad layout), split in 2 (3 + 2) and 3 (2 + 2 + 1).
# Every case has a split of at least 2 blocks after the first: with one block per split the sum of the partials
# is the unsplit order again
for name, n, k, rows_b, splits_list in (("fp8-w", 192, 700, 128, (2, 3)), ("fp8-a", 96, 640, 1, (2, 3))):
    x = torch.randn(FULL, k, generator=g)
    qx = quantize_tensor(x, ACT)
    qw = quantize_tensor(torch.randn(n, k, generator=g), WEIGHT if rows_b == 128 else ACT)
    def fn(m, over, tiles=E.EXACT_TILES, qx=qx, qw=qw, rows_b=rows_b):
        with tuning.override(**over):
            return E.exact_fp8_gemm(qx.data[:m], qx.scale[:m], qw.data, qw.scale, rows_b, torch.float32,
                                    tiles=tiles)
    ref = unsplit_gemm(qx.data, qw.data, qx.scale, qw.scale, rows_b, torch.float32)
    R_ref[name] = R.gemm_exact(qx, qw, torch.float32).double()
    mag = (qx.dequantize().double().abs() @ qw.dequantize().double().abs().t())
    # every partial, each block's scale product and the sums of partials round at most k + S + 2 times along an
    # element's path, each by at most 2^-24 of sum |a||b|; the fp32 reference at most k + 2 times
    cases(name, fn, ref, k, splits_list, lambda s, mag=mag, k=k: (2 * k + s + 4) * 2.0 ** -24 * mag + 1e-30)

# 16/32-bit: K = 600 (5 blocks of 128 = 10 blocks of 64, the last one 24 wide), split in 2 (3 + 2 blocks of 128)
# and 5 (one each); fp16 operands are upcast by the interpreter's dot, so fp32 accumulation holds for both
for dtype in (torch.float32, torch.float16):
    name = f"mm-{dtype}"
    x = torch.randn(FULL, 600, generator=g).to(dtype)
    w = torch.randn(80, 600, generator=g).to(dtype)
    def fn(m, over, tiles=E.EXACT_TILES, x=x, w=w):
        with tuning.override(**over):
            return E.exact_matmul(x[:m], w, tiles=tiles)
    ref = unsplit_gemm(x, w)
    R_ref[name] = x.double() @ w.double().t()
    mag = x.double().abs() @ w.double().abs().t()
    # fp32 sums as above, plus the fp16 output's rounding (2^-11 relative) and fp16's subnormal spacing
    tol = (lambda s, mag=mag: (2 * 600 + s + 4) * 2.0 ** -24 * mag) if dtype == torch.float32 else \
          (lambda s, mag=mag, r=R_ref[name]: (2 * 600 + s + 4) * 2.0 ** -24 * mag + 2.0 ** -11 * r.abs() + 2.0 ** -24)
    cases(name, fn, ref, 600, (2, 5), tol)
json.dump(out, sys.stdout)
'''


@pytest.fixture(scope="module")
def interpreted():
    return run_interpreted(_CHILD, "exact split-K kernels", timeout=900)


CASES = ("fp8-w", "fp8-a", "mm-torch.float32", "mm-torch.float16")


@pytest.mark.parametrize("case", CASES)
def test_exact_gemm_one_split_is_the_unsplit_kernel(interpreted, case):
    assert interpreted[f"{case}-s1-equals-unsplit"]


@pytest.mark.parametrize("what", ["config", "rows-bitwise", "schedules-bitwise", "differs-from-s1", "close",
                                  "wide"])
def test_exact_gemm_split_k(interpreted, what):
    """Per case and split count: the config has the split asked for, rows of M = 1, 3, 64, 130 equal the first
    rows of M = 136 bitwise (across both schedules), both schedules agree at one M, the split changes some fp32
    bits (so it ran), and the result is within the error bound of the reference, also with the wide schedule's
    128-row tiles."""
    results = {k: v for k, v in interpreted.items() if k.endswith(f"-{what}")}
    if what == "wide":  # one split per case
        assert len(results) == len(CASES) and all(results.values()), results
        return

    # fp16 outputs round the last fp32 bits away, so only the fp32 outputs show that the split changed them
    assert len(results) == 2 * (len(CASES) - (what == "differs-from-s1")) and all(results.values()), results


def test_exact_split_heuristic_at_8b_shapes():
    """The fixed rule (tuning.EXACT_SPLIT_RULE): ceil(N / tile) * S reaches the 112 programs where K allows it,
    S <= 8, at least 28 K blocks per split (only long K splits: the 8B model's down projection); never a function
    of M (the method takes no M). A rule of 4 K blocks per split (the earlier default) splits the short-K weights
    too."""
    assert tuning.current().exact_split_k == 0  # the heuristic is the default
    t = tuning.current()
    expected = {(4096, 4096): 1, (1024, 4096): 1, (6144, 4096): 1, (14336, 4096): 1, (28672, 4096): 1,
                (4096, 14336): 4, (128256, 4096): 1, (4096, 1024): 1, (1024, 512): 1, (4096, 100): 1,
                (1536, 8960): 2, (8960, 1536): 1}
    assert {shape: t.exact_split(*shape) for shape in expected} == expected
    assert tuning.EXACT_SPLIT_RULE == tuning.ExactSplitRule(programs=112, max_split=8, min_kb_per_split=28,
                                                            block_n=128, narrow_block_n=64, narrow_n=1024)
    rule = tuning.ExactSplitRule(min_kb_per_split=4)
    expected = {(4096, 4096): 4, (1024, 4096): 8, (6144, 4096): 4, (14336, 4096): 1, (4096, 14336): 4,
                (4096, 1024): 2}
    assert {shape: t.exact_split(*shape, rule) for shape in expected} == expected


def test_exact_on_cublas_only_from_its_rows_and_only_unsplit():
    """cuBLAS's schedule (``exact_cublas_min_m``) takes an exact FP8 GEMM from that many rows on, and only where the
    weight's K is walked in one range: cuBLAS has no split to match. 0 turns it off."""
    t = tuning.current()
    assert t.exact_cublas_min_m == 65  # past the decode schedule's rows (exact_decode_max_m)
    assert t.exact_on_cublas(65, 28672, 4096) and t.exact_on_cublas(8192, 128256, 4096)
    assert not t.exact_on_cublas(64, 28672, 4096)  # decode-sized: the decode kernel
    assert not t.exact_on_cublas(8192, 4096, 14336)  # S = 4
    assert t.exact_on_cublas(8192, 14336, 4096) and t.exact_on_cublas(8192, 4096, 4096)  # S = 1
    with tuning.override(exact_split_k=1):
        assert tuning.current().exact_on_cublas(8192, 4096, 14336)
    with tuning.override(exact_cublas_min_m=0):
        assert not tuning.current().exact_on_cublas(8192, 28672, 4096)
    with pytest.raises(ValueError, match="exact_cublas_min_m"):
        tuning.KernelTuning(exact_cublas_min_m=-1)


def test_exact_decode_config_is_the_decode_tiles_at_the_exact_split():
    """``exact_decode_max_m`` (64 by default): up to that many rows exact mode's FP8 GEMM runs the decode kernel
    with the tiles it would run in fast mode, exact mode's K split (never the decode policy's, which follows M), the
    fast config's K blocks per loop trip only where they divide a split's blocks (else the decode kernel would round
    the split's boundaries); weights that share an input run as one launch only if their splits agree; above the
    bound, or at 0, the schedule is off."""
    pytest.importorskip("triton")
    from jetrl.quant.kernels import gemm_exact_triton as E
    from jetrl.quant.kernels.gemm_decode_triton import split_blocks

    t = tuning.current()
    assert t.exact_decode_max_m == 64
    unrolled = set()
    for m in (1, 17, 33, 64):
        for widths, k in (((4096,), 4096), ((1024,), 4096), ((14336,), 4096), ((4096,), 14336),
                          ((14336, 14336), 4096), ((1024, 1024), 4096), ((4096,), 14464)):
            cfg = t.exact_decode_config(m, widths, k, sm_count=132)
            tiles = t.decode_config(m, sum(widths), k, 132, grouped=len(widths) > 1)
            exact = E.exact_config(widths[0], k)  # the exact kernel's split: the bits the decode kernel must keep
            assert cfg.split_k == exact.split_k == t.exact_split(widths[0], k), (m, widths, cfg)
            # the decode kernel's own split of K (whole unrolled loop trips) lands on the exact kernel's boundaries
            assert split_blocks(-(-k // 128), cfg.split_k, cfg.k_unroll) == (exact.split_kb, exact.split_k), cfg
            assert cfg.k_unroll in (tiles.k_unroll, 1), (m, widths, cfg)
            unrolled.add(cfg.k_unroll)
            assert (cfg.block_n, cfg.num_warps, cfg.num_stages, cfg.block_m, cfg.tma) == \
                (tiles.block_n, tiles.num_warps, tiles.num_stages, tiles.block_m, tiles.tma)
    assert unrolled == {1, 2}  # the 8B down projection keeps its fast config's unroll
    # the split is the weight's, whatever the row count and the device's SMs
    assert {t.exact_decode_config(m, (4096,), 14336, sm).split_k for m in (1, 64) for sm in (78, 132)} == {4}
    assert t.exact_decode_config(64, (4096, 1024, 1024), 4096, 132).split_k == 1  # q/k/v in one launch
    assert [t.exact_split(n, 14336) for n in (4096, 28672)] == [4, 1]  # splits that differ: no grouped launch
    assert t.exact_decode_config(64, (4096, 28672), 14336, 132) is None
    assert t.exact_decode_config(65, (4096,), 4096, 132) is None
    assert t.exact_decode_config(64, (), 4096, 132) is None
    with tuning.override(exact_decode_max_m=0):
        assert tuning.current().exact_decode_config(1, (4096,), 4096, 132) is None
    with tuning.override(exact_decode_max_m=256):
        assert tuning.current().exact_decode_config(256, (4096,), 14336, 132).split_k == 4
    for bad in (-1, 257, True):
        with pytest.raises(ValueError, match="exact_decode_max_m"):
            tuning.KernelTuning(exact_decode_max_m=bad)


@pytest.mark.parametrize("forced", [0, 1, 2, 3, 5, 8, 64])
def test_exact_split_holds_whole_k_blocks_and_none_is_empty(forced):
    with tuning.override(exact_split_k=forced):
        t = tuning.current()
        for n in (64, 1000, 4096, 30000):
            for k in (1, 127, 128, 129, 300, 700, 1024, 4000, 4096, 14336):
                s = t.exact_split(n, k)
                kb = -(-k // 128)
                per = -(-kb // s)
                assert 1 <= s <= max(1, min(kb, forced or tuning.EXACT_SPLIT_RULE.max_split)), (n, k, s)
                assert (s - 1) * per < kb <= s * per, (n, k, s)  # s ranges of `per` whole blocks, none empty
                if forced:
                    assert s == -(-kb // -(-kb // min(forced, kb))), (n, k, s)


def test_exact_split_settings_are_checked():
    for bad in (dict(max_split=3), dict(block_n=96), dict(narrow_block_n=0), dict(min_kb_per_split=-1),
                dict(programs=True)):
        with pytest.raises(ValueError, match="ExactSplitRule"):
            tuning.ExactSplitRule(**bad)
    for bad in (dict(exact_split_k=-1), dict(exact_split_max_m=-1), dict(exact_wide_min_m=-1)):
        with pytest.raises(ValueError, match=next(iter(bad))):
            tuning.KernelTuning(**bad)


def test_exact_gemm_path_routes_by_rows_and_blocks():
    """The CUDA backend's route for exact mode's FP8 GEMM (plain CPU tensors: only the choice is checked here;
    the kernels' equal bits are GPU tests): decode-sized rows to the decode kernel, the rest to the exact kernel
    where cuBLAS is not there (it is not on a CPU), 1x128 right operands always to the exact kernel."""
    import torch

    from jetrl.quant import ACT, WEIGHT, quantize_tensor
    from jetrl.quant.kernels.cuda_backend import exact_gemm_path

    g = torch.Generator().manual_seed(3)
    w = quantize_tensor(torch.randn(256, 512, generator=g), WEIGHT)
    x = torch.randn(80, 512, generator=g)
    rows = {m: exact_gemm_path(quantize_tensor(x[:m], ACT), w)[0] for m in (1, 64, 65, 80)}
    assert rows == {1: "decode", 64: "decode", 65: "triton", 80: "triton"}
    assert exact_gemm_path(quantize_tensor(x[:8], ACT), quantize_tensor(torch.randn(256, 512, generator=g), ACT)) \
        == ("triton", None)
    with tuning.override(exact_decode_max_m=0):
        assert exact_gemm_path(quantize_tensor(x[:8], ACT), w)[0] == "triton"
