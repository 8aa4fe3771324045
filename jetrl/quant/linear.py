"""``FP8Linear``: a drop-in ``nn.Linear`` whose three GEMMs run in blockwise FP8.

A linear layer ``y = x W^T`` (x: (M, K) tokens x in-features, W: (N, K)) costs three GEMMs per training
step, and jetrl runs all three in E4M3 with fp32 block scales:

* **Fprop** ``y = x @ W^T``: x quantized per (1, 128) (one scale per token per 128 in-features: outliers
  stay local to a token), W per (128, 128) tiles. Output in the input's dtype (BF16 in training).
* **DGrad** ``dx = dy @ W``: dy quantized per (1, 128) along N; W's (128, 128) tiles transposed (data and
  scales, no re-quantization) give W^T's quantized form, so DGrad reads *the same* FP8 weight as Fprop.
* **WGrad** ``dW = dy^T @ x``: the contraction runs over tokens, so both operands are grouped by 128
  tokens: dy quantized per (128, 1), and the *FP8* input saved by Fprop re-quantized to (128, 1). The
  BF16 input is never saved: activations live in FP8 between forward and backward. Both operands are
  made with zero token rows up to a multiple of 128 (``whole_blocks``): the same bytes on the real tokens,
  zeros that add nothing to dW, and a contraction of whole blocks, which the fast blockwise GEMM needs, at
  any token count.

Gradients flow between ops in BF16; the master weight stays BF16 (its gradient is in its dtype).

**Unified precision flow.** Rollout and training call this same module on the same weight. Rollout
reuses the quantized weight cached for the current weight version; training quantizes identically
(it reads the same cache), so the tokens the policy learns from were produced by exactly the FP8 policy
that is being trained. The quantized weight is recomputed when the weight changes (its version counter
moves, e.g. after an optimizer step) or when :meth:`FP8Linear.invalidate_weight_cache` is called; no
calibration is involved.

Which precision each side runs is set by the recipe (see :mod:`jetrl.quant.recipe`): the module holds
``fp8_rollout`` and ``fp8_train`` and reads the side from :func:`jetrl.quant.side.current_side`.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from jetrl.quant.backend import get_backend, selected_backend_name
from jetrl.quant.exact import exact_linear
from jetrl.quant.formats import ACT, TOKEN, WEIGHT, Fp8Tensor
from jetrl.quant.side import current_side


class _Fp8LinearFunction(torch.autograd.Function):
    """Fprop/DGrad/WGrad in FP8; saves the FP8 input and the FP8 weight, nothing in BF16."""

    @staticmethod
    def forward(ctx, x, weight, bias, w_data, w_scale, pow2_scale: bool, wt_data=None, xq_data=None,
                xq_scale=None, exact: bool = False):  # x: (M, K)
        backend = get_backend(x.device)
        if xq_data is not None:  # x's 1x128 quantization, made by the op that produced x (a fused kernel)
            qx = Fp8Tensor(xq_data, xq_scale, ACT)
        else:
            qx = backend.quantize(x, ACT, pow2_scale)
        qw = Fp8Tensor(w_data, w_scale, WEIGHT)
        # exact mode: each row's sum in the same order whatever M is (the backward stays the fast one)
        y = (backend.gemm_exact if exact else backend.gemm)(qx, qw, out_dtype=x.dtype)  # (M, N)
        if bias is not None:
            y = y + bias.to(y.dtype)
        # wt_data: a row-major copy of W^T's FP8 data (same values as w_data.t()), cached with the weight
        # when a grad-enabled forward made it (the backend's quantize_weight_pair); DGrad reads it
        ctx.save_for_backward(qx.data, qx.scale, w_data, w_scale, wt_data)
        ctx.pow2_scale = pow2_scale
        ctx.x_dtype = x.dtype
        ctx.weight_dtype = weight.dtype
        ctx.bias_dtype = bias.dtype if bias is not None else None
        return y

    @staticmethod
    def backward(ctx, grad_out):  # grad_out: (M, N)
        x_data, x_scale, w_data, w_scale, wt_data = ctx.saved_tensors
        backend = get_backend(grad_out.device)
        grad_out = grad_out.contiguous()
        grad_x = grad_w = grad_b = None
        qg = qg_tok = None
        if ctx.needs_input_grad[0] and ctx.needs_input_grad[1]:
            # one read of grad_out; the 128x1 operands of WGrad have zero rows to a multiple of 128 tokens
            qg, qg_tok = backend.quantize_act_and_token(grad_out, ctx.pow2_scale, whole_blocks=True)
        if ctx.needs_input_grad[0]:  # DGrad: dy (1x128) @ W  ==  dy @ (W^T as 128x128 tiles)^T
            if qg is None:
                qg = backend.quantize(grad_out, ACT, ctx.pow2_scale)
            if wt_data is not None:
                qw_t = Fp8Tensor(wt_data, w_scale.t(), WEIGHT)  # (K, N), row-major data
            else:
                qw_t = Fp8Tensor(w_data, w_scale, WEIGHT).t()  # (K, N)
            grad_x = backend.gemm(qg, qw_t, out_dtype=ctx.x_dtype)  # (M, K)
        if ctx.needs_input_grad[1]:  # WGrad: dy^T @ x, both grouped by 128 tokens
            # both operands are quantized with zero rows up to M' (M rounded up to 128): the same bytes and
            # scales on the M tokens, and zeros add nothing to dW, so the GEMM's contraction runs over whole
            # 128-token blocks (cuBLAS's blockwise rule) whatever the micro-batch's token count
            if qg_tok is None:
                qg_tok = backend.quantize(grad_out, TOKEN, ctx.pow2_scale, whole_blocks=True)
            qg_tok = qg_tok.t()  # (N, M'), 1x128 along M'
            qx_tok = backend.requantize(Fp8Tensor(x_data, x_scale, ACT), TOKEN, ctx.pow2_scale,
                                        whole_blocks=True).t()  # (K, M')
            grad_w = backend.gemm(qg_tok, qx_tok, out_dtype=ctx.weight_dtype)  # (N, K)
        if ctx.bias_dtype is not None and ctx.needs_input_grad[2]:
            grad_b = grad_out.sum(0, dtype=torch.float32).to(ctx.bias_dtype)  # fp32 sums, no fp32 copy of grad_out
        return grad_x, grad_w, grad_b, None, None, None, None, None, None, None


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, qweight: Fp8Tensor,
               pow2_scale: bool = False, qweight_t: Fp8Tensor | None = None,
               x_fp8: Fp8Tensor | None = None, exact: bool = False) -> torch.Tensor:
    """``F.linear`` in FP8 for a 2-D ``x`` (M, K) given the (128, 128)-quantized ``weight``.

    ``qweight_t`` optionally gives W^T's quantized form with row-major data (values equal to
    ``qweight.t()``), which DGrad then reads instead of the transposed view. ``x_fp8`` optionally gives
    x's 1x128 quantization (bitwise what the backend would compute from x), so x is not read again.
    ``exact``: Fprop through the backend's batch-invariant ``gemm_exact`` (see :mod:`jetrl.quant.exact`).
    """
    wt_data = qweight_t.data if qweight_t is not None else None
    xq_data, xq_scale = (x_fp8.data, x_fp8.scale) if x_fp8 is not None else (None, None)
    return _Fp8LinearFunction.apply(x, weight, bias, qweight.data, qweight.scale, pow2_scale, wt_data, xq_data,
                                    xq_scale, bool(exact))


def _write_into(old: Fp8Tensor | None, new: Fp8Tensor | None) -> Fp8Tensor | None:
    """Copy ``new`` into ``old``'s buffers when their layouts match (stable addresses), else ``new``."""
    if old is None or new is None or old.block != new.block:
        return new
    for a, b in ((old.data, new.data), (old.scale, new.scale)):
        if a.shape != b.shape or a.stride() != b.stride() or a.device != b.device or a.dtype != b.dtype:
            return new
    old.data.copy_(new.data)
    old.scale.copy_(new.scale)
    return old


