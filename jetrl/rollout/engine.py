"""``RolloutEngine``: batched generation on the policy model itself, through a paged KV cache.

The engine holds the very module the trainer optimises (no weight copy, no server). Each step it asks the
:class:`~jetrl.rollout.scheduler.Scheduler` what to compute, packs those tokens into one
``model.forward_paged`` call (inside ``precision_side("rollout")``, so in ``jet`` every linear layer reads
its cached FP8 weight of the current weight version, the same bytes the training forward uses), samples
on the device, and copies only the sampled tokens and their log-probabilities to the host (one small
transfer per step: that is all the stop checks need).

On CUDA the decode step (one token per sequence) is captured in CUDA graphs for a set of batch sizes;
a batch is padded to the next captured size with rows that write into a scratch block no sequence owns.
The graphs are recaptured only when a parameter or a cached FP8 weight moves to new storage: a new
weight version is re-quantized into the same FP8 buffers, so graphs survive optimizer steps in ``jet``.

Forwards run under ``torch.no_grad`` rather than ``torch.inference_mode``: the FP8 weights the rollout
quantizes are cached on the layers and reused by the training forward of the same weight version, and
inference-mode tensors cannot be saved for backward.
"""

from __future__ import annotations

import dataclasses
import math
import sys
import time
import warnings
from typing import Sequence as Seq

import numpy as np
import torch

from jetrl.models.attention import PagedAttentionMetadata, PagedKVCache
from jetrl.quant import fp8_linears, precision_side
from jetrl.rollout.block_manager import BlockManager, BlockTableMirror
from jetrl.rollout.sampling import SamplingBatch, SamplingParams, sample
from jetrl.rollout.scheduler import PLACEHOLDER, Scheduler, SchedulerOutput
from jetrl.rollout.sequence import Completion, Sequence

DEFAULT_CPU_BUDGET_BYTES = 256 * 2 ** 20
DEFAULT_GPU_FRACTION = 0.5


def _config_value(config, *names, default=None):
    for name in names:
        value = getattr(config, name, None)
        if value is not None:
            return value
    return default


class _Progress:
    """Requests done and output tokens/s on stderr: tqdm when installed, else a line every few seconds."""

    def __init__(self, total: int, enabled: bool) -> None:
        self.total, self.enabled, self.done, self.tokens = total, enabled, 0, 0
        self.start = self.last = time.perf_counter()
        self.bar = None
        if enabled:
            try:
                from tqdm.auto import tqdm
                self.bar = tqdm(total=total, desc="rollout", unit="req", dynamic_ncols=True)
            except ImportError:
                pass

    def update(self, finished: int, new_tokens: int) -> None:
        if not self.enabled:
            return
        self.done += finished
        self.tokens += new_tokens
        now = time.perf_counter()
        rate = self.tokens / max(now - self.start, 1e-9)
        if self.bar is not None:
            if finished:
                self.bar.update(finished)
            if now - self.last > 0.5:
                self.bar.set_postfix_str(f"{rate:,.0f} tok/s", refresh=False)
                self.last = now
        elif now - self.last > 5.0 or self.done == self.total:
            print(f"rollout: {self.done}/{self.total} requests, {rate:,.0f} tok/s", file=sys.stderr)
            self.last = now

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


