"""One RL step of a Llama-3.1-8B-shaped policy, ``bf16`` vs ``jet`` (+ FP8 KV cache): phase times, speed-ups.

The step is :meth:`jetrl.rl.trainer.Trainer.step` itself (rollout -> reward -> old-logprob forward -> reference
forward -> PPO update -> FP8 weight refresh), timed by the trainer's own phase timers. The model has random
weights built from a config (no download), BF16 parameters, fp32 master weights and AdamW moments, and
per-block activation checkpointing in the update. The reference policy is a frozen copy in the same recipe
(``kl_coef > 0``). Rollouts are fixed-length (``ignore_eos``, every sample ``--new-tokens`` long) so every
recipe does the same work; the reward is a trivial function of the token ids (random weights make noise
anyway), so the reward phase costs almost nothing.

Default setting: 16 prompts x ``n=4`` samples = 64 sequences of 256 prompt + 1,024 new tokens (the rollout
target's batch 64 x 1,024), one PPO epoch, the whole batch as one mini-batch, micro-batches of 8 sequences.
Each recipe runs ``--warmup`` untimed steps (kernel autotuning, CUDA-graph capture) then ``--steps`` timed
ones; phase times are medians over the timed steps.

**Memory and the layer count.** A full 8B policy needs about 20 bytes per parameter in the update
(BF16 param 2 + fp32 master 4 + AdamW moments 8 + BF16 grad 2 + its fp32 copy 4): 160 GB before the
reference, the FP8 weight caches, the KV cache and activations -- more than one H200 holds. The default is
therefore the 8B *shape* (hidden 4096, 32 heads / 8 KV heads, MLP 14336, vocab 128256) with 16 of its 32
blocks; ``--layers 32`` asks for the full depth on a bigger device. The script prints its memory estimate
before building. With fewer blocks the BF16 LM head and embedding (1.05B parameters, unquantized in every
recipe) weigh more, so the jet/bf16 speed-ups are somewhat below what the full depth would show.

Reported next to the measured jet/bf16 speed-ups: Jet-RL's published 8B numbers and jetrl's targets.

**Arms** (``--arms``, alias ``--recipes``; default :data:`bench.common.DEFAULT_ARMS`):
``<recipe>[+kv8][-exact][@KEY=VALUE[;KEY=VALUE...]]`` (see :class:`bench.common.Arm`). ``--kv-fp8`` adds
``jet+kv8``: ``jet`` with the run config's ``kv_fp8: true``, so the engine stores K and V in an E4M3 cache (one fp32
scale per token per KV head) and the training forwards (old log-probs, reference, update) attend over the same
quantized K and V. Its end-to-end speed-up over ``bf16`` is set against issue 17's target (:data:`JETRL_KV8_TARGETS`)
and NeMo-RL's published 8B number (FP8 linears, KV cache and attention: :data:`NEMO_RL_REPORTED`). After ``@``,
fields of the kernels' tuning object (:mod:`jetrl.quant.kernels.tuning`) for that arm alone: the arm's whole run
(model, engine and CUDA graphs, trainer, warm-up and timed steps) is inside ``tuning.override`` of them, nested in
the run's ``--tuning`` (the arm's settings win), so two kernel routes are measured in one process against one
``bf16`` arm, e.g. exact mode's split-K heuristic against its single K walk::

    PYTHONPATH=$PWD python3 bench/rl_step.py --arms 'bf16,jet-exact,jet-exact@exact_split_k=0'

Every arm builds its own model (and so its cached FP8 weights), engine (and CUDA graphs) and trainer; Triton's
compiled kernels are keyed by the values the tuning passes them. Each arm's ``tuning`` in the report lists the
settings it ran under (``--tuning`` updated by the arm's own).

**Long rollouts** (``--long``): 16 prompts x 4 samples x (256 + 4,096) tokens, where the KV cache outweighs the
weights in every decode step and the FP8 cache pays most. The step's memory grows with the sequence length
(KV cache, activations and the micro-batch's LM-head logits), so ``--long`` takes 8 of the 32 blocks unless
``--layers`` says otherwise: by :func:`estimate_memory_bytes`, 16 blocks with the reference model need about
141 GiB in ``jet``, more than one H200 holds, and 8 blocks about 89 GiB (the BF16 LM head and embedding, 1.05B
parameters, then weigh over half as much as the 1.74B of the FP8 blocks, so the training phases gain less than at
full depth). Its warm-up step generates 256 tokens (``--warmup-new-tokens``: it compiles the kernels and captures
the CUDA graphs, which the engine sizes for the full length from the start), the timed step the full 4,096.
Command for issue 17's row, three arms::

    PYTHONPATH=$PWD python3 bench/rl_step.py --long --kv-fp8

**Exact mode** (``--exact``): a third arm, ``jet-exact`` (the ``jet`` recipe with ``exact: true``: the engine's
log-probabilities equal the trainer's bitwise, see :mod:`jetrl.quant.exact`), runs after the fast arms; the table
then also gives each phase's cost of exact ``jet`` over fast ``jet`` (``jet-exact/jet``, seconds over seconds),
and the mismatch line shows every arm's rollout/training |dlogp| side by side (``jet-exact``: 0 by construction).

GPU: ``python bench/rl_step.py``; ``--prompts``, ``--n``, ``--new-tokens``, ``--prompt-len``, ``--layers``,
``--no-reference`` change the setting. The results go to ``$OUT/rl_step.json`` when ``OUT`` is set (and to
``--json PATH``). CPU smoke run: ``--tiny``.
"""

