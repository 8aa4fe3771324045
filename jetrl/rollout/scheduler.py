"""Continuous batching: which tokens of which sequences the next engine step computes.

Work is organised in *entries*: a list of sequences whose tokens are identical and which share KV blocks.
A fresh prompt enters as one entry holding its ``n`` samples (prefilled once: prefix sharing); once the
prompt's last logits are sampled, every sample becomes an entry of its own. A preempted sequence comes
back as an entry of one.

Each step is either a **prefill** step (chunks of uncomputed tokens, at most ``max_num_batched_tokens``
in total; a prompt longer than that is split over several steps: chunked prefill) or a **decode** step
(one new token for every running sequence, the shape CUDA graphs capture). Prefill has priority: a
waiting entry joins as soon as it fits (continuous batching), which keeps the decode batch full.

**Decode runs.** ``schedule(decode_steps=k)`` may make a decode step a *run* of up to ``k`` steps
(``SchedulerOutput.steps``) that the device takes without the host in between: each step's sampled tokens
are the next step's inputs on the device. A sequence takes the run's steps up to its length limit
(``SchedulerOutput.row_steps`` where some take fewer: such a row idles for the rest of the run, writing
nowhere but the scratch block, and finishes by length); the run is as long as the longest of them and as the
free blocks allow, the blocks of all its steps made writable up front (fresh blocks, copy-on-write of a shared
tail). A sequence that a stop token or stop string ends inside a run keeps the tokens up to the stop; the rest
of its run is computed for nothing and dropped (:meth:`Scheduler.resolve`). When not even the blocks for a run
of 2 are free, the step is a single decode step, which preempts as usual.

When a decode step needs a block and none is free, the newest running entry is **preempted by
recomputation**: its blocks are freed, it goes back to the front of the waiting queue keeping its
generated tokens, and later re-prefills them. Nothing is ever truncated; a sequence that cannot fit in
the whole pool even alone is rejected before generation starts (see :meth:`Scheduler.check_fits`).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Callable

from jetrl.rollout.block_manager import BlockManager
from jetrl.rollout.sequence import Sequence, SequenceStatus

PLACEHOLDER = -1  # a sampled token still on its way to the host (see Scheduler.advance)


@dataclass
class ScheduledChunk:
    """Tokens ``[start, end)`` of ``seqs[0].token_ids`` computed this step; ``seqs`` share them.

    When ``end`` reaches the sequence length (``samples``), the logits of the chunk's last row are
    sampled once per sequence in ``seqs``.
    """

    seqs: list[Sequence]
    start: int
    end: int
    # fixed when scheduled: a stop found inside the run before (resolved after this step was queued) may
    # shorten the sequence, and the step still samples the row it was launched with
    samples: bool = field(init=False)

    def __post_init__(self) -> None:
        self.samples = self.end == len(self.seqs[0])

    @property
    def num_tokens(self) -> int:
        return self.end - self.start


@dataclass
class SchedulerOutput:
    chunks: list[ScheduledChunk]
    is_decode: bool
    copies: list[tuple[int, int]] = field(default_factory=list)  # (src, dst) blocks to copy before the step
    steps: int = 1  # decode steps the device runs back to back (a decode run; see the module doc)
    row_steps: tuple[int, ...] | None = None  # a run's steps per chunk where some take fewer (None: all take steps)

    def steps_of(self, index: int) -> int:
        """The steps chunk ``index`` takes in this step or run."""
        return self.steps if self.row_steps is None else self.row_steps[index]


class Scheduler:
    """Waiting and running queues over a :class:`BlockManager`."""

    def __init__(self, block_manager: BlockManager, *, max_num_seqs: int, max_num_batched_tokens: int,
                 max_model_len: int) -> None:
        self.blocks = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.waiting: deque[list[Sequence]] = deque()
        self.running: list[list[Sequence]] = []
        self.num_preemptions = 0

    def check_fits(self, num_prompt_tokens: int, params_max_tokens: int, n: int) -> None:
        """Raise ValueError for a request that could never run, even alone in an empty pool."""
        total = min(num_prompt_tokens + params_max_tokens, self.max_model_len)
        needed = self.blocks.blocks_for_tokens(total - 1)  # the last sampled token is never cached
        if needed > self.blocks.num_blocks:
            raise ValueError(
                f"a sequence of {num_prompt_tokens} prompt + {total - num_prompt_tokens} new tokens needs "
                f"{needed} KV blocks of {self.blocks.block_size} tokens, but the pool has only "
                f"{self.blocks.num_blocks}; raise memory_budget, or lower max_tokens")
        if n > self.max_num_seqs:
            raise ValueError(f"n={n} samples per prompt exceeds max_num_seqs={self.max_num_seqs}")

    def add(self, seqs: list[Sequence]) -> None:
        """Queue the samples of one prompt (identical tokens) as one shared-prefix entry."""
        self.waiting.append(seqs)

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    @staticmethod
    def _is_prefilling(entry: list[Sequence]) -> bool:
        return entry[0].num_computed_tokens < len(entry[0]) - 1 or len(entry) > 1

    def schedule(self, decode_steps: int = 1) -> SchedulerOutput:
        """The next step: prefill chunks if any can run, else a decode step, or a run of up to
        ``decode_steps`` decode steps (see the module doc)."""
        out = self._schedule_prefill()
        return out if out.chunks else self._schedule_decode(*self._run_plan(decode_steps))

    def _schedule_prefill(self) -> SchedulerOutput:
        budget = self.max_num_batched_tokens
        chunks: list[ScheduledChunk] = []
        for entry in self.running:  # chunked prefills in progress continue first
            if budget == 0:
                break
            if self._is_prefilling(entry):
                start = entry[0].num_computed_tokens
                end = min(len(entry[0]), start + budget)
                chunks.append(ScheduledChunk(entry, start, end))
                budget -= end - start
        watermark = self.blocks.num_blocks // 100
        future = sum(self._future_blocks(e) for e in self.running) if self.waiting else 0
        while self.waiting and budget > 0:
            entry = self.waiting[0]
            if sum(len(e) for e in self.running) + len(entry) > self.max_num_seqs:
                break
            needed = self.blocks.blocks_for_tokens(len(entry[0]))
            # keep a watermark of free blocks (1% of the pool) for the running sequences to grow into, so an
            # admission does not force a preemption right away; no more than they can still use, so a pool
            # sized for every sequence admits every sequence; with nothing running, admit what fits
            entry_future = self._future_blocks(entry, allocated=False)
            reserve = min(watermark, future + entry_future) if self.running else 0
            if needed + reserve > self.blocks.num_free_blocks:
                break
            self.waiting.popleft()
            self.blocks.allocate_shared(entry, len(entry[0]))
            for seq in entry:
                seq.status = SequenceStatus.RUNNING
                seq.num_computed_tokens = 0
            self.running.append(entry)
            future += entry_future
            end = min(len(entry[0]), budget)
            chunks.append(ScheduledChunk(entry, 0, end))
            budget -= end
        return SchedulerOutput(chunks, is_decode=False)

    def _future_blocks(self, entry: list[Sequence], allocated: bool = True) -> int:
        """Blocks the entry's sequences may still allocate before they finish (at most)."""
        seq = entry[0]
        final_len = min(seq.num_prompt_tokens + seq.params.max_tokens, self.max_model_len) - 1  # cached tokens
        final_blocks = self.blocks.blocks_for_tokens(final_len)
        held = len(seq.block_table) if allocated else self.blocks.blocks_for_tokens(len(seq))
        partial = len(seq) % self.blocks.block_size != 0 and len(entry) > 1  # copy-on-write of the shared tail
        return len(entry) * (max(final_blocks - held, 0) + partial)

    def _run_plan(self, limit: int) -> tuple[int, tuple[int, ...] | None]:
        """A run's steps (at most ``limit``, at most the most any running sequence has left before its length
        limit) and each sequence's (its own limit where that is fewer; None: all the same), the longest run whose
        blocks are free; ``(1, None)``: a single decode step."""
        if limit <= 1 or not self.running:
            return 1, None
        left = [min(seq.params.max_tokens - seq.num_output_tokens, self.max_model_len - len(seq))
                for seq in (entry[0] for entry in self.running)]
        free = self.blocks.num_free_blocks
        for steps in range(min(limit, max(left)), 1, -1):  # the longest whose blocks are free
            rows = [min(steps, n) for n in left]
            if sum(self.blocks.blocks_needed_to_write(e[0], n) for e, n in zip(self.running, rows)) <= free:
                return steps, None if min(rows) == steps else tuple(rows)
        return 1, None

    def _schedule_decode(self, steps: int, row_steps: tuple[int, ...] | None) -> SchedulerOutput:
        """A decode step (preempting the newest entries while a block is missing), or a run whose blocks
        :meth:`_run_plan` found free (so nothing is preempted)."""
        out = SchedulerOutput([], is_decode=True, steps=steps, row_steps=row_steps)
        i = 0
        while i < len(self.running):
            entry = self.running[i]
            seq = entry[0]
            while self.blocks.blocks_needed_to_write(seq, 1) > self.blocks.num_free_blocks:
                victim = self.running[-1]
                self._preempt(victim)
                if victim is entry:  # it was the newest: nothing after it remains
                    return out
            start = seq.num_computed_tokens
            for position in range(start, start + out.steps_of(i)):
                pair = self.blocks.prepare_append(seq, position)
                if pair is not None:
                    out.copies.append(pair)
            out.chunks.append(ScheduledChunk(entry, start, start + 1))
            i += 1
        return out

    def _preempt(self, entry: list[Sequence]) -> None:
        self.running = [e for e in self.running if e is not entry]
        for seq in entry:
            self.blocks.free(seq)
            seq.num_computed_tokens = 0
            seq.status = SequenceStatus.WAITING
            seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(entry)

    # ---------------------------------------------------------------- after the step
    #
    # A step's results are recorded in two halves, so the engine can queue the next step on the GPU
    # before this one's tokens reach the host (asynchronous scheduling):
    #   advance(out)  right after the step is launched: every sampled sequence gets a placeholder token
    #                 (so the next step can be scheduled: lengths, blocks, positions are all known) and
    #                 sequences that reach max_tokens / the context limit finish ("length" needs no token);
    #   resolve(...)  once the tokens are on the host: placeholders become tokens, stop tokens and stop
    #                 strings end their sequences. A sequence that stopped may already be part of the next
    #                 step, computed once more for nothing; advance() of that step skips it.

    def advance(self, out: SchedulerOutput) -> tuple[list[Sequence | None], list[Sequence]]:
        """Placeholders for the step's sampled tokens (``out.steps_of(chunk)`` per sequence); returns (one entry
        per sampled row, in chunk order: the sequence, or None for a sequence that had already finished; the
        sequences finished by length)."""
        rows: list[Sequence | None] = []
        finished: list[Sequence] = []
        replaced: dict[int, list[list[Sequence]]] = {}
        for index, chunk in enumerate(out.chunks):
            steps = out.steps_of(index)
            for seq in chunk.seqs:
                if not seq.is_finished:  # a run computes its sampled tokens but the last as well
                    seq.num_computed_tokens = chunk.end + steps - 1
            if not chunk.samples:
                continue
            survivors: list[list[Sequence]] = []
            for seq in chunk.seqs:
                if seq.is_finished:  # stopped at the previous step, after this one was queued
                    rows.append(None)
                    continue
                for _ in range(steps):
                    seq.append(PLACEHOLDER, float("nan"))
                rows.append(seq)
                if seq.num_output_tokens >= seq.params.max_tokens or len(seq) >= self.max_model_len:
                    self._finish(seq, "length")
                    finished.append(seq)
                else:
                    survivors.append([seq])
            if len(chunk.seqs) > 1 or len(survivors) != 1:  # a solo entry that goes on stays as it is
                replaced[id(chunk.seqs)] = survivors
        if replaced:
            self.running = [e for entry in self.running for e in replaced.get(id(entry), [entry])]
        return rows, finished

    def resolve(self, rows: list[Sequence | None], tokens: list[int], logprobs: list[float],
                is_stopped: Callable[[Sequence], bool] | None = None, steps: int = 1,
                row_steps: tuple[int, ...] | None = None) -> tuple[list[Sequence], int]:
        """Write the sampled tokens over the placeholders of :meth:`advance` (``rows``; ``steps`` tokens per
        row, step-major: row i's token of step j is ``tokens[j * len(rows) + i]``, of which row i keeps its
        ``row_steps[i]`` where given) and retire the sequences a stop token or stop string ends, keeping their
        tokens up to the stop; returns them and the number of tokens kept."""
        if len(rows) * steps != len(tokens) or len(tokens) != len(logprobs):
            raise RuntimeError(f"scheduler expected {len(rows) * steps} sampled tokens, got {len(tokens)}")
        finished: list[Sequence] = []
        kept = 0
        width = len(rows)
        for i, seq in enumerate(rows):
            if seq is None:
                continue
            own = steps if row_steps is None else row_steps[i]
            # a sequence's only unresolved tokens are its newest step's (or run's): resolve() runs before the next
            # advance()
            index = len(seq.token_ids) - own
            if index < seq.num_prompt_tokens or any(t != PLACEHOLDER for t in seq.token_ids[index:]):
                raise RuntimeError(f"{seq!r}: no {own} sampled tokens are pending (scheduler bug)")
            del seq.token_ids[index:]  # appended back one by one: a stop string sees the output up to its token
            del seq.logprobs[index - seq.num_prompt_tokens:]
            for j in range(own):
                token = tokens[j * width + i]
                seq.append(token, logprobs[j * width + i])
                kept += 1
                if token in seq.stop_ids or (is_stopped is not None and bool(seq.params.stop) and is_stopped(seq)):
                    break
            else:  # no stop
                continue
            if seq.is_finished:  # also at its length limit: a stop says more
                seq.finish_reason = "stop"
                continue
            self.running = [e for e in self.running if seq not in e]
            if seq.status is SequenceStatus.WAITING:  # preempted while its last token was in flight
                self.waiting = deque(e for e in self.waiting if seq not in e)
            self._finish(seq, "stop")
            finished.append(seq)
        return finished, kept

    def _finish(self, seq: Sequence, reason: str) -> None:
        seq.finish_reason = reason
        seq.status = SequenceStatus.FINISHED
        self.blocks.free(seq)


__all__ = ["Scheduler", "SchedulerOutput", "ScheduledChunk", "PLACEHOLDER"]
