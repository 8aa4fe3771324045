"""Where each decode step's time goes: GPU busy and idle time, host time and GPU kernel time by category, per step.

For each model shape (``--shape``, from :data:`bench.common.MODEL_SHAPES`: ``0.5b``, ``1.5b``, ``7b``, ``8b``,
``32b``; ``NAME:N`` keeps the first ``N`` blocks, ``--blocks N`` does so for every shape without its own), arm
(``--arms``, default ``bf16,jet,jet+kv8``, :class:`bench.common.Arm` as in bench/rollout.py) and batch
(``--batches``, default ``64,256`` sequences), the ``RolloutEngine`` is built as bench/rollout.py builds it (random
weights, the arm's recipe and KV cache, CUDA graphs, ``max_model_len = prompt_len + new_tokens``), runs a short
warm-up generation (``--warmup-tokens`` tokens after 16-token prompts: compiles the kernels, captures the decode
graph of the batch), then generates ``--new-tokens`` tokens per sequence (default 1,024, stops ignored) after
``--prompt-len``-token prompts (default 256) under a probe on the engine's runner (its ``launch`` and ``collect``,
wrapped on the instance: nothing in jetrl changes). The probe times every decode step on the host, and around
decode steps ``--start`` .. ``--start + --steps - 1`` (default 100..119) runs ``torch.profiler`` (CPU + CUDA):
it starts ``--profile-warmup`` steps earlier (profiler start-up is not measured), marks each launch with
``record_function("jetrl.decode_step.<n>")`` and stops, after a device synchronize, once step ``start + steps`` is
queued. The generation ends there (``start + steps + 3`` tokens; ``--whole`` runs all ``--new-tokens``): its decode
steps up to then are those of the full generation, the engine being sized for it.

**Per step** (means over the ``--steps`` profiled steps; a step ``n`` attends over ``prompt_len + n + 1`` tokens):

* *ms/step, tok/s*: the step's wall time, from one decode launch to the next on the host, over the ``--steps``
  steps just before the profiler starts (no profiler cost in them); ``tok/s`` = batch / that. The same over the
  profiled steps is reported too (``ms_per_step_profiled``): the gap between the two is the profiler's own cost.
* *GPU busy*: the union of the step's kernel, memcpy and memset intervals (all streams), from the trace; each GPU
  operation belongs to the step whose launch enqueued it (CUPTI correlation ids: a CUDA-graph replay's kernels
  carry their ``cudaGraphLaunch``'s). *GPU period*: from the step's first GPU operation to the next step's first.
  *Gap* (``gap_ms``) = period - busy: the GPU idle in the step's period, split into idle inside the step (between its
  own operations, ``gap_inside_ms``, the table's *in-step*) and the wait before its first operation after the
  previous step's last (``gpu_wait_for_host_ms``: the GPU waiting for the host). The profiler slows the host, so the
  table's *idle* is the unprofiled ms/step - GPU busy (``idle_ms``).
* *host*: the host time of a step not spent waiting for the GPU (the engine's ``host_seconds``, per step): the
  launch (scheduling output to packed inputs, H2D copy, graph replay, sampling, D2H copy enqueued), the collect of
  the previous step's tokens less its wait, and the rest of the engine loop (scheduler ``resolve``/``advance``/
  ``schedule``). When host > GPU busy, the GPU waits for the host. From the unprofiled steps; the profiled ones' too,
  with the top-level CPU operators and CUDA API calls inside the launches (``host_ops``, ``cuda_calls``).
* *kernel categories* (:func:`classify_kernel`, by name; shares of the summed GPU operation time): ``gemm``,
  ``quantize``, ``attention``, ``kv_write`` (the paged cache store), ``norm``, ``rope``, ``swiglu/act``,
  ``lm_head+sampling``, ``copy/memset``, ``other``. The LM head's GEMM is told from the block GEMMs by position
  (:func:`step_categories`): the step's last run of GEMM kernels and every kernel after it (logits cast, sampling, the
  token/log-prob packing) are ``lm_head+sampling``, memcpy/memset operations excepted; sampling kernels by name
  (:func:`classify_kernel` says ``sampling``) count there too.
* *roofline*: the bytes one decode step must read (bench/rollout.py's ``step_bytes``: weights + the batch's KV at
  the profiled steps' mean context) over ``--bandwidth`` (4.3e12 B/s), as a share of the measured step time.

Prints one line per case and a table last; ``--json PATH`` writes every number (and ``$OUT/decode_profile.json``
when ``OUT`` is set); ``--trace-dir DIR`` keeps each case's chrome trace (``<shape>_b<batch>_<arm>.json``, several
MB; off by default). ``--max-seconds S`` starts no case that would end after ``S`` seconds (estimated from the
cases before) and still reports those done. CPU smoke run (no CUDA kernels: the GPU columns are 0, the table says
"no GPU"; host times and the whole pipeline run)::

    PYTHONPATH=$PWD python bench/decode_profile.py --device cpu --shape tiny --batches 4 --prompt-len 8 \\
        --new-tokens 32 --start 8 --steps 4

**On one H200** (the issue-46 table: 0.5B, 1.5B, 8B, then 8 blocks of the 7B shape while the time lasts)::

    PYTHONPATH=$PWD python bench/decode_profile.py --shape 0.5b,1.5b,8b,7b:8 --batches 64,256 \\
        --arms bf16,jet,jet+kv8 --steps 20 --max-seconds 210 --json $OUT/decode_profile.json

Expected about 3.5-4 minutes: 24 cases (18 without the 7B shape), each an engine, a warm-up generation of 8 tokens
(one graph capture), a 256-token prefill of the batch and 123 decode steps at 2-15 ms (bench/rollout.py's decode
tokens/s in BENCHMARKS.md: 8B 8,546 tok/s at 64 sequences, 17,445 at 256; 1.5B 19,511 and 48,091; 0.5B faster),
i.e. 0.3-2 s of decode, plus about 3 s of profiler start, stop and trace parsing: 5-8 s a case, 150-190 s in all;
with process start and Triton compilation (about 40 s + 10 s per shape for the FP8 arms) and the random weights
(8B: 16 GB, about 5 s). ``--max-seconds 210`` drops the last (7B) cases if the first ones run long.
"""

