"""The interval arithmetic behind the overlap-corrected communication time, against a brute-force sweep."""

from __future__ import annotations

import importlib
import pathlib
import random

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.fixture
def co(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT))
    return importlib.import_module("bench.comm_overlap")


def _covered(intervals, x):
    return any(s < x < e for s, e in intervals)


def _brute(a, b):
    """|A|, |B|, |A & B|, |A \\ B| by sweeping the elementary segments between all endpoints: each segment
    lies wholly inside or outside every interval, so testing its midpoint is exact."""
    points = sorted({p for iv in a + b for p in iv})
    la = lb = both = only_a = 0.0
    for lo, hi in zip(points, points[1:]):
        mid, width = (lo + hi) / 2, hi - lo
        in_a, in_b = _covered(a, mid), _covered(b, mid)
        la += width * in_a
        lb += width * in_b
        both += width * (in_a and in_b)
        only_a += width * (in_a and not in_b)
    return la, lb, both, only_a


def _random_intervals(rng, n, integer):
    out = []
    for _ in range(n):
        if integer:  # a coarse grid: touching, identical, nested and empty intervals come up often
            s = rng.randint(0, 12)
            out.append((float(s), float(s + rng.randint(0, 5))))
        else:
            s = rng.uniform(0, 10)
            out.append((s, s + rng.expovariate(1.0)))
    return out


@pytest.mark.parametrize("integer", [True, False])
def test_union_intersection_and_exposed_match_a_brute_force_sweep(co, integer):
    rng = random.Random(1234 + integer)
    for _ in range(400):
        a = _random_intervals(rng, rng.randint(0, 8), integer)
        b = _random_intervals(rng, rng.randint(0, 8), integer)
        la, lb, both, only_a = _brute(a, b)
        assert co.length(a) == pytest.approx(la, abs=1e-9)
        assert co.length(b) == pytest.approx(lb, abs=1e-9)
        assert co.length(co.intersect(a, b)) == pytest.approx(both, abs=1e-9)
        assert co.exposed_length(a, b) == pytest.approx(only_a, abs=1e-9)
        assert co.exposed_length(b, a) == pytest.approx(lb - both, abs=1e-9)
        for result in (co.merge(a), co.intersect(a, b), co.subtract(a, b)):  # sorted, disjoint, non-empty
            assert all(s < e for s, e in result)
            assert all(e1 < s2 for (_, e1), (s2, _) in zip(result, result[1:]))


def test_edge_cases(co):
    assert co.merge([]) == [] and co.length([]) == 0.0
    assert co.merge([(1.0, 1.0), (2.0, 2.0)]) == []  # empty intervals vanish
    assert co.merge([(0.0, 1.0), (1.0, 2.0)]) == [(0.0, 2.0)]  # touching ones join
    assert co.merge([(0.0, 5.0), (1.0, 2.0)]) == [(0.0, 5.0)]  # nested
    assert co.merge([(3.0, 4.0), (3.0, 4.0)]) == [(3.0, 4.0)]  # identical
    assert co.exposed_length([(0.0, 4.0)], []) == 4.0
    assert co.exposed_length([], [(0.0, 4.0)]) == 0.0
    assert co.exposed_length([(1.0, 2.0)], [(0.0, 4.0)]) == 0.0  # nested in compute: hidden
    assert co.exposed_length([(0.0, 4.0)], [(1.0, 2.0)]) == 3.0  # compute nested in comm
    assert co.exposed_length([(0.0, 2.0)], [(2.0, 3.0)]) == 2.0  # touching: nothing hidden
    assert co.exposed_length([(0.0, 2.0)], [(0.0, 2.0)]) == 0.0  # identical
    assert co.subtract([(0.0, 10.0)], [(1.0, 2.0), (3.0, 4.0), (9.0, 12.0)]) == [(0.0, 1.0), (2.0, 3.0), (4.0, 9.0)]
    with pytest.raises(ValueError, match="ends before it starts"):
        co.merge([(2.0, 1.0)])


def test_collective_kinds(co):
    assert co.collective_kind("ncclDevKernel_AllGather_RING_LL(ncclDevKernelArgsStorage<4096ul>)") == "all_gather"
    assert co.collective_kind("ncclDevKernel_ReduceScatter_Sum_bf16_RING_LL") == "reduce_scatter"
    assert co.collective_kind("ncclKernel_AllReduce_RING_LL_Sum_float") == "all_reduce"
    assert co.collective_kind("gloo:all_gather") == "all_gather"
    assert co.collective_kind("ncclDevKernel_SendRecv") is None
    assert co.is_nccl("ncclDevKernel_SendRecv") and not co.is_nccl("void gemm_kernel<128>")


def test_overlap_summary_splits_a_hand_made_step(co):
    kernels = [
        ("ncclDevKernel_AllGather_RING_LL", 0.0, 2.0),      # 0-1 exposed, 1-2 under the gemm
        ("gemm", 1.0, 3.0),
        ("ncclDevKernel_ReduceScatter_Sum", 2.5, 4.0),      # 2.5-3 hidden, 3-4 exposed
        ("ncclDevKernel_AllGather_RING_LL", 3.5, 4.5),      # overlaps the reduce-scatter; 4-4.5 exposed
        ("memcpy", 6.0, 7.0),
        ("ncclDevKernel_AllReduce_Sum_f32", 6.5, 8.0),      # 7-8 exposed, but 7.5-8 is outside the step
        ("ncclDevKernel_AllReduce_Sum_f32", 9.0, 10.0),     # outside the step: ignored
    ]
    out = co.overlap_summary(kernels, step=[(0.0, 7.5)], phases={"rollout": [(0.0, 2.0)], "update": [(2.0, 5.0)]})
    assert out["step_s"] == 7.5
    assert out["comm_kernel_s"] == pytest.approx(2.0 + 1.5 + 1.0 + 1.0)
    assert out["comm_busy_s"] == pytest.approx(2.0 + 2.0 + 1.0)  # 0-2, 2.5-4.5, 6.5-7.5
    assert out["compute_busy_s"] == pytest.approx(2.0 + 1.0)
    assert out["exposed_comm_s"] == pytest.approx(1.0 + 1.5 + 0.5)
    assert out["kinds"]["all_gather"] == pytest.approx({"kernel_s": 3.0, "busy_s": 3.0, "exposed_s": 1.0 + 1.0})
    assert out["kinds"]["reduce_scatter"] == pytest.approx({"kernel_s": 1.5, "busy_s": 1.5, "exposed_s": 1.0})
    assert out["kinds"]["all_reduce"] == pytest.approx({"kernel_s": 1.0, "busy_s": 1.0, "exposed_s": 0.5})
    assert out["kinds"]["other"] == {"kernel_s": 0.0, "busy_s": 0.0, "exposed_s": 0.0}
    phases = out["phases"]
    assert phases["rollout"] == pytest.approx({"seconds": 2.0, "comm_busy_s": 2.0, "compute_busy_s": 1.0,
                                               "exposed_comm_s": 1.0})
    assert phases["update"] == pytest.approx({"seconds": 3.0, "comm_busy_s": 2.0, "compute_busy_s": 1.0,
                                              "exposed_comm_s": 1.5})
    assert phases["other"] == pytest.approx({"seconds": 2.5, "comm_busy_s": 1.0, "compute_busy_s": 1.0,
                                             "exposed_comm_s": 0.5})
    assert "phases" not in co.overlap_summary(kernels, step=[(0.0, 7.5)])
