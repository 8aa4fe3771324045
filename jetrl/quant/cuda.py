"""The ``"cuda"`` FP8 backend: Triton and Gluon quantization kernels and blockwise GEMMs on Hopper.

Same three operations and the same results as :mod:`jetrl.quant.reference` (quantization bit for bit,
GEMMs to output rounding), plus fused entry points that :class:`~jetrl.quant.linear.FP8Linear` uses
when a backend offers them:

* :meth:`CudaBackend.quantize_weight_pair`: W and the row-major W^T copy DGrad reads, one pass;
* :meth:`CudaBackend.quantize_act_and_token`: grad_out per 1x128 (DGrad) and 128x1 (WGrad), one pass.

GEMM choice, per shape class: decode-sized M (see :func:`decode_max_m`) goes to the split-K Triton decode
GEMM (:func:`~jetrl.quant.decode_gemm_triton.fp8_decode_gemm`: bound by the weight's bytes, so it is built to
stream the FP8 weight with every SM, which cuBLAS's 128x128-tile blockwise kernel does not at small M), and
so do grouped launches of weights sharing an input (q/k/v, gate/up) up to their own bound; everything else
to cuBLAS blockwise ``scaled_mm`` where its layout constraints hold, the Triton blockwise GEMM otherwise
(M > 256 never takes the decode kernel). ``JETRL_FP8_GEMM`` = ``cublas`` | ``triton`` | ``decode`` forces one
path (benchmarks and batch-invariance use it; ``decode`` applies to M <= 256 only). :data:`TOKEN_KERNEL` and
:data:`REQUANT_KERNEL` pick the 128x1 kernels (the Triton ones, or the Gluon ones with an explicit layout).

Importing this module imports Triton and registers the backend with :mod:`jetrl.quant.backend`.
"""

from __future__ import annotations

import os

import torch

from jetrl.quant import reference, scaled_mm
from jetrl.quant import decode_gemm_triton as dk
from jetrl.quant import token_gluon
from jetrl.quant import triton_kernels as tk
from jetrl.quant.backend import register_backend
from jetrl.quant.formats import ACT, TOKEN, WEIGHT, Block, Fp8Tensor, check_block

# Decode-sized GEMMs (M <= 64 rows) go to the split-K decode kernel (measured faster than cuBLAS up to 64;
# from 128 rows on, cuBLAS's tiles do more MMA work per weight byte), grouped launches (one kernel for
# q/k/v or gate/up, against one cuBLAS call per weight) up to GROUPED_DECODE_MAX_M rows. Per-shape
# exceptions, from `bench/kernels.py --sections decode-sweep`: {(N, K): max M} for single GEMMs and
# {("grouped", sum of N, K): max M} for grouped launches, each replacing the general bound.
DECODE_MAX_M = 64
GROUPED_DECODE_MAX_M = 64
# Measured (decode sweep): Llama-8B's grouped q/k/v (4096 + 1024 + 1024 rows, K = 4096) runs 1.5-2.2x
# faster in the decode kernel than in three cuBLAS calls up to M = 256 (cuBLAS's ~14 us floor per call);
# the other 8B shapes lose to cuBLAS beyond M = 64.
# For the 1.5B rollout shape (decode sweep with --sweep-shape 1.5b) the decode kernel also beats cuBLAS through
# M = 256 for down (1536 x 8960: 14.3 vs 30.4 us at M = 128) and the grouped q/k/v (9.4 vs 23.3 us at M = 256).
DECODE_MAX_M_BY_SHAPE: dict[tuple, int] = {("grouped", 6144, 4096): 256, (1536, 8960): 256,
                                           ("grouped", 2048, 1536): 256}
# Both blockings of grad_out from one read: the Gluon one-pass kernel reached 0.74-0.87 of copy bandwidth on
# the H200 (4 bytes per element), 19-28% faster than its halves run apart (act 1x128 at 0.92-0.95 of copy, then
# 128x1 at 0.84-0.95, 6 bytes per element). The Triton one-pass kernel (0.42-0.46) stays selectable, and the
# two kernels run where the Gluon kernels cannot (no Gluon in this Triton, or strided rows).
FUSED_ACT_AND_TOKEN = True
FUSED_ACT_AND_TOKEN_KERNEL = "gluon"  # with FUSED_ACT_AND_TOKEN: "gluon" (jetrl.quant.token_gluon) or "triton"
# The 128x1 kernels (grad_out per 128x1, and the 1x128 -> 128x1 re-quantization of the saved input): "gluon"
# (the tile staged in shared memory, one whole column per thread: jetrl.quant.token_gluon; 0.73-0.77 and
# 0.84-0.98 of copy bandwidth on the H200) or "triton" (compiler-chosen layout: 0.49-0.54 and 0.69-0.82).
# The same bytes. Where the installed Triton has no Gluon, the Triton kernels run.
TOKEN_KERNEL = "gluon"
REQUANT_KERNEL = "gluon"
TOKEN_KERNELS = ("triton", "gluon")
GEMM_CHOICES = ("auto", "cublas", "triton", "decode")


