"""The ``"cuda"`` FP8 backend: Triton and Gluon quantization kernels, blockwise GEMMs and the fused kernels.

Implements every operation of :class:`jetrl.quant.backend.Fp8Backend` with the same results as the reference
backend (quantization bit for bit, GEMMs to output rounding):

* quantization: 1x128 and 128x128 by the Triton kernels (:mod:`~jetrl.quant.kernels.quantize_triton`); 128x1,
  the 1x128 -> 128x1 re-quantization and grad_out's two blockings in one pass by the Gluon kernels
  (:mod:`~jetrl.quant.kernels.quantize_gluon`) where they run (:func:`uses_gluon`), else by the Triton kernels;
* GEMMs, per shape class (:func:`gemm_path`): decode-sized M, and grouped launches of weights sharing an input
  (q/k/v, gate/up) up to their own bound, on the split-K decode GEMM (:mod:`~jetrl.quant.kernels.gemm_decode_triton`:
  bound by the weight's bytes, it streams the FP8 weight with every SM, which cuBLAS's 128x128-tile blockwise
  kernel does not at small M), or on DeepGEMM where it loads (its rule; the tuning's ``gemm`` "auto" or "deepgemm",
  :meth:`~jetrl.quant.kernels.tuning.KernelTuning.uses_deepgemm`); the rest on
  cuBLAS's blockwise ``scaled_mm`` (:mod:`~jetrl.quant.kernels.gemm_scaled_mm`) where its layout rules hold, else
  the Triton GEMM (:mod:`~jetrl.quant.kernels.gemm_triton`);
* exact mode's GEMMs: the batch-invariant Triton GEMMs of :mod:`~jetrl.quant.kernels.gemm_exact_triton`, or one of
  two schedules with the same bits (:func:`exact_gemm_path`: the split-K decode kernel at exact mode's split,
  cuBLAS for a weight walked unsplit);
* ``fused_kernels = True``: RMSNorm, SwiGLU, RoPE, LM-head log-probabilities, paged decode attention, the
  seeded sampler, exact mode's attention and the FP8 KV-cache write run their kernels of this folder (the
  seam's :func:`~jetrl.quant.backend.choose_impl`, over :data:`~jetrl.quant.backend.FUSED_OPS`).

Every choice reads :func:`jetrl.quant.kernels.tuning.current` (``gemm`` forces one GEMM path; the bounds of the
decode routing; ``gluon``). Importing this module imports Triton; the seam imports it lazily.
"""

from __future__ import annotations

from typing import Sequence

import torch

from jetrl.quant import reference
from jetrl.quant.backend import KERNEL_DTYPES, GemmWeight
from jetrl.quant.formats import ACT, TOKEN, WEIGHT, Block, Fp8Tensor, check_block
from jetrl.quant.kernels import bias_triton, deepgemm_builds, gemm_exact_triton, gemm_triton, quantize_gluon, tuning
from jetrl.quant.kernels import gemm_decode_triton as dk
from jetrl.quant.kernels import gemm_deepgemm as deepgemm
from jetrl.quant.kernels import gemm_scaled_mm as scaled_mm
from jetrl.quant.kernels import quantize_triton as tk


def uses_gluon(x: torch.Tensor) -> bool:
    """Whether the Gluon kernels quantize ``x``: ``tuning.gluon`` on, Gluon in the installed Triton, rows with
    unit stride. Otherwise the Triton kernels run (the 128x1 kernel; grad_out as 1x128 then 128x1)."""
    return tuning.current().gluon and quantize_gluon.available() and (x.numel() == 0 or x.stride(1) == 1)


def _gluon_quantizes(x: torch.Tensor) -> bool:
    """Whether the Gluon kernels quantize the float input ``x``: :func:`uses_gluon`, and a dtype they read."""
    return uses_gluon(x) and x.dtype in KERNEL_DTYPES


def act_and_token_path(x: torch.Tensor) -> str:
    """How grad_out's 1x128 and 128x1 blockings are made: ``"gluon-one-pass"`` (one read of x) or
    ``"triton-two-kernels"`` (the fastest path without Gluon: the 1x128 kernel, then the 128x1 kernel)."""
    return "gluon-one-pass" if _gluon_quantizes(x) else "triton-two-kernels"


