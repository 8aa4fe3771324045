"""One RL step on several GPUs (FSDP2 + data-parallel rollout), ``bf16`` vs ``jet``: phases, memory, comms.

The distributed sibling of ``bench/rl_step.py`` (same step, same setting, same trainer): launch it with
``torchrun --nproc-per-node N``; every rank builds the policy, :class:`jetrl.rl.trainer.Trainer` shards it (and the
reference) with FSDP2 over the N GPUs and each rank rolls out and trains on 1/N of the prompt groups.
Without torchrun it is the one-GPU run (no sharding) of the same step: the scaling baseline.

Reported per recipe (rank 0 prints, ``$OUT/rl_step_parallel.json`` gets everything):

* per-phase seconds (the slowest rank's, as the trainer's metrics report them), jet/bf16 ratios;
* tokens/s per GPU for rollout and the training phases, and *block-tokens*/s per GPU (tokens x decoder
  blocks / s / GPU), which compares a 32-block model on 2 GPUs with a 16-block one on 1 GPU;
* peak memory of every GPU;
* ``weight_gather``: what the rollout pays before decoding, timed after the timed steps in the state a
  step leaves (:func:`time_weight_gather`): entering :func:`jetrl.parallel.full_weights` (FSDP2 all-gathers
  every BF16 parameter), the first FP8 quantization of the rollout side's linears on those full weights,
  leaving it; synchronized seconds (median of 3, slowest rank) and (gather + quantization) / rollout phase.
  Gathering FP8 instead of BF16 halves the bytes, so it could save at most half of ``gather_s``;
* with ``--profile`` one more (untimed) step under ``torch.profiler``, its phases inside ``record_function``
  ranges the bench sets on the trainer object (:func:`phase_ranges`; the library emits none):

  - ``collective_seconds``: per collective kind (all-gather, reduce-scatter, all-reduce) the summed
    duration of the NCCL kernels (the gloo ops' host time on CPU), slowest rank, and
    ``collective_share_of_step`` = their sum / the timed step. An upper bound: NCCL kernels run on their own
    stream alongside compute, and their time includes waiting for the peer;
  - ``comm_overlap`` (GPU only; ``None`` on CPU, where gloo runs no device kernels): from every device
    activity's interval (:func:`device_kernels`), per rank (``per_rank``) and the slowest rank's per number
    (``max``), within the profiled step's window: ``comm_kernel_s`` (summed NCCL kernel time),
    ``comm_busy_s`` (their union), ``compute_busy_s`` (the union of every other kernel, memcpy and memset, on
    any stream) and ``exposed_comm_s`` = |NCCL union minus compute union|, the time the GPU communicates and
    does nothing else (:mod:`bench.comm_overlap`); the same per kind (``kinds``: ``kernel_s``, ``busy_s``,
    ``exposed_s``) and per phase (``phases``, with ``other`` for the step outside them: weight refresh and
    the metrics' gathers); ``exposed_comm_share_of_step`` = ``max.exposed_comm_s`` / the timed step, the
    overlap-corrected share (``None`` on CPU). A rank that reaches a collective first spins in its
    NCCL kernel until the slowest arrives; with nothing else running that wait counts as exposed, so
    ``exposed_comm_s`` also holds load imbalance between ranks (e.g. in ``reward``, after uneven rollouts);
  - ``profiled_step``: the profiled step's and its phases' host seconds (slowest rank; the profiler slows
    the host side, so these run longer than the timed steps).

Commands (2 x H200, the full 32-block Llama-3.1-8B shape, reference model on; each recipe separately to
stay within a 10-minute call)::

    torchrun --nproc-per-node 2 bench/rl_step_parallel.py --recipes bf16 --layers 32
    torchrun --nproc-per-node 2 bench/rl_step_parallel.py --recipes jet --layers 32 --profile
    python bench/rl_step_parallel.py --recipes bf16,jet --layers 16        # 1 GPU: the scaling baseline

CPU smoke run: ``--tiny`` (optionally under ``torchrun --nproc-per-node 2``, gloo).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import gc
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Iterator

import torch

if __package__ in (None, ""):  # python bench/rl_step_parallel.py / torchrun: make ``bench.`` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.comm_overlap import COLLECTIVES, collective_kind, is_nccl, length, overlap_summary  # noqa: E402
from bench.common import (DEFAULT_ARMS, LLAMA31_8B, TINY_LLAMA, device_description, recipe_names,  # noqa: E402
                          with_layers, write_report)
from bench.rl_step import (PHASES, RandomPrompts, Setting, _check_step, build_run_config, decode_ids,  # noqa: E402
                           even_token_reward, parameter_counts, speedups)

RANGE_PREFIX = "rl_step_parallel/"  # record_function ranges of the profiled step: "step" and one per phase
# the trainer's phase methods and the phase each is timed as (score: old_logprob or reference, by its model)
PHASE_METHODS = {"rollout": "rollout", "build_batch": "reward", "score": None, "update": "update"}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def collective_seconds(prof: Any, device: torch.device) -> dict[str, float]:
    """Seconds per collective kind in a ``torch.profiler`` run: on GPU the summed duration of the NCCL
    kernels (:func:`device_kernels`, so neither the host ops nor the device copies of ProcessGroupNCCL's
    ``nccl:*`` ranges, which ``key_averages`` would add to the kernels' time); on CPU the gloo ops' host
    time (``key_averages``). An upper bound (overlapped or not; see :func:`bench.comm_overlap.overlap_summary`
    for the exposed part)."""
    out = {kind: 0.0 for kind in COLLECTIVES}
    if device.type == "cuda":
        timed = [(name, end - start) for name, start, end in device_kernels(prof.events()) if is_nccl(name)]
    else:
        timed = [(e.key, e.cpu_time_total / 1e6) for e in prof.key_averages() if e.key.lower().startswith("gloo:")]
    for name, seconds in timed:
        kind = collective_kind(name)
        if kind is not None:
            out[kind] += seconds
    return out


def device_kernels(events: Any) -> list[tuple[str, float, float]]:
    """``(name, start_s, end_s)`` of every device activity in ``prof.events()`` (kernels, memcpy, memset),
    times on the profiler's clock (the host's, which kineto maps the GPU timestamps onto).

    ``prof.events()`` holds one ``FunctionEvent`` per kineto event, device ones with ``device_type`` CUDA and
    their own ``time_range`` (torch 2.11 and 2.13 alike; ``key_averages`` would sum them and lose the
    intervals). A ``record_function`` range also appears on the device timeline (``gpu_user_annotation``)
    with ``device_type`` CUDA and ``is_user_annotation`` set; those are spans, not work, and are left out (as
    torch's own table does when it sums device time). The chrome-trace export would give the same intervals
    through a file of several hundred MB for an 8B step. A device event named like a host-side range is
    left out too: should a torch version not flag the device copy of a range, it would otherwise count a
    whole phase as compute and hide every collective in it."""
    from torch.autograd import DeviceType

    ranges = {e.name for e in events if e.device_type == DeviceType.CPU and e.is_user_annotation}
    return [(e.name, e.time_range.start / 1e6, e.time_range.end / 1e6) for e in events
            if e.device_type == DeviceType.CUDA and not e.is_user_annotation and e.name not in ranges]


def range_windows(events: Any, prefix: str = RANGE_PREFIX) -> dict[str, list[tuple[float, float]]]:
    """The host windows (seconds) of the ``record_function`` ranges named ``prefix + NAME``, by ``NAME``."""
    from torch.autograd import DeviceType

    out: dict[str, list[tuple[float, float]]] = {}
    for e in events:
        if e.device_type == DeviceType.CPU and e.name.startswith(prefix):
            out.setdefault(e.name[len(prefix):], []).append((e.time_range.start / 1e6, e.time_range.end / 1e6))
    return out


@contextlib.contextmanager
def phase_ranges(trainer: Any, device: torch.device) -> Iterator[None]:
    """Within the block, the trainer's phase methods (:data:`PHASE_METHODS`) run inside ``record_function``
    ranges named after their phase, ending with a device synchronize (the trainer's phase timer synchronizes
    right after them anyway), so each phase's kernels lie inside its range's window. The wrappers are set on
    this trainer object only and removed on exit; the library is untouched."""
    from torch.profiler import record_function

    def wrap(attr: str, phase: str | None) -> Any:
        method = getattr(trainer, attr)

        @functools.wraps(method)
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            name = phase or ("reference" if args[0] is trainer.ref_model else "old_logprob")
            with record_function(RANGE_PREFIX + name):
                out = method(*args, **kwargs)
                _sync(device)
            return out
        return wrapped

    for attr, phase in PHASE_METHODS.items():
        setattr(trainer, attr, wrap(attr, phase))
    try:
        yield
    finally:
        for attr in PHASE_METHODS:
            delattr(trainer, attr)


def time_weight_gather(model: Any, device: torch.device, repeats: int = 3) -> dict[str, float]:
    """What the rollout pays before it decodes, in the state a step leaves (weights updated, FP8 caches
    dropped): ``gather_s``, entering :func:`jetrl.parallel.full_weights` (FSDP2 all-gathers every parameter;
    a no-op on one rank); ``quantize_s``, the first FP8 quantization of the rollout side's FP8 linears on the
    full weights (what the engine's first forward does; nothing on one rank, whose refresh quantized eagerly,
    nor in ``bf16``); ``release_s``, leaving it (the reshard). Synchronized wall seconds, median of
    ``repeats``; the FP8 caches are dropped again afterwards, so the next step starts as it would have."""
    from jetrl.parallel import full_weights, refresh_rollout_weights
    from jetrl.quant import fp8_linears

    layers = [m for m in fp8_linears(model) if m.fp8_rollout]
    times: dict[str, list[float]] = {"gather_s": [], "quantize_s": [], "release_s": []}
    for _ in range(repeats):
        refresh_rollout_weights(model)  # exactly what the step's weight_refresh phase leaves
        _sync(device)
        t0 = time.perf_counter()
        with full_weights(model):
            _sync(device)
            t1 = time.perf_counter()
            for layer in layers:
                layer.quantized_weight()
            _sync(device)
            t2 = time.perf_counter()
        _sync(device)
        t3 = time.perf_counter()
        for key, value in zip(times, (t1 - t0, t2 - t1, t3 - t2)):
            times[key].append(value)
    refresh_rollout_weights(model)
    return {key: statistics.median(values) for key, values in times.items()}


def _max_over_ranks(values: list[Any]) -> Any:
    """Leaf-wise maximum of equally shaped nested dicts of numbers (one per rank)."""
    if isinstance(values[0], dict):
        return {key: _max_over_ranks([v[key] for v in values]) for key in values[0]}
    return max(values)


def run_recipe(recipe: str, shape: dict, setting: Setting, parallel: Any, warmup: int, steps: int,
               memory_budget: float, profile: bool) -> dict[str, Any]:
    """Build, shard and run ``warmup + steps`` RL steps (+ one profiled step); the timed steps' medians."""
    from jetrl.models import build_model
    from jetrl.rl.trainer import Trainer
    from jetrl.rollout import RolloutEngine

    device = parallel.device
    config = build_run_config(recipe, setting, warmup + steps + int(profile))
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    model = build_model(shape, dtype=getattr(torch, setting.dtype), device=device, recipe=recipe, seed=0)
    model.set_activation_checkpointing(setting.checkpointing)
    local_sequences = setting.num_sequences // parallel.world_size
    engine = RolloutEngine(model, memory_budget=memory_budget if device.type == "cuda" else 2 ** 30,
                           max_num_seqs=local_sequences, max_model_len=setting.prompt_len + setting.new_tokens,
                           progress=False)
    prompts = RandomPrompts(setting.prompts, setting.prompt_len, shape["vocab_size"])
    trainer = Trainer(config, model, engine, prompts, even_token_reward, decode_ids, parallel=parallel)
    timed: list[dict[str, float]] = []
    comm = profiled = overlap = None
    try:
        for i in range(warmup + steps):
            metrics = trainer.step()
            _check_step(recipe, metrics, setting)
            if i >= warmup:
                timed.append(metrics)
            if parallel.is_main:
                print(f"  {recipe} step {i + 1}/{warmup + steps} ({'timed' if i >= warmup else 'warm-up'}): "
                      f"{metrics['time/step']:.2f} s", flush=True)
        gather = dict(zip(("gather_s", "quantize_s", "release_s"),
                          parallel.max(list(time_weight_gather(model, device).values()))))
        if profile:
            from torch.profiler import ProfilerActivity, record_function
            from torch.profiler import profile as torch_profile

            activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
            with torch_profile(activities=activities) as prof, phase_ranges(trainer, device):
                _sync(device)
                with record_function(RANGE_PREFIX + "step"):
                    trainer.step()
                    _sync(device)
            comm = dict(zip(COLLECTIVES, parallel.max(list(collective_seconds(prof, device).values()))))
            events = prof.events()
            windows = range_windows(events)
            step_window = windows.pop("step")
            profiled = {"step_s": length(step_window), "phase_s": {k: length(v) for k, v in windows.items()}}
            overlap = None
            if device.type == "cuda":  # gloo has no device kernels: nothing to measure the overlap on
                overlap = overlap_summary(device_kernels(events), step_window, windows)
            profiled, overlap = _max_over_ranks(parallel.gather_objects(profiled)), parallel.gather_objects(overlap)
        peak = torch.cuda.max_memory_allocated(device) / 2 ** 30 if device.type == "cuda" else None
        peaks = parallel.gather_objects(peak)
    finally:
        engine.free_cache()
        del trainer, engine, model
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    seconds = {}
    for phase in PHASES + ("step",):
        values = [m[f"time/{phase}"] for m in timed if f"time/{phase}" in m]
        if values:
            seconds["total" if phase == "step" else phase] = statistics.median(values)
    world, layers = parallel.world_size, shape["num_hidden_layers"]
    tokens = {"rollout": setting.generated_tokens, "old_logprob": setting.scored_tokens,
              "reference": setting.scored_tokens, "update": setting.scored_tokens, "total": setting.generated_tokens}
    per_gpu = {p: tokens[p] / seconds[p] / world for p in tokens if p in seconds}
    result = {"seconds": seconds, "tokens_per_s_per_gpu": per_gpu,
              "block_tokens_per_s_per_gpu": {p: v * layers for p, v in per_gpu.items()},
              "peak_gib_per_gpu": peaks, "step_metrics": timed[-1]}
    gather["share_of_rollout"] = (gather["gather_s"] + gather["quantize_s"]) / seconds["rollout"]
    result["weight_gather"] = gather
    if comm is not None:
        result["collective_seconds"] = comm
        result["collective_share_of_step"] = sum(comm.values()) / seconds["total"]
        result["profiled_step"] = profiled
        result["comm_overlap"] = None if overlap[0] is None else {"max": _max_over_ranks(overlap), "per_rank": overlap}
        result["exposed_comm_share_of_step"] = (
            None if overlap[0] is None else result["comm_overlap"]["max"]["exposed_comm_s"] / seconds["total"])
    return result


def format_report(results: dict[str, dict[str, Any]], ratios: dict[str, dict[str, float]], world: int) -> str:
    lines = [f"{'phase':<15}" + "".join(f"{name + ' s':>12}{name + ' tok/s/GPU':>20}" for name in results)
             + "".join(f"{name + '/bf16':>12}" for name in ratios)]
    for phase in PHASES + ("total",):
        if not any(phase in r["seconds"] for r in results.values()):
            continue
        row = f"{phase:<15}"
        for r in results.values():
            s, t = r["seconds"].get(phase), r["tokens_per_s_per_gpu"].get(phase)
            row += f"{s:>12.3f}" if s is not None else f"{'-':>12}"
            row += f"{t:>20,.0f}" if t is not None else f"{'-':>20}"
        for name in ratios:
            v = ratios[name].get(phase)
            row += f"{v:>11.2f}x" if v is not None else f"{'-':>12}"
        lines.append(row)
    for name, r in results.items():
        peaks = ", ".join("n/a" if p is None else f"{p:.1f}" for p in r["peak_gib_per_gpu"])
        line = f"{name}: peak GiB per GPU [{peaks}]"
        if "collective_seconds" in r:
            c = r["collective_seconds"]
            line += (f"; collectives per step: all-gather {c['all_gather']:.3f} s, reduce-scatter "
                     f"{c['reduce_scatter']:.3f} s, all-reduce {c['all_reduce']:.3f} s "
                     f"({100 * r['collective_share_of_step']:.1f}% of the step, overlapped or not)")
        lines.append(line)
        if "comm_overlap" in r:
            o = r["comm_overlap"]
            if o is None:
                lines.append(f"{name}: exposed communication n/a (no device kernels on CPU)")
            else:
                m = o["max"]
                phases = ", ".join(f"{p} {v['exposed_comm_s']:.3f}" for p, v in m["phases"].items()
                                   if v["comm_busy_s"] > 0)
                lines.append(f"{name}: NCCL busy {m['comm_busy_s']:.3f} s, exposed (no other kernel running) "
                             f"{m['exposed_comm_s']:.3f} s = {100 * r['exposed_comm_share_of_step']:.1f}% of the "
                             f"step; exposed s by phase: {phases or '-'}")
        g = r["weight_gather"]
        lines.append(f"{name}: rollout weight gather {g['gather_s']:.3f} s + first FP8 quantization "
                     f"{g['quantize_s']:.3f} s = {100 * g['share_of_rollout']:.1f}% of the rollout")
    lines.append(f"{world} GPU(s); block-tokens/s per GPU (update): " + ", ".join(
        f"{n} {r['block_tokens_per_s_per_gpu'].get('update', float('nan')):,.0f}" for n, r in results.items()))
    return "\n".join(lines)


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="CPU smoke run: 2-layer model, 2 prompts x 2, 8 tokens")
    parser.add_argument("--recipes", default=DEFAULT_ARMS, help=f"comma list of {recipe_names()}")
    parser.add_argument("--layers", type=int, default=None, help="decoder blocks (8B default: 32)")
    parser.add_argument("--prompts", type=int, default=None, help="prompts per step, all ranks (16; tiny: 2)")
    # not "--n": torchrun would take it for an abbreviation of its own options
    parser.add_argument("--samples", type=int, default=None, help="samples per prompt, n (4; tiny: 2)")
    parser.add_argument("--new-tokens", type=int, default=None, help="tokens per sample (1024; tiny: 8)")
    parser.add_argument("--prompt-len", type=int, default=None, help="prompt tokens (256; tiny: 8)")
    parser.add_argument("--micro-batch", type=int, default=None, help="sequences per micro-batch (8)")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--steps", type=int, default=1)
    parser.add_argument("--profile", action="store_true", help="one more step under torch.profiler: collectives")
    parser.add_argument("--no-reference", action="store_true")
    parser.add_argument("--memory-budget", type=float, default=0.5,
                        help="KV cache: fraction of the free GPU memory after the weights are gathered")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    args.recipes = [r.strip() for r in args.recipes.split(",") if r.strip()]
    from jetrl.quant.recipe import RECIPES
    if not args.recipes or any(r not in RECIPES for r in args.recipes):
        parser.error(f"--recipes must name some of {list(RECIPES)}")
    for name in ("layers", "prompts", "samples", "new_tokens", "prompt_len", "micro_batch"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.warmup < 0 or args.steps < 1:
        parser.error("need --warmup >= 0 and --steps >= 1")
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run the benchmark on this rank; returns the report (the same on every rank)."""
    from jetrl.parallel import init_parallel

    args = _parse(argv)
    device = "cpu" if args.tiny else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("bench/rl_step_parallel.py needs CUDA GPUs for the 8B shape (use --tiny on CPU)")
    parallel = init_parallel(device)
    try:
        with parallel.guard():
            return _main(args, parallel)
    finally:
        parallel.close()


def _main(args: argparse.Namespace, parallel: Any) -> dict[str, Any]:
    base = TINY_LLAMA if args.tiny else LLAMA31_8B
    shape = with_layers(base, args.layers or base["num_hidden_layers"])
    prompts = args.prompts or (2 * parallel.world_size if args.tiny else 16)
    n = args.samples or (2 if args.tiny else 4)
    setting = Setting(
        shape="tiny" if args.tiny else "llama-3.1-8b", num_layers=shape["num_hidden_layers"],
        num_params=parameter_counts(shape)[0], prompts=prompts, n=n,
        prompt_len=args.prompt_len or (8 if args.tiny else 256), new_tokens=args.new_tokens or (8 if args.tiny else 1024),
        micro_batch=args.micro_batch or min(8, prompts * n // parallel.world_size), reference=not args.no_reference,
        checkpointing=True, dtype="float32" if args.tiny else "bfloat16", device=str(parallel.device))
    if parallel.is_main:
        print(f"model: {setting.shape}-shaped, {setting.num_layers} blocks, {setting.num_params / 1e9:.2f}B "
              f"parameters, {setting.dtype}; {parallel.world_size} x {device_description(parallel.device)}; torch "
              f"{torch.__version__}\nstep: {prompts} prompts x n={n} = {setting.num_sequences} sequences "
              f"({setting.num_sequences // parallel.world_size} per GPU), {setting.prompt_len} prompt + "
              f"{setting.new_tokens} new tokens, micro-batch {setting.micro_batch}, reference "
              f"{'on' if setting.reference else 'off'}", flush=True)
    results = {recipe: run_recipe(recipe, shape, setting, parallel, args.warmup, args.steps, args.memory_budget,
                                  args.profile)
               for recipe in args.recipes}
    ratios = speedups({name: _Seconds(r["seconds"]) for name, r in results.items()})
    report = {"setting": {**setting.__dict__, "world_size": parallel.world_size}, "results": results,
              "speedups_over_bf16": ratios, "torch": torch.__version__}
    if parallel.is_main:
        write_report(report, args.json, "rl_step_parallel.json")
        print(format_report(results, ratios, parallel.world_size), flush=True)
    return report


class _Seconds:
    """Adapts a result to :func:`bench.rl_step.speedups` (which reads ``.seconds``)."""

    def __init__(self, seconds: dict[str, float]) -> None:
        self.seconds = seconds


if __name__ == "__main__":
    main()
