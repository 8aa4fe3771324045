"""Rollout throughput: ``RolloutEngine`` arms (``bf16``, ``jet``, ``jet`` + FP8 KV cache, ...) against ``bf16``.

Random weights built from configs (no download): the Llama-3.1-8B shape (``8b``), the Qwen2.5-32B shape
(``32b``: 65.5 GB of BF16 weights, one copy on one H200), a ~1.5B shape (``1.5b``, Qwen2-1.5B), the Qwen2.5-7B
and Qwen2.5-0.5B shapes (``7b``, ``0.5b``; all from :data:`bench.common.MODEL_SHAPES`). One model per
shape lives on the device; the arms share it (:func:`jetrl.quant.apply_recipe` swaps the linear layers in place,
sharing the parameters) and each arm's engine, KV cache, CUDA graphs and cached FP8 weights are freed before the
next arm or shape starts.

**Arms** (``--arms``, default ``bf16,jet,jet+kv8``): ``<recipe>[+kv8][-exact][@KEY=VALUE[;KEY=VALUE...]]``
(see :class:`bench.common.Arm`): ``jet+kv8`` is ``jet`` with ``RolloutEngine(kv_fp8=True)``: K and V stored in the
paged cache as E4M3 with one fp32 scale per token per KV head. ``--exact`` adds ``jet-exact``
(``RolloutEngine(exact=True)``). After ``@``, fields of the kernels' tuning object
(:mod:`jetrl.quant.kernels.tuning`) for that arm alone: everything the arm does (the FP8 weights' quantization, its
engine and CUDA graphs, warm-up, timed generations, the mismatch scoring) runs inside ``tuning.override`` of them,
nested in the run's ``--tuning`` (the arm's settings win), so two kernel routes are compared in one process against
one ``bf16`` arm::

    PYTHONPATH=$PWD python3 bench/rollout.py --arms 'bf16,jet+kv8,jet+kv8@kv_decode_factored=true'

Every arm's engine (its CUDA graphs, captured under the arm's tuning) is freed before the next arm starts, the FP8
weights are re-quantized for each arm, and Triton's compiled kernels are keyed by the values the tuning passes
them. ``Result.tuning`` lists, per arm, the settings it ran under (``--tuning`` updated by the arm's own); an exact
arm's cost is set against its fast arm (:func:`bench.common.fast_arm_of`, ``Result.exact_fast_arm``).

**Settings** (prompts x samples, new tokens with stops ignored, ``--prompt-len`` prompt tokens, default 256):

* ``b64``: 64 x 1, 1,024 new tokens (the weight-bytes regime)
* ``b256``: 256 x 1, 1,024 new tokens (the KV-bytes regime)
* ``n8``: 32 x 8, 1,024 new tokens (256 sequences sharing their prompts' KV blocks)
* ``b64-2k``: 64 x 1, 2,048 new tokens
* ``b64-8k``: 64 x 1, 8,192 new tokens (long rollouts: the KV bytes outweigh the BF16 weights)

Defaults per shape (the issue-17 table): ``8b``: ``b64,b256,b64-8k``; ``32b``: ``b64,b64-2k`` (at 32B, 256 x 1,280
tokens of BF16 KV, 80 GiB, do not fit next to the weights, and neither do 64 x 8,448); ``1.5b``, ``7b``, ``0.5b``:
``b64,b256``.

**What is measured.** A setting with at most ``--window`` new tokens (default 1,024; ``--window 0``: every
setting whole) runs its whole generation: end-to-end tokens/s (prefill included) and decode-step tokens/s (the
engine's ``decode_tokens_per_s``: tokens of decode steps over the wall time of those steps). A setting with more
new tokens than ``--window W`` is measured in *steady state*: the same sequences, with prompts of
``prompt_len + (new_tokens - W) // 2`` random tokens, generate ``W`` tokens; the ``W - 1`` decode steps then read
contexts centred on the mean context of the full generation, and their tokens/s is reported (the long prefill is
excluded). A decode step's cost is linear in its context, so this equals the full generation's mean decode step
up to that linearity; it is what the full run's decode tokens/s would be, not its end-to-end tokens/s.

**Bytes ceiling of a ratio.** Every ratio is an arm's decode-step tokens/s over ``bf16``'s (end-to-end ratios are
printed as well for whole generations). Its ceiling is the ratio of the bytes one decode step reads, at the mean
context ``C = prompt_len + new_tokens / 2`` of the generation's decode steps (step ``t = 1 .. T-1`` attends over
``prompt_len + t`` tokens), for ``S`` sequences::

    bytes(arm) = W(arm) + S * C * kv(arm)
    W(bf16)    = 2 * P_lin + 2 * P_other
    W(FP8)     = 1 * P_lin + 4 * (number of 128x128 weight blocks) + 2 * P_other       (jet, fp8-rollout)
    kv(BF16)   = 2 * L * H_kv * D * 2                 bytes per token: K and V of every layer
    kv(FP8)    = 2 * L * H_kv * (D * 1 + 4)           E4M3 data + one fp32 scale per token per KV head
    ceiling(arm) = bytes(bf16) / bytes(arm)

with ``P_lin`` the block linears' parameters (q, k, v, o, gate, up, down), ``P_other`` what every step also reads
in BF16 (the LM head, the norms, the biases), ``L`` layers, ``H_kv`` KV heads, ``D`` the head dimension. The
fraction of the ceiling reached is ratio / ceiling. At 8B, ``b256``: 16 GB of BF16 weights against 26 GB of KV at
C = 768, so ``jet``'s ceiling is about 1.24x and ``jet+kv8``'s about 1.9x. The roofline tokens/s (bytes over
``--bandwidth`` or FLOPs over the measured BF16 matmul rate, FP8 linears twice as fast, whichever is slower) is
printed too.

**Mismatch** (``--mismatch``, implied by ``--exact``): every arm's completions are scored by the training forward
(``forward_packed`` with the arm's ``exact`` and, for ``jet+kv8``, ``kv_fp8``: the training side quantizes K and V
too) and the rollout/training |dlogp| mean and max are printed side by side (``jet-exact``: 0 by construction).

**GPU time.** ``--plan`` prints each run's estimated GPU seconds (from the bytes model above at assumed
efficiencies: :class:`PlanAssumptions`) without touching a GPU; ``--max-seconds S`` skips the runs that would end
after ``S`` seconds by that estimate (they show as skipped). The issue-17 table in one process::

    PYTHONPATH=$PWD python3 bench/rollout.py --shape 8b,32b --window 256 --max-seconds 330

(8B: ``b64``, ``b256``, ``b64-8k``; 32B: ``b64``, ``b64-2k``; every setting over 256 decode steps at its mean
context); add ``--plan`` for its estimate, per setting and in all. The default, ``--shape 8b``, runs ``b64`` and
``b256`` whole (end to end, comparable with earlier runs) and ``b64-8k`` over a 1,024-token window.
The ``transformers.generate`` comparison (``--hf``, static cache, a second copy of the weights: 8B and 1.5B only)
is off by default. CPU smoke run: ``python bench/rollout.py --tiny``. ``--json PATH`` saves the results.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import time
from dataclasses import asdict, dataclass, field

import torch

from jetrl.rollout.engine import DEFAULT_DECODE_STEPS

try:  # repository root on sys.path (python -m bench.rollout, the tests)
    from bench.common import (LLAMA31_8B, QWEN2_15B, QWEN25_05B, QWEN25_7B, QWEN25_32B, TINY_LLAMA, Arm,
                              add_tuning_argument, arms_help, fast_arm_of, parse_arm_args, random_prompts,
                              sync)
except ModuleNotFoundError:  # python bench/rollout.py: bench/ itself is on sys.path
    from common import (LLAMA31_8B, QWEN2_15B, QWEN25_05B, QWEN25_7B, QWEN25_32B,  # type: ignore[no-redef]
                        TINY_LLAMA, Arm, add_tuning_argument, arms_help, fast_arm_of, parse_arm_args,
                        random_prompts, sync)

SHAPES = {  # the shared shapes of bench/common.py (1.5b: Qwen2-1.5B, qwen2: q/k/v biases)
    "8b": LLAMA31_8B,
    "32b": QWEN25_32B,
    "1.5b": QWEN2_15B,
    "7b": QWEN25_7B,
    "0.5b": QWEN25_05B,
    "tiny": TINY_LLAMA,
}
GPU_SHAPES = ("8b", "32b", "1.5b", "7b", "0.5b")
HF_SHAPES = ("8b", "1.5b")  # transformers' copy of the weights fits next to ours
DEFAULT_ARMS = "bf16,jet,jet+kv8"
BLOCK = 128  # the FP8 weight block edge (128 x 128, one fp32 scale each)


@dataclass(frozen=True)
class Setting:
    """The work of one setting: ``num_prompts`` x ``n`` sequences, each generating ``new_tokens``."""

    num_prompts: int
    n: int
    new_tokens: int

    @property
    def num_seqs(self) -> int:
        return self.num_prompts * self.n


SETTINGS = {
    "b64": Setting(64, 1, 1024),
    "b256": Setting(256, 1, 1024),
    "n8": Setting(32, 8, 1024),
    "b64-2k": Setting(64, 1, 2048),
    "b64-8k": Setting(64, 1, 8192),
}
DEFAULT_SETTINGS = {"8b": ("b64", "b256", "b64-8k"), "32b": ("b64", "b64-2k"), "1.5b": ("b64", "b256"),
                    "7b": ("b64", "b256"), "0.5b": ("b64", "b256")}
TINY_SETTINGS = {"tiny": Setting(4, 1, 8), "tiny-n2": Setting(2, 2, 8)}


# ------------------------------------------------------------------------------------ what one run measures

@dataclass(frozen=True)
class Measurement:
    """The generation one run performs for a setting: prompts of ``prompt_len`` tokens, ``new_tokens`` each.

    ``window``: a steady-state window of the setting's longer generation (see the module doc), whose decode
    steps have the same mean context; otherwise the whole generation."""

    prompt_len: int
    new_tokens: int
    window: bool

    @property
    def decode_steps(self) -> int:
        """Decode steps per sequence (the first token comes from the prefill)."""
        return self.new_tokens - 1

    @property
    def mean_context(self) -> float:
        """Mean over the decode steps of the tokens each attends over: step t sees prompt_len + t tokens."""
        return self.prompt_len + self.new_tokens / 2


def plan_measurement(prompt_len: int, new_tokens: int, window: int | None) -> Measurement:
    """The whole generation, or (``new_tokens > window``) a window of ``window`` generated tokens after a prompt
    of ``prompt_len + (new_tokens - window) // 2`` tokens: same mean decode context (to half a token)."""
    for name, value in (("prompt_len", prompt_len), ("new_tokens", new_tokens)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 2):
        raise ValueError(f"window must be an int >= 2 (decode steps need a prefilled token first), got {window!r}")
    if window is None or new_tokens <= window:
        return Measurement(prompt_len, new_tokens, False)
    return Measurement(prompt_len + (new_tokens - window) // 2, window, True)


# ---------------------------------------------------------------------------------------- the bytes model

def _config(shape: dict):
    """The :class:`~jetrl.models.DecoderConfig` of a HF-style config dict (biases, tied head, head dim)."""
    from jetrl.models import DecoderConfig

    return DecoderConfig.from_hf(shape)


def _dims(shape: dict) -> tuple[int, int, int, int, int, int, int]:
    """(layers, hidden, heads, KV heads, head dim, intermediate, vocab) of a HF-style config dict."""
    c = _config(shape)
    return (c.num_hidden_layers, c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim,
            c.intermediate_size, c.vocab_size)


def block_linear_shapes(shape: dict) -> list[tuple[int, int]]:
    """(out, in) of one decoder block's linears: q, k, v, o, gate, up, down."""
    _, hidden, heads, kv_heads, head_dim, inter, _ = _dims(shape)
    q, kv = heads * head_dim, kv_heads * head_dim
    return [(q, hidden), (kv, hidden), (kv, hidden), (hidden, q), (inter, hidden), (inter, hidden), (hidden, inter)]


def linear_weight_bytes(shape: dict, fp8: bool) -> int:
    """Bytes of the block linears' weights: BF16, or E4M3 + one fp32 scale per 128 x 128 block (what an FP8
    arm's decode step reads instead of the BF16 weight, and what its FP8 weight cache holds)."""
    linears = block_linear_shapes(shape)
    layers = _dims(shape)[0]
    params = layers * sum(o * i for o, i in linears)
    if not fp8:
        return 2 * params
    return params + 4 * layers * sum(math.ceil(o / BLOCK) * math.ceil(i / BLOCK) for o, i in linears)


def other_weight_bytes(shape: dict) -> int:
    """BF16 bytes every decode step reads besides the block linears: the LM head (the embedding when tied),
    the norms, the biases."""
    layers, hidden, heads, kv_heads, head_dim, inter, vocab = _dims(shape)
    c = _config(shape)
    other = vocab * hidden + (2 * layers + 1) * hidden
    if c.qk_norm:
        other += layers * 2 * head_dim
    if c.qkv_bias:
        other += layers * (heads + 2 * kv_heads) * head_dim
    if c.o_proj_bias:
        other += layers * hidden
    if c.mlp_bias:
        other += layers * (2 * inter + hidden)
    return 2 * other


def weight_bytes(shape: dict, fp8: bool) -> int:
    """Weight bytes one decode step reads (``W`` of the module doc)."""
    return linear_weight_bytes(shape, fp8) + other_weight_bytes(shape)


def kv_bytes_per_token(shape: dict, kv_fp8: bool) -> int:
    """KV-cache bytes of one token: K and V of every layer and KV head, BF16 or E4M3 + one fp32 scale each."""
    layers, _, _, kv_heads, head_dim, _, _ = _dims(shape)
    return 2 * layers * kv_heads * ((head_dim + 4) if kv_fp8 else 2 * head_dim)


def step_bytes(shape: dict, arm: Arm, num_seqs: int, context: float) -> float:
    """Bytes one decode step of ``num_seqs`` sequences reads at ``context`` tokens each: weights + KV."""
    return weight_bytes(shape, arm.rollout_fp8) + num_seqs * context * kv_bytes_per_token(shape, arm.kv_fp8)


def bytes_ceiling(shape: dict, arm: Arm, num_seqs: int, context: float) -> float:
    """The most ``arm`` can gain over ``bf16`` on a bytes-bound decode step: bf16's step bytes over the arm's."""
    return step_bytes(shape, Arm("bf16"), num_seqs, context) / step_bytes(shape, arm, num_seqs, context)


def step_flops(shape: dict, num_seqs: int, context: float) -> tuple[float, float]:
    """(FLOPs of the block linears, the rest: LM head and attention) of one decode step."""
    layers, hidden, heads, _, head_dim, _, vocab = _dims(shape)
    linear = 2 * num_seqs * layers * sum(o * i for o, i in block_linear_shapes(shape))
    rest = 2 * num_seqs * vocab * hidden + 4 * num_seqs * context * layers * heads * head_dim
    return linear, rest


def roofline(shape: dict, arm: Arm, num_seqs: int, context: float, bandwidth: float,
             matmul_flops: float) -> tuple[float, str]:
    """Decode tokens/s if a step only streamed its bytes at ``bandwidth`` or ran its FLOPs at ``matmul_flops``
    (FP8 linears at twice that), whichever is slower, and which one binds."""
    linear, rest = step_flops(shape, num_seqs, context)
    t_bytes = step_bytes(shape, arm, num_seqs, context) / bandwidth
    t_flops = linear / (matmul_flops * (2 if arm.rollout_fp8 else 1)) + rest / matmul_flops
    return num_seqs / max(t_bytes, t_flops), ("bandwidth" if t_bytes >= t_flops else "compute")


# --------------------------------------------------------------------------------------------- the plan

@dataclass(frozen=True)
class PlanAssumptions:
    """What ``--plan`` and ``--max-seconds`` assume of the device: H200 datasheet rates (HBM3e bandwidth, dense
    BF16 matmul), the fraction of them a decode step and a prefill reach, the fixed cost of each arm (engine,
    warm-up generation, CUDA-graph capture), of building random weights, of starting the process (imports,
    Triton compilation), and the device memory left for weights and KV. Planning guesses, not measurements:
    BENCHMARKS.md has those."""

    bandwidth: float = 4.8e12
    matmul_flops: float = 989e12
    decode_efficiency: float = 0.55
    prefill_efficiency: float = 0.45
    arm_seconds: float = 5.0
    build_seconds_per_gb: float = 0.3
    start_seconds: float = 40.0
    device_gib: float = 139.0
    workspace_gib: float = 6.0


def prefill_seconds(shape: dict, num_prompts: int, prompt_len: int, a: PlanAssumptions) -> float:
    """Estimated prefill time of ``num_prompts`` prompts (samples of one prompt share its KV blocks)."""
    layers, hidden, heads, _, head_dim, _, _ = _dims(shape)
    linear_params = layers * sum(o * i for o, i in block_linear_shapes(shape))
    flops = num_prompts * (2 * prompt_len * linear_params + 2 * prompt_len ** 2 * layers * heads * head_dim)
    return flops / (a.matmul_flops * a.prefill_efficiency)


def estimate_arm_seconds(shape: dict, setting: Setting, m: Measurement, arm: Arm, a: PlanAssumptions,
                         repeats: int = 1, mismatch: bool = False) -> float:
    """Estimated GPU seconds of one arm of one setting: set-up and warm-up (a whole generation's warm-up
    prefills the full prompts again; a window's warm-up uses short ones), ``repeats`` timed generations
    (prefill + decode steps at the mean context), and with ``mismatch`` the training forward's scoring."""
    prefill = prefill_seconds(shape, setting.num_prompts, m.prompt_len, a)
    linear, rest = step_flops(shape, setting.num_seqs, m.mean_context)
    step = max(step_bytes(shape, arm, setting.num_seqs, m.mean_context) / (a.bandwidth * a.decode_efficiency),
               (linear + rest) / (a.matmul_flops * a.prefill_efficiency))
    seconds = a.arm_seconds + (0.0 if m.window else prefill) + repeats * (prefill + m.decode_steps * step)
    if mismatch:
        seconds += prefill_seconds(shape, setting.num_seqs, m.prompt_len + m.new_tokens, a)
    return seconds


def kv_needed_bytes(shape: dict, arm: Arm, setting: Setting, m: Measurement, block_size: int = 16) -> int:
    """KV bytes the run needs without preemption: every sequence at its full length, in whole blocks."""
    return setting.num_seqs * math.ceil((m.prompt_len + m.new_tokens) / block_size) * block_size \
        * kv_bytes_per_token(shape, arm.kv_fp8)


def kv_available_bytes(shape: dict, arm: Arm, a: PlanAssumptions, memory_budget: float) -> float:
    """The KV pool ``arm`` gets on the assumed device: ``memory_budget`` of what the BF16 parameters (the
    untied embedding too), the FP8 weight cache of an FP8 arm and a workspace leave."""
    _, hidden, _, _, _, _, vocab = _dims(shape)
    params = weight_bytes(shape, False) + (0 if _config(shape).tie_word_embeddings else 2 * vocab * hidden)
    fp8_cache = linear_weight_bytes(shape, True) if arm.rollout_fp8 else 0
    free = a.device_gib * 2 ** 30 - params - fp8_cache - a.workspace_gib * 2 ** 30
    return max(free, 0.0) * memory_budget


# ------------------------------------------------------------------------------------------------ running

@dataclass
class Result:
    """One setting at one shape, every arm; ratios are over ``bf16`` (see the module doc)."""

    shape: str
    setting: str
    num_prompts: int
    n: int
    prompt_len: int
    new_tokens: int
    measured_prompt_len: int  # what the engine ran (a window: the longer prompt, fewer new tokens)
    measured_new_tokens: int
    window: bool
    mean_context: float  # of the decode steps, the same for the window and the whole generation
    tokens_per_s: dict[str, float] = field(default_factory=dict)  # arm -> end to end of the measured run
    decode_tokens_per_s: dict[str, float] = field(default_factory=dict)  # decode steps only
    over_bf16: dict[str, float] = field(default_factory=dict)  # decode tokens/s over bf16's
    e2e_over_bf16: dict[str, float] = field(default_factory=dict)  # end to end; whole generations only
    ceiling: dict[str, float] = field(default_factory=dict)  # bytes ceiling of over_bf16
    ceiling_fraction: dict[str, float] = field(default_factory=dict)  # over_bf16 / ceiling
    step_bytes: dict[str, float] = field(default_factory=dict)  # at the mean context
    roofline_tokens_per_s: dict[str, float] = field(default_factory=dict)
    decode_roofline_fraction: dict[str, float] = field(default_factory=dict)
    bound: dict[str, str] = field(default_factory=dict)
    preemptions: dict[str, int] = field(default_factory=dict)
    kv_blocks: dict[str, int] = field(default_factory=dict)  # the engine's pool (capped at what the run needs)
    kv_capacity_tokens: dict[str, int] = field(default_factory=dict)
    prefill_seconds: dict[str, float] = field(default_factory=dict)
    decode_seconds: dict[str, float] = field(default_factory=dict)
    host_seconds: dict[str, float] = field(default_factory=dict)
    # with --mismatch: rollout/training |dlogp| per arm; exact arms' end-to-end time over their fast arm's
    mismatch_mean: dict[str, float] = field(default_factory=dict)
    mismatch_max: dict[str, float] = field(default_factory=dict)
    exact_over_fast: dict[str, float] = field(default_factory=dict)
    exact_fast_arm: dict[str, str] = field(default_factory=dict)  # exact arm -> the fast arm of exact_over_fast
    exact_over_bf16: dict[str, float] = field(default_factory=dict)
    # arm -> the kernels' tuning fields set for it (--tuning, updated by the arm's own @KEY=VALUE); empty: defaults
    tuning: dict[str, dict] = field(default_factory=dict)
    hf_tokens_per_s: float = 0.0
    engine_over_hf: float = 0.0
    skipped: list[str] = field(default_factory=list)  # arms not run (--max-seconds)


def _run_engine(model, prompts, warmup_prompts, n, new_tokens, arm: Arm, args, device) -> tuple[float, dict, list]:
    """One arm's engine: a short warm-up generation (graph capture, kernel compilation), ``args.repeats`` timed
    generations (the median reported), then the engine and its KV cache are freed."""
    from jetrl.rollout import RolloutEngine, SamplingParams

    engine = RolloutEngine(model, memory_budget=args.memory_budget if device.type == "cuda" else 2 ** 30,
                           max_num_seqs=len(prompts) * n, max_num_batched_tokens=args.max_num_batched_tokens,
                           max_model_len=len(prompts[0]) + new_tokens, progress=args.progress,
                           cuda_graphs=not args.no_cuda_graphs, exact=arm.exact, kv_fp8=arm.kv_fp8,
                           decode_steps=args.decode_steps)
    # a seed per prompt, as the trainer gives (jetrl.rl.trainer): the sampler's path of jetrl train
    params = [SamplingParams(n=n, temperature=1.0, max_tokens=new_tokens, ignore_eos=True, seed=i)
              for i in range(len(prompts))]
    # the warm-up samples as the timed generations do (seeded: the same sampling kernels) and runs past one decode
    # run, so that no kernel is compiled and no graph captured inside the timing (the first arm of a fresh machine
    # compiled the seeded sampler there)
    warm_tokens = min(2 * max(1, args.decode_steps) + 1, new_tokens)
    engine.generate(warmup_prompts, [SamplingParams(n=n, temperature=1.0, max_tokens=warm_tokens, ignore_eos=True,
                                                    seed=i) for i in range(len(warmup_prompts))])
    times = []
    try:
        for _ in range(args.repeats):
            sync(device)
            start = time.perf_counter()
            outs = engine.generate(prompts, params)
            sync(device)
            times.append(time.perf_counter() - start)
            if sum(len(o.token_ids) for o in outs) != len(prompts) * n * new_tokens:
                raise RuntimeError(f"{arm.name}: generated {sum(len(o.token_ids) for o in outs)} tokens, expected "
                                   f"{len(prompts) * n * new_tokens} (stops are ignored)")
        stats = dict(engine.last_stats)
    finally:
        engine.free_cache()
        del engine
    seconds = sorted(times)[len(times) // 2]
    return len(prompts) * n * new_tokens / seconds, stats, outs


def mismatch(model, prompts, outs, arm: Arm, device, max_tokens: int = 16384) -> tuple[float, float]:
    """Mean and max |engine log-prob - training-forward log-prob| over every generated token. The training
    forward is ``forward_packed`` with the arm's ``exact`` and, where the recipe trains in FP8, its ``kv_fp8``
    (``fp8-rollout+kv8`` quantizes the rollout's cache only); it runs in micro-batches of at most
    ``max_tokens`` tokens."""
    from jetrl.models import token_logprobs

    total, count, worst = 0.0, 0, 0.0
    start = 0
    while start < len(outs):
        group, used = [], 0
        while start < len(outs) and (not group or used + len(prompts[outs[start].prompt_index]) +
                                     len(outs[start].token_ids) <= max_tokens):
            used += len(prompts[outs[start].prompt_index]) + len(outs[start].token_ids)
            group.append(outs[start])
            start += 1
        ids, pos, cu, tg = [], [], [0], []
        for c in group:
            seq = list(prompts[c.prompt_index]) + list(c.token_ids)
            ids, pos, tg = ids + seq, pos + list(range(len(seq))), tg + seq[1:] + [-1]
            cu.append(cu[-1] + len(seq))
        with torch.no_grad():
            lp, _ = token_logprobs(model, torch.tensor(ids, device=device), torch.tensor(pos, device=device),
                                   torch.tensor(cu, device=device), None, torch.tensor(tg, device=device), 1.0,
                                   exact=arm.exact, kv_fp8=arm.train_kv_fp8)
        lp = lp.cpu()
        for i, c in enumerate(group):
            first = cu[i] + len(prompts[c.prompt_index]) - 1
            diff = (lp[first:first + len(c.token_ids)] - torch.tensor(c.logprobs, dtype=torch.float32)).abs()
            total, count, worst = total + float(diff.sum()), count + diff.numel(), max(worst, float(diff.max()))
    return total / max(count, 1), worst


def _run_hf(model, prompts, n, new_tokens, device) -> float:
    """``transformers`` generate with a static cache on a copy of the same weights (BF16)."""
    import transformers

    hf_config = transformers.AutoConfig.for_model(**model.config.to_hf())
    with torch.device(device):  # initialised on the device (fast), then overwritten with our weights
        try:
            hf = transformers.AutoModelForCausalLM.from_config(hf_config, dtype=model.dtype)
        except TypeError:  # transformers < 4.56 names it torch_dtype
            hf = transformers.AutoModelForCausalLM.from_config(hf_config, torch_dtype=model.dtype)
    missing, unexpected = hf.load_state_dict(model.state_dict(), strict=False)
    missing = [k for k in missing if not (hf_config.tie_word_embeddings and "lm_head" in k)]
    if missing or unexpected:
        raise RuntimeError(f"weights do not map onto transformers' model: missing {missing[:4]}, "
                           f"unexpected {unexpected[:4]}")
    hf.eval()
    ids = torch.tensor([p for p in prompts for _ in range(n)], device=device)
    kwargs = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=True, temperature=1.0, top_k=0,
                  top_p=1.0, cache_implementation="static", pad_token_id=0,
                  attention_mask=torch.ones_like(ids))
    with torch.no_grad():
        hf.generate(ids, **{**kwargs, "max_new_tokens": 4, "min_new_tokens": 4})  # warm-up
        sync(device)
        start = time.perf_counter()
        out = hf.generate(ids, **kwargs)
        sync(device)
        seconds = time.perf_counter() - start
    assert out.shape[1] - ids.shape[1] == new_tokens
    del hf
    _release(device)
    return ids.shape[0] * new_tokens / seconds


def _release(device: torch.device) -> None:
    """Return freed tensors' memory to the device (engines, FP8 weight caches, a shape's model)."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _measure_device(device: torch.device) -> tuple[float, float]:
    """Copy bandwidth (bytes/s, read + write) and BF16 matmul rate (FLOP/s) on ``device``."""
    if device.type != "cuda":
        return 50e9, 1e11
    src = torch.empty(1 << 30, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)

    def timed(fn, reps):
        fn()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        times = []
        for _ in range(reps):
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        return sorted(times)[len(times) // 2]

    bw = 2 * src.numel() / timed(lambda: dst.copy_(src), 20)
    flops = 2 * 8192 ** 3 / timed(lambda: a @ b, 20)
    return bw, flops  # the buffers are freed on return


def run_setting(model, shape_name: str, shape: dict, setting_name: str, setting: Setting, arms: list[Arm], args,
                device, bandwidth: float, matmul_flops: float, deadline: float | None) -> Result:
    """Every arm of one setting on ``model`` (recipes swapped in place), each inside ``tuning.override`` of its own
    settings (weight quantization, engine, warm-up, timing, scoring); the model is back in ``bf16`` after."""
    from jetrl.quant import apply_recipe, refresh_fp8_weights
    from jetrl.quant.kernels import tuning

    m = plan_measurement(args.prompt_len, args.new_tokens or setting.new_tokens, args.window)
    res = Result(shape_name, setting_name, setting.num_prompts, setting.n, args.prompt_len,
                 args.new_tokens or setting.new_tokens, m.prompt_len, m.new_tokens, m.window, m.mean_context)
    prompts = random_prompts(setting.num_prompts, m.prompt_len, shape["vocab_size"], seed=m.prompt_len)
    # a window's warm-up only compiles and captures: short prompts spare a second long prefill
    warmup = [p[:16] for p in prompts] if m.window else prompts
    what = (f"a window of {m.new_tokens} tokens after {m.prompt_len}-token prompts (decode steps at the mean "
            f"context {m.mean_context:g} of {res.prompt_len} + {res.new_tokens})" if m.window else
            f"{res.prompt_len} + {res.new_tokens} tokens, whole generation")
    print(f"[{shape_name} {setting_name}] {setting.num_prompts} prompts x {setting.n}: {what}", flush=True)
    assumptions = PlanAssumptions()
    try:
        for arm in arms:
            if deadline is not None and time.perf_counter() + estimate_arm_seconds(
                    shape, setting, m, arm, assumptions, args.repeats, args.mismatch) > deadline:
                res.skipped.append(arm.name)
                print(f"[{shape_name} {setting_name}] {arm.name}: skipped (--max-seconds)", flush=True)
                continue
            with tuning.override(**arm.tuning):  # nested in the run's --tuning: the arm's settings win
                apply_recipe(model, arm.recipe)  # swaps linear layers in place, sharing the parameters
                # quantize the FP8 weights now (under the arm's tuning), so the engine sizes its KV pool from the
                # memory they leave
                refresh_fp8_weights(model, eager=True)
                tps, stats, outs = _run_engine(model, prompts, warmup, setting.n, m.new_tokens, arm, args, device)
                if args.mismatch:
                    res.mismatch_mean[arm.name], res.mismatch_max[arm.name] = mismatch(model, prompts, outs, arm,
                                                                                       device)
                del outs
            _release(device)
            name = arm.name
            res.tuning[name] = dict(sorted({**args.tuning, **arm.tuning}.items()))
            res.tokens_per_s[name] = tps
            res.decode_tokens_per_s[name] = stats["decode_tokens_per_s"]
            res.prefill_seconds[name], res.decode_seconds[name] = stats["prefill_seconds"], stats["decode_seconds"]
            res.host_seconds[name] = stats["host_seconds"]
            res.preemptions[name] = int(stats["preemptions"])
            res.kv_blocks[name] = int(stats["num_blocks"])
            res.kv_capacity_tokens[name] = int(stats["kv_capacity_tokens"])
            res.step_bytes[name] = step_bytes(shape, arm, setting.num_seqs, m.mean_context)
            roof, res.bound[name] = roofline(shape, arm, setting.num_seqs, m.mean_context, bandwidth, matmul_flops)
            res.roofline_tokens_per_s[name] = roof
            res.decode_roofline_fraction[name] = stats["decode_tokens_per_s"] / roof
            e2e = f"{tps:,.0f} tok/s end to end, " if not m.window else ""
            print(f"[{shape_name} {setting_name}] {name}: {e2e}decode steps {stats['decode_tokens_per_s']:,.0f} "
                  f"tok/s ({res.decode_roofline_fraction[name]:.1%} of the {res.bound[name]} roofline "
                  f"{roof:,.0f}); prefill {stats['prefill_seconds']:.2f} s, decode {stats['decode_seconds']:.2f} s, "
                  f"host time not waiting for the GPU {res.host_seconds[name]:.2f} s of {stats['seconds']:.2f} s; "
                  f"{res.kv_blocks[name]} KV blocks ({res.kv_capacity_tokens[name]:,} tokens), "
                  f"{res.preemptions[name]} preemptions"
                  + (" (not steady state: the pool is too small)" if res.preemptions[name] else ""), flush=True)
    finally:
        apply_recipe(model, "bf16")  # drops the FP8 modules and their cached weights
        _release(device)
    _ratios(res, shape, setting, arms)
    for name in res.over_bf16:
        e2e = f", end to end {res.e2e_over_bf16[name]:.2f}x" if name in res.e2e_over_bf16 else ""
        print(f"[{shape_name} {setting_name}] {name} / bf16 = {res.over_bf16[name]:.2f}x (decode steps{e2e}); bytes "
              f"ceiling {res.ceiling[name]:.2f}x, {res.ceiling_fraction[name]:.0%} of it", flush=True)
    if res.exact_over_fast:
        print(f"[{shape_name} {setting_name}] exact arms' time over their fast arm's (end to end): "
              + ", ".join(f"{a} {v:.2f}x (over {res.exact_fast_arm[a]})" for a, v in res.exact_over_fast.items()),
              flush=True)
    if args.mismatch:
        print(f"[{shape_name} {setting_name}] {mismatch_line(res)}", flush=True)
    return res


def _ratios(res: Result, shape: dict, setting: Setting, arms: list[Arm]) -> None:
    """Fill the ratios over ``bf16``, their bytes ceilings and the exact arms' cost, from the measured arms."""
    ran = {a.name: a for a in arms if a.name in res.decode_tokens_per_s}
    if "bf16" in ran:
        for name, arm in ran.items():
            if name == "bf16":
                continue
            res.over_bf16[name] = res.decode_tokens_per_s[name] / res.decode_tokens_per_s["bf16"]
            if not res.window:
                res.e2e_over_bf16[name] = res.tokens_per_s[name] / res.tokens_per_s["bf16"]
            res.ceiling[name] = bytes_ceiling(shape, arm, setting.num_seqs, res.mean_context)
            res.ceiling_fraction[name] = res.over_bf16[name] / res.ceiling[name]
    for name, arm in ran.items():
        fast = fast_arm_of(arm, ran)
        if fast is not None:
            res.exact_fast_arm[name] = fast
            res.exact_over_fast[name] = res.tokens_per_s[fast] / res.tokens_per_s[name]
        if arm.exact and "bf16" in ran:
            res.exact_over_bf16[name] = res.tokens_per_s["bf16"] / res.tokens_per_s[name]


def mismatch_line(res: Result) -> str:
    """Every arm's rollout/training |dlogp| mean / max, side by side."""
    return "rollout/training mismatch |dlogp| mean / max: " + ", ".join(
        f"{a} {res.mismatch_mean[a]:.2e} / {res.mismatch_max[a]:.2e}" for a in res.mismatch_mean)


def format_table(results: list[Result]) -> str:
    """The short summary table: one row per shape, setting and arm."""
    header = ["shape", "setting", "measured", "arm", "tok/s", "decode tok/s", "/bf16", "e2e /bf16", "ceiling",
              "of ceiling", "preempt"]
    rows = []
    for r in results:
        size = f"{r.num_prompts}x{r.n} {r.prompt_len}+{r.new_tokens}" if r.n > 1 else \
            f"{r.num_prompts} {r.prompt_len}+{r.new_tokens}"
        measured = f"window {r.measured_new_tokens} @ctx {r.mean_context:g}" if r.window else "whole"
        for arm in [*r.decode_tokens_per_s, *r.skipped]:
            if arm in r.skipped:
                rows.append([r.shape, f"{r.setting} ({size})", measured, arm, "skipped", "-", "-", "-", "-", "-", "-"])
                continue
            rows.append([
                r.shape, f"{r.setting} ({size})", measured, arm,
                "-" if r.window else f"{r.tokens_per_s[arm]:,.0f}", f"{r.decode_tokens_per_s[arm]:,.0f}",
                f"{r.over_bf16[arm]:.2f}x" if arm in r.over_bf16 else ("1.00x" if arm == "bf16" else "-"),
                f"{r.e2e_over_bf16[arm]:.2f}x" if arm in r.e2e_over_bf16 else "-",
                f"{r.ceiling[arm]:.2f}x" if arm in r.ceiling else "-",
                f"{r.ceiling_fraction[arm]:.0%}" if arm in r.ceiling_fraction else "-",
                str(r.preemptions[arm])])
    widths = [max(len(h), *(len(row[i]) for row in rows)) if rows else len(h) for i, h in enumerate(header)]
    lines = ["  ".join(h.ljust(w) if i < 4 else h.rjust(w) for i, (h, w) in enumerate(zip(header, widths)))]
    for row in rows:
        lines.append("  ".join(c.ljust(w) if i < 4 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths))))
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------------- main

