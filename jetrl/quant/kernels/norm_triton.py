"""Triton kernels of the fused residual add + RMSNorm (+ 1x128 FP8 of the output) and its backward.

Forward, per tile of ``BLOCK_M`` rows (one row for long rows, several for short ones such as the
per-head q/k norm over ``head_dim``), in fp32 as :func:`jetrl.quant.norm.rms_norm_reference` does:

* ``h = dtype(fp32(x) + fp32(residual))`` (torch's add: fp32 math, one rounding), stored as the new
  residual stream;
* ``rstd = rsqrt(sum(h^2) / D + eps)``: the only step whose order differs from torch's (the sum of
  squares), so ``out`` may differ from the reference by one ulp where a value sits on a rounding edge;
* ``normed = dtype(h * rstd)``, ``out = out_dtype(weight * normed)``;
* optionally ``out``'s 1x128 E4M3 quantization with the helpers of :mod:`jetrl.quant.kernels.quantize_triton`,
  bitwise ``reference.quantize`` of the stored ``out``, in the layout
  :func:`jetrl.quant.kernels.quantize_triton.quantize_act_1x128` gives the GEMMs (``act_buffers``).

Rows up to ``max_tile`` elements (a keyword of :func:`rms_norm_forward` / :func:`rms_norm_backward`, by
default ``MAX_FWD_TILE`` / ``MAX_BWD_TILE``) stay in registers; longer rows are walked in chunks of that size
(a first pass for the sum of squares, a second one recomputing ``h``).

Backward (fp32): ``dn = g * w``, ``n = h * rstd``, ``dh = rstd * (dn - n * mean(dn * n)) (+ grad of the
residual output)``; ``dweight`` = per-program partial sums of ``g * normed`` (fp32), summed by torch.
``h`` is the saved residual stream (or ``x``), ``rstd`` the forward's: no reduction is repeated.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from jetrl.quant.formats import ACT, BLOCK_SIZE, Fp8Tensor
from jetrl.quant.kernels.decode_splits import sm_count
from jetrl.quant.kernels.quantize_triton import _block_scale, _cdiv, _quantize_e4m3, act_buffers
from jetrl.quant.kernels.quantize_triton import cast_rne as _cast  # RNE to bf16 under the interpreter too
from jetrl.quant.kernels.tuning import COMPILE_OPTIONS, pdl_args


# Longest row held in registers (power of two, >= 128); chosen so that ptxas (sm_90) spills no register with 16
# warps (16 elements per thread forward, 8 backward). The backward holds more live tensors per element. Constants: the
# defaults of the wrappers' ``max_tile`` keyword (pass a smaller one, e.g. to test the chunked path).
MAX_FWD_TILE = 8192
MAX_BWD_TILE = 4096
# elements per program for short rows (e.g. the per-head norm over head_dim): rows are grouped up to this
ROWS_TILE_FWD = 4096
ROWS_TILE_BWD = 2048
BWD_PROGRAMS_PER_SM = 2


# --------------------------------------------------------------------------------------------------
# device helpers


@triton.jit
def _load_h(x_ptr, r_ptr, h_ptr, offs, mask, HAS_RES: tl.constexpr, STORE_H: tl.constexpr):
    """fp32 of ``h = x + residual`` rounded to x's dtype (stored when ``STORE_H``), or of ``x``."""
    x = tl.load(x_ptr + offs, mask=mask, other=0.0)
    if HAS_RES:
        r = tl.load(r_ptr + offs, mask=mask, other=0.0)
        h = _cast(x.to(tl.float32) + r.to(tl.float32), x_ptr.dtype.element_ty)
        if STORE_H:
            tl.store(h_ptr + offs, h, mask=mask)
    else:
        h = x
    return h.to(tl.float32)


