"""The trainer's view of a rollout, shared by the tests that compare the engine's log-probabilities with it."""

from __future__ import annotations

import torch

from jetrl.models import token_logprobs


def trainer_logprobs(model, prompts, completions, *, micro: int | None = None, exact: bool = True,
                     kv_fp8: bool = False) -> list[torch.Tensor]:
    """Each completion's response log-probs (on the CPU) from the training side's packed forward, no grad: all
    sequences in one forward or ``micro`` at a time, in exact mode by default (``kv_fp8``: over fake-quantized K/V,
    as the trainer runs jet with an FP8 KV cache). ``prompts[c.prompt_index]`` is each completion's prompt."""
    device = next(model.parameters()).device
    out = []
    step = micro or len(completions)
    for s in range(0, len(completions), step):
        group = completions[s:s + step]
        ids, pos, cu, tg = [], [], [0], []
        for c in group:
            seq = prompts[c.prompt_index] + c.token_ids
            ids += seq
            pos += range(len(seq))
            cu.append(cu[-1] + len(seq))
            tg += seq[1:] + [-1]
        with torch.no_grad():
            lp, _ = token_logprobs(model, torch.tensor(ids, device=device), torch.tensor(pos, device=device),
                                   torch.tensor(cu, device=device), None, torch.tensor(tg, device=device), 1.0,
                                   exact=exact, kv_fp8=kv_fp8)
        for i, c in enumerate(group):
            start = cu[i] + len(prompts[c.prompt_index]) - 1
            out.append(lp[start:start + len(c.token_ids)].cpu())
    return out
