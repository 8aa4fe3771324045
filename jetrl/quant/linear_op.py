"""The FP8 linear op: the three GEMMs of ``y = x W^T`` in blockwise FP8, as one autograd function, and its
functional entry point :func:`fp8_linear_group` (the module is :class:`jetrl.quant.linear.FP8Linear`; the
quantized weights it hands the op are cached by :mod:`jetrl.quant.weight_cache`).

A linear layer ``y = x W^T`` (x: (M, K) tokens x in-features, W: (N, K)) costs three GEMMs per training
step, and jetrl runs all three in E4M3 with fp32 block scales:

* **Fprop** ``y = x @ W^T``: x quantized per (1, 128) (one scale per token per 128 in-features: outliers
  stay local to a token), W per (128, 128) tiles. Output in the input's dtype (BF16 in training).
* **DGrad** ``dx = dy @ W``: dy quantized per (1, 128) along N; W's (128, 128) tiles transposed (data and
  scales, no re-quantization) give W^T's quantized form, so DGrad reads *the same* FP8 weight as Fprop.
* **WGrad** ``dW = dy^T @ x``: the contraction runs over tokens, so both operands are grouped by 128
  tokens: dy quantized per (128, 1), and the *FP8* input saved by Fprop re-quantized to (128, 1). The
  BF16 input is never saved: activations live in FP8 between forward and backward. Both operands get zero
  token rows up to a multiple of 128 (``whole_blocks``), so the contraction runs over whole blocks, which the
  fast blockwise GEMM needs, at any token count (zeros add nothing to dW).

Gradients flow between ops in BF16; the weight parameter keeps its dtype (BF16; the fp32 master copy is the
optimizer's, :class:`jetrl.train.optim.MasterWeightAdamW`) and its gradient is in that dtype.
"""

from __future__ import annotations

import torch

from jetrl.quant.backend import get_backend, keeps_forward_context
from jetrl.quant.formats import ACT, TOKEN, WEIGHT, Fp8Tensor


def _fprop(x: torch.Tensor, w_data: torch.Tensor, w_scale: torch.Tensor, pow2_scale: bool,
           xq_data: torch.Tensor | None, xq_scale: torch.Tensor | None, exact: bool,
           biases: tuple[torch.Tensor, ...] | list[torch.Tensor]) -> tuple[torch.Tensor, Fp8Tensor]:
    """Fprop: ``(y, x's 1x128 quantization)``, y = x @ W^T (+ the biases side by side) from W's FP8 form."""
    backend = get_backend(x.device)
    # xq_data / xq_scale: x's 1x128 quantization, made by the op that produced x (a fused kernel)
    qx = Fp8Tensor(xq_data, xq_scale, ACT) if xq_data is not None else backend.quantize(x, ACT, pow2_scale)
    # exact mode: each row's sum in the same order whatever M is (the backward stays the fast one)
    y = (backend.gemm_exact if exact else backend.gemm)(qx, Fp8Tensor(w_data, w_scale, WEIGHT), out_dtype=x.dtype)
    if biases:
        y = backend.add_bias(y, biases[0] if len(biases) == 1 else torch.cat(biases))
    return y, qx


@keeps_forward_context  # the backward reads the kernel tuning the forward ran under, on autograd's CUDA threads too
class _Fp8LinearFunction(torch.autograd.Function):
    """Fprop/DGrad/WGrad in FP8; saves the FP8 input and the FP8 weight, nothing in BF16.

    ``params`` are the weights of one linear, or of several linears that read the same input (q/k/v, gate/up),
    then their biases (all or none); the FP8 weight ``w_data`` / ``w_scale`` holds them side by side along the
    output dim, so the group runs as one linear of their summed width: one GEMM each way, one quantization of
    grad_out, one re-quantization of the saved input. The output is (M, sum of widths); the gradients are split
    back per weight and bias."""

    @staticmethod
    def forward(ctx, x, w_data, w_scale, pow2_scale: bool, wt_data, wt_scale, xq_data, xq_scale, exact: bool,
                num_weights: int, *params):  # x: (M, K)
        weights, biases = params[:num_weights], params[num_weights:]
        y, qx = _fprop(x, w_data, w_scale, pow2_scale, xq_data, xq_scale, exact, biases)
        # wt_data / wt_scale: W^T's FP8 form with row-major data (same values as w_data.t()), where the layer caches
        # it with the weight (tuning.cache_weight_t; the backend's quantize_weight_pair); else None, and DGrad
        # transposes W's tiles
        ctx.save_for_backward(qx.data, qx.scale, w_data, w_scale, wt_data, wt_scale)
        ctx.pow2_scale = pow2_scale
        ctx.x_dtype = x.dtype
        ctx.widths = [w.shape[0] for w in weights]
        ctx.weight_dtype = weights[0].dtype  # one dtype for the group (groupable checks it)
        ctx.bias_dtypes = [b.dtype for b in biases]
        return y

    @staticmethod
    def backward(ctx, grad_out):  # grad_out: (M, N)
        x_data, x_scale, w_data, w_scale, wt_data, wt_scale = ctx.saved_tensors
        backend = get_backend(grad_out.device)
        grad_out = grad_out.contiguous()
        num_weights = len(ctx.widths)
        needs_w = any(ctx.needs_input_grad[10:10 + num_weights])
        grad_x = qg = qg_tok = None
        grad_ws: list[torch.Tensor | None] = [None] * num_weights
        grad_bs: list[torch.Tensor | None] = [None] * len(ctx.bias_dtypes)
        if ctx.needs_input_grad[0] and needs_w:
            # one read of grad_out; the 128x1 operands of WGrad have zero rows to a multiple of 128 tokens
            qg, qg_tok = backend.quantize_act_and_token(grad_out, ctx.pow2_scale, whole_blocks=True)
        if ctx.needs_input_grad[0]:
            if qg is None:
                qg = backend.quantize(grad_out, ACT, ctx.pow2_scale)
            grad_x = _dgrad(backend, qg, w_data, w_scale, wt_data, wt_scale, ctx.x_dtype)
        if needs_w:
            if qg_tok is None:
                qg_tok = backend.quantize(grad_out, TOKEN, ctx.pow2_scale, whole_blocks=True)
            grad_ws = list(_wgrad(backend, qg_tok, x_data, x_scale, ctx.pow2_scale, ctx.weight_dtype).split(ctx.widths))
        if grad_bs and any(ctx.needs_input_grad[10 + num_weights:]):
            grad_b = grad_out.sum(0, dtype=torch.float32)  # fp32 sums, no fp32 copy of grad_out
            grad_bs = [g.to(d) for g, d in zip(grad_b.split(ctx.widths), ctx.bias_dtypes)]
        return (grad_x, None, None, None, None, None, None, None, None, None, *grad_ws, *grad_bs)


