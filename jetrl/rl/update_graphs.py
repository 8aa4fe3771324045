"""CUDA graphs of the update's micro-batches: forward, loss and backward captured once per padded shape, replayed
for every later micro-batch of that shape; and of the old-logprob pass's forwards (:meth:`UpdateGraphs.score`).

Why: at 0.5B-1.5B parameters the update is host-bound. A micro-batch issues thousands of kernels from Python
(autograd, activation checkpointing, the FP8 linears' quantizers and GEMMs), and the GPU waits between them. A
replay issues them all at once.

How: each micro-batch is padded to a :func:`~jetrl.rl.micro_batch.bucket_shape` (above 2K tokens at most 1/16 more; see
:mod:`jetrl.rl.micro_batch` for why padding changes neither the loss nor the gradient). The first micro-batch of
the run's first shape (of each kind: scoring, update) runs eagerly on the graphs' stream: its gradient is real,
and it compiles and warms up everything lazily made. Then the same work is captured (not run again). The first
micro-batch of every later shape is captured straight away and replayed: a capture issues the kernels without
running them and never waits for the GPU, so it overlaps the previous micro-batch's replay, where an eager run
would leave the GPU idle between host-bound launches; only if that capture fails does the micro-batch warm up
eagerly and capture again (and every later new shape warms up eagerly too). Later micro-batches of a shape copy
their inputs into the shape's static buffers and replay. All graphs share one memory pool, so the largest shape's
activations are held once, not once per shape. ``capture_seconds`` sums the host time new shapes took over the run
(the step's ``update/graph_capture_seconds``).

What a replay relies on staying put is checked before each one (:func:`~jetrl.models.cuda_graphs.storage_key`
with gradients and W^T copies); any change drops every graph, and the next micro-batches capture again. The
gradient buffers stay put: the optimizer keeps them and zeroes them in place
(:class:`~jetrl.train.optim.MasterWeightAdamW` with ``keep_grads``), and autograd accumulates into them inside the
graph.

Fast mode on one CUDA device only: exact mode plans its attention on the host per micro-batch, and FSDP gathers
parameters collectively, so those run eagerly (:func:`graphs_apply`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import Sequence

import torch
import torch.nn as nn

from jetrl.models.attention import flash_varlen_supported
from jetrl.models.cuda_graphs import CaptureFailed, capture, storage_key, warn_eager
from jetrl.rl.batch import RolloutBatch
from jetrl.rl.micro_batch import (MicroBatchShape, PackedMicroBatch, blob_sizes, bucket_shape, micro_batch_loss,
                                  micro_batch_sizes, pack, packed_logprobs)

# the loss inputs a micro-batch may carry besides mask and advantages, in the order of their static buffers
LOSS_INPUTS = ("old_logprobs", "rollout_logprobs", "is_weights", "ref_logprobs")


def graphs_apply(model: nn.Module, *, exact: bool, world_size: int) -> str | None:
    """Why the update cannot run as CUDA graphs here (None: it can)."""
    param = next(model.parameters())
    if param.device.type != "cuda":
        return "the model is not on a CUDA device"
    if exact:
        return "exact mode plans its attention on the host for every micro-batch"
    if world_size > 1:
        return "FSDP gathers the parameters collectively inside the forward"
    if not flash_varlen_supported(param.device, param.dtype, model.config.head_dim):
        return (f"the packed flash-attention path does not take {param.dtype} at head size {model.config.head_dim} "
                "on this GPU")
    return None


@dataclass
class _Graph:
    """One shape's graph with its static inputs and outputs."""

    blob: torch.Tensor                      # the packed index tensors (PackedMicroBatch.blob) on the device
    mask: torch.Tensor                      # (sequences, width) bool
    advantages: torch.Tensor                # (sequences,)
    inputs: dict[str, torch.Tensor]         # LOSS_INPUTS present: (sequences, width) fp32
    counts: torch.Tensor                    # (2,) fp32: the mini-batch's token and sequence normalisers
    score: bool = False                     # a forward-only graph (the old-logprob pass)
    graph: torch.cuda.CUDAGraph | None = None
    lp: torch.Tensor | None = None          # (sequences, width) log-probs, detached
    stats: torch.Tensor | None = None       # micro_batch_loss's statistics


