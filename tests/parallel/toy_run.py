"""A tiny RL setup for the several-rank tests: fp32 two-block decoder, toy prompts and reward (CPU)."""

from __future__ import annotations

import torch

from jetrl.config import load_config
from toy_rl import MODEL, ToyPrompts, decode, low_token_reward

# lr 0.1 moves the weights by several percent per step; eps 1.0 keeps AdamW close to linear in the
# gradient, so summation-order differences stay at fp32 rounding in the weights instead of being amplified
# by g / (|g| + eps) on near-zero gradient entries
BASE = ["--data.prompts_per_step=2", "--rollout.n=4", "--rollout.max_tokens=6", "--optim.lr=0.1",
        "--optim.eps=1.0", "--trainer.steps=4"]


def make_trainer(recipe="bf16", overrides=(), parallel=None, reward_fn=low_token_reward):
    from jetrl.models import DecoderConfig, build_model
    from jetrl.rl.trainer import Trainer
    from jetrl.rollout import RolloutEngine

    cfg = load_config(None, [f"--recipe={recipe}", *BASE, *overrides])
    model = build_model(DecoderConfig(**MODEL), dtype=torch.float32, recipe=recipe, seed=0)
    engine = RolloutEngine(model, max_num_seqs=16, num_blocks=64, block_size=4, progress=False, exact=cfg.exact)
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
