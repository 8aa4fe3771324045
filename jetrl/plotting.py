"""Curves of one or several RL runs from their ``metrics.jsonl``, drawn to a PNG with matplotlib.

Four panels: reward, accuracy, mean response length and the rollout-vs-training mismatch (mean
``|logp_rollout - logp_train|`` on the same tokens, log scale). Every run is one line in each panel,
labelled by its folder name and precision recipe (read from the run's saved config), so runs of the
three recipes on the same task sit side by side: ``jet`` should track ``bf16`` in reward while its
mismatch stays near rounding level; ``fp8-rollout`` shows the larger mismatch. Noisy curves get a
moving average drawn over the raw points. :func:`summarize_run` condenses the same log into the rows of
a run's summary table.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import yaml

# the file the RL loop writes (jetrl.rl.metrics.METRICS_FILE: the same name; plotting imports nothing of jetrl)
METRICS_FILE = "metrics.jsonl"

# (metric key, panel title, log scale)
PANELS: tuple[tuple[str, str, bool], ...] = (
    ("reward/mean", "reward (mean)", False),
    ("reward/accuracy", "accuracy", False),
    ("response/length_mean", "response length (tokens)", False),
    ("mismatch/logp_abs_diff_mean", "rollout vs training |Δ logp| (mean)", True),
)


@dataclass
class RunCurves:
    """The logged steps of one run and its label."""

    label: str
    records: list[dict]

    def series(self, key: str) -> tuple[list[int], list[float]]:
        steps, values = [], []
        for r in self.records:
            value = r.get(key)
            if isinstance(value, str):  # non-finite floats are logged as strings
                value = float(value)
            if isinstance(value, (int, float)) and "step" in r:
                steps.append(int(r["step"]))
                values.append(float(value))
        return steps, values


def _metrics_path(run: str | Path) -> Path:
    path = Path(run)
    if path.is_dir():
        path = path / METRICS_FILE
    if not path.is_file():
        raise FileNotFoundError(f"no metrics at {path}: give a run folder (holding {METRICS_FILE}) or the file itself")
    return path


def _recipe_of(run_dir: Path) -> str | None:
    for path in (run_dir / "config.yaml", run_dir / "config.json"):
        if path.is_file():
            try:
                return (yaml.safe_load(path.read_text()) or {}).get("recipe")  # YAML reads JSON too
            except Exception:
                return None
    return None


def load_run(run: str | Path, label: str | None = None, name: str | None = None) -> RunCurves:
    """Read a run's ``metrics.jsonl`` (a partial last line from a killed run is skipped); labelled ``label``, else
    ``name`` (default: the run folder's name) with the run's recipe."""
    path = _metrics_path(run)
    records = []
    for line in filter(str.strip, path.read_text().splitlines()):
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    if not records:
        raise ValueError(f"{path} holds no logged steps yet")
    if label is None:
        recipe = _recipe_of(path.parent)
        label = (name or path.resolve().parent.name) + (f" ({recipe})" if recipe else "")  # "." names its folder
    return RunCurves(label, records)


def moving_average(values: Sequence[float], window: int) -> list[float]:
    """Trailing mean over up to ``window`` points (NaNs skipped)."""
    chunks = [[v for v in values[max(0, i - window + 1):i + 1] if not math.isnan(v)] for i in range(len(values))]
    return [sum(chunk) / len(chunk) if chunk else float("nan") for chunk in chunks]


def summarize_run(run: str | Path) -> list[tuple[str, str]]:
    """Summary rows (name, value) of a run from its metrics log: reward, accuracy and response length at the
    start and the end (means over the first and last few steps), the last steps' mismatch, and the time."""
    records = load_run(run).records
    k = max(1, min(5, len(records) // 4))
    first, last = records[:k], records[-k:]

    def mean(rows: list[dict], key: str) -> float:
        vals = [float(r[key]) for r in rows if key in r]
        return sum(vals) / len(vals) if vals else float("nan")

    rows = [("steps", str(records[-1].get("step", len(records))))]
    # with 0/1 rewards the mean reward is the accuracy: one row then
    same = all(r.get("reward/mean") == r.get("reward/accuracy") for r in records)
    shown = [("reward/mean", "reward = accuracy" if same else "reward")]
    shown += [] if same else [("reward/accuracy", "accuracy")]
    for key, name in (*shown, ("response/length_mean", "response length")):
        rows.append((f"{name} (first {k} -> last {k} steps)", f"{mean(first, key):.3f} -> {mean(last, key):.3f}"))
    errors, timeouts = (sum(int(float(r.get(f"reward/{kind}", 0))) for r in records) for kind in ("errors", "timeouts"))
    rows.append(("failed rewards (all steps)", f"{errors} errors, {timeouts} timeouts"))
    rows.append(("mismatch |Δ logp| mean (last)", f"{mean(last, 'mismatch/logp_abs_diff_mean'):.2e}"))
    rows.append(("mismatch |Δ p| max (last)", f"{mean(last, 'mismatch/prob_abs_diff_max'):.2e}"))
    total = sum(float(r.get("time/step_wall", r.get("time/step", 0.0))) for r in records)
    rows.append(("time in steps", f"{total:.0f} s"))
    return rows


def default_plot_path(runs: Sequence[str | Path]) -> Path:
    """``RUN/curves.png`` for one run; for several, ``curves_A_vs_B.png`` (run folder names) next to the
    first run, so that a comparison never replaces a run's own plot."""
    folders = _folders(runs)
    if len(folders) == 1:
        return folders[0] / "curves.png"
    names = "_vs_".join(_distinct_names(folders, "-"))
    return folders[0].resolve().parent / f"curves_{names}.png"


def _folders(runs: Sequence[str | Path]) -> list[Path]:
    if not runs:
        raise ValueError("plot needs at least one run folder")
    return [Path(r) if Path(r).is_dir() else Path(r).parent for r in runs]


def _distinct_names(folders: Sequence[Path], sep: str) -> list[str]:
    """Each folder's name; where two runs share one (``a/seed0``, ``b/seed0``), its parent's name ``sep`` its own."""
    names = [f.resolve().name for f in folders]
    return [f"{f.resolve().parent.name}{sep}{n}" if names.count(n) > 1 else n for f, n in zip(folders, names)]


def draw_runs(runs: Sequence[str | Path], labels: Sequence[str] | None = None, smooth: int | None = None,
              title: str | None = None) -> Any:
    """The matplotlib figure of the four panels for ``runs`` (folders or metrics files); the caller closes it
    (``matplotlib.pyplot.close``). Steps are whole numbers, so are the x ticks.

    ``smooth`` is the moving-average window (default: about a tenth of the longest run, at least 1).
    """
    names = _distinct_names(_folders(runs), "/")  # runs in folders of one name told apart by their parents'
    if labels is not None and len(labels) != len(runs):
        raise ValueError(f"got {len(labels)} labels for {len(runs)} runs")
    curves = [load_run(r, labels[i] if labels else None, names[i]) for i, r in enumerate(runs)]
    import matplotlib

    matplotlib.use("Agg")  # files only, no display needed
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    window = smooth if smooth is not None else max(1, max(len(c.records) for c in curves) // 10)
    fig, axes = plt.subplots(2, 2, figsize=(11, 7.5))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for ax, (key, name, log_scale) in zip(axes.flat, PANELS):
        drawn = False
        for i, run in enumerate(curves):
            steps, values = run.series(key)
            if not steps:
                continue
            color = colors[i % len(colors)]
            if window > 1 and len(values) > 2:
                ax.plot(steps, values, color=color, alpha=0.25, linewidth=1)
                ax.plot(steps, moving_average(values, window), color=color, linewidth=2, label=run.label)
            else:
                ax.plot(steps, values, color=color, linewidth=2, marker="o" if len(steps) < 30 else None,
                        markersize=3, label=run.label)
            drawn = True
        if log_scale and drawn and any(v > 0 for c in curves for v in c.series(key)[1]):
            ax.set_yscale("log")
        ax.set(title=name, xlabel="step")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # no step 1.5 on a short run's axis
        ax.grid(alpha=0.3)
        if not drawn:
            ax.text(0.5, 0.5, f"no '{key}' logged", ha="center", va="center", transform=ax.transAxes, color="gray")
    handles, names = axes.flat[0].get_legend_handles_labels()
    if handles:
        fig.legend(handles, names, loc="lower center", ncol=min(4, len(names)), frameon=False)
    fig.suptitle(title or "jetrl: " + ", ".join(c.label for c in curves))
    fig.tight_layout(rect=(0, 0.05 if handles else 0, 1, 1))
    return fig


def png_path(output: str | Path) -> Path:
    """The file a plot to ``output`` goes to: a name without a suffix gets ``.png``, as matplotlib adds it."""
    output = Path(output)
    return output if output.suffix else output.with_name(output.name + ".png")


def plot_runs(runs: Sequence[str | Path], output: str | Path, labels: Sequence[str] | None = None,
              smooth: int | None = None, title: str | None = None) -> Path:
    """Draw the four panels for ``runs`` (folders or metrics files; :func:`draw_runs`) into the PNG ``output``,
    replacing a file there."""
    fig = draw_runs(runs, labels=labels, smooth=smooth, title=title)
    import matplotlib.pyplot as plt

    output = png_path(output)
    output.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(output, dpi=110)
    plt.close(fig)
    return output


__all__ = ["plot_runs", "png_path", "draw_runs", "default_plot_path", "load_run", "summarize_run", "RunCurves",
           "moving_average", "PANELS", "METRICS_FILE"]
