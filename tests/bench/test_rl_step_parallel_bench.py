"""The several-GPU RL-step benchmark runs end to end on CPU as one rank (its smoke mode)."""

from __future__ import annotations

import importlib
import json
import pathlib

import pytest
import torch

ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.fixture
def bench(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT))
    return importlib.import_module("bench.rl_step_parallel")


def test_tiny_one_rank_reports_phases_memory_and_collectives(bench, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("OUT", str(tmp_path))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        report = bench.main(["--tiny", "--warmup", "0", "--steps", "1", "--profile", "--prompt-len", "4",
                             "--new-tokens", "4"])
    finally:
        torch.set_num_threads(threads)
    assert report["setting"]["world_size"] == 1 and report["setting"]["num_layers"] == 2
    for recipe in ("bf16", "jet"):
        r = report["results"][recipe]
        assert set(r["seconds"]) >= {"rollout", "old_logprob", "reference", "update", "total"}
        # 2 prompts x 2 samples x 4 new tokens, on the one GPU there is
        assert r["tokens_per_s_per_gpu"]["rollout"] == pytest.approx(16 / r["seconds"]["rollout"])
        assert r["block_tokens_per_s_per_gpu"]["update"] == pytest.approx(2 * r["tokens_per_s_per_gpu"]["update"])
        assert r["peak_gib_per_gpu"] == [None]  # CPU: not tracked
        assert set(r["collective_seconds"]) == {"all_gather", "reduce_scatter", "all_reduce"}
        assert sum(r["collective_seconds"].values()) == 0.0  # one rank: no collective runs
    ratios = report["speedups_over_bf16"]["jet"]
    assert ratios["total"] == pytest.approx(report["results"]["bf16"]["seconds"]["total"]
                                            / report["results"]["jet"]["seconds"]["total"])
    assert json.loads((tmp_path / "rl_step_parallel.json").read_text())["setting"]["world_size"] == 1
    out = capsys.readouterr().out
    assert "collectives per step: all-gather" in out and "block-tokens/s per GPU" in out


def test_collective_seconds_sorts_profiler_events_by_kind(bench):
    class Event:
        def __init__(self, key, cpu_us, device_us=0.0):
            self.key, self.cpu_time_total, self.device_time_total = key, cpu_us, device_us

    class Prof:
        def key_averages(self):
            return [Event("ncclDevKernel_AllGather_RING_LL", 0, 2e6), Event("ncclDevKernel_ReduceScatter_Sum_f32", 0,
                    1e6), Event("ncclDevKernel_AllReduce_Sum_f64", 0, 5e5), Event("aten::mm", 9e6, 9e6),
                    Event("gloo:all_gather", 3e6)]

    assert bench.collective_seconds(Prof(), torch.device("cuda")) == {"all_gather": 2.0, "reduce_scatter": 1.0,
                                                                     "all_reduce": 0.5}
    assert bench.collective_seconds(Prof(), torch.device("cpu")) == {"all_gather": 3.0, "reduce_scatter": 0.0,
                                                                    "all_reduce": 0.0}
