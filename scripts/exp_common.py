"""What the experiment scripts share: the experiment model, its SFT warm start, and the output conventions.

**The model.** A Llama-style decoder with hidden size 1024 (eight 128-wide FP8 blocks per activation
row, 128x128 weight blocks 8 x 8 per square projection, like real models), 8 layers, 8 query heads of
128 and 4 KV heads, SwiGLU 2816 (22 blocks), tied embeddings over the 26-token character vocabulary:
about 94M parameters (:func:`num_parameters`). It is warm-started from scratch by ``jetrl sft`` on the
``chain`` task (difficulty 8-320: solutions of about 90 to 4,300 tokens) inside every device call,
because nothing stays on the GPU machine between calls and a checkpoint of this size does not fit what
a call brings back.

**Sizing from FLOPs** (an estimate; EXPERIMENTS.md has the measured time and accuracy):
:func:`train_flops_per_token` counts ``6 x (matrix parameters)`` plus causal attention ``6 x 2 x layers
x sequence / 2 x hidden``; for this model and its training sequences (~2,050 tokens on average) that
is about 0.67 GFLOP per token, and :func:`sft_seconds_estimate` turns it into seconds at a given share of
the H200's dense BF16 peak. The default 250 steps of 64 sequences (~33M tokens, 16K worked chains) give a
model that has seen each kind of step a great many times, but whose long chains (hundreds of steps, every
one of which must be right) are not saturated. ``--sft-steps`` is the knob.

**Outputs.** A device call brings back at most 8 files of 16 MiB from ``$OUT``: each script writes one
JSON (every number it reports, with the settings) and a few PNGs there, and keeps checkpoints and run
folders in a work folder outside it. Each script prints its short table last.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any, Sequence

from jetrl.config import load_config
from jetrl.sft import SFTConfig, run_sft

# The experiment model and its SFT: every field of jetrl.sft.train.SFTConfig that differs from its default.
GPU_SFT = dict(task="chain", difficulty=(8, 320), hidden_size=1024, num_hidden_layers=8, num_attention_heads=8,
               num_key_value_heads=4, intermediate_size=2816, max_position_embeddings=8192, steps=250,
               batch_size=64, lr=1e-3, warmup_steps=30, min_lr_ratio=0.1, weight_decay=0.01, dtype="bfloat16",
               save_dtype="bfloat16", packing=True, micro_batch_tokens=65536, device="cuda", eval_examples=64,
               log_every=25, checkpoint_every=0)
# The CPU smoke model: the same code path in seconds (tiny, fp32, short chains).
SMOKE_SFT = dict(task="chain", difficulty=(1, 6), hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                 num_key_value_heads=1, intermediate_size=64, max_position_embeddings=512, steps=8, batch_size=8,
                 lr=1e-2, warmup_steps=2, dtype="float32", save_dtype="float32", packing=True,
                 micro_batch_tokens=1024, device="cpu", eval_examples=2, log_every=4, checkpoint_every=0)

H200_BF16_DENSE_FLOPS = 700e12

# The arms of the experiments, by name: RunConfig overrides (``section.key=value``) on top of the
# experiment's own settings. ``jet-exact`` is ``jet`` in exact on-policy mode (the rollout's log-probs
# equal the trainer's bitwise). ``jet-kv8`` is ``jet`` with the FP8 KV cache (rollout and training forward
# attend over the same quantized K/V); ``fp8-rollout-kv8`` quantizes the rollout's KV cache only (what peers
# ship). More arms come by name from the command line without touching this list:
# ``--arm 'NAME:recipe=jet;key=value'`` (see :func:`resolve_arms`).
ARMS: dict[str, tuple[str, ...]] = {
    "bf16": ("recipe=bf16",),
    "fp8-rollout": ("recipe=fp8-rollout",),
    "fp8-rollout-tis": ("recipe=fp8-rollout", "algorithm.tis_cap=2.0"),
    "jet": ("recipe=jet",),
    "jet-exact": ("recipe=jet", "exact=true"),
    "jet-kv8": ("recipe=jet", "kv_fp8=true"),
    "fp8-rollout-kv8": ("recipe=fp8-rollout", "kv_fp8=true"),
}


def resolve_arms(names: Sequence[str], extra: Sequence[str] = ()) -> dict[str, tuple[str, ...]]:
    """``{arm name: overrides}`` for ``names`` (each a name in :data:`ARMS` or defined in ``extra``), in
    order. ``extra`` items read ``"NAME:override;override"``, e.g.
    ``"jet-exact-kv8:recipe=jet;exact=true;kv_fp8=true"``."""
    defined = dict(ARMS)
    for item in extra:
        name, sep, rest = item.partition(":")
        overrides = tuple(o.strip() for o in rest.split(";") if o.strip())
        if not sep or not name.strip() or not overrides or any("=" not in o for o in overrides):
            raise ValueError(f"--arm must read 'NAME:key=value;key=value', got {item!r}")
        defined[name.strip()] = overrides
    unknown = [n for n in names if n not in defined]
    if unknown:
        raise ValueError(f"unknown arms {unknown}; defined: {', '.join(defined)} "
                         f"(define more with --arm NAME:overrides)")
    if len(set(names)) != len(names):
        raise ValueError(f"an arm is named twice in {list(names)}")
    return {n: defined[n] for n in names}


def arm_config(base: Sequence[str], overrides: Sequence[str]):
    """The :class:`jetrl.config.RunConfig` of an arm: defaults <- ``base`` <- the arm's ``overrides`` (validated)."""
    return load_config(None, [*base, *overrides])


