"""Which of SmolLM2-135M's linear layers carry the FP8 flow's inference cost (CPU, reference kernels).

The model in BF16 against the same model in `jet`'s FP8 flow with one group of linears kept in BF16 (the recipe's
``exclude`` patterns, on both sides as the recipe does it): KL(BF16 || FP8) per token and the mean |Δ log p| of
the text's own tokens, on the first 16 GSM8K test questions with their worked answers (74 tokens each, teacher
forced). Groups: each linear type over all blocks, then each decoder block whole.

    python experiments/results/exp3-2026-12-04/fp8_sensitivity.py --model <SmolLM2 folder or .gguf> \
        --text data/gsm8k/test.jsonl
"""
import argparse
import json
import sys
from pathlib import Path

import torch

from jetrl.asset_files import resolve_asset
from jetrl.models import load_model, load_tokenizer
from jetrl.quant.recipe import DEFAULT_EXCLUDE, apply_recipe, get_recipe

HERE = Path(__file__).resolve().parent
TYPES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument("--text", required=True, help="GSM8K JSONL: its first 16 questions and answers are the text")
    p.add_argument("--out", default=str(HERE / "fp8_sensitivity.json"))
    args = p.parse_args()
    path = resolve_asset(args.model)
    model = load_model(path, dtype=torch.bfloat16, device="cpu", recipe="bf16").eval()
    tokenizer = load_tokenizer(model.source_path)
    rows = [json.loads(line) for line in Path(args.text).read_text().splitlines()[:16]]
    ids = [tokenizer(r["question"] + "\n" + r["answer"])["input_ids"][:128] for r in rows]
    length = min(len(i) for i in ids)
    batch = torch.tensor([i[:length] for i in ids])
    with torch.no_grad():
        ref = torch.log_softmax(model(batch).float(), -1)
    token = batch[:, 1:].unsqueeze(-1)

    def cost(kept: tuple[str, ...]) -> dict:
        apply_recipe(model, get_recipe("jet", exclude=DEFAULT_EXCLUDE + kept))
        with torch.no_grad():
            lp = torch.log_softmax(model(batch).float(), -1)
        apply_recipe(model, "bf16")
        kl = (ref.exp() * (ref - lp)).sum(-1).mean()
        dlogp = (lp[:, :-1].gather(-1, token) - ref[:, :-1].gather(-1, token)).abs().mean()
        return {"kl": float(kl), "dlogp": float(dlogp)}

    groups = {"none (all FP8)": ()}
    groups.update({f"every {t}": (f"*.{t}",) for t in TYPES})
    groups.update({f"block {i}": (f"model.layers.{i}.*",) for i in range(len(model.model.layers))})
    out = {"tokens": int(batch.numel()), "kept_in_bf16": {}}
    for name, kept in groups.items():
        out["kept_in_bf16"][name] = cost(kept)
        print(name, out["kept_in_bf16"][name], file=sys.stderr, flush=True)
    Path(args.out).write_text(json.dumps(out, indent=1))
    res = out["kept_in_bf16"]
    base = res["none (all FP8)"]["kl"]
    print("| kept in BF16 | KL(BF16 \\|\\| FP8) per token | of all-FP8's | mean \\|Δ log p\\| |")
    print("| --- | --- | --- | --- |")
    blocks = [k for k in res if k.startswith("block")]
    for name in [k for k in res if not k.startswith("block")]:
        print(f"| {name} | {res[name]['kl']:.4f} | {res[name]['kl'] / base:.2f} | {res[name]['dlogp']:.3f} |")
    lo = min(blocks, key=lambda k: res[k]["kl"])
    hi = max(blocks, key=lambda k: res[k]["kl"])
    print(f"| one block (of {len(blocks)}) | {res[lo]['kl']:.4f} ({lo}) - {res[hi]['kl']:.4f} ({hi}) | "
          f"{res[lo]['kl'] / base:.2f} - {res[hi]['kl'] / base:.2f} | |")


if __name__ == "__main__":
    main()
