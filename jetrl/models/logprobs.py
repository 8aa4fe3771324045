"""Per-token log-probabilities and entropies, in fp32, without materialising (N, vocab) logits.

The definition shared by rollout and training: ``logprob = log_softmax(logits / temperature)[target]``
in fp32, before any top-p / top-k truncation; ``entropy = -sum(p * log p)`` of that same distribution.

The LM head runs on ``chunk_size`` rows at a time, inside one autograd function
(:class:`_LMHeadLogprobs`): forward keeps, per row, only the log-sum-exp and the entropy besides the
(N, hidden) input; backward recomputes each chunk's logits, turns them into d(loss)/d(logits) in place
and feeds them to the two GEMMs of the head's backward (d hidden, d weight accumulated over chunks).
No tensor larger than ``chunk_size x vocab`` is created, forward or backward, unless the logits are kept
for the backward (``keep_logits_bytes``: the default on the kernels' path when they fit in
``KEEP_LOGITS_BYTES``), which saves recomputing them: one of the head's four GEMMs.

The per-chunk statistics and logit gradients have two implementations, picked by the seam
(:func:`jetrl.quant.backend.choose_impl`): one Triton kernel each way (:mod:`jetrl.quant.kernels.logprobs_triton`,
reading the chunk's logits in the model dtype once), or the PyTorch formulas below (fp32 copies). Heads that are not
a plain bias-free ``nn.Linear`` take the generic path (``model.compute_logits`` per chunk under activation
checkpointing).

**Exact mode** (``exact=True``, :mod:`jetrl.quant.exact`): the rollout sampler and the trainer compute the
log-probability with ONE function, :func:`exact_logprobs_from_logits`, from the logits of the batch-invariant LM
head (the values of ``model.compute_logits(..., exact=True)``), so the two are bitwise equal. A plain head runs the
chunked function of fast mode with the exact GEMM for the logits and that function for the statistics; other heads
run ``compute_logits(exact=True)`` per chunk under activation checkpointing. Either way the backward is the
hand-written logit gradient of fast mode (only forward values must match the rollout's).
"""

from __future__ import annotations

import functools

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from jetrl.quant.backend import KERNEL_DTYPES, choose_impl
from jetrl.quant.exact import exact_linear

DEFAULT_CHUNK_SIZE = 512  # the PyTorch path's rows per chunk (its fp32 temporaries: ~14 bytes per logit)
FUSED_CHUNK_SIZE = 2048  # the kernels' (the logits in the model dtype only: ~2 bytes per logit)
# With autograd on the kernels' path, logits up to this size are kept for the backward rather than recomputed
# there (saves one of the LM head's four GEMMs; 8,192 rows x 128k vocab in bf16 is 2 GiB)
KEEP_LOGITS_BYTES = 4 << 30


