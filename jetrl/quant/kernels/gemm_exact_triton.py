"""Exact mode's batch-invariant GEMMs in Triton: blockwise FP8 ``a @ b.T`` and 16/32-bit ``x @ w.T``.

The CUDA backend's ``gemm_exact`` and ``matmul_exact`` (see :mod:`jetrl.quant.exact`). A row's result must
not depend on M, so everything that decides a row's *arithmetic* is fixed per weight shape (N, K):

* one K block width (128 on the FP8 path, 64 on the 16/32-bit one) and one tile configuration per (N, K)
  (:func:`exact_config`, never a function of M);
* one K split per (N, K) (:meth:`~jetrl.quant.kernels.tuning.KernelTuning.exact_split`, from a fixed program count,
  :class:`~jetrl.quant.kernels.tuning.ExactSplitRule`; ``exact_split_k=1`` forces the single walk): S contiguous
  ranges of whole 128-wide K blocks, each range's partial accumulated in fp32 from zero, its K blocks walked in
  order, the S partials summed in the fixed order ``((p_0 + p_1) + p_2) + ...`` and cast once. No atomics, no
  stream-K: nothing depends on which program finishes first;
* the FP8 path applies the scales exactly as the blockwise GEMM does (``acc += dot(a_k, b_k) * (sa * sb)``
  per 128-wide K block); the 16/32-bit path accumulates ``dot(x_k, w_k)`` over 64-wide K blocks in fp32
  (fp32 inputs with IEEE products, not TF32);
* M is not specialised on (``do_not_specialize``), so M = 1, 16 or 8192 run the same compiled kernels.

Only the *schedule* may follow M, because it does not change a bit: up to ``exact_split_max_m`` rows (decode, where
N / BLOCK_N tiles alone leave most SMs idle) program (tile, split) writes its range's partial to an fp32 workspace
(S, M, N), and a small second kernel sums the S planes in order; above it (where the row tiles fill the GPU and the
workspace would cost more traffic than the weight) one program per tile walks its S ranges itself, adding each
partial to its running total in the same order. Both run the same partial code (:func:`_k_range_partial`), store
the partials exactly (fp32) and add them in the same order, so they give the same bits; with S = 1 the kernel is the
single in-order walk. From ``exact_wide_min_m`` rows on the walking schedule takes wide tiles (:class:`ExactTiles`'
``wide_*``; fp32 operands keep the small ones), or on the FP8 path the decode-sized tiles loaded through TMA where
the layouts allow (:func:`_launch_tma`; the tuning's ``ExactSchedule`` says why either keeps the bits).

Within a tile, ``tl.dot`` computes each output row from that row's operands only (the MMA instructions
reduce along K per row, whatever the instruction's M and N extent or the warps sharing the tile), so a row's bits
are independent of its tile neighbours and of the tile's size. (The Triton interpreter's ``tl.dot`` is numpy's
sgemm, which does not promise that; the tile-size claim is checked on the GPU.) A different S is a different
summation order, so the rollout and the trainer must run the same split; both compute it per weight shape. The
launch's tiles, warps and stages are :data:`EXACT_TILES`, or the :class:`ExactTiles` a caller passes (the tests and
``bench/kernels.py`` run others: the same bits).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from jetrl.quant.kernels import tuning
from jetrl.quant.kernels.gemm_triton import grouped_tile
from jetrl.quant.kernels.quantize_triton import BLOCK, _cdiv
from jetrl.quant.kernels.tuning import COMPILE_OPTIONS


@triton.jit
def _k_range_partial(a_ptr, b_ptr, as_ptr, bs_ptr, rm, rn, m_ok, n_ok, K, kb_start, kb_end,
                     stride_am, stride_ak, stride_bn, stride_bk, stride_asm, stride_ask, stride_bsn, stride_bsk,
                     BLOCK_K: tl.constexpr, FP8: tl.constexpr, B_SCALE_ROWS: tl.constexpr, IEEE: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """One tile's fp32 partial over K blocks ``kb_start .. kb_end - 1``, walked in order from zero; with ``FP8``,
    per-128-K-block scales: ``acc += dot(a_k, b_k) * (sa_k * sb_k)``. Every schedule calls this same code."""
    rk = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + rm[:, None].to(tl.int64) * stride_am + (kb_start * BLOCK_K + rk[None, :]) * stride_ak
    b_ptrs = b_ptr + rn[None, :].to(tl.int64) * stride_bn + (kb_start * BLOCK_K + rk[:, None]) * stride_bk
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kb in range(kb_start, kb_end):
        k_ok = rk < K - kb * BLOCK_K
        a = tl.load(a_ptrs, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        if FP8:
            sa = tl.load(as_ptr + rm * stride_asm + kb * stride_ask, mask=m_ok, other=0.0)
            sb = tl.load(bs_ptr + (rn // B_SCALE_ROWS) * stride_bsn + kb * stride_bsk, mask=n_ok, other=0.0)
            acc += tl.dot(a, b) * (sa[:, None] * sb[None, :])
        elif IEEE:
            acc = tl.dot(a, b, acc, input_precision="ieee")
        else:
            acc = tl.dot(a, b, acc)
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk
    return acc


@triton.jit(do_not_specialize=["M"], do_not_specialize_on_alignment=["stride_ask"])
def _exact_gemm_kernel(
    a_ptr, b_ptr, c_ptr, ws_ptr, as_ptr, bs_ptr,
    M, N, K,
    stride_am, stride_ak, stride_bn, stride_bk, stride_cm, stride_cn,
    stride_asm, stride_ask, stride_bsn, stride_bsk,
    NUM_KB: tl.constexpr, SPLIT_KB: tl.constexpr, SPLITS: tl.constexpr, ACROSS: tl.constexpr,
    BLOCK_K: tl.constexpr, FP8: tl.constexpr, B_SCALE_ROWS: tl.constexpr,
    IEEE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr,
):
    """C = A @ B^T over ``SPLITS`` contiguous ranges of ``SPLIT_KB`` K blocks, summed in order 0..SPLITS-1.

    ``ACROSS``: program (tile, split) writes its range's fp32 partial to the workspace ``ws`` (SPLITS, M, N), and
    :func:`_exact_reduce_kernel` sums them; otherwise the program walks all ranges of its tile itself and adds
    each partial to the running total in the same order (one split: the single in-order walk, as before split-K)."""
    pid_m, pid_n = grouped_tile(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)

    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = rm < M
    n_ok = rn < N
    mn_ok = m_ok[:, None] & n_ok[None, :]
    if ACROSS:
        split = tl.program_id(1)
        part = _k_range_partial(a_ptr, b_ptr, as_ptr, bs_ptr, rm, rn, m_ok, n_ok, K, split * SPLIT_KB,
                                tl.minimum(split * SPLIT_KB + SPLIT_KB, NUM_KB),
                                stride_am, stride_ak, stride_bn, stride_bk, stride_asm, stride_ask, stride_bsn,
                                stride_bsk, BLOCK_K, FP8, B_SCALE_ROWS, IEEE, BLOCK_M, BLOCK_N)
        plane = split.to(tl.int64) * M * N
        tl.store(ws_ptr + plane + rm[:, None].to(tl.int64) * N + rn[None, :], part, mask=mn_ok)
    else:
        total = _k_range_partial(a_ptr, b_ptr, as_ptr, bs_ptr, rm, rn, m_ok, n_ok, K, 0, SPLIT_KB,
                                 stride_am, stride_ak, stride_bn, stride_bk, stride_asm, stride_ask, stride_bsn,
                                 stride_bsk, BLOCK_K, FP8, B_SCALE_ROWS, IEEE, BLOCK_M, BLOCK_N)
        for split in range(1, SPLITS):
            total += _k_range_partial(a_ptr, b_ptr, as_ptr, bs_ptr, rm, rn, m_ok, n_ok, K, split * SPLIT_KB,
                                      tl.minimum(split * SPLIT_KB + SPLIT_KB, NUM_KB),
                                      stride_am, stride_ak, stride_bn, stride_bk, stride_asm, stride_ask,
                                      stride_bsn, stride_bsk, BLOCK_K, FP8, B_SCALE_ROWS, IEEE, BLOCK_M, BLOCK_N)
        tl.store(c_ptr + rm[:, None].to(tl.int64) * stride_cm + rn[None, :] * stride_cn,
                 total.to(c_ptr.dtype.element_ty), mask=mn_ok)


@triton.jit
def _k_range_partial_tma(a_desc, b_desc, as_ptr, bs_ptr, rm, rn, m_ok, n_ok, m0, n0, kb_start, kb_end,
                         stride_asm, stride_ask, stride_bsn, stride_bsk,
                         B_SCALE_ROWS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                         ROW_SCALE: tl.constexpr):
    """:func:`_k_range_partial` with the operands' tiles loaded through TMA descriptors (zero-filled past the
    edges, as the masked loads are): the same K blocks in the same order, the same ``acc += dot * (sa * sb)``.

    ``ROW_SCALE`` (the tile's columns inside one 128-row weight scale block): ``sb`` is one value per K block, so
    ``sa * sb`` is a per-row factor, each product the same fp32 ``sa[m] * sb`` as the outer product's: the same
    ``acc += dot * s`` per element with BLOCK_M multiplies per K block instead of BLOCK_M x BLOCK_N."""
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kb in range(kb_start, kb_end):
        a = a_desc.load([m0, kb * 128])
        b = b_desc.load([n0, kb * 128])
        sa = tl.load(as_ptr + rm * stride_asm + kb * stride_ask, mask=m_ok, other=0.0)
        if ROW_SCALE:
            sb1 = tl.load(bs_ptr + (n0 // B_SCALE_ROWS) * stride_bsn + kb * stride_bsk)
            acc += tl.dot(a, tl.trans(b)) * (sa * sb1)[:, None]
        else:
            sb = tl.load(bs_ptr + (rn // B_SCALE_ROWS) * stride_bsn + kb * stride_bsk, mask=n_ok, other=0.0)
            acc += tl.dot(a, tl.trans(b)) * (sa[:, None] * sb[None, :])
    return acc


@triton.jit(do_not_specialize=["M"], do_not_specialize_on_alignment=["stride_ask"])
def _exact_gemm_tma_kernel(a_desc, b_desc, c_ptr, as_ptr, bs_ptr, M, N,
                           stride_cm, stride_cn, stride_asm, stride_ask, stride_bsn, stride_bsk,
                           NUM_KB: tl.constexpr, SPLIT_KB: tl.constexpr, SPLITS: tl.constexpr,
                           B_SCALE_ROWS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                           GROUP_M: tl.constexpr, ROW_SCALE: tl.constexpr):
    """The walking schedule of :func:`_exact_gemm_kernel` (FP8, one program per output tile adding its ranges'
    partials in order) with TMA loads: the pointer tensors of the plain kernel do not occupy registers, so
    64-row tiles of 4 warps run two programs per SM."""
    pid_m, pid_n = grouped_tile(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
    m0 = pid_m * BLOCK_M
    n0 = pid_n * BLOCK_N
    rm = m0 + tl.arange(0, BLOCK_M)
    rn = n0 + tl.arange(0, BLOCK_N)
    m_ok = rm < M
    n_ok = rn < N
    total = _k_range_partial_tma(a_desc, b_desc, as_ptr, bs_ptr, rm, rn, m_ok, n_ok, m0, n0, 0, SPLIT_KB,
                                 stride_asm, stride_ask, stride_bsn, stride_bsk, B_SCALE_ROWS, BLOCK_M, BLOCK_N,
                                 ROW_SCALE)
    for split in range(1, SPLITS):
        total += _k_range_partial_tma(a_desc, b_desc, as_ptr, bs_ptr, rm, rn, m_ok, n_ok, m0, n0, split * SPLIT_KB,
                                      tl.minimum(split * SPLIT_KB + SPLIT_KB, NUM_KB), stride_asm, stride_ask,
                                      stride_bsn, stride_bsk, B_SCALE_ROWS, BLOCK_M, BLOCK_N, ROW_SCALE)
    tl.store(c_ptr + rm[:, None].to(tl.int64) * stride_cm + rn[None, :] * stride_cn,
             total.to(c_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


@triton.jit(do_not_specialize=["M"])
def _exact_reduce_kernel(ws_ptr, c_ptr, M, N, stride_cm, stride_cn, SPLITS: tl.constexpr, BLOCK_M: tl.constexpr,
                         BLOCK_N: tl.constexpr):
    """C = cast(((p_0 + p_1) + p_2) + ... + p_{SPLITS-1}) per element, p_s the workspace's fp32 planes."""
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mn_ok = (rm < M)[:, None] & (rn < N)[None, :]
    offs = rm[:, None].to(tl.int64) * N + rn[None, :]
    total = tl.load(ws_ptr + offs, mask=mn_ok, other=0.0)
    for split in tl.static_range(1, SPLITS):
        total += tl.load(ws_ptr + split * M.to(tl.int64) * N + offs, mask=mn_ok, other=0.0)
    tl.store(c_ptr + rm[:, None].to(tl.int64) * stride_cm + rn[None, :] * stride_cn,
             total.to(c_ptr.dtype.element_ty), mask=mn_ok)


@dataclass(frozen=True)
class ExactTiles:
    """The launch of exact mode's GEMM besides its N tiles (:class:`~jetrl.quant.kernels.tuning.ExactSplitRule`):
    a schedule, any values give the same bits (module doc)."""

    block_m: int = 64  # tile rows (decode-sized: they bound decode's padding waste)
    num_warps: int = 4  # warps of those tiles
    num_stages: int = 3  # their pipeline stages
    wide_block_m: int = 128  # tile rows of the walking schedule's plain kernel from exact_wide_min_m rows on
    wide_block_n: int = 128  # its tile columns on the FP8 path
    wide_mm_block_n: int = 256  # its tile columns on the 16/32-bit path (the LM head)
    wide_num_warps: int = 8  # its warps
    wide_num_stages: int = 3  # its pipeline stages


EXACT_TILES = ExactTiles()


@dataclass(frozen=True)
class ExactGemmConfig:
    """The tile configuration and K split of an exact GEMM for a weight shape (never chosen by M).

    ``split_k`` contiguous K ranges of ``split_kb`` 128-wide K blocks each (the last one the rest)."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    group_m: int = 8
    split_k: int = 1
    split_kb: int = 0


def exact_config(n: int, k: int, tiles: ExactTiles = EXACT_TILES) -> ExactGemmConfig:
    """The configuration for an (N, K) weight: the decode-sized tiles of ``tiles``, the N tile of
    :data:`~jetrl.quant.kernels.tuning.EXACT_SPLIT_RULE` (narrower for narrow weights: more programs), and the K
    split of :meth:`~jetrl.quant.kernels.tuning.KernelTuning.exact_split`."""
    t = tuning.current()
    return ExactGemmConfig(tiles.block_m, tuning.EXACT_SPLIT_RULE.tile_n(n), tiles.num_warps, tiles.num_stages,
                           split_k=t.exact_split(n, k), split_kb=t.exact_split_kb(n, k))


_REDUCE_BLOCK_M, _REDUCE_BLOCK_N = 32, 128


def _launch(a, b, a_scale, b_scale, out, fp8: bool, b_scale_rows: int, tiles: ExactTiles) -> torch.Tensor:
    m, k = a.shape
    n = b.shape[0]
    if m == 0 or n == 0:
        return out
    if k == 0:
        return out.zero_()
    cfg = exact_config(n, k, tiles)
    block_k = BLOCK if fp8 else 64
    num_kb = _cdiv(k, block_k)
    # K blocks per split in this path's blocks (64-wide without FP8): at most num_kb, the last split the rest
    split_kb = cfg.split_kb * (BLOCK // block_k) if cfg.split_k > 1 else num_kb
    t = tuning.current()
    across = cfg.split_k > 1 and m <= t.exact_split_max_m
    wide = not across and t.exact_wide_min_m and m >= t.exact_wide_min_m  # a schedule, the same bits (module doc)
    if wide and fp8 and _tma_ok(a) and _tma_ok(b):
        return _launch_tma(a, b, a_scale, b_scale, out, b_scale_rows, cfg, num_kb, split_kb)
    block_m, block_n, warps, stages = cfg.block_m, cfg.block_n, cfg.num_warps, cfg.num_stages
    if wide and a.dtype != torch.float32:  # fp32 operands (tests): wide tiles would not fit in shared memory
        block_m, block_n = tiles.wide_block_m, tiles.wide_block_n if fp8 else tiles.wide_mm_block_n
        warps, stages = tiles.wide_num_warps, tiles.wide_num_stages
    ws = torch.empty((cfg.split_k, m, n), dtype=torch.float32, device=a.device) if across else out
    scales = (a_scale, b_scale) if fp8 else (out, out)  # unused without FP8
    strides = (a_scale.stride(0), a_scale.stride(1), b_scale.stride(0), b_scale.stride(1)) if fp8 else (0, 0, 0, 0)
    grid_tiles = _cdiv(m, block_m) * _cdiv(n, block_n)
    _exact_gemm_kernel[(grid_tiles, cfg.split_k if across else 1)](
        a, b, out, ws, *scales, m, n, k, *a.stride(), *b.stride(), *out.stride(), *strides,
        NUM_KB=num_kb, SPLIT_KB=split_kb, SPLITS=cfg.split_k, ACROSS=across, BLOCK_K=block_k, FP8=fp8,
        B_SCALE_ROWS=b_scale_rows, IEEE=a.dtype == torch.float32, BLOCK_M=block_m, BLOCK_N=block_n,
        GROUP_M=cfg.group_m, num_warps=warps, num_stages=stages, **COMPILE_OPTIONS)
    if across:
        _exact_reduce_kernel[(_cdiv(m, _REDUCE_BLOCK_M), _cdiv(n, _REDUCE_BLOCK_N))](
            ws, out, m, n, out.stride(0), out.stride(1), SPLITS=cfg.split_k, BLOCK_M=_REDUCE_BLOCK_M,
            BLOCK_N=_REDUCE_BLOCK_N, num_warps=4, **COMPILE_OPTIONS)
    return out


def _tma_ok(t: torch.Tensor) -> bool:
    """TMA reads a row-major 2-D tile source: unit column stride, 16-byte aligned rows and base."""
    return (t.dim() == 2 and t.stride(1) == 1 and (t.stride(0) * t.element_size()) % 16 == 0
            and t.data_ptr() % 16 == 0 and t.shape[1] % 16 == 0)


def _launch_tma(a, b, a_scale, b_scale, out, b_scale_rows: int, cfg: ExactGemmConfig, num_kb: int,
                split_kb: int) -> torch.Tensor:
    """The FP8 walking schedule with TMA loads: the decode-sized tiles of ``cfg``, two programs per SM where the
    plain kernel's wide tiles fit one; a tile whose columns lie in one weight scale block scales by rows."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    m, n = a.shape[0], b.shape[0]
    a_desc = TensorDescriptor.from_tensor(a, [cfg.block_m, BLOCK])
    b_desc = TensorDescriptor.from_tensor(b, [cfg.block_n, BLOCK])
    tiles = _cdiv(m, cfg.block_m) * _cdiv(n, cfg.block_n)
    _exact_gemm_tma_kernel[(tiles,)](
        a_desc, b_desc, out, a_scale, b_scale, m, n, *out.stride(), *a_scale.stride(), *b_scale.stride(),
        NUM_KB=num_kb, SPLIT_KB=split_kb, SPLITS=cfg.split_k, B_SCALE_ROWS=b_scale_rows, BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n, GROUP_M=cfg.group_m, ROW_SCALE=b_scale_rows % cfg.block_n == 0,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **COMPILE_OPTIONS)
    return out


def exact_fp8_gemm(a_data: torch.Tensor, a_scale: torch.Tensor, b_data: torch.Tensor, b_scale: torch.Tensor,
                   b_scale_rows: int, out_dtype: torch.dtype = torch.bfloat16, *,
                   tiles: ExactTiles = EXACT_TILES) -> torch.Tensor:
    """``a @ b.T``: a (M, K) with 1x128 scales (M, Kb), b (N, K) with 128x128 scales (``b_scale_rows=128``) or
    1x128 scales (``b_scale_rows=1``); batch-invariant in M. ``tiles``: the launch (the same bits)."""
    out = torch.empty((a_data.shape[0], b_data.shape[0]), dtype=out_dtype, device=a_data.device)
    return _launch(a_data, b_data, a_scale, b_scale, out, True, b_scale_rows, tiles)


def exact_matmul(x: torch.Tensor, w: torch.Tensor, *, tiles: ExactTiles = EXACT_TILES) -> torch.Tensor:
    """``x @ w.T`` in x's dtype (bf16/fp16: fp32 accumulation; fp32: IEEE products); batch-invariant in M.
    ``tiles``: the launch (the same bits)."""
    if x.dtype not in (torch.bfloat16, torch.float16, torch.float32) or w.dtype != x.dtype:
        raise TypeError(f"exact_matmul: x and w must share a 16/32-bit float dtype, got {x.dtype} and {w.dtype}")
    out = torch.empty((x.shape[0], w.shape[0]), dtype=x.dtype, device=x.device)
    return _launch(x, w, None, None, out, False, 1, tiles)


__all__ = ["exact_fp8_gemm", "exact_matmul", "exact_config", "ExactGemmConfig", "ExactTiles", "EXACT_TILES"]