def _kernel_choice(choice: str, name: str) -> str:
    """``choice`` if it names a kernel family of :data:`TOKEN_KERNELS` (a clear error naming the setting if
    not); "gluon" becomes "triton" where the installed Triton has no Gluon."""
    if choice not in TOKEN_KERNELS:
        raise ValueError(f"jetrl.quant.cuda.{name} must be one of {TOKEN_KERNELS}, got {choice!r}")
    if choice == "gluon" and not token_gluon.available():
        return "triton"
    return choice


def _gluon_takes(x: torch.Tensor) -> bool:
    """Whether the Gluon kernels take ``x`` (rows with unit stride, a 16- or 32-bit float); else Triton runs."""
    return x.stride(1) == 1 and x.dtype in (torch.bfloat16, torch.float16, torch.float32)


def _quantize_token(x: torch.Tensor, pow2_scale: bool) -> tuple[torch.Tensor, torch.Tensor]:
    if _kernel_choice(TOKEN_KERNEL, "TOKEN_KERNEL") == "gluon" and _gluon_takes(x):
        return token_gluon.quantize_token_128x1(x, pow2_scale)
    return tk.quantize_token_128x1(x, pow2_scale)


def _check_cuda(x: torch.Tensor, what: str) -> None:
    if x.device.type != "cuda":
        raise ValueError(f"the 'cuda' FP8 backend needs CUDA tensors; {what} is on {x.device}")


def decode_max_m(n: int, k: int, grouped: bool = False) -> int:
    """The most rows for which the decode kernel runs an (N, K) weight (``n``: the total width of a grouped
    launch), by :data:`DECODE_MAX_M`, :data:`GROUPED_DECODE_MAX_M` and :data:`DECODE_MAX_M_BY_SHAPE`."""
    bound = max(DECODE_MAX_M, GROUPED_DECODE_MAX_M) if grouped else DECODE_MAX_M
    bound = DECODE_MAX_M_BY_SHAPE.get(("grouped", n, k) if grouped else (n, k), bound)
    return min(bound, dk.DECODE_GEMM_MAX_M)


def gemm_path(a: Fp8Tensor, b: Fp8Tensor, grouped_n: int | None = None) -> str:
    """Which GEMM runs ``a @ b.T``: ``"decode"``, ``"cublas"`` or ``"triton"`` (see the module docstring);
    ``grouped_n`` (the total width) asks for a grouped launch of weights shaped like ``b``."""
    choice = os.environ.get("JETRL_FP8_GEMM", "auto")
    if choice not in GEMM_CHOICES:
        raise ValueError(f"JETRL_FP8_GEMM must be one of {GEMM_CHOICES}, got {choice!r}")
    m, k = a.shape[0], a.shape[1]
    if choice == "decode":
        return "decode" if m <= dk.DECODE_GEMM_MAX_M else "triton"
    grouped = grouped_n is not None
    if choice == "auto" and m <= decode_max_m(grouped_n if grouped else b.shape[0], k, grouped):
        return "decode"
    cublas_ok = scaled_mm.is_available(a.data.device) and scaled_mm.supports(a, b)
    if choice == "triton" or not cublas_ok:
        return "triton"
    return "cublas"


