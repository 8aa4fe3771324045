"""The RL step on a tiny random model and a toy task (CPU): learning, mismatch metrics, resume."""

import copy
import math

import pytest
import torch

from jetrl.config import load_config
from jetrl.rl.trainer import PromptItem, Trainer

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


def make_trainer(recipe="bf16", overrides=(), dtype=torch.float32):
    from jetrl.models import DecoderConfig, build_model
    from jetrl.rollout import RolloutEngine

    cfg = load_config(None, [f"--recipe={recipe}", "--data.prompts_per_step=4", "--rollout.n=4",
                             "--rollout.max_tokens=8", "--algorithm.mini_batch_size=8",
                             "--algorithm.micro_batch_size=4", "--optim.lr=1e-2", "--optim.grad_clip=1.0",
                             "--trainer.steps=20", *overrides])
    model = build_model(DecoderConfig(**MODEL), dtype=dtype, recipe=recipe, seed=0)
    engine = RolloutEngine(model, max_num_seqs=16, num_blocks=64, block_size=4, progress=False)
    return Trainer(cfg, model, engine, ToyPrompts(4), low_token_reward, decode)


def test_reward_rises_and_every_parameter_changes():
    trainer = make_trainer("bf16")
    start = {k: v.detach().clone() for k, v in trainer.model.named_parameters()}
    rewards = []
    for _ in range(12):
        m = trainer.step()
        assert all(not isinstance(v, float) or not math.isnan(v) for v in m.values()), m
        rewards.append(m["reward/mean"])
    assert sum(rewards[-4:]) / 4 > sum(rewards[:4]) / 4 + 0.15, rewards
    for k, v in trainer.model.named_parameters():
        assert not torch.equal(v, start[k]), f"{k} did not change"
    # bf16 recipe with fp32 weights on CPU: rollout and training agree to fp32 rounding
    assert m["mismatch/logp_abs_diff_max"] < 1e-4
    assert trainer.step_count == 12 and m["actor/num_updates"] == 2