def sft_config(smoke: bool, output_dir: str | Path, steps: int | None = None, seed: int = 0):
    """The experiment model's :class:`jetrl.sft.SFTConfig` (``smoke``: the tiny CPU one)."""
    fields = dict(SMOKE_SFT if smoke else GPU_SFT)
    if steps is not None:
        fields["steps"] = steps
    return SFTConfig(output_dir=str(output_dir), seed=seed, **fields)


def num_parameters(config) -> int:
    """Parameters of an SFT config's model (tied embeddings)."""
    h, i, layers = config.hidden_size, config.intermediate_size, config.num_hidden_layers
    head_dim = h // config.num_attention_heads
    kv = config.num_key_value_heads * head_dim
    per_layer = h * h * 2 + 2 * h * kv + 3 * h * i + 2 * h
    return layers * per_layer + h + 26 * h


def train_flops_per_token(config, sequence_tokens: float) -> float:
    """Training FLOPs per token of sequences of ``sequence_tokens`` (forward + backward = 3 x forward):
    ``6 x`` the parameters in matrices (the LM head included, the embedding lookup not) plus causal
    attention, whose forward is ``2 x 2 x (sequence_tokens / 2) x hidden`` per layer (QK^T and PV, a
    token attends to half the sequence on average)."""
    h, layers = config.hidden_size, config.num_hidden_layers
    matrix_params = num_parameters(config) - layers * 2 * h - h  # all but the norms (the tied head counts once)
    attention = 3 * layers * 2 * 2 * (sequence_tokens / 2) * h
    return 6 * matrix_params + attention


def sft_seconds_estimate(config, mean_sequence_tokens: float, utilization: float) -> float:
    """Seconds of an SFT run at ``utilization`` of the H200's dense BF16 peak (an estimate, not a measurement)."""
    tokens = config.steps * config.batch_size * mean_sequence_tokens
    return tokens * train_flops_per_token(config, mean_sequence_tokens) / (H200_BF16_DENSE_FLOPS * utilization)


