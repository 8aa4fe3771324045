"""The reward pool returns in bounded time whatever the reward function does, and counts failures."""

from __future__ import annotations

import signal
import time

import pytest

from jetrl.data import RewardPool, RewardPoolConfig, gsm8k_reward

BAD = "pathological_rewards:misbehaving"  # tests/data/pathological_rewards.py, importable by the workers


def test_hang_raise_crash_nan_score_zero_in_bounded_time():
    completions = ["a", "hang", "b", "raise", "crash", "nan", "slow", "c", "hang", "d"]
    references = ["a", "x", "b", "x", "x", "x", "x", "c", "x", "wrong"]
    with RewardPool(BAD, RewardPoolConfig(num_workers=2, timeout_s=1.0)) as pool:
        start = time.monotonic()
        result = pool.score(completions, references)
        elapsed = time.monotonic() - start
        # Two hangs of 1 s each on two workers plus restarts; a generous bound for a loaded machine,
        # far below "forever".
        assert elapsed < 15, elapsed
        assert result.rewards == [1.0, 0.0, 1.0, 0.0, 0.0, 0.0, 0.5, 1.0, 0.0, 0.0]
        assert result.status == ["ok", "timeout", "ok", "error", "error", "error", "ok", "ok", "timeout", "ok"]
        assert (result.num_timeouts, result.num_errors) == (2, 3)
        messages = "\n".join(result.errors)
        assert "sample 3: RuntimeError: reward function exploded" in messages
        assert "sample 4: reward worker died (exit code" in messages and "sample 5: non-finite reward" in messages
        assert "sample 1: timed out after 1 s" in messages
        # The pool keeps working after replacing its workers, and counts across calls.
        again = pool.score(["a", "b"] * 50, ["a", "x"] * 50)
        assert again.rewards == [1.0, 0.0] * 50 and again.num_failed == 0
        assert (pool.total_timeouts, pool.total_errors) == (2, 3)


def test_everything_hangs_still_returns():
    with RewardPool(BAD, RewardPoolConfig(num_workers=2, timeout_s=0.5)) as pool:
        start = time.monotonic()
        result = pool.score(["hang"] * 4, ["x"] * 4)
        assert time.monotonic() - start < 20
        assert result.rewards == [0.0] * 4 and result.num_timeouts == 4


def test_many_samples_match_direct_computation():
    refs = [f"Some work.\n#### {i * 7 - 300}" for i in range(2000)]
    completions = [f"The answer is {i * 7 - 300 + (i % 3 == 0)}" for i in range(2000)]
    with RewardPool("gsm8k", RewardPoolConfig(num_workers=2, timeout_s=5.0, chunk_size=64)) as pool:
        result = pool.score(completions, refs)
    assert result.rewards == [gsm8k_reward(c, r) for c, r in zip(completions, refs)]
    assert sum(result.rewards) == 2000 - 667 and result.num_failed == 0


def test_inline_mode_counts_errors():
    pool = RewardPool(BAD, RewardPoolConfig(num_workers=0))
    result = pool.score(["a", "raise", "nan"], ["a", "a", "a"])
    assert result.rewards == [1.0, 0.0, 0.0] and result.num_errors == 2
    assert pool.score([], []).rewards == []


def test_worker_start_up_failure_is_reported():
    from pathological_rewards import BrokenWarmup

    pool = RewardPool(BrokenWarmup(), RewardPoolConfig(num_workers=1))
    with pytest.raises(RuntimeError, match="failed to start: ImportError: this reward needs a package"):
        pool.score(["a"], ["a"])


def test_clear_errors():
    with pytest.raises(ValueError, match="neither a built-in"):
        RewardPool("not_a_reward", RewardPoolConfig(num_workers=0))
    with pytest.raises(TypeError, match="cannot be sent to worker processes"):
        RewardPool(lambda c, r: 1.0, RewardPoolConfig(num_workers=1))
    with pytest.raises(ValueError, match="timeout_s must be a positive"):
        RewardPoolConfig(timeout_s=0)
    with pytest.raises(ValueError, match="num_workers"):
        RewardPoolConfig(num_workers=-1)
    pool = RewardPool("gsm8k", RewardPoolConfig(num_workers=1))
    with pytest.raises(ValueError, match="2 completions but 1 references"):
        pool.score(["a", "b"], ["a"])
    with pytest.raises(TypeError, match=r"completions\[1\] is a int"):
        pool.score(["a", 3], ["a", "b"])
    pool.close()
    with pytest.raises(RuntimeError, match="after close"):
        pool.score(["a"], ["#### 1"])


def test_interrupted_call_leaves_no_stale_work():
    with RewardPool(BAD, RewardPoolConfig(num_workers=1, timeout_s=30.0)) as pool:
        pool.score(["a"], ["a"])  # started and warm
        worker = pool._workers[0]

        def interrupt(signum, frame):  # as Ctrl-C would, while the worker is stuck
            raise KeyboardInterrupt

        previous = signal.signal(signal.SIGALRM, interrupt)
        signal.setitimer(signal.ITIMER_REAL, 0.5)
        try:
            with pytest.raises(KeyboardInterrupt):
                pool.score(["hang", "a"], ["x", "a"])
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, previous)
        assert pool._workers[0] is not worker and not worker.process.is_alive()
        result = pool.score(["b", "a"], ["b", "x"])
        assert result.rewards == [1.0, 0.0] and result.num_failed == 0
