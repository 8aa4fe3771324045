"""Chunked fp32 logprobs/entropy: equal to log_softmax + gather, and never (N, vocab) at once."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import jetrl.models as jm
from conftest import VOCAB, rel_err


class LargestLogits(TorchDispatchMode):
    """Records the most elements of any vocab-wide tensor an op allocates (forward and backward); views
    (e.g. of the LM head's weight) allocate nothing and are not counted."""

    def __init__(self, vocab: int):
        super().__init__()
        self.vocab, self.largest = vocab, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in (out if isinstance(out, (tuple, list)) else [out]):
            if isinstance(t, torch.Tensor) and not func.is_view and t.dim() and t.shape[-1] == self.vocab:
                self.largest = max(self.largest, t.numel())
        return out


def packed_batch(lengths, gen):
    ids = torch.randint(0, VOCAB, (sum(lengths),), generator=gen)
    positions = torch.cat([torch.arange(n) for n in lengths])
    cu = torch.tensor([0] + lengths).cumsum(0).to(torch.int32)
    targets = torch.randint(0, VOCAB, (sum(lengths),), generator=gen)
    targets[cu[1:] - 1] = -1  # no next token at the end of a sequence
    return ids, positions, cu, targets


@pytest.mark.parametrize("temperature,chunk_size", [(1.0, 7), (0.7, 64), (1.3, 10_000)])
def test_matches_log_softmax_gather(hf_checkpoints, gen, temperature, chunk_size):
    model = jm.load_model(hf_checkpoints["qwen2"][0], dtype=torch.float32)
    lengths = [9, 30, 2]
    ids, positions, cu, targets = packed_batch(lengths, gen)
    with torch.no_grad():
        lp, ent = jm.token_logprobs(model, ids, positions, cu, max(lengths), targets, temperature, chunk_size)
        logits = model.compute_logits(model.forward_packed(ids, positions, cu, max(lengths))) / temperature
    logp = torch.log_softmax(logits.double(), -1)
    ref_lp = torch.where(targets >= 0, logp.gather(-1, targets.clamp(min=0)[:, None])[:, 0], 0.0)
    ref_ent = -(logp.exp() * logp).sum(-1)
    assert lp.dtype == ent.dtype == torch.float32 and lp.shape == ent.shape == targets.shape
    assert (lp[targets < 0] == 0).all() and (lp[targets >= 0] < 0).all()
    assert torch.allclose(lp.double(), ref_lp, atol=1e-5, rtol=0)  # fp32 logsumexp over 1000 logits
    assert torch.allclose(ent.double(), ref_ent, atol=1e-5, rtol=0)
    # the model's plain (B, T) forward scores the same tokens identically
    with torch.no_grad():
        plain = model(ids[cu[1]:cu[2]][None])[0].float() / temperature
    assert rel_err(plain, logits[cu[1]:cu[2]]) < 1e-5


def test_peak_is_one_chunk_and_gradients_match(hf_checkpoints, gen):
    model = jm.load_model(hf_checkpoints["llama"][0], dtype=torch.float32)
    lengths = [40, 25, 31]
    ids, positions, cu, targets = packed_batch(lengths, gen)
    n, chunk = sum(lengths), 16
    hidden = model.forward_packed(ids, positions, cu, max(lengths)).detach().requires_grad_(True)
    mode = LargestLogits(VOCAB)
    saved_for_backward = []
    with mode:
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved_for_backward.append(t.shape) or t, lambda t: t):
            lp, ent = jm.logprobs_from_hidden(model, hidden, targets, 1.0, chunk)
        (lp.sum() + 0.1 * ent.sum()).backward()
    # between forward and backward no logits are kept alive, only hidden rows
    assert saved_for_backward and not [s for s in saved_for_backward if s[-1] == VOCAB]
    # forward AND backward (chunk logits are recomputed, never kept): nothing bigger than chunk x vocab
    assert chunk * VOCAB == mode.largest < n * VOCAB
    grad_chunked = hidden.grad.clone()

    hidden.grad = None
    logits = model.compute_logits(hidden)
    logp = torch.log_softmax(logits, -1)
    ref_lp = torch.where(targets >= 0, logp.gather(-1, targets.clamp(min=0)[:, None])[:, 0], 0.0)
    ref_ent = -(logp.exp() * logp).sum(-1)
    (ref_lp.sum() + 0.1 * ref_ent.sum()).backward()
    assert torch.isfinite(grad_chunked).all()
    assert rel_err(grad_chunked, hidden.grad) < 1e-5


def test_bad_arguments(hf_checkpoints, gen):
    model = jm.load_model(hf_checkpoints["llama"][0], dtype=torch.float32)
    ids, positions, cu, targets = packed_batch([5, 6], gen)
    with pytest.raises(ValueError, match="temperature"):
        jm.token_logprobs(model, ids, positions, cu, 6, targets, temperature=0.0)
    with pytest.raises(ValueError, match="targets"):
        jm.token_logprobs(model, ids, positions, cu, 6, targets[:-1])
    with pytest.raises(ValueError, match="max_seqlen"):
        jm.token_logprobs(model, ids, positions, cu, 3, targets)
    with pytest.raises(ValueError, match="cu_seqlens"):
        jm.token_logprobs(model, ids, positions, torch.tensor([0, 4], dtype=torch.int32), 6, targets)
    with pytest.raises(TypeError, match="integer"):
        model(torch.rand(2, 3))
