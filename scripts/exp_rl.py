"""Experiment 2: RL from one warm start in several arms -- the same seed, data and hyper-parameters.

Arms (``exp_common.ARMS``; more by name with ``--arm NAME:overrides``): ``bf16`` (the reference),
``fp8-rollout`` (BF16 training on FP8 rollouts: off-policy), ``fp8-rollout-tis`` (the same with
truncated importance sampling, cap 2) and ``jet`` (FP8 on both sides). Each arm is one ``jetrl train``
run (:func:`jetrl.rl.loop.run`, unchanged) on the ``chain`` task from the same checkpoint, for
``--steps`` steps or until its ``--time-budget`` is spent, whichever comes first (the budget ends a run
by lowering ``trainer.steps`` to the step just finished, inside the loop's ``on_step`` callback: the loop
then writes its final checkpoint and stops as if that had been the step count). Greedy accuracy on
held-out problems (another task seed) is measured before and after, in the arm's recipe.

Per arm and seed the JSON keeps every logged step (reward, accuracy, the rollout-vs-training mismatch,
entropy, clip fraction, response length, timings); ``exp_rl_curves.png`` draws reward, accuracy,
length and mismatch per step (:func:`jetrl.plotting.plot_runs`), ``exp_rl_health.png`` the k3 KL, the
fraction of tokens with ``|Δp| > 1e-3``, entropy and clip fraction. With several ``--seeds`` the last
table gives the seed spread next to each arm's change. Everything the call needs to bring back is
``exp_rl.json`` and the two PNGs in ``--out``; the runs themselves stay in the work folder.

    python scripts/exp_rl.py --arms bf16,fp8-rollout --out $OUT           # SFT + two arms, one device call
    python scripts/exp_rl.py --smoke                                      # the whole path on CPU in seconds
    python scripts/exp_rl.py --replot a/exp_rl.json b/exp_rl.json --out d  # one table and plots of several calls
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import sys
from pathlib import Path
from typing import Any, Sequence

import exp_common as common
from jetrl.evaluate import held_out_accuracy
from jetrl.plotting import plot_runs
from jetrl.train.checkpoint import latest_checkpoint
from jetrl.rl.loop import run
from jetrl.rl.metrics import read_jsonl

# The RL settings every arm shares (GPU). Chains of ~1K tokens (difficulty_for_tokens(1024) = 89 steps);
# 32 prompts x 8 samples = 256 sequences per step, two optimizer steps of 128 per RL step.
GPU_RL = (
    "data.task=chain", "data.difficulty=89", "data.num_examples=20000", "data.prompts_per_step=32",
    "data.max_prompt_tokens=32", "rollout.n=8", "rollout.temperature=1.0", "rollout.max_tokens=1552",
    "algorithm.advantage_estimator=grpo", "algorithm.clip_low=0.2", "algorithm.clip_high=0.28",
    "algorithm.mini_batch_size=128", "algorithm.max_tokens_per_micro_batch=65536",
    "optim.lr=1e-5", "optim.warmup_steps=2", "optim.grad_clip=1.0",
    "model.dtype=bfloat16", "model.device=cuda",
    "trainer.checkpoint_every=0", "trainer.keep_last=1", "trainer.log_every=1",
)
SMOKE_RL = (
    "data.task=chain", "data.difficulty=2", "data.num_examples=16", "data.prompts_per_step=2",
    "data.max_prompt_tokens=16", "rollout.n=2", "rollout.temperature=1.0", "rollout.max_tokens=40",
    "algorithm.mini_batch_size=4", "algorithm.micro_batch_size=4", "optim.lr=1e-4",
    "model.dtype=float32", "model.device=cpu",
    "trainer.checkpoint_every=0", "trainer.keep_last=1", "trainer.log_every=1",
)
HEALTH_PANELS = (("mismatch/kl_k3", "k3 KL(rollout || train)", True),
                 ("mismatch/frac_prob_diff_gt_thr", "fraction of tokens |Δp| > 1e-3", False),
                 ("actor/entropy", "entropy (nats / token)", False),
                 ("actor/clip_frac", "clip fraction", False))


def run_arm(name: str, overrides: Sequence[str], base: Sequence[str], model_path: str, run_dir: Path, seed: int,
            steps: int, time_budget: float, num_eval: int, log=print, cross_eval: bool = False) -> dict[str, Any]:
    """One arm and seed: held-out accuracy, RL for ``steps`` steps or ``time_budget`` seconds, held-out
    accuracy of the final checkpoint (a task's problems of another seed, or ``data.eval_path``'s rows for a run on
    a file: ``--override data.eval_path=...``); returns the summary and every logged step. ``cross_eval``:
    the final checkpoint is also evaluated in the other precision (``bf16``'s in the FP8 flow, an FP8 arm's in
    BF16), which separates what FP8 inference costs from what FP8 training learned."""
    config = common.arm_config([*base, f"model.path={model_path}", f"trainer.output_dir={run_dir}",
                                f"trainer.seed={seed}", f"trainer.steps={steps}"], overrides)
    clock = common.Clock()
    before = held_out_accuracy(model_path, config, num_eval) if num_eval else None
    train_clock = common.Clock()

    def on_step(step: int, metrics: dict[str, float]) -> None:
        log(f"{name} seed {seed} step {step}: reward {metrics.get('reward/mean', math.nan):.3f}, |dlogp| "
            f"{metrics.get('mismatch/logp_abs_diff_mean', math.nan):.2e}, {train_clock.elapsed():.0f} s")
        if train_clock.elapsed() >= time_budget and step < config.trainer.steps:
            config.trainer.steps = step  # the loop checkpoints this step as its last and stops

    run(config, on_step=on_step)
    train_seconds = train_clock.elapsed()
    final = latest_checkpoint(run_dir / "checkpoints")
    after = held_out_accuracy(str(final / "model"), config, num_eval) if num_eval else None
    after_other = None
    if cross_eval and num_eval:
        other = copy.deepcopy(config)
        other.recipe, other.exact, other.kv_fp8 = ("jet" if config.recipe == "bf16" else "bf16"), False, False
        after_other = held_out_accuracy(str(final / "model"), other, num_eval)
        log(f"{name} seed {seed}: held-out after {after}, in {other.recipe} {after_other}")
    records = read_jsonl(run_dir / "metrics.jsonl")
    return {"arm": name, "seed": seed, "overrides": list(overrides), "recipe": config.recipe,
            "steps": len(records), "steps_requested": steps, "train_seconds": train_seconds,
            "seconds": clock.elapsed(), "held_out_examples": num_eval, "held_out_before": before,
            "held_out_after": after,
            "held_out_after_other_precision": after_other, "run_dir": str(run_dir), "records": records}


def _mean(values: Sequence[float]) -> float:
    values = [v for v in values if isinstance(v, (int, float)) and math.isfinite(v)]
    return sum(values) / len(values) if values else math.nan


def _ends(records: list[dict], key: str, window: int = 3) -> tuple[float, float]:
    """Mean of ``key`` over the first and the last ``window`` logged steps."""
    values = [float(r[key]) for r in records if key in r]
    return _mean(values[:window]), _mean(values[-window:])


def plot(results: dict[str, Any], out: Path, title: str = "Experiment 2") -> list[Path]:
    """``exp_rl_curves.png`` (reward, accuracy, length, mismatch per step, every run) and
    ``exp_rl_health.png`` (k3 KL, |Δp| > 1e-3 fraction, entropy, clip fraction)."""
    runs = results["runs"]
    labels = [f"{r['arm']} s{r['seed']}" for r in runs]
    paths = [plot_runs([r["run_dir"] for r in runs], out / "exp_rl_curves.png", labels=labels,
                       title=f"{title}: RL from one warm start, per arm")]
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(10, 7))
    for ax, (key, panel, log_scale) in zip(axes.flat, HEALTH_PANELS):
        for label, r in zip(labels, runs):
            points = [(rec["step"], float(rec[key])) for rec in r["records"] if key in rec]
            if points:
                ax.plot(*zip(*points), marker="o" if len(points) < 30 else None, markersize=3, label=label)
        if log_scale:
            common.log_scale_with_zero(ax, [float(rec[key]) for r in runs for rec in r["records"] if key in rec])
        ax.set_title(panel)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    axes.flat[0].legend(fontsize=8)
    fig.suptitle(f"{title}: mismatch and policy health per step")
    fig.tight_layout()
    paths.append(out / "exp_rl_health.png")
    fig.savefig(paths[-1], dpi=100)
    plt.close(fig)
    held_out = plot_held_out(runs, out / "exp_rl_held_out.png", title)
    return paths + ([held_out] if held_out else [])


def plot_held_out(runs: list[dict[str, Any]], path: Path, title: str) -> Path | None:
    """Held-out accuracy before and after RL per arm: bars at the mean over seeds, each seed a dot; None when no
    run measured it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    arms: dict[str, list[dict[str, Any]]] = {}
    for r in runs:
        if r.get("held_out_before") is not None and r.get("held_out_after") is not None:
            arms.setdefault(r["arm"], []).append(r)
    if not arms:
        return None
    fig, ax = plt.subplots(figsize=(1.6 * len(arms) + 2, 4))
    for i, (arm, rs) in enumerate(arms.items()):
        for j, (key, label, color) in enumerate((("held_out_before", "before", "0.7"),
                                                 ("held_out_after", "after RL", "C0"))):
            values = [r[key] for r in rs]
            x = i + (j - 0.5) * 0.38
            ax.bar(x, _mean(values), width=0.36, color=color, label=label if i == 0 else None)
            ax.scatter([x] * len(values), values, color="k", s=10, zorder=3)
        steps = sorted({len(r["records"]) for r in rs})
        span = str(steps[0]) if len(steps) == 1 else f"{steps[0]}-{steps[-1]}"
        ax.annotate(f"{len(rs)} seed{'s' if len(rs) > 1 else ''}, {span} steps", (i, 0.01), ha="center", fontsize=8)
    ax.set_xticks(range(len(arms)), list(arms))
    ax.set_ylabel("held-out greedy accuracy")
    ax.set_ylim(0, 1)
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=8, loc="upper left")
    ax.set_title(f"{title}: held-out accuracy before and after RL")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def _finite(value: Any) -> float | None:
    value = float(value) if isinstance(value, (int, float, str)) else math.nan  # non-finite floats log as strings
    return value if math.isfinite(value) else None


