"""bench/rollout.py: its bytes model against hand-computed values, its settings, arms and windows, its plan and
table, and end-to-end CPU smoke runs (--tiny) that report every quantity it promises."""

import importlib.util
import math
import re
import pathlib
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
BENCH = ROOT / "bench" / "rollout.py"


@pytest.fixture(scope="module")
def bench():
    sys.path.insert(0, str(ROOT))  # the script imports bench.common
    spec = importlib.util.spec_from_file_location("bench_rollout", BENCH)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.modules.pop(spec.name, None)
        sys.path.remove(str(ROOT))


# ----------------------------------------------------------------------------------------- the bytes model

def test_8b_bytes_by_hand(bench):
    from bench.common import LLAMA31_8B, parse_arm

    layers = 32
    # per block: q and o 4096 x 4096, k and v 1024 x 4096, gate/up/down 14336 x 4096
    linear = layers * (2 * 4096 * 4096 + 2 * 1024 * 4096 + 3 * 14336 * 4096)
    assert linear == 6_979_321_856
    blocks = layers * (2 * 32 * 32 + 2 * 8 * 32 + 3 * 112 * 32)  # 128 x 128 weight blocks, one fp32 scale each
    other = 128256 * 4096 + (2 * layers + 1) * 4096  # LM head, norms (no biases in Llama)
    assert bench.linear_weight_bytes(LLAMA31_8B, False) == 2 * linear
    assert bench.linear_weight_bytes(LLAMA31_8B, True) == linear + 4 * blocks
    assert bench.weight_bytes(LLAMA31_8B, False) == 2 * linear + 2 * other == 15_009_849_344
    assert bench.weight_bytes(LLAMA31_8B, True) == linear + 4 * blocks + 2 * other
    kv16, kv8 = 2 * 32 * 8 * 128 * 2, 2 * 32 * 8 * (128 + 4)
    assert kv16 == 128 * 1024  # the issue's 128 KiB of BF16 KV per token
    assert bench.kv_bytes_per_token(LLAMA31_8B, False) == kv16
    assert bench.kv_bytes_per_token(LLAMA31_8B, True) == kv8

    jet, kv = parse_arm("jet"), parse_arm("jet+kv8")
    # 256 x (256 + 1,024): decode steps attend over 256 + t tokens, t = 1..1023: mean 768
    assert bench.plan_measurement(256, 1024, None).mean_context == 768
    kv_bytes = 256 * 768 * kv16
    assert kv_bytes == 25_769_803_776  # the issue's "about 25 GB of KV"
    assert bench.step_bytes(LLAMA31_8B, jet, 256, 768) == linear + 4 * blocks + 2 * other + kv_bytes
    ceiling = (2 * linear + 2 * other + kv_bytes) / (linear + 4 * blocks + 2 * other + kv_bytes)
    assert bench.bytes_ceiling(LLAMA31_8B, jet, 256, 768) == pytest.approx(ceiling, rel=1e-12)
    assert bench.bytes_ceiling(LLAMA31_8B, jet, 256, 768) == pytest.approx(1.206, abs=1e-3)  # "about 1.2x"
    ceiling_kv8 = (2 * linear + 2 * other + kv_bytes) / (linear + 4 * blocks + 2 * other + 256 * 768 * kv8)
    assert bench.bytes_ceiling(LLAMA31_8B, kv, 256, 768) == pytest.approx(ceiling_kv8, rel=1e-12)
    assert bench.bytes_ceiling(LLAMA31_8B, kv, 256, 768) == pytest.approx(1.913, abs=1e-3)  # "about 2x"
    # 64 x (256 + 8,192): mean context 4,352, about 37 GB of BF16 KV per step
    assert 64 * 4352 * kv16 == 36_507_222_016
    assert bench.bytes_ceiling(LLAMA31_8B, jet, 64, 4352) == pytest.approx(1.157, abs=1e-3)
    assert bench.bytes_ceiling(LLAMA31_8B, kv, 64, 4352) == pytest.approx(1.918, abs=1e-3)
    assert bench.bytes_ceiling(LLAMA31_8B, parse_arm("bf16"), 64, 4352) == 1.0
    # exact mode reads the same bytes as its fast arm
    assert bench.bytes_ceiling(LLAMA31_8B, parse_arm("jet+kv8-exact"), 64, 4352) == \
        bench.bytes_ceiling(LLAMA31_8B, kv, 64, 4352)


