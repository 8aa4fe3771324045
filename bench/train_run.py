"""``jetrl train`` as a user runs it, once per recipe: median step and phase times, their ratios to ``bf16``, peak memory.

What a user does: a HuggingFace checkpoint of a Qwen2.5 model, the shipped ``examples/gsm8k_qwen2.5_jet.yaml``
with GSM8K prompts, a reward plugged in as ``data.reward=module:function``, and ``jetrl train --recipe R``. This
script does the same through the same code (:func:`jetrl.rl.loop.run`, what ``jetrl train`` calls), so every
phase runs on the real data path: prompts of every length, responses of every length, micro-batches packed by
token count (so token counts are never multiples of 128), the reward pool, the metrics.

* **The checkpoint**: a Qwen2.5 shape (``--shape``: ``qwen2.5-0.5b``, ``-1.5b``, ``-3b``, ``-7b``; ``--layers`` for
  fewer blocks where memory or disk requires), random weights, written in HuggingFace format with a byte-level BPE
  tokenizer trained here on the prompts (no download).
* **The prompts**: GSM8K's train split (``--data``, default the shared copy when present), else generated
  GSM8K-like rows of realistic lengths.
* **The responses**: random weights never pick the end-of-text token, so every sample would run to
  ``rollout.max_tokens``. The run instead stops a sample at any of ``vocab / --mean-response`` token ids
  (``rollout.stop_token_ids``): near-uniform sampling then ends a response after about ``--mean-response``
  tokens, geometrically distributed and capped at ``max_tokens``, as real responses vary. The measured lengths
  are in the report. ``--setting`` picks the regime (:data:`SETTINGS`): ``gsm8k`` (that, the default),
  ``to-max`` (no stops: every response runs to 1,024 tokens, as a fresh policy's often do) and ``long`` (8 prompts
  x 8, every response 4,096 tokens: where the FP8 KV cache pays).
* **The reward**: :func:`coin_reward`, a fixed pseudo-random 0/1 of the completion text, so advantages are not
  all zero (random weights score nothing on GSM8K).

Each recipe runs ``--steps`` RL steps; the report gives medians over steps 2 and later (step 1 compiles kernels
and captures CUDA graphs). The run stops before its final checkpoint (a 1.5B model's is 21 GB). JSON to
``$OUT/train_run.json`` when ``OUT`` is set and to ``--json``. GPU::

    PYTHONPATH=$PWD python bench/train_run.py --shape qwen2.5-1.5b

CPU smoke run (the tests): ``--tiny``.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import random
import statistics
import sys
import tempfile
import time
import zlib
from pathlib import Path
from typing import Any

import torch

try:  # repository root on sys.path (python -m bench.train_run, the tests)
    from bench.common import device_description, reset_peak_memory, write_report
except ModuleNotFoundError:  # python bench/train_run.py: bench/ itself is on sys.path
    from common import device_description, reset_peak_memory, write_report

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples" / "gsm8k_qwen2.5_jet.yaml"
SHARED_GSM8K = REPO.parent / "shared" / "data" / "gsm8k" / "train.jsonl"

_QWEN25 = dict(model_type="qwen2", rms_norm_eps=1e-6, max_position_embeddings=32768, rope_theta=1000000.0,
               bos_token_id=151643, eos_token_id=151645)
# Qwen2.5 as published (the instruct models' config.json fields that shape the compute)
SHAPES: dict[str, dict] = {
    "qwen2.5-0.5b": dict(_QWEN25, vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                         num_attention_heads=14, num_key_value_heads=2, tie_word_embeddings=True),
    "qwen2.5-1.5b": dict(_QWEN25, vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                         num_attention_heads=12, num_key_value_heads=2, tie_word_embeddings=True),
    "qwen2.5-3b": dict(_QWEN25, vocab_size=151936, hidden_size=2048, intermediate_size=11008, num_hidden_layers=36,
                       num_attention_heads=16, num_key_value_heads=2, tie_word_embeddings=True),
    "qwen2.5-7b": dict(_QWEN25, vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                       num_attention_heads=28, num_key_value_heads=4, tie_word_embeddings=False),
    # CPU smoke size: the same family, head_dim 64, widths multiples of the 128-wide FP8 blocks
    "tiny": dict(_QWEN25, vocab_size=4096, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True, bos_token_id=0,
                 eos_token_id=0, max_position_embeddings=4096),
}
RECIPES = {"bf16": ("bf16", False), "fp8-rollout": ("fp8-rollout", False), "jet": ("jet", False),
           "jet+kv8": ("jet", True)}  # name: (recipe, FP8 KV cache)
PHASES = ("rollout", "reward", "old_logprob", "reference", "update", "weight_refresh")
EOS = "<|endoftext|>"


def coin_reward(completion_text: str, reference_answer: str) -> float:
    """A fixed pseudo-random 0/1 of the completion (the same text always scores the same)."""
    return float(zlib.crc32(completion_text.encode("utf-8", "replace")) & 1)


# ------------------------------------------------------------------------------------------------ the inputs

def gsm8k_rows(path: Path | None, count: int, seed: int) -> list[dict[str, str]]:
    """GSM8K rows (question, answer): the file's when it exists, else generated ones of GSM8K's lengths (questions
    of 20-90 words, answers ending in ``#### N``)."""
    if path is not None and path.is_file():
        with open(path) as f:
            rows = [json.loads(line) for line in f if line.strip()]
        return rows[:count] if count else rows
    rng = random.Random(seed)
    words = ("apples", "Tom", "buys", "each", "costs", "dollars", "how", "many", "more", "than", "twice", "the",
             "store", "sells", "week", "she", "has", "left", "after", "giving", "friends", "total", "of", "and")
    rows = []
    for _ in range(count or 2000):
        question = " ".join(rng.choice(words) if rng.random() > 0.15 else str(rng.randint(2, 500))
                            for _ in range(rng.randint(20, 90))) + "?"
        answer = f"{rng.randint(2, 90)} + {rng.randint(2, 90)} = {rng.randint(4, 180)}\n#### {rng.randint(1, 999)}"
        rows.append({"question": question, "answer": answer})
    return rows


def train_tokenizer(texts: list[str], vocab_size: int, folder: Path):
    """A byte-level BPE (GPT-2 / Qwen style) trained on ``texts``, saved into ``folder`` with ``EOS`` as its
    end-of-text token."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, pad_token=EOS,
                                   clean_up_tokenization_spaces=False, model_max_length=32768)
    fast.save_pretrained(os.fspath(folder))
    return fast


def make_checkpoint(shape: dict, folder: Path, texts: list[str], tokenizer_vocab: int, device: torch.device):
    """A HuggingFace folder: random weights of ``shape`` (BF16) and a tokenizer trained on ``texts``, whose
    end-of-text id becomes the model's ``eos_token_id``. Returns the tokenizer."""
    from jetrl.models import build_model, save_model

    folder.mkdir(parents=True, exist_ok=True)
    tokenizer = train_tokenizer(texts, min(tokenizer_vocab, shape["vocab_size"]), folder)
    eos = tokenizer.convert_tokens_to_ids(EOS)
    shape = dict(shape, eos_token_id=eos, bos_token_id=eos)
    model = build_model(shape, dtype=torch.bfloat16, device=device, recipe="bf16", seed=0)
    save_model(model, folder)
    del model
    return tokenizer


def stop_ids(vocab_size: int, mean_response: int, avoid: set[int], seed: int) -> list[int]:
    """``vocab_size / mean_response`` token ids (none of ``avoid``): under near-uniform sampling a response stops
    at one of them after about ``mean_response`` tokens. ``mean_response`` 0: none (every response runs to
    ``rollout.max_tokens``)."""
    if mean_response == 0:
        return []
    count = max(1, round(vocab_size / max(1, mean_response)))
    pool = [i for i in range(vocab_size) if i not in avoid]
    return sorted(random.Random(seed).sample(pool, min(count, len(pool))))


# ------------------------------------------------------------------------------------------------ one recipe

class _Enough(Exception):
    """Raised from the step callback after the last timed step: the run ends before its final checkpoint."""


def run_recipe(recipe: str, base: Any, steps: int, out_root: Path) -> dict[str, Any]:
    """``jetrl train`` (:func:`jetrl.rl.loop.run`) of ``base`` in ``recipe`` for ``steps`` steps; every step's
    metrics, the peak memory and the wall time."""
    from jetrl.rl.loop import run

    config = dataclasses.replace(base, recipe=RECIPES[recipe][0], kv_fp8=RECIPES[recipe][1],
                                 trainer=dataclasses.replace(base.trainer, output_dir=os.fspath(out_root / recipe),
                                                             steps=steps + 1))
    device = torch.device(config.model.device)
    reset_peak_memory(device)
    steps_seen: list[dict[str, float]] = []

    def on_step(step: int, metrics: dict[str, float]) -> None:
        steps_seen.append(dict(metrics))
        print(f"  {recipe} step {step}: {metrics['time/step_wall']:.2f} s (rollout {metrics['time/rollout']:.2f}, "
              f"update {metrics['time/update']:.2f}; response length {metrics['response/length_mean']:.0f})",
              flush=True)
        if step >= steps:
            raise _Enough

    start = time.perf_counter()
    try:
        run(config, on_step=on_step)
    except _Enough:
        pass
    wall = time.perf_counter() - start
    # the trainer resets the device's peak counter per phase (memory/*): the run's peak is the largest of those
    peak = max((m.get("memory/peak_gib", 0.0) for m in steps_seen), default=None) if device.type == "cuda" else None
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return {"recipe": recipe, "steps": steps_seen, "peak_gib": peak, "wall_s": wall}


def steady_steps(steps: list[dict[str, float]], skip: int = 1) -> list[dict[str, float]]:
    """The steps after the first ``skip`` that captured no CUDA graph (the update's, the old-logprob pass's or the
    rollout's decode step): what a long run's steps look like once every micro-batch shape has its graph."""
    out, captured = [], 0.0
    for i, m in enumerate(steps):
        total = m.get("update/graph_captures", 0.0)
        if i >= skip and total == captured and not m.get("time/rollout_graph_capture", 0.0):
            out.append(m)
        captured = total
    return out


def summarize(result: dict[str, Any], skip: int = 1, steady: bool = False) -> dict[str, float]:
    """Medians over the steps after the first ``skip`` (all of them when there are no more); ``steady``: over
    :func:`steady_steps` only (empty when there are none)."""
    timed = steady_steps(result["steps"], skip) if steady else (result["steps"][skip:] or result["steps"])
    if not timed:
        return {}
    keys = ["time/step_wall", "time/step"] + [f"time/{p}" for p in PHASES]
    keys += [k for k in timed[-1] if k.startswith("memory/")]
    keys += ["response/length_mean", "response/length_max", "response/truncation_rate", "response/num_tokens",
             "mismatch/logp_abs_diff_mean"]
    out = {}
    for key in keys:
        values = [m[key] for m in timed if key in m]
        if values:
            out[key] = statistics.median(values)
    # response tokens per second of the step and of each phase: the recipes sample different lengths, so their
    # steps hold different token counts; these rates compare them per token
    for key in ["time/step_wall"] + [f"time/{p}" for p in PHASES]:
        rates = [m["response/num_tokens"] / m[key] for m in timed
                 if m.get(key, 0) > 0 and "response/num_tokens" in m]
        if rates:
            out["tokens_per_s/" + key.removeprefix("time/")] = statistics.median(rates)
    return out


# ------------------------------------------------------------------------------------------------ the run

# --setting: (what it is, prompts per step, rollout.max_tokens, mean response aimed at; 0: all run to max_tokens)
SETTINGS = {
    "gsm8k": ("responses of every length, about 300 tokens on average, capped at 1,024", 32, 1024, 300),
    "to-max": ("every response runs to 1,024 tokens, as a fresh policy's often do", 32, 1024, 0),
    "long": ("8 prompts x 8, every response runs to 4,096 tokens", 8, 4096, 0),
}

def build_base_config(args, folder: Path, data: Path, vocab_size: int, avoid: set[int]):
    from jetrl.config import load_config

    overrides = [f"--model.path={folder}", f"--model.device={args.device}", f"--data.path={data}",
                 f"--data.prompts_per_step={args.prompts}", f"--rollout.n={args.n}",
                 f"--rollout.max_tokens={args.max_tokens}", f"--algorithm.mini_batch_size={args.mini_batch}",
                 f"--algorithm.max_tokens_per_micro_batch={args.micro_tokens}",
                 "--data.reward=bench.train_run:coin_reward", "--trainer.checkpoint_every=0",
                 "--trainer.seed=0", "--rollout.progress=false"]
    if args.mean_response == 0:  # responses run to max_tokens, as a fresh policy's often do
        overrides += ["--rollout.ignore_eos=true"]
    if args.device == "cpu":
        overrides += ["--model.dtype=float32"]
    overrides += [f"--{o.removeprefix('--')}" for o in args.set]  # last: they win
    config = load_config(args.config, overrides)
    return dataclasses.replace(config, rollout=dataclasses.replace(
        config.rollout, stop_token_ids=stop_ids(vocab_size, args.mean_response, avoid, seed=1)))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", default="qwen2.5-1.5b", choices=sorted(SHAPES))
    parser.add_argument("--layers", type=int, default=None, help="blocks (default: the shape's)")
    parser.add_argument("--recipes", default="bf16,fp8-rollout,jet",
                        help=f"among {', '.join(RECIPES)} (jet+kv8: jet with the FP8 KV cache)")
    parser.add_argument("--steps", type=int, default=None,
                        help="RL steps per recipe (default 8, --tiny 2); medians over steps 2 and later")
    parser.add_argument("--config", default=os.fspath(EXAMPLE), help="the run config (default: the shipped example)")
    parser.add_argument("--data", default=os.fspath(SHARED_GSM8K),
                        help="GSM8K train.jsonl (generated rows when missing)")
    parser.add_argument("--prompts", type=int, default=None, help="data.prompts_per_step (default: the setting's)")
    parser.add_argument("--n", type=int, default=8, help="rollout.n")
    parser.add_argument("--max-tokens", type=int, default=None, help="rollout.max_tokens (default: the setting's)")
    parser.add_argument("--setting", default="gsm8k", choices=sorted(SETTINGS),
                        help="prompts, samples and response lengths: " + "; ".join(
                            f"{k}: {v[0]}" for k, v in sorted(SETTINGS.items())))
    parser.add_argument("--mean-response", type=int, default=None,
                        help="mean response length aimed at (0: every response runs to --max-tokens)")
    parser.add_argument("--mini-batch", type=int, default=None,
                        help="algorithm.mini_batch_size (default 128, or the whole batch where it is smaller)")
    parser.add_argument("--micro-tokens", type=int, default=16384, help="algorithm.max_tokens_per_micro_batch")
    parser.add_argument("--tokenizer-vocab", type=int, default=8192)
    parser.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                        help="a config override for every recipe, as `jetrl train` takes it (repeatable), e.g. "
                             "--set model.checkpoint_blocks=14")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--workdir", default=None, help="checkpoint and run folders (default: a temporary one)")
    parser.add_argument("--json", default=None)
    parser.add_argument("--tiny", action="store_true", help="CPU smoke run: tiny shape, 2 steps, small batch")
    return parser


