"""A tiny RL setup for the several-rank tests: fp32 two-block decoder, toy prompts and reward (CPU)."""

from __future__ import annotations

import torch

from jetrl.config import load_config

MODEL = dict(model_type="llama", vocab_size=64, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, eos_token_id=1)
LOW_TOKENS = 32  # the toy reward: fraction of generated tokens below this id
# lr 0.1 moves the weights by several percent per step; eps 1.0 keeps AdamW close to linear in the
# gradient, so summation-order differences stay at fp32 rounding in the weights instead of being amplified
# by g / (|g| + eps) on near-zero gradient entries
BASE = ["--data.prompts_per_step=2", "--rollout.n=4", "--rollout.max_tokens=6", "--optim.lr=0.1",
        "--optim.eps=1.0", "--trainer.steps=4"]


class ToyPrompts:
    """Deterministic prompts of three tokens; position is resumable."""

    def __init__(self, per_step: int) -> None:
        self.per_step, self.pos = per_step, 0

    def next_batch(self):
        from jetrl.rl.trainer import PromptItem

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


def make_trainer(recipe="bf16", overrides=(), parallel=None, reward_fn=low_token_reward):
    from jetrl.models import DecoderConfig, build_model
    from jetrl.rl.trainer import Trainer
    from jetrl.rollout import RolloutEngine

    cfg = load_config(None, [f"--recipe={recipe}", *BASE, *overrides])
    model = build_model(DecoderConfig(**MODEL), dtype=torch.float32, recipe=recipe, seed=0)
    engine = RolloutEngine(model, max_num_seqs=16, num_blocks=64, block_size=4, progress=False)
    return Trainer(cfg, model, engine, ToyPrompts(cfg.data.prompts_per_step), reward_fn, decode, parallel=parallel)


def full_params(model) -> dict[str, torch.Tensor]:
    """Every parameter whole (gathered from the ranks when sharded), detached, on the CPU."""
    from torch.distributed.tensor import DTensor

    return {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
            for n, p in model.named_parameters()}


def max_rel_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """The largest per-tensor ``max|a - b| / max|a|``."""
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max() / a[k].abs().max()) for k in a)


def assert_metrics_close(ref: dict[str, float], got: dict[str, float], rel: float = 1e-5) -> None:
    """Every metric but times and throughputs agrees within ``rel`` (absolute below 1)."""
    assert ref.keys() == got.keys(), sorted(set(ref) ^ set(got))
    for key, value in ref.items():
        if key.startswith(("time/", "throughput/")):
            continue
        assert abs(value - got[key]) <= rel * max(1.0, abs(value)), (key, value, got[key])