def _check_cuda(x: torch.Tensor, what: str) -> None:
    if x.device.type != "cuda":
        raise ValueError(f"the 'cuda' FP8 backend needs CUDA tensors; {what} is on {x.device}")


def _exact_decode_config(a: Fp8Tensor, weights: list[Fp8Tensor]):
    return tuning.current().exact_decode_config(a.shape[0], tuple(w.shape[0] for w in weights), a.shape[1],
                                                dk._sm_count(a.data.device))


def exact_gemm_path(a: Fp8Tensor, b: Fp8Tensor) -> tuple[str, tuning.DecodeGemmConfig | None]:
    """Which kernel runs exact mode's ``a @ b.T`` (every one computes the same bits, see the tuning's doc), with the
    decode kernel's config where that is the path: ``"decode"`` (the split-K decode kernel at exact mode's split, up
    to ``exact_decode_max_m`` rows), ``"cublas"`` (a weight walked unsplit, from ``exact_cublas_min_m`` rows on) or
    ``"triton"`` (the exact kernel)."""
    if b.block != WEIGHT or a.block != ACT:
        return "triton", None
    cfg = _exact_decode_config(a, [b])
    if cfg is not None:
        return "decode", cfg
    m, n, k = a.shape[0], b.shape[0], b.shape[1]
    if (tuning.current().exact_on_cublas(m, n, k) and scaled_mm.is_available(a.data.device)
            and scaled_mm.supports(a, b)):
        return "cublas", None
    return "triton", None


def gemm_path(a: Fp8Tensor, b: Fp8Tensor, grouped_n: int | None = None,
              out_dtype: torch.dtype = torch.bfloat16, biased: bool = False) -> str:
    """Which GEMM runs ``a @ b.T``: ``"decode"``, ``"deepgemm"``, ``"cublas"`` or ``"triton"`` (see the module
    docstring); ``grouped_n`` (the total width) asks for a grouped launch of weights shaped like ``b``, ``biased``
    with biases, which the grouped decode kernel adds in its epilogue and DeepGEMM cannot (two more launches), so
    where DeepGEMM's rule routes such a launch keeps the decode kernel where its bound takes the rows
    (:func:`~jetrl.quant.kernels.gemm_deepgemm.route`). The choice reads the GEMM's operands and the tuning, never
    which phase (rollout or training) runs it."""
    cfg = tuning.current()
    choice = cfg.gemm
    m, k = a.shape[0], a.shape[1]
    if choice == "decode":
        return "decode" if m <= tuning.DECODE_GEMM_MAX_M else "triton"
    grouped = grouped_n is not None
    n = grouped_n if grouped else b.shape[0]
    if (m <= cfg.deepgemm_decode_max_m and cfg.uses_deepgemm(lambda: deepgemm.is_available(a.data.device))
            and deepgemm.supports(a, b, out_dtype)):
        # a grouped launch's rows go where the stacked weight's GEMM goes (the caller then runs that GEMM)
        where = deepgemm.route(m, n, k, decode_bound=cfg.decode_rows(n, k, grouped) if biased else 0,
                               **cfg.deepgemm_rule())
        if where == "deepgemm" and not deepgemm.is_available(a.data.device):
            raise RuntimeError("the FP8 GEMM path is set to DeepGEMM (JETRL_FP8_GEMM=deepgemm or tuning gemm=), but "
                               "DeepGEMM does not load here (see the warning before); rebuild it "
                               "(github.com/deepseek-ai/DeepGEMM; docs/recipes.md; "
                               f"{deepgemm_builds.builds_for(torch.__version__)}), or choose another path")
        if where is not None:
            return where
    if choice in ("auto", "deepgemm") and m <= cfg.decode_rows(n, k, grouped):
        return "decode"
    if choice == "triton" or not (scaled_mm.is_available(a.data.device) and scaled_mm.supports(a, b)):
        return "triton"
    return "cublas"


