"""The ``jetrl`` command line: argument parsing and printing over importable functions.

``jetrl`` alone runs ``jetrl train`` on the embedded default: RL of the packaged tiny model on its
arithmetic task, a few minutes on a CPU. Every command's work lives in a library function of the stage
that owns it (imported below), so scripts and tests call those; this module only turns arguments into their
inputs and their results into text. Choice lists of library settings (recipes, tasks, dataset formats,
dtypes) come from the registries that own them; the one choice of the CLI's own is ``--resume``'s
``auto``/``must`` (its spelling of :func:`jetrl.rl.loop.run`'s ``require_checkpoint``).

User errors (a missing file, a bad config key, an unknown dataset column, a tokenizer that lacks a
needed special token or belongs to another model, an output folder that holds another run) print one
``jetrl: error: ...`` line and exit with status 2; a run stopped by failing rewards
(:class:`~jetrl.data.reward_pool.RewardFailureError`) or a diverged SFT loss prints one line and exits with status
1. Set ``JETRL_DEBUG=1`` to see the traceback instead. Warnings (Python's ``warnings.warn`` anywhere in jetrl)
print as one ``jetrl: warning: ...`` line each; with ``JETRL_DEBUG=1`` in Python's own format.

``jetrl train --resume`` continues from the newest complete checkpoint in the output folder; with none
there it warns and starts from step 0, while ``--resume=must`` makes that an error. A fresh run into a
folder holding another run's checkpoints is refused; ``--overwrite`` deletes that run's outputs first.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import math
import os
import sys
import warnings
from pathlib import Path
from typing import Sequence

from jetrl.asset_files import DEFAULT_CONFIG, EMBEDDED_MODEL, config_path, existing_path, model_path, resolve_asset
from jetrl.bench_scripts import available_benches, run_bench
from jetrl.config import DTYPES, DataConfig, RunConfig, load_config
from jetrl.config.reference import commented_yaml
from jetrl.config.schema import is_device
from jetrl.data import (
    DATASET_FORMATS, TASKS, RewardConfig, build_prompt_dataset, build_reward_fn, read_prompts,
)
from jetrl.data.sources import check_output_path
from jetrl.data.tasks import STYLES
from jetrl.data.reward_pool import RewardFailureError
from jetrl.rollout.sampling import MIN_TEMPERATURE
from jetrl.evaluate import EVAL_REWARD_WORKERS, EVAL_SEED, evaluate, generate_texts, load_policy, write_samples
from jetrl.models import export_model, resolve_device
from jetrl.parallel import launched_rank
from jetrl.plotting import default_plot_path, plot_runs, png_path
from jetrl.quant.recipe import RECIPES, kv_fp8_train
from jetrl.quant.selfcheck import check_fp8_linear
from jetrl.registries import check_config, configuration_reference
from jetrl.rl.loop import prepare_output_dir, run
from jetrl.sft.train import SFT_DTYPES, SFT_RECIPE, SFTConfig, SFTDiverged, model_task, run_sft
from jetrl.tables import text_table
from jetrl.threads import configure_threads
from jetrl.train_job import check_train_job, train_and_evaluate

USAGE_ERROR = 2
RUN_FAILED = 1
THREADS_HELP = ("torch's CPU threads (default: OMP_NUM_THREADS when set, else half the cores, fewer beside the "
                "reward workers)")
RESUME_MODES = ("auto", "must")  # jetrl train --resume[=MODE]; "must": run(..., require_checkpoint=True)


class UsageError(ValueError):
    """A problem with what the user asked for; reported as one line, exit status 2."""


# ------------------------------------------------------------------------------------------ helpers

def _version() -> str:
    """The installed distribution's version (``jetrl --version``)."""
    try:
        return importlib.metadata.version("jetrl")
    except importlib.metadata.PackageNotFoundError:  # a source tree on PYTHONPATH that was never installed
        return "unknown (not installed)"