from __future__ import annotations

import argparse
import gc
import math
import statistics
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import torch

try:  # repository root on sys.path (python -m bench.rl_step, the tests)
    from bench.common import (DEFAULT_ARMS, LLAMA31_8B, TINY_LLAMA, add_tuning_argument, arms_help,
                              device_description, fast_arm_of, parse_arm, parse_arms, parse_tuning, peak_memory_gib,
                              random_prompts, reset_peak_memory, with_layers, write_report)
except ModuleNotFoundError:  # python bench/rl_step.py: bench/ itself is on sys.path
    from common import (DEFAULT_ARMS, LLAMA31_8B, TINY_LLAMA, add_tuning_argument,  # type: ignore[no-redef]
                        arms_help, device_description, fast_arm_of, parse_arm, parse_arms, parse_tuning,
                        peak_memory_gib, random_prompts, reset_peak_memory, with_layers, write_report)

PHASES = ("rollout", "reward", "old_logprob", "reference", "update", "weight_refresh")
# Jet-RL's reported speed-ups of jet over BF16 at 8B, and the targets jetrl sets itself (issue 6).
JET_RL_REPORTED = {"rollout": "1.07-1.33x", "reference": "1.80x", "update": "1.54x", "total": "1.16x"}
JETRL_TARGETS = {"rollout": 1.3, "reference": 1.8, "update": 1.6, "total": 1.3}
# jet + FP8 KV cache over BF16: NeMo-RL's published 8B end-to-end speed-up, and issue 17's target for long rollouts
NEMO_RL_REPORTED = {"total": "1.48x"}
JETRL_KV8_TARGETS = {"total": 1.5}
# arm -> (whose published speed-ups, those, jetrl's targets), for the table's comparison columns
COMPARISONS = {"jet": ("Jet-RL", JET_RL_REPORTED, JETRL_TARGETS),
               "jet+kv8": ("NeMo-RL", NEMO_RL_REPORTED, JETRL_KV8_TARGETS)}
DEFAULT_8B_LAYERS = 16  # of 32: what fits one H200 with the reference model (see the module doc)
LONG = dict(prompts=16, n=4, new_tokens=4096, layers=8, warmup_new_tokens=256)  # --long (see the module doc)


@dataclass
class Setting:
    """The work of one RL step (identical for every recipe)."""

    shape: str
    num_layers: int
    num_params: int
    prompts: int
    n: int
    prompt_len: int
    new_tokens: int
    micro_batch: int
    reference: bool
    checkpointing: bool
    dtype: str
    device: str
    old_logprobs_from_update: bool = False  # no separate old_logprob pass (see AlgorithmConfig)
    rollout_logprobs: bool = False  # use_rollout_logprobs: exact arms skip the old_logprob pass (see AlgorithmConfig)

    @property
    def num_sequences(self) -> int:
        return self.prompts * self.n

    @property
    def generated_tokens(self) -> int:
        return self.num_sequences * self.new_tokens

    @property
    def scored_tokens(self) -> int:
        """Tokens every training-side forward runs over: prompt + response of every sequence."""
        return self.num_sequences * (self.prompt_len + self.new_tokens)