class _DecodeGraphs:
    """CUDA graphs of ``forward_paged`` for decode batches of the captured sizes, over static buffers."""

    def __init__(self, engine: "RolloutEngine", sizes: list[int]) -> None:
        self.sizes = sorted(sizes)
        max_b, width, dev = self.sizes[-1], engine.max_blocks_per_seq, engine.device
        self.input_ids = torch.zeros(max_b, dtype=torch.long, device=dev)
        self.positions = torch.zeros(max_b, dtype=torch.long, device=dev)
        self.query_start_loc = torch.arange(max_b + 1, dtype=torch.int32, device=dev)
        self.context_lens = torch.ones(max_b, dtype=torch.int32, device=dev)
        self.block_tables = torch.full((max_b, width), -1, dtype=torch.int32, device=dev)
        self.block_tables[:, 0] = engine.scratch_block
        self.slot_mapping = torch.full((max_b,), engine.scratch_block * engine.block_size, dtype=torch.long,
                                       device=dev)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.max_context_len = engine.max_model_len
        self.scratch_block, self.block_size = engine.scratch_block, engine.block_size
        pool = torch.cuda.graph_pool_handle()
        for b in reversed(self.sizes):
            meta = self._meta(b)
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                engine._forward(self.input_ids[:b], self.positions[:b], meta, None)  # warm-up (autotune, caches)
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[b] = engine._forward(self.input_ids[:b], self.positions[:b], meta, None)
            self.graphs[b] = graph
        torch.cuda.synchronize()

    def _meta(self, b: int) -> PagedAttentionMetadata:
        return PagedAttentionMetadata(self.query_start_loc[:b + 1], self.context_lens[:b], self.block_tables[:b],
                                      self.slot_mapping[:b], max_query_len=1, max_context_len=self.max_context_len)

    def padded_size(self, b: int) -> int | None:
        for size in self.sizes:
            if size >= b:
                return size
        return None

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, context_lens: torch.Tensor,
            slot_mapping: torch.Tensor, block_tables: torch.Tensor) -> torch.Tensor:
        b = input_ids.shape[0]
        size = self.padded_size(b)
        width = block_tables.shape[1]
        self.input_ids[:b].copy_(input_ids)
        self.positions[:b].copy_(positions)
        self.context_lens[:b].copy_(context_lens)
        self.slot_mapping[:b].copy_(slot_mapping)
        self.block_tables[:b, :width].copy_(block_tables)
        if size > b:  # padding rows: one token written into the scratch block, attending to it alone
            self.input_ids[b:size].zero_()
            self.positions[b:size].zero_()
            self.context_lens[b:size].fill_(1)
            self.slot_mapping[b:size].fill_(self.scratch_block * self.block_size)
            self.block_tables[b:size, 0].fill_(self.scratch_block)
        self.graphs[size].replay()
        return self.outputs[size][:b]