def warm_start(args, work: Path, log=print) -> tuple[str, dict[str, Any]]:
    """The checkpoint the experiment runs on: ``args.model`` when given, else a fresh SFT into
    ``work/sft``; returns its path and a summary (SFT settings, accuracy, seconds)."""
    if args.model:
        return args.model, {"model": args.model, "sft": None}

    config = sft_config(args.smoke, work / "sft", steps=args.sft_steps, seed=args.sft_seed)
    if not args.smoke:
        mean_tokens = _mean_sequence_tokens(config)
        log(f"sft: {num_parameters(config) / 1e6:.0f}M parameters, ~{mean_tokens:.0f} tokens per sequence; estimate "
            f"{sft_seconds_estimate(config, mean_tokens, 0.4):.0f}-{sft_seconds_estimate(config, mean_tokens, 0.3):.0f}"
            f" s at 30-40% of the H200's BF16 peak")
    result = run_sft(config, progress=False, log=log)
    summary = {"model": result.output_dir, "sft": {"config": asdict(config), "num_parameters": result.num_parameters,
                                                   "final_loss": result.final_loss,
                                                   "greedy_accuracy": result.accuracy, "seconds": result.seconds}}
    return result.output_dir, summary


def _mean_sequence_tokens(config) -> float:
    task = config.build_task(config.train_seed)
    return sum(len(ex.prompt) + len(ex.solution) + 2 for ex in task.examples(64)) / 64


def add_common_arguments(parser, default_out: str, default_arms: str) -> None:
    """``--smoke``, ``--out``, ``--work``, ``--model``, ``--sft-steps``, ``--sft-seed``, ``--arms``, ``--arm``."""
    parser.add_argument("--arms", default=default_arms, help=f"comma-separated arm names (built in: {', '.join(ARMS)})")
    parser.add_argument("--arm", action="append", default=[], metavar="NAME:OVERRIDES",
                        help="define an arm: 'NAME:key=value;key=value' (RunConfig overrides); repeatable")
    parser.add_argument("--smoke", action="store_true", help="tiny CPU model and sizes: the code path in seconds")
    parser.add_argument("--out", default=os.environ.get("OUT", default_out),
                        help="folder for the JSON and PNGs (default: $OUT, else %(default)s)")
    parser.add_argument("--work", default=None, help="folder for checkpoints and run logs (default: a temp folder)")
    parser.add_argument("--model", default=None, help="a checkpoint to use instead of a fresh SFT")
    parser.add_argument("--sft-steps", type=int, default=None, help="SFT steps (default: the config's)")
    parser.add_argument("--sft-seed", type=int, default=0, help="SFT weight-init seed")


def work_dir(args) -> Path:
    if args.work:
        path = Path(args.work)
        path.mkdir(parents=True, exist_ok=True)
        return path

    return Path(tempfile.mkdtemp(prefix="jetrl-exp-"))


def parse_list(text: str, kind=str) -> list:
    """``"256,1024"`` -> ``[256, 1024]``."""
    items = [kind(x.strip()) for x in text.split(",") if x.strip()]
    if not items:
        raise ValueError(f"empty list {text!r}")
    return items


def write_json(path: Path, data: dict[str, Any]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1, default=_jsonable))
    return path


def _jsonable(value: Any) -> Any:
    if isinstance(value, (set, tuple)):
        return list(value)
    if isinstance(value, Path):
        return str(value)
    return repr(value)


def table(rows: Sequence[Sequence[str]], header: Sequence[str]) -> str:
    """A plain fixed-width text table."""
    cells = [list(map(str, header))] + [list(map(str, r)) for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def log_scale_with_zero(ax, values: Sequence[float]) -> None:
    """A symmetric-log y axis whose linear part ends at the smallest positive value (so exact zeros,
    rounding-level values and large ones all show), cut at 0; left linear when nothing is positive."""
    positive = [v for v in values if isinstance(v, (int, float)) and v > 0 and v == v]
    if positive:
        ax.set_yscale("symlog", linthresh=min(positive))
        ax.set_ylim(bottom=0)


class Clock:
    """Seconds since creation, for time budgets."""
    def __init__(self) -> None:
        self.start = time.perf_counter()

    def elapsed(self) -> float:
        return time.perf_counter() - self.start
