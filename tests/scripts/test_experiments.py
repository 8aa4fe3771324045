"""The experiment scripts end to end in their CPU smoke mode, and the pieces they are sized and extended by."""

import json
import math
from types import SimpleNamespace

import pytest
import torch

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: one thread is fastest (tests/conftest.py)


@pytest.fixture(scope="module")
def common(scripts_path):
    import exp_common

    return exp_common


@pytest.fixture(scope="module")
def warm_model(common, tmp_path_factory):
    """The smoke warm start: a fresh SFT of the tiny model through the scripts' own path (no --model)."""
    work = tmp_path_factory.mktemp("work")
    args = SimpleNamespace(model=None, smoke=True, sft_steps=2, sft_seed=0)
    path, summary = common.warm_start(args, work, log=lambda m: None)
    assert summary["sft"]["config"]["task"] == "chain" and summary["sft"]["config"]["steps"] == 2
    return path


def test_the_experiment_model_is_sized_as_documented(common):
    from jetrl.models import build_model
    from jetrl.sft.tokenizer import build_char_tokenizer

    config = common.sft_config(smoke=False, output_dir="unused")
    assert config.hidden_size >= 1024 and config.hidden_size % 128 == 0 and config.intermediate_size % 128 == 0
    assert config.uses_packing() and config.dtype == "bfloat16"
    model = build_model(config.model_config(build_char_tokenizer()), dtype=torch.bfloat16, device="meta", init=False)
    assert common.num_parameters(config) == sum(p.numel() for p in model.parameters())
    # 6 x matrix parameters + attention; the attention term grows linearly with the sequence length
    short, long = common.train_flops_per_token(config, 1000), common.train_flops_per_token(config, 2000)
    assert 6 * 90e6 < short < long and long - short == pytest.approx(3 * 8 * 2 * 2 * 500 * 1024)
    seconds = common.sft_seconds_estimate(config, 2048, utilization=0.35)
    assert 60 < seconds < 300  # the warm start fits a 10-minute device call with room for an experiment


def test_arms_resolve_by_name_and_from_the_command_line(common):
    arms = common.resolve_arms(["jet", "exact"], ["exact:recipe=jet; rollout.n=2"])
    assert arms == {"jet": ("recipe=jet",), "exact": ("recipe=jet", "rollout.n=2")}
    assert common.arm_config(["rollout.n=4"], arms["exact"]).rollout.n == 2  # the arm's overrides come last
    assert common.arm_config([], common.ARMS["fp8-rollout-tis"]).algorithm.tis_cap == 2.0
    with pytest.raises(ValueError, match="unknown arms.*no-such-arm"):
        common.resolve_arms(["no-such-arm"])
    kv8 = common.arm_config([], common.ARMS["jet-kv8"])
    assert kv8.recipe == "jet" and kv8.kv_fp8 and kv8.kv_fp8_train  # FP8 K/V on both sides
    peers = common.arm_config([], common.ARMS["fp8-rollout-kv8"])
    assert peers.recipe == "fp8-rollout" and peers.kv_fp8 and not peers.kv_fp8_train  # the rollout's cache only
    with pytest.raises(ValueError, match="NAME:key=value"):
        common.resolve_arms(["x"], ["x=recipe=jet"])
    with pytest.raises(ValueError, match="twice"):
        common.resolve_arms(["jet", "jet"])