def _checked(parse, rule: str, ok):
    """argparse type: ``parse(text)``, which must satisfy ``ok`` (``rule`` says how)."""
    def check(text: str):
        try:
            value = parse(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {'a whole number' if parse is int else 'a number'}, got "
                                             f"{text!r}") from None
        if not ok(value):
            raise argparse.ArgumentTypeError(f"must be {rule}, got {value!r}")
        return value
    return check


_positive, _non_negative = _checked(int, ">= 1", lambda v: v >= 1), _checked(int, ">= 0", lambda v: v >= 0)
_device = _checked(str, "'auto', 'cpu', 'cuda' or 'cuda:N'", is_device)


# ------------------------------------------------------------------------------------------ train

def _overrides(items: Sequence[str]) -> list[str]:
    """The ``--section.key=value`` arguments after a config file; anything else is a UsageError, which shows the
    form for Hydra's ``section.key=value`` (verl) and argparse's ``--section.key value``."""
    for item in items:
        if not item.startswith("--") or "=" not in item:
            hint = (f"write --{item}" if "=" in item and not item.startswith("-") else
                    f"write {item}=VALUE" if item.startswith("--") else "e.g. --optim.lr=1e-5")
            raise UsageError(f"unexpected argument {item!r}: overrides look like --section.key=value; {hint}")
    return list(items)


def _config_source(args: argparse.Namespace) -> tuple[str, list[str]]:
    """The config file (checked; default: the embedded one) and the overrides; an override in the file's place
    (``jetrl train optim.lr=1e-5``) is reported as one."""
    overrides = _overrides(args.overrides)
    if args.config and "=" in args.config and not os.path.exists(args.config):
        _overrides([args.config])
    return config_path(args.config), overrides


def _train_config(args: argparse.Namespace) -> RunConfig:
    """The run config: the file (default: the embedded one) <- overrides <- --max-steps, --output-dir, --recipe,
    --resume, --threads."""
    path, overrides = _config_source(args)
    options = (("trainer.steps", args.max_steps), ("trainer.output_dir", args.output_dir), ("recipe", args.recipe),
               ("trainer.resume", "true" if args.resume else None), ("trainer.num_threads", args.threads))
    overrides += [f"--{key}={value}" for key, value in options if value is not None]
    config = load_config(path, overrides)
    config.model.path = resolve_asset(config.model.path) if config.model.path else config.model.path
    if config.model.tokenizer:
        config.model.tokenizer = resolve_asset(config.model.tokenizer)
    if config.data.path:
        config.data.path = existing_path(config.data.path, "data file", "set data.path to a JSONL or Parquet file")
    return config


def _cmd_train(args: argparse.Namespace) -> None:
    config = _train_config(args)
    data = check_train_job(config, args.eval_examples)  # before the evaluation that precedes training
    # under torchrun every rank runs this command; rank 0 alone prepares the folder, evaluates and reports
    if launched_rank() != 0:
        run(config, require_checkpoint=args.resume == "must", data=data)
        return
    prepare_output_dir(config, overwrite=args.overwrite)  # last: --overwrite deletes the old run
    print(f"jetrl train: {config.recipe} recipe, model {config.model.path}, "
          f"{config.data.task or config.data.path}, {config.trainer.steps} steps -> {config.trainer.output_dir}",
          file=sys.stderr)
    result = train_and_evaluate(config, data, require_checkpoint=args.resume == "must",
                                progress=not args.no_progress, log=lambda m: print(m, file=sys.stderr))
    print(text_table(result.rows(), title="jetrl train: summary"))


# ------------------------------------------------------------------------------------------ config

def _cmd_config_show(args: argparse.Namespace) -> None:
    path, overrides = _config_source(args)
    config = load_config(path, overrides)
    source = " ".join([args.config or DEFAULT_CONFIG, *overrides])
    print(commented_yaml(config, title=f"jetrl config show {source}\nthe resolved configuration: every field, "
                                       f"with its meaning (docs/configuration.md)"), end="")


def _cmd_config_check(args: argparse.Namespace) -> None:
    config = load_config(*_config_source(args))
    check_config(config)
    steps = config.rollout_batch_size // config.mini_batch_size * config.algorithm.ppo_epochs
    print(f"{args.config}: valid ({config.recipe} recipe, {config.data.prompts_per_step} prompts x "
          f"{config.rollout.n} samples = {config.rollout_batch_size} sequences per RL step, {steps} optimizer "
          f"step{'s' if steps > 1 else ''} each)")


