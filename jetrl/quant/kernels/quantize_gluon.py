"""The 128x1 quantization kernels in Gluon (Triton with explicit layouts): the tile staged in shared memory.

Three entry points with the Triton kernels' contracts and bytes: :func:`requantize_act_to_token` (1x128 FP8
-> 128x1, WGrad's saved activation), :func:`quantize_token_128x1` (a float tensor -> 128x1, WGrad's
grad_out) and :func:`quantize_act_and_token` (both blockings of grad_out from one read).

The Triton kernels (:func:`jetrl.quant.kernels.quantize_triton.requantize_act_to_token`) let the compiler choose
the layout of a 128 x 32 tile: threads and warps then share each 128-row column, so every column's reduction
needs shuffles and each thread keeps many registers live, so few warps per SM hide memory latency.

Here one program of 4 warps owns a 128 x 128 tile (one 1x128 source block per row) and:

1. loads it with 16-byte coalesced loads into shared memory (every byte read from memory once);
2. reads it back with each thread owning one whole column (``threads_per_warp = [1, 32]``): the column's
   maximum needs no shuffle, its scale and reciprocal are computed once, by its owner, and its 128 values
   stay in registers between the maximum and the quantization (one read of shared memory);
3. stages the transposed E4M3 tile in shared memory (16-byte chunks swizzled so that neither side of the
   transposition hits one bank group) and writes it in whole 128-byte lines.

The one-pass grad_out kernel then reads the tile's rows back from shared memory, 32 at a time, for the
1x128 quantization: 4 bytes of memory traffic per element against 6 for the two kernels apart (the alternatives
measured are in docs/benchmark-history.md). The arithmetic is the reference's, through the same device helpers
as the Triton kernels: the same bytes.

Gluon is experimental in Triton; this module imports it lazily (at the first launch), and
:func:`available` says whether this Triton has it (the CUDA backend runs the Triton kernels where not).
"""

from __future__ import annotations

import functools

import torch

from jetrl.quant.kernels.quantize_triton import BLOCK, _cdiv, act_buffers, token_buffers
from jetrl.quant.kernels.tuning import COMPILE_OPTIONS

NUM_WARPS = 4  # one column of the 128-wide tile per thread


@functools.lru_cache(maxsize=None)
def available() -> bool:
    """Whether the installed Triton has Gluon (``triton.experimental.gluon``)."""
    try:
        from triton.experimental import gluon  # noqa: F401
        from triton.experimental.gluon import language  # noqa: F401
    except ImportError:
        return False
    return True


