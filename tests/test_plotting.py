"""Run summaries from a metrics log: start and end means, the last mismatch, the time in steps."""

import json

import pytest

from jetrl.plotting import summarize_run


def test_summarize_run_means_first_and_last_steps(tmp_path):
    with open(tmp_path / "metrics.jsonl", "w") as f:
        for step in range(1, 9):  # 8 steps: means over the first 2 and the last 2
            f.write(json.dumps({"step": step, "reward/mean": step / 10, "response/length_mean": 10.0 * step,
                                "mismatch/logp_abs_diff_mean": 1e-3, "time/step_wall": 1.5}) + "\n")
    rows = dict(summarize_run(tmp_path))
    assert rows["steps"] == "8"
    assert rows["reward (first 2 -> last 2 steps)"] == "0.150 -> 0.750"
    assert rows["response length (first 2 -> last 2 steps)"] == "15.000 -> 75.000"
    assert rows["accuracy (first 2 -> last 2 steps)"] == "nan -> nan"  # not logged
    assert rows["mismatch |Δ logp| mean (last)"] == "1.00e-03"
    assert rows["time in steps"] == "12 s"


def test_summarize_run_needs_a_log(tmp_path):
    with pytest.raises(FileNotFoundError, match="no metrics"):
        summarize_run(tmp_path)
