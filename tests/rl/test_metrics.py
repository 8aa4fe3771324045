"""Metrics log: JSONL appends, resume truncation to the cursor, TensorBoard fallback, timers."""

import time

import pytest
import torch

from jetrl.rl.metrics import JsonlWriter, MetricsLogger, PhaseTimer, read_jsonl


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
    assert logger.tensorboard.enabled == has_tb
    logger.log(1, {"reward/mean": 0.25, "note": "x"})
    logger.close()
    assert read_jsonl(tmp_path / "metrics.jsonl") == [{"step": 1, "reward/mean": 0.25, "note": "x"}]


def test_phase_timer():
    t = PhaseTimer("cpu")
    with t.phase("rollout"):
        time.sleep(0.02)
    with t.phase("rollout"):
        time.sleep(0.01)
    with t.phase("update"):
        pass
    m = t.metrics()
    assert 0.03 <= m["time/rollout"] < 0.5 and 0 <= m["time/update"] < m["time/rollout"]
    t.reset()
    assert t.metrics() == {}
