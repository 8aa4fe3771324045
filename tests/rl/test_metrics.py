"""Step metrics from hand-computed inputs; the metrics log: JSONL appends, resume truncation to the cursor,
TensorBoard fallback, timers."""

import math
import time

import pytest
import torch

from jetrl.rl.metrics import (
    JsonlWriter, MetricsLogger, PhaseTimer, batch_metrics, logprob_metrics, read_jsonl, step_metrics, timing_metrics,
)
from jetrl.rl.mismatch import mismatch_metrics
from jetrl.rl.batch import RolloutBatch

LOG_HALF, LOG_QUARTER = math.log(0.5), math.log(0.25)


def _batch() -> RolloutBatch:
    """Two prompts x two samples: responses of 3, 1, 2 and 0 tokens after prompts of 2 tokens."""
    lens = [3, 1, 2, 0]
    mask = torch.tensor([[j < k for j in range(3)] for k in lens])
    rollout_lp = torch.where(mask, torch.tensor(LOG_HALF), torch.tensor(0.0))
    return RolloutBatch(tokens=[torch.arange(2 + k) for k in lens], prompt_lens=[2] * 4, response_lens=lens,
                        mask=mask, rollout_logprobs=rollout_lp, rewards=torch.tensor([[1.0, 0.0], [1.0, 1.0]]),
                        advantages=torch.tensor([1.0, -1.0, 0.0, 0.0]), truncated=[True, False, False, False],
                        num_reward_errors=2, num_reward_timeouts=1)


def test_batch_metrics_hand_computed():
    m = batch_metrics(_batch())
    assert m == {"reward/mean": 0.75, "reward/std": 0.5,  # unbiased: sqrt((3 * 0.25^2 + 0.75^2) / 3)
                 "reward/accuracy": 0.75, "reward/zero_variance_groups": 1.0, "reward/zero_variance_frac": 0.5,
                 "reward/errors": 2.0, "reward/timeouts": 1.0, "response/length_mean": 1.5, "response/length_max": 3.0, "response/truncation_rate": 0.25,
                 "advantage/mean": 0.0, "advantage/abs_mean": 0.5}
    one = _batch()
    one.rewards = torch.tensor([[0.5]])
    assert batch_metrics(one)["reward/std"] == 0.0  # one sample: no spread rather than NaN


def test_logprob_metrics_hand_computed():
    batch = _batch()
    train = batch.rollout_logprobs.clone()
    train[0, 0] = LOG_QUARTER  # one of the six tokens: the training side gives it half the probability
    ref = train.clone()
    ref[0, 1] = LOG_QUARTER  # the reference: half of the policy's probability on another token
    m = logprob_metrics(batch.rollout_logprobs, train, batch.mask, ref, tis_cap=2.0)
    expected = mismatch_metrics(batch.rollout_logprobs, train, batch.mask, tis_cap=2.0)
    assert {k: v for k, v in m.items() if k.startswith("mismatch/")} == \
        {f"mismatch/{k}": v for k, v in expected.items() if k != "num_tokens"}
    assert m["mismatch/logp_abs_diff_max"] == pytest.approx(math.log(2))
    # k3 = (r - 1) - log r with r = p_ref / p = 1/2 on one token, 0 on the other five: mean over six tokens
    assert m["kl_ref/k3"] == pytest.approx((0.5 - 1 + math.log(2)) / 6)
    assert "kl_ref/k3" not in logprob_metrics(batch.rollout_logprobs, train, batch.mask)
    assert "mismatch/tis_weight_mean" not in logprob_metrics(batch.rollout_logprobs, train, batch.mask)