def parse_args(argv: list[str] | None = None, parser: argparse.ArgumentParser | None = None) -> argparse.Namespace:
    """The arguments, with the ``--setting``'s prompts, ``max_tokens`` and mean response where not given."""
    parser = parser or build_parser()
    args = parser.parse_args(argv)
    _, prompts, max_tokens, mean_response = SETTINGS[args.setting]
    args.prompts = prompts if args.prompts is None else args.prompts
    args.max_tokens = max_tokens if args.max_tokens is None else args.max_tokens
    args.mean_response = mean_response if args.mean_response is None else args.mean_response
    args.mini_batch = min(128, args.prompts * args.n) if args.mini_batch is None else args.mini_batch
    if args.mean_response < 0:
        parser.error("--mean-response must be >= 0")
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = build_parser()
    args = parse_args(argv, parser)
    if args.tiny:
        args.shape, args.device, args.prompts, args.n = "tiny", "cpu", 2, 2
        args.steps = 2 if args.steps is None else args.steps
        args.max_tokens, args.mini_batch, args.micro_tokens = 24, 4, 1024
        args.mean_response = 0 if args.mean_response == 0 else 12
        args.tokenizer_vocab = 600
    args.steps = 8 if args.steps is None else args.steps
    if args.steps < 1:
        parser.error("--steps must be at least 1")
    recipes = [r.strip() for r in args.recipes.split(",") if r.strip()]
    unknown = [r for r in recipes if r not in RECIPES]
    if unknown or "bf16" not in recipes:
        parser.error(f"--recipes: choose among {', '.join(RECIPES)}, bf16 included (the baseline); got {unknown}")
    shape = dict(SHAPES[args.shape])
    if args.layers is not None:
        shape["num_hidden_layers"] = args.layers
    device = torch.device(args.device)
    rows = gsm8k_rows(Path(args.data) if args.data else None, 0 if not args.tiny else 200, seed=0)
    if args.workdir:
        os.makedirs(args.workdir, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=args.workdir) as tmp:
        root = Path(tmp)
        data = root / "gsm8k.jsonl"
        with open(data, "w") as f:
            for row in rows:
                f.write(json.dumps({"question": row["question"], "answer": row["answer"]}) + "\n")
        folder = root / "checkpoint"
        start = time.perf_counter()
        tokenizer = make_checkpoint(shape, folder, [r["question"] + "\n" + r["answer"] for r in rows],
                                    args.tokenizer_vocab, device)
        print(f"checkpoint {args.shape} ({shape['num_hidden_layers']} blocks) written in "
              f"{time.perf_counter() - start:.1f} s", flush=True)
        avoid = set(tokenizer.all_special_ids)
        base = build_base_config(args, folder, data, shape["vocab_size"], avoid)
        results = {}
        for recipe in recipes:
            print(f"{recipe}:", flush=True)
            results[recipe] = run_recipe(recipe, base, args.steps, root / "runs")
    report = {"benchmark": "train_run", "shape": args.shape, "layers": shape["num_hidden_layers"],
              "device": device_description(device), "torch": torch.__version__,
              "setting": {"name": args.setting, **{k: getattr(args, k) for k in (
                  "prompts", "n", "max_tokens", "mean_response", "mini_batch", "micro_tokens", "steps", "config",
                  "set")}},
              "data": "gsm8k" if Path(args.data).is_file() else "generated",
              "recipes": {r: {"median": summarize(res), "steady": summarize(res, steady=True),
                              "steady_steps": len(steady_steps(res["steps"])), "peak_gib": res["peak_gib"],
                              "wall_s": res["wall_s"], "steps": res["steps"]} for r, res in results.items()}}
    base_med = report["recipes"]["bf16"]["median"]
    base_steady = report["recipes"]["bf16"]["steady"]
    for recipe, entry in report["recipes"].items():
        med = entry["median"]
        entry["vs_bf16"] = {key.removeprefix("time/"): base_med[key] / med[key]
                            for key in med if key.startswith("time/") and key in base_med and med[key] > 0}
        entry["vs_bf16_steady"] = {key.removeprefix("time/"): base_steady[key] / value
                                   for key, value in entry["steady"].items()
                                   if key.startswith("time/") and key in base_steady and value > 0}
        entry["vs_bf16_per_token"] = {key.removeprefix("tokens_per_s/"): med[key] / base_med[key]
                                      for key in med if key.startswith("tokens_per_s/") and base_med.get(key, 0) > 0}
    print_table(report)
    write_report(report, args.json, "train_run.json")
    return report


