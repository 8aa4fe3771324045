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
        # The pool keeps working after replacing its workers.
        again = pool.score(["a", "b"] * 50, ["a", "x"] * 50)
        assert again.rewards == [1.0, 0.0] * 50 and again.num_failed == 0


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
    result = pool.score(["a", "raise", "nan", "text"], ["a", "a", "a", "a"])
    assert result.rewards == [1.0, 0.0, 0.0, 0.0] and result.num_errors == 3
    assert "sample 3: TypeError: the reward returned str '1', not a number" in result.errors
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
    with pytest.raises(ValueError, match="chunk_size must be an int >= 1"):
        RewardPoolConfig(chunk_size=0)
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


def test_out_of_bound_rewards_are_errors():
    with RewardPool("pathological_rewards:scaled", RewardPoolConfig(num_workers=0, max_abs_reward=10)) as pool:
        result = pool.score(["1", "-10", "11", "-1e30", "inf"], [""] * 5)
    assert result.rewards == [1.0, -10.0, 0.0, 0.0, 0.0]
    assert result.status == ["ok", "ok", "error", "error", "error"] and result.num_errors == 3
    assert "reward 11 is beyond max_abs_reward=10" in result.errors[0]
    with pytest.raises(ValueError, match="max_abs_reward"):
        RewardPoolConfig(max_abs_reward=0)


def test_error_messages_are_bounded_excerpts():
    from jetrl.data.reward_pool import MAX_MESSAGE_CHARS

    with RewardPool("pathological_rewards:scaled", RewardPoolConfig(num_workers=0)) as pool:
        result = pool.score(["x" * 1_000_000], [""])  # float("xxx...") quotes the whole input
    assert result.status == ["error"] and len(result.errors[0]) <= MAX_MESSAGE_CHARS + 20
    assert "chars ...]" in result.errors[0]


def test_failure_guard_reports_once_and_stops_when_every_sample_failed():
    from jetrl.data.reward_pool import RewardFailureError, RewardFailureGuard

    lines: list[str] = []
    guard = RewardFailureGuard(log=lines.append)
    with RewardPool(BAD, RewardPoolConfig(num_workers=0)) as pool:
        guard.check(pool.score(["a", "b"], ["a", "c"]))  # no failure: silent
        assert lines == []
        guard.check(pool.score(["raise", "a", "nan"], ["a", "a", "a"]))
        guard.check(pool.score(["raise", "a"], ["a", "a"]))
        assert len(lines) == 1 and "2 of 3 samples (2 errors, 0 timeouts)" in lines[0]
        assert "RuntimeError: reward function exploded" in lines[0]
        with pytest.raises(RewardFailureError, match=r"failed for 2 of 2 samples \(2 errors, 0 timeouts\), at "
                                                     r"least 1 of them; stopping the run\. First failure: sample 0: "
                                                     "RuntimeError: reward function exploded"):
            guard.check(pool.score(["raise", "raise"], ["a", "a"]))
        half = RewardFailureGuard(stop_fraction=0.5, log=lines.append)
        half.check(pool.score(["raise", "a", "a"], ["a"] * 3))
        with pytest.raises(RewardFailureError, match="2 of 4 samples"):
            half.check(pool.score(["raise", "a", "nan", "a"], ["a"] * 4))
    for bad in (0, 1.5, True):
        with pytest.raises(ValueError, match="stop_fraction"):
            RewardFailureGuard(stop_fraction=bad)


def test_error_messages_are_the_lowest_numbered_failures_whatever_order_they_finish_in():
    from jetrl.data.reward_pool import MAX_ERROR_MESSAGES

    n = MAX_ERROR_MESSAGES + 4
    completions = [str(10 * (n - i)) for i in range(n)]  # sample 0 sleeps longest, so it fails last
    with RewardPool("pathological_rewards:fails_late_first", RewardPoolConfig(num_workers=2, chunk_size=1)) as pool:
        result = pool.score(completions, ["x"] * n)
    assert result.num_errors == n
    assert [m.split(":")[0] for m in result.errors] == [f"sample {i}" for i in range(MAX_ERROR_MESSAGES)]
