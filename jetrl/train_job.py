"""An RL run with its held-out check, as ``jetrl train`` does it: :func:`train_and_evaluate`.

Around :func:`jetrl.rl.loop.run` it adds what a finished run is judged by: greedy accuracy on held-out
problems before training (skipped when the run resumes from a checkpoint, whose starting weights are not the
configured model's) and after it (on the newest complete checkpoint), written to ``<output_dir>/eval.json``; the run's
curves in ``<output_dir>/curves.png``; and its summary rows. It is a separate module because the RL stage
imports neither the evaluation nor the plotting. :func:`check_train_job` makes the command's checks before a model
loads; the prompts it read and tokenized, with the tokenizer it loaded, go to the run (and the evaluation before
it), which do not read or load them again.

Under torchrun only rank 0 calls it, after preparing the output folder
(:func:`jetrl.rl.loop.prepare_output_dir`); the other ranks call :func:`jetrl.rl.loop.run` with the
same config.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from jetrl.asset_files import existing_path
from jetrl.config import RunConfig
from jetrl.data import RunPrompts, check_run_prompts
from jetrl.evaluate import EVAL_SEED, held_out_accuracy
from jetrl.models import check_eos, resolve_device
from jetrl.plotting import METRICS_FILE, plot_runs, summarize_run
from jetrl.progress import Progress
from jetrl.registries import check_config
from jetrl.rl.loop import EVAL_FILE, PLOT_FILE, check_model, run, run_settings
from jetrl.train.checkpoint import CHECKPOINT_SUBDIR, latest_checkpoint
from jetrl.train.policy import has_checkpoint


@dataclass
class TrainJobResult:
    """Where a run's outputs went, its summary rows and, with a held-out check, the accuracies.

    ``accuracy_before`` is None when it was not measured (a resumed run, or no check), ``accuracy_after`` when the
    run left no complete checkpoint (every save skipped for disk space); ``checkpoint`` is the checkpoint whose
    accuracy is ``accuracy_after``. Both are measured in the run's precision ``recipe``."""

    output_dir: Path
    plot: Path
    summary: list[tuple[str, str]] = field(default_factory=list)
    recipe: str = ""
    num_eval: int = 0
    accuracy_before: float | None = None
    accuracy_after: float | None = None
    checkpoint: Path | None = None

    def rows(self) -> list[tuple[str, str]]:
        """(name, value) pairs for a summary table: the run's summary, the held-out accuracy, the outputs."""
        rows = list(self.summary)
        if self.num_eval:
            before = f"{self.accuracy_before:.3f}" if self.accuracy_before is not None else None
            after = f"{self.accuracy_after:.3f}" if self.accuracy_after is not None else "no checkpoint to evaluate"
            shown = f"{before} -> {after}" if before is not None else after
            rows.insert(1, (f"greedy accuracy ({self.recipe}), {self.num_eval} held-out problems", shown))
        out = self.output_dir
        return rows + [("metrics", str(out / METRICS_FILE)), ("checkpoints", str(out / CHECKPOINT_SUBDIR)),
                       ("plot", str(self.plot))]


def _step_reporter(total: int, bar: Progress, log: Callable[[str], None] | None):
    """``on_step`` for :func:`jetrl.rl.loop.run`: the latest reward and length on the bar, and with ``log`` a
    line per step."""
    t0, shown = time.perf_counter(), 0

    def on_step(step: int, metrics: dict[str, float]) -> None:
        nonlocal shown
        reward, length = metrics.get("reward/mean", float("nan")), metrics.get("response/length_mean", float("nan"))
        bar.set_postfix(reward=f"{reward:.3f}", len=f"{length:.0f}")
        bar.update(step - shown)  # a resumed run starts past 0
        shown = step
        if log is not None:
            log(f"step {step}/{total}  reward {reward:.3f}  length {length:.0f}  {time.perf_counter() - t0:.0f}s")
    return on_step


def _recorded_before(path: Path, config: RunConfig, num_eval: int) -> float | None:
    """The accuracy before training that an earlier part of this run wrote to ``path``, where it was measured as
    this one would be (the same problems and recipe); else None."""
    try:
        recorded = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    same = (recorded.get("num_examples"), recorded.get("recipe"), recorded.get("file")) == (
        num_eval, config.recipe, config.data.eval_path)
    return recorded.get("greedy_accuracy_before") if same else None


