"""Exact mode's GEMM kernel as it was before split-K, kept verbatim as the reference the split-K kernel must
reproduce bit for bit with one split (``tuning.override(exact_split_k=1)``): one program per output tile, K walked
in order from block 0 to the last. Test-only; used by test_exact_split_interpret.py and test_exact_gpu.py."""

import torch
import triton
import triton.language as tl

from jetrl.quant.kernels.gemm_exact_triton import exact_config
from jetrl.quant.kernels.quantize_triton import BLOCK, _cdiv


@triton.jit(do_not_specialize=["M"])
def _exact_gemm_kernel(
    a_ptr, b_ptr, c_ptr, as_ptr, bs_ptr,
    M, N, K,
    stride_am, stride_ak, stride_bn, stride_bk, stride_cm, stride_cn,
    stride_asm, stride_ask, stride_bsn, stride_bsk,
    NUM_KB: tl.constexpr, BLOCK_K: tl.constexpr, FP8: tl.constexpr, B_SCALE_ROWS: tl.constexpr,
    IEEE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr,
):
    """C = A @ B^T; with ``FP8``, per-128-K-block scales: ``acc += dot(a_k, b_k) * (sa_k * sb_k)``."""
    pid = tl.program_id(0)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    group = GROUP_M * num_pid_n
    first_m = (pid // group) * GROUP_M
    group_size = tl.minimum(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % group) % group_size
    pid_n = (pid % group) // group_size

    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + rm[:, None].to(tl.int64) * stride_am + rk[None, :] * stride_ak
    b_ptrs = b_ptr + rn[None, :].to(tl.int64) * stride_bn + rk[:, None] * stride_bk  # (BLOCK_K, BLOCK_N)
    m_ok = rm < M
    n_ok = rn < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kb in range(0, NUM_KB):
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
    tl.store(c_ptr + rm[:, None].to(tl.int64) * stride_cm + rn[None, :] * stride_cn, acc.to(c_ptr.dtype.element_ty),
             mask=m_ok[:, None] & n_ok[None, :])


def unsplit_gemm(a, b, a_scale=None, b_scale=None, b_scale_rows=1, out_dtype=None):
    """``a @ b.T`` through the unsplit kernel with the current tiles (``exact_config``'s, its split ignored);
    FP8 when scales are given (``out_dtype`` then defaults to bf16), else in a's dtype."""
    fp8 = a_scale is not None
    m, k = a.shape
    n = b.shape[0]
    out = torch.empty((m, n), dtype=out_dtype or (torch.bfloat16 if fp8 else a.dtype), device=a.device)
    cfg = exact_config(n, k)
    block_k = BLOCK if fp8 else 64
    scales = (a_scale, b_scale) if fp8 else (out, out)
    strides = (a_scale.stride(0), a_scale.stride(1), b_scale.stride(0), b_scale.stride(1)) if fp8 else (0, 0, 0, 0)
    _exact_gemm_kernel[(_cdiv(m, cfg.block_m) * _cdiv(n, cfg.block_n),)](
        a, b, out, *scales, m, n, k,
        a.stride(0), a.stride(1), b.stride(0), b.stride(1), out.stride(0), out.stride(1), *strides,
        NUM_KB=_cdiv(k, block_k), BLOCK_K=block_k, FP8=fp8, B_SCALE_ROWS=b_scale_rows,
        IEEE=a.dtype == torch.float32, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, GROUP_M=cfg.group_m,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return out