def plot_arm_bands(runs: list[dict[str, Any]], path: Path, panels: Sequence[tuple[str, str, bool]], title: str,
                   absent_note: str = "not logged", notes: dict[str, str] | None = None) -> Path:
    """One line per arm in each of the four ``panels`` ((key, title, log scale), e.g. ``jetrl.plotting.PANELS``
    or ``HEALTH_PANELS``): the mean over the arm's seeds at each step (of the seeds that logged it), and a band
    over their range (min-max). Only the runs' ``records`` are read (no run folders). A panel draws the arms that
    logged its key and names the others in its title with ``absent_note``; ``notes`` adds a line per key. On a
    log panel the axis is symlog down to 0 (:func:`exp_common.log_scale_with_zero`), so an arm at exactly 0
    is drawn on 0 and named in the panel rather than left out."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch
    from matplotlib.ticker import MaxNLocator

    arms: dict[str, list[dict[str, Any]]] = {}
    for r in runs:
        arms.setdefault(r["arm"], []).append(r)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    color = {arm: colors[i % len(colors)] for i, arm in enumerate(arms)}
    labels = {}
    for arm, rs in arms.items():
        steps = [max((rec["step"] for rec in r["records"]), default=0) for r in rs]
        span = f"{steps[0]} steps" if len(set(steps)) == 1 else f"{', '.join(map(str, steps))} steps"
        labels[arm] = f"{arm} ({len(rs)} seed{'s' if len(rs) > 1 else ''}, {span})"
    logged = {arm: {key for key, _, _ in panels if any(_finite(rec.get(key)) is not None
                                                       for r in rs for rec in r["records"])}
              for arm, rs in arms.items()}
    nowhere = [arm for arm in arms if not logged[arm]]
    fig, axes = plt.subplots(2, 2, figsize=(11, 8))
    for ax, (key, name, log_scale) in zip(axes.flat, panels):
        absent, zero, drawn = [], [], []
        for arm, rs in arms.items():
            by_step: dict[int, list[float]] = {}
            for r in rs:
                for rec in r["records"]:
                    if (v := _finite(rec.get(key))) is not None:
                        by_step.setdefault(int(rec["step"]), []).append(v)
            if not by_step:
                absent += [] if arm in nowhere else [arm]
                continue
            steps = sorted(by_step)
            values = [by_step[s] for s in steps]
            ax.fill_between(steps, [min(v) for v in values], [max(v) for v in values], color=color[arm], alpha=0.2,
                            linewidth=0)
            drawn += [x for v in values for x in v]
            if log_scale and all(x == 0 for v in values for x in v):
                zero.append(arm)
            ax.plot(steps, [_mean(v) for v in values], color=color[arm], linewidth=2.5 if arm in zero else 1.8,
                    zorder=3 if arm in zero else 2)
        if log_scale and any(x == 0 for x in drawn):
            common.log_scale_with_zero(ax, drawn)
            if zero:  # room under 0 (the linear part of the symlog axis), so the line on 0 is not the frame
                ax.set_ylim(bottom=-0.3 * min(x for x in drawn if x > 0) if any(x > 0 for x in drawn) else -0.1)
                ax.annotate(f"{', '.join(zero)} = 0", (0.02, 0.03), xycoords="axes fraction", fontsize=8,
                            color=color[zero[0]])
        elif log_scale and any(x > 0 for x in drawn):
            ax.set_yscale("log")
        lines = [name]
        if absent:
            lines.append(f"(no {', '.join(absent)}: {absent_note})")
        if zero:
            lines.append(f"({', '.join(zero)}: exactly 0 at every step of every seed, the line on 0)")
        if notes and key in notes:
            lines.append(notes[key])
        ax.set_title("\n".join(lines), fontsize=9 if len(lines) > 1 else None)
        ax.set_xlabel("step")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
    shown = [a for a in arms if a not in nowhere]
    handles = [(Patch(facecolor=color[a], alpha=0.2, linewidth=0), Line2D([], [], color=color[a], linewidth=1.8))
               for a in shown]
    fig.legend(handles, [labels[a] for a in shown], loc="lower center", ncol=min(3, len(shown)), frameon=False,
               fontsize=9, title_fontsize=9,
               title=f"not drawn: {', '.join(labels[a] for a in nowhere)}: {absent_note}" if nowhere else None)
    fig.suptitle(f"{title}\nper arm: mean over its seeds (line) and their min-max range (band)")
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def summary_tables(results: dict[str, Any]) -> str:
    """Per run: steps, held-out accuracy before -> after, reward and mismatch at the start and the end;
    then per arm over seeds: the mean change of held-out accuracy and reward with the seed spread."""
    rows = []
    for r in results["runs"]:
        recs = r["records"]
        reward = _ends(recs, "reward/mean")
        dlogp = _ends(recs, "mismatch/logp_abs_diff_mean")
        k3 = _ends(recs, "mismatch/kl_k3")
        acc = (f"{r['held_out_before']:.3f} -> {r['held_out_after']:.3f}" if r["held_out_before"] is not None else "-")
        rows.append((r["arm"], r["seed"], r["steps"], acc, f"{reward[0]:.3f} -> {reward[1]:.3f}",
                     f"{dlogp[0]:.1e} -> {dlogp[1]:.1e}", f"{k3[1]:.1e}",
                     f"{_ends(recs, 'actor/entropy')[1]:.3f}",
                     f"{_mean([x.get('actor/clip_frac', math.nan) for x in recs]):.4f}",
                     f"{_ends(recs, 'response/length_mean')[1]:.0f}", f"{r['train_seconds']:.0f}"))
    text = common.table(rows, ("arm", "seed", "steps", "held-out acc", "reward (first3 -> last3)",
                               "|dlogp| first -> last", "k3 last", "entropy", "clip frac", "len", "s"))
    spread_rows = []
    for arm in dict.fromkeys(r["arm"] for r in results["runs"]):
        runs = [r for r in results["runs"] if r["arm"] == arm]
        gains = [r["held_out_after"] - r["held_out_before"] for r in runs if r["held_out_before"] is not None]
        rewards = [_ends(r["records"], "reward/mean") for r in runs]
        reward_gains = [b - a for a, b in rewards]
        spread_rows.append((arm, len(runs), _with_spread(gains), _with_spread(reward_gains)))
    skipped = [f"{s['arm']} seed {s['seed']}" for s in results.get("skipped", [])]
    return (text + (f"\nnot run (deadline): {', '.join(skipped)}" if skipped else "") + "\n\n"
            + common.table(spread_rows, ("arm", "seeds", "held-out acc change (mean ± half range)",
                                         "reward change (mean ± half range)"))
            + "\n\n" + step_matched_table(results))


def _window(records: list[dict], key: str, first: int, last: int) -> float:
    """Mean of ``key`` over the logged steps ``first..last`` (1-based, inclusive)."""
    return _mean([float(r[key]) for r in records if key in r and first <= r["step"] <= last])


def step_matched_table(results: dict[str, Any], window: int = 5) -> str:
    """Per arm over seeds, every run cut at the same step S (the fewest steps any run reached, since the arms
    run at different speeds within one deadline): reward and mismatch over steps ``1..window`` and
    ``S-window+1..S``, the reward gain and the mismatch's growth factor (last window over first), each as the
    seeds' mean ± half range."""
    runs = [r for r in results["runs"] if r["records"]]
    if not runs:
        return "step-matched: no run logged a step"
    s = min(max(rec["step"] for rec in r["records"]) for r in runs)
    window = max(1, min(window, s // 2)) if s >= 2 else 1
    lo, hi = (1, window), (s - window + 1, s)
    rows = []
    for arm in dict.fromkeys(r["arm"] for r in runs):
        mine = [r["records"] for r in runs if r["arm"] == arm]
        reward = [(_window(rec, "reward/mean", *lo), _window(rec, "reward/mean", *hi)) for rec in mine]
        dlogp = [(_window(rec, "mismatch/logp_abs_diff_mean", *lo), _window(rec, "mismatch/logp_abs_diff_mean", *hi))
                 for rec in mine]
        k3 = [(_window(rec, "mismatch/kl_k3", *lo), _window(rec, "mismatch/kl_k3", *hi)) for rec in mine]
        rows.append((arm, len(mine), _with_spread([b for _, b in reward], sign=False),
                     _with_spread([b - a for a, b in reward]),
                     _with_spread([b for _, b in dlogp], sign=False, fmt=".2e"),
                     _with_spread([b / a for a, b in dlogp if a > 0], sign=False, fmt=".2f"),
                     _with_spread([b for _, b in k3], sign=False, fmt=".2e"),
                     _with_spread([b / a for a, b in k3 if a > 0], sign=False, fmt=".2f")))
    head = (f"step-matched at S = {s} (every run's steps {lo[0]}-{lo[1]} against {hi[0]}-{hi[1]}; "
            f"mean ± half range over seeds)")
    return head + "\n" + common.table(rows, ("arm", "seeds", "reward at S", "reward gain", "|dlogp| at S",
                                             "|dlogp| growth", "k3 at S", "k3 growth"))


def _with_spread(values: Sequence[float], sign: bool = True, fmt: str = ".3f") -> str:
    """``mean ± half range`` of finite ``values`` (``fmt``, with a sign by default); one value: no spread."""
    values = [v for v in values if math.isfinite(v)]
    if not values:
        return "-"
    spec = ("+" if sign else "") + fmt
    if len(values) == 1:
        return f"{values[0]:{spec}} (one seed: no spread)"
    return f"{_mean(values):{spec}} ± {(max(values) - min(values)) / 2:{fmt}}"


def run_experiment(args: argparse.Namespace, log=print) -> dict[str, Any]:
    """SFT (or ``--model``), then every arm for every seed; writes the JSON after each run and the PNGs."""
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    work = common.work_dir(args)
    arms = common.resolve_arms(common.parse_list(args.arms), args.arm)
    seeds = common.parse_list(args.seeds, int)
    base = [*(SMOKE_RL if args.smoke else GPU_RL), *args.override]
    for overrides in arms.values():  # every arm's config is valid before the SFT starts
        common.arm_config([*base, "model.path=unused"], overrides)
    clock = common.Clock()
    model_path, warm = common.warm_start(args, work, log=log)
    results: dict[str, Any] = {"experiment": "rl_arms", "smoke": args.smoke, "warm_start": warm, "base_overrides": base,
                               "arm_overrides": arms, "seeds": seeds, "steps": args.steps,
                               "time_budget_per_arm": args.time_budget, "deadline": args.deadline, "runs": [],
                               "skipped": []}
    json_path = out / "exp_rl.json"
    todo = [(seed, name) for seed in seeds for name in arms]
    for i, (seed, name) in enumerate(todo):
        budget = args.time_budget
        if args.deadline is not None:  # share what is left fairly among the runs still to come
            share = (args.deadline - clock.elapsed()) / (len(todo) - i) - args.reserve
            budget = min(budget, share)
        if args.deadline is not None and share <= 0:
            results["skipped"].append({"arm": name, "seed": seed, "reason": "deadline"})
            log(f"{name} seed {seed}: skipped, no time left before the {args.deadline:.0f} s deadline")
            continue
        result = run_arm(name, arms[name], base, model_path, work / "rl" / f"{name}-s{seed}", seed, args.steps,
                         budget, args.eval_examples, log=log, cross_eval=args.cross_eval)
        results["runs"].append(result)
        common.write_json(json_path, results)  # a call cut short still brings the finished runs
    common.write_json(json_path, results)
    if results["runs"]:
        plot(results, out, args.title)
    return results


def replot(paths: Sequence[str], out: Path, title: str = "Experiment 2") -> dict[str, Any]:
    """The runs of several ``exp_rl.json`` files (e.g. the two GPUs of ``scripts/exp_two_gpus.sh``) as one
    result: their step records are written back as run folders under ``out`` so the plots can read them."""
    merged: dict[str, Any] = {"experiment": "rl_arms", "sources": list(paths), "runs": [], "skipped": []}
    for path in paths:
        data = json.loads(Path(path).read_text())
        merged["skipped"] += data.get("skipped", [])
        for run_ in data["runs"]:
            run_dir = out / "runs" / f"{run_['arm']}-s{run_['seed']}"
            run_dir.mkdir(parents=True, exist_ok=True)
            (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in run_["records"]))
            merged["runs"].append({**run_, "run_dir": str(run_dir)})
    common.write_json(out / "exp_rl.json", merged)
    plot(merged, out, title)
    return merged


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    common.add_common_arguments(p, default_out="runs/exp_rl", default_arms="bf16,fp8-rollout,fp8-rollout-tis,jet")
    p.add_argument("--seeds", default="0", help="comma-separated trainer seeds (each arm runs once per seed)")
    p.add_argument("--steps", type=int, default=None, help="RL steps per arm (default 40; smoke 2)")
    p.add_argument("--time-budget", type=float, default=None,
                   help="seconds of RL per arm; the run ends after the step that crosses it (default 150; smoke 600)")
    p.add_argument("--eval-examples", type=int, default=None, help="held-out problems (default 128; smoke 2; 0 = off)")
    p.add_argument("--cross-eval", action="store_true",
                   help="also evaluate each final checkpoint in the other precision (bf16 <-> the FP8 flow)")
    p.add_argument("--deadline", type=float, default=None,
                   help="seconds after the start by which every run should be done (default 540 on the GPU, none in "
                        "smoke): each run's budget is at most its share of the time left, less --reserve")
    p.add_argument("--reserve", type=float, default=None,
                   help="seconds per run kept for loading, held-out evaluation and the checkpoint "
                        "(default 45; smoke 0)")
    p.add_argument("--replot", nargs="+", default=None, metavar="JSON",
                   help="no runs: merge these exp_rl.json files into one JSON, table and plots in --out")
    p.add_argument("--title", default="Experiment 2", help="the plots' title prefix")
    p.add_argument("--override", action="append", default=[], metavar="KEY=VALUE",
                   help="a RunConfig override for every arm (e.g. rollout.max_tokens=3000); repeatable")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.replot:
        print(summary_tables(replot(args.replot, Path(args.out), args.title)))
        return 0
    args.steps = args.steps if args.steps is not None else (2 if args.smoke else 40)
    args.time_budget = args.time_budget if args.time_budget is not None else (600.0 if args.smoke else 150.0)
    args.eval_examples = args.eval_examples if args.eval_examples is not None else (2 if args.smoke else 128)
    args.reserve = args.reserve if args.reserve is not None else (0.0 if args.smoke else 45.0)
    if args.deadline is None and not args.smoke:
        args.deadline = 540.0
    results = run_experiment(args, log=lambda m: print(m, file=sys.stderr, flush=True))
    print(summary_tables(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
