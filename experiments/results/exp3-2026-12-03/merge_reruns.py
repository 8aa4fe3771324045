"""Experiment 3's table and held-out plot with the `jet-exact` and `jet-kv8` re-runs (3 seeds x 40 steps each).

The re-runs' JSON files were lost; only their logs (``rl_jet-exact_{0,1,2}.log``, ``rl_jet-kv8_{0,1,2}.log``, this
folder) came back. Each log has one line per step (reward, mean |dlogp|) and the run's table row, so a re-run here
is that row plus per-step records holding only ``reward/mean`` and ``mismatch/logp_abs_diff_mean`` (rounded as
logged). `bf16`, `jet` and `fp8-rollout` come from ``exp_rl.json`` (its 1-seed `jet-exact` / `jet-kv8` runs,
cut at 19 and 25 steps, are dropped). Writes ``exp_rl_heldout_runs.json`` (the merged runs, records trimmed to the
keys the tables use), ``table.txt``, ``exp_rl_held_out.png`` (``plot_held_out`` of ``scripts/exp_rl.py``) and, from
the same merged runs with their full records, ``exp_rl_curves.png`` (reward, accuracy, response length, |dlogp|:
``jetrl.plotting.PANELS``) and ``exp_rl_health.png`` (k3 KL, |dp| > 1e-3 fraction, entropy, clip fraction:
``HEALTH_PANELS``), both by ``plot_arm_bands``: per arm the mean over its 3 seeds per step and their min-max band.
The re-runs appear only in the reward and |dlogp| panels; the others name them as absent. `jet-exact`'s |dlogp|
is 0 at every step: that panel's axis is symlog down to 0, and the panel says so.

    python experiments/results/exp3-2026-12-03/merge_reruns.py
"""
import json
import re
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[2] / "scripts"))

import exp_common as common  # noqa: E402
from exp_rl import (HEALTH_PANELS, _ends, _mean, _with_spread, plot_arm_bands, plot_held_out,  # noqa: E402
                    step_matched_table)
from jetrl.plotting import PANELS  # noqa: E402

KEEP = ("step", "reward/mean", "mismatch/logp_abs_diff_mean", "mismatch/kl_k3")
RERUN_ARMS = ("jet-exact", "jet-kv8")
STEP = re.compile(r"^(\S+) seed (\d+) step (\d+): reward ([0-9.]+), \|dlogp\| ([0-9.e+-]+), ")
ROW = re.compile(r"^(\S+)\s+(\d+)\s+(\d+)\s+([0-9.]+) -> ([0-9.]+)\s+([0-9.]+) -> ([0-9.]+)\s+(\S+) -> (\S+)\s+"
                 r"(\S+)\s+(\S+)\s+(\S+)\s+(\S+)\s+(\S+)$")


def rerun(log: Path) -> dict:
    records, row = [], None
    for line in log.read_text().splitlines():
        if m := STEP.match(line):
            records.append({"step": int(m[3]), "reward/mean": float(m[4]),
                            "mismatch/logp_abs_diff_mean": float(m[5])})
        elif m := ROW.match(line):
            row = m
    arm, seed, steps = row[1], int(row[2]), int(row[3])
    assert len(records) == steps and records[-1]["step"] == steps, log
    return {"arm": arm, "seed": seed, "steps": steps, "steps_requested": 40, "held_out_examples": 200,
            "held_out_before": float(row[4]), "held_out_after": float(row[5]), "train_seconds": float(row[14]),
            "source": log.name, "concurrent": "six runs at once on one H200: seconds not comparable",
            # the log's own table row (k3, entropy, clip fraction and length are not logged per step)
            "logged_row": {"reward": f"{row[6]} -> {row[7]}", "dlogp": f"{row[8]} -> {row[9]}", "k3_last": row[10],
                           "entropy": row[11], "clip_frac": row[12], "len": row[13]},
            "records": records}


