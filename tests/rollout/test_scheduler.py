"""Block manager and scheduler, driven by a simulated KV cache (no model).

The simulated cache stores, at each slot, the token written there. Each step writes the scheduled tokens
at their slots (after performing the requested block copies) and then checks that every running
sequence reads back exactly its own tokens through its block table: sharing, copy-on-write and
preemption bugs all show up as a mismatch.
"""

import pytest

from jetrl.rollout import BlockManager, NoFreeBlocks, SamplingParams, Scheduler, Sequence
from jetrl.rollout.sequence import SequenceStatus


def _seq(i, prompt, n_index=0, max_tokens=8, stop_ids=frozenset()):
    return Sequence(i, i, n_index, prompt, SamplingParams(max_tokens=max_tokens), stop_ids)


def _slot(bm, seq, position):
    """Flat slot (block_id * block_size + offset) of ``seq``'s token at ``position``."""
    return seq.block_table[position // bm.block_size] * bm.block_size + position % bm.block_size


def _postprocess(sched, out, tokens, logprobs):
    """Record a step's sampled tokens as the engine does (:meth:`advance`, then :meth:`resolve`); the finished."""
    rows, finished = sched.advance(out)
    return finished + sched.resolve(rows, tokens, logprobs, None, out.steps, out.row_steps)[0]


def test_block_manager_sharing_and_copy_on_write():
    bm = BlockManager(num_blocks=6, block_size=4)
    seqs = [_seq(i, [1, 2, 3, 4, 5, 6]) for i in range(3)]  # 6 tokens: one full block + 2 in a partial one
    bm.allocate_shared(seqs, 6)
    assert bm.num_free_blocks == 4
    full, partial = seqs[0].block_table
    assert bm.ref_counts[full] == 3 and bm.ref_counts[partial] == 3
    for s in seqs:
        s.num_computed_tokens = 6
    pair0 = bm.prepare_append(seqs[0])
    pair1 = bm.prepare_append(seqs[1])
    pair2 = bm.prepare_append(seqs[2])  # the last holder writes in place
    assert pair0[0] == partial and pair1[0] == partial and pair2 is None
    assert _slot(bm, seqs[0], 6) == pair0[1] * 4 + 2 and _slot(bm, seqs[2], 5) == partial * 4 + 1
    assert len({seqs[0].block_table[1], seqs[1].block_table[1], seqs[2].block_table[1]}) == 3
    assert seqs[2].block_table[1] == partial and bm.ref_counts[partial] == 1 and bm.ref_counts[full] == 3
    assert bm.num_free_blocks == 2
    for s in seqs:
        s.num_computed_tokens = 8  # next token opens a new block
    assert bm.blocks_needed_to_write(seqs[0], 1) == 1
    bm.prepare_append(seqs[0])
    bm.prepare_append(seqs[1])
    with pytest.raises(NoFreeBlocks):
        bm.prepare_append(seqs[2])
    for s in seqs:
        bm.free(s)
    assert bm.num_free_blocks == 6 and all(c == 0 for c in bm.ref_counts)
    with pytest.raises(ValueError):
        BlockManager(0, 16)


class _SimulatedRun:
    """Runs a scheduler to completion with a fake sampler (next token = f(history)) and a slot store."""

    def __init__(self, num_blocks, block_size, max_num_seqs=8, max_num_batched_tokens=64, max_model_len=128,
                 decode_steps=1):
        self.decode_steps = decode_steps
        self.bm = BlockManager(num_blocks, block_size)
        self.sched = Scheduler(self.bm, max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                               max_model_len=max_model_len)
        self.store = {}
        self.steps = {"prefill": 0, "decode": 0}

    FILLER = 1000  # what an idle row of a decode run samples (never a token of the fake model)

    @staticmethod
    def next_token(seq, history=None):  # depends on the whole history, like a model would
        history = seq.token_ids if history is None else history
        return (sum((i + 1) * t for i, t in enumerate(history)) * 31 + seq.sample_index) % 97

    def run(self, groups):
        for g in groups:
            self.sched.add(g)
        finished = []
        while self.sched.has_unfinished:
            out = self.sched.schedule(self.decode_steps)
            assert out.chunks, "empty step with work pending"
            assert out.steps == 1 or (out.is_decode and out.steps <= self.decode_steps)
            self.steps["decode" if out.is_decode else "prefill"] += 1
            self.steps["runs"] = self.steps.get("runs", 0) + (out.steps > 1)
            if out.is_decode:
                assert all(c.num_tokens == 1 for c in out.chunks)
            assert sum(c.num_tokens for c in out.chunks) <= max(self.sched.max_num_batched_tokens, len(out.chunks))
            for src, dst in out.copies:
                for off in range(self.bm.block_size):
                    key = src * self.bm.block_size + off
                    if key in self.store:
                        self.store[dst * self.bm.block_size + off] = self.store[key]
            for chunk in out.chunks:
                leader = chunk.seqs[0]
                for p in range(chunk.start, chunk.end):
                    self.store[_slot(self.bm, leader, p)] = leader.token_ids[p]
                for s in chunk.seqs:  # every sharer sees the same blocks and tokens
                    assert s.token_ids == leader.token_ids
                    for p in range(chunk.end):
                        assert self.store[_slot(self.bm, s, p)] == s.token_ids[p], (s, p)
            tokens = [self.next_token(s) for c in out.chunks if c.samples for s in c.seqs]
            if out.steps > 1:  # a decode run: the device writes each step's input and samples the next
                histories = [list(c.seqs[0].token_ids) for c in out.chunks]
                tokens = []
                self.steps["short rows"] = self.steps.get("short rows", 0) + sum(
                    out.steps_of(i) < out.steps for i in range(len(out.chunks)))
                for j in range(out.steps):
                    for i, (c, history) in enumerate(zip(out.chunks, histories)):
                        if j >= out.steps_of(i):  # past its own steps: the row idles, its token is dropped
                            tokens.append(self.FILLER)
                            continue
                        leader = c.seqs[0]
                        self.store[_slot(self.bm, leader, len(history) - 1)] = history[-1]
                        history.append(self.next_token(leader, history))
                        tokens.append(history[-1])
            finished += _postprocess(self.sched, out, tokens, [0.0] * len(tokens))
            for entry in self.sched.running:  # cached prefixes stay intact across steps
                for s in entry:
                    for p in range(s.num_computed_tokens):
                        assert self.store[_slot(self.bm, s, p)] == s.token_ids[p]
        assert self.bm.num_free_blocks == self.bm.num_blocks and all(c == 0 for c in self.bm.ref_counts)
        assert all(self.FILLER not in s.token_ids for s in finished)
        return finished


def _groups(prompts, n, max_tokens, stop_ids=frozenset()):
    groups, k = [], 0
    for i, prompt in enumerate(prompts):
        group = []
        for j in range(n):
            limit = max_tokens[i] if isinstance(max_tokens, list) else max_tokens  # one per prompt, or for all
            group.append(Sequence(k, i, j, prompt, SamplingParams(n=n, max_tokens=limit), stop_ids))
            k += 1
        groups.append(group)
    return groups


PROMPTS = [[(7 * i + j) % 90 + 1 for j in range(length)] for i, length in enumerate([5, 13, 1, 30, 17, 8])]


def _outputs(finished):
    return {(s.prompt_index, s.sample_index): s.output_ids for s in finished}


def test_scheduler_runs_everything_with_a_large_pool():
    run = _SimulatedRun(num_blocks=200, block_size=4)
    finished = run.run(_groups(PROMPTS, n=3, max_tokens=9))
    assert len(finished) == 18
    assert all(len(s.output_ids) == 9 and s.finish_reason == "length" for s in finished)
    assert run.sched.num_preemptions == 0


def test_preemption_under_a_tiny_pool_gives_the_same_tokens():
    reference = _outputs(_SimulatedRun(num_blocks=200, block_size=4).run(_groups(PROMPTS, n=3, max_tokens=9)))
    # 30 + 9 - 1 tokens need 10 blocks: the longest sequence fits alone, barely
    tiny = _SimulatedRun(num_blocks=10, block_size=4)
    finished = tiny.run(_groups(PROMPTS, n=3, max_tokens=9))
    assert tiny.sched.num_preemptions > 0
    assert _outputs(finished) == reference
    assert any(s.num_preemptions for s in finished)


def test_chunked_prefill_and_seq_limit():
    run = _SimulatedRun(num_blocks=200, block_size=4, max_num_seqs=4, max_num_batched_tokens=7)
    reference = _outputs(_SimulatedRun(num_blocks=200, block_size=4).run(_groups(PROMPTS, n=2, max_tokens=5)))
    sched = run.sched
    orig = sched.schedule

    def checked(*args):
        out = orig(*args)
        assert sum(len(e) for e in sched.running) <= 4
        return out

    sched.schedule = checked
    assert _outputs(run.run(_groups(PROMPTS, n=2, max_tokens=5))) == reference
    assert run.steps["prefill"] >= sum(map(len, PROMPTS)) // 7


def test_stop_tokens_and_context_limit():
    stop = frozenset({SimStop.token})
    groups = _groups([[3, 4, 5]], n=1, max_tokens=50, stop_ids=stop)
    run = _SimulatedRun(num_blocks=50, block_size=4, max_model_len=12)
    run.next_token = lambda seq: SimStop.token if seq.num_output_tokens == 4 else 10 + seq.num_output_tokens
    (seq,) = run.run(groups)
    assert seq.output_ids == [10, 11, 12, 13, SimStop.token] and seq.finish_reason == "stop"
    run = _SimulatedRun(num_blocks=50, block_size=4, max_model_len=12)
    (seq,) = run.run(_groups([[3, 4, 5]], n=1, max_tokens=50))
    assert len(seq) == 12 and seq.finish_reason == "length" and seq.status is SequenceStatus.FINISHED


class SimStop:
    token = 96


def test_requests_that_cannot_fit_are_rejected():
    sched = Scheduler(BlockManager(4, 4), max_num_seqs=2, max_num_batched_tokens=16, max_model_len=100)
    sched.check_fits(10, 7, 1)  # 16 cached tokens: exactly 4 blocks
    with pytest.raises(ValueError, match="KV blocks"):
        sched.check_fits(10, 8, 1)
    with pytest.raises(ValueError, match="max_num_seqs"):
        sched.check_fits(2, 2, 3)


def test_pool_sized_for_every_sequence_admits_every_sequence():
    groups = _groups(PROMPTS, n=2, max_tokens=9)
    exact = sum(2 * -(-(len(p) + 9 - 1) // 4) for p in PROMPTS)  # every sample at full length, no sharing
    run = _SimulatedRun(num_blocks=exact, block_size=4, max_num_seqs=12, max_num_batched_tokens=1000)
    for g in groups:
        run.sched.add(g)
    out = run.sched.schedule()
    assert not run.sched.waiting and len(out.chunks) == len(PROMPTS)  # the watermark held nothing back
    big = _SimulatedRun(num_blocks=exact, block_size=4, max_num_seqs=12, max_num_batched_tokens=1000)
    finished = big.run(_groups(PROMPTS, n=2, max_tokens=9))
    assert big.sched.num_preemptions == 0 and len(finished) == 12


def test_block_table_mirror_follows_every_kind_of_table_change():
    """The engine's incremental host copy of the block tables equals the tables themselves after
    shared-prefix allocation, appends, copy-on-write, free and re-allocation (recomputation), in any order."""
    import random

    import numpy as np

    from jetrl.rollout.block_manager import BlockTableMirror

    rng = random.Random(0)
    bm = BlockManager(num_blocks=256, block_size=2)
    seqs = [_seq(i, [1, 2, 3], max_tokens=40) for i in range(5)]
    mirror = BlockTableMirror(seqs, max_blocks_per_seq=30)

    def check(subset):
        got = mirror.rows(subset)
        width = max(len(s.block_table) for s in subset) or 1
        want = np.array([s.block_table + [-1] * (width - len(s.block_table)) for s in subset]).reshape(len(subset), -1)
        assert got.shape == (len(subset), max(width, 1)) and (got[:, :width] == want).all()

    bm.allocate_shared(seqs[:3], 3)  # three samples share a prefix (one full block + a partial one)
    bm.allocate_shared(seqs[3:], 3)
    for s in seqs:
        s.num_computed_tokens = 3
    check(seqs)
    for _ in range(200):
        s = rng.choice(seqs)
        action = rng.random()
        if action < 0.75 and s.block_table and s.num_computed_tokens < 56:  # write the next token (append/copy)
            bm.prepare_append(s)
            s.num_computed_tokens += 1
        elif action < 0.85:  # preempted and recomputed: free, then a fresh (unshared) allocation
            bm.free(s)
            check([x for x in seqs if x.block_table] or seqs)
            bm.allocate_shared([s], max(s.num_computed_tokens, 1))
        check(rng.sample(seqs, rng.randint(1, len(seqs))))
    check(seqs)


@pytest.mark.parametrize("steps", [2, 3, 8])
def test_decode_runs_give_the_same_tokens_in_every_setting(steps):
    """Runs of several decode steps (blocks made writable for the whole run up front, copy-on-write of the
    shared prompt tail included) give the step-by-step scheduler's tokens: a large pool, a tiny pool that
    preempts (runs fall back to single steps when their blocks are not free), a sequence limit with chunked
    prefill (prompts join between runs), stop tokens inside runs, and the context limit."""
    short_rows = 0
    for kw, max_tokens in ((dict(num_blocks=200), 9), (dict(num_blocks=10), 9),
                           (dict(num_blocks=200, max_num_seqs=4, max_num_batched_tokens=7), 13),
                           (dict(num_blocks=200), [9, 4, 11, 6, 13, 5])):
        reference = _outputs(_SimulatedRun(block_size=4, **kw).run(_groups(PROMPTS, n=3, max_tokens=max_tokens)))
        run = _SimulatedRun(block_size=4, decode_steps=steps, **kw)
        assert _outputs(run.run(_groups(PROMPTS, n=3, max_tokens=max_tokens))) == reference, kw
        assert run.steps["runs"] > 0
        short_rows += run.steps.get("short rows", 0)
        if kw["num_blocks"] == 10:
            assert run.sched.num_preemptions > 0
    assert short_rows > 0  # rows that reach their max_tokens inside a run
    stop = frozenset({SimStop.token})
    for at in range(6):  # a stop at every offset of a run
        run = _SimulatedRun(num_blocks=50, block_size=4, max_model_len=40, decode_steps=steps)
        def next_token(seq, history=None, at=at):
            length = len(seq.token_ids if history is None else history)
            return SimStop.token if length - 3 == at + 2 else 10 + length
        run.next_token = next_token
        (seq,) = run.run(_groups([[3, 4, 5]], n=1, max_tokens=50, stop_ids=stop))
        assert seq.output_ids == [13 + i for i in range(at + 2)] + [SimStop.token] and seq.finish_reason == "stop"
    run = _SimulatedRun(num_blocks=50, block_size=4, max_model_len=12, decode_steps=steps)
    (seq,) = run.run(_groups([[3, 4, 5]], n=1, max_tokens=50))
    assert len(seq) == 12 and seq.finish_reason == "length"


def test_a_run_is_as_long_as_the_longest_remaining_budget_and_the_free_blocks_allow():
    bm = BlockManager(num_blocks=9, block_size=4)
    sched = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64)
    a, b = _seq(0, [1] * 6, max_tokens=20), _seq(1, [2] * 3, max_tokens=5)
    for s in (a, b):
        sched.add([s])
    out = sched.schedule(8)  # the prefill of both
    _postprocess(sched, out, [7, 7], [0.0, 0.0])
    out = sched.schedule(8)
    assert out.is_decode and out.steps == 8 and out.row_steps == (8, 4)  # b may sample 4 more tokens
    assert [len(s.block_table) for s in (a, b)] == [4, 2]  # a writes positions 6..13, b 3..6
    _postprocess(sched, out, [7] * 16, [0.0] * 16)
    assert b.is_finished and b.finish_reason == "length" and len(b.output_ids) == 5 and len(a.output_ids) == 9
    out = sched.schedule(8)
    assert out.steps == 8 and out.row_steps is None and len(a.block_table) == 6  # a alone: positions 14..21
    _postprocess(sched, out, [7] * 8, [0.0] * 8)
    out = sched.schedule(8)
    assert out.steps == 3 and out.row_steps is None  # a's last 3 tokens: a run no longer than any row needs
    tight = Scheduler(BlockManager(num_blocks=3, block_size=4), max_num_seqs=1, max_num_batched_tokens=64,
                      max_model_len=64)
    c = _seq(2, [1] * 7, max_tokens=30)
    tight.add([c])
    _postprocess(tight, tight.schedule(8), [7], [0.0])
    assert tight.schedule(8).steps == 5  # 3 blocks hold positions up to 11: no run reaches into a 4th
