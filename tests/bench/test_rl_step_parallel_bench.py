"""The several-GPU RL-step benchmark runs end to end on CPU as one rank (its smoke mode)."""

from __future__ import annotations

import importlib
import json
import pathlib
import types

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
        # CPU: no device kernels, so no overlap-corrected measure (not a zero)
        assert r["comm_overlap"] is None and r["exposed_comm_share_of_step"] is None
        profiled = r["profiled_step"]  # the phase ranges the bench sets on the trainer
        assert set(profiled["phase_s"]) == {"rollout", "reward", "old_logprob", "reference", "update"}
        assert 0 < sum(profiled["phase_s"].values()) <= profiled["step_s"]
        g = r["weight_gather"]
        assert set(g) == {"gather_s", "quantize_s", "release_s", "share_of_rollout"}
        assert min(g.values()) >= 0.0
        assert g["share_of_rollout"] == pytest.approx((g["gather_s"] + g["quantize_s"]) / r["seconds"]["rollout"])
    ratios = report["speedups_over_bf16"]["jet"]
    assert ratios["total"] == pytest.approx(report["results"]["bf16"]["seconds"]["total"]
                                            / report["results"]["jet"]["seconds"]["total"])
    assert json.loads((tmp_path / "rl_step_parallel.json").read_text())["setting"]["world_size"] == 1
    out = capsys.readouterr().out
    assert "collectives per step: all-gather" in out and "block-tokens/s per GPU" in out
    assert "exposed communication n/a" in out and "rollout weight gather" in out


def test_collective_seconds_sorts_profiler_events_by_kind(bench):
    class Avg:
        def __init__(self, key, cpu_us):
            self.key, self.cpu_time_total = key, cpu_us

    class Prof:
        def events(self):
            return [_event("ncclDevKernel_AllGather_RING_LL", "CUDA", 0, 2e6),
                    _event("nccl:_all_gather_base", "CPU", 0, 3e6, annotation=True),
                    _event("nccl:_all_gather_base", "CUDA", 0, 2.5e6, annotation=True),  # not a kernel
                    _event("ncclDevKernel_ReduceScatter_Sum_f32", "CUDA", 2e6, 3e6),
                    _event("ncclDevKernel_AllReduce_Sum_f64", "CUDA", 3e6, 3.5e6),
                    _event("ncclDevKernel_AllReduce_Sum_f64", "CPU", 3e6, 9e6),  # not on the device
                    _event("ncclDevKernel_SendRecv", "CUDA", 4e6, 5e6),  # none of the three
                    _event("sm90_gemm_allgather_fused", "CUDA", 0, 9e6)]  # not NCCL

        def key_averages(self):
            return [Avg("aten::mm", 9e6), Avg("gloo:all_gather", 3e6), Avg("gloo:all_reduce", 1e6)]

    assert bench.collective_seconds(Prof(), torch.device("cuda")) == {"all_gather": 2.0, "reduce_scatter": 1.0,
                                                                     "all_reduce": 0.5}
    assert bench.collective_seconds(Prof(), torch.device("cpu")) == {"all_gather": 3.0, "reduce_scatter": 0.0,
                                                                    "all_reduce": 1.0}


def _event(name, device, start_us, end_us, annotation=False):
    from torch.autograd import DeviceType

    return types.SimpleNamespace(name=name, device_type=getattr(DeviceType, device), is_user_annotation=annotation,
                                 time_range=types.SimpleNamespace(start=start_us, end=end_us))


