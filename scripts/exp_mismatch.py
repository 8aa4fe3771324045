"""Experiment 1: rollout-vs-training mismatch against rollout length, per precision recipe, on one checkpoint.

For each arm (``bf16``, ``fp8-rollout``, ``jet``; more by name, see ``exp_common.ARMS``) the same
checkpoint is loaded in the arm's recipe; for each rollout length L the same prompts -- ``chain``
problems whose worked solutions are about L tokens (:func:`jetrl.data.tasks.difficulty_for_tokens`) --
are sampled at temperature 1 by the rollout engine (the rollout side of the recipe), and the sampled
tokens are scored again by a training-side forward (``forward_packed``, no grad, the recipe's training
precision): exactly the two log-probabilities an RL step compares. Per arm and length it reports
(:func:`jetrl.rl.mismatch.mismatch_metrics`): mean and max ``|Δ logp|``, the k3 estimate of
KL(rollout || train), the fraction of tokens whose probability differs by more than 1e-3, and the
spread of the token-level importance ratio ``pi_train / pi_rollout`` (min, 1st and 99th percentile,
max, standard deviation); plus the accuracy and length of the rollouts, and the mean ``|Δ logp|`` by
position (does it grow along a long rollout?).

No training happens: each arm samples its own tokens (that is what its RL would train on) from the same
weights, with the same sampling seeds. Writes ``exp_mismatch.json`` and two PNGs into ``--out`` and
prints the table last. ``--smoke`` runs the whole path on a tiny CPU model in seconds.

    python scripts/exp_mismatch.py --out $OUT                      # SFT (GPU) + the experiment
    python scripts/exp_mismatch.py --model runs/sft --lengths 256,1024,4096 --arms bf16,fp8-rollout,jet
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any, Sequence

import torch

import exp_common as common
from jetrl.data import decode_completion, encode_prompt
from jetrl.data.tasks import ChainTask, check_chain, difficulty_for_tokens
from jetrl.models import load_model, load_tokenizer, logprobs_from_hidden, resolve_device
from jetrl.quant import precision_side
from jetrl.rl.losses import MAX_LOG_RATIO
from jetrl.rl.mismatch import mismatch_metrics
from jetrl.rollout import RolloutEngine, SamplingParams

GPU_LENGTHS = (256, 1024, 4096)
SMOKE_LENGTHS = (16, 48)
MAX_TOKENS_SLACK = 1.5  # rollouts may run this much longer than a correct solution before they are cut


def training_logprobs(model: torch.nn.Module, sequences: Sequence[tuple[list[int], list[int]]],
                      max_tokens_per_forward: int, exact: bool = False,
                      kv_fp8: bool = False) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Training-side log-probs and entropies (fp32, on the CPU) of each ``(prompt ids, response ids)``'s
    response tokens: packed forwards of at most ``max_tokens_per_forward`` tokens (one sequence at least),
    no grad, in the recipe's training precision (``exact``: exact mode's batch-invariant kernels, as the
    trainer runs them; ``kv_fp8``: attention over FP8-quantized K/V, as the trainer runs ``jet`` with an FP8
    KV cache)."""
    device = next(model.parameters()).device
    logprobs: list[torch.Tensor] = []
    entropies: list[torch.Tensor] = []
    groups: list[list[tuple[list[int], list[int]]]] = []
    used = 0
    for prompt, response in sequences:
        n = len(prompt) + len(response)
        if not groups or used + n > max_tokens_per_forward:
            groups.append([])
            used = 0
        groups[-1].append((prompt, response))
        used += n
    with torch.no_grad(), precision_side("train"):
        for group in groups:
            ids = torch.tensor([t for p, r in group for t in p + r], dtype=torch.long, device=device)
            positions = torch.tensor([i for p, r in group for i in range(len(p) + len(r))], device=device)
            cu, rows, targets = [0], [], []
            for p, r in group:
                # row i predicts token i + 1: response token j sits at row start + len(p) - 1 + j
                rows += range(cu[-1] + len(p) - 1, cu[-1] + len(p) - 1 + len(r))
                targets += r
                cu.append(cu[-1] + len(p) + len(r))
            hidden = model.forward_packed(ids, positions, cu, max(b - a for a, b in zip(cu, cu[1:])), exact=exact,
                                          kv_fp8=kv_fp8)
            index = torch.tensor(rows, dtype=torch.long, device=device)
            lp, ent = logprobs_from_hidden(model, hidden[index], torch.tensor(targets, device=device), exact=exact)
            lp, ent = lp.float().cpu(), ent.float().cpu()
            at = 0
            for _, r in group:
                logprobs.append(lp[at:at + len(r)])
                entropies.append(ent[at:at + len(r)])
                at += len(r)
    return logprobs, entropies