def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="8b", help=f"comma list of {list(GPU_SHAPES)}")
    parser.add_argument("--settings", default=None,
                        help=f"comma list of {list(SETTINGS)} (default per shape: {DEFAULT_SETTINGS})")
    parser.add_argument("--arms", "--recipes", dest="arms", default=DEFAULT_ARMS,
                        help=arms_help("jet+kv8@kv_decode_factored=true"))
    parser.add_argument("--exact", action="store_true", help="also run jet in exact mode (the arm jet-exact)")
    parser.add_argument("--mismatch", action="store_true",
                        help="score every arm's completions with the training forward (implied by --exact)")
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--new-tokens", type=int, default=None, help="override every setting's new tokens")
    parser.add_argument("--window", type=int, default=1024,
                        help="settings with more new tokens are measured over this many at their mean context "
                             "(0: none)")
    parser.add_argument("--max-seconds", type=float, default=None,
                        help="skip the runs that would end after this many seconds (by the --plan estimate)")
    parser.add_argument("--plan", action="store_true",
                        help="print the runs and their estimated GPU seconds; run nothing")
    parser.add_argument("--hf", action="store_true", help="compare with transformers.generate (8b, 1.5b)")
    parser.add_argument("--no-hf", action="store_true", help="(the default; kept for older command lines)")
    parser.add_argument("--hf-new-tokens", type=int, default=None, help="new tokens for transformers (default: same)")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--memory-budget", type=float, default=0.85, help="fraction of free GPU memory for KV")
    parser.add_argument("--max-num-batched-tokens", type=int, default=16384)
    parser.add_argument("--bandwidth", type=float, default=4.3e12, help="bytes/s for the roofline")
    parser.add_argument("--no-cuda-graphs", action="store_true")
    parser.add_argument("--decode-steps", type=int, default=DEFAULT_DECODE_STEPS,
                        help="decode steps the engine runs per host iteration (1: the host between every step)")
    parser.add_argument("--progress", action="store_true")
    parser.add_argument("--tiny", action="store_true", help="CPU smoke run: tiny model, 4 prompts, 8 tokens")
    parser.add_argument("--json", default=None)
    add_tuning_argument(parser)
    args = parse_arm_args(parser, argv)
    if args.exact and "jet-exact" not in [a.name for a in args.arms]:
        args.arms.append(Arm("jet", exact=True))
    args.mismatch = args.mismatch or args.exact
    for name in ("prompt_len", "new_tokens", "repeats", "max_num_batched_tokens", "hf_new_tokens"):
        value = getattr(args, name)
        if value is not None and value < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {value}")
    if args.window == 0:
        args.window = None
    if args.window is not None and args.window < 2:
        parser.error(f"--window must be >= 2 (or 0: no window), got {args.window}")
    if args.max_seconds is not None and args.max_seconds <= 0:
        parser.error(f"--max-seconds must be positive, got {args.max_seconds}")
    if not 0 < args.memory_budget <= 1:
        parser.error(f"--memory-budget is a fraction in (0, 1], got {args.memory_budget}")
    if args.tiny:
        names = [s.strip() for s in (args.settings or ",".join(TINY_SETTINGS)).split(",") if s.strip()]
        unknown = [n for n in names if n not in TINY_SETTINGS]
        if not names or unknown:
            parser.error(f"--settings: unknown {unknown or args.settings!r}; --tiny has {list(TINY_SETTINGS)}")
        args.shapes = {"tiny": {n: TINY_SETTINGS[n] for n in names}}
        args.prompt_len = 8
        return args
    shapes = [s.strip() for s in args.shape.split(",") if s.strip()]
    unknown = [s for s in shapes if s not in GPU_SHAPES]
    if not shapes or unknown:
        parser.error(f"--shape: unknown {unknown or args.shape!r}; choose from {list(GPU_SHAPES)}")
    if args.hf and any(s not in HF_SHAPES for s in shapes):
        parser.error(f"--hf needs a second copy of the weights: only shapes {list(HF_SHAPES)}")
    args.shapes = {}
    for shape in shapes:
        names = ([s.strip() for s in args.settings.split(",") if s.strip()] if args.settings
                 else list(DEFAULT_SETTINGS[shape]))
        unknown = [s for s in names if s not in SETTINGS]
        if not names or unknown:
            parser.error(f"--settings: unknown {unknown or args.settings!r}; choose from {list(SETTINGS)}")
        args.shapes[shape] = {s: SETTINGS[s] for s in names}
    return args


