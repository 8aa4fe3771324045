"""The blockwise FP8 GEMM in Triton: ``a @ b.T`` with one fp32 scale per 128-wide K block of each operand.

The CUDA backend's GEMM where cuBLAS's blockwise ``scaled_mm`` cannot run (layouts or shapes it rejects, a
GPU other than sm_90) or where ``JETRL_FP8_GEMM=triton`` asks for it. Operands and scales are laid out as
the quantization kernels of :mod:`jetrl.quant.kernels.quantize_triton` write them, any strides accepted.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from jetrl.quant.kernels.quantize_triton import BLOCK, _cdiv
from jetrl.quant.kernels.tuning import COMPILE_OPTIONS


@triton.jit
def grouped_tile(pid, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """(row tile, column tile) of program ``pid`` in grouped order: GROUP_M row tiles walk the column tiles
    together, so neighbouring programs share operand tiles in L2. An order only: no result depends on it."""
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    group = GROUP_M * num_pid_n
    first_m = (pid // group) * GROUP_M
    group_size = tl.minimum(num_pid_m - first_m, GROUP_M)
    return first_m + (pid % group) % group_size, (pid % group) // group_size


@triton.jit(do_not_specialize=["M"], do_not_specialize_on_alignment=["stride_ask"])
def _blockwise_fp8_gemm_kernel(
    a_ptr, b_ptr, c_ptr, as_ptr, bs_ptr,
    M, N, K,
    stride_am, stride_ak, stride_bn, stride_bk, stride_cm, stride_cn,
    stride_asm, stride_ask, stride_bsn, stride_bsk,
    NUM_KB: tl.constexpr,  # ceil(K / 128); a constexpr so the loop bound is known at compile time
    B_SCALE_ROWS: tl.constexpr,  # 128: b has 128x128 blocks; 1: b has 1x128 blocks
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr,
):
    """C = A @ B^T with per-128-K-block scales: ``acc += dot(a_k, b_k) * sa_k * sb_k`` in fp32.

    BLOCK_K is 128 (one scale block); one program owns one output tile and walks all of K in order
    (no split-K, no atomics), so the result is deterministic and independent of the batch size M.
    """
    pid_m, pid_n = grouped_tile(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)

    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, 128)
    a_ptrs = a_ptr + rm[:, None].to(tl.int64) * stride_am + rk[None, :] * stride_ak
    b_ptrs = b_ptr + rn[None, :].to(tl.int64) * stride_bn + rk[:, None] * stride_bk  # (128, BLOCK_N)
    as_ptrs = as_ptr + rm * stride_asm
    bs_ptrs = bs_ptr + (rn // B_SCALE_ROWS) * stride_bsn
    m_ok = rm < M
    n_ok = rn < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kb in range(0, NUM_KB):
        k_ok = rk < K - kb * 128
        a = tl.load(a_ptrs, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        sa = tl.load(as_ptrs + kb * stride_ask, mask=m_ok, other=0.0)
        sb = tl.load(bs_ptrs + kb * stride_bsk, mask=n_ok, other=0.0)
        acc += tl.dot(a, b) * (sa[:, None] * sb[None, :])
        a_ptrs += 128 * stride_ak
        b_ptrs += 128 * stride_bk
    c = acc.to(c_ptr.dtype.element_ty)
    tl.store(c_ptr + rm[:, None].to(tl.int64) * stride_cm + rn[None, :] * stride_cn, c,
             mask=m_ok[:, None] & n_ok[None, :])


@dataclass(frozen=True)
class GemmConfig:
    """A fixed tile configuration of the blockwise GEMM (BLOCK_K is always 128, one scale block)."""

    block_m: int
    block_n: int
    group_m: int = 8
    num_warps: int = 8
    num_stages: int = 3


def default_config(m: int, n: int) -> GemmConfig:
    """Decode-sized M (<= 64): one tile row covers all of M, so the weight is streamed from memory once,
    in narrow column tiles so that every SM streams a share of it; larger M: 128x128 tiles."""
    if m <= 64:
        block_m = max(16, 1 << (m - 1).bit_length())
        return GemmConfig(block_m=block_m, block_n=32 if n <= 8192 else 64, group_m=1, num_warps=4, num_stages=4)
    return GemmConfig(block_m=128, block_n=128)


def blockwise_fp8_gemm(a_data: torch.Tensor, a_scale: torch.Tensor, b_data: torch.Tensor, b_scale: torch.Tensor,
                       b_scale_rows: int, out_dtype: torch.dtype = torch.bfloat16,
                       config: GemmConfig | None = None) -> torch.Tensor:
    """``a @ b.T`` for a (M, K) with 1x128 scales (M, Kb) and b (N, K) with 128x128 scales (Nb, Kb)
    (``b_scale_rows=128``) or 1x128 scales (N, Kb) (``b_scale_rows=1``). Any strides; fp32 accumulation."""
    m, k = a_data.shape
    n = b_data.shape[0]
    out = torch.empty((m, n), dtype=out_dtype, device=a_data.device)
    if m == 0 or n == 0:
        return out
    if k == 0:
        return out.zero_()
    cfg = config or default_config(m, n)
    grid = (_cdiv(m, cfg.block_m) * _cdiv(n, cfg.block_n),)
    _blockwise_fp8_gemm_kernel[grid](
        a_data, b_data, out, a_scale, b_scale, m, n, k, *a_data.stride(), *b_data.stride(), *out.stride(),
        *a_scale.stride(), *b_scale.stride(), NUM_KB=_cdiv(k, BLOCK), B_SCALE_ROWS=b_scale_rows, BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n, GROUP_M=cfg.group_m, num_warps=cfg.num_warps, num_stages=cfg.num_stages, **COMPILE_OPTIONS)
    return out