def chunk_stats_reference(logits: torch.Tensor, targets: torch.Tensor,
                          temperature: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """fp32 ``(logprob, entropy, logsumexp)`` per row of a chunk of logits (rows, vocab): the definition."""
    z = logits.float() if temperature == 1.0 else logits.float() / temperature
    lse = torch.logsumexp(z, dim=-1)
    picked = z.gather(-1, targets.clamp(min=0)[:, None])[:, 0]
    logprobs = torch.where(targets >= 0, picked - lse, torch.zeros_like(lse))
    probs = torch.exp(z - lse[:, None])
    entropy = lse - (probs * z).sum(-1)
    return logprobs, entropy, lse


def chunk_grad_reference(logits: torch.Tensor, targets: torch.Tensor, lse: torch.Tensor, entropy: torch.Tensor,
                         grad_logprob: torch.Tensor | None, grad_entropy: torch.Tensor | None,
                         temperature: float) -> torch.Tensor:
    """d(loss)/d(logits) in the logits' dtype, from the upstream gradients of logprob and entropy:
    ``dz = g_lp * (onehot(target) - p) - g_ent * p * (z - lse + entropy)``, ``dlogits = dz / T``."""
    z = logits.float() if temperature == 1.0 else logits.float() / temperature
    p = torch.exp(z - lse[:, None])
    dz = torch.zeros_like(z)
    if grad_logprob is not None:
        g = torch.where(targets >= 0, grad_logprob.float(), torch.zeros_like(lse))
        dz = -g[:, None] * p
        rows = torch.arange(len(targets), device=z.device)
        dz[rows, targets.clamp(min=0)] += g
    if grad_entropy is not None:
        dz = dz - grad_entropy.float()[:, None] * p * (z - lse[:, None] + entropy[:, None])
    if temperature != 1.0:
        dz = dz / temperature
    return dz.to(logits.dtype)


def exact_stats_reference(logits: torch.Tensor, targets: torch.Tensor, temperature: torch.Tensor
                          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Exact mode's ``(logprob, entropy, logsumexp)`` in PyTorch (the path off the kernels, e.g. on CPU):
    ``log_softmax(float(logits) / T)`` row by row (max, sum of exp, log: a per-row kernel, batch-invariant), the
    target's entry, ``-sum(p * log p)``, and the log-sum-exp (for the backward only)."""
    z = logits.float() / temperature.to(torch.float32)[:, None]
    logsm = z.log_softmax(dim=-1)
    picked = logsm.gather(-1, targets.clamp(min=0)[:, None])[:, 0]
    lp = torch.where(targets >= 0, picked, torch.zeros_like(picked))
    return lp, -(logsm.exp() * logsm).sum(-1), torch.logsumexp(z, dim=-1)


def exact_logprobs_from_logits(logits: torch.Tensor, targets: torch.Tensor, temperature: torch.Tensor,
                               impl: str | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Exact mode's fp32 ``(logprob, entropy, logsumexp)`` per row of ``logits`` (B, V) at ``targets`` (B,)
    (logprob 0 where negative), each row at its temperature ``temperature`` (B,): ONE function for the rollout's
    sampler and the trainer, so equal logits give equal bits on both sides.

    Two implementations, one dispatch rule (:func:`~jetrl.quant.backend.choose_impl`, op ``"logprobs"``; ``impl``
    forces one): the kernel :func:`jetrl.quant.kernels.logprobs_triton.exact_logprob_stats` (one pass over each
    row's logits, nothing of size (B, V) written), else :func:`exact_stats_reference`. Each is batch-invariant
    (a row's bits depend on that row alone); the two agree to fp32 rounding, not bitwise, which is fine because
    both sides of exact mode reach the same one on a given device. The logits are read as their fp32 values:
    fp32 and 16-bit logits of the same values give the same bits (the kernel reads 16-bit ones as they are)."""
    if logits.dim() != 2 or targets.shape != logits.shape[:1] or temperature.shape != logits.shape[:1]:
        raise ValueError(f"exact log-probabilities: logits (B, V), targets and temperature (B,), got "
                         f"{tuple(logits.shape)}, {tuple(targets.shape)} and {tuple(temperature.shape)}")
    if choose_impl(logits, impl, op="logprobs") == "triton":
        from jetrl.quant.kernels.logprobs_triton import exact_logprob_stats

        return exact_logprob_stats(logits if logits.dtype in KERNEL_DTYPES else logits.float(), targets,
                                   temperature.to(torch.float32))
    return exact_stats_reference(logits, targets, temperature)


class _ExactStats(torch.autograd.Function):
    """:func:`exact_logprobs_from_logits` of fp32 logits at one temperature, differentiable: the backward is the
    hand-written d(loss)/d(logits) of :func:`chunk_grad_reference` (or its kernel), not autograd's."""

    @staticmethod
    def forward(ctx, logits, targets, temperature, impl):
        t = torch.full((logits.shape[0],), temperature, dtype=torch.float32, device=logits.device)
        lp, ent, lse = exact_logprobs_from_logits(logits, targets, t, impl)
        ctx.save_for_backward(logits, targets, lse, ent)
        ctx.temperature, ctx.impl = temperature, impl
        ctx.mark_non_differentiable(lse)
        return lp, ent, lse

    @staticmethod
    def backward(ctx, g_lp, g_ent, _g_lse):
        logits, targets, lse, ent = ctx.saved_tensors
        work = logits.clone() if ctx.impl == "triton" else logits  # the kernel writes the gradient in place
        return _grad(work, targets, lse, ent, g_lp, g_ent, ctx.temperature, ctx.impl), None, None, None


def _exact_chunk(model, hidden: torch.Tensor, targets: torch.Tensor, temperature: float, impl: str | None):
    lp, ent, _ = _ExactStats.apply(model.compute_logits(hidden, exact=True), targets, temperature, impl)
    return lp, ent


def _stats(logits, targets, temperature, impl):
    if impl == "triton":
        from jetrl.quant.kernels.logprobs_triton import logprob_stats

        return logprob_stats(logits, targets, temperature)
    return chunk_stats_reference(logits, targets, temperature)


def _grad(logits, targets, lse, entropy, g_lp, g_ent, temperature, impl):
    if impl == "triton":
        from jetrl.quant.kernels.logprobs_triton import logprob_grad_

        return logprob_grad_(logits, targets, lse, entropy, g_lp, g_ent, temperature)
    return chunk_grad_reference(logits, targets, lse, entropy, g_lp, g_ent, temperature)


class _LMHeadLogprobs(torch.autograd.Function):
    """``(logprob, entropy)`` of ``targets`` under ``softmax(hidden @ weight.T / T)``, chunk by chunk.

    With ``keep_logits`` the forward writes every chunk's logits into one (N, vocab) buffer that the
    backward turns into logit gradients in place, instead of recomputing them (one LM-head GEMM less).
    ``exact``: the logits from exact mode's batch-invariant GEMM and the statistics from
    :func:`exact_logprobs_from_logits` (the sampler's function); the gradient formula is the same."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, temperature, chunk_size, impl, keep_logits=False, exact=False):
        n = hidden.shape[0]
        lp = hidden.new_empty(n, dtype=torch.float32)
        ent, lse = torch.empty_like(lp), torch.empty_like(lp)
        kept = hidden.new_empty(n, weight.shape[0]) if keep_logits else None
        temps = torch.full((min(n, chunk_size),), temperature, dtype=torch.float32, device=hidden.device) \
            if exact else None
        for s in range(0, n, chunk_size):
            e = min(n, s + chunk_size)
            logits = _head_logits(hidden[s:e], weight, exact)
            if kept is not None:
                kept[s:e] = logits
            if exact:  # the sampler's function, on the values of compute_logits(exact=True) (read unwidened)
                lp[s:e], ent[s:e], lse[s:e] = exact_logprobs_from_logits(logits, targets[s:e], temps[:e - s], impl)
            else:
                lp[s:e], ent[s:e], lse[s:e] = _stats(logits, targets[s:e], temperature, impl)
        ctx.save_for_backward(hidden, weight, targets, lse, ent)
        ctx.temperature, ctx.chunk_size, ctx.impl, ctx.kept, ctx.exact = temperature, chunk_size, impl, kept, exact
        return lp, ent

    @staticmethod
    def backward(ctx, g_lp, g_ent):
        hidden, weight, targets, lse, ent = ctx.saved_tensors
        kept, ctx.kept = ctx.kept, None  # overwritten below; freed with this function's references
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        d_hidden = torch.empty_like(hidden) if need_h else None
        d_weight = None
        n = hidden.shape[0]
        for s in range(0, n, ctx.chunk_size):
            e = min(n, s + ctx.chunk_size)
            h = hidden[s:e]
            logits = kept[s:e] if kept is not None else _head_logits(h, weight, ctx.exact)
            dlogits = _grad(logits, targets[s:e], lse[s:e], ent[s:e],
                            None if g_lp is None else g_lp[s:e], None if g_ent is None else g_ent[s:e],
                            ctx.temperature, ctx.impl)
            if need_h:
                torch.mm(dlogits, weight, out=d_hidden[s:e])
            if need_w:  # one rounding per chunk: the GEMM adds into the running sum (beta = 1)
                d_weight = dlogits.t() @ h if d_weight is None else d_weight.addmm_(dlogits.t(), h)
        if need_w and d_weight is None:
            d_weight = torch.zeros_like(weight)
        return d_hidden, d_weight, None, None, None, None, None, None


def _head_logits(hidden: torch.Tensor, weight: torch.Tensor, exact: bool) -> torch.Tensor:
    """A chunk's logits in the model dtype: ``F.linear``, or exact mode's batch-invariant GEMM (the values of
    ``compute_logits(hidden, exact=True)`` before its widening to fp32)."""
    return exact_linear(hidden, weight) if exact else F.linear(hidden, weight)


def _plain_head_weight(model) -> torch.Tensor | None:
    """The LM head's weight when logits are exactly ``F.linear(hidden, weight)`` (a jetrl decoder's bias-free
    ``nn.Linear`` head, ``compute_logits`` not overridden); ``None`` sends the model to the generic path."""
    from jetrl.models.transformer import DecoderLM

    if (isinstance(model, DecoderLM) and type(model).compute_logits is DecoderLM.compute_logits
            and type(model.lm_head) is nn.Linear and model.lm_head.bias is None):
        return model.lm_head.weight
    return None


def _chunk_logprobs(model, hidden: torch.Tensor, targets: torch.Tensor, temperature: float):
    lp, ent, _ = chunk_stats_reference(model.compute_logits(hidden), targets, temperature)
    return lp, ent


def logprobs_from_hidden(model, hidden: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0,
                         chunk_size: int | None = None, impl: str | None = None,
                         keep_logits_bytes: int | None = None, exact: bool = False, check_targets: bool = True
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """Chunked fp32 log-probabilities and entropies of ``targets`` (N,) from final hidden states (N, hidden).

    A negative target marks a row without a target (its logprob is 0; its entropy is still computed).
    ``chunk_size``: rows per chunk (default: ``DEFAULT_CHUNK_SIZE`` on the PyTorch path,
    ``FUSED_CHUNK_SIZE`` on the kernels'); ``impl`` forces ``"reference"`` or ``"triton"``.
    ``keep_logits_bytes``: with autograd, keep the (N, vocab) logits in the model dtype for the backward
    when they take at most this many bytes, instead of recomputing them there (default:
    ``KEEP_LOGITS_BYTES`` on the kernels' path, 0 on the PyTorch path).
    ``exact``: exact mode (see the module docstring): bitwise the rollout sampler's log-probabilities of the
    same rows; ``model`` must have ``compute_logits(hidden, exact=True)`` (a jetrl decoder).
    ``check_targets``: on the kernels' path with a plain head, check that targets are below the vocabulary size
    (a host sync; the kernels would read past a row); a caller that checked its ids on the host passes False.
    """
    if hidden.dim() != 2 or targets.shape != hidden.shape[:1]:
        raise ValueError(f"hidden must be (N, hidden) and targets (N,), got {tuple(hidden.shape)} and "
                         f"{tuple(targets.shape)}")
    if targets.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"targets must be an integer tensor, got {targets.dtype}")
    if not float(temperature) > 0:
        raise ValueError(f"temperature must be positive, got {temperature}")
    if chunk_size is not None and int(chunk_size) <= 0:
        raise ValueError(f"chunk_size must be positive, got {chunk_size}")
    targets = targets.long()
    temperature = float(temperature)
    weight = _plain_head_weight(model)
    if weight is None and not exact:
        return _chunked(_chunk_logprobs, model, hidden, targets, temperature, int(chunk_size or DEFAULT_CHUNK_SIZE))
    if weight is not None and (weight.dtype != hidden.dtype or weight.device != hidden.device):
        raise ValueError(f"hidden ({hidden.dtype}, {hidden.device}) must match the LM head "
                         f"({weight.dtype}, {weight.device})")
    # exact mode: the sampler's rule (device and backend only), so both sides reach the same implementation;
    # resolved once, so a backward runs the same one
    chosen = choose_impl(hidden, impl, eligible=exact or hidden.dtype in KERNEL_DTYPES, op="logprobs")
    size = int(chunk_size or (FUSED_CHUNK_SIZE if chosen == "triton" else DEFAULT_CHUNK_SIZE))
    if weight is None:
        return _chunked(_exact_chunk, model, hidden, targets, temperature, size, chosen)
    if check_targets and chosen == "triton" and targets.numel() and int(targets.max()) >= weight.shape[0]:
        # the kernels would read past a row (a host sync: ``check_targets=False`` from a caller that checked)
        raise ValueError(f"targets hold ids >= the vocabulary size {weight.shape[0]}")
    keep = False  # without autograd nothing is kept
    if torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad):
        budget = keep_logits_bytes if keep_logits_bytes is not None else KEEP_LOGITS_BYTES if chosen == "triton" else 0
        keep = hidden.shape[0] * weight.shape[0] * hidden.element_size() <= budget
    return _LMHeadLogprobs.apply(hidden, weight, targets, temperature, size, chosen, keep, exact)


def _chunked(chunk_fn, model, hidden: torch.Tensor, targets: torch.Tensor, temperature: float, size: int, *args):
    """The generic path, for a head that is not a plain ``nn.Linear`` (:func:`_plain_head_weight`):
    ``chunk_fn(model, hidden, targets, temperature, *args) -> (logprob, entropy)`` per chunk of ``size`` rows,
    under activation checkpointing with grad."""
    if torch.is_grad_enabled() and hidden.requires_grad:
        chunk_fn = functools.partial(checkpoint, chunk_fn, use_reentrant=False, preserve_rng_state=False)
    parts = [chunk_fn(model, hidden[start:start + size], targets[start:start + size], temperature, *args)
             for start in range(0, hidden.shape[0], size)]
    if not parts:
        empty = hidden.new_zeros(0, dtype=torch.float32)
        return empty, empty.clone()
    return torch.cat([lp for lp, _ in parts]), torch.cat([ent for _, ent in parts])


def token_logprobs(model, input_ids: torch.Tensor, positions: torch.Tensor, cu_seqlens: torch.Tensor,
                   max_seqlen: int | None, targets: torch.Tensor, temperature: float = 1.0,
                   chunk_size: int | None = None, impl: str | None = None, exact: bool = False,
                   kv_fp8: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed forward then chunked fp32 ``(logprobs (N,), entropy (N,))`` of ``targets`` (N,).

    Row ``i``'s logprob is that of ``targets[i]`` under the distribution predicted at row ``i`` (the
    caller shifts: ``targets[i] = input_ids[i + 1]`` inside a sequence, and a negative value where there
    is no next token). Differentiable; see the module docstring for the memory bound. ``exact``: exact mode
    (bitwise the rollout engine's log-probabilities with ``exact=True``). ``kv_fp8``: attention over K and V as
    an FP8 KV cache holds them (the training side of ``jet`` with the FP8 cache, see ``forward_packed``).
    """
    hidden = model.forward_packed(input_ids, positions, cu_seqlens, max_seqlen, exact=exact, kv_fp8=kv_fp8)
    return logprobs_from_hidden(model, hidden, targets, temperature, chunk_size, impl, exact=exact)


__all__ = ["token_logprobs", "logprobs_from_hidden", "exact_logprobs_from_logits", "chunk_stats_reference",
           "chunk_grad_reference", "DEFAULT_CHUNK_SIZE", "FUSED_CHUNK_SIZE", "KEEP_LOGITS_BYTES"]