@dataclass(frozen=True)
class PlanRow:
    """One line of ``--plan``: building a shape's weights (``setting`` and ``arm`` None) or one arm of a setting,
    its estimated seconds, and for an arm the KV bytes it needs against the pool it would get."""

    shape: str
    setting: str | None
    arm: str | None
    seconds: float
    kv_needed: int = 0
    kv_pool: float = 0.0
    what: str = ""

    @property
    def preempts(self) -> bool:
        return self.kv_needed > self.kv_pool

    def __str__(self) -> str:
        if self.setting is None:
            return f"{self.shape}: build {self.seconds:.0f} s"
        return (f"{self.shape} {self.setting} {self.arm}: {self.seconds:.0f} s ({self.what}); KV "
                f"{self.kv_needed / 2 ** 30:.1f} GiB of a {self.kv_pool / 2 ** 30:.0f} GiB pool"
                + (" -- preempts" if self.preempts else ""))


def plan(args, assumptions: PlanAssumptions | None = None) -> tuple[float, list[PlanRow]]:
    """Estimated GPU seconds of the whole run (process start included) and its rows: each shape's build, then
    each setting's arms with the KV they need against the assumed device's pool (a run that needs more
    preempts and does not measure steady state)."""
    a = assumptions or PlanAssumptions()
    total, rows = a.start_seconds, []
    for shape_name, settings in args.shapes.items():
        shape = SHAPES[shape_name]
        rows.append(PlanRow(shape_name, None, None, weight_bytes(shape, False) / 1e9 * a.build_seconds_per_gb))
        for name, setting in settings.items():
            m = plan_measurement(args.prompt_len, args.new_tokens or setting.new_tokens, args.window)
            for arm in args.arms:
                rows.append(PlanRow(shape_name, name, arm.name,
                                    estimate_arm_seconds(shape, setting, m, arm, a, args.repeats, args.mismatch),
                                    kv_needed_bytes(shape, arm, setting, m),
                                    kv_available_bytes(shape, arm, a, args.memory_budget),
                                    f"{'window' if m.window else 'whole'} {m.prompt_len} + {m.new_tokens}"))
    return total + sum(r.seconds for r in rows), rows


