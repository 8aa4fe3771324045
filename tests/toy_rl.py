"""The toy RL task the trainer tests share (one process and several ranks): a tiny decoder's config,
deterministic three-token prompts, and a reward for generating low token ids (it rises as the policy learns)."""

import torch

from jetrl.rl.batch import RolloutBatch
from jetrl.rl.trainer import PromptItem

MODEL = dict(model_type="llama", vocab_size=64, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, eos_token_id=1)
LOW_TOKENS = 32  # the toy reward: fraction of generated tokens below this id


class ToyPrompts:
    """Deterministic prompts of three tokens; position is resumable."""

    def __init__(self, per_step: int) -> None:
        self.per_step, self.pos = per_step, 0

    def next_batch(self):
        items = [PromptItem([2 + (self.pos + i) % 40, 3 + (self.pos + i) % 7, 4], "") for i in range(self.per_step)]
        self.pos += self.per_step
        return items

    def state_dict(self):
        return {"pos": self.pos}

    def load_state_dict(self, state):
        self.pos = state["pos"]


def decode(ids):
    return ",".join(map(str, ids))


def low_token_reward(texts, references):
    return [sum(int(t) < LOW_TOKENS for t in x.split(",")) / len(x.split(",")) if x else 0.0 for x in texts]


def ragged_batch(seed: int, num: int = 7, vocab: int = 64, width: int = 23, max_prompt: int = 17,
                 device: str = "cpu") -> RolloutBatch:
    """A rollout batch of random sequences: prompts of 1-``max_prompt`` tokens, responses of 0-``width`` tokens (the
    first one ``width``), so packed token counts are unaligned; response tensors on ``device``."""
    gen = torch.Generator().manual_seed(seed)
    prompts = torch.randint(1, max_prompt + 1, (num,), generator=gen).tolist()
    responses = torch.randint(0, width + 1, (num,), generator=gen).tolist()
    responses[0] = width  # one full-width response
    tokens = [torch.randint(0, vocab, (p + r,), generator=gen) for p, r in zip(prompts, responses)]
    mask = torch.zeros(num, width, dtype=torch.bool)
    for s, r in enumerate(responses):
        mask[s, :r] = True
    rollout_lp = torch.where(mask, -torch.rand(num, width, generator=gen), torch.zeros(()))
    return RolloutBatch(tokens, prompts, responses, mask.to(device), rollout_lp.to(device),
                        torch.rand(1, num, generator=gen), torch.randn(num, generator=gen).to(device), [False] * num)