# no ``from __future__ import annotations``: ``jetrl bench`` executes this file as a module it does not register in
# sys.modules, where dataclasses cannot resolve string annotations
import argparse
import bisect
import gc
import json
import math
import os
import re
import shutil
import statistics
import tempfile
import time
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from typing import Iterable

import torch

try:  # repository root on sys.path (python -m bench.decode_profile, the tests, PYTHONPATH=$PWD)
    from bench.common import (MODEL_SHAPES, Arm, add_tuning_argument, arms_help, device_description, parse_arm_args,
                              random_prompts, sync, with_layers, write_report)
    from bench.rollout import step_bytes
except ModuleNotFoundError:  # python bench/decode_profile.py, jetrl bench decode_profile: bench/ is on sys.path
    from common import (MODEL_SHAPES, Arm, add_tuning_argument, arms_help,  # type: ignore[no-redef]
                        device_description, parse_arm_args, random_prompts, sync, with_layers, write_report)
    from rollout import step_bytes  # type: ignore[no-redef]

STEP_MARK = "jetrl.decode_step."  # record_function name of a profiled decode launch: the mark + the step number
PREFILL_MARK = "jetrl.prefill_step"  # a prefill launch while profiling (a recomputation after a preemption)
COLLECT_MARK = "jetrl.collect"
DEFAULT_PROFILE_ARMS = "bf16,jet,jet+kv8"
WARMUP_PROMPT_LEN = 16

# the categories a step's GPU time is reported in, in table order
CATEGORIES = ("gemm", "quantize", "attention", "kv_write", "norm", "rope", "swiglu/act", "lm_head+sampling",
              "copy/memset", "other")
SHORT = {"gemm": "gemm", "quantize": "quant", "attention": "attn", "kv_write": "kv", "norm": "norm", "rope": "rope",
         "swiglu/act": "act", "lm_head+sampling": "lm+smp", "copy/memset": "copy", "other": "other"}

# (category, lower-case name fragments), first match wins. Exact mode's Triton kernels come before the generic words
# their names hold (``_exact_reduce_kernel`` is the exact GEMM's split-K sum); the KV-cache store before
# ``quantize`` (``_quantize_scatter_kv_kernel``, the FP8 cache) and ``copy`` (``index_copy``, the BF16 cache: in a
# decode step write_kv is the only index_copy_); the attention kernels before ``gemm`` (FlashAttention-3 is a
# ``cutlass::device_kernel<flash::...>``) and ``sampling`` (``softmax``); the Gluon 128x1 quantization kernels are
# ``token_kernel`` and ``act_and_token_kernel``; ``_add_bias_kernel`` is a linear's bias epilogue (a GEMM's cost).
NAME_RULES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("gemm", ("_exact_gemm", "_exact_reduce")),
    ("attention", ("_exact_attention", "_exact_decode_kernel")),
    ("kv_write", ("_quantize_scatter_kv", "scatter_kv", "index_copy", "reshape_and_cache", "store_kvcache")),
    ("quantize", ("quantiz", "token_kernel", "_act_1x128", "fp8_quant", "to_fp8", "cast_fp8")),
    ("attention", ("paged_decode", "merge_splits", "flash", "fmha", "sdpa", "attention", "attn")),
    ("gemm", ("gemm", "gemv", "cutlass", "cublas", "nvjet", "xmma", "scaled_mm", "matmul", "splitk", "_add_bias")),
    ("norm", ("rms_norm", "rmsnorm", "layer_norm", "layernorm", "norm_fwd")),
    ("rope", ("rope", "rotary")),
    ("swiglu/act", ("swiglu", "silu", "gelu", "act_and_mul")),
    ("sampling", ("sample", "gumbel", "_logprob", "softmax", "argmax", "argmin", "topk", "top_k", "sort",
                  "multinomial", "distribution", "uniform")),
    ("copy/memset", ("copy", "memcpy", "memset", "fill", "cat_array", "catarray", "index", "gather", "scatter")),
)


def classify_kernel(name: str) -> str:
    """The category of a GPU operation by its name: one of :data:`CATEGORIES` but ``lm_head+sampling``, or
    ``sampling`` (sampling, softmax, top-k, argmax, random-number kernels; :func:`step_categories` counts them in
    ``lm_head+sampling``). CUPTI's memcpy/memset records (``Memcpy HtoD (Pinned -> Device)``, ``Memset (Device)``)
    are ``copy/memset``; a name no rule matches is ``other``."""
    low = name.lower()
    if low.startswith(("memcpy", "memset")):
        return "copy/memset"
    for category, fragments in NAME_RULES:
        if any(f in low for f in fragments):
            return category
    return "other"


@dataclass(frozen=True)
class GpuOp:
    """One GPU operation of the trace: a kernel, or a memcpy/memset (``kind``), in microseconds."""

    name: str
    start: float
    end: float
    kind: str = "kernel"

    @property
    def duration(self) -> float:
        return self.end - self.start