def _cmd_config_reference(args: argparse.Namespace) -> None:
    print(configuration_reference(), end="")


# ------------------------------------------------------------------------------------------ sft

def _cmd_sft(args: argparse.Namespace) -> None:
    args.output_dir = check_output_path(args.output_dir, "--output-dir", folder=True)
    configure_threads(args.threads, EVAL_REWARD_WORKERS)
    config = SFTConfig(output_dir=args.output_dir, task=args.task, difficulty=args.difficulty, steps=args.steps,
                       batch_size=args.batch_size, lr=args.lr, seed=args.seed, eval_examples=args.eval_examples,
                       eval_every=args.eval_every, save_dtype=args.save_dtype, checkpoint_every=args.checkpoint_every,
                       keep_checkpoints=args.keep_checkpoints, device=str(resolve_device(args.device)),
                       dtype=args.dtype, packing=args.packing, micro_batch_tokens=args.micro_batch_tokens)
    result = run_sft(config, progress=not args.no_progress, log=lambda m: print(m, file=sys.stderr),
                     resume=args.resume)
    print(text_table([("task", f"{config.task} (difficulty {config.difficulty})"), ("steps", str(result.steps)),
                  ("parameters", f"{result.num_parameters:,}"), ("final loss (EMA)", f"{result.final_loss:.4f}"),
                  (f"greedy accuracy ({SFT_RECIPE}, {config.eval_examples} unseen)", f"{result.accuracy:.3f}"),
                  ("time", f"{result.seconds:.0f} s"), ("checkpoint", result.output_dir)], title="jetrl sft: summary"))


# ------------------------------------------------------------------------------------------ eval

_TASK_OPTIONS, _FILE_OPTIONS = ("task", "difficulty", "task_style"), ("format", "prompt_column", "answer_column")


def _eval_data(args: argparse.Namespace) -> DataConfig:
    """The prompts to evaluate on, as a data section: a file (``--data``) or a built-in task; an option of the other
    kind is an error (it would be ignored)."""
    other = [f"--{o.replace('_', '-')}" for o in (_TASK_OPTIONS if args.data else _FILE_OPTIONS)
             if vars(args)[o] is not None]
    if other:
        raise UsageError(f"{', '.join(other)} " + ("choose a built-in task, not --data's file" if args.data else
                                                   "describe a --data file (none given)"))
    if args.data:
        path = existing_path(args.data, "data file", "give a JSONL or Parquet file")
        return DataConfig(path=path, format=args.format or "custom", prompt_column=args.prompt_column,
                          answer_column=args.answer_column, reward=args.reward, max_examples=args.num_examples)
    return DataConfig(task=args.task or "arithmetic", difficulty=3 if args.difficulty is None else args.difficulty,
                      task_style=args.task_style or "compact", num_examples=args.num_examples or 200)


def _check_greedy_n(args: argparse.Namespace) -> None:
    if args.temperature == 0 and args.n > 1:
        raise UsageError("greedy decoding (--temperature 0) gives one completion per prompt; set --temperature > 0 "
                         "for --n > 1")


def _cmd_eval(args: argparse.Namespace) -> None:
    configure_threads(args.threads, EVAL_REWARD_WORKERS)
    kv_fp8_train(args.recipe, args.kv_fp8)  # a recipe that rolls out in BF16 has no FP8 cache: say so first
    _check_greedy_n(args)
    if args.k and max(args.k) > args.n:
        raise UsageError(f"pass@{max(args.k)} needs --n >= {max(args.k)} samples per prompt (now {args.n})")
    if args.output:
        args.output = check_output_path(args.output, "--output")
    dataset = build_prompt_dataset(_eval_data(args), seed=args.seed)  # data errors before the model is loaded
    build_reward_fn(RewardConfig(name=args.reward), default=dataset.reward)
    model, tokenizer = load_policy(model_path(args.model), args.recipe, args.device, args.dtype, args.max_tokens)
    result = evaluate(model, tokenizer, dataset, reward=args.reward, n=args.n, temperature=args.temperature,
                      top_p=args.top_p, max_tokens=args.max_tokens, ks=args.k or (), seed=args.sample_seed,
                      progress=not args.no_progress, keep_samples=bool(args.output), kv_fp8=args.kv_fp8)
    mode = "greedy" if args.temperature == 0 else f"sampled, T={args.temperature}"
    print(text_table(result.rows(), title=f"jetrl eval: {args.model} on {dataset.name} ({mode}, {args.recipe} recipe)"))
    if args.output:
        write_samples(result.samples, args.output)
        print(f"samples written to {args.output}", file=sys.stderr)


