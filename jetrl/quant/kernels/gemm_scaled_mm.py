"""cuBLAS blockwise FP8 GEMM through ``torch.nn.functional.scaled_mm`` on sm_90.

cuBLAS (12.9+) multiplies E4M3 operands with fp32 block scales on Hopper for two pairings, which are
exactly jetrl's three GEMMs:

* (1x128) x (128x128): Fprop ``x @ W^T`` and DGrad ``dy @ W`` (``b`` = W or W^T with 128x128 tiles);
* (1x128) x (1x128): WGrad ``dy^T @ x``, both operands grouped by 128 along the token dimension.

The layout rules live here and nowhere else (callers pass :class:`Fp8Tensor` pairs in jetrl's layout):

* ``a`` (M, K) row-major; its (M, K/128) scales "outer-dim-major" (stride (1, M)); M a multiple of 4.
  jetrl's 1x128 producers allocate M rounded up to 4 rows (``quantize_triton.act_buffers``), and the GEMM
  runs on those buffers' padded views: the extra rows are read as they are and the output rows they make
  are dropped (rows of a product are independent). Other operands are zero-padded here (a copy);
* ``b`` (N, K) row-major, handed to cuBLAS as the column-major ``b.T``; 1x128 scales (N, K/128)
  outer-dim-major; 128x128 scales as a (L4, N/128) view of a row-major (N/128, L4) buffer whose
  K/128 dim is zero-padded to L4, a multiple of 4 (the weight quantizer allocates it so, once per weight
  version; other scales are padded here, a copy per call);
* K a multiple of 128 and N a multiple of 16 (128 for 128x128 ``b``): other shapes go to the Triton
  GEMM (see :func:`supports`).

Scales are decode scales (``x ~= data * scale``), which is what cuBLAS multiplies by.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from jetrl.quant.formats import ACT, E4M3, WEIGHT, Fp8Tensor

# the blockwise recipes by name (``F.scaled_mm`` with ``F.ScalingType``: torch >= 2.11, the project's floor)
_ACT_RECIPE = F.ScalingType.BlockWise1x128
_TILE_RECIPE = F.ScalingType.BlockWise128x128


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def is_available(device: torch.device) -> bool:
    """cuBLAS blockwise scaling exists on sm_90 only (PyTorch rejects it elsewhere)."""
    return device.type == "cuda" and _is_sm90(device.index if device.index is not None else torch.cuda.current_device())


@functools.lru_cache(maxsize=None)
def _is_sm90(index: int) -> bool:
    return torch.cuda.get_device_capability(index) == (9, 0)


def supports(a: Fp8Tensor, b: Fp8Tensor) -> bool:
    """Whether ``a @ b.T`` fits cuBLAS's blockwise constraints (shape-wise; see the module docstring)."""
    if a.block != ACT or b.block not in (ACT, WEIGHT) or a.data.dtype != E4M3 or b.data.dtype != E4M3:
        return False
    k, n = a.shape[1], b.shape[0]
    if k == 0 or k % 128 or a.shape[0] == 0 or n == 0:
        return False
    return n % (128 if b.block == WEIGHT else 16) == 0


def _outer_dim_major(scale: torch.Tensor) -> torch.Tensor:
    """A (R, C) scale with stride (1, R): the transposed view of a row-major (C, R) buffer."""
    if scale.stride(0) == 1 and (scale.stride(1) == scale.shape[0] or scale.shape[1] == 1):
        return scale
    return scale.t().contiguous().t()


def _fits(t: torch.Tensor, shape: tuple[int, int], stride: tuple[int, int]) -> bool:
    """Whether ``t``'s storage holds the ``as_strided(shape, stride)`` view from ``t``'s offset."""
    last = t.storage_offset() + sum((n - 1) * s for n, s in zip(shape, stride)) + 1
    return all(n > 0 for n in shape) and last * t.element_size() <= t.untyped_storage().nbytes()