def _dgrad(backend, qg: Fp8Tensor, w_data, w_scale, wt_data, wt_scale, x_dtype: torch.dtype) -> torch.Tensor:
    """DGrad: dy (1x128) @ W  ==  dy @ (W^T as 128x128 tiles)^T, (M, K)."""
    if wt_data is not None:
        qw_t = Fp8Tensor(wt_data, wt_scale, WEIGHT)  # (K, N), row-major data
    else:  # W^T not cached (tuning.cache_weight_t): a transient transpose of W's FP8 tiles, the same bytes
        qw_t = backend.transpose_weight(Fp8Tensor(w_data, w_scale, WEIGHT))
    return backend.gemm(qg, qw_t, out_dtype=x_dtype)


def _wgrad(backend, qg_tok: Fp8Tensor, x_data, x_scale, pow2_scale: bool, weight_dtype: torch.dtype) -> torch.Tensor:
    """WGrad: dy^T @ x, both grouped by 128 tokens, (N, K); both operands with zero rows up to M' (M rounded up to
    128, ``whole_blocks``; ``qg_tok`` made so), as the module doc says."""
    qx_tok = backend.requantize(Fp8Tensor(x_data, x_scale, ACT), TOKEN, pow2_scale, whole_blocks=True).t()  # (K, M')
    return backend.gemm(qg_tok.t(), qx_tok, out_dtype=weight_dtype)  # (N, M') @ (K, M')^T


def fp8_linear_group(x: torch.Tensor, weights: list[torch.Tensor], biases: list[torch.Tensor], qweight: Fp8Tensor,
                     pow2_scale: bool = False, qweight_t: Fp8Tensor | None = None,
                     x_fp8: Fp8Tensor | None = None, exact: bool = False) -> torch.Tensor:
    """``F.linear`` in FP8 of the linears of ``weights`` (and ``biases``: one each, or none) on the same 2-D ``x``
    (M, K), side by side: (M, sum of their widths), from ``qweight``, their (128, 128)-quantized weights stacked
    along the output dim; gradients flow to each weight and bias.

    ``qweight_t`` optionally gives W^T's quantized form with row-major data (values equal to ``qweight.t()``),
    which DGrad then reads instead of transposing W's tiles. ``x_fp8`` optionally gives x's 1x128 quantization
    (bitwise what the backend would compute from x), so x is not read again. ``exact``: Fprop through the
    backend's batch-invariant ``gemm_exact`` (see :mod:`jetrl.quant.exact`)."""
    xq_data, xq_scale = (x_fp8.data, x_fp8.scale) if x_fp8 is not None else (None, None)
    if not torch.is_grad_enabled():  # no graph to record (rollout, scoring): Fprop alone, without autograd's cost
        return _fprop(x, qweight.data, qweight.scale, pow2_scale, xq_data, xq_scale, exact, biases)[0]
    wt_data, wt_scale = (qweight_t.data, qweight_t.scale) if qweight_t is not None else (None, None)
    return _Fp8LinearFunction.apply(x, qweight.data, qweight.scale, pow2_scale, wt_data, wt_scale, xq_data, xq_scale,
                                    bool(exact), len(weights), *weights, *biases)