def union_length(intervals: Iterable[tuple[float, float]]) -> float:
    """Total length covered by the intervals (overlaps counted once; empty or reversed intervals add nothing)."""
    total, cur_start, cur_end = 0.0, None, None
    for start, end in sorted((s, e) for s, e in intervals if e > s):
        if cur_end is None or start > cur_end:
            if cur_end is not None:
                total += cur_end - cur_start
            cur_start, cur_end = start, end
        else:
            cur_end = max(cur_end, end)
    if cur_end is not None:
        total += cur_end - cur_start
    return total


def step_categories(ops: list[GpuOp]) -> dict[str, float]:
    """GPU time (summed durations, us) of one step's operations by category (:data:`CATEGORIES`, all present).

    By name (:func:`classify_kernel`), except for the LM head, whose GEMM a name does not tell from the blocks': the
    step's last run of consecutive ``gemm`` operations in start order (the LM head's GEMM, with a split-K reduction
    if it has one; the final norm separates it from the last block's down projection) and every kernel after it
    (the logits' cast, the sampler's kernels, the packing of tokens and log-probabilities) are ``lm_head+sampling``;
    memcpy/memset operations stay ``copy/memset``. ``sampling`` kernels count in ``lm_head+sampling`` anywhere."""
    ordered = sorted(ops, key=lambda op: (op.start, op.end))
    names = [classify_kernel(op.name) for op in ordered]
    head = max((i for i, c in enumerate(names) if c == "gemm"), default=None)
    while head is not None and head > 0 and names[head - 1] == "gemm":
        head -= 1
    out = dict.fromkeys(CATEGORIES, 0.0)
    for i, (op, category) in enumerate(zip(ordered, names)):
        if category == "sampling" or (head is not None and i >= head and op.kind == "kernel"):
            category = "lm_head+sampling"
        out[category] += op.duration
    return out


@dataclass
class StepGpu:
    """One step's GPU time, us: ``busy`` (union of its operations), ``span`` (first start to last end),
    ``inside_gap`` (span - busy), ``period`` (its first start to the next step's first start; the span where there
    is no next step), ``idle`` (period - busy), ``wait_before`` (idle between the previous step's last end and its
    first start), ``kernel_time`` (summed durations), ``categories`` (:func:`step_categories`), ``ops`` (count)."""

    busy: float
    span: float
    inside_gap: float
    period: float
    idle: float
    wait_before: float
    kernel_time: float
    categories: dict[str, float]
    ops: int


def gpu_step_stats(ops_by_step: dict[int, list[GpuOp]], steps: Iterable[int]) -> list[StepGpu]:
    """:class:`StepGpu` of each of ``steps`` (a step with no operation counts zeros) from the GPU operations of
    every traced step: ``ops_by_step[n + 1]`` bounds step ``n``'s period, ``ops_by_step[n - 1]`` its wait."""
    out = []
    for n in steps:
        ops = ops_by_step.get(n, [])
        if not ops:
            out.append(StepGpu(0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, dict.fromkeys(CATEGORIES, 0.0), 0))
            continue
        first, last = min(op.start for op in ops), max(op.end for op in ops)
        busy = union_length((op.start, op.end) for op in ops)
        after = ops_by_step.get(n + 1)
        period = (min(op.start for op in after) - first) if after else last - first
        before = ops_by_step.get(n - 1)
        wait = max(0.0, first - max(op.end for op in before)) if before else 0.0
        out.append(StepGpu(busy, last - first, last - first - busy, period, max(period - busy, 0.0), wait,
                           sum(op.duration for op in ops), step_categories(ops), len(ops)))
    return out


# ------------------------------------------------------------------------------------------ the trace

@dataclass
class TraceSteps:
    """What a chrome trace says of the marked decode steps: each step's launch range on the host (us, the trace's
    clock) and thread, the GPU operations each launch enqueued, and those of no marked step."""

    launches: dict[int, tuple[float, float]] = field(default_factory=dict)
    threads: dict[int, object] = field(default_factory=dict)
    ops_by_step: dict[int, list[GpuOp]] = field(default_factory=dict)
    unattributed: int = 0


_GPU_KINDS = {"kernel": "kernel", "gpu_memcpy": "memcpy", "gpu_memset": "memset"}
_LAUNCH_CATS = ("cuda_runtime", "cuda_driver")


def _complete(events: list[dict]) -> Iterable[dict]:
    for e in events:
        if e.get("ph") == "X" and "ts" in e:
            yield e


def parse_trace(events: list[dict], mark: str = STEP_MARK) -> TraceSteps:
    """The steps of a kineto chrome trace's ``traceEvents``: host ranges named ``<mark><n>`` (``user_annotation``),
    and the kernels/memcpys/memsets whose CUDA API call (``cuda_runtime``/``cuda_driver`` event of the same
    ``correlation``) came in step ``n``'s launch: the last marked range begun at or before the call (every call that
    enqueues GPU work of a step is made inside its launch, and the engine makes none between launches). GPU work of
    a prefill launch (a range named ``PREFILL_MARK``) or of no marked launch is counted in ``unattributed``."""
    out = TraceSteps()
    starts: list[tuple[float, int]] = []  # (start, step), step -1 for a prefill launch (its GPU work is no step's)
    for e in _complete(events):
        name = e.get("name", "")
        if e.get("cat") != "user_annotation":
            continue
        if name.startswith(mark) and name[len(mark):].isdigit():
            n = int(name[len(mark):])
            out.launches[n] = (float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0.0)))
            out.threads[n] = e.get("tid")
            starts.append((float(e["ts"]), n))
        elif name.startswith(PREFILL_MARK):
            starts.append((float(e["ts"]), -1))
    starts.sort()
    start_ts = [ts for ts, _ in starts]
    step_of_call: dict = {}
    for e in _complete(events):
        if e.get("cat") in _LAUNCH_CATS:
            corr = (e.get("args") or {}).get("correlation")
            i = bisect.bisect_right(start_ts, float(e["ts"])) - 1
            if corr is not None and i >= 0 and starts[i][1] >= 0:
                step_of_call[corr] = starts[i][1]
    for e in _complete(events):
        kind = _GPU_KINDS.get(e.get("cat"))
        if kind is None:
            continue
        n = step_of_call.get((e.get("args") or {}).get("correlation"))
        if n is None:
            out.unattributed += 1
            continue
        ts = float(e["ts"])
        out.ops_by_step.setdefault(n, []).append(GpuOp(e.get("name", ""), ts, ts + float(e.get("dur", 0.0)), kind))
    return out