class UpdateGraphs:
    """The update's micro-batches as CUDA graphs, one per (shape, loss inputs present); see the module doc.

    ``alg``: the :class:`~jetrl.config.schema.AlgorithmConfig`; ``temperature``: the sampling temperature the
    log-probs are taken at; ``kv_fp8``: attention over FP8-cache values (``forward_packed``'s); ``max_len``: the
    generation budget (``rollout.max_tokens``): the loss tensors' width and the ``sequence-sum-norm`` constant."""

    def __init__(self, model: nn.Module, alg, *, temperature: float, kv_fp8: bool, max_len: int) -> None:
        self.model, self.alg = model, alg
        self.temperature, self.kv_fp8, self.max_len = float(temperature), bool(kv_fp8), int(max_len)
        self.device = next(model.parameters()).device
        self.stream = torch.cuda.Stream(self.device)
        self.pool = torch.cuda.graph_pool_handle()
        self.graphs: dict[tuple, _Graph] = {}
        self.key: tuple | None = None
        self.captures = 0  # over the run, for the step's metrics
        self.replays = 0
        self.warm: set[bool] = set()  # the kinds (``score``) that ran eagerly once: later shapes capture directly
        self.capture_first = True  # False once such a direct capture failed: every new shape warms up eagerly
        self.capture_seconds = 0.0  # host time spent on new shapes (warm-up, capture), over the run
        self.failed: str | None = None  # why a capture failed (the trainer then runs eagerly)
        self.max_sequences = 0  # capacities of every shape so far (see pack)
        self.max_seqlen = 0

    def pack(self, batch: RolloutBatch, rows: Sequence[int]) -> PackedMicroBatch:
        """``rows`` of ``batch`` packed at their bucket shape (:func:`~jetrl.rl.micro_batch.bucket_shape`, ``max_len``
        cells per sequence), with the sequence capacity and the sequence-length bound the largest the run has met
        so far (they only grow), so that micro-batches of one token count share a graph."""
        tokens, scored, longest = micro_batch_sizes(batch, rows)
        shape = bucket_shape(tokens, scored, len(rows), self.max_len, longest)
        self.max_sequences = max(self.max_sequences, shape.sequences)
        self.max_seqlen = max(self.max_seqlen, shape.max_seqlen)
        shape = replace(shape, sequences=self.max_sequences, max_seqlen=self.max_seqlen,
                        offsets=shape.offsets - shape.sequences + self.max_sequences)
        return pack(batch, rows, shape.width, shape)

    def _step(self, packed: PackedMicroBatch, g: _Graph) -> tuple[torch.Tensor, torch.Tensor]:
        with torch.set_grad_enabled(not g.score):  # scoring: forward only
            lp, ent = packed_logprobs(self.model, packed, g.blob, self.temperature, kv_fp8=self.kv_fp8, on_device=True)
        if g.score:
            return lp, g.counts
        loss, stats = micro_batch_loss(self.alg, lp, ent, g.mask, g.advantages, num_tokens=g.counts[0],
                                       num_seqs=g.counts[1], max_len=self.max_len,
                                       **{name: g.inputs.get(name) for name in LOSS_INPUTS})
        loss.backward()
        return lp.detach(), stats

    def run(self, packed: PackedMicroBatch, mask: torch.Tensor, advantages: torch.Tensor,
            inputs: dict[str, torch.Tensor | None], num_tokens: int, num_seqs: int
            ) -> tuple[torch.Tensor, torch.Tensor]:
        """Forward, loss and backward of one micro-batch packed at a bucket shape; the gradient is accumulated
        into the parameters' ``.grad``. ``mask`` (b, R), ``advantages`` (b,) and ``inputs`` (b, R) each (by
        :data:`LOSS_INPUTS` name; None: absent) cover the micro-batch's b real sequences. Returns the
        log-probs (b, R), detached, and the statistics vector, both fresh tensors."""
        present = tuple(name for name in LOSS_INPUTS if inputs.get(name) is not None)
        b, width = mask.shape
        return self._launch(packed, present, b, width,
                            lambda g: self._fill(g, packed, mask, advantages, inputs, num_tokens, num_seqs))

    def score(self, packed: PackedMicroBatch, num_rows: int, width: int) -> torch.Tensor:
        """Log-probs (num_rows, width) of a micro-batch packed at a bucket shape, without grad (the old-logprob
        pass): a forward-only graph per shape, in the same pool."""
        return self._launch(packed, None, num_rows, width, lambda g: self._fill(g, packed))[0]

    def _launch(self, packed: PackedMicroBatch, present: tuple[str, ...] | None, b: int, width: int, fill
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """Replay the graph of (shape, ``present``; None: scoring) after ``fill`` set its inputs; the first time,
        capture it and replay, or, before any micro-batch of this kind ran (or if that capture fails), run
        eagerly and capture (see the module doc)."""
        shape = packed.shape
        with torch.no_grad():  # a graph accumulates into existing buffers (into none, it would replace .grad)
            for p in self.model.parameters():
                if p.requires_grad and p.grad is None:
                    p.grad = torch.zeros_like(p)
        key = storage_key(self.model, grads=True, transposes=True)
        if key != self.key:
            self.graphs.clear()
        g = self.graphs.get((shape, present))
        fresh = g is None
        if fresh:
            g = self._buffers(shape, present)
        fill(g)
        if not fresh:
            return self._replay(g, b, width)
        start = time.perf_counter()
        try:
            return self._first(packed, present, g, key, b, width)
        finally:
            self.capture_seconds += time.perf_counter() - start

    def _first(self, packed: PackedMicroBatch, present: tuple[str, ...] | None, g: _Graph, key: tuple, b: int,
               width: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The first micro-batch of a shape: captured and replayed, or run eagerly and captured (module doc)."""
        shape = packed.shape
        main = torch.cuda.current_stream(self.device)
        if self.capture_first and g.score in self.warm:
            if self._capture(packed, g):
                self._store(shape, present, g, key)
                return self._replay(g, b, width)
            self.capture_first = False  # something here needs its eager run first: warm up every new shape
        self.warm.add(g.score)
        self.stream.wait_stream(main)
        with torch.cuda.stream(self.stream):
            lp, stats = self._step(packed, g)  # the real micro-batch, eagerly: warms up what the capture records
            lp, stats = lp[:b, :width].clone(), stats.clone()
        main.wait_stream(self.stream)
        lp.record_stream(main)
        stats.record_stream(main)
        if not self._capture(packed, g):  # a path that cannot be captured still trains, eagerly (this
            self.graphs.clear()           # micro-batch already did)
            what = "old-logprob pass's" if g.score else "update's"
            warn_eager(f"the {what} micro-batch", CaptureFailed(self.failed), "the update and the old-logprob pass "
                       "run eagerly from here (algorithm.cuda_graphs: false says so up front)", stacklevel=5)
            return lp, stats
        self.failed = None
        self._store(shape, present, g, key)
        return lp, stats

    def _capture(self, packed: PackedMicroBatch, g: _Graph) -> bool:
        """Capture ``g``'s micro-batch on the graphs' stream (nothing runs); False, with :attr:`failed` set, if
        the capture failed."""
        try:
            g.graph, (g.lp, g.stats) = capture(lambda: self._step(packed, g), stream=self.stream, pool=self.pool)
        except CaptureFailed as exc:
            self.failed = str(exc)
            self.pool = torch.cuda.graph_pool_handle()  # a failed capture's pool takes no other (the toolkit's doc)
            return False
        return True

    def _store(self, shape: MicroBatchShape, present: tuple[str, ...] | None, g: _Graph, key: tuple) -> None:
        self.graphs[(shape, present)] = g
        self.captures += 1
        # the eager run may have made FP8 caches (a group's stacked weight)
        after = storage_key(self.model, grads=True, transposes=True)
        if after != key:  # the graphs captured before read the old addresses
            self.graphs = {(shape, present): g}
        self.key = after

    def _replay(self, g: _Graph, b: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
        g.graph.replay()
        self.replays += 1
        return g.lp[:b, :width].clone(), g.stats.clone()

    def _buffers(self, shape: MicroBatchShape, present: tuple[str, ...] | None) -> _Graph:
        cells = (shape.sequences, shape.width)
        kw = dict(device=self.device)
        return _Graph(blob=torch.zeros(sum(blob_sizes(shape)), dtype=torch.int64, **kw),
                      mask=torch.zeros(cells, dtype=torch.bool, **kw),
                      advantages=torch.zeros(shape.sequences, dtype=torch.float32, **kw),
                      inputs={name: torch.zeros(cells, dtype=torch.float32, **kw) for name in present or ()},
                      counts=torch.ones(2, dtype=torch.float32, **kw), score=present is None)

    def _fill(self, g: _Graph, packed: PackedMicroBatch, mask: torch.Tensor | None = None,
              advantages: torch.Tensor | None = None, inputs: dict[str, torch.Tensor | None] | None = None,
              num_tokens: int = 1, num_seqs: int = 1) -> None:
        host = torch.cat([packed.blob, torch.tensor([num_tokens, num_seqs], dtype=torch.int64)]).pin_memory()
        device = host.to(self.device, non_blocking=True)
        g.blob.copy_(device[:-2])
        g.counts.copy_(device[-2:])
        if mask is None:  # scoring reads the packed tensors alone
            return
        b, width = mask.shape
        g.mask.zero_()
        g.mask[:b, :width].copy_(mask)
        g.advantages.zero_()
        g.advantages[:b].copy_(advantages.float())
        for name, buf in g.inputs.items():
            buf.zero_()
            buf[:b, :width].copy_(inputs[name].float())


__all__ = ["UpdateGraphs", "graphs_apply", "LOSS_INPUTS"]