class CudaBackend:
    """Triton quantization + cuBLAS/Triton blockwise GEMMs; see the module docstring."""

    name = "cuda"

    def quantize(self, x: torch.Tensor, block: Block, pow2_scale: bool = False) -> Fp8Tensor:
        reference._check_input(x)
        _check_cuda(x, "the input")
        block = check_block(block)
        if block == ACT:
            data, scale = tk.quantize_act_1x128(x, pow2_scale)
        elif block == TOKEN:
            data, scale = _quantize_token(x, pow2_scale)
        else:
            data, scale, _ = tk.quantize_weight_128x128(x, pow2_scale)
        return Fp8Tensor(data, scale, block)

    def quantize_weight_pair(self, w: torch.Tensor, pow2_scale: bool = False) -> tuple[Fp8Tensor, Fp8Tensor]:
        """W (N, K) per 128x128 tile and W^T's quantized form with its data row-major (K, N), one pass."""
        reference._check_input(w, "the weight")
        _check_cuda(w, "the weight")
        data, scale, data_t = tk.quantize_weight_128x128(w, pow2_scale, emit_t=True)
        return Fp8Tensor(data, scale, WEIGHT), Fp8Tensor(data_t, scale.t(), WEIGHT)

    def quantize_act_and_token(self, x: torch.Tensor, pow2_scale: bool = False) -> tuple[Fp8Tensor, Fp8Tensor]:
        """x per 1x128 and per 128x1 (grad_out for DGrad and WGrad).

        With ``FUSED_ACT_AND_TOKEN`` (the default) from one read of x by the kernel
        ``FUSED_ACT_AND_TOKEN_KERNEL`` names; as two kernels otherwise, and where the Gluon kernel cannot
        run (see :data:`FUSED_ACT_AND_TOKEN`).
        """
        reference._check_input(x)
        _check_cuda(x, "the input")
        one_pass = _kernel_choice(FUSED_ACT_AND_TOKEN_KERNEL, "FUSED_ACT_AND_TOKEN_KERNEL") if FUSED_ACT_AND_TOKEN \
            else None
        if one_pass == "gluon" and _gluon_takes(x):
            data, scale, tok, tok_scale = token_gluon.quantize_act_and_token(x, pow2_scale)
        elif one_pass == "triton":
            data, scale, tok, tok_scale = tk.quantize_act_1x128(x, pow2_scale, emit_token=True)
        else:
            data, scale = tk.quantize_act_1x128(x, pow2_scale)
            tok, tok_scale = _quantize_token(x, pow2_scale)
        return Fp8Tensor(data, scale, ACT), Fp8Tensor(tok, tok_scale, TOKEN)

    def requantize(self, t: Fp8Tensor, block: Block, pow2_scale: bool = False) -> Fp8Tensor:
        block = check_block(block)
        _check_cuda(t.data, "the FP8 tensor")
        if t.block == ACT and block == TOKEN:
            if _kernel_choice(REQUANT_KERNEL, "REQUANT_KERNEL") == "gluon" and t.data.stride(1) == 1:
                data, scale = token_gluon.requantize_act_to_token(t.data, t.scale, pow2_scale)
            else:
                data, scale = tk.requantize_act_to_token(t.data, t.scale, pow2_scale)
            return Fp8Tensor(data, scale, TOKEN)
        return self.quantize(t.dequantize(), block, pow2_scale)  # rare pairs: same arithmetic, unfused

    def grouped_gemm(self, a: Fp8Tensor, weights: list[Fp8Tensor], biases: list[torch.Tensor | None],
                     out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor | None:
        """``cat([a @ w.T (+ bias)])`` in one launch for decode-sized ``a`` and 128x128-block weights that
        share it; ``None`` where this does not apply (the caller then runs the GEMMs one by one)."""
        if (a.block != ACT or not 1 <= len(weights) <= 3 or any(w.block != WEIGHT for w in weights)
                or gemm_path(a, weights[0], grouped_n=sum(w.shape[0] for w in weights)) != "decode"
                or (any(b is not None for b in biases) and any(b is None for b in biases))):
            return None
        for w in weights:
            reference.check_gemm_operands(a, w)
        _check_cuda(a.data, "the left operand")
        bias_list = [b.to(out_dtype) if b is not None else None for b in biases]
        return dk.fp8_decode_gemm_grouped(a.data, a.scale, [(w.data, w.scale, b) for w, b in zip(weights, bias_list)],
                                          out_dtype)

    def gemm(self, a: Fp8Tensor, b: Fp8Tensor, out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        reference.check_gemm_operands(a, b)
        _check_cuda(a.data, "the left operand")
        path = gemm_path(a, b)
        rows = 128 if b.block == WEIGHT else 1
        if path == "cublas":
            return scaled_mm.blockwise_scaled_mm(a, b, out_dtype)
        if path == "decode":
            return dk.fp8_decode_gemm(a.data, a.scale, b.data, b.scale, rows, out_dtype)
        return tk.blockwise_fp8_gemm(a.data, a.scale, b.data, b.scale, rows, out_dtype)


register_backend("cuda", CudaBackend)
