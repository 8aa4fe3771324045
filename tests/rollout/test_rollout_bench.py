"""bench/rollout.py runs end to end on CPU (--tiny) and reports every quantity it promises."""

import importlib.util
import math
import pathlib
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
BENCH = ROOT / "bench" / "rollout.py"


def _load(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT))  # the script imports bench.common
    spec = importlib.util.spec_from_file_location("bench_rollout", BENCH)
    bench = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = bench  # dataclasses look their module up
    try:
        spec.loader.exec_module(bench)
    finally:
        sys.modules.pop(spec.name, None)
    return bench


@pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="transformers is not installed")
def test_rollout_bench_tiny(monkeypatch):
    bench = _load(monkeypatch)
    results = bench.main(["--tiny"])
    assert [r.setting for r in results] == ["tiny", "tiny-n2"]
    for r in results:
        assert set(r.tokens_per_s) == {"bf16", "jet"}
        values = [*r.tokens_per_s.values(), *r.roofline_fraction.values(), r.jet_over_bf16, r.jet_ceiling,
                  r.hf_tokens_per_s, r.engine_over_hf]
        assert all(math.isfinite(v) and v > 0 for v in values), r
        assert r.jet_ceiling > 1  # FP8 halves the linear weights' bytes


def test_rollout_bench_tiny_exact_arm(monkeypatch, capsys):
    """--exact: the jet-exact arm next to bf16 and jet, its time ratios, and every arm's mismatch (jet-exact's 0)."""
    bench = _load(monkeypatch)
    results = bench.main(["--tiny", "--no-hf", "--exact"])
    for r in results:
        assert set(r.tokens_per_s) == {"bf16", "jet", "jet-exact"}
        assert r.mismatch_max["jet-exact"] == 0.0 and r.mismatch_mean["jet-exact"] == 0.0
        assert all(math.isfinite(r.mismatch_mean[a]) and r.mismatch_max[a] >= r.mismatch_mean[a]
                   for a in ("bf16", "jet"))
        assert r.exact_over_jet == r.tokens_per_s["jet"] / r.tokens_per_s["jet-exact"] > 0
        assert r.exact_over_bf16 == r.tokens_per_s["bf16"] / r.tokens_per_s["jet-exact"] > 0
        assert set(r.prefill_seconds) == set(r.decode_seconds) == {"bf16", "jet", "jet-exact"}
    out = capsys.readouterr().out
    assert "rollout/training mismatch |dlogp| mean / max: bf16" in out and "jet-exact 0.00e+00 / 0.00e+00" in out
