"""The 128x1 quantization kernels in Gluon (Triton with explicit layouts): the tile staged in shared memory.

Two entry points with the Triton kernels' contracts and bytes: :func:`requantize_act_to_token` (1x128 FP8 ->
128x1, WGrad's saved activation) and :func:`quantize_token_128x1` (a float tensor -> 128x1, WGrad's grad_out).

The Triton kernel (:func:`jetrl.quant.triton_kernels.requantize_act_to_token`) lets the compiler choose the
layout of its 128 x 32 tile: threads and warps then share each 128-row column, so every column's reduction
needs shuffles, and each thread keeps 128 values live (about 220 registers, so few warps per SM hide memory
latency). On the H200 it reaches about half of copy bandwidth.

Here one program owns a 128 x 128 tile (one 1x128 source block per row) and:

1. loads it with 16-byte coalesced loads (every byte read from memory once) into shared memory;
2. reads it back in a layout where each thread owns whole columns (``threads_per_warp = [1, 32]``), in
   chunks of ``ROWS`` rows, twice: the first pass finds the column maxima without shuffles, the second
   quantizes; each column's scale and reciprocal are computed once, by its owner;
3. writes each thread's quantized column chunk as ``ROWS`` contiguous bytes of the transposed output
   (``STAGE_OUT=False``), or stages the transposed tile in shared memory and writes it with 16-byte
   coalesced stores, whole 128-byte lines (``STAGE_OUT=True``).

A first version without the shared-memory stage (two passes over global memory, each thread storing 16
bytes of a line at a time) reached only 0.08-0.38 of copy on the H200: its second pass re-read memory and
its partial lines were spread over the whole run. The arithmetic is the reference's, through the same device
helpers as the Triton kernels: the same bytes.

Gluon is experimental in Triton; this module imports it lazily (at the first launch).
"""

from __future__ import annotations

import functools

import torch

from jetrl.quant.formats import E4M3
from jetrl.quant.triton_kernels import BLOCK, _cdiv

ROWS_PER_CHUNK = 16  # rows per column pass step: 16 bytes of an output line per thread and column
NUM_WARPS = 4        # 128 / (32 * NUM_WARPS) adjacent columns per thread
STAGE_OUT = True     # the transposed tile goes out through shared memory, in whole lines


