"""The 128x1 quantization kernels in Gluon (Triton with explicit layouts): threads own whole output columns.

Two entry points with the Triton kernels' contracts and bytes: :func:`requantize_act_to_token` (1x128 FP8 ->
128x1, WGrad's saved activation) and :func:`quantize_token_128x1` (a BF16 tensor -> 128x1, WGrad's grad_out).

The Triton kernel (:func:`jetrl.quant.triton_kernels.requantize_act_to_token`) lets the compiler choose the
layout of its 128 x 32 tile: threads and warps then share each 128-row column, so every column's reduction
needs shuffles, the per-column scale and reciprocal are computed again by every thread that holds part of
the column, the tile is transposed through shared memory, and each thread keeps 128 values live (about 220
registers, so few warps per SM hide memory latency). On the H200 it reaches about half of copy bandwidth.

Here each thread owns whole columns (``threads_per_warp = [1, 32]``, ``COLS`` adjacent columns per thread,
read with one vector load per row): the 128-row reduction stays in the thread, each column's scale and
reciprocal are computed once, and the thread's quantized columns are runs of contiguous bytes of the
transposed output (vector stores after a reordering of the thread's own registers, no transpose). The 128
rows are walked in chunks of ``ROWS`` twice: the first pass finds the column maxima, the second re-reads
the (cached) tile and quantizes it, so only a chunk is live at a time and many warps fit on an SM
(compiled for sm_90: 68 registers at 16 rows x 4 columns, against about 220). The arithmetic is the
reference's, through the same device helpers as the Triton kernels: the same bytes.

Gluon is experimental in Triton; this module imports it lazily (at the first launch).
"""

from __future__ import annotations

import functools

import torch

from jetrl.quant.formats import E4M3
from jetrl.quant.triton_kernels import BLOCK, _cdiv

ROWS_PER_CHUNK = 16  # rows per pass step: 16 bytes per thread per store
COLS_PER_THREAD = 4  # one 4-byte load per row per thread
NUM_WARPS = 1        # 32 * COLS_PER_THREAD * NUM_WARPS columns per program, at most one 1x128 source block