def test_exp_mismatch_smoke(common, warm_model, tmp_path, capsys):
    import exp_mismatch

    out = tmp_path / "out"
    assert exp_mismatch.main(["--smoke", "--model", warm_model, "--out", str(out), "--work", str(tmp_path / "w"),
                              "--lengths", "16", "--prompts", "1", "--n", "2",
                              "--arms", "bf16,fp8-rollout,jet,jet-kv8,fp8-rollout-kv8"]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["exp_mismatch.json", "exp_mismatch_length.png",
                                                    "exp_mismatch_position.png"]
    results = json.loads((out / "exp_mismatch.json").read_text())
    arms = results["arms"]
    assert list(arms) == ["bf16", "fp8-rollout", "jet", "jet-kv8", "fp8-rollout-kv8"] and results["lengths"] == [16]
    for arm in arms.values():
        m = arm["16"]
        assert m["num_sequences"] == 2 and m["num_tokens"] > 0 and 0 <= m["accuracy"] <= 1
        assert m["is_ratio_min"] <= m["is_ratio_p01"] <= m["is_ratio_p99"] <= m["is_ratio_max"]
        assert len(m["logp_abs_diff_by_position"]) == math.ceil(m["response_length_max"] / 8)  # bins of 8 tokens
    # the same weights and sampling seeds: BF16 and the unified FP8 flow (with FP8 K/V on both sides too) agree to
    # summation order, while sampling in FP8 and scoring in BF16 differs by the FP8 rounding of every linear layer
    # (and, with the rollout-only FP8 KV cache, of every key and value)
    unified = max(arms[a]["16"]["logp_abs_diff_mean"] for a in ("bf16", "jet", "jet-kv8"))
    for split in ("fp8-rollout", "fp8-rollout-kv8"):
        assert unified < 1e-5 and arms[split]["16"]["logp_abs_diff_mean"] > 100 * unified, split
    last = capsys.readouterr().out.strip().splitlines()
    assert last[0].split()[:2] == ["arm", "length"] and [line.split()[0] for line in last[2:]] == list(arms)


def test_position_profile_and_ratio_spread(scripts_path):
    from exp_mismatch import position_profile, ratio_spread

    rollout = torch.zeros(2, 5)
    train = torch.tensor([[0.1, 0.2, 0.0, 0.0, 0.0], [0.3, 0.0, 0.4, 9.0, 9.0]])
    mask = torch.tensor([[True, True, False, False, False], [True, True, True, False, False]])
    assert position_profile(rollout, train, mask, 2) == pytest.approx([0.15, 0.4, math.nan], nan_ok=True)
    spread = ratio_spread(rollout, train, mask)
    ratios = torch.tensor([0.1, 0.2, 0.3, 0.0, 0.4], dtype=torch.float64).exp()
    assert spread["is_ratio_std"] == pytest.approx(float(ratios.std()))
    assert spread["is_ratio_p01"] >= 1.0 and spread["is_ratio_p99"] <= float(ratios.max())


def test_exp_rl_smoke_with_a_time_budget_and_two_seeds(common, warm_model, tmp_path, capsys):
    import exp_rl

    out = tmp_path / "out"
    assert exp_rl.main(["--smoke", "--model", warm_model, "--out", str(out), "--work", str(tmp_path / "w"),
                        "--arms", "bf16,tis3", "--arm", "tis3:recipe=fp8-rollout;algorithm.tis_cap=3.0",
                        "--seeds", "0,1", "--steps", "3", "--time-budget", "0", "--eval-examples", "1"]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["exp_rl.json", "exp_rl_curves.png", "exp_rl_health.png",
                                                     "exp_rl_held_out.png"]
    results = json.loads((out / "exp_rl.json").read_text())
    runs = results["runs"]
    assert [(r["arm"], r["seed"]) for r in runs] == [("bf16", 0), ("tis3", 0), ("bf16", 1), ("tis3", 1)]
    for r in runs:
        # a zero budget ends each run after its first step, which the loop checkpointed as its last
        assert r["steps"] == 1 and r["steps_requested"] == 3 and [rec["step"] for rec in r["records"]] == [1]
        assert r["held_out_before"] is not None and r["held_out_after"] is not None
        assert "mismatch/kl_k3" in r["records"][0] and "actor/clip_frac" in r["records"][0]
    assert {r["recipe"] for r in runs} == {"bf16", "fp8-rollout"}
    tis = [r for r in runs if r["arm"] == "tis3"][0]["records"][0]
    assert tis["mismatch/logp_abs_diff_mean"] > 0
    text = capsys.readouterr().out
    assert "±" in text.strip().splitlines()[-1]  # the seed spread, last

    # --replot merges two calls' JSONs (the two GPUs of exp_two_gpus.sh) into one JSON, table and plots
    half = {**results, "runs": [r for r in runs if r["seed"] == 1]}
    (tmp_path / "g1.json").write_text(json.dumps({**results, "runs": [r for r in runs if r["seed"] == 0]}))
    (tmp_path / "g2.json").write_text(json.dumps(half))
    merged_dir = tmp_path / "merged"
    assert exp_rl.main(["--replot", str(tmp_path / "g1.json"), str(tmp_path / "g2.json"), "--out", str(merged_dir)]) == 0
    merged = json.loads((merged_dir / "exp_rl.json").read_text())
    assert [(r["arm"], r["seed"]) for r in merged["runs"]] == [("bf16", 0), ("tis3", 0), ("bf16", 1), ("tis3", 1)]
    assert [r["records"] for r in merged["runs"]] == [r["records"] for r in runs]
    assert (merged_dir / "exp_rl_curves.png").stat().st_size > 0 and (merged_dir / "exp_rl_health.png").exists()
    assert "±" in capsys.readouterr().out.strip().splitlines()[-1]


def test_exp_sft_writes_a_checkpoint_the_experiments_load(scripts_path, tmp_path, capsys):
    import exp_sft
    from jetrl.models import load_model

    assert exp_sft.main(["--smoke", "--out-dir", str(tmp_path / "sft"), "--steps", "1"]) == 0
    assert "sft done" in capsys.readouterr().out
    model = load_model(str(tmp_path / "sft"), dtype=torch.float32, device="cpu", recipe="bf16")
    assert model.config.hidden_size == 32


def test_runs_past_the_deadline_are_skipped_and_reported(common, warm_model, tmp_path, capsys):
    import exp_mismatch
    import exp_rl

    out = tmp_path / "out"
    assert exp_rl.main(["--smoke", "--model", warm_model, "--out", str(out), "--arms", "bf16,jet",
                        "--deadline", "0"]) == 0
    results = json.loads((out / "exp_rl.json").read_text())
    assert results["runs"] == [] and [(s["arm"], s["seed"]) for s in results["skipped"]] == [("bf16", 0), ("jet", 0)]
    assert "not run (deadline): bf16 seed 0, jet seed 0" in capsys.readouterr().out
    assert exp_mismatch.main(["--smoke", "--model", warm_model, "--out", str(out), "--lengths", "8,16",
                              "--deadline", "0"]) == 0
    results = json.loads((out / "exp_mismatch.json").read_text())
    assert results["arms"] == {} and len(results["skipped"]) == 6
    assert "not run (deadline): bf16 L=8" in capsys.readouterr().out


def test_step_matched_table_cuts_every_run_at_the_fewest_steps(scripts_path):
    """Runs of 12 and 8 steps are compared over steps 1-4 and 5-8 (S = 8, window S // 2); the reward gain and the
    mismatch's growth factor per arm are the mean ± half range over seeds, computed from fresh random curves."""
    import exp_rl

    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31 - 1, ())))
    runs, expected = [], {}
    for arm, seed, steps in (("a", 0, 12), ("a", 1, 10), ("b", 0, 8), ("b", 1, 9)):
        reward = torch.rand(steps, generator=gen).tolist()
        dlogp = (torch.rand(steps, generator=gen) + 0.1).tolist()
        runs.append({"arm": arm, "seed": seed, "records": [
            {"step": i + 1, "reward/mean": reward[i], "mismatch/logp_abs_diff_mean": dlogp[i], "mismatch/kl_k3": 1.0}
            for i in range(steps)]})
        gain = sum(reward[4:8]) / 4 - sum(reward[:4]) / 4
        growth = (sum(dlogp[4:8]) / 4) / (sum(dlogp[:4]) / 4)
        expected.setdefault(arm, []).append((gain, growth))
    text = exp_rl.step_matched_table({"runs": runs}, window=5)
    assert text.startswith("step-matched at S = 8 (every run's steps 1-4 against 5-8")
    for arm, pairs in expected.items():
        row = next(line for line in text.splitlines() if line.startswith(arm + " "))
        cells = [c.strip() for c in row.split("  ") if c.strip()]
        gains, growths = [g for g, _ in pairs], [q for _, q in pairs]
        assert cells[3] == f"{sum(gains) / 2:+.3f} ± {(max(gains) - min(gains)) / 2:.3f}", row
        assert cells[5] == f"{sum(growths) / 2:.2f} ± {(max(growths) - min(growths)) / 2:.2f}", row
        assert cells[7] == "1.00 ± 0.00", row  # a constant k3 does not grow