@functools.lru_cache(maxsize=None)
def _kernels():
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl

    from jetrl.quant.triton_kernels import _block_scale, _recip_scale, _to_e4m3_recip

    @gluon.jit
    def load_tile(x_ptr, M, K, stride_xm, pid_m, pid_k, VEC: gl.constexpr, WARPS: gl.constexpr):
        """The (128, 128) tile of x at (pid_m, pid_k), zero past M and K, in 16-byte coalesced loads (a row of
        the tile is 128 / VEC threads); with its row and column indices."""
        layout: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, VEC], threads_per_warp=[32 * VEC // 128, 128 // VEC],
                                                warps_per_cta=[WARPS, 1], order=[1, 0])
        rm = pid_m * 128 + gl.arange(0, 128, layout=gl.SliceLayout(1, layout))
        rk = pid_k * 128 + gl.arange(0, 128, layout=gl.SliceLayout(0, layout))
        mask = (rm[:, None] < M) & (rk[None, :] < K)
        tile = gl.load(x_ptr + rm[:, None].to(gl.int64) * stride_xm + rk[None, :], mask=mask, other=0.0)
        return tile, rm, rk, mask

    @gluon.jit
    def emit_chunk(x, recip, scale_r, c, out_smem, tok_ptr, M, K, pid_m, pid_k, POW2: gl.constexpr,
                   ROWS: gl.constexpr, WARPS: gl.constexpr, STAGE_OUT: gl.constexpr):
        """Quantize rows [c, c + ROWS) of the tile (x: fp32 in the column layout) with its columns' reciprocals,
        into the staged transposed tile (STAGE_OUT) or straight to memory: ROWS bytes of an output line per
        thread and column."""
        y = _to_e4m3_recip(x, recip[None, :], scale_r[None, :], POW2)
        if STAGE_OUT:
            out_smem.slice(c, ROWS, dim=1).permute([1, 0]).store(y)
        else:
            COLS: gl.constexpr = 128 // (32 * WARPS)
            # the column layout with the rows innermost in a thread's registers, for vector stores
            out_layout: gl.constexpr = gl.BlockedLayout(size_per_thread=[ROWS, COLS], threads_per_warp=[1, 32],
                                                        warps_per_cta=[1, WARPS], order=[0, 1])
            rm = pid_m * 128 + c + gl.arange(0, ROWS, layout=gl.SliceLayout(1, out_layout))
            rk = pid_k * 128 + gl.arange(0, 128, layout=gl.SliceLayout(0, out_layout))
            gl.store(tok_ptr + rk[None, :].to(gl.int64) * M + rm[:, None], gl.convert_layout(y, out_layout),
                     mask=(rm[:, None] < M) & (rk[None, :] < K))

    @gluon.jit
    def tile_to_token(smem, M, K, s_ptr, stride_sm, stride_sk, tok_ptr, tok_scale_ptr, pid_m, pid_k,
                      POW2: gl.constexpr, HAS_SCALE: gl.constexpr, ROWS: gl.constexpr, WARPS: gl.constexpr,
                      STAGE_OUT: gl.constexpr):
        """Quantize the (128, 128) tile in shared memory per 128x1 (one block per column) and write it
        transposed. HAS_SCALE: the tile is 1x128 FP8, dequantized with row scales s first."""
        COLS: gl.constexpr = 128 // (32 * WARPS)
        # each thread owns COLS adjacent whole columns, ROWS rows at a time
        col_layout: gl.constexpr = gl.BlockedLayout(size_per_thread=[ROWS, COLS], threads_per_warp=[1, 32],
                                                    warps_per_cta=[1, WARPS], order=[1, 0])
        cols: gl.constexpr = gl.SliceLayout(0, col_layout)
        rows: gl.constexpr = gl.SliceLayout(1, col_layout)
        rk = pid_k * 128 + gl.arange(0, 128, layout=cols)
        k_ok = rk < K
        if HAS_SCALE:  # the tile's 128 row scales, read from memory once, then from shared memory per chunk
            one_each: gl.constexpr = gl.BlockedLayout(size_per_thread=[1], threads_per_warp=[32], warps_per_cta=[WARPS],
                                                      order=[0])
            rm_s = pid_m * 128 + gl.arange(0, 128, layout=one_each)
            s_smem = gl.allocate_shared_memory(gl.float32, [128], gl.SwizzledSharedLayout(1, 1, 1, order=[0]))
            s_smem.store(gl.load(s_ptr + rm_s * stride_sm + pid_k * stride_sk, mask=rm_s < M, other=0.0))
        # Out-of-range lanes hold x = 0 and, past M, s = 0; past K a row's scale may be inf and 0 * inf NaN,
        # which the maxima skip (like the Triton kernel's) and which is never stored.
        if STAGE_OUT:
            # (k, m), m contiguous, 16-byte chunks swizzled by k % 8: a thread's ROWS bytes of a column go in
            # with one vector store, and neither those stores (32 columns) nor the line loads hit one bank group
            out_smem = gl.allocate_shared_memory(gl.float8e4nv, [128, 128],
                                                 gl.SwizzledSharedLayout(16, 1, 8, order=[1, 0]))
        else:
            out_smem = smem  # unused
        if ROWS == 128:  # whole columns in registers (one value per register): one read of shared memory
            x = smem.load(col_layout).to(gl.float32)
            if HAS_SCALE:
                x = x * s_smem.load(rows)[:, None]
            scale = _block_scale(gl.max(gl.abs(x), axis=0), POW2, True)
            recip, scale_r = _recip_scale(scale)
            gl.store(tok_scale_ptr + pid_m * K + rk, scale, mask=k_ok)
            emit_chunk(x, recip, scale_r, 0, out_smem, tok_ptr, M, K, pid_m, pid_k, POW2, ROWS, WARPS, STAGE_OUT)
        else:  # two passes over shared memory, ROWS rows at a time: few registers, more programs per SM
            amax = gl.zeros([128], gl.float32, layout=cols)
            for c in gl.static_range(0, 128, ROWS):  # pass 1: the column maxima, each in the thread owning it
                x = smem.slice(c, ROWS, dim=0).load(col_layout).to(gl.float32)
                if HAS_SCALE:
                    x = x * s_smem.slice(c, ROWS).load(rows)[:, None]
                amax = gl.maximum(amax, gl.max(gl.abs(x), axis=0))
            scale = _block_scale(amax, POW2, True)  # computed once, by the thread that owns the column
            recip, scale_r = _recip_scale(scale)
            gl.store(tok_scale_ptr + pid_m * K + rk, scale, mask=k_ok)
            for c in gl.static_range(0, 128, ROWS):  # pass 2: quantize
                x = smem.slice(c, ROWS, dim=0).load(col_layout).to(gl.float32)
                if HAS_SCALE:
                    x = x * s_smem.slice(c, ROWS).load(rows)[:, None]
                emit_chunk(x, recip, scale_r, c, out_smem, tok_ptr, M, K, pid_m, pid_k, POW2, ROWS, WARPS, STAGE_OUT)
        if STAGE_OUT:  # whole 128-byte lines of the transposed output, 16 bytes per thread
            line_layout: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, 16], threads_per_warp=[4, 8],
                                                         warps_per_cta=[WARPS, 1], order=[1, 0])
            yt = out_smem.load(line_layout)  # (k, m)
            rk_o = pid_k * 128 + gl.arange(0, 128, layout=gl.SliceLayout(1, line_layout))
            rm_o = pid_m * 128 + gl.arange(0, 128, layout=gl.SliceLayout(0, line_layout))
            gl.store(tok_ptr + rk_o[:, None].to(gl.int64) * M + rm_o[None, :], yt,
                     mask=(rk_o[:, None] < K) & (rm_o[None, :] < M))

    @gluon.jit
    def token_kernel(x_ptr, M, K, stride_xm, s_ptr, stride_sm, stride_sk, tok_ptr, tok_scale_ptr,
                     POW2: gl.constexpr, HAS_SCALE: gl.constexpr, ROWS: gl.constexpr, WARPS: gl.constexpr,
                     VEC: gl.constexpr, STAGE_OUT: gl.constexpr):
        """x (M, K) per 128x1, one (128, 128) tile per program. HAS_SCALE: x is 1x128 FP8 with row scales s
        (re-quantization), else a float tensor. VEC: elements of x per 16 bytes."""
        pid_m = gl.program_id(0)
        pid_k = gl.program_id(1)
        tile, _, _, _ = load_tile(x_ptr, M, K, stride_xm, pid_m, pid_k, VEC, WARPS)
        smem = gl.allocate_shared_memory(x_ptr.dtype.element_ty, [128, 128], gl.SwizzledSharedLayout(1, 1, 1, order=[1, 0]))
        smem.store(tile)
        tile_to_token(smem, M, K, s_ptr, stride_sm, stride_sk, tok_ptr, tok_scale_ptr, pid_m, pid_k,
                      POW2, HAS_SCALE, ROWS, WARPS, STAGE_OUT)

    @gluon.jit
    def act_and_token_kernel(x_ptr, M, K, stride_xm, act_ptr, act_scale_ptr, tok_ptr, tok_scale_ptr,
                             POW2: gl.constexpr, ROWS: gl.constexpr, WARPS: gl.constexpr, VEC: gl.constexpr,
                             STAGE_OUT: gl.constexpr):
        """x (M, K) per 1x128 and per 128x1 from one read: each row's 1x128 block is quantized in the
        registers of the coalesced load (a reduction over 128 / VEC lanes), then the tile goes through
        shared memory to the column passes."""
        pid_m = gl.program_id(0)
        pid_k = gl.program_id(1)
        tile, rm, rk, mask = load_tile(x_ptr, M, K, stride_xm, pid_m, pid_k, VEC, WARPS)
        smem = gl.allocate_shared_memory(x_ptr.dtype.element_ty, [128, 128], gl.SwizzledSharedLayout(1, 1, 1, order=[1, 0]))
        smem.store(tile)
        x = tile.to(gl.float32)
        row_scale = _block_scale(gl.max(gl.abs(x), axis=1), POW2, True)
        row_recip, row_scale_r = _recip_scale(row_scale)
        qa = _to_e4m3_recip(x, row_recip[:, None], row_scale_r[:, None], POW2)
        gl.store(act_ptr + rm[:, None].to(gl.int64) * K + rk[None, :], qa, mask=mask)
        gl.store(act_scale_ptr + pid_k * M + rm, row_scale, mask=rm < M)  # a (Kb, M) buffer
        tile_to_token(smem, M, K, tok_ptr, 1, 1, tok_ptr, tok_scale_ptr, pid_m, pid_k,
                      POW2, False, ROWS, WARPS, STAGE_OUT)

    return token_kernel, act_and_token_kernel