@functools.lru_cache(maxsize=None)
def _kernels():
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl

    from jetrl.quant.triton_kernels import _block_scale, _recip_scale, _to_e4m3_recip

    @gluon.jit
    def columns_to_token_kernel(q_ptr, M, K, stride_qm, s_ptr, stride_sm, stride_sk, tok_ptr, tok_scale_ptr,
                                POW2: gl.constexpr, HAS_SCALE: gl.constexpr, ROWS: gl.constexpr, COLS: gl.constexpr,
                                WARPS: gl.constexpr):
        # HAS_SCALE: the input is 1x128 FP8 with row scales s (re-quantization), else a float tensor
        # loads: each thread reads COLS adjacent bytes of a row (one vector load); stores: the same values with
        # the rows innermost in the thread's registers, so its ROWS consecutive bytes of an output row go out
        # as one vector store (a register reordering inside the thread, no data exchange)
        load_layout: gl.constexpr = gl.BlockedLayout(size_per_thread=[ROWS, COLS], threads_per_warp=[1, 32],
                                                     warps_per_cta=[1, WARPS], order=[1, 0])
        store_layout: gl.constexpr = gl.BlockedLayout(size_per_thread=[ROWS, COLS], threads_per_warp=[1, 32],
                                                      warps_per_cta=[1, WARPS], order=[0, 1])
        cols: gl.constexpr = gl.SliceLayout(0, load_layout)
        rows: gl.constexpr = gl.SliceLayout(1, load_layout)
        BK: gl.constexpr = 32 * COLS * WARPS
        pid_m = gl.program_id(0)
        pid_k = gl.program_id(1)
        rk = pid_k * BK + gl.arange(0, BK, layout=cols)
        k_ok = rk < K
        kb = (pid_k * BK) // 128  # with HAS_SCALE, BK divides 128: one source scale per row for the tile
        # Out-of-range lanes load q = 0 and, past M, s = 0; past K a row's scale may be inf and 0 * inf NaN,
        # which the maxima skip (like the Triton kernel's) and which is never stored.
        amax = gl.zeros([BK], gl.float32, layout=cols)
        for c in range(0, 128, ROWS):  # pass 1: the column maxima of the dequantized tile
            rm = pid_m * 128 + c + gl.arange(0, ROWS, layout=rows)
            mask = (rm[:, None] < M) & k_ok[None, :]
            x = gl.load(q_ptr + rm[:, None].to(gl.int64) * stride_qm + rk[None, :], mask=mask, other=0.0).to(gl.float32)
            if HAS_SCALE:
                x = x * gl.load(s_ptr + rm * stride_sm + kb * stride_sk, mask=rm < M, other=0.0)[:, None]
            amax = gl.maximum(amax, gl.max(gl.abs(x), axis=0))
        scale = _block_scale(amax, POW2, True)  # computed once, by the thread that owns the column
        recip, scale_r = _recip_scale(scale)
        gl.store(tok_scale_ptr + pid_m * K + rk, scale, mask=k_ok)
        for c in range(0, 128, ROWS):  # pass 2: quantize the (cached) tile again, chunk by chunk
            rm = pid_m * 128 + c + gl.arange(0, ROWS, layout=rows)
            mask = (rm[:, None] < M) & k_ok[None, :]
            x = gl.load(q_ptr + rm[:, None].to(gl.int64) * stride_qm + rk[None, :], mask=mask, other=0.0).to(gl.float32)
            if HAS_SCALE:
                x = x * gl.load(s_ptr + rm * stride_sm + kb * stride_sk, mask=rm < M, other=0.0)[:, None]
            y = _to_e4m3_recip(x, recip[None, :], scale_r[None, :], POW2)
            out = tok_ptr + rk[None, :].to(gl.int64) * M + rm[:, None]
            gl.store(gl.convert_layout(out, store_layout), gl.convert_layout(y, store_layout),
                     mask=gl.convert_layout(mask, store_layout))

    @gluon.jit
    def act_and_token_kernel(x_ptr, M, K, stride_xm, act_ptr, act_scale_ptr, tok_ptr, tok_scale_ptr,
                             POW2: gl.constexpr, ROWS: gl.constexpr):
        # One warp per 128 x 128 tile: its 128 columns (4 per lane) are one 1x128 group of every row, so a row's
        # maximum is a reduction across the warp's lanes, and a column's stays in its lane. Pass 1 finds the
        # column maxima; pass 2 re-reads the tile and writes both quantizations.
        load_layout: gl.constexpr = gl.BlockedLayout(size_per_thread=[ROWS, 4], threads_per_warp=[1, 32],
                                                     warps_per_cta=[1, 1], order=[1, 0])
        store_layout: gl.constexpr = gl.BlockedLayout(size_per_thread=[ROWS, 4], threads_per_warp=[1, 32],
                                                      warps_per_cta=[1, 1], order=[0, 1])
        one_per_lane: gl.constexpr = gl.BlockedLayout(size_per_thread=[1], threads_per_warp=[32], warps_per_cta=[1],
                                                      order=[0])
        cols: gl.constexpr = gl.SliceLayout(0, load_layout)
        rows: gl.constexpr = gl.SliceLayout(1, load_layout)
        pid_m = gl.program_id(0)
        pid_k = gl.program_id(1)
        rk = pid_k * 128 + gl.arange(0, 128, layout=cols)
        k_ok = rk < K
        amax = gl.zeros([128], gl.float32, layout=cols)
        for c in range(0, 128, ROWS):  # pass 1: the column maxima (128x1 blocks)
            rm = pid_m * 128 + c + gl.arange(0, ROWS, layout=rows)
            mask = (rm[:, None] < M) & k_ok[None, :]
            x = gl.load(x_ptr + rm[:, None].to(gl.int64) * stride_xm + rk[None, :], mask=mask, other=0.0).to(gl.float32)
            amax = gl.maximum(amax, gl.max(gl.abs(x), axis=0))
        col_scale = _block_scale(amax, POW2, True)
        col_recip, col_scale_r = _recip_scale(col_scale)
        gl.store(tok_scale_ptr + pid_m * K + rk, col_scale, mask=k_ok)
        for c in range(0, 128, ROWS):  # pass 2: both quantizations of the (cached) tile
            rm = pid_m * 128 + c + gl.arange(0, ROWS, layout=rows)
            m_ok = rm < M
            mask = m_ok[:, None] & k_ok[None, :]
            x = gl.load(x_ptr + rm[:, None].to(gl.int64) * stride_xm + rk[None, :], mask=mask, other=0.0).to(gl.float32)
            # each row's scale is computed once, in the lane that owns it, then handed to every lane
            row_amax = gl.convert_layout(gl.max(gl.abs(x), axis=1), one_per_lane)
            row_scale_1 = _block_scale(row_amax, POW2, True)
            row_recip_1, row_scale_r_1 = _recip_scale(row_scale_1)
            row_scale = gl.convert_layout(row_scale_1, rows)
            row_recip = gl.convert_layout(row_recip_1, rows)
            row_scale_r = gl.convert_layout(row_scale_r_1, rows)
            qa = _to_e4m3_recip(x, row_recip[:, None], row_scale_r[:, None], POW2)
            gl.store(act_ptr + rm[:, None].to(gl.int64) * K + rk[None, :], qa, mask=mask)
            gl.store(act_scale_ptr + pid_k * M + rm, row_scale, mask=m_ok)  # a (Kb, M) buffer
            qt = _to_e4m3_recip(x, col_recip[None, :], col_scale_r[None, :], POW2)
            out = tok_ptr + rk[None, :].to(gl.int64) * M + rm[:, None]
            gl.store(gl.convert_layout(out, store_layout), gl.convert_layout(qt, store_layout),
                     mask=gl.convert_layout(mask, store_layout))

    return columns_to_token_kernel, act_and_token_kernel


