"""``ModelRunner``: runs the policy model for the rollout engine, one scheduled step at a time.

The engine (:mod:`jetrl.rollout.engine`) decides *what* to compute; the runner decides *how* it is computed on
the device, and holds everything that lives there: the paged KV cache (sized from a memory budget), the CUDA
graphs of the decode step, the per-step input tensors, the block copies of copy-on-write, and the sampling of
the logits. Its interface, in the order a ``generate`` call uses it: :meth:`~ModelRunner.allocate_kv_cache`,
:meth:`~ModelRunner.begin`, then :meth:`~ModelRunner.launch` and :meth:`~ModelRunner.collect` per step;
:meth:`~ModelRunner.free_cache` in between calls. Exact on-policy mode is its ``exact`` flag (every forward,
captured or eager, runs the model's exact path and the sampler reports the trainer's exact log-probabilities, see
:mod:`jetrl.quant.exact`); the FP8 KV cache its ``kv_fp8`` flag (E4M3 pools plus fp32 scale pools, see
:mod:`jetrl.models.attention`).

**Inputs.** A step is packed into one ``model.forward_paged`` call: the chunks' tokens concatenated, their
positions, the KV slots they write, and :class:`~jetrl.models.attention.PagedAttentionMetadata`. All the
step's integer metadata goes to the device in one (pinned, asynchronous) host-to-device copy. A prefill
step computes logits only at the rows that sample (the last row of a chunk that completes its prompt).

**CUDA graphs.** On CUDA the decode step (one token per sequence) runs as a CUDA graph per batch size of a
candidate set; a batch is padded to the next candidate with rows that write into a scratch block no sequence
owns (the pool's last block). A size is captured the first time a step needs it. Besides ``free_cache``, the
graphs are dropped and captured again only when what they depend on changes: a parameter, a cached FP8 weight
or its scale, or a stacked BF16 weight (:func:`jetrl.quant.bf16_stacks`) moves to new storage; the recipe swaps
the linear layers for new modules; or the kernel tuning in force changes
(:func:`jetrl.models.cuda_graphs.storage_key`, shared with the update's graphs, as is the capture itself:
:func:`~jetrl.models.cuda_graphs.capture`, after one eager warm-up). A new weight version is
re-quantized into the same FP8 buffers, so graphs survive optimizer steps in ``jet``, but a sharded model's
weights, gathered for each rollout, move every step. The first capture of a set of graphs first compiles the
GEMM kernels that compile at first use (DeepGEMM's, where it loads) for every candidate size at once.
``graph_captures`` and ``graph_capture_seconds`` count the work (that compilation included).

**Precision.** Every forward runs under ``torch.no_grad`` and ``precision_side("rollout")``, so in ``jet``
each linear layer reads its cached FP8 weight of the current weight version, the same bytes the training
forward uses. Not ``torch.inference_mode``: the FP8 weights quantized here are cached on the layers and
reused by the training forward of the same version, and inference-mode tensors cannot be saved for backward.
"""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Sequence as Seq

import numpy as np
import torch

from jetrl.models.attention import PagedAttentionMetadata, PagedKVCache
from jetrl.models.cuda_graphs import capture, storage_key, warn_eager
from jetrl.quant import precision_side
from jetrl.quant.backend import prepare_gemms
from jetrl.quant.linear import forward_gemm_weights
from jetrl.quant.recipe import check_exact
from jetrl.rollout.block_manager import BlockTableMirror
from jetrl.rollout.sampling import SamplingBatch, sample, to_device
from jetrl.rollout.scheduler import PLACEHOLDER, SchedulerOutput
from jetrl.rollout.sequence import Sequence

DEFAULT_CPU_BUDGET_BYTES = 256 * 2 ** 20
DEFAULT_GPU_FRACTION = 0.5


@dataclasses.dataclass
class LaunchedStep:
    """A step queued on the device: its sampled tokens there and, on their way, on the host.

    ``sampled`` lists the sequence of each sampled row (chunk order): the next step finds its placeholder
    inputs among them."""

    sampled: list[Sequence] = dataclasses.field(default_factory=list)
    tokens: torch.Tensor | None = None  # (rows,) on the device: a decode run's last step's
    host: torch.Tensor | None = None  # (2, steps, rows) float64: tokens and log-probs, pinned on CUDA
    done: torch.cuda.Event | None = None
    wait_seconds: float = 0.0


