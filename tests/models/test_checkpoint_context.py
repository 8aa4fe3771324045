"""Per-block activation checkpointing recomputes a block in the backward under the context variables its forward
ran in (the kernel tuning, a forced fused implementation): autograd runs a CUDA backward on device threads of its
own, whose context is empty, and a recomputation there would otherwise take the default kernels."""

from __future__ import annotations

import torch
import torch.nn as nn

from jetrl.models import build_model, token_logprobs
from jetrl.quant.kernels import tuning

QWEN = dict(model_type="qwen2", vocab_size=300, hidden_size=256, intermediate_size=384, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=True)


class _Probe(nn.Module):
    """A block that records the kernel tuning it runs under and ends in an ATen op that saves its input, so that the
    recomputation is started by that op's backward (not by one of jetrl's functions, which run their backward in
    their forward's context anyway)."""

    def __init__(self, layer: nn.Module, seen: list) -> None:
        super().__init__()
        self.layer, self.seen = layer, seen

    def forward(self, h, residual, *args):
        self.seen.append(tuning.current().gemm)
        h, residual = self.layer(h, residual, *args)
        return h * h.detach().sign(), residual  # |h|: the multiply saves the sign tensor, made in the block


def test_the_recomputation_sees_the_forwards_kernel_tuning():
    model = build_model(QWEN, dtype=torch.float32, recipe="jet", seed=4).set_activation_checkpointing(True)
    seen: list = []
    model.model.layers = nn.ModuleList(_Probe(layer, seen) for layer in model.model.layers)
    ids = torch.randint(2, 300, (40,), generator=torch.Generator().manual_seed(1))
    with tuning.override(gemm="triton"):
        lp, _ = token_logprobs(model, ids, torch.arange(40), torch.tensor([0, 40]), 40, torch.roll(ids, -1))
    assert seen == ["triton", "triton"]
    lp.sum().backward()  # outside the override, as a CUDA backward thread is
    assert seen == ["triton"] * 4  # each block's forward, then its recomputation
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())