def test_logprob_metrics_over_checked_tokens():
    """``checked`` (exact mode without the old-logprob pass): the mismatch over the checked tokens only, their share
    of the valid tokens, the KL over every valid token; nothing checked reads NaN, not a zero mismatch."""
    batch = _batch()
    train = batch.rollout_logprobs.clone()
    train[0, 0] = LOG_QUARTER  # a difference on row 0, which is not checked
    ref = train.clone()
    ref[1, 0] = LOG_QUARTER
    checked = torch.zeros_like(batch.mask)
    checked[1:] = True  # rows 1-3: 3 of the 6 valid tokens
    m = logprob_metrics(batch.rollout_logprobs, train, batch.mask, ref, checked=checked.float())  # 0/1 masks too
    assert m["mismatch/logp_abs_diff_max"] == 0.0 and m["mismatch/checked_frac"] == 0.5
    assert m["kl_ref/k3"] == logprob_metrics(batch.rollout_logprobs, train, batch.mask, ref)["kl_ref/k3"]
    checked[0, 0] = True
    m = logprob_metrics(batch.rollout_logprobs, train, batch.mask, checked=checked)
    assert m["mismatch/logp_abs_diff_max"] == pytest.approx(math.log(2)) and m["mismatch/checked_frac"] == 4 / 6
    none = logprob_metrics(batch.rollout_logprobs, train, batch.mask, checked=torch.zeros_like(batch.mask))
    assert none["mismatch/checked_frac"] == 0.0
    assert all(math.isnan(v) for k, v in none.items() if k != "mismatch/checked_frac"), none


def test_timing_metrics_only_for_phases_that_ran():
    m = timing_metrics({"rollout": 2.0, "reward": 0.5, "update": 4.0},
                       {"rollout": 100.0, "old_logprob": 50.0, "update": 80.0})
    assert m == {"time/rollout": 2.0, "time/reward": 0.5, "time/update": 4.0, "time/step": 6.5,
                 "throughput/rollout_tokens_per_s": 50.0, "throughput/update_tokens_per_s": 20.0}


def test_step_metrics_assembles_every_group():
    batch = _batch()
    seconds = {"rollout": 2.0, "reward": 0.5, "old_logprob": 1.0, "update": 4.0, "weight_refresh": 0.5}
    actor = {"actor/pg_loss": -0.25, "actor/num_updates": 2.0}
    stats = {"preemptions": 3, "decode_tokens_per_s": 123.0, "host_seconds": 0.75, "steps": 9}
    m = step_metrics(batch, batch.rollout_logprobs, None, actor, seconds, generated_tokens=6.0, ppo_epochs=2,
                     engine_stats=stats)
    expected = {**batch_metrics(batch), **logprob_metrics(batch.rollout_logprobs, batch.rollout_logprobs, batch.mask),
                **actor, **timing_metrics(seconds, {"rollout": 6.0, "old_logprob": 14.0, "reference": 14.0,
                                                    "update": 28.0}),
                "response/num_tokens": 6.0, "rollout/preemptions": 3.0,
                "throughput/rollout_decode_tokens_per_s": 123.0, "time/rollout_host": 0.75}
    assert m == expected
    assert m["throughput/update_tokens_per_s"] == 7.0  # 14 prompt + response tokens, two epochs, 4 s
    assert m["mismatch/kl_k3"] == 0.0 and "kl_ref/k3" not in m
    bare = step_metrics(batch, batch.rollout_logprobs, None, actor, seconds, generated_tokens=6.0, ppo_epochs=2)
    assert set(m) - set(bare) == {"rollout/preemptions", "throughput/rollout_decode_tokens_per_s",
                                  "time/rollout_host"}


def test_jsonl_resume_truncates_to_cursor(tmp_path):
    path = tmp_path / "metrics.jsonl"
    w = JsonlWriter(path)
    w.write({"step": 1, "reward": torch.tensor(0.5), "nan": float("nan"), "inf": float("-inf")})
    w.write({"step": 2, "reward": 0.75})
    cursor = w.cursor()
    w.write({"step": 3, "reward": 0.8})
    w._file.write(b'{"step": 4, "rew')  # killed mid-write
    w.close()
    assert [r["step"] for r in read_jsonl(path)] == [1, 2, 3]  # partial last line dropped
    assert read_jsonl(path)[0] == {"step": 1, "reward": 0.5, "nan": "nan", "inf": "-inf"}

    w = JsonlWriter(path, resume_cursor=cursor)
    w.write({"step": 3, "reward": 0.9})
    w.close()
    assert [(r["step"], r["reward"]) for r in read_jsonl(path)] == [(1, 0.5), (2, 0.75), (3, 0.9)]
    with pytest.raises(ValueError, match="does not belong to this run"):
        JsonlWriter(path, resume_cursor=10_000)


