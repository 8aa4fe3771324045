"""Experiment 3, part one: a pretrained model's held-out accuracy before any RL, in BF16 and in the FP8 flow.

For each task setting (built-in tasks asked in English, ``--tasks arithmetic:1,arithmetic:2,...``, and GSM8K's test
split with ``--gsm8k FILE``) and each recipe's rollout precision (``bf16``; ``jet``, whose rollout is the FP8 flow's:
``fp8-rollout`` samples from the same FP8 policy), the model's greedy accuracy and its pass@k from ``--n`` samples at
temperature 1, on ``--num-examples`` problems of another task seed than training uses. The table says which tasks a
model starts between about 10% and 60% on (where RL has a signal to learn from) and how much accuracy FP8 costs the
model before training.

    python scripts/exp_real_model.py --model SmolLM2-135M-Instruct.Q4_1.gguf --gsm8k data/gsm8k/test.jsonl --out $OUT
    python scripts/exp_real_model.py --smoke                   # the embedded model, tiny sizes, on the CPU

Writes ``exp_real_model.json`` into ``--out`` and prints the table last.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any, Sequence

import torch

from jetrl.config import DataConfig
from jetrl.data import build_prompt_dataset
from jetrl.asset_files import resolve_asset
from jetrl.evaluate import EVAL_SEED, evaluate, load_policy

RECIPES = ("bf16", "jet")


def task_settings(tasks: str, gsm8k: str | None, num_examples: int, style: str) -> list[tuple[str, DataConfig]]:
    """(name, data section) of each setting: ``task:difficulty`` items, then GSM8K's file."""
    settings = []
    for item in filter(None, (t.strip() for t in tasks.split(","))):
        name, _, difficulty = item.partition(":")
        settings.append((f"{name}:{difficulty or 1}", DataConfig(task=name, difficulty=int(difficulty or 1),
                                                                 task_style=style, num_examples=num_examples)))
    if gsm8k:
        settings.append(("gsm8k-test", DataConfig(path=gsm8k, format="gsm8k", max_examples=num_examples)))
    return settings


def measure(model_path: str, settings: list[tuple[str, DataConfig]], recipes: Sequence[str], *, n: int,
            max_tokens: int, device: str | None, dtype: str, log=print) -> list[dict[str, Any]]:
    rows = []
    for recipe in recipes:
        model, tokenizer = load_policy(resolve_asset(model_path), recipe, device, dtype, max_tokens)
        for name, data in settings:
            dataset = build_prompt_dataset(data, seed=EVAL_SEED)
            start = time.time()
            greedy = evaluate(model, tokenizer, dataset, max_tokens=max_tokens)
            sampled = evaluate(model, tokenizer, dataset, n=n, temperature=1.0, max_tokens=max_tokens,
                               ks=sorted({1, n}), seed=1)
            row = {"setting": name, "recipe": recipe, "num_prompts": greedy.num_prompts,
                   "greedy_accuracy": greedy.accuracy, "sampled_accuracy": sampled.accuracy,
                   f"pass@{n}": sampled.pass_at_k[n], "greedy_length": greedy.mean_length,
                   "greedy_truncated": greedy.truncation_rate, "seconds": time.time() - start}
            rows.append(row)
            log(json.dumps(row))
        del model
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return rows


def table(rows: list[dict[str, Any]], n: int) -> str:
    head = f"| setting | recipe | greedy | T=1 accuracy | pass@{n} | greedy tokens |"
    lines = [head, "| --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        lines.append(f"| {r['setting']} | {r['recipe']} | {r['greedy_accuracy']:.3f} | {r['sampled_accuracy']:.3f} | "
                     f"{r[f'pass@{n}']:.3f} | {r['greedy_length']:.0f} |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="checkpoint folder or .gguf file")
    p.add_argument("--tasks", default="arithmetic:1,arithmetic:2,arithmetic:3,countdown:2")
    p.add_argument("--task-style", default="natural")
    p.add_argument("--gsm8k", default=None, help="GSM8K test JSONL")
    p.add_argument("--recipes", default=",".join(RECIPES))
    p.add_argument("--num-examples", type=int, default=200)
    p.add_argument("--n", type=int, default=8, help="samples per prompt for pass@n")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--device", default=None)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--out", default=os.environ.get("OUT", "exp-real-model"))
    p.add_argument("--smoke", action="store_true", help="the embedded model, tiny sizes, CPU")
    args = p.parse_args(argv)
    if args.smoke:
        args.model, args.tasks, args.task_style = "jetrl:tiny-arith", "arithmetic:3", "compact"
        args.num_examples, args.n, args.max_tokens, args.device, args.dtype = 4, 2, 48, "cpu", "float32"
    if not args.model:
        p.error("--model is required (or --smoke)")
    settings = task_settings(args.tasks, args.gsm8k, args.num_examples, args.task_style)
    rows = measure(args.model, settings, [r for r in args.recipes.split(",") if r], n=args.n,
                   max_tokens=args.max_tokens, device=args.device, dtype=args.dtype,
                   log=lambda s: print(s, file=sys.stderr))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "exp_real_model.json").write_text(json.dumps({"model": args.model, "args": vars(args), "rows": rows},
                                                        indent=1))
    print(table(rows, args.n))
    return 0


if __name__ == "__main__":
    sys.exit(main())