@dataclass
class RecipeResult:
    recipe: str
    seconds: dict[str, float] = field(default_factory=dict)         # phase (and "total") -> median seconds
    tokens_per_s: dict[str, float] = field(default_factory=dict)    # phase (and "total") -> tokens/s
    peak_gib: float | None = None
    estimated_gib: float = 0.0
    # of the rollout phase: seconds in the engine's generation loop; the rest is set-up before it
    # (KV cache, CUDA-graph capture, which repeats whenever the cached FP8 weights move to new storage)
    rollout_loop_seconds: float = 0.0
    rollout_host_seconds: float = 0.0  # of the loop: the host not waiting for the GPU (overlapped when async)
    step_metrics: dict[str, float] = field(default_factory=dict)    # the last timed step's trainer metrics
    # the kernels' tuning fields set for the arm: --tuning, updated by the arm's own @KEY=VALUE (empty: defaults)
    tuning: dict[str, Any] = field(default_factory=dict)


# ----------------------------------------------------------------------------------------------- the model

def parameter_counts(shape: dict) -> tuple[int, int]:
    """(all parameters, parameters of the blocks' linear layers -- the FP8-quantized ones), counted on a
    meta-device model, so nothing is allocated."""
    from jetrl.models import DecoderLM, DecoderConfig

    with torch.device("meta"):
        model = DecoderLM(DecoderConfig.from_hf(shape), dtype=torch.bfloat16)
    model.tie_weights()
    total = sum(p.numel() for p in model.parameters())
    linear = sum(m.weight.numel() for name, m in model.named_modules()
                 if isinstance(m, torch.nn.Linear) and not name.endswith("lm_head"))
    return total, linear


def estimate_memory_bytes(shape: dict, recipe: str, reference: bool, num_sequences: int, seq_len: int,
                          micro_batch: int, counts: tuple[int, int] | None = None, kv_fp8: bool = False) -> int:
    """A conservative estimate of the step's peak device memory (bytes), to choose the layer count.

    Update state: 20 bytes per parameter (BF16 param 2, fp32 master 4, AdamW moments 8, BF16 grad 2 and its
    fp32 copy 4, all live at the optimizer step). The reference: 2 bytes per parameter. FP8 recipes cache
    each block linear's E4M3 weight and its transposed copy (2 bytes per linear parameter), in the policy
    and in the reference copy. The KV cache holds every sequence at full length in BF16 (``kv_fp8``: E4M3 plus
    one fp32 scale per token per KV head). Activations with
    per-block checkpointing: one BF16 hidden row per token per block, one block recomputed at a time,
    and the LM head's logits: one micro-batch's kept for the backward (BF16, up to the 4 GiB the kernels'
    path keeps) plus one 2,048-row chunk in flight, plus 2 GiB of workspace.
    ``counts`` is :func:`parameter_counts` of ``shape`` when already known.
    """
    from jetrl.models.logprobs import KEEP_LOGITS_BYTES

    total, linear = counts or parameter_counts(shape)
    layers, hidden = shape["num_hidden_layers"], shape["hidden_size"]
    head_dim = shape.get("head_dim") or hidden // shape["num_attention_heads"]
    state = 20 * total + (2 * total if reference else 0)
    fp8_cache = 0 if recipe == "bf16" else 2 * linear * (2 if reference else 1)
    kv = num_sequences * seq_len * 2 * layers * shape["num_key_value_heads"] * ((head_dim + 4) if kv_fp8
                                                                                  else 2 * head_dim)
    micro_tokens = micro_batch * seq_len
    activations = (micro_tokens * (layers * hidden * 2 + (8 * hidden + 6 * shape["intermediate_size"]) * 2)
                   + min(micro_tokens * shape["vocab_size"] * 2, KEEP_LOGITS_BYTES)
                   + 2048 * shape["vocab_size"] * 2 + 2 * 2 ** 30)
    return state + fp8_cache + kv + activations


# ------------------------------------------------------------------------------------- the trainer's inputs