def _vec(dtype: torch.dtype) -> int:
    return 16 // torch.empty((), dtype=dtype).element_size()


def _config(rows: int | None, warps: int | None, stage_out: bool | None) -> tuple[int, int, bool]:
    rows = rows or ROWS_PER_CHUNK
    warps = warps or NUM_WARPS
    stage_out = STAGE_OUT if stage_out is None else stage_out
    if BLOCK % rows or warps not in (1, 2, 4):
        raise ValueError(f"rows_per_chunk must divide {BLOCK} and num_warps be 1, 2 or 4; got {rows} and {warps}")
    return rows, warps, stage_out


def _check_rows(x: torch.Tensor, what: str) -> None:
    if x.numel() and x.stride(1) != 1:
        raise ValueError(f"the Gluon {what} kernel needs rows with unit stride, got strides {tuple(x.stride())}")


def _token(src: torch.Tensor, scale: torch.Tensor | None, pow2_scale: bool, rows: int | None, warps: int | None,
           stage_out: bool | None):
    m, k = src.shape
    rows, warps, stage_out = _config(rows, warps, stage_out)
    _check_rows(src, "128x1")
    tok = torch.empty((k, m), dtype=E4M3, device=src.device)
    tok_scale = torch.empty((_cdiv(m, BLOCK), k), dtype=torch.float32, device=src.device)
    if m and k:
        s = scale if scale is not None else tok_scale  # an unused pointer without HAS_SCALE
        _kernels()[0][(_cdiv(m, BLOCK), _cdiv(k, BLOCK))](
            src, m, k, src.stride(0), s, s.stride(0), s.stride(1), tok, tok_scale, POW2=pow2_scale,
            HAS_SCALE=scale is not None, ROWS=rows, WARPS=warps, VEC=_vec(src.dtype), STAGE_OUT=stage_out,
            num_warps=warps)
    return tok.t(), tok_scale


