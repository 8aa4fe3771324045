"""bench/rollout.py runs end to end on CPU (--tiny) and reports every quantity it promises."""

import importlib.util
import math
import pathlib
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
BENCH = ROOT / "bench" / "rollout.py"


@pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="transformers is not installed")
def test_rollout_bench_tiny(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT))  # the script imports bench.common
    spec = importlib.util.spec_from_file_location("bench_rollout", BENCH)
    bench = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = bench  # dataclasses look their module up
    try:
        spec.loader.exec_module(bench)
    finally:
        sys.modules.pop(spec.name, None)
    results = bench.main(["--tiny"])
    assert [r.setting for r in results] == ["tiny", "tiny-n2"]
    for r in results:
        assert set(r.tokens_per_s) == {"bf16", "jet"}
        values = [*r.tokens_per_s.values(), *r.roofline_fraction.values(), r.jet_over_bf16, r.jet_ceiling,
                  r.hf_tokens_per_s, r.engine_over_hf]
        assert all(math.isfinite(v) and v > 0 for v in values), r
        assert r.jet_ceiling > 1  # FP8 halves the linear weights' bytes