class RandomPrompts:
    """``prompts`` random prompts of ``length`` ids per call, fresh each call, resumable by position."""

    def __init__(self, prompts: int, length: int, vocab_size: int, seed: int = 0) -> None:
        self.prompts, self.length, self.vocab_size, self.seed = prompts, length, vocab_size, seed
        self.position = 0

    def next_batch(self) -> list:
        from jetrl.rl.trainer import PromptItem

        ids = random_prompts(self.prompts, self.length, self.vocab_size, seed=self.seed + self.position)
        self.position += 1
        return [PromptItem(p, "") for p in ids]

    def state_dict(self) -> dict[str, Any]:
        return {"position": self.position}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.position = int(state["position"])


def decode_ids(ids: list[int]) -> str:
    """Tokenizer-free "text": the ids, comma-separated (all the reward below needs)."""
    return ",".join(map(str, ids))


def even_token_reward(texts: list[str], references: list[str]) -> list[float]:
    """Fraction of even token ids in each completion: trivial, but it varies across samples, so the GRPO
    advantages are non-zero and the update does its full work."""
    out = []
    for text in texts:
        ids = text.split(",") if text else []
        out.append(sum(int(t) % 2 == 0 for t in ids) / len(ids) if ids else 0.0)
    return out


def build_run_config(recipe: str, setting: Setting, steps: int, exact: bool = False, kv_fp8: bool = False) -> Any:
    from jetrl.config import (AlgorithmConfig, DataConfig, ModelConfig, OptimConfig, RolloutConfig, RunConfig,
                              TrainerConfig)

    return RunConfig(
        recipe=recipe,
        exact=exact,
        kv_fp8=kv_fp8,
        model=ModelConfig(dtype=setting.dtype, device=setting.device, gradient_checkpointing=setting.checkpointing),
        data=DataConfig(prompts_per_step=setting.prompts, max_prompt_tokens=setting.prompt_len),
        rollout=RolloutConfig(n=setting.n, temperature=1.0, max_tokens=setting.new_tokens, ignore_eos=True),
        algorithm=AlgorithmConfig(kl_coef=1e-3 if setting.reference else 0.0, micro_batch_size=setting.micro_batch,
                                  old_logprobs_from_update=setting.old_logprobs_from_update,
                                  use_rollout_logprobs=setting.rollout_logprobs),
        optim=OptimConfig(lr=1e-6),
        trainer=TrainerConfig(steps=steps, seed=0),
    )


# ------------------------------------------------------------------------------------------------- a recipe

def run_recipe(arm: str, shape: dict, setting: Setting, warmup: int, steps: int, memory_budget: float,
               cuda_graphs: bool, progress: bool, warmup_new_tokens: int | None = None) -> RecipeResult:
    """Build the policy (and its engine and trainer) for ``arm`` (``<recipe>[+kv8][-exact][@KEY=VALUE...]``), run
    ``warmup + steps`` RL steps, and return the timed steps' median phase times; everything is freed before
    returning. All of it runs inside ``tuning.override`` of the arm's own tuning (nested in whatever is in force:
    the arm's settings win). ``warmup_new_tokens``: the warm-up steps' rollout length (default: the setting's)."""
    from jetrl.quant.kernels import tuning

    spec = parse_arm(arm)
    with tuning.override(**spec.tuning):
        return _run_recipe(arm, spec, shape, setting, warmup, steps, memory_budget, cuda_graphs, progress,
                           warmup_new_tokens)


