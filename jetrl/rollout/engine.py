"""``RolloutEngine``: batched generation on the policy model itself, through a paged KV cache.

The engine holds the very module the trainer optimises (no weight copy, no server). It owns the *generate
loop*: it checks the requests, turns each prompt into ``n`` :class:`~jetrl.rollout.sequence.Sequence` s,
and each step asks the :class:`~jetrl.rollout.scheduler.Scheduler` what to compute, hands that to its
:class:`~jetrl.rollout.model_runner.ModelRunner` (which packs the step into one ``model.forward_paged``
call on the rollout side of the precision recipe, samples on the device and copies only the sampled tokens
and their log-probabilities to the host), and gives the sampled tokens back to the scheduler, which applies
the stop conditions. Everything on the device (KV cache, CUDA graphs, input tensors, the sampler) is the
runner's; the engine never touches a tensor.

**Stats.** After each ``generate``, ``last_stats`` holds its wall time, steps, generated tokens and
throughput, preemptions, the KV pool (``num_blocks``, ``kv_capacity_tokens``, ``kv_bytes_per_block``, ``kv_fp8``:
an FP8 cache holds about twice the tokens of a BF16 one in the same memory, so it preempts less), prefill/decode
time, the host time not spent waiting for the device (scheduling, input packing, launches: overlapped with the
device's work when scheduling asynchronously, its idle time between steps when not), and the decode-step CUDA
graphs captured during the call (``graph_captures``, ``graph_capture_seconds``: nonzero on the first call, on a call
whose decode batch first needs a size not captured yet, and on every call whose weights moved to new storage since
the last one, as a sharded model's gathered weights do).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Sequence as Seq

import torch

from jetrl.models.transformer import DecoderLM
from jetrl.progress import Progress
from jetrl.rollout.block_manager import BlockManager
from jetrl.rollout.model_runner import LaunchedStep, ModelRunner
from jetrl.rollout.sampling import SamplingParams
from jetrl.rollout.scheduler import Scheduler, SchedulerOutput
from jetrl.rollout.sequence import Completion, Sequence

DEFAULT_DECODE_STEPS = 8


class RolloutEngine:
    """Generate completions with the policy ``model`` through a paged KV cache and continuous batching.

    Args:
        model: a jetrl decoder with ``forward_paged`` and ``config`` (see :mod:`jetrl.models`). Its precision
            recipe decides what the rollout side runs (``jet``/``fp8-rollout``: FP8 linears).
        tokenizer: needed only for stop strings (anything with ``decode(list[int]) -> str``); where the config
            names no end-of-sequence ids, its ``eos_token_id`` stops samples.
        memory_budget: KV-cache size: a fraction (0, 1] of the free GPU memory, or bytes (> 1). On CPU,
            bytes (default 256 MiB). The pool never exceeds what ``max_num_seqs`` full-length sequences need.
        block_size: tokens per KV block.
        max_num_seqs: most sequences decoded together (the decode batch).
        max_num_batched_tokens: most tokens in one prefill step (longer prompts are chunked).
        max_model_len: context limit (default, and at most: the config's ``max_position_embeddings``).
        num_blocks: exact pool size in blocks (overrides ``memory_budget``; tests use it for tiny pools).
        progress: show requests done and tokens/s.
        cuda_graphs: capture the decode step on CUDA; ``graph_batch_sizes`` overrides the captured sizes.
        async_scheduling: queue step t+1 before step t's tokens reach the host (its input tokens are read
            on the device), so scheduling and input packing overlap the GPU's work instead of idling it.
            A sequence that stops at step t is computed once more at t+1 and that result dropped; the
            completions are the same as without (up to the batch-size dependence of the GEMMs' rounding).
        exact: exact on-policy mode (:mod:`jetrl.quant.exact`): each reported log-probability equals, bitwise,
            the trainer's ``forward_packed(..., exact=True)`` log-probability of that token, whatever the batch
            composition, prefix sharing, preemption or CUDA graphs. Valid with the ``bf16`` and ``jet`` recipes
            (a ``ValueError`` under ``fp8-rollout``). With it, completions no longer depend on the batch either.
        kv_fp8: an FP8 KV cache (K after RoPE and V as E4M3, one fp32 scale per token and KV head, see
            :mod:`jetrl.models.attention`): about twice the tokens in the same memory. The trainer's forward
            sees the same values with ``forward_packed(..., kv_fp8=True)`` (the ``jet`` recipe; with ``exact``
            the log-probabilities stay bitwise equal); without it (``fp8-rollout``) it is a rollout-only cache.
            Any model and dtype takes it (attention dequantizes to the model's dtype); only the run config and
            ``jetrl eval`` (:func:`~jetrl.quant.recipe.kv_fp8_train`) refuse it under ``bf16``, whose rollout must
            stay the BF16 reference.
        decode_steps: decode steps the device runs back to back per host iteration (a decode run, see
            :mod:`jetrl.rollout.scheduler`): the host schedules, launches and reads back once per run, so its
            per-step work (which grows with the batch) no longer bounds small models' decoding. A sample that
            stops inside a run is computed to the run's end for nothing, and a waiting prompt joins at most
            ``decode_steps - 1`` steps later. Seeded and greedy samples are the same tokens as with 1 (up to the
            batch-size dependence of the GEMMs' rounding, none in exact mode). 1: a host iteration per step.

    The KV-cache and CUDA-graph arguments configure :attr:`runner`, the
    :class:`~jetrl.rollout.model_runner.ModelRunner` that runs the model; ``last_stats`` holds the stats of
    the last ``generate`` call.
    """

    def __init__(self, model: torch.nn.Module, tokenizer=None, *, memory_budget: float | int | None = None,
                 block_size: int = 16, max_num_seqs: int = 256, max_num_batched_tokens: int = 8192,
                 max_model_len: int | None = None, num_blocks: int | None = None, progress: bool = True,
                 cuda_graphs: bool = True, graph_batch_sizes: Seq[int] | None = None, async_scheduling: bool = True,
                 exact: bool = False, kv_fp8: bool = False, decode_steps: int = DEFAULT_DECODE_STEPS) -> None:
        if not isinstance(model, DecoderLM):
            raise TypeError(f"RolloutEngine needs a jetrl decoder (DecoderLM: forward_paged and config), "
                            f"got {type(model).__name__}")
        for name, value in (("block_size", block_size), ("max_num_seqs", max_num_seqs),
                            ("max_num_batched_tokens", max_num_batched_tokens), ("decode_steps", decode_steps)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"RolloutEngine: {name} must be a positive int, got {value!r}")
        self.model = model
        self.tokenizer = tokenizer
        config = model.config  # a DecoderConfig
        self.vocab_size = config.vocab_size
        self.max_model_len = int(max_model_len) if max_model_len is not None else config.max_position_embeddings
        if self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")
        config.check_context(self.max_model_len, "RolloutEngine max_model_len")
        # DecoderConfig.eos_token_ids is [] (not None) when the config names none: fall back then too
        eos = config.eos_token_ids or getattr(tokenizer, "eos_token_id", None)
        self.eos_token_ids = frozenset([eos] if isinstance(eos, int) else (eos or ()))
        self.block_size = block_size
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.progress = progress
        self.async_scheduling = bool(async_scheduling)
        self.decode_steps = decode_steps
        self.runner = ModelRunner(model, max_model_len=self.max_model_len, block_size=block_size,
                                  max_num_seqs=max_num_seqs, memory_budget=memory_budget, num_blocks=num_blocks,
                                  cuda_graphs=cuda_graphs, graph_batch_sizes=graph_batch_sizes, exact=exact,
                                  kv_fp8=kv_fp8)
        self.exact = self.runner.exact
        self.kv_fp8 = self.runner.kv_fp8
        self._seq_counter = 0
        self.last_stats: dict[str, float] = {}

    def free_cache(self) -> None:
        """Release the KV cache and CUDA graphs (e.g. to give memory to the trainer); re-made on demand."""
        self.runner.free_cache()

    def generate(self, prompts: list[list[int]], params: SamplingParams | Seq[SamplingParams] | None = None
                 ) -> list[Completion]:
        """Generate ``params.n`` samples for every prompt; prompt-major order (prompt i's samples at
        ``i*n .. i*n+n-1``; with a list of per-prompt params, prompts' samples are concatenated in order)."""
        prompts, per_prompt = self._validate(prompts, params)
        runner = self.runner
        num_blocks = runner.allocate_kv_cache()
        scheduler = Scheduler(BlockManager(num_blocks, self.block_size), max_num_seqs=self.max_num_seqs,
                              max_num_batched_tokens=self.max_num_batched_tokens, max_model_len=self.max_model_len)
        all_seqs: list[Sequence] = []
        for i, (prompt, p) in enumerate(zip(prompts, per_prompt)):
            scheduler.check_fits(len(prompt), p.max_tokens, p.n)
            stop_ids = frozenset(p.stop_token_ids) | (frozenset() if p.ignore_eos else self.eos_token_ids)
            group = [Sequence(self._seq_counter + j, i, j, prompt, p, stop_ids) for j in range(p.n)]
            self._seq_counter += p.n
            all_seqs += group
            scheduler.add(group)
        captures, capture_seconds = runner.graph_captures, runner.graph_capture_seconds
        runner.begin(all_seqs)
        progress = Progress(len(all_seqs), "rollout", unit="req", enabled=self.progress)
        num_steps = num_decode_steps = num_decode_launches = num_generated = decode_tokens = 0
        step_seconds = [0.0, 0.0]  # prefill, decode
        wait_seconds = 0.0  # the host waiting for the device
        start = time.perf_counter()
        in_flight: _InFlight | None = None
        last_finish = shown = 0.0

        def finish(step: _InFlight) -> None:
            nonlocal num_generated, decode_tokens, last_finish, wait_seconds, shown
            tokens, logprobs = runner.collect(step.launched)
            wait_seconds += step.launched.wait_seconds
            finished, n = scheduler.resolve(step.rows, tokens, logprobs, self._stop_string_hit, step.out.steps,
                                            step.out.row_steps)
            finished += step.finished
            num_generated += n
            decode_tokens += n if step.out.is_decode else 0
            now = time.perf_counter()  # steps overlap when asynchronous: count each span once
            step_seconds[step.out.is_decode] += now - max(step.start, last_finish)
            last_finish = now
            progress.update(len(finished))
            if now - shown > 0.5:  # requests done, with the output tokens/s so far (refreshed twice a second)
                progress.set_postfix(speed=f"{num_generated / max(now - start, 1e-9):,.0f} tok/s")
                shown = now

        try:
            while scheduler.has_unfinished:
                out = scheduler.schedule(self.decode_steps)
                if not out.chunks:
                    if in_flight is not None:  # what the scheduler waits for may be freed by the last step
                        finish(in_flight)
                        in_flight = None
                        continue
                    raise RuntimeError("scheduler produced an empty step with work pending (a bug)")
                step_start = time.perf_counter()
                launched = runner.launch(out, None if in_flight is None else in_flight.launched)  # the host goes on
                if in_flight is not None:
                    finish(in_flight)
                rows, finished = scheduler.advance(out)
                num_steps += 1
                num_decode_steps += out.steps if out.is_decode else 0
                num_decode_launches += out.is_decode
                in_flight = _InFlight(out, step_start, launched, rows, finished)
                if not self.async_scheduling:
                    finish(in_flight)
                    in_flight = None
            if in_flight is not None:
                finish(in_flight)
        finally:
            progress.close()
        elapsed = time.perf_counter() - start
        self.last_stats = dict(seconds=elapsed, steps=num_steps, decode_steps=num_decode_steps,
                               decode_launches=num_decode_launches,  # host iterations of decoding
                               generated_tokens=num_generated, tokens_per_s=num_generated / max(elapsed, 1e-9),
                               preemptions=scheduler.num_preemptions, num_blocks=num_blocks,
                               kv_capacity_tokens=num_blocks * self.block_size,
                               kv_bytes_per_block=runner.bytes_per_block, kv_fp8=float(self.kv_fp8),
                               prefill_seconds=step_seconds[0], decode_seconds=step_seconds[1],
                               decode_tokens=decode_tokens,
                               decode_tokens_per_s=decode_tokens / max(step_seconds[1], 1e-9),
                               host_seconds=elapsed - wait_seconds, graph_captures=runner.graph_captures - captures,
                               graph_capture_seconds=runner.graph_capture_seconds - capture_seconds)
        return [s.to_completion() for s in all_seqs]

    def _validate(self, prompts, params) -> tuple[list[list[int]], list[SamplingParams]]:
        if isinstance(prompts, torch.Tensor) or not isinstance(prompts, (list, tuple)):
            raise TypeError(f"prompts must be a list of token-id lists, got {type(prompts).__name__}")
        if not prompts:
            raise ValueError("prompts is empty: give at least one prompt")
        if params is None or isinstance(params, SamplingParams):
            per_prompt = [params or SamplingParams()] * len(prompts)
        else:
            per_prompt = list(params)
            if len(per_prompt) != len(prompts):
                raise ValueError(f"got {len(per_prompt)} SamplingParams for {len(prompts)} prompts")
            for p in per_prompt:
                if not isinstance(p, SamplingParams):
                    raise TypeError(f"params must be SamplingParams, got {type(p).__name__}")
        clean = []
        for i, prompt in enumerate(prompts):
            if isinstance(prompt, torch.Tensor):
                prompt = prompt.tolist()
            if isinstance(prompt, (str, bytes)) or not isinstance(prompt, (list, tuple)):
                raise TypeError(f"prompt {i} must be a list of token ids, got {type(prompt).__name__}")
            if len(prompt) == 0:
                raise ValueError(f"prompt {i} is empty: every prompt needs at least one token")
            if len(prompt) >= self.max_model_len:
                raise ValueError(f"prompt {i} has {len(prompt)} tokens, which leaves no room to generate within "
                                 f"the context length {self.max_model_len}")
            if any(isinstance(t, bool) or not isinstance(t, int) for t in prompt):
                raise TypeError(f"prompt {i} must hold ints (token ids)")
            if min(prompt) < 0 or max(prompt) >= self.vocab_size:
                raise ValueError(f"prompt {i} has token ids outside [0, {self.vocab_size})")
            clean.append(list(prompt))
        if self.tokenizer is None and any(p.stop for p in per_prompt):
            raise ValueError("stop strings need a tokenizer: pass tokenizer= to RolloutEngine")
        return clean, per_prompt

    def _stop_string_hit(self, seq: Sequence) -> bool:
        """Whether a stop string occurs in the decoded tail of ``seq``'s output (decoding only a short tail)."""
        longest = max(len(s) for s in seq.params.stop)
        text = self.tokenizer.decode(seq.output_ids[-(4 * longest + 4):])
        return any(s in text for s in seq.params.stop)


@dataclass
class _InFlight:
    """A launched step as the generate loop tracks it: its schedule, when it was launched, the runner's
    handle, and what :meth:`Scheduler.advance` recorded for it (one entry per sampled row, the sequences
    it finished by length)."""

    out: SchedulerOutput
    start: float
    launched: LaunchedStep
    rows: list[Sequence | None]
    finished: list[Sequence]


__all__ = ["RolloutEngine"]
