"""Triton kernels of the fused SwiGLU ``silu(gate) * up``: forward (optionally with its 1x128 FP8) and backward.

Op for op the arithmetic of the unfused PyTorch code ``F.silu(gate) * up`` on CUDA, so the results are
the same bits:

* ``silu``: ATen computes ``x / (1 + exp(-x))`` in fp32 (``expf`` of CUDA's math library, an IEEE
  division) and rounds to the tensor dtype; here ``libdevice.exp`` (the same ``__nv_expf``) and
  ``tl.div_rn`` (Triton's ``/`` on fp32 is approximate).
* the product: ``silu`` (already rounded) times ``up`` in fp32, rounded to the dtype.
* FP8 (``QUANTIZE``): the 1x128 quantization of the rounded output, with the jitted helpers of
  :mod:`jetrl.quant.kernels.quantize_triton` (bitwise the reference's quantization of the returned tensor).
* backward: autograd of the unfused code rounds ``g * up`` and ``g * silu`` to the dtype, then ATen's
  ``silu_backward`` computes ``dy * s * (1 + x * (1 - s))`` with ``s = 1 / (1 + exp(-x))`` in fp32, which
  nvcc contracts to ``(dy * s) * fma(x, 1 - s, 1)``; the kernel does exactly that.

Floating-point contraction is switched off at launch (``enable_fp_fusion=False``) so that no other
multiply-add is fused behind our back; the one fma above is explicit.

Under ``TRITON_INTERPRET=1`` (CPU tests): ``exp`` is NumPy's (libdevice does not exist there); the roundings are
:func:`~jetrl.quant.kernels.quantize_triton.cast_rne`'s, nearest even under the interpreter too.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from jetrl.quant.kernels import tuning
from jetrl.quant.kernels.quantize_triton import _block_scale, _cdiv, _quantize_e4m3, act_buffers, cast_rne


BLOCK_K = 128  # one 1x128 scale block per program along the columns
_BLOCK_K = tl.constexpr(BLOCK_K)
_INTERPRET = tl.constexpr(tuning.interpreting())


@triton.jit
def _exp(x):
    """fp32 ``exp`` as CUDA's ``expf`` (libdevice); NumPy's under the interpreter."""
    if _INTERPRET:
        return tl.exp(x)
    else:
        return libdevice.exp(x)


@triton.jit(do_not_specialize=["M", "SCALE_M"])
def _swiglu_fwd_kernel(
    gate_ptr, up_ptr, out_ptr, q_ptr, scale_ptr,
    M, K, stride_gm, stride_um, SCALE_M,
    POW2: tl.constexpr, QUANTIZE: tl.constexpr, BLOCK_M: tl.constexpr,
    PDL: tl.constexpr, WRITE_OUT: tl.constexpr,
):
    """One (BLOCK_M, 128) tile: ``out = rnd(rnd(silu(gate)) * up)`` and its 1x128 FP8 (data row-major
    (M, K), scales into a (Kb, SCALE_M) buffer); ``out`` stored only with ``WRITE_OUT`` (``out_ptr`` otherwise only
    names the dtype)."""
    if PDL:  # a programmatic dependent (tuning.decode_gemm_pdl): wait for the kernel before (a decode GEMM may
        gdc_wait()  # still be writing this one's input), then let the next one (a decode GEMM) launch
        gdc_launch_dependents()
    pid_m = tl.program_id(0)
    pid_k = tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rk = pid_k * _BLOCK_K + tl.arange(0, _BLOCK_K)
    mask = (rm[:, None] < M) & (rk[None, :] < K)
    rows = rm[:, None].to(tl.int64)
    gate = tl.load(gate_ptr + rows * stride_gm + rk[None, :], mask=mask, other=0.0).to(tl.float32)
    up = tl.load(up_ptr + rows * stride_um + rk[None, :], mask=mask, other=0.0).to(tl.float32)
    silu = cast_rne(tl.div_rn(gate, 1.0 + _exp(-gate)), out_ptr.dtype.element_ty).to(tl.float32)
    out = cast_rne(silu * up, out_ptr.dtype.element_ty)
    if WRITE_OUT:
        tl.store(out_ptr + rows * K + rk[None, :], out, mask=mask)
    if QUANTIZE:
        x = out.to(tl.float32)  # masked lanes are silu(0) * 0 = 0, like the reference's zero padding
        scale = _block_scale(tl.max(tl.abs(x), axis=1), POW2)  # (BLOCK_M,)
        tl.store(q_ptr + rows * K + rk[None, :], _quantize_e4m3(x, scale[:, None], POW2), mask=mask)
        tl.store(scale_ptr + pid_k * SCALE_M + rm, scale, mask=rm < M)


@triton.jit
def _swiglu_grad_values(g, x, up, dt: tl.constexpr):
    """``(d gate, d up)`` from fp32 values of the incoming gradient ``g``, ``gate`` (``x``) and ``up``, as fp32 values
    on ``dt``'s grid: ``d up = rnd(g * rnd(silu(gate)))`` and ``d gate = silu'(gate) * rnd(g * up)`` rounded where
    autograd of the unfused code rounds (the module doc)."""
    e = 1.0 + _exp(-x)
    silu = cast_rne(tl.div_rn(x, e), dt).to(tl.float32)
    d_up = cast_rne(g * silu, dt).to(tl.float32)
    d_silu = cast_rne(g * up, dt).to(tl.float32)
    s = tl.div_rn(tl.full(x.shape, 1.0, tl.float32), e)
    slope = tl.fma(x, 1.0 - s, 1.0)  # as nvcc contracts ATen's silu_backward
    d_gate = cast_rne((d_silu * s) * slope, dt).to(tl.float32)
    return d_gate, d_up


@triton.jit(do_not_specialize=["M"])
def _swiglu_bwd_kernel(
    grad_ptr, gate_ptr, up_ptr, dgate_ptr, dup_ptr,
    M, K, stride_grm, stride_gm, stride_um, stride_dgm, stride_dum,
    BLOCK_M: tl.constexpr,
):
    """One (BLOCK_M, 128) tile of ``d gate = silu'(gate) * rnd(g * up)`` and ``d up = rnd(g * rnd(silu(gate)))``."""
    pid_m = tl.program_id(0)
    pid_k = tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rk = pid_k * _BLOCK_K + tl.arange(0, _BLOCK_K)
    mask = (rm[:, None] < M) & (rk[None, :] < K)
    rows = rm[:, None].to(tl.int64)
    g = tl.load(grad_ptr + rows * stride_grm + rk[None, :], mask=mask, other=0.0).to(tl.float32)
    x = tl.load(gate_ptr + rows * stride_gm + rk[None, :], mask=mask, other=0.0).to(tl.float32)
    up = tl.load(up_ptr + rows * stride_um + rk[None, :], mask=mask, other=0.0).to(tl.float32)
    d_gate, d_up = _swiglu_grad_values(g, x, up, dgate_ptr.dtype.element_ty)
    # exact casts: the values are on the dtype's grid
    tl.store(dgate_ptr + rows * stride_dgm + rk[None, :], d_gate.to(dgate_ptr.dtype.element_ty), mask=mask)
    tl.store(dup_ptr + rows * stride_dum + rk[None, :], d_up.to(dup_ptr.dtype.element_ty), mask=mask)


