"""Triton kernel of the half-split rotary embedding, q and k in one launch, forward or backward.

With ``x1 = x[..., :half]``, ``x2 = x[..., half:]`` and ``rnd`` the rounding to the tensor dtype, the
unfused ``x * cos + cat(-x2, x1) * sin`` computes, per element, in fp32 then rounded::

    out1 = rnd(rnd(x1 * cos1) + rnd(-x2 * sin1))      out2 = rnd(rnd(x2 * cos2) + rnd(x1 * sin2))

and autograd of it, for an incoming gradient g, ``g * cos + rot^T(g * sin)``::

    dx1 = rnd(rnd(g1 * cos1) + rnd(g2 * sin2))        dx2 = rnd(rnd(g2 * cos2) + rnd(-g1 * sin1))

(autograd adds the zero-padded slices of ``rnd(g * sin)`` to ``rnd(g * cos)``: one rounding per element).
The kernel does exactly these operations, so both directions are bitwise the unfused results. Contraction
of multiply-adds into fma is switched off at launch (``enable_fp_fusion=False``): with fp32 tensors the
roundings are no-ops and the compiler would otherwise fuse ``x1 * cos1 + ...`` into one fma. The roundings
are :func:`~jetrl.quant.kernels.quantize_triton.cast_rne`'s, nearest even under the interpreter too.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_wait

from jetrl.quant.kernels import tuning
from jetrl.quant.kernels.quantize_triton import cast_rne

MAX_TILE = 2048  # elements per half-tile (BLOCK_H * BLOCK_HALF): registers for four fp32 tiles at 4 warps


@triton.jit
def _rnd(x, dtype: tl.constexpr):
    """Round fp32 ``x`` to ``dtype`` (nearest even) and back to fp32; the identity for fp32."""
    return cast_rne(x, dtype).to(tl.float32)


@triton.jit
def _rotate_heads(
    x_ptr, out_ptr, cos_ptr, sin_ptr, n, h0, H, HALF,
    stride_xn, stride_xh, stride_xd, stride_cn, stride_cd, stride_sn, stride_sd,
    BACKWARD: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr,
):
    """Heads ``h0 .. h0 + BLOCK_H`` of token ``n`` of one tensor (strided (N, H, D)) into ``out``
    (contiguous (N, H, D))."""
    rd = tl.arange(0, BLOCK_HALF)
    d_ok = rd < HALF
    c_row = cos_ptr + n * stride_cn
    s_row = sin_ptr + n * stride_sn
    cos1 = tl.load(c_row + rd * stride_cd, mask=d_ok, other=0.0).to(tl.float32)[None, :]
    cos2 = tl.load(c_row + (rd + HALF) * stride_cd, mask=d_ok, other=0.0).to(tl.float32)[None, :]
    sin1 = tl.load(s_row + rd * stride_sd, mask=d_ok, other=0.0).to(tl.float32)[None, :]
    sin2 = tl.load(s_row + (rd + HALF) * stride_sd, mask=d_ok, other=0.0).to(tl.float32)[None, :]
    if BACKWARD:  # out1 pairs x2 with sin2, out2 pairs -x1 with sin1
        sin_a = sin2
        sin_b = sin1
        sign_a = 1.0
    else:  # out1 pairs -x2 with sin1, out2 pairs x1 with sin2
        sin_a = sin1
        sin_b = sin2
        sign_a = -1.0
    rh = h0 + tl.arange(0, BLOCK_H)
    mask = (rh < H)[:, None] & d_ok[None, :]
    src = x_ptr + n * stride_xn + rh[:, None] * stride_xh + rd[None, :] * stride_xd
    x1 = tl.load(src, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF * stride_xd, mask=mask, other=0.0).to(tl.float32)
    dt = out_ptr.dtype.element_ty
    out1 = _rnd(_rnd(x1 * cos1, dt) + _rnd((sign_a * x2) * sin_a, dt), dt)
    out2 = _rnd(_rnd(x2 * cos2, dt) + _rnd((-sign_a * x1) * sin_b, dt), dt)
    dst = out_ptr + n * (H * 2 * HALF) + rh[:, None] * (2 * HALF) + rd[None, :]
    tl.store(dst, out1.to(dt), mask=mask)  # exact: out1 is on the dtype's grid
    tl.store(dst + HALF, out2.to(dt), mask=mask)


@triton.jit
def _rope_qk_kernel(
    q_ptr, k_ptr, q_out_ptr, k_out_ptr, cos_ptr, sin_ptr,
    HQ, HK, HALF, NUM_QB,
    stride_qn, stride_qh, stride_qd, stride_kn, stride_kh, stride_kd,
    stride_cn, stride_cd, stride_sn, stride_sd,
    BACKWARD: tl.constexpr,
    BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr, BLOCK_HALF: tl.constexpr, PDL: tl.constexpr = False,
):
    """Program (n, j) rotates token n's q heads block j (j < NUM_QB), else its k heads block j - NUM_QB."""
    if PDL:  # a programmatic dependent (tuning.decode_gemm_pdl): the q/k/v GEMM before may still be writing q and k
        gdc_wait()
    n = tl.program_id(0).to(tl.int64)
    j = tl.program_id(1)
    if j < NUM_QB:
        _rotate_heads(q_ptr, q_out_ptr, cos_ptr, sin_ptr, n, j * BLOCK_HQ, HQ, HALF, stride_qn, stride_qh, stride_qd,
                      stride_cn, stride_cd, stride_sn, stride_sd, BACKWARD, BLOCK_HQ, BLOCK_HALF)
    else:
        _rotate_heads(k_ptr, k_out_ptr, cos_ptr, sin_ptr, n, (j - NUM_QB) * BLOCK_HK, HK, HALF,
                      stride_kn, stride_kh, stride_kd, stride_cn, stride_cd, stride_sn, stride_sd, BACKWARD, BLOCK_HK,
                      BLOCK_HALF)


def _block_h(heads: int, block_half: int) -> int:
    return max(1, min(triton.next_power_of_2(max(heads, 1)), MAX_TILE // block_half))


def rope_qk(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
            backward: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q (N, Hq, D) and k (N, Hkv, D) (any strides) by cos/sin (N, D); new contiguous outputs.

    ``backward``: apply the transposed rotation to incoming gradients instead (RoPE is linear).
    """
    n, hq, d = q.shape
    hk = k.shape[1]
    q_out = torch.empty((n, hq, d), dtype=q.dtype, device=q.device)
    k_out = torch.empty((n, hk, d), dtype=k.dtype, device=k.device)
    if n == 0 or d == 0 or hq + hk == 0:
        return q_out, k_out
    half = d // 2
    block_half = triton.next_power_of_2(half)
    block_hq, block_hk = _block_h(hq, block_half), _block_h(hk, block_half)
    num_qb, num_kb = -(-hq // block_hq), -(-hk // block_hk)
    _rope_qk_kernel[(n, num_qb + num_kb)](
        q, k, q_out, k_out, cos, sin, hq, hk, half, num_qb,
        *q.stride()[:3], *k.stride()[:3], *cos.stride()[:2], *sin.stride()[:2], BACKWARD=backward,
        BLOCK_HQ=block_hq, BLOCK_HK=block_hk, BLOCK_HALF=block_half, num_warps=4, enable_fp_fusion=False,
        **tuning.pdl_args(q.device))
    return q_out, k_out
