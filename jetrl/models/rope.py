"""Rotary position embedding of q and k in one kernel (forward and backward).

Unfused, ``apply_rope`` (the half-split convention of HF Llama/Qwen) costs about ten small kernels per
decoder layer (slices, a negation, a concatenation, two multiplies and an add, for q and again for k).
:func:`apply_rope_qk` rotates q and k in ONE Triton launch, reading them through their strides (views of
a fused qkv projection need no copy) and writing new contiguous tensors.

Numerics: :func:`apply_rope` below *is* the unfused model code and the specification. The kernel rounds
exactly where it does (``x * cos`` to the dtype, ``rotated * sin`` to the dtype, their sum to the dtype),
so the Triton forward is bitwise equal to it for bf16, fp16 and fp32. RoPE is linear in x; its backward is
``g * cos + rot^T(g * sin)`` with ``rot^T(v) = cat(v[..., half:], -v[..., :half])``, rounded where autograd
of the unfused code rounds (each product, then the sum), so it is bitwise equal to that too.

Dispatch: :func:`jetrl.quant.backend.choose_impl` (the kernel: :mod:`jetrl.quant.kernels.rope_triton`;
``impl="reference" | "triton"`` forces one).
"""

from __future__ import annotations

import torch

from jetrl.quant.backend import KERNEL_DTYPES, choose_impl


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate (N, H, D) by the half-split convention of HF Llama/Qwen; cos, sin are (N, D)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


def _check(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    for name, t, shape in (("q", q, "3-D (N, heads, head_dim)"), ("k", k, "3-D (N, heads, head_dim)"),
                           ("cos", cos, "2-D (N, head_dim)"), ("sin", sin, "2-D (N, head_dim)")):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"apply_rope_qk: {name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dtype not in KERNEL_DTYPES:
            raise TypeError(f"apply_rope_qk: {name} must be bfloat16, float16 or float32, got {t.dtype}")
        if t.device != q.device:
            raise ValueError(f"apply_rope_qk: {name} is on {t.device} but q is on {q.device}")
        if t.dim() != int(shape[0]):
            raise ValueError(f"apply_rope_qk: {name} must be {shape}, got shape {tuple(t.shape)}")
    n, _, d = q.shape
    if k.shape[0] != n or k.shape[2] != d:
        raise ValueError(f"apply_rope_qk: k {tuple(k.shape)} must have q's tokens and head_dim, q is {tuple(q.shape)}")
    if tuple(cos.shape) != (n, d) or tuple(sin.shape) != (n, d):
        raise ValueError(f"apply_rope_qk: cos {tuple(cos.shape)} and sin {tuple(sin.shape)} must be (N, head_dim) = "
                         f"{(n, d)}")
    if d % 2:
        raise ValueError(f"apply_rope_qk: head_dim must be even (half-split rotation), got {d}")
    if not (q.dtype == k.dtype == cos.dtype == sin.dtype):
        raise TypeError(f"apply_rope_qk: q, k, cos and sin must share one dtype, got {q.dtype}, {k.dtype}, "
                        f"{cos.dtype}, {sin.dtype}")


class _RopeQK(torch.autograd.Function):
    """Triton forward and backward (the same kernel, transposed rotation) of the rotation of q and k."""

    @staticmethod
    def forward(ctx, q, k, cos, sin):
        from jetrl.quant.kernels import rope_triton

        ctx.save_for_backward(cos, sin)
        return rope_triton.rope_qk(q, k, cos, sin, backward=False)

    @staticmethod
    def backward(ctx, grad_q, grad_k):
        from jetrl.quant.kernels import rope_triton

        cos, sin = ctx.saved_tensors
        return (*rope_triton.rope_qk(grad_q, grad_k, cos, sin, backward=True), None, None)


def apply_rope_qk(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *,
                  impl: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(apply_rope(q, cos, sin), apply_rope(k, cos, sin))`` for q (N, Hq, D), k (N, Hkv, D), cos/sin (N, D).

    q and k may be strided views (e.g. heads of a fused qkv projection). The Triton path returns new
    contiguous tensors and is differentiable in q and k (cos and sin get no gradient).
    """
    _check(q, k, cos, sin)
    if choose_impl(q, impl, op="rope") != "triton":
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    return _RopeQK.apply(q, k, cos, sin)