class FP8Linear(nn.Linear):
    """``nn.Linear`` with FP8 Fprop/DGrad/WGrad; same parameters, same state-dict keys.

    ``fp8_train`` / ``fp8_rollout`` choose, per side, FP8 or the plain ``F.linear`` on the master weight.
    ``check_finite`` raises on NaN/Inf inputs (a debugging aid: it costs a device sync per call).
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, device=None, dtype=None, *,
                 fp8_train: bool = True, fp8_rollout: bool = True, pow2_scale: bool = False,
                 check_finite: bool = False) -> None:
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self.fp8_train = fp8_train
        self.fp8_rollout = fp8_rollout
        self.pow2_scale = pow2_scale
        self.check_finite = check_finite
        self._qweight_key: tuple | None = None
        self._qweight: Fp8Tensor | None = None
        self._qweight_t: Fp8Tensor | None = None

    @classmethod
    def from_linear(cls, linear: nn.Linear, **options) -> "FP8Linear":
        """Wrap an existing ``nn.Linear``, sharing its parameters (optimizers and tied weights stay valid)."""
        if not isinstance(linear, nn.Linear):
            raise TypeError(f"FP8Linear.from_linear needs an nn.Linear, got {type(linear).__name__}")
        new = cls(linear.in_features, linear.out_features, bias=linear.bias is not None, device="meta", **options)
        new.weight = linear.weight
        new.bias = linear.bias
        new.train(linear.training)
        return new

    def to_linear(self) -> nn.Linear:
        """A plain ``nn.Linear`` sharing this layer's parameters."""
        plain = nn.Linear(self.in_features, self.out_features, bias=self.bias is not None, device="meta")
        plain.weight = self.weight
        plain.bias = self.bias
        plain.train(self.training)
        return plain

    def uses_fp8(self) -> bool:
        """Whether the current side runs this layer in FP8."""
        return self.fp8_rollout if current_side() == "rollout" else self.fp8_train

    def invalidate_weight_cache(self) -> None:
        """Mark the quantized weight stale (call after changing the weight behind autograd's back).

        The next use re-quantizes into the same buffers, so their addresses stay fixed and CUDA graphs
        captured by the rollout engine stay valid across optimizer steps.
        """
        self._qweight_key = None

    def quantized_weight(self) -> Fp8Tensor:
        """The (128, 128)-block FP8 weight for the current weight version, quantized at most once."""
        return self._cached_weights(with_transpose=False)[0]

    def quantized_weight_t(self) -> Fp8Tensor | None:
        """W^T's quantized form with row-major data (DGrad reads it instead of the transposed view).

        Same values as ``quantized_weight().t()``; made once per weight version, only when a
        grad-enabled forward needs it (rollout never pays its memory).
        """
        return self._cached_weights(with_transpose=True)[1]

    def _cached_weights(self, with_transpose: bool) -> tuple[Fp8Tensor, Fp8Tensor | None]:
        w = self.weight
        key = (w._version, w.data_ptr(), w.device, w.dtype, tuple(w.shape), self.pow2_scale,
               selected_backend_name())
        stale_q = stale_t = None
        if self._qweight_key != key:
            stale_q, stale_t = self._qweight, self._qweight_t
            self._qweight = self._qweight_t = None
            self._qweight_key = key
        backend = get_backend(w.device)
        with torch.no_grad():
            if with_transpose and self._qweight_t is None:
                if self._qweight is None:  # W and W^T from one read of the weight
                    self._qweight, self._qweight_t = backend.quantize_weight_pair(w.detach(), self.pow2_scale)
                else:
                    q = self._qweight
                    self._qweight_t = Fp8Tensor(q.data.t().contiguous(), q.scale.t(), WEIGHT)
            elif self._qweight is None:
                self._qweight = backend.quantize(w.detach(), WEIGHT, self.pow2_scale)
            self._qweight = _write_into(stale_q, self._qweight)
            self._qweight_t = _write_into(stale_t, self._qweight_t)
        return self._qweight, self._qweight_t

    def forward(self, x: torch.Tensor, x_fp8: Fp8Tensor | None = None, *, exact: bool = False) -> torch.Tensor:
        """``x`` (..., in_features). ``x_fp8``: x flattened to 2-D and quantized per 1x128 with this layer's
        ``pow2_scale`` by a fused producer (see :func:`fp8_input_scaling`); ignored when not in FP8.
        ``exact``: batch-invariant forward (exact on-policy mode, :mod:`jetrl.quant.exact`), in FP8 or not."""
        if not self.uses_fp8():
            return exact_linear(x, self.weight, self.bias) if exact else F.linear(x, self.weight, self.bias)
        if x.shape[-1] != self.in_features:
            raise ValueError(f"FP8Linear expects inputs with {self.in_features} features in the last dim, "
                             f"got shape {tuple(x.shape)}")
        if not x.is_floating_point():
            raise TypeError(f"FP8Linear input must be a floating-point tensor, got {x.dtype}")
        if self.check_finite and not bool(torch.isfinite(x).all()):
            raise FloatingPointError(f"non-finite values (NaN/Inf) in the input of {self!r}")
        lead = x.shape[:-1]
        x2d = x.reshape(math.prod(lead), self.in_features)
        # W^T's row-major copy only matters for DGrad; no-grad forwards (rollout) read W alone
        qweight, qweight_t = self._cached_weights(with_transpose=torch.is_grad_enabled())
        if x_fp8 is not None and (x_fp8.block != ACT or tuple(x_fp8.shape) != tuple(x2d.shape)):
            raise ValueError(f"x_fp8 must be x's (1, 128) quantization of shape {tuple(x2d.shape)}, got "
                             f"block {x_fp8.block} and shape {tuple(x_fp8.shape)}")
        y = fp8_linear(x2d, self.weight, self.bias, qweight, self.pow2_scale, qweight_t, x_fp8, exact)
        return y.reshape(*lead, self.out_features)

    def extra_repr(self) -> str:
        return (f"{super().extra_repr()}, fp8_train={self.fp8_train}, fp8_rollout={self.fp8_rollout}"
                + (", pow2_scale=True" if self.pow2_scale else ""))