def host_calls(events: list[dict], ranges: list[tuple[float, float, object]], cats: tuple[str, ...]
               ) -> dict[str, tuple[float, int]]:
    """Name -> (total us, count) of the top-level events of ``cats`` (not inside another of them on the same
    thread) that start inside one of ``ranges`` (start, end, thread)."""
    picked = [e for e in _complete(events) if e.get("cat") in cats]
    picked.sort(key=lambda e: (float(e["ts"]), -float(e.get("dur", 0.0))))
    totals: dict[str, list] = defaultdict(lambda: [0.0, 0])
    ends: dict = {}
    ordered = sorted(ranges, key=lambda r: r[0])
    range_starts = [r[0] for r in ordered]
    for e in picked:
        ts, dur, tid = float(e["ts"]), float(e.get("dur", 0.0)), e.get("tid")
        if ts < ends.get(tid, -math.inf):
            continue  # nested in a top-level event already counted
        i = bisect.bisect_right(range_starts, ts) - 1
        if i < 0 or ts > ordered[i][1] or (ordered[i][2] is not None and tid != ordered[i][2]):
            continue
        ends[tid] = ts + dur
        totals[e.get("name", "")][0] += dur
        totals[e.get("name", "")][1] += 1
    return {k: (v[0], v[1]) for k, v in totals.items()}


# ------------------------------------------------------------------------------------------ the probe

class StepProbe:
    """Wraps a ``ModelRunner``'s ``launch`` and ``collect`` (instance attributes, removed by :meth:`remove`):
    times every decode step on the host and runs ``profiler_factory()``'s profiler from decode step
    ``profile_from`` until step ``profile_until`` is about to be launched (synchronizing the device first, so every
    traced step's GPU work is done), marking each decode launch of that window ``<STEP_MARK><n>``."""

    def __init__(self, runner, device: torch.device, profile_from: int | None = None,
                 profile_until: int | None = None, profiler_factory=None) -> None:
        self.runner, self.device = runner, device
        self.profile_from, self.profile_until, self.factory = profile_from, profile_until, profiler_factory
        self.profiler = None
        self.profiling = False
        self.count = 0  # decode launches so far
        self.starts: list[float] = []  # perf_counter at each decode launch's start
        self.launch_s: list[float] = []
        self.collect_s: dict[int, float] = defaultdict(float)  # by the decode step in whose loop iteration it ran
        self.wait_s: dict[int, float] = defaultdict(float)
        self._launch, self._collect = runner.launch, runner.collect
        runner.launch, runner.collect = self.launch, self.collect

    def remove(self) -> None:
        for name in ("launch", "collect"):
            self.runner.__dict__.pop(name, None)
        self.stop()

    def stop(self) -> None:
        if self.profiling:
            sync(self.device)
            self.profiler.stop()
            self.profiling = False

    def launch(self, out, prev):
        if not out.is_decode:
            if self.profiling:
                with torch.profiler.record_function(PREFILL_MARK):
                    return self._launch(out, prev)
            return self._launch(out, prev)
        n = self.count
        self.count += 1
        t0 = time.perf_counter()
        self.starts.append(t0)
        if n == self.profile_until:
            self.stop()
        if n == self.profile_from and self.factory is not None:
            self.profiler = self.factory()
            self.profiler.start()
            self.profiling = True
        if self.profiling:
            with torch.profiler.record_function(f"{STEP_MARK}{n}"):
                launched = self._launch(out, prev)
        else:
            launched = self._launch(out, prev)
        self.launch_s.append(time.perf_counter() - t0)
        return launched

    def collect(self, step):
        t0 = time.perf_counter()
        if self.profiling:
            with torch.profiler.record_function(COLLECT_MARK):
                result = self._collect(step)
        else:
            result = self._collect(step)
        n = self.count - 1  # collect of step n - 1 runs in step n's loop iteration (after launch n)
        self.collect_s[n] += time.perf_counter() - t0
        self.wait_s[n] += getattr(step, "wait_seconds", 0.0)
        return result

    def host_stats(self, steps: Iterable[int]) -> dict[str, float]:
        """Means over ``steps`` (each with a next launch) of the loop iteration's wall time and its parts, ms:
        ``period`` (launch n to launch n + 1), ``launch``, ``collect`` (the previous step's, its wait included),
        ``wait`` (the host blocked on the GPU), ``host`` (period - wait), ``other`` (period - launch - collect: the
        scheduler's resolve/advance/schedule, the loop)."""
        steps = [n for n in steps if n + 1 < len(self.starts)]
        if not steps:
            return dict.fromkeys(("period", "launch", "collect", "wait", "host", "other", "steps"), 0.0)
        period = [self.starts[n + 1] - self.starts[n] for n in steps]
        launch = [self.launch_s[n] for n in steps]
        collect = [self.collect_s.get(n, 0.0) for n in steps]
        wait = [self.wait_s.get(n, 0.0) for n in steps]
        mean = lambda xs: 1e3 * sum(xs) / len(xs)  # noqa: E731
        return dict(period=mean(period), period_median=1e3 * statistics.median(period), launch=mean(launch),
                    collect=mean(collect), wait=mean(wait), host=mean([p - w for p, w in zip(period, wait)]),
                    other=mean([p - l - c for p, l, c in zip(period, launch, collect)]), steps=float(len(steps)))