def _launch(src: torch.Tensor, scale: torch.Tensor | None, pow2_scale: bool, rows: int | None, cols: int | None,
            warps: int | None):
    m, k = src.shape
    rows, cols, warps = rows or ROWS_PER_CHUNK, cols or COLS_PER_THREAD, warps or NUM_WARPS
    if BLOCK % rows or cols not in (1, 2, 4, 8) or warps not in (1, 2, 4):
        raise ValueError(f"rows_per_chunk must divide {BLOCK}, cols_per_thread be 1, 2, 4 or 8 and num_warps 1, 2 "
                         f"or 4; got {rows}, {cols}, {warps}")
    if scale is not None and BLOCK % (32 * cols * warps):
        raise ValueError(f"re-quantization needs 32 * cols_per_thread * num_warps to divide {BLOCK} (one source "
                         f"scale block per program), got {32 * cols * warps}")
    if m and k and src.stride(1) != 1:
        raise ValueError(f"the Gluon 128x1 kernels need rows with unit stride, got strides {tuple(src.stride())}")
    tok = torch.empty((k, m), dtype=E4M3, device=src.device)
    tok_scale = torch.empty((_cdiv(m, BLOCK), k), dtype=torch.float32, device=src.device)
    if m and k:
        s = scale if scale is not None else tok_scale  # an unused pointer without HAS_SCALE
        grid = (_cdiv(m, BLOCK), _cdiv(k, 32 * cols * warps))
        _kernels()[0][grid](src, m, k, src.stride(0), s, s.stride(0), s.stride(1), tok, tok_scale,
                        POW2=pow2_scale, HAS_SCALE=scale is not None, ROWS=rows, COLS=cols, WARPS=warps,
                        num_warps=warps)
    return tok.t(), tok_scale


def requantize_act_to_token(data: torch.Tensor, scale: torch.Tensor, pow2_scale: bool = False,
                            rows_per_chunk: int | None = None, cols_per_thread: int | None = None,
                            num_warps: int | None = None):
    """Same contract and bytes as :func:`jetrl.quant.triton_kernels.requantize_act_to_token`: 1x128 FP8
    (data (M, K) with unit column stride, scale (M, Kb)) to 128x1. Returns the (M, K) view of a row-major
    (K, M) data buffer and (Mb, K) row-major scales."""
    return _launch(data, scale, pow2_scale, rows_per_chunk, cols_per_thread, num_warps)


def quantize_token_128x1(x: torch.Tensor, pow2_scale: bool = False, rows_per_chunk: int | None = None,
                         cols_per_thread: int | None = None, num_warps: int | None = None):
    """Same contract and bytes as :func:`jetrl.quant.triton_kernels.quantize_token_128x1` for a bf16, fp16 or
    fp32 x (M, K) with unit column stride."""
    if x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise TypeError(f"the Gluon 128x1 kernel takes bf16, fp16 or fp32 input, got {x.dtype}")
    return _launch(x, None, pow2_scale, rows_per_chunk, cols_per_thread, num_warps)


ACT_TOKEN_ROWS_PER_CHUNK = 16


def quantize_act_and_token(x: torch.Tensor, pow2_scale: bool = False, rows_per_chunk: int | None = None):
    """x (M, K) per 1x128 and per 128x1 from one kernel, with the contract and bytes of
    ``jetrl.quant.triton_kernels.quantize_act_1x128(x, emit_token=True)``: returns ``(data, scale, tok_data,
    tok_scale)``, data (M, K) row-major, scale the (M, Kb) view of a (Kb, M) buffer, tok_data the (M, K) view
    of a row-major (K, M) buffer, tok_scale (Mb, K) row-major. bf16, fp16 or fp32 x with unit column stride."""
    if x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise TypeError(f"the Gluon 1x128 + 128x1 kernel takes bf16, fp16 or fp32 input, got {x.dtype}")
    m, k = x.shape
    if m and k and x.stride(1) != 1:
        raise ValueError(f"the Gluon 1x128 + 128x1 kernel needs rows with unit stride, got strides {tuple(x.stride())}")
    rows = rows_per_chunk or ACT_TOKEN_ROWS_PER_CHUNK
    if BLOCK % rows or rows > 32:
        raise ValueError(f"rows_per_chunk must divide {BLOCK} and be at most 32, got {rows}")
    kb = _cdiv(k, BLOCK)
    data = torch.empty((m, k), dtype=E4M3, device=x.device)
    scale_buf = torch.empty((kb, m), dtype=torch.float32, device=x.device)
    tok = torch.empty((k, m), dtype=E4M3, device=x.device)
    tok_scale = torch.empty((_cdiv(m, BLOCK), k), dtype=torch.float32, device=x.device)
    if m and k:
        _kernels()[1][(_cdiv(m, BLOCK), kb)](x, m, k, x.stride(0), data, scale_buf, tok, tok_scale, POW2=pow2_scale,
                                            ROWS=rows, num_warps=1)
    return data, scale_buf.t(), tok.t(), tok_scale