class RolloutEngine:
    """Generate completions with the policy ``model`` through a paged KV cache and continuous batching.

    Args:
        model: a jetrl decoder with ``forward_paged`` and ``config`` (see :mod:`jetrl.models`). Its precision
            recipe decides what the rollout side runs (``jet``/``fp8-rollout``: FP8 linears).
        tokenizer: needed only for stop strings (anything with ``decode(list[int]) -> str``).
        memory_budget: KV-cache size: a fraction (0, 1] of the free GPU memory, or bytes (> 1). On CPU,
            bytes (default 256 MiB). The pool never exceeds what ``max_num_seqs`` full-length sequences need.
        block_size: tokens per KV block.
        max_num_seqs: most sequences decoded together (the decode batch).
        max_num_batched_tokens: most tokens in one prefill step (longer prompts are chunked).
        max_model_len: context limit (default: the config's ``max_position_embeddings``).
        num_blocks: exact pool size in blocks (overrides ``memory_budget``; tests use it for tiny pools).
        progress: show requests done and tokens/s.
        cuda_graphs: capture the decode step on CUDA; ``graph_batch_sizes`` overrides the captured sizes.
        async_scheduling: queue step t+1 before step t's tokens reach the host (its input tokens are read
            on the device), so scheduling and input packing overlap the GPU's work instead of idling it.
            A sequence that stops at step t is computed once more at t+1 and that result dropped; the
            completions are the same as without (up to the batch-size dependence of the GEMMs' rounding).
    """

    def __init__(self, model: torch.nn.Module, tokenizer=None, *, memory_budget: float | int | None = None,
                 block_size: int = 16, max_num_seqs: int = 256, max_num_batched_tokens: int = 8192,
                 max_model_len: int | None = None, num_blocks: int | None = None, progress: bool = True,
                 cuda_graphs: bool = True, graph_batch_sizes: Seq[int] | None = None,
                 async_scheduling: bool = True) -> None:
        if not hasattr(model, "forward_paged") or not hasattr(model, "config"):
            raise TypeError(f"RolloutEngine needs a jetrl decoder with forward_paged and config, "
                            f"got {type(model).__name__}")
        for name, value in (("block_size", block_size), ("max_num_seqs", max_num_seqs),
                            ("max_num_batched_tokens", max_num_batched_tokens)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"RolloutEngine: {name} must be a positive int, got {value!r}")
        self.model = model
        self.tokenizer = tokenizer
        config = model.config
        self.num_layers = int(_config_value(config, "num_hidden_layers"))
        num_heads = int(_config_value(config, "num_attention_heads"))
        self.num_kv_heads = int(_config_value(config, "num_key_value_heads", default=num_heads))
        self.head_dim = int(_config_value(config, "head_dim",
                                          default=_config_value(config, "hidden_size", default=0) // num_heads))
        self.vocab_size = int(_config_value(config, "vocab_size"))
        config_len = int(_config_value(config, "max_position_embeddings", default=4096))
        self.max_model_len = int(max_model_len) if max_model_len is not None else config_len
        if self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")
        # DecoderConfig.eos_token_ids is [] (not None) when the config names none: fall back then too
        eos = _config_value(config, "eos_token_ids", "eos_token_id") or None
        if eos is None and tokenizer is not None:
            eos = getattr(tokenizer, "eos_token_id", None)
        self.eos_token_ids = frozenset([eos] if isinstance(eos, int) else (eos or ()))
        self.block_size = block_size
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_blocks_per_seq = math.ceil(self.max_model_len / block_size)
        self.progress = progress
        first = next(p for p in model.parameters() if p.is_floating_point())
        self.device = first.device
        self.dtype = first.dtype
        self.memory_budget = memory_budget
        self.requested_num_blocks = num_blocks
        self.use_cuda_graphs = cuda_graphs and self.device.type == "cuda"
        self.async_scheduling = bool(async_scheduling)
        self._sampling_cache: tuple[tuple[int, ...], SamplingBatch] | None = None
        self._wait_seconds = 0.0
        self.graph_batch_sizes = self._graph_sizes(graph_batch_sizes)
        self.kv_cache: PagedKVCache | None = None
        self.num_blocks = 0  # usable blocks (the pool has one more: the scratch block)
        self._graphs: _DecodeGraphs | None = None
        self._tables: BlockTableMirror | None = None  # the current generate call's block tables, on the host
        self._graph_key: tuple | None = None
        self._seq_counter = 0
        self.last_stats: dict[str, float] = {}

    # ------------------------------------------------------------------ setup

    def _graph_sizes(self, sizes: Seq[int] | None) -> list[int]:
        if sizes is None:
            sizes = [1, 2, 4, 8] + list(range(16, self.max_num_seqs + 1, 16))
        sizes = sorted({int(s) for s in sizes if 1 <= int(s) <= self.max_num_seqs})
        if not sizes or sizes[-1] < self.max_num_seqs:
            sizes.append(self.max_num_seqs)
        return sizes

    @property
    def bytes_per_block(self) -> int:
        elem = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.block_size * self.num_kv_heads * self.head_dim * elem

    def _pool_blocks(self) -> int:
        if self.requested_num_blocks is not None:
            if self.requested_num_blocks < 1:
                raise ValueError(f"num_blocks must be >= 1, got {self.requested_num_blocks}")
            return int(self.requested_num_blocks)
        budget = self.memory_budget
        if self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            budget = DEFAULT_GPU_FRACTION if budget is None else budget
            nbytes = budget * free if budget <= 1 else budget
        else:
            budget = DEFAULT_CPU_BUDGET_BYTES if budget is None else budget
            if budget <= 1:
                raise ValueError("on CPU give memory_budget in bytes (a fraction refers to free GPU memory)")
            nbytes = budget
        if budget <= 0:
            raise ValueError(f"memory_budget must be positive, got {budget}")
        blocks = int(nbytes // self.bytes_per_block)
        blocks = min(blocks, self.max_num_seqs * self.max_blocks_per_seq)
        if blocks < 1:
            raise ValueError(f"memory_budget of {nbytes:.0f} bytes holds no KV block of {self.bytes_per_block} "
                             f"bytes; raise it")
        return blocks

    def _ensure_cache(self) -> None:
        if self.kv_cache is None:
            self.num_blocks = self._pool_blocks()
            self.kv_cache = PagedKVCache.allocate(self.num_layers, self.num_blocks + 1, self.block_size,
                                                  self.num_kv_heads, self.head_dim, self.dtype, self.device)
            self._graphs = None

    @property
    def scratch_block(self) -> int:
        return self.num_blocks

    def free_cache(self) -> None:
        """Release the KV cache and CUDA graphs (e.g. to give memory to the trainer); re-made on demand."""
        self.kv_cache = None
        self._graphs = None
        self._graph_key = None
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def _weights_key(self) -> tuple:
        """Storage of every parameter and cached FP8 weight: CUDA graphs stay valid while it is unchanged."""
        ptrs = [p.data_ptr() for p in self.model.parameters()]
        with precision_side("rollout"):
            for layer in fp8_linears(self.model):
                ptrs.append(id(layer))  # a recipe swap replaces the modules the graphs captured
                if layer.uses_fp8():
                    qw = layer.quantized_weight()  # re-quantizes here if the weight version moved
                    ptrs += [qw.data.data_ptr(), qw.scale.data_ptr()]
        return tuple(ptrs)

    def _ensure_graphs(self) -> None:
        if not self.use_cuda_graphs:
            return
        key = self._weights_key()
        if self._graphs is not None and key == self._graph_key:
            return
        self._graphs = None
        try:
            with torch.no_grad(), precision_side("rollout"):
                graphs = _DecodeGraphs(self, self.graph_batch_sizes)
            self._graphs = graphs
            self._graph_key = key
        except Exception as exc:  # a model path that cannot be captured still runs, eagerly
            warnings.warn(f"CUDA graph capture of the decode step failed ({type(exc).__name__}: {exc}); "
                          f"decoding eagerly", RuntimeWarning, stacklevel=3)
            self.use_cuda_graphs = False

    # ------------------------------------------------------------------ public API

    def generate(self, prompts: list[list[int]], params: SamplingParams | Seq[SamplingParams] | None = None
                 ) -> list[Completion]:
        """Generate ``params.n`` samples for every prompt; prompt-major order (prompt i's samples at
        ``i*n .. i*n+n-1``; with a list of per-prompt params, prompts' samples are concatenated in order)."""
        prompts, per_prompt = self._validate(prompts, params)
        self._ensure_cache()
        blocks = BlockManager(self.num_blocks, self.block_size)
        scheduler = Scheduler(blocks, max_num_seqs=self.max_num_seqs,
                              max_num_batched_tokens=self.max_num_batched_tokens, max_model_len=self.max_model_len)
        all_seqs: list[Sequence] = []
        for i, (prompt, p) in enumerate(zip(prompts, per_prompt)):
            scheduler.check_fits(len(prompt), p.max_tokens, p.n)
            stop_ids = frozenset(p.stop_token_ids) | (frozenset() if p.ignore_eos else self.eos_token_ids)
            group = []
            for j in range(p.n):
                group.append(Sequence(self._seq_counter, i, j, prompt, p, stop_ids))
                self._seq_counter += 1
            all_seqs += group
            scheduler.add(group)
        self._ensure_graphs()
        self._tables = BlockTableMirror(all_seqs, self.max_blocks_per_seq)
        progress = _Progress(len(all_seqs), self.progress)
        num_steps = num_decode_steps = num_generated = decode_tokens = 0
        step_seconds = [0.0, 0.0]  # prefill, decode
        self._wait_seconds = 0.0
        start = time.perf_counter()
        in_flight: _InFlight | None = None
        last_finish = 0.0

        def finish(step: _InFlight) -> None:
            nonlocal num_generated, decode_tokens, last_finish
            tokens, logprobs = self._collect(step)
            finished = scheduler.resolve(step.rows, tokens, logprobs, self._stop_string_hit) + step.finished
            n = sum(1 for r in step.rows if r is not None)
            num_generated += n
            decode_tokens += n if step.out.is_decode else 0
            now = time.perf_counter()  # steps overlap when asynchronous: count each span once
            step_seconds[step.out.is_decode] += now - max(step.start, last_finish)
            last_finish = now
            progress.update(len(finished), n)

        try:
            with torch.no_grad(), precision_side("rollout"):
                while scheduler.has_unfinished:
                    out = scheduler.schedule()
                    if not out.chunks:
                        if in_flight is not None:  # what the scheduler waits for may be freed by the last step
                            finish(in_flight)
                            in_flight = None
                            continue
                        raise RuntimeError("scheduler produced an empty step with work pending (a bug)")
                    step = self._launch(out, in_flight)  # queued on the GPU; the host goes on
                    if in_flight is not None:
                        finish(in_flight)
                    step.rows, step.finished = scheduler.advance(out)
                    num_steps += 1
                    num_decode_steps += out.is_decode
                    in_flight = step
                    if not self.async_scheduling:
                        finish(in_flight)
                        in_flight = None
                if in_flight is not None:
                    finish(in_flight)
        finally:
            progress.close()
        elapsed = time.perf_counter() - start
        self.last_stats = dict(seconds=elapsed, steps=num_steps, decode_steps=num_decode_steps,
                               generated_tokens=num_generated, tokens_per_s=num_generated / max(elapsed, 1e-9),
                               preemptions=scheduler.num_preemptions, num_blocks=self.num_blocks,
                               prefill_seconds=step_seconds[0], decode_seconds=step_seconds[1],
                               decode_tokens=decode_tokens,
                               decode_tokens_per_s=decode_tokens / max(step_seconds[1], 1e-9),
                               # time the host was not waiting for the GPU: scheduling, input building,
                               # launches; overlapped with the GPU's work when scheduling asynchronously,
                               # the GPU's idle time between steps when not
                               host_seconds=elapsed - self._wait_seconds)
        return [s.to_completion() for s in all_seqs]

    # ------------------------------------------------------------------ internals

    def _validate(self, prompts, params) -> tuple[list[list[int]], list[SamplingParams]]:
        if params is None:
            params = SamplingParams()
        if isinstance(prompts, torch.Tensor) or not isinstance(prompts, (list, tuple)):
            raise TypeError(f"prompts must be a list of token-id lists, got {type(prompts).__name__}")
        if not prompts:
            raise ValueError("prompts is empty: give at least one prompt")
        if isinstance(params, SamplingParams):
            per_prompt = [params] * len(prompts)
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
        for p in per_prompt:
            if p.stop and self.tokenizer is None:
                raise ValueError("stop strings need a tokenizer: pass tokenizer= to RolloutEngine")
        return clean, per_prompt

    def _stop_string_hit(self, seq: Sequence) -> bool:
        """Whether a stop string ends the decoded tail of ``seq``'s output (decoding only a short tail)."""
        longest = max(len(s) for s in seq.params.stop)
        tail = seq.output_ids[-(4 * longest + 4):]
        text = self.tokenizer.decode(tail)
        return any(s in text for s in seq.params.stop)

    def _forward(self, input_ids, positions, meta, logits_indices):
        return self.model.forward_paged(input_ids, positions, meta, self.kv_cache, logits_indices)

    def _copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        host = torch.tensor([[s for s, _ in copies], [d for _, d in copies]], dtype=torch.long)
        if self.device.type == "cuda":  # pinned: the copy does not wait for the steps already queued
            host = host.pin_memory()
        src, dst = host.to(self.device, non_blocking=True)
        for k, v in zip(self.kv_cache.k, self.kv_cache.v):
            k.index_copy_(0, dst, k.index_select(0, src))
            v.index_copy_(0, dst, v.index_select(0, src))

    def _launch(self, out: SchedulerOutput, prev: "_InFlight | None") -> "_InFlight":
        """Queue one step (inputs, forward, sampling, the copy of its tokens to the host) without waiting.

        Decode rows whose input token is still a placeholder (sampled by ``prev``, not yet on the host)
        read it from ``prev``'s sampled tokens on the device."""
        step = _InFlight(out, time.perf_counter())
        if out.copies:
            self._copy_blocks(out.copies)
        ids, pos, slots, qsl, ctx, sample_rows = [], [], [], [0], [], []
        sampled: list[Sequence] = []
        out_pos: list[int] = []
        bs = self.block_size
        from_prev: list[tuple[int, int]] = []  # (row of this step, sampled row of prev)
        prev_rows = {} if prev is None else {id(q): r for r, q in enumerate(prev.rows) if q is not None}
        for chunk in out.chunks:
            seq = chunk.seqs[0]
            table = seq.block_table
            if chunk.num_tokens == 1:  # a decode step (or a one-token chunk): no list building per token
                token = seq.token_ids[chunk.start]
                if token == PLACEHOLDER:
                    from_prev.append((len(ids), prev_rows[id(seq)]))
                ids.append(token)
                pos.append(chunk.start)
                slots.append(table[chunk.start // bs] * bs + chunk.start % bs)
            else:
                ids += seq.token_ids[chunk.start:chunk.end]
                pos += range(chunk.start, chunk.end)
                slots += [table[p // bs] * bs + p % bs for p in range(chunk.start, chunk.end)]
            qsl.append(qsl[-1] + chunk.num_tokens)
            ctx.append(chunk.end)
            if chunk.samples:
                for s in chunk.seqs:
                    sample_rows.append(qsl[-1] - 1)
                    sampled.append(s)
                    out_pos.append(s.num_output_tokens)
        tables = self._tables.rows([chunk.seqs[0] for chunk in out.chunks])  # (S, width), one gather
        dev = self.device
        n_rows, n_seqs, width = len(ids), tables.shape[0], tables.shape[1]
        if from_prev and (prev is None or prev.tokens is None):
            raise RuntimeError("a placeholder token without the step that samples it (engine bug)")
        fill = [r for r, _ in from_prev] + [q for _, q in from_prev]  # rows to fill, prev's sampled rows
        head = np.array(ids + pos + slots + qsl + ctx + sample_rows + fill + out_pos, dtype=np.int64)
        host = torch.from_numpy(np.concatenate([head, tables.reshape(-1)]))
        if dev.type == "cuda":  # one host-to-device transfer for the whole step's metadata (pinned, so
            host = host.pin_memory()  # it does not wait for the steps already queued)
        packed = host.to(dev, non_blocking=True)
        ids_t, pos_t, slots_t, qsl_t, ctx_t, rows_t, fill_t, out_pos_t, table_t = packed.split(
            [n_rows, n_rows, n_rows, n_seqs + 1, n_seqs, len(sample_rows), len(fill), len(out_pos), n_seqs * width])
        if from_prev:  # placeholder inputs: the previous step's sampled tokens, still on the device
            k = len(from_prev)
            ids_t = ids_t.index_put((fill_t[:k],), prev.tokens[fill_t[k:]].to(ids_t.dtype))
        ctx_t = ctx_t.to(torch.int32)
        table_t = table_t.to(torch.int32).view(n_seqs, width)
        # the sampling settings go to the device before the forward is queued, so the sampler follows the
        # forward on the GPU without the host waiting in between
        batch = self._sampling_batch(sampled, out_pos, out_pos_t) if sample_rows else None
        graphs = self._graphs
        if out.is_decode and graphs is not None and graphs.padded_size(n_rows) is not None:
            logits = graphs.run(ids_t, pos_t, ctx_t, slots_t, table_t)
        else:
            meta = PagedAttentionMetadata(
                query_start_loc=qsl_t.to(torch.int32), context_lens=ctx_t, block_tables=table_t, slot_mapping=slots_t,
                max_query_len=max(c.num_tokens for c in out.chunks), max_context_len=max(ctx))
            rows = None if out.is_decode else rows_t
            logits = self._forward(ids_t, pos_t, meta, rows)
            if batch is None:  # prefill chunks that end mid-prompt: nothing to sample this step
                return step
        tokens, logprobs = sample(logits, batch)
        step.tokens = tokens
        packed = torch.stack([tokens.to(torch.float64), logprobs.to(torch.float64)])
        if dev.type == "cuda":  # one D2H copy into pinned memory, waited for in _collect
            step.host = torch.empty(packed.shape, dtype=packed.dtype, pin_memory=True)
            step.host.copy_(packed, non_blocking=True)
            step.done = torch.cuda.Event()
            step.done.record()
        else:
            step.host = packed
        return step

    def _sampling_batch(self, seqs: list[Sequence], out_pos: list[int], out_pos_t: torch.Tensor) -> SamplingBatch:
        """The rows' sampling settings on the device. Between decode steps of the same sequences only the
        output positions change (they came with the step's metadata): the rest is built once and reused."""
        key = tuple(s.seq_id for s in seqs)
        cached = self._sampling_cache
        if cached is None or cached[0] != key:
            batch = SamplingBatch.build([s.params for s in seqs], [s.sample_index for s in seqs], out_pos, self.device)
            self._sampling_cache = (key, batch)
            return batch
        return dataclasses.replace(cached[1], position=out_pos_t)

    def _collect(self, step: "_InFlight") -> tuple[list[int], list[float]]:
        """The step's sampled tokens and log-probabilities on the host (waits for the step)."""
        if step.host is None:
            return [], []
        wait_start = time.perf_counter()
        if step.done is not None:
            step.done.synchronize()
        self._wait_seconds += time.perf_counter() - wait_start
        return [int(t) for t in step.host[0].tolist()], step.host[1].tolist()


class _InFlight:
    """A launched step: its schedule, its sampled tokens on the device and (on their way) on the host,
    and what :meth:`Scheduler.advance` recorded for it."""

    def __init__(self, out: SchedulerOutput, start: float) -> None:
        self.out, self.start = out, start
        self.tokens: torch.Tensor | None = None
        self.host: torch.Tensor | None = None
        self.done: torch.cuda.Event | None = None
        self.rows: list[Sequence | None] = []
        self.finished: list[Sequence] = []




__all__ = ["RolloutEngine"]
