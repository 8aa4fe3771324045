"""Where a recipe's rollout leaves its trainer: every linear's and block's output, rollout against training side.

One prompt is sampled by the rollout engine (its decode steps: one row per step) and the prompt plus the sampled
tokens are scored by the training side's packed forward (one row per token, the whole sequence in one call), both
on the same model. A forward hook on every linear layer, decoder block and the attention input of ``o_proj``
records its output rows on each side; the two are compared row by row over the decode positions. The first module
(in forward order) whose decode rows differ is where the two sides' computations part: a GEMM whose result depends
on how many rows it holds, an attention kernel of another summation order, or a different FP8 path. The table
gives each module's largest difference and the share of rows that differ; the final line the log-prob mismatch.

    python scripts/exp_mismatch_layers.py --model SmolLM2-135M-Instruct.Q4_1.gguf --recipes bf16,jet --device cuda
    python scripts/exp_mismatch_layers.py --smoke                    # the embedded model on the CPU
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from typing import Any, Sequence

import torch

from jetrl.asset_files import resolve_asset
from jetrl.evaluate import load_policy
from jetrl.models import logprobs_from_hidden
from jetrl.quant import precision_side
from jetrl.rollout import RolloutEngine, SamplingParams

PROMPT = "Question: Tom has 12 apples and buys 7 more. How many apples does he have?\nAnswer:"


def module_names(model: torch.nn.Module) -> list[str]:
    """The compared modules in forward order: each block's linears (q, k, v, o's input, o, gate, up, down), its
    attention and MLP, and the block itself. Linears that run as one stacked GEMM (q/k/v, gate/up on the GPU) call
    no module of their own, so they are not recorded; the attention's and the MLP's outputs still are."""
    names = []
    for i, _ in enumerate(model.model.layers):
        p = f"model.layers.{i}."
        names += [p + n for n in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj:in",
                                  "self_attn.o_proj", "self_attn", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj",
                                  "mlp")] + [p[:-1]]
    return names


def record(model: torch.nn.Module, names: Sequence[str]):
    """Forward hooks filling ``{name: [output rows (N, width)]}``; returns (records, handles)."""
    rows: dict[str, list[torch.Tensor]] = defaultdict(list)
    handles = []
    for name in names:
        module_name, _, kind = name.partition(":")

        def hook(module, inputs, output, name=name, kind=kind):
            value = inputs[0] if kind == "in" else (output[0] if isinstance(output, tuple) else output)
            rows[name].append(value.detach().reshape(-1, value.shape[-1]).float().cpu())
        handles.append(model.get_submodule(module_name).register_forward_hook(hook))
    return rows, handles


def compare(model_path: str, recipe: str, *, device: str | None, dtype: str, max_tokens: int, seed: int,
            prompt: str = PROMPT) -> dict[str, Any]:
    model, tokenizer = load_policy(model_path, recipe, device, dtype, max_tokens)
    ids = tokenizer(prompt)["input_ids"]
    names = module_names(model)
    rows, handles = record(model, names)
    # eager decode steps: the hooks copy rows to the host, which a CUDA-graph capture cannot hold
    engine = RolloutEngine(model, tokenizer, progress=False, max_num_seqs=1, cuda_graphs=False)
    out = engine.generate([ids], [SamplingParams(n=1, temperature=1.0, max_tokens=max_tokens, seed=seed,
                                                 ignore_eos=True)])[0]
    rollout = {n: torch.cat(v) for n, v in rows.items()}
    rows.clear()
    full = ids + list(out.token_ids)
    dev = next(model.parameters()).device
    with torch.no_grad(), precision_side("train"):
        hidden = model.forward_packed(torch.tensor(full, device=dev), torch.arange(len(full), device=dev),
                                      [0, len(full)], len(full))
        lp, _ = logprobs_from_hidden(model, hidden[len(ids) - 1:len(full) - 1],
                                     torch.tensor(out.token_ids, device=dev))
    train = {n: torch.cat(v) for n, v in rows.items()}
    for h in handles:
        h.remove()
    p = len(ids)
    modules, unrecorded = [], []
    for name in names:
        if name not in rollout or name not in train:  # a linear inside a stacked GEMM (on either side)
            unrecorded.append(name)
            continue
        r, t = rollout[name], train[name]
        steps = min(len(r), len(t)) - p  # the decode rows (the last sampled token is never fed back)
        diff = (r[p:p + steps] - t[p:p + steps]).abs().amax(-1)
        modules.append({"module": name, "max_abs_diff": float(diff.max()), "rows_differing": float((diff > 0).float().mean()),
                        "scale": float(t.abs().max())})
    first = next((m["module"] for m in modules if m["max_abs_diff"] > 0), None)
    dlogp = (lp.float().cpu() - torch.tensor(out.logprobs)).abs()
    return {"recipe": recipe, "decode_steps": len(out.token_ids) - 1, "first_differing": first, "modules": modules,
            "logp_abs_diff_mean": float(dlogp.mean()), "logp_abs_diff_max": float(dlogp.max()),
            "unrecorded": sorted({n.split(".", 3)[-1] for n in unrecorded})}


def table(result: dict[str, Any], every: bool) -> str:
    lines = [f"{result['recipe']}: first module whose decode rows differ: {result['first_differing']}; |dlogp| mean "
             f"{result['logp_abs_diff_mean']:.2e}, max {result['logp_abs_diff_max']:.2e} over "
             f"{result['decode_steps'] + 1} tokens"]
    if result["unrecorded"]:
        lines.append(f"  (inside stacked GEMMs, not recorded: {', '.join(result['unrecorded'])})")
    shown = result["modules"] if every else [m for m in result["modules"] if m["max_abs_diff"] > 0][:12]
    for m in shown:
        lines.append(f"  {m['module']:36s} max |diff| {m['max_abs_diff']:.3g} (scale {m['scale']:.3g}), "
                     f"rows differing {m['rows_differing']:.0%}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="checkpoint folder or .gguf file")
    p.add_argument("--recipes", default="bf16,jet")
    p.add_argument("--device", default=None)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--max-tokens", type=int, default=24)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--prompt", default=PROMPT)
    p.add_argument("--json", default=None, help="write the results here")
    p.add_argument("--all", action="store_true", help="list every module, not only the first that differ")
    p.add_argument("--smoke", action="store_true", help="the embedded model on the CPU")
    args = p.parse_args(argv)
    if args.smoke:
        args.model, args.device, args.dtype, args.max_tokens, args.prompt = "jetrl:tiny-arith", "cpu", "float32", 6, \
            "12+7*3\n"
    if not args.model:
        p.error("--model is required (or --smoke)")
    results = [compare(resolve_asset(args.model), r, device=args.device, dtype=args.dtype, max_tokens=args.max_tokens,
                       seed=args.seed, prompt=args.prompt) for r in args.recipes.split(",") if r]
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    print("\n".join(table(r, args.all) for r in results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