@functools.lru_cache(maxsize=None)
def _kernels():
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl

    from jetrl.quant.kernels.quantize_triton import _block_scale, _recip_scale, _to_e4m3_recip

    @gluon.jit
    def load_tile(x_ptr, M, K, stride_xm, pid_m, pid_k, VEC: gl.constexpr):
        """The (128, 128) tile of x at (pid_m, pid_k), zero past M and K, in 16-byte coalesced loads (a row of
        the tile is 128 / VEC threads)."""
        layout: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, VEC],
                                                threads_per_warp=[32 * VEC // 128, 128 // VEC],
                                                warps_per_cta=[4, 1], order=[1, 0])
        rm = pid_m * 128 + gl.arange(0, 128, layout=gl.SliceLayout(1, layout))
        rk = pid_k * 128 + gl.arange(0, 128, layout=gl.SliceLayout(0, layout))
        mask = (rm[:, None] < M) & (rk[None, :] < K)
        return gl.load(x_ptr + rm[:, None].to(gl.int64) * stride_xm + rk[None, :], mask=mask, other=0.0)

    @gluon.jit
    def tile_to_token(smem, s_smem, OUT_M, K, tok_ptr, tok_scale_ptr, pid_m, pid_k, POW2: gl.constexpr,
                      HAS_SCALE: gl.constexpr):
        """Quantize the (128, 128) tile in shared memory per 128x1 (one block per column) and write it
        transposed into the row-major (K, OUT_M) buffer (rows of the tile past the input's M hold zeros).
        HAS_SCALE: the tile is 1x128 FP8, dequantized first with the row scales in s_smem."""
        col_layout: gl.constexpr = gl.BlockedLayout(size_per_thread=[128, 1], threads_per_warp=[1, 32],
                                                    warps_per_cta=[1, 4], order=[1, 0])
        rk = pid_k * 128 + gl.arange(0, 128, layout=gl.SliceLayout(0, col_layout))
        x = smem.load(col_layout).to(gl.float32)
        if HAS_SCALE:
            # Lanes past M hold x = 0 and s = 0; past K a row's scale may be inf and 0 * inf NaN, which the
            # maxima skip (like the Triton kernel's) and which is never stored.
            x = x * s_smem.load(gl.SliceLayout(1, col_layout))[:, None]
        scale = _block_scale(gl.max(gl.abs(x), axis=0), POW2)  # computed once, by the column's owner
        recip, scale_r = _recip_scale(scale)
        gl.store(tok_scale_ptr + pid_m * K + rk, scale, mask=rk < K)
        y = _to_e4m3_recip(x, recip[None, :], scale_r[None, :], POW2)
        # (k, m), m contiguous, 16-byte chunks swizzled by k % 8: a thread's column goes in as 16-byte stores
        # and the lines come out as 16-byte loads, neither with bank conflicts
        out_smem = gl.allocate_shared_memory(gl.float8e4nv, [128, 128], gl.SwizzledSharedLayout(16, 1, 8, order=[1, 0]))
        out_smem.permute([1, 0]).store(y)
        line_layout: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, 16], threads_per_warp=[4, 8],
                                                     warps_per_cta=[4, 1], order=[1, 0])
        yt = out_smem.load(line_layout)
        rk_o = pid_k * 128 + gl.arange(0, 128, layout=gl.SliceLayout(1, line_layout))
        rm_o = pid_m * 128 + gl.arange(0, 128, layout=gl.SliceLayout(0, line_layout))
        gl.store(tok_ptr + rk_o[:, None].to(gl.int64) * OUT_M + rm_o[None, :], yt,
                 mask=(rk_o[:, None] < K) & (rm_o[None, :] < OUT_M))

    @gluon.jit(do_not_specialize=["M"], do_not_specialize_on_alignment=["stride_sk"])
    def token_kernel(x_ptr, M, K, stride_xm, s_ptr, stride_sm, stride_sk, tok_ptr, tok_scale_ptr, OUT_M,
                     POW2: gl.constexpr, HAS_SCALE: gl.constexpr, VEC: gl.constexpr):
        """x (M, K) per 128x1, one (128, 128) tile per program, into a (K, OUT_M) buffer (OUT_M >= M: zero rows
        appended). HAS_SCALE: x is 1x128 FP8 with row scales s (re-quantization), else a float tensor. VEC:
        elements of x per 16 bytes."""
        pid_m = gl.program_id(0)
        pid_k = gl.program_id(1)
        tile = load_tile(x_ptr, M, K, stride_xm, pid_m, pid_k, VEC)
        smem = gl.allocate_shared_memory(x_ptr.dtype.element_ty, [128, 128],
                                         gl.SwizzledSharedLayout(1, 1, 1, order=[1, 0]))
        if HAS_SCALE:  # the row scales, loaded with the tile (one per thread), handed to all through shared memory
            one_each: gl.constexpr = gl.BlockedLayout(size_per_thread=[1], threads_per_warp=[32], warps_per_cta=[4],
                                                      order=[0])
            rm_s = pid_m * 128 + gl.arange(0, 128, layout=one_each)
            s = gl.load(s_ptr + rm_s * stride_sm + pid_k * stride_sk, mask=rm_s < M, other=0.0)
            s_smem = gl.allocate_shared_memory(gl.float32, [128], gl.SwizzledSharedLayout(1, 1, 1, order=[0]))
            s_smem.store(s)
        else:
            s_smem = smem  # unused
        smem.store(tile)
        tile_to_token(smem, s_smem, OUT_M, K, tok_ptr, tok_scale_ptr, pid_m, pid_k, POW2, HAS_SCALE)

    @gluon.jit
    def tile_to_act(smem, M, K, act_ptr, act_scale_ptr, ACT_SCALE_M, pid_m, pid_k, POW2: gl.constexpr):
        """Quantize the (128, 128) tile in shared memory per 1x128 into column block ``pid_k`` of the row-major
        (M, K) ``act`` (scales into a (K / 128, ACT_SCALE_M) buffer): its rows read back 32 at a time, 32 values of
        a row per thread (4 lanes per row: two shuffles per row maximum, and each row's scale computed in 4 lanes,
        not 128 / VEC)."""
        row_layout: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, 32], threads_per_warp=[8, 4],
                                                    warps_per_cta=[4, 1], order=[1, 0])
        rk = pid_k * 128 + gl.arange(0, 128, layout=gl.SliceLayout(0, row_layout))
        for c in gl.static_range(0, 128, 32):
            x = smem.slice(c, 32, dim=0).load(row_layout).to(gl.float32)
            rm = pid_m * 128 + c + gl.arange(0, 32, layout=gl.SliceLayout(1, row_layout))
            row_scale = _block_scale(gl.max(gl.abs(x), axis=1), POW2)
            row_recip, row_scale_r = _recip_scale(row_scale)
            qa = _to_e4m3_recip(x, row_recip[:, None], row_scale_r[:, None], POW2)
            gl.store(act_ptr + rm[:, None].to(gl.int64) * K + rk[None, :], qa,
                     mask=(rm[:, None] < M) & (rk[None, :] < K))
            gl.store(act_scale_ptr + pid_k * ACT_SCALE_M + rm, row_scale, mask=rm < M)

    @gluon.jit(do_not_specialize=["M", "ACT_SCALE_M"])
    def act_and_token_kernel(x_ptr, M, K, stride_xm, act_ptr, act_scale_ptr, ACT_SCALE_M, tok_ptr, tok_scale_ptr,
                             OUT_M, POW2: gl.constexpr, VEC: gl.constexpr):
        """x (M, K) per 128x1 and per 1x128 from one read: the tile goes through shared memory to the column
        quantization, then its rows are read back for the row quantization."""
        pid_m = gl.program_id(0)
        pid_k = gl.program_id(1)
        tile = load_tile(x_ptr, M, K, stride_xm, pid_m, pid_k, VEC)
        smem = gl.allocate_shared_memory(x_ptr.dtype.element_ty, [128, 128],
                                         gl.SwizzledSharedLayout(1, 1, 1, order=[1, 0]))
        smem.store(tile)
        tile_to_token(smem, smem, OUT_M, K, tok_ptr, tok_scale_ptr, pid_m, pid_k, POW2, False)
        tile_to_act(smem, M, K, act_ptr, act_scale_ptr, ACT_SCALE_M, pid_m, pid_k, POW2)

    return token_kernel, act_and_token_kernel


