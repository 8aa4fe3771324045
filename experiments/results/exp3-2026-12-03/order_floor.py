"""How far SmolLM2-135M-Instruct's log-probabilities move when only the summation order of its attention changes
(the record of the measurement in EXPERIMENTS.md, experiment 3; CPU, torch 2.13).

The engine samples 8 responses of 48 tokens (two prompts, T=1, seed 3); the training side scores them three times,
identical but for the dtype the CPU reference attention computes in (``jetrl.models.attention.reference_dtype``,
swapped here for the measurement only): float64 (exact, the default on the CPU), float32 and bfloat16. The
difference is what any two kernels summing attention in different orders make of this model.

    python experiments/results/exp3-2026-12-03/order_floor.py /path/to/converted/SmolLM2 bf16   (or jet)
"""
import sys

import torch

import jetrl.models.attention as attention
from jetrl.models import load_model, load_tokenizer, logprobs_from_hidden
from jetrl.quant import precision_side
from jetrl.rollout import RolloutEngine, SamplingParams

path, recipe = sys.argv[1], sys.argv[2]
model = load_model(path, dtype=torch.bfloat16, device="cpu", recipe=recipe)
tok = load_tokenizer(path)
prompts = ["Question: Tom has 12 apples and buys 7 more. How many apples does he have?\nAnswer:",
           "Start with 13; subtract 6. What is the result?"]
ids = [tok(p)["input_ids"] for p in prompts]
outs = RolloutEngine(model, tok, progress=False).generate(
    ids, [SamplingParams(n=4, temperature=1.0, max_tokens=48, seed=3, ignore_eos=True)] * 2)


def score(dtype):
    attention.reference_dtype = lambda q: dtype or q.dtype
    lps = []
    for c in outs:
        p = ids[c.prompt_index]
        full = p + list(c.token_ids)
        with torch.no_grad(), precision_side("train"):
            h = model.forward_packed(torch.tensor(full), torch.arange(len(full)), [0, len(full)], len(full))
            lp, _ = logprobs_from_hidden(model, h[len(p) - 1:len(full) - 1], torch.tensor(c.token_ids))
        lps.append(lp.float())
    return torch.cat(lps)


exact = score(torch.float64)
for name, dtype in (("float32", torch.float32), ("bfloat16", None)):
    d = (score(dtype) - exact).abs()
    print(f"{recipe}: attention in {name} vs float64: mean |dlogp| {d.mean():.3f}, max {d.max():.3f}")
