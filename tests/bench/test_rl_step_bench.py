"""The RL-step benchmark runs end to end on CPU with a tiny config; its 8B shape and memory estimate hold."""

from __future__ import annotations

import importlib
import json
import math
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.fixture
def bench(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT))  # bench/ is a folder of scripts, importable from the root
    return importlib.import_module("bench.rl_step")


def test_tiny_run_times_every_phase_and_writes_json(bench, one_thread, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("OUT", str(tmp_path))
    report = bench.main(["--tiny", "--warmup", "0", "--steps", "1", "--prompt-len", "4", "--new-tokens", "4"])
    setting = report["setting"]
    assert (setting["prompts"], setting["n"], setting["new_tokens"]) == (2, 2, 4)
    assert setting["generated_tokens"] == 16 and setting["scored_tokens"] == 32
    results = report["results"]
    assert list(results) == ["bf16", "jet"]
    for recipe, r in results.items():
        seconds = r["seconds"]
        for phase in ("rollout", "reward", "old_logprob", "reference", "update", "weight_refresh", "total"):
            assert phase in seconds and math.isfinite(seconds[phase]) and seconds[phase] >= 0, (recipe, phase)
        assert seconds["rollout"] > 0 and seconds["update"] > 0
        assert 0 < r["rollout_loop_seconds"] <= seconds["rollout"]  # the engine's loop is part of the phase
        # one timed step: the total is the sum of its phases
        parts = sum(v for k, v in seconds.items() if k != "total")
        assert seconds["total"] == pytest.approx(parts, rel=1e-9)
        assert r["tokens_per_s"]["rollout"] == pytest.approx(16 / seconds["rollout"])
        assert r["tokens_per_s"]["update"] == pytest.approx(32 / seconds["update"])
        assert r["step_metrics"]["response/num_tokens"] == 16  # fixed-length rollouts: EOS ignored
        assert r["step_metrics"]["actor/num_updates"] == 1
        assert r["peak_gib"] is None and r["estimated_gib"] > 0  # CPU: not tracked
    ratios = report["speedups_over_bf16"]["jet"]
    for phase in ("rollout", "reference", "update", "total"):
        assert ratios[phase] == pytest.approx(results["bf16"]["seconds"][phase] / results["jet"]["seconds"][phase])
    written = json.loads((tmp_path / "rl_step.json").read_text())
    assert written["results"]["jet"]["seconds"] == results["jet"]["seconds"]
    assert written["jetrl_targets"] == {"rollout": 1.3, "reference": 1.8, "update": 1.6, "total": 1.3}
    out = capsys.readouterr().out.rstrip().splitlines()
    # the table comes last: header, one row per phase, the memory line
    assert out[-1].startswith("peak memory:")
    table_rows = [line.split()[0] for line in out[-9:-1]]
    assert table_rows == ["phase", "rollout", "reward", "old_logprob", "reference", "update", "weight_refresh", "total"]
    assert "1.07-1.33x" in out[-8] and "1.80x" in out[-5]


def test_tiny_run_without_the_old_logprob_pass(bench, one_thread, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("OUT", str(tmp_path))
    report = bench.main(["--tiny", "--warmup", "0", "--steps", "1", "--prompt-len", "4", "--new-tokens", "4",
                         "--recipes", "jet", "--old-logprobs-from-update"])
    assert report["setting"]["old_logprobs_from_update"] is True
    seconds = report["results"]["jet"]["seconds"]
    assert "old_logprob" not in seconds and seconds["update"] > 0
    assert report["results"]["jet"]["step_metrics"]["actor/ratio_mean"] == 1.0
    assert "old log-probs from the update" in capsys.readouterr().out


def test_tiny_run_with_the_exact_arm(bench, one_thread, tmp_path, monkeypatch, capsys):
    """--exact adds jet-exact after the recipes: its mismatch is 0.0, the table gives its cost over fast jet,
    and the mismatch line shows every arm."""
    monkeypatch.setenv("OUT", str(tmp_path))
    report = bench.main(["--tiny", "--warmup", "0", "--steps", "1", "--prompt-len", "4", "--new-tokens", "4",
                         "--recipes", "jet", "--exact", "--no-reference"])
    results = report["results"]
    assert list(results) == ["jet", "jet-exact"]
    assert results["jet-exact"]["step_metrics"]["mismatch/logp_abs_diff_max"] == 0.0
    assert results["jet"]["step_metrics"]["response/num_tokens"] == 16  # 2 prompts x 2 samples x 4 tokens
    out = capsys.readouterr().out
    header = next(line for line in out.splitlines() if line.startswith("phase"))
    assert "jet-exact/jet" in header
    ratio_row = next(line for line in out.splitlines() if line.startswith("update"))
    expected = results["jet-exact"]["seconds"]["update"] / results["jet"]["seconds"]["update"]
    assert f"{expected:.2f}x" in ratio_row
    mismatch = next(line for line in out.splitlines() if line.startswith("rollout/training mismatch"))
    assert "jet-exact 0.00e+00 / 0.00e+00" in mismatch and "jet " in mismatch


def test_tuning_settings_are_typed_checked_and_in_force_for_the_run(bench, one_thread, tmp_path, monkeypatch):
    from jetrl.quant.kernels import tuning

    seen = {}
    real = bench._main
    monkeypatch.setattr(bench, "_main", lambda args: seen.update(vars(tuning.current())) or real(args))
    monkeypatch.setenv("OUT", str(tmp_path))
    report = bench.main(["--tiny", "--warmup", "0", "--steps", "1", "--prompt-len", "4", "--new-tokens", "4",
                         "--recipes", "jet", "--no-reference", "--tuning", "exact_split_k=2",
                         "--tuning", "kv_decode_factored=false"])
    assert report["tuning"] == {"exact_split_k": 2, "kv_decode_factored": False}
    assert seen["exact_split_k"] == 2 and seen["kv_decode_factored"] is False
    assert tuning.current().exact_split_k == 0 and tuning.current().kv_decode_factored  # restored after
    for bad in ("nonsense=1", "exact_split_k=two", "kv_decode_factored=maybe", "exact_split_k", "exact_split_k=-1"):
        with pytest.raises(SystemExit):
            bench._parse(["--tiny", "--tuning", bad])


def test_exact_arm_of_an_unknown_recipe_is_refused(bench):
    with pytest.raises(SystemExit):
        bench._parse(["--tiny", "--recipes", "fp9-exact"])


def test_8b_shape_and_default_depth_fit_one_h200(bench):
    from bench.common import LLAMA31_8B, with_layers

    total, linear = bench.parameter_counts(LLAMA31_8B)
    assert total == 8_030_261_248  # Llama-3.1-8B as published
    assert total - linear == 2 * 128256 * 4096 + 65 * 4096  # embedding, LM head, norms stay BF16
    h200 = 139 * 2 ** 30

    def estimate(layers, recipe, reference=True):
        return bench.estimate_memory_bytes(with_layers(LLAMA31_8B, layers), recipe, reference, 64, 1280, 8)

    # the full depth cannot hold 20 bytes per parameter of update state on one H200, even without a reference
    assert estimate(32, "bf16", reference=False) > h200
    # the default depth fits in every recipe, with the reference model, with headroom for fragmentation
    depth = bench.DEFAULT_8B_LAYERS
    assert max(estimate(depth, r) for r in ("bf16", "fp8-rollout", "jet")) < 0.9 * h200
    assert estimate(depth, "jet") > estimate(depth, "bf16")  # FP8 weight caches come on top


def test_bad_arguments_are_rejected(bench):
    with pytest.raises(SystemExit):
        bench.main(["--tiny", "--prompts", "0"])
    with pytest.raises(SystemExit):
        bench.main(["--tiny", "--recipes", "fp4"])
    with pytest.raises(ValueError, match="num_layers"):
        from bench.common import LLAMA31_8B, with_layers
        with_layers(LLAMA31_8B, 0)


def test_tiny_run_with_the_fp8_kv_arm(bench, one_thread, tmp_path, monkeypatch, capsys):
    """--kv-fp8 adds jet+kv8 (run config kv_fp8: true); its end-to-end speed-up is set against NeMo-RL's and
    issue 17's target, its mismatch printed beside bf16's; a short warm-up step runs first."""
    monkeypatch.setenv("OUT", str(tmp_path))
    report = bench.main(["--tiny", "--warmup", "1", "--warmup-new-tokens", "2", "--steps", "1", "--prompt-len", "4",
                         "--new-tokens", "4", "--recipes", "bf16", "--kv-fp8", "--no-reference"])
    results = report["results"]
    assert list(results) == ["bf16", "jet+kv8"]
    for r in results.values():  # the timed step generated the full length (the warm-up step 2 tokens a sample)
        assert r["step_metrics"]["response/num_tokens"] == 16 and r["step_metrics"]["actor/num_updates"] == 1
    assert report["speedups_over_bf16"]["jet+kv8"]["total"] == pytest.approx(
        results["bf16"]["seconds"]["total"] / results["jet+kv8"]["seconds"]["total"])
    assert report["jetrl_kv8_targets"] == {"total": 1.5} and report["nemo_rl_reported"] == {"total": "1.48x"}
    out = capsys.readouterr().out.splitlines()
    header = next(line for line in out if line.startswith("phase"))
    assert "NeMo-RL" in header and "jet+kv8 target" in header and "Jet-RL" not in header
    total = next(line for line in out if line.startswith("total"))
    assert "1.48x" in total and "1.5x" in total
    mismatch = next(line for line in out if line.startswith("rollout/training mismatch"))
    assert "bf16 " in mismatch and "jet+kv8 " in mismatch
    assert any(line.startswith("end to end over bf16: jet+kv8 ") for line in out)
    assert "1 warm-up (2 new tokens) + 1 timed steps" in "\n".join(out)


def test_long_setting_and_its_memory(bench):
    from bench.common import LLAMA31_8B, with_layers

    args = bench._parse(["--long", "--kv-fp8"])
    assert (args.prompts, args.n, args.new_tokens, args.layers, args.warmup_new_tokens) == (16, 4, 4096, 8, 256)
    assert args.recipes == ["bf16", "jet", "jet+kv8"]
    assert bench._parse(["--long", "--layers", "12", "--new-tokens", "2048"]).layers == 12
    assert bench._parse(["--long", "--layers", "12", "--new-tokens", "2048"]).new_tokens == 2048
    assert bench._parse(["--tiny", "--long"]).new_tokens is None  # the tiny model keeps its own setting

    h200 = 139 * 2 ** 30

    def estimate(layers, recipe, kv_fp8=False):
        return bench.estimate_memory_bytes(with_layers(LLAMA31_8B, layers), recipe, True, 64, 256 + 4096, 8,
                                           kv_fp8=kv_fp8)

    # as the module doc says: 16 blocks do not fit with long rollouts, 8 do, in every arm
    assert estimate(16, "jet") > h200
    assert max(estimate(8, "bf16"), estimate(8, "jet"), estimate(8, "jet", kv_fp8=True)) < 0.7 * h200
    assert estimate(16, "jet") / 2 ** 30 == pytest.approx(141, abs=1)
    assert estimate(8, "jet") / 2 ** 30 == pytest.approx(89, abs=1)
    # the FP8 cache: (128 + 4) bytes per token per KV head for K and for V instead of 2 x 128
    kv_bf16 = 64 * 4352 * 2 * 8 * 8 * 128 * 2
    assert estimate(8, "jet") - estimate(8, "jet", kv_fp8=True) == kv_bf16 - kv_bf16 * 132 // 256


@pytest.mark.parametrize("argv", [["--tiny", "--recipes", "bf16+kv8"], ["--tiny", "--arms", "jet,jet"],
                                  ["--tiny", "--warmup-new-tokens", "0"], ["--tiny", "--arms", "fp8-rollout-exact"]])
def test_bad_arms_and_warmups_are_refused(bench, argv):
    with pytest.raises(SystemExit):
        bench._parse(argv)