class _DecodeGraphs:
    """CUDA graphs of ``forward_paged`` for decode batches of the candidate sizes, over static buffers.

    A size is captured when a step first needs it, not up front: a rollout whose batch never shrinks captures one
    graph, and a model whose weights move every step pays one capture per size it uses, not per candidate."""

    def __init__(self, runner: "ModelRunner", sizes: list[int]) -> None:
        # no reference back to the runner: a runner dropped with its graphs is freed at once, not by the cyclic
        # collector at some later allocation, possibly inside another runner's capture
        model, cache, exact = runner.model, runner.kv_cache, runner.exact
        self.model, self.device = model, runner.device
        self.forward = lambda ids, pos, meta: model.forward_paged(ids, pos, meta, cache, None, exact=exact)
        self.sizes = sorted(sizes)
        max_b, width, dev = self.sizes[-1], runner.max_blocks_per_seq, runner.device
        self.input_ids = torch.zeros(max_b, dtype=torch.long, device=dev)
        self.positions = torch.zeros(max_b, dtype=torch.long, device=dev)
        self.query_start_loc = torch.arange(max_b + 1, dtype=torch.int32, device=dev)
        self.context_lens = torch.ones(max_b, dtype=torch.int32, device=dev)
        self.block_tables = torch.full((max_b, width), -1, dtype=torch.int32, device=dev)
        self.slot_mapping = torch.zeros(max_b, dtype=torch.long, device=dev)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.max_context_len = runner.max_model_len
        self.scratch_block, self.block_size = runner.scratch_block, runner.block_size
        self._park(0, max_b)
        self.pool = torch.cuda.graph_pool_handle()
        self.stream = torch.cuda.Stream(dev)  # warm-ups and captures run here
        self.prepared = False  # GEMM kernels compiled ahead for every size (the first capture does it)

    def _park(self, start: int, stop: int) -> None:
        """Rows ``start..stop-1`` to the padding state: one token written into the scratch block, attending to
        it alone (what a padding row of a replay does, and what a capture's warm-up forward runs on)."""
        self.input_ids[start:stop].zero_()
        self.positions[start:stop].zero_()
        self.context_lens[start:stop].fill_(1)
        self.slot_mapping[start:stop].fill_(self.scratch_block * self.block_size)
        self.block_tables[start:stop, 0].fill_(self.scratch_block)

    def capture(self, b: int) -> None:
        """Capture the decode step for ``b`` rows: a warm-up forward (autotuning, caches), then the capture,
        both over parked rows so that nothing is written outside the scratch block. The first capture first
        compiles the GEMM kernels of every candidate size at once (:func:`~jetrl.quant.backend.prepare_gemms`,
        for the FP8 weights the rollout-side forwards have multiplied so far, the prefill's at least)."""
        if not self.prepared:
            self.prepared = True
            with precision_side("rollout"):
                prepare_gemms(self.sizes, self.device, forward_gemm_weights(self.model))
        self._park(0, b)
        meta = PagedAttentionMetadata(self.query_start_loc[:b + 1], self.context_lens[:b], self.block_tables[:b],
                                      self.slot_mapping[:b], max_query_len=1, max_context_len=self.max_context_len)
        self.graphs[b], self.outputs[b] = capture(lambda: self.forward(self.input_ids[:b], self.positions[:b], meta),
                                                  stream=self.stream, pool=self.pool, warmup=True)

    def padded_size(self, b: int) -> int | None:
        return next((size for size in self.sizes if size >= b), None)

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, context_lens: torch.Tensor,
            slot_mapping: torch.Tensor, block_tables: torch.Tensor) -> torch.Tensor:
        b = input_ids.shape[0]
        size = self.padded_size(b)  # captured by the runner before this call
        self.input_ids[:b].copy_(input_ids)
        self.positions[:b].copy_(positions)
        self.context_lens[:b].copy_(context_lens)
        self.slot_mapping[:b].copy_(slot_mapping)
        self.block_tables[:b, :block_tables.shape[1]].copy_(block_tables)
        if size > b:
            self._park(b, size)
        self.graphs[size].replay()
        return self.outputs[size][:b]