# ------------------------------------------------------------------------------------------ generate

def _cmd_generate(args: argparse.Namespace) -> None:
    configure_threads(args.threads)
    prompts = read_prompts(args.prompts, resolve_asset(args.file) if args.file else None)
    _check_greedy_n(args)
    folder = model_path(args.model)
    model, tokenizer = load_policy(folder, args.recipe, args.device, args.dtype, args.max_tokens)
    mode = "greedy" if args.temperature == 0 else f"sampled, T={args.temperature}"
    header = sys.stderr if args.jsonl else sys.stdout  # JSON lines alone on stdout
    print(f"jetrl generate: {args.model} ({mode}, {args.recipe} recipe)", file=header)
    task = model_task(folder)
    if task is not None:  # what this model answers, so that a prompt in another form is not a surprise
        print(f"model: {task.describe()}; e.g. {task.example!r}", file=header)
    results = generate_texts(model, tokenizer, prompts, n=args.n, temperature=args.temperature, top_p=args.top_p,
                             max_tokens=args.max_tokens, seed=args.seed, raw=args.raw)
    for prompt, completions in zip(prompts, results):
        if args.jsonl:
            print(json.dumps({"prompt": prompt, "completions": completions}))
            continue
        print(f"=== {prompt.rstrip()}")
        for c in completions:
            print(c.rstrip("\n"))
            if len(completions) > 1:
                print("---")


# ------------------------------------------------------------------------------------------ plot, export

def _cmd_plot(args: argparse.Namespace) -> None:
    output = png_path(check_output_path(args.output, "--output") if args.output else default_plot_path(args.runs))
    existed = output.is_file()  # for one run, by default: the plot jetrl train wrote
    path = plot_runs(args.runs, output, labels=args.labels, smooth=args.smooth)
    print(path)
    if existed:
        print(f"jetrl plot: replaced the existing {path} (-o PATH writes elsewhere)", file=sys.stderr)


def _cmd_export(args: argparse.Namespace) -> None:
    out = export_model(resolve_asset(args.model), args.output, fp8=args.fp8, overwrite=args.overwrite)
    size = sum(f.stat().st_size for f in Path(out).iterdir() if f.is_file())
    print(f"exported {'block-FP8' if args.fp8 else 'BF16'} checkpoint to {out} ({size / 2 ** 20:.1f} MiB)")


# ------------------------------------------------------------------------------------------ bench

def _cmd_bench(args: argparse.Namespace) -> int | None:
    if args.name in (None, "list"):
        print("benchmarks: " + ", ".join(available_benches()))
        print("run one with: jetrl bench NAME [its arguments]   (fp8 = jetrl check-fp8)")
        return None
    if args.name == "fp8":
        return main(["check-fp8", *args.bench_args])
    if args.name not in available_benches():  # a name, never a path: only the shipped scripts run
        raise UsageError(f"unknown benchmark {args.name!r}; available: {', '.join(available_benches())} "
                         f"(bench scripts live in the source checkout's bench/ folder)")
    run_bench(args.name, args.bench_args)


def _cmd_check_fp8(args: argparse.Namespace) -> None:
    result = check_fp8_linear(args.m, args.n, args.k, device=str(resolve_device(args.device)))
    width = max(len(name) for name, _ in result.rows())
    print("FP8Linear (jet: FP8 Fprop/DGrad/WGrad) vs BF16 nn.Linear, random data")
    for name, value in result.rows():
        print(f"  {name:<{width}}  {value}")


