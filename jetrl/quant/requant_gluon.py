"""Re-quantization 1x128 -> 128x1 in Gluon (Triton with explicit layouts): one thread per output column.

The Triton kernel (:func:`jetrl.quant.triton_kernels.requantize_act_to_token`) lets the compiler choose the
layout of its 128 x 32 tile: threads and warps then share each 128-row column, so every column's reduction
needs shuffles, the per-column scale and reciprocal are computed again by every thread that holds part of
the column, the tile is transposed through shared memory, and each thread keeps 128 values live (about 220
registers, so few warps per SM hide memory latency). On the H200 it reaches about half of copy bandwidth.

Here each thread owns whole columns (``threads_per_warp = [1, 32]``): the 128-row reduction stays in the
thread, the column's scale and reciprocal are computed once, and the thread's quantized column is a run of
contiguous bytes of the transposed output (vector stores, no transpose). The 128 rows are walked in chunks
of ``ROWS`` twice: the first pass finds the column maxima, the second re-reads the (cached) tile and
quantizes it, so only a chunk is live at a time and many warps fit on an SM. The arithmetic is the
reference's, through the same device helpers as the Triton kernels: the same bytes.

Gluon is experimental in Triton; this module imports it lazily (only ``requantize_act_to_token`` touches it).
"""

from __future__ import annotations

import functools

import torch

from jetrl.quant.formats import E4M3
from jetrl.quant.triton_kernels import BLOCK, _cdiv

ROWS_PER_CHUNK = 16  # rows per pass step: 16 bytes per thread per store
NUM_WARPS = 4        # 128 columns per program (one 1x128 source scale block)


@functools.lru_cache(maxsize=None)
def _kernel():
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl

    from jetrl.quant.triton_kernels import _block_scale, _recip_scale, _to_e4m3_recip

    @gluon.jit
    def requant_columns_kernel(q_ptr, M, K, stride_qm, s_ptr, stride_sm, stride_sk, tok_ptr, tok_scale_ptr,
                               POW2: gl.constexpr, ROWS: gl.constexpr, WARPS: gl.constexpr):
        layout: gl.constexpr = gl.BlockedLayout(size_per_thread=[ROWS, 1], threads_per_warp=[1, 32],
                                                warps_per_cta=[1, WARPS], order=[0, 1])
        cols: gl.constexpr = gl.SliceLayout(0, layout)
        rows: gl.constexpr = gl.SliceLayout(1, layout)
        BK: gl.constexpr = 32 * WARPS
        pid_m = gl.program_id(0)
        pid_k = gl.program_id(1)
        rk = pid_k * BK + gl.arange(0, BK, layout=cols)
        k_ok = rk < K
        kb = (pid_k * BK) // 128  # BK divides 128: one 1x128 source scale per row for the whole tile
        amax = gl.zeros([BK], gl.float32, layout=cols)
        for c in range(0, 128, ROWS):  # pass 1: the column maxima of the dequantized tile
            rm = pid_m * 128 + c + gl.arange(0, ROWS, layout=rows)
            mask = (rm[:, None] < M) & k_ok[None, :]
            q = gl.load(q_ptr + rm[:, None].to(gl.int64) * stride_qm + rk[None, :], mask=mask, other=0.0)
            s = gl.load(s_ptr + rm * stride_sm + kb * stride_sk, mask=rm < M, other=0.0)
            x = gl.where(mask, q.to(gl.float32) * s[:, None], 0.0)
            amax = gl.maximum(amax, gl.max(gl.abs(x), axis=0))
        scale = _block_scale(amax, POW2, True)  # one per thread: its own column
        recip, scale_r = _recip_scale(scale)
        gl.store(tok_scale_ptr + pid_m * K + rk, scale, mask=k_ok)
        for c in range(0, 128, ROWS):  # pass 2: quantize, each thread writing a run of its output row
            rm = pid_m * 128 + c + gl.arange(0, ROWS, layout=rows)
            mask = (rm[:, None] < M) & k_ok[None, :]
            q = gl.load(q_ptr + rm[:, None].to(gl.int64) * stride_qm + rk[None, :], mask=mask, other=0.0)
            s = gl.load(s_ptr + rm * stride_sm + kb * stride_sk, mask=rm < M, other=0.0)
            x = gl.where(mask, q.to(gl.float32) * s[:, None], 0.0)
            y = _to_e4m3_recip(x, recip[None, :], scale_r[None, :], POW2)
            gl.store(tok_ptr + rk[None, :].to(gl.int64) * M + rm[:, None], y, mask=mask)

    return requant_columns_kernel


def requantize_act_to_token(data: torch.Tensor, scale: torch.Tensor, pow2_scale: bool = False,
                            rows_per_chunk: int | None = None, num_warps: int | None = None):
    """Same contract and bytes as :func:`jetrl.quant.triton_kernels.requantize_act_to_token`: 1x128 FP8
    (data (M, K) with unit column stride, scale (M, Kb)) to 128x1. Returns the (M, K) view of a row-major
    (K, M) data buffer and (Mb, K) row-major scales."""
    m, k = data.shape
    if m and k and data.stride(1) != 1:
        raise ValueError(f"the Gluon requant kernel needs rows with unit stride, got strides {data.stride()}")
    rows = rows_per_chunk or ROWS_PER_CHUNK
    warps = num_warps or NUM_WARPS
    if BLOCK % rows or warps not in (1, 2, 4):
        raise ValueError(f"rows_per_chunk must divide {BLOCK} and num_warps be 1, 2 or 4, got {rows}, {warps}")
    tok = torch.empty((k, m), dtype=E4M3, device=data.device)
    tok_scale = torch.empty((_cdiv(m, BLOCK), k), dtype=torch.float32, device=data.device)
    if m and k:
        grid = (_cdiv(m, BLOCK), _cdiv(k, 32 * warps))
        _kernel()[grid](data, m, k, data.stride(0), scale, scale.stride(0), scale.stride(1), tok, tok_scale,
                        POW2=pow2_scale, ROWS=rows, WARPS=warps, num_warps=warps)
    return tok.t(), tok_scale