def fp8_input_scaling(*modules: nn.Module) -> bool | None:
    """Whether a producer should hand these linears a pre-quantized input, and with which scaling.

    Returns the shared ``pow2_scale`` when every module is an :class:`FP8Linear` running FP8 on the
    current side (so each would quantize the same input per 1x128 with that scaling), else ``None``: then
    the producer emits no FP8 copy and the layers do what they always do.
    """
    if not modules or not all(isinstance(m, FP8Linear) and m.uses_fp8() for m in modules):
        return None
    scalings = {m.pow2_scale for m in modules}
    return scalings.pop() if len(scalings) == 1 else None


def call_linear(module: nn.Module, x: torch.Tensor, x_fp8: Fp8Tensor | None = None, *,
                exact: bool = False) -> torch.Tensor:
    """``module(x)``, passing ``x_fp8`` along to an :class:`FP8Linear` when there is one.

    ``exact``: the batch-invariant forward (:mod:`jetrl.quant.exact`): an :class:`FP8Linear` is asked for it,
    a plain ``nn.Linear`` runs :func:`~jetrl.quant.exact.exact_linear` on its parameters.
    """
    if exact:
        if isinstance(module, FP8Linear):
            return module(x, x_fp8=x_fp8, exact=True)
        if type(module) is not nn.Linear:
            raise TypeError(f"exact mode needs nn.Linear or FP8Linear layers, got {type(module).__name__}")
        return exact_linear(x, module.weight, module.bias)
    if x_fp8 is None:
        return module(x)
    return module(x, x_fp8=x_fp8)