# ------------------------------------------------------------------------------------------ parser

def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=EMBEDDED_MODEL, help=f"checkpoint folder or .gguf file (default: "
                   f"{EMBEDDED_MODEL})")
    p.add_argument("--recipe", default="bf16", choices=list(RECIPES), help="precision recipe of the rollout "
                   "(default bf16)")
    p.add_argument("--device", type=_device, default="auto", help="cpu, cuda or auto")
    p.add_argument("--dtype", default="float32", choices=DTYPES, help="weight dtype")
    p.add_argument("--threads", type=_positive, default=None, help=THREADS_HELP)
    p.add_argument("--max-tokens", type=_positive, default=128, help="new tokens per completion")
    p.add_argument("--temperature", type=_checked(float, f"0 (greedy) or >= {MIN_TEMPERATURE}",
                                                  lambda t: t == 0 or MIN_TEMPERATURE <= t < math.inf),
                   default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=_checked(float, "in (0, 1]", lambda p: 0 < p <= 1), default=1.0)
    p.add_argument("--n", type=_positive, default=1, help="samples per prompt")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="jetrl", description="RL of LLMs with a unified FP8 precision flow. With no command: jetrl train "
        "(RL of the embedded tiny model on its arithmetic task, a few minutes on CPU).")
    parser.add_argument("--version", action="version", version=f"jetrl {_version()}")
    parser.set_defaults(takes_overrides=False)  # whether --section.key=value arguments may follow
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    p = sub.add_parser("train", help="RL run from a config file (default: the embedded tiny model)",
                       description="RL run: a config file plus --section.key=value overrides. Without a config, "
                       "the embedded default (" + DEFAULT_CONFIG + ").")
    p.add_argument("config", nargs="?", default=None, help="YAML/JSON/TOML config (default: the embedded one)")
    p.add_argument("--max-steps", type=_positive, default=None, help="run at most N RL steps (sets trainer.steps)")
    p.add_argument("--output-dir", default=None, help="where metrics, checkpoints and plots go")
    p.add_argument("--recipe", default=None, choices=list(RECIPES), help="precision recipe")
    p.add_argument("--resume", nargs="?", const="auto", default=None, choices=list(RESUME_MODES),
                   help="continue from the latest complete checkpoint in the output dir (none there: a warning and "
                   "a fresh start; --resume=must: an error)")
    p.add_argument("--overwrite", action="store_true", help="delete the output dir's previous run (checkpoints, "
                   "metrics, plot) before starting")
    p.add_argument("--eval-examples", type=_non_negative, default=None, help="greedy accuracy on N held-out problems "
                   "before and after the run (a built-in task, or data.eval_path's first N rows; default 200, 0 = off)")
    p.add_argument("--threads", type=_positive, default=None, help=THREADS_HELP)
    p.add_argument("--no-progress", action="store_true", help="a log line per step instead of a progress bar")
    p.set_defaults(func=_cmd_train, overrides=[], takes_overrides=True)

    p = sub.add_parser("config", help="print the resolved configuration, validate one, or print the reference",
                       description="Run configurations: the file plus --section.key=value overrides, as jetrl train "
                       "reads them. Every field is listed in docs/configuration.md.")
    actions = p.add_subparsers(dest="config_command", metavar="ACTION", required=True)
    show = actions.add_parser("show", help="the resolved configuration as commented YAML (a valid config file)",
                              usage="jetrl config show [CONFIG] [--section.key=value ...]")
    show.add_argument("config", nargs="?", default=None, help="YAML/JSON/TOML config (default: the embedded one)")
    show.set_defaults(func=_cmd_config_show, overrides=[], takes_overrides=True)
    check = actions.add_parser("check", help="validate a config and its overrides without loading a model",
                               usage="jetrl config check CONFIG [--section.key=value ...]")
    check.add_argument("config", help="YAML/JSON/TOML config")
    check.set_defaults(func=_cmd_config_check, overrides=[], takes_overrides=True)
    reference = actions.add_parser("reference", help="the configuration reference in Markdown "
                                   "(docs/configuration.md)")
    reference.set_defaults(func=_cmd_config_reference)

    p = sub.add_parser("sft", help="supervised warm-start of a tiny model on a built-in task (makes the embedded one)")
    p.add_argument("--output-dir", default="tiny-arith", help="checkpoint folder to write")
    p.add_argument("--task", default="arithmetic", choices=sorted(TASKS), help="built-in task")
    p.add_argument("--difficulty", type=int, default=3, help="reasoning steps per problem")
    p.add_argument("--steps", type=int, default=600, help="optimizer steps (the early-stopping budget)")
    p.add_argument("--batch-size", type=int, default=64, help="sequences per step")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0, help="weight-init seed")
    p.add_argument("--eval-examples", type=int, default=200, help="unseen problems for the final greedy accuracy")
    p.add_argument("--eval-every", type=_non_negative, default=0, help="also evaluate every N steps (to tune --steps)")
    p.add_argument("--save-dtype", default="float32",
                   help=f"dtype of the saved weights ({' or '.join(SFT_DTYPES)})")
    p.add_argument("--device", type=_device, default="cpu", help="cpu, cuda, cuda:N or auto")
    p.add_argument("--dtype", default="float32", choices=list(SFT_DTYPES),
                   help="training parameters (bfloat16 keeps fp32 master weights)")
    p.add_argument("--packing", action=argparse.BooleanOptionalAction, default=None,
                   help="packed forwards instead of padded batches (default: packed on CUDA only)")
    p.add_argument("--micro-batch-tokens", type=int, default=65536, help="with packing: tokens per forward")
    p.add_argument("--checkpoint-every", type=int, default=100, help="a resumable checkpoint every N steps (0: none)")
    p.add_argument("--keep-checkpoints", action="store_true", help="keep OUTPUT_DIR/checkpoints after the final model")
    p.add_argument("--resume", action="store_true", help="continue an interrupted run from its newest checkpoint "
                   "(none there: a warning and a fresh start)")
    p.add_argument("--threads", type=_positive, default=None, help=THREADS_HELP)
    p.add_argument("--no-progress", action="store_true")
    p.set_defaults(func=_cmd_sft)

    p = sub.add_parser("eval", help="accuracy of a checkpoint on a task or dataset (greedy or sampled, pass@k)")
    _add_model_args(p)
    p.add_argument("--task", choices=sorted(TASKS), help="built-in task (when no --data; default arithmetic)")
    p.add_argument("--difficulty", type=int, help="the task's difficulty (default 3)")
    p.add_argument("--task-style", choices=STYLES, help="compact (the embedded model's; default) or natural (an "
                   "English instruction, for pretrained models)")
    p.add_argument("--seed", type=int, default=EVAL_SEED, help="task seed of the evaluation problems")
    p.add_argument("--num-examples", type=_positive, default=None, help="problems (task default 200; file: all rows)")
    p.add_argument("--data", default=None, help="JSONL/Parquet prompt file instead of a task")
    p.add_argument("--format", choices=sorted(DATASET_FORMATS), help="layout of the --data file (default custom)")
    p.add_argument("--prompt-column", default=None)
    p.add_argument("--answer-column", default=None)
    p.add_argument("--reward", default=None, help="reward name or package.module:function (default: the data's)")
    p.add_argument("--k", type=_positive, action="append", help="report pass@k (repeatable; needs --n >= k)")
    p.add_argument("--sample-seed", type=int, default=0)
    p.add_argument("--output", default=None, help="write every sample to this JSONL file")
    p.add_argument("--kv-fp8", action="store_true",
                   help="FP8 KV cache in the rollout engine (a recipe that rolls out in FP8: jet, fp8-rollout)")
    p.set_defaults(func=_cmd_eval)

    embedded = model_task(resolve_asset(EMBEDDED_MODEL))
    p = sub.add_parser("generate", help="completions of prompts given as arguments or in a file",
                       description="Completions of prompts given as arguments or in a file." + (
                           f" The embedded model ({EMBEDDED_MODEL}) was {embedded.describe()}. Try: jetrl generate "
                           f"'{embedded.example}'" if embedded else ""))
    _add_model_args(p)
    p.add_argument("prompts", nargs="*", help="prompt texts")
    p.add_argument("--file", default=None, help="one prompt per line (or JSONL with 'prompt')")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--raw", action="store_true", help="send the text exactly (no template, no trailing newline)")
    p.add_argument("--jsonl", action="store_true", help="print one JSON object per prompt")
    p.set_defaults(func=_cmd_generate)

    p = sub.add_parser("bench", help="run a benchmark script (jetrl bench list)")
    p.add_argument("name", nargs="?", default=None, help="benchmark name, or 'list'")
    p.add_argument("bench_args", nargs=argparse.REMAINDER, help="arguments passed to the benchmark")
    p.set_defaults(func=_cmd_bench)

    p = sub.add_parser("plot", help="reward/accuracy/length/mismatch curves of runs to a PNG")
    p.add_argument("runs", nargs="+", help="run folders (holding metrics.jsonl)")
    p.add_argument("--output", "-o", default=None, help="PNG path (default for one run: RUN/curves.png, replacing "
                   "the plot jetrl train wrote; for several: curves_A_vs_B.png beside the first)")
    p.add_argument("--labels", nargs="+", default=None, help="one label per run")
    p.add_argument("--smooth", type=int, default=None, help="moving-average window in steps")
    p.set_defaults(func=_cmd_plot)

    p = sub.add_parser("export", help="write a checkpoint (or a .gguf file) as HuggingFace BF16 or block-FP8")
    p.add_argument("model", help=f"checkpoint folder, .gguf file (or {EMBEDDED_MODEL})")
    p.add_argument("output", help="folder to write")
    p.add_argument("--fp8", action="store_true", help="block-FP8 weights (128x128 scales), as vLLM/SGLang serve")
    p.add_argument("--overwrite", action="store_true", help="write into a non-empty output folder")
    p.set_defaults(func=_cmd_export)

    check = sub.add_parser("check-fp8", help="FP8Linear vs BF16 on random data: error, and speed on a GPU")
    check.add_argument("--m", type=_positive, default=512, help="tokens")
    check.add_argument("--n", type=_positive, default=768, help="out features")
    check.add_argument("--k", type=_positive, default=1024, help="in features")
    check.add_argument("--device", type=_device, default=None, help="cpu or cuda (default: cuda when present)")
    check.set_defaults(func=_cmd_check_fp8)
    return parser


