"""The 8B memory/time benchmark runs end to end with a tiny config on CPU."""

from __future__ import annotations

import importlib.util
import math
import pathlib
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
BENCH = ROOT / "bench" / "model_memory.py"


def load_bench():
    if str(ROOT) not in sys.path:  # the script imports bench.common
        sys.path.insert(0, str(ROOT))
    spec = importlib.util.spec_from_file_location("bench_model_memory", BENCH)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_tiny_run_prints_table(capsys):
    bench = load_bench()
    results = bench.main(["--tiny", "--device", "cpu", "--num-seqs", "2", "--seq-len", "16", "--steps", "1",
                          "--warmup", "0"])
    assert [r.recipe for r in results] == ["bf16", "jet"]
    assert all(math.isfinite(r.median_ms) and r.median_ms > 0 and r.tokens == 32 for r in results)
    out = capsys.readouterr().out
    assert "time/bf16" in out and "jet" in out and "1.000" in out


def test_8b_config_has_the_published_shape():
    cfg = load_bench().DecoderConfig.from_hf(load_bench().LLAMA31_8B)
    params = (cfg.vocab_size * cfg.hidden_size * 2
              + cfg.num_hidden_layers * (cfg.hidden_size * cfg.head_dim * (2 * cfg.num_attention_heads
                                                                          + 2 * cfg.num_key_value_heads)
                                         + 3 * cfg.hidden_size * cfg.intermediate_size + 2 * cfg.hidden_size)
              + cfg.hidden_size)
    assert params == 8_030_261_248  # Llama-3.1-8B parameter count
    with pytest.raises(SystemExit):
        load_bench().main(["--steps", "x"])


def test_shapes_come_from_bench_common():
    import bench.common

    bench_module = load_bench()
    assert bench_module.LLAMA31_8B is bench.common.LLAMA31_8B and bench_module.TINY_LLAMA is bench.common.TINY_LLAMA