# ------------------------------------------------------------------------------------------ one case

@dataclass
class CaseResult:
    """One (shape, batch, arm): the means per decode step over the profiled window (see the module doc)."""

    shape: str
    layers: int
    batch: int
    arm: str
    prompt_len: int
    new_tokens: int  # the generation the engine is sized for
    generated_tokens: int  # per sequence, in the measured generation
    start_step: int
    steps: int
    mean_context: float
    gpu: bool
    tuning: dict = field(default_factory=dict)
    # unprofiled decode steps (just before the profiler starts)
    decode_tokens_per_s: float = 0.0
    ms_per_step: float = 0.0
    ms_per_step_median: float = 0.0
    host_ms: float = 0.0
    launch_ms: float = 0.0
    collect_ms: float = 0.0
    wait_ms: float = 0.0
    loop_other_ms: float = 0.0
    # the profiled steps: host side (probe) ...
    ms_per_step_profiled: float = 0.0
    host_ms_profiled: float = 0.0
    launch_ms_profiled: float = 0.0
    wait_ms_profiled: float = 0.0
    # ... and GPU side (trace), ms per step
    gpu_period_ms: float = 0.0
    gpu_busy_ms: float = 0.0
    gap_ms: float = 0.0  # GPU period - busy, profiled
    idle_ms: float = 0.0  # ms_per_step (unprofiled) - gpu_busy_ms: the GPU's idle time per step without the profiler
    gap_inside_ms: float = 0.0
    gpu_wait_for_host_ms: float = 0.0
    kernel_ms: float = 0.0
    gpu_ops_per_step: float = 0.0
    unattributed_gpu_ops: int = 0
    category_ms: dict[str, float] = field(default_factory=dict)
    category_share: dict[str, float] = field(default_factory=dict)  # of kernel_ms
    top_kernels: list = field(default_factory=list)  # [name, category, us per step, per step]
    host_ops: list = field(default_factory=list)  # top-level CPU operators in the launches: [name, us/step, calls]
    cuda_calls: list = field(default_factory=list)  # CUDA API calls in the launches: [name, us/step, calls]
    launch_untraced_ms: float = 0.0  # launch time outside top-level operators and API calls (Python)
    # the bytes roofline at the profiled steps' mean context
    step_bytes: float = 0.0
    roofline_ms: float = 0.0
    roofline_share: float = 0.0
    engine_decode_tokens_per_s: float = 0.0  # the engine's own figure for the generation (profiler stop included)
    preemptions: int = 0
    trace: str | None = None


def _arm_file_name(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.+-]+", "_", text)


def run_case(model, shape_label: str, shape: dict, batch: int, arm: Arm, args, device: torch.device) -> CaseResult:
    """One engine of ``batch`` sequences under ``arm`` (already applied to ``model``): warm-up, then the probed and
    profiled generation; the engine and its cache are freed before returning."""
    from jetrl.rollout import RolloutEngine, SamplingParams

    start, k, w = args.start, args.steps, args.profile_warmup
    gen_tokens = args.new_tokens if args.whole else start + k + 3
    cuda = device.type == "cuda"
    res = CaseResult(shape_label, shape["num_hidden_layers"], batch, arm.name, args.prompt_len, args.new_tokens,
                     gen_tokens, start, k, args.prompt_len + start + (k + 1) / 2, cuda)
    res.tuning = dict(sorted({**args.tuning, **arm.tuning}.items()))
    prompts = random_prompts(batch, args.prompt_len, shape["vocab_size"], seed=args.prompt_len)
    engine = RolloutEngine(model, memory_budget=args.memory_budget if cuda else 2 ** 30, max_num_seqs=batch,
                           max_num_batched_tokens=args.max_num_batched_tokens,
                           max_model_len=args.prompt_len + args.new_tokens, progress=False,
                           cuda_graphs=not args.no_cuda_graphs, exact=arm.exact, kv_fp8=arm.kv_fp8,
                           decode_steps=1)  # one step per launch: the probe's steps are the device's
    trace_dir = args.trace_dir or tempfile.mkdtemp(prefix="decode_profile_")
    os.makedirs(trace_dir, exist_ok=True)
    trace_path = os.path.join(trace_dir, f"{_arm_file_name(shape_label)}_b{batch}_{_arm_file_name(arm.name)}.json")
    probe = None
    try:
        # the warm-up: kernels compiled, the batch's decode graph captured (short prompts: the graph is the same)
        engine.generate([p[:WARMUP_PROMPT_LEN] for p in prompts],
                        SamplingParams(temperature=1.0, max_tokens=args.warmup_tokens, ignore_eos=True))
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        probe = StepProbe(engine.runner, device, start - w, start + k + 1,
                          lambda: profile(activities=activities, record_shapes=False, with_stack=False))
        sync(device)
        # a seed per prompt, as the trainer gives (jetrl.rl.trainer): the sampler's path of jetrl train
        outs = engine.generate(prompts, [SamplingParams(temperature=1.0, max_tokens=gen_tokens, ignore_eos=True,
                                                        seed=i) for i in range(len(prompts))])
        probe.stop()  # (a --whole generation stops it mid-way already)
        got = sum(len(o.token_ids) for o in outs)
        if got != batch * gen_tokens:
            raise RuntimeError(f"{arm.name}: generated {got} tokens, expected {batch * gen_tokens} (stops are ignored)")
        stats = dict(engine.last_stats)
        if probe.profiler is None or probe.count <= start + k:
            raise RuntimeError(f"the generation made {probe.count} decode steps, the profile needs {start + k + 1}")
        probe.profiler.export_chrome_trace(trace_path)
    finally:
        if probe is not None:
            probe.remove()
        engine.free_cache()
        del engine
        _release(device)
    with open(trace_path) as f:
        events = json.load(f).get("traceEvents", [])
    if args.trace_dir:
        res.trace = trace_path
    else:
        shutil.rmtree(trace_dir, ignore_errors=True)
    window = range(start, start + k)
    _fill(res, probe, events, window, stats, shape, arm, args)
    return res