def test_32b_shape_bytes_and_parameter_count(bench):
    from bench.common import QWEN25_32B
    from bench.rl_step import parameter_counts

    total, linear = parameter_counts(QWEN25_32B)
    assert total == 32_763_876_352  # Qwen2.5-32B as published
    layers = 64
    assert linear == layers * (2 * 5120 * 5120 + 2 * 1024 * 5120 + 3 * 27648 * 5120)
    embedding = 152064 * 5120
    # every parameter but the embedding is read by each decode step (the q/k/v biases too)
    assert bench.weight_bytes(QWEN25_32B, False) == 2 * (total - embedding)
    assert 2 * total < 139 * 2 ** 30 / 2  # 65.5 GB of BF16 weights: one copy fits an H200 with room for KV
    assert bench.kv_bytes_per_token(QWEN25_32B, False) == 2 * 64 * 8 * 128 * 2
    assert bench.kv_bytes_per_token(QWEN25_32B, True) == 2 * 64 * 8 * (128 + 4)


def test_weight_bytes_match_a_built_model(bench):
    """The formula's parameter and scale counts equal those of a real model's modules (tiny shape, CPU)."""
    import torch

    from bench.common import TINY_LLAMA
    from jetrl.models import build_model
    from jetrl.quant import apply_recipe, fp8_linears

    model = build_model(TINY_LLAMA, dtype=torch.float32, seed=0)
    params = sum(p.numel() for name, p in model.named_parameters() if "embed" not in name)
    assert bench.weight_bytes(TINY_LLAMA, False) == 2 * params  # at 2 bytes a parameter (BF16)
    apply_recipe(model, "jet")
    cached = sum(q.data.numel() + 4 * q.scale.numel() for q in (m.quantized_weight() for m in fp8_linears(model)))
    assert bench.linear_weight_bytes(TINY_LLAMA, True) == cached


def test_roofline_binds_on_bytes_at_decode(bench):
    from bench.common import LLAMA31_8B, parse_arm

    tps, bound = bench.roofline(LLAMA31_8B, parse_arm("jet"), 64, 768, bandwidth=4.3e12, matmul_flops=780e12)
    assert bound == "bandwidth"
    assert tps == pytest.approx(64 / (bench.step_bytes(LLAMA31_8B, parse_arm("jet"), 64, 768) / 4.3e12))
    _, bound = bench.roofline(LLAMA31_8B, parse_arm("bf16"), 4096, 1, bandwidth=4.3e12, matmul_flops=780e12)
    assert bound == "compute"


# ------------------------------------------------------------------------------- what a run measures

def test_window_keeps_the_mean_decode_context(bench):
    whole = bench.plan_measurement(256, 8192, None)
    assert (whole.prompt_len, whole.new_tokens, whole.window, whole.decode_steps) == (256, 8192, False, 8191)
    assert whole.mean_context == 256 + 4096
    w = bench.plan_measurement(256, 8192, 256)
    assert (w.prompt_len, w.new_tokens, w.window) == (256 + 3968, 256, True)
    assert w.mean_context == whole.mean_context == 4352
    # by hand: the window's decode steps t = 1..255 attend over 4224 + t tokens
    assert sum(4224 + t for t in range(1, 256)) / 255 == 4352
    assert bench.plan_measurement(256, 1024, 1024) == bench.Measurement(256, 1024, False)  # not longer: whole
    odd = bench.plan_measurement(256, 1001, 256)
    assert abs(odd.mean_context - bench.plan_measurement(256, 1001, None).mean_context) <= 0.5


@pytest.mark.parametrize("args", [(256, 1024, 1), (256, 0, None), (0, 1024, None), (256, 1024, True),
                                  (256.0, 1024, None)])
def test_window_rejects_bad_input(bench, args):
    with pytest.raises(ValueError):
        bench.plan_measurement(*args)


