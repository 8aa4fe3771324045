"""The rollout of one RL step as training sequences: :class:`RolloutBatch`.

The trainer makes it (rollout, rewards, advantages) and consumes it (log-probs, update); the metrics read it.
It lives in its own module so that both import it and neither imports the other for its type.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class RolloutBatch:
    """The rollout of one step as sequences (prompt-major: prompt p's samples are rows p*n .. p*n+n-1).

    Response tensors are (S, R) with R the longest response; ``mask`` marks real response tokens."""

    tokens: list[torch.Tensor]        # per sequence: prompt + response ids, (L_s,) int64
    prompt_lens: list[int]
    response_lens: list[int]
    mask: torch.Tensor                # (S, R) bool
    rollout_logprobs: torch.Tensor    # (S, R) fp32, 0 where masked
    rewards: torch.Tensor             # (P, n) fp32
    advantages: torch.Tensor          # (S,) fp32
    truncated: list[bool]             # finish_reason == "length"
    num_reward_errors: int = 0        # samples whose reward raised, was non-finite or out of bounds (scored 0)
    num_reward_timeouts: int = 0      # samples whose reward ran past the pool's timeout (scored 0)

    @property
    def num_sequences(self) -> int:
        return len(self.tokens)


__all__ = ["RolloutBatch"]
