"""Per-token log-probabilities and entropies, in fp32, without materialising (N, vocab) logits.

The definition shared by rollout and training: ``logprob = log_softmax(logits / temperature)[target]``
in fp32, before any top-p / top-k truncation; ``entropy = -sum(p * log p)`` of that same distribution.

Memory: the LM head runs on ``chunk_size`` rows at a time. Inside a chunk the live temporaries are the
head's output in the model dtype, its fp32 copy, the fp32 probabilities and one fp32 product, so the
extra peak is about ``chunk_size * vocab * (2 + 3 * 4)`` bytes (~14 bytes per logit; 512 x 152k vocab:
~1.1 GB), independent of the number of tokens N. No tensor larger than ``chunk_size x vocab`` is ever
created. With autograd on, each chunk is checkpointed: backward keeps only the chunk's hidden rows and
recomputes its logits, so the saved state is the (N, hidden) input, not (N, vocab) logits.
"""

from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint

DEFAULT_CHUNK_SIZE = 512


def _chunk_logprobs(compute_logits, hidden: torch.Tensor, targets: torch.Tensor, temperature: float):
    logits = compute_logits(hidden)  # (C, V) fp32
    if temperature != 1.0:
        logits = logits / temperature
    lse = torch.logsumexp(logits, dim=-1)  # (C,)
    picked = logits.gather(-1, targets.clamp(min=0)[:, None])[:, 0]
    logprobs = torch.where(targets >= 0, picked - lse, torch.zeros_like(lse))
    probs = torch.exp(logits - lse[:, None])
    entropy = lse - (probs * logits).sum(-1)
    return logprobs, entropy


def logprobs_from_hidden(model, hidden: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0,
                         chunk_size: int = DEFAULT_CHUNK_SIZE) -> tuple[torch.Tensor, torch.Tensor]:
    """Chunked fp32 log-probabilities and entropies of ``targets`` (N,) from final hidden states (N, hidden).

    ``model.compute_logits`` maps hidden rows to fp32 logits. A negative target marks a row without a
    target (its logprob is 0; its entropy is still computed).
    """
    if hidden.dim() != 2 or targets.shape != hidden.shape[:1]:
        raise ValueError(f"hidden must be (N, hidden) and targets (N,), got {tuple(hidden.shape)} and "
                         f"{tuple(targets.shape)}")
    if targets.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"targets must be an integer tensor, got {targets.dtype}")
    if not float(temperature) > 0:
        raise ValueError(f"temperature must be positive, got {temperature}")
    if int(chunk_size) <= 0:
        raise ValueError(f"chunk_size must be positive, got {chunk_size}")
    targets = targets.long()
    recompute = torch.is_grad_enabled() and hidden.requires_grad
    lps, ents = [], []
    for start in range(0, hidden.shape[0], chunk_size):
        h, t = hidden[start:start + chunk_size], targets[start:start + chunk_size]
        if recompute:
            lp, ent = checkpoint(_chunk_logprobs, model.compute_logits, h, t, float(temperature), use_reentrant=False)
        else:
            lp, ent = _chunk_logprobs(model.compute_logits, h, t, float(temperature))
        lps.append(lp)
        ents.append(ent)
    if not lps:
        empty = hidden.new_zeros(0, dtype=torch.float32)
        return empty, empty.clone()
    return torch.cat(lps), torch.cat(ents)


def token_logprobs(model, input_ids: torch.Tensor, positions: torch.Tensor, cu_seqlens: torch.Tensor,
                   max_seqlen: int | None, targets: torch.Tensor, temperature: float = 1.0,
                   chunk_size: int = DEFAULT_CHUNK_SIZE) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed forward then chunked fp32 ``(logprobs (N,), entropy (N,))`` of ``targets`` (N,).

    Row ``i``'s logprob is that of ``targets[i]`` under the distribution predicted at row ``i`` (the
    caller shifts: ``targets[i] = input_ids[i + 1]`` inside a sequence, and a negative value where there
    is no next token). Differentiable; see the module docstring for the memory bound.
    """
    hidden = model.forward_packed(input_ids, positions, cu_seqlens, max_seqlen)
    return logprobs_from_hidden(model, hidden, targets, temperature, chunk_size)


__all__ = ["token_logprobs", "logprobs_from_hidden", "DEFAULT_CHUNK_SIZE"]