# -------------------------------------------------------------------------------- arms and command lines

def test_arm_names(bench):
    from bench.common import Arm, parse_arm, parse_arms

    assert [a.name for a in parse_arms("bf16, jet,jet+kv8")] == ["bf16", "jet", "jet+kv8"]
    assert parse_arm("jet+kv8-exact") == Arm("jet", kv_fp8=True, exact=True)
    assert parse_arm("fp8-rollout+kv8") == Arm("fp8-rollout", kv_fp8=True)
    assert parse_arm("jet+kv8").train_kv_fp8 and not parse_arm("fp8-rollout+kv8").train_kv_fp8
    assert not parse_arm("jet").train_kv_fp8
    for bad, match in [("bf16+kv8", "rolls out in BF16"), ("fp8-rollout-exact", "same precision"),
                       ("fp9", "unknown recipe"), ("jet+kv8+kv8", "unknown recipe"), ("kv8", "unknown recipe")]:
        with pytest.raises(ValueError, match=match):
            parse_arm(bad)
    with pytest.raises(ValueError, match="twice"):
        parse_arms("jet,jet")
    with pytest.raises(ValueError, match="no arm"):
        parse_arms(" , ")


def test_command_line(bench):
    args = bench._parse([])
    assert [a.name for a in args.arms] == ["bf16", "jet", "jet+kv8"]
    assert {s: list(v) for s, v in args.shapes.items()} == {"8b": ["b64", "b256", "b64-8k"]}
    # by default a 1,024-token setting runs whole, a longer one over a 1,024-token window; --window 0: all whole
    assert args.window == 1024 and bench._parse(["--window", "0"]).window is None
    args = bench._parse(["--shape", "8b,32b"])
    assert {s: list(v) for s, v in args.shapes.items()} == {"8b": ["b64", "b256", "b64-8k"],
                                                            "32b": ["b64", "b64-2k"]}
    assert args.shapes["8b"]["b64-8k"] == bench.Setting(64, 1, 8192)
    args = bench._parse(["--recipes", "bf16,jet", "--exact", "--settings", "b64"])  # the older spelling
    assert [a.name for a in args.arms] == ["bf16", "jet", "jet-exact"] and args.mismatch
    assert list(args.shapes["8b"]) == ["b64"]
    assert [a.name for a in bench._parse(["--arms", "jet-exact", "--exact"]).arms] == ["jet-exact"]


@pytest.mark.parametrize("argv", [["--shape", "70b"], ["--shape", ""], ["--settings", "b65"], ["--arms", "bf16+kv8"],
                                  ["--arms", "fp4"], ["--window", "1"], ["--new-tokens", "0"], ["--prompt-len", "0"],
                                  ["--max-seconds", "0"], ["--memory-budget", "1.5"], ["--shape", "32b", "--hf"],
                                  ["--repeats", "0"], ["--tiny", "--settings", "b64"], ["--tiny", "--settings", ","]])
def test_bad_command_lines_are_refused(bench, argv):
    with pytest.raises(SystemExit):
        bench._parse(argv)


def test_tiny_runs_the_settings_it_is_given(bench):
    assert list(bench._parse(["--tiny", "--settings", "tiny-n2"]).shapes["tiny"]) == ["tiny-n2"]
    assert list(bench._parse(["--tiny"]).shapes["tiny"]) == ["tiny", "tiny-n2"]