class CudaBackend:
    """Triton/Gluon quantization, cuBLAS/Triton blockwise GEMMs, the fused kernels; see the module docstring."""

    name = "cuda"
    fused_kernels = True

    def quantize(self, x: torch.Tensor, block: Block, pow2_scale: bool = False, *,
                 whole_blocks: bool = False) -> Fp8Tensor:
        reference._check_input(x)
        _check_cuda(x, "the input")
        block = check_block(block)
        if block == ACT:
            data, scale = tk.quantize_act_1x128(x, pow2_scale)
        elif block == TOKEN:
            kernels = quantize_gluon if _gluon_quantizes(x) else tk
            data, scale = kernels.quantize_token_128x1(x, pow2_scale, whole_blocks)
        elif whole_blocks and x.shape[0] % 128:
            return self.quantize(reference.pad_to_whole_blocks(x, block), block, pow2_scale)
        else:
            data, scale, _ = tk.quantize_weight_128x128(x, pow2_scale)
        return Fp8Tensor(data, scale, block)

    def quantize_weight_pair(self, w: torch.Tensor, pow2_scale: bool = False) -> tuple[Fp8Tensor, Fp8Tensor]:
        """W (N, K) per 128x128 tile and W^T's quantized form with its data row-major (K, N), one pass."""
        reference._check_input(w, "the weight")
        _check_cuda(w, "the weight")
        data, scale, data_t = tk.quantize_weight_128x128(w, pow2_scale, emit_t=True)
        scale_t = tk.tile_scale_buffer(scale.shape[1], scale.shape[0], w.device)  # W^T's in cuBLAS's layout too
        scale_t.copy_(scale.t())
        return Fp8Tensor(data, scale, WEIGHT), Fp8Tensor(data_t, scale_t, WEIGHT)

    def transpose_weight(self, q: Fp8Tensor) -> Fp8Tensor:
        """W^T (K, N) row-major with its scales in cuBLAS's layout, from W's FP8 bytes: one launch."""
        if q.block != WEIGHT:
            raise ValueError(f"transpose_weight takes a 128x128-block weight, got block {q.block}")
        _check_cuda(q.data, "the FP8 weight")
        data_t, scale_t = tk.transpose_weight_128x128(q.data, q.scale)
        return Fp8Tensor(data_t, scale_t, WEIGHT)

    def quantize_act_and_token(self, x: torch.Tensor, pow2_scale: bool = False, *,
                               whole_blocks: bool = False) -> tuple[Fp8Tensor, Fp8Tensor]:
        """x per 1x128 and per 128x1 (grad_out for DGrad and WGrad), by :func:`act_and_token_path`."""
        reference._check_input(x)
        _check_cuda(x, "the input")
        if act_and_token_path(x) == "gluon-one-pass":
            data, scale, tok, tok_scale = quantize_gluon.quantize_act_and_token(x, pow2_scale, whole_blocks)
        else:
            data, scale = tk.quantize_act_1x128(x, pow2_scale)
            tok, tok_scale = tk.quantize_token_128x1(x, pow2_scale, whole_blocks)
        return Fp8Tensor(data, scale, ACT), Fp8Tensor(tok, tok_scale, TOKEN)

    def requantize(self, t: Fp8Tensor, block: Block, pow2_scale: bool = False, *,
                   whole_blocks: bool = False) -> Fp8Tensor:
        block = check_block(block)
        _check_cuda(t.data, "the FP8 tensor")
        if t.block == ACT and block == TOKEN:
            kernels = quantize_gluon if uses_gluon(t.data) else tk
            data, scale = kernels.requantize_act_to_token(t.data, t.scale, pow2_scale, whole_blocks)
            return Fp8Tensor(data, scale, TOKEN)
        # rare pairs: same arithmetic, unfused
        return self.quantize(t.dequantize(), block, pow2_scale, whole_blocks=whole_blocks)

    def grouped_gemm(self, a: Fp8Tensor, weights: list[Fp8Tensor], biases: list[torch.Tensor | None],
                     out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor | None:
        """``cat([a @ w.T (+ bias)])`` in one launch for decode-sized ``a`` and 128x128-block weights that
        share it; ``None`` where this does not apply (the caller then runs the GEMMs one by one)."""
        biased, width = any(b is not None for b in biases), sum(w.shape[0] for w in weights)
        if (a.block != ACT or not 1 <= len(weights) <= 3 or any(w.block != WEIGHT for w in weights)
                or gemm_path(a, weights[0], grouped_n=width, out_dtype=out_dtype, biased=biased) != "decode"
                or (biased and any(b is None for b in biases))):
            return None
        for w in weights:
            reference.check_gemm_operands(a, w)
        _check_cuda(a.data, "the left operand")
        operands = [(w.data, w.scale, b.to(out_dtype) if b is not None else None) for w, b in zip(weights, biases)]
        return dk.fp8_decode_gemm_grouped(a.data, a.scale, operands, out_dtype)

    def add_bias(self, y: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        """In place by :mod:`~jetrl.quant.kernels.bias_triton` (ATen's broadcast add takes its slow generic loop);
        operands it does not take (:func:`~jetrl.quant.kernels.bias_triton.supports`) add as the reference does."""
        bias = bias.to(y.dtype)
        if y.is_cuda and bias_triton.supports(y, bias):
            return bias_triton.add_bias_(y, bias)
        return y + bias

    def gemm(self, a: Fp8Tensor, b: Fp8Tensor, out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        reference.check_gemm_operands(a, b)
        _check_cuda(a.data, "the left operand")
        path = gemm_path(a, b, out_dtype=out_dtype)
        rows = 128 if b.block == WEIGHT else 1
        if path == "deepgemm":
            return deepgemm.gemm(a, b, out_dtype)
        if path == "cublas":
            return scaled_mm.blockwise_scaled_mm(a, b, out_dtype)
        if path == "decode":
            return dk.fp8_decode_gemm(a.data, a.scale, b.data, b.scale, rows, out_dtype)
        return gemm_triton.blockwise_fp8_gemm(a.data, a.scale, b.data, b.scale, rows, out_dtype)

    def prepare_gemms(self, token_counts: list[int], device: torch.device, weights: Sequence[GemmWeight]) -> float:
        """Compile ahead DeepGEMM's kernels for GEMMs of ``weights`` at these token counts (rows: the rollout's
        decode graph sizes), where :func:`gemm_path`'s rule routes them there, a group with biases keeping the
        decode kernel up to its bound as :meth:`grouped_gemm` does
        (:func:`~jetrl.quant.kernels.gemm_deepgemm.compile_kernels`); the seconds taken."""
        cfg = tuning.current()
        if not (cfg.uses_deepgemm(lambda: deepgemm.is_available(device)) and deepgemm.is_available(device)):
            return 0.0
        biased = {(w.n, w.k) for w in weights if w.biased_group}
        shapes = deepgemm.planned_shapes(
            token_counts, {(w.n, w.k) for w in weights}, **cfg.deepgemm_rule(),
            decode_bound=lambda n, k: cfg.decode_rows(n, k, grouped=True) if (n, k) in biased else 0)
        return deepgemm.compile_kernels(shapes, device)

    def gemm_exact(self, a: Fp8Tensor, b: Fp8Tensor, out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        reference.check_gemm_operands(a, b)
        _check_cuda(a.data, "the left operand")
        path, cfg = exact_gemm_path(a, b)
        if path == "decode":  # the exact kernel's bits (tuning's doc, exact_decode_max_m)
            return dk.fp8_decode_gemm(a.data, a.scale, b.data, b.scale, 128, out_dtype, config=cfg)
        if path == "cublas":  # the in-order walk's bits (tuning's doc, exact_cublas_min_m)
            return scaled_mm.blockwise_scaled_mm(a, b, out_dtype)
        rows = 128 if b.block == WEIGHT else 1
        return gemm_exact_triton.exact_fp8_gemm(a.data, a.scale, b.data, b.scale, rows, out_dtype)

    def grouped_gemm_exact(self, a: Fp8Tensor, weights: list[Fp8Tensor],
                           out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor | None:
        """``cat([gemm_exact(a, w)])`` in one decode-kernel launch where the decode schedule takes these weights
        (decode-sized ``a``, 128x128-block weights of one K split); ``None`` otherwise."""
        if (a.block != ACT or not 1 <= len(weights) <= 3 or any(w.block != WEIGHT for w in weights)
                or a.data.device.type != "cuda"):
            return None
        cfg = _exact_decode_config(a, weights)
        if cfg is None:
            return None
        for w in weights:
            reference.check_gemm_operands(a, w)
        return dk.fp8_decode_gemm_grouped(a.data, a.scale, [(w.data, w.scale, None) for w in weights], out_dtype,
                                          config=cfg)

    def matmul_exact(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        _check_cuda(x, "the input")
        return gemm_exact_triton.exact_matmul(x, w)