def _run_recipe(arm: str, spec, shape: dict, setting: Setting, warmup: int, steps: int, memory_budget: float,
                cuda_graphs: bool, progress: bool, warmup_new_tokens: int | None) -> RecipeResult:
    from jetrl.models import build_model
    from jetrl.rl.trainer import Trainer
    from jetrl.rollout import RolloutEngine

    device = torch.device(setting.device)
    # config errors before the model is built
    config = build_run_config(spec.recipe, setting, warmup + steps, spec.exact, spec.kv_fp8)
    warm_tokens = setting.new_tokens if warmup_new_tokens is None else min(warmup_new_tokens, setting.new_tokens)
    warm_config = replace(config, rollout=replace(config.rollout, max_tokens=warm_tokens))
    reset_peak_memory(device)
    model = build_model(shape, dtype=getattr(torch, setting.dtype), device=device, recipe=spec.recipe, seed=0)
    model.set_activation_checkpointing(setting.checkpointing)
    engine = RolloutEngine(model, memory_budget=memory_budget if device.type == "cuda" else 2 ** 30,
                           max_num_seqs=setting.num_sequences, max_model_len=setting.prompt_len + setting.new_tokens,
                           progress=progress, cuda_graphs=cuda_graphs, exact=spec.exact, kv_fp8=spec.kv_fp8)
    prompts = RandomPrompts(setting.prompts, setting.prompt_len, shape["vocab_size"])
    trainer = Trainer(config, model, engine, prompts, even_token_reward, decode_ids)
    timed: list[dict[str, float]] = []
    loop_seconds: list[float] = []
    host_seconds: list[float] = []
    try:
        for i in range(warmup + steps):
            # the warm-up steps may generate fewer tokens (the engine's graphs and pool are sized for the full
            # length already); the timed steps run the setting as configured
            trainer.config = warm_config if i < warmup else config
            metrics = trainer.step()
            _check_step(arm, metrics, setting, warm_tokens if i < warmup else setting.new_tokens)
            if i >= warmup:
                timed.append(metrics)
                loop_seconds.append(float(engine.last_stats.get("seconds", 0.0)))
                host_seconds.append(float(engine.last_stats.get("host_seconds", 0.0)))
            print(f"  {arm} step {i + 1}/{warmup + steps} ({'timed' if i >= warmup else 'warm-up'}): "
                  f"{metrics['time/step']:.2f} s", flush=True)
        peak = peak_memory_gib(device)
    finally:
        engine.free_cache()
        del trainer, engine, model
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    result = RecipeResult(arm, peak_gib=peak, step_metrics=timed[-1],
                          rollout_loop_seconds=statistics.median(loop_seconds),
                          rollout_host_seconds=statistics.median(host_seconds))
    for phase in PHASES + ("step",):
        values = [m[f"time/{phase}"] for m in timed if f"time/{phase}" in m]
        if values:
            result.seconds["total" if phase == "step" else phase] = statistics.median(values)
    tokens = {"rollout": setting.generated_tokens, "old_logprob": setting.scored_tokens,
              "reference": setting.scored_tokens, "update": setting.scored_tokens,
              "total": setting.generated_tokens}
    for phase, count in tokens.items():
        if phase in result.seconds:
            result.tokens_per_s[phase] = count / max(result.seconds[phase], 1e-12)
    return result


def _check_step(recipe: str, metrics: dict[str, float], setting: Setting, new_tokens: int | None = None) -> None:
    """Every recipe must have done the same work (``new_tokens`` per sequence, default the setting's), and a
    finite one."""
    expected = setting.num_sequences * (setting.new_tokens if new_tokens is None else new_tokens)
    if metrics["response/num_tokens"] != expected:
        raise RuntimeError(f"{recipe}: the rollout generated {metrics['response/num_tokens']:.0f} tokens, expected "
                           f"{expected} (fixed-length rollouts ignore EOS)")
    if metrics["actor/num_updates"] < 1:
        raise RuntimeError(f"{recipe}: the optimizer step was skipped (non-finite loss or gradient)")
    if not math.isfinite(metrics["actor/grad_norm"]):
        raise RuntimeError(f"{recipe}: non-finite gradient norm")


# ------------------------------------------------------------------------------------------------- reporting

def speedups(results: dict[str, RecipeResult], baseline: str = "bf16") -> dict[str, dict[str, float]]:
    """recipe -> phase -> baseline seconds / recipe seconds, for every recipe other than the baseline."""
    if baseline not in results:
        return {}
    base = results[baseline].seconds
    return {name: {phase: base[phase] / r.seconds[phase] for phase in base
                   if phase in r.seconds and r.seconds[phase] > 0}
            for name, r in results.items() if name != baseline}