def per_run_row(r: dict) -> tuple:
    if "logged_row" in r:
        g = r["logged_row"]
        return (r["arm"], r["seed"], r["steps"], f"{r['held_out_before']:.3f} -> {r['held_out_after']:.3f}",
                g["reward"], g["dlogp"], g["k3_last"], g["entropy"], g["clip_frac"], g["len"],
                f"{r['train_seconds']:.0f}*")
    recs = r["full_records"]
    reward, dlogp, k3 = (_ends(recs, k) for k in ("reward/mean", "mismatch/logp_abs_diff_mean", "mismatch/kl_k3"))
    return (r["arm"], r["seed"], r["steps"], f"{r['held_out_before']:.3f} -> {r['held_out_after']:.3f}",
            f"{reward[0]:.3f} -> {reward[1]:.3f}", f"{dlogp[0]:.1e} -> {dlogp[1]:.1e}", f"{k3[1]:.1e}",
            f"{_ends(recs, 'actor/entropy')[1]:.3f}", f"{_mean([x.get('actor/clip_frac') for x in recs]):.4f}",
            f"{_ends(recs, 'response/length_mean')[1]:.0f}", f"{r['train_seconds']:.0f}")


def main() -> None:
    old = json.loads((HERE / "exp_rl.json").read_text())["runs"]
    runs = [{**r, "full_records": r["records"]} for r in old if r["arm"] not in RERUN_ARMS]
    runs += [rerun(HERE / f"rl_{arm}_{seed}.log") for arm in RERUN_ARMS for seed in (0, 1, 2)]
    order = ("bf16", "jet", "fp8-rollout", *RERUN_ARMS)
    runs.sort(key=lambda r: (order.index(r["arm"]), r["seed"]))

    table = common.table([per_run_row(r) for r in runs],
                         ("arm", "seed", "steps", "held-out acc", "reward (first3 -> last3)", "|dlogp| first -> last",
                          "k3 last", "entropy", "clip frac", "len", "s"))
    spread = []
    for arm in order:
        rs = [r for r in runs if r["arm"] == arm]
        rewards = [_ends(r["records"], "reward/mean") for r in rs]
        spread.append((arm, len(rs), ", ".join(str(r["steps"]) for r in rs),
                       _with_spread([r["held_out_after"] for r in rs], sign=False),
                       _with_spread([r["held_out_after"] - r["held_out_before"] for r in rs]),
                       _with_spread([b - a for a, b in rewards])))
    spread_table = common.table(spread, ("arm", "seeds", "steps", "held-out acc after (mean ± half range)",
                                         "held-out acc change (mean ± half range)",
                                         "reward change (mean ± half range)"))

    def matched(s: int) -> str:
        cut = {"runs": [{**r, "records": [x for x in r.get("full_records", r["records"]) if x["step"] <= s]}
                        for r in runs]}
        return step_matched_table(cut)

    text = (table + "\n* jet-exact and jet-kv8: re-run to 40 steps at 3 seeds (rl_*.log here), the six at once on "
            "one H200,\n  so their seconds are not comparable with the other arms' (run one after another); their rows "
            "are the logs'.\n\n" + spread_table + "\n\n" + matched(19) + "\n\n" + matched(36)
            + "\n(jet-exact, jet-kv8: k3 is not logged per step, so no step-matched k3; reward and |dlogp| per step "
              "from the logs, 3 digits)\n")
    (HERE / "table.txt").write_text(text)
    print(text)

    title = "Experiment 3 (SmolLM2-135M-Instruct, arithmetic)"
    full = [{**r, "records": r.get("full_records", r["records"])} for r in runs]
    assert all(x["reward/mean"] == x["reward/accuracy"] for r in full for x in r["records"] if "reward/accuracy" in x)
    absent = "their re-run logs kept only reward and |Δ logp|"
    plot_arm_bands(full, HERE / "exp_rl_curves.png", PANELS, f"{title}: RL from one warm start", absent,
                   notes={"reward/accuracy": "(0/1 rewards: accuracy = mean reward at every step of the arms drawn)"})
    plot_arm_bands(full, HERE / "exp_rl_health.png", HEALTH_PANELS, f"{title}: mismatch and policy health per step",
                   absent)

    for r in runs:
        r["records"] = [{k: x[k] for k in KEEP if k in x} for x in r.pop("full_records", r["records"])]
        r.pop("run_dir", None)
    common.write_json(HERE / "exp_rl_heldout_runs.json",
                      {"experiment": "rl_arms", "sources": ["exp_rl.json", *(r["source"] for r in runs if "source" in r)],
                       "records_keys": list(KEEP), "runs": runs})
    plot_held_out(runs, HERE / "exp_rl_held_out.png", title)


if __name__ == "__main__":
    main()