def _fill(res: CaseResult, probe: StepProbe, events: list[dict], window: range, stats: dict, shape: dict, arm: Arm,
          args) -> None:
    k = len(window)
    ref = range(max(1, window.start - args.profile_warmup - k), window.start - args.profile_warmup)
    unprofiled, profiled = probe.host_stats(ref), probe.host_stats(window)
    res.ms_per_step, res.ms_per_step_median = unprofiled["period"], unprofiled["period_median"]
    res.decode_tokens_per_s = res.batch / (res.ms_per_step / 1e3) if res.ms_per_step > 0 else 0.0
    res.host_ms, res.launch_ms, res.collect_ms = unprofiled["host"], unprofiled["launch"], unprofiled["collect"]
    res.wait_ms, res.loop_other_ms = unprofiled["wait"], unprofiled["other"]
    res.ms_per_step_profiled, res.host_ms_profiled = profiled["period"], profiled["host"]
    res.launch_ms_profiled, res.wait_ms_profiled = profiled["launch"], profiled["wait"]
    res.engine_decode_tokens_per_s = float(stats.get("decode_tokens_per_s", 0.0))
    res.preemptions = int(stats.get("preemptions", 0))

    trace = parse_trace(events)
    missing = [n for n in window if n not in trace.launches]
    if missing:
        raise RuntimeError(f"the trace has no launch range of decode steps {missing} (marks {STEP_MARK}<n>)")
    gpu = gpu_step_stats(trace.ops_by_step, window)
    res.unattributed_gpu_ops = trace.unattributed
    mean = lambda xs: sum(xs) / k  # noqa: E731
    res.gpu_period_ms = mean([s.period for s in gpu]) / 1e3
    res.gpu_busy_ms = mean([s.busy for s in gpu]) / 1e3
    res.gap_ms = mean([s.idle for s in gpu]) / 1e3
    res.gap_inside_ms = mean([s.inside_gap for s in gpu]) / 1e3
    res.idle_ms = max(res.ms_per_step - res.gpu_busy_ms, 0.0) if res.gpu else 0.0
    res.gpu_wait_for_host_ms = mean([s.wait_before for s in gpu]) / 1e3
    res.kernel_ms = mean([s.kernel_time for s in gpu]) / 1e3
    res.gpu_ops_per_step = mean([s.ops for s in gpu])
    res.category_ms = {c: mean([s.categories[c] for s in gpu]) / 1e3 for c in CATEGORIES}
    res.category_share = {c: (res.category_ms[c] / res.kernel_ms if res.kernel_ms > 0 else 0.0) for c in CATEGORIES}
    if res.gpu and not any(trace.ops_by_step.get(n) for n in window):
        print(f"WARNING [{res.shape} b{res.batch} {res.arm}]: the trace holds no GPU operation of the profiled steps "
              f"({trace.unattributed} unattributed): CUPTI recorded no kernels (try --no-cuda-graphs)", flush=True)

    kernels: dict[str, list] = defaultdict(lambda: [0.0, 0])
    for n in window:
        for op in trace.ops_by_step.get(n, []):
            kernels[op.name][0] += op.duration
            kernels[op.name][1] += 1
    top = sorted(kernels.items(), key=lambda kv: -kv[1][0])[:args.top]
    res.top_kernels = [[name[:200], classify_kernel(name), round(t / k, 2), v / k] for name, (t, v) in top]
    ranges = [(*trace.launches[n], trace.threads.get(n)) for n in window]
    ops = host_calls(events, ranges, ("cpu_op",))
    calls = host_calls(events, ranges, _LAUNCH_CATS)
    res.host_ops = [[name, round(t / k, 2), c / k] for name, (t, c) in sorted(ops.items(), key=lambda kv: -kv[1][0])
                    [:args.top]]
    res.cuda_calls = [[name, round(t / k, 2), c / k] for name, (t, c) in
                      sorted(calls.items(), key=lambda kv: -kv[1][0])[:args.top]]
    traced_launch = mean([b - a for a, b, _ in ranges]) / 1e3
    covered = sum(t for t, _ in host_calls(events, ranges, ("cpu_op",) + _LAUNCH_CATS).values()) / k / 1e3
    res.launch_untraced_ms = max(traced_launch - covered, 0.0)

    res.step_bytes = step_bytes(shape, arm, res.batch, res.mean_context)
    res.roofline_ms = res.step_bytes / args.bandwidth * 1e3
    res.roofline_share = res.roofline_ms / res.ms_per_step if res.ms_per_step > 0 else 0.0