def _block_m(m: int) -> int:
    return min(32, triton.next_power_of_2(max(m, 1)))


def swiglu_fwd(gate: torch.Tensor, up: torch.Tensor, quantize: bool = False, pow2_scale: bool = False,
               write_out: bool = True):
    """``silu(gate) * up`` for 2-D (M, K) ``gate``/``up`` with unit column stride (any row stride).

    Returns ``(out, data, scale)``: ``out`` (M, K) contiguous in gate's dtype; with ``quantize`` the 1x128
    E4M3 ``data`` (M, K) and fp32 ``scale`` (M, Kb) in the layout of
    :func:`jetrl.quant.kernels.quantize_triton.quantize_act_1x128`
    (:func:`~jetrl.quant.kernels.quantize_triton.act_buffers`), else ``None, None``. ``write_out=False`` (with
    ``quantize``): ``out`` is not written, and ``None`` is returned in its place (the caller's consumer reads the FP8
    only).
    """
    m, k = gate.shape
    out = torch.empty((m, k), dtype=gate.dtype, device=gate.device) if write_out else None
    data = scale_buf = None
    if quantize:
        data, scale_buf = act_buffers(m, k, gate.device)
    if m and k:
        block_m = _block_m(m)
        grid = (_cdiv(m, block_m), _cdiv(k, BLOCK_K))
        dest = out if write_out else gate  # unwritten: the pointer only names the output dtype
        _swiglu_fwd_kernel[grid](
            gate, up, dest, data if quantize else dest, scale_buf if quantize else dest,
            m, k, gate.stride(0), up.stride(0), scale_buf.shape[1] if quantize else m,
            POW2=pow2_scale, QUANTIZE=quantize, BLOCK_M=block_m, WRITE_OUT=write_out, num_warps=4,
            enable_fp_fusion=False, **tuning.pdl_args(gate.device, quantize))
    return out, data, scale_buf[:, :m].t() if quantize else None


def swiglu_bwd(grad: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, d_gate: torch.Tensor,
               d_up: torch.Tensor) -> None:
    """Write ``d gate`` and ``d up`` (M, K) into the given buffers (unit column stride, any row stride;
    they may be the two halves of one (M, 2K) buffer)."""
    m, k = gate.shape
    if m and k:
        block_m = _block_m(m)
        grid = (_cdiv(m, block_m), _cdiv(k, BLOCK_K))
        _swiglu_bwd_kernel[grid](
            grad, gate, up, d_gate, d_up,
            m, k, grad.stride(0), gate.stride(0), up.stride(0), d_gate.stride(0), d_up.stride(0),
            BLOCK_M=block_m, num_warps=4, enable_fp_fusion=False,
        )