def format_table(results: dict[str, RecipeResult], ratios: dict[str, dict[str, float]]) -> str:
    """Phase rows: seconds and tokens/s per arm, speed-ups over bf16, and for ``jet`` (``jet+kv8``) the published
    Jet-RL (NeMo-RL) speed-up, jetrl's target and whether it is met."""
    names = list(results)
    columns: list[tuple[str, Any]] = []  # (header, phase -> cell text or None)
    for n in names:
        columns.append((f"{n} s", lambda p, n=n: f"{results[n].seconds[p]:.3f}" if p in results[n].seconds else None))
    for n in names:
        columns.append((f"{n} tok/s", lambda p, n=n: (f"{results[n].tokens_per_s[p]:,.0f}"
                                                      if p in results[n].tokens_per_s else None)))
    for n in ratios:
        columns.append((f"{n}/bf16", lambda p, n=n: f"{ratios[n][p]:.2f}x" if p in ratios[n] else None))
    for n in names:  # exact mode's cost: its seconds over its fast arm's (bench.common.fast_arm_of)
        base = fast_arm_of(parse_arm(n), names)
        if base is not None:
            columns.append((f"{n}/{base}", lambda p, n=n, base=base: (
                f"{results[n].seconds[p] / results[base].seconds[p]:.2f}x"
                if p in results[n].seconds and results[base].seconds.get(p, 0) > 0 else None)))
    for arm, (who, reported, targets) in COMPARISONS.items():
        if arm not in ratios:
            continue
        prefix = "" if arm == "jet" else f"{arm} "
        columns.append((who, lambda p, reported=reported: reported.get(p)))
        columns.append((f"{prefix}target", lambda p, targets=targets: f"{targets[p]:.1f}x" if p in targets else None))
        columns.append((f"{prefix}met", lambda p, arm=arm, targets=targets: (
            ("yes" if ratios[arm][p] >= targets[p] else "no") if p in targets and p in ratios[arm] else None)))
    phases = [p for p in PHASES + ("total",) if any(p in r.seconds for r in results.values())]
    cells = [[fn(p) or "-" for _, fn in columns] for p in phases]
    widths = [max(len(h), *(len(row[i]) for row in cells)) + 2 for i, (h, _) in enumerate(columns)]
    lines = [f"{'phase':<15}" + "".join(f"{h:>{w}}" for (h, _), w in zip(columns, widths))]
    for phase, row in zip(phases, cells):
        lines.append(f"{phase:<15}" + "".join(f"{c:>{w}}" for c, w in zip(row, widths)))
    peaks = ", ".join(f"{n} {r.peak_gib:.1f} GiB (estimated {r.estimated_gib:.1f})" if r.peak_gib is not None
                      else f"{n} n/a" for n, r in results.items())
    lines.append(f"peak memory: {peaks}")
    return "\n".join(lines)


def mismatch_line(results: dict[str, RecipeResult]) -> str:
    """Every arm's rollout/training mismatch (|dlogp| mean and max of the last timed step), side by side."""
    parts = [f"{n} {r.step_metrics.get('mismatch/logp_abs_diff_mean', float('nan')):.2e} / "
             f"{r.step_metrics.get('mismatch/logp_abs_diff_max', float('nan')):.2e}"
             + (f" (over {r.step_metrics['mismatch/checked_frac']:.0%} of the tokens)"
                if "mismatch/checked_frac" in r.step_metrics else "") for n, r in results.items()]
    return "rollout/training mismatch |dlogp| mean / max: " + ", ".join(parts)


def _results_json(setting: Setting, results: dict[str, RecipeResult], ratios: dict[str, dict[str, float]]
                  ) -> dict[str, Any]:
    return {"setting": {**asdict(setting), "num_sequences": setting.num_sequences,
                        "generated_tokens": setting.generated_tokens, "scored_tokens": setting.scored_tokens},
            "results": {n: asdict(r) for n, r in results.items()}, "speedups_over_bf16": ratios,
            "jet_rl_reported": JET_RL_REPORTED, "jetrl_targets": JETRL_TARGETS,
            "nemo_rl_reported": NEMO_RL_REPORTED, "jetrl_kv8_targets": JETRL_KV8_TARGETS,
            "torch": torch.__version__}


# ------------------------------------------------------------------------------------------------- main