def ratio_spread(rollout: torch.Tensor, train: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    """Spread of the token-level importance ratio ``exp(logp_train - logp_rollout)`` over valid tokens:
    standard deviation and 1st / 99th percentiles (min, max and mean come from ``mismatch_metrics``)."""
    log_r = (train[mask].double() - rollout[mask].double()).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
    if log_r.numel() == 0:
        return {"is_ratio_std": 0.0, "is_ratio_p01": 1.0, "is_ratio_p99": 1.0}
    ratio = log_r.exp()
    q = torch.quantile(ratio, torch.tensor([0.01, 0.99], dtype=ratio.dtype))
    std = float(ratio.std()) if ratio.numel() > 1 else 0.0
    return {"is_ratio_std": std, "is_ratio_p01": float(q[0]), "is_ratio_p99": float(q[1])}


def position_profile(rollout: torch.Tensor, train: torch.Tensor, mask: torch.Tensor, bin_size: int) -> list[float]:
    """Mean ``|Δ logp|`` over the valid tokens of each ``bin_size``-token window of response positions
    (NaN for a window no sequence reaches)."""
    diff = (train - rollout).abs().double() * mask
    out = []
    for start in range(0, mask.shape[1], bin_size):
        count = float(mask[:, start:start + bin_size].sum())
        out.append(float(diff[:, start:start + bin_size].sum()) / count if count else float("nan"))
    return out


def load_arm(model_path: str, config):
    """The checkpoint in an arm's recipe, dtype and device (its RunConfig), in eval mode."""
    model = load_model(model_path, dtype=getattr(torch, config.model.dtype), device=resolve_device(config.model.device),
                       recipe=config.recipe)
    return model.eval()


def measure(model: torch.nn.Module, tokenizer, length: int, num_prompts: int, n: int, seed: int, eval_seed: int,
            bin_size: int, max_tokens_per_forward: int, exact: bool = False, kv_fp8: bool = False,
            kv_fp8_train: bool = False, ignore_eos: bool = False) -> dict[str, Any]:
    """Experiment 1 for one arm's model at one rollout length: the mismatch statistics, the ratio spread,
    rollout accuracy and length, and the position profile. ``kv_fp8``: the engine's FP8 KV cache;
    ``kv_fp8_train``: the training-side forward quantizes K/V the same way (a run config's ``kv_fp8_train``);
    ``ignore_eos``: every rollout runs to ``max_tokens``, past the model's end-of-sequence token."""
    clock = common.Clock()
    difficulty = difficulty_for_tokens(length)
    problems = ChainTask(difficulty, seed=eval_seed).examples(num_prompts)
    prompts = [encode_prompt(tokenizer, ex.prompt) for ex in problems]
    max_tokens = int(length * MAX_TOKENS_SLACK) + 16
    engine = RolloutEngine(model, tokenizer, progress=False, max_num_seqs=min(256, num_prompts * n),
                           max_model_len=max(len(p) for p in prompts) + max_tokens, exact=exact,
                           kv_fp8=kv_fp8)
    params = [SamplingParams(n=n, temperature=1.0, max_tokens=max_tokens, seed=seed * 1_000_003 + i,
                             ignore_eos=ignore_eos)
              for i in range(len(prompts))]
    completions = engine.generate(prompts, params)
    engine.free_cache()
    sequences = [(prompts[k // n], list(c.token_ids)) for k, c in enumerate(completions)]
    train_lp, entropy = training_logprobs(model, sequences, max_tokens_per_forward, exact=exact, kv_fp8=kv_fp8_train)
    width = max(1, max(len(c.token_ids) for c in completions))
    mask = torch.zeros(len(completions), width, dtype=torch.bool)
    rollout = torch.zeros(len(completions), width)
    train = torch.zeros(len(completions), width)
    for k, c in enumerate(completions):
        mask[k, :len(c.token_ids)] = True
        rollout[k, :len(c.token_ids)] = torch.tensor(c.logprobs, dtype=torch.float32)
        train[k, :len(c.token_ids)] = train_lp[k]
    texts = [decode_completion(tokenizer, c.token_ids) for c in completions]
    correct = [check_chain(t, problems[k // n].answer) for k, t in enumerate(texts)]
    metrics = mismatch_metrics(rollout, train, mask)
    metrics.update(ratio_spread(rollout, train, mask))
    lengths_generated = [len(c.token_ids) for c in completions]
    metrics.update({
        "difficulty": difficulty, "max_tokens": max_tokens, "num_sequences": len(completions),
        "accuracy": sum(correct) / len(correct), "response_length_mean": sum(lengths_generated) / len(completions),
        "response_length_max": max(lengths_generated),
        "truncation_rate": sum(c.finish_reason == "length" for c in completions) / len(completions),
        "entropy_mean": float(torch.cat(entropy).mean()) if sum(lengths_generated) else 0.0,
        "position_bin_size": bin_size, "logp_abs_diff_by_position": position_profile(rollout, train, mask, bin_size),
        "seconds": clock.elapsed(),
    })
    return metrics


def plot(results: dict[str, Any], out: Path) -> list[Path]:
    """``exp_mismatch_length.png`` (four statistics against rollout length, one line per arm) and
    ``exp_mismatch_position.png`` (mean |Δ logp| along the rollout at the longest length)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    arms = results["arms"]
    panels = (("logp_abs_diff_mean", "mean |Δ logp|"), ("logp_abs_diff_max", "max |Δ logp|"),
              ("kl_k3", "k3 KL(rollout || train)"), ("frac_prob_diff_gt_thr", "fraction |Δp| > 1e-3"))
    fig, axes = plt.subplots(2, 2, figsize=(10, 7))
    for ax, (key, title) in zip(axes.flat, panels):
        for arm, per_length in arms.items():
            xs = [int(L) for L in per_length]
            ys = [per_length[L][key] for L in per_length]
            ax.plot(xs, ys, marker="o", label=arm)
        ax.set_xscale("log", base=2)
        common.log_scale_with_zero(ax, [m[key] for per_length in arms.values() for m in per_length.values()])
        ax.set_title(title)
        ax.set_xlabel("rollout length (target tokens)")
        ax.grid(alpha=0.3)
    axes.flat[0].legend()
    fig.suptitle("Experiment 1: rollout-vs-training mismatch against rollout length")
    fig.tight_layout()
    paths = [out / "exp_mismatch_length.png"]
    fig.savefig(paths[0], dpi=100)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(8, 4.5))
    drawn = []
    for arm, per_length in arms.items():
        longest = per_length[max(per_length, key=int)]
        bins = longest["logp_abs_diff_by_position"]
        ax.plot([i * longest["position_bin_size"] for i in range(len(bins))], bins, marker=".", label=arm)
        drawn += bins
    common.log_scale_with_zero(ax, drawn)
    ax.set_xlabel("response position (tokens)")
    ax.set_title(f"mean |Δ logp| along the rollout (length {max(next(iter(arms.values())), key=int)})")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    paths.append(out / "exp_mismatch_position.png")
    fig.savefig(paths[1], dpi=100)
    plt.close(fig)
    return paths


def summary_table(results: dict[str, Any]) -> str:
    rows = []
    for arm, per_length in results["arms"].items():
        for length, m in per_length.items():
            rows.append((arm, length, f"{m['logp_abs_diff_mean']:.2e}", f"{m['logp_abs_diff_max']:.2e}",
                         f"{m['kl_k3']:.2e}", f"{m['frac_prob_diff_gt_thr']:.4f}",
                         f"[{m['is_ratio_p01']:.4f}, {m['is_ratio_p99']:.4f}]", f"{m['is_ratio_std']:.2e}",
                         f"{m['accuracy']:.3f}", f"{m['response_length_mean']:.0f}"))
    text = common.table(rows, ("arm", "length", "|dlogp| mean", "|dlogp| max", "k3 KL", "frac dp>1e-3",
                               "ratio p01-p99", "ratio std", "acc", "mean len"))
    skipped = [f"{s['arm']} L={s['length']}" for s in results.get("skipped", [])]
    failed = [f"{f['arm']} L={f['length']}: {f['error']}" for f in results.get("failed", [])]
    return (text + (f"\nnot run (deadline): {', '.join(skipped)}" if skipped else "")
            + "".join(f"\nFAILED {line}" for line in failed))


def run_experiment(args: argparse.Namespace, log=print) -> dict[str, Any]:
    """SFT (or ``--model``), then every arm at every length; writes the JSON and PNGs; returns the results."""
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    work = common.work_dir(args)
    arms = common.resolve_arms(common.parse_list(args.arms), args.arm)
    default_lengths = SMOKE_LENGTHS if args.smoke else GPU_LENGTHS
    lengths = common.parse_list(args.lengths, int) if args.lengths else list(default_lengths)
    base = ["model.dtype=float32", "model.device=cpu"] if args.smoke else ["model.dtype=bfloat16", "model.device=cuda"]
    configs = {name: common.arm_config(base, overrides) for name, overrides in arms.items()}  # errors before the SFT
    clock = common.Clock()
    model_path, warm = common.warm_start(args, work, log=log)
    tokenizer = load_tokenizer(model_path)
    models = {name: load_arm(model_path, config) for name, config in configs.items()}  # the same weights, each recipe
    results: dict[str, Any] = {
        "experiment": "mismatch_vs_length", "smoke": args.smoke, "warm_start": warm, "lengths": lengths,
        "arm_overrides": arms, "num_prompts": args.prompts, "n": args.n, "seed": args.seed, "eval_seed": args.eval_seed,
        "deadline": args.deadline, "ignore_eos": args.ignore_eos, "skipped": [], "failed": [],
        "arms": {name: {} for name in configs}}
    json_path = out / "exp_mismatch.json"
    # shortest lengths first, every arm at each: a call that runs out of time has whole rows of the table
    for length in lengths:
        for name, config in configs.items():
            if args.deadline is not None and clock.elapsed() > args.deadline:
                results["skipped"].append({"arm": name, "length": length, "reason": "deadline"})
                log(f"{name} L={length}: skipped, past the {args.deadline:.0f} s deadline")
                continue
            try:
                m = measure(models[name], tokenizer, length, args.prompts, args.n, args.seed, args.eval_seed,
                            args.bin_size, args.max_tokens_per_forward, exact=config.exact, kv_fp8=config.kv_fp8,
                            kv_fp8_train=config.kv_fp8_train, ignore_eos=args.ignore_eos)
            except Exception as exc:  # one broken arm must not cost the other cells of a device call
                if args.smoke:
                    raise
                results["failed"].append({"arm": name, "length": length, "error": repr(exc)})
                log(f"{name} L={length}: FAILED: {exc!r}")
                common.write_json(json_path, results)
                continue
            results["arms"][name][str(length)] = m
            log(f"{name} L={length}: |dlogp| mean {m['logp_abs_diff_mean']:.2e} max {m['logp_abs_diff_max']:.2e}, "
                f"k3 {m['kl_k3']:.2e}, accuracy {m['accuracy']:.3f}, {m['seconds']:.0f} s")
            common.write_json(json_path, results)  # after every cell: a call cut short still brings the finished ones
    results["arms"] = {name: cells for name, cells in results["arms"].items() if cells}
    common.write_json(json_path, results)
    if results["arms"]:
        plot(results, out)
    return results


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    common.add_common_arguments(p, default_out="runs/exp_mismatch", default_arms="bf16,fp8-rollout,jet")
    p.add_argument("--lengths", default=None,
                   help=f"rollout lengths in tokens (default {','.join(map(str, GPU_LENGTHS))}; smoke "
                        f"{','.join(map(str, SMOKE_LENGTHS))})")
    p.add_argument("--prompts", type=int, default=None, help="prompts per length (default 64; smoke 2)")
    p.add_argument("--n", type=int, default=None, help="samples per prompt (default 4; smoke 2)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed (the same for every arm)")
    p.add_argument("--eval-seed", type=int, default=12345, help="task seed of the prompts (unseen by the SFT)")
    p.add_argument("--bin-size", type=int, default=None, help="tokens per position bin (default 256; smoke 8)")
    p.add_argument("--ignore-eos", action="store_true",
                   help="rollouts run to their max_tokens past the end-of-sequence token: lengths a pretrained model "
                        "that answers briefly does not reach by itself (its own continuation, sampled as RL would)")
    p.add_argument("--max-tokens-per-forward", type=int, default=65536, help="training-side scoring budget")
    p.add_argument("--deadline", type=float, default=None,
                   help="seconds after the start past which no new (length, arm) cell starts (default 540 on the GPU, "
                        "none in smoke): the JSON and plots of what finished still get written")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.prompts = args.prompts or (2 if args.smoke else 64)
    args.n = args.n or (2 if args.smoke else 4)
    args.bin_size = args.bin_size or (8 if args.smoke else 256)
    if args.deadline is None and not args.smoke:
        args.deadline = 540.0
    results = run_experiment(args, log=lambda m: print(m, file=sys.stderr, flush=True))
    print(summary_table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