def requantize_act_to_token(data: torch.Tensor, scale: torch.Tensor, pow2_scale: bool = False,
                            rows_per_chunk: int | None = None, num_warps: int | None = None,
                            stage_out: bool | None = None):
    """Same contract and bytes as :func:`jetrl.quant.triton_kernels.requantize_act_to_token`: 1x128 FP8
    (data (M, K) with unit column stride, scale (M, Kb)) to 128x1. Returns the (M, K) view of a row-major
    (K, M) data buffer and (Mb, K) row-major scales. The keywords override the module's defaults (sweeps)."""
    return _token(data, scale, pow2_scale, rows_per_chunk, num_warps, stage_out)


def quantize_token_128x1(x: torch.Tensor, pow2_scale: bool = False, rows_per_chunk: int | None = None,
                         num_warps: int | None = None, stage_out: bool | None = None):
    """Same contract and bytes as :func:`jetrl.quant.triton_kernels.quantize_token_128x1` for a bf16, fp16 or
    fp32 x (M, K) with unit column stride."""
    if x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise TypeError(f"the Gluon 128x1 kernel takes bf16, fp16 or fp32 input, got {x.dtype}")
    return _token(x, None, pow2_scale, rows_per_chunk, num_warps, stage_out)


def quantize_act_and_token(x: torch.Tensor, pow2_scale: bool = False, rows_per_chunk: int | None = None,
                           num_warps: int | None = None, stage_out: bool | None = None):
    """x (M, K) per 1x128 and per 128x1 from one kernel, with the contract and bytes of
    ``jetrl.quant.triton_kernels.quantize_act_1x128(x, emit_token=True)``: returns ``(data, scale, tok_data,
    tok_scale)``, data (M, K) row-major, scale the (M, Kb) view of a (Kb, M) buffer, tok_data the (M, K) view
    of a row-major (K, M) buffer, tok_scale (Mb, K) row-major. bf16, fp16 or fp32 x with unit column stride."""
    if x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise TypeError(f"the Gluon 1x128 + 128x1 kernel takes bf16, fp16 or fp32 input, got {x.dtype}")
    m, k = x.shape
    rows, warps, stage_out = _config(rows_per_chunk, num_warps, stage_out)
    _check_rows(x, "1x128 + 128x1")
    kb = _cdiv(k, BLOCK)
    data = torch.empty((m, k), dtype=E4M3, device=x.device)
    scale_buf = torch.empty((kb, m), dtype=torch.float32, device=x.device)
    tok = torch.empty((k, m), dtype=E4M3, device=x.device)
    tok_scale = torch.empty((_cdiv(m, BLOCK), k), dtype=torch.float32, device=x.device)
    if m and k:
        _kernels()[1][(_cdiv(m, BLOCK), kb)](x, m, k, x.stride(0), data, scale_buf, tok, tok_scale, POW2=pow2_scale,
                                            ROWS=rows, WARPS=warps, VEC=_vec(x.dtype), STAGE_OUT=stage_out,
                                            num_warps=warps)
    return data, scale_buf.t(), tok.t(), tok_scale
