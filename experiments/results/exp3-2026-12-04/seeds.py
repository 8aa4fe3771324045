"""Experiment 3 at more seeds, and the final checkpoints evaluated in both precisions.

Reads ``../exp3-2026-12-03/exp_rl_heldout_runs.json`` (seeds 0-2 of every arm, 2026-12-03/04) and ``runs.json``
here (2026-12-04: seeds 3 and 4 of `bf16`, `jet` and `jet-exact`; one GSM8K run; a second run of seeds 0-2 of
`bf16` and `jet` and seed 0 of `jet-exact` whose final checkpoints were also evaluated in the other precision,
``exp_rl.py --cross-eval``). Prints the tables EXPERIMENTS.md quotes and writes ``exp_rl_held_out.png``: held-out
accuracy before and after RL per arm, every seed a dot (seeds 0-4 for `bf16`, `jet`, `jet-exact`; 0-2 for the
others).

    python experiments/results/exp3-2026-12-04/seeds.py
"""
import json
import math
import statistics
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[2] / "scripts"))

from exp_rl import plot_held_out  # noqa: E402

T95 = {2: 12.706, 3: 4.303, 4: 3.182, 5: 2.776, 6: 2.571, 7: 2.447, 8: 2.365}  # two-sided t, by sample size


def summary(values: list[float]) -> str:
    """mean, half range, sample standard deviation and a 95% t interval of the mean."""
    n, mean = len(values), statistics.fmean(values)
    if n == 1:
        return f"{mean:.3f} (one run)"
    sd = statistics.stdev(values)
    half = T95[n] * sd / math.sqrt(n)
    return (f"{mean:.3f} ± {(max(values) - min(values)) / 2:.3f} (sd {sd:.3f}; 95% CI {mean - half:.3f}-"
            f"{mean + half:.3f})")


def main() -> None:
    first = json.loads((HERE.parent / "exp3-2026-12-03" / "exp_rl_heldout_runs.json").read_text())["runs"]
    later = json.loads((HERE / "runs.json").read_text())["runs"]
    seeds = [r for r in later if r["setting"] == "arithmetic-1"]
    # the 5-seed comparison: the first runs of seeds 0-2 and the runs of seeds 3-4
    runs = first + seeds
    print("held-out greedy accuracy after 40 steps, 200 problems, in the arm's own recipe")
    print("| arm | seeds | after (per seed) | mean ± half range (sd; 95% CI) | change from before |")
    print("| --- | --- | --- | --- | --- |")
    for arm in dict.fromkeys(r["arm"] for r in runs):
        mine = sorted((r for r in runs if r["arm"] == arm), key=lambda r: r["seed"])
        after = [r["held_out_after"] for r in mine]
        change = [r["held_out_after"] - r["held_out_before"] for r in mine]
        print(f"| `{arm}` | {len(mine)} | {', '.join(f'{v:.3f}' for v in after)} | {summary(after)} | "
              f"{statistics.fmean(change):+.3f} |")
    cross = [r for r in later if r["setting"] == "arithmetic-1, cross-eval" and r["steps"] == 40]
    print("\nsecond runs of seeds 0-2, each final checkpoint evaluated in BF16 and in the FP8 flow")
    print("| arm | runs (seeds) | after, BF16 inference | after, FP8 inference | FP8 - BF16 per run |")
    print("| --- | --- | --- | --- | --- |")
    for arm in dict.fromkeys(r["arm"] for r in cross):
        mine = sorted((r for r in cross if r["arm"] == arm), key=lambda r: r["seed"])
        own, other = [r["held_out_after"] for r in mine], [r["held_out_after_other_precision"] for r in mine]
        bf16, fp8 = (own, other) if arm == "bf16" else (other, own)
        print(f"| `{arm}` | {len(mine)} ({', '.join(str(r['seed']) for r in mine)}) | {summary(bf16)} | "
              f"{summary(fp8)} | {', '.join(f'{b - a:+.3f}' for a, b in zip(bf16, fp8))} |")
    cut = [r for r in later if r["setting"] == "arithmetic-1, cross-eval" and r["steps"] != 40]
    for r in cut:
        print(f"(left out: {r['arm']} seed {r['seed']}, cut at {r['steps']} steps by its time budget)")
    for r in (r for r in later if r["setting"] == "gsm8k"):
        recs = r["records"]
        reward = [x["reward/mean"] for x in recs]
        length = [x["response/length_mean"] for x in recs]
        trunc = [x["response/truncation_rate"] for x in recs]
        dlogp = [x["mismatch/logp_abs_diff_mean"] for x in recs]
        print(f"\nGSM8K, {r['arm']} seed {r['seed']}, {len(recs)} steps: held-out {r['held_out_before']:.3f} -> "
              f"{r['held_out_after']:.3f} ({r['held_out_examples']} test problems); reward {min(reward):.3f}-"
              f"{max(reward):.3f} (first 5 {statistics.fmean(reward[:5]):.3f}, last 5 "
              f"{statistics.fmean(reward[-5:]):.3f}); response tokens {min(length):.0f}-{max(length):.0f}, truncated "
              f"at 512: {min(trunc):.2f}-{max(trunc):.2f}; "
              f"|dlogp| {min(dlogp):.2e}-{max(dlogp):.2e}")
    plot_held_out(runs, HERE / "exp_rl_held_out.png", "SmolLM2-135M-Instruct, arithmetic (1 step)")


if __name__ == "__main__":
    main()