class ModelRunner:
    """Runs ``model`` for the rollout engine over a paged KV cache (see the module doc for the interface).

    Args:
        model: a jetrl decoder with ``forward_paged`` and ``config`` (a :class:`~jetrl.models.DecoderConfig`),
            already in its precision recipe.
        max_model_len: context limit in tokens (sizes the block tables and the graphs' attention).
        block_size: tokens per KV block.
        max_num_seqs: most sequences in one decode step (the largest captured graph; caps the pool size).
        memory_budget, num_blocks, cuda_graphs, graph_batch_sizes, exact, kv_fp8: as
            :class:`~jetrl.rollout.engine.RolloutEngine`'s (``exact`` requires a recipe with one precision on both
            sides). An FP8 cache takes ``head_dim + 4`` bytes per token, head and K or V instead of
            ``2 * head_dim`` in BF16; block copies and the scratch block cover its scales.
    """

    def __init__(self, model: torch.nn.Module, *, max_model_len: int, block_size: int, max_num_seqs: int,
                 memory_budget: float | int | None = None, num_blocks: int | None = None, cuda_graphs: bool = True,
                 graph_batch_sizes: Seq[int] | None = None, exact: bool = False, kv_fp8: bool = False) -> None:
        if exact:
            check_exact(model)
        self.model = model
        self.exact = bool(exact)
        self.kv_fp8 = bool(kv_fp8)
        config = model.config  # a DecoderConfig: head_dim is set (hidden_size // num_attention_heads by default)
        self.num_layers = config.num_hidden_layers
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.max_model_len = max_model_len
        self.block_size = block_size
        self.max_num_seqs = max_num_seqs
        self.max_blocks_per_seq = math.ceil(max_model_len / block_size)
        first = next(p for p in model.parameters() if p.is_floating_point())
        self.device, self.dtype = first.device, first.dtype
        self.memory_budget = memory_budget
        self.requested_num_blocks = num_blocks
        self.use_cuda_graphs = cuda_graphs and self.device.type == "cuda"
        sizes = [1, 2, 4, 8] + list(range(16, max_num_seqs + 1, 16)) if graph_batch_sizes is None else graph_batch_sizes
        self.graph_batch_sizes = sorted({int(s) for s in sizes if 1 <= int(s) <= max_num_seqs} | {max_num_seqs})
        self.kv_cache: PagedKVCache | None = None
        self.num_blocks = 0  # usable blocks (the pool has one more: the scratch block)
        self.graphs: _DecodeGraphs | None = None
        self._graph_key: tuple | None = None
        self.graph_captures = 0  # decode graphs captured so far, and the seconds that took (the engine's stats)
        self.graph_capture_seconds = 0.0
        self._tables: BlockTableMirror | None = None  # the current generate call's block tables, on the host
        self._sampling_cache: tuple[tuple[int, ...], SamplingBatch] | None = None

    @property
    def bytes_per_block(self) -> int:
        """K and V of ``block_size`` tokens in every layer: in the model's dtype, or (``kv_fp8``) one byte per
        element plus a 4-byte scale per token and KV head."""
        per_head = self.head_dim + 4 if self.kv_fp8 else self.head_dim * self.dtype.itemsize
        return 2 * self.num_layers * self.block_size * self.num_kv_heads * per_head

    @property
    def scratch_block(self) -> int:
        """The pool's extra block: CUDA-graph padding rows write there; no sequence owns it."""
        return self.num_blocks

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
        blocks = min(int(nbytes // self.bytes_per_block), self.max_num_seqs * self.max_blocks_per_seq)
        if blocks < 1:
            raise ValueError(f"memory_budget of {nbytes:.0f} bytes holds no KV block of {self.bytes_per_block} "
                             f"bytes; raise it")
        return blocks

    def allocate_kv_cache(self) -> int:
        """Make the KV cache if there is none (sized once, then kept); returns the usable block count."""
        if self.kv_cache is None:
            self.num_blocks = self._pool_blocks()
            self.kv_cache = PagedKVCache.allocate(self.num_layers, self.num_blocks + 1, self.block_size,
                                                  self.num_kv_heads, self.head_dim, self.dtype, self.device,
                                                  kv_fp8=self.kv_fp8)
            self.graphs = None
        return self.num_blocks

    def free_cache(self) -> None:
        """Release the KV cache and CUDA graphs (e.g. to give memory to the trainer); re-made on demand."""
        self.kv_cache = self.graphs = self._graph_key = None
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def _weights_key(self) -> tuple:
        """What the captured CUDA graphs depend on (:func:`~jetrl.models.cuda_graphs.storage_key`): the kernel
        tuning, the parameters, the rollout side's FP8 weights without their W^T copies (a grouped layer's are
        its group's stacked weight, so no per-layer copy is made) and the stacked BF16 weights."""
        with precision_side("rollout"):
            return storage_key(self.model, grads=False, transposes=False)

    def _decode_eagerly(self, exc: Exception, stacklevel: int) -> None:
        """A model path that cannot be captured still runs, eagerly: warn and turn the graphs off."""
        warn_eager("the decode step", exc, "decoding eagerly", stacklevel=stacklevel + 1)
        self.use_cuda_graphs = False
        self.graphs = None

    def _graphs_for(self, rows: int) -> _DecodeGraphs | None:
        """The graphs that replay a decode step of ``rows`` rows, its padded size captured now if this is the
        first step that needs it; None when there are no graphs or ``rows`` exceeds the largest size. A capture
        that fails turns the graphs off with a warning: the steps run eagerly."""
        graphs = self.graphs
        size = graphs.padded_size(rows) if graphs is not None else None
        if size is None or size in graphs.graphs:
            return None if size is None else graphs
        t0 = time.perf_counter()
        try:
            graphs.capture(size)
        except Exception as exc:
            self._decode_eagerly(exc, stacklevel=4)
            return None
        self.graph_captures += 1
        self.graph_capture_seconds += time.perf_counter() - t0
        # the capture ran the layers, so every FP8 weight a graph reads exists now: key the graphs on those buffers
        # (a key taken before the first forward would name none, and the next rollout would capture again)
        self._graph_key = self._weights_key()
        return graphs

    def begin(self, seqs: list[Sequence]) -> None:
        """A ``generate`` call over ``seqs`` starts (after :meth:`allocate_kv_cache`): drop the CUDA graphs if what
        they depend on changed, and start a host mirror of the sequences' block tables."""
        key = self._weights_key() if self.use_cuda_graphs else None
        if self.use_cuda_graphs and (self.graphs is None or key != self._graph_key):
            try:
                with torch.no_grad(), precision_side("rollout"):
                    self.graphs = _DecodeGraphs(self, self.graph_batch_sizes)
                self._graph_key = key
            except Exception as exc:
                self._decode_eagerly(exc, stacklevel=3)
        self._tables = BlockTableMirror(seqs, self.max_blocks_per_seq)

    def _copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        src, dst = to_device(torch.tensor(list(zip(*copies)), dtype=torch.long), self.device)  # (2, copies)
        cache = self.kv_cache
        pools = [*cache.k, *cache.v] + ([*cache.k_scale, *cache.v_scale] if cache.is_fp8 else [])
        for pool in pools:  # an FP8 block's scales travel with its data
            if pool.dtype == torch.float8_e4m3fn:  # copy the bytes: index_copy_ has no float8 kernel everywhere
                pool = pool.view(torch.uint8)
            pool.index_copy_(0, dst, pool.index_select(0, src))

    def launch(self, out: SchedulerOutput, prev: LaunchedStep | None) -> LaunchedStep:
        """Queue one step (block copies, inputs, forward, sampling, the copy of its tokens to the host)
        without waiting for the device. A decode run takes ``out.steps`` forwards and samplings back to back,
        each step's inputs made on the device from the step before (sampled tokens; positions, context lengths
        and KV slots one further, within the blocks the scheduler made writable for the whole run).

        Decode rows whose input token is still a placeholder (sampled by ``prev``, not yet on the host)
        read it from ``prev``'s sampled tokens on the device."""
        with torch.no_grad(), precision_side("rollout"):
            return self._launch(out, prev)

    def _launch(self, out: SchedulerOutput, prev: LaunchedStep | None) -> LaunchedStep:
        step = LaunchedStep()
        if out.copies:
            self._copy_blocks(out.copies)
        ids, pos, slots, qsl, ctx, sample_rows = [], [], [], [0], [], []
        sampled = step.sampled
        out_pos: list[int] = []
        bs = self.block_size
        from_prev: list[tuple[int, int]] = []  # (row of this step, sampled row of prev)
        prev_rows = {} if prev is None else {id(q): r for r, q in enumerate(prev.sampled)}
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
            raise RuntimeError("a placeholder token without the step that samples it (model runner bug)")
        fill = [r for r, _ in from_prev] + [q for _, q in from_prev]  # rows to fill, prev's sampled rows
        row_steps = list(out.row_steps or ())  # a run's steps per row where some take fewer
        head = np.array(ids + pos + slots + qsl + ctx + sample_rows + fill + out_pos + row_steps, dtype=np.int64)
        packed = to_device(torch.from_numpy(np.concatenate([head, tables.reshape(-1)])), dev)  # one transfer
        ids_t, pos_t, slots_t, qsl_t, ctx_t, rows_t, fill_t, out_pos_t, row_steps_t, table_t = packed.split(
            [n_rows, n_rows, n_rows, n_seqs + 1, n_seqs, len(sample_rows), len(fill), len(out_pos), len(row_steps),
             n_seqs * width])
        if from_prev:  # placeholder inputs: the previous step's sampled tokens, still on the device
            k = len(from_prev)
            ids_t = ids_t.index_put((fill_t[:k],), prev.tokens[fill_t[k:]].to(ids_t.dtype))
        ctx_t = ctx_t.to(torch.int32)
        table_t = table_t.to(torch.int32).view(n_seqs, width)
        # the sampling settings go to the device before the forward is queued, so the sampler follows the
        # forward on the GPU without the host waiting in between
        batch = self._sampling_batch(sampled, out_pos, out_pos_t) if sample_rows else None
        graphs = self._graphs_for(n_rows) if out.is_decode else None
        qsl_t = qsl_t.to(torch.int32)
        tokens_run, logprobs_run = [], []
        for j in range(out.steps):  # a decode run: each step's sampled tokens are the next one's inputs
            if j:  # a row past its own steps idles: it stays where it is and writes into the scratch block
                live = row_steps_t > j if row_steps else 1
                ids_t, pos_t, ctx_t = tokens_run[-1], pos_t + live, ctx_t + live
                slots_t = table_t.gather(1, (pos_t // bs)[:, None]).squeeze(1) * bs + pos_t % bs
                if row_steps:
                    slots_t = torch.where(live, slots_t, self.scratch_block * bs)
                batch = dataclasses.replace(batch, position=batch.position + live)
            if graphs is not None:
                logits = graphs.run(ids_t, pos_t, ctx_t, slots_t, table_t)
            else:
                meta = PagedAttentionMetadata(
                    query_start_loc=qsl_t, context_lens=ctx_t, block_tables=table_t, slot_mapping=slots_t,
                    max_query_len=max(c.num_tokens for c in out.chunks), max_context_len=max(ctx) + j)
                logits = self.model.forward_paged(ids_t, pos_t, meta, self.kv_cache, None if out.is_decode else rows_t,
                                                  exact=self.exact)
                if batch is None:  # prefill chunks that end mid-prompt: nothing to sample this step
                    return step
            tokens, logprobs = sample(logits, batch, exact=self.exact)
            tokens_run.append(tokens)
            logprobs_run.append(logprobs)
        step.tokens = tokens
        packed = torch.stack([torch.stack(tokens_run).to(torch.float64), torch.stack(logprobs_run).to(torch.float64)])
        if dev.type == "cuda":  # one D2H copy into pinned memory, waited for in collect
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

    def collect(self, step: LaunchedStep) -> tuple[list[int], list[float]]:
        """The step's sampled tokens and log-probabilities on the host (waits for the step), one per sampled row
        in chunk order (empty when it sampled nothing); a decode run's step-major (row i's token of step j at
        ``j * rows + i``). ``step.wait_seconds`` then holds how long the host waited for the device."""
        if step.host is None:
            return [], []
        wait_start = time.perf_counter()
        if step.done is not None:
            step.done.synchronize()
        step.wait_seconds = time.perf_counter() - wait_start
        return [int(t) for t in step.host[0].reshape(-1).tolist()], step.host[1].reshape(-1).tolist()


__all__ = ["ModelRunner", "LaunchedStep"]
