"""Exact (batch-invariant) numerics: the linear layers of exact on-policy mode.

**What exact mode guarantees.** With ``exact=True`` the rollout engine's log-probability of every generated
token equals, bit for bit, the one the trainer's forward computes for it. Both sides already run the same
weights, the same quantization and the same formulas; what differs is the *batch*: the engine computes a
token in a decode step of 1..256 rows (or a prefill chunk), the trainer in a packed forward of thousands.
Floating-point sums depend on their order, and a GEMM's order depends on M wherever the implementation picks
its algorithm by shape (a GEMV for one row, split-K for few rows, other tiles for many). In FP8 those
last-bit differences are amplified to whole quantization steps by the next layer's rounding.

Exact mode removes the cause: every op computes each row with the same operations in the same order,
whatever the other rows are.

* **Linear layers** (:func:`exact_linear`, :func:`exact_fp8_gemm`): the backend's ``matmul_exact`` /
  ``gemm_exact``. The reference backend pads the rows to whole chunks of :data:`EXACT_ROW_CHUNK` and runs one
  fixed-shape ``(EXACT_ROW_CHUNK, K) @ (K, N)`` product per chunk: one shape, so one algorithm, and a row's
  result does not depend on its position in the chunk or on the other rows (the tests check both). The CUDA
  backend runs Triton GEMMs (:mod:`jetrl.quant.kernels.gemm_exact_triton`) whose arithmetic (the K blocks, one K
  split per weight shape, the order of every sum) never depends on M; only how the work is spread over programs,
  tiles and kernels may, since every schedule adds the same fp32 partials in the same order (the GPU tests check
  each one bitwise against the exact kernel).
* **Attention** (:func:`jetrl.models.attention.exact_attention`): one function for prefill, paged decode and
  the packed training forward, walking each sequence's keys in fixed chunks of :data:`EXACT_KV_CHUNK` positions
  from position 0 with an online softmax (see its reference for the order).
* **Row-wise ops** (RMSNorm with its residual add, SwiGLU, RoPE, the 1x128 quantization) read one row each and stay
  as they are (tests prove their batch invariance, at several CPU thread counts too), except ATen's CPU ``silu``,
  whose bits depend on an element's place in the tensor: exact mode's SwiGLU runs :func:`jetrl.quant.swiglu.silu`
  with ``exact`` on the CPU (:mod:`jetrl.quant.swiglu` says why).
* **The LM head's log-probabilities** (:func:`jetrl.models.logprobs.exact_logprobs_from_logits`): one function
  for the sampler and the trainer, over the logits of the exact LM head (:mod:`jetrl.models.logprobs`).

Only forward values must agree: the backward of an exact linear is the ordinary one (:class:`_ExactLinear`).

**The fast mode's gap, and why it grows with the number of tokens compared.** Without exact mode the two
sides sum in different orders: the engine's GEMMs see M = the decode batch (a GEMV for one row, other
blockings for a few), the trainer's M = the packed micro-batch, and the attention is the paged path on one
side and SDPA on the other. In fp32 that moves an activation by an ulp or so (the ``bf16`` recipe on fp32
weights agrees to about 1e-6). In ``jet`` the next layer quantizes that activation to E4M3, whose grid is 2^-3
relative: almost always both sides round to the same E4M3 value, but now and then an element (or the amax that
sets its block's scale) sits within an ulp of a rounding boundary and the two sides round to neighbouring
values, a 2^-3-sized step that moves the token's log-probability by up to about 1e-2. Those flips are rare and
independent per token, so the *mean* gap stays tiny while the *max* is the largest of many rare events: it
grows with the number of tokens compared, not with any change to the kernels (a bisection over the repository's
history gives the same bits at every commit since the first rollout engine; docs/benchmark-history.md). The fused
RMSNorm and SwiGLU quantization paths produce bitwise the bytes of the unfused code, so they are not a cause.
Exact mode removes the flips' cause, the differing orders.
"""

from __future__ import annotations

import torch

from jetrl.quant.backend import get_backend
from jetrl.quant.formats import Fp8Tensor
from jetrl.quant.reference import EXACT_KV_CHUNK, EXACT_ROW_CHUNK, row_invariant_matmul


class _ExactLinear(torch.autograd.Function):
    """Forward: the backend's batch-invariant ``matmul_exact``; backward: the ordinary GEMMs (only forward
    values have to match between rollout and training)."""

    @staticmethod
    def forward(ctx, x, weight, bias):  # x: (M, K)
        y = get_backend(x.device).matmul_exact(x, weight.to(x.dtype))
        if bias is not None:
            y = y + bias.to(y.dtype)
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        return y

    @staticmethod
    def backward(ctx, grad_out):
        x, weight = ctx.saved_tensors
        grad_x = grad_out @ weight.to(grad_out.dtype) if ctx.needs_input_grad[0] else None
        grad_w = (grad_out.t() @ x.to(grad_out.dtype)).to(weight.dtype) if ctx.needs_input_grad[1] else None
        grad_b = grad_out.float().sum(0).to(grad_out.dtype) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return grad_x, grad_w, grad_b


def exact_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for x (..., K), batch-invariant (see the module docstring).

    Differentiable in all three; the backward runs the ordinary GEMMs.
    """
    if x.shape[-1] != weight.shape[-1]:
        raise ValueError(f"exact_linear: x has {x.shape[-1]} features, the weight {tuple(weight.shape)}")
    return _ExactLinear.apply(x.reshape(-1, x.shape[-1]), weight, bias).reshape(*x.shape[:-1], weight.shape[0])


def exact_fp8_gemm(a: Fp8Tensor, b: Fp8Tensor, out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Blockwise FP8 ``a @ b.T`` (operands as :func:`jetrl.quant.gemm`), batch-invariant in ``a``'s rows."""
    return get_backend(a.data.device).gemm_exact(a, b, out_dtype)


__all__ = ["EXACT_ROW_CHUNK", "EXACT_KV_CHUNK", "row_invariant_matmul", "exact_linear", "exact_fp8_gemm"]