def main(argv: list[str] | None = None) -> list[Result]:
    from jetrl.quant.kernels import tuning

    args = _parse(argv)
    with tuning.override(**args.tuning):
        return _main(args)


def _main(args: argparse.Namespace) -> list[Result]:
    if args.plan:
        total, rows = plan(args)
        print("\n".join(map(str, rows)))
        print(f"estimated GPU seconds in all (assumptions: {PlanAssumptions()}): {total:.0f}")
        return []
    started = time.perf_counter()
    deadline = None if args.max_seconds is None else started + args.max_seconds
    from jetrl.models import build_model

    if args.tiny:
        device, dtype = torch.device("cpu"), torch.float32
    else:
        if not torch.cuda.is_available():
            raise SystemExit("bench/rollout.py needs a CUDA GPU (use --tiny for a CPU smoke run, --plan for the "
                             "estimate)")
        device, dtype = torch.device("cuda"), torch.bfloat16
    bandwidth_measured, matmul_flops = _measure_device(device)
    _release(device)
    bandwidth = args.bandwidth if device.type == "cuda" else bandwidth_measured
    print(f"device {torch.cuda.get_device_name() if device.type == 'cuda' else 'cpu'}: copy bandwidth "
          f"{bandwidth_measured / 1e12:.2f} TB/s measured (roofline uses {bandwidth / 1e12:.2f}), BF16 matmul "
          f"{matmul_flops / 1e12:.0f} TFLOP/s; arms {[a.name for a in args.arms]}", flush=True)

    results = []
    for shape_name, settings in args.shapes.items():
        shape = SHAPES[shape_name]
        # seed=None draws the random weights on the device itself (a CPU generator would take minutes at 8B)
        model = build_model(shape, dtype=dtype, device=device, recipe="bf16",
                            seed=0 if device.type == "cpu" else None)
        try:
            for setting_name, setting in settings.items():
                res = run_setting(model, shape_name, shape, setting_name, setting, args.arms, args, device,
                                  bandwidth, matmul_flops, deadline)
                if args.hf:
                    hf_tokens = args.hf_new_tokens or res.new_tokens
                    prompts = random_prompts(setting.num_prompts, res.prompt_len, shape["vocab_size"],
                                             seed=res.prompt_len)
                    res.hf_tokens_per_s = _run_hf(model, prompts, setting.n, hf_tokens, device)
                    if "bf16" in res.tokens_per_s:
                        res.engine_over_hf = res.tokens_per_s["bf16"] / res.hf_tokens_per_s
                    print(f"[{shape_name} {setting_name}] transformers.generate (static cache, {hf_tokens} new "
                          f"tokens): {res.hf_tokens_per_s:,.0f} tok/s; engine bf16 / transformers = "
                          f"{res.engine_over_hf:.2f}x", flush=True)
                results.append(res)
        finally:
            del model  # one shape's weights on the device at a time
            _release(device)
    if args.json:
        with open(args.json, "w") as f:
            json.dump([asdict(r) for r in results], f, indent=2)
    print(f"\nrollout throughput ({time.perf_counter() - started:.0f} s); /bf16 and the bytes ceiling are of "
          f"decode-step tokens/s, e2e /bf16 of whole generations (prefill included)")
    print(format_table(results), flush=True)
    return results


if __name__ == "__main__":
    main()