def test_exp_real_model_smoke(scripts_path, tmp_path, capsys):
    """The baseline table of a model per task and rollout precision: greedy accuracy, pass@n, lengths."""
    import exp_real_model

    assert exp_real_model.main(["--smoke", "--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "exp_real_model.json").read_text())["rows"]
    assert [(r["setting"], r["recipe"]) for r in rows] == [("arithmetic:3", "bf16"), ("arithmetic:3", "jet")]
    for r in rows:
        assert r["num_prompts"] == 4 and 0 <= r["greedy_accuracy"] <= 1 and 0 <= r["pass@2"] <= 1
        assert r["pass@2"] >= r["sampled_accuracy"] - 1e-9 and r["greedy_length"] > 0
    assert "| arithmetic:3 | jet |" in capsys.readouterr().out


def test_exp_mismatch_layers_finds_where_the_sides_part(scripts_path, tmp_path):
    """On the CPU jet's rollout and trainer agree in every module (the reference sums exactly); fp8-rollout's part at
    the first FP8 linear, and its log-probs differ."""
    import exp_mismatch_layers

    assert exp_mismatch_layers.main(["--smoke", "--recipes", "jet,fp8-rollout", "--json", str(tmp_path / "l.json")]) == 0
    jet, fp8_rollout = json.loads((tmp_path / "l.json").read_text())
    assert jet["first_differing"] is None and jet["logp_abs_diff_max"] < 1e-5
    assert len(jet["modules"]) == 11 * 4 and jet["decode_steps"] == 5 and jet["unrecorded"] == []
    assert fp8_rollout["first_differing"] == "model.layers.0.self_attn.q_proj"
    assert fp8_rollout["logp_abs_diff_mean"] > 1e-3
