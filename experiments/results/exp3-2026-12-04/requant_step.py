"""How far one optimizer step moves SmolLM2-135M's policy in BF16 and in the FP8 flow (CPU, reference kernels).

Adam's first update moves every weight by exactly ``lr`` (``m / sqrt(v)`` is the gradient's sign). This applies
``lr * s`` with random signs ``s`` to the fp32 masters of every weight, rounds them as the trainer does (BF16
weights; in `jet` the FP8 linears quantize those, 128x128 blocks, E4M3), and measures on fixed text:
- the fraction of each linear's forward weights that change, and their relative change (Frobenius);
- the KL between the policy's next-token distributions before and after (mean over the text's positions), and
  the mean and largest |Δ log p| of the text's own next tokens.
Random signs stand for the noise part of an update, not its direction, so this isolates what the precision adds.

    python experiments/results/exp3-2026-12-04/requant_step.py --model SmolLM2-135M-Instruct.Q4_1.gguf \
        --text data/gsm8k/test.jsonl
"""
import argparse
import json
import sys
from pathlib import Path

import torch

from jetrl.asset_files import resolve_asset
from jetrl.models import load_model, load_tokenizer
from jetrl.quant import reference
from jetrl.quant.formats import WEIGHT

HERE = Path(__file__).resolve().parent


def forward_weights(model: torch.nn.Module, recipe: str) -> dict[str, torch.Tensor]:
    """Each linear's weight as its forward uses it: BF16, or its FP8 quantization dequantized (`jet`)."""
    out = {}
    for name, layer in model.named_modules():
        if name.endswith("_proj"):  # the decoder blocks' linears (FP8 in `jet`)
            w = layer.weight.detach()
            out[name] = reference.quantize_tensor(w, WEIGHT).dequantize() if recipe == "jet" else w.float()
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument("--text", required=True, help="GSM8K JSONL: its first 8 questions are the text")
    p.add_argument("--lrs", default="1e-5,1e-4")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=str(HERE / "requant_step.json"))
    args = p.parse_args()
    path = resolve_asset(args.model)
    tokenizer = load_tokenizer(load_model(path, dtype=torch.bfloat16, device="cpu", recipe="bf16").source_path)
    texts = [json.loads(line)["question"] for line in Path(args.text).read_text().splitlines()[:8]]
    ids = [tokenizer(t)["input_ids"][:64] for t in texts]
    length = min(len(i) for i in ids)
    batch = torch.tensor([i[:length] for i in ids])
    rows = []
    for recipe in ("bf16", "jet"):
        model = load_model(path, dtype=torch.bfloat16, device="cpu", recipe=recipe).eval()
        masters = {n: q.detach().float().clone() for n, q in model.named_parameters()}
        with torch.no_grad():
            before_w = forward_weights(model, recipe)
            before = torch.log_softmax(model(batch).float(), -1)
        for lr in (float(x) for x in args.lrs.split(",")):
            gen = torch.Generator().manual_seed(args.seed)
            with torch.no_grad():
                for n, q in model.named_parameters():
                    step = torch.randint(0, 2, masters[n].shape, generator=gen).float() * 2 - 1
                    q.copy_((masters[n] + lr * step).to(q.dtype))
                after_w = forward_weights(model, recipe)
                after = torch.log_softmax(model(batch).float(), -1)
            changed = sum(int((after_w[k] != before_w[k]).sum()) for k in before_w)
            total = sum(w.numel() for w in before_w.values())
            rel = (sum(float((after_w[k] - before_w[k]).pow(2).sum()) for k in before_w)
                   / sum(float(before_w[k].pow(2).sum()) for k in before_w)) ** 0.5
            kl = float((before.exp() * (before - after)).sum(-1).mean())
            token = batch[:, 1:].unsqueeze(-1)
            dlogp = (after[:, :-1].gather(-1, token) - before[:, :-1].gather(-1, token)).abs()
            row = {"recipe": recipe, "lr": lr, "weights_changed": changed / total, "weights_rel_change": rel,
                   "kl_mean": kl, "dlogp_mean": float(dlogp.mean()), "dlogp_max": float(dlogp.max()),
                   "tokens": int(batch.numel())}
            rows.append(row)
            print(json.dumps(row), file=sys.stderr)
            with torch.no_grad():
                for n, q in model.named_parameters():
                    q.copy_(masters[n].to(q.dtype))
    Path(args.out).write_text(json.dumps(rows, indent=1))
    print("| recipe | lr | forward weights changed | relative change | KL(before, after) per token | mean / max "
          "\\|Δ logp\\| of the text's tokens |")
    print("| --- | --- | --- | --- | --- | --- |")
    for r in rows:
        print(f"| `{r['recipe']}` | {r['lr']:g} | {r['weights_changed']:.4f} | {r['weights_rel_change']:.2e} | "
              f"{r['kl_mean']:.2e} | {r['dlogp_mean']:.2e} / {r['dlogp_max']:.3f} |")


if __name__ == "__main__":
    main()