def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="CPU smoke run: 2-layer model, 2 prompts x 2, 8 tokens")
    parser.add_argument("--device", default=None, help="default: cuda when available (required unless --tiny)")
    parser.add_argument("--arms", "--recipes", dest="recipes", default=DEFAULT_ARMS,
                        help=arms_help("jet-exact@exact_split_k=0"))
    parser.add_argument("--kv-fp8", action="store_true",
                        help="also run jet with the FP8 KV cache (the arm jet+kv8), after the arms")
    parser.add_argument("--exact", action="store_true",
                        help="also run jet in exact mode (the arm jet-exact), after the arms")
    parser.add_argument("--long", action="store_true",
                        help="long rollouts: 16 prompts x 4 x 4,096 new tokens, 8 blocks, 256-token warm-up "
                             "(each can still be set)")
    parser.add_argument("--prompts", type=_positive, default=None, help="prompts per step (16; tiny: 2)")
    parser.add_argument("--n", type=_positive, default=None, help="samples per prompt (4; tiny: 2)")
    parser.add_argument("--new-tokens", type=_positive, default=None, help="tokens per sample (1024; tiny: 8)")
    parser.add_argument("--prompt-len", type=_positive, default=None, help="prompt tokens (256; tiny: 8)")
    parser.add_argument("--layers", type=_positive, default=None,
                        help=f"blocks of the 8B shape ({DEFAULT_8B_LAYERS} of 32, see the doc; tiny: 2)")
    parser.add_argument("--micro-batch", type=_positive, default=None,
                        help="sequences per forward/backward (8, or fewer when the batch is smaller)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed RL steps first")
    parser.add_argument("--warmup-new-tokens", type=_positive, default=None,
                        help="tokens per sample in the warm-up steps (default: as the timed ones; --long: 256)")
    parser.add_argument("--steps", type=_positive, default=1, help="timed RL steps (medians reported)")
    parser.add_argument("--no-reference", action="store_true", help="no KL penalty, so no reference model")
    parser.add_argument("--no-checkpointing", action="store_true", help="keep every block's activations")
    parser.add_argument("--old-logprobs-from-update", action="store_true",
                        help="take the old log-probs from the update's own forward (no old_logprob pass)")
    parser.add_argument("--rollout-logprobs", action="store_true",
                        help="the engine's log-probs are the old ones (use_rollout_logprobs) in every arm; exact "
                             "arms then skip the old_logprob pass, fast arms still run it for the mismatch metrics")
    parser.add_argument("--memory-budget", type=float, default=0.9,
                        help="KV-cache fraction of free GPU memory (capped at what the batch needs)")
    parser.add_argument("--no-cuda-graphs", action="store_true")
    parser.add_argument("--progress", action="store_true", help="rollout progress display")
    parser.add_argument("--json", default=None, help="also write the results here")
    add_tuning_argument(parser)
    args = parser.parse_args(argv)
    if args.warmup < 0:
        parser.error(f"--warmup must be >= 0, got {args.warmup}")
    try:
        recipes = [a.name for a in parse_arms(args.recipes)]
    except ValueError as exc:
        parser.error(f"--arms: {exc}")
    args.tuning = parse_tuning(parser, args.tuning)
    for flag, extra in ((args.kv_fp8, "jet+kv8"), (args.exact, "jet-exact")):
        if flag and extra not in recipes:
            recipes.append(extra)
    args.recipes = recipes
    if args.long and not args.tiny:  # the long setting's defaults, where not given
        for name, value in LONG.items():
            if getattr(args, name) is None:
                setattr(args, name, value)
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run the benchmark; returns the results as printed (and as written to ``$OUT/rl_step.json``)."""
    from jetrl.quant.kernels import tuning

    args = _parse(argv)
    with tuning.override(**args.tuning):
        return _main(args)


def _main(args: argparse.Namespace) -> dict[str, Any]:
    tiny = args.tiny
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() and not tiny else "cpu"))
    if device.type != "cuda" and not tiny:
        raise SystemExit("bench/rl_step.py needs a CUDA GPU for the 8B shape (use --tiny for a CPU smoke run)")
    base_shape = TINY_LLAMA if tiny else LLAMA31_8B
    shape = with_layers(base_shape, args.layers or (base_shape["num_hidden_layers"] if tiny else DEFAULT_8B_LAYERS))
    prompts = args.prompts or (2 if tiny else 16)
    n = args.n or (2 if tiny else 4)
    micro_batch = args.micro_batch or min(8, prompts * n)
    counts = parameter_counts(shape)
    setting = Setting(
        shape="tiny" if tiny else "llama-3.1-8b", num_layers=shape["num_hidden_layers"],
        num_params=counts[0], prompts=prompts, n=n,
        prompt_len=args.prompt_len or (8 if tiny else 256), new_tokens=args.new_tokens or (8 if tiny else 1024),
        micro_batch=micro_batch, reference=not args.no_reference, checkpointing=not args.no_checkpointing,
        old_logprobs_from_update=args.old_logprobs_from_update,
        rollout_logprobs=args.rollout_logprobs,
        dtype="bfloat16" if device.type == "cuda" else "float32", device=str(device))
    full_layers = base_shape["num_hidden_layers"]
    depth = (f"{setting.num_layers} of {full_layers} blocks (fewer than the full model: see the doc)"
             if setting.num_layers < full_layers else f"{setting.num_layers} blocks")
    print(f"model: {setting.shape}-shaped, {depth}, {setting.num_params / 1e9:.2f}B parameters, {setting.dtype}; "
          f"device {device_description(device)}; torch {torch.__version__}", flush=True)
    print(f"step: {prompts} prompts x n={n} = {setting.num_sequences} sequences, {setting.prompt_len} prompt + "
          f"{setting.new_tokens} new tokens (EOS ignored), micro-batch {micro_batch}, reference model "
          f"{'on' if setting.reference else 'off'}, activation checkpointing "
          f"{'on' if setting.checkpointing else 'off'}"
          f"{', old log-probs from the update' if setting.old_logprobs_from_update else ''}"
          f"{', old log-probs from the rollout' if setting.rollout_logprobs else ''}; "
          f"{args.warmup} warm-up"
          f"{f' ({args.warmup_new_tokens} new tokens)' if args.warmup_new_tokens and args.warmup else ''}"
          f" + {args.steps} timed steps", flush=True)

    results: dict[str, RecipeResult] = {}
    for recipe in args.recipes:  # an arm: <recipe>[+kv8][-exact]
        spec = parse_arm(recipe)
        estimate = estimate_memory_bytes(shape, spec.recipe, setting.reference, setting.num_sequences,
                                         setting.prompt_len + setting.new_tokens, micro_batch, counts,
                                         kv_fp8=spec.kv_fp8) / 2 ** 30
        line = f"{recipe}: estimated peak memory {estimate:.1f} GiB"
        if device.type == "cuda":
            total = torch.cuda.get_device_properties(device).total_memory / 2 ** 30
            line += f" of {total:.0f} GiB"
            if estimate > total:
                line += " -- likely out of memory: lower --layers, or --no-reference"
        print(line, flush=True)
        results[recipe] = run_recipe(recipe, shape, setting, args.warmup, args.steps, args.memory_budget,
                                     cuda_graphs=not args.no_cuda_graphs, progress=args.progress,
                                     warmup_new_tokens=args.warmup_new_tokens)
        results[recipe].estimated_gib = estimate
        results[recipe].tuning = dict(sorted({**args.tuning, **spec.tuning}.items()))
        r = results[recipe]
        m = r.step_metrics
        print(f"{recipe}: step {r.seconds['total']:.2f} s; rollout {r.seconds['rollout']:.2f} s of which "
              f"{r.seconds['rollout'] - r.rollout_loop_seconds:.2f} s before the generation loop (KV cache, CUDA "
              f"graphs) and {r.rollout_host_seconds:.2f} s of host time not waiting for the GPU; rollout/training "
              f"mismatch |dlogp| mean "
              f"{m.get('mismatch/logp_abs_diff_mean', float('nan')):.2e} max "
              f"{m.get('mismatch/logp_abs_diff_max', float('nan')):.2e}", flush=True)

    ratios = speedups(results)
    report = _results_json(setting, results, ratios)
    report["tuning"] = args.tuning  # the kernels' tuning fields set with --tuning (empty: the defaults)
    write_report(report, args.json, "rl_step.json")
    print(f"\nRL step, {setting.shape} ({setting.num_layers} blocks), {setting.num_sequences} x "
          f"({setting.prompt_len} + {setting.new_tokens}) tokens; Jet-RL / NeMo-RL = their reported 8B speed-ups, "
          f"target = jetrl's")
    if ratios:
        print("end to end over bf16: " + ", ".join(f"{a} {r['total']:.2f}x" for a, r in ratios.items()
                                                    if "total" in r))
    print(mismatch_line(results))
    print(format_table(results, ratios), flush=True)
    return report


if __name__ == "__main__":
    main()
