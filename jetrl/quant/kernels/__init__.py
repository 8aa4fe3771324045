"""The kernels behind the ``"cuda"`` FP8 backend, named by role and layout, and their one tuning object.

Nothing outside this folder imports these modules at import time: the seam (:mod:`jetrl.quant.backend`) loads
:mod:`~jetrl.quant.kernels.cuda_backend` when the CUDA backend is first chosen, and the fused ops import their
kernel module when the seam picks it. Every module here imports Triton but :mod:`~jetrl.quant.kernels.tuning`,
:mod:`~jetrl.quant.kernels.gemm_scaled_mm` and :mod:`~jetrl.quant.kernels.gemm_deepgemm`; with ``TRITON_INTERPRET=1``
set before Triton is imported, the Triton kernels run on CPU tensors (the tests do).

=============================  ==============================================================================
module                         what it holds
=============================  ==============================================================================
``cuda_backend``               the CUDA backend: which kernel runs each FP8 operation and GEMM shape
``tuning``                     the frozen tuning object (paths, tiles, warps, decode configs) and ``override``
``quantize_triton``            1x128, 128x1, 128x128 (+ W^T) and 1x128 -> 128x1 quantization; shared helpers
``quantize_gluon``             the 128x1 kernels and grad_out's one-pass 1x128 + 128x1 in Gluon
``gemm_scaled_mm``             cuBLAS blockwise FP8 GEMM (``F.scaled_mm``) and its layout rules
``gemm_deepgemm``              DeepGEMM's FP8 GEMMs (decode GEMMs, where it loads) and compiling them ahead
``gemm_triton``                the Triton blockwise FP8 GEMM (shapes cuBLAS rejects)
``gemm_decode_triton``         the split-K decode GEMM (and grouped q/k/v, gate/up launches)
``gemm_exact_triton``          exact mode's batch-invariant FP8 and 16/32-bit GEMMs (tiles and K split fixed per shape)
``norm_triton``                residual add + RMSNorm (+ 1x128 FP8 of the output), forward and backward
``swiglu_triton``              SwiGLU (+ 1x128 FP8 of the output), forward and backward
``rope_triton``                RoPE of q and k in one launch, forward and backward
``logprobs_triton``            the LM head's per-token log-probabilities and entropies, and their gradient
``paged_attention_triton``     paged decode attention (flash-decoding splits), over a BF16 or FP8 K/V cache
``paged_attention_gluon``      Gluon paged decode attention over an FP8 K/V cache (warps as streams of tiles)
``decode_splits``              the decode attention kernels' split merge, SM count and 32-bit offset check
``exact_attention_triton``     exact mode's one attention forward (prefill, paged decode, packed training)
``kv_cache_triton``            the FP8 K/V cache write: quantize new tokens' K/V per (token, head), scatter
``sampling_triton``            the seeded Gumbel-max sampler for rows without truncation
=============================  ==============================================================================

Each kernel's specification is a plain PyTorch function outside this folder (``jetrl.quant.reference``,
``jetrl.quant.norm``, ``jetrl.quant.swiglu``, ``jetrl.models.rope``, ``jetrl.models.logprobs``,
``jetrl.models.attention``, ``jetrl.rollout.sampling``), and the tests hold each kernel to it.
"""