def test_kernels_and_windows_from_profiler_events(bench):
    events = [
        _event("rl_step_parallel/step", "CPU", 0, 10e6, annotation=True),
        _event("rl_step_parallel/rollout", "CPU", 0, 4e6, annotation=True),
        _event("rl_step_parallel/update", "CPU", 5e6, 9e6, annotation=True),
        _event("rl_step_parallel/update", "CUDA", 5e6, 9e6, annotation=True),  # the range's device copy
        _event("rl_step_parallel/rollout", "CUDA", 0, 4e6),  # a device copy not flagged: still not a kernel
        _event("FSDP::all_gather", "CPU", 1e6, 2e6, annotation=True),
        _event("aten::mm", "CPU", 1e6, 2e6),
        _event("ncclDevKernel_AllGather_RING_LL", "CUDA", 1e6, 3e6),
        _event("sm90_gemm_bf16", "CUDA", 2e6, 2.5e6),
        _event("ncclDevKernel_ReduceScatter_Sum_bf16", "CUDA", 6e6, 7e6),
        _event("Memcpy DtoD (Device -> Device)", "CUDA", 6.5e6, 8e6),
    ]
    kernels = bench.device_kernels(events)
    assert kernels == [("ncclDevKernel_AllGather_RING_LL", 1.0, 3.0), ("sm90_gemm_bf16", 2.0, 2.5),
                       ("ncclDevKernel_ReduceScatter_Sum_bf16", 6.0, 7.0), ("Memcpy DtoD (Device -> Device)", 6.5, 8.0)]
    windows = bench.range_windows(events)
    assert windows == {"step": [(0.0, 10.0)], "rollout": [(0.0, 4.0)], "update": [(5.0, 9.0)]}
    step = windows.pop("step")
    out = bench.overlap_summary(kernels, step, windows)
    assert out["exposed_comm_s"] == pytest.approx(1.5 + 0.5)
    assert out["phases"]["rollout"]["exposed_comm_s"] == pytest.approx(1.5)
    assert out["phases"]["update"]["exposed_comm_s"] == pytest.approx(0.5)
    assert out["phases"]["other"]["seconds"] == pytest.approx(2.0)


def test_phase_ranges_name_each_phase_and_leave_the_trainer_as_it_was(bench):
    from torch.profiler import ProfilerActivity, profile

    class Trainer:
        def __init__(self):
            self.model, self.ref_model, self.calls = object(), object(), []

        def rollout(self, items, first=0):
            self.calls.append(("rollout", items, first))
            return "completions"

        def build_batch(self, items, completions):
            return "batch"

        def score(self, model, batch):
            return "lp"

        def update(self, batch, old_lp, ref_lp, is_weights):
            return {}

        def step(self):
            self.rollout([1], first=3)
            self.build_batch([1], "completions")
            self.score(self.model, "batch")
            self.score(self.ref_model, "batch")
            self.update("batch", None, None, None)

    trainer = Trainer()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        with bench.phase_ranges(trainer, torch.device("cpu")):
            assert trainer.rollout([2]) == "completions"
            trainer.step()
    assert trainer.calls == [("rollout", [2], 0), ("rollout", [1], 3)]
    assert not vars(trainer).keys() & set(bench.PHASE_METHODS)  # the class's methods again
    windows = bench.range_windows(prof.events())
    assert {k: len(v) for k, v in windows.items()} == {"rollout": 2, "reward": 1, "old_logprob": 1, "reference": 1,
                                                       "update": 1}


def test_report_prints_exposed_communication_per_phase(bench):
    overlap = {"comm_busy_s": 3.0, "exposed_comm_s": 1.0,
               "phases": {"rollout": {"exposed_comm_s": 0.75, "comm_busy_s": 1.0},
                          "reward": {"exposed_comm_s": 0.0, "comm_busy_s": 0.0},
                          "update": {"exposed_comm_s": 0.25, "comm_busy_s": 2.0}}}
    result = {"seconds": {"rollout": 4.0, "total": 10.0}, "tokens_per_s_per_gpu": {}, "peak_gib_per_gpu": [70.0, 71.0],
              "block_tokens_per_s_per_gpu": {"update": 1.0},
              "collective_seconds": {"all_gather": 2.0, "reduce_scatter": 0.5, "all_reduce": 0.5},
              "collective_share_of_step": 0.3, "comm_overlap": {"max": overlap, "per_rank": [overlap, overlap]},
              "exposed_comm_share_of_step": 0.1,
              "weight_gather": {"gather_s": 0.3, "quantize_s": 0.1, "release_s": 0.0, "share_of_rollout": 0.1}}
    text = bench.format_report({"jet": result}, {}, 2)
    assert ("jet: NCCL busy 3.000 s, exposed (no other kernel running) 1.000 s = 10.0% of the step; exposed s by "
            "phase: rollout 0.750, update 0.250") in text
    assert "jet: rollout weight gather 0.300 s + first FP8 quantization 0.100 s = 10.0% of the rollout" in text