@triton.jit
def _rstd(sum_sq, D, eps):
    """``rsqrt(sum_sq / D + eps)`` with an IEEE division (Triton's ``/`` on fp32 is approximate)."""
    mean = tl.div_rn(sum_sq, tl.zeros_like(sum_sq) + D)
    return tl.math.rsqrt(mean + eps)


@triton.jit
def _normalize_store(
    h, rstd, x_ptr, w_ptr, out_ptr, q_ptr, qs_ptr, rows, cols, row_ok, col_ok, QS_M, D, chunk,
    QUANT: tl.constexpr, POW2: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, QG: tl.constexpr,
):
    """Store ``out = weight * dtype(h * rstd)`` for one (BLOCK_M, BLOCK_D) tile and its 1x128 FP8."""
    normed = _cast(h * rstd[:, None], x_ptr.dtype.element_ty)
    w = tl.load(w_ptr + cols, mask=col_ok, other=0.0)
    out = _cast(w.to(tl.float32)[None, :] * normed.to(tl.float32), out_ptr.dtype.element_ty)
    mask = row_ok[:, None] & col_ok[None, :]
    offs = rows[:, None] * D + cols[None, :]
    tl.store(out_ptr + offs, out, mask=mask)
    if QUANT:
        # masked lanes hold 0 (x and weight load 0), like the reference's zero padding of a partial block
        o = tl.reshape(out.to(tl.float32), (BLOCK_M, BLOCK_D // QG, QG))
        scale = _block_scale(tl.max(tl.abs(o), axis=2), POW2)  # (BLOCK_M, BLOCK_D // QG)
        q = tl.reshape(_quantize_e4m3(o, scale[:, :, None], POW2), (BLOCK_M, BLOCK_D))
        tl.store(q_ptr + offs, q, mask=mask)
        grp = chunk * (BLOCK_D // QG) + tl.arange(0, BLOCK_D // QG)
        tl.store(qs_ptr + grp[None, :].to(tl.int64) * QS_M + rows[:, None], scale,
                 mask=row_ok[:, None] & (grp[None, :] * QG < D))


@triton.jit
def _load_bwd_chunk(h_ptr, g_ptr, w_ptr, rows, cols, row_ok, D):
    """fp32 ``h``, ``g`` (rows x cols) and ``w`` (cols) of a chunked backward tile, 0 where masked, with the tile's
    ``col_ok``, mask and offsets."""
    col_ok = cols < D
    mask = row_ok[:, None] & col_ok[None, :]
    offs = rows[:, None] * D + cols[None, :]
    h = tl.load(h_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
    return h, g, w, col_ok, mask, offs


# --------------------------------------------------------------------------------------------------
# kernels


@triton.jit(do_not_specialize=["M", "QS_M"])
def _rms_norm_fwd_kernel(
    x_ptr, r_ptr, w_ptr, out_ptr, h_ptr, rstd_ptr, q_ptr, qs_ptr,
    M, D, eps, QS_M,
    HAS_RES: tl.constexpr, QUANT: tl.constexpr, POW2: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, NUM_CHUNKS: tl.constexpr, QG: tl.constexpr,
    PDL: tl.constexpr,
):
    """One tile of BLOCK_M rows: residual add, sum of squares, rstd, normalise, weight, FP8. Inputs and
    outputs are row-major (M, D) with row stride D; the FP8 scales go to a (Db, QS_M) buffer."""
    if PDL:  # a programmatic dependent (tuning.decode_gemm_pdl): wait for the kernel before (a decode GEMM may
        gdc_wait()  # still be writing this one's input), then let the next one (a decode GEMM) launch
        gdc_launch_dependents()
    pid = tl.program_id(0)
    rm = pid * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rm < M
    rows = rm.to(tl.int64)
    cols0 = tl.arange(0, BLOCK_D)
    if NUM_CHUNKS == 1:
        col_ok = cols0 < D
        mask = row_ok[:, None] & col_ok[None, :]
        h = _load_h(x_ptr, r_ptr, h_ptr, rows[:, None] * D + cols0[None, :], mask, HAS_RES, True)
        rstd = _rstd(tl.sum(h * h, axis=1), D, eps)
        tl.store(rstd_ptr + rows, rstd, mask=row_ok)
        _normalize_store(h, rstd, x_ptr, w_ptr, out_ptr, q_ptr, qs_ptr, rows, cols0, row_ok, col_ok, QS_M, D, 0,
                         QUANT, POW2, BLOCK_M, BLOCK_D, QG)
    else:
        sum_sq = tl.zeros((BLOCK_M,), dtype=tl.float32)
        for c in range(NUM_CHUNKS):
            cols = c * BLOCK_D + cols0
            mask = row_ok[:, None] & (cols < D)[None, :]
            h = _load_h(x_ptr, r_ptr, h_ptr, rows[:, None] * D + cols[None, :], mask, HAS_RES, True)
            sum_sq += tl.sum(h * h, axis=1)
        rstd = _rstd(sum_sq, D, eps)
        tl.store(rstd_ptr + rows, rstd, mask=row_ok)
        for c in range(NUM_CHUNKS):
            cols = c * BLOCK_D + cols0
            col_ok = cols < D
            mask = row_ok[:, None] & col_ok[None, :]
            h = _load_h(x_ptr, r_ptr, h_ptr, rows[:, None] * D + cols[None, :], mask, HAS_RES, False)
            _normalize_store(h, rstd, x_ptr, w_ptr, out_ptr, q_ptr, qs_ptr, rows, cols, row_ok, col_ok, QS_M, D, c,
                             QUANT, POW2, BLOCK_M, BLOCK_D, QG)


@triton.jit(do_not_specialize=["M"])
def _rms_norm_bwd_kernel(
    g_ptr, gr_ptr, h_ptr, w_ptr, rstd_ptr, dh_ptr, dw_ptr,
    M, D,
    HAS_GRES: tl.constexpr, COMPUTE_DW: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, NUM_CHUNKS: tl.constexpr, TILES: tl.constexpr,
):
    """Row tiles pid * TILES .. pid * TILES + TILES - 1 (those past M masked): ``dh`` per row, and this
    program's partial ``dweight``, row pid of a (P, D) fp32 buffer (zero-initialised when chunked). All
    (M, D) tensors row-major with row stride D."""
    pid = tl.program_id(0)
    cols0 = tl.arange(0, BLOCK_D)
    if NUM_CHUNKS == 1:
        col_ok = cols0 < D
        w = tl.load(w_ptr + cols0, mask=col_ok, other=0.0).to(tl.float32)
        dw = tl.zeros((BLOCK_D,), dtype=tl.float32)
        for i in range(TILES):
            rm = (pid * TILES + i) * BLOCK_M + tl.arange(0, BLOCK_M)
            row_ok = rm < M
            rows = rm.to(tl.int64)
            mask = row_ok[:, None] & col_ok[None, :]
            offs = rows[:, None] * D + cols0[None, :]
            h = tl.load(h_ptr + offs, mask=mask, other=0.0).to(tl.float32)
            g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
            rstd = tl.load(rstd_ptr + rows, mask=row_ok, other=0.0)
            n = h * rstd[:, None]
            dn = g * w[None, :]
            c = tl.div_rn(tl.sum(dn * n, axis=1), tl.zeros_like(rstd) + D)
            dh = rstd[:, None] * (dn - n * c[:, None])
            if HAS_GRES:
                dh += tl.load(gr_ptr + offs, mask=mask, other=0.0).to(tl.float32)
            tl.store(dh_ptr + offs, _cast(dh, dh_ptr.dtype.element_ty), mask=mask)
            if COMPUTE_DW:
                dw += tl.sum(g * _cast(n, h_ptr.dtype.element_ty).to(tl.float32), axis=0)
        if COMPUTE_DW:
            tl.store(dw_ptr + pid.to(tl.int64) * D + cols0, dw, mask=col_ok)
    else:
        for i in range(TILES):
            rm = (pid * TILES + i) * BLOCK_M + tl.arange(0, BLOCK_M)
            row_ok = rm < M
            rows = rm.to(tl.int64)
            rstd = tl.load(rstd_ptr + rows, mask=row_ok, other=0.0)
            dot = tl.zeros((BLOCK_M,), dtype=tl.float32)
            for ch in range(NUM_CHUNKS):
                h, g, w, _, _, _ = _load_bwd_chunk(h_ptr, g_ptr, w_ptr, rows, ch * BLOCK_D + cols0, row_ok, D)
                dot += tl.sum(g * w[None, :] * (h * rstd[:, None]), axis=1)
            c = tl.div_rn(dot, tl.zeros_like(rstd) + D)
            for ch in range(NUM_CHUNKS):
                cols = ch * BLOCK_D + cols0
                h, g, w, col_ok, mask, offs = _load_bwd_chunk(h_ptr, g_ptr, w_ptr, rows, cols, row_ok, D)
                n = h * rstd[:, None]
                dh = rstd[:, None] * (g * w[None, :] - n * c[:, None])
                if HAS_GRES:
                    dh += tl.load(gr_ptr + offs, mask=mask, other=0.0).to(tl.float32)
                tl.store(dh_ptr + offs, _cast(dh, dh_ptr.dtype.element_ty), mask=mask)
                if COMPUTE_DW:
                    # this program's own row of the partial buffer: each lane re-reads what it wrote
                    dw_ptrs = dw_ptr + pid.to(tl.int64) * D + cols
                    part = tl.sum(g * _cast(n, h_ptr.dtype.element_ty).to(tl.float32), axis=0)
                    tl.store(dw_ptrs, tl.load(dw_ptrs, mask=col_ok, other=0.0) + part, mask=col_ok)


# --------------------------------------------------------------------------------------------------
# host wrappers


def _check_max_tile(max_tile: int) -> None:
    """A tile is a power of two of at least one 1x128 quantization group."""
    if (isinstance(max_tile, bool) or not isinstance(max_tile, int) or max_tile < BLOCK_SIZE
            or max_tile & (max_tile - 1)):
        raise ValueError(f"max_tile must be a power-of-two int >= {BLOCK_SIZE}, got {max_tile!r}")


def _tile(m: int, d: int, max_tile: int, rows_tile: int) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_D, NUM_CHUNKS, num_warps): whole rows when they fit ``max_tile``, short rows
    grouped up to ``rows_tile`` elements per program, long rows walked in chunks."""
    block_d = triton.next_power_of_2(d)
    chunks = 1
    if block_d > max_tile:
        block_d, chunks = max_tile, _cdiv(d, max_tile)
    block_m = max(1, min(rows_tile // block_d, triton.next_power_of_2(max(m, 1))))
    num_warps = min(16, max(1, block_m * block_d // 256))  # about 8 elements per thread
    return block_m, block_d, chunks, num_warps


def _check_rows(t: torch.Tensor, name: str) -> None:
    if t.dim() != 2 or not t.is_contiguous():
        raise ValueError(f"{name} must be a contiguous 2-D (M, D) tensor, got shape {tuple(t.shape)}, "
                         f"strides {t.stride()}")


def rms_norm_forward(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float,
    quantize: bool = False, pow2_scale: bool = False, *, max_tile: int = MAX_FWD_TILE,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, Fp8Tensor | None]:
    """Fused forward on (M, D) rows. Returns ``(out, h, rstd, out_fp8)``: ``h`` the new residual stream
    (None without ``residual``), ``rstd`` (M,) fp32, ``out_fp8`` only with ``quantize``. ``max_tile``: the
    longest row held in registers (a power of two >= 128); longer rows are walked in chunks of that size."""
    _check_max_tile(max_tile)
    x = x if x.is_contiguous() else x.contiguous()
    _check_rows(x, "x")
    if residual is not None:
        residual = residual if residual.is_contiguous() else residual.contiguous()
        _check_rows(residual, "residual")
    weight = weight if weight.is_contiguous() else weight.contiguous()
    m, d = x.shape
    device = x.device
    out = torch.empty((m, d), dtype=torch.promote_types(weight.dtype, x.dtype), device=device)
    h = torch.empty((m, d), dtype=x.dtype, device=device) if residual is not None else None
    rstd = torch.empty((m,), dtype=torch.float32, device=device)
    q_data, q_scale = act_buffers(m, d, device) if quantize else (None, None)
    if m:
        block_m, block_d, chunks, num_warps = _tile(m, d, max_tile, ROWS_TILE_FWD)
        _rms_norm_fwd_kernel[(_cdiv(m, block_m),)](
            x, residual if residual is not None else x, weight, out, h if h is not None else x, rstd,
            q_data if quantize else out, q_scale if quantize else rstd,
            m, d, eps, q_scale.shape[1] if quantize else m,
            HAS_RES=residual is not None, QUANT=quantize, POW2=pow2_scale,
            BLOCK_M=block_m, BLOCK_D=block_d, NUM_CHUNKS=chunks, QG=min(BLOCK_SIZE, block_d),
            num_warps=num_warps, **COMPILE_OPTIONS, **pdl_args(device, quantize))
    return out, h, rstd, Fp8Tensor(q_data, q_scale[:, :m].t(), ACT) if quantize else None


def _programs(device: torch.device) -> int:
    """Backward programs: a few per SM on the GPU (each reduces its rows' share of dweight), 4 on the CPU."""
    return sm_count(device) * BWD_PROGRAMS_PER_SM if device.type == "cuda" else 4


def rms_norm_backward(
    grad_out: torch.Tensor, grad_h: torch.Tensor | None, h: torch.Tensor, weight: torch.Tensor,
    rstd: torch.Tensor, compute_dweight: bool = True, *, max_tile: int = MAX_BWD_TILE,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Fused backward. ``grad_h`` is the grad of the returned residual stream (None if unused). Returns
    ``(grad_h_total, grad_weight)``: the gradient of ``x`` (and of the input residual), in h's dtype, and of
    ``weight`` in its dtype (None unless asked). ``max_tile`` as in :func:`rms_norm_forward` (default
    ``MAX_BWD_TILE``)."""
    _check_max_tile(max_tile)
    m, d = h.shape
    grad_out, grad_h = grad_out.contiguous(), grad_h.contiguous() if grad_h is not None else None
    dh = torch.empty((m, d), dtype=h.dtype, device=h.device)
    if m == 0:
        dw = torch.zeros((d,), dtype=weight.dtype, device=h.device) if compute_dweight else None
        return dh, dw
    block_m, block_d, chunks, num_warps = _tile(m, d, max_tile, ROWS_TILE_BWD)
    # a power-of-two number of row tiles per program keeps the number of compiled variants small
    tiles = triton.next_power_of_2(_cdiv(_cdiv(m, block_m), _programs(h.device)))
    programs = _cdiv(_cdiv(m, block_m), tiles)
    dw_partial = None
    if compute_dweight:
        alloc = torch.zeros if chunks > 1 else torch.empty
        dw_partial = alloc((programs, d), dtype=torch.float32, device=h.device)
    _rms_norm_bwd_kernel[(programs,)](
        grad_out, grad_h if grad_h is not None else grad_out, h, weight, rstd, dh,
        dw_partial if dw_partial is not None else rstd, m, d, HAS_GRES=grad_h is not None, COMPUTE_DW=compute_dweight,
        BLOCK_M=block_m, BLOCK_D=block_d, NUM_CHUNKS=chunks, TILES=tiles, num_warps=num_warps, **COMPILE_OPTIONS)
    dw = dw_partial.sum(0).to(weight.dtype) if dw_partial is not None else None
    return dh, dw
