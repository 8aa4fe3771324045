"""Triton kernels for the LM head's log-probabilities and entropies, one pass over the logits each way.

Unfused, a chunk of logits costs about ten full-width PyTorch kernels forward (an fp32 copy, the
temperature division, logsumexp's max and exp-sum, exp, product, sum) and as many again backward, each
reading and writing a (rows x vocab) fp32 tensor: a large share of a training step's non-GEMM time.
Here:

* :func:`logprob_stats` reads the chunk's logits (model dtype) once and returns, per row, the
  log-probability of the target, the entropy and the log-sum-exp, all in fp32 (an online log-sum-exp
  that rescales its running sums when the running maximum grows).
* :func:`exact_logprob_stats` is the same pass for exact mode (:mod:`jetrl.quant.exact`): a temperature per
  row and one fixed configuration, so a row's bits depend on that row alone (and not on whether its logits
  come as fp32, the sampler's, or bf16, the trainer's); the rollout's sampler and the trainer both call it
  (through ``jetrl.models.logprobs.exact_logprobs_from_logits``).
* :func:`logprob_grad_` reads them once more and overwrites them with d(loss)/d(logits), given the
  upstream gradients of the log-probabilities and entropies and the saved log-sum-exp and entropy.

Arithmetic (the reference is ``jetrl.models.logprobs.chunk_stats_reference`` /
``chunk_grad_reference``): ``z = float(logit) / T`` (IEEE division, as the reference's), ``p = exp(z - lse)``,
``logprob = z[target] - lse`` (0 where target < 0), ``entropy = lse - sum(p * z)``;
backward ``dz = g_lp * (onehot(target) - p) - g_ent * p * (z - lse + entropy)``, ``dlogit = dz / T``.
Only the summation order differs from the reference, so results agree to fp32 rounding.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from jetrl.quant.kernels.quantize_triton import cast_rne
from jetrl.quant.kernels.tuning import COMPILE_OPTIONS

STATS_BLOCK_V = 4096
GRAD_BLOCK_V = 2048
STATS_NUM_WARPS = 8  # warps of the statistics kernel (logprob_stats)
GRAD_NUM_WARPS = 8  # warps of the gradient kernel (logprob_grad_)
EXACT_NUM_WARPS = 8  # exact mode's statistics kernel: its warps set the order of its sums, part of its bits


@triton.jit
def _stats_loop(x_row, cols, V, temp, SCALE: tl.constexpr, NUM_BLOCKS: tl.constexpr, BLOCK_V: tl.constexpr):
    """The row's online log-sum-exp over its vocabulary in blocks of ``BLOCK_V``: the running maximum ``m``,
    ``s = sum exp(z - m)`` and ``w = sum exp(z - m) * z``, with ``z = logit / temp`` (``SCALE``) or the logit."""
    m = tl.full((), float("-inf"), tl.float32)
    s = tl.zeros((), tl.float32)  # sum exp(z - m)
    w = tl.zeros((), tl.float32)  # sum exp(z - m) * z
    for i in range(NUM_BLOCKS):  # a constexpr trip count (vocab is fixed per model)
        v0 = i * BLOCK_V
        ok = v0 + cols < V
        z = tl.load(x_row + v0 + cols, mask=ok, other=float("-inf")).to(tl.float32)
        if SCALE:
            z = tl.div_rn(z, temp)
        m_new = tl.maximum(m, tl.max(z, axis=0))
        alpha = tl.exp(m - m_new)
        e = tl.exp(z - m_new)
        s = s * alpha + tl.sum(e, axis=0)
        w = w * alpha + tl.sum(tl.where(ok, e * z, 0.0), axis=0)
        m = m_new
    return m, s, w


@triton.jit
def _logprob_stats_kernel(x_ptr, t_ptr, lp_ptr, ent_ptr, lse_ptr, temp_ptr, V, stride_x, temp,
                          SCALE: tl.constexpr, EXACT: tl.constexpr, NUM_BLOCKS: tl.constexpr,
                          BLOCK_V: tl.constexpr):
    row = tl.program_id(0)
    x_row = x_ptr + row.to(tl.int64) * stride_x
    cols = tl.arange(0, BLOCK_V)
    if EXACT:  # each row's own temperature; at most 4 contiguous logits per thread, whatever their dtype: the same
        temp = tl.load(temp_ptr + row)  # register layout, so the same order of every sum, for fp32 and 16-bit logits
        cols = tl.max_contiguous(cols, 4)
        if temp == 1.0:  # skips the division (x / 1.0 == x exactly: the same z, the same sums)
            m, s, w = _stats_loop(x_row, cols, V, temp, False, NUM_BLOCKS, BLOCK_V)
        else:
            m, s, w = _stats_loop(x_row, cols, V, temp, True, NUM_BLOCKS, BLOCK_V)
    else:
        m, s, w = _stats_loop(x_row, cols, V, temp, SCALE, NUM_BLOCKS, BLOCK_V)
    lse = m + tl.log(s)
    ent = lse - w / s
    tgt = tl.load(t_ptr + row)
    has = tgt >= 0
    zt = tl.load(x_row + tl.where(has, tgt, 0)).to(tl.float32)
    if SCALE:
        zt = tl.div_rn(zt, temp)
    tl.store(lp_ptr + row, tl.where(has, zt - lse, 0.0))
    tl.store(ent_ptr + row, ent)
    tl.store(lse_ptr + row, lse)


@triton.jit
def _logprob_grad_kernel(x_ptr, t_ptr, lse_ptr, ent_ptr, glp_ptr, gent_ptr, V, stride_x, temp,
                         SCALE: tl.constexpr, HAS_GLP: tl.constexpr, HAS_GENT: tl.constexpr,
                         BLOCK_V: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
    ok = cols < V
    ptrs = x_ptr + row.to(tl.int64) * stride_x + cols
    z = tl.load(ptrs, mask=ok, other=0.0).to(tl.float32)
    if SCALE:
        z = tl.div_rn(z, temp)
    lse = tl.load(lse_ptr + row)
    p = tl.exp(z - lse)
    dz = tl.zeros_like(z)
    if HAS_GLP:
        tgt = tl.load(t_ptr + row)
        g = tl.where(tgt >= 0, tl.load(glp_ptr + row), 0.0)
        dz = g * (tl.where(cols == tgt, 1.0, 0.0) - p)
    if HAS_GENT:
        dz -= tl.load(gent_ptr + row) * p * (z - lse + tl.load(ent_ptr + row))
    if SCALE:
        dz = tl.div_rn(dz, temp)
    tl.store(ptrs, cast_rne(dz, x_ptr.dtype.element_ty), mask=ok)


def _check(logits: torch.Tensor, targets: torch.Tensor) -> None:
    if logits.dim() != 2 or logits.stride(1) != 1:
        raise ValueError(f"logits must be a 2-D tensor with contiguous rows, got shape {tuple(logits.shape)} "
                         f"and strides {logits.stride()}")
    if targets.shape != logits.shape[:1]:
        raise ValueError(f"targets must be ({logits.shape[0]},), got {tuple(targets.shape)}")


def _stats_buffer(rows: int, device: torch.device) -> torch.Tensor:
    """The (3, rows) fp32 (logprob, entropy, logsumexp) output: a view of a (3, rows rounded up to 4) buffer, so each
    of the three rows starts 16-byte aligned whatever ``rows`` is (Triton specializes pointers on their alignment:
    a row count that moved it would compile the kernels again, mid-run)."""
    return torch.empty((3, -(-rows // 4) * 4), dtype=torch.float32, device=device)[:, :rows]


def logprob_stats(logits: torch.Tensor, targets: torch.Tensor,
                  temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """fp32 ``(logprob, entropy, logsumexp)`` per row of ``logits`` (rows, vocab) at ``temperature``."""
    _check(logits, targets)
    rows, vocab = logits.shape
    out = _stats_buffer(rows, logits.device)
    if rows:
        _logprob_stats_kernel[(rows,)](logits, targets, out[0], out[1], out[2], out[0], vocab, logits.stride(0),
                                       float(temperature), SCALE=float(temperature) != 1.0, EXACT=False,
                                       NUM_BLOCKS=triton.cdiv(vocab, STATS_BLOCK_V), BLOCK_V=STATS_BLOCK_V,
                                       num_warps=STATS_NUM_WARPS, **COMPILE_OPTIONS)
    return out[0], out[1], out[2]


def exact_logprob_stats(logits: torch.Tensor, targets: torch.Tensor,
                        temperature: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Exact mode's fp32 ``(logprob, entropy, logsumexp)`` per row of ``logits`` (rows, vocab; fp32, bf16 or fp16),
    each row at its own temperature (``temperature``: (rows,) fp32; a target < 0 gives logprob 0).

    Batch-invariant by construction: one program per row walks that row's vocabulary in the fixed blocks of
    ``STATS_BLOCK_V`` with its own fixed warp count (``EXACT_NUM_WARPS``), and nothing the compiled kernel depends on
    changes with the number of rows. Nor with the dtype: a 16-bit logit widens to fp32 exactly, and the kernel caps
    each thread's contiguous run at 4 elements, so fp32 and 16-bit logits get the same register layout and thus the
    same order of every sum (without the cap a 16-bit row would load 8 per thread): the sampler's fp32 logits and the
    trainer's bf16 logits of the same values give the same bits. Rows that are not dense or start unaligned (the
    16-byte alignment also sets the layout) are copied first, which changes no value. A row at temperature 1 skips
    the division in its pass (``x / 1.0 == x`` exactly: the same sums); the target's logit is divided either way."""
    if logits.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise TypeError(f"exact_logprob_stats: logits must be fp32, bf16 or fp16, got {logits.dtype}")
    if logits.dim() != 2 or targets.shape != logits.shape[:1] or temperature.shape != logits.shape[:1]:
        raise ValueError(f"exact_logprob_stats: logits (rows, vocab), targets and temperature (rows,), got "
                         f"{tuple(logits.shape)}, {tuple(targets.shape)} and {tuple(temperature.shape)}")
    rows, vocab = logits.shape
    if not logits.is_contiguous() or logits.data_ptr() % 16:
        logits = logits.clone(memory_format=torch.contiguous_format)  # a fresh allocation: aligned, dense
    out = _stats_buffer(rows, logits.device)
    if rows:
        _logprob_stats_kernel[(rows,)](logits, targets.to(torch.int64).contiguous(), out[0], out[1], out[2],
                                       temperature.to(torch.float32).contiguous(), vocab, vocab, 1.0,
                                       SCALE=True, EXACT=True, NUM_BLOCKS=triton.cdiv(vocab, STATS_BLOCK_V),
                                       BLOCK_V=STATS_BLOCK_V, num_warps=EXACT_NUM_WARPS, **COMPILE_OPTIONS)
    return out[0], out[1], out[2]


def logprob_grad_(logits: torch.Tensor, targets: torch.Tensor, lse: torch.Tensor, entropy: torch.Tensor,
                  grad_logprob: torch.Tensor | None, grad_entropy: torch.Tensor | None,
                  temperature: float = 1.0) -> torch.Tensor:
    """Overwrite ``logits`` with the gradient of the loss with respect to them (same dtype) and return it."""
    _check(logits, targets)
    rows, vocab = logits.shape
    if rows and vocab:
        grid = (rows, triton.cdiv(vocab, GRAD_BLOCK_V))
        _logprob_grad_kernel[grid](  # lse stands in for an absent upstream gradient (never read)
            logits, targets, lse, entropy,
            lse if grad_logprob is None else grad_logprob.float().contiguous(),
            lse if grad_entropy is None else grad_entropy.float().contiguous(),
            vocab, logits.stride(0), float(temperature), SCALE=float(temperature) != 1.0,
            HAS_GLP=grad_logprob is not None, HAS_GENT=grad_entropy is not None, BLOCK_V=GRAD_BLOCK_V,
            num_warps=GRAD_NUM_WARPS, **COMPILE_OPTIONS)
    return logits


__all__ = ["logprob_stats", "exact_logprob_stats", "logprob_grad_"]
