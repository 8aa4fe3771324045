"""The blockwise FP8 GEMM for training-sized M in Triton, with TMA loads: ``a @ b.T``, one fp32 scale per 128-wide
K block of each operand.

An experimental path (``gemm="triton-tma"`` in the tuning object; "auto" never picks it) that the GEMM benchmark
(``bench/kernels.py --sections gemm-train``) times against cuBLAS's blockwise ``scaled_mm`` at the training
shapes. The arithmetic is the blockwise GEMM's (:mod:`~jetrl.quant.kernels.gemm_triton`, the reference's
:func:`jetrl.quant.reference.gemm` to summation order): per 128-wide K block, in order from zero,
``acc += dot(a_k, b_k) * (sa_k * sb_k)`` in fp32, cast once at the end. BLOCK_K is 128, one scale block: the MMA of
a K block sums raw E4M3 products and its result is promoted into the fp32 accumulator with that block's scales.

The operands are the layouts jetrl's quantizers write, in all three training pairings, each a row-major (rows, K)
E4M3 tensor read through a TMA descriptor (tiles zero-filled past the edges, so an unaligned M needs no masks):

* Fprop ``x @ W^T``: ``a`` = x per 1x128 (M, K), its scales (M, Kb) outer-dim-major; ``b`` = W (N, K) with
  128x128 scales (Nb, Kb);
* DGrad ``dy @ W``: ``a`` = dy per 1x128; ``b`` = the row-major W^T copy (K_in, N_out) with 128x128 scales;
* WGrad ``dy^T @ x``: both operands per 128x1 along the tokens (:func:`~jetrl.quant.kernels.quantize_triton.
  quantize_token_128x1` with whole blocks: row-major (features, tokens) buffers, K the token count), so ``b`` has
  1x128 scales (``b_scale_rows=1``), one per row and K block.

Schedule (:class:`TmaGemmConfig`, from the tuning object's ``tma_gemm_*`` fields or given): one output tile per
program in grouped order (``group_m`` row tiles walk the column tiles together, for L2 reuse), or ``persistent``
programs, one per SM, each walking tiles ``pid, pid + programs, ...`` (the same tiles, the same arithmetic per
tile). ``skew`` issues block k+1's MMA before promoting block k's result (the same sums in the same order: an
attempt to let the compiler overlap the promotion with the next MMA, which it otherwise waits for before
scaling). ``row_scale``: where a tile's columns lie inside one 128-row weight scale block (128x128 ``b`` scales,
``block_n`` dividing 128), ``sa * sb`` is one factor per row, ``sa[m] * sb``, the same fp32 products as the outer
product's. ``tma_store`` writes the output tile through a descriptor too (where the output's rows are 16-byte
aligned). None of these changes a result's bits except through the MMA's own summation of a K block, which every
tile shape does per output element.

Token counts (M; K for WGrad) and the strides that follow them are not specialised on (``do_not_specialize``): a
new micro-batch size compiles nothing. Layouts TMA cannot read (a unit column stride, 16-byte aligned rows and
base) fall back to the pointer-based :func:`~jetrl.quant.kernels.gemm_triton.blockwise_fp8_gemm`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from jetrl.quant.kernels import tuning
from jetrl.quant.kernels.gemm_exact_triton import _tma_ok
from jetrl.quant.kernels.gemm_triton import blockwise_fp8_gemm, grouped_tile
from jetrl.quant.kernels.quantize_triton import BLOCK, _cdiv
from jetrl.quant.kernels.tuning import COMPILE_OPTIONS


@triton.jit
def _block_scale(as_ptr, bs_ptr, rm, rn, m_ok, n_ok, n0, kb, stride_asm, stride_ask, stride_bsn, stride_bsk,
                 B_SCALE_ROWS: tl.constexpr, ROW_SCALE: tl.constexpr):
    """K block ``kb``'s scale factor for the tile: (BLOCK_M, 1) per-row ``sa * sb`` (``ROW_SCALE``) or the
    (BLOCK_M, BLOCK_N) outer product ``sa[:, None] * sb[None, :]``; rows and columns past the edges read 0."""
    sa = tl.load(as_ptr + rm * stride_asm + kb * stride_ask, mask=m_ok, other=0.0)
    if ROW_SCALE:
        sb1 = tl.load(bs_ptr + (n0 // B_SCALE_ROWS) * stride_bsn + kb * stride_bsk)
        return (sa * sb1)[:, None]
    else:
        sb = tl.load(bs_ptr + (rn // B_SCALE_ROWS) * stride_bsn + kb * stride_bsk, mask=n_ok, other=0.0)
        return sa[:, None] * sb[None, :]


@triton.jit(do_not_specialize=["M", "K", "NUM_PROGRAMS"],
            do_not_specialize_on_alignment=["stride_ask", "stride_bsn", "stride_bsk"])
def _tma_gemm_kernel(a_desc, b_desc, c_desc, c_ptr, as_ptr, bs_ptr, M, N, K, NUM_PROGRAMS,
                     stride_cm, stride_cn, stride_asm, stride_ask, stride_bsn, stride_bsk,
                     B_SCALE_ROWS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     GROUP_M: tl.constexpr, ROW_SCALE: tl.constexpr, SKEW: tl.constexpr, TMA_STORE: tl.constexpr):
    """C = A @ B^T with per-128-K-block scales, A and B tiles by TMA; program ``pid`` computes tiles ``pid,
    pid + NUM_PROGRAMS, ...`` (one tile each when the grid has one program per tile), each walking all of K in
    order from zero (no split-K, no atomics: deterministic)."""
    num_tiles = tl.cdiv(M, BLOCK_M) * tl.cdiv(N, BLOCK_N)
    num_kb = tl.cdiv(K, 128)
    for tile in range(tl.program_id(0), num_tiles, NUM_PROGRAMS):
        pid_m, pid_n = grouped_tile(tile, M, N, BLOCK_M, BLOCK_N, GROUP_M)
        m0 = pid_m * BLOCK_M
        n0 = pid_n * BLOCK_N
        rm = m0 + tl.arange(0, BLOCK_M)
        rn = n0 + tl.arange(0, BLOCK_N)
        m_ok = rm < M
        n_ok = rn < N
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        if SKEW:
            # block 0's MMA, then per iteration: block kb's MMA issued, block kb - 1's result promoted
            prev = tl.dot(a_desc.load([m0, 0]), tl.trans(b_desc.load([n0, 0])))
            s_prev = _block_scale(as_ptr, bs_ptr, rm, rn, m_ok, n_ok, n0, 0, stride_asm, stride_ask, stride_bsn,
                                  stride_bsk, B_SCALE_ROWS, ROW_SCALE)
            for kb in range(1, num_kb):
                cur = tl.dot(a_desc.load([m0, kb * 128]), tl.trans(b_desc.load([n0, kb * 128])))
                s_cur = _block_scale(as_ptr, bs_ptr, rm, rn, m_ok, n_ok, n0, kb, stride_asm, stride_ask,
                                     stride_bsn, stride_bsk, B_SCALE_ROWS, ROW_SCALE)
                acc += prev * s_prev
                prev = cur
                s_prev = s_cur
            acc += prev * s_prev
        else:
            for kb in range(0, num_kb):
                a = a_desc.load([m0, kb * 128])
                b = b_desc.load([n0, kb * 128])
                s = _block_scale(as_ptr, bs_ptr, rm, rn, m_ok, n_ok, n0, kb, stride_asm, stride_ask, stride_bsn,
                                 stride_bsk, B_SCALE_ROWS, ROW_SCALE)
                acc += tl.dot(a, tl.trans(b)) * s
        c = acc.to(c_ptr.dtype.element_ty)
        if TMA_STORE:
            c_desc.store([m0, n0], c)
        else:
            tl.store(c_ptr + rm[:, None].to(tl.int64) * stride_cm + rn[None, :] * stride_cn, c,
                     mask=m_ok[:, None] & n_ok[None, :])


@dataclass(frozen=True)
class TmaGemmConfig:
    """Tiles and schedule of :func:`tma_fp8_gemm` (BLOCK_K is always 128, one scale block); see the module doc."""

    block_m: int = 128
    block_n: int = 128
    num_warps: int = 8
    num_stages: int = 4
    group_m: int = 8
    persistent: bool = False
    skew: bool = False
    row_scale: bool = True
    tma_store: bool = False

    @property
    def name(self) -> str:
        flags = "".join(f"-{f}" for f in ("persistent", "skew", "tma_store") if getattr(self, f))
        return (f"{self.block_m}x{self.block_n}w{self.num_warps}s{self.num_stages}g{self.group_m}"
                f"{'' if self.row_scale else '-outer'}{flags}")


def config_from_tuning() -> TmaGemmConfig:
    """The tuning object's ``tma_gemm_*`` fields as a :class:`TmaGemmConfig`."""
    t = tuning.current()
    return TmaGemmConfig(t.tma_gemm_block_m, t.tma_gemm_block_n, t.tma_gemm_num_warps, t.tma_gemm_num_stages,
                         t.tma_gemm_group_m, t.tma_gemm_persistent, t.tma_gemm_skew, t.tma_gemm_row_scale,
                         t.tma_gemm_tma_store)