def _vec(dtype: torch.dtype) -> int:
    """Elements of ``dtype`` per 16-byte load."""
    return 16 // dtype.itemsize


def _check_input(x: torch.Tensor, what: str, floats_only: bool = True) -> None:
    if floats_only and x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise TypeError(f"the Gluon {what} kernel takes bf16, fp16 or fp32 input, got {x.dtype}")
    if x.numel() and x.stride(1) != 1:
        raise ValueError(f"the Gluon {what} kernel needs rows with unit stride, got strides {tuple(x.stride())}")


def _token(src: torch.Tensor, scale: torch.Tensor | None, pow2_scale: bool, whole_blocks: bool):
    m, k = src.shape
    tok, tok_scale = token_buffers(m, k, whole_blocks, src.device)
    if m and k:
        s = scale if scale is not None else tok_scale  # an unused pointer without HAS_SCALE
        _kernels()[0][(_cdiv(m, BLOCK), _cdiv(k, BLOCK))](
            src, m, k, src.stride(0), s, s.stride(0), s.stride(1), tok, tok_scale, tok.shape[1], POW2=pow2_scale,
            HAS_SCALE=scale is not None, VEC=_vec(src.dtype), num_warps=NUM_WARPS, **COMPILE_OPTIONS)
    return tok.t(), tok_scale


def requantize_act_to_token(data: torch.Tensor, scale: torch.Tensor, pow2_scale: bool = False,
                            whole_blocks: bool = False):
    """Same contract and bytes as :func:`jetrl.quant.kernels.quantize_triton.requantize_act_to_token` for data
    (M, K) with unit column stride."""
    _check_input(data, "re-quantization", floats_only=False)
    return _token(data, scale, pow2_scale, whole_blocks)


def quantize_token_128x1(x: torch.Tensor, pow2_scale: bool = False, whole_blocks: bool = False):
    """Same contract and bytes as :func:`jetrl.quant.kernels.quantize_triton.quantize_token_128x1` for a bf16, fp16 or
    fp32 x (M, K) with unit column stride."""
    _check_input(x, "128x1")
    return _token(x, None, pow2_scale, whole_blocks)


def quantize_act_and_token(x: torch.Tensor, pow2_scale: bool = False, whole_blocks: bool = False):
    """x (M, K) per 1x128 and per 128x1 from one kernel, with the bytes of
    :func:`~jetrl.quant.kernels.quantize_triton.quantize_act_1x128` and
    :func:`~jetrl.quant.kernels.quantize_triton.quantize_token_128x1` (``whole_blocks`` for the latter): returns
    ``(data, scale, tok_data, tok_scale)`` in their layouts. bf16, fp16 or fp32 x with unit column stride."""
    _check_input(x, "1x128 + 128x1")
    m, k = x.shape
    data, scale_buf = act_buffers(m, k, x.device)
    tok, tok_scale = token_buffers(m, k, whole_blocks, x.device)
    if m and k:
        _kernels()[1][(_cdiv(m, BLOCK), _cdiv(k, BLOCK))](x, m, k, x.stride(0), data, scale_buf, scale_buf.shape[1],
                                                         tok, tok_scale, tok.shape[1], POW2=pow2_scale,
                                                         VEC=_vec(x.dtype), num_warps=NUM_WARPS, **COMPILE_OPTIONS)
    return data, scale_buf[:, :m].t(), tok.t(), tok_scale
