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
    assert bm.slot(seqs[0], 6) == pair0[1] * 4 + 2 and bm.slot(seqs[2], 5) == partial * 4 + 1
    assert len({seqs[0].block_table[1], seqs[1].block_table[1], seqs[2].block_table[1]}) == 3
    assert seqs[2].block_table[1] == partial and bm.ref_counts[partial] == 1 and bm.ref_counts[full] == 3
    assert bm.num_free_blocks == 2
    for s in seqs:
        s.num_computed_tokens = 8  # next token opens a new block
    assert bm.blocks_needed_to_append(seqs[0]) == 1
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

    def __init__(self, num_blocks, block_size, max_num_seqs=8, max_num_batched_tokens=64, max_model_len=128):
        self.bm = BlockManager(num_blocks, block_size)
        self.sched = Scheduler(self.bm, max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                               max_model_len=max_model_len)
        self.store = {}
        self.steps = {"prefill": 0, "decode": 0}

    @staticmethod
    def next_token(seq):  # depends on the whole history, like a model would
        return (sum((i + 1) * t for i, t in enumerate(seq.token_ids)) * 31 + seq.sample_index) % 97

    def run(self, groups):
        for g in groups:
            self.sched.add(g)
        finished = []
        while self.sched.has_unfinished:
            out = self.sched.schedule()
            assert out.chunks, "empty step with work pending"
            self.steps["decode" if out.is_decode else "prefill"] += 1
            if out.is_decode:
                assert all(c.num_tokens == 1 for c in out.chunks)
            assert out.num_tokens <= max(self.sched.max_num_batched_tokens, len(out.chunks))
            for src, dst in out.copies:
                for off in range(self.bm.block_size):
                    key = src * self.bm.block_size + off
                    if key in self.store:
                        self.store[dst * self.bm.block_size + off] = self.store[key]
            for chunk in out.chunks:
                leader = chunk.seqs[0]
                for p in range(chunk.start, chunk.end):
                    self.store[self.bm.slot(leader, p)] = leader.token_ids[p]
                for s in chunk.seqs:  # every sharer sees the same blocks and tokens
                    assert s.token_ids == leader.token_ids
                    for p in range(chunk.end):
                        assert self.store[self.bm.slot(s, p)] == s.token_ids[p], (s, p)
            tokens = [self.next_token(s) for c in out.chunks if c.samples for s in c.seqs]
            finished += self.sched.postprocess(out, tokens, [0.0] * len(tokens))
            for entry in self.sched.running:  # cached prefixes stay intact across steps
                for s in entry:
                    for p in range(s.num_computed_tokens):
                        assert self.store[self.bm.slot(s, p)] == s.token_ids[p]
        assert self.bm.num_free_blocks == self.bm.num_blocks and all(c == 0 for c in self.bm.ref_counts)
        return finished


def _groups(prompts, n, max_tokens, stop_ids=frozenset()):
    groups, k = [], 0
    for i, prompt in enumerate(prompts):
        group = []
        for j in range(n):
            group.append(Sequence(k, i, j, prompt, SamplingParams(n=n, max_tokens=max_tokens), stop_ids))
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

    def checked():
        out = orig()
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