def _program_count(device: torch.device) -> int:
    """Persistent programs: one per SM (the interpreter: a few, so that programs walk several tiles)."""
    if device.type != "cuda":
        return 4
    return torch.cuda.get_device_properties(device).multi_processor_count


def tma_fp8_gemm(a_data: torch.Tensor, a_scale: torch.Tensor, b_data: torch.Tensor, b_scale: torch.Tensor,
                 b_scale_rows: int, out_dtype: torch.dtype = torch.bfloat16,
                 config: TmaGemmConfig | None = None) -> torch.Tensor:
    """``a @ b.T`` for a (M, K) with 1x128 scales (M, Kb) and b (N, K) with 128x128 scales (Nb, Kb)
    (``b_scale_rows=128``) or 1x128 scales (N, Kb) (``b_scale_rows=1``); scales of any strides. ``config``:
    the tiles (default: the tuning object's, :func:`config_from_tuning`). Operands TMA cannot read go to the
    pointer-based blockwise GEMM."""
    m, k = a_data.shape
    n = b_data.shape[0]
    if not (_tma_ok(a_data) and _tma_ok(b_data)):
        return blockwise_fp8_gemm(a_data, a_scale, b_data, b_scale, b_scale_rows, out_dtype)
    out = torch.empty((m, n), dtype=out_dtype, device=a_data.device)
    if m == 0 or n == 0:
        return out
    if k == 0:
        return out.zero_()
    from triton.tools.tensor_descriptor import TensorDescriptor

    cfg = config or config_from_tuning()
    a_desc = TensorDescriptor.from_tensor(a_data, [cfg.block_m, BLOCK])
    b_desc = TensorDescriptor.from_tensor(b_data, [cfg.block_n, BLOCK])
    tma_store = cfg.tma_store and _tma_ok(out)
    c_desc = TensorDescriptor.from_tensor(out, [cfg.block_m, cfg.block_n]) if tma_store else a_desc
    tiles = _cdiv(m, cfg.block_m) * _cdiv(n, cfg.block_n)
    programs = min(tiles, _program_count(a_data.device)) if cfg.persistent else tiles
    _tma_gemm_kernel[(programs,)](
        a_desc, b_desc, c_desc, out, a_scale, b_scale, m, n, k, programs,
        out.stride(0), out.stride(1), a_scale.stride(0), a_scale.stride(1), b_scale.stride(0), b_scale.stride(1),
        B_SCALE_ROWS=b_scale_rows, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, GROUP_M=cfg.group_m,
        ROW_SCALE=cfg.row_scale and b_scale_rows % cfg.block_n == 0, SKEW=cfg.skew, TMA_STORE=tma_store,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **COMPILE_OPTIONS)
    return out


__all__ = ["tma_fp8_gemm", "TmaGemmConfig", "config_from_tuning"]