def test_plan_of_the_issue_table(bench, capsys):
    """The documented command's runs, their estimates (the doc points to ``--plan`` for them), and the KV each
    needs against the pool it gets."""
    argv = "--shape 8b,32b --window 256 --max-seconds 330".split()
    assert "bench/rollout.py --shape 8b,32b --window 256 --max-seconds 330" in bench.__doc__
    total, rows = bench.plan(bench._parse(argv))
    assert [(r.shape, r.setting) for r in rows if r.arm in (None, "bf16")] == [
        ("8b", None), ("8b", "b64"), ("8b", "b256"), ("8b", "b64-8k"), ("32b", None), ("32b", "b64"), ("32b", "b64-2k")]
    assert [r.arm for r in rows if r.setting == "b64-8k"] == ["bf16", "jet", "jet+kv8"]
    assert not any(r.preempts for r in rows)
    assert total == pytest.approx(bench.PlanAssumptions().start_seconds + sum(r.seconds for r in rows))
    assert total < 330  # the run fits its own cap by the estimate: nothing is skipped on an H200 at that pace
    assert "--plan" in bench.__doc__  # the doc points to the estimate instead of quoting it
    # at 32B, 64 x (256 + 3,072) tokens of BF16 KV fit next to the BF16 weights but not next to the FP8 weight
    # cache as well; the FP8 KV cache holds them
    _, rows = bench.plan(bench._parse(["--shape", "32b", "--settings", "b64", "--new-tokens", "3072", "--window", "0"]))
    assert [(r.arm, r.preempts) for r in rows[1:]] == [("bf16", False), ("jet", True), ("jet+kv8", False)]
    assert rows[3].kv_needed == 64 * (256 + 3072) * bench.kv_bytes_per_token(bench.SHAPES["32b"], True)
    bench.main(["--plan", "--shape", "8b", "--settings", "b64"])
    out = capsys.readouterr().out
    assert "8b b64 jet+kv8: " in out and "estimated GPU seconds in all" in out


def test_estimates_add_up(bench):
    from bench.common import LLAMA31_8B, parse_arm

    a = bench.PlanAssumptions()
    s = bench.Setting(64, 1, 1024)
    whole, window = bench.plan_measurement(256, 1024, None), bench.plan_measurement(256, 1024, 256)
    step = bench.step_bytes(LLAMA31_8B, parse_arm("bf16"), 64, 768) / (a.bandwidth * a.decode_efficiency)
    prefill = bench.prefill_seconds(LLAMA31_8B, 64, 256, a)
    # a whole generation: set-up, the warm-up's prefill, then prefill + 1,023 decode steps
    assert bench.estimate_arm_seconds(LLAMA31_8B, s, whole, parse_arm("bf16"), a) == \
        pytest.approx(a.arm_seconds + 2 * prefill + 1023 * step)
    assert bench.estimate_arm_seconds(LLAMA31_8B, s, window, parse_arm("jet+kv8"), a) < \
        bench.estimate_arm_seconds(LLAMA31_8B, s, window, parse_arm("bf16"), a)


def test_ratios_ceilings_and_table(bench):
    """Ratios over bf16 are of decode-step tokens/s; their ceilings come from the bytes model; skipped arms
    show in the table."""
    from bench.common import LLAMA31_8B, parse_arms

    arms = parse_arms("bf16,jet,jet+kv8,jet-exact")
    res = bench.Result("8b", "b256", 256, 1, 256, 1024, 256, 1024, False, 768.0)
    for name, e2e, decode in [("bf16", 15000.0, 16000.0), ("jet", 17000.0, 19000.0), ("jet-exact", 8500.0, 9000.0)]:
        res.tokens_per_s[name], res.decode_tokens_per_s[name], res.preemptions[name] = e2e, decode, 0
    res.skipped.append("jet+kv8")
    bench._ratios(res, LLAMA31_8B, bench.SETTINGS["b256"], arms)
    assert res.over_bf16 == {"jet": 19000 / 16000, "jet-exact": 9000 / 16000}
    assert res.e2e_over_bf16 == {"jet": 17000 / 15000, "jet-exact": 8500 / 15000}
    assert res.ceiling["jet"] == bench.bytes_ceiling(LLAMA31_8B, arms[1], 256, 768)
    assert res.ceiling_fraction["jet"] == res.over_bf16["jet"] / res.ceiling["jet"]
    assert res.exact_over_fast == {"jet-exact": 2.0} and res.exact_over_bf16 == {"jet-exact": 15000 / 8500}
    table = bench.format_table([res]).splitlines()
    assert table[0].split()[:4] == ["shape", "setting", "measured", "arm"]
    rows = {re.split(r"\s{2,}", line)[3]: line for line in table[1:]}  # columns: two spaces or more apart
    assert set(rows) == {"bf16", "jet", "jet-exact", "jet+kv8"}
    assert "17,000" in rows["jet"] and "1.19x" in rows["jet"] and "1.13x" in rows["jet"]
    assert f"{res.ceiling['jet']:.2f}x" in rows["jet"] and f"{res.ceiling_fraction['jet']:.0%}" in rows["jet"]
    assert "skipped" in rows["jet+kv8"]
    # a window reports no end-to-end numbers
    res.window = True
    res.e2e_over_bf16.clear()
    row = next(line for line in bench.format_table([res]).splitlines() if " jet " in line)
    assert "window 1024 @ctx 768" in row and "17,000" not in row