def case_line(r: CaseResult) -> str:
    head = (f"[{r.shape} b{r.batch} {r.arm}] {r.decode_tokens_per_s:,.0f} decode tok/s, {r.ms_per_step:.3f} ms/step "
            f"({r.ms_per_step_profiled:.3f} profiled) at context {r.mean_context:g}; host {r.host_ms:.3f} ms "
            f"(launch {r.launch_ms:.3f}, collect {r.collect_ms:.3f} of which waiting {r.wait_ms:.3f}, loop "
            f"{r.loop_other_ms:.3f}); roofline {r.roofline_ms:.3f} ms = {r.roofline_share:.0%}")
    if not r.gpu:
        return head + "; no GPU"
    shares = ", ".join(f"{c} {r.category_share[c]:.0%}" for c in CATEGORIES if r.category_share[c] >= 0.005)
    return (head + f"; GPU busy {r.gpu_busy_ms:.3f} ms, idle {r.idle_ms:.3f} a step; profiled: a {r.gpu_period_ms:.3f} "
            f"ms period, idle {r.gap_ms:.3f} (inside the step {r.gap_inside_ms:.3f}, waiting for the host "
            f"{r.gpu_wait_for_host_ms:.3f}); "
            f"{r.gpu_ops_per_step:.0f} GPU ops/step; kernel time {r.kernel_ms:.3f} ms: {shares}")


def format_table(results: list[CaseResult]) -> str:
    header = ["shape", "batch", "arm", "tok/s", "ms/step", "GPU busy", "idle", "in-step", "host", "roofline",
              *(SHORT[c] for c in CATEGORIES)]
    rows = []
    for r in results:
        row = [r.shape, str(r.batch), r.arm, f"{r.decode_tokens_per_s:,.0f}", f"{r.ms_per_step:.3f}"]
        if r.gpu:
            row += [f"{r.gpu_busy_ms:.3f}", f"{r.idle_ms:.3f}", f"{r.gap_inside_ms:.3f}"]
        else:
            row += ["no GPU"] * 3
        row += [f"{r.host_ms:.3f}", f"{r.roofline_share:.0%}"]
        row += [f"{r.category_share[c]:.0%}" if r.gpu else "-" for c in CATEGORIES]
        rows.append(row)
    widths = [max(len(h), *(len(row[i]) for row in rows)) if rows else len(h) for i, h in enumerate(header)]
    lines = ["  ".join(h.ljust(w) if i < 3 else h.rjust(w) for i, (h, w) in enumerate(zip(header, widths)))]
    for row in rows:
        lines.append("  ".join(c.ljust(w) if i < 3 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths))))
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------ main