def _cells(medians: dict[str, float], ratios: dict[str, float], cols: tuple[str, ...]) -> str:
    """``seconds (ratio x)`` per column, 22 characters each; ``-`` where there is no median or no ratio."""
    out = []
    for c in cols:
        if "time/" + c in medians and c in ratios:
            out.append(f"{medians['time/' + c]:>12.2f} s ({ratios[c]:.2f}x)")
        else:
            out.append(f"{'-':>22}")
    return "".join(out)


def print_table(report: dict[str, Any]) -> None:
    cols = ("step_wall", "rollout", "old_logprob", "update")
    print(f"\n{report['shape']} ({report['layers']} blocks), {report['device']}, data {report['data']}; "
          "medians of steps 2+, bf16 / recipe in parentheses (> 1: faster than bf16)")
    print(f"{'recipe':<12}" + "".join(f"{c:>22}" for c in cols) + f"{'peak GiB':>10}{'resp len':>10}")
    for recipe, entry in report["recipes"].items():
        cells = _cells(entry["median"], entry["vs_bf16"], cols)
        med = entry["median"]
        peak = f"{entry['peak_gib']:.1f}" if entry["peak_gib"] is not None else "-"
        length = f"{med['response/length_mean']:.0f}" if "response/length_mean" in med else "-"
        print(f"{recipe:<12}{cells}{peak:>10}{length:>10}")
    print("per response token (medians of response tokens/s per step, recipe / bf16): the recipes sample different "
          "lengths")
    for recipe, entry in report["recipes"].items():
        per = entry["vs_bf16_per_token"]
        print(f"{recipe:<12}" + "".join(f"{per[c]:>21.2f}x" if c in per else f"{'-':>22}" for c in cols))
    print("steady state: medians of the steps 2+ that captured no CUDA graph (a long run's steps once every shape "
          "has its graph), bf16 / recipe in parentheses")
    for recipe, entry in report["recipes"].items():
        later = len(entry["steps"]) - 1
        if not entry["steady"]:
            why = (f"each of its {later} steps 2+ captured a graph (a longer run reaches them)" if later
                   else "no step after the first")
            print(f"{recipe:<12}none: {why}")
            continue
        cells = _cells(entry["steady"], entry["vs_bf16_steady"], cols)
        print(f"{recipe:<12}{cells}   ({entry['steady_steps']} of {later} steps)")
    print("peak GiB allocated per phase (medians)")
    for recipe, entry in report["recipes"].items():
        med = entry["median"]
        phases = ", ".join(f"{key.removeprefix('memory/').removesuffix('_peak_gib')} {value:.1f}"
                           for key, value in med.items() if key.startswith("memory/") and key.endswith("_peak_gib"))
        held, dropped = med.get("memory/fp8_weights_gib"), med.get("memory/released_bf16_weights_gib")
        print(f"  {recipe:<12}{phases}" + (f"; FP8 weight copies {held:.2f}" if held else "")
              + (f"; BF16 weight copies dropped {dropped:.2f}" if dropped else ""))
    print("per step (s), step / update [CUDA graphs captured in that step, host seconds they took]: a step far "
          "above its neighbours captured graphs of new shapes or compiled a kernel variant")
    for recipe, entry in report["recipes"].items():
        steps, captured, seconds = [], 0.0, 0.0
        for m in entry["steps"]:
            total, spent = m.get("update/graph_captures"), m.get("update/graph_capture_seconds")
            new = "" if total is None else f" [{total - captured:.0f}" + (
                "" if spent is None else f", {spent - seconds:.2f} s") + "]"
            captured = total if total is not None else captured
            seconds = spent if spent is not None else seconds
            steps.append(f"{m['time/step_wall']:.2f}/{m['time/update']:.2f}{new}")
        print(f"  {recipe:<12}{', '.join(steps)}")


if __name__ == "__main__":
    main(sys.argv[1:])