def linears_shared_input(modules: tuple[nn.Module, ...] | list[nn.Module], x: torch.Tensor,
                         x_fp8: Fp8Tensor | None = None, *, exact: bool = False) -> list[torch.Tensor]:
    """``[m(x) for m in modules]`` for linears that read the same input (q/k/v, gate/up).

    In a no-grad step with FP8 on this side and ``x_fp8`` given, the backend computes them together, each
    output a column slice of one buffer (the reference as the layers' own GEMMs): fast mode through
    ``grouped_gemm`` (the CUDA backend in one launch for decode-sized inputs, the same FP8 operands; the K split
    of the sum may differ from a lone call's, so values agree to output rounding), ``exact`` through
    ``grouped_gemm_exact`` (the bits of each layer's own exact GEMM; the CUDA backend groups decode-sized inputs
    whose weights share exact mode's K split, e.g. q/k/v and gate/up). Where the backend does not group (``None``),
    each layer runs as usual (``exact``: its batch-invariant forward).
    """
    if x_fp8 is not None and not torch.is_grad_enabled() and 2 <= len(modules) <= 3 and x.dim() == 2:
        if fp8_input_scaling(*modules) is not None and tuple(x_fp8.shape) == tuple(x.shape):
            weights = [m._cached_weights(with_transpose=False)[0] for m in modules]
            backend = get_backend(x.device)
            widths = [m.out_features for m in modules]
            if exact:
                out = backend.grouped_gemm_exact(x_fp8, weights, out_dtype=x.dtype)
                if out is not None:  # each bias added as FP8Linear adds it
                    return [y + m.bias.to(y.dtype) if m.bias is not None else y
                            for m, y in zip(modules, out.split(widths, dim=1))]
            else:
                out = backend.grouped_gemm(x_fp8, weights, [m.bias for m in modules], out_dtype=x.dtype)
                if out is not None:
                    return list(out.split(widths, dim=1))
    return [call_linear(m, x, x_fp8, exact=exact) for m in modules]