def check_train_job(config: RunConfig, eval_examples: int | None = None) -> RunPrompts:
    """What ``jetrl train`` checks before any weight loads: the config's names (task, format, reward, ...), the
    device, the model's config and tokenizer (with its end-of-sequence token), and every prompt read and tokenized
    against the context; returns those prompts with the tokenizer (:func:`jetrl.data.check_run_prompts`; pass them
    on to :func:`train_and_evaluate`) and the number of held-out problems to evaluate on (``eval_examples``;
    ``None``: 200 where the run has a task or a held-out file, else 0), or the held-out file's row count where that
    is smaller (with a warning). ValueError for held-out problems asked of a run with neither a task nor a held-out
    file, or for a held-out file without ``data.path``; FileNotFoundError for a held-out file that is not there
    (its path is resolved into ``config.data.eval_path``)."""
    held_out = config.data.task or config.data.eval_path
    num_eval = eval_examples if eval_examples is not None else (200 if held_out else 0)
    if num_eval and not held_out:
        raise ValueError("--eval-examples measures held-out accuracy on a built-in task (data.task) or a held-out "
                         "file (data.eval_path, e.g. GSM8K's test split)")
    if config.data.eval_path and not config.data.path:
        raise ValueError("data.eval_path holds the held-out rows of a run on a file: set data.path too")
    if num_eval and config.data.eval_path:
        config.data.eval_path = existing_path(config.data.eval_path, "held-out file", "set data.eval_path to a JSONL "
                                              "or Parquet file, or pass --eval-examples 0 to skip the evaluation")
    check_config(config)
    resolve_device(config.model.device)
    folder, _, tokenizer = check_model(config)
    check_eos(tokenizer, config.model.tokenizer or folder, folder)
    return check_run_prompts(config.data, config.trainer.seed, tokenizer, num_eval)


def train_and_evaluate(config: RunConfig, data: RunPrompts, *, require_checkpoint: bool = False,
                       progress: bool = True, log: Callable[[str], None] = print) -> TrainJobResult:
    """Run RL as configured on ``data`` (what :func:`check_train_job` returned: the prompts, the tokenizer and
    ``num_eval``), with greedy accuracy on ``data.num_eval`` held-out problems before and after.

    ``data.num_eval`` > 0 needs a built-in task (the config's ``data.task``; its problems drawn with
    :data:`jetrl.evaluate.EVAL_SEED`) or a held-out file (``data.eval_path``; its first ``num_eval`` rows),
    measured by :func:`jetrl.evaluate.held_out_accuracy` in the run's recipe. ``require_checkpoint`` is
    :func:`jetrl.rl.loop.run`'s. ``progress`` shows bars over the evaluations and the steps; without it each step
    is a ``log`` line. ``log`` also announces each evaluation. The run's threads and kernel settings
    (:func:`jetrl.rl.loop.run_settings`) are in force throughout."""
    num_eval = data.num_eval
    with run_settings(config):  # the evaluations compute with the run's threads and kernels too
        before = None
        resumes = config.trainer.resume and has_checkpoint(Path(config.trainer.output_dir) / CHECKPOINT_SUBDIR)
        if num_eval and resumes:  # the run's own measurement before its first step, where it made the same one
            before = _recorded_before(Path(config.trainer.output_dir) / EVAL_FILE, config, num_eval)
        elif num_eval:  # a resume with nothing to resume from starts from the configured model
            log(f"greedy accuracy ({config.recipe} recipe) on {num_eval} held-out problems before training ...")
            before = held_out_accuracy(config.model.path, config, num_eval, progress=progress,
                                       tokenizer=data.tokenizer)
        with Progress(config.trainer.steps, "train", unit="step", enabled=progress) as bar:
            run(config, on_step=_step_reporter(config.trainer.steps, bar, log=None if progress else log),
                require_checkpoint=require_checkpoint, data=data)
        out = Path(config.trainer.output_dir)
        result = TrainJobResult(output_dir=out, plot=plot_runs([out], out / PLOT_FILE), summary=summarize_run(out),
                                recipe=config.recipe, num_eval=num_eval)
        if num_eval:
            final = latest_checkpoint(out / CHECKPOINT_SUBDIR)
            after = None
            if final is None:  # every save skipped (trainer.on_disk_full: skip) or damaged
                log(f"no complete checkpoint in {out / CHECKPOINT_SUBDIR}: no held-out accuracy after training")
            else:
                log(f"greedy accuracy ({config.recipe} recipe) on {num_eval} held-out problems after training ...")
                after = held_out_accuracy(str(final / "model"), config, num_eval, progress=progress)
            (out / EVAL_FILE).write_text(json.dumps({
                "seed": None if config.data.eval_path else EVAL_SEED, "file": config.data.eval_path,
                "num_examples": num_eval, "recipe": config.recipe, "greedy_accuracy_before": before,
                "greedy_accuracy_after": after, "checkpoint": str(final) if final is not None else None}))
            result.accuracy_before, result.accuracy_after, result.checkpoint = before, after, final
    return result


__all__ = ["TrainJobResult", "check_train_job", "train_and_evaluate", "PLOT_FILE", "EVAL_FILE"]