def _tile_scale(scale: torch.Tensor) -> torch.Tensor:
    """(R/128, K/128) 128x128 scales -> cuBLAS's (L4, R/128) view with L4 = K/128 padded to 4: no copy where the
    scale is a view of a row-major (R/128, L4) buffer (as the weight quantizer makes it)."""
    rb, kb = scale.shape
    l4 = _round_up(kb, 4)
    if scale.stride() == (l4, 1) and _fits(scale, (rb, l4), (l4, 1)):
        return scale.as_strided((rb, l4), (l4, 1)).t()
    if l4 != kb:
        padded = scale.new_zeros((rb, l4))
        padded[:, :kb] = scale
        return padded.t()
    return scale.contiguous().t()


def _rows_view(data: torch.Tensor, scale: torch.Tensor, rows: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """A 1x128 operand of M rows as ``rows`` rows without a copy, where its buffers were allocated that long
    (row-major data, scales a view of a (K/128, rows) buffer); None otherwise. The extra rows hold whatever the
    buffers hold: they only make output rows that are dropped."""
    k, kb = data.shape[1], scale.shape[1]
    if (data.stride() != (k, 1) or scale.stride() != (1, rows) or not _fits(data, (rows, k), (k, 1))
            or not _fits(scale, (rows, kb), (1, rows))):
        return None
    return data.as_strided((rows, k), (k, 1)), scale.as_strided((rows, kb), (1, rows))


def _pad_rows(data: torch.Tensor, scale: torch.Tensor, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Zero-pad a 1x128 operand to ``rows`` rows (data rows 0, scales 1): a copy."""
    m, k = data.shape
    padded = data.new_zeros((rows, k))
    padded[:m] = data
    scale_buf = scale.new_ones((scale.shape[1], rows))
    scale_buf[:, :m] = scale.t()
    return padded, scale_buf.t()


def act_operand(a: Fp8Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A 1x128 ``a``'s data (row-major) and its outer-dim-major scales over M rounded up to 4 rows: views where
    jetrl's producers allocated them so, a zero-padded copy otherwise (the layout cuBLAS's and DeepGEMM's blockwise
    GEMMs read)."""
    m = a.shape[0]
    view = _rows_view(a.data, a.scale, _round_up(m, 4)) if m % 4 else None
    if view is not None:
        return view
    data = a.data if a.data.is_contiguous() else a.data.contiguous()
    scale = _outer_dim_major(a.scale)
    if m % 4:
        data, scale = _pad_rows(data, scale, _round_up(m, 4))
    return data, scale


def _call(a: torch.Tensor, b_t: torch.Tensor, sa: torch.Tensor, sb: torch.Tensor, b_is_tile: bool,
          out_dtype: torch.dtype) -> torch.Tensor:
    return F.scaled_mm(a, b_t, sa, _ACT_RECIPE, sb, _TILE_RECIPE if b_is_tile else _ACT_RECIPE, output_dtype=out_dtype)


def blockwise_scaled_mm(a: Fp8Tensor, b: Fp8Tensor, out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """``a @ b.T`` on cuBLAS; ``a`` 1x128, ``b`` 128x128 or 1x128 (check :func:`supports` first)."""
    if not supports(a, b):
        raise ValueError(f"cuBLAS blockwise GEMM does not support a {tuple(a.shape)} {a.block} x "
                         f"b {tuple(b.shape)} {b.block}; K must be a multiple of 128, N of 16 (128 for tiles)")
    m = a.shape[0]
    a_data, a_scale = act_operand(a)
    b_data = b.data if b.data.is_contiguous() else b.data.contiguous()
    b_scale = _tile_scale(b.scale) if b.block == WEIGHT else _outer_dim_major(b.scale)
    out = _call(a_data, b_data.t(), a_scale, b_scale, b.block == WEIGHT, out_dtype)
    return out[:m] if out.shape[0] != m else out