def _show_warning(message, category, filename, lineno, file=None, line=None) -> None:
    """``warnings.showwarning`` while a command runs, unless ``JETRL_DEBUG=1`` (see the module doc)."""
    print(f"jetrl: warning: {' '.join(str(message).split())}", file=sys.stderr if file is None else file)


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``jetrl`` console script; returns the exit status."""
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or (argv[0].startswith("--") and argv[0] not in ("--help", "--version")):
        argv = ["train", *argv]  # the main job, on its embedded default unless a config is given
    args, extra = parser.parse_known_args(argv)
    if extra:
        if not args.takes_overrides:
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
        args.overrides = extra
    try:
        with warnings.catch_warnings():  # restores Python's warning printer when the command returns
            if not os.environ.get("JETRL_DEBUG"):
                warnings.showwarning = _show_warning
            return int(args.func(args) or 0)  # a command returns nothing, or the status of the one it runs
    except KeyboardInterrupt:
        print("jetrl: interrupted", file=sys.stderr)
        return 130
    except (RewardFailureError, SFTDiverged, OSError, ValueError, TypeError, ImportError) as e:
        if os.environ.get("JETRL_DEBUG"):
            raise
        message = str(e).splitlines()[0] if str(e) else type(e).__name__
        if isinstance(e, OSError) and e.filename:  # raised by the OS: "[Errno 20] Not a directory: 'x'"
            message = f"{e.filename}: {e.strerror or message}"
        print(f"jetrl: error: {message}", file=sys.stderr)
        return RUN_FAILED if isinstance(e, (RewardFailureError, SFTDiverged)) else USAGE_ERROR


if __name__ == "__main__":
    sys.exit(main())