def test_fresh_run_starts_a_fresh_log(tmp_path):
    path = tmp_path / "m.jsonl"
    path.write_text('{"step": 99}\n')
    JsonlWriter(path).close()
    assert read_jsonl(path) == []


def test_logger_and_tensorboard_fallback(tmp_path):
    try:
        import tensorboard  # noqa: F401
        has_tb = True
    except ImportError:
        has_tb = False
    if has_tb:
        logger = MetricsLogger(tmp_path, tensorboard=True)
    else:
        with pytest.warns(UserWarning, match="tensorboard is not installed"):
            logger = MetricsLogger(tmp_path, tensorboard=True)
    assert (logger.tensorboard is not None) == has_tb
    logger.log(1, {"reward/mean": 0.25, "note": "x"})
    logger.close()
    assert read_jsonl(tmp_path / "metrics.jsonl") == [{"step": 1, "reward/mean": 0.25, "note": "x"}]


def test_tensorboard_gets_every_scalar_nan_and_inf_included(tmp_path):
    """A NaN grad norm (every step skipped) or an infinite mismatch is what a user must see in TensorBoard too: the
    JSONL log spells them as strings, TensorBoard gets the floats; tensors and numpy scalars as numbers, text and
    flags left out."""
    import numpy as np

    calls = []

    class Writer:  # SummaryWriter's two methods the logger calls per step
        def add_scalar(self, key, value, global_step):
            calls.append((key, value, global_step))

        def flush(self):
            pass

        def close(self):
            pass

    logger = MetricsLogger(tmp_path)
    logger.tensorboard = Writer()
    logger.log(3, {"actor/grad_norm": float("nan"), "mismatch/kl_k1": float("inf"), "reward/mean": torch.tensor(0.5),
                   "time/step": np.float32(2.0), "note": "x", "flag": True, "steps": 7})
    logger.close()
    got = {key: value for key, value, step in calls if step == 3}
    assert sorted(got) == ["actor/grad_norm", "mismatch/kl_k1", "reward/mean", "steps", "time/step"]
    assert math.isnan(got["actor/grad_norm"]) and got["mismatch/kl_k1"] == float("inf")
    assert got["reward/mean"] == 0.5 and got["time/step"] == 2.0 and got["steps"] == 7
    assert read_jsonl(tmp_path / "metrics.jsonl")[0]["actor/grad_norm"] == "nan"


def test_engine_stats_of_several_ranks_read_like_one_engines():
    """Each rank runs its own engine on its share: the step reports the preemptions and decode throughput added over
    ranks, the host and capture times of the slowest (they overlap) and one engine's KV capacity, not rank 0's."""
    from jetrl.rl.metrics import global_engine_stats

    class TwoRanks:  # ParallelContext's reductions, with the other rank's values as the collective returns them
        is_distributed = True
        other = {"preemptions": 2.0, "kv_capacity_tokens": 1000.0, "decode_tokens_per_s": 300.0,
                 "host_seconds": 0.5, "graph_capture_seconds": 0.1}

        def sum(self, values):
            return [v + o for v, o in zip(values, [self.other[k] for k in ("preemptions", "decode_tokens_per_s")])]

        def max(self, values):
            return [max(v, o) for v, o in zip(values, [self.other[k] for k in ("kv_capacity_tokens", "host_seconds",
                                                                            "graph_capture_seconds")])]

    ours = {"preemptions": 1.0, "kv_capacity_tokens": 1000.0, "decode_tokens_per_s": 200.0, "host_seconds": 0.25,
            "graph_capture_seconds": 0.3, "seconds": 4.0}
    combined = global_engine_stats(ours, TwoRanks())
    assert combined == {"preemptions": 3.0, "kv_capacity_tokens": 1000.0, "decode_tokens_per_s": 500.0,
                        "host_seconds": 0.5, "graph_capture_seconds": 0.3, "seconds": 4.0}
    one = type("OneRank", (), {"is_distributed": False})()
    assert global_engine_stats(ours, one) == ours


def test_phase_timer():
    t = PhaseTimer("cpu")
    with t.phase("rollout"):
        time.sleep(0.02)
    with t.phase("rollout"):
        time.sleep(0.01)
    with t.phase("update"):
        pass
    m = t.seconds
    assert 0.03 <= m["rollout"] < 0.5 and 0 <= m["update"] < m["rollout"]