# ------------------------------------------------------------------------------------ CPU smoke runs

def test_tiny_run(bench, one_thread, capsys):
    results = bench.main(["--tiny", "--arms", "bf16,jet", "--exact"])
    assert [r.setting for r in results] == ["tiny", "tiny-n2"]
    for r in results:
        assert list(r.tokens_per_s) == ["bf16", "jet", "jet-exact"] and not r.window
        values = [*r.tokens_per_s.values(), *r.decode_tokens_per_s.values(), *r.decode_roofline_fraction.values(),
                  *r.over_bf16.values(), *r.e2e_over_bf16.values(), *r.ceiling.values(),
                  *r.ceiling_fraction.values()]
        assert all(math.isfinite(v) and v > 0 for v in values), r
        assert r.ceiling["jet"] > 1  # FP8 halves the linear weights' bytes
        assert r.mismatch_max["jet-exact"] == 0.0 and r.mismatch_mean["jet-exact"] == 0.0
        assert all(math.isfinite(r.mismatch_mean[a]) and r.mismatch_max[a] >= r.mismatch_mean[a]
                   for a in ("bf16", "jet"))
        assert r.exact_over_fast["jet-exact"] == r.tokens_per_s["jet"] / r.tokens_per_s["jet-exact"]
        assert set(r.prefill_seconds) == set(r.decode_seconds) == {"bf16", "jet", "jet-exact"}
    out = capsys.readouterr().out
    assert "rollout/training mismatch |dlogp| mean / max: bf16" in out and "jet-exact 0.00e+00 / 0.00e+00" in out
    assert out.rstrip().splitlines()[-7].startswith("shape")  # the table comes last: header + 6 rows


def test_tiny_run_fp8_kv_window(bench, one_thread, capsys):
    """The FP8-KV arm in a steady-state window: its mismatch, ratio and bytes ceiling (above jet's)."""
    results = bench.main(["--tiny", "--arms", "bf16,jet,jet+kv8", "--window", "4", "--mismatch"])
    for r in results:
        assert r.window and (r.measured_prompt_len, r.measured_new_tokens) == (10, 4) and r.mean_context == 12
        assert r.tokens_per_s.keys() == r.decode_tokens_per_s.keys() == {"bf16", "jet", "jet+kv8"}
        assert not r.e2e_over_bf16
        assert r.ceiling["jet+kv8"] > r.ceiling["jet"] > 1
        assert all(math.isfinite(r.mismatch_mean[a]) and r.mismatch_max[a] >= r.mismatch_mean[a]
                   for a in ("bf16", "jet", "jet+kv8"))
        assert r.preemptions["jet+kv8"] == 0
        assert all(r.kv_capacity_tokens[a] == 16 * r.kv_blocks[a] > 0 for a in r.kv_blocks)
    assert "jet+kv8 " in capsys.readouterr().out.splitlines()[-1]


def test_tiny_run_past_its_time_cap_skips_every_arm(bench, capsys):
    results = bench.main(["--tiny", "--max-seconds", "1"])  # every arm's estimate is longer
    assert all(r.skipped == ["bf16", "jet", "jet+kv8"] and not r.tokens_per_s for r in results)
    assert capsys.readouterr().out.count("skipped") >= 2 * 3


@pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="transformers is not installed")
def test_tiny_run_against_transformers(bench, one_thread):
    results = bench.main(["--tiny", "--arms", "bf16", "--hf"])
    assert all(r.hf_tokens_per_s > 0 and r.engine_over_hf > 0 for r in results)