def parse_shapes(text: str, blocks: int | None) -> list[tuple[str, dict]]:
    """``"0.5b,7b:8"`` -> [(label, shape dict)]: ``NAME[:N]`` of :data:`MODEL_SHAPES`, the first ``N`` blocks
    (``blocks`` for a name without its own); the label names the blocks kept when fewer than the model's."""
    out = []
    for item in [t.strip() for t in text.split(",") if t.strip()]:
        name, _, n = item.partition(":")
        if name not in MODEL_SHAPES:
            raise ValueError(f"unknown shape {name!r}; choose from {list(MODEL_SHAPES)}")
        if n and not n.isdigit():
            raise ValueError(f"{item!r}: the blocks after ':' are a positive int")
        layers = int(n) if n else blocks
        full = MODEL_SHAPES[name]
        if layers is not None and (layers < 1 or layers > full["num_hidden_layers"]):
            raise ValueError(f"{item!r}: {name} has {full['num_hidden_layers']} blocks, keep 1..that many")
        shape = with_layers(full, layers)
        label = name if layers is None or layers == full["num_hidden_layers"] else f"{name}:{layers}"
        out.append((label, shape))
    if not out:
        raise ValueError(f"no shape named in {text!r}")
    return out


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", "--shapes", dest="shape", default="0.5b,1.5b,8b",
                        help=f"comma list of NAME[:BLOCKS], names {list(MODEL_SHAPES)} (default 0.5b,1.5b,8b)")
    parser.add_argument("--blocks", type=int, default=None, help="keep the first N blocks of every shape without "
                                                                 "its own :N")
    parser.add_argument("--batches", default="64,256", help="comma list of decode batch sizes (sequences)")
    parser.add_argument("--arms", default=DEFAULT_PROFILE_ARMS,
                        help=arms_help("jet+kv8@kv_decode_factored=true", DEFAULT_PROFILE_ARMS))
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--new-tokens", type=int, default=1024, help="the generation the engine is sized for")
    parser.add_argument("--whole", action="store_true", help="generate all --new-tokens (default: stop after the "
                                                             "profiled steps)")
    parser.add_argument("--start", type=int, default=100, help="first profiled decode step")
    parser.add_argument("--steps", type=int, default=20, help="profiled decode steps (K)")
    parser.add_argument("--profile-warmup", type=int, default=4,
                        help="decode steps the profiler runs before --start, not reported")
    parser.add_argument("--warmup-tokens", type=int, default=8, help="tokens of the warm-up generation")
    parser.add_argument("--memory-budget", type=float, default=0.85, help="fraction of free GPU memory for KV")
    parser.add_argument("--max-num-batched-tokens", type=int, default=16384)
    parser.add_argument("--bandwidth", type=float, default=4.3e12, help="bytes/s for the roofline")
    parser.add_argument("--no-cuda-graphs", action="store_true")
    parser.add_argument("--top", type=int, default=15, help="kernels and host operators listed per case in the JSON")
    parser.add_argument("--max-seconds", type=float, default=None,
                        help="start no case that would end after this many seconds (estimated)")
    parser.add_argument("--trace-dir", default=None, help="keep one chrome trace per case here")
    parser.add_argument("--json", default=None)
    add_tuning_argument(parser)
    args = parse_arm_args(parser, argv)
    if args.blocks is not None and args.blocks < 1:
        parser.error(f"--blocks must be >= 1, got {args.blocks}")
    try:
        args.shapes = parse_shapes(args.shape, args.blocks)
    except ValueError as exc:
        parser.error(f"--shape: {exc}")
    try:
        args.batches = [int(b) for b in args.batches.split(",") if b.strip()]
    except ValueError:
        parser.error(f"--batches: a comma list of ints, got {args.batches!r}")
    if not args.batches or min(args.batches) < 1:
        parser.error(f"--batches: positive sizes, got {args.batches}")
    for name in ("prompt_len", "new_tokens", "steps", "profile_warmup", "warmup_tokens", "max_num_batched_tokens",
                 "top"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.start < args.profile_warmup + 2:
        parser.error(f"--start must be >= --profile-warmup + 2 = {args.profile_warmup + 2} (unprofiled steps come "
                     f"first), got {args.start}")
    if args.start + args.steps + 3 > args.new_tokens:
        parser.error(f"--start + --steps + 3 = {args.start + args.steps + 3} exceeds --new-tokens {args.new_tokens}")
    if not 0 < args.memory_budget <= 1:
        parser.error(f"--memory-budget is a fraction in (0, 1], got {args.memory_budget}")
    if args.max_seconds is not None and args.max_seconds <= 0:
        parser.error(f"--max-seconds must be positive, got {args.max_seconds}")
    return args


def _release(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def main(argv: list[str] | None = None) -> list[CaseResult]:
    from jetrl.quant.kernels import tuning

    args = _parse(argv)
    with tuning.override(**args.tuning):
        return _main(args)


def _main(args: argparse.Namespace) -> list[CaseResult]:
    from jetrl.models import build_model
    from jetrl.quant import apply_recipe, refresh_fp8_weights
    from jetrl.quant.kernels import tuning

    started = time.perf_counter()
    if args.device == "cuda":
        if not torch.cuda.is_available():
            raise SystemExit("bench/decode_profile.py --device cuda needs a CUDA GPU (--device cpu --shape tiny: the "
                             "CPU smoke run)")
        device, dtype = torch.device("cuda"), torch.bfloat16
    else:
        device, dtype = torch.device("cpu"), torch.float32
    print(f"device {device_description(device)}; shapes {[s for s, _ in args.shapes]}, batches {args.batches}, arms "
          f"{[a.name for a in args.arms]}; decode steps {args.start}..{args.start + args.steps - 1} profiled",
          flush=True)
    results: list[CaseResult] = []
    skipped: list[str] = []
    case_seconds: dict[str, float] = {}
    for label, shape in args.shapes:
        def over_budget(extra: float = 0.0) -> bool:
            if args.max_seconds is None:
                return False
            guess = case_seconds.get(label, max(case_seconds.values(), default=10.0))
            return time.perf_counter() - started + guess + extra > args.max_seconds
        if over_budget(extra=2 * _weight_gb(shape) * 0.3):
            skipped += [f"{label} b{b} {a.name}" for a in args.arms for b in args.batches]
            print(f"[{label}] skipped (--max-seconds)", flush=True)
            continue
        t_build = time.perf_counter()
        model = build_model(shape, dtype=dtype, device=device, recipe="bf16", seed=0 if device.type == "cpu" else None)
        print(f"[{label}] built in {time.perf_counter() - t_build:.1f} s", flush=True)
        try:
            for arm in args.arms:
                with tuning.override(**arm.tuning):  # nested in the run's --tuning: the arm's settings win
                    apply_recipe(model, arm.recipe)
                    refresh_fp8_weights(model, eager=True)
                    for batch in args.batches:
                        if over_budget():
                            skipped.append(f"{label} b{batch} {arm.name}")
                            print(f"[{label} b{batch} {arm.name}] skipped (--max-seconds)", flush=True)
                            continue
                        t0 = time.perf_counter()
                        res = run_case(model, label, shape, batch, arm, args, device)
                        case_seconds[label] = max(case_seconds.get(label, 0.0), time.perf_counter() - t0)
                        results.append(res)
                        print(case_line(res), flush=True)
        finally:
            apply_recipe(model, "bf16")
            del model
            _release(device)
    report = dict(device=device_description(device), seconds=time.perf_counter() - started,
                  args={k: v for k, v in vars(args).items() if k not in ("arms", "shapes")}
                  | dict(arms=[a.name for a in args.arms], shapes=[s for s, _ in args.shapes]),
                  categories=list(CATEGORIES), results=[asdict(r) for r in results], skipped=skipped)
    write_report(report, args.json, "decode_profile.json")
    print(f"\ndecode steps {args.start}..{args.start + args.steps - 1} ({time.perf_counter() - started:.0f} s): tok/s, "
          f"ms/step and host (its time a step not waiting for the GPU) unprofiled; GPU busy, in-step gaps and kernel "
          f"time shares profiled; idle = ms/step - GPU busy; roofline = step bytes / {args.bandwidth:.2g} B/s over "
          f"ms/step"
          + (f"; skipped (--max-seconds): {', '.join(skipped)}" if skipped else ""))
    print(format_table(results), flush=True)
    return results


def _weight_gb(shape: dict) -> float:
    """BF16 parameter bytes of a shape, GB (for the build-time guess of --max-seconds)."""
    try:
        from bench.rollout import weight_bytes
    except ModuleNotFoundError:
        from rollout import weight_bytes  # type: ignore[no-redef]
    return weight_bytes(shape, False) / 1e9


if __name__ == "__main__":
    main()
